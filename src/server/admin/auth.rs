//! Who may use the admin listener's mutating endpoints (`POST /prefetch`,
//! `POST /purge`, and anything added later). Two locks, both required:
//! - where the request comes from ([`super::provenance`]): not a web page
//!   (no `Origin`, no cross-site `Sec-Fetch-Site`), and addressed to a host
//!   the listener answers to (no DNS rebinding);
//! - the bearer token of the token file, compared in constant time:
//!   `[admin] token_file`, or, on a loopback listener without one, a token
//!   larder writes at start-up to `cache.dir/admin-token` (mode 0600). A
//!   loopback listener used to be open to every local process, and on a
//!   `hostNetwork` node every local process is every `hostNetwork` pod; now
//!   only those that can read larder's files (its user, root) can operate,
//!   and `larder prefetch`/`purge --config` read the file. The token file is
//!   watched and fails closed ([`super::token_file`]).
//!
//! A listener others can reach without `[admin] token_file` refuses them:
//! a generated token there would be a secret nobody was told to
//! distribute. Read-only endpoints (`/metrics`, `/healthz`, `/readyz`, the
//! status page) stay open.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use http::HeaderMap;
use http::header::AUTHORIZATION;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq;

use super::provenance::{AllowedHosts, Suspect};
use super::token_file::{self, TokenFile};
use crate::config::AdminConfig;
use crate::error::Error;
use crate::metrics::metrics;

/// The admin listener's access rule, decided at start-up.
pub struct AdminAuth {
    rule: Rule,
    hosts: AllowedHosts,
}

enum Rule {
    /// Requests must carry `Authorization: Bearer <the file's token>`.
    Token { file: Arc<TokenFile>, generated: bool },
    /// No token file and a listener others can reach: mutating endpoints are off.
    Disabled,
}

/// Why a request was refused, a metric label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A token that is not the configured one.
    Wrong,
    /// No token file and a non-loopback listener.
    Disabled,
    /// The token file is missing, empty or invalid: no token is accepted.
    Revoked,
    /// A web page's request (`Origin`, cross-site `Sec-Fetch-Site`).
    CrossSite,
    /// A `Host` the listener does not answer to (DNS rebinding), shown.
    Host(String),
}

impl Refusal {
    pub fn as_str(&self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Wrong => "wrong",
            Refusal::Disabled => "disabled",
            Refusal::Revoked => "revoked",
            Refusal::CrossSite => "cross_site",
            Refusal::Host(_) => "host",
        }
    }
}

impl AdminAuth {
    /// Reads the token file, or on a loopback listener without one writes
    /// a generated token into `cache_dir` (blocking file I/O: call from
    /// start-up on the blocking pool). `listen` is the admin listener's address.
    pub fn load(config: &AdminConfig, listen: SocketAddr, cache_dir: &Path) -> Result<AdminAuth, String> {
        let hosts = AllowedHosts::new(listen.ip(), &config.allowed_hosts);
        let rule = match &config.token_file {
            Some(path) => Rule::Token { file: Arc::new(TokenFile::load(path)?), generated: false },
            // `is_loopback` as std has it: an IPv4-mapped 127.0.0.1 counts as
            // reachable (tests/admin_auth.rs uses it to be "reachable" on loopback).
            None if listen.ip().is_loopback() => {
                let path = token_file::generate(cache_dir)?;
                Rule::Token { file: Arc::new(TokenFile::load(&path)?), generated: true }
            }
            None => Rule::Disabled,
        };
        Ok(AdminAuth { rule, hosts })
    }

    /// The token file, to be watched; and whether larder wrote it.
    pub fn token_file(&self) -> Option<(&Arc<TokenFile>, bool)> {
        match &self.rule {
            Rule::Token { file, generated } => Some((file, *generated)),
            Rule::Disabled => None,
        }
    }

    /// Which token this listener takes, for a 401's message: the
    /// configured file, or the one larder generated and where (only a
    /// loopback listener generates one, so only local clients read it).
    fn expected_token(&self) -> String {
        match &self.rule {
            Rule::Token { file, generated: false } => {
                format!("the token in [admin] token_file ({})", shown(file.path()).display())
            }
            Rule::Token { file, generated: true } => format!(
                "the token larder generated at start in {} (there is no [admin] token_file; `larder <command> \
                 --config <larder's config>` reads it, or pass --token-file)",
                shown(file.path()).display()
            ),
            Rule::Disabled => "no token: admin operations are disabled here".to_owned(),
        }
    }

    /// Whether a request with `headers` (and `uri`) may run a mutating operation.
    pub fn check(&self, headers: &HeaderMap, uri: &http::Uri) -> Result<(), Refusal> {
        self.hosts.check(headers, uri).map_err(|suspect| match suspect {
            Suspect::CrossSite => Refusal::CrossSite,
            Suspect::Host(host) => Refusal::Host(host),
        })?;
        let expected = match &self.rule {
            Rule::Disabled => return Err(Refusal::Disabled),
            Rule::Token { file, .. } => file.expected().map_err(|_| Refusal::Revoked)?,
        };
        let presented = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .ok_or(Refusal::Missing)?;
        let presented: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        if bool::from(presented.ct_eq(&expected)) { Ok(()) } else { Err(Refusal::Wrong) }
    }

    /// [`AdminAuth::check`], counting a refusal in
    /// `larder_admin_auth_failures_total{endpoint,reason}`, logging it, and
    /// mapping it to its error: 401 with a Bearer challenge when a token
    /// would help, 403 DENIED when none would.
    pub fn authorize(&self, headers: &HeaderMap, uri: &http::Uri, endpoint: &'static str) -> Result<(), Error> {
        self.check(headers, uri).map_err(|refusal| {
            metrics().admin_auth_failures.with_label_values(&[endpoint, refusal.as_str()]).inc();
            match &refusal {
                Refusal::Host(host) => {
                    tracing::warn!(endpoint, reason = refusal.as_str(), ?host, "admin request refused")
                }
                _ => tracing::warn!(endpoint, reason = refusal.as_str(), "admin request refused"),
            }
            match refusal {
                Refusal::Missing => Error::AdminUnauthorized(format!(
                    "this admin operation needs `Authorization: Bearer <token>` with {}; no token was sent",
                    self.expected_token()
                )),
                Refusal::Wrong => {
                    Error::AdminUnauthorized(format!("the bearer token sent is not {}", self.expected_token()))
                }
                Refusal::Disabled => Error::AdminDisabled,
                Refusal::Revoked => Error::AdminForbidden(
                    "no admin token is accepted: the admin token file is missing, empty or invalid (see larder's \
                     log); write a valid token to it"
                        .to_owned(),
                ),
                Refusal::CrossSite => Error::AdminForbidden(
                    "admin operations are refused to web pages: this request carries Origin or a cross-site \
                     Sec-Fetch-Site (larder's CLI and curl send neither)"
                        .to_owned(),
                ),
                Refusal::Host(host) => Error::AdminForbidden(format!(
                    "admin operations are refused for Host {host:?}: address the admin listener by a loopback \
                     address, localhost or its own address, or list the name in [admin] allowed_hosts"
                )),
            }
        })
    }
}

/// A path as a client in another folder can use it: absolute.
fn shown(path: &Path) -> std::path::PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(authorization: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::HOST, "127.0.0.1:9090".parse().unwrap());
        if let Some(a) = authorization {
            h.insert(AUTHORIZATION, a.parse().unwrap());
        }
        h
    }

    fn uri() -> http::Uri {
        http::Uri::from_static("/purge")
    }

    fn with_token(token: &str) -> (tempfile::TempDir, AdminAuth) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), format!("{token}\n")).unwrap();
        let config = AdminConfig { token_file: Some(dir.path().join("token")), ..Default::default() };
        let auth = AdminAuth::load(&config, "0.0.0.0:9090".parse().unwrap(), dir.path()).unwrap();
        (dir, auth)
    }

    #[test]
    fn a_token_file_requires_exactly_that_bearer_token() {
        let (_dir, auth) = with_token("correct-horse-battery-staple");
        let check = |h: &HeaderMap| auth.check(h, &uri());
        assert_eq!(check(&headers(Some("Bearer correct-horse-battery-staple"))), Ok(()));
        assert_eq!(check(&headers(Some("bearer correct-horse-battery-staple"))), Ok(()));
        assert_eq!(check(&headers(None)), Err(Refusal::Missing));
        assert_eq!(check(&headers(Some("Basic Y29ycmVjdA=="))), Err(Refusal::Missing));
        assert_eq!(check(&headers(Some("Bearer correct-horse-battery-stapl"))), Err(Refusal::Wrong));
        assert_eq!(check(&headers(Some("Bearer correct-horse-battery-staple2"))), Err(Refusal::Wrong));
    }

    #[test]
    fn the_right_token_from_a_web_page_or_to_a_foreign_host_is_refused() {
        let (_dir, auth) = with_token("correct-horse-battery-staple");
        let mut page = headers(Some("Bearer correct-horse-battery-staple"));
        page.insert(http::header::ORIGIN, "https://evil.example".parse().unwrap());
        assert_eq!(auth.check(&page, &uri()), Err(Refusal::CrossSite));
        let mut rebound = headers(Some("Bearer correct-horse-battery-staple"));
        rebound.insert(http::header::HOST, "attacker.example:9090".parse().unwrap());
        assert_eq!(auth.check(&rebound, &uri()), Err(Refusal::Host("attacker.example:9090".into())));
    }

    #[test]
    fn without_a_token_file_a_loopback_listener_generates_one_and_others_refuse() {
        let none = AdminConfig::default();
        for loopback in ["127.0.0.1:9090", "[::1]:9090", "127.0.0.2:9090"] {
            let dir = tempfile::tempdir().unwrap();
            let auth = AdminAuth::load(&none, loopback.parse().unwrap(), dir.path()).unwrap();
            assert_eq!(auth.check(&headers(None), &uri()), Err(Refusal::Missing), "{loopback}: no longer open");
            let (file, generated) = auth.token_file().expect("a token file");
            assert!(generated);
            let token = std::fs::read_to_string(file.path()).unwrap();
            let bearer = format!("Bearer {}", token.trim());
            assert_eq!(auth.check(&headers(Some(&bearer)), &uri()), Ok(()), "{loopback}: the generated token");
        }
        for reachable in ["0.0.0.0:9090", "[::]:9090", "10.0.0.5:9090"] {
            let dir = tempfile::tempdir().unwrap();
            let auth = AdminAuth::load(&none, reachable.parse().unwrap(), dir.path()).unwrap();
            let bearer = headers(Some("Bearer anything-at-all-123"));
            assert_eq!(auth.check(&bearer, &uri()), Err(Refusal::Disabled), "{reachable}");
            assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{reachable}: no token written");
        }
    }
}
