//! The facts an operator wants at a glance, gathered once for both the
//! status page (`GET /`) and `larder status` (`GET /status`, JSON): cache
//! size against its limit (and pinned content), entries, hit ratio since
//! start, fills in flight, each upstream's last error, rate-limit headroom
//! and share of the cache, the largest and most recently used
//! repositories, and the warm images. Repository figures come from an index
//! scan on the blocking pool, cached for [`HOLDINGS_TTL`] so that a page
//! reloaded in a loop costs one scan per TTL.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::cache::pins::PinnedUsage;
use crate::cache::stats::{Holdings, RepositoryUsage};
use crate::error::Error;
use crate::metrics::metrics;
use crate::state::App;
use crate::upstream::health::LastError;
use crate::warm::status::WarmReport;

/// How long one index scan for the repository figures is reused.
pub const HOLDINGS_TTL: Duration = Duration::from_secs(10);
/// Repositories listed in each of "largest" and "most recently used".
pub const TOP_REPOSITORIES: usize = 10;

/// Everything `GET /status` answers (also what the page shows).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Status {
    pub version: String,
    pub uptime_seconds: u64,
    /// Unix millis when this was gathered.
    pub now_ms: u64,
    pub cache: CacheStatus,
    pub hit_ratio: HitRatio,
    pub upstreams: Vec<UpstreamStatus>,
    pub repositories: Repositories,
    /// The warm images and the warm file.
    #[serde(default)]
    pub warm: WarmReport,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CacheStatus {
    pub size_bytes: u64,
    pub max_size_bytes: u64,
    pub high_watermark_bytes: u64,
    pub blobs: u64,
    pub manifests: u64,
    pub fills_in_flight: usize,
    /// Pinned content (warm images), and the limits it alone is above.
    #[serde(default)]
    pub pinned: PinnedUsage,
}

/// Share of requests served without a new upstream download, since start
/// (`None` before the first request of that kind).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HitRatio {
    pub blob: Option<f64>,
    pub manifest: Option<f64>,
    pub blob_requests: u64,
    pub manifest_requests: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct UpstreamStatus {
    pub name: String,
    pub url: String,
    pub default: bool,
    /// Requests sent since start, and how many failed (no answer, 5xx, 429).
    pub requests: u64,
    pub errors: u64,
    pub last_error: Option<LastErrorStatus>,
    pub last_success_ms: Option<u64>,
    pub rate_limit: Option<RateLimitStatus>,
    /// Bytes of the cache charged to this upstream (shared content counts
    /// once, for the upstream that used it most recently, or that pins it).
    #[serde(default)]
    pub cache_bytes: u64,
    /// Its own `max_size`, if it has one.
    #[serde(default)]
    pub max_size_bytes: Option<u64>,
    /// Its `max_bandwidth` (bytes per second for all its fills), if it has one.
    #[serde(default)]
    pub max_bandwidth_bytes_per_second: Option<u64>,
    /// `client_credentials = "verify"`: every client's own credentials are
    /// checked with this upstream before anything of it is served.
    #[serde(default)]
    pub verifies_clients: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LastErrorStatus {
    pub at_ms: u64,
    pub message: String,
}

/// The pull limit upstream last announced (Docker Hub's `ratelimit-*`
/// headers; remaining 0 after a 429), from larder's rate-limit gauges.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RateLimitStatus {
    pub remaining: u64,
    pub limit: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Repositories {
    pub count: u64,
    pub largest: Vec<Repository>,
    pub recent: Vec<Repository>,
    /// False when the scan stopped at its row limit.
    pub complete: bool,
    /// Unix millis of the index scan these figures come from.
    pub scanned_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Repository {
    pub upstream: String,
    pub repository: String,
    pub items: u64,
    pub bytes: u64,
    pub last_used_ms: u64,
}

impl From<&RepositoryUsage> for Repository {
    fn from(r: &RepositoryUsage) -> Repository {
        Repository {
            upstream: r.upstream.clone(),
            repository: r.repository.clone(),
            items: r.items,
            bytes: r.bytes,
            last_used_ms: r.last_used_ms,
        }
    }
}

impl From<LastError> for LastErrorStatus {
    fn from(e: LastError) -> LastErrorStatus {
        LastErrorStatus { at_ms: e.at_ms, message: e.message }
    }
}

pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The last index scan, reused for [`HOLDINGS_TTL`]. A tokio Mutex: it is
/// held across the scan, so concurrent page loads wait for one scan
/// instead of starting their own.
#[derive(Default)]
pub struct HoldingsCache {
    last: tokio::sync::Mutex<Option<(Instant, u64, Arc<Holdings>)>>,
}

impl HoldingsCache {
    /// The holdings and the unix millis of their scan.
    async fn get(&self, app: &App) -> Result<(Arc<Holdings>, u64), Error> {
        let mut last = self.last.lock().await;
        if let Some((at, scanned_ms, holdings)) = last.as_ref() {
            if at.elapsed() < HOLDINGS_TTL {
                return Ok((Arc::clone(holdings), *scanned_ms));
            }
        }
        let holdings = Arc::new(app.cache.holdings(TOP_REPOSITORIES).await?);
        let scanned_ms = unix_ms(SystemTime::now());
        *last = Some((Instant::now(), scanned_ms, Arc::clone(&holdings)));
        Ok((holdings, scanned_ms))
    }
}

fn ratio(kind: &str) -> (Option<f64>, u64) {
    let counter = |result: &str| metrics().cache_requests.with_label_values(&[kind, result]).get();
    let served = counter("hit") + counter("coalesced") + counter("stale");
    let total = served + counter("miss");
    ((total > 0).then(|| served as f64 / total as f64), total)
}

/// What the metrics say about one upstream since start: requests and
/// failures (no answer, 5xx, 429) from `larder_upstream_requests_total`,
/// and the announced rate limit from `larder_upstream_ratelimit_*` (a
/// series exists only once upstream announced one).
struct UpstreamFigures {
    requests: u64,
    errors: u64,
    rate_limit: Option<RateLimitStatus>,
}

fn upstream_figures(families: &[prometheus::proto::MetricFamily], name: &str) -> UpstreamFigures {
    let (mut requests, mut errors, mut remaining, mut limit) = (0, 0, None, None);
    for family in families {
        for m in family.get_metric() {
            let label = |k: &str| m.get_label().iter().find(|l| l.name() == k).map(|l| l.value().to_owned());
            if label("upstream").as_deref() != Some(name) {
                continue;
            }
            match family.name() {
                "larder_upstream_requests_total" => {
                    let n = m.get_counter().get_value() as u64;
                    requests += n;
                    if matches!(label("status").as_deref(), Some("error" | "5xx" | "429")) {
                        errors += n;
                    }
                }
                "larder_upstream_ratelimit_remaining" => remaining = Some(m.get_gauge().get_value().max(0.0) as u64),
                "larder_upstream_ratelimit_limit" => limit = Some(m.get_gauge().get_value().max(0.0) as u64),
                _ => {}
            }
        }
    }
    UpstreamFigures { requests, errors, rate_limit: remaining.map(|remaining| RateLimitStatus { remaining, limit }) }
}

/// Gathers the status. `started` is when the admin listener started.
pub async fn gather(app: &App, holdings: &HoldingsCache, started: Instant) -> Result<Status, Error> {
    let (h, scanned_ms) = holdings.get(app).await?;
    let (blob, blob_requests) = ratio("blob");
    let (manifest, manifest_requests) = ratio("manifest");
    let families = metrics().registry.gather();
    let upstreams = app
        .config
        .upstreams
        .iter()
        .map(|c| {
            let health = app.upstreams.get(&c.name).map(|u| u.health.report()).unwrap_or_default();
            let figures = upstream_figures(&families, &c.name);
            UpstreamStatus {
                name: c.name.clone(),
                url: c.url.to_string().trim_end_matches('/').to_owned(),
                default: c.default,
                requests: figures.requests,
                errors: figures.errors,
                last_error: health.last_error.map(Into::into),
                last_success_ms: health.last_success_ms,
                rate_limit: figures.rate_limit,
                cache_bytes: app.cache.upstream_usage(&c.name),
                max_size_bytes: app.cache.upstream_max_size(&c.name),
                max_bandwidth_bytes_per_second: c.max_bandwidth,
                verifies_clients: c.client_credentials.verifies(),
            }
        })
        .collect();
    Ok(Status {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        uptime_seconds: started.elapsed().as_secs(),
        now_ms: unix_ms(SystemTime::now()),
        cache: CacheStatus {
            size_bytes: app.cache.usage(),
            max_size_bytes: app.cache.max_size(),
            high_watermark_bytes: app.cache.high_watermark_bytes(),
            blobs: h.blobs,
            manifests: h.manifests,
            fills_in_flight: app.cache.fills_in_flight(),
            pinned: app.cache.pinned(),
        },
        hit_ratio: HitRatio { blob, manifest, blob_requests, manifest_requests },
        upstreams,
        repositories: Repositories {
            count: h.repositories,
            largest: h.largest.iter().map(Into::into).collect(),
            recent: h.recent.iter().map(Into::into).collect(),
            complete: h.complete,
            scanned_ms,
        },
        warm: app.warm.report(),
    })
}
