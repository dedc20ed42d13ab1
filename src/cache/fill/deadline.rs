//! Every fill's deadline, derived from the blob's size and a minimum
//! rate: a source that trickles (or a chain of sources that each bring a
//! little) cannot hold a fill, and the clients following it, for longer
//! than a healthy link would take. A fill past its deadline fails like
//! any other: nothing is committed, its temp file goes, its readers'
//! bodies are aborted, and the next request starts a new fill.
//!
//! The time larder itself held the fill's reads back, waiting on its
//! upstream's bandwidth (`max_bandwidth`, or a fill ahead or a warm
//! download yielding to clients' fills), is added to the deadline: the
//! minimum rate judges the source, and a fill held below it by its own
//! upstream's cap (a rate under 256 KiB/s, or clients using the whole
//! rate while a fill ahead waits) is not a source that trickles. A fill
//! held back thus runs as long as larder holds it, and then still has its
//! whole allowance for the source's own time.

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
/// bound). `held` says how long the fill's reads were held back so far
/// (by its upstream's bandwidth); the deadline moves out by the time held
/// since the clock started. Never ends once the blob is verified: its
/// commit is not cut short.
pub async fn deadline(mut rx: watch::Receiver<Progress>, unknown: u64, held: impl Fn() -> Duration) -> Error {
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
    let held_before = held();
    let due = |size: u64| started + allowance(size) + held().saturating_sub(held_before);
    let mut size = unknown;
    let sleep = tokio::time::sleep_until(due(size));
    tokio::pin!(sleep);
    loop {
        let now = match running(&mut rx, unknown) {
            Some(now) => now.unwrap_or(unknown),
            None => return std::future::pending().await,
        };
        if size != now {
            size = now;
            sleep.as_mut().reset(due(size));
        }
        tokio::select! {
            () = &mut sleep => {
                let due = due(size);
                if Instant::now() < due {
                    // Held back meanwhile: that time is not the source's.
                    sleep.as_mut().reset(due);
                    continue;
                }
                return UpstreamError::Timeout(
                    "the fill ran past its deadline (its size at the minimum fill rate, plus the time its upstream's \
                     bandwidth held it back)",
                )
                .into();
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
    use crate::upstream::Priority;
    use crate::upstream::bandwidth::Bandwidth;

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
        let mut timer = tokio::spawn(deadline(rx, 1 << 30, || Duration::ZERO));
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
    async fn time_held_back_moves_the_deadline_out_by_as_much() {
        let held = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let seconds = Arc::clone(&held);
        let held_for = move || Duration::from_secs(seconds.load(std::sync::atomic::Ordering::Relaxed));
        // Held 5 s before the clock starts: not the fill's, not added.
        held.store(5, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = watch::channel(streaming(Some(FILL_MIN_RATE * 10)));
        let start = Instant::now();
        let mut timer = tokio::spawn(deadline(rx, 1 << 30, held_for));
        tokio::time::sleep(Duration::from_secs(20)).await;
        // Then held back 60 s more (its sleep is not woken for it).
        held.store(65, std::sync::atomic::Ordering::Relaxed);
        tokio::time::sleep(FILL_GRACE).await;
        assert!(!timer.is_finished(), "past the allowance, but held back for 60 s of it");
        let e = (&mut timer).await.unwrap();
        assert!(matches!(e, Error::Upstream(UpstreamError::Timeout(_))), "{e}");
        assert_eq!(Instant::now() - start, FILL_GRACE + Duration::from_secs(10 + 60));
        drop(tx);
    }

    /// A fill and its deadline, as `Cache::spawn_fill` runs them: the
    /// fill reads `size` bytes in 256 KiB chunks through `pace` (after
    /// `before`, if any, ends) and then is verified. Returns whether the
    /// deadline ended first, and how long the reads took.
    async fn read_against_deadline(
        bandwidth: &Arc<Bandwidth>,
        priority: &Priority,
        size: u64,
        before: Option<tokio::task::JoinHandle<()>>,
    ) -> (bool, Duration) {
        let _registered = bandwidth.register(priority);
        let (tx, rx) = watch::channel(Progress::Connecting);
        let (b, p) = (Arc::clone(bandwidth), priority.clone());
        let mut timer = tokio::spawn(deadline(rx, 1 << 30, move || b.held(&p)));
        let pace = bandwidth.pace(priority);
        tx.send_replace(streaming(Some(size)));
        let start = Instant::now();
        let read = async {
            if let Some(before) = before {
                before.await.unwrap();
            }
            for _ in 0..size / (256 << 10) {
                pace.take(256 << 10).await;
            }
        };
        let cut = tokio::select! {
            () = read => false,
            _ = &mut timer => true,
        };
        let took = Instant::now() - start;
        tx.send_replace(Progress::Verified { file: Arc::new(File::open("/dev/null").unwrap()), size });
        (cut, took)
    }

    #[tokio::test(start_paused = true)]
    async fn a_fill_held_below_the_minimum_rate_by_max_bandwidth_is_not_cut_at_its_deadline() {
        // max_bandwidth = 64 KiB/s: 8 MiB takes about 128 s; its allowance
        // at 256 KiB/s is 30 + 32 s.
        let bandwidth = Arc::new(Bandwidth::new("deadline.test", Some(64 << 10)));
        let size = 8 << 20;
        let (cut, took) = read_against_deadline(&bandwidth, &Priority::client(), size, None).await;
        assert!(took > allowance(size), "the cap held it past its allowance: {took:?}");
        assert!(!cut, "cut at its deadline after {took:?}, though the cap, not the source, held it");
    }

    #[tokio::test(start_paused = true)]
    async fn a_fill_ahead_yielding_while_a_client_uses_the_whole_rate_is_not_cut_at_its_deadline() {
        // 1 MiB/s; a client's fill reads 128 MiB (about 128 s) while a fill
        // ahead of 4 MiB (allowance 30 + 16 s) waits for what it leaves.
        let bandwidth = Arc::new(Bandwidth::new("deadline-ahead.test", Some(1 << 20)));
        let client = Priority::client();
        let registered = bandwidth.register(&client);
        let pace = bandwidth.pace(&client);
        let client_fill = tokio::spawn(async move {
            for _ in 0..512 {
                pace.take(256 << 10).await;
            }
            drop(registered);
        });
        let (cut, took) = read_against_deadline(&bandwidth, &Priority::ahead(), 4 << 20, None).await;
        assert!(client_fill.is_finished(), "the fill ahead read only once the client's was done");
        assert!(took > allowance(4 << 20), "it yielded past its allowance: {took:?}");
        assert!(!cut, "cut at its deadline after {took:?}, though it only yielded to a client");
    }

    #[tokio::test(start_paused = true)]
    async fn a_source_that_trickles_is_cut_at_its_deadline_under_a_cap_too() {
        // The cap (64 MiB/s) never holds a fill that reads 256 KiB every
        // 10 s: the source is slow, and the deadline still ends it.
        let bandwidth = Arc::new(Bandwidth::new("deadline-trickle.test", Some(64 << 20)));
        let priority = Priority::client();
        let _registered = bandwidth.register(&priority);
        let (tx, rx) = watch::channel(streaming(Some(64 << 20)));
        let (b, p) = (Arc::clone(&bandwidth), priority.clone());
        let start = Instant::now();
        let timer = tokio::spawn(deadline(rx, 1 << 30, move || b.held(&p)));
        let pace = bandwidth.pace(&priority);
        let trickle = async {
            loop {
                tokio::time::sleep(Duration::from_secs(10)).await;
                pace.take(256 << 10).await;
            }
        };
        let ended = tokio::select! {
            () = trickle => None,
            e = timer => Some(e.unwrap()),
        };
        assert!(matches!(ended, Some(Error::Upstream(UpstreamError::Timeout(_)))), "{ended:?}");
        assert_eq!(Instant::now() - start, allowance(64 << 20));
        drop(tx);
    }

    #[tokio::test(start_paused = true)]
    async fn a_verified_fill_is_never_cut_short() {
        let (tx, rx) = watch::channel(streaming(Some(1)));
        let timer = tokio::spawn(deadline(rx, 1, || Duration::ZERO));
        tokio::time::sleep(Duration::from_secs(1)).await;
        tx.send_replace(Progress::Verified { file: Arc::new(File::open("/dev/null").unwrap()), size: 1 });
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!timer.is_finished());
    }
}
