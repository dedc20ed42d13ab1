//! Upstream pull limits (DESIGN.md rule 7). Docker Hub announces its limit
//! on manifest responses, GET and HEAD alike (`ratelimit-limit: 100;w=21600`,
//! `ratelimit-remaining: 76;w=21600`), counts only GETs, and answers 429 once
//! the limit is used up. larder exports what it last heard as gauges, and
//! while the limit is used up (remaining 0, or a recent 429) the cache
//! serves tags it holds stale instead of spending a GET on a moved tag.

use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use http::{HeaderMap, Method, StatusCode};
use tokio::time::Instant;

use crate::metrics::metrics;

/// How long a 429 without a usable `Retry-After` counts as "limited".
const DEFAULT_RATE_LIMITED_FOR: Duration = Duration::from_secs(60);
/// Longest a 429's `Retry-After` is believed; a larger value is clamped.
const MAX_RATE_LIMITED_FOR: Duration = Duration::from_secs(3600);

pub struct RateLimit {
    upstream: String,
    /// `ratelimit-remaining` as last seen; -1 until upstream sends one.
    remaining: AtomicI64,
    /// Until when a 429 said to stop. A std Mutex: never held across `.await`.
    limited_until: Mutex<Option<Instant>>,
}

impl RateLimit {
    pub fn new(upstream: &str) -> RateLimit {
        RateLimit { upstream: upstream.to_owned(), remaining: AtomicI64::new(-1), limited_until: Mutex::new(None) }
    }

    /// Takes note of one response from the upstream's own origin. A pause
    /// after a 429 ends when upstream says pulls remain, or a GET succeeds
    /// (a HEAD succeeding says nothing: it is not what is limited).
    pub fn observe(&self, method: &Method, status: StatusCode, headers: &HeaderMap) {
        let m = metrics();
        if let Some(limit) = count(headers, "ratelimit-limit") {
            m.upstream_ratelimit_limit.with_label_values(&[&self.upstream]).set(limit);
        }
        let remaining = count(headers, "ratelimit-remaining");
        if let Some(remaining) = remaining {
            self.remaining.store(remaining, Ordering::Relaxed);
            m.upstream_ratelimit_remaining.with_label_values(&[&self.upstream]).set(remaining);
        }
        let mut until = self.limited_until.lock().unwrap_or_else(|p| p.into_inner());
        if status == StatusCode::TOO_MANY_REQUESTS {
            let pause = retry_after(headers).unwrap_or(DEFAULT_RATE_LIMITED_FOR).min(MAX_RATE_LIMITED_FOR);
            *until = Some(Instant::now() + pause);
            m.upstream_ratelimit_remaining.with_label_values(&[&self.upstream]).set(0);
        } else if remaining.is_some_and(|r| r > 0) || (status.is_success() && method == Method::GET) {
            *until = None;
        }
    }

    /// Whether a manifest GET now would be refused or spend the last of the
    /// limit: upstream said 0 remain, or answered 429 recently.
    pub fn exhausted(&self) -> bool {
        if self.remaining.load(Ordering::Relaxed) == 0 {
            return true;
        }
        self.limited_until.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|until| Instant::now() < until)
    }
}

/// The count in a `ratelimit-*` header: `76;w=21600` → 76.
fn count(headers: &HeaderMap, name: &str) -> Option<i64> {
    let value = headers.get(name)?.to_str().ok()?;
    let n: i64 = value.split(';').next()?.trim().parse().ok()?;
    (n >= 0).then_some(n)
}

/// `Retry-After` in seconds (the HTTP-date form is not used by registries).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let secs: u64 = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_secs(secs.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs.iter().map(|(k, v)| (http::HeaderName::from_static(k), HeaderValue::from_static(v))).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn docker_hub_headers_and_429() {
        let r = RateLimit::new("ratelimit-test");
        assert!(!r.exhausted(), "nothing known yet");
        let (get, head) = (&Method::GET, &Method::HEAD);
        let announced = headers(&[("ratelimit-limit", "100;w=21600"), ("ratelimit-remaining", "3;w=21600")]);
        r.observe(get, StatusCode::OK, &announced);
        assert!(!r.exhausted());
        let m = metrics();
        assert_eq!(m.upstream_ratelimit_limit.with_label_values(&["ratelimit-test"]).get(), 100);
        assert_eq!(m.upstream_ratelimit_remaining.with_label_values(&["ratelimit-test"]).get(), 3);
        // A HEAD (free) says the limit is used up.
        r.observe(head, StatusCode::OK, &headers(&[("ratelimit-remaining", "0;w=21600")]));
        assert!(r.exhausted());
        r.observe(head, StatusCode::OK, &headers(&[("ratelimit-remaining", "100;w=21600")]));
        assert!(!r.exhausted(), "the window reset");

        // A registry without the headers answers 429: limited for Retry-After.
        r.observe(get, StatusCode::TOO_MANY_REQUESTS, &headers(&[("retry-after", "30")]));
        assert!(r.exhausted());
        assert_eq!(m.upstream_ratelimit_remaining.with_label_values(&["ratelimit-test"]).get(), 0);
        r.observe(get, StatusCode::NOT_FOUND, &HeaderMap::new());
        assert!(r.exhausted(), "a 404 says nothing about the limit");
        r.observe(head, StatusCode::OK, &HeaderMap::new());
        assert!(r.exhausted(), "nor does a (free) HEAD");
        tokio::time::advance(Duration::from_secs(31)).await;
        assert!(!r.exhausted(), "Retry-After has passed");
        r.observe(get, StatusCode::TOO_MANY_REQUESTS, &HeaderMap::new());
        r.observe(head, StatusCode::OK, &headers(&[("ratelimit-remaining", "5")]));
        assert!(!r.exhausted(), "upstream saying pulls remain ends the pause");
        r.observe(get, StatusCode::TOO_MANY_REQUESTS, &HeaderMap::new());
        r.observe(get, StatusCode::OK, &HeaderMap::new());
        assert!(!r.exhausted(), "so does a GET that succeeds");
    }
}
