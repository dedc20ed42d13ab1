//! Which upstreams answer ranges reliably. A parallel fill asks for parts
//! by range; an upstream that answered one of them with the whole blob (a
//! `200`), with a `206` running past the part asked for (mixed backends
//! behind a load balancer, a cache still populating the object), or with
//! other bytes than asked, is not asked for parts again for [`DISTRUST`]:
//! its fills are one stream each, as for an upstream that ignores
//! `Range`. The fill that met it goes on as one stream from the bytes it
//! has (see `super::parts`), unless the bytes were other than asked: that
//! fill fails, and only the next ones are spared.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long an upstream whose ranges proved unreliable gets no ranged
/// fills. Long enough that a misbehaving backend costs one fill in many,
/// short enough that a fixed one is trusted again the same hour.
pub const DISTRUST: Duration = Duration::from_secs(10 * 60);

/// Per upstream (by name), until when its ranges are not relied on. The
/// map holds at most one entry per configured upstream.
#[derive(Default)]
pub struct RangeTrust {
    // A std Mutex: held for a lookup or an insert, never across `.await`.
    until: Mutex<HashMap<String, Instant>>,
}

impl RangeTrust {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.until.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `upstream` answered a part's range with more than was asked.
    pub fn distrust(&self, upstream: &str) {
        let until = Instant::now() + DISTRUST;
        if self.lock().insert(upstream.to_owned(), until).is_none_or(|before| before < Instant::now()) {
            tracing::warn!(
                upstream,
                for_s = DISTRUST.as_secs(),
                "upstream answered a ranged GET with more than asked: its fills go as one stream for a while"
            );
        }
    }

    /// Whether fills from `upstream` may ask for parts by range.
    pub fn trusted(&self, upstream: &str) -> bool {
        self.lock().get(upstream).is_none_or(|until| *until <= Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upstream_is_distrusted_alone_and_for_a_while() {
        let trust = RangeTrust::default();
        assert!(trust.trusted("hub"));
        trust.distrust("hub");
        assert!(!trust.trusted("hub"));
        assert!(trust.trusted("quay"), "another upstream keeps its ranges");
        trust.lock().insert("hub".into(), Instant::now() - Duration::from_secs(1));
        assert!(trust.trusted("hub"), "trusted again once the while is over");
    }
}
