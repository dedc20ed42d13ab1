//! Who may pull what (DESIGN.md, "Authorization before the cache"): an
//! upstream's repository policy (`allow`, `deny`) and the client grants of
//! `[[server.auth.grant]]`. Both are decided from the request alone —
//! before any cache read, membership check or dial — so a cached image is
//! never a way around them. Pure matching, no I/O.
//!
//! Patterns are globs on a repository name (after Docker Hub's `library/`
//! mapping): `*` matches within one path segment (`team-*`, `library/*`),
//! `**` as a whole segment matches any number of segments, none included
//! (`bitnami/**` matches `bitnami` and `bitnami/charts/redis`).

use std::fmt;

use crate::oci::RepoName;

/// Longest glob accepted (a repository name is at most 255 characters).
pub const MAX_GLOB_LEN: usize = 255;

/// A repository-name glob.
#[derive(Clone, PartialEq, Eq)]
pub struct RepoGlob {
    text: String,
    segments: Vec<Segment>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    /// `**`: any number of whole segments.
    Any,
    /// A segment pattern, `*` matching any run of characters but `/`.
    Pattern(String),
}

impl RepoGlob {
    /// Parses a glob: `/`-separated segments of the characters a repository
    /// name may hold (lowercase letters, digits, `.`, `_`, `-`) and `*`;
    /// `**` only as a whole segment.
    pub fn parse(text: &str) -> Result<RepoGlob, String> {
        if text.is_empty() || text.len() > MAX_GLOB_LEN {
            return Err(format!("{text:?} must be 1 to {MAX_GLOB_LEN} characters"));
        }
        let segments = text
            .split('/')
            .map(|s| match s {
                "" => Err(format!("{text:?} has an empty path segment")),
                "**" => Ok(Segment::Any),
                s if s.contains("**") => Err(format!("{text:?}: `**` must be a whole segment, as in \"team/**\"")),
                s if s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-*".contains(&b)) => {
                    Ok(Segment::Pattern(s.to_owned()))
                }
                _ => Err(format!(
                    "{text:?} may hold only lowercase letters, digits, '.', '_', '-', '/' and '*' (a repository name)"
                )),
            })
            .collect::<Result<_, _>>()?;
        Ok(RepoGlob { text: text.to_owned(), segments })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn matches(&self, repo: &RepoName) -> bool {
        let name: Vec<&str> = repo.as_str().split('/').collect();
        matches_from(&self.segments, &name)
    }
}

fn matches_from(pattern: &[Segment], name: &[&str]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some((Segment::Any, rest)) => (0..=name.len()).any(|skip| matches_from(rest, &name[skip..])),
        Some((Segment::Pattern(p), rest)) => {
            name.split_first().is_some_and(|(first, more)| segment_matches(p, first) && matches_from(rest, more))
        }
    }
}

/// `*` matches any run of characters (within the segment).
fn segment_matches(pattern: &str, segment: &str) -> bool {
    let Some((head, tail)) = pattern.split_once('*') else { return pattern == segment };
    let Some(mut rest) = segment.strip_prefix(head) else { return false };
    let mut parts: Vec<&str> = tail.split('*').collect();
    let last = parts.pop().unwrap_or_default();
    for part in parts {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

impl fmt::Debug for RepoGlob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.text)
    }
}

/// An upstream's `allow` and `deny`: everything when `allow` is empty,
/// and a `deny` always wins.
#[derive(Clone, Debug, Default)]
pub struct RepoPolicy {
    pub allow: Vec<RepoGlob>,
    pub deny: Vec<RepoGlob>,
}

impl RepoPolicy {
    /// `Err` names the rule that refused `repo`.
    pub fn check(&self, repo: &RepoName) -> Result<(), String> {
        if let Some(rule) = self.deny.iter().find(|g| g.matches(repo)) {
            return Err(format!("deny rule {:?}", rule.as_str()));
        }
        if !self.allow.is_empty() && !self.allow.iter().any(|g| g.matches(repo)) {
            let rules: Vec<String> = self.allow.iter().map(|g| format!("\"{}\"", g.as_str())).collect();
            return Err(format!("no allow rule (allow = [{}]) matches it", rules.join(", ")));
        }
        Ok(())
    }
}

/// Who a `who` entry names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    /// An htpasswd user (`team-a`).
    User(String),
    /// A client certificate's subject common name (`cn:ci-runner`).
    CommonName(String),
    /// A client certificate's subject alternative name: a DNS name, an
    /// e-mail address or a URI (`san:runner.ci.example.com`).
    AltName(String),
}

impl Principal {
    /// `user`, `cn:<name>` or `san:<name>`.
    pub fn parse(text: &str) -> Result<Principal, String> {
        // A common name may hold spaces ("CI runner"); a user or an
        // alternative name (DNS, e-mail, URI) never does.
        let valid = |s: &str, spaces: bool| {
            !s.is_empty()
                && s.len() <= 255
                && s.trim() == s
                && !s.chars().any(|c| c.is_control() || (c == ' ' && !spaces))
        };
        let (kind, name, spaces) = match text.split_once(':') {
            Some(("cn", name)) => (Principal::CommonName as fn(String) -> Principal, name, true),
            Some(("san", name)) => (Principal::AltName as fn(String) -> Principal, name, false),
            Some(_) => return Err(format!("{text:?}: a name with ':' must start with \"cn:\" or \"san:\"")),
            None => (Principal::User as fn(String) -> Principal, text, false),
        };
        if !valid(name, spaces) {
            return Err(format!("{text:?} is not a user name, cn:<name> or san:<name>"));
        }
        Ok(kind(name.to_owned()))
    }
}

/// As a grant's `who` writes it: `team-a`, `cn:ci-runner`, `san:runner.ci.example.com`.
impl std::fmt::Display for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Principal::User(u) => f.write_str(u),
            Principal::CommonName(cn) => write!(f, "cn:{cn}"),
            Principal::AltName(san) => write!(f, "san:{san}"),
        }
    }
}

/// Who a client proved to be: its htpasswd user and its verified client
/// certificate's names, any of them absent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientIdentity {
    pub user: Option<String>,
    pub common_name: Option<String>,
    pub alt_names: Vec<String>,
}

impl ClientIdentity {
    /// The htpasswd user, as logged: `team-a`, or `none`.
    pub fn user_text(&self) -> &str {
        self.user.as_deref().unwrap_or("none")
    }

    /// The client certificate's names as a grant's `who` writes them
    /// (`cn:ci-runner san:runner.ci.example.com`), or `none`.
    pub fn certificate_text(&self) -> String {
        let names: Vec<String> = self
            .common_name
            .iter()
            .map(|cn| format!("cn:{cn}"))
            .chain(self.alt_names.iter().map(|san| format!("san:{san}")))
            .collect();
        if names.is_empty() { "none".to_owned() } else { names.join(" ") }
    }

    fn is(&self, who: &Principal) -> bool {
        match who {
            Principal::User(u) => self.user.as_ref() == Some(u),
            Principal::CommonName(cn) => self.common_name.as_ref() == Some(cn),
            Principal::AltName(san) => self.alt_names.contains(san),
        }
    }
}

/// One `[[server.auth.grant]]`: `who` may pull `repositories` (every one
/// when empty) of `upstreams` (every upstream when `None`).
#[derive(Clone, Debug)]
pub struct Grant {
    pub who: Vec<Principal>,
    /// Upstream names (aliases resolved to the name).
    pub upstreams: Option<Vec<String>>,
    pub repositories: Vec<RepoGlob>,
}

impl Grant {
    fn gives(&self, client: &ClientIdentity, upstream: &str, repo: &RepoName) -> bool {
        self.who.iter().any(|w| client.is(w))
            && self.upstreams.as_ref().is_none_or(|u| u.iter().any(|u| u == upstream))
            && (self.repositories.is_empty() || self.repositories.iter().any(|g| g.matches(repo)))
    }
}

/// Whether some grant gives `client` the repository (grants add up).
pub fn granted(grants: &[Grant], client: &ClientIdentity, upstream: &str, repo: &RepoName) -> bool {
    grants.iter().any(|g| g.gives(client, upstream, repo))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo(s: &str) -> RepoName {
        s.parse().unwrap()
    }

    fn glob(s: &str) -> RepoGlob {
        RepoGlob::parse(s).unwrap()
    }

    #[test]
    fn one_star_stays_in_its_segment_two_stars_cross_them() {
        let cases = [
            ("library/*", "library/nginx", true),
            ("library/*", "library/a/b", false),
            ("library/*", "library", false),
            ("bitnami/**", "bitnami/charts/redis", true),
            ("bitnami/**", "bitnami", true),
            ("bitnami/**", "bitnamix/redis", false),
            ("**/redis", "a/b/redis", true),
            ("**/redis", "redis", true),
            ("team-*/app", "team-a/app", true),
            ("team-*/app", "other/app", false),
            ("*-db", "postgres-db", true),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "axxcyyb", false),
            ("**", "anything/at/all", true),
            ("library/ubuntu", "library/ubuntu", true),
            ("library/ubuntu", "library/ubuntu-debootstrap", false),
        ];
        for (pattern, name, want) in cases {
            assert_eq!(glob(pattern).matches(&repo(name)), want, "{pattern} ~ {name}");
        }
    }

    #[test]
    fn bad_globs_are_refused() {
        for bad in ["", "a//b", "a**", "te**am/x", "Team/x", "a b", "a/?", &"a".repeat(256)] {
            assert!(RepoGlob::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn deny_wins_and_an_empty_allow_allows_everything() {
        let open = RepoPolicy::default();
        assert!(open.check(&repo("anything")).is_ok());
        let policy =
            RepoPolicy { allow: vec![glob("library/*"), glob("bitnami/**")], deny: vec![glob("library/ubuntu")] };
        assert!(policy.check(&repo("library/nginx")).is_ok());
        assert!(policy.check(&repo("bitnami/charts/redis")).is_ok());
        assert_eq!(policy.check(&repo("library/ubuntu")).unwrap_err(), "deny rule \"library/ubuntu\"");
        let e = policy.check(&repo("evil/app")).unwrap_err();
        assert!(e.contains("no allow rule") && e.contains("library/*"), "{e}");
    }

    #[test]
    fn grants_add_up_and_name_users_or_certificate_names() {
        let grants = vec![
            Grant {
                who: vec![Principal::parse("team-a").unwrap(), Principal::parse("cn:ci-runner-a").unwrap()],
                upstreams: Some(vec!["ghcr.io".into()]),
                repositories: vec![glob("team-a/**")],
            },
            Grant {
                who: vec![Principal::parse("team-a").unwrap()],
                upstreams: None,
                repositories: vec![glob("library/*")],
            },
        ];
        let user = |u: &str| ClientIdentity { user: Some(u.into()), ..Default::default() };
        let cert = ClientIdentity { common_name: Some("ci-runner-a".into()), ..Default::default() };
        assert!(granted(&grants, &user("team-a"), "ghcr.io", &repo("team-a/app")));
        assert!(granted(&grants, &user("team-a"), "docker.io", &repo("library/nginx")), "the second grant adds");
        assert!(!granted(&grants, &user("team-a"), "docker.io", &repo("team-a/app")), "ghcr.io only");
        assert!(!granted(&grants, &user("team-b"), "ghcr.io", &repo("team-a/app")));
        assert!(granted(&grants, &cert, "ghcr.io", &repo("team-a/app")));
        assert!(!granted(&grants, &ClientIdentity::default(), "ghcr.io", &repo("team-a/app")), "anonymous");
        let san = ClientIdentity { alt_names: vec!["runner.ci.example".into()], ..Default::default() };
        let by_san = [Grant {
            who: vec![Principal::parse("san:runner.ci.example").unwrap()],
            upstreams: None,
            repositories: vec![],
        }];
        assert!(granted(&by_san, &san, "docker.io", &repo("any/thing")), "no repositories: every one");
        assert!(
            Principal::parse("uid:x").is_err() && Principal::parse("cn:").is_err() && Principal::parse("a b").is_err()
        );
        assert_eq!(Principal::parse("cn:CI runner").unwrap(), Principal::CommonName("CI runner".into()));
        assert!(Principal::parse("san:a b").is_err() && Principal::parse("cn: padded").is_err());
    }
}
