//! A cache in a temporary folder for the unit tests of the cache's parts.

use std::sync::Arc;
use std::time::Duration;

use super::Cache;
use crate::config::CacheConfig;

/// An empty cache of 1 GiB in a new temporary folder (kept as long as the
/// returned guard lives).
pub async fn temporary() -> (tempfile::TempDir, Arc<Cache>) {
    temporary_with(|_| {}).await
}

/// [`temporary`], with its config changed by `edit` first.
pub async fn temporary_with(edit: impl FnOnce(&mut CacheConfig)) -> (tempfile::TempDir, Arc<Cache>) {
    let dir = tempfile::tempdir().unwrap();
    let config = CacheConfig {
        dir: dir.path().join("cache"),
        max_size: 1 << 30,
        max_blob_size: 1 << 28,
        max_import_size: 1 << 30,
        high_watermark: 0.9,
        low_watermark: 0.8,
        memory: 1 << 20,
        tag_ttl: Duration::from_secs(60),
        stale_if_error: Duration::from_secs(60),
        warm_file: None,
        warm_interval: None,
        upstream_max_size: Vec::new(),
        parallel_fill_min: crate::config::DEFAULT_PARALLEL_FILL_MIN,
    };
    let mut config = config;
    edit(&mut config);
    let cache = Cache::open(config).await.unwrap();
    (dir, cache)
}
