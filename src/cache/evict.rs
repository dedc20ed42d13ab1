//! Bounded disk: how many bytes the store holds, when each item was last
//! used, and the least-recently-used eviction that keeps usage between the
//! watermarks. Access times are collected in memory on the request path and
//! written to the index in batches by the maintenance task, never per request.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::sync::Notify;

use super::index::Kind;
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

pub struct Evictor {
    limits: Limits,
    bytes: AtomicU64,
    /// Access times not yet written to the index: (kind, digest) → unix millis.
    pending: Mutex<HashMap<(Kind, Digest), u64>>,
    disk_full: AtomicBool,
    wake: Notify,
}

impl Evictor {
    pub fn new(limits: Limits, bytes: u64) -> Evictor {
        crate::metrics::metrics().cache_size.set(i64::try_from(bytes).unwrap_or(i64::MAX));
        Evictor {
            limits,
            bytes: AtomicU64::new(bytes),
            pending: Mutex::new(HashMap::new()),
            disk_full: AtomicBool::new(false),
            wake: Notify::new(),
        }
    }

    pub fn usage(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Counts newly stored bytes and wakes the maintenance task if usage
    /// crossed the high watermark.
    pub fn added(&self, bytes: u64) {
        let now = self.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        crate::metrics::metrics().cache_size.set(i64::try_from(now).unwrap_or(i64::MAX));
        if now > self.limits.high {
            self.wake.notify_one();
        }
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

    pub fn record_access(&self, kind: Kind, digest: Digest, now_ms: u64) {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).insert((kind, digest), now_ms);
    }

    /// The access times collected since the last call.
    pub fn take_accesses(&self) -> Vec<(Kind, Digest, u64)> {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        pending.into_iter().map(|((kind, digest), at)| (kind, digest, at)).collect()
    }

    /// Waits until usage crossed the high watermark or a disk-full report.
    pub async fn woken(&self) {
        self.wake.notified().await;
    }

    /// How many bytes to free now, if any.
    pub fn bytes_to_free(&self) -> u64 {
        let usage = self.usage();
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
        let e = Evictor::new(Limits::new(1000, 0.9, 0.7), 0);
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
}
