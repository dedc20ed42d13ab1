//! A verified client's credentials, lent to larder for its own requests
//! for that repository: an upstream with `client_credentials = "verify"`
//! and no credentials of larder's own fills private images with the
//! credentials of a client the upstream just accepted for the repository
//! (`super::verify`). They go only where the upstream's own credentials
//! would (its origins that get credentials, its trusted realms), only for
//! requests naming that repository, and never to another repository,
//! a redirect target, a peer or a hub. They are held only as long as the
//! verdict that lent them: a credential whose verdict ended (revoked
//! upstream, perhaps) is not used again until it is verified again, and
//! neither is a token fetched with it ([`Lend::id`] is in its key).

use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

use crate::config::Credentials;
use crate::oci::RepoName;

/// Repositories whose lent credentials are remembered at most; past that
/// the least useful go (a fill for one of them is then anonymous until its
/// next client is verified or served again).
pub const MAX_LENT: u64 = 10_000;

/// Credentials lent for a repository, until the verdict that lent them ends.
#[derive(Debug, PartialEq, Eq)]
pub struct Lend {
    pub credentials: Credentials,
    /// Salted SHA-256 of the credentials: whose tokens these are (a token
    /// fetched with one client's credentials is never presented for
    /// another's, nor once its own are no longer lent).
    pub id: [u8; 32],
    /// When the verdict that lent them ends.
    until: Instant,
}

/// Keeps a lend until its verdict ends.
struct UntilVerdictEnds;

impl moka::Expiry<RepoName, Arc<Lend>> for UntilVerdictEnds {
    fn expire_after_create(&self, _: &RepoName, lend: &Arc<Lend>, now: Instant) -> Option<Duration> {
        Some(lend.until.saturating_duration_since(now))
    }

    fn expire_after_update(
        &self,
        _: &RepoName,
        lend: &Arc<Lend>,
        now: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(lend.until.saturating_duration_since(now))
    }
}

pub struct Lent {
    /// Mixed into every [`Lend::id`].
    salt: [u8; 32],
    /// The credentials of the client verified or served last for each
    /// repository. Behind an `Arc`, so that looking them up on every
    /// request copies no strings.
    by_repo: moka::sync::Cache<RepoName, Arc<Lend>>,
}

impl Lent {
    pub fn new() -> Lent {
        Lent {
            salt: rand::random(),
            by_repo: moka::sync::Cache::builder().max_capacity(MAX_LENT).expire_after(UntilVerdictEnds).build(),
        }
    }

    /// `credentials` were accepted upstream for `repo` by a verdict that
    /// lasts `until`: larder's requests for it may use them until then.
    /// Written only when they (or their verdict) differ from those held,
    /// so that a client pulling blob after blob costs one lookup each.
    pub fn lend(&self, repo: &RepoName, credentials: &Credentials, until: Instant) {
        let held = self.by_repo.get(repo);
        if held.is_some_and(|h| h.credentials == *credentials && h.until == until) {
            return;
        }
        let lend = Lend { credentials: credentials.clone(), id: self.id(credentials), until };
        self.by_repo.insert(repo.clone(), Arc::new(lend));
    }

    /// The credentials lent for `repo`, if their verdict still lasts.
    pub fn get(&self, repo: &RepoName) -> Option<Arc<Lend>> {
        self.by_repo.get(repo).filter(|l| l.until > Instant::now())
    }

    /// Upstream refused `used` for `repo` (revoked since they were
    /// verified): they are not used again, unless another client lent
    /// others since.
    pub fn refused(&self, repo: &RepoName, used: &Credentials) {
        self.by_repo.entry(repo.clone()).and_compute_with(|held| match held {
            Some(e) if e.value().credentials == *used => moka::ops::compute::Op::Remove,
            _ => moka::ops::compute::Op::Nop,
        });
    }

    fn id(&self, credentials: &Credentials) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(self.salt);
        for field in [credentials.username.as_str(), credentials.password.expose()] {
            h.update((field.len() as u64).to_be_bytes());
            h.update(field.as_bytes());
        }
        h.finalize().into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    fn creds(user: &str) -> Credentials {
        Credentials { username: user.into(), password: Secret::new("p") }
    }

    #[test]
    fn lent_credentials_serve_their_repository_only_and_a_refusal_drops_them() {
        let lent = Lent::new();
        let until = Instant::now() + Duration::from_secs(60);
        let (a, b): (RepoName, RepoName) = ("team-a/app".parse().unwrap(), "team-b/app".parse().unwrap());
        lent.lend(&a, &creds("alice"), until);
        assert_eq!(lent.get(&a).map(|l| l.credentials.clone()), Some(creds("alice")));
        assert!(lent.get(&b).is_none(), "never another repository's");
        lent.refused(&a, &creds("bob"));
        assert_eq!(lent.get(&a).map(|l| l.credentials.clone()), Some(creds("alice")), "a refusal of others: nothing");
        lent.refused(&a, &creds("alice"));
        assert!(lent.get(&a).is_none());
    }

    #[test]
    fn lent_credentials_end_with_the_verdict_that_lent_them() {
        let lent = Lent::new();
        let a: RepoName = "team-a/app".parse().unwrap();
        let soon = Instant::now() + Duration::from_millis(50);
        lent.lend(&a, &creds("alice"), soon);
        lent.lend(&a, &creds("carol"), Instant::now() + Duration::from_secs(60));
        // alice served again on her first verdict: lent only until it ends,
        // not for a whole ttl from now.
        lent.lend(&a, &creds("alice"), soon);
        let alice = lent.get(&a).expect("alice's verdict still lasts");
        assert_eq!(alice.credentials, creds("alice"));
        std::thread::sleep(Duration::from_millis(100));
        assert!(lent.get(&a).is_none(), "alice's verdict ended");
    }

    #[test]
    fn a_lends_id_tells_credentials_apart_and_is_salted() {
        let (one, two) = (Lent::new(), Lent::new());
        assert_eq!(one.id(&creds("alice")), one.id(&creds("alice")));
        assert_ne!(one.id(&creds("alice")), one.id(&creds("carol")));
        let split = |u: &str, p: &str| Credentials { username: u.into(), password: Secret::new(p) };
        assert_ne!(one.id(&split("ab", "c")), one.id(&split("a", "bc")));
        assert_ne!(one.id(&creds("alice")), two.id(&creds("alice")));
    }
}
