//! The admin listener: `/metrics` (Prometheus text format), `/healthz`
//! (the process answers) and `/readyz` (the index is readable and the cache
//! folder writable). Kept off the registry port so that it can be firewalled
//! separately.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

use super::HEADER_READ_TIMEOUT;
use super::routes::{self, Endpoint, Parsed, Route};
use crate::body::{self, Body};
use crate::error::Error;
use crate::oci::{Reference, RepoName};
use crate::state::App;

/// Serves until `shutdown` fires. Admin requests are short, so open
/// connections are simply dropped then.
pub async fn serve(listener: TcpListener, app: Arc<App>, mut shutdown: crate::shutdown::Shutdown) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
    let builder = Arc::new(builder);
    loop {
        let accepted = tokio::select! {
            _ = shutdown.changed() => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let (app, builder) = (Arc::clone(&app), Arc::clone(&builder));
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let app = Arc::clone(&app);
                async move { Ok::<_, Infallible>(handle(&app, req).await) }
            });
            let _ = builder.serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

fn text(status: StatusCode, content_type: &'static str, bytes: Vec<u8>) -> Response<Body> {
    let mut resp = Response::new(body::full(Bytes::from(bytes)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    resp
}

async fn handle(app: &Arc<App>, req: Request<Incoming>) -> Response<Body> {
    if req.method() == Method::POST {
        return operation(app, req.uri()).await;
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "text/plain", b"method not allowed\n".to_vec());
    }
    let mut resp = match req.uri().path() {
        "/metrics" => text(StatusCode::OK, "text/plain; version=0.0.4", crate::metrics::render()),
        "/healthz" => text(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
        "/readyz" => match app.cache.check_ready().await {
            Ok(()) => text(StatusCode::OK, "text/plain", b"ready\n".to_vec()),
            Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, "text/plain", format!("not ready: {e}\n").into_bytes()),
        },
        _ => text(StatusCode::NOT_FOUND, "text/plain", b"not found\n".to_vec()),
    };
    if req.method() == Method::HEAD {
        let len = http_body::Body::size_hint(resp.body()).exact().unwrap_or(0);
        resp.headers_mut().insert(CONTENT_LENGTH, len.into());
        *resp.body_mut() = body::empty();
    }
    resp
}

/// `POST /prefetch?image=REF[&platform=os/arch]` and
/// `POST /purge?upstream=NAME[&repo=REPO]`: answered with a JSON summary
/// once done, or an OCI error envelope.
async fn operation(app: &Arc<App>, uri: &http::Uri) -> Response<Body> {
    let params: Vec<(String, String)> =
        form_urlencoded::parse(uri.query().unwrap_or("").as_bytes()).into_owned().collect();
    let param = |name: &str| params.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    let result = match uri.path() {
        "/prefetch" => match param("image") {
            Some(image) => prefetch(app, image, param("platform")).await,
            None => Err(Error::NameInvalid(crate::oci::NameError::Empty)),
        },
        "/purge" => purge(app, param("upstream"), param("repo")).await,
        _ => Err(Error::NotFound),
    };
    match result {
        Ok(summary) => text(StatusCode::OK, "application/json", summary.to_string().into_bytes()),
        Err(e) => e.into_response(false),
    }
}

/// Resolves `image` (`[registry/]repo[:tag|@digest]`) as a client's pull
/// would be routed: a registry that names a configured upstream selects it,
/// anything else goes to the default upstream.
fn resolve(app: &App, image: &str) -> Result<(Route, Reference), Error> {
    let (name, reference) = match image.split_once('@') {
        Some((name, digest)) => (name, digest.to_owned()),
        None => match image.rsplit_once(':').filter(|(_, tag)| !tag.contains('/')) {
            Some((name, tag)) => (name, tag.to_owned()),
            None => (image, "latest".to_owned()),
        },
    };
    let uri: http::Uri = format!("/v2/{name}/manifests/{reference}")
        .parse()
        .map_err(|_| Error::NameInvalid(crate::oci::NameError::BadComponent(image.chars().take(64).collect())))?;
    match routes::parse(&Method::GET, &uri, &app.upstreams)? {
        Parsed::Repo(route) => match route.endpoint.clone() {
            Endpoint::Manifest(reference) => Ok((route, reference)),
            _ => Err(Error::NotFound),
        },
        Parsed::Base => Err(Error::NotFound),
    }
}

async fn prefetch(app: &App, image: &str, platform: Option<&str>) -> Result<serde_json::Value, Error> {
    let (route, reference) = resolve(app, image)?;
    let report =
        crate::cache::prefetch::prefetch(&app.cache, &route.upstream, &route.repo, &reference, image, platform).await?;
    Ok(serde_json::json!(report))
}

async fn purge(app: &App, upstream: Option<&str>, repo: Option<&str>) -> Result<serde_json::Value, Error> {
    let name = upstream.ok_or(Error::NotFound)?;
    // The canonical name, so that an alias purges the same rows.
    let upstream = app.upstreams.get(name).ok_or_else(|| Error::UnknownUpstream(name.to_owned()))?;
    let repo = repo.map(|r| r.parse::<RepoName>().map_err(Error::NameInvalid)).transpose()?;
    let purged = app.cache.purge(upstream.name(), repo.as_ref()).await?;
    tracing::info!(upstream = upstream.name(), repo = ?repo, ?purged, "purged");
    Ok(serde_json::json!(purged))
}
