//! The shared tier's circuit breaker: after a lookup fails or times out,
//! lookups skip the store for a pause that grows while it keeps failing,
//! so a dead store costs one lookup deadline per pause, not one per miss.

use std::time::Duration;

use crate::metrics::metrics;

/// How long lookups skip the store after one timed out or failed: the
/// first pause, doubled per failure in a row up to [`BREAKER_MAX`]. A
/// dead store then costs one [`super::LOOKUP_TIMEOUT`] per pause, not one per
/// miss (and a client's retries do not multiply it); the first lookup
/// after a pause tries the store again, and one that answers closes the
/// breaker.
pub const BREAKER_MIN: Duration = Duration::from_secs(1);
/// Longest pause of lookups while the store keeps failing: how late a
/// store that came back is used again at worst.
pub const BREAKER_MAX: Duration = Duration::from_secs(30);

/// Skips lookups for a growing pause after they fail (see [`BREAKER_MIN`]).
pub(super) struct Breaker {
    min: Duration,
    max: Duration,
    // A std Mutex: held for a read or an update, never across `.await`.
    state: std::sync::Mutex<BreakerState>,
}

#[derive(Default)]
struct BreakerState {
    /// Lookups skip the store until then.
    open_until: Option<tokio::time::Instant>,
    /// Failures in a row.
    failures: u32,
}

impl Breaker {
    pub(super) fn new(min: Duration, max: Duration) -> Breaker {
        Breaker { min, max, state: std::sync::Mutex::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BreakerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether lookups skip the store now.
    pub(super) fn is_open(&self) -> bool {
        self.lock().open_until.is_some_and(|until| tokio::time::Instant::now() < until)
    }

    /// A lookup failed: skip the store for the next pause.
    pub(super) fn failed(&self) {
        let pause = {
            let mut state = self.lock();
            state.failures = state.failures.saturating_add(1);
            let doublings = state.failures.saturating_sub(1).min(16);
            let pause = self.min.saturating_mul(1 << doublings).min(self.max);
            state.open_until = Some(tokio::time::Instant::now() + pause);
            pause
        };
        metrics().shared_down.set(1);
        tracing::warn!(skip_for = ?pause, "shared tier failing; lookups skip it for a while");
    }

    /// A lookup was answered (found or not): the store works.
    pub(super) fn answered(&self) {
        let was_failing = {
            let mut state = self.lock();
            let was = state.failures > 0;
            *state = BreakerState::default();
            was
        };
        if was_failing {
            metrics().shared_down.set(0);
            tracing::info!("shared tier answers again");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_breaker_pauses_longer_while_the_store_keeps_failing_and_closes_on_an_answer() {
        let breaker = Breaker::new(Duration::from_secs(1), Duration::from_secs(3));
        assert!(!breaker.is_open());
        let mut pauses = Vec::new();
        for _ in 0..4 {
            breaker.failed();
            let started = tokio::time::Instant::now();
            while breaker.is_open() {
                tokio::time::advance(Duration::from_millis(100)).await;
            }
            pauses.push(started.elapsed().as_millis());
        }
        assert_eq!(pauses, [1000, 2000, 3000, 3000], "doubled per failure in a row, up to the cap");
        breaker.failed();
        breaker.answered();
        assert!(!breaker.is_open(), "an answer closes it at once");
        breaker.failed();
        assert_eq!(breaker.lock().failures, 1, "and the count starts again");
    }
}
