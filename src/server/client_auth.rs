//! Optional client authentication: HTTP Basic credentials checked against
//! an htpasswd file of bcrypt hashes (`htpasswd -B`). bcrypt is slow by
//! design (tens of milliseconds), so a verified (user, password) pair is
//! remembered for a while instead of hashed on every blob request.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, LazyLock, RwLock};
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

/// A hash checked for unknown users, so a wrong user name costs as much
/// time as a wrong password.
static DUMMY_HASH: LazyLock<String> =
    LazyLock::new(|| bcrypt::hash("larder unknown user", bcrypt::DEFAULT_COST).unwrap_or_default());

pub struct ClientAuth {
    realm: String,
    path: PathBuf,
    users: RwLock<HashMap<String, String>>,
    /// sha256(user, password, hash) of pairs bcrypt accepted recently.
    verified: moka::sync::Cache<[u8; 32], ()>,
}

impl std::fmt::Debug for ClientAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientAuth").field("realm", &self.realm).field("path", &self.path).finish_non_exhaustive()
    }
}

impl ClientAuth {
    pub fn load(config: &ClientAuthConfig) -> Result<Arc<ClientAuth>, String> {
        let users = read_htpasswd(&config.htpasswd)?;
        Ok(Arc::new(ClientAuth {
            realm: config.realm.clone(),
            path: config.htpasswd.clone(),
            users: RwLock::new(users),
            verified: moka::sync::Cache::builder().max_capacity(VERIFIED_CAPACITY).time_to_live(VERIFIED_TTL).build(),
        }))
    }

    pub fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// Re-reads the htpasswd file; on error the current users stay.
    pub fn reload(&self) -> Result<(), String> {
        let users = read_htpasswd(&self.path)?;
        *self.users.write().unwrap_or_else(|p| p.into_inner()) = users;
        self.verified.invalidate_all();
        Ok(())
    }

    /// Accepts the request's Basic credentials or answers with a challenge.
    pub async fn check(&self, headers: &HeaderMap) -> Result<(), Error> {
        let challenge = || Error::Unauthorized { realm: self.realm.clone() };
        let (user, password) = basic_credentials(headers).ok_or_else(challenge)?;
        let hash = self.users.read().unwrap_or_else(|p| p.into_inner()).get(&user).cloned();
        let known = hash.is_some();
        let hash = hash.unwrap_or_else(|| DUMMY_HASH.clone());
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
        let ok = crate::blocking::blocking(move || Ok(bcrypt::verify(password, &hash).unwrap_or(false))).await?;
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
