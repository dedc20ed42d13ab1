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
use crate::app::App;
use crate::body::{self, Body};

/// Serves until `shutdown` fires. Admin requests are short, so open
/// connections are simply dropped then.
pub async fn serve(listener: TcpListener, app: Arc<App>, mut shutdown: super::Shutdown) {
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

async fn handle(app: &App, req: Request<Incoming>) -> Response<Body> {
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
