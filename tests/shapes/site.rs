//! `Site`: one made-up HTTPS host (a registry, a token realm, a CDN) on
//! 127.0.0.1 and a port of its own, answering every request with a
//! handler and recording what it was sent, credentials included.
//!
//! ```ignore
//! let tls = Tls::for_names(&["registry.hub.test", "auth.hub.test"]);
//! let (registry, auth) = (Addr::pick("registry.hub.test"), Addr::pick("auth.hub.test"));
//! let realm = format!("{}/token", auth.url());  // known before either starts
//! let registry = Site::start(&tls, &registry, move |req| answer(req, &realm)).await;
//! assert!(registry.seen().iter().all(|r| r.authorization.is_none()));
//! ```

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A response from a site's handler.
pub type Reply = Response<Full<Bytes>>;

/// A test CA and one server certificate for every made-up host name of a
/// test; larder trusts the CA through `ca_file`.
pub struct Tls {
    acceptor: TlsAcceptor,
    ca_file: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tls {
    pub fn for_names(names: &[&str]) -> Tls {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "larder registry-shapes CA");
        let ca = ca_params.self_signed(&ca_key).expect("self-sign the CA");
        let leaf_key = KeyPair::generate().expect("leaf key");
        let leaf_params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).expect("leaf params");
        let leaf = leaf_params.signed_by(&leaf_key, &ca, &ca_key).expect("sign the leaf");
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        let config =
            ServerConfig::builder_with_provider(Arc::new(tokio_rustls::rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_no_client_auth()
                .with_single_cert(vec![CertificateDer::from(leaf.der().to_vec())], key)
                .expect("server certificate");
        let dir = tempfile::tempdir().expect("a temp dir for the CA file");
        let ca_file = dir.path().join("shapes-ca.pem");
        std::fs::write(&ca_file, ca.pem()).expect("write the CA file");
        Tls { acceptor: TlsAcceptor::from(Arc::new(config)), ca_file, _dir: dir }
    }

    /// The CA certificate (PEM), for an upstream's `ca_file`.
    pub fn ca_file(&self) -> String {
        self.ca_file.display().to_string()
    }
}

/// What a site was sent.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    pub authorization: Option<String>,
    /// What the handler answered.
    pub status: u16,
}

impl Seen {
    /// A query parameter's values (`scope` may come more than once).
    pub fn params(&self, name: &str) -> Vec<String> {
        let query = self.query.as_deref().unwrap_or_default();
        form_urlencoded::parse(query.as_bytes()).filter(|(k, _)| k == name).map(|(_, v)| v.into_owned()).collect()
    }
}

/// A request as a handler sees it.
#[derive(Clone, Debug)]
pub struct Req {
    pub method: Method,
    pub path: String,
    pub query: Option<String>,
    pub authorization: Option<String>,
}

impl Req {
    pub fn head(&self) -> bool {
        self.method == Method::HEAD
    }

    pub fn params(&self, name: &str) -> Vec<String> {
        let query = self.query.as_deref().unwrap_or_default();
        form_urlencoded::parse(query.as_bytes()).filter(|(k, _)| k == name).map(|(_, v)| v.into_owned()).collect()
    }
}

type Handler = Arc<dyn Fn(&Req) -> Reply + Send + Sync>;

/// Where a site listens: a made-up host name (pinned to 127.0.0.1 in
/// /etc/hosts) and a port of its own, chosen before any site starts so
/// that sites can name each other (a registry its realm, a realm itself).
#[derive(Clone, Debug)]
pub struct Addr {
    pub host: &'static str,
    pub port: u16,
}

impl Addr {
    /// `host` on a free port of 127.0.0.1.
    pub fn pick(host: &'static str) -> Addr {
        Addr { host, port: crate::common::free_port() }
    }

    /// `https://<host>:<port>`
    pub fn url(&self) -> String {
        format!("https://{}:{}", self.host, self.port)
    }
}

/// A running site; stops when dropped.
pub struct Site {
    host: &'static str,
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

impl Site {
    /// Serves `addr` over HTTPS (HTTP/1.1) on 127.0.0.1.
    pub async fn start(tls: &Tls, addr: &Addr, handler: impl Fn(&Req) -> Reply + Send + Sync + 'static) -> Site {
        let listener = TcpListener::bind(("127.0.0.1", addr.port))
            .await
            .unwrap_or_else(|e| panic!("bind {} on 127.0.0.1:{}: {e}", addr.host, addr.port));
        let (host, port) = (addr.host, addr.port);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let handler: Handler = Arc::new(handler);
        let acceptor = tls.acceptor.clone();
        let task = tokio::spawn({
            let seen = Arc::clone(&seen);
            async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    let (acceptor, seen, handler) = (acceptor.clone(), Arc::clone(&seen), Arc::clone(&handler));
                    tokio::spawn(async move {
                        let Ok(stream) = acceptor.accept(tcp).await else { return };
                        let service = service_fn(move |req| {
                            let reply = answer(&seen, &handler, req);
                            async move { Ok::<_, Infallible>(reply) }
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            }
        });
        Site { host, port, seen, task }
    }

    /// `https://<host>:<port>`
    pub fn url(&self) -> String {
        format!("https://{}:{}", self.host, self.port)
    }

    pub fn host(&self) -> &'static str {
        self.host
    }

    /// Every request so far, in arrival order.
    pub fn seen(&self) -> Vec<Seen> {
        lock(&self.seen).clone()
    }

    /// Requests whose path starts with `prefix`.
    pub fn seen_under(&self, prefix: &str) -> Vec<Seen> {
        self.seen().into_iter().filter(|s| s.path.starts_with(prefix)).collect()
    }

    /// Every `Authorization` value this site was sent.
    pub fn authorizations(&self) -> Vec<String> {
        self.seen().into_iter().filter_map(|s| s.authorization).collect()
    }

    /// Forgets what was seen so far.
    pub fn clear(&self) {
        lock(&self.seen).clear();
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn answer(seen: &Mutex<Vec<Seen>>, handler: &Handler, req: Request<Incoming>) -> Reply {
    let req = Req {
        method: req.method().clone(),
        path: req.uri().path().to_owned(),
        query: req.uri().query().map(str::to_owned),
        authorization: req.headers().get("authorization").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
    };
    let reply = handler(&req);
    lock(seen).push(Seen {
        method: req.method.to_string(),
        path: req.path,
        query: req.query,
        authorization: req.authorization,
        status: reply.status().as_u16(),
    });
    reply
}

pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---- replies ------------------------------------------------------------------

/// A reply with `status`, `headers` and `body`.
pub fn reply(status: u16, headers: &[(&str, String)], body: impl Into<Bytes>) -> Reply {
    let body = body.into();
    let mut builder = Response::builder().status(status).header("content-length", body.len());
    for (name, value) in headers {
        builder = builder.header(*name, value.as_str());
    }
    builder.body(Full::new(body)).expect("a valid reply")
}

/// An OCI error envelope with `status`.
pub fn error(status: u16, code: &str) -> Reply {
    let body = serde_json::json!({"errors": [{"code": code, "message": code, "detail": null}]}).to_string();
    reply(status, &[("content-type", "application/json".into())], body)
}

/// 401 with a `WWW-Authenticate` challenge.
pub fn challenge(value: String) -> Reply {
    let body =
        serde_json::json!({"errors": [{"code": "UNAUTHORIZED", "message": "authentication required", "detail": null}]})
            .to_string();
    reply(401, &[("www-authenticate", value), ("content-type", "application/json".into())], body)
}

/// A redirect to `location` (absolute or relative).
pub fn redirect(status: u16, location: String) -> Reply {
    reply(status, &[("location", location)], Bytes::new())
}

// ---- broken hosts -------------------------------------------------------------

/// A made-up host whose port accepts TCP connections and closes them at
/// once: the TLS handshake fails, which larder counts as a connect error.
/// Counts the connections it was offered; stops when dropped.
pub struct Hangup {
    addr: Addr,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    task: JoinHandle<()>,
}

impl Hangup {
    pub async fn start(addr: &Addr) -> Hangup {
        let listener = TcpListener::bind(("127.0.0.1", addr.port))
            .await
            .unwrap_or_else(|e| panic!("bind {} on 127.0.0.1:{}: {e}", addr.host, addr.port));
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let task = tokio::spawn({
            let accepted = Arc::clone(&accepted);
            async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    drop(tcp);
                }
            }
        });
        Hangup { addr: addr.clone(), accepted, task }
    }

    pub fn url(&self) -> String {
        self.addr.url()
    }

    /// Connections accepted (and hung up) so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for Hangup {
    fn drop(&mut self) {
        self.task.abort();
    }
}
