//! Accepting and serving connections under limits, shared by the registry
//! listener and the admin listener so that both get the same protections:
//! a connection cap taken before `accept` (backpressure into the kernel's
//! accept queue, not a queue in memory), hyper's header-read timeout, and
//! the [`watchdog`](super::watchdog) deadlines (first request, then idle).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
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

use super::watchdog;
use super::{HEADER_READ_TIMEOUT, MAX_CONCURRENT_STREAMS, TLS_HANDSHAKE_TIMEOUT};
use crate::body::{Body, BoxError};
use crate::shutdown::Shutdown;

/// Pause after a failed `accept` (EMFILE and the like) before the next try,
/// so that a descriptor shortage does not become a busy loop.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// The HTTP/1.1 + HTTP/2 connection builder both listeners use: hyper's
/// header-read timeout and the HTTP/2 stream limit.
pub fn http_builder() -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
    builder.http2().timer(TokioTimer::new()).max_concurrent_streams(MAX_CONCURRENT_STREAMS);
    builder
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
/// (the handshake bounded by [`TLS_HANDSHAKE_TIMEOUT`]), else in the clear.
///
/// The TLS arm is boxed: rustls' connection state lives inline in its
/// stream, and unboxed it would size every connection's task, cleartext
/// ones included (11.6 KiB per idle connection measured with massif,
/// against 2 KiB for the cleartext future alone).
pub async fn serve_maybe_tls<H, Fut>(
    builder: &auto::Builder<TokioExecutor>,
    stream: TcpStream,
    acceptor: Option<TlsAcceptor>,
    watcher: Option<Watcher>,
    handler: H,
) -> Result<(), BoxError>
where
    H: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let Some(acceptor) = acceptor else {
        return serve_watched(builder, stream, watcher, handler).await;
    };
    Box::pin(async move {
        match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
            Ok(Ok(stream)) => serve_watched(builder, stream, watcher, handler).await,
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
    let activity = watchdog::Activity::new();
    let io = watchdog::Tracked::new(io, Arc::clone(&activity));
    let requests = Arc::clone(&activity);
    // The handler's future is boxed per request: hyper keeps a slot for
    // the in-flight future in every connection, and unboxed that slot is
    // the whole handler state machine (about 10 KiB, measured with massif),
    // held by each idle keep-alive connection of a hub's thousands.
    let service = service_fn(move |req| {
        requests.request();
        let response = handler(req);
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
