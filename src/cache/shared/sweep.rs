//! The `max_age` sweep of the shared tier: deletes objects uploaded longer
//! ago than `[shared] max_age`, run by one replica of the cluster.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::stream::TryStreamExt;
use object_store::path::Path as ObjectPath;

use super::{ObjectKind, SharedError, SharedStore, delete_counted, store_err};
use crate::metrics::metrics;

/// Deletions in flight at once during a `max_age` sweep.
const SWEEP_DELETES_IN_FLIGHT: usize = 8;
/// The key whose owner among the peers runs the `max_age` sweeper.
pub const SWEEPER_KEY: &str = "larder/shared-sweeper";
/// How often the `max_age` sweeper lists the prefix.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(3600);

/// What a `max_age` sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    pub listed: u64,
    pub deleted: u64,
}

impl SharedStore {
    /// Deletes every blob and manifest object uploaded more than `max_age`
    /// ago (by the store's `Last-Modified`). Other keys under the prefix
    /// are left alone.
    pub async fn sweep(&self, max_age: Duration) -> Result<Swept, SharedError> {
        let cutoff = SystemTime::now().checked_sub(max_age).unwrap_or(UNIX_EPOCH);
        let cutoff = cutoff.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        let (listed, deleted) = (AtomicU64::new(0), AtomicU64::new(0));
        for kind in [ObjectKind::Blob, ObjectKind::Manifest] {
            let folder = ObjectPath::from(format!("{}{}/sha256", self.prefix, kind.folder()));
            // Streamed page by page, deleting as it goes: a bucket of
            // millions of objects is never listed into memory at once.
            let result = self
                .store
                .list(Some(&folder))
                .map_err(store_err)
                .try_for_each_concurrent(SWEEP_DELETES_IN_FLIGHT, |meta| {
                    listed.fetch_add(1, Ordering::Relaxed);
                    let (store, deleted) = (&self.store, &deleted);
                    async move {
                        if meta.last_modified.timestamp_millis() < cutoff
                            && delete_counted(store, &meta.location).await.is_ok()
                        {
                            deleted.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(())
                    }
                })
                .await;
            let label = if result.is_ok() { "ok" } else { "error" };
            metrics().shared_requests.with_label_values(&["list", label]).inc();
            result?;
        }
        let swept = Swept { listed: listed.into_inner(), deleted: deleted.into_inner() };
        Ok(swept)
    }

    /// Sweeps objects older than `max_age` now and every [`SWEEP_INTERVAL`]
    /// until `shutdown`. With `peers`, only the replica that owns
    /// [`SWEEPER_KEY`] among the live peers sweeps (once the member set is
    /// known): listing a large prefix on every replica would cost the store
    /// N times for nothing. If that replica goes, the next owner sweeps at
    /// its next round.
    pub fn spawn_sweeper(
        self: &Arc<Self>,
        max_age: Duration,
        peers: Option<Arc<crate::cluster::Peers>>,
        mut shutdown: crate::shutdown::Shutdown,
    ) -> tokio::task::JoinHandle<()> {
        let store = Arc::clone(self);
        tokio::spawn(async move {
            if let Some(peers) = &peers {
                tokio::select! {
                    _ = shutdown.changed() => return,
                    () = peers.settled() => {}
                }
            }
            loop {
                if peers.as_ref().is_none_or(|p| p.owns(SWEEPER_KEY)) {
                    let swept = tokio::select! {
                        _ = shutdown.changed() => return,
                        swept = store.sweep(max_age) => swept,
                    };
                    match swept {
                        Ok(s) => {
                            tracing::info!(listed = s.listed, deleted = s.deleted, max_age = %crate::config::units::spelled_duration(max_age), "swept the shared tier")
                        }
                        Err(e) => tracing::warn!(error = %e, "sweeping the shared tier failed"),
                    }
                } else {
                    tracing::debug!("another replica sweeps the shared tier");
                }
                tokio::select! {
                    _ = shutdown.changed() => return,
                    () = tokio::time::sleep(SWEEP_INTERVAL) => {}
                }
            }
        })
    }
}
