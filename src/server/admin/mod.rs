//! The admin listener, kept off the registry port so that it can be
//! firewalled separately. Read-only, open to anyone who can connect:
//! `/metrics` (Prometheus text format), `/healthz` (the process answers),
//! `/readyz` (the index is readable and the cache folder writable), `/`
//! (the status page) and `/status` (the same facts as JSON, for
//! `larder status`). Mutating, guarded by [`auth`]: `POST /prefetch` and
//! `POST /purge` (see [`operations`]), `POST /export` and `POST /import`
//! (see [`seed`]). The listener has the registry
//! listener's protections (first-request deadline, idle timeout, header
//! timeout), with its own, smaller connection cap. It speaks TLS when
//! `[admin] tls` gives it a certificate (by default `[server.tls]`'s, so a
//! bearer token never crosses the network in the clear when the registry
//! port is TLS), re-read when its files change.

pub mod auth;
pub mod operations;
pub mod provenance;
pub mod seed;
pub mod status;
pub mod status_page;
pub mod token_file;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{ACCEPT, CACHE_CONTROL, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::{TLS_HANDSHAKE_TIMEOUT, listener};
use crate::body::{self, Body};
use crate::error::Error;
use crate::metrics::metrics;
use crate::state::App;
pub use auth::AdminAuth;

/// Open admin connections at most; further ones wait in the kernel's
/// accept queue until one closes. Prometheus, the kubelet's probes and a
/// few operators need a handful; the cap keeps a flood of admin
/// connections from taking the descriptors the registry port needs.
pub const MAX_ADMIN_CONNECTIONS: usize = 256;

struct Admin {
    app: Arc<App>,
    auth: AdminAuth,
    holdings: status::HoldingsCache,
    started: Instant,
}

/// Serves until `shutdown` fires, over TLS with `tls`. Open admin
/// connections are not drained: a prefetch streaming its progress stops
/// with the process.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    auth: AdminAuth,
    tls: Option<TlsAcceptor>,
    mut shutdown: crate::shutdown::Shutdown,
) {
    crate::metrics::init_known_series();
    let m = metrics();
    m.cache_max_size.set(app.cache.max_size() as i64);
    m.cache_high_watermark.set(app.cache.high_watermark_bytes() as i64);
    if let Some((file, _)) = auth.token_file() {
        Arc::clone(file).watch(shutdown.clone());
    }
    let admin = Arc::new(Admin { app, auth, holdings: status::HoldingsCache::default(), started: Instant::now() });
    let builder = Arc::new(listener::http_builder());
    listener::accept_loop(&listener, MAX_ADMIN_CONNECTIONS, &mut shutdown, "admin", |stream, peer| {
        let (admin, builder, tls) = (Arc::clone(&admin), Arc::clone(&builder), tls.clone());
        async move {
            let handler = move |req| {
                let admin = Arc::clone(&admin);
                async move { admin.handle(req).await }
            };
            let served = match tls {
                None => listener::serve_watched(&builder, stream, None, handler).await,
                // Boxed, as on the registry listener: rustls' state would
                // otherwise size every admin connection's task.
                Some(acceptor) => {
                    Box::pin(async move {
                        match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                            Ok(Ok(stream)) => listener::serve_watched(&builder, stream, None, handler).await,
                            Ok(Err(e)) => Err(e.into()),
                            Err(_) => Err("TLS handshake timed out".into()),
                        }
                    })
                    .await
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "admin connection ended with an error");
            }
        }
    })
    .await;
}

/// What `check-config` says about the admin listener's rules: who may
/// operate, from where, and over what. Empty without `admin_listen`.
pub fn explain(config: &crate::config::Config) -> Vec<String> {
    let Some(listen) = config.server.admin_listen else { return Vec::new() };
    let admin = &config.admin;
    let mut lines = Vec::new();
    lines.push(match &admin.token_file {
        Some(path) => format!(
            "admin: POST /prefetch and /purge need the bearer token in {}; deleting, emptying or breaking that file \
             revokes it (refused until the file holds a valid token again)",
            path.display()
        ),
        None if listen.ip().is_loopback() => format!(
            "admin: no [admin] token_file, and admin_listen {listen} is loopback: at each start larder writes a new \
             token to {} (mode 0600), and POST /prefetch and /purge need it (larder prefetch/purge --config read \
             it). They are no longer open to every local process",
            config.cache.dir.join(crate::config::GENERATED_ADMIN_TOKEN_FILE).display()
        ),
        None => format!(
            "admin: no [admin] token_file, and admin_listen {listen} is reachable from other hosts: POST /prefetch \
             and /purge are refused (403)"
        ),
    });
    let mut hosts = vec!["a loopback address".to_owned(), "localhost".to_owned()];
    if !listen.ip().is_unspecified() && !listen.ip().is_loopback() {
        hosts.push(listen.ip().to_string());
    }
    hosts.extend(admin.allowed_hosts.iter().map(|h| match h {
        crate::config::AdminHost::Name(n) => n.clone(),
        crate::config::AdminHost::Subdomains(d) => format!("*.{d}"),
        crate::config::AdminHost::Ip(ip) => ip.to_string(),
    }));
    lines.push(format!(
        "admin: mutating requests from web pages (an Origin header, or a cross-site Sec-Fetch-Site) are refused, \
         and so are those whose Host is not {} (add names to [admin] allowed_hosts)",
        hosts.join(", ")
    ));
    lines.push(match (&admin.tls, admin.tls_is_server, &config.server.tls) {
        (Some(_), true, _) => "admin: served over TLS with [server.tls]'s certificate (Prometheus and probes need \
                               https; [admin] tls = \"off\" serves plain HTTP)"
            .to_owned(),
        (Some(t), false, _) => format!("admin: served over TLS with its own certificate {}", t.cert.display()),
        (None, _, Some(_)) if listen.ip().is_loopback() => {
            "admin: plain HTTP although [server.tls] is set ([admin] tls = \"off\"), on loopback".to_owned()
        }
        (None, _, Some(_)) => "admin: plain HTTP although [server.tls] is set ([admin] tls = \"off\"): the admin \
                               token crosses the network in the clear"
            .to_owned(),
        (None, _, _) => "admin: plain HTTP (set [server.tls] or [admin] tls for TLS)".to_owned(),
    });
    lines
}

fn text(status: StatusCode, content_type: &'static str, bytes: impl Into<Bytes>) -> Response<Body> {
    let mut resp = Response::new(body::full(bytes.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// The endpoints that change something, taken with `POST` only.
const MUTATING: [&str; 4] = ["/prefetch", "/purge", "/export", "/import"];
/// The read-only endpoints, taken with `GET` and `HEAD` only.
const READ_ONLY: [&str; 5] = ["/metrics", "/healthz", "/readyz", "/", "/status"];

/// `405` for an endpoint that exists, with the methods it takes: `GET
/// /prefetch` is a mistake of method, not of path.
fn method_not_allowed(allow: &'static str) -> Response<Body> {
    let mut resp = text(StatusCode::METHOD_NOT_ALLOWED, "text/plain", format!("method not allowed: use {allow}\n"));
    resp.headers_mut().insert(http::header::ALLOW, HeaderValue::from_static(allow));
    resp
}

/// The label of a mutating endpoint in `larder_admin_auth_failures_total`.
fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/prefetch" => "prefetch",
        "/purge" => "purge",
        "/export" => "export",
        "/import" => "import",
        _ => "other",
    }
}

impl Admin {
    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let head = parts.method == Method::HEAD;
        let mut resp = if parts.method == Method::GET || head {
            self.read(parts.uri.path()).await
        } else {
            // Every other method may change something: the token check
            // comes before routing, so an endpoint added later is guarded too.
            let path = parts.uri.path();
            let result = match self.auth.authorize(&parts.headers, &parts.uri, endpoint_label(path)) {
                Err(e) => Err(e),
                Ok(()) if parts.method != Method::POST => {
                    let allow = if MUTATING.contains(&path) { "POST" } else { "GET, HEAD" };
                    return method_not_allowed(allow);
                }
                Ok(()) => {
                    let params = operations::Params::of(&parts.uri);
                    match path {
                        "/prefetch" => {
                            let stream = parts
                                .headers
                                .get_all(ACCEPT)
                                .iter()
                                .any(|v| v.to_str().is_ok_and(|v| v.contains(operations::NDJSON)));
                            operations::prefetch(&self.app, &params, stream).await
                        }
                        "/purge" => operations::purge(&self.app, &params).await,
                        "/export" => seed::export(&self.app, &params).await,
                        "/import" => seed::import(&self.app, &params, body).await,
                        path if READ_ONLY.contains(&path) => return method_not_allowed("GET, HEAD"),
                        _ => Err(Error::NotFound),
                    }
                }
            };
            result.unwrap_or_else(|e| e.into_response(false))
        };
        if head {
            let len = http_body::Body::size_hint(resp.body()).exact().unwrap_or(0);
            resp.headers_mut().insert(CONTENT_LENGTH, len.into());
            *resp.body_mut() = body::empty();
        }
        resp
    }

    /// GET and HEAD: the read-only endpoints.
    async fn read(&self, path: &str) -> Response<Body> {
        match path {
            "/metrics" => {
                // Readiness is evaluated at every scrape, so that an alert
                // can see it without a probe.
                let _ = self.ready().await;
                text(StatusCode::OK, "text/plain; version=0.0.4", crate::metrics::render())
            }
            "/healthz" => text(StatusCode::OK, "text/plain", "ok\n"),
            "/readyz" => match self.ready().await {
                Ok(()) => text(StatusCode::OK, "text/plain", "ready\n"),
                Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, "text/plain", format!("not ready: {e}\n")),
            },
            "/" | "/status" => match status::gather(&self.app, &self.holdings, self.started).await {
                Ok(s) if path == "/" => {
                    let mut resp = text(StatusCode::OK, "text/html; charset=utf-8", status_page::render(&s));
                    resp.headers_mut().insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
                    resp
                }
                Ok(s) => text(StatusCode::OK, "application/json", serde_json::json!(s).to_string()),
                Err(e) => e.into_response(false),
            },
            path if MUTATING.contains(&path) => method_not_allowed("POST"),
            _ => text(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
        }
    }

    async fn ready(&self) -> Result<(), Error> {
        let ready = self.app.cache.check_ready().await;
        metrics().ready.set(i64::from(ready.is_ok()));
        ready
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn explained(extra: &str) -> String {
        let text = format!("{extra}\n[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\n");
        super::explain(&Config::parse(&text, "t.toml", None).unwrap()).join("\n")
    }

    #[test]
    fn check_config_explains_who_may_operate_from_where() {
        assert_eq!(explained(""), "", "no admin listener, nothing to say");
        let loopback = explained("[server]\nadmin_listen = \"127.0.0.1:9090\"\n[cache]\ndir = \"/data\"");
        assert!(loopback.contains("writes a new token to /data/admin-token"), "{loopback}");
        assert!(loopback.contains("plain HTTP"), "{loopback}");
        let reachable = explained(
            "[server]\nadmin_listen = \"10.0.0.7:9090\"\n[admin]\nallowed_hosts = [\"a.example\", \"*.b.example\"]",
        );
        assert!(reachable.contains("are refused (403)"), "{reachable}");
        assert!(reachable.contains("a loopback address, localhost, 10.0.0.7, a.example, *.b.example"), "{reachable}");
    }
}
