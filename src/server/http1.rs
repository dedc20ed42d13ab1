//! Cleartext HTTP/1 connections: blob bytes by sendfile, and nothing held
//! by a connection between requests but its socket.
//!
//! A hub mirror holds thousands of keep-alive connections, nearly all of
//! them idle at any moment. hyper keeps an 8 KiB read buffer and an 8 KiB
//! write buffer for as long as a connection lives: 16 of the 18.7 KiB an
//! idle connection cost (massif), 235 MiB at 10,000 connections. So, as
//! nginx frees its request buffers on a keep-alive connection, a
//! connection here is *parked* once every request it received has been
//! answered: hyper's connection is shut down without closing the socket
//! (`graceful_shutdown` on an idle connection, `into_parts`), and a new
//! one is made when the next request's first bytes arrive. Bytes hyper had
//! read but not used (the start of the next request) are handed to the new
//! connection first. The client sees one keep-alive connection throughout.
//!
//! Only a connection with no request in flight is parked, so hyper never
//! answers a request with `Connection: close` because of it; a response
//! still being flushed is finished first.

use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use bytes::{Buf, Bytes};
use http::{Request, Response};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::Watcher;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use super::HEADER_READ_TIMEOUT;
use super::watchdog::{Activity, Tracked};
use crate::body::{Body, BoxError};
use crate::sendfile::{FileSink, FileStream};
use crate::shutdown::Shutdown;

/// How cleartext HTTP/1 connections are served: hyper's builder with the
/// header-read timeout and vectored writes forced on (which keeps every
/// body chunk as the memory it was given: sendfile's placeholders depend
/// on it), and when connections are parked.
pub struct Http1 {
    builder: http1::Builder,
    parking: Parking,
}

/// When a connection that has answered every request is parked.
#[derive(Clone, Copy, Debug)]
pub struct Parking {
    /// Once idle this long.
    pub idle_after: Duration,
    /// At once, while more than this many connections are open, unless
    /// it is busy: its last request came within `busy_gap` of its park.
    pub at_once_above: usize,
    pub busy_gap: Duration,
}

impl Default for Parking {
    fn default() -> Parking {
        Parking { idle_after: PARK_IDLE_AFTER, at_once_above: PARK_AT_ONCE_ABOVE, busy_gap: BUSY_GAP }
    }
}

impl Http1 {
    pub fn new(parking: Parking) -> Http1 {
        let mut builder = http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT).writev(true);
        Http1 { builder, parking }
    }
}

impl Default for Http1 {
    fn default() -> Http1 {
        Http1::new(Parking::default())
    }
}

/// Connections idle this long are parked, however few are open: a client
/// that pulls an image keeps its connection busy, then leaves it idle for
/// minutes.
pub const PARK_IDLE_AFTER: Duration = Duration::from_secs(1);
/// Above this many open cleartext HTTP/1 connections, each is parked as
/// soon as it has answered every request it received, unless it is busy.
/// Parking costs a new hyper connection for the next request (measured:
/// +6.5 µs of CPU per warm manifest GET when every request paid it,
/// benches/README.md); below this many connections their buffers (16 KiB
/// each, 8 MiB in all) are worth more.
pub const PARK_AT_ONCE_ABOVE: usize = 512;
/// A connection whose next request came within this long of its park is
/// busy: it is parked again only once idle for [`PARK_IDLE_AFTER`], so a
/// client sending request after request pays for one rebuild, not one
/// per request, however many connections are open.
pub const BUSY_GAP: Duration = Duration::from_millis(100);

/// Cleartext HTTP/1 connections open now (in [`serve`]).
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// Counts a connection in [`OPEN`] while it lives.
struct Open;

impl Open {
    fn count() -> Open {
        OPEN.fetch_add(1, Ordering::Relaxed);
        Open
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a connection's requests and its serving loop share.
struct Shared<H> {
    handler: H,
    activity: Arc<Activity>,
    /// Given to each request when its blob bytes may go by sendfile.
    sink: Option<FileSink>,
    requests: Arc<Requests>,
}

/// Requests received and answered over a connection's life.
#[derive(Default)]
struct Requests {
    started: AtomicUsize,
    answered: AtomicUsize,
}

impl Requests {
    /// Every request received since `since` (the started count when the
    /// current hyper connection began) is answered, and there was one.
    fn all_answered(&self, since: usize) -> bool {
        let answered = self.answered.load(Ordering::Acquire);
        answered > since && answered == self.started.load(Ordering::Acquire)
    }
}

/// Serves one cleartext HTTP/1 connection (already [`sniff`]ed), under the
/// watchdog's deadlines, parking it between requests as `http1`'s
/// [`Parking`] says. With `sendfile`, its
/// requests carry a [`FileSink`] for cached blob bytes. With a `watcher`,
/// the server's graceful shutdown waits for it; at `shutdown` a parked
/// connection closes and a busy one finishes its request first.
///
/// [`sniff`]: super::listener
pub async fn serve<H, Fut>(
    http1: &Http1,
    tcp: TcpStream,
    sendfile: bool,
    watcher: Option<Watcher>,
    mut shutdown: Shutdown,
    handler: H,
) -> Result<(), BoxError>
where
    H: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    // Held until the connection ends, so a graceful shutdown waits for it.
    let _watcher = watcher;
    let _open = Open::count();
    let activity = Activity::new();
    let sink = FileSink::default();
    let shared = Arc::new(Shared {
        handler,
        activity: Arc::clone(&activity),
        sink: sendfile.then(|| sink.clone()),
        requests: Arc::default(),
    });
    let mut io = Rewind::new(Tracked::new(FileStream::new(tcp, sink.clone()), Arc::clone(&activity)));
    // One deadline and one shutdown watch for the connection's whole life,
    // not a new timer per park.
    let mut expired = std::pin::pin!(activity.expired());
    let mut stop = std::pin::pin!(shutdown.changed());
    let timed_out = || -> BoxError { "connection timed out (no request, or idle)".into() };
    let mut parked_at: Option<Instant> = None;
    loop {
        // Parked: nothing but the socket until the next request's first bytes.
        if !io.has_unread() {
            tokio::select! {
                ready = io.get_ref().get_ref().tcp().readable() => ready?,
                () = &mut expired => return Err(timed_out()),
                _ = &mut stop => return Ok(()),
            }
        }
        let busy = parked_at.is_some_and(|at| at.elapsed() < http1.parking.busy_gap);
        let since = shared.requests.started.load(Ordering::Acquire);
        let service = {
            let shared = Arc::clone(&shared);
            service_fn(move |mut req: Request<Incoming>| {
                shared.activity.request();
                shared.requests.started.fetch_add(1, Ordering::AcqRel);
                if let Some(sink) = &shared.sink {
                    req.extensions_mut().insert(sink.clone());
                }
                let response = (shared.handler)(req);
                let answer = Answer(Arc::clone(&shared.requests));
                // Boxed per request: unboxed, hyper's slot for the in-flight
                // future is the whole handler state machine (about 10 KiB).
                Box::pin(
                    async move { Ok::<_, Infallible>(response.await.map(|body| Answered { body, _answer: answer })) },
                ) as Pin<Box<dyn Future<Output = Result<Response<Answered>, Infallible>> + Send>>
            })
        };
        // Boxed: hyper's connection state lives on the heap only while a
        // request is being served, not in every parked connection's task.
        let mut conn = Box::new(http1.builder.serve_connection(TokioIo::new(io), service));
        let mut quiet = std::pin::pin!(activity.quiet_for(http1.parking.idle_after));
        let (mut parking, mut stopping) = (false, false);
        let ended = poll_fn(|cx| {
            if expired.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(timed_out()));
            }
            if !stopping && stop.as_mut().poll(cx).is_ready() {
                stopping = true;
                Pin::new(&mut *conn).graceful_shutdown();
            }
            loop {
                match conn.poll_without_shutdown(cx) {
                    Poll::Ready(done) => return Poll::Ready(done.map_err(BoxError::from)),
                    Poll::Pending if !parking && !stopping && shared.requests.all_answered(since) => {
                        let at_once = !busy && OPEN.load(Ordering::Relaxed) > http1.parking.at_once_above;
                        if !at_once && quiet.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        parking = true;
                        Pin::new(&mut *conn).graceful_shutdown();
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .await;
        ended?;
        let parts = (*conn).into_parts();
        io = parts.io.into_inner();
        if stopping || !parking || !sink.is_empty() {
            // The client closed, the server is stopping, or (never expected)
            // file bytes were handed to hyper and not sent: close, with
            // the write side shut down first as hyper's own connection does.
            let _ = io.shutdown().await;
            return Ok(());
        }
        io.unread(parts.read_buf);
        parked_at = Some(Instant::now());
        #[cfg(test)]
        tests::PARKED.fetch_add(1, Ordering::Relaxed);
    }
}

/// A request, counted as answered when dropped: with its response body
/// (after its last byte, or with the connection), or with the handler's
/// future if that is dropped first.
struct Answer(Arc<Requests>);

impl Drop for Answer {
    fn drop(&mut self) {
        self.0.answered.fetch_add(1, Ordering::AcqRel);
    }
}

/// A response body that carries its request's [`Answer`].
struct Answered {
    body: Body,
    _answer: Answer,
}

impl hyper::body::Body for Answered {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A stream that first yields bytes read earlier (by a previous hyper
/// connection on the same socket), then reads on.
struct Rewind<I> {
    unread: Bytes,
    inner: I,
}

impl<I> Rewind<I> {
    fn new(inner: I) -> Rewind<I> {
        Rewind { unread: Bytes::new(), inner }
    }

    fn has_unread(&self) -> bool {
        !self.unread.is_empty()
    }

    /// Keeps `bytes` to be read first. They are copied out: hyper hands
    /// back its whole 8 KiB read buffer, even when nothing is left in it.
    fn unread(&mut self, bytes: Bytes) {
        debug_assert!(self.unread.is_empty(), "a new connection reads what the last left first");
        self.unread = if bytes.is_empty() { Bytes::new() } else { Bytes::copy_from_slice(&bytes) };
    }

    fn get_ref(&self) -> &I {
        &self.inner
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Rewind<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.unread.is_empty() {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        let n = self.unread.len().min(buf.remaining());
        buf.put_slice(&self.unread[..n]);
        self.unread.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Rewind<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::io::Write;
    use std::net::SocketAddr;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use http::header::CONTENT_LENGTH;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::cache::fill::read_body;

    /// Connections parked, over the whole test binary.
    pub static PARKED: AtomicUsize = AtomicUsize::new(0);
    /// The tests that count parks run one at a time.
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// Parked as soon as every request is answered.
    const AT_ONCE: Parking =
        Parking { idle_after: Duration::from_secs(3600), at_once_above: 0, busy_gap: Duration::ZERO };
    /// Parked after 300 ms of silence, however few connections are open.
    const WHEN_IDLE: Parking =
        Parking { idle_after: Duration::from_millis(300), at_once_above: usize::MAX, busy_gap: Duration::ZERO };
    /// Parked at once, unless the next request came within 50 ms.
    const AT_ONCE_UNLESS_BUSY: Parking =
        Parking { idle_after: Duration::from_millis(300), at_once_above: 0, busy_gap: Duration::from_millis(50) };

    /// A server on loopback: `/file/<start>-<end>` answers that range of
    /// `file` (sent by sendfile where the connection allows), any other
    /// path its own path as the body.
    async fn server(file: Arc<std::fs::File>, parking: Parking) -> (SocketAddr, tokio::sync::watch::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, shutdown) = tokio::sync::watch::channel(());
        tokio::spawn(async move {
            let http1 = Arc::new(Http1::new(parking));
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                let (file, http1, shutdown) = (Arc::clone(&file), Arc::clone(&http1), shutdown.clone());
                let handler = move |req: Request<Incoming>| {
                    let file = Arc::clone(&file);
                    async move {
                        let path = req.uri().path().to_owned();
                        let Some(range) = path.strip_prefix("/file/") else {
                            return Response::new(crate::body::full(Bytes::from(path)));
                        };
                        let (start, end) = range.split_once('-').unwrap();
                        let (start, end): (u64, u64) = (start.parse().unwrap(), end.parse().unwrap());
                        let sink = req.extensions().get::<FileSink>().cloned();
                        assert!(sink.is_some(), "a cleartext HTTP/1 request carries its connection's sink");
                        Response::builder()
                            .header(CONTENT_LENGTH, end - start)
                            .body(read_body(file, None, start, Some(end), crate::cache::Via::Client, sink))
                            .unwrap()
                    }
                };
                tokio::spawn(async move { serve(&http1, tcp, true, None, shutdown, handler).await });
            }
        });
        (addr, stop)
    }

    fn random_file(len: usize) -> (Vec<u8>, Arc<std::fs::File>) {
        let data: Vec<u8> = (0..len).map(|_| rand::random()).collect();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&data).unwrap();
        (data, Arc::new(file))
    }

    /// Reads one response with a `Content-Length` body: (head, body).
    async fn response(client: &mut TcpStream, buffered: &mut Vec<u8>) -> (String, Vec<u8>) {
        let head_end = loop {
            if let Some(at) = buffered.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            let mut chunk = [0u8; 65536];
            let n = client.read(&mut chunk).await.unwrap();
            assert!(n > 0, "connection closed before a response head");
            buffered.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8(buffered[..head_end].to_vec()).unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length: ").map(|v| v.trim().parse().unwrap()))
            .expect("a content-length");
        while buffered.len() < head_end + length {
            let mut chunk = vec![0u8; 1 << 20];
            let n = client.read(&mut chunk).await.unwrap();
            assert!(n > 0, "connection closed inside a body");
            buffered.extend_from_slice(&chunk[..n]);
        }
        let body = buffered[head_end..head_end + length].to_vec();
        buffered.drain(..head_end + length);
        (head, body)
    }

    /// Asks for `path` and checks the server answered with it (its echo).
    async fn echo(client: &mut TcpStream, buffered: &mut Vec<u8>, path: &str) {
        client.write_all(format!("GET {path} HTTP/1.1\r\nhost: a\r\n\r\n").as_bytes()).await.unwrap();
        assert_eq!(response(client, buffered).await.1, path.as_bytes(), "GET {path}");
    }

    /// Waits until the server has parked `more` connections since `before`.
    async fn parked_since(before: usize, more: usize) {
        for _ in 0..600 {
            if PARKED.load(Ordering::Relaxed) >= before + more {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the connection was not parked");
    }

    /// A client of a fresh server over a 10-byte file: (client, its read
    /// buffer, parks so far, the server's stop signal).
    async fn client(parking: Parking) -> (TcpStream, Vec<u8>, usize, tokio::sync::watch::Sender<()>) {
        let (_, file) = random_file(10);
        let (addr, stop) = server(file, parking).await;
        let client = TcpStream::connect(addr).await.unwrap();
        (client, Vec::new(), PARKED.load(Ordering::Relaxed), stop)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blob_ranges_go_out_by_sendfile_exactly_and_the_connection_is_parked_between_requests() {
        let _serial = SERIAL.lock().await;
        let (data, file) = random_file(5 * crate::sendfile::MAX_CHUNK + 12_345);
        let (addr, _stop) = server(file, AT_ONCE).await;
        let sent_before = crate::metrics::metrics().sendfile_bytes.get();
        let mut client = TcpStream::connect(addr).await.unwrap();
        let mut buffered = Vec::new();
        let ranges = [(0, data.len()), (1, 2), (4095, 3 * crate::sendfile::MAX_CHUNK + 7), (0, data.len())];
        for (start, end) in ranges {
            let parked = PARKED.load(Ordering::Relaxed);
            let request = format!("GET /file/{start}-{end} HTTP/1.1\r\nhost: larder\r\n\r\n");
            client.write_all(request.as_bytes()).await.unwrap();
            let (head, body) = response(&mut client, &mut buffered).await;
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            assert!(!head.to_ascii_lowercase().contains("connection: close"), "kept alive: {head}");
            assert!(body == data[start..end], "bytes {start}..{end} exactly");
            parked_since(parked, 1).await;
        }
        let total: usize = ranges.iter().map(|(s, e)| e - s).sum();
        let sent = crate::metrics::metrics().sendfile_bytes.get() - sent_before;
        assert!(sent >= total as u64, "{sent} of {total} bytes went by sendfile (a file just written is cached)");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pipelined_and_split_requests_are_answered_across_parking() {
        let _serial = SERIAL.lock().await;
        let (mut client, mut buffered, parked, _stop) = client(WHEN_IDLE).await;
        // Two whole requests and the start of a third in one write.
        client
            .write_all(b"GET /one HTTP/1.1\r\nhost: a\r\n\r\nGET /two HTTP/1.1\r\nhost: a\r\n\r\nGET /thr")
            .await
            .unwrap();
        assert_eq!(response(&mut client, &mut buffered).await.1, b"/one");
        assert_eq!(response(&mut client, &mut buffered).await.1, b"/two");
        // Parked while holding "GET /thr": the next connection reads it first.
        parked_since(parked, 1).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.write_all(b"ee HTTP/1.1\r\nhost: a\r\n\r\n").await.unwrap();
        assert_eq!(response(&mut client, &mut buffered).await.1, b"/three");
        echo(&mut client, &mut buffered, "/four").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_parked_connection_closes_at_shutdown() {
        let _serial = SERIAL.lock().await;
        let (mut client, mut buffered, parked, stop) = client(AT_ONCE).await;
        echo(&mut client, &mut buffered, "/x").await;
        parked_since(parked, 1).await;
        stop.send(()).unwrap();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest)).await;
        assert!(matches!(closed, Ok(Ok(0))), "closed without another byte: {closed:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_few_connections_a_busy_connection_is_kept_and_an_idle_one_parked() {
        let _serial = SERIAL.lock().await;
        let (mut client, mut buffered, parked, _stop) = client(WHEN_IDLE).await;
        // Requests 100 ms apart: never 300 ms of silence, never parked.
        for i in 0..6 {
            echo(&mut client, &mut buffered, &format!("/busy{i}")).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(PARKED.load(Ordering::Relaxed), parked, "a busy connection keeps its hyper connection");
        parked_since(parked, 1).await;
        echo(&mut client, &mut buffered, "/after").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn when_crowded_a_quiet_connection_parks_at_once_and_a_busy_one_once_idle() {
        let _serial = SERIAL.lock().await;
        let (mut client, mut buffered, parked, _stop) = client(AT_ONCE_UNLESS_BUSY).await;
        echo(&mut client, &mut buffered, "/first").await;
        parked_since(parked, 1).await;
        // Requests right after one another: busy, kept until 300 ms of silence.
        for i in 0..5 {
            echo(&mut client, &mut buffered, &format!("/busy{i}")).await;
        }
        assert_eq!(PARKED.load(Ordering::Relaxed), parked + 1, "one park, after the first request only");
        parked_since(parked, 2).await;
    }
}
