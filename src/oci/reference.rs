//! Repository names and manifest references (tag or digest), validated with
//! the grammar of the OCI distribution spec.

use std::fmt;
use std::str::FromStr;

use super::{Digest, DigestError};

/// Longest repository name accepted, as in distribution (`reference.NameTotalLengthMax`).
pub const MAX_NAME_LEN: usize = 255;
/// Longest tag accepted (the spec's `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`).
pub const MAX_TAG_LEN: usize = 128;

/// A repository name such as `library/alpine`: slash-separated path
/// components of `[a-z0-9]+` joined by `.`, `_`, `__` or runs of `-`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RepoName(String);

/// A tag such as `3.20` or `latest`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(String);

/// What a manifest request names.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum Reference {
    Tag(Tag),
    Digest(Digest),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("repository name is empty")]
    Empty,
    #[error("repository name is longer than {MAX_NAME_LEN} characters")]
    TooLong,
    #[error("repository name component {0:?} is invalid")]
    BadComponent(String),
    #[error("tag is invalid")]
    BadTag,
    #[error(transparent)]
    Digest(#[from] DigestError),
}

impl RepoName {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Number of `/`-separated components.
    pub fn components(&self) -> usize {
        self.0.split('/').count()
    }

    /// `library/<name>`: Docker Hub's namespace for one-component names.
    /// Refused if the prefix makes the name too long.
    pub fn in_library(&self) -> Result<RepoName, NameError> {
        let name = format!("library/{}", self.0);
        if name.len() > MAX_NAME_LEN {
            return Err(NameError::TooLong);
        }
        Ok(RepoName(name))
    }
}

fn valid_component(c: &str) -> bool {
    // [a-z0-9]+ ((\.|_|__|-+) [a-z0-9]+)*
    let bytes = c.as_bytes();
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    if bytes.is_empty() || !alnum(bytes[0]) || !alnum(bytes[bytes.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < bytes.len() {
        if alnum(bytes[i]) {
            i += 1;
            continue;
        }
        // A separator run: ".", "_", "__" or one or more "-".
        let start = i;
        match bytes[i] {
            b'.' => i += 1,
            b'_' => {
                i += 1;
                if i < bytes.len() && bytes[i] == b'_' {
                    i += 1;
                }
            }
            b'-' => {
                while i < bytes.len() && bytes[i] == b'-' {
                    i += 1;
                }
            }
            _ => return false,
        }
        if i == start || i >= bytes.len() || !alnum(bytes[i]) {
            return false;
        }
    }
    true
}

impl FromStr for RepoName {
    type Err = NameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Err(NameError::Empty);
        }
        if s.len() > MAX_NAME_LEN {
            return Err(NameError::TooLong);
        }
        if let Some(bad) = s.split('/').find(|c| !valid_component(c)) {
            return Err(NameError::BadComponent(bad.chars().take(64).collect()));
        }
        Ok(RepoName(s.to_owned()))
    }
}

impl FromStr for Tag {
    type Err = NameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let b = s.as_bytes();
        let ok = !b.is_empty()
            && b.len() <= MAX_TAG_LEN
            && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
            && b[1..].iter().all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'));
        if ok { Ok(Tag(s.to_owned())) } else { Err(NameError::BadTag) }
    }
}

impl Tag {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Reference {
    type Err = NameError;

    /// A reference containing `:` is a digest, anything else a tag (tags
    /// cannot contain `:`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.contains(':') { Ok(Reference::Digest(s.parse()?)) } else { Ok(Reference::Tag(s.parse()?)) }
    }
}

impl fmt::Display for RepoName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl fmt::Debug for RepoName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}
impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl fmt::Debug for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}
impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reference::Tag(t) => t.fmt(f),
            Reference::Digest(d) => d.fmt(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_valid_names() {
        for name in ["alpine", "library/alpine", "a/b/c", "my-app", "my__app", "a.b_c--d", "0", "x/y-z.1"] {
            assert!(name.parse::<RepoName>().is_ok(), "{name}");
        }
    }

    #[test]
    fn rejects_invalid_names() {
        for name in [
            "", "Alpine", "a//b", "/a", "a/", "-a", "a-", "a___b", "a..b", "..", "a/../b", "%2e", "a\0b", "a b", "a:b",
            "_a",
        ] {
            assert!(name.parse::<RepoName>().is_err(), "{name:?}");
        }
        assert_eq!("a".repeat(256).parse::<RepoName>(), Err(NameError::TooLong));
    }

    #[test]
    fn tags_follow_the_spec_grammar() {
        for tag in ["latest", "v1.2.3", "_x", "A-b.c_d", &"t".repeat(128)] {
            assert!(tag.parse::<Tag>().is_ok(), "{tag}");
        }
        for tag in [".INVALID_MANIFEST_NAME", "-x", "", "a/b", "a+b", &"t".repeat(129)] {
            assert!(tag.parse::<Tag>().is_err(), "{tag}");
        }
    }

    #[test]
    fn references_are_tags_or_digests() {
        assert!(matches!("latest".parse::<Reference>(), Ok(Reference::Tag(_))));
        let d = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert!(matches!(d.parse::<Reference>(), Ok(Reference::Digest(_))));
        assert!(matches!("sha256:totallywrong".parse::<Reference>(), Err(NameError::Digest(_))));
    }

    #[test]
    fn library_namespace() {
        let n: RepoName = "alpine".parse().unwrap();
        assert_eq!(n.components(), 1);
        assert_eq!(n.in_library().unwrap().as_str(), "library/alpine");
        // Found by fuzzing: a 250-character name cannot take the prefix.
        let long: RepoName = "a".repeat(250).parse().unwrap();
        assert_eq!(long.in_library(), Err(NameError::TooLong));
    }
}
