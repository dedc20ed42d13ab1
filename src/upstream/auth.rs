//! Answering `WWW-Authenticate` challenges (DESIGN.md, "Upstream client",
//! rules 1–4), per hop of a request:
//!
//! - the upstream's own origin gets its credentials: Basic, or a Bearer
//!   token from a trusted realm ([`super::realm::for_upstream`]) requested
//!   with them;
//! - a redirect target (another origin: Artifact Registry behind
//!   registry.k8s.io, ghcr.io behind a Scarf front) gets only an
//!   **anonymous** token from its own realm, never the upstream's
//!   credentials or tokens, and never Basic credentials.
//!
//! Whose credentials an own origin gets is [`Who`] asks: larder's (its
//! configured credentials; without any, on an upstream that verifies
//! clients, the credentials a verified client lent for the repository,
//! [`super::lent`]), or a client's being checked ([`super::verify`]): then
//! a fresh token every time, never cached or shared, so that no client is
//! ever let in on another's token.
//!
//! The scope comes from the path that got the 401 ([`super::scope`]).
//! Tokens are cached per (realm, service, scopes, identity) in a bounded
//! cache, one token request per key however many wait for it. A token
//! (or credentials) that was refused is dropped, and the request retried
//! once with a fresh one.

use std::sync::Arc;

use base64::Engine;
use http::{HeaderValue, Uri};

use super::challenge::Challenge;
use super::client::HttpClient;
use super::credentials::CredentialStore;
use super::lent::Lent;
use super::realm;
use super::scope::{Scopes, repository_of};
use super::tokens::{self, FetchError, Identity, TokenCache, TokenKey};
use crate::coalesce::SingleFlight;
use crate::config::{ClientCredentialsMode, Credentials, Secret, UpstreamConfig};
use crate::error::{Error, UpstreamError};
use crate::metrics::metrics;
use crate::oci::RepoName;

/// Origins whose last challenge is remembered (the upstream, its realms'
/// hosts, the redirect targets it uses), so that later requests present a
/// cached token up front instead of collecting a 401 first.
const MAX_REMEMBERED_CHALLENGES: u64 = 1024;

/// Whose credentials a request presents to the upstream's own origins.
#[derive(Clone, Copy)]
pub enum Who<'a> {
    /// larder's own: its configured credentials, or, without any, a
    /// verified client's lent for the repository.
    Larder,
    /// A client's, being checked: a token fetched with them for this
    /// request alone, or them as Basic credentials; nothing cached, and a
    /// refusal is final.
    Client(&'a Credentials),
}

/// One request of a chain of redirects: where it goes, and whether that is
/// the upstream's own origin.
pub struct Hop<'a> {
    pub url: &'a Uri,
    /// One of the upstream's configured origins (`url`, `urls`).
    pub own: bool,
    /// An own origin the upstream's credentials go to: `url`, and the
    /// fallbacks of `urls` on its site or marked `credentials = true`.
    pub credentials: bool,
    /// The repository the client asked for, the scope of last resort for the
    /// upstream's own origin when the path names none.
    pub requested: &'a RepoName,
    pub who: Who<'a>,
}

impl Hop<'_> {
    /// The repository a token for this hop must be scoped to: the one its
    /// path names (a redirect may have rewritten it).
    fn repository(&self) -> Option<RepoName> {
        repository_of(self.url.path()).or_else(|| self.own.then(|| self.requested.clone()))
    }

    fn origin(&self) -> String {
        let scheme = self.url.scheme_str().unwrap_or("https");
        let authority = self.url.authority().map(|a| a.as_str()).unwrap_or_default();
        format!("{scheme}://{authority}").to_ascii_lowercase()
    }

    /// Whether this hop goes to an own origin for the repository the
    /// request is for (not one a redirect rewrote).
    fn for_requested(&self) -> bool {
        self.credentials && self.repository().as_ref() == Some(self.requested)
    }
}

/// The credentials a hop carries.
enum Source {
    /// None: a redirect target, or an upstream without credentials (and,
    /// on one that verifies clients, none lent for the repository).
    Anonymous { own: bool },
    /// larder's configured credentials.
    Store(Arc<CredentialStore>),
    /// A verified client's, lent for the requested repository.
    Lent(Credentials),
    /// The client's being checked.
    Client(Credentials),
}

impl Source {
    /// Whose tokens a hop with these credentials shares.
    fn identity(&self) -> Identity {
        match self {
            Source::Anonymous { own: false } => Identity::Anonymous,
            Source::Anonymous { own: true } | Source::Store(_) => Identity::Upstream,
            Source::Lent(_) => Identity::Lent,
            // Never cached: a key only for the token request's query.
            Source::Client(_) => Identity::Client,
        }
    }

    fn fixed(&self) -> Option<&Credentials> {
        match self {
            Source::Lent(c) | Source::Client(c) => Some(c),
            _ => None,
        }
    }
}

/// What a request carried, so that a 401 can drop exactly that.
pub enum Presented {
    Nothing,
    /// A cached token.
    Token(TokenKey, Secret),
    /// The upstream's Basic credentials.
    Basic(Credentials),
    /// Credentials a verified client lent for the repository.
    Lent(RepoName, Credentials),
    /// What answering a 401 just produced: refused again, the request fails.
    Fresh,
}

pub struct Auth {
    /// The upstream's name, for metrics and messages.
    upstream: String,
    trusted_realms: Vec<Uri>,
    credentials: Option<Arc<CredentialStore>>,
    /// Verified clients' credentials, on an upstream that verifies clients
    /// and has none of its own.
    lent: Option<Lent>,
    challenges: moka::sync::Cache<String, Challenge>,
    tokens: TokenCache,
    flights: SingleFlight<TokenKey, Secret>,
}

impl Auth {
    pub fn new(config: &UpstreamConfig) -> Auth {
        Auth {
            upstream: config.name.clone(),
            trusted_realms: config.trusted_realms.clone(),
            credentials: config
                .credentials
                .as_ref()
                .map(|c| Arc::new(CredentialStore::new(&config.name, config.authority(), c))),
            lent: match config.client_credentials {
                ClientCredentialsMode::Verify { ttl } if config.credentials.is_none() => Some(Lent::new(ttl)),
                _ => None,
            },
            challenges: moka::sync::Cache::new(MAX_REMEMBERED_CHALLENGES),
            tokens: TokenCache::new(),
            flights: SingleFlight::default(),
        }
    }

    /// A verified client's `credentials` may be used for larder's own
    /// requests for `repo` (on an upstream without credentials of its own).
    pub fn lend(&self, repo: &RepoName, credentials: &Credentials) {
        if let Some(lent) = &self.lent {
            lent.lend(repo, credentials);
        }
    }

    /// The credentials `hop` carries.
    fn source(&self, hop: &Hop<'_>) -> Source {
        if !hop.credentials {
            return Source::Anonymous { own: hop.own };
        }
        match (hop.who, &self.credentials, &self.lent) {
            (Who::Client(c), _, _) => Source::Client(c.clone()),
            (Who::Larder, Some(store), _) => Source::Store(Arc::clone(store)),
            (Who::Larder, None, Some(lent)) if hop.for_requested() => match lent.get(hop.requested) {
                Some(c) => Source::Lent(c),
                None => Source::Anonymous { own: true },
            },
            (Who::Larder, None, _) => Source::Anonymous { own: true },
        }
    }

    /// What to send with a request before any 401: a cached token for the
    /// hop's origin and scope, or the upstream's Basic credentials when its
    /// origin asked for Basic before. Nothing for a redirect target that
    /// wants Basic. A client being checked gets a token of its own at once
    /// (its origin's challenge is known), or its Basic credentials.
    pub async fn up_front(
        &self,
        http: &HttpClient,
        hop: &Hop<'_>,
    ) -> Result<(Option<HeaderValue>, Presented), UpstreamError> {
        let Some(challenge) = self.challenges.get(&hop.origin()) else {
            return Ok((None, Presented::Nothing));
        };
        let source = self.source(hop);
        if let Source::Client(_) = source {
            return Ok((Some(self.answer(http, hop, challenge, Presented::Nothing).await?), Presented::Fresh));
        }
        match challenge {
            Challenge::Basic => match source {
                Source::Store(store) => {
                    let c = store.current().await?;
                    Ok((Some(basic(&c)?), Presented::Basic(c)))
                }
                Source::Lent(c) => Ok((Some(basic(&c)?), Presented::Lent(hop.requested.clone(), c))),
                _ => Ok((None, Presented::Nothing)),
            },
            Challenge::Bearer { realm, service, scope } => {
                let key = self.key(hop, &source, realm, service, scope.as_deref());
                match self.tokens.get(&key) {
                    Some(token) => Ok((Some(bearer(&token)?), Presented::Token(key, token))),
                    None => Ok((None, Presented::Nothing)),
                }
            }
        }
    }

    /// Answers a 401 from `hop`: drops what was `presented` (a refused
    /// cached token, or credentials to be read again), then returns what to
    /// retry the request with, once.
    pub async fn answer(
        &self,
        http: &HttpClient,
        hop: &Hop<'_>,
        challenge: Challenge,
        presented: Presented,
    ) -> Result<HeaderValue, UpstreamError> {
        match &presented {
            Presented::Token(key, token) => {
                self.tokens.evict(key, token);
                metrics().upstream_auth_retries.with_label_values(&[&self.upstream]).inc();
            }
            Presented::Basic(c) => {
                if let Some(store) = &self.credentials {
                    store.refused(c);
                }
                metrics().upstream_auth_retries.with_label_values(&[&self.upstream]).inc();
            }
            Presented::Lent(repo, c) => {
                if let Some(lent) = &self.lent {
                    lent.refused(repo, c);
                }
                metrics().upstream_auth_retries.with_label_values(&[&self.upstream]).inc();
            }
            Presented::Nothing | Presented::Fresh => {}
        }
        let source = self.source(hop);
        let (realm, service, scope) = match &challenge {
            Challenge::Basic => return self.answer_basic(hop, source).await,
            Challenge::Bearer { realm, service, scope } => (realm.clone(), service.clone(), scope.clone()),
        };
        let checked = if hop.own {
            realm::for_upstream(&realm, &self.upstream, hop.url, &self.trusted_realms)
        } else {
            realm::for_redirect_target(&realm, hop.url)
        };
        let realm_uri = checked.map_err(|refused| {
            self.failed("realm_refused");
            tracing::warn!(upstream = self.upstream, why = refused.0, "refused a token realm");
            UpstreamError::Auth(refused.0)
        })?;
        self.challenges.insert(hop.origin(), challenge);
        let key = self.key(hop, &source, realm, service, scope.as_deref());
        if let Source::Client(c) = &source {
            // A token of the client's own, for this request alone.
            return match tokens::fetch(http, &realm_uri, &key, Some(basic(c)?)).await {
                Ok(token) => bearer(&token.secret),
                Err(FetchError::Refused) => Err(UpstreamError::Denied),
                Err(FetchError::Other(e)) => Err(e),
            };
        }
        if let Some(token) = self.tokens.get(&key) {
            return bearer(&token);
        }
        if !hop.credentials {
            tracing::debug!(upstream = self.upstream, target = hop.origin(), "anonymous token for this host");
        }
        let lent = source.fixed().cloned();
        let fetch = {
            let (http, tokens, key) = (http.clone(), self.tokens.clone(), key.clone());
            let store = match &source {
                Source::Store(store) => Some(Arc::clone(store)),
                _ => None,
            };
            let upstream = self.upstream.clone();
            let lent = lent.clone();
            move || async move {
                let credentials = match (store, lent) {
                    (Some(store), _) => Credentialed::Store(store),
                    (None, Some(c)) => Credentialed::Fixed(c),
                    (None, None) => Credentialed::Anonymous,
                };
                fetch_and_keep(&upstream, &http, &realm_uri, key, &tokens, credentials).await
            }
        };
        let (result, _) = self.flights.run(key, fetch).await;
        metrics().upstream_tokens_cached.with_label_values(&[&self.upstream]).set(self.tokens.len() as i64);
        match result {
            Ok(token) => bearer(&token),
            Err(Error::Upstream(UpstreamError::Denied)) => {
                if let (Some(lent), Some(used)) = (&self.lent, &lent) {
                    lent.refused(hop.requested, used);
                }
                self.failed("denied");
                Err(UpstreamError::Denied)
            }
            Err(Error::Upstream(e)) => Err(e),
            Err(e) => Err(UpstreamError::Auth(e.to_string())),
        }
    }

    /// Basic credentials go only to the upstream's own origins that get them.
    async fn answer_basic(&self, hop: &Hop<'_>, source: Source) -> Result<HeaderValue, UpstreamError> {
        if !hop.credentials {
            tracing::info!(
                upstream = self.upstream,
                target = hop.origin(),
                "a host asks for Basic credentials that larder does not send there (only to the upstream's url, \
                 and to fallbacks of its urls on the same site or marked credentials = true)"
            );
            self.failed("denied");
            return Err(UpstreamError::Denied);
        }
        let credentials = match source {
            Source::Store(store) => store.current().await?,
            Source::Lent(c) | Source::Client(c) => c,
            Source::Anonymous { .. } => {
                self.failed("denied");
                return Err(UpstreamError::Denied);
            }
        };
        self.challenges.insert(hop.origin(), Challenge::Basic);
        basic(&credentials)
    }

    /// Counts a failure of this upstream's authentication.
    pub fn failed(&self, reason: &'static str) {
        metrics().upstream_auth_failures.with_label_values(&[&self.upstream, reason]).inc();
    }

    fn key(
        &self,
        hop: &Hop<'_>,
        source: &Source,
        realm: String,
        service: Option<String>,
        scope: Option<&str>,
    ) -> TokenKey {
        let scopes = Scopes::new(hop.repository().as_ref(), scope);
        TokenKey { realm, service, scopes, identity: source.identity() }
    }
}

/// The credentials a token request sends.
enum Credentialed {
    Anonymous,
    /// larder's, kept current by the store (read again once refused).
    Store(Arc<CredentialStore>),
    /// A verified client's, lent: refused means refused.
    Fixed(Credentials),
}

/// Fetches a token (with the upstream's credentials when `store` is given)
/// and caches it. Runs as the one flight for its key: it looks at the cache
/// first, since a flight that just ended may have filled it. Refused
/// credentials are read again (file, helper) and tried once more.
async fn fetch_and_keep(
    upstream: &str,
    http: &HttpClient,
    realm: &Uri,
    key: TokenKey,
    tokens: &TokenCache,
    sent: Credentialed,
) -> Result<Secret, Error> {
    if let Some(token) = tokens.get(&key) {
        return Ok(token);
    }
    let (store, mut credentials) = match sent {
        Credentialed::Store(s) => {
            let c = s.current().await?;
            (Some(s), Some(c))
        }
        Credentialed::Fixed(c) => (None, Some(c)),
        Credentialed::Anonymous => (None, None),
    };
    let store = store.as_deref();
    let mut refreshed = false;
    let token = loop {
        let authorization = credentials.as_ref().map(basic).transpose()?;
        match tokens::fetch(http, realm, &key, authorization).await {
            Ok(token) => break token,
            Err(FetchError::Other(e)) => {
                if matches!(e, UpstreamError::Auth(_)) {
                    metrics().upstream_auth_failures.with_label_values(&[upstream, "token_service"]).inc();
                }
                return Err(e.into());
            }
            Err(FetchError::Refused) => match (store, credentials, refreshed) {
                (Some(s), Some(used), false) => {
                    s.refused(&used);
                    let fresh = s.current().await?;
                    if fresh == used {
                        return Err(UpstreamError::Denied.into());
                    }
                    (credentials, refreshed) = (Some(fresh), true);
                }
                _ => return Err(UpstreamError::Denied.into()),
            },
        }
    };
    let secret = token.secret.clone();
    tokens.insert(key, token);
    Ok(secret)
}

fn bearer(token: &Secret) -> Result<HeaderValue, UpstreamError> {
    let mut v = HeaderValue::from_str(&format!("Bearer {}", token.expose()))
        .map_err(|_| UpstreamError::Auth("the token is not a valid header value".into()))?;
    v.set_sensitive(true);
    Ok(v)
}

fn basic(c: &Credentials) -> Result<HeaderValue, UpstreamError> {
    let raw = format!("{}:{}", c.username, c.password.expose());
    let mut v = HeaderValue::from_str(&format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(raw)))
        .map_err(|_| UpstreamError::Auth("the credentials are not a valid header value".into()))?;
    v.set_sensitive(true);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_headers_are_sensitive() {
        let c = Credentials { username: "u".into(), password: Secret::new("p") };
        let h = basic(&c).unwrap();
        assert!(h.is_sensitive());
        assert_eq!(h, "Basic dTpw");
        let t = bearer(&Secret::new("tok")).unwrap();
        assert!(t.is_sensitive());
        assert!(bearer(&Secret::new("bad\nvalue")).is_err());
    }

    #[test]
    fn the_scope_follows_the_path_of_each_hop() {
        let requested: RepoName = "pause".parse().unwrap();
        let own: Uri = "https://registry.k8s.io/v2/pause/manifests/3.9".parse().unwrap();
        let rewritten: Uri =
            "https://us-docker.pkg.dev/v2/k8s-artifacts-prod/images/pause/manifests/3.9".parse().unwrap();
        let cdn: Uri = "https://cdn.example/blob/abc".parse().unwrap();
        let hop = |url, own| Hop { url, own, credentials: own, requested: &requested, who: Who::Larder };
        assert_eq!(hop(&own, true).repository(), Some(requested.clone()));
        assert_eq!(hop(&rewritten, false).repository().unwrap().as_str(), "k8s-artifacts-prod/images/pause");
        assert_eq!(hop(&cdn, false).repository(), None, "a redirect target's path names no repository");
        assert_eq!(hop(&cdn, true).repository(), Some(requested.clone()), "the upstream's own origin");
        assert_eq!(Source::Anonymous { own: false }.identity(), Identity::Anonymous);
        assert!(!hop(&rewritten, false).for_requested(), "a redirect target is never lent credentials");
        assert!(hop(&own, true).for_requested());
        assert_eq!(hop(&own, true).origin(), "https://registry.k8s.io");
    }
}
