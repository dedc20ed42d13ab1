//! Purges remembered as barriers: what came from before a purge of a
//! repository must not bring back what the purge removed. A tag mapping a
//! peer confirmed before it is not taken from that peer, and a fill that
//! started before it commits without the repository's membership row
//! (the blob stays, a member of no repository, until another fetch or an
//! upstream check makes it one again).

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

/// Purges remembered. Past this, the oldest is forgotten: a replica down
/// through that many purges may hand out a mapping the oldest one
/// removed, until its TTL; a fill that started before a forgotten purge
/// commits without its membership row whatever it was purged of.
pub const MAX_PURGE_BARRIERS: usize = 1024;

/// Recent purges, newest last, numbered from 1 in the order they began.
#[derive(Debug, Default)]
pub struct Purges {
    /// (index prefix purged, when, its number).
    recent: VecDeque<(String, SystemTime, u64)>,
    /// How many purges began so far.
    count: u64,
}

/// The purges, locked (a std Mutex: held for a few comparisons, never
/// across `.await`).
pub fn lock_purges(purges: &Mutex<Purges>) -> MutexGuard<'_, Purges> {
    purges.lock().unwrap_or_else(|p| p.into_inner())
}

impl Purges {
    /// A purge of `prefix` ("upstream\0" or "upstream\0repo\0") begins,
    /// before any row is removed.
    pub fn begin(&mut self, prefix: String) {
        if self.recent.len() >= MAX_PURGE_BARRIERS {
            self.recent.pop_front();
        }
        self.count += 1;
        self.recent.push_back((prefix, SystemTime::now(), self.count));
    }

    /// How many purges began so far: taken when a fill starts, for
    /// [`Purges::purged_since`].
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Whether a purge that began after `seen` ([`Purges::count`] then)
    /// covers `key` ("upstream\0repo\0..."). When purges that recent are
    /// forgotten already, it is taken that one did.
    pub fn purged_since(&self, key: &str, seen: u64) -> bool {
        let oldest = self.recent.front().map_or(self.count + 1, |(_, _, n)| *n);
        if seen + 1 < oldest && seen < self.count {
            return true;
        }
        self.recent.iter().any(|(prefix, _, n)| *n > seen && key.starts_with(prefix.as_str()))
    }

    /// Whether a purge covering `key` began after `at`.
    pub fn purged_after(&self, key: &str, at: SystemTime) -> bool {
        self.recent.iter().any(|(prefix, when, _)| key.starts_with(prefix.as_str()) && at < *when)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_purge_since_a_count_covers_its_prefix_only() {
        let mut purges = Purges::default();
        purges.begin("hub\0old\0".into());
        let seen = purges.count();
        assert!(!purges.purged_since("hub\0app\0abc", seen), "nothing since");
        purges.begin("hub\0other\0".into());
        assert!(!purges.purged_since("hub\0app\0abc", seen), "another repository");
        purges.begin("hub\0app\0".into());
        assert!(purges.purged_since("hub\0app\0abc", seen));
        assert!(!purges.purged_since("hub\0app\0abc", purges.count()), "a fill started after it");
        purges.begin("hub\0".into());
        assert!(purges.purged_since("hub\0any\0abc", seen), "the whole upstream");
        assert!(!purges.purged_since("quay\0app\0abc", seen));
    }

    #[test]
    fn forgotten_purges_are_taken_to_cover_everything() {
        let mut purges = Purges::default();
        let seen = purges.count();
        for i in 0..=MAX_PURGE_BARRIERS {
            purges.begin(format!("hub\0r{i}\0"));
        }
        assert!(purges.purged_since("quay\0app\0abc", seen), "the first purge since is forgotten");
        assert!(!purges.purged_since("quay\0app\0abc", purges.count()));
    }
}
