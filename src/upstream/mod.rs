//! One configured upstream registry: the only hosts larder ever dials are
//! the `url`s of these (plus token realms and redirect targets they name,
//! under the rules in `auth`, `realm` and `Upstream::open`).
//!
//! The request loop is here; who gets which credentials is in `auth`
//! (with `realm`, `scope`, `tokens`, `credentials` and `helper`);
//! Docker Hub's pull limit in `ratelimit`; the pause of tag
//! revalidation after failures in `backoff`. Background work has permits
//! of its own ([`crate::background`]).

mod auth;
mod backoff;
pub mod bandwidth;
mod challenge;
mod client;
mod credentials;
pub mod dial;
mod embedded;
pub mod health;
mod helper;
mod lent;
pub mod priority;
mod ratelimit;
mod realm;
mod scope;
mod tokens;
mod upstreams;
mod verify;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, LINK, LOCATION, RANGE, USER_AGENT};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::Empty;
use hyper::body::Incoming;

pub use backoff::Backoff;
pub use challenge::Challenge;
pub use client::{client_tls, error_chain};
pub use priority::{Permit, Priority};
pub use upstreams::Upstreams;
pub use verify::Probe;

use crate::config::UpstreamConfig;
use crate::error::{Error, UpstreamError};
use crate::metrics::metrics;
use crate::oci::{Digest, MAX_MANIFEST_SIZE, ManifestRefs, MediaType, Reference, RepoName, Warnings};
use auth::{Auth, Hop, Presented, Who};
use client::{HttpClient, Named};
use ratelimit::RateLimit;
use tokio::time::Instant;

/// Redirects followed for one request (blob GETs go to a CDN); more is an error.
pub const MAX_REDIRECTS: usize = 5;
/// Largest `tags/list` or `referrers` page read from upstream.
pub const MAX_LIST_PAGE: usize = 4 << 20;
/// After one of several `urls` failed to connect or timed out, it is tried
/// after the others for this long, so that a blackholed primary does not
/// cost every request a connect timeout.
pub const FAILOVER_PAUSE: Duration = Duration::from_secs(30);

pub struct Upstream {
    pub config: UpstreamConfig,
    /// `config.name`, shared without copying (recorded with each use of
    /// cached content: the charge of an item follows its users).
    name: Arc<str>,
    http: HttpClient,
    auth: Auth,
    /// `max_concurrency` permits; one is held while an upstream request is
    /// open (until its body is read or dropped). Waiters are served in
    /// order; fills ahead of a client hold at most half (see [`priority`]).
    permits: priority::Permits,
    /// The permits of background work (the warm loop), apart from
    /// clients' (see [`crate::background`]).
    background_permits: priority::Permits,
    /// The bandwidth its fills share (`max_bandwidth`; clients first).
    bandwidth: Arc<bandwidth::Bandwidth>,
    /// Last error, last success and rate-limit headroom, for operators.
    pub health: health::Health,
    /// `url` and the fallbacks of `urls`, in order: the upstream's own origins.
    origins: Vec<Origin>,
    /// Per origin, until when it goes last after failing to connect.
    /// A std Mutex: never held across `.await`.
    demoted: Mutex<Vec<Option<Instant>>>,
    rate_limit: RateLimit,
    revalidation: Backoff,
    /// With `client_credentials = "verify"`: the verdicts on clients'
    /// credentials and the bounds on checking them.
    verifier: Option<verify::Verifier>,
}

/// One of the upstream's own origins, and whether its credentials go there.
struct Origin {
    uri: Uri,
    credentials: bool,
}

/// One request as [`Upstream::open_from`] sends it to each origin.
#[derive(Clone, Copy)]
struct Outbound<'a> {
    method: &'a Method,
    path_and_query: &'a str,
    repo: &'a RepoName,
    accept: Option<&'static str>,
    range: Option<&'a str>,
    who: Who<'a>,
}

/// An upstream response whose body is still open, with the concurrency
/// permit it holds.
pub struct Opened {
    pub response: Response<Incoming>,
    pub permit: Permit,
}

/// The bytes of a blob a GET asks for: from `start` to `end` (exclusive),
/// or to the blob's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub start: u64,
    pub end: Option<u64>,
}

impl Span {
    /// The whole blob: a GET without `Range`.
    pub const WHOLE: Span = Span { start: 0, end: None };

    /// From `start` to the blob's end (a resume).
    pub fn from(start: u64) -> Span {
        Span { start, end: None }
    }

    /// The `Range` header asking for it; `None` for the whole blob.
    fn header(&self) -> Option<String> {
        match (self.start, self.end) {
            (0, None) => None,
            (start, None) => Some(format!("bytes={start}-")),
            (start, Some(end)) => Some(format!("bytes={start}-{}", end.saturating_sub(1))),
        }
    }
}

/// As an operator reads it in an error: `bytes 0-8388607` (the last byte
/// included, as in a `Range` header), `bytes 100-` or `the whole blob`.
impl std::fmt::Display for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.start, self.end) {
            (0, None) => write!(f, "the whole blob"),
            (start, None) => write!(f, "bytes {start}-"),
            (start, Some(end)) => write!(f, "bytes {start}-{}", end.saturating_sub(1)),
        }
    }
}

/// What a `206`'s [`content_range`] said, for an error: `bytes 100-199/4096`
/// (`/*` for an unknown total), or that it had no valid one.
pub fn described_range(range: Option<(u64, u64, Option<u64>)>) -> String {
    match range {
        Some((first, last, Some(total))) => format!("bytes {first}-{last}/{total}"),
        Some((first, last, None)) => format!("bytes {first}-{last}/*"),
        None => "a 206 without a valid Content-Range".to_owned(),
    }
}

/// A manifest as upstream sent it, checked: its digest is the hash of the
/// exact bytes, and it agrees with the reference and `Docker-Content-Digest`.
#[derive(Clone, Debug)]
pub struct FetchedManifest {
    pub bytes: Bytes,
    pub media_type: MediaType,
    pub digest: Digest,
    pub refs: ManifestRefs,
    /// The registry warnings sent with it (relayed to clients); `None`
    /// from a source that keeps none (the shared tier, an import).
    pub warnings: Option<Warnings>,
}

/// What a listing endpoint lists.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Listing {
    /// `tags/list`
    Tags,
    /// `referrers/<digest>`: manifests whose `subject` is the digest.
    Referrers(Digest),
}

impl Listing {
    fn path(&self, repo: &RepoName) -> String {
        match self {
            Listing::Tags => format!("/v2/{repo}/tags/list"),
            Listing::Referrers(d) => format!("/v2/{repo}/referrers/{d}"),
        }
    }
}

/// One page of a listing, as upstream sent it.
#[derive(Clone, Debug)]
pub struct Page {
    pub body: Bytes,
    pub content_type: HeaderValue,
    /// Upstream's next-page `Link`, on upstream's own path.
    pub link: Option<HeaderValue>,
    /// `OCI-Filters-Applied` of a filtered referrers answer.
    pub filters_applied: Option<HeaderValue>,
}

impl Upstream {
    /// Builds the client for one upstream (reads its `ca_file`: call it off
    /// the async threads).
    pub fn new(config: UpstreamConfig) -> Result<Upstream, String> {
        let auth = Auth::new(&config);
        let permits = priority::Permits::new(config.max_concurrency.get());
        // Through a hub larder (`via`), the hub is the only origin (and
        // such an upstream has no credentials: the config refuses them).
        let origins: Vec<Origin> = match &config.via {
            Some(hub) => vec![Origin { uri: hub.clone(), credentials: false }],
            None => std::iter::once(Origin { uri: config.url.clone(), credentials: true })
                .chain(config.fallback_urls.iter().map(|f| Origin { uri: f.url.clone(), credentials: f.credentials }))
                .collect(),
        };
        let own: Vec<&Uri> = origins.iter().map(|o| &o.uri).collect();
        let policy = Arc::new(dial::DialPolicy::new(&own, &config.trusted_networks));
        let http = HttpClient::new(&config, policy)?;
        if let Some(crate::config::CredentialSource::Helper(name)) = &config.credentials {
            let program = helper::program(name);
            let path = std::env::var_os("PATH").unwrap_or_default();
            if !std::env::split_paths(&path).any(|dir| dir.join(&program).is_file()) {
                tracing::warn!(upstream = config.name, program, "credential helper not found on PATH");
            }
        }
        let bandwidth = Arc::new(bandwidth::Bandwidth::new(&config.name, config.max_bandwidth));
        Ok(Upstream {
            name: Arc::from(config.name.as_str()),
            demoted: Mutex::new(vec![None; origins.len()]),
            origins,
            rate_limit: RateLimit::new(&config.name),
            revalidation: Backoff::default(),
            verifier: match config.client_credentials {
                crate::config::ClientCredentialsMode::Verify { ttl } => Some(verify::Verifier::new(&config.name, ttl)),
                crate::config::ClientCredentialsMode::Ignore => None,
            },
            config,
            http,
            auth,
            permits,
            background_permits: priority::Permits::new(crate::background::CONCURRENCY),
            bandwidth,
            health: health::Health::default(),
        })
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The name, shared.
    pub fn shared_name(&self) -> &Arc<str> {
        &self.name
    }

    /// The bandwidth this upstream's fills share.
    pub fn bandwidth(&self) -> &Arc<bandwidth::Bandwidth> {
        &self.bandwidth
    }

    pub fn body_idle_timeout(&self) -> std::time::Duration {
        self.http.body_idle_timeout()
    }

    /// Whether upstream's pull limit is used up (Docker Hub's
    /// `ratelimit-remaining: 0`, or a recent 429): a manifest GET now would
    /// be refused, or spend the last pull.
    pub fn rate_limited(&self) -> bool {
        self.rate_limit.exhausted()
    }

    /// The pause of tag revalidation after it failed against this upstream.
    pub fn revalidation_backoff(&self) -> &Backoff {
        &self.revalidation
    }

    fn url(base: &Uri, path_and_query: &str) -> Result<Uri, UpstreamError> {
        let authority = base.authority().map(|a| a.as_str()).unwrap_or_default();
        format!("{}://{authority}{path_and_query}", base.scheme_str().unwrap_or("https"))
            .parse()
            .map_err(|e| UpstreamError::Protocol(format!("building upstream URL: {e}")))
    }

    /// The own origin `uri` is on, if it is on one.
    fn own_origin(&self, uri: &Uri) -> Option<&Origin> {
        self.origins.iter().find(|o| uri.scheme() == o.uri.scheme() && uri.authority() == o.uri.authority())
    }

    /// The origins in the order to try them: those not demoted first.
    fn origin_order(&self) -> Vec<usize> {
        let demoted = self.demoted.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let is_demoted = |i: &usize| demoted[*i].is_some_and(|until| now < until);
        let (later, first): (Vec<usize>, Vec<usize>) = (0..self.origins.len()).partition(is_demoted);
        first.into_iter().chain(later).collect()
    }

    fn demote(&self, origin: usize, until: Option<Instant>) {
        let mut demoted = self.demoted.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = demoted.get_mut(origin) {
            *slot = until;
        }
    }

    /// Sends one request for `repo` and returns the final response, from
    /// the first of the upstream's `urls` that connects and does not answer
    /// 5xx (the last one's answer, whatever it is). One permit of
    /// `max_concurrency` is held throughout, taken as `priority` says (of
    /// background work's own pool for background work: clients go first,
    /// see [`crate::background`]).
    async fn open(
        &self,
        method: Method,
        path_and_query: &str,
        repo: &RepoName,
        accept: Option<&'static str>,
        range_priority: (Option<String>, Option<&Priority>),
    ) -> Result<Opened, UpstreamError> {
        self.open_as(Who::Larder, method, path_and_query, repo, accept, range_priority).await
    }

    /// [`Upstream::open`] with `who`'s credentials. A client's go only to
    /// the origins that get the upstream's own credentials, and its
    /// request stops at a redirect (the registry's answer is all a check
    /// needs; a storage URL is nobody's to judge credentials by).
    async fn open_as(
        &self,
        who: Who<'_>,
        method: Method,
        path_and_query: &str,
        repo: &RepoName,
        accept: Option<&'static str>,
        (range, priority): (Option<String>, Option<&Priority>),
    ) -> Result<Opened, UpstreamError> {
        let permits = if crate::background::active() { &self.background_permits } else { &self.permits };
        let permit =
            permits.acquire(priority).await.map_err(|_| UpstreamError::Connect("upstream is shutting down".into()))?;
        // A hub routes by `ns`, as it does containerd's requests.
        let with_ns;
        let path_and_query = match &self.config.via {
            Some(_) => {
                let sep = if path_and_query.contains('?') { '&' } else { '?' };
                let ns = form_urlencoded::Serializer::new(String::new()).append_pair("ns", self.name()).finish();
                with_ns = format!("{path_and_query}{sep}{ns}");
                with_ns.as_str()
            }
            None => path_and_query,
        };
        let client = matches!(who, Who::Client(_));
        let order = self.origin_order().into_iter().filter(|i| !client || self.origins[*i].credentials);
        let mut order = order.collect::<Vec<_>>().into_iter().peekable();
        while let Some(i) = order.next() {
            let request = Outbound { method: &method, path_and_query, repo, accept, range: range.as_deref(), who };
            let result = self.open_from(&self.origins[i].uri, request).await;
            let unreachable = matches!(result, Err(UpstreamError::Connect(_) | UpstreamError::Timeout(_)));
            self.demote(i, unreachable.then(|| Instant::now() + FAILOVER_PAUSE));
            let failed = unreachable || result.as_ref().is_ok_and(|r| r.status().is_server_error());
            if failed && order.peek().is_some() {
                let why = match &result {
                    Ok(r) => r.status().to_string(),
                    Err(e) => e.to_string(),
                };
                tracing::warn!(upstream = self.name(), url = %self.origins[i].uri, why, "trying the next of its urls");
                continue;
            }
            return result.map(|response| Opened { response, permit });
        }
        Err(UpstreamError::Connect("no upstream url to try".into()))
    }

    /// One request from one origin: a 401 is answered once per hop through
    /// [`Auth`] (the upstream's credentials for its own origins that get
    /// them, an anonymous token elsewhere), redirects are followed up to
    /// [`MAX_REDIRECTS`], never from https to http, and a redirect target
    /// is dialled only at an address [`dial`] allows. `Authorization` only
    /// ever carries what [`Auth`] chose for that hop's origin.
    async fn open_from(&self, base: &Uri, request: Outbound<'_>) -> Result<Response<Incoming>, UpstreamError> {
        let Outbound { method, path_and_query, repo, accept, range, who } = request;
        let larder = matches!(who, Who::Larder);
        let mut url = Self::url(base, path_and_query)?;
        let mut answer: Option<HeaderValue> = None;
        let mut redirects = 0;
        loop {
            let origin = self.own_origin(&url);
            let hop = Hop {
                url: &url,
                own: origin.is_some(),
                credentials: origin.is_some_and(|o| o.credentials),
                requested: repo,
                who,
            };
            let (authorization, presented) = match answer.take() {
                Some(fresh) => (Some(fresh), Presented::Fresh),
                None => self.auth.up_front(&self.http, &hop).await?,
            };
            let mut req =
                Request::builder().method(method.clone()).uri(url.clone()).header(USER_AGENT, crate::USER_AGENT);
            if let Some(accept) = accept {
                req = req.header(ACCEPT, accept);
            }
            if let Some(range) = range {
                req = req.header(RANGE, range);
            }
            if let Some(a) = authorization {
                req = req.header(AUTHORIZATION, a);
            }
            let req = req
                .body(Empty::<Bytes>::new())
                .map_err(|e| UpstreamError::Protocol(format!("building request: {e}")))?;
            let named = if hop.own { Named::ByOperator } else { Named::ByUpstream };
            let resp = self.send(req, method, named).await?;
            let status = resp.status();
            if hop.own {
                self.rate_limit.observe(method, status, resp.headers());
            }
            if status == StatusCode::UNAUTHORIZED {
                if matches!(presented, Presented::Fresh) {
                    // A client refused is the client's business, not larder's.
                    if larder {
                        self.auth.failed("denied");
                    }
                    return Ok(resp);
                }
                let Some(challenge) = Challenge::from_headers(resp.headers()) else {
                    return Ok(resp);
                };
                answer = Some(self.auth.answer(&self.http, &hop, challenge, presented).await?);
                continue;
            }
            let redirect = larder && matches!(status.as_u16(), 301 | 302 | 303 | 307 | 308);
            if let (true, Some(location)) = (redirect, resp.headers().get(LOCATION)) {
                redirects += 1;
                if redirects > MAX_REDIRECTS {
                    return Err(UpstreamError::Protocol(format!("more than {MAX_REDIRECTS} redirects")));
                }
                let target = resolve_location(&url, location)?;
                if url.scheme() == Some(&http::uri::Scheme::HTTPS) && target.scheme() != Some(&http::uri::Scheme::HTTPS)
                {
                    let why = format!("{} redirects to {}", without_query(&url), without_query(&target));
                    return Err(self.http.refused("downgrade", &why));
                }
                url = target;
                continue;
            }
            return Ok(resp);
        }
    }

    /// Sends one request, counted and timed per upstream.
    async fn send(
        &self,
        req: Request<Empty<Bytes>>,
        method: &Method,
        named: Named,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let started = std::time::Instant::now();
        let sent = self.http.send(req, named).await;
        let m = metrics();
        m.upstream_duration.with_label_values(&[self.name()]).observe(started.elapsed().as_secs_f64());
        let status_label = sent.as_ref().map_or("error", |r| status_label(r.status()));
        m.upstream_requests.with_label_values(&[self.name(), method.as_str(), status_label]).inc();
        self.health.observe(&sent);
        sent
    }

    /// GET a manifest. `Ok(None)`: upstream says it does not exist.
    pub async fn get_manifest(
        &self,
        repo: &RepoName,
        reference: &Reference,
    ) -> Result<Option<FetchedManifest>, UpstreamError> {
        let path = format!("/v2/{repo}/manifests/{reference}");
        let opened = self.open(Method::GET, &path, repo, Some(MediaType::upstream_accept()), (None, None)).await?;
        let resp = opened.response;
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if resp.status() != StatusCode::OK {
            return Err(failure(resp.status(), resp.headers()));
        }
        let declared = header_str(resp.headers(), CONTENT_TYPE.as_str()).and_then(MediaType::parse);
        let header_digest = header_str(resp.headers(), "docker-content-digest").and_then(|d| d.parse::<Digest>().ok());
        let warnings = Some(Warnings::from_headers(resp.headers()));
        if let Some(len) = content_length(resp.headers()) {
            if len > MAX_MANIFEST_SIZE as u64 {
                return Err(UpstreamError::Protocol(format!("manifest of {len} bytes exceeds {MAX_MANIFEST_SIZE}")));
            }
        }
        let bytes = self.http.read_body(resp.into_body(), MAX_MANIFEST_SIZE).await?;
        drop(opened.permit);

        let digest = Digest::of(&bytes);
        let expected = match reference {
            Reference::Digest(d) => Some(*d),
            Reference::Tag(_) => header_digest,
        };
        if let Some(expected) = expected {
            if expected != digest {
                metrics().digest_mismatch.inc();
                return Err(UpstreamError::DigestMismatch { expected, actual: digest.to_string() });
            }
        }
        let (media_type, refs) = crate::oci::inspect_manifest(&bytes, declared).map_err(UpstreamError::Protocol)?;
        Ok(Some(FetchedManifest { bytes, media_type, digest, refs, warnings }))
    }

    /// HEAD a manifest: the digest a tag points at now, or confirmation that
    /// a digest exists in `repo`. `Ok(None)`: upstream does not have it.
    pub async fn head_manifest(&self, repo: &RepoName, reference: &Reference) -> Result<Option<Digest>, UpstreamError> {
        Ok(self.head_manifest_warned(repo, reference).await?.map(|(digest, _)| digest))
    }

    /// [`Upstream::head_manifest`], with the registry warnings of the
    /// answer (a tag's revalidation keeps its manifest's warnings current).
    pub async fn head_manifest_warned(
        &self,
        repo: &RepoName,
        reference: &Reference,
    ) -> Result<Option<(Digest, Warnings)>, UpstreamError> {
        let path = format!("/v2/{repo}/manifests/{reference}");
        let opened = self.open(Method::HEAD, &path, repo, Some(MediaType::upstream_accept()), (None, None)).await?;
        let resp = opened.response;
        match resp.status() {
            StatusCode::NOT_FOUND => Ok(None),
            StatusCode::OK => header_str(resp.headers(), "docker-content-digest")
                .and_then(|d| d.parse().ok())
                .map(|digest| Some((digest, Warnings::from_headers(resp.headers()))))
                .ok_or_else(|| UpstreamError::Protocol("HEAD manifest without Docker-Content-Digest".into())),
            status => Err(failure(status, resp.headers())),
        }
    }

    /// GET the `span` of a blob, the body left open for the caller to
    /// stream: a `Range` request unless it is the whole blob (a resume of
    /// a fill another source broke off, or one part of a parallel fill).
    /// The response is a 206 for the range, or a 200 with the whole blob
    /// from a registry that ignores `Range`. `Ok(None)`: upstream says it
    /// does not exist.
    pub async fn get_blob(
        &self,
        repo: &RepoName,
        digest: &Digest,
        span: Span,
        priority: &Priority,
    ) -> Result<Option<Opened>, UpstreamError> {
        let path = format!("/v2/{repo}/blobs/{digest}");
        let range = span.header();
        let ranged = range.is_some();
        let opened = self.open(Method::GET, &path, repo, None, (range, Some(priority))).await?;
        match opened.response.status() {
            StatusCode::OK => Ok(Some(opened)),
            StatusCode::PARTIAL_CONTENT if ranged => Ok(Some(opened)),
            StatusCode::NOT_FOUND => Ok(None),
            status => Err(failure(status, opened.response.headers())),
        }
    }

    /// HEAD a blob: `Some` if upstream has it in `repo`, with its size if
    /// upstream said.
    pub async fn head_blob(&self, repo: &RepoName, digest: &Digest) -> Result<Option<Option<u64>>, UpstreamError> {
        let opened = self.open(Method::HEAD, &format!("/v2/{repo}/blobs/{digest}"), repo, None, (None, None)).await?;
        let resp = opened.response;
        match resp.status() {
            StatusCode::OK => Ok(Some(content_length(resp.headers()))),
            StatusCode::NOT_FOUND => Ok(None),
            status => Err(failure(status, resp.headers())),
        }
    }

    /// GET one page of a listing, with the client's query (pagination,
    /// `artifactType`). `Ok(None)`: upstream answered 404.
    pub async fn get_listing(
        &self,
        repo: &RepoName,
        listing: &Listing,
        query: Option<&str>,
    ) -> Result<Option<Page>, Error> {
        let path = match query {
            Some(q) => format!("{}?{q}", listing.path(repo)),
            None => listing.path(repo),
        };
        let opened = self.open(Method::GET, &path, repo, None, (None, None)).await?;
        let resp = opened.response;
        match resp.status() {
            StatusCode::OK => {}
            StatusCode::NOT_FOUND => return Ok(None),
            status => return Err(failure(status, resp.headers()).into()),
        }
        let link = resp.headers().get(LINK).cloned();
        let filters_applied = resp.headers().get("oci-filters-applied").cloned();
        let body = self.http.read_body(resp.into_body(), MAX_LIST_PAGE).await?;
        // Parsed and written anew, never relayed: a body that is not a
        // listing (an answer from wherever a redirect led) stops here.
        // The parser's words may quote the body: they go to the log only.
        let (checked, content_type, label, expected) = match listing {
            Listing::Tags => (crate::oci::tag_list::reserialize(&body), "application/json", "tags", "a tag list"),
            Listing::Referrers(_) => {
                (crate::oci::referrers::reserialize(&body), MediaType::OciIndex.as_str(), "referrers", "an image index")
            }
        };
        let body = checked.map_err(|why| {
            metrics().upstream_listings_refused.with_label_values(&[self.name(), label]).inc();
            tracing::warn!(upstream = self.name(), %repo, listing = label, why, "refused an upstream listing");
            UpstreamError::Protocol(format!("the {label} answer is not {expected}"))
        })?;
        Ok(Some(Page {
            body: Bytes::from(body),
            content_type: HeaderValue::from_static(content_type),
            link,
            filters_applied,
        }))
    }
}

/// A bounded label for an upstream status code.
fn status_label(status: StatusCode) -> &'static str {
    match status.as_u16() {
        200 => "200",
        206 => "206",
        301 | 302 | 303 | 307 | 308 => "3xx",
        401 => "401",
        403 => "403",
        404 => "404",
        429 => "429",
        500..=599 => "5xx",
        _ => "other",
    }
}

/// Maps an unexpected upstream status to the error a client should see.
fn failure(status: StatusCode, headers: &HeaderMap) -> UpstreamError {
    match status.as_u16() {
        401 | 403 => UpstreamError::Denied,
        429 => UpstreamError::RateLimited { retry_after: retry_after(headers) },
        s => UpstreamError::Status { status: s, retry_after: retry_after(headers) },
    }
}

fn retry_after(headers: &HeaderMap) -> Option<String> {
    header_str(headers, "retry-after").map(str::to_owned)
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// `Content-Range: bytes <first>-<last>/<total or *>` of a `206`: the
/// first and last byte (inclusive) and the blob's size if given.
pub fn content_range(headers: &HeaderMap) -> Option<(u64, u64, Option<u64>)> {
    let value = header_str(headers, http::header::CONTENT_RANGE.as_str())?;
    let (range, total) = value.trim().strip_prefix("bytes ")?.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let (first, last) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    (first <= last).then_some((first, last, total.trim().parse().ok()))
}

/// `Content-Length` of a response, if present and valid.
pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    header_str(headers, CONTENT_LENGTH.as_str()).and_then(|v| v.trim().parse().ok())
}

/// `scheme://authority/path` of a URL, for logs: a signed CDN URL's query
/// is a credential of its own.
fn without_query(uri: &Uri) -> String {
    format!("{}://{}{}", uri.scheme_str().unwrap_or("?"), uri.authority().map_or("", |a| a.as_str()), uri.path())
}

/// Resolves a `Location` header (absolute or relative) against the request URL.
fn resolve_location(base: &Uri, location: &HeaderValue) -> Result<Uri, UpstreamError> {
    let bad = |m: String| UpstreamError::Protocol(format!("redirect: {m}"));
    let location = location.to_str().map_err(|e| bad(e.to_string()))?;
    let base = url::Url::parse(&base.to_string()).map_err(|e| bad(e.to_string()))?;
    let target = base.join(location).map_err(|e| bad(format!("{location:?}: {e}")))?;
    if !matches!(target.scheme(), "http" | "https") {
        return Err(bad(format!("{location:?} is not http(s)")));
    }
    target.as_str().parse().map_err(|e| bad(format!("{location:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_and_ranges_read_as_an_operator_writes_them() {
        assert_eq!(Span { start: 0, end: Some(8 << 20) }.to_string(), "bytes 0-8388607");
        assert_eq!(Span::from(100).to_string(), "bytes 100-");
        assert_eq!(Span::WHOLE.to_string(), "the whole blob");
        assert_eq!(described_range(Some((100, 199, Some(4096)))), "bytes 100-199/4096");
        assert_eq!(described_range(Some((0, 9, None))), "bytes 0-9/*");
        assert_eq!(described_range(None), "a 206 without a valid Content-Range");
    }

    #[test]
    fn relative_and_absolute_locations() {
        let base: Uri = "https://r.example/v2/a/blobs/sha256:x".parse().unwrap();
        let abs = resolve_location(&base, &HeaderValue::from_static("https://cdn.example/p?sig=1")).unwrap();
        assert_eq!(abs.to_string(), "https://cdn.example/p?sig=1");
        let rel = resolve_location(&base, &HeaderValue::from_static("/storage/abc")).unwrap();
        assert_eq!(rel.to_string(), "https://r.example/storage/abc");
        let rel2 = resolve_location(&base, &HeaderValue::from_static("y")).unwrap();
        assert_eq!(rel2.to_string(), "https://r.example/v2/a/blobs/y");
        assert!(resolve_location(&base, &HeaderValue::from_static("file:///etc/passwd")).is_err());
    }

    #[test]
    fn ipv6_hosts_with_zone_ids_or_odd_ipv4_tails_are_not_followed() {
        // The dial guard sees only hosts a URL parser accepted: these never get that far.
        let base: Uri = "https://r.example/v2/a/manifests/v1".parse().unwrap();
        for location in [
            "http://[2002:a9fe:a9fe::1%25lo]/",
            "http://[2002:a9fe:a9fe::1%lo]/",
            "http://[64:ff9b:1::0xa9.0xfe.0xa9.0xfe]/",
            "http://[64:ff9b:1::0251.0376.0251.0376]/",
            "http://[::ffff:0:169.254.169.0254]/",
            "http://[::ffff:0:2852039166]/",
            "http://2002:a9fe:a9fe::1/",
        ] {
            let got = resolve_location(&base, &HeaderValue::from_str(location).unwrap());
            assert!(got.is_err(), "{location} became {got:?}");
        }
        // Written differently, the same address: the guard sees it as one.
        for (location, host) in [
            ("http://[::FFFF:169.254.169.254]/", "::ffff:a9fe:a9fe"),
            ("http://[2002:A9FE:A9FE:0000::0001]/", "2002:a9fe:a9fe::1"),
            ("http://[64:ff9b:1::169.254.169.254]/", "64:ff9b:1::a9fe:a9fe"),
        ] {
            let target = resolve_location(&base, &HeaderValue::from_str(location).unwrap()).unwrap();
            assert_eq!(crate::site::host_of(&target), host, "{location}");
        }
    }

    #[test]
    fn failures_map_by_status() {
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("7"));
        assert!(matches!(
            failure(StatusCode::TOO_MANY_REQUESTS, &h),
            UpstreamError::RateLimited { retry_after: Some(r) } if r == "7"
        ));
        assert!(matches!(failure(StatusCode::FORBIDDEN, &h), UpstreamError::Denied));
        assert!(matches!(failure(StatusCode::BAD_GATEWAY, &h), UpstreamError::Status { status: 502, .. }));
    }
}
