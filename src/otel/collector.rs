//! The HTTP client spans are exported with: hyper-util's pooled client
//! over rustls (the web PKI roots plus `[tracing] ca_file`), the same
//! stack larder dials upstreams with, running on larder's own runtime.
//!
//! The OTLP exporter calls it from the batch processor's thread, which is
//! not a runtime thread: each request runs as a task on the runtime and
//! the thread waits for it, at most the export timeout. It dials only the
//! configured endpoint's host and follows no redirect.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_http::{HttpClient, HttpError};

/// Largest answer read from a collector (an OTLP answer is a few bytes,
/// or a partial-success message).
const MAX_ANSWER: usize = 64 << 10;
/// How long an idle connection to the collector is kept: longer than the
/// batch delay, so exports reuse one connection.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

pub struct CollectorClient {
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
    /// Why the last request failed, for the log: the exporter reports
    /// every failure to connect as "network error".
    last_error: LastError,
}

/// The last error of a [`CollectorClient`], shared with whoever logs it.
#[derive(Clone, Default, Debug)]
pub struct LastError(std::sync::Arc<std::sync::Mutex<Option<String>>>);

impl LastError {
    fn set(&self, e: &str) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_owned());
    }

    /// The last error, taken (so an old one is not reported again).
    pub fn take(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl fmt::Debug for CollectorClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CollectorClient").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

impl CollectorClient {
    /// A client whose requests run on `runtime` and end after `timeout`
    /// (connect, answer and body together). Reads `ca_file`.
    pub fn new(
        runtime: tokio::runtime::Handle,
        timeout: Duration,
        ca_file: Option<&std::path::Path>,
        last_error: LastError,
    ) -> Result<CollectorClient, String> {
        let tls = crate::upstream::client_tls(ca_file)?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(timeout));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        let http = Client::builder(TokioExecutor::new()).pool_idle_timeout(POOL_IDLE_TIMEOUT).build(https);
        Ok(CollectorClient { http, runtime, timeout, last_error })
    }
}

#[async_trait::async_trait]
impl HttpClient for CollectorClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (http, timeout) = (self.http.clone(), self.timeout);
        let request = request.map(Full::new);
        let exchange = async move {
            let response = http.request(request).await.map_err(|e| crate::upstream::error_chain(&e))?;
            let (parts, body) = response.into_parts();
            let body =
                Limited::new(body, MAX_ANSWER).collect().await.map_err(|e| format!("reading the answer: {e}"))?;
            Ok::<_, String>(Response::from_parts(parts, body.to_bytes()))
        };
        let task = self.runtime.spawn(async move {
            match tokio::time::timeout(timeout, exchange).await {
                Ok(answer) => answer,
                Err(_) => Err(format!("no answer within {}", humantime::format_duration(timeout))),
            }
        });
        let answer = match task.await {
            Ok(answer) => answer,
            Err(e) => Err(format!("the export task ended: {e}")),
        };
        answer.map_err(|e| {
            self.last_error.set(&e);
            HttpError::from(e)
        })
    }
}
