//! Who may use the admin listener's mutating endpoints (`POST /prefetch`,
//! `POST /purge`, and anything added later): the holder of the bearer token
//! in `[admin] token_file`, compared in constant time. Without a token file
//! they are open only when the admin listener is on a loopback address
//! (nobody else can connect); otherwise refused. Read-only endpoints
//! (`/metrics`, `/healthz`, `/readyz`, the status page) stay open.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::RwLock;

use http::HeaderMap;
use http::header::AUTHORIZATION;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{AdminConfig, Secret, parse_admin_token};
use crate::error::Error;
use crate::metrics::metrics;

/// The admin listener's access rule, decided once at start-up.
pub enum AdminAuth {
    /// Requests must carry `Authorization: Bearer <token>`.
    Token {
        path: PathBuf,
        /// sha256 of the token: comparing digests keeps the compare
        /// constant-time whatever the lengths.
        digest: RwLock<[u8; 32]>,
    },
    /// No token file and a loopback listener: only local processes can connect.
    LoopbackOnly,
    /// No token file and a listener others can reach: mutating endpoints are off.
    Disabled,
}

/// Why a request was refused, a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A token that is not the configured one.
    Wrong,
    /// No token file and a non-loopback listener.
    Disabled,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Wrong => "wrong",
            Refusal::Disabled => "disabled",
        }
    }
}

fn digest(token: &Secret) -> [u8; 32] {
    Sha256::digest(token.expose().as_bytes()).into()
}

impl AdminAuth {
    /// Reads the token file, if configured (blocking file I/O: call from
    /// start-up on the blocking pool).
    pub fn load(config: &AdminConfig, listen: SocketAddr) -> Result<AdminAuth, String> {
        match &config.token_file {
            Some(path) => {
                let token = read_token(path)?;
                Ok(AdminAuth::Token { path: path.clone(), digest: RwLock::new(digest(&token)) })
            }
            None if listen.ip().is_loopback() => Ok(AdminAuth::LoopbackOnly),
            None => Ok(AdminAuth::Disabled),
        }
    }

    /// The token file to watch for changes, if any.
    pub fn path(&self) -> Option<PathBuf> {
        match self {
            AdminAuth::Token { path, .. } => Some(path.clone()),
            _ => None,
        }
    }

    /// Re-reads the token file (a rotated Kubernetes Secret); on error the
    /// current token stays.
    pub fn reload(&self) -> Result<(), String> {
        if let AdminAuth::Token { path, digest: current } = self {
            let token = read_token(path)?;
            *current.write().unwrap_or_else(|e| e.into_inner()) = digest(&token);
        }
        Ok(())
    }

    /// Whether a request with `headers` may run a mutating operation.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), Refusal> {
        let expected = match self {
            AdminAuth::LoopbackOnly => return Ok(()),
            AdminAuth::Disabled => return Err(Refusal::Disabled),
            AdminAuth::Token { digest, .. } => *digest.read().unwrap_or_else(|e| e.into_inner()),
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
    /// `larder_admin_auth_failures_total{endpoint,reason}` and mapping it to
    /// its error (401 with a Bearer challenge, or 403 when disabled).
    pub fn authorize(&self, headers: &HeaderMap, endpoint: &'static str) -> Result<(), Error> {
        self.check(headers).map_err(|refusal| {
            metrics().admin_auth_failures.with_label_values(&[endpoint, refusal.as_str()]).inc();
            tracing::warn!(endpoint, reason = refusal.as_str(), "admin request refused");
            match refusal {
                Refusal::Missing | Refusal::Wrong => Error::AdminUnauthorized,
                Refusal::Disabled => Error::AdminDisabled,
            }
        })
    }
}

fn read_token(path: &std::path::Path) -> Result<Secret, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse_admin_token(&text).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(authorization: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = authorization {
            h.insert(AUTHORIZATION, a.parse().unwrap());
        }
        h
    }

    fn with_token(token: &str) -> (tempfile::TempDir, AdminAuth) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), format!("{token}\n")).unwrap();
        let config = AdminConfig { token_file: Some(dir.path().join("token")) };
        let auth = AdminAuth::load(&config, "0.0.0.0:9090".parse().unwrap()).unwrap();
        (dir, auth)
    }

    #[test]
    fn a_token_file_requires_exactly_that_bearer_token() {
        let (_dir, auth) = with_token("correct-horse-battery-staple");
        assert_eq!(auth.check(&headers(Some("Bearer correct-horse-battery-staple"))), Ok(()));
        assert_eq!(auth.check(&headers(Some("bearer correct-horse-battery-staple"))), Ok(()));
        assert_eq!(auth.check(&headers(None)), Err(Refusal::Missing));
        assert_eq!(auth.check(&headers(Some("Basic Y29ycmVjdA=="))), Err(Refusal::Missing));
        assert_eq!(auth.check(&headers(Some("Bearer correct-horse-battery-stapl"))), Err(Refusal::Wrong));
        assert_eq!(auth.check(&headers(Some("Bearer correct-horse-battery-staple2"))), Err(Refusal::Wrong));
    }

    #[test]
    fn a_rotated_token_file_replaces_the_token() {
        let (dir, auth) = with_token("first-token-0123456789");
        std::fs::write(dir.path().join("token"), "second-token-0123456789\n").unwrap();
        auth.reload().unwrap();
        assert_eq!(auth.check(&headers(Some("Bearer first-token-0123456789"))), Err(Refusal::Wrong));
        assert_eq!(auth.check(&headers(Some("Bearer second-token-0123456789"))), Ok(()));
        std::fs::write(dir.path().join("token"), "short\n").unwrap();
        assert!(auth.reload().is_err(), "a bad new token is refused");
        assert_eq!(auth.check(&headers(Some("Bearer second-token-0123456789"))), Ok(()), "and the old one kept");
    }

    #[test]
    fn without_a_token_file_only_a_loopback_listener_is_open() {
        let none = AdminConfig::default();
        for open in ["127.0.0.1:9090", "[::1]:9090", "127.0.0.2:9090"] {
            let auth = AdminAuth::load(&none, open.parse().unwrap()).unwrap();
            assert_eq!(auth.check(&headers(None)), Ok(()), "{open}");
        }
        for reachable in ["0.0.0.0:9090", "[::]:9090", "10.0.0.5:9090"] {
            let auth = AdminAuth::load(&none, reachable.parse().unwrap()).unwrap();
            assert_eq!(auth.check(&headers(Some("Bearer anything-at-all-123"))), Err(Refusal::Disabled), "{reachable}");
        }
    }
}
