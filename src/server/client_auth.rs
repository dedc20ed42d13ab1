//! Optional client authentication: HTTP Basic credentials checked against
//! an htpasswd file of bcrypt hashes (`htpasswd -B`). bcrypt is slow by
//! design (milliseconds to seconds, by its cost), so:
//! - a verified (user, password) pair is remembered for a while instead of
//!   hashed on every blob request;
//! - an unknown user is checked against a dummy hash of the same cost as
//!   the file's hashes, so the time taken does not tell which users exist;
//! - bcrypt runs on the blocking pool, at most [`MAX_CONCURRENT_BCRYPT`] at
//!   once, so a flood of made-up credentials cannot take every core from
//!   clients whose credentials are already verified.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use base64::Engine;
use http::HeaderMap;
use http::header::AUTHORIZATION;
use sha2::{Digest as _, Sha256};

use crate::config::ClientAuthConfig;
use crate::error::Error;

/// How long a verified (user, password) pair is accepted without bcrypt.
const VERIFIED_TTL: Duration = Duration::from_secs(300);
/// Verified pairs remembered at most.
const VERIFIED_CAPACITY: u64 = 10_000;

/// bcrypt checks running at once; more wait their turn. One core's worth:
/// on a small node the other cores keep serving verified clients.
pub const MAX_CONCURRENT_BCRYPT: usize = 1;

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
    /// sha256(user, password, hash) of pairs bcrypt accepted recently.
    verified: moka::sync::Cache<[u8; 32], ()>,
    bcrypt_permits: tokio::sync::Semaphore,
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
        let users = load_users(&config.htpasswd)?;
        Ok(Arc::new(ClientAuth {
            realm: config.realm.clone(),
            path: config.htpasswd.clone(),
            users: RwLock::new(Arc::new(users)),
            verified: moka::sync::Cache::builder().max_capacity(VERIFIED_CAPACITY).time_to_live(VERIFIED_TTL).build(),
            bcrypt_permits: tokio::sync::Semaphore::new(MAX_CONCURRENT_BCRYPT),
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

    /// Accepts the request's Basic credentials or answers with a challenge.
    pub async fn check(&self, headers: &HeaderMap) -> Result<(), Error> {
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
        if known && self.verified.contains_key(&key) {
            return Ok(());
        }
        let permit = self.bcrypt_permits.acquire().await.map_err(|_| challenge())?;
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
            Ok(())
        } else {
            tracing::info!(user, "client authentication failed");
            Err(challenge())
        }
    }
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

    /// bcrypt checks running now, and the most ever seen at once.
    #[derive(Default)]
    pub(super) struct Probe {
        running: AtomicUsize,
        peak: AtomicUsize,
    }

    pub(super) struct Running<'a>(&'a Probe);

    impl Probe {
        pub(super) fn enter(&self) -> Running<'_> {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak.fetch_max(now, Ordering::SeqCst);
            Running(self)
        }
    }

    impl Drop for Running<'_> {
        fn drop(&mut self) {
            self.0.running.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn auth_with(lines: &str) -> (tempfile::TempDir, Arc<ClientAuth>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("htpasswd");
        std::fs::write(&path, lines).unwrap();
        let auth = ClientAuth::load(&ClientAuthConfig { htpasswd: path, realm: "larder".into() }).unwrap();
        (dir, auth)
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
        assert!(auth.check(&basic("alice", "s3cret")).await.is_ok());
        assert!(auth.check(&basic("alice", "s3cret")).await.is_ok(), "again, from the verified cache");
        for bad in [basic("alice", "wrong"), basic("bob", "s3cret"), HeaderMap::new()] {
            let e = auth.check(&bad).await.unwrap_err();
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
        assert!(auth.check(&basic("alice", "s3cret")).await.is_ok(), "verified once");
        let flood: Vec<_> = (0..8)
            .map(|i| {
                let auth = Arc::clone(&auth);
                tokio::spawn(async move { auth.check(&basic(&format!("mallory{i}"), "x")).await })
            })
            .collect();
        // A verified client is answered from the cache, not queued behind the flood.
        assert!(auth.check(&basic("alice", "s3cret")).await.is_ok());
        assert!(flood.iter().any(|f| !f.is_finished()), "the flood is still being checked");
        for f in flood {
            assert_eq!(f.await.unwrap().unwrap_err().status(), 401);
        }
        assert_eq!(auth.probe.peak.load(Ordering::SeqCst), MAX_CONCURRENT_BCRYPT, "bcrypt checks ran one at a time");
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
