//! `[[warm]]`: images larder keeps warm (fetched before anyone asks) and,
//! unless `pin = false`, pinned (never evicted). The same references come
//! one per line from `[cache] warm_file`; both are parsed here, so that a
//! line of the file means exactly what `image = "…"` means in the config.
//!
//! An image names its upstream the way a client's pull is routed: a first
//! component that is a configured upstream's name or alias selects it
//! (`docker.io/library/postgres:16`, `ghcr.io/org/app@sha256:…`), a name
//! without a registry host goes to the default upstream (`postgres:16`),
//! and a registry host that is not configured is an error, never silently
//! the default upstream's repository of that name. Docker Hub's `library/`
//! mapping and the upstream's `allow`/`deny` apply as for a pull.

use serde::Deserialize;

use super::upstream::UpstreamConfig;
use super::{ConfigError, Validator};
use crate::oci::{Reference, RepoName};

/// Most warm images from the config and the warm file together; lines past
/// it are reported and skipped (each image costs one `HEAD` per interval).
pub const MAX_WARM_IMAGES: usize = 1_000;
/// Longest line of a warm file, and longest image reference, accepted.
pub const MAX_WARM_LINE: usize = 1_024;

/// One image kept warm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmImage {
    /// As written (`docker.io/library/postgres:16`), for status and logs.
    pub image: String,
    /// The configured name of its upstream (an alias resolved to it).
    pub upstream: String,
    pub repo: RepoName,
    /// A tag (revalidated every interval) or a digest (fetched once).
    pub reference: Reference,
    /// `os/arch[/variant]` of the platforms of an index to fetch; empty:
    /// every platform. `linux/arm64` selects `linux/arm64/v8` too.
    pub platforms: Vec<String>,
    /// Whether its content is never evicted (default true).
    pub pin: bool,
    /// Whether its referrers (signatures, SBOMs, attestations) are
    /// fetched too, with their blobs (default false).
    pub referrers: bool,
}

impl WarmImage {
    /// What identifies it: upstream, repository and reference.
    pub fn key(&self) -> String {
        format!("{}\0{}\0{}", self.upstream, self.repo, self.reference)
    }
}

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWarm {
    image: String,
    #[serde(default)]
    platforms: Vec<String>,
    pin: Option<bool>,
    #[serde(default)]
    referrers: bool,
}

/// A registry host as a reference's first component: it has a `.` or a
/// `:port`, or is `localhost` (Docker's rule; `library/postgres` is a path).
fn looks_like_host(component: &str) -> bool {
    component.contains('.') || component.contains(':') || component == "localhost"
}

/// Resolves `[registry/]repo[:tag|@digest]` against the upstreams: its
/// upstream's configured name, the repository (after `library/` mapping)
/// and the reference (`latest` when none is given).
pub fn resolve_image(text: &str, upstreams: &[UpstreamConfig]) -> Result<(String, RepoName, Reference), String> {
    if text.is_empty() || text.len() > MAX_WARM_LINE {
        return Err(format!("an image reference is 1 to {MAX_WARM_LINE} characters"));
    }
    let (name, reference) = match text.split_once('@') {
        Some((name, digest)) => (name, Reference::Digest(digest.parse().map_err(|e| format!("{text:?}: {e}"))?)),
        None => match text.rsplit_once(':').filter(|(_, tag)| !tag.contains('/')) {
            Some((name, tag)) => (name, Reference::Tag(tag.parse().map_err(|e| format!("{text:?}: {e}"))?)),
            None => (text, Reference::Tag("latest".parse().map_err(|e| format!("{e}"))?)),
        },
    };
    let named = |key: &str| {
        upstreams
            .iter()
            .find(|u| u.name.eq_ignore_ascii_case(key) || u.aliases.iter().any(|a| a.eq_ignore_ascii_case(key)))
    };
    let (upstream, path) = match name.split_once('/') {
        Some((first, rest)) if looks_like_host(first) => match named(first) {
            Some(u) => (u, rest),
            None => {
                return Err(format!("{text:?}: {first:?} is not the name or an alias of a configured [[upstream]]"));
            }
        },
        _ => match upstreams.iter().find(|u| u.default) {
            Some(u) => (u, name),
            None => {
                return Err(format!(
                    "{text:?} names no registry and no [[upstream]] is `default = true`: write \
                     <upstream name>/{name}"
                ));
            }
        },
    };
    let mut repo: RepoName = path.parse().map_err(|e| format!("{text:?}: {e}"))?;
    if upstream.library_namespace && repo.components() == 1 {
        repo = repo.in_library().map_err(|e| format!("{text:?}: {e}"))?;
    }
    upstream.policy.check(&repo).map_err(|rule| {
        format!("{text:?}: repository {:?} of upstream {:?} is refused by its {rule}", repo.as_str(), upstream.name)
    })?;
    Ok((upstream.name.clone(), repo, reference))
}

/// `os/arch` or `os/arch/variant`, each part of `[a-z0-9._-]`.
fn valid_platform(p: &str) -> bool {
    let parts: Vec<&str> = p.split('/').collect();
    (2..=3).contains(&parts.len())
        && parts.iter().all(|s| {
            !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        })
}

fn platforms(list: &[String]) -> Result<Vec<String>, String> {
    for p in list {
        if !valid_platform(p) {
            return Err(format!("{p:?} is not a platform like \"linux/amd64\" or \"linux/arm64/v8\""));
        }
    }
    let mut list = list.to_vec();
    list.sort();
    list.dedup();
    Ok(list)
}

/// One line of a warm file: `IMAGE [platforms=os/arch,…] [pin=true|false]
/// [referrers=true|false]`.
/// `Ok(None)` for a blank line or a `#` comment.
pub fn parse_warm_line(line: &str, upstreams: &[UpstreamConfig]) -> Result<Option<WarmImage>, String> {
    if line.len() > MAX_WARM_LINE {
        return Err(format!("longer than {MAX_WARM_LINE} characters"));
    }
    let line = line.split_once('#').map_or(line, |(before, _)| before).trim();
    let mut words = line.split_whitespace();
    let Some(image) = words.next() else { return Ok(None) };
    // The whole line is quoted when it is more than the image: `this is
    // not an image` is one mistake, not a problem with the word "is".
    let whole = |e: String| if line == image { e } else { format!("{line:?}: {e}") };
    let (upstream, repo, reference) = resolve_image(image, upstreams).map_err(whole)?;
    let mut warm = WarmImage {
        image: image.to_owned(),
        upstream,
        repo,
        reference,
        platforms: Vec::new(),
        pin: true,
        referrers: false,
    };
    for word in words {
        match word.split_once('=') {
            Some(("platforms", list)) => {
                let list: Vec<String> = list.split(',').map(str::to_owned).collect();
                warm.platforms = platforms(&list).map_err(whole)?;
            }
            Some(("pin", "true")) => warm.pin = true,
            Some(("referrers", "true")) => warm.referrers = true,
            Some(("referrers", "false")) => warm.referrers = false,
            Some(("pin", "false")) => warm.pin = false,
            _ => {
                return Err(whole(format!(
                    "{word:?} is not understood: a line is an image, then only `platforms=os/arch,…`, \
                     `pin=true|false` and `referrers=true|false`"
                )));
            }
        }
    }
    Ok(Some(warm))
}

/// A warm file read: the images of its good lines, in order, and for each
/// bad line its number (from 1) and what is wrong with it. A line naming
/// an image already listed (in `known`, the config's `[[warm]]`, or on an
/// earlier line) is reported and skipped.
#[derive(Debug, Default)]
pub struct WarmFile {
    pub images: Vec<WarmImage>,
    pub bad_lines: Vec<(usize, String)>,
}

pub fn parse_warm_file(text: &str, upstreams: &[UpstreamConfig], known: &[WarmImage]) -> WarmFile {
    let mut file = WarmFile::default();
    for (n, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l)) {
        match parse_warm_line(line, upstreams) {
            Ok(None) => {}
            Ok(Some(image)) => {
                let key = image.key();
                if known.iter().any(|k| k.key() == key) {
                    file.bad_lines.push((n, format!("{:?} is in the config's [[warm]] already", image.image)));
                } else if file.images.iter().any(|k| k.key() == key) {
                    file.bad_lines.push((n, format!("{:?} is listed on an earlier line", image.image)));
                } else if known.len() + file.images.len() >= MAX_WARM_IMAGES {
                    file.bad_lines.push((n, format!("more than {MAX_WARM_IMAGES} warm images")));
                } else {
                    file.images.push(image);
                }
            }
            Err(e) => file.bad_lines.push((n, e)),
        }
    }
    file
}

impl Validator<'_> {
    /// Every `[[warm]]`, resolved against the upstreams.
    pub(super) fn warm(&self, raw: Vec<RawWarm>, upstreams: &[UpstreamConfig]) -> Result<Vec<WarmImage>, ConfigError> {
        if raw.len() > MAX_WARM_IMAGES {
            return Err(self.err("warm", format!("at most {MAX_WARM_IMAGES} [[warm]] images")));
        }
        let mut images: Vec<WarmImage> = Vec::with_capacity(raw.len());
        for (i, w) in raw.into_iter().enumerate() {
            let key = |k: &str| format!("warm[{i}].{k}");
            let (upstream, repo, reference) =
                resolve_image(&w.image, upstreams).map_err(|e| self.err(key("image"), e))?;
            let platforms = platforms(&w.platforms).map_err(|e| self.err(key("platforms"), e))?;
            let pin = w.pin.unwrap_or(true);
            let image = WarmImage { image: w.image, upstream, repo, reference, platforms, pin, referrers: w.referrers };
            if let Some(j) = images.iter().position(|k| k.key() == image.key()) {
                return Err(self.err(key("image"), format!("{:?} is listed at warm[{j}] already", image.image)));
            }
            images.push(image);
        }
        Ok(images)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{MINIMAL, parse};
    use super::*;

    const TWO_UPSTREAMS: &str = r#"
        [[upstream]]
        name = "docker.io"
        url = "https://registry-1.docker.io"
        default = true

        [[upstream]]
        name = "ghcr.io"
        aliases = ["ghcr.example.com"]
        url = "https://ghcr.io"
        deny = ["secret/**"]
    "#;

    fn upstreams() -> Vec<UpstreamConfig> {
        parse(TWO_UPSTREAMS).unwrap().upstreams
    }

    #[test]
    fn images_resolve_like_a_pull_and_default_to_pinned_every_platform() {
        let c = parse(&format!(
            "[[warm]]\nimage = \"docker.io/library/postgres:16\"\nplatforms = [\"linux/arm64\", \"linux/amd64\"]\n\
             [[warm]]\nimage = \"ghcr.example.com/org/app@sha256:{}\"\npin = false\n\
             [[warm]]\nimage = \"redis\"\n{TWO_UPSTREAMS}",
            "a".repeat(64)
        ))
        .unwrap();
        let [postgres, app, redis] = &c.warm[..] else { panic!("{:?}", c.warm) };
        assert_eq!((postgres.upstream.as_str(), postgres.repo.as_str()), ("docker.io", "library/postgres"));
        assert_eq!(postgres.reference, Reference::Tag("16".parse().unwrap()));
        assert_eq!(postgres.platforms, ["linux/amd64", "linux/arm64"], "sorted");
        assert!(postgres.pin, "pinned by default");
        assert_eq!((app.upstream.as_str(), app.repo.as_str()), ("ghcr.io", "org/app"), "an alias selects its upstream");
        assert!(matches!(app.reference, Reference::Digest(_)) && !app.pin && app.platforms.is_empty());
        assert_eq!((redis.upstream.as_str(), redis.repo.as_str()), ("docker.io", "library/redis"), "the default");
        assert_eq!(redis.reference, Reference::Tag("latest".parse().unwrap()));
    }

    #[test]
    fn a_bad_warm_image_names_its_key() {
        let cases = [
            ("image = \"quay.io/org/app:1\"", "warm[0].image", "not the name or an alias"),
            ("image = \"ghcr.io/secret/keys:1\"", "warm[0].image", "deny rule"),
            ("image = \"docker.io/Bad/Name:1\"", "warm[0].image", "invalid"),
            ("image = \"docker.io/app:-x\"", "warm[0].image", "tag"),
            ("image = \"docker.io/app\"\nplatforms = [\"amd64\"]", "warm[0].platforms", "linux/amd64"),
            ("image = \"docker.io/app\"\nbogus = 1", "bogus", ""),
        ];
        for (body, key, says) in cases {
            let e = parse(&format!("[[warm]]\n{body}\n{TWO_UPSTREAMS}")).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")) || e.contains(key), "{e}");
            assert!(e.contains(says), "{e}");
        }
        let twice = "[[warm]]\nimage = \"docker.io/library/app:1\"\n[[warm]]\nimage = \"app:1\"\n";
        let e = parse(&format!("{twice}{MINIMAL}")).unwrap_err().to_string();
        assert!(e.contains("`warm[1].image`") && e.contains("warm[0]"), "{e}");
    }

    #[test]
    fn a_warm_file_keeps_its_good_lines_and_numbers_the_bad_ones() {
        let known =
            parse(&format!("[[warm]]\nimage = \"docker.io/library/postgres:16\"\n{TWO_UPSTREAMS}")).unwrap().warm;
        let text = "# base images\n\
                    docker.io/library/alpine:3.20 platforms=linux/amd64\n\
                    \n\
                    quay.io/org/app:1\n\
                    ghcr.io/org/app:2   pin=false  # not pinned\n\
                    postgres:16\n\
                    docker.io/library/alpine:3.20\n\
                    ghcr.io/org/app:3 colour=blue\n";
        let file = parse_warm_file(text, &upstreams(), &known);
        let images: Vec<(&str, &str, bool)> =
            file.images.iter().map(|i| (i.repo.as_str(), i.upstream.as_str(), i.pin)).collect();
        assert_eq!(images, [("library/alpine", "docker.io", true), ("org/app", "ghcr.io", false)]);
        assert_eq!(file.images[0].platforms, ["linux/amd64"]);
        let lines: Vec<usize> = file.bad_lines.iter().map(|(n, _)| *n).collect();
        assert_eq!(lines, [4, 6, 7, 8], "{:?}", file.bad_lines);
        assert!(file.bad_lines[0].1.contains("quay.io"), "{:?}", file.bad_lines);
        assert!(file.bad_lines[1].1.contains("[[warm]] already"));
        assert!(file.bad_lines[2].1.contains("earlier line"));
        assert!(file.bad_lines[3].1.contains("colour=blue"));
    }

    #[test]
    fn a_bad_line_is_quoted_whole() {
        let file = parse_warm_file(
            "this is not an image
",
            &upstreams(),
            &[],
        );
        assert_eq!(
            file.bad_lines,
            [(
                1,
                "\"this is not an image\": \"is\" is not understood: a line is an image, then only \
                 `platforms=os/arch,…`, `pin=true|false` and `referrers=true|false`"
                    .to_owned()
            )]
        );
        let file = parse_warm_file("quay.io/org/app:1 pin=false\n", &upstreams(), &[]);
        assert!(
            file.bad_lines[0].1.starts_with("\"quay.io/org/app:1 pin=false\": \"quay.io/org/app:1\""),
            "{:?}",
            file.bad_lines
        );
    }
}
