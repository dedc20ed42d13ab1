//! Traces in OpenTelemetry: the spans larder makes for a request, and the
//! W3C `traceparent` it continues and passes on.
//!
//! Spans are `tracing` spans of their own target, [`TARGET`], which only
//! the OpenTelemetry layer sees (the log's filter leaves them out, so log
//! lines read the same with tracing on or off); `tracing-opentelemetry`
//! turns them into OTLP spans and [`export`] sends them. They are made at
//! a few central points, each through a function here:
//!
//! | span | kind | where |
//! |---|---|---|
//! | `GET /v2/{name}/manifests/{reference}` … | server | the registry and peer listeners |
//! | `cache manifest`, `cache blob`, `cache tags`, `cache referrers` | internal | the cache decision (handlers) |
//! | `fill` | internal | a blob fill, in its own task |
//! | `GET`, `HEAD` | client | every request to an upstream: each redirect hop, each part of a parallel fill |
//! | `token` | internal | a token fetch (its `GET` inside) |
//! | `verify credentials` | internal | a check of a client's credentials with an upstream (its requests inside) |
//! | `GET`, `HEAD` to a peer | client | asks to a cluster owner |
//! | `shared get`, `shared head` | client | reads of the shared object store |
//!
//! With tracing off ([`enabled`] is false) every function here returns a
//! disabled span after one relaxed atomic load, and nothing is read from
//! or written to headers.

pub mod collector;
pub mod export;
mod propagation;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};

use http::{HeaderMap, Method, StatusCode, Uri};
use tracing::Span;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub use export::{Tracing, start};

/// The `tracing` target of every span meant for OpenTelemetry.
pub const TARGET: &str = "larder::otel";

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported (set once, at start-up, by [`start`]).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The method as a span may name it: the nine of RFC 9110, else `_OTHER`
/// (OpenTelemetry's word), so a client cannot put arbitrary text there.
fn method_name(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "_OTHER",
    }
}

/// The route template of an endpoint label (the registry listener's
/// metrics labels).
fn route_template(label: &str) -> Option<&'static str> {
    match label {
        "base" => Some("/v2/"),
        "manifest" => Some("/v2/{name}/manifests/{reference}"),
        "blob" => Some("/v2/{name}/blobs/{digest}"),
        "tags" => Some("/v2/{name}/tags/list"),
        "referrers" => Some("/v2/{name}/referrers/{digest}"),
        _ => None,
    }
}

/// Longest request path recorded on a span (longer ones are cut): as long
/// as the longest path the registry listener considers at all.
const MAX_RECORDED_PATH: usize = 2048;

fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The server span of a request on `listener` (`registry` or `peer`),
/// continuing the client's trace when its `traceparent` is valid;
/// `request_id` is its `X-Request-Id` (hex digits); `label_of_path` gives
/// a path's endpoint label (the listener's own routing, called only when
/// tracing is on, so this module does not depend on the server's).
pub fn server(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    (listener, label_of_path): (&'static str, fn(&str) -> &'static str),
    request_id: Option<&[u8]>,
) -> Span {
    if !enabled() {
        return Span::none();
    }
    let request_id = request_id.and_then(|id| std::str::from_utf8(id).ok());
    let path = uri.path();
    let method = method_name(method);
    let route = route_template(label_of_path(path));
    let name = match route {
        Some(route) => format!("{method} {route}"),
        None => method.to_owned(),
    };
    let span = tracing::info_span!(
        target: TARGET,
        parent: None,
        "request",
        otel.name = name.as_str(),
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = method,
        http.route = route,
        url.path = cut(path, MAX_RECORDED_PATH),
        http.response.status_code = Empty,
        larder.listener = listener,
        larder.request_id = request_id,
        larder.upstream = Empty,
        larder.repository = Empty,
        larder.cache = Empty,
        error.message = Empty,
    );
    let _ = span.set_parent(propagation::extract(headers));
    span
}

/// Names the upstream and repository a request was routed to.
pub fn route(span: &Span, upstream: &str, repository: &str) {
    if span.is_disabled() {
        return;
    }
    span.record("larder.upstream", upstream);
    span.record("larder.repository", repository);
}

/// Records the answer to a request: its status, the cache's verdict, and
/// the error a client was told, if any (a 5xx marks the span an error).
pub fn response(span: &Span, status: StatusCode, cache: Option<&str>, error: Option<&str>) {
    if span.is_disabled() {
        return;
    }
    span.record("http.response.status_code", status.as_u16());
    if let Some(cache) = cache {
        span.record("larder.cache", cache);
    }
    if let Some(error) = error {
        span.record("error.message", error);
    }
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
}

/// The cache's decision for one request: `what` is the endpoint label.
pub fn cache(what: &'static str) -> Span {
    if !enabled() {
        return Span::none();
    }
    let name = match what {
        "manifest" => "cache manifest",
        "blob" => "cache blob",
        "tags" => "cache tags",
        "referrers" => "cache referrers",
        _ => "cache",
    };
    tracing::info_span!(target: TARGET, "cache", otel.name = name, otel.kind = "internal", larder.cache = Empty, error.message = Empty)
}

/// The cache's verdict (`hit`, `miss`, `coalesced`, `stale`) or its error.
pub fn decided(span: &Span, result: Result<&str, &dyn std::fmt::Display>) {
    if span.is_disabled() {
        return;
    }
    match result {
        Ok(verdict) => span.record("larder.cache", verdict),
        Err(e) => span.record("error.message", tracing::field::display(e)),
    };
}

/// A blob fill, run in a task of its own: a child of the span that starts
/// it in the trace, but not in the log (its lines stay the fill's own).
pub fn fill(digest: &dyn std::fmt::Display, reason: &'static str, upstream: &str) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = tracing::info_span!(
        target: TARGET,
        parent: None,
        "fill",
        otel.kind = "internal",
        otel.status_code = Empty,
        larder.digest = tracing::field::display(digest),
        larder.fill.reason = reason,
        larder.upstream = upstream,
        larder.fill.size = Empty,
        error.message = Empty,
    );
    let _ = span.set_parent(opentelemetry::Context::current());
    span
}

/// How a fill ended: the blob's size, or why it failed.
pub fn filled(span: &Span, result: Result<u64, &dyn std::fmt::Display>) {
    if span.is_disabled() {
        return;
    }
    match result {
        Ok(size) => span.record("larder.fill.size", size),
        Err(e) => {
            span.record("error.message", tracing::field::display(e));
            span.record("otel.status_code", "error")
        }
    };
}

/// One HTTP request larder sends (to an upstream, a redirect target, a
/// token realm, or a peer: `peer` names the peer), with `traceparent`
/// and `tracestate` set on `headers` so the trace goes on there. The URL
/// is recorded without its query: a signed CDN URL's query is a credential.
pub fn client(method: &Method, uri: &Uri, headers: &mut HeaderMap, peer: Option<&str>) -> Span {
    if !enabled() {
        return Span::none();
    }
    let method = method_name(method);
    let url = format!(
        "{}://{}{}",
        uri.scheme_str().unwrap_or("http"),
        uri.authority().map_or("", |a| a.as_str()),
        uri.path()
    );
    let span = tracing::info_span!(
        target: TARGET,
        "client",
        otel.name = method,
        otel.kind = "client",
        otel.status_code = Empty,
        http.request.method = method,
        url.full = cut(&url, MAX_RECORDED_PATH),
        server.address = uri.host().unwrap_or_default(),
        server.port = uri.port_u16().unwrap_or(if uri.scheme_str() == Some("https") { 443 } else { 80 }),
        http.request.header.range = Empty,
        http.response.status_code = Empty,
        larder.peer = peer,
        error.message = Empty,
    );
    if let Some(range) = headers.get(http::header::RANGE).and_then(|r| r.to_str().ok()) {
        span.record("http.request.header.range", range);
    }
    propagation::inject(&span.context(), headers);
    span
}

/// The answer to a request [`client`] traced: its status, or why none came.
pub fn answered(span: &Span, result: Result<StatusCode, &dyn std::fmt::Display>) {
    if span.is_disabled() {
        return;
    }
    match result {
        Ok(status) => {
            span.record("http.response.status_code", status.as_u16());
            if status.is_server_error() {
                span.record("otel.status_code", "error");
            }
        }
        Err(e) => {
            span.record("error.message", tracing::field::display(e));
            span.record("otel.status_code", "error");
        }
    }
}

/// A token fetch from `realm` (without its query) for `scopes`.
pub fn token(realm: &Uri, service: Option<&str>, scopes: &mut dyn Iterator<Item = &str>) -> Span {
    if !enabled() {
        return Span::none();
    }
    let scope = scopes.collect::<Vec<_>>().join(" ");
    let realm = format!(
        "{}://{}{}",
        realm.scheme_str().unwrap_or("https"),
        realm.authority().map_or("", |a| a.as_str()),
        realm.path()
    );
    tracing::info_span!(
        target: TARGET,
        "token",
        otel.kind = "internal",
        larder.realm = realm.as_str(),
        larder.service = service,
        larder.scope = scope.as_str(),
    )
}

/// A check of a client's own credentials with `upstream`
/// (`client_credentials = "verify"`): its requests and token fetch inside.
pub fn verify(upstream: &str) -> Span {
    if !enabled() {
        return Span::none();
    }
    tracing::info_span!(
        target: TARGET,
        "verify",
        otel.name = "verify credentials",
        otel.kind = "internal",
        otel.status_code = Empty,
        larder.upstream = upstream,
        larder.verdict = Empty,
        error.message = Empty,
    )
}

/// A check's verdict (`granted`, `rejected`, `denied`, `not_found`) or
/// why there is none.
pub fn verified(span: &Span, result: Result<&'static str, &dyn std::fmt::Display>) {
    if span.is_disabled() {
        return;
    }
    match result {
        Ok(verdict) => span.record("larder.verdict", verdict),
        Err(e) => {
            span.record("error.message", tracing::field::display(e));
            span.record("otel.status_code", "error")
        }
    };
}

/// A read of the shared object store (`op`: `get`, `head`) of `key`.
pub fn shared(op: &'static str, key: &str) -> Span {
    if !enabled() {
        return Span::none();
    }
    let name = match op {
        "get" => "shared get",
        "head" => "shared head",
        _ => "shared",
    };
    tracing::info_span!(
        target: TARGET,
        "shared",
        otel.name = name,
        otel.kind = "client",
        otel.status_code = Empty,
        larder.shared.key = key,
        larder.shared.result = Empty,
    )
}

/// What a shared-store read found: `found`, `not_found` or `error`.
pub fn shared_result(span: &Span, result: &'static str) {
    if span.is_disabled() {
        return;
    }
    span.record("larder.shared.result", result);
    if result == "error" {
        span.record("otel.status_code", "error");
    }
}

/// `f`, run with the current trace context: for work spawned on a
/// request's behalf (a coalesced fetch, a fill, a token), so its spans
/// join the request's trace. With tracing off, `f` as it is.
pub fn follow<F: Future>(f: F) -> futures_util::future::Either<opentelemetry::context::WithContext<F>, F> {
    use opentelemetry::context::FutureExt as _;
    if enabled() {
        futures_util::future::Either::Left(f.with_current_context())
    } else {
        futures_util::future::Either::Right(f)
    }
}
