//! One small function per endpoint: ask the cache facade, build the response.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{ACCEPT_RANGES, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, LINK, RANGE};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, Uri};

use super::range::ByteRange;
use super::routes::Route;
use crate::body::{self, Body};
use crate::cache::fill::{read_body, wait_for_headers};
use crate::cache::{BlobSource, CacheResult, StoredManifest, Via};
use crate::error::Error;
use crate::oci::headers::{API_VERSION, API_VERSION_V2, DOCKER_CONTENT_DIGEST, WARNING};
use crate::oci::{Accept, Digest, Reference};
use crate::sendfile::FileSink;
use crate::state::App;
use crate::upstream::Listing;

const OCTET_STREAM: HeaderValue = HeaderValue::from_static("application/octet-stream");
const BYTES: HeaderValue = HeaderValue::from_static("bytes");

fn response(status: StatusCode) -> http::response::Builder {
    Response::builder().status(status).header(API_VERSION, API_VERSION_V2)
}

fn built(r: Result<Response<Body>, http::Error>) -> Result<Response<Body>, Error> {
    r.map_err(|e| Error::Internal(format!("building response: {e}")))
}

/// `GET /v2/`: the API version check.
pub fn base(method: &Method) -> Result<Response<Body>, Error> {
    let body = if method == Method::HEAD { body::empty() } else { body::full(Bytes::from_static(b"{}")) };
    built(response(StatusCode::OK).header(CONTENT_TYPE, "application/json").header(CONTENT_LENGTH, 2).body(body))
}

/// When a client's request must have its response headers: its
/// `server.manifest_deadline` from its arrival, set by the registry
/// listener before anything else is waited for (a check of the client's
/// credentials with upstream included). A request without it (a peer's)
/// counts from when its handler starts.
#[derive(Clone, Copy, Debug)]
pub struct Deadline(pub tokio::time::Instant);

/// The address a client's request came from (put in the request's
/// extensions by the listener's request handler).
#[derive(Clone, Copy, Debug)]
pub struct ClientAddr(pub std::net::IpAddr);

/// `GET/HEAD /v2/<name>/manifests/<reference>`; where a client's request
/// came from is its [`ClientAddr`] extension.
pub async fn manifest(
    app: &App,
    route: &Route,
    reference: &Reference,
    method: &Method,
    request: &http::request::Parts,
) -> Result<(Response<Body>, CacheResult), Error> {
    let headers = &request.headers;
    let client = request.extensions.get::<ClientAddr>().map(|c| c.0);
    // Headers within `server.manifest_deadline` of the request, whatever
    // upstream does (containerd 2.3 gives up on a response at 30 s).
    let deadline = match request.extensions.get::<Deadline>() {
        Some(Deadline(at)) => *at,
        None => tokio::time::Instant::now() + app.config.server.manifest_deadline,
    };
    let (m, result) = app.cache.manifest_by(&route.upstream, &route.repo, reference, route.via, deadline).await?;
    // A client that only speaks Docker v2 must never get an OCI index it
    // cannot read (distribution answers MANIFEST_UNKNOWN there too). By
    // digest, the client asked for exactly these bytes.
    if matches!(reference, Reference::Tag(_)) && !Accept::from_headers(headers).allows(m.media_type) {
        return Err(Error::NotAcceptable);
    }
    // Remembered, not downloaded: the image's layers start ahead of this
    // client only once it asks for one of them (many clients only look).
    if let (true, Via::Client, Some(client)) = (method == Method::GET, route.via, client) {
        app.cache.resolved(&route.upstream, &route.repo, client, &m);
    }
    // A peer keeps the tag as long as this owner would: from when upstream
    // last confirmed it, not from now.
    let confirmed = match (route.via, reference) {
        (Via::Peer { .. }, Reference::Tag(tag)) => app.cache.tag_confirmed(route.upstream.name(), &route.repo, tag),
        _ => None,
    };
    Ok((manifest_response(&m, method == Method::HEAD, confirmed)?, result))
}

/// A manifest as served: its exact bytes (none for `HEAD`) and headers,
/// upstream's registry warnings among them (`GET` and `HEAD` alike:
/// containerd reports the ones of the `HEAD` that resolves a tag); with
/// `confirmed`, when upstream last confirmed the tag asked for (for a peer).
pub fn manifest_response(
    m: &StoredManifest,
    head: bool,
    confirmed: Option<std::time::SystemTime>,
) -> Result<Response<Body>, Error> {
    let body = if head {
        body::empty()
    } else {
        crate::metrics::served_from_memory(m.bytes.len() as u64);
        body::full(m.bytes.clone())
    };
    let mut resp = response(StatusCode::OK)
        .header(CONTENT_TYPE, m.content_type.clone())
        .header(CONTENT_LENGTH, m.content_length.clone())
        .header(DOCKER_CONTENT_DIGEST, m.digest_header.clone())
        .header(http::header::ETAG, m.etag.clone());
    if let Some(confirmed) = confirmed {
        let ms = confirmed.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        resp = resp.header(crate::cluster::client::TAG_CONFIRMED_HEADER, ms);
    }
    for warning in m.warnings.iter() {
        resp = resp.header(WARNING, warning.clone());
    }
    built(resp.body(body))
}

/// `GET/HEAD /v2/<name>/blobs/<digest>`, with `Range`; with a `sink`, the
/// connection can send the blob's cached bytes with sendfile; `client`:
/// where a client's request came from.
pub async fn blob(
    app: &Arc<App>,
    route: &Route,
    digest: Digest,
    (method, headers): (&Method, &HeaderMap),
    (sink, client): (Option<&FileSink>, Option<std::net::IpAddr>),
) -> Result<(Response<Body>, CacheResult), Error> {
    let range = headers.get(RANGE).and_then(ByteRange::requested);
    if method == Method::HEAD {
        return blob_head(app, route, digest).await;
    }
    let (source, result) = app.cache.blob_via(&route.upstream, &route.repo, digest, route.via).await?;
    // A pull, not a look: the first layer this client asks for of an image
    // it resolved starts the fills of the image's other layers.
    if let (Via::Client, Some(client)) = (route.via, client) {
        app.cache.layer_requested(&route.upstream, &route.repo, client, digest);
    }
    let (file, size, progress) = match source {
        BlobSource::Committed { file, size } => (file, Some(size), None),
        BlobSource::Filling(mut rx) => {
            let (file, size) = wait_for_headers(&mut rx).await?;
            (file, size, Some(rx))
        }
    };
    let builder = response(StatusCode::OK)
        .header(CONTENT_TYPE, OCTET_STREAM)
        .header(DOCKER_CONTENT_DIGEST, digest.header_value())
        .header(ACCEPT_RANGES, BYTES)
        .header(http::header::ETAG, digest.etag());
    // Without a known size (upstream sent no Content-Length) a Range cannot
    // be resolved before the fill ends; RFC 9110 lets a server ignore Range,
    // so the whole blob is sent.
    let resp = match (range, size) {
        (Some(range), Some(size)) => {
            let (start, end) = range.ok().and_then(|r| r.resolve(size)).ok_or(Error::RangeNotSatisfiable { size })?;
            builder
                .status(StatusCode::PARTIAL_CONTENT)
                .header(CONTENT_RANGE, format!("bytes {start}-{}/{size}", end - 1))
                .header(CONTENT_LENGTH, end - start)
                .body(read_body(file, progress, start, Some(end), route.via, sink.cloned()))
        }
        (_, Some(size)) => builder.header(CONTENT_LENGTH, size).body(read_body(
            file,
            progress,
            0,
            Some(size),
            route.via,
            sink.cloned(),
        )),
        // Chunked: hyper frames each chunk, so no placeholders there.
        (_, None) => builder.body(read_body(file, progress, 0, None, route.via, None)),
    };
    Ok((built(resp)?, result))
}

/// `HEAD` of a blob: answered from the cache, or by a `HEAD` upstream; it
/// never starts a fill.
async fn blob_head(app: &App, route: &Route, digest: Digest) -> Result<(Response<Body>, CacheResult), Error> {
    // Upstream's HEAD may carry no length: then none is sent (a
    // `Content-Length: 0` would claim an empty blob).
    let (size, result) = app.cache.head_blob(&route.upstream, &route.repo, &digest, route.via).await?;
    let mut builder = response(StatusCode::OK)
        .header(CONTENT_TYPE, OCTET_STREAM)
        .header(DOCKER_CONTENT_DIGEST, digest.header_value())
        .header(ACCEPT_RANGES, BYTES);
    if let Some(size) = size {
        builder = builder.header(CONTENT_LENGTH, size);
    }
    let resp = builder.body(body::empty());
    Ok((built(resp)?, result))
}

/// `GET /v2/<name>/tags/list` and `GET /v2/<name>/referrers/<digest>`:
/// forwarded with the pagination (and `artifactType`) parameters.
pub async fn listing(
    app: &App,
    route: &Route,
    listing: &Listing,
    query: Option<&str>,
    method: &Method,
    uri: &Uri,
) -> Result<(Response<Body>, CacheResult), Error> {
    let (page, result) = app.cache.listing(&route.upstream, &route.repo, listing, query, route.via).await?;
    let mut builder = response(StatusCode::OK)
        .header(CONTENT_TYPE, page.content_type.clone())
        .header(CONTENT_LENGTH, page.body.len());
    if let Some(link) = page.link.as_ref().and_then(|l| next_page_link(l, uri)) {
        builder = builder.header(LINK, link);
    }
    if let Some(filters) = page.filters_applied {
        builder = builder.header("OCI-Filters-Applied", filters);
    }
    let body = if method == Method::HEAD { body::empty() } else { body::full(page.body) };
    Ok((built(builder.body(body))?, result))
}

/// Upstream's `Link: </v2/<repo>/tags/list?n=…&last=…>; rel="next"` names
/// upstream's path; the client needs its own (path prefix, `ns`), with the
/// upstream's pagination (and filter) parameters.
fn next_page_link(link: &HeaderValue, uri: &Uri) -> Option<HeaderValue> {
    let link = link.to_str().ok()?;
    let (target, rest) = link.trim_start().strip_prefix('<')?.split_once('>')?;
    let mut query = form_urlencoded::Serializer::new(String::new());
    if let Some((_, upstream_query)) = target.split_once('?') {
        for (k, v) in form_urlencoded::parse(upstream_query.as_bytes()) {
            if k == "n" || k == "last" || k == "artifactType" {
                query.append_pair(&k, &v);
            }
        }
    }
    if let Some(client_query) = uri.query() {
        for (k, v) in form_urlencoded::parse(client_query.as_bytes()) {
            if k == "ns" {
                query.append_pair(&k, &v);
            }
        }
    }
    HeaderValue::from_str(&format!("<{}?{}>{rest}", uri.path(), query.finish())).ok()
}

/// Dispatches a parsed route to its handler; the cache's decision (the
/// handler's whole run) is the request's `cache` span in a trace.
pub async fn route(
    app: &Arc<App>,
    route: Route,
    request: &http::request::Parts,
) -> Result<(Response<Body>, Option<CacheResult>), Error> {
    use tracing::Instrument;
    let trace = crate::otel::cache(route.endpoint.label());
    let decided = answer(app, &route, request).instrument(trace.clone()).await;
    match &decided {
        Ok((_, Some(c))) => crate::otel::decided(&trace, Ok(c.as_str())),
        Ok((_, None)) => {}
        Err(e) => crate::otel::decided(&trace, Err(e)),
    }
    decided
}

async fn answer(
    app: &Arc<App>,
    route: &Route,
    request: &http::request::Parts,
) -> Result<(Response<Body>, Option<CacheResult>), Error> {
    use super::routes::Endpoint;
    let (method, headers, uri) = (&request.method, &request.headers, &request.uri);
    let client = request.extensions.get::<ClientAddr>().map(|c| c.0);
    match &route.endpoint {
        Endpoint::Manifest(reference) => {
            let (r, c) = manifest(app, route, reference, method, request).await?;
            Ok((r, Some(c)))
        }
        Endpoint::Blob(digest) => {
            let sink = request.extensions.get::<FileSink>();
            let (r, c) = blob(app, route, *digest, (method, headers), (sink, client)).await?;
            Ok((r, Some(c)))
        }
        Endpoint::TagsList(query) => {
            let (r, c) = listing(app, route, &Listing::Tags, query.as_deref(), method, uri).await?;
            Ok((r, Some(c)))
        }
        Endpoint::Referrers(digest, query) => {
            let (r, c) = listing(app, route, &Listing::Referrers(*digest), query.as_deref(), method, uri).await?;
            Ok((r, Some(c)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_page_links_follow_the_client_path() {
        let upstream = HeaderValue::from_static("</v2/team/app/tags/list?last=v2&n=2>; rel=\"next\"");
        let prefixed: Uri = "/v2/origin.test/team/app/tags/list?n=2".parse().unwrap();
        assert_eq!(
            next_page_link(&upstream, &prefixed).unwrap(),
            "</v2/origin.test/team/app/tags/list?last=v2&n=2>; rel=\"next\""
        );
        let with_ns: Uri = "/v2/team/app/tags/list?n=2&ns=ghcr.io".parse().unwrap();
        assert_eq!(
            next_page_link(&upstream, &with_ns).unwrap(),
            "</v2/team/app/tags/list?last=v2&n=2&ns=ghcr.io>; rel=\"next\""
        );
        assert!(next_page_link(&HeaderValue::from_static("garbage"), &with_ns).is_none());
    }
}
