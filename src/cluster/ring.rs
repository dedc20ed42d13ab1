//! Rendezvous (highest random weight) hashing: every replica ranks the
//! peers for a key the same way, with no coordination. The first peer of
//! the ranking owns the key; the rest are its fallbacks, in order. Adding
//! or removing one of N peers moves only the keys that peer wins or won,
//! about 1/N of them, and the fallback order of the others stays as it was.
//!
//! The score is SHA-256 over the peer's name and the key: stable across
//! builds, platforms and larder versions, which a rolling upgrade needs
//! (std's `DefaultHasher` promises none of that).

use sha2::{Digest as _, Sha256};

/// A set of peers to rank keys over. Built once per peer-set change; each
/// member's hash state is seeded with its name up front, so ranking a key
/// hashes only the key per member.
#[derive(Clone)]
pub struct Ring<T> {
    members: Vec<(T, Sha256)>,
}

impl<T: AsRef<str>> Ring<T> {
    /// A ring over `members`; duplicates (by name) count once.
    pub fn new(members: impl IntoIterator<Item = T>) -> Ring<T> {
        let mut members: Vec<T> = members.into_iter().collect();
        members.sort_by(|a, b| a.as_ref().cmp(b.as_ref()));
        members.dedup_by(|a, b| a.as_ref() == b.as_ref());
        let members = members
            .into_iter()
            .map(|m| {
                let seed = seeded(m.as_ref());
                (m, seed)
            })
            .collect();
        Ring { members }
    }

    /// The members, sorted by name.
    pub fn members(&self) -> impl Iterator<Item = &T> {
        self.members.iter().map(|(m, _)| m)
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Every member, ranked for `key`: owner first, then the fallbacks.
    /// Ties (astronomically unlikely) go to the smaller name, so every
    /// replica still agrees.
    pub fn ranked(&self, key: &str) -> Vec<&T> {
        let mut scored: Vec<(u64, &T)> = self.members.iter().map(|(m, seed)| (score_seeded(seed, key), m)).collect();
        scored.sort_by(|(sa, a), (sb, b)| sb.cmp(sa).then_with(|| a.as_ref().cmp(b.as_ref())));
        scored.into_iter().map(|(_, m)| m).collect()
    }

    /// The member that owns `key`, if the ring has any.
    pub fn owner(&self, key: &str) -> Option<&T> {
        self.members
            .iter()
            .map(|(m, seed)| (score_seeded(seed, key), m))
            .max_by(|(sa, a), (sb, b)| sa.cmp(sb).then_with(|| b.as_ref().cmp(a.as_ref())))
            .map(|(_, m)| m)
    }
}

/// The weight of `member` for `key`; the owner has the highest.
pub fn score(member: &str, key: &str) -> u64 {
    score_seeded(&seeded(member), key)
}

/// Hash state after the member's name, length-prefixed so that no
/// (member, key) pair can be confused with another.
fn seeded(member: &str) -> Sha256 {
    let mut h = Sha256::new();
    h.update((member.len() as u64).to_be_bytes());
    h.update(member.as_bytes());
    h
}

fn score_seeded(seed: &Sha256, key: &str) -> u64 {
    let digest = seed.clone().chain_update(key.as_bytes()).finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(n: usize) -> Vec<String> {
        (1..=n).map(|i| format!("http://10.0.0.{i}:5001")).collect()
    }

    fn keys(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("sha256:{:064x}", i as u128 * 0x9e37_79b9_7f4a_7c15)).collect()
    }

    fn owners<'a>(ring: &'a Ring<String>, keys: &[String]) -> Vec<&'a str> {
        keys.iter().map(|k| ring.owner(k).unwrap().as_str()).collect()
    }

    #[test]
    fn owner_is_the_first_ranked_and_the_ranking_is_a_permutation() {
        let ring = Ring::new(peers(10));
        for key in keys(200) {
            let ranked = ring.ranked(&key);
            assert_eq!(ranked.len(), 10);
            assert_eq!(ranked[0], ring.owner(&key).unwrap());
            let mut names: Vec<&String> = ranked.clone();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), 10, "each peer appears once");
        }
    }

    #[test]
    fn every_replica_agrees_whatever_order_it_lists_the_peers_in() {
        let mut reversed = peers(10);
        reversed.reverse();
        let (a, b) = (Ring::new(peers(10)), Ring::new(reversed));
        for key in keys(500) {
            assert_eq!(a.ranked(&key), b.ranked(&key));
        }
    }

    #[test]
    fn keys_spread_evenly_over_ten_peers() {
        let ring = Ring::new(peers(10));
        let keys = keys(10_000);
        let owners = owners(&ring, &keys);
        for peer in peers(10) {
            let owned = owners.iter().filter(|o| **o == peer).count();
            // 1000 expected; 5 standard deviations is about ±150.
            assert!((800..=1200).contains(&owned), "{peer} owns {owned} of 10000 keys");
        }
    }

    #[test]
    fn removing_one_of_ten_peers_moves_only_its_own_keys() {
        let keys = keys(10_000);
        let all = Ring::new(peers(10));
        let before = owners(&all, &keys);
        let gone = "http://10.0.0.4:5001";
        let nine = Ring::new(peers(10).into_iter().filter(|p| p != gone));
        let after = owners(&nine, &keys);
        let moved: Vec<usize> = (0..keys.len()).filter(|&i| before[i] != after[i]).collect();
        assert!(moved.iter().all(|&i| before[i] == gone), "only the removed peer's keys move");
        assert_eq!(moved.len(), before.iter().filter(|o| **o == gone).count());
        let share = moved.len() as f64 / keys.len() as f64;
        assert!((0.08..=0.12).contains(&share), "moved {share:.3} of the keys, expected about 1/10");
        // Each moved key goes to the peer that was second in its ranking.
        for &i in &moved {
            assert_eq!(after[i], all.ranked(&keys[i])[1]);
        }
    }

    #[test]
    fn adding_an_eleventh_peer_moves_about_one_in_eleven_keys_all_to_it() {
        let keys = keys(10_000);
        let ten = Ring::new(peers(10));
        let before = owners(&ten, &keys);
        let eleven = Ring::new(peers(11));
        let after = owners(&eleven, &keys);
        let moved: Vec<usize> = (0..keys.len()).filter(|&i| before[i] != after[i]).collect();
        assert!(moved.iter().all(|&i| after[i] == "http://10.0.0.11:5001"), "keys move only to the new peer");
        let share = moved.len() as f64 / keys.len() as f64;
        assert!((0.07..=0.11).contains(&share), "moved {share:.3} of the keys, expected about 1/11");
    }

    #[test]
    fn scores_are_stable_across_builds() {
        // Pinned: a change here would make replicas of two versions
        // disagree about owners during a rolling upgrade.
        assert_eq!(score("http://10.0.0.1:5001", "sha256:abc"), score("http://10.0.0.1:5001", "sha256:abc"));
        assert_ne!(score("a", "bc"), score("ab", "c"), "the member name is length-prefixed");
        let expected = {
            let mut h = Sha256::new();
            h.update(20u64.to_be_bytes());
            h.update(b"http://10.0.0.1:5001");
            h.update(b"sha256:abc");
            let d = h.finalize();
            u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
        };
        assert_eq!(score("http://10.0.0.1:5001", "sha256:abc"), expected);
    }

    #[test]
    fn an_empty_ring_has_no_owner() {
        let ring: Ring<String> = Ring::new(Vec::new());
        assert!(ring.owner("k").is_none());
        assert!(ring.ranked("k").is_empty());
    }
}
