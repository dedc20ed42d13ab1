//! How long to leave an upstream alone after a tag revalidation failed.
//! During an outage every request past its tag's TTL would otherwise wait
//! for its own timeout, so stale tags are served without asking for a
//! while. The pause starts short and doubles with each failure in a row,
//! bounded by the upstream's `tag_ttl` (and [`MAX_REVALIDATION_BACKOFF`]):
//! a down upstream is not hammered, and once it is back a moved tag is seen
//! within about one `tag_ttl`. One success ends the pause.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The pause after the first failed revalidation.
pub const REVALIDATION_BACKOFF_START: Duration = Duration::from_secs(1);
/// The longest pause, whatever `tag_ttl` says.
pub const MAX_REVALIDATION_BACKOFF: Duration = Duration::from_secs(300);

#[derive(Default)]
pub struct Backoff {
    /// A std Mutex: never held across `.await`.
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Failures in a row.
    failures: u32,
    until: Option<Instant>,
}

impl Backoff {
    /// Whether a recent failure says not to ask now.
    pub fn active(&self) -> bool {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.until.is_some_and(|until| Instant::now() < until)
    }

    /// Records how a revalidation went; `bound` is the upstream's `tag_ttl`.
    pub fn record(&self, failed: bool, bound: Duration) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if !failed {
            *state = State::default();
            return;
        }
        let pause = REVALIDATION_BACKOFF_START
            .saturating_mul(1 << state.failures.min(16))
            .min(bound)
            .min(MAX_REVALIDATION_BACKOFF);
        state.failures = state.failures.saturating_add(1);
        state.until = Some(Instant::now() + pause);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How long the pause after the latest failure lasts.
    async fn pause(b: &Backoff) -> Duration {
        let started = Instant::now();
        while b.active() {
            tokio::time::advance(Duration::from_millis(100)).await;
        }
        started.elapsed()
    }

    #[tokio::test(start_paused = true)]
    async fn doubles_from_a_short_start_bounded_by_the_tag_ttl() {
        let b = Backoff::default();
        assert!(!b.active());
        let ttl = Duration::from_secs(5);
        let mut pauses = Vec::new();
        for _ in 0..5 {
            b.record(true, ttl);
            pauses.push(pause(&b).await.as_secs());
        }
        assert_eq!(pauses, [1, 2, 4, 5, 5]);
        b.record(false, ttl);
        assert!(!b.active());
        b.record(true, ttl);
        assert_eq!(pause(&b).await.as_secs(), 1, "a success starts over");

        let long = Backoff::default();
        for _ in 0..20 {
            long.record(true, Duration::from_secs(86_400));
        }
        assert_eq!(pause(&long).await, MAX_REVALIDATION_BACKOFF);
        let zero = Backoff::default();
        zero.record(true, Duration::ZERO);
        assert!(!zero.active(), "tag_ttl = 0 asks every time");
    }
}
