//! Every fill's deadline, derived from the blob's size and a minimum
//! rate: a source that trickles (or a chain of sources that each bring a
//! little) cannot hold a fill, and the clients following it, for longer
//! than a healthy link would take. A fill past its deadline fails like
//! any other: nothing is committed, its temp file goes, its readers'
//! bodies are aborted, and the next request starts a new fill.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::progress::Progress;
use crate::error::{Error, UpstreamError};

/// The slowest average rate a fill may keep: one still running after its
/// size at this rate, plus [`FILL_GRACE`], fails. 256 KiB/s (2 Mbit/s) is
/// well below any link a registry mirror is used over, and a 1 GiB layer
/// still gets 68 minutes.
pub const FILL_MIN_RATE: u64 = 256 << 10;
/// Added to every fill's deadline: connections, redirects, tokens and each
/// source's (and part's) time to first byte.
pub const FILL_GRACE: Duration = Duration::from_secs(30);

/// How long a fill of `size` bytes may run.
pub fn allowance(size: u64) -> Duration {
    FILL_GRACE + Duration::from_millis(size.saturating_mul(1000) / FILL_MIN_RATE)
}

/// Ends, with the error to fail the fill with, when the fill publishing
/// on `rx` passes its deadline. The clock starts when the fill has its
/// first source's answer (until then `response_timeout` bounds each wait);
/// the size is the one its sources declared, else `unknown` (the fill's
/// bound). Never ends once the blob is verified: its commit is not cut
/// short.
pub async fn deadline(mut rx: watch::Receiver<Progress>, unknown: u64) -> Error {
    let started = loop {
        match running(&mut rx, unknown) {
            Some(None) => {}
            Some(Some(_)) => break Instant::now(),
            None => return std::future::pending().await,
        }
        if rx.changed().await.is_err() {
            return std::future::pending().await;
        }
    };
    let mut size = None;
    let sleep = tokio::time::sleep_until(started + allowance(unknown));
    tokio::pin!(sleep);
    loop {
        let now = match running(&mut rx, unknown) {
            Some(now) => now.unwrap_or(unknown),
            None => return std::future::pending().await,
        };
        if size != Some(now) {
            size = Some(now);
            sleep.as_mut().reset(started + allowance(now));
        }
        tokio::select! {
            () = &mut sleep => {
                return UpstreamError::Timeout("the fill ran past its deadline (its size at the minimum fill rate)").into();
            }
            changed = rx.changed() => if changed.is_err() {
                return std::future::pending().await;
            },
        }
    }
}

/// Where the fill is: `None` once it is verified (or over), else
/// `Some(None)` while it waits for its first answer, `Some(Some(size))`
/// once it streams (`unknown` where no source declared a size).
fn running(rx: &mut watch::Receiver<Progress>, unknown: u64) -> Option<Option<u64>> {
    match &*rx.borrow_and_update() {
        Progress::Connecting => Some(None),
        Progress::Streaming { size, .. } => Some(Some(size.unwrap_or(unknown))),
        Progress::Verified { .. } | Progress::Complete { .. } | Progress::Failed(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::sync::Arc;

    use super::*;

    fn streaming(size: Option<u64>) -> Progress {
        let file = Arc::new(File::open("/dev/null").unwrap());
        Progress::Streaming { file, size, written: 0, vouched_from: 0, extents: None }
    }

    #[test]
    fn the_allowance_is_the_grace_plus_the_size_at_the_minimum_rate() {
        assert_eq!(allowance(0), FILL_GRACE);
        assert_eq!(allowance(FILL_MIN_RATE * 60), FILL_GRACE + Duration::from_secs(60));
        assert_eq!(allowance(1 << 30), FILL_GRACE + Duration::from_secs(4096));
        assert!(allowance(u64::MAX) > Duration::from_secs(1 << 30), "no overflow");
    }

    #[tokio::test(start_paused = true)]
    async fn the_clock_starts_with_the_first_answer_and_follows_the_declared_size() {
        let (tx, rx) = watch::channel(Progress::Connecting);
        let mut timer = tokio::spawn(deadline(rx, 1 << 30));
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!timer.is_finished(), "waiting for headers is not the fill's time");
        tx.send_replace(streaming(None));
        let start = Instant::now();
        tokio::time::sleep(Duration::from_secs(5)).await;
        // The source declared the size: 10 s at the minimum rate.
        tx.send_replace(streaming(Some(FILL_MIN_RATE * 10)));
        let e = (&mut timer).await.unwrap();
        assert!(matches!(e, Error::Upstream(UpstreamError::Timeout(_))), "{e}");
        assert_eq!(Instant::now() - start, FILL_GRACE + Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_verified_fill_is_never_cut_short() {
        let (tx, rx) = watch::channel(streaming(Some(1)));
        let timer = tokio::spawn(deadline(rx, 1));
        tokio::time::sleep(Duration::from_secs(1)).await;
        tx.send_replace(Progress::Verified { file: Arc::new(File::open("/dev/null").unwrap()), size: 1 });
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!timer.is_finished());
    }
}
