//! Upstream authentication: answers `WWW-Authenticate` challenges with a
//! Bearer token (anonymous, or obtained with the configured Basic
//! credentials) or Basic credentials. Tokens are cached per
//! (realm, service, scope) until they expire, and concurrent requests for
//! the same token share one token request.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use http::header::{AUTHORIZATION, USER_AGENT};
use http::{HeaderValue, Request, Uri};
use http_body_util::Empty;
use serde::Deserialize;

use super::challenge::Challenge;
use super::client::HttpClient;
use crate::coalesce::SingleFlight;
use crate::config::{Credentials, Secret};
use crate::error::{Error, UpstreamError};

/// Largest token response read; bigger ones are refused.
pub const MAX_TOKEN_RESPONSE: usize = 1 << 20;
/// Lifetime assumed when a token response has no `expires_in` (the spec's default).
const DEFAULT_TOKEN_LIFETIME: Duration = Duration::from_secs(60);
/// Longest a token is cached, whatever its `expires_in` says.
const MAX_TOKEN_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// A token is dropped from the cache this long before it expires, so that
/// it is not sent while it expires in flight.
const TOKEN_EXPIRY_MARGIN: Duration = Duration::from_secs(5);

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct TokenKey {
    realm: String,
    service: Option<String>,
    scope: String,
}

struct CachedToken {
    token: Secret,
    expires: Instant,
}

pub struct Auth {
    credentials: Option<Credentials>,
    /// Host of the upstream URL; token realms must be on it or its registrable domain.
    upstream_host: String,
    /// The last challenge upstream sent, so later requests can present a
    /// cached token up front instead of collecting a 401 first.
    last_challenge: Mutex<Option<Challenge>>,
    tokens: Mutex<HashMap<TokenKey, CachedToken>>,
    flights: SingleFlight<TokenKey, (Secret, Duration)>,
}

#[derive(Deserialize)]
struct TokenResponse {
    token: Option<String>,
    access_token: Option<String>,
    expires_in: Option<u64>,
}

impl Auth {
    pub fn new(credentials: Option<Credentials>, upstream_host: &str) -> Auth {
        Auth {
            credentials,
            upstream_host: upstream_host.to_ascii_lowercase(),
            last_challenge: Mutex::new(None),
            tokens: Mutex::new(HashMap::new()),
            flights: SingleFlight::default(),
        }
    }

    fn basic(&self) -> Option<HeaderValue> {
        let c = self.credentials.as_ref()?;
        let raw = format!("{}:{}", c.username, c.password.expose());
        let mut v =
            HeaderValue::from_str(&format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(raw))).ok()?;
        v.set_sensitive(true);
        Some(v)
    }

    /// An `Authorization` value for `scope` that needs no network round
    /// trip: a cached, unexpired token for the last challenge, or Basic
    /// credentials if upstream asked for Basic.
    pub fn cached_header(&self, scope: &str) -> Option<HeaderValue> {
        let challenge = self.last_challenge.lock().unwrap_or_else(|p| p.into_inner()).clone()?;
        match challenge {
            Challenge::Basic => self.basic(),
            Challenge::Bearer { realm, service, .. } => {
                let key = TokenKey { realm, service, scope: scope.to_owned() };
                let tokens = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
                let t = tokens.get(&key).filter(|t| t.expires > Instant::now())?;
                bearer(&t.token)
            }
        }
    }

    /// Answers a challenge for `scope`, fetching a token if needed.
    pub async fn authorize(
        &self,
        http: &HttpClient,
        challenge: Challenge,
        scope: &str,
    ) -> Result<HeaderValue, UpstreamError> {
        *self.last_challenge.lock().unwrap_or_else(|p| p.into_inner()) = Some(challenge.clone());
        let (realm, service) = match challenge {
            Challenge::Basic => return self.basic().ok_or(UpstreamError::Denied),
            Challenge::Bearer { realm, service, .. } => (realm, service),
        };
        let realm_uri = self.trusted_realm(&realm)?;
        let key = TokenKey { realm, service, scope: scope.to_owned() };
        if let Some(h) = self.cached_token(&key) {
            return Ok(h);
        }
        let fetch = {
            let http = http.clone();
            let key = key.clone();
            let basic = self.basic();
            move || async move { fetch_token(&http, realm_uri, &key, basic).await.map_err(Error::Upstream) }
        };
        let (result, _) = self.flights.run(key.clone(), fetch).await;
        let (token, lifetime) = match result {
            Ok(token) => token,
            Err(Error::Upstream(e)) => return Err(e),
            Err(e) => return Err(UpstreamError::Auth(e.to_string())),
        };
        let header = bearer(&token).ok_or_else(|| UpstreamError::Auth("token is not a valid header value".into()))?;
        let expires = Instant::now() + lifetime.saturating_sub(TOKEN_EXPIRY_MARGIN);
        self.tokens.lock().unwrap_or_else(|p| p.into_inner()).insert(key, CachedToken { token, expires });
        Ok(header)
    }

    fn cached_token(&self, key: &TokenKey) -> Option<HeaderValue> {
        let tokens = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        tokens.get(key).filter(|t| t.expires > Instant::now()).and_then(|t| bearer(&t.token))
    }

    /// The realm is where larder sends its credentials, so it must belong
    /// to the upstream: the same host, or (for DNS names) the same
    /// registrable domain per the public suffix list. An IP or localhost
    /// realm is trusted only if it is exactly the upstream's host.
    fn trusted_realm(&self, realm: &str) -> Result<Uri, UpstreamError> {
        let uri: Uri = realm.parse().map_err(|_| UpstreamError::Auth(format!("token realm {realm:?} is not a URL")))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) {
            return Err(UpstreamError::Auth(format!("token realm {realm:?} is not http(s)")));
        }
        let host = uri.host().unwrap_or_default().trim_matches(['[', ']']).to_ascii_lowercase();
        let upstream = self.upstream_host.trim_matches(['[', ']']);
        let is_literal = |h: &str| h.parse::<IpAddr>().is_ok() || h == "localhost";
        let trusted = host == upstream
            || (!is_literal(&host)
                && !is_literal(upstream)
                && psl::domain_str(&host).is_some_and(|d| Some(d) == psl::domain_str(upstream)));
        if trusted {
            Ok(uri)
        } else {
            Err(UpstreamError::Auth(format!(
                "token realm host {host:?} is not upstream {upstream:?} or its registrable domain"
            )))
        }
    }
}

fn bearer(token: &Secret) -> Option<HeaderValue> {
    let mut v = HeaderValue::from_str(&format!("Bearer {}", token.expose())).ok()?;
    v.set_sensitive(true);
    Some(v)
}

async fn fetch_token(
    http: &HttpClient,
    realm: Uri,
    key: &TokenKey,
    basic: Option<HeaderValue>,
) -> Result<(Secret, Duration), UpstreamError> {
    let query = {
        let mut query = form_urlencoded::Serializer::new(String::new());
        if let Some(service) = &key.service {
            query.append_pair("service", service);
        }
        query.append_pair("scope", &key.scope);
        query.finish()
    };
    let sep = if realm.query().is_some() { '&' } else { '?' };
    let url = format!("{realm}{sep}{query}");
    let mut req = Request::get(url).header(USER_AGENT, crate::USER_AGENT);
    if let Some(b) = basic {
        req = req.header(AUTHORIZATION, b);
    }
    let req =
        req.body(Empty::<Bytes>::new()).map_err(|e| UpstreamError::Auth(format!("building token request: {e}")))?;
    let resp = http.send(req).await?;
    let status = resp.status();
    match status.as_u16() {
        200 => {}
        401 | 403 => return Err(UpstreamError::Denied),
        429 => {
            return Err(UpstreamError::RateLimited { retry_after: super::retry_after(resp.headers()) });
        }
        _ => {
            return Err(UpstreamError::Auth(format!("token service answered {status}")));
        }
    }
    let body = http.read_body(resp.into_body(), MAX_TOKEN_RESPONSE).await?;
    let parsed: TokenResponse =
        serde_json::from_slice(&body).map_err(|e| UpstreamError::Auth(format!("token response: {e}")))?;
    let token = parsed
        .token
        .or(parsed.access_token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| UpstreamError::Auth("token response has no token".into()))?;
    crate::metrics::metrics().tokens_fetched.inc();
    // An untrusted number: clamped, so that `now + lifetime` cannot overflow.
    let lifetime = parsed.expires_in.map(Duration::from_secs).unwrap_or(DEFAULT_TOKEN_LIFETIME).min(MAX_TOKEN_LIFETIME);
    Ok((Secret::new(token), lifetime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn realms_must_belong_to_the_upstream() {
        let hub = Auth::new(None, "registry-1.docker.io");
        assert!(hub.trusted_realm("https://auth.docker.io/token").is_ok());
        assert!(hub.trusted_realm("https://evil.example/token").is_err());
        assert!(hub.trusted_realm("https://docker.io.evil.example/token").is_err());
        assert!(hub.trusted_realm("ftp://auth.docker.io/token").is_err());

        let ghcr = Auth::new(None, "ghcr.io");
        assert!(ghcr.trusted_realm("https://ghcr.io/token").is_ok());
        // Different registrable domains under a public suffix.
        let a = Auth::new(None, "a.github.io");
        assert!(a.trusted_realm("https://b.github.io/token").is_err());

        let local = Auth::new(None, "127.0.0.1");
        assert!(local.trusted_realm("http://127.0.0.1:9999/token").is_ok());
        assert!(local.trusted_realm("http://127.0.0.2:9999/token").is_err());
        assert!(hub.trusted_realm("http://127.0.0.1/token").is_err());
    }

    #[test]
    fn basic_credentials_are_sensitive() {
        let auth = Auth::new(Some(Credentials { username: "u".into(), password: Secret::new("p") }), "r.example");
        *auth.last_challenge.lock().unwrap() = Some(Challenge::Basic);
        let h = auth.cached_header("repository:x:pull").unwrap();
        assert!(h.is_sensitive());
        assert_eq!(h, "Basic dTpw");
    }
}
