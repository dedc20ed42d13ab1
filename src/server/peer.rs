//! The peer listener: what this replica answers the others. It is its own
//! listener (`[cluster] listen`, outside the client-facing Service), with
//! the registry listener's limits, and it serves only what an owner is
//! asked for: manifests and blobs by `GET`/`HEAD` on the registry paths,
//! for an upstream named by its configured name in `?ns=`; and another
//! replica's purge (`POST /larder/purge`).
//!
//! Every request must carry the cluster secret (compared in constant
//! time); without it the answer is 401 and nothing is looked up or
//! fetched. A request is served as [`Via::Peer`]: from this replica's
//! cache, the shared tier or upstream, never forwarded to another peer,
//! and under the same membership rule as a client's, so the peer path is
//! neither an open proxy nor a way around repository membership.

use std::sync::Arc;
use std::time::Instant;

use http::{Method, Request, Response};
use hyper::body::Incoming;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tracing::Instrument;

use super::routes::{self, Endpoint, Parsed, Route};
use super::{handlers, listener};
use crate::body::Body;
use crate::cache::Via;
use crate::cluster::client::{LOOKUP_HEADER, PURGE_PATH, SECRET_HEADER, SHARED_MISSED_HEADER, UNKNOWN_UPSTREAM_HEADER};
use crate::error::Error;
use crate::metrics::metrics;
use crate::oci::Reference;
use crate::shutdown::Shutdown;
use crate::state::App;

/// Open peer connections at most; more wait in the kernel's accept queue.
/// Peers keep a pooled connection or a few each, so this is generous.
pub const MAX_PEER_CONNECTIONS: usize = 1024;

/// Accepts peer connections until `shutdown` fires. With `tls` (exactly
/// when `[cluster] self` is https, which needs `[server.tls]`), peers are
/// served over TLS with the registry listener's certificate, re-read when it
/// rotates like the registry's, and never asked for a client certificate:
/// the cluster secret proves a peer. One certificate for both listeners is
/// one Secret to issue and rotate; for peers found by address it must also
/// carry the name they verify it under (`[cluster] tls_name`, see
/// [`crate::cluster::PeerClient`]).
pub async fn serve(listener: TcpListener, app: Arc<App>, tls: Option<TlsAcceptor>, mut shutdown: Shutdown) {
    let Some(cluster) = &app.config.cluster else { return };
    let secret: [u8; 32] = Sha256::digest(cluster.secret.expose().as_bytes()).into();
    let builders = Arc::new(listener::Builders::new(app.config.server.sendfile));
    let stop = shutdown.clone();
    listener::accept_loop(&listener, MAX_PEER_CONNECTIONS, &mut shutdown, "peer", |stream, peer| {
        let (app, builders, tls, stop) = (Arc::clone(&app), Arc::clone(&builders), tls.clone(), stop.clone());
        async move {
            let handler = move |req| handle(Arc::clone(&app), secret, req);
            let served = listener::serve_maybe_tls(&builders, stream, tls, None, stop, handler).await;
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "peer connection ended with an error");
            }
        }
    })
    .await;
}

/// Whether `headers` carry the cluster secret whose sha256 is `secret`.
fn has_secret(headers: &http::HeaderMap, secret: &[u8; 32]) -> bool {
    let Some(sent) = headers.get(SECRET_HEADER) else { return false };
    let sent: [u8; 32] = Sha256::digest(sent.as_bytes()).into();
    sent.ct_eq(secret).into()
}

/// `?ns=` exactly as sent: a peer names an upstream by its configured
/// name, never an alias, a path prefix or the default.
fn named_upstream(query: Option<&str>) -> Option<String> {
    form_urlencoded::parse(query?.as_bytes()).find(|(k, _)| k == "ns").map(|(_, v)| v.into_owned())
}

/// Why a peer request was not served.
enum Refused {
    /// No secret or a wrong one, or a request no peer makes: nothing was
    /// looked up or fetched.
    Refused(Error),
    /// Served, and failed like a client's request would have.
    Failed(Error),
}

async fn handle(app: Arc<App>, secret: [u8; 32], req: Request<Incoming>) -> Response<Body> {
    let started = Instant::now();
    let (parts, _body) = req.into_parts();
    let head = parts.method == Method::HEAD;
    let kind = match parts.uri.path() {
        PURGE_PATH => "purge",
        path if path.contains("/blobs/") => "blob",
        _ => "manifest",
    };
    let trace =
        crate::otel::server(&parts.method, &parts.uri, &parts.headers, ("peer", super::routes::label_of_path), None);
    let (resp, result) = match serve_peer(&app, &secret, &parts).instrument(trace.clone()).await {
        Ok(resp) => (resp, "ok"),
        Err(Refused::Refused(e @ Error::UnknownUpstream(_))) => {
            // Still a 404 (with NAME_UNKNOWN), but marked: the asker must
            // not read it as "this repository lacks it".
            let mut resp = e.into_response(head);
            resp.headers_mut().insert(UNKNOWN_UPSTREAM_HEADER, http::HeaderValue::from_static("1"));
            (resp, "refused")
        }
        Err(Refused::Refused(e)) => (e.into_response(head), "refused"),
        Err(Refused::Failed(e)) => {
            let result = if e.status() == http::StatusCode::NOT_FOUND { "not_found" } else { "error" };
            (e.into_response(head), result)
        }
    };
    crate::otel::response(&trace, resp.status(), None, None);
    metrics().peer_requests.with_label_values(&["in", kind, result]).inc();
    if result == "refused" {
        tracing::warn!(method = %parts.method, path = parts.uri.path(), status = resp.status().as_u16(), "peer request refused");
    } else {
        tracing::debug!(
            method = %parts.method,
            path = parts.uri.path(),
            status = resp.status().as_u16(),
            result,
            ms = started.elapsed().as_millis() as u64,
            "peer request"
        );
    }
    resp
}

async fn serve_peer(
    app: &Arc<App>,
    secret: &[u8; 32],
    parts: &http::request::Parts,
) -> Result<Response<Body>, Refused> {
    if !has_secret(&parts.headers, secret) {
        return Err(Refused::Refused(Error::Unauthorized { realm: "larder-cluster".into() }));
    }
    if parts.uri.path() == PURGE_PATH && parts.method == Method::POST {
        return purge(app, parts.uri.query()).await;
    }
    // Peers ask for manifests and blobs, by their upstream's own name.
    let Some(ns) = named_upstream(parts.uri.query()) else {
        return Err(Refused::Refused(Error::UnknownUpstream(String::new())));
    };
    let mut route = match routes::parse(&parts.method, &parts.uri, &app.upstreams) {
        Ok(Parsed::Repo(route)) if matches!(route.endpoint, Endpoint::Manifest(_) | Endpoint::Blob(_)) => route,
        Ok(_) => return Err(Refused::Refused(Error::NotFound)),
        Err(e) => return Err(Refused::Refused(e)),
    };
    if route.upstream.name() != ns {
        return Err(Refused::Refused(Error::UnknownUpstream(ns.chars().take(255).collect())));
    }
    if parts.headers.contains_key(LOOKUP_HEADER) {
        return lookup(app, &route, &parts.method).await.map_err(Refused::Failed);
    }
    route.via = Via::Peer { shared_missed: parts.headers.contains_key(SHARED_MISSED_HEADER) };
    handlers::route(app, route, parts).await.map(|(resp, _)| resp).map_err(Refused::Failed)
}

/// Another replica's purge (`POST /larder/purge?upstream=NAME[&repo=REPO]`,
/// see [`crate::cluster::purge`]): this replica forgets the same, and
/// answers what it removed. Passed on to nobody.
async fn purge(app: &App, query: Option<&str>) -> Result<Response<Body>, Refused> {
    let params: Vec<(String, String)> = form_urlencoded::parse(query.unwrap_or("").as_bytes()).into_owned().collect();
    let param = |k: &str| params.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
    let name = param("upstream").unwrap_or_default();
    // By its configured name, as every peer request names an upstream.
    let upstream = app.upstreams.get(name).filter(|u| u.name() == name);
    let Some(upstream) = upstream else {
        return Err(Refused::Refused(Error::UnknownUpstream(name.chars().take(255).collect())));
    };
    let repo = param("repo").map(|r| r.parse::<crate::oci::RepoName>().map_err(Error::NameInvalid)).transpose();
    let repo = repo.map_err(Refused::Refused)?;
    let purged = app.cache.purge(upstream.name(), repo.as_ref()).await.map_err(Refused::Failed)?;
    tracing::info!(
        upstream = upstream.name(),
        repo = repo.as_ref().map_or("every repository", |r| r.as_str()),
        tags = purged.tags,
        members = purged.members,
        blobs = purged.blobs,
        manifests = purged.manifests,
        bytes = purged.bytes,
        "purged at a peer's request"
    );
    let body =
        serde_json::to_vec(&purged).map_err(|e| Refused::Failed(Error::Internal(format!("purge answer: {e}"))))?;
    Response::builder()
        .status(http::StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(crate::body::full(body.into()))
        .map_err(|e| Refused::Failed(Error::Internal(format!("building response: {e}"))))
}

/// A lookup: what this replica already holds, never fetched or forwarded.
/// A miss is a 404, which the asker takes as "not here", nothing more.
async fn lookup(app: &App, route: &Route, method: &Method) -> Result<Response<Body>, Error> {
    let head = method == Method::HEAD;
    let (upstream, repo) = (&route.upstream, &route.repo);
    match &route.endpoint {
        Endpoint::Manifest(Reference::Digest(digest)) => {
            let m = app.cache.local_manifest(upstream.name(), repo, digest).await?.ok_or(Error::ManifestUnknown)?;
            handlers::manifest_response(&m, head, None)
        }
        Endpoint::Manifest(Reference::Tag(tag)) => {
            let (m, confirmed) = app.cache.local_tag(upstream, repo, tag).await?.ok_or(Error::ManifestUnknown)?;
            handlers::manifest_response(&m, head, Some(confirmed))
        }
        Endpoint::Blob(digest) if head => {
            if !app.cache.local_member(upstream.name(), repo, digest).await? {
                return Err(Error::BlobUnknown(*digest));
            }
            Response::builder()
                .status(http::StatusCode::OK)
                .body(crate::body::empty())
                .map_err(|e| Error::Internal(format!("building response: {e}")))
        }
        _ => Err(Error::NotFound),
    }
}
