//! Sending spans: the OpenTelemetry SDK's tracer provider, its batch span
//! processor (a thread of its own) and the OTLP/HTTP exporter
//! (protobuf), over [`super::collector::CollectorClient`].
//!
//! A request never waits for the collector. A finished span is handed to
//! the batch queue, which holds at most [`queue_limit`] spans; past that
//! a span is dropped at once and counted
//! (`larder_trace_spans_total{result="dropped"}`). The batch thread
//! exports every [`BatchConfig`] delay (5 s, `OTEL_BSP_SCHEDULE_DELAY`)
//! or when a batch is full, each export bounded by the export timeout
//! (10 s, `OTEL_EXPORTER_OTLP_TIMEOUT`) with the exporter's retries inside
//! it; a batch that still fails is counted (`result="failed"`) and logged
//! once per outage. So a collector that is down, hangs or answers 500
//! costs spans, never a request.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, SpanData, SpanExporter, SpanProcessor,
};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::registry::LookupSpan;

use crate::config::TracingConfig;
use crate::metrics::metrics;

/// Spans waiting for export at most, unless `OTEL_BSP_MAX_QUEUE_SIZE`
/// says otherwise (the SDK's default): about a minute of a node's pulls
/// (a warm request makes two spans, a cold blob five or more).
pub const DEFAULT_QUEUE_LIMIT: usize = 2048;
/// How long the last export may take when larder stops; past it, the
/// spans still queued are lost and larder exits.
pub const SHUTDOWN_FLUSH_LIMIT: Duration = Duration::from_secs(2);

/// The export queue's limit: `OTEL_BSP_MAX_QUEUE_SIZE` when it is a
/// positive number, else [`DEFAULT_QUEUE_LIMIT`].
pub fn queue_limit(env: &dyn Fn(&str) -> Option<String>) -> usize {
    env("OTEL_BSP_MAX_QUEUE_SIZE").and_then(|v| v.trim().parse().ok()).filter(|n| *n > 0).unwrap_or(DEFAULT_QUEUE_LIMIT)
}

/// The export timeout: `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, else
/// `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds), else 10 s.
pub fn export_timeout(env: &dyn Fn(&str) -> Option<String>) -> Duration {
    ["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"]
        .iter()
        .find_map(|name| env(name)?.trim().parse::<u64>().ok())
        .map_or(opentelemetry_otlp::OTEL_EXPORTER_OTLP_TIMEOUT_DEFAULT, Duration::from_millis)
}

/// Keeps the tracer provider; [`Tracing::shutdown`] sends what is queued.
pub struct Tracing {
    provider: SdkTracerProvider,
}

impl Tracing {
    /// Exports the spans still queued, waiting at most
    /// [`SHUTDOWN_FLUSH_LIMIT`]. Call it off the runtime's threads, while
    /// the runtime still runs (the export is a task on it).
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown_with_timeout(SHUTDOWN_FLUSH_LIMIT) {
            tracing::warn!(error = %e, "traces: the last spans were not all exported");
        }
    }
}

/// Starts exporting spans when `config` names a collector: the layer to
/// add to the subscriber (it sees only spans of [`super::TARGET`], and
/// larder's warnings and errors as events on them), and the provider to
/// shut down at exit. `None` when tracing is off. Export requests run on
/// `runtime`.
#[allow(clippy::type_complexity)]
pub fn start<S>(
    config: &TracingConfig,
    runtime: tokio::runtime::Handle,
) -> Result<Option<(Box<dyn Layer<S> + Send + Sync>, Tracing)>, String>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    let Some(export) = &config.export else { return Ok(None) };
    let env = |name: &str| std::env::var(name).ok();
    let timeout = export_timeout(&env);
    let last_error = super::collector::LastError::default();
    let client =
        super::collector::CollectorClient::new(runtime, timeout, export.ca_file.as_deref(), last_error.clone())
            .map_err(|e| format!("tracing.ca_file: {e}"))?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(export.url.to_string())
        .with_timeout(timeout)
        .build()
        .map_err(|e| format!("the OTLP exporter for {}: {e}", export.url))?;
    let limit = queue_limit(&env);
    let queued = Arc::new(AtomicUsize::new(0));
    let exporter = Counted {
        inner: exporter,
        queued: Arc::clone(&queued),
        endpoint: export.url.to_string(),
        failing: AtomicBool::new(false),
        last_error,
    };
    let batch = BatchSpanProcessor::new(exporter, BatchConfigBuilder::default().with_max_queue_size(limit).build());
    let resource = Resource::builder()
        .with_service_name(config.service_name.clone())
        .with_attribute(opentelemetry::KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(Bounded { inner: batch, queued, limit })
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(config.sampling_ratio))))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("larder");
    let filter = Targets::new().with_target(super::TARGET, LevelFilter::TRACE).with_target("larder", LevelFilter::WARN);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_tracked_inactivity(false)
        .with_threads(false)
        .with_location(false)
        .with_target(false)
        .with_filter(filter)
        .boxed();
    super::ENABLED.store(true, Ordering::Relaxed);
    Ok(Some((layer, Tracing { provider })))
}

/// The batch processor behind a queue limit larder counts: a span past
/// the limit is dropped here (and counted) rather than in the SDK, whose
/// own count is not exposed. `queued` goes up here and down when a batch
/// leaves for the exporter, so the SDK's queue, of the same size, never
/// fills.
#[derive(Debug)]
struct Bounded {
    inner: BatchSpanProcessor,
    queued: Arc<AtomicUsize>,
    limit: usize,
}

impl SpanProcessor for Bounded {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.limit {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            metrics().trace_spans.with_label_values(&["dropped"]).inc();
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, counting what it exported or failed to, and saying
/// in the log when the collector stops taking spans (once) and when it
/// takes them again.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    queued: Arc<AtomicUsize>,
    endpoint: String,
    failing: AtomicBool,
    last_error: super::collector::LastError,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        self.queued.fetch_sub(n, Ordering::AcqRel);
        let result = self.inner.export(batch).await;
        let spans = &metrics().trace_spans;
        match &result {
            Ok(()) => {
                spans.with_label_values(&["exported"]).inc_by(n as u64);
                self.last_error.take();
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(endpoint = self.endpoint, "traces: the collector takes spans again");
                }
            }
            Err(e) => {
                spans.with_label_values(&["failed"]).inc_by(n as u64);
                let cause = self.last_error.take();
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        endpoint = self.endpoint,
                        error = %e,
                        cause = cause.as_deref().unwrap_or("-"),
                        spans = n,
                        "traces: export failed; spans are dropped until the collector answers \
                         (larder_trace_spans_total{{result=\"failed\"}})"
                    );
                }
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_limit_and_timeout_read_the_standard_variables() {
        let none = |_: &str| None;
        assert_eq!(queue_limit(&none), DEFAULT_QUEUE_LIMIT);
        assert_eq!(queue_limit(&|_: &str| Some("64".into())), 64);
        assert_eq!(queue_limit(&|_: &str| Some("0".into())), DEFAULT_QUEUE_LIMIT);
        assert_eq!(queue_limit(&|_: &str| Some("lots".into())), DEFAULT_QUEUE_LIMIT);
        assert_eq!(export_timeout(&none), Duration::from_secs(10));
        let both = |name: &str| match name {
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT" => Some("1500".to_owned()),
            _ => Some("3000".to_owned()),
        };
        assert_eq!(export_timeout(&both), Duration::from_millis(1500));
        assert_eq!(
            export_timeout(&|n: &str| (n == "OTEL_EXPORTER_OTLP_TIMEOUT").then(|| "3000".into())),
            Duration::from_secs(3)
        );
    }
}
