//! The HTTP client larder dials upstreams with: hyper-util's pooled client
//! over rustls (web PKI roots plus an optional CA file), ALPN h2/http1.1,
//! with the connect and response-header timeouts applied to every request.
//!
//! Two pools: one for the upstream's own origins (the operator named them),
//! one for hosts the upstream named (redirect targets, token realms), whose
//! connector dials only addresses [`super::dial`] allows.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tracing::Instrument;

use super::dial::{DialPolicy, GuardedConnector};
use crate::config::UpstreamConfig;
use crate::error::UpstreamError;

/// How long an idle pooled upstream connection is kept.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// HTTP/2 flow-control windows towards upstreams. Upstreams are far away
/// and speak h2 over TLS, and one blob can never go faster than its stream
/// window per round trip: hyper's default (2 MiB) pulled a 64 MiB blob over
/// a 100 ms RTT in 3.9 s, its adaptive window in 2.3 s, 16 MiB in 0.69 s
/// (benches/README.md, "HTTP/2 windows"). The connection window bounds what
/// one upstream connection can buffer in larder when the disk stalls.
const UPSTREAM_H2_STREAM_WINDOW: u32 = 16 << 20;
const UPSTREAM_H2_CONNECTION_WINDOW: u32 = 32 << 20;

/// Who named the host a request goes to, which decides the pool it uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Named {
    /// The operator: one of the upstream's `url`/`urls`.
    ByOperator,
    /// The upstream: a redirect target or a token realm, dialled only at
    /// addresses [`super::dial::DialPolicy`] allows.
    ByUpstream,
}

#[derive(Clone)]
pub struct HttpClient {
    upstream: Arc<str>,
    own: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
    guarded: Client<HttpsConnector<GuardedConnector>, Empty<Bytes>>,
    response_timeout: Duration,
    body_idle_timeout: Duration,
}

impl HttpClient {
    pub fn new(config: &UpstreamConfig, policy: Arc<DialPolicy>) -> Result<HttpClient, String> {
        let tls = client_tls(config.ca_file.as_deref())?;
        let connect_timeout = Some(config.connect_timeout);
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(connect_timeout);
        let guarded = GuardedConnector::new(policy, |http| {
            http.enforce_http(false);
            http.set_nodelay(true);
            http.set_connect_timeout(connect_timeout);
        });
        Ok(HttpClient {
            upstream: config.name.as_str().into(),
            own: pooled(https(tls.clone(), http)),
            guarded: pooled(https(tls, guarded)),
            response_timeout: config.response_timeout,
            body_idle_timeout: config.body_idle_timeout,
        })
    }

    /// The upstream's `response_timeout`.
    pub fn response_timeout(&self) -> Duration {
        self.response_timeout
    }

    pub fn body_idle_timeout(&self) -> Duration {
        self.body_idle_timeout
    }

    /// Sends a request to a host named by `named` and waits for the
    /// response headers, at most the configured response timeout. A dial
    /// refused by the guard is counted and logged here. With tracing on,
    /// the request is a client span and carries its `traceparent`.
    pub async fn send(&self, req: Request<Empty<Bytes>>, named: Named) -> Result<Response<Incoming>, UpstreamError> {
        let (mut head, body) = req.into_parts();
        let trace = crate::otel::client(&head.method, &head.uri, &mut head.headers, None);
        let sent = self.send_traced(Request::from_parts(head, body), named).instrument(trace.clone()).await;
        match &sent {
            Ok(resp) => crate::otel::answered(&trace, Ok(resp.status())),
            Err(e) => crate::otel::answered(&trace, Err(e)),
        }
        sent
    }

    async fn send_traced(&self, req: Request<Empty<Bytes>>, named: Named) -> Result<Response<Incoming>, UpstreamError> {
        let sent = match named {
            Named::ByOperator => tokio::time::timeout(self.response_timeout, self.own.request(req)).await,
            Named::ByUpstream => tokio::time::timeout(self.response_timeout, self.guarded.request(req)).await,
        };
        match sent {
            Err(_) => Err(UpstreamError::Timeout("response headers")),
            Ok(Err(e)) => {
                if let Some(refused) = super::dial::refusal_in(&e) {
                    return Err(self.refused(refused.class.label(), &refused.to_string()));
                }
                match e.is_connect() {
                    true => Err(UpstreamError::Connect(error_chain(&e))),
                    false => Err(UpstreamError::Protocol(error_chain(&e))),
                }
            }
            Ok(Ok(resp)) => Ok(resp),
        }
    }

    /// Counts and logs a refused redirect target or realm (`reason` is a
    /// label of `larder_upstream_redirects_refused_total`), and returns the
    /// error the client gets.
    pub fn refused(&self, reason: &'static str, why: &str) -> UpstreamError {
        crate::metrics::metrics().upstream_redirects_refused.with_label_values(&[reason]).inc();
        tracing::warn!(upstream = %self.upstream, reason, why, "refused to follow the upstream");
        UpstreamError::Refused { reason }
    }

    /// Reads a whole (small) body, refusing more than `limit` bytes and
    /// pauses longer than the body idle timeout.
    pub async fn read_body(&self, body: Incoming, limit: usize) -> Result<Bytes, UpstreamError> {
        let mut body = Limited::new(body, limit);
        let mut out = bytes::BytesMut::new();
        loop {
            match tokio::time::timeout(self.body_idle_timeout, body.frame()).await {
                Err(_) => return Err(UpstreamError::Timeout("response body")),
                Ok(None) => return Ok(out.freeze()),
                Ok(Some(Err(e))) => {
                    return Err(UpstreamError::Protocol(format!("reading body (limit {limit} bytes): {e}")));
                }
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        out.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

fn https<C>(tls: rustls::ClientConfig, connector: C) -> HttpsConnector<C> {
    hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(connector)
}

fn pooled<C>(connector: HttpsConnector<C>) -> Client<HttpsConnector<C>, Empty<Bytes>>
where
    C: tower_service::Service<http::Uri> + Clone + Send + Sync + 'static,
    C::Response: hyper::rt::Read + hyper::rt::Write + hyper_util::client::legacy::connect::Connection + Send + Unpin,
    C::Future: Send + Unpin + 'static,
    C::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .http2_initial_stream_window_size(UPSTREAM_H2_STREAM_WINDOW)
        .http2_initial_connection_window_size(UPSTREAM_H2_CONNECTION_WINDOW)
        .build(connector)
}

/// The TLS settings larder dials with (upstreams, peers): the web PKI
/// roots, plus the PEM certificates in `ca_file` (reads it: call it off the
/// async threads).
pub fn client_tls(ca_file: Option<&std::path::Path>) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut added = 0;
        for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
            let cert = cert.map_err(|e| format!("{}: {e}", path.display()))?;
            roots.add(cert).map_err(|e| format!("{}: {e}", path.display()))?;
            added += 1;
        }
        if added == 0 {
            return Err(format!("{}: no PEM certificates found", path.display()));
        }
    }
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// An error and its sources on one line ("tcp connect error: Connection
/// refused (os error 111)"). hyper-util's client error says only which
/// step failed, as Rust's `Debug` of its kind ("client error (Connect)"):
/// when it has a source, the source says more, and it is left out.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = Vec::new();
    let mut current = Some(e);
    while let Some(error) = current {
        let wrapper = error.is::<hyper_util::client::legacy::Error>() && error.source().is_some();
        if !wrapper {
            parts.push(error.to_string());
        }
        current = error.source();
    }
    parts.join(": ")
}
