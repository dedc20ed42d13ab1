//! Bounded disk: how many bytes the store holds, when each item was last
//! used, and the least-recently-used eviction that keeps usage between the
//! watermarks. Access times are collected in memory on the request path and
//! written to the index in batches by the maintenance task, never per request.
//!
//! Each upstream with its own `max_size` is kept between the same
//! watermarks of it, counting what it is charged for (see
//! [`crate::cache::index::Charged`]); the maintenance task evicts within such an
//! upstream first, then across the cache.
//!
//! Fills in flight count too ([`InFlight`]): their temp files take disk
//! now and their blobs will be committed, so a cold pull of several large
//! layers makes room before it writes them instead of taking the cache
//! past `max_size` until they commit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::cache::index::{Charged, Kind, Use};
use crate::oci::Digest;

/// Disk budget and the watermarks derived from it.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Above this many bytes, eviction starts.
    pub high: u64,
    /// Eviction removes items until usage is at or below this.
    pub low: u64,
}

impl Limits {
    pub fn new(max_size: u64, high_watermark: f64, low_watermark: f64) -> Limits {
        Limits { high: (max_size as f64 * high_watermark) as u64, low: (max_size as f64 * low_watermark) as u64 }
    }
}

/// Share of current usage freed when a write fails with ENOSPC although
/// usage is under the watermarks (the disk is shared, or `max_size` is
/// larger than the disk).
const DISK_FULL_RELIEF: f64 = 0.10;

/// When an item was last used, and for which upstream.
type LastUse = (u64, Arc<str>);

pub struct Evictor {
    limits: Limits,
    /// Each upstream's own limits (`[[upstream]] max_size`).
    quotas: Vec<(String, Limits)>,
    /// What each upstream is charged, as the index last committed it.
    charged: Arc<Charged>,
    bytes: AtomicU64,
    /// Uses not yet written to the index (the last one of an item wins).
    /// Hashed with foldhash: every warm request inserts here (issue 35).
    pending: Mutex<HashMap<(Kind, Digest), LastUse, foldhash::fast::RandomState>>,
    disk_full: AtomicBool,
    wake: Notify,
    /// Bytes of fills in flight, in all and per upstream.
    in_flight: Mutex<InFlightBytes>,
}

#[derive(Default)]
struct InFlightBytes {
    total: u64,
    by_upstream: HashMap<String, u64>,
}

/// A fill in flight's bytes, counted toward eviction until it ends (the
/// blob is committed and counted as usage, or it fails) or is dropped.
pub struct InFlight {
    evictor: Arc<Evictor>,
    upstream: String,
    bytes: u64,
}

impl InFlight {
    /// The fill now knows its blob's size (or the size is gone: 0).
    pub fn set(&mut self, bytes: u64) {
        if bytes != self.bytes {
            self.evictor.move_in_flight(&self.upstream, self.bytes, bytes);
            self.bytes = bytes;
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.set(0);
    }
}

impl Evictor {
    pub fn new(limits: Limits, bytes: u64, quotas: Vec<(String, Limits)>, charged: Arc<Charged>) -> Evictor {
        crate::metrics::metrics().cache_size.set(i64::try_from(bytes).unwrap_or(i64::MAX));
        Evictor {
            limits,
            quotas,
            charged,
            bytes: AtomicU64::new(bytes),
            pending: Mutex::new(HashMap::default()),
            disk_full: AtomicBool::new(false),
            wake: Notify::new(),
            in_flight: Mutex::default(),
        }
    }

    /// Counts `bytes` of a fill for `upstream` in flight until the guard
    /// drops (see [`InFlight`]).
    pub fn in_flight(self: &Arc<Self>, upstream: &str, bytes: u64) -> InFlight {
        let mut guard = InFlight { evictor: Arc::clone(self), upstream: upstream.to_owned(), bytes: 0 };
        guard.set(bytes);
        guard
    }

    fn move_in_flight(&self, upstream: &str, before: u64, after: u64) {
        {
            let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
            in_flight.total = (in_flight.total + after).saturating_sub(before);
            let mine = in_flight.by_upstream.entry(upstream.to_owned()).or_default();
            *mine = (*mine + after).saturating_sub(before);
            if *mine == 0 {
                in_flight.by_upstream.remove(upstream);
            }
        }
        if after > before {
            self.wake_if_over();
        }
    }

    /// Bytes of fills in flight: in all, or for `upstream`.
    pub fn bytes_in_flight(&self, upstream: Option<&str>) -> u64 {
        let in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        match upstream {
            None => in_flight.total,
            Some(u) => in_flight.by_upstream.get(u).copied().unwrap_or(0),
        }
    }

    /// What an upstream's share counts: what it is charged and its fills in flight.
    fn share(&self, upstream: &str) -> u64 {
        self.charged.get(upstream) + self.bytes_in_flight(Some(upstream))
    }

    /// Wakes the maintenance task if the cache, or an upstream's share,
    /// with the fills in flight, is above its high watermark.
    fn wake_if_over(&self) {
        let total = self.usage() + self.bytes_in_flight(None);
        if total > self.limits.high || self.quotas.iter().any(|(u, l)| self.share(u) > l.high) {
            self.wake.notify_one();
        }
    }

    pub fn usage(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Counts newly stored bytes and wakes the maintenance task if usage
    /// crossed the high watermark, or an upstream's usage its own.
    pub fn added(&self, bytes: u64) {
        let now = self.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        crate::metrics::metrics().cache_size.set(i64::try_from(now).unwrap_or(i64::MAX));
        self.wake_if_over();
    }

    /// The upstreams above their own high watermark (with their fills in
    /// flight), each with how many of its bytes to free (down to its low
    /// watermark).
    pub fn upstreams_to_free(&self) -> Vec<(String, u64)> {
        self.quotas
            .iter()
            .filter_map(|(upstream, limits)| {
                let share = self.share(upstream);
                (share > limits.high).then(|| (upstream.clone(), share - limits.low))
            })
            .collect()
    }

    /// The upstreams with their own `max_size`, and its limits.
    pub fn quotas(&self) -> &[(String, Limits)] {
        &self.quotas
    }

    /// An upstream's own limits, if it has a `max_size`.
    pub fn quota(&self, upstream: &str) -> Option<Limits> {
        self.quotas.iter().find(|(u, _)| u == upstream).map(|(_, l)| *l)
    }

    /// The whole cache's limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Bytes charged to `upstream`.
    pub fn charged(&self, upstream: &str) -> u64 {
        self.charged.get(upstream)
    }

    pub fn removed(&self, bytes: u64) {
        let prev = self.bytes.fetch_sub(bytes.min(self.usage()), Ordering::Relaxed);
        let now = prev.saturating_sub(bytes);
        crate::metrics::metrics().cache_size.set(i64::try_from(now).unwrap_or(i64::MAX));
    }

    /// A write failed with ENOSPC: make room now, whatever the watermarks say.
    pub fn disk_full(&self) {
        self.disk_full.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }

    /// A request for upstream `by` served the item now (see [`Use`]).
    pub fn record_access(&self, kind: Kind, digest: Digest, by: &Arc<str>, now_ms: u64) {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).insert((kind, digest), (now_ms, Arc::clone(by)));
    }

    /// The uses collected since the last call.
    pub fn take_accesses(&self) -> Vec<Use> {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        pending.into_iter().map(|((kind, digest), (at_ms, by))| Use { kind, digest, at_ms, by: Some(by) }).collect()
    }

    /// Waits until usage crossed the high watermark or a disk-full report.
    pub async fn woken(&self) {
        self.wake.notified().await;
    }

    /// How many bytes to free now, if any: the fills in flight count as
    /// if their blobs were committed.
    pub fn bytes_to_free(&self) -> u64 {
        let usage = self.usage() + self.bytes_in_flight(None);
        let over = usage.saturating_sub(self.limits.low);
        if usage > self.limits.high {
            over.max(1)
        } else if self.disk_full.swap(false, Ordering::Relaxed) {
            over.max((usage as f64 * DISK_FULL_RELIEF) as u64).max(1)
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermarks_decide_how_much_to_free() {
        let e = Evictor::new(Limits::new(1000, 0.9, 0.7), 0, Vec::new(), Arc::default());
        e.added(850);
        assert_eq!(e.bytes_to_free(), 0, "under the high watermark");
        e.added(100);
        assert_eq!(e.bytes_to_free(), 250, "down to the low watermark");
        e.removed(250);
        assert_eq!(e.usage(), 700);
        e.disk_full();
        assert_eq!(e.bytes_to_free(), 70, "ENOSPC frees a share even under the watermarks");
        assert_eq!(e.bytes_to_free(), 0, "once");
    }

    #[test]
    fn fills_in_flight_count_toward_eviction_until_they_end() {
        let quota = Limits::new(500, 0.9, 0.7);
        let e = Arc::new(Evictor::new(Limits::new(1000, 0.9, 0.7), 0, vec![("hub".into(), quota)], Arc::default()));
        e.added(600);
        let mut fill = e.in_flight("hub", 0);
        assert_eq!(e.bytes_to_free(), 0, "size not known yet");
        fill.set(480);
        assert_eq!(e.bytes_to_free(), 380, "600 cached + 480 being written: down to the low watermark");
        assert_eq!(e.upstreams_to_free(), vec![("hub".to_owned(), 480 - 350)], "the upstream's share counts it too");
        let other = e.in_flight("mirror", 100);
        assert_eq!(e.bytes_in_flight(None), 580);
        drop(fill);
        assert_eq!((e.bytes_in_flight(None), e.bytes_in_flight(Some("hub"))), (100, 0), "an ended fill counts no more");
        assert_eq!(e.bytes_to_free(), 0);
        drop(other);
        assert_eq!(e.bytes_in_flight(None), 0);
    }

    mod with_a_cache {
        use crate::cache::Cache;
        use crate::cache::index::Kind;
        use crate::cache::test_cache::temporary as cache;
        use crate::oci::{Digest, RepoName};

        const SIZE: u64 = 100;

        /// A blob of `SIZE` bytes committed for `repo` of upstream `hub`,
        /// file, row and usage, the way a fill leaves it.
        fn commit(cache: &Cache, repo: &str, seed: u8, accessed_ms: u64) -> Digest {
            let bytes = vec![seed; SIZE as usize];
            let d = Digest::of(&bytes);
            let path = cache.store.blob_path(&d);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &bytes).unwrap();
            let member = format!("hub\0{repo}\0{}", d.hex().as_str());
            if cache.index.insert_blob(&d, SIZE, &member, accessed_ms).unwrap() {
                cache.evictor.added(SIZE);
            }
            d
        }

        fn repo(name: &str) -> RepoName {
            name.parse().unwrap()
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn an_eviction_and_a_purge_of_the_same_blobs_count_them_once() {
            for round in 0..20u8 {
                let (_dir, cache) = cache().await;
                let purged: Vec<_> =
                    (0..3).map(|n| commit(&cache, "team/app", 3 * round + n, 1_000 + u64::from(n))).collect();
                let other = commit(&cache, "team/other", 200, 9_000);
                // Both remove the three least recently used blobs at once.
                // (When the purge goes first, the eviction still frees its
                // 3 × SIZE, so it takes the other repository's blob too.)
                let app = repo("team/app");
                let (evicted, purge) = tokio::join!(cache.evict(3 * SIZE), cache.purge("hub", Some(&app)));
                evicted.unwrap();
                purge.unwrap();
                for d in &purged {
                    assert!(!cache.store.blob_path(d).exists(), "round {round}: removed");
                }
                let other_kept = cache.index.blob_size(&other).unwrap().is_some();
                assert_eq!(cache.store.blob_path(&other).is_file(), other_kept, "round {round}: file and row agree");
                let left = if other_kept { SIZE } else { 0 };
                assert_eq!(cache.usage(), left, "round {round}: each removed blob counted once");
                assert_eq!(cache.index.usage().unwrap(), left);
            }
        }

        #[tokio::test]
        async fn a_blob_committed_again_while_it_was_being_removed_keeps_its_file_and_row() {
            let (_dir, cache) = cache().await;
            let d = commit(&cache, "team/app", 1, 1_000);
            let removed = cache.index.remove_content(&[(Kind::Blob, d)]).unwrap();
            // A fill commits it again before the file is unlinked.
            commit(&cache, "team/app", 1, 2_000);
            cache.forget_removed(&removed).await;
            assert!(cache.store.blob_path(&d).is_file(), "the new file stays");
            assert_eq!(cache.index.blob_size(&d).unwrap(), Some(SIZE), "and so does its row");
            assert_eq!(cache.usage(), SIZE, "counted once: removed once, added once");
        }

        #[tokio::test]
        async fn a_purge_goes_on_past_a_file_it_cannot_unlink_and_counts_exactly() {
            let (_dir, cache) = cache().await;
            let mut blobs: Vec<_> = (0..3).map(|n| commit(&cache, "team/app", n, 1_000)).collect();
            blobs.sort_by(|a, b| a.hex().as_str().cmp(b.hex().as_str()));
            // The first one a purge unlinks becomes a folder with a file
            // in it, which unlink(2) refuses (even for root).
            let stuck = cache.store.blob_path(&blobs[0]);
            std::fs::remove_file(&stuck).unwrap();
            std::fs::create_dir(&stuck).unwrap();
            std::fs::write(stuck.join("pinned"), b"x").unwrap();

            let purged = cache.purge("hub", Some(&repo("team/app"))).await.unwrap();
            assert_eq!((purged.blobs, purged.bytes), (3, 3 * SIZE));
            assert!(stuck.is_dir(), "could not be removed");
            for d in &blobs[1..] {
                assert!(!cache.store.blob_path(d).exists(), "the others are removed");
            }
            assert_eq!(cache.usage(), 0, "every removed row is given back");
            assert_eq!(cache.index.usage().unwrap(), 0);
        }
    }
}
