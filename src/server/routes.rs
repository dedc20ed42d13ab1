//! Parses a request's method, path and `?ns=` into a [`Route`]: which
//! upstream, which repository, which endpoint. Parse only; no I/O.
//!
//! Upstream selection, in order: `?ns=<host>` (containerd), a path prefix
//! `/v2/<upstream>/<repo>/…`, then the `default = true` upstream. A route
//! is only made for a repository the upstream's `allow`/`deny` serves.

use std::sync::Arc;

use http::{Method, Uri};

use crate::cache::Via;
use crate::error::Error;
use crate::oci::{Digest, NameError, Reference, RepoName};
use crate::upstream::{Upstream, Upstreams};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Manifest(Reference),
    Blob(Digest),
    /// `tags/list` with the client's pagination query (`n`, `last`), if any.
    TagsList(Option<String>),
    /// `referrers/<digest>` with the client's `artifactType` filter and
    /// pagination, if any.
    Referrers(Digest, Option<String>),
}

impl Endpoint {
    /// The route label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Endpoint::Manifest(_) => "manifest",
            Endpoint::Blob(_) => "blob",
            Endpoint::TagsList(_) => "tags",
            Endpoint::Referrers(..) => "referrers",
        }
    }
}

pub struct Route {
    pub upstream: Arc<Upstream>,
    pub repo: RepoName,
    pub endpoint: Endpoint,
    /// A client's request, or a peer's (the peer listener sets it).
    pub via: Via,
}

pub enum Parsed {
    /// `GET /v2/`
    Base,
    Repo(Route),
}

/// Longest request path considered; longer ones cannot name a valid repository.
pub const MAX_PATH_LEN: usize = 2048;

pub fn parse(method: &Method, uri: &Uri, upstreams: &Upstreams) -> Result<Parsed, Error> {
    let path = uri.path();
    if path.len() > MAX_PATH_LEN {
        return Err(Error::NameInvalid(NameError::TooLong));
    }
    let Some(rest) = path.strip_prefix("/v2") else {
        return Err(Error::NotFound);
    };
    if !rest.is_empty() && !rest.starts_with('/') {
        return Err(Error::NotFound);
    }
    // A read-only mirror: pushes and deletes are refused wherever they aim.
    if method != Method::GET && method != Method::HEAD {
        return Err(Error::Unsupported);
    }
    let rest = rest.trim_start_matches('/');
    if rest.is_empty() {
        return Ok(Parsed::Base);
    }

    let (name, endpoint) = if let Some(name) = rest.strip_suffix("/tags/list") {
        (name, Endpoint::TagsList(pagination(uri.query())))
    } else if let Some((name, reference)) = rest.rsplit_once("/manifests/") {
        (name, Endpoint::Manifest(manifest_reference(reference)?))
    } else if let Some((name, digest)) = rest.rsplit_once("/blobs/") {
        if digest == "uploads" || digest.starts_with("uploads/") {
            return Err(Error::Unsupported);
        }
        (name, Endpoint::Blob(digest.parse().map_err(Error::DigestInvalid)?))
    } else if let Some((name, digest)) = rest.rsplit_once("/referrers/") {
        let query = keep_params(uri.query(), &["artifactType", "n", "last"]);
        (name, Endpoint::Referrers(digest.parse().map_err(Error::DigestInvalid)?, query))
    } else {
        return Err(Error::NotFound);
    };

    let (upstream, name) = select_upstream(name, ns(uri.query()).as_deref(), upstreams)?;
    let mut repo: RepoName = name.parse().map_err(Error::NameInvalid)?;
    if upstream.config.library_namespace && repo.components() == 1 {
        repo = repo.in_library().map_err(Error::NameInvalid)?;
    }
    // A route exists only for a repository the upstream's policy serves:
    // clients, peers and prefetches all come through here, before any
    // cache read, membership check or dial.
    if let Err(rule) = upstream.config.policy.check(&repo) {
        crate::metrics::metrics().policy_denied.with_label_values(&[upstream.name()]).inc();
        return Err(Error::Denied(format!(
            "repository {:?} of upstream {:?} is refused by its {rule}",
            repo.as_str(),
            upstream.name()
        )));
    }
    Ok(Parsed::Repo(Route { upstream: Arc::clone(upstream), repo, endpoint, via: Via::Client }))
}

/// The route label of a request refused before its route was made (a
/// repository policy or grant denial, a missing or wrong password, too
/// many password checks waiting): the endpoint its path names, so that a
/// denied pull is counted under its route with its 401/403/429 status.
/// `invalid` for a path that names no endpoint.
pub fn label_of_path(path: &str) -> &'static str {
    let Some(rest) = path.strip_prefix("/v2") else { return "invalid" };
    let rest = rest.trim_start_matches('/');
    if rest.is_empty() {
        "base"
    } else if rest.ends_with("/tags/list") {
        "tags"
    } else if rest.contains("/manifests/") {
        "manifest"
    } else if rest.contains("/blobs/") {
        "blob"
    } else if rest.contains("/referrers/") {
        "referrers"
    } else {
        "invalid"
    }
}

/// A digest-shaped reference must be a valid digest (400 otherwise); any
/// other string that is not a valid tag is a manifest that cannot exist
/// (404, as the OCI conformance suite expects).
fn manifest_reference(s: &str) -> Result<Reference, Error> {
    match s.parse::<Reference>() {
        Ok(r) => Ok(r),
        Err(NameError::Digest(e)) => Err(Error::DigestInvalid(e)),
        Err(_) => Err(Error::ManifestUnknown),
    }
}

fn select_upstream<'a, 'u>(
    name: &'a str,
    ns: Option<&str>,
    upstreams: &'u Upstreams,
) -> Result<(&'u Arc<Upstream>, &'a str), Error> {
    if let Some(ns) = ns {
        let upstream = upstreams.get(ns).ok_or_else(|| Error::UnknownUpstream(ns.chars().take(255).collect()))?;
        return Ok((upstream, name));
    }
    if let Some((first, rest)) = name.split_once('/') {
        if let Some(upstream) = upstreams.get(first) {
            return Ok((upstream, rest));
        }
        // Docker's reference grammar reads a first component with a dot or a
        // port, or `localhost`, as a registry host. One that is not
        // configured is refused, not sent to the default upstream.
        if first.contains(['.', ':']) || first == "localhost" {
            return Err(Error::UnknownUpstream(first.chars().take(255).collect()));
        }
    }
    let upstream =
        upstreams.default_upstream().ok_or_else(|| Error::UnknownUpstream("(no default upstream)".into()))?;
    Ok((upstream, name))
}

fn ns(query: Option<&str>) -> Option<String> {
    form_urlencoded::parse(query?.as_bytes()).find(|(k, _)| k == "ns").map(|(_, v)| v.into_owned())
}

/// Longest `ns` value echoed in `OCI-Namespace`: a host name (253) with a
/// port. A longer one names no upstream (404) and is not echoed.
pub const MAX_NS_ECHO: usize = 260;

/// The `OCI-Namespace` value for a request: its `ns` parameter as the
/// client sent it (the first one, the one routing uses), whether or not
/// it names an upstream. `None` without `ns`, or for one that is too long
/// or not a valid header value.
pub fn namespace_echo(uri: &Uri) -> Option<http::HeaderValue> {
    let ns = ns(uri.query())?;
    if ns.len() > MAX_NS_ECHO {
        return None;
    }
    http::HeaderValue::from_str(&ns).ok()
}

/// The `n` and `last` parameters of a `tags/list` query, re-encoded.
fn pagination(query: Option<&str>) -> Option<String> {
    keep_params(query, &["n", "last"])
}

/// The query's parameters named in `keep`, re-encoded; `None` if none.
fn keep_params(query: Option<&str>, keep: &[&str]) -> Option<String> {
    let mut out = form_urlencoded::Serializer::new(String::new());
    let mut any = false;
    for (k, v) in form_urlencoded::parse(query?.as_bytes()) {
        if keep.contains(&k.as_ref()) {
            out.append_pair(&k, &v);
            any = true;
        }
    }
    any.then(|| out.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn a_refused_request_is_labelled_with_the_route_its_path_names() {
        for (path, label) in [
            ("/v2/", "base"),
            ("/v2", "base"),
            ("/v2/team/app/manifests/v1", "manifest"),
            ("/v2/team/app/blobs/sha256:abc", "blob"),
            ("/v2/team/app/tags/list", "tags"),
            ("/v2/team/app/referrers/sha256:abc", "referrers"),
            ("/v2/team/app/other", "invalid"),
            ("/metrics", "invalid"),
        ] {
            assert_eq!(label_of_path(path), label, "{path}");
        }
    }

    fn upstreams() -> Upstreams {
        let config = Config::parse(
            r#"
            [[upstream]]
            name = "docker.io"
            url = "https://registry-1.docker.io"
            default = true
            aliases = ["index.docker.io"]
            [[upstream]]
            name = "ghcr.io"
            url = "https://ghcr.io"
            "#,
            "test.toml",
            None,
        )
        .unwrap();
        Upstreams::new(&config).unwrap()
    }

    fn route(method: Method, uri: &str) -> Result<(String, String, Endpoint), Error> {
        match parse(&method, &uri.parse().unwrap(), &upstreams())? {
            Parsed::Base => Ok(("".into(), "".into(), Endpoint::TagsList(None))),
            Parsed::Repo(r) => Ok((r.upstream.name().to_owned(), r.repo.to_string(), r.endpoint)),
        }
    }

    const D: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn the_namespace_echo_is_the_ns_the_client_sent() {
        let echo = |uri: &str| namespace_echo(&uri.parse().unwrap());
        assert_eq!(echo("/v2/a/manifests/v1?ns=index.docker.io").unwrap(), "index.docker.io");
        assert_eq!(echo("/v2/a/manifests/v1?n=1&ns=ghcr.io&ns=quay.io").unwrap(), "ghcr.io");
        assert_eq!(echo("/v2/a/manifests/v1?ns=localhost%3A5000").unwrap(), "localhost:5000");
        assert_eq!(echo("/v2/a/manifests/v1?ns=evil.example").unwrap(), "evil.example", "unknown ones too");
        assert!(echo("/v2/a/manifests/v1").is_none());
        assert!(echo("/v2/a/manifests/v1?n=1").is_none());
        assert!(echo("/v2/a/manifests/v1?ns=a%0Ab").is_none(), "not a header value");
        assert!(echo(&format!("/v2/a/manifests/v1?ns={}", "a".repeat(MAX_NS_ECHO + 1))).is_none());
        assert!(echo(&format!("/v2/a/manifests/v1?ns={}", "a".repeat(MAX_NS_ECHO))).is_some());
    }

    #[test]
    fn default_upstream_with_library_namespace() {
        let (up, repo, ep) = route(Method::GET, "/v2/alpine/manifests/3.20").unwrap();
        assert_eq!((up.as_str(), repo.as_str()), ("docker.io", "library/alpine"));
        assert_eq!(ep, Endpoint::Manifest(Reference::Tag("3.20".parse().unwrap())));
    }

    #[test]
    fn ns_selects_the_upstream_and_keeps_the_path() {
        let (up, repo, _) = route(Method::HEAD, "/v2/org/app/manifests/v1?ns=ghcr.io").unwrap();
        assert_eq!((up.as_str(), repo.as_str()), ("ghcr.io", "org/app"));
        let (up, repo, _) = route(Method::GET, "/v2/alpine/manifests/v1?ns=index.docker.io").unwrap();
        assert_eq!((up.as_str(), repo.as_str()), ("docker.io", "library/alpine"));
    }

    #[test]
    fn unknown_ns_is_name_unknown() {
        let e = route(Method::GET, "/v2/x/manifests/v1?ns=evil.example").err().unwrap();
        assert!(matches!(e, Error::UnknownUpstream(_)));
        assert_eq!(e.status(), 404);
    }

    #[test]
    fn path_prefix_selects_the_upstream() {
        let (up, repo, ep) = route(Method::GET, &format!("/v2/ghcr.io/org/app/blobs/{D}")).unwrap();
        assert_eq!((up.as_str(), repo.as_str()), ("ghcr.io", "org/app"));
        assert_eq!(ep, Endpoint::Blob(D.parse().unwrap()));
        // A prefix that looks like a registry host but is no upstream is refused.
        for path in ["/v2/evil.example/app/manifests/1", "/v2/localhost/app/manifests/1"] {
            assert!(matches!(route(Method::GET, path), Err(Error::UnknownUpstream(_))), "{path}");
        }
        // Other first components are part of the name on the default upstream.
        let (up, repo, _) = route(Method::GET, "/v2/team/app/manifests/1").unwrap();
        assert_eq!((up.as_str(), repo.as_str()), ("docker.io", "team/app"));
    }

    #[test]
    fn tags_list_keeps_pagination_only() {
        let (_, repo, ep) = route(Method::GET, "/v2/ghcr.io/a/b/tags/list?n=10&last=v2&x=1").unwrap();
        assert_eq!(repo, "a/b");
        assert_eq!(ep, Endpoint::TagsList(Some("n=10&last=v2".into())));
    }

    #[test]
    fn referrers_keep_their_filter() {
        let (up, repo, ep) =
            route(Method::GET, &format!("/v2/org/app/referrers/{D}?artifactType=application%2Fspdx&ns=ghcr.io&x=1"))
                .unwrap();
        assert_eq!((up.as_str(), repo.as_str()), ("ghcr.io", "org/app"));
        assert_eq!(ep, Endpoint::Referrers(D.parse().unwrap(), Some("artifactType=application%2Fspdx".into())));
        assert_eq!(route(Method::GET, "/v2/a/referrers/sha256:nope").err().unwrap().status(), 400);
    }

    #[test]
    fn bad_input_maps_to_oci_errors() {
        let status = |m: Method, u: &str| route(m, u).err().map(|e| (e.status().as_u16(), e.to_string()));
        assert_eq!(status(Method::GET, "/v2/a/manifests/sha256:totallywrong").unwrap().0, 400);
        assert_eq!(status(Method::GET, "/v2/a/manifests/.INVALID_MANIFEST_NAME").unwrap().0, 404);
        assert_eq!(status(Method::GET, "/v2/a/blobs/sha512:abc").unwrap().0, 400);
        assert_eq!(status(Method::GET, "/v2/a/blobs/nope").unwrap().0, 400);
        assert_eq!(status(Method::GET, "/v2/A/manifests/x").unwrap().0, 400);
        assert_eq!(status(Method::GET, "/v2/a/../b/manifests/x").unwrap().0, 400);
        assert_eq!(status(Method::GET, "/v2/%2e%2e/manifests/x").unwrap().0, 400);
        assert_eq!(status(Method::GET, &format!("/v2/{}/manifests/x", "a/".repeat(1100))).unwrap().0, 400);
        assert_eq!(status(Method::PUT, "/v2/a/manifests/x").unwrap().0, 405);
        assert_eq!(status(Method::DELETE, &format!("/v2/a/blobs/{D}")).unwrap().0, 405);
        assert_eq!(status(Method::POST, "/v2/a/blobs/uploads/").unwrap().0, 405);
        assert_eq!(status(Method::GET, "/v2/a/blobs/uploads/123").unwrap().0, 405);
        assert_eq!(status(Method::GET, "/v2/a/unknown").unwrap().0, 404);
        assert_eq!(status(Method::GET, "/v2x").unwrap().0, 404);
        assert!(matches!(parse(&Method::GET, &"/v2/".parse().unwrap(), &upstreams()), Ok(Parsed::Base)));
        assert!(matches!(parse(&Method::GET, &"/v2".parse().unwrap(), &upstreams()), Ok(Parsed::Base)));
    }
}
