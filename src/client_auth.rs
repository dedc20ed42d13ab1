//! Optional client authentication: HTTP Basic credentials checked against
//! an htpasswd file of bcrypt hashes (`htpasswd -B`). bcrypt is slow by
//! design (milliseconds to seconds, by its cost), so:
//! - a verified (user, password) pair is remembered while it is in use
//!   (forgotten after [`VERIFIED_IDLE`] without a request, and at the
//!   latest [`VERIFIED_MAX_AGE`] after bcrypt accepted it), instead of
//!   hashed on every blob request;
//! - an unknown user is checked against a dummy hash of the same cost as
//!   the file's hashes, so the time taken does not tell which users exist;
//! - bcrypt runs on the blocking pool, at most [`MAX_CONCURRENT_BCRYPT`] at
//!   once, so a flood of made-up credentials cannot take every core from
//!   clients whose credentials are already verified;
//! - the queue for bcrypt is bounded twice, so that a flood cannot stall
//!   the first login of a valid user either: one client address may have at
//!   most [`MAX_BCRYPT_PER_PEER`] checks waiting or running, and no check
//!   waits longer than [`BCRYPT_WAIT`] for its turn. Past either bound the
//!   client gets `429 TOOMANYREQUESTS` with `Retry-After` at once, and
//!   nothing was hashed. A valid user on another address therefore waits
//!   behind at most [`MAX_BCRYPT_PER_PEER`] checks per flooding address.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use base64::Engine;
use http::HeaderMap;
use http::header::AUTHORIZATION;
use sha2::{Digest as _, Sha256};

use crate::config::ClientAuthConfig;
use crate::error::Error;

/// A verified (user, password) pair not used for this long is forgotten:
/// its next request pays bcrypt again. Every accepted request restarts
/// the clock, so a client pulling all day pays bcrypt once per
/// [`VERIFIED_MAX_AGE`], not every few minutes mid-pull.
pub const VERIFIED_IDLE: Duration = Duration::from_secs(300);
/// However busy, a verified pair is checked with bcrypt again this long
/// after it was verified. (A changed htpasswd file forgets every pair at
/// once, whatever their age.)
pub const VERIFIED_MAX_AGE: Duration = Duration::from_secs(3600);
/// Verified pairs remembered at most.
const VERIFIED_CAPACITY: u64 = 10_000;

/// bcrypt checks running at once; more wait their turn. One core's worth:
/// on a small node the other cores keep serving verified clients.
pub const MAX_CONCURRENT_BCRYPT: usize = 1;
/// bcrypt checks one client address (IPv4, or IPv6 address; IPv4-mapped
/// IPv6 counts as IPv4) may have waiting or running at once. A further
/// request from that address is answered `429 TOOMANYREQUESTS` at once,
/// without waiting or hashing. Four covers a client that opens a few
/// connections with the same not-yet-verified credentials; a flood from
/// one address can put no more than this in front of anyone else.
pub const MAX_BCRYPT_PER_PEER: usize = 4;
/// Longest a check waits for its turn at bcrypt; then the client gets
/// `429 TOOMANYREQUESTS` with `Retry-After: `[`RETRY_AFTER`] (the bound
/// when a flood comes from many addresses). At the file's usual cost
/// (`htpasswd -B`: 5, a few ms a check) it takes hundreds of checks
/// queued to reach it.
pub const BCRYPT_WAIT: Duration = Duration::from_secs(2);
/// What a client refused for [`MAX_BCRYPT_PER_PEER`] or [`BCRYPT_WAIT`] is
/// told to wait before trying again.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// How long verified pairs are remembered (see [`VERIFIED_IDLE`] and
/// [`VERIFIED_MAX_AGE`]); tests shorten them.
#[derive(Clone, Copy, Debug)]
pub struct Lifetimes {
    pub idle: Duration,
    pub max_age: Duration,
}

impl Default for Lifetimes {
    fn default() -> Lifetimes {
        Lifetimes { idle: VERIFIED_IDLE, max_age: VERIFIED_MAX_AGE }
    }
}

/// Why a check was refused without running bcrypt: the label of
/// `larder_client_auth_throttled_total{reason}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Throttled {
    /// The client's address already had [`MAX_BCRYPT_PER_PEER`] checks in the queue.
    PeerLimit,
    /// No turn at bcrypt came within [`BCRYPT_WAIT`].
    QueueWait,
}

impl Throttled {
    pub fn as_str(self) -> &'static str {
        match self {
            Throttled::PeerLimit => "peer_limit",
            Throttled::QueueWait => "queue_wait",
        }
    }
}

/// The users of an htpasswd file, and a hash to check unknown users
/// against, made with the cost the file's hashes use.
struct Users {
    hashes: HashMap<String, String>,
    dummy: String,
}

pub struct ClientAuth {
    realm: String,
    path: PathBuf,
    users: RwLock<Arc<Users>>,
    /// sha256(user, password, hash) of pairs bcrypt accepted, while in use.
    verified: moka::sync::Cache<[u8; 32], ()>,
    bcrypt_permits: tokio::sync::Semaphore,
    /// Checks waiting for or running bcrypt, per client address.
    queued: crate::peer_slots::PeerSlots,
    /// How many bcrypt checks ran at once, for the tests.
    #[cfg(test)]
    probe: Arc<tests::Probe>,
}

impl std::fmt::Debug for ClientAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientAuth").field("realm", &self.realm).field("path", &self.path).finish_non_exhaustive()
    }
}

impl ClientAuth {
    /// Reads the htpasswd file (blocking: call it on the blocking pool).
    pub fn load(config: &ClientAuthConfig) -> Result<Arc<ClientAuth>, String> {
        ClientAuth::load_with(config, Lifetimes::default())
    }

    /// [`ClientAuth::load`] with other lifetimes for verified pairs.
    pub fn load_with(config: &ClientAuthConfig, lifetimes: Lifetimes) -> Result<Arc<ClientAuth>, String> {
        let users = load_users(&config.htpasswd)?;
        // Idle expiry keeps a pair in use verified; the age cap still
        // sends it through bcrypt now and then. moka expires an entry at
        // whichever comes first.
        let verified = moka::sync::Cache::builder()
            .max_capacity(VERIFIED_CAPACITY)
            .time_to_idle(lifetimes.idle)
            .time_to_live(lifetimes.max_age)
            .build();
        Ok(Arc::new(ClientAuth {
            realm: config.realm.clone(),
            path: config.htpasswd.clone(),
            users: RwLock::new(Arc::new(users)),
            verified,
            bcrypt_permits: tokio::sync::Semaphore::new(MAX_CONCURRENT_BCRYPT),
            queued: crate::peer_slots::PeerSlots::new(MAX_BCRYPT_PER_PEER),
            #[cfg(test)]
            probe: Arc::default(),
        }))
    }

    pub fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// Re-reads the htpasswd file; on error the current users stay.
    pub fn reload(&self) -> Result<(), String> {
        let users = load_users(&self.path)?;
        *self.users.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(users);
        self.verified.invalidate_all();
        Ok(())
    }

    /// Accepts the request's Basic credentials, or answers with a
    /// challenge, or (when bcrypt's queue is full for `peer`, the client's
    /// address, or overall) with `429` and `Retry-After`.
    /// The user the request's Basic credentials prove, or the error to answer.
    pub async fn check(&self, headers: &HeaderMap, peer: IpAddr) -> Result<String, Error> {
        let challenge = || Error::Unauthorized { realm: self.realm.clone() };
        let (user, password) = basic_credentials(headers).ok_or_else(challenge)?;
        let users = Arc::clone(&self.users.read().unwrap_or_else(|p| p.into_inner()));
        let hash = users.hashes.get(&user).cloned();
        let known = hash.is_some();
        let hash = hash.unwrap_or_else(|| users.dummy.clone());
        let key: [u8; 32] = Sha256::new()
            .chain_update(user.as_bytes())
            .chain_update([0])
            .chain_update(password.as_bytes())
            .chain_update([0])
            .chain_update(hash.as_bytes())
            .finalize()
            .into();
        // `get`, not `contains_key`: a lookup is what restarts the idle clock.
        if known && self.verified.get(&key).is_some() {
            return Ok(user);
        }
        let _slot = self.queued.enter(peer).ok_or_else(|| throttled(Throttled::PeerLimit, peer))?;
        let permit = match tokio::time::timeout(BCRYPT_WAIT, self.bcrypt_permits.acquire()).await {
            Ok(permit) => permit.map_err(|_| challenge())?,
            Err(_) => return Err(throttled(Throttled::QueueWait, peer)),
        };
        #[cfg(test)]
        let probe = Arc::clone(&self.probe);
        let ok = crate::blocking::blocking(move || {
            #[cfg(test)]
            let _running = probe.enter();
            Ok(bcrypt::verify(password, &hash).unwrap_or(false))
        })
        .await?;
        drop(permit);
        if ok && known {
            self.verified.insert(key, ());
            Ok(user)
        } else {
            tracing::info!(user, "client authentication failed");
            Err(challenge())
        }
    }
}

/// Counts a check refused before bcrypt, and its 429.
fn throttled(why: Throttled, peer: IpAddr) -> Error {
    crate::metrics::metrics().client_auth_throttled.with_label_values(&[why.as_str()]).inc();
    // Debug only: a flood would otherwise be a flood of log lines too (the
    // access log has each 429, the metric their count).
    tracing::debug!(%peer, reason = why.as_str(), "password check refused: bcrypt queue full");
    Error::TooManyRequests { retry_after: RETRY_AFTER.as_secs() }
}

/// `user:password` from `Authorization: Basic …`.
fn basic_credentials(headers: &HeaderMap) -> Option<(String, String)> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, encoded) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let (user, password) = std::str::from_utf8(&decoded).ok()?.split_once(':')?;
    Some((user.to_owned(), password.to_owned()))
}

/// The users of `path`, and a dummy hash of the highest cost among theirs
/// (the default cost if there are none).
fn load_users(path: &std::path::Path) -> Result<Users, String> {
    let hashes = read_htpasswd(path)?;
    let cost = hashes.values().filter_map(|h| bcrypt_cost(h)).max().unwrap_or(bcrypt::DEFAULT_COST);
    let dummy = bcrypt::hash("larder unknown user", cost).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Users { hashes, dummy })
}

/// The cost of a `$2b$NN$…` hash.
fn bcrypt_cost(hash: &str) -> Option<u32> {
    hash.split('$').nth(2)?.parse().ok()
}

/// `user:hash` lines; blank lines and `#` comments are skipped. Only bcrypt
/// hashes (`$2a$`, `$2b$`, `$2y$`) are accepted: the others htpasswd can
/// write (MD5, SHA-1, crypt) are too weak to keep.
fn read_htpasswd(path: &std::path::Path) -> Result<HashMap<String, String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut users = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (user, hash) =
            line.split_once(':').ok_or_else(|| format!("{}:{}: expected user:hash", path.display(), n + 1))?;
        if !["$2a$", "$2b$", "$2y$"].iter().any(|p| hash.starts_with(p)) {
            return Err(format!("{}:{}: user {user:?} has no bcrypt hash (use htpasswd -B)", path.display(), n + 1));
        }
        users.insert(user.to_owned(), hash.to_owned());
    }
    Ok(users)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// bcrypt checks running now, the most ever seen at once, and how many ran.
    #[derive(Default)]
    pub(super) struct Probe {
        running: AtomicUsize,
        peak: AtomicUsize,
        runs: AtomicUsize,
    }

    pub(super) struct Running<'a>(&'a Probe);

    impl Probe {
        pub(super) fn enter(&self) -> Running<'_> {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak.fetch_max(now, Ordering::SeqCst);
            self.runs.fetch_add(1, Ordering::SeqCst);
            Running(self)
        }
    }

    impl Drop for Running<'_> {
        fn drop(&mut self) {
            self.0.running.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn auth_with(lines: &str) -> (tempfile::TempDir, Arc<ClientAuth>) {
        auth_living(lines, Lifetimes::default())
    }

    fn auth_living(lines: &str, lifetimes: Lifetimes) -> (tempfile::TempDir, Arc<ClientAuth>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("htpasswd");
        std::fs::write(&path, lines).unwrap();
        let config = ClientAuthConfig { htpasswd: path, realm: "larder".into() };
        (dir, ClientAuth::load_with(&config, lifetimes).unwrap())
    }

    /// A client address: 127.0.0.`n`.
    fn peer(n: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, n])
    }

    /// Checks from `peer` waiting for or running bcrypt now.
    fn queued(auth: &ClientAuth, peer: IpAddr) -> usize {
        auth.queued.held(peer)
    }

    fn runs(auth: &ClientAuth) -> usize {
        auth.probe.runs.load(Ordering::SeqCst)
    }

    fn basic(user: &str, password: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        h.insert(AUTHORIZATION, HeaderValue::from_str(&format!("Basic {token}")).unwrap());
        h
    }

    #[tokio::test]
    async fn bcrypt_users_are_checked() {
        let hash = bcrypt::hash("s3cret", 4).unwrap();
        let (_dir, auth) = auth_with(&format!("# users\nalice:{hash}\n"));
        assert!(auth.check(&basic("alice", "s3cret"), peer(1)).await.is_ok());
        assert!(auth.check(&basic("alice", "s3cret"), peer(1)).await.is_ok(), "again, from the verified cache");
        assert_eq!(runs(&auth), 1);
        for bad in [basic("alice", "wrong"), basic("bob", "s3cret"), HeaderMap::new()] {
            let e = auth.check(&bad, peer(1)).await.unwrap_err();
            assert_eq!(e.status(), 401);
        }
    }

    #[tokio::test]
    async fn unknown_users_cost_what_known_users_cost() {
        let hash = bcrypt::hash("s3cret", 5).unwrap();
        let (_dir, auth) = auth_with(&format!("alice:{hash}\n"));
        let users = Arc::clone(&auth.users.read().unwrap());
        assert_eq!(bcrypt_cost(&users.dummy), Some(5), "the dummy hash has the file's cost, not the default 12");
        let (_dir, empty) = auth_with("# nobody\n");
        assert_eq!(bcrypt_cost(&empty.users.read().unwrap().dummy), Some(bcrypt::DEFAULT_COST));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_flood_of_made_up_users_runs_one_bcrypt_at_a_time_and_spares_verified_clients() {
        let hash = bcrypt::hash("s3cret", 6).unwrap();
        let (_dir, auth) = auth_with(&format!("alice:{hash}\n"));
        assert!(auth.check(&basic("alice", "s3cret"), peer(1)).await.is_ok(), "verified once");
        // From 8 addresses, so that no per-address bound refuses any.
        let flood: Vec<_> = (0..8u8)
            .map(|i| {
                let auth = Arc::clone(&auth);
                tokio::spawn(async move { auth.check(&basic(&format!("mallory{i}"), "x"), peer(10 + i)).await })
            })
            .collect();
        // A verified client is answered from the cache, not queued behind the flood.
        assert!(auth.check(&basic("alice", "s3cret"), peer(1)).await.is_ok());
        assert!(flood.iter().any(|f| !f.is_finished()), "the flood is still being checked");
        for f in flood {
            assert_eq!(f.await.unwrap().unwrap_err().status(), 401);
        }
        assert_eq!(auth.probe.peak.load(Ordering::SeqCst), MAX_CONCURRENT_BCRYPT, "bcrypt checks ran one at a time");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_address_gets_a_bounded_share_of_the_queue_and_another_address_still_gets_its_turn() {
        let hash = bcrypt::hash("s3cret", 4).unwrap();
        let (_dir, auth) = auth_with(&format!("alice:{hash}\n"));
        // bcrypt is busy (the test holds its one permit): checks queue up.
        let busy = auth.bcrypt_permits.acquire().await.unwrap();
        let flood: Vec<_> = (0..MAX_BCRYPT_PER_PEER)
            .map(|i| {
                let auth = Arc::clone(&auth);
                tokio::spawn(async move { auth.check(&basic(&format!("mallory{i}"), "x"), peer(3)).await })
            })
            .collect();
        while queued(&auth, peer(3)) < MAX_BCRYPT_PER_PEER {
            tokio::task::yield_now().await;
        }
        // The address's share is taken: its next check is refused at once, with Retry-After.
        let refused = auth.check(&basic("mallory", "x"), peer(3)).await.unwrap_err();
        assert!(matches!(refused, Error::TooManyRequests { retry_after: 1 }), "{refused:?}");
        let resp = refused.into_response(false);
        assert_eq!(resp.status(), 429);
        assert_eq!(resp.headers()["retry-after"], "1");
        // The same address in its IPv4-mapped IPv6 form is the same address.
        let mapped = IpAddr::from(std::net::Ipv4Addr::new(127, 0, 0, 3).to_ipv6_mapped());
        assert_eq!(auth.check(&basic("mallory", "x"), mapped).await.unwrap_err().status(), 429);
        // Another address is queued, not refused, and gets its turn.
        let alice = {
            let auth = Arc::clone(&auth);
            tokio::spawn(async move { auth.check(&basic("alice", "s3cret"), peer(2)).await })
        };
        while queued(&auth, peer(2)) < 1 {
            tokio::task::yield_now().await;
        }
        drop(busy);
        assert!(alice.await.unwrap().is_ok(), "the valid user on another address is let in");
        for f in flood {
            assert_eq!(f.await.unwrap().unwrap_err().status(), 401);
        }
        assert_eq!((queued(&auth, peer(3)), queued(&auth, peer(2))), (0, 0), "every place given back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_waits_for_its_turn_at_most_bcrypt_wait() {
        let hash = bcrypt::hash("s3cret", 4).unwrap();
        let (_dir, auth) = auth_with(&format!("alice:{hash}\n"));
        let _busy = auth.bcrypt_permits.acquire().await.unwrap();
        let started = tokio::time::Instant::now();
        let e = auth.check(&basic("alice", "s3cret"), peer(2)).await.unwrap_err();
        assert_eq!(e.status(), 429);
        let waited = started.elapsed();
        assert!(BCRYPT_WAIT <= waited && waited < BCRYPT_WAIT + std::time::Duration::from_millis(10), "{waited:?}");
        assert_eq!((runs(&auth), queued(&auth, peer(2))), (0, 0), "nothing hashed, the place given back");
    }

    /// The old rule forgot a verified pair a fixed time after its
    /// verification, however busy it was: a long pull paid bcrypt again
    /// mid-way (and queued behind any flood). A pair in use stays
    /// verified; an unused one is forgotten; none outlives the age cap.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_verified_pair_in_use_stays_verified_past_its_idle_time() {
        use std::time::{Duration, Instant};
        let hash = bcrypt::hash("s3cret", 4).unwrap();
        let lines = format!("alice:{hash}\n");
        let idle = Duration::from_millis(1500);
        let (_dir, auth) = auth_living(&lines, Lifetimes { idle, max_age: Duration::from_secs(60) });
        assert!(auth.check(&basic("alice", "s3cret"), peer(2)).await.is_ok());
        let verified = Instant::now();
        while verified.elapsed() < 3 * idle {
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(auth.check(&basic("alice", "s3cret"), peer(2)).await.is_ok());
        }
        assert_eq!(runs(&auth), 1, "used every 100 ms for 3× the idle time: verified once");
        tokio::time::sleep(idle + Duration::from_millis(500)).await;
        assert!(auth.check(&basic("alice", "s3cret"), peer(2)).await.is_ok());
        assert_eq!(runs(&auth), 2, "left idle: checked with bcrypt again");

        let (_dir, capped) = auth_living(&lines, Lifetimes { idle: Duration::from_secs(60), max_age: idle });
        assert!(capped.check(&basic("alice", "s3cret"), peer(2)).await.is_ok());
        let verified = Instant::now();
        while verified.elapsed() < idle + Duration::from_millis(500) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(capped.check(&basic("alice", "s3cret"), peer(2)).await.is_ok());
        }
        assert_eq!(runs(&capped), 2, "in use, but past the age cap: checked with bcrypt again");
    }

    #[tokio::test]
    async fn weak_hashes_and_malformed_lines_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("htpasswd");
        std::fs::write(&path, "bob:$apr1$abc$def\n").unwrap();
        let e = ClientAuth::load(&ClientAuthConfig { htpasswd: path.clone(), realm: "r".into() }).unwrap_err();
        assert!(e.contains(":1: user \"bob\" has no bcrypt hash"), "{e}");
        std::fs::write(&path, "nocolon\n").unwrap();
        assert!(ClientAuth::load(&ClientAuthConfig { htpasswd: path, realm: "r".into() }).is_err());
    }
}
