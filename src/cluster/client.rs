//! The asking side of the peer protocol. A replica that misses asks the
//! key's owner on the owner's peer listener, on the same `/v2/` paths
//! clients use, with `?ns=<upstream name>` and the cluster secret: for a
//! blob (streamed while the owner fills, from an offset when resuming), a
//! manifest, or whether a repository has a digest (`HEAD`). The owner
//! applies the membership rule and never forwards the request again.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, HeaderValue, RANGE, USER_AGENT};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Incoming;
use hyper_rustls::{FixedServerNameResolver, HttpsConnector};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tracing::Instrument;

use super::PeerUrl;
use crate::config::ClusterConfig;
use crate::metrics::metrics;

/// Header that carries the cluster secret on every peer request.
pub const SECRET_HEADER: &str = "larder-cluster-secret";
/// On a request that only asks what the peer already holds: it answers
/// from its memory and disk, never fetches, never forwards (404 otherwise).
/// Costs one short round trip, and spares upstream a request whenever the
/// peer knows (a replica that joined, or lost its disk, asking the one that
/// owned the key before).
pub const LOOKUP_HEADER: &str = "larder-peer-lookup";
/// On an owner's answer for a tag: when upstream last confirmed where the
/// tag points (unix milliseconds), so the asker's copy expires with the
/// owner's and not a TTL later.
pub const TAG_CONFIRMED_HEADER: &str = "larder-tag-confirmed";
/// On a blob request to the owner: the asker already looked in the shared
/// tier for it and missed (or the store failed), so the owner does not
/// look again (one store GET per cold blob, not two).
pub const SHARED_MISSED_HEADER: &str = "larder-shared-missed";
/// On a peer's error answer: the upstream named in `?ns=` is not
/// configured there (yet: a rolling config change). Its 404 then says
/// nothing about the repository, and the asker goes on to the next source.
pub const UNKNOWN_UPSTREAM_HEADER: &str = "larder-unknown-upstream";
/// The peer listener's purge endpoint: `POST` with `?upstream=NAME[&repo=REPO]`
/// and the cluster secret; the answer is what the replica removed (JSON).
pub const PURGE_PATH: &str = "/larder/purge";
/// Largest answer to a purge read from a peer (a few counts).
const MAX_PURGE_ANSWER: usize = 64 << 10;
/// Longest wait for a peer's error body (which carries its OCI code): a
/// peer that sent error headers and then stalls costs the asker this
/// much, then its answer counts as an error without a code.
pub const PEER_ERROR_BODY_TIMEOUT: Duration = Duration::from_secs(2);
/// Time to open a connection to a peer (TCP, and TLS for https peers).
/// Peers are near: a peer that does not accept within this is taken for
/// down, and the next source is tried.
pub const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Wait for a lookup's answer ([`LOOKUP_HEADER`]): the peer answers from
/// its memory and index, in milliseconds when healthy. Past this the
/// asker goes on without it (the peer is not marked down), so a hung
/// runner-up adds at most this to an owner's answer.
pub const PEER_LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);
/// Added to the owner's worst legitimate wait when waiting for its
/// response headers: the round trips between the two replicas.
pub const PEER_RESPONSE_MARGIN: Duration = Duration::from_secs(2);

/// Largest error body read from a peer (to learn its OCI error code).
const MAX_ERROR_BODY: usize = 64 << 10;
/// How long an idle pooled connection to a peer is kept.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Why a peer did not give what was asked.
///
/// Only [`PeerError::Unreachable`], a failed TCP connect or TLS handshake,
/// marks a peer down. A peer that is slow to answer is alive: an owner
/// may legitimately wait on the shared tier, a runner-up lookup, an
/// upstream slot, a token and upstream itself; marking it down would send
/// every asker to upstream for all of its keys for
/// [`super::peers::PEER_DOWN_FOR`], N upstream fetches per key exactly
/// while upstream is struggling. An owner that answers 5xx is alive too:
/// its 502, 503 and 504 are upstream's failures relayed (or its disk's,
/// a 503 too), and the asker goes on for that one request. Nor does a
/// body that breaks off mark it down: the owner also aborts its answer
/// when its own source broke off and nothing could resume, which the
/// asker cannot tell from the owner dying; the fill resumes from its next
/// source either way, and a dead owner is marked down by the next request
/// it misses (a refused connection is immediate, a silent host costs
/// [`PEER_CONNECT_TIMEOUT`]).
#[derive(Debug)]
pub enum PeerError {
    /// No connection: refused, or no TCP or TLS handshake in time, or the
    /// certificate did not verify. The peer is marked down.
    Unreachable(String),
    /// Connected, but no response headers in time, or the connection
    /// broke before them. Not marked down (see above).
    NoAnswer(String),
    /// The peer does not know the upstream named ([`UNKNOWN_UPSTREAM_HEADER`]).
    UnknownUpstream,
    /// The peer answered with an error status and the OCI code of its body.
    /// Not marked down (see above).
    Status { status: StatusCode, code: String, retry_after: Option<String> },
}

impl std::fmt::Display for PeerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerError::Unreachable(e) => write!(f, "peer unreachable: {e}"),
            PeerError::NoAnswer(e) => write!(f, "peer did not answer: {e}"),
            PeerError::UnknownUpstream => write!(f, "peer does not know the upstream"),
            PeerError::Status { status, code, .. } => write!(f, "peer answered {status} {code}"),
        }
    }
}

/// One request to a peer.
pub struct Ask<'a> {
    pub method: Method,
    /// `/v2/<repo>/{blobs,manifests}/<ref>?ns=<upstream>`.
    pub path_and_query: &'a str,
    pub accept: Option<&'static str>,
    /// Resume a blob from this byte (`Range`).
    pub from: Option<u64>,
    /// Only what the peer already holds ([`LOOKUP_HEADER`]).
    pub lookup: bool,
    /// The asker missed in the shared tier already ([`SHARED_MISSED_HEADER`]).
    pub shared_missed: bool,
    /// How long to wait for response headers.
    pub timeout: Duration,
}

/// How a replica dials its peers.
///
/// https peers are verified like any TLS server, against the web PKI roots
/// plus `[cluster] ca_file`, and under one name: `[cluster] tls_name` when
/// set (sent as SNI too), else the host of the peer's URL. The fixed name
/// is what makes TLS work where peers are found by address (`peers_dns`, a
/// headless Service, or a list of pod IPs): every replica serves the same
/// `[server.tls]` certificate, which names Services, not pod IPs, so one
/// name on it verifies them all, while a certificate per pod IP would have
/// to be reissued whenever a pod moves. What the name proves is "holds a
/// key the cluster's CA certified for the peers' name", which is what
/// matters; the cluster secret, sent only after the handshake, still
/// proves membership. A peer whose certificate fails verification is
/// treated as unreachable ([`PeerError::Unreachable`]): marked down, and
/// the key fetched elsewhere, so a certificate mistake costs deduplication,
/// never a pull, and never sends the secret to whoever answered.
pub struct PeerClient {
    http: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
    secret: HeaderValue,
}

impl PeerClient {
    /// A client for `[cluster]`: sends its secret and verifies https peers
    /// as the type's docs say. Reads `ca_file`: call it off the async threads.
    pub fn new(config: &ClusterConfig) -> Result<Arc<PeerClient>, String> {
        let tls = crate::upstream::client_tls(config.ca_file.as_deref())?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(PEER_CONNECT_TIMEOUT));
        let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http();
        let builder = match &config.tls_name {
            Some(name) => builder.with_server_name_resolver(FixedServerNameResolver::new(name.clone())),
            None => builder,
        };
        let https = builder.enable_http1().enable_http2().wrap_connector(http);
        let http = Client::builder(TokioExecutor::new()).pool_idle_timeout(POOL_IDLE_TIMEOUT).build(https);
        let mut secret = HeaderValue::from_str(config.secret.expose())
            .map_err(|_| "the cluster secret is not a valid header value")?;
        secret.set_sensitive(true);
        Ok(Arc::new(PeerClient { http, secret }))
    }

    /// Sends one request to `peer` and returns a successful response (its
    /// body still open), or why there is none. `from`: a `Range` from that
    /// byte to the end.
    pub async fn send(&self, peer: &PeerUrl, ask: Ask<'_>) -> Result<Response<Incoming>, PeerError> {
        let kind = if ask.path_and_query.starts_with(PURGE_PATH) {
            "purge"
        } else if ask.path_and_query.contains("/blobs/") {
            "blob"
        } else {
            "manifest"
        };
        let answer = self.exchange(peer, ask).await;
        let result = match &answer {
            Ok(_) => "ok",
            Err(PeerError::Unreachable(_)) => "unreachable",
            Err(PeerError::NoAnswer(_)) => "no_answer",
            Err(PeerError::Status { status, .. }) if *status == StatusCode::NOT_FOUND => "not_found",
            Err(PeerError::UnknownUpstream | PeerError::Status { .. }) => "error",
        };
        metrics().peer_requests.with_label_values(&["out", kind, result]).inc();
        answer
    }

    /// Asks `peer` to purge what `query` names (`upstream=NAME[&repo=REPO]`,
    /// form-encoded): its answer, what it removed, as JSON.
    pub async fn purge(&self, peer: &PeerUrl, query: &str, timeout: Duration) -> Result<serde_json::Value, PeerError> {
        let path = format!("{PURGE_PATH}?{query}");
        let ask = Ask {
            method: Method::POST,
            path_and_query: &path,
            accept: None,
            from: None,
            lookup: false,
            shared_missed: false,
            timeout,
        };
        let resp = self.send(peer, ask).await?;
        let body = Limited::new(resp.into_body(), MAX_PURGE_ANSWER).collect();
        let body = tokio::time::timeout(timeout, body)
            .await
            .map_err(|_| PeerError::NoAnswer("the purge's answer stalled".into()))?
            .map_err(|e| PeerError::NoAnswer(format!("the purge's answer: {e}")))?;
        serde_json::from_slice(&body.to_bytes()).map_err(|e| PeerError::NoAnswer(format!("the purge's answer: {e}")))
    }

    async fn exchange(&self, peer: &PeerUrl, ask: Ask<'_>) -> Result<Response<Incoming>, PeerError> {
        let mut req = Request::builder()
            .method(ask.method)
            .uri(format!("{}{}", peer.as_str(), ask.path_and_query))
            .header(USER_AGENT, crate::USER_AGENT)
            .header(SECRET_HEADER, self.secret.clone());
        if let Some(accept) = ask.accept {
            req = req.header(ACCEPT, accept);
        }
        if let Some(from) = ask.from.filter(|f| *f > 0) {
            req = req.header(RANGE, format!("bytes={from}-"));
        }
        if ask.lookup {
            req = req.header(LOOKUP_HEADER, "1");
        }
        if ask.shared_missed {
            req = req.header(SHARED_MISSED_HEADER, "1");
        }
        let req = req.body(Empty::new()).map_err(|e| PeerError::NoAnswer(format!("building request: {e}")))?;
        let (mut head, body) = req.into_parts();
        let trace = crate::otel::client(&head.method, &head.uri, &mut head.headers, Some(peer.as_str()));
        let answer = self.answer(Request::from_parts(head, body), ask.timeout).instrument(trace.clone()).await;
        match &answer {
            Ok(resp) => crate::otel::answered(&trace, Ok(resp.status())),
            Err(PeerError::Status { status, .. }) => crate::otel::answered(&trace, Ok(*status)),
            Err(e) => crate::otel::answered(&trace, Err(e)),
        }
        answer
    }

    /// Sends `req` and reads what the peer answered (see [`PeerClient::send`]).
    async fn answer(&self, req: Request<Empty<Bytes>>, timeout: Duration) -> Result<Response<Incoming>, PeerError> {
        let resp = match tokio::time::timeout(timeout, self.http.request(req)).await {
            Err(_) => {
                let waited = humantime::format_duration(timeout);
                return Err(PeerError::NoAnswer(format!("no response headers within {waited}")));
            }
            Ok(Err(e)) if e.is_connect() => return Err(PeerError::Unreachable(crate::upstream::error_chain(&e))),
            Ok(Err(e)) => return Err(PeerError::NoAnswer(crate::upstream::error_chain(&e))),
            Ok(Ok(resp)) => resp,
        };
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        if resp.headers().contains_key(UNKNOWN_UPSTREAM_HEADER) {
            return Err(PeerError::UnknownUpstream);
        }
        let retry_after = resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let body = Limited::new(resp.into_body(), MAX_ERROR_BODY).collect();
        let body = tokio::time::timeout(PEER_ERROR_BODY_TIMEOUT, body).await.ok().and_then(Result::ok);
        let code = body
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b.to_bytes()).ok())
            .and_then(|v| v["errors"][0]["code"].as_str().map(str::to_owned))
            .unwrap_or_default();
        Err(PeerError::Status { status, code, retry_after })
    }
}
