//! Waiting for larder's log to catch up. larder writes its log lines in
//! batches (at least every 10 ms while it has lines, `log_writer::BATCH_WINDOW`),
//! so a line logged just before a test reads the log may not be out yet.
//! Shared by `common` and `fake` (included by path in both).

use std::time::{Duration, Instant};

/// How long a log must stop growing before it counts as caught up.
const LOG_SETTLE: Duration = Duration::from_millis(60);
/// The longest a read waits for the log to settle.
const LOG_SETTLE_LIMIT: Duration = Duration::from_secs(3);

/// Waits until `size()` has not changed for [`LOG_SETTLE`], or
/// [`LOG_SETTLE_LIMIT`] has passed. Blocks the thread: the log must be
/// collected by something else than the caller's task.
pub fn settled(mut size: impl FnMut() -> u64) {
    let started = Instant::now();
    let mut last = size();
    let mut since = Instant::now();
    while since.elapsed() < LOG_SETTLE && started.elapsed() < LOG_SETTLE_LIMIT {
        std::thread::sleep(Duration::from_millis(10));
        let now = size();
        if now != last {
            last = now;
            since = Instant::now();
        }
    }
}
