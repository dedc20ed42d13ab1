//! A verified client's credentials, lent to larder for its own requests
//! for that repository: an upstream with `client_credentials = "verify"`
//! and no credentials of larder's own fills private images with the
//! credentials of a client the upstream just accepted for the repository
//! (`super::verify`). They go only where the upstream's own credentials
//! would (its origins that get credentials, its trusted realms), only for
//! requests naming that repository, and never to another repository,
//! a redirect target, a peer or a hub.

use std::sync::Arc;
use std::time::Duration;

use crate::config::Credentials;
use crate::oci::RepoName;

/// Repositories whose lent credentials are remembered at most; past that
/// the least useful go (a fill for one of them is then anonymous until its
/// next client is verified or served again).
pub const MAX_LENT: u64 = 10_000;

pub struct Lent {
    /// The credentials of the client verified or served last for each
    /// repository, for as long as a verdict on them lasts. Behind an `Arc`,
    /// so that looking them up on every request copies no strings.
    by_repo: moka::sync::Cache<RepoName, Arc<Credentials>>,
}

impl Lent {
    /// Credentials are kept for `ttl` after they were last lent: no longer
    /// than a verdict on them is trusted.
    pub fn new(ttl: Duration) -> Lent {
        Lent { by_repo: moka::sync::Cache::builder().max_capacity(MAX_LENT).time_to_live(ttl).build() }
    }

    /// `credentials` were accepted upstream for `repo`: larder's requests
    /// for it may use them. Written only when they differ from those held,
    /// so that a client pulling blob after blob costs one lookup each.
    pub fn lend(&self, repo: &RepoName, credentials: &Credentials) {
        if self.by_repo.get(repo).as_deref() != Some(credentials) {
            self.by_repo.insert(repo.clone(), Arc::new(credentials.clone()));
        }
    }

    /// The credentials lent for `repo`, if any.
    pub fn get(&self, repo: &RepoName) -> Option<Credentials> {
        self.by_repo.get(repo).map(|c| Credentials::clone(&c))
    }

    /// Upstream refused `used` for `repo` (revoked since they were
    /// verified): they are not used again, unless another client lent
    /// others since.
    pub fn refused(&self, repo: &RepoName, used: &Credentials) {
        self.by_repo.entry(repo.clone()).and_compute_with(|held| match held {
            Some(e) if e.value().as_ref() == used => moka::ops::compute::Op::Remove,
            _ => moka::ops::compute::Op::Nop,
        });
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
        let lent = Lent::new(Duration::from_secs(60));
        let (a, b): (RepoName, RepoName) = ("team-a/app".parse().unwrap(), "team-b/app".parse().unwrap());
        lent.lend(&a, &creds("alice"));
        assert_eq!(lent.get(&a), Some(creds("alice")));
        assert_eq!(lent.get(&b), None, "never another repository's");
        lent.refused(&a, &creds("bob"));
        assert_eq!(lent.get(&a), Some(creds("alice")), "a refusal of other credentials changes nothing");
        lent.refused(&a, &creds("alice"));
        assert_eq!(lent.get(&a), None);
    }

    #[test]
    fn lent_credentials_expire() {
        let lent = Lent::new(Duration::from_millis(50));
        let a: RepoName = "team-a/app".parse().unwrap();
        lent.lend(&a, &creds("alice"));
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(lent.get(&a), None);
    }
}
