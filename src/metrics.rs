//! Prometheus metrics, registered once in a process-wide registry. Label
//! values are bounded: routes, methods, status codes, upstream names from
//! the config, and fixed result words; never repository names or digests.

use std::sync::LazyLock;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

pub struct Metrics {
    pub registry: Registry,
    /// `requests_total{route,method,status}`
    pub requests: IntCounterVec,
    /// `request_duration_seconds{route}`: until response headers are sent.
    pub request_duration: HistogramVec,
    /// `cache_requests_total{kind,result}`: kind `manifest|blob`, result `hit|miss|coalesced|stale`.
    pub cache_requests: IntCounterVec,
    /// `upstream_requests_total{upstream,method,status}`; status `error` when no response came.
    pub upstream_requests: IntCounterVec,
    /// `upstream_request_duration_seconds{upstream}`: until response headers.
    pub upstream_duration: HistogramVec,
    /// `bytes_served_total{source}`: source `memory|disk|fill`.
    pub bytes_served: IntCounterVec,
    /// `upstream_bytes_total{upstream}`: blob bytes received from upstream.
    pub upstream_bytes: IntCounterVec,
    pub fills_in_flight: IntGauge,
    /// `cache_size_bytes`: blobs and manifests on disk.
    pub cache_size: IntGauge,
    /// `cache_evictions_total{kind}`: kind `blob|manifest`.
    pub cache_evictions: IntCounterVec,
    pub digest_mismatch: IntCounter,
    pub tokens_fetched: IntCounter,
    /// `admin_auth_failures_total{endpoint,reason}`: admin operations
    /// refused; reason `missing|wrong|disabled`.
    pub admin_auth_failures: IntCounterVec,
    /// `ready`: 1 when the last readiness check (on every `/readyz` and
    /// every scrape) passed, 0 when it failed.
    pub ready: IntGauge,
    /// `cache_max_size_bytes`: the configured `cache.max_size`.
    pub cache_max_size: IntGauge,
    /// `cache_high_watermark_bytes`: usage above which eviction starts.
    pub cache_high_watermark: IntGauge,
}

const PREFIX: &str = "larder";

fn build() -> Result<Metrics, prometheus::Error> {
    let registry = Registry::new_custom(Some(PREFIX.to_owned()), None)?;
    let counter_vec = |name: &str, help: &str, labels: &[&str]| -> Result<IntCounterVec, prometheus::Error> {
        let c = IntCounterVec::new(Opts::new(name, help), labels)?;
        registry.register(Box::new(c.clone()))?;
        Ok(c)
    };
    let histogram_vec = |name: &str, help: &str, labels: &[&str]| -> Result<HistogramVec, prometheus::Error> {
        let buckets = vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
        let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)?;
        registry.register(Box::new(h.clone()))?;
        Ok(h)
    };
    let fills_in_flight = IntGauge::new("fills_in_flight", "Blob fills currently streaming from upstream")?;
    registry.register(Box::new(fills_in_flight.clone()))?;
    let cache_size = IntGauge::new("cache_size_bytes", "Bytes of blobs and manifests in the disk cache")?;
    registry.register(Box::new(cache_size.clone()))?;
    let digest_mismatch = IntCounter::new("digest_mismatch_total", "Upstream content that failed verification")?;
    registry.register(Box::new(digest_mismatch.clone()))?;
    let tokens_fetched = IntCounter::new("tokens_fetched_total", "Bearer tokens fetched from upstream realms")?;
    registry.register(Box::new(tokens_fetched.clone()))?;
    let gauge = |name: &str, help: &str| -> Result<IntGauge, prometheus::Error> {
        let g = IntGauge::new(name, help)?;
        registry.register(Box::new(g.clone()))?;
        Ok(g)
    };
    let ready = gauge("ready", "1 when the last readiness check passed (index readable, cache folder writable)")?;
    let cache_max_size = gauge("cache_max_size_bytes", "The configured cache.max_size")?;
    let cache_high_watermark =
        gauge("cache_high_watermark_bytes", "Cache usage above which least recently used content is evicted")?;
    Ok(Metrics {
        requests: counter_vec("requests_total", "Requests served", &["route", "method", "status"])?,
        request_duration: histogram_vec("request_duration_seconds", "Time to response headers", &["route"])?,
        cache_requests: counter_vec("cache_requests_total", "Cache lookups by result", &["kind", "result"])?,
        upstream_requests: counter_vec(
            "upstream_requests_total",
            "Requests sent upstream",
            &["upstream", "method", "status"],
        )?,
        upstream_duration: histogram_vec(
            "upstream_request_duration_seconds",
            "Upstream time to response headers",
            &["upstream"],
        )?,
        bytes_served: counter_vec("bytes_served_total", "Body bytes served to clients", &["source"])?,
        upstream_bytes: counter_vec("upstream_bytes_total", "Blob bytes received from upstream", &["upstream"])?,
        fills_in_flight,
        cache_size,
        cache_evictions: counter_vec("cache_evictions_total", "Items evicted from the disk cache", &["kind"])?,
        digest_mismatch,
        tokens_fetched,
        admin_auth_failures: counter_vec(
            "admin_auth_failures_total",
            "Admin operations refused for a missing or wrong token, or because they are disabled",
            &["endpoint", "reason"],
        )?,
        ready,
        cache_max_size,
        cache_high_watermark,
        registry,
    })
}

static METRICS: LazyLock<Metrics> =
    LazyLock::new(|| build().expect("metric names and labels are static and registered once"));

/// The process-wide metrics.
pub fn metrics() -> &'static Metrics {
    &METRICS
}

/// Creates the series of the known label combinations at 0, so that
/// Prometheus sees each counter start from zero: a series that first
/// appears at 1 loses that increment in `rate()` and `increase()` (the
/// first hit after start would vanish from the hit ratio).
pub fn init_known_series() {
    let m = metrics();
    for kind in ["manifest", "blob"] {
        for result in ["hit", "miss", "coalesced", "stale"] {
            m.cache_requests.with_label_values(&[kind, result]);
        }
    }
    for source in ["memory", "disk", "fill"] {
        m.bytes_served.with_label_values(&[source]);
    }
    for kind in ["manifest", "blob"] {
        m.cache_evictions.with_label_values(&[kind]);
    }
}

/// The registry in Prometheus text format.
pub fn render() -> Vec<u8> {
    let mut out = Vec::new();
    // Encoding into a Vec only fails on an inconsistent metric family, which
    // static registration rules out; an empty page is the fallback.
    let _ = TextEncoder::new().encode(&metrics().registry.gather(), &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prefixed_families() {
        metrics().cache_requests.with_label_values(&["blob", "hit"]).inc();
        metrics().fills_in_flight.set(0);
        let text = String::from_utf8(render()).unwrap();
        assert!(text.contains("larder_cache_requests_total{kind=\"blob\",result=\"hit\"}"), "{text}");
        assert!(text.contains("# TYPE larder_fills_in_flight gauge"), "{text}");
    }
}
