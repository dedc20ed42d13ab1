//! Prometheus metrics, registered once in a process-wide registry. Label
//! values are bounded: routes, methods, status codes, upstream names from
//! the config, and fixed result words; never repository names or digests.

use std::sync::{LazyLock, OnceLock};

use prometheus::{
    CounterVec, Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
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
    /// `sendfile_bytes_total`: the part of `bytes_served_total` sent from
    /// the page cache with sendfile (cleartext HTTP/1 only), not copied
    /// through larder's memory.
    pub sendfile_bytes: IntCounter,
    pub fills_in_flight: IntGauge,
    /// `fills_total{reason}`: blob fills started; reason `client` (a
    /// client's request), `peer` (another replica's) or `ahead` (the other
    /// layers of an image whose first layer a client that resolved it
    /// asked for, before it asks for them).
    pub fills: IntCounterVec,
    /// `fills_ahead_joined_total`: fills started ahead that a client then
    /// asked for (the rest of `fills_total{reason="ahead"}` went unused).
    pub fills_ahead_joined: IntCounter,
    /// `fill_parts_total{upstream}`: ranged parts of parallel fills, one
    /// per part however many GETs it took.
    pub fill_parts: IntCounterVec,
    /// `fill_part_bytes_total{upstream}`: blob bytes the parts received
    /// (part of `upstream_bytes_total`).
    pub fill_part_bytes: IntCounterVec,
    /// `fill_part_resumes_total{upstream}`: GETs that resumed a part whose
    /// connection broke, from the byte it reached.
    pub fill_part_resumes: IntCounterVec,
    /// `cache_size_bytes`: blobs and manifests on disk.
    pub cache_size: IntGauge,
    /// `cache_evictions_total{kind}`: kind `blob|manifest`.
    pub cache_evictions: IntCounterVec,
    pub digest_mismatch: IntCounter,
    pub tokens_fetched: IntCounter,
    /// `admin_auth_failures_total{endpoint,reason}`: admin operations
    /// refused; reason `missing|wrong|disabled|revoked|cross_site|host`.
    pub admin_auth_failures: IntCounterVec,
    /// `client_auth_throttled_total{reason}`: client password checks
    /// answered 429 before bcrypt; reason `peer_limit|queue_wait`.
    pub client_auth_throttled: IntCounterVec,
    /// `ready`: 1 when the last readiness check (on every `/readyz` and
    /// every scrape) passed, 0 when it failed.
    pub ready: IntGauge,
    /// `cache_max_size_bytes`: the configured `cache.max_size`.
    pub cache_max_size: IntGauge,
    /// `cache_high_watermark_bytes`: usage above which eviction starts.
    pub cache_high_watermark: IntGauge,
    /// `shared_requests_total{op,result}`: requests to the shared object
    /// store; op `head|get|put|put_multipart|delete|list`, result
    /// `ok|not_found|error|skipped` (`skipped`: a lookup not sent because
    /// the store failed a moment ago, see `shared_down`).
    pub shared_requests: IntCounterVec,
    /// `shared_down`: 1 while lookups skip the shared tier after it failed
    /// (timed out, refused or errored), for a pause that grows while it
    /// keeps failing; 0 once it answered again.
    pub shared_down: IntGauge,
    /// `shared_bytes_total{direction}`: direction `download|upload`.
    pub shared_bytes: IntCounterVec,
    /// `shared_uploads_total{kind,result}`: background uploads; kind
    /// `blob|manifest`, result `uploaded|present|failed|dropped` (`failed`
    /// is retried later; `dropped` had nothing valid left to upload).
    pub shared_uploads: IntCounterVec,
    /// `log_lines_dropped_total`: log lines dropped because the log writer
    /// fell behind (stderr slow or stalled).
    pub log_lines_dropped: IntCounter,
    /// `cache_reconcile_running`: 1 while the start-up check of blob files
    /// against the index runs in the background (larder serves meanwhile).
    pub cache_reconcile_running: IntGauge,
    /// `pending_uploads`: verified content waiting for upload to the shared tier.
    pub pending_uploads: IntGauge,
    /// `peers_up` / `peers_down`: cluster members answering or being
    /// skipped (this replica counts as up).
    pub peers_up: IntGauge,
    pub peers_down: IntGauge,
    /// `peers_marked_down_total`: times a peer could not be connected to
    /// and was skipped for a while.
    pub peers_marked_down: IntCounter,
    /// `peer_requests_total{direction,kind,result}`: direction `out` (asked
    /// an owner) or `in` (asked by a peer); kind `blob|manifest|purge`; result
    /// `ok|not_found|unreachable|no_answer|error|refused` (`unreachable`:
    /// no connection, the peer is marked down; `no_answer`: connected but
    /// no response headers in time, not marked down; `refused`: no or a
    /// wrong cluster secret, or an upstream named by anything but its name).
    pub peer_requests: IntCounterVec,
    /// `peer_bytes_total`: blob bytes received from owners.
    pub peer_bytes: IntCounter,
    /// `shared_corrupt_total`: shared-tier blobs whose size disagreed with
    /// the manifest's (or upstream's) or whose bytes failed the digest
    /// check (the object is deleted and the blob fetched elsewhere).
    pub shared_corrupt: IntCounter,
    /// `upstream_ratelimit_limit{upstream}`: the pull limit upstream last
    /// announced (Docker Hub's `ratelimit-limit`).
    pub upstream_ratelimit_limit: IntGaugeVec,
    /// `upstream_ratelimit_remaining{upstream}`: pulls left in the window,
    /// as upstream last said (`ratelimit-remaining`); 0 after a 429.
    pub upstream_ratelimit_remaining: IntGaugeVec,
    /// `upstream_auth_failures_total{upstream,reason}`: reason
    /// `realm_refused|helper_missing|helper_timeout|helper_failed|password_file|token_service|denied`.
    pub upstream_auth_failures: IntCounterVec,
    /// `upstream_auth_retries_total{upstream}`: requests answered 401 with a
    /// cached token or credentials, retried once with fresh ones.
    pub upstream_auth_retries: IntCounterVec,
    /// `upstream_tokens_cached{upstream}`: tokens held in the (bounded) token
    /// cache, as of the last token request.
    pub upstream_tokens_cached: IntGaugeVec,
    /// `upstream_redirects_refused_total{reason}`: redirect targets and
    /// token realms larder refused to dial. reason: `downgrade` (https to
    /// http), or the class of the address (`loopback|link_local|metadata|
    /// private|unspecified|multicast|reserved`).
    pub upstream_redirects_refused: IntCounterVec,
    /// `upstream_listings_refused_total{upstream,listing}`: `tags/list` or
    /// `referrers` answers that were not a tag list or an image index
    /// (answered 502, never relayed).
    pub upstream_listings_refused: IntCounterVec,
    /// `policy_denied_total{upstream}`: requests for a repository the
    /// upstream's `allow`/`deny` refuses (clients, peers and prefetches).
    pub policy_denied: IntCounterVec,
    /// `grant_denied_total{upstream}`: client requests no grant allows.
    pub grant_denied: IntCounterVec,
    /// `upstream_cache_size_bytes{upstream}`: bytes of the cache charged to
    /// each upstream (content shared by upstreams counts once, for the one
    /// that used it most recently, or pins it); `cache_size_bytes` stays the whole.
    pub upstream_cache_size: IntGaugeVec,
    /// `upstream_cache_max_size_bytes{upstream}`: an upstream's own
    /// `max_size`, for those that have one.
    pub upstream_cache_max_size: IntGaugeVec,
    /// `upstream_max_bandwidth_bytes{upstream}`: an upstream's
    /// `max_bandwidth` in bytes per second (0: unlimited).
    pub upstream_max_bandwidth: IntGaugeVec,
    /// `upstream_bandwidth_wait_seconds_total{upstream,class}`: time fills
    /// spent waiting for their share of an upstream's bandwidth, by whom
    /// they ran for (`client`, `ahead`, `warm`).
    pub upstream_bandwidth_wait: CounterVec,
    /// `cache_pinned_bytes`: bytes of pinned content (warm images) cached.
    pub cache_pinned_bytes: IntGauge,
    /// `cache_pinned_over_limit`: 1 while pinned content alone is above the
    /// high watermark of `max_size` (or of an upstream's own `max_size`):
    /// only unpinned content is evicted, and it cannot make room.
    pub cache_pinned_over_limit: IntGauge,
    /// `client_verifications_total{upstream,result}`: checks of a client's
    /// credentials with an upstream that has `client_credentials =
    /// "verify"` (one per (credentials, repository) and ttl, however many
    /// requests wait on it); result `granted|rejected|denied|not_found|unavailable`.
    pub client_verifications: IntCounterVec,
    /// `client_verdicts_cached{upstream}`: (credentials, repository)
    /// verdicts remembered, as of the last check.
    pub client_verdicts_cached: IntGaugeVec,
    /// `warm_images{state}`: warm images by state,
    /// `ready|fetching|missing_upstream|not_found|failed`.
    pub warm_images: IntGaugeVec,
    /// `trace_spans_total{result}`: OpenTelemetry spans, with `[tracing]`
    /// on; result `exported` (the collector took them), `failed` (the
    /// export failed: collector down, hung past the export timeout, or an
    /// error answer) or `dropped` (the export queue was full: never waited for).
    pub trace_spans: IntCounterVec,
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
    let log_lines_dropped =
        IntCounter::new("log_lines_dropped_total", "Log lines dropped because stderr could not keep up")?;
    registry.register(Box::new(log_lines_dropped.clone()))?;
    let cache_reconcile_running = gauge(
        "cache_reconcile_running",
        "1 while the start-up check of blob files against the index runs in the background",
    )?;
    let pending_uploads =
        gauge("pending_uploads", "Verified blobs and manifests waiting for upload to the shared tier")?;
    let shared_down = gauge("shared_down", "1 while lookups skip the shared tier after it failed")?;
    let peers_up = gauge("peers_up", "Cluster members currently answering (this replica included)")?;
    let peers_down = gauge("peers_down", "Cluster members skipped after a failed request")?;
    let peer_bytes = IntCounter::new("peer_bytes_total", "Blob bytes received from owners among the peers")?;
    registry.register(Box::new(peer_bytes.clone()))?;
    let shared_corrupt = IntCounter::new(
        "shared_corrupt_total",
        "Shared-tier blobs of the wrong size or whose bytes failed the digest check",
    )?;
    registry.register(Box::new(shared_corrupt.clone()))?;
    let peers_marked_down =
        IntCounter::new("peers_marked_down_total", "Times a peer failed a request and was skipped for a while")?;
    registry.register(Box::new(peers_marked_down.clone()))?;
    let sendfile_bytes = IntCounter::new(
        "sendfile_bytes_total",
        "Blob body bytes sent from the page cache with sendfile (part of bytes_served_total)",
    )?;
    registry.register(Box::new(sendfile_bytes.clone()))?;
    let gauge_vec = |name: &str, help: &str, labels: &[&str]| -> Result<IntGaugeVec, prometheus::Error> {
        let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
        registry.register(Box::new(g.clone()))?;
        Ok(g)
    };
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
        sendfile_bytes,
        fills_in_flight,
        fills: counter_vec("fills_total", "Blob fills started, by who they were started for", &["reason"])?,
        fills_ahead_joined: {
            let c =
                IntCounter::new("fills_ahead_joined_total", "Fills started ahead of a client that a client joined")?;
            registry.register(Box::new(c.clone()))?;
            c
        },
        fill_parts: counter_vec("fill_parts_total", "Ranged parts of parallel blob fills", &["upstream"])?,
        fill_part_bytes: counter_vec(
            "fill_part_bytes_total",
            "Blob bytes received by the ranged parts of parallel fills",
            &["upstream"],
        )?,
        fill_part_resumes: counter_vec(
            "fill_part_resumes_total",
            "Ranged GETs resuming a part whose connection broke",
            &["upstream"],
        )?,
        cache_size,
        cache_reconcile_running,
        log_lines_dropped,
        cache_evictions: counter_vec("cache_evictions_total", "Items evicted from the disk cache", &["kind"])?,
        digest_mismatch,
        tokens_fetched,
        admin_auth_failures: counter_vec(
            "admin_auth_failures_total",
            "Admin operations refused: a missing or wrong token, disabled, the token file revoked, from a web page, \
             or for a foreign Host",
            &["endpoint", "reason"],
        )?,
        client_auth_throttled: counter_vec(
            "client_auth_throttled_total",
            "Client password checks answered 429 because bcrypt's queue was full for the address or overall",
            &["reason"],
        )?,
        ready,
        cache_max_size,
        cache_high_watermark,
        shared_requests: counter_vec(
            "shared_requests_total",
            "Requests to the shared object store by operation and result",
            &["op", "result"],
        )?,
        shared_bytes: counter_vec(
            "shared_bytes_total",
            "Bytes moved to and from the shared object store",
            &["direction"],
        )?,
        shared_uploads: counter_vec(
            "shared_uploads_total",
            "Background uploads to the shared tier by kind and result",
            &["kind", "result"],
        )?,
        pending_uploads,
        shared_down,
        peers_up,
        peers_down,
        peers_marked_down,
        peer_requests: counter_vec(
            "peer_requests_total",
            "Requests between replicas",
            &["direction", "kind", "result"],
        )?,
        peer_bytes,
        shared_corrupt,
        upstream_ratelimit_limit: gauge_vec(
            "upstream_ratelimit_limit",
            "Pull limit upstream last announced (ratelimit-limit)",
            &["upstream"],
        )?,
        upstream_ratelimit_remaining: gauge_vec(
            "upstream_ratelimit_remaining",
            "Pulls left in upstream's rate-limit window (ratelimit-remaining), 0 after a 429",
            &["upstream"],
        )?,
        upstream_auth_failures: counter_vec(
            "upstream_auth_failures_total",
            "Upstream authentication failures by reason",
            &["upstream", "reason"],
        )?,
        upstream_auth_retries: counter_vec(
            "upstream_auth_retries_total",
            "Upstream requests refused with a cached token or credentials and retried once with fresh ones",
            &["upstream"],
        )?,
        upstream_tokens_cached: gauge_vec(
            "upstream_tokens_cached",
            "Tokens held in the token cache, as of the last token request",
            &["upstream"],
        )?,
        upstream_redirects_refused: counter_vec(
            "upstream_redirects_refused_total",
            "Redirect targets and token realms refused: https-to-http downgrades, or addresses that are not public",
            &["reason"],
        )?,
        policy_denied: counter_vec(
            "policy_denied_total",
            "Requests for a repository the upstream's allow/deny refuses, answered 403 before any cache read or dial",
            &["upstream"],
        )?,
        grant_denied: counter_vec(
            "grant_denied_total",
            "Client requests no [[server.auth.grant]] allows, answered 403 before any cache read or dial",
            &["upstream"],
        )?,
        upstream_cache_size: gauge_vec(
            "upstream_cache_size_bytes",
            "Bytes of the cache charged to each upstream (shared content counts once, for the upstream that used \
             it most recently or pins it)",
            &["upstream"],
        )?,
        upstream_cache_max_size: gauge_vec(
            "upstream_cache_max_size_bytes",
            "An upstream's own max_size: its content is evicted, least recently used first, to stay under it",
            &["upstream"],
        )?,
        upstream_max_bandwidth: gauge_vec(
            "upstream_max_bandwidth_bytes",
            "An upstream's max_bandwidth in bytes per second for all its fills together (0: unlimited)",
            &["upstream"],
        )?,
        upstream_bandwidth_wait: {
            let c = CounterVec::new(
                Opts::new(
                    "upstream_bandwidth_wait_seconds_total",
                    "Seconds fills waited for their share of an upstream's bandwidth, by whom they ran for (client, \
                     ahead, warm)",
                ),
                &["upstream", "class"],
            )?;
            registry.register(Box::new(c.clone()))?;
            c
        },
        cache_pinned_bytes: gauge("cache_pinned_bytes", "Bytes of pinned content (warm images) in the cache")?,
        cache_pinned_over_limit: gauge(
            "cache_pinned_over_limit",
            "1 while pinned content alone is above the high watermark of max_size or of an upstream's max_size",
        )?,
        warm_images: gauge_vec(
            "warm_images",
            "Warm images by state: ready, fetching, missing_upstream (gone upstream, served from the cache), not_found (never found upstream) or failed",
            &["state"],
        )?,
        client_verifications: counter_vec(
            "client_verifications_total",
            "Client credentials checked with the upstream for a repository (client_credentials = \"verify\"), by \
             result: granted, rejected (wrong credentials), denied (may not pull it), not_found, unavailable",
            &["upstream", "result"],
        )?,
        client_verdicts_cached: gauge_vec(
            "client_verdicts_cached",
            "Verdicts on (client credentials, repository) pairs remembered, as of the last check",
            &["upstream"],
        )?,
        upstream_listings_refused: counter_vec(
            "upstream_listings_refused_total",
            "Upstream tags/list or referrers answers that were not a tag list or an image index",
            &["upstream", "listing"],
        )?,
        trace_spans: counter_vec(
            "trace_spans_total",
            "OpenTelemetry spans: exported, failed (export failed) or dropped (export queue full)",
            &["result"],
        )?,
        registry,
    })
}

static METRICS: LazyLock<Metrics> =
    LazyLock::new(|| build().expect("metric names and labels are static and registered once"));

/// The process-wide metrics.
pub fn metrics() -> &'static Metrics {
    &METRICS
}

/// The route labels of `requests_total`, `request_duration_seconds` and
/// (`manifest`, `blob`) `cache_requests_total`.
const ROUTES: [&str; 6] = ["manifest", "blob", "tags", "referrers", "base", "invalid"];
/// The method labels of `requests_total`.
const METHODS: [&str; 3] = ["GET", "HEAD", "other"];
/// The result labels of `cache_requests_total`.
const RESULTS: [&str; 4] = ["hit", "miss", "coalesced", "stale"];

/// Handles of the series every request touches, each looked up once.
///
/// `with_label_values` hashes its label values and takes the vector's
/// read lock on every call, a lock both workers share; a warm manifest
/// GET made four such calls (issue 35, benches/README.md "Warm manifests
/// at nginx's cost"). A handle is made the first time its series is used,
/// so `/metrics` shows the same series as before: none that never
/// happened. Statuses other than 200 (rare next to it) take the lookup.
struct RequestSeries {
    ok: [[OnceLock<IntCounter>; METHODS.len()]; ROUTES.len()],
    duration: [OnceLock<prometheus::Histogram>; ROUTES.len()],
    cache: [[OnceLock<IntCounter>; RESULTS.len()]; ROUTES.len()],
    served_from_memory: OnceLock<IntCounter>,
}

static REQUEST_SERIES: RequestSeries = RequestSeries {
    ok: [const { [const { OnceLock::new() }; METHODS.len()] }; ROUTES.len()],
    duration: [const { OnceLock::new() }; ROUTES.len()],
    cache: [const { [const { OnceLock::new() }; RESULTS.len()] }; ROUTES.len()],
    served_from_memory: OnceLock::new(),
};

fn index_of(labels: &[&str], label: &str) -> Option<usize> {
    labels.iter().position(|l| *l == label)
}

/// Counts one answered request: `requests_total`, its time to response
/// headers, and (with a cache result) `cache_requests_total`.
pub fn count_request(
    route: &'static str,
    method: &'static str,
    status: http::StatusCode,
    seconds: f64,
    cache: Option<&'static str>,
) {
    let m = metrics();
    let (r, meth) = (index_of(&ROUTES, route), index_of(&METHODS, method));
    match (r, meth) {
        (Some(r), Some(meth)) if status == http::StatusCode::OK => REQUEST_SERIES.ok[r][meth]
            .get_or_init(|| m.requests.with_label_values(&[route, method, status.as_str()]))
            .inc(),
        _ => m.requests.with_label_values(&[route, method, status.as_str()]).inc(),
    }
    match r {
        Some(r) => {
            REQUEST_SERIES.duration[r].get_or_init(|| m.request_duration.with_label_values(&[route])).observe(seconds)
        }
        None => m.request_duration.with_label_values(&[route]).observe(seconds),
    }
    if let Some(result) = cache {
        match (r, index_of(&RESULTS, result)) {
            (Some(r), Some(c)) => {
                REQUEST_SERIES.cache[r][c].get_or_init(|| m.cache_requests.with_label_values(&[route, result])).inc()
            }
            _ => m.cache_requests.with_label_values(&[route, result]).inc(),
        }
    }
}

/// Counts `bytes` of a manifest served from memory (`bytes_served_total{source="memory"}`).
pub fn served_from_memory(bytes: u64) {
    REQUEST_SERIES
        .served_from_memory
        .get_or_init(|| metrics().bytes_served.with_label_values(&["memory"]))
        .inc_by(bytes);
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
    for state in WARM_STATES {
        m.warm_images.with_label_values(&[state]);
    }
    for reason in ["client", "peer", "ahead"] {
        m.fills.with_label_values(&[reason]);
    }
    for result in ["exported", "failed", "dropped"] {
        m.trace_spans.with_label_values(&[result]);
    }
}

/// The values of `warm_images{state}`.
pub const WARM_STATES: [&str; 5] = ["ready", "fetching", "missing_upstream", "not_found", "failed"];

/// The log writer, whose count of lines it had to drop is read when
/// metrics are rendered (see `main`'s `init_logs`).
static LOG_WRITER: OnceLock<crate::log_writer::LogWriter> = OnceLock::new();

pub fn count_dropped_log_lines(writer: crate::log_writer::LogWriter) {
    let _ = LOG_WRITER.set(writer);
}

/// The registry in Prometheus text format.
pub fn render() -> Vec<u8> {
    if let Some(writer) = LOG_WRITER.get() {
        let counted = metrics().log_lines_dropped.get();
        metrics().log_lines_dropped.inc_by(writer.dropped_lines().saturating_sub(counted));
    }
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
