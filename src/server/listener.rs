//! Accepting and serving connections under limits, shared by the registry
//! listener and the admin listener so that both get the same protections:
//! a connection cap taken before `accept` (backpressure into the kernel's
//! accept queue, not a queue in memory), hyper's header-read timeout, and
//! the [`watchdog`] deadlines (first request, then idle).

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::Watcher;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use super::http1;
use super::watchdog::{self, FIRST_REQUEST_TIMEOUT};
use super::{HEADER_READ_TIMEOUT, MAX_CONCURRENT_STREAMS, TLS_HANDSHAKE_TIMEOUT};
use crate::body::{Body, BoxError};
use crate::config::SendfileMode;
use crate::shutdown::Shutdown;

/// Pause after a failed `accept` (EMFILE and the like) before the next try,
/// so that a descriptor shortage does not become a busy loop.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// The HTTP/2 connection preface (RFC 9113 §3.4) starts with `PRI `, a
/// method no HTTP/1 request uses: a cleartext connection's first four
/// bytes tell the two versions apart.
const H2_PREFACE_START: &[u8; 4] = b"PRI ";

/// The HTTP/1.1 + HTTP/2 connection builder every listener uses: hyper's
/// header-read timeout and the HTTP/2 stream limit. It tells the versions
/// apart by reading a connection's first bytes itself (TLS, the admin port).
pub fn http_builder() -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
    builder.http2().timer(TokioTimer::new()).max_concurrent_streams(MAX_CONCURRENT_STREAMS);
    builder
}

/// [`http_builder`], HTTP/2 alone, and [`http1::Http1`], for cleartext
/// connections whose version was `sniff`ed; and which of those HTTP/1
/// connections send cached blob bytes with sendfile.
pub struct Builders {
    any: auto::Builder<TokioExecutor>,
    http1: http1::Http1,
    http2: auto::Builder<TokioExecutor>,
    sendfile: SendfileMode,
}

impl Builders {
    pub fn new(sendfile: SendfileMode) -> Builders {
        let any = http_builder();
        Builders { http1: http1::Http1::default(), http2: any.clone().http2_only(), any, sendfile }
    }

    /// Whether blob bytes go to this client with sendfile: under `auto`,
    /// only when it is on another host. A client on this host would pay
    /// for it: the loopback reader of sendfile'd bytes spent 2-3× the CPU
    /// of one reading written bytes, more than the sendfile saved here
    /// (benches/README.md).
    fn sendfile_to(&self, stream: &TcpStream) -> bool {
        match self.sendfile {
            SendfileMode::Always => true,
            SendfileMode::Never => false,
            SendfileMode::Auto => match (stream.peer_addr(), stream.local_addr()) {
                (Ok(peer), Ok(local)) => !same_host(peer.ip(), local.ip()),
                _ => false,
            },
        }
    }
}

impl Default for Builders {
    fn default() -> Builders {
        Builders::new(SendfileMode::default())
    }
}

/// A client on this host: loopback, or connected from the address it
/// connected to (this host's own address, as with host networking).
fn same_host(peer: IpAddr, local: IpAddr) -> bool {
    let (peer, local) = (peer.to_canonical(), local.to_canonical());
    peer.is_loopback() || peer == local
}

/// What a cleartext client's first bytes say.
#[derive(Debug, PartialEq)]
enum Sniffed {
    Http1,
    Http2,
    /// Only part of [`H2_PREFACE_START`] so far (or the client closed after
    /// it): hyper-util's auto builder reads on and decides.
    Unsure,
}

/// Which version a cleartext client speaks, judged from its first bytes
/// with `peek`, so hyper still reads them itself. hyper-util's auto mode
/// reads those bytes ahead of hyper instead, and hyper, finding its 8 KiB
/// read buffer no longer empty, then grows it to 16 KiB on every
/// connection (massif): this way an idle HTTP/1 connection keeps 8 KiB.
/// One peek, never a loop: `peek` returns at once while any byte waits, so
/// waiting for more would spin; the rare first segment that holds only
/// part of `PRI ` is [`Sniffed::Unsure`]. End of stream counts as HTTP/1,
/// which then sees it.
async fn sniff(stream: &TcpStream) -> std::io::Result<Sniffed> {
    let mut start = [0u8; H2_PREFACE_START.len()];
    let n = stream.peek(&mut start).await?;
    Ok(if n == 0 || !H2_PREFACE_START.starts_with(&start[..n]) {
        Sniffed::Http1
    } else if n == start.len() {
        Sniffed::Http2
    } else {
        Sniffed::Unsure
    })
}

/// Accepts connections on `listener` until `shutdown` fires, at most
/// `max_connections` open at once: a further client waits in the kernel's
/// accept queue until one closes. Each accepted connection runs
/// `serve(stream, peer)` in its own task, holding its permit until done.
pub async fn accept_loop<F, Fut>(
    listener: &TcpListener,
    max_connections: usize,
    shutdown: &mut Shutdown,
    what: &'static str,
    mut serve: F,
) where
    F: FnMut(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(max_connections));
    loop {
        // The permit is taken before accept: backpressure, not a queue in memory.
        let accepted = tokio::select! {
            _ = shutdown.changed() => return,
            accepted = async {
                let permit = Arc::clone(&permits).acquire_owned().await;
                (permit, listener.accept().await)
            } => accepted,
        };
        let (permit, (stream, peer)) = match accepted {
            (Ok(permit), Ok(conn)) => (permit, conn),
            (Err(_), _) => return,
            (_, Err(e)) => {
                tracing::warn!(listener = what, error = %e, "accept failed");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let served = serve(stream, peer);
        tokio::spawn(async move {
            served.await;
            drop(permit);
        });
    }
}

/// Serves one accepted connection, over TLS when there is an `acceptor`
/// (the handshake bounded by [`TLS_HANDSHAKE_TIMEOUT`]), else in the clear
/// with its version `sniff`ed first: within [`FIRST_REQUEST_TIMEOUT`],
/// and given up at once when `shutdown` fires (no request is in flight).
///
/// The TLS arm is boxed: rustls' connection state lives inline in its
/// stream, and unboxed it would size every connection's task, cleartext
/// ones included (11.6 KiB per idle connection measured with massif,
/// against 2 KiB for the cleartext future alone).
pub async fn serve_maybe_tls<H, Fut>(
    builders: &Builders,
    stream: TcpStream,
    acceptor: Option<TlsAcceptor>,
    watcher: Option<Watcher>,
    mut shutdown: Shutdown,
    handler: H,
) -> Result<(), BoxError>
where
    H: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let Some(acceptor) = acceptor else {
        let sniffed = tokio::select! {
            sniffed = tokio::time::timeout(FIRST_REQUEST_TIMEOUT, sniff(&stream)) => sniffed,
            _ = shutdown.changed() => return Ok(()),
        };
        let builder = match sniffed {
            Ok(Ok(Sniffed::Http1)) => {
                let sendfile = builders.sendfile_to(&stream);
                return http1::serve(&builders.http1, stream, sendfile, watcher, shutdown, handler).await;
            }
            Ok(Ok(Sniffed::Http2)) => &builders.http2,
            Ok(Ok(Sniffed::Unsure)) => &builders.any,
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err("connection timed out (no request)".into()),
        };
        // Boxed like the TLS arm, so that a parked HTTP/1 connection's task
        // does not carry room for a whole auto-builder connection.
        return Box::pin(serve_watched(builder, stream, watcher, handler)).await;
    };
    Box::pin(async move {
        match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
            // A verified client certificate names the client for grants:
            // every request of the connection carries its names.
            Ok(Ok(stream)) => match super::tls::client_identity(stream.get_ref().1) {
                Some(identity) => {
                    let handler = move |mut req: Request<Incoming>| {
                        req.extensions_mut().insert(identity.clone());
                        handler(req)
                    };
                    serve_watched(&builders.any, stream, watcher, handler).await
                }
                None => serve_watched(&builders.any, stream, watcher, handler).await,
            },
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err("TLS handshake timed out".into()),
        }
    })
    .await
}

/// Serves HTTP/1.1 or HTTP/2 on one accepted connection (plain or TLS)
/// under the watchdog: closed when no request arrives by the first-request
/// deadline or no byte moves for the idle timeout. With a `watcher`, a
/// graceful shutdown lets in-flight requests finish.
pub async fn serve_watched<I, H, Fut>(
    builder: &auto::Builder<TokioExecutor>,
    io: I,
    watcher: Option<Watcher>,
    handler: H,
) -> Result<(), BoxError>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    serve_watched_with(builder, io, watcher, move |req, _: &Arc<watchdog::Activity>| handler(req)).await
}

/// [`serve_watched`], the handler also given the connection's watchdog
/// activity, to hold a [`watchdog::Working`] mark while it works.
pub async fn serve_watched_with<I, H, Fut>(
    builder: &auto::Builder<TokioExecutor>,
    io: I,
    watcher: Option<Watcher>,
    handler: H,
) -> Result<(), BoxError>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>, &Arc<watchdog::Activity>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let activity = watchdog::Activity::new();
    let io = watchdog::Tracked::new(io, Arc::clone(&activity));
    let requests = Arc::clone(&activity);
    // The handler's future is boxed per request: hyper keeps a slot for
    // the in-flight future in every connection, and unboxed that slot is
    // the whole handler state machine (about 10 KiB, measured with massif),
    // held by each idle keep-alive connection of a hub's thousands.
    let service = service_fn(move |req| {
        requests.request();
        let response = handler(req, &requests);
        Box::pin(async move { Ok::<_, Infallible>(response.await) })
            as Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>
    });
    let conn = builder.serve_connection(TokioIo::new(io), service);
    let expired = || async { Err::<(), BoxError>("connection timed out (no request, or idle)".into()) };
    match watcher {
        Some(watcher) => tokio::select! {
            served = watcher.watch(conn) => served,
            () = activity.expired() => expired().await,
        },
        None => tokio::select! {
            served = conn => served,
            () = activity.expired() => expired().await,
        },
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    use super::{Builders, Sniffed, sniff};

    /// A connected pair on loopback: (client, server side).
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    /// Sends `first`, and what `sniff` says.
    async fn sniffed(first: &[u8]) -> Sniffed {
        let (mut client, server) = pair().await;
        client.write_all(first).await.unwrap();
        client.flush().await.unwrap();
        // One segment on loopback; let it land before the peek.
        tokio::time::sleep(Duration::from_millis(20)).await;
        sniff(&server).await.unwrap()
    }

    #[test]
    fn loopback_and_this_hosts_own_address_are_the_same_host() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert!(super::same_host(ip("127.0.0.1"), ip("127.0.0.1")));
        assert!(super::same_host(ip("127.0.0.5"), ip("10.0.0.1")), "all of 127/8 is loopback");
        assert!(super::same_host(ip("::1"), ip("::1")));
        assert!(super::same_host(ip("::ffff:127.0.0.1"), ip("::ffff:127.0.0.1")), "v4-mapped loopback");
        assert!(super::same_host(ip("10.0.0.7"), ip("10.0.0.7")), "host networking: from this host's own address");
        assert!(super::same_host(ip("::ffff:10.0.0.7"), ip("10.0.0.7")));
        assert!(!super::same_host(ip("10.0.0.8"), ip("10.0.0.7")), "another host");
        assert!(!super::same_host(ip("fd00::8"), ip("fd00::7")));
    }

    #[tokio::test]
    async fn the_first_bytes_tell_http2_from_http1_and_nothing_is_consumed() {
        assert_eq!(sniffed(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await, Sniffed::Http2);
        assert_eq!(sniffed(b"GET /v2/ HTTP/1.1\r\n").await, Sniffed::Http1);
        assert_eq!(sniffed(b"PUT /v2/x HTTP/1.1\r\n").await, Sniffed::Http1, "PUT shares only the P");
        assert_eq!(sniffed(b"PRIX").await, Sniffed::Http1);
        assert_eq!(sniffed(b"PR").await, Sniffed::Unsure, "a part of the preface: the auto builder decides");

        let (mut client, server) = pair().await;
        client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        assert_eq!(sniff(&server).await.unwrap(), Sniffed::Http1);
        let mut start = [0u8; 3];
        assert_eq!(server.peek(&mut start).await.unwrap(), 3);
        assert_eq!(&start, b"GET", "left for hyper to read");

        let (client, server) = pair().await;
        drop(client);
        assert_eq!(sniff(&server).await.unwrap(), Sniffed::Http1, "end of stream is HTTP/1's to see");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_sends_part_of_the_preface_and_closes_is_let_go_at_once() {
        let (mut client, server) = pair().await;
        client.write_all(b"P").await.unwrap();
        client.shutdown().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (_stop, shutdown) = tokio::sync::watch::channel(());
        let handler = |_req| async { http::Response::new(crate::body::empty()) };
        let builders = Builders::default();
        let served = super::serve_maybe_tls(&builders, server, None, None, shutdown, handler);
        let ended = tokio::time::timeout(Duration::from_secs(5), served).await;
        assert!(ended.is_ok(), "the auto builder read the end of stream; nothing waited for more bytes");
    }

    #[tokio::test]
    async fn a_silent_cleartext_connection_is_let_go_at_shutdown() {
        let (_client, server) = pair().await;
        let (stop, shutdown) = tokio::sync::watch::channel(());
        let handler = |_req| async { http::Response::new(crate::body::empty()) };
        let served = tokio::spawn(async move {
            super::serve_maybe_tls(&Builders::default(), server, None, None, shutdown, handler).await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!served.is_finished(), "still waiting for the client's first bytes");
        stop.send(()).unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(5), served).await;
        assert!(matches!(ended, Ok(Ok(Ok(())))), "returned at the shutdown signal: {ended:?}");
    }
}
