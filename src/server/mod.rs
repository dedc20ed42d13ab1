//! The registry API listener: HTTP/1.1 and cleartext HTTP/2 on one port
//! (hyper-util's builders, the version told apart in
//! [`listener::serve_maybe_tls`]), one task per connection.

pub mod access_log;
pub mod admin;
pub mod handlers;
pub mod http1;
pub mod listener;
pub mod peer;
pub mod range;
pub mod reload;
pub mod routes;
pub mod tls;
pub mod watchdog;

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tracing::Instrument;

use crate::body::Body;
use crate::error::Error;
use crate::metrics::metrics;
use crate::policy::ClientIdentity;
use crate::shutdown::Shutdown;
use crate::state::App;
use routes::Parsed;

/// Time a client has to send a request's headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Time a client has to complete the TLS handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 streams a client may have open on one connection.
pub const MAX_CONCURRENT_STREAMS: u32 = 256;

/// Accepts connections until `shutdown` fires, then drains the open ones
/// for at most `grace`.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    tls: Option<TlsAcceptor>,
    mut shutdown: Shutdown,
    grace: Duration,
) {
    let builders = Arc::new(listener::Builders::new(app.config.server.sendfile));
    let stop = shutdown.clone();
    let graceful = GracefulShutdown::new();
    let max_connections = app.config.server.max_connections;
    listener::accept_loop(&listener, max_connections, &mut shutdown, "registry", |stream, peer| {
        let (app, builders, watcher, tls) = (Arc::clone(&app), Arc::clone(&builders), graceful.watcher(), tls.clone());
        let stop = stop.clone();
        async move {
            // The client's address: client authentication bounds its bcrypt queue per address.
            let handler = move |req| handle(Arc::clone(&app), req, peer.ip());
            let served = listener::serve_maybe_tls(&builders, stream, tls, Some(watcher), stop, handler).await;
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        }
    })
    .await;
    drop(listener);
    let stopped = Instant::now();
    tracing::info!(grace_secs = grace.as_secs_f64(), "stopped accepting; draining connections");
    match tokio::time::timeout(grace, graceful.shutdown()).await {
        Ok(()) => tracing::info!("all connections drained"),
        Err(_) => tracing::warn!("grace period over; closing the remaining connections"),
    }
    // What is left of the grace goes to the fills still committing blobs
    // clients already have (or still streaming for nobody).
    let left = app.cache.finish_fills(grace.saturating_sub(stopped.elapsed())).await;
    if left > 0 {
        tracing::warn!(fills = left, "grace period over; fills in flight are abandoned (nothing of them is kept)");
    }
}

/// Routes a request, runs its handler, maps any error to its OCI response,
/// records metrics and logs one line.
/// Every log line of a request carries its id (also sent back as
/// `X-Request-Id`), so one pull can be followed through the logs.
/// Every response to a request with `?ns=` carries it back in
/// `OCI-Namespace`, errors included.
/// `peer` is the client's address (the connection's source).
pub async fn handle(app: Arc<App>, req: Request<Incoming>, peer: std::net::IpAddr) -> Response<Body> {
    let id = RequestId(rand::random());
    let span = tracing::info_span!("request", id = %id);
    let hex = id.hex();
    let namespace = routes::namespace_echo(req.uri());
    let trace =
        crate::otel::server(req.method(), req.uri(), req.headers(), ("registry", routes::label_of_path), Some(&hex));
    // Boxed where it is made: the request's state machine (every handler
    // and cache path inline, about 10 KiB) was otherwise copied whole each
    // time it moved (into `instrument`, into this future, into hyper's
    // slot): `memmove` was 5.3 % of larder's samples on a warm manifest
    // GET, the largest user-space entry (issue 35, benches/README.md).
    let mut resp =
        Box::pin(handle_request(app, req, &hex, peer, &trace)).instrument(trace.clone()).instrument(span).await;
    if let Ok(value) = http::HeaderValue::from_bytes(&hex) {
        resp.headers_mut().insert("x-request-id", value);
    }
    if let Some(ns) = namespace {
        resp.headers_mut().insert(crate::oci::headers::OCI_NAMESPACE, ns);
    }
    resp
}

/// With `[[server.auth.grant]]`s, a client pulls only what some grant
/// gives it: its htpasswd `user` or its client certificate's names (put in
/// the request's extensions by the TLS listener) must be named by a grant
/// of the route's upstream and repository. Checked before the handler,
/// so before any cache read or dial.
fn check_grants(
    app: &App,
    extensions: &http::Extensions,
    user: Option<String>,
    route: &routes::Route,
) -> Result<(), crate::error::Error> {
    let grants = &app.config.server.grants;
    if grants.is_empty() {
        return Ok(());
    }
    let mut client = extensions.get::<ClientIdentity>().cloned().unwrap_or_default();
    client.user = user;
    if crate::policy::granted(grants, &client, route.upstream.name(), &route.repo) {
        return Ok(());
    }
    metrics().grant_denied.with_label_values(&[route.upstream.name()]).inc();
    tracing::info!(
        user = client.user_text(),
        certificate = %client.certificate_text(),
        upstream = route.upstream.name(),
        repo = %route.repo,
        "no grant for this client"
    );
    Err(crate::error::Error::Denied(format!(
        "no grant gives this client repository {:?} of upstream {:?}",
        route.repo.as_str(),
        route.upstream.name()
    )))
}

/// Parses the route and decides whether this client may have it, before
/// any cache read or dial: the upstream's policy (in the parse), the
/// grants, then, for an upstream with `client_credentials = "verify"`,
/// the client's own credentials checked with that upstream. `GET /v2/`
/// challenges a client without credentials when any upstream verifies, so
/// that skopeo, podman and dockerd (which send credentials only where
/// `/v2/` asked for them) send theirs. The request's trace span `trace`
/// names the route's upstream and repository once parsed, refused or not.
async fn authorize(
    app: &App,
    parts: &http::request::Parts,
    user: Option<String>,
    peer: std::net::IpAddr,
    trace: &tracing::Span,
    deadline: tokio::time::Instant,
) -> (&'static str, Result<Parsed, crate::error::Error>) {
    let parsed = match routes::parse(&parts.method, &parts.uri, &app.upstreams) {
        Ok(parsed) => parsed,
        Err(e) => return ("invalid", Err(e)),
    };
    match &parsed {
        Parsed::Repo(route) => {
            let label = route.endpoint.label();
            crate::otel::route(trace, route.upstream.name(), route.repo.as_str());
            if let Err(e) = check_grants(app, &parts.extensions, user, route) {
                return (label, Err(e));
            }
            let probe = match &route.endpoint {
                routes::Endpoint::Manifest(r) => crate::upstream::Probe::Manifest(r.clone()),
                routes::Endpoint::Blob(d) => crate::upstream::Probe::Blob(*d),
                routes::Endpoint::TagsList(_) => crate::upstream::Probe::Tags,
                routes::Endpoint::Referrers(d, _) => crate::upstream::Probe::Referrers(*d),
            };
            if let Err(e) = route.upstream.verify_client(&parts.headers, &route.repo, probe, peer, deadline).await {
                return (label, Err(e));
            }
        }
        Parsed::Base => {
            let verifying = app.config.upstreams.iter().any(|u| u.client_credentials.verifies());
            if verifying && !parts.headers.contains_key(http::header::AUTHORIZATION) {
                return (
                    "base",
                    Err(crate::error::Error::CredentialsRequired {
                        realm: "larder".to_owned(),
                        message: "this mirror serves some registries only to clients those registries accept: \
                                  send your credentials for them (HTTP Basic)"
                            .to_owned(),
                    }),
                );
            }
        }
    }
    ("base", Ok(parsed))
}

/// A request's id: 16 hex digits in its log span and its `X-Request-Id`,
/// formatted where each needs it, with no `String` of its own.
#[derive(Clone, Copy)]
struct RequestId(u64);

impl RequestId {
    fn hex(self) -> [u8; 16] {
        let mut out = [0u8; 16];
        hex::encode_to_slice(self.0.to_be_bytes(), &mut out).expect("8 bytes are 16 hex digits");
        out
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// `id`: the request's id as its 16 hex digits.
/// `trace`: the request's OpenTelemetry span (disabled when tracing is off).
async fn handle_request(
    app: Arc<App>,
    req: Request<Incoming>,
    id: &[u8; 16],
    peer: std::net::IpAddr,
    trace: &tracing::Span,
) -> Response<Body> {
    let started = Instant::now();
    // Response headers go out within `server.manifest_deadline` of the
    // request: a check of the client's credentials with upstream counts
    // against it, and a manifest's fetch gets what is left.
    let deadline = tokio::time::Instant::now() + app.config.server.manifest_deadline;
    let (mut parts, _body) = req.into_parts();
    parts.extensions.insert(handlers::Deadline(deadline));
    parts.extensions.insert(handlers::ClientAddr(peer));
    let head = parts.method == http::Method::HEAD;
    let user = match &app.auth {
        Some(auth) => auth.check(&parts.headers, peer).await.map(Some),
        None => Ok(None),
    };
    let (label, parsed) = match user {
        Ok(user) => authorize(&app, &parts, user, peer, trace, deadline).await,
        Err(e) => ("invalid", Err(e)),
    };
    let (route, outcome) = match parsed {
        Ok(Parsed::Base) => ("base", handlers::base(&parts.method).map(|r| (r, None))),
        Ok(Parsed::Repo(route)) => (route.endpoint.label(), handlers::route(&app, route, &parts).await),
        // Refused for who asks (policy, grants, password, the client's
        // credentials upstream): the route is valid, and its status says
        // it was denied. Routes parsed before the refusal have their label.
        Err(e @ (Error::Denied(_) | Error::Unauthorized { .. } | Error::TooManyRequests { .. }))
            if label == "invalid" =>
        {
            (routes::label_of_path(parts.uri.path()), Err(e))
        }
        Err(e) => (label, Err(e)),
    };
    let (resp, cache, error) = match outcome {
        Ok((resp, cache)) => (resp, cache, None),
        Err(e) => {
            let message = e.to_string();
            (e.into_response(head), None, Some(message))
        }
    };
    let elapsed = started.elapsed();
    crate::otel::response(trace, resp.status(), cache.map(|c| c.as_str()), error.as_deref());
    let method = match parts.method {
        http::Method::GET => "GET",
        http::Method::HEAD => "HEAD",
        _ => "other",
    };
    crate::metrics::count_request(route, method, resp.status(), elapsed.as_secs_f64(), cache.map(|c| c.as_str()));
    // The body is still to be sent: its length is what will be sent, unless
    // the connection is aborted (a failed fill) or the client goes away.
    let bytes = resp.headers().get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    access_log::log(&access_log::Line {
        id: std::str::from_utf8(id).unwrap_or_default(),
        method: parts.method.as_str(),
        path: parts.uri.path(),
        route,
        status: resp.status().as_u16(),
        bytes,
        cache: cache.map(|c| c.as_str()),
        error: error.as_deref(),
        ms: elapsed.as_millis() as u64,
    });
    resp
}

#[cfg(test)]
mod tests {
    use super::RequestId;

    #[test]
    fn a_request_id_reads_the_same_in_the_header_and_in_the_log() {
        for id in [0, 0xf, 0x0123_4567_89ab_cdef, u64::MAX] {
            let id = RequestId(id);
            assert_eq!(std::str::from_utf8(&id.hex()).unwrap(), id.to_string());
        }
        assert_eq!(&RequestId(0x0123_4567_89ab_cdef).hex(), b"0123456789abcdef");
        assert_eq!(&RequestId(0xf).hex(), b"000000000000000f");
    }
}
