//! The HTTP side of the operator commands: one request to a running
//! larder's admin listener, with the bearer token when there is one, and
//! bounded waits (connect, response headers, and between two lines of a
//! streamed answer).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, USER_AGENT};
use http::{Method, Request, Response, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use rustls::DigitallySignedStruct;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

use crate::config::Secret;

/// Time to connect to the admin listener.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Time for the response headers. A purge of a large upstream answers when
/// done, so this is generous.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest wait for the next chunk of a body; larder sends a streamed
/// prefetch's progress at least every 5 s.
pub const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest non-streamed answer read (the status JSON is a few KiB).
pub const MAX_ANSWER: usize = 4 << 20;

/// A failed admin call: what to print, after `larder <command>: `.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("{0}")]
    Usage(String),
    #[error("cannot reach the admin listener at {url}: {message}")]
    Unreachable { url: String, message: String },
    /// larder answered with an error (its OCI envelope, summarised).
    #[error("{status} {code}: {message}")]
    Refused { status: u16, code: String, message: String },
    #[error("{0}")]
    Protocol(String),
}

/// Which certificates an https admin listener may present.
#[derive(Debug, Default)]
pub struct Trust {
    /// CA certificates trusted beside the web PKI roots (`--ca-file`); the
    /// certificate must also name the host of the URL.
    pub extra_roots: Vec<CertificateDer<'static>>,
    /// larder's own admin certificate, read from its config: accepted as
    /// itself, whatever it names.
    pub pinned: Option<CertificateDer<'static>>,
    /// The name the certificate is verified under (and sent as SNI)
    /// instead of the URL's host (`--tls-name`): through a port-forward to
    /// 127.0.0.1, the certificate names the Service, not 127.0.0.1.
    pub name: Option<ServerName<'static>>,
}

/// The web PKI (plus `--ca-file`) verifier, and the pinned certificate.
///
/// Accepting a pinned certificate without checking names or issuer is safe:
/// it is byte-for-byte the certificate larder's config names, and the
/// handshake signature (checked below as always) proves the server holds
/// its private key. It is what lets `larder status --config` reach
/// `https://127.0.0.1:9090`, a name the certificate rarely carries.
#[derive(Debug)]
struct PinnedOrRoots {
    pinned: Option<CertificateDer<'static>>,
    roots: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for PinnedOrRoots {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if self.pinned.as_ref().is_some_and(|p| p.as_ref() == end_entity.as_ref()) {
            return Ok(ServerCertVerified::assertion());
        }
        self.roots.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.roots.supported_verify_schemes()
    }
}

/// What a request to the admin listener carries.
pub type RequestBody = BoxBody<Bytes, crate::body::BoxError>;

/// Where the command found the admin URL and the token, for the messages
/// of a failed call: what to check when larder cannot be reached, and
/// where the token came from, or everywhere it was looked for.
#[derive(Clone, Debug, Default)]
pub struct Found {
    /// Where the URL came from (`--admin or LARDER_ADMIN`, `server.admin_listen
    /// of larder.toml`); `None`: the built-in default.
    pub url_from: Option<String>,
    /// larder's config (`--config`) says its admin listener speaks TLS.
    pub tls_in_config: bool,
    /// Where the token sent came from; `None`: none was sent.
    pub token_from: Option<String>,
    /// Each place a token was looked for, when none was found.
    pub token_looked: Vec<String>,
}

impl Found {
    /// Said after a 401: which token was sent, or that none was and where
    /// the command looked.
    fn token_hint(&self) -> String {
        match &self.token_from {
            Some(from) => format!("the token sent came from {from}"),
            None => format!(
                "this command found no token to send: {}; pass --config with larder's config file (its [admin] \
                 token_file, or the token larder generated in its cache folder), or --token-file",
                self.token_looked.join(", ")
            ),
        }
    }

    /// Said when the listener cannot be reached, a line each: the likely
    /// causes, the commonest first. TLS only when it may be why: the
    /// config says the listener speaks it, or a connection was made but no
    /// HTTP answer came (what a TLS listener does to plain HTTP).
    fn unreachable_hint(&self, base: &str, failure: Failure) -> String {
        let mut causes = vec![
            match failure {
                Failure::Refused => {
                    "nothing listens there: is larder running, with its admin listener (server.admin_listen) on this \
                 address?"
                }
                Failure::Certificate => {
                    "its certificate is not trusted: pass --ca-file with its CA (or --config: larder's own admin \
                 certificate is trusted as it is), and --tls-name if it names another host"
                }
                Failure::Connect => "is larder running there, and is the address right?",
                Failure::NoHttp => {
                    "something accepted the connection there, but did not answer as larder's admin listener does"
                }
            }
            .to_owned(),
        ];
        let connected = failure == Failure::NoHttp;
        match &self.url_from {
            Some(from) => causes.push(format!("the address came from {from}")),
            None => causes.push(format!(
                "without --config or --admin, larder commands look at {base}: pass --config with larder's config \
                 file (its admin_listen, token and certificate are then used), or --admin URL"
            )),
        }
        if base.starts_with("http://") && (self.tls_in_config || connected) {
            let why = if self.tls_in_config {
                "larder's config serves the admin listener over TLS"
            } else {
                "if the admin listener speaks TLS"
            };
            causes.push(format!(
                "{why} ([admin] tls, or [server.tls]): use --admin https://... with --ca-file, or --config alone"
            ));
        }
        causes.join("\n  ")
    }
}

/// How a call failed before any answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failure {
    /// The connection was refused: nothing listens.
    Refused,
    /// The TLS handshake failed on the certificate.
    Certificate,
    /// Another connect failure (a timeout, an unreachable host, a name).
    Connect,
    /// Connected, but no HTTP answer came.
    NoHttp,
}

impl Failure {
    fn of(e: &hyper_util::client::legacy::Error) -> Failure {
        let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
        while let Some(s) = source {
            let io = s.downcast_ref::<std::io::Error>();
            if io.is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused) {
                return Failure::Refused;
            }
            // rustls' error travels inside an io::Error (whose `source`
            // skips it).
            let tls = s.downcast_ref::<rustls::Error>().or_else(|| io?.get_ref()?.downcast_ref::<rustls::Error>());
            if matches!(tls, Some(rustls::Error::InvalidCertificate(_))) {
                return Failure::Certificate;
            }
            source = s.source();
        }
        if crate::upstream::error_chain(e).contains("certificate") {
            return Failure::Certificate;
        }
        if e.is_connect() { Failure::Connect } else { Failure::NoHttp }
    }
}

/// A running larder's admin listener.
pub struct AdminClient {
    base: String,
    token: Option<Secret>,
    found: Found,
    inner: Client<hyper_rustls::HttpsConnector<HttpConnector>, RequestBody>,
}

impl AdminClient {
    /// `base` is `http(s)://host:port` (a trailing `/` is ignored); `trust`
    /// says which certificates an https listener may present.
    pub fn new(base: &str, token: Option<Secret>, trust: Trust) -> Result<AdminClient, CallError> {
        let base = base.trim_end_matches('/').to_owned();
        let uri: Uri = base.parse().map_err(|e| CallError::Usage(format!("--admin {base:?}: {e}")))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
            return Err(CallError::Usage(format!("--admin {base:?} must be http(s)://host:port")));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        for ca in trust.extra_roots {
            roots.add(ca).map_err(|e| CallError::Usage(format!("--ca-file: {e}")))?;
        }
        let roots = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
            .build()
            .map_err(|e| CallError::Usage(format!("--ca-file: {e}")))?;
        let verifier = PinnedOrRoots { pinned: trust.pinned.clone(), roots };
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| CallError::Usage(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let https = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http();
        let https = match trust.name {
            Some(name) => https.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name)),
            None => https,
        };
        let https = https.enable_http1().wrap_connector(http);
        Ok(AdminClient {
            base,
            token,
            found: Found::default(),
            inner: Client::builder(TokioExecutor::new()).build(https),
        })
    }

    /// Where the URL and the token were found, for the messages of a failed call.
    pub fn with_found(mut self, found: Found) -> AdminClient {
        self.found = found;
        self
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// Sends `method path_and_query`; a non-2xx answer is a [`CallError::Refused`].
    pub async fn call(
        &self,
        method: Method,
        path_and_query: &str,
        accept: &str,
    ) -> Result<Response<Incoming>, CallError> {
        let empty = Empty::new().map_err(|never| match never {}).boxed();
        self.send(method, path_and_query, accept, empty, RESPONSE_TIMEOUT).await
    }

    /// [`AdminClient::call`] with a request body (a layout to import):
    /// the response headers within `timeout`, the body's upload included.
    pub async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        accept: &str,
        body: RequestBody,
        timeout: Duration,
    ) -> Result<Response<Incoming>, CallError> {
        let url = format!("{}{path_and_query}", self.base);
        let mut req =
            Request::builder().method(method).uri(&url).header(ACCEPT, accept).header(USER_AGENT, crate::USER_AGENT);
        if let Some(token) = &self.token {
            req = req.header(AUTHORIZATION, format!("Bearer {}", token.expose()));
        }
        let req = req.body(body).map_err(|e| CallError::Usage(format!("{url}: {e}")))?;
        let unreachable = |message: String| CallError::Unreachable { url: self.base.clone(), message };
        let resp = match tokio::time::timeout(timeout, self.inner.request(req)).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => {
                // A TLS listener hangs up on plain HTTP after the connection
                // was made; nothing listening refuses the connection itself.
                let hint = self.found.unreachable_hint(&self.base, Failure::of(&e));
                return Err(unreachable(format!("{}\n  {hint}", crate::upstream::error_chain(&e))));
            }
            Err(_) => return Err(unreachable(format!("no answer within {timeout:?}"))),
        };
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let body = read_body(resp.into_body()).await.unwrap_or_default();
        match refusal(status, &body) {
            CallError::Refused { status: 401, code, message } => {
                let message = format!("{message}\n  {}", self.found.token_hint());
                Err(CallError::Refused { status: 401, code, message })
            }
            refused => Err(refused),
        }
    }

    /// [`AdminClient::call`], then the whole (small) body.
    pub async fn call_json(&self, method: Method, path_and_query: &str) -> Result<serde_json::Value, CallError> {
        let resp = self.call(method, path_and_query, "application/json").await?;
        let body = read_body(resp.into_body()).await?;
        serde_json::from_slice(&body).map_err(|e| CallError::Protocol(format!("the answer is not JSON: {e}")))
    }
}

/// The OCI error envelope (or whatever came) as a [`CallError::Refused`].
pub fn refusal(status: u16, body: &[u8]) -> CallError {
    let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let first = parsed.as_ref().and_then(|v| v["errors"].get(0));
    let code = first.and_then(|e| e["code"].as_str()).unwrap_or("ERROR").to_owned();
    let message = match first.and_then(|e| e["message"].as_str()) {
        Some(m) => m.to_owned(),
        None => String::from_utf8_lossy(body).trim().chars().take(300).collect(),
    };
    CallError::Refused { status, code, message }
}

pub async fn read_body(body: Incoming) -> Result<Bytes, CallError> {
    let limited = http_body_util::Limited::new(body, MAX_ANSWER);
    match tokio::time::timeout(BODY_IDLE_TIMEOUT, limited.collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) => Err(CallError::Protocol(format!("reading the answer: {e}"))),
        Err(_) => Err(CallError::Protocol(format!("the answer stalled for {BODY_IDLE_TIMEOUT:?}"))),
    }
}

/// Reads a newline-delimited JSON body one object at a time, waiting at
/// most [`BODY_IDLE_TIMEOUT`] for each chunk.
pub struct Lines {
    body: Incoming,
    buffer: Vec<u8>,
}

/// Longest line accepted in a streamed answer.
const MAX_LINE: usize = 1 << 20;

impl Lines {
    pub fn new(body: Incoming) -> Lines {
        Lines { body, buffer: Vec::new() }
    }

    /// The next JSON object, or `None` at the end of the body.
    pub async fn next(&mut self) -> Result<Option<serde_json::Value>, CallError> {
        loop {
            if let Some(end) = self.buffer.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=end).collect();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return serde_json::from_slice(&line)
                    .map(Some)
                    .map_err(|e| CallError::Protocol(format!("a progress line is not JSON: {e}")));
            }
            if self.buffer.len() > MAX_LINE {
                return Err(CallError::Protocol("a progress line is too long".into()));
            }
            let frame = match tokio::time::timeout(BODY_IDLE_TIMEOUT, self.body.frame()).await {
                Err(_) => return Err(CallError::Protocol(format!("no progress for {BODY_IDLE_TIMEOUT:?}"))),
                Ok(None) if self.buffer.is_empty() => return Ok(None),
                Ok(None) => return Err(CallError::Protocol("the answer ended inside a line".into())),
                Ok(Some(Err(e))) => return Err(CallError::Protocol(format!("the connection broke: {e}"))),
                Ok(Some(Ok(frame))) => frame,
            };
            if let Ok(data) = frame.into_data() {
                self.buffer.extend_from_slice(&data);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_listener_names_the_likely_causes_and_tls_only_when_it_may_be_why() {
        let default = Found::default();
        assert_eq!(
            default.unreachable_hint("http://127.0.0.1:9090", Failure::Refused),
            "nothing listens there: is larder running, with its admin listener (server.admin_listen) on this \
             address?\n  without --config or --admin, larder commands look at http://127.0.0.1:9090: pass --config \
             with larder's config file (its admin_listen, token and certificate are then used), or --admin URL"
        );
        let tls_config = Found { url_from: Some("--admin (or LARDER_ADMIN)".into()), tls_in_config: true, ..default };
        let hint = tls_config.unreachable_hint("http://127.0.0.1:9090", Failure::Refused);
        assert!(hint.ends_with("\n  larder's config serves the admin listener over TLS ([admin] tls, or [server.tls]): use --admin https://... with --ca-file, or --config alone"), "{hint}");
        let hint = Found::default().unreachable_hint("http://127.0.0.1:9090", Failure::NoHttp);
        assert!(hint.contains("\n  if the admin listener speaks TLS"), "connected, no HTTP: {hint}");
        let hint = Found::default().unreachable_hint("https://127.0.0.1:9090", Failure::Certificate);
        assert!(hint.starts_with("its certificate is not trusted: pass --ca-file"), "{hint}");
        assert!(!hint.contains("speaks TLS"), "{hint}");
    }
}
