//! Private images, verified per client (`client_credentials = "verify"`):
//! every request for such an upstream must carry HTTP Basic credentials
//! that the upstream itself accepts for pulling the repository, whether
//! larder has the content cached or not. larder asks the upstream the way
//! a client would: its own auth flow with the client's credentials (a
//! token from a trusted realm for the repository's pull scope, or Basic
//! credentials), then a request that proves access (a `HEAD` of the
//! manifest or blob asked for, or `tags/list`): a token alone proves
//! nothing, since Docker Hub and others hand out tokens with an empty
//! access list.
//!
//! Verdicts are remembered per (credentials, repository), keyed by a
//! salted SHA-256 of both (never the password itself): a positive one for
//! the upstream's `client_credentials_ttl`, a negative one for
//! [`NEGATIVE_TTL`], at most [`MAX_VERDICTS`] of them. Concurrent first
//! requests with the same credentials share one check. A check that cannot
//! reach upstream leaves no verdict: a pair verified within the ttl is
//! still served, any other gets `503`.
//!
//! Checks are bounded: [`MAX_CONCURRENT_CHECKS`] at once per upstream, no
//! client address with more than [`MAX_CHECKS_PER_PEER`] waiting, none
//! waiting longer than [`CHECK_WAIT`]; past these a client gets `429`, so
//! a flood of made-up credentials neither reaches upstream unbounded nor
//! stalls clients already verified (they are answered from the verdicts).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use http::header::AUTHORIZATION;
use http::{HeaderMap, Method};
use sha2::{Digest as _, Sha256};

use super::Upstream;
use super::auth::Who;
use super::challenge::Challenge;
use crate::coalesce::SingleFlight;
use crate::config::{Credentials, Secret};
use crate::error::{Error, UpstreamError};
use crate::metrics::metrics;
use crate::oci::{Digest, MediaType, Reference, RepoName};
use crate::peer_slots::PeerSlots;

/// How long a refusal (wrong credentials, no access, no such repository)
/// is remembered: long enough that a client retrying in a loop costs one
/// check every few seconds, short enough that access granted upstream
/// works through larder moments later. At most the upstream's ttl.
pub const NEGATIVE_TTL: Duration = Duration::from_secs(10);
/// Verdicts remembered per upstream. Past that the least useful go
/// (moka's TinyLFU: verdicts in use stay, a flood of one-off credentials
/// does not push them out); a verdict that went is checked again.
pub const MAX_VERDICTS: u64 = 50_000;
/// Checks with upstream running at once per upstream; more wait their
/// turn (up to [`CHECK_WAIT`]).
pub const MAX_CONCURRENT_CHECKS: usize = 8;
/// Checks one client address may have waiting or running at once; a
/// further new pair of credentials from it is answered `429` at once.
/// Concurrent requests with credentials already being checked join that
/// check instead of taking a place (a node's hundred pods with one pull
/// secret take one). A node's containerd is one address for all its pods:
/// sixteen covers a node starting pods of many tenants at once, and keeps
/// one address from holding more than two rounds of [`MAX_CONCURRENT_CHECKS`].
pub const MAX_CHECKS_PER_PEER: usize = 16;
/// Longest a check waits for its turn; then the client gets `429` with
/// `Retry-After: `[`RETRY_AFTER`].
pub const CHECK_WAIT: Duration = Duration::from_secs(5);
/// What a client refused by these bounds is told to wait.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);
/// Longest `Authorization` header read, in bytes (base64 of `user:password`).
/// Registry passwords are long tokens (an ECR password is about 2–3 KiB
/// encoded, a GCP access token a few hundred bytes); more is refused
/// without a check.
pub const MAX_AUTHORIZATION_LEN: usize = 8192;

/// What a client asked for: what the check asks upstream about.
#[derive(Clone, Debug)]
pub enum Probe {
    Manifest(Reference),
    Blob(Digest),
    Tags,
    /// Referrers of a manifest: the manifest is asked for.
    Referrers(Digest),
}

/// What upstream said about a pair of credentials and a repository.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// It let them pull the repository.
    Granted,
    /// It did not accept the credentials (its token realm refused them,
    /// or a Basic registry answered 401).
    Rejected,
    /// It accepted them, but not for pulling this repository.
    Denied,
    /// It has no such repository (for these credentials).
    NotFound,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Verdict::Granted => "granted",
            Verdict::Rejected => "rejected",
            Verdict::Denied => "denied",
            Verdict::NotFound => "not_found",
        }
    }
}

/// The metric labels of `client_verifications_total{result}`.
const RESULTS: [&str; 5] = ["granted", "rejected", "denied", "not_found", "unavailable"];

/// Keeps a granted verdict for the ttl, any other for [`NEGATIVE_TTL`].
struct VerdictExpiry {
    ttl: Duration,
}

impl moka::Expiry<[u8; 32], Verdict> for VerdictExpiry {
    fn expire_after_create(&self, _: &[u8; 32], verdict: &Verdict, _: Instant) -> Option<Duration> {
        Some(match verdict {
            Verdict::Granted => self.ttl,
            _ => NEGATIVE_TTL.min(self.ttl),
        })
    }
}

/// The verdicts of one upstream, and the bounds on its checks.
pub struct Verifier {
    upstream: String,
    /// Mixed into every key, so that a key (were it ever seen) cannot be
    /// checked against guessed passwords without this process's memory.
    salt: [u8; 32],
    verdicts: moka::sync::Cache<[u8; 32], Verdict>,
    flights: SingleFlight<[u8; 32], Verdict>,
    checks: tokio::sync::Semaphore,
    peers: PeerSlots,
}

impl Verifier {
    pub fn new(upstream: &str, ttl: Duration) -> Verifier {
        let m = metrics();
        for result in RESULTS {
            m.client_verifications.with_label_values(&[upstream, result]);
        }
        m.client_verdicts_cached.with_label_values(&[upstream]).set(0);
        Verifier {
            upstream: upstream.to_owned(),
            salt: rand::random(),
            verdicts: moka::sync::Cache::builder()
                .max_capacity(MAX_VERDICTS)
                .expire_after(VerdictExpiry { ttl })
                .build(),
            flights: SingleFlight::default(),
            checks: tokio::sync::Semaphore::new(MAX_CONCURRENT_CHECKS),
            peers: PeerSlots::new(MAX_CHECKS_PER_PEER),
        }
    }

    /// The key of (`credentials`, `repo`): every field length-prefixed, so
    /// that no two pairs share one.
    fn key(&self, credentials: &Credentials, repo: &RepoName) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(self.salt);
        for field in [self.upstream.as_str(), repo.as_str(), &credentials.username, credentials.password.expose()] {
            h.update((field.len() as u64).to_be_bytes());
            h.update(field.as_bytes());
        }
        h.finalize().into()
    }

    /// Verdicts held (after pending evictions ran).
    fn held(&self) -> u64 {
        self.verdicts.run_pending_tasks();
        self.verdicts.entry_count()
    }
}

/// The Basic credentials a request carries.
#[derive(Debug)]
enum Presented {
    None,
    Malformed(&'static str),
    Basic(Credentials),
}

/// Reads `Authorization: Basic …`. No header, another scheme, or an empty
/// user and password (what containers/image sends when it has none) are
/// no credentials; anything else that is not `base64(user:password)` in
/// UTF-8 is malformed. The password may hold colons (the user may not).
fn presented(headers: &HeaderMap) -> Presented {
    let Some(value) = headers.get(AUTHORIZATION) else { return Presented::None };
    if value.len() > MAX_AUTHORIZATION_LEN {
        return Presented::Malformed("the Authorization header is too long");
    }
    let Ok(value) = value.to_str() else { return Presented::Malformed("the Authorization header is not ASCII") };
    let Some((scheme, encoded)) = value.trim().split_once(' ') else { return Presented::None };
    if !scheme.eq_ignore_ascii_case("basic") {
        return Presented::None;
    }
    let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(encoded.trim()) else {
        return Presented::Malformed("the Basic credentials are not base64");
    };
    let Ok(decoded) = String::from_utf8(decoded) else {
        return Presented::Malformed("the Basic credentials are not UTF-8");
    };
    let Some((user, password)) = decoded.split_once(':') else {
        return Presented::Malformed("the Basic credentials have no ':' between user and password");
    };
    if user.is_empty() && password.is_empty() {
        return Presented::None;
    }
    if user.chars().chain(password.chars()).any(char::is_control) {
        return Presented::Malformed("the Basic credentials hold control characters");
    }
    Presented::Basic(Credentials { username: user.to_owned(), password: Secret::new(password) })
}

/// What one request to upstream with the client's credentials showed.
enum Answer {
    Verdict(Verdict),
    /// 404: nothing proven either way yet.
    Missing,
    /// No answer that says anything about the credentials (unreachable,
    /// 5xx, 429, a realm larder does not trust): the text is for the log.
    Unavailable(String),
}

impl Upstream {
    /// Whether this upstream verifies clients' credentials.
    pub fn verifies_clients(&self) -> bool {
        self.verifier.is_some()
    }

    /// Whether this upstream's fills use verified clients' credentials
    /// (it verifies clients and has no credentials of its own). Only the
    /// replica a client reached holds them: such fills are never left to
    /// a peer, which is asked only for what it already holds.
    pub fn fills_with_client_credentials(&self) -> bool {
        self.verifier.is_some() && self.config.credentials.is_none()
    }

    /// With `client_credentials = "verify"`: `Ok` when the request's Basic
    /// credentials are ones this upstream lets pull `repo` (remembered, or
    /// checked now), else the error to answer. Checked before any cache
    /// read, membership check or fill, after policy and grants. `peer` is
    /// the client's address. Without `verify`: `Ok` at once.
    pub async fn verify_client(
        self: &Arc<Self>,
        headers: &HeaderMap,
        repo: &RepoName,
        probe: Probe,
        peer: IpAddr,
    ) -> Result<(), Error> {
        let Some(verifier) = &self.verifier else { return Ok(()) };
        let credentials = match presented(headers) {
            Presented::Basic(c) => c,
            Presented::None => {
                return Err(self.challenge(format!(
                    "upstream {:?} serves only clients it accepts itself: send the credentials you pull from it with \
                     (HTTP Basic)",
                    self.name()
                )));
            }
            Presented::Malformed(why) => return Err(self.challenge(why.to_owned())),
        };
        let key = verifier.key(&credentials, repo);
        let verdict = match verifier.verdicts.get(&key) {
            Some(verdict) => verdict,
            None => {
                let work = {
                    let (me, credentials, repo) = (Arc::clone(self), credentials.clone(), repo.clone());
                    move || async move { me.check(key, &credentials, &repo, &probe, peer).await }
                };
                verifier.flights.run(key, work).await.0?
            }
        };
        match verdict {
            Verdict::Granted => {
                self.auth.lend(repo, &credentials);
                Ok(())
            }
            Verdict::Rejected => {
                Err(self.challenge(format!("upstream {:?} does not accept these credentials", self.name())))
            }
            Verdict::Denied => Err(Error::Denied(format!(
                "upstream {:?} does not let these credentials pull repository {:?}",
                self.name(),
                repo.as_str()
            ))),
            Verdict::NotFound => Err(Error::NameUnknown),
        }
    }

    fn challenge(&self, message: String) -> Error {
        Error::CredentialsRequired { realm: self.name().to_owned(), message }
    }

    /// One check (the one flight for its key): within the bounds, asks
    /// upstream, remembers the verdict and counts it.
    async fn check(
        &self,
        key: [u8; 32],
        credentials: &Credentials,
        repo: &RepoName,
        probe: &Probe,
        peer: IpAddr,
    ) -> Result<Verdict, Error> {
        let Some(verifier) = &self.verifier else { return Ok(Verdict::Granted) };
        // A flight that ended just before this one started left its verdict.
        if let Some(verdict) = verifier.verdicts.get(&key) {
            return Ok(verdict);
        }
        let throttled = |reason: &str| {
            tracing::debug!(upstream = self.name(), %peer, reason, "credentials check refused: too many waiting");
            Error::TooManyRequests { retry_after: RETRY_AFTER.as_secs() }
        };
        let _slot = verifier.peers.enter(peer).ok_or_else(|| throttled("peer_limit"))?;
        let _permit = match tokio::time::timeout(CHECK_WAIT, verifier.checks.acquire()).await {
            Ok(Ok(permit)) => permit,
            Ok(Err(_)) | Err(_) => return Err(throttled("queue_wait")),
        };
        let answer = match self.ask(credentials, repo, probe).await {
            Answer::Missing if !matches!(probe, Probe::Tags) => self.ask(credentials, repo, &Probe::Tags).await,
            answer => answer,
        };
        let counter = |result: &str| metrics().client_verifications.with_label_values(&[self.name(), result]).inc();
        let verdict = match answer {
            Answer::Verdict(verdict) => verdict,
            Answer::Missing => Verdict::NotFound,
            Answer::Unavailable(why) => {
                counter("unavailable");
                tracing::warn!(upstream = self.name(), %repo, user = credentials.username, why, "cannot check a client's credentials");
                return Err(Error::CredentialsUnverified { upstream: self.name().to_owned() });
            }
        };
        verifier.verdicts.insert(key, verdict);
        counter(verdict.label());
        metrics().client_verdicts_cached.with_label_values(&[self.name()]).set(verifier.held() as i64);
        match verdict {
            Verdict::Granted => {
                tracing::debug!(upstream = self.name(), %repo, user = credentials.username, "client credentials verified")
            }
            refused => {
                tracing::info!(upstream = self.name(), %repo, user = credentials.username, verdict = refused.label(), "client credentials refused upstream")
            }
        }
        Ok(verdict)
    }

    /// One request for `probe` with the client's credentials, the way a
    /// client would make it: `HEAD` of the manifest or blob, or the first
    /// page of `tags/list`.
    async fn ask(&self, credentials: &Credentials, repo: &RepoName, probe: &Probe) -> Answer {
        let manifest = |r: &dyn std::fmt::Display| format!("/v2/{repo}/manifests/{r}");
        let (method, path, accept) = match probe {
            Probe::Manifest(r) => (Method::HEAD, manifest(r), Some(MediaType::upstream_accept())),
            Probe::Referrers(d) => (Method::HEAD, manifest(d), Some(MediaType::upstream_accept())),
            Probe::Blob(d) => (Method::HEAD, format!("/v2/{repo}/blobs/{d}"), None),
            Probe::Tags => (Method::GET, format!("/v2/{repo}/tags/list?n=1"), None),
        };
        let opened = self.open_as(Who::Client(credentials), method, &path, repo, accept, (None, None)).await;
        let response = match opened {
            Ok(opened) => opened.response,
            // The realm refused the credentials.
            Err(UpstreamError::Denied) => return Answer::Verdict(Verdict::Rejected),
            Err(e) => return Answer::Unavailable(e.to_string()),
        };
        let status = response.status();
        match status.as_u16() {
            200..=399 => Answer::Verdict(Verdict::Granted),
            // A Basic registry refuses wrong credentials with 401; a token
            // one answers 401 to a token without the repository's access.
            401 => match Challenge::from_headers(response.headers()) {
                Some(Challenge::Basic) => Answer::Verdict(Verdict::Rejected),
                _ => Answer::Verdict(Verdict::Denied),
            },
            403 => Answer::Verdict(Verdict::Denied),
            404 => Answer::Missing,
            _ => Answer::Unavailable(format!("upstream answered {status}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with(value: &[u8]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, HeaderValue::from_bytes(value).unwrap());
        h
    }

    fn basic(raw: &[u8]) -> HeaderMap {
        with(format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(raw)).as_bytes())
    }

    #[test]
    fn basic_credentials_are_read_at_the_edge() {
        let Presented::Basic(c) = presented(&basic(b"alice:pa:ss:word")) else { panic!("valid") };
        assert_eq!((c.username.as_str(), c.password.expose()), ("alice", "pa:ss:word"), "colons stay in the password");
        assert!(matches!(presented(&HeaderMap::new()), Presented::None));
        assert!(matches!(presented(&basic(b":")), Presented::None), "containers/image's empty credentials");
        assert!(matches!(presented(&with(b"Bearer abc")), Presented::None));
        assert!(matches!(presented(&basic(b"no-colon")), Presented::Malformed(_)));
        assert!(matches!(presented(&basic(b"bad\xff:utf8")), Presented::Malformed(_)));
        assert!(matches!(presented(&basic(b"a:line\nbreak")), Presented::Malformed(_)));
        assert!(matches!(presented(&with(b"Basic !!!notbase64")), Presented::Malformed(_)));
        assert!(matches!(presented(&with(b"Basic \xe9t\xe9")), Presented::Malformed(_)), "not ASCII");
        let huge = format!("alice:{}", "x".repeat(MAX_AUTHORIZATION_LEN));
        assert!(matches!(presented(&basic(huge.as_bytes())), Presented::Malformed(_)));
        let Presented::Basic(c) = presented(&basic(b"AWS:")) else { panic!("an empty password is upstream's call") };
        assert_eq!(c.username, "AWS");
    }

    #[test]
    fn keys_are_salted_and_tell_every_field_apart() {
        let v = Verifier::new("verify-keys.test", Duration::from_secs(60));
        let c = |u: &str, p: &str| Credentials { username: u.into(), password: Secret::new(p) };
        let repo: RepoName = "team-a/app".parse().unwrap();
        let other: RepoName = "team-b/app".parse().unwrap();
        let k = v.key(&c("alice", "pw"), &repo);
        assert_eq!(k, v.key(&c("alice", "pw"), &repo));
        assert_ne!(k, v.key(&c("alice", "pw2"), &repo));
        assert_ne!(k, v.key(&c("alice", "pw"), &other));
        assert_ne!(v.key(&c("ab", "c"), &repo), v.key(&c("a", "bc"), &repo), "length-prefixed fields");
        let again = Verifier::new("verify-keys.test", Duration::from_secs(60));
        assert_ne!(k, again.key(&c("alice", "pw"), &repo), "another process, another salt");
    }

    #[test]
    fn refusals_are_remembered_briefly_and_the_number_of_verdicts_is_bounded() {
        let v = Verifier::new("verify-bound.test", Duration::from_secs(300));
        let expiry = VerdictExpiry { ttl: Duration::from_secs(300) };
        use moka::Expiry;
        let now = Instant::now();
        assert_eq!(expiry.expire_after_create(&[0; 32], &Verdict::Granted, now), Some(Duration::from_secs(300)));
        assert_eq!(expiry.expire_after_create(&[0; 32], &Verdict::Denied, now), Some(NEGATIVE_TTL));
        let short = VerdictExpiry { ttl: Duration::from_secs(2) };
        assert_eq!(short.expire_after_create(&[0; 32], &Verdict::Rejected, now), Some(Duration::from_secs(2)));
        for i in 0..(MAX_VERDICTS + 20_000) {
            let mut key = [0u8; 32];
            key[..8].copy_from_slice(&i.to_be_bytes());
            v.verdicts.insert(key, Verdict::Rejected);
        }
        assert!(v.held() <= MAX_VERDICTS, "{} verdicts held", v.held());
    }
}
