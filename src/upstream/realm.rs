//! Which token realms larder asks for tokens (DESIGN.md, "Upstream client",
//! rule 1 and 2). A realm is where larder sends credentials, so a realm
//! named by a challenge is trusted only if it belongs to whoever challenged:
//!
//! - for the upstream itself: its host, or another host of its site
//!   ([`crate::site`]: the same registrable domain, but never across
//!   tenants of a cloud domain such as `azurecr.io`, or across namespaces
//!   under `cluster.local`), or an entry of the
//!   upstream's `trusted_realms` (nvcr.io and Scarf front-ends name realms
//!   on other domains);
//! - for a redirect target (which only ever gets anonymous token requests):
//!   the target's host or another host of its site, nothing else.
//!
//! https only, http only when whoever challenged is http itself; an IP
//! literal or `localhost` only when it is exactly the challenger's host.

use http::Uri;

use crate::site::{host_of, same_site};

/// Why a realm was refused; the message names the realm and, for the
/// upstream, the `trusted_realms` key that would allow it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused(pub String);

/// A realm named by the upstream's own challenge.
pub fn for_upstream(realm: &str, upstream_name: &str, challenger: &Uri, trusted: &[Uri]) -> Result<Uri, Refused> {
    let uri = parse(realm)?;
    if trusted.iter().any(|t| listed(t, &uri)) {
        return Ok(uri);
    }
    scheme_allowed(realm, &uri, challenger)?;
    let (host, own) = (host_of(&uri), host_of(challenger));
    if same_site(&host, &own) {
        return Ok(uri);
    }
    Err(Refused(format!(
        "token realm host {host:?} is not upstream {own:?} or another host of its site; \
         to send this upstream's credentials there, list it in `trusted_realms` of upstream {upstream_name:?}: \
         trusted_realms = [{:?}]",
        without_query(&uri)
    )))
}

/// A realm named by a redirect target's challenge: larder asks it only for
/// an anonymous token, and only if it is on the target's own site.
pub fn for_redirect_target(realm: &str, target: &Uri) -> Result<Uri, Refused> {
    let uri = parse(realm)?;
    scheme_allowed(realm, &uri, target)?;
    let (host, own) = (host_of(&uri), host_of(target));
    if same_site(&host, &own) {
        return Ok(uri);
    }
    Err(Refused(format!(
        "token realm host {host:?} named by redirect target {own:?} is not on that host or its site; \
         larder asks only a redirect target's own realm for an anonymous token"
    )))
}

fn parse(realm: &str) -> Result<Uri, Refused> {
    let uri: Uri = realm.parse().map_err(|_| Refused(format!("token realm {realm:?} is not a URL")))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none_or(str::is_empty) {
        return Err(Refused(format!("token realm {realm:?} is not an http(s) URL")));
    }
    Ok(uri)
}

fn scheme_allowed(realm: &str, uri: &Uri, challenger: &Uri) -> Result<(), Refused> {
    match (uri.scheme_str(), challenger.scheme_str()) {
        (Some("https"), _) | (Some("http"), Some("http")) => Ok(()),
        _ => Err(Refused(format!("token realm {realm:?} is not https, and credentials never travel in clear text"))),
    }
}

/// Whether `realm` is what a `trusted_realms` entry lists: the same scheme,
/// host and port, and the same path unless the entry has none.
fn listed(entry: &Uri, realm: &Uri) -> bool {
    let port = |u: &Uri| u.port_u16().unwrap_or(if u.scheme_str() == Some("http") { 80 } else { 443 });
    let entry_path = entry.path().trim_end_matches('/');
    entry.scheme() == realm.scheme()
        && host_of(entry) == host_of(realm)
        && port(entry) == port(realm)
        && (entry_path.is_empty() || entry_path == realm.path().trim_end_matches('/'))
        && !realm.authority().is_some_and(|a| a.as_str().contains('@'))
}

fn without_query(uri: &Uri) -> String {
    let scheme = uri.scheme_str().unwrap_or("https");
    let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
    format!("{scheme}://{authority}{}", uri.path())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uri(s: &str) -> Uri {
        s.parse().unwrap()
    }

    fn upstream_ok(realm: &str, upstream: &str, trusted: &[&str]) -> bool {
        let trusted: Vec<Uri> = trusted.iter().map(|t| uri(t)).collect();
        for_upstream(realm, "u", &uri(upstream), &trusted).is_ok()
    }

    #[test]
    fn realms_must_belong_to_the_upstream() {
        let hub = "https://registry-1.docker.io";
        assert!(upstream_ok("https://auth.docker.io/token", hub, &[]));
        assert!(!upstream_ok("https://evil.example/token", hub, &[]));
        assert!(!upstream_ok("https://docker.io.evil.example/token", hub, &[]));
        assert!(!upstream_ok("ftp://auth.docker.io/token", hub, &[]));
        // https only, unless the upstream itself is http.
        assert!(!upstream_ok("http://auth.docker.io/token", hub, &[]));
        assert!(upstream_ok("http://auth.r.example/token", "http://r.example", &[]));
        assert!(upstream_ok("https://ghcr.io/token", "https://ghcr.io", &[]));
        // Different registrable domains under a public suffix.
        assert!(!upstream_ok("https://b.github.io/token", "https://a.github.io", &[]));
        // Tenants of one cloud domain, and Services of one cluster, are
        // not one site: another tenant's realm needs trusted_realms.
        let ecr = "https://123456789012.dkr.ecr.us-east-1.amazonaws.com";
        assert!(!upstream_ok("https://210987654321.dkr.ecr.us-east-1.amazonaws.com/token", ecr, &[]));
        assert!(!upstream_ok("https://theirs.azurecr.io/oauth2/token", "https://mine.azurecr.io", &[]));
        assert!(upstream_ok("https://mine.azurecr.io/oauth2/token", "https://mine.azurecr.io", &[]));
        let svc = "http://registry.ns.svc.cluster.local:5000";
        assert!(!upstream_ok("http://evil.other.svc.cluster.local/token", svc, &[]));
        assert!(upstream_ok(
            "http://evil.other.svc.cluster.local/token",
            svc,
            &["http://evil.other.svc.cluster.local"]
        ));
        // IP literals and localhost only as exactly the upstream's host.
        assert!(upstream_ok("http://127.0.0.1:9999/token", "http://127.0.0.1:5000", &[]));
        assert!(!upstream_ok("http://127.0.0.2:9999/token", "http://127.0.0.1:5000", &[]));
        assert!(!upstream_ok("http://localhost:9999/token", "http://127.0.0.1:5000", &[]));
        assert!(!upstream_ok("https://127.0.0.1/token", hub, &[]));
    }

    #[test]
    fn trusted_realms_allow_named_realms_on_other_domains() {
        let nvcr = "https://nvcr.io";
        let trusted = ["https://authn.nvidia.com/token"];
        assert!(upstream_ok("https://authn.nvidia.com/token", nvcr, &trusted));
        assert!(upstream_ok("https://authn.nvidia.com/token?x=1", nvcr, &trusted));
        assert!(!upstream_ok("https://authn.nvidia.com/other", nvcr, &trusted));
        assert!(!upstream_ok("https://authn.nvidia.com:8443/token", nvcr, &trusted));
        assert!(!upstream_ok("https://user@authn.nvidia.com/token", nvcr, &trusted));
        // An entry without a path trusts the whole origin.
        assert!(upstream_ok("https://ghcr.io/token", "https://lscr.io", &["https://ghcr.io"]));
        let e = for_upstream("https://authn.nvidia.com/token", "nvcr.io", &uri(nvcr), &[]).unwrap_err();
        assert!(e.0.contains("token realm host \"authn.nvidia.com\""), "{e:?}");
        assert!(e.0.contains("trusted_realms = [\"https://authn.nvidia.com/token\"]"), "{e:?}");
    }

    #[test]
    fn a_redirect_target_may_only_name_its_own_site() {
        let target = uri("https://us-docker.pkg.dev/v2/k8s-artifacts-prod/images/pause/manifests/3.9");
        assert!(for_redirect_target("https://us-docker.pkg.dev/v2/token", &target).is_ok());
        assert!(for_redirect_target("https://auth.pkg.dev/token", &target).is_ok());
        assert!(for_redirect_target("https://auth.docker.io/token", &target).is_err());
        assert!(for_redirect_target("http://us-docker.pkg.dev/v2/token", &target).is_err());
        let ip = uri("http://127.0.0.2:8080/x");
        assert!(for_redirect_target("http://127.0.0.2:9/token", &ip).is_ok());
        assert!(for_redirect_target("http://127.0.0.1:9/token", &ip).is_err());
    }
}
