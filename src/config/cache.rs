//! `[cache]`: where and how much larder keeps, and for how long tags are
//! trusted.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::units::Size;
use super::{ConfigError, Validator};

/// Default share of `max_size` above which eviction starts.
pub const DEFAULT_HIGH_WATERMARK: f64 = 0.95;
/// Default share of `max_size` eviction brings usage down to.
pub const DEFAULT_LOW_WATERMARK: f64 = 0.85;
/// Smallest `cache.max_size` accepted: below this every commit would
/// trigger an eviction of everything.
pub const MIN_MAX_SIZE: u64 = 1 << 20;
/// `cache.max_blob_size` when not set: this share of `max_size`.
pub const DEFAULT_MAX_BLOB_SIZE_DIVISOR: u64 = 4;
/// `cache.parallel_fill_min` when not set: blobs this large or larger are
/// fetched as parallel ranges (see `crate::cache::fill::parts`).
pub const DEFAULT_PARALLEL_FILL_MIN: u64 = 32 << 20;

#[derive(Debug, Clone)]
pub struct CacheConfig {
    pub dir: PathBuf,
    /// Disk budget for cached content, in bytes.
    pub max_size: u64,
    /// Largest blob a fill may write when no manifest declared its size
    /// (an upstream streaming without `Content-Length` is cut off here).
    pub max_blob_size: u64,
    /// Share of `max_size` above which eviction starts.
    pub high_watermark: f64,
    /// Share of `max_size` eviction brings usage down to.
    pub low_watermark: f64,
    /// Memory budget of the in-memory manifest tier, in bytes.
    pub memory: u64,
    /// How long a tag → digest mapping is trusted before a `HEAD` revalidates it.
    pub tag_ttl: Duration,
    /// How long past its TTL a tag may still be served when upstream fails.
    pub stale_if_error: Duration,
    /// More images to keep warm, one reference per line, re-read when it
    /// changes (`[[warm]]` lists them in the config itself).
    pub warm_file: Option<PathBuf>,
    /// How often each warm tag is revalidated; `None`: its upstream's `tag_ttl`.
    pub warm_interval: Option<Duration>,
    /// Each upstream's own share (`[[upstream]] max_size`), by upstream
    /// name: copied here from the upstreams, for the evictor.
    pub upstream_max_size: Vec<(String, u64)>,
    /// Smallest blob (by the size its manifest declared) fetched from
    /// upstream as parallel ranged parts, `upstream.fill_connections` at once.
    pub parallel_fill_min: u64,
}

/// Shortest `cache.warm_interval` accepted: each warm tag costs one `HEAD`
/// per interval.
pub const MIN_WARM_INTERVAL: Duration = Duration::from_secs(1);

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCache {
    dir: Option<String>,
    max_size: Option<String>,
    max_blob_size: Option<String>,
    high_watermark: Option<f64>,
    low_watermark: Option<f64>,
    memory: Option<String>,
    tag_ttl: Option<String>,
    stale_if_error: Option<String>,
    warm_file: Option<String>,
    warm_interval: Option<String>,
    parallel_fill_min: Option<String>,
}

impl Validator<'_> {
    pub(super) fn cache(&self, raw: Option<RawCache>) -> Result<CacheConfig, ConfigError> {
        let rc = raw.unwrap_or_default();
        let max_size = self.size("cache.max_size", rc.max_size.as_deref(), 50 << 30)?;
        if max_size < MIN_MAX_SIZE {
            return Err(self.err(
                "cache.max_size",
                format!("{} is less than the minimum, {}", Size(max_size), Size(MIN_MAX_SIZE)),
            ));
        }
        let max_blob_size =
            self.size("cache.max_blob_size", rc.max_blob_size.as_deref(), max_size / DEFAULT_MAX_BLOB_SIZE_DIVISOR)?;
        if max_blob_size == 0 || max_blob_size > max_size {
            return Err(self.err(
                "cache.max_blob_size",
                format!(
                    "must be more than 0 and at most cache.max_size, {}, not {}",
                    Size(max_size),
                    Size(max_blob_size)
                ),
            ));
        }
        let cache = CacheConfig {
            dir: self.path(rc.dir.as_deref().unwrap_or("./larder-data")),
            max_size,
            max_blob_size,
            high_watermark: rc.high_watermark.unwrap_or(DEFAULT_HIGH_WATERMARK),
            low_watermark: rc.low_watermark.unwrap_or(DEFAULT_LOW_WATERMARK),
            memory: self.size("cache.memory", rc.memory.as_deref(), 256 << 20)?,
            tag_ttl: self.duration("cache.tag_ttl", rc.tag_ttl.as_deref(), Duration::from_secs(300))?,
            stale_if_error: self.duration(
                "cache.stale_if_error",
                rc.stale_if_error.as_deref(),
                Duration::from_secs(7 * 86400),
            )?,
            // Not read here: the file may appear later (a ConfigMap a
            // controller writes), and a bad line is skipped, never fatal.
            warm_file: rc.warm_file.as_deref().map(|p| self.path(p)),
            warm_interval: rc
                .warm_interval
                .as_deref()
                .map(|v| self.duration("cache.warm_interval", Some(v), Duration::ZERO))
                .transpose()?,
            upstream_max_size: Vec::new(),
            parallel_fill_min: self.size(
                "cache.parallel_fill_min",
                rc.parallel_fill_min.as_deref(),
                DEFAULT_PARALLEL_FILL_MIN,
            )?,
        };
        if cache.parallel_fill_min == 0 {
            return Err(self.err("cache.parallel_fill_min", "must be more than 0"));
        }
        if cache.warm_interval.is_some_and(|i| i < MIN_WARM_INTERVAL) {
            return Err(self.err("cache.warm_interval", "must be at least 1s"));
        }
        // Each watermark's own error under its own key: the high one
        // alone first, then the low one against it.
        let (low, high) = (cache.low_watermark, cache.high_watermark);
        if !(0.0 < high && high <= 1.0) {
            return Err(self.err("cache.high_watermark", format!("must be above 0 and at most 1, not {high}")));
        }
        if !(0.0 < low && low < high) {
            return Err(self.err(
                "cache.low_watermark",
                format!("must be above 0 and below cache.high_watermark ({high}), not {low}"),
            ));
        }
        Ok(cache)
    }
}
