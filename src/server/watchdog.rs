//! Per-connection deadlines hyper cannot enforce on its own. The auto
//! builder reads a connection's first bytes (to tell HTTP/1 from HTTP/2)
//! before hyper's header timeout applies, so a client that connects and
//! sends nothing, or trickles bytes, would hold a connection forever. The
//! watchdog closes a connection that has not delivered its first request
//! within [`FIRST_REQUEST_TIMEOUT`], and after that one on which no byte
//! moved either way for [`IDLE_TIMEOUT`], unless a request on it holds a
//! [`Working`] mark: work the server does itself after the request was
//! read (an import's checks and commit) takes the time its size needs,
//! bounded by its own limits, not by the client's idleness.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

/// Time from accept until the first request's headers are complete.
pub const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest time without a byte read or written, once a request was seen.
/// Longer than the upstream response-header and body-idle timeouts, so a
/// request waiting on a slow upstream is not cut off by it.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

// The config refuses upstream timeouts above this bound; it must stay below
// the idle limit so that a client waiting on upstream gets a 504, not a cut.
const _: () = assert!(crate::config::MAX_UPSTREAM_TIMEOUT.as_secs() < IDLE_TIMEOUT.as_secs());

/// What the watchdog watches, shared with the connection's IO and service.
pub struct Activity {
    start: Instant,
    /// Milliseconds since `start` of the last byte moved.
    last_ms: AtomicU64,
    requested: AtomicBool,
    /// [`Working`] marks held.
    working: AtomicU64,
}

/// Held while the server works on a request with nothing to send or read
/// yet: the connection's idle timeout waits, and starts again from when
/// the mark is dropped.
pub struct Working(Arc<Activity>);

impl Drop for Working {
    fn drop(&mut self) {
        self.0.touch();
        self.0.working.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            requested: AtomicBool::new(false),
            working: AtomicU64::new(0),
        })
    }

    /// Marks the connection as working until the mark is dropped.
    pub fn working(self: &Arc<Self>) -> Working {
        self.working.fetch_add(1, Ordering::Relaxed);
        Working(Arc::clone(self))
    }

    fn touch(&self) {
        self.last_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// A request's headers were parsed.
    pub fn request(&self) {
        self.requested.store(true, Ordering::Relaxed);
        self.touch();
    }

    /// When a byte last moved (or the connection was accepted).
    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    /// Resolves once no byte has moved for `quiet`.
    pub async fn quiet_for(&self, quiet: Duration) {
        until(|| self.last() + quiet).await
    }

    /// Resolves when the connection should be closed.
    pub async fn expired(&self) {
        let first_deadline = self.start + FIRST_REQUEST_TIMEOUT;
        until(|| match self.requested.load(Ordering::Relaxed) {
            false => first_deadline,
            true if self.working.load(Ordering::Relaxed) > 0 => Instant::now() + IDLE_TIMEOUT,
            true => self.last() + IDLE_TIMEOUT,
        })
        .await
    }
}

/// Resolves once `deadline()`, read again whenever the timer fires, has
/// passed: the timer is set once and moved on only when it fires, never
/// per byte.
async fn until(deadline: impl Fn() -> Instant) {
    loop {
        let at = deadline();
        if Instant::now() >= at {
            return;
        }
        tokio::time::sleep_until(at).await;
    }
}

/// An IO stream that records when bytes move.
pub struct Tracked<I> {
    inner: I,
    activity: Arc<Activity>,
}

impl<I> Tracked<I> {
    pub fn new(inner: I, activity: Arc<Activity>) -> Tracked<I> {
        Tracked { inner, activity }
    }

    pub fn get_ref(&self) -> &I {
        &self.inner
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Tracked<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Tracked<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
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
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_expires_at_the_first_request_deadline() {
        let activity = Activity::new();
        let started = Instant::now();
        activity.expired().await;
        assert_eq!(started.elapsed(), FIRST_REQUEST_TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn quiet_waits_for_silence_since_the_last_byte() {
        let activity = Activity::new();
        tokio::time::sleep(Duration::from_millis(700)).await;
        activity.request();
        let started = Instant::now();
        activity.quiet_for(Duration::from_secs(1)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(1), "a second after the last byte, not after the start");
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_the_server_works_on_is_not_idle_until_the_work_ends() {
        let activity = Activity::new();
        activity.request();
        let started = Instant::now();
        let working = activity.working();
        let expired = tokio::spawn({
            let activity = Arc::clone(&activity);
            async move { activity.expired().await }
        });
        tokio::time::sleep(IDLE_TIMEOUT * 5).await;
        assert!(!expired.is_finished(), "five idle timeouts of work, and the connection is still open");
        drop(working);
        expired.await.unwrap();
        assert_eq!(started.elapsed(), IDLE_TIMEOUT * 6, "one idle timeout after the work ended");
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_request_only_idleness_counts() {
        let activity = Activity::new();
        tokio::time::sleep(Duration::from_secs(10)).await;
        activity.request();
        let started = Instant::now();
        activity.expired().await;
        assert_eq!(started.elapsed(), IDLE_TIMEOUT);
    }
}
