//! Bearer tokens: fetched from a realm, and cached per (realm, service,
//! scopes, identity) until shortly before they expire (DESIGN.md rule 4).
//!
//! The cache is bounded (issue 15, item 7): any client can make larder
//! fetch a token for a made-up repository, and Docker Hub hands out
//! anonymous tokens for any scope, so an unbounded cache grew by every name
//! a client sent. Entries expire with their token and the whole cache is
//! capped in bytes ([`MAX_TOKEN_CACHE_BYTES`]); past the cap the least
//! useful entries go (moka's TinyLFU), and a token that is not kept is
//! simply fetched again when it is next needed.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{AUTHORIZATION, USER_AGENT};
use http::{HeaderValue, Request, Uri};
use http_body_util::Empty;
use serde::Deserialize;

use super::client::HttpClient;
use super::scope::Scopes;
use crate::config::Secret;
use crate::error::UpstreamError;

/// Largest token response read; bigger ones are refused.
pub const MAX_TOKEN_RESPONSE: usize = 1 << 20;
/// Most bytes of tokens (and their keys) cached per upstream.
pub const MAX_TOKEN_CACHE_BYTES: u64 = 8 << 20;
/// Bytes an entry is charged on top of its strings (the entry itself and
/// moka's bookkeeping), so that many tiny tokens are bounded too.
const TOKEN_ENTRY_OVERHEAD: usize = 256;
/// Lifetime assumed when a token response has no `expires_in` (the spec's default).
const DEFAULT_TOKEN_LIFETIME: Duration = Duration::from_secs(60);
/// Longest a token is cached, whatever its `expires_in` says.
const MAX_TOKEN_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// A token stops being used this share of its lifetime before it expires
/// (a 2 s token is reused for 1.5 s), so that it does not expire in
/// flight; never more than [`MAX_TOKEN_EXPIRY_MARGIN`] early.
const TOKEN_EXPIRY_MARGIN_DIVISOR: u32 = 4;
const MAX_TOKEN_EXPIRY_MARGIN: Duration = Duration::from_secs(30);

/// Whose token: the upstream's (obtained with its credentials, if it has
/// any), an anonymous one for a redirect target, one obtained with a
/// verified client's credentials lent for the repository in its scope, or
/// (never cached) one for a client being checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Identity {
    Upstream,
    Anonymous,
    Lent,
    Client,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TokenKey {
    pub realm: String,
    pub service: Option<String>,
    pub scopes: Scopes,
    pub identity: Identity,
}

impl TokenKey {
    fn weight(&self, token: &Secret) -> u32 {
        let bytes = self.realm.len()
            + self.service.as_ref().map_or(0, String::len)
            + self.scopes.len_bytes()
            + token.expose().len()
            + TOKEN_ENTRY_OVERHEAD;
        u32::try_from(bytes).unwrap_or(u32::MAX)
    }
}

/// A token and how long it may still be used.
#[derive(Clone)]
pub struct Token {
    pub secret: Secret,
    usable_for: Duration,
}

/// Expires each entry when its token stops being usable.
struct UsableFor;

impl moka::Expiry<TokenKey, Token> for UsableFor {
    fn expire_after_create(&self, _: &TokenKey, token: &Token, _: Instant) -> Option<Duration> {
        Some(token.usable_for)
    }

    /// A fresh token replacing an old one brings its own lifetime.
    fn expire_after_update(&self, _: &TokenKey, token: &Token, _: Instant, _: Option<Duration>) -> Option<Duration> {
        Some(token.usable_for)
    }
}

#[derive(Clone)]
pub struct TokenCache {
    inner: moka::sync::Cache<TokenKey, Token>,
}

impl TokenCache {
    pub fn new() -> TokenCache {
        let inner = moka::sync::Cache::builder()
            .max_capacity(MAX_TOKEN_CACHE_BYTES)
            .weigher(|k: &TokenKey, t: &Token| k.weight(&t.secret))
            .expire_after(UsableFor)
            .build();
        TokenCache { inner }
    }

    pub fn get(&self, key: &TokenKey) -> Option<Secret> {
        self.inner.get(key).map(|t| t.secret)
    }

    pub fn insert(&self, key: TokenKey, token: Token) {
        if !token.usable_for.is_zero() {
            self.inner.insert(key, token);
        }
    }

    /// Drops `key`'s token if it is still `refused` (a concurrent request
    /// may already have put a fresh one there, which stays).
    pub fn evict(&self, key: &TokenKey, refused: &Secret) {
        self.inner.entry(key.clone()).and_compute_with(|entry| match entry {
            Some(e) if e.value().secret == *refused => moka::ops::compute::Op::Remove,
            _ => moka::ops::compute::Op::Nop,
        });
    }

    /// Tokens held (after pending evictions ran).
    pub fn len(&self) -> u64 {
        self.inner.run_pending_tasks();
        self.inner.entry_count()
    }
}

#[derive(Deserialize)]
struct TokenResponse {
    token: Option<String>,
    access_token: Option<String>,
    /// Seconds; some services send a float.
    expires_in: Option<f64>,
}

/// How a token request failed, for metrics and the error a client sees.
pub enum FetchError {
    /// The realm answered 401/403 (to the credentials, or to anonymity).
    Refused,
    Other(UpstreamError),
}

impl From<UpstreamError> for FetchError {
    fn from(e: UpstreamError) -> Self {
        FetchError::Other(e)
    }
}

/// `GET <realm>?service=…&scope=…` (one `scope` per scope; `service` only
/// when the challenge named one), with Basic credentials when given.
pub async fn fetch(
    http: &HttpClient,
    realm: &Uri,
    key: &TokenKey,
    basic: Option<HeaderValue>,
) -> Result<Token, FetchError> {
    let query = {
        let mut query = form_urlencoded::Serializer::new(String::new());
        if let Some(service) = &key.service {
            query.append_pair("service", service);
        }
        for scope in key.scopes.iter() {
            query.append_pair("scope", scope);
        }
        query.finish()
    };
    let url = match (query.is_empty(), realm.query().is_some()) {
        (true, _) => realm.to_string(),
        (false, true) => format!("{realm}&{query}"),
        (false, false) => format!("{realm}?{query}"),
    };
    let mut req = Request::get(url).header(USER_AGENT, crate::USER_AGENT);
    if let Some(b) = basic {
        req = req.header(AUTHORIZATION, b);
    }
    let req =
        req.body(Empty::<Bytes>::new()).map_err(|e| UpstreamError::Auth(format!("building token request: {e}")))?;
    // A realm is named by a challenge, not by the operator: dialled only
    // at addresses the upstream's dial policy allows.
    let resp = http.send(req, super::client::Named::ByUpstream).await?;
    let status = resp.status();
    match status.as_u16() {
        200 => {}
        401 | 403 => return Err(FetchError::Refused),
        429 => return Err(UpstreamError::RateLimited { retry_after: super::retry_after(resp.headers()) }.into()),
        _ => return Err(UpstreamError::Auth(format!("token service answered {status}")).into()),
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
    let lifetime = parsed
        .expires_in
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(DEFAULT_TOKEN_LIFETIME, |s| Duration::from_secs_f64(s.min(MAX_TOKEN_LIFETIME.as_secs_f64())));
    Ok(Token { secret: Secret::new(token), usable_for: usable_for(lifetime) })
}

/// How long a token of `lifetime` is used: all but a margin that is a
/// share of the lifetime, so that short tokens are still reused.
fn usable_for(lifetime: Duration) -> Duration {
    lifetime.saturating_sub((lifetime / TOKEN_EXPIRY_MARGIN_DIVISOR).min(MAX_TOKEN_EXPIRY_MARGIN))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(scope: &str) -> TokenKey {
        let repo: crate::oci::RepoName = scope.parse().unwrap();
        TokenKey {
            realm: "https://auth.example/token".into(),
            service: None,
            scopes: Scopes::new(Some(&repo), None),
            identity: Identity::Anonymous,
        }
    }

    fn token(s: &str, usable_for: Duration) -> Token {
        Token { secret: Secret::new(s), usable_for }
    }

    #[test]
    fn the_margin_is_a_share_of_the_lifetime() {
        assert_eq!(usable_for(Duration::from_secs(2)), Duration::from_millis(1500));
        assert_eq!(usable_for(Duration::from_secs(60)), Duration::from_secs(45));
        assert_eq!(usable_for(Duration::from_secs(300)), Duration::from_secs(270));
        assert_eq!(usable_for(Duration::from_secs(43_200)), Duration::from_secs(43_170));
    }

    #[test]
    fn eviction_drops_only_the_refused_token() {
        let cache = TokenCache::new();
        let k = key("team/app");
        cache.insert(k.clone(), token("old", Duration::from_secs(60)));
        cache.evict(&k, &Secret::new("other"));
        assert_eq!(cache.get(&k), Some(Secret::new("old")));
        cache.evict(&k, &Secret::new("old"));
        assert_eq!(cache.get(&k), None);
    }

    #[test]
    fn tokens_expire_and_the_cache_is_bounded_in_bytes() {
        let cache = TokenCache::new();
        cache.insert(key("short/lived"), token("t", Duration::from_millis(50)));
        assert!(cache.get(&key("short/lived")).is_some());
        std::thread::sleep(Duration::from_millis(100));
        assert!(cache.get(&key("short/lived")).is_none(), "expired");

        // 64 KiB tokens for 1,000 made-up repositories: 64 MiB unbounded.
        let big = "t".repeat(64 << 10);
        for i in 0..1000 {
            cache.insert(key(&format!("made-up/repo-{i}")), token(&big, Duration::from_secs(300)));
        }
        let held = cache.len();
        assert!(held * (64 << 10) <= MAX_TOKEN_CACHE_BYTES, "{held} tokens of 64 KiB held");
        assert!(held > 0);
    }
}
