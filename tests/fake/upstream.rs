//! `FakeUpstream`: an in-process registry on 127.0.0.1 that larder dials,
//! serving blobs and manifests with faults injected on request.
//!
//! ```ignore
//! let up = FakeUpstream::builder()
//!     .blob(bytes)
//!     .stall_after(1 << 20)
//!     .start()
//!     .await;
//! ```
//!
//! Fault knobs written after `.blob(..)` or `.manifest(..)` apply to that
//! item; [`FakeUpstreamBuilder::faults_for_all`] applies to every item that
//! does not set the knob itself. At run time the same knobs can be changed
//! ([`FakeUpstream::set_faults`], [`FakeUpstream::heal`]), a stalled body
//! released, the next requests failed with a status, and the whole server
//! taken down and brought back.
//!
//! A blob GET's `Range` is answered the ways real upstreams get it wrong
//! when asked ([`Ranges`]: ignored, honoured, honoured for the first part
//! only, longer, shorter or shifted), each answer's body subject to the
//! same faults (a part that trickles, or stalls after a few bytes).
//!
//! For attack tests it can also act as a registry that wants credentials
//! ([`FakeUpstreamBuilder::challenge`]), hands out a token at `/token`,
//! redirects a blob to a "CDN" ([`FakeUpstreamBuilder::redirect`]), serves
//! `/cdn/<digest>` itself for same-host redirects (answering `Range` with
//! a 206, as object stores do), and keeps an item to one repository
//! ([`FakeUpstreamBuilder::only_in`]).
//!
//! Every connection carries exactly one request (no keep-alive), so the
//! fake can look at a request before choosing how to answer it: through
//! hyper, or on the raw socket when a fault breaks HTTP framing in a way
//! hyper refuses to (a body longer than its `Content-Length`).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{
    AUTHORIZATION, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, HeaderValue, LOCATION, RANGE, RETRY_AFTER, SET_COOKIE,
    WWW_AUTHENTICATE,
};
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

pub type FakeBody = UnsyncBoxBody<Bytes, io::Error>;

/// Body bytes handed to hyper at once when the body is not trickled.
const CHUNK: usize = 64 << 10;

/// What can go wrong with one item (or, as global faults, with all).
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// A blob: same length, different content. A manifest: a trailing
    /// newline (still valid JSON, but no longer the digest it is served as).
    pub wrong_bytes: bool,
    /// `Docker-Content-Digest` names other content than the body.
    pub wrong_digest_header: bool,
    /// Sends this many body bytes, then breaks the connection; the
    /// `Content-Length` promised the whole body.
    pub truncate_at: Option<usize>,
    /// Declares a `Content-Length` this many bytes short of the body, then
    /// sends the whole body anyway (raw TCP; hyper will not).
    pub overlong_by: Option<usize>,
    /// Waits this long before sending response headers.
    pub stall_headers: Option<Duration>,
    /// Waits this long after the headers before the first body byte.
    pub delay_body: Option<Duration>,
    /// Sends the body `chunk` bytes at a time, pausing `every` between.
    pub trickle: Option<(usize, Duration)>,
    /// Sends this many body bytes, then waits for [`FakeUpstream::release`].
    pub stall_after: Option<usize>,
    /// Answers every request for the item with this status (and error
    /// JSON) instead of the content.
    pub status: Option<u16>,
    /// How a blob GET with a `Range` header is answered (unset: as
    /// [`Ranges::Ignored`], a registry that ignores `Range`).
    pub ranges: Option<Ranges>,
}

/// How the fake answers a blob GET that carries `Range: bytes=first-last`
/// (an unparseable or unsatisfiable one gets the whole blob, `200`). The
/// faults on the body (a stall, a trickle, a cut) apply to each answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ranges {
    /// `200` with the whole blob, as a registry that ignores `Range`.
    #[default]
    Ignored,
    /// `206` with exactly the bytes asked, as distribution and object
    /// stores answer.
    Honoured,
    /// `206` for a range from byte 0, `200` with the whole blob for any
    /// later one: mixed backends behind a load balancer.
    FirstOnly,
    /// `206` from the byte asked to the blob's end, however little was
    /// asked: a cache still populating the object.
    Overlong,
    /// `206` with exactly the bytes asked for a range from byte 0, from
    /// the byte asked to the blob's end for any later one.
    OverlongLater,
    /// `206` from the byte asked, at most this many bytes of it.
    Short(usize),
    /// `206` starting this many bytes after the byte asked (and ending as
    /// many after, within the blob), its `Content-Range` saying so.
    Shifted(usize),
}

impl Ranges {
    /// The status, bytes and `Content-Range` answering `range` for `blob`.
    fn answer(self, range: Option<&str>, blob: &Bytes) -> (u16, Bytes, Option<String>) {
        let size = blob.len();
        let Some((first, last)) = range.and_then(|r| cdn_range(r, size)) else {
            return (200, blob.clone(), None);
        };
        let (first, last) = match self {
            Ranges::Ignored => return (200, blob.clone(), None),
            Ranges::FirstOnly if first > 0 => return (200, blob.clone(), None),
            Ranges::Honoured | Ranges::FirstOnly => (first, last),
            Ranges::Overlong => (first, size - 1),
            Ranges::OverlongLater if first > 0 => (first, size - 1),
            Ranges::OverlongLater => (first, last),
            Ranges::Short(n) => (first, last.min(first + n.max(1) - 1)),
            Ranges::Shifted(by) => ((first + by).min(size - 1), (last + by).min(size - 1)),
        };
        (206, blob.slice(first..=last), Some(format!("bytes {first}-{last}/{size}")))
    }
}

impl Faults {
    /// Each knob from `self`, or from `global` where `self` leaves it unset.
    fn or(&self, global: &Faults) -> Faults {
        Faults {
            wrong_bytes: self.wrong_bytes || global.wrong_bytes,
            wrong_digest_header: self.wrong_digest_header || global.wrong_digest_header,
            truncate_at: self.truncate_at.or(global.truncate_at),
            overlong_by: self.overlong_by.or(global.overlong_by),
            stall_headers: self.stall_headers.or(global.stall_headers),
            delay_body: self.delay_body.or(global.delay_body),
            trickle: self.trickle.or(global.trickle),
            stall_after: self.stall_after.or(global.stall_after),
            status: self.status.or(global.status),
            ranges: self.ranges.or(global.ranges),
        }
    }
}

/// One request as the fake received it.
#[derive(Clone, Debug)]
pub struct Logged {
    pub method: String,
    pub path: String,
    /// The `Range` header, if the request carried one.
    pub range: Option<String>,
    /// The `Authorization` header, if the request carried one.
    pub authorization: Option<String>,
    /// The query string, if any.
    pub query: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Blob,
    Manifest,
}

#[derive(Clone)]
struct Item {
    kind: Kind,
    bytes: Bytes,
    /// `Content-Type` of a manifest.
    media_type: Option<String>,
    faults: Faults,
    /// A GET is answered `307` with this `Location` instead of the content.
    redirect: Option<String>,
    /// Sent without `Content-Length` (chunked).
    chunked: bool,
    /// The only repository that has the item; `None`: every repository.
    only_in: Option<String>,
    /// `Warning` header values sent with a manifest (GET and HEAD), one
    /// header line each, as they are.
    warnings: Vec<String>,
}

impl Item {
    /// An empty blob without faults, for `..Item::plain()`.
    fn plain() -> Item {
        Item {
            kind: Kind::Blob,
            bytes: Bytes::new(),
            media_type: None,
            faults: Faults::default(),
            redirect: None,
            chunked: false,
            only_in: None,
            warnings: Vec::new(),
        }
    }
}

#[derive(Default)]
struct Content {
    /// Blobs and manifests by digest.
    items: HashMap<String, Item>,
    /// `(repo, tag)` → manifest digest.
    tags: HashMap<(String, String), String>,
    global: Faults,
    /// `WWW-Authenticate` of the `401` answered to every request (but
    /// `/token` and `/cdn/…`) without the accepted `Authorization`.
    challenge: Option<String>,
    /// The `Authorization` value that passes the challenge.
    accepted_authorization: Option<String>,
    /// Body of `GET /token`.
    token_response: Option<Bytes>,
    /// How long `GET /token` waits before it answers.
    token_delay: Option<Duration>,
    /// `tags/list` of a repository, answered as a registry that paginates
    /// does: sorted, `n` and `last` applied, a `Link` to the next page.
    tag_lists: HashMap<String, Vec<String>>,
}

#[derive(Default, Clone, Copy)]
struct BodyProgress {
    /// Body bytes handed to the connection, over all requests.
    sent: u64,
    /// Bodies whose final byte was handed to the connection.
    finished: usize,
}

struct State {
    content: Mutex<Content>,
    /// Statuses for the next requests (not `/v2/`), one per request.
    next_statuses: Mutex<VecDeque<(u16, Option<String>)>>,
    log: Mutex<Vec<Logged>>,
    progress: Mutex<HashMap<String, BodyProgress>>,
    /// Requests whose response is not finished yet, and the most ever seen.
    open: AtomicUsize,
    max_open: AtomicUsize,
    /// Bumped on every change of faults, so stalled bodies look again.
    changed: watch::Sender<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl State {
    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    fn record(&self, method: &str, path: &str, query: Option<&str>, range: Option<String>, auth: Option<String>) {
        let (method, path, query) = (method.to_owned(), path.to_owned(), query.map(str::to_owned));
        lock(&self.log).push(Logged { method, path, range, authorization: auth, query });
    }

    fn progress(&self, key: &str, f: impl FnOnce(&mut BodyProgress)) {
        f(lock(&self.progress).entry(key.to_owned()).or_default());
    }

    /// The item a request names, its digest, and its effective faults.
    fn lookup(&self, kind: Kind, repo: &str, reference: &str) -> Option<(String, Item, Faults)> {
        let content = lock(&self.content);
        let key = if reference.starts_with("sha256:") {
            reference.to_owned()
        } else {
            content.tags.get(&(repo.to_owned(), reference.to_owned()))?.clone()
        };
        let item = content
            .items
            .get(&key)
            .filter(|i| i.kind == kind && i.only_in.as_ref().is_none_or(|only| only == repo))?
            .clone();
        let faults = item.faults.or(&content.global);
        Some((key, item, faults))
    }

    /// Where a body in flight must stop now, read afresh on every chunk
    /// so that [`FakeUpstream::release`] reaches bodies already stalled.
    fn stall_point(&self, key: &str) -> Option<usize> {
        let content = lock(&self.content);
        let item = content.items.get(key)?;
        item.faults.stall_after.or(content.global.stall_after)
    }
}

/// Counts a request as open until its response is finished or dropped.
struct OpenGuard(Arc<State>);

impl OpenGuard {
    fn new(state: &Arc<State>) -> OpenGuard {
        let now = state.open.fetch_add(1, Ordering::SeqCst) + 1;
        state.max_open.fetch_max(now, Ordering::SeqCst);
        OpenGuard(Arc::clone(state))
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

#[must_use]
pub struct FakeUpstreamBuilder {
    content: Content,
    next_statuses: VecDeque<(u16, Option<String>)>,
    last: Option<String>,
}

impl FakeUpstreamBuilder {
    /// Serves `bytes` as a blob under its digest, in any repository.
    pub fn blob(mut self, bytes: impl Into<Bytes>) -> Self {
        let bytes = bytes.into();
        let key = super::digest(&bytes);
        self.content.items.insert(key.clone(), Item { kind: Kind::Blob, bytes, media_type: None, ..Item::plain() });
        self.last = Some(key);
        self
    }

    /// Serves a manifest by `repo:tag` and by its digest.
    pub fn manifest(mut self, repo: &str, tag: &str, media_type: &str, bytes: impl Into<Bytes>) -> Self {
        let bytes = bytes.into();
        let key = super::digest(&bytes);
        self.content.items.insert(
            key.clone(),
            Item { kind: Kind::Manifest, bytes, media_type: Some(media_type.to_owned()), ..Item::plain() },
        );
        self.content.tags.insert((repo.to_owned(), tag.to_owned()), key.clone());
        self.last = Some(key);
        self
    }

    fn last(self, f: impl FnOnce(&mut Faults)) -> Self {
        self.last_item(|item| f(&mut item.faults))
    }

    fn last_item(mut self, f: impl FnOnce(&mut Item)) -> Self {
        let key = self.last.as_ref().expect("add a blob or manifest before its faults");
        let item = self.content.items.get_mut(key).expect("the last item");
        f(item);
        self
    }

    /// A `GET` of the last item is answered `307 Temporary Redirect` to
    /// `location` (absolute or relative, sent as is), with a `Set-Cookie`
    /// that a client must not carry to another host.
    pub fn redirect(self, location: &str) -> Self {
        self.last_item(|item| item.redirect = Some(location.to_owned()))
    }

    /// `repo`'s tags, listed by `tags/list` with real pagination.
    pub fn tag_list(mut self, repo: &str, tags: &[&str]) -> Self {
        self.content.tag_lists.insert(repo.to_owned(), tags.iter().map(|t| (*t).to_owned()).collect());
        self
    }

    /// Only `repo` has the last item: asked for in any other repository,
    /// it is `404` (by default every repository has every item).
    pub fn only_in(self, repo: &str) -> Self {
        self.last_item(|item| item.only_in = Some(repo.to_owned()))
    }

    /// The last item (a manifest) is sent with these `Warning` header
    /// values, one line each (GET and HEAD).
    pub fn warnings(self, values: &[&str]) -> Self {
        self.last_item(|item| item.warnings = values.iter().map(|v| (*v).to_owned()).collect())
    }

    /// The last item is sent without `Content-Length` (chunked encoding).
    pub fn chunked(self) -> Self {
        self.last_item(|item| item.chunked = true)
    }

    /// Every request (but `/token` and `/cdn/…`) that does not carry the
    /// [`Self::accept_authorization`] value is answered `401` with this
    /// `WWW-Authenticate`.
    pub fn challenge(mut self, www_authenticate: &str) -> Self {
        self.content.challenge = Some(www_authenticate.to_owned());
        self
    }

    /// The `Authorization` value that passes [`Self::challenge`].
    pub fn accept_authorization(mut self, authorization: &str) -> Self {
        self.content.accepted_authorization = Some(authorization.to_owned());
        self
    }

    /// `GET /token` answers `200` with this JSON body.
    pub fn token_response(mut self, body: impl Into<Bytes>) -> Self {
        self.content.token_response = Some(body.into());
        self
    }

    /// `GET /token` waits `d` before it answers (a slow token service).
    pub fn token_delay(mut self, d: Duration) -> Self {
        self.content.token_delay = Some(d);
        self
    }

    /// See [`Faults::wrong_bytes`].
    pub fn wrong_bytes(self) -> Self {
        self.last(|f| f.wrong_bytes = true)
    }

    /// See [`Faults::wrong_digest_header`].
    pub fn wrong_digest_header(self) -> Self {
        self.last(|f| f.wrong_digest_header = true)
    }

    /// See [`Faults::truncate_at`].
    pub fn truncate(self, after: usize) -> Self {
        self.last(|f| f.truncate_at = Some(after))
    }

    /// See [`Faults::overlong_by`].
    pub fn overlong(self, extra: usize) -> Self {
        self.last(|f| f.overlong_by = Some(extra))
    }

    /// See [`Faults::stall_headers`].
    pub fn stall_headers(self, d: Duration) -> Self {
        self.last(|f| f.stall_headers = Some(d))
    }

    /// See [`Faults::delay_body`].
    pub fn delay_body(self, d: Duration) -> Self {
        self.last(|f| f.delay_body = Some(d))
    }

    /// See [`Faults::trickle`].
    pub fn trickle(self, chunk: usize, every: Duration) -> Self {
        self.last(|f| f.trickle = Some((chunk, every)))
    }

    /// See [`Faults::stall_after`].
    pub fn stall_after(self, bytes: usize) -> Self {
        self.last(|f| f.stall_after = Some(bytes))
    }

    /// See [`Faults::status`].
    pub fn status(self, status: u16) -> Self {
        self.last(|f| f.status = Some(status))
    }

    /// See [`Faults::ranges`].
    pub fn ranges(self, ranges: Ranges) -> Self {
        self.last(|f| f.ranges = Some(ranges))
    }

    /// Faults for every item, where the item does not set the knob itself.
    pub fn faults_for_all(mut self, faults: Faults) -> Self {
        self.content.global = faults;
        self
    }

    /// The next `times` requests (any but `GET /v2/`) are answered with
    /// `status`, and `Retry-After` if given.
    pub fn fail_next(mut self, times: usize, status: u16, retry_after: Option<&str>) -> Self {
        for _ in 0..times {
            self.next_statuses.push_back((status, retry_after.map(str::to_owned)));
        }
        self
    }

    pub async fn start(self) -> FakeUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the fake upstream on 127.0.0.1");
        self.start_with(listener)
    }

    /// Serves on `listener` (made elsewhere, e.g. in a network namespace
    /// of a test lab, where it stays), which must be non-blocking.
    pub fn start_on(self, listener: std::net::TcpListener) -> FakeUpstream {
        self.start_with(TcpListener::from_std(listener).expect("a tokio listener"))
    }

    fn start_with(self, listener: TcpListener) -> FakeUpstream {
        let addr = listener.local_addr().expect("local address");
        let state = Arc::new(State {
            content: Mutex::new(self.content),
            next_statuses: Mutex::new(self.next_statuses),
            log: Mutex::default(),
            progress: Mutex::default(),
            open: AtomicUsize::new(0),
            max_open: AtomicUsize::new(0),
            changed: watch::channel(0).0,
        });
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&state)));
        FakeUpstream { addr, state, accept: Mutex::new(Some(accept)) }
    }
}

/// A running fake registry. Stops listening when dropped.
pub struct FakeUpstream {
    addr: SocketAddr,
    state: Arc<State>,
    accept: Mutex<Option<JoinHandle<()>>>,
}

impl FakeUpstream {
    pub fn builder() -> FakeUpstreamBuilder {
        FakeUpstreamBuilder { content: Content::default(), next_statuses: VecDeque::new(), last: None }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    // ---- content at run time --------------------------------------------

    /// Serves `bytes` as a blob from now on, in any repository.
    pub fn add_blob(&self, bytes: impl Into<Bytes>) {
        let bytes = bytes.into();
        let key = super::digest(&bytes);
        lock(&self.state.content).items.insert(key, Item { kind: Kind::Blob, bytes, ..Item::plain() });
    }

    /// Serves a manifest by `repo:tag` and by its digest from now on.
    pub fn add_manifest(&self, repo: &str, tag: &str, media_type: &str, bytes: impl Into<Bytes>) {
        let bytes = bytes.into();
        let key = super::digest(&bytes);
        let mut content = lock(&self.state.content);
        let item = Item { kind: Kind::Manifest, bytes, media_type: Some(media_type.to_owned()), ..Item::plain() };
        content.items.insert(key.clone(), item);
        content.tags.insert((repo.to_owned(), tag.to_owned()), key);
    }

    // ---- faults at run time ---------------------------------------------

    /// Replaces the faults of the item with this digest.
    pub fn set_faults(&self, digest: &str, faults: Faults) {
        lock(&self.state.content)
            .items
            .get_mut(digest)
            .unwrap_or_else(|| panic!("the fake serves no {digest}"))
            .faults = faults;
        self.state.bump();
    }

    /// Replaces the `Warning` values sent with the item (a manifest).
    pub fn set_warnings(&self, digest: &str, values: &[&str]) {
        lock(&self.state.content)
            .items
            .get_mut(digest)
            .unwrap_or_else(|| panic!("the fake serves no {digest}"))
            .warnings = values.iter().map(|v| (*v).to_owned()).collect();
    }

    /// Clears every fault of the item: it is served correctly from now on,
    /// and a body stalled on it goes on.
    pub fn heal(&self, digest: &str) {
        self.set_faults(digest, Faults::default());
    }

    /// Lets bodies stalled by `stall_after` on this item go on to the end.
    pub fn release(&self, digest: &str) {
        if let Some(item) = lock(&self.state.content).items.get_mut(digest) {
            item.faults.stall_after = None;
        }
        self.state.bump();
    }

    /// Replaces the challenge (see [`FakeUpstreamBuilder::challenge`]);
    /// `None` serves without one.
    pub fn set_challenge(&self, www_authenticate: Option<&str>) {
        lock(&self.state.content).challenge = www_authenticate.map(str::to_owned);
    }

    /// Replaces the global faults.
    pub fn set_global_faults(&self, faults: Faults) {
        lock(&self.state.content).global = faults;
        self.state.bump();
    }

    /// See [`FakeUpstreamBuilder::fail_next`].
    pub fn fail_next(&self, times: usize, status: u16, retry_after: Option<&str>) {
        let mut q = lock(&self.state.next_statuses);
        for _ in 0..times {
            q.push_back((status, retry_after.map(str::to_owned)));
        }
    }

    /// Stops listening: new connections are refused until [`Self::up`].
    pub async fn down(&self) {
        let handle = lock(&self.accept).take();
        if let Some(handle) = handle {
            handle.abort();
            let _ = handle.await;
        }
    }

    /// Listens again on the same address.
    pub async fn up(&self) {
        let listener = TcpListener::bind(self.addr).await.expect("bind the fake upstream again");
        let handle = tokio::spawn(accept_loop(listener, Arc::clone(&self.state)));
        if let Some(old) = lock(&self.accept).replace(handle) {
            old.abort();
        }
    }

    // ---- what the fake saw ----------------------------------------------

    /// Every request so far, in arrival order.
    pub fn log(&self) -> Vec<Logged> {
        lock(&self.state.log).clone()
    }

    /// Requests with this method and exact path.
    pub fn requests(&self, method: &str, path: &str) -> usize {
        lock(&self.state.log).iter().filter(|r| r.method == method && r.path == path).count()
    }

    /// `GET`s of this blob, in any repository.
    pub fn blob_gets(&self, digest: &str) -> usize {
        let suffix = format!("/blobs/{digest}");
        lock(&self.state.log).iter().filter(|r| r.method == "GET" && r.path.ends_with(&suffix)).count()
    }

    /// `GET`s of this manifest reference (tag or digest), in any repository.
    pub fn manifest_gets(&self, reference: &str) -> usize {
        let suffix = format!("/manifests/{reference}");
        lock(&self.state.log).iter().filter(|r| r.method == "GET" && r.path.ends_with(&suffix)).count()
    }

    /// All requests, `/v2/` included.
    pub fn total_requests(&self) -> usize {
        lock(&self.state.log).len()
    }

    /// Requests that carried a `Range` header.
    pub fn ranged_requests(&self) -> usize {
        lock(&self.state.log).iter().filter(|r| r.range.is_some()).count()
    }

    /// Body bytes of this item handed to connections, over all requests.
    pub fn bytes_sent(&self, digest: &str) -> u64 {
        lock(&self.state.progress).get(digest).map_or(0, |p| p.sent)
    }

    /// Bodies of this item whose final byte was handed to a connection.
    pub fn bodies_finished(&self, digest: &str) -> usize {
        lock(&self.state.progress).get(digest).map_or(0, |p| p.finished)
    }

    /// Requests open right now (response not finished).
    pub fn open_requests(&self) -> usize {
        self.state.open.load(Ordering::SeqCst)
    }

    /// The most requests ever open at once.
    pub fn max_open_requests(&self) -> usize {
        self.state.max_open.load(Ordering::SeqCst)
    }
}

impl Drop for FakeUpstream {
    fn drop(&mut self) {
        if let Some(handle) = lock(&self.accept).take() {
            handle.abort();
        }
    }
}

// ---- serving ------------------------------------------------------------

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(serve_connection(stream, Arc::clone(&state)));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

/// The request line and headers of a request, peeked without consuming them.
struct Peeked {
    method: String,
    path: String,
    range: Option<String>,
    head_len: usize,
}

async fn peek_request(stream: &TcpStream) -> Option<Peeked> {
    let mut buf = vec![0u8; 16 << 10];
    for _ in 0..10_000 {
        let n = stream.peek(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        if let Some(end) = buf[..n].windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let mut lines = head.split("\r\n");
            let mut first = lines.next()?.split(' ');
            let method = first.next()?.to_owned();
            let target = first.next()?;
            let path = target.split('?').next().unwrap_or(target).to_owned();
            let range = lines.find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("range").then(|| value.trim().to_owned())
            });
            return Some(Peeked { method, path, range, head_len: end + 4 });
        }
        if n == buf.len() {
            return None;
        }
        // Only part of the head has arrived; peek returns at once, so wait.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    None
}

async fn serve_connection(mut stream: TcpStream, state: Arc<State>) {
    let Some(peeked) = peek_request(&stream).await else {
        return;
    };
    if let Some(raw) = overlong_response(&state, &peeked) {
        let mut head = vec![0u8; peeked.head_len];
        if stream.read_exact(&mut head).await.is_err() {
            return;
        }
        state.record(&peeked.method, &peeked.path, None, peeked.range, None);
        let _guard = OpenGuard::new(&state);
        raw.send(&mut stream, &state).await;
        return;
    }
    let service = service_fn(move |req| {
        let state = Arc::clone(&state);
        async move { Ok::<_, Infallible>(handle(state, req).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

/// A response written on the raw socket: a blob body longer than the
/// `Content-Length` it declares.
struct RawOverlong {
    key: String,
    bytes: Bytes,
    declared: usize,
}

fn overlong_response(state: &State, peeked: &Peeked) -> Option<RawOverlong> {
    if peeked.method != "GET" || !lock(&state.next_statuses).is_empty() {
        return None;
    }
    let (kind, repo, reference) = parse_path(&peeked.path)?;
    let (key, item, faults) = state.lookup(kind, &repo, &reference)?;
    let extra = faults.overlong_by?;
    Some(RawOverlong { key, declared: item.bytes.len().saturating_sub(extra), bytes: item.bytes })
}

impl RawOverlong {
    async fn send(self, stream: &mut TcpStream, state: &State) {
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\
             Content-Length: {}\r\nDocker-Content-Digest: {}\r\nConnection: close\r\n\r\n",
            self.declared, self.key
        );
        if stream.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        for chunk in self.bytes.chunks(CHUNK) {
            if stream.write_all(chunk).await.is_err() {
                return;
            }
            state.progress(&self.key, |p| p.sent += chunk.len() as u64);
        }
        state.progress(&self.key, |p| p.finished += 1);
        let _ = stream.shutdown().await;
    }
}

/// `(kind, repo, reference)` of `/v2/<repo>/{blobs,manifests}/<reference>`.
fn parse_path(path: &str) -> Option<(Kind, String, String)> {
    let rest = path.strip_prefix("/v2/")?;
    if let Some((repo, digest)) = rest.rsplit_once("/blobs/") {
        return Some((Kind::Blob, repo.to_owned(), digest.to_owned()));
    }
    let (repo, reference) = rest.rsplit_once("/manifests/")?;
    Some((Kind::Manifest, repo.to_owned(), reference.to_owned()))
}

/// One page of `tags/list` as a paginating registry answers it.
fn tag_page(repo: &str, mut tags: Vec<String>, query: Option<&str>, head: bool) -> Response<FakeBody> {
    let params: HashMap<String, String> =
        form_urlencoded::parse(query.unwrap_or_default().as_bytes()).into_owned().collect();
    tags.sort();
    if let Some(last) = params.get("last") {
        tags.retain(|t| t > last);
    }
    let mut next = None;
    if let Some(n) = params.get("n").and_then(|n| n.parse::<usize>().ok()) {
        if tags.len() > n {
            tags.truncate(n);
            next = tags.last().map(|last| format!("</v2/{repo}/tags/list?n={n}&last={last}>; rel=\"next\""));
        }
    }
    let body = serde_json::json!({ "name": repo, "tags": tags }).to_string();
    let mut resp = Response::builder().header(CONTENT_TYPE, "application/json").header(CONTENT_LENGTH, body.len());
    if let Some(link) = next {
        resp = resp.header("link", link);
    }
    resp.body(if head { empty() } else { full(body) }).expect("a valid tag list")
}

fn full(bytes: impl Into<Bytes>) -> FakeBody {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

fn empty() -> FakeBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// An error response with the OCI error envelope.
fn error(status: u16, code: &str, retry_after: Option<&str>, head: bool) -> Response<FakeBody> {
    let json = serde_json::json!({
        "errors": [{ "code": code, "message": format!("fake upstream: {code}"), "detail": null }]
    })
    .to_string();
    let mut resp =
        Response::builder().status(status).header(CONTENT_TYPE, "application/json").header(CONTENT_LENGTH, json.len());
    if let Some(r) = retry_after {
        resp = resp.header(RETRY_AFTER, r);
    }
    let body = if head { empty() } else { full(json) };
    resp.body(body).expect("a valid error response")
}

fn status_code(status: u16) -> &'static str {
    match status {
        429 => "TOOMANYREQUESTS",
        401 => "UNAUTHORIZED",
        403 => "DENIED",
        404 => "NOT_FOUND",
        503 => "UNAVAILABLE",
        _ => "UNKNOWN",
    }
}

/// `bytes=first-[last]` within a blob of `size` bytes, as inclusive offsets.
fn cdn_range(header: &str, size: usize) -> Option<(usize, usize)> {
    let (first, last) = header.strip_prefix("bytes=")?.split_once('-')?;
    let first: usize = first.trim().parse().ok()?;
    let last = match last.trim() {
        "" => size.checked_sub(1)?,
        l => l.parse::<usize>().ok()?.min(size.checked_sub(1)?),
    };
    (first <= last).then_some((first, last))
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<FakeBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let range = req.headers().get(RANGE).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let authorization = req.headers().get(AUTHORIZATION).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    state.record(method.as_str(), &path, req.uri().query(), range.clone(), authorization.clone());
    let guard = OpenGuard::new(&state);
    let head = method == Method::HEAD;

    let (challenge, accepted, token, token_delay) = {
        let content = lock(&state.content);
        let token = content.token_response.clone();
        (content.challenge.clone(), content.accepted_authorization.clone(), token, content.token_delay)
    };
    if let (Some(body), "/token") = (token, path.as_str()) {
        if let Some(d) = token_delay {
            tokio::time::sleep(d).await;
        }
        return Response::builder()
            .header(CONTENT_TYPE, "application/json")
            .header(CONTENT_LENGTH, body.len())
            .body(if head { empty() } else { full(body) })
            .expect("a valid token response");
    }
    if let Some(digest) = path.strip_prefix("/cdn/") {
        let item = lock(&state.content).items.get(digest).cloned();
        let Some(item) = item else {
            return error(404, "BLOB_UNKNOWN", None, head);
        };
        // The CDN answers a satisfiable `bytes=first-[last]` with a 206,
        // as object stores do; the registry itself ignores `Range`.
        let size = item.bytes.len();
        let wanted = range.as_deref().and_then(|r| cdn_range(r, size));
        let (status, body) = match wanted {
            Some((first, last)) => (206, item.bytes.slice(first..=last)),
            None => (200, item.bytes),
        };
        let mut resp = Response::builder()
            .status(status)
            .header(CONTENT_TYPE, "application/octet-stream")
            .header(CONTENT_LENGTH, body.len());
        if let Some((first, last)) = wanted {
            resp = resp.header(CONTENT_RANGE, format!("bytes {first}-{last}/{size}"));
        }
        return resp.body(if head { empty() } else { full(body) }).expect("a valid CDN response");
    }
    if let Some(challenge) = challenge {
        if authorization.is_none() || authorization != accepted {
            let mut resp = error(401, "UNAUTHORIZED", None, head);
            let value = HeaderValue::from_str(&challenge).expect("a valid WWW-Authenticate value");
            resp.headers_mut().insert(WWW_AUTHENTICATE, value);
            return resp;
        }
    }

    if path == "/v2/" || path == "/v2" {
        return Response::builder()
            .header(CONTENT_TYPE, "application/json")
            .header("Docker-Distribution-API-Version", "registry/2.0")
            .body(if head { empty() } else { full("{}") })
            .expect("a valid response");
    }
    let next_status = lock(&state.next_statuses).pop_front();
    if let Some((status, retry_after)) = next_status {
        return error(status, status_code(status), retry_after.as_deref(), head);
    }
    if let Some(repo) = path.strip_prefix("/v2/").and_then(|p| p.strip_suffix("/tags/list")) {
        let tags = lock(&state.content).tag_lists.get(repo).cloned();
        return match tags {
            Some(tags) => tag_page(repo, tags, req.uri().query(), head),
            None => error(404, "NAME_UNKNOWN", None, head),
        };
    }
    let Some((kind, repo, reference)) = parse_path(&path) else {
        return error(404, "NOT_FOUND", None, head);
    };
    let Some((key, item, faults)) = state.lookup(kind, &repo, &reference) else {
        let code = match kind {
            Kind::Blob => "BLOB_UNKNOWN",
            Kind::Manifest => "MANIFEST_UNKNOWN",
        };
        return error(404, code, None, head);
    };
    if let Some(status) = faults.status {
        return error(status, status_code(status), None, head);
    }
    if let (Some(location), false) = (&item.redirect, head) {
        return Response::builder()
            .status(307)
            .header(LOCATION, location.as_str())
            .header(SET_COOKIE, "session=fake-upstream-session; Path=/")
            .header(CONTENT_LENGTH, 0)
            .body(empty())
            .expect("a valid redirect");
    }
    if let Some(d) = faults.stall_headers {
        tokio::time::sleep(d).await;
    }

    let bytes = match (faults.wrong_bytes, kind) {
        (false, _) => item.bytes.clone(),
        (true, Kind::Blob) => {
            let mut v = item.bytes.to_vec();
            if let Some(b) = v.get_mut(item.bytes.len() / 2) {
                *b ^= 0xff;
            }
            Bytes::from(v)
        }
        (true, Kind::Manifest) => {
            let mut v = item.bytes.to_vec();
            v.push(b'\n');
            Bytes::from(v)
        }
    };
    let digest_header = if faults.wrong_digest_header { super::digest(b"some other content") } else { key.clone() };
    let (status, bytes, content_range) = match (kind, head) {
        (Kind::Blob, false) => faults.ranges.unwrap_or_default().answer(range.as_deref(), &bytes),
        _ => (200, bytes, None),
    };
    let mut builder = Response::builder()
        .status(status)
        .header(CONTENT_TYPE, item.media_type.as_deref().unwrap_or("application/octet-stream"))
        .header("Docker-Content-Digest", digest_header);
    if let Some(content_range) = content_range {
        builder = builder.header(CONTENT_RANGE, content_range);
    }
    if !item.chunked {
        builder = builder.header(CONTENT_LENGTH, bytes.len());
    }
    for warning in &item.warnings {
        builder = builder.header("warning", warning.as_str());
    }
    if head {
        return builder.body(empty()).expect("a valid response");
    }
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(produce(state, key, bytes, faults, guard, tx));
    let frames = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|frame| (frame, rx)) });
    builder.body(StreamBody::new(frames).boxed_unsync()).expect("a valid response")
}

type FrameResult = Result<Frame<Bytes>, io::Error>;

/// Feeds a response body to hyper with the item's faults: a delay, a
/// trickle, a stall until released, a broken connection. Stops when the
/// client goes away (hyper drops the receiver).
async fn produce(
    state: Arc<State>,
    key: String,
    bytes: Bytes,
    faults: Faults,
    guard: OpenGuard,
    tx: mpsc::Sender<FrameResult>,
) {
    let mut guard = Some(guard);
    let mut changes = state.changed.subscribe();
    if let Some(d) = faults.delay_body {
        tokio::time::sleep(d).await;
    }
    let chunk = faults.trickle.map_or(CHUNK, |(c, _)| c.max(1));
    let mut offset = 0;
    while offset < bytes.len() {
        changes.borrow_and_update();
        let stall = state.stall_point(&key);
        if stall.is_some_and(|at| offset >= at) {
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                () = tx.closed() => return,
            }
            continue;
        }
        let mut end = (offset + chunk).min(bytes.len());
        if let Some(at) = stall {
            end = end.min(at);
        }
        if let Some(at) = faults.truncate_at {
            if offset >= at {
                let _ = tx.send(Err(io::Error::other("fake upstream: truncated"))).await;
                return;
            }
            end = end.min(at);
        }
        if end == bytes.len() {
            // Counted as finished before the final bytes go out, so that
            // nobody can have seen the end of the body before the count.
            drop(guard.take());
            state.progress(&key, |p| p.finished += 1);
        }
        if tx.send(Ok(Frame::data(bytes.slice(offset..end)))).await.is_err() {
            return;
        }
        state.progress(&key, |p| p.sent += (end - offset) as u64);
        offset = end;
        if let (Some((_, every)), true) = (faults.trickle, offset < bytes.len()) {
            tokio::time::sleep(every).await;
        }
    }
}
