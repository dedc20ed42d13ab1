//! What an operator wants to know about one upstream at a glance (the
//! status page, `larder status`): its last failure and when, its last
//! success, and the rate-limit headroom it last announced (Docker Hub's
//! `ratelimit-remaining` / `ratelimit-limit`, e.g. `76;w=21600`). Updated
//! from every upstream response; a std Mutex held only to copy a few fields.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use http::{HeaderMap, Response, StatusCode};
use serde::Serialize;

use crate::error::UpstreamError;

/// Longest error message kept (an upstream error can quote a body).
const MAX_MESSAGE: usize = 300;

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct HealthReport {
    pub last_error: Option<LastError>,
    /// Unix millis of the last response that was not an error.
    pub last_success_ms: Option<u64>,
    pub rate_limit: Option<RateLimit>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct LastError {
    pub at_ms: u64,
    pub message: String,
}

/// Requests left in upstream's rate-limit window, as it last said.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct RateLimit {
    pub remaining: u64,
    pub limit: Option<u64>,
    pub at_ms: u64,
}

#[derive(Default)]
pub struct Health {
    state: Mutex<HealthReport>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The leading count of a `ratelimit-*` header (`"76;w=21600"` → 76).
fn leading_number(headers: &HeaderMap, name: &str) -> Option<u64> {
    let value = headers.get(name)?.to_str().ok()?;
    value.split(';').next()?.trim().parse().ok()
}

impl Health {
    /// Records one upstream answer (or the failure to get one).
    pub fn observe<B>(&self, sent: &Result<Response<B>, UpstreamError>) {
        let at_ms = now_ms();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let error = match sent {
            Err(e) => Some(e.to_string()),
            Ok(resp) => {
                if let Some(remaining) = leading_number(resp.headers(), "ratelimit-remaining") {
                    let limit = leading_number(resp.headers(), "ratelimit-limit");
                    state.rate_limit = Some(RateLimit { remaining, limit, at_ms });
                }
                match resp.status() {
                    StatusCode::TOO_MANY_REQUESTS => Some("rate limited (429 Too Many Requests)".to_owned()),
                    s if s.is_server_error() => Some(format!("answered {s}")),
                    _ => None,
                }
            }
        };
        match error {
            Some(mut message) => {
                if message.len() > MAX_MESSAGE {
                    let cut = (0..=MAX_MESSAGE).rev().find(|&i| message.is_char_boundary(i)).unwrap_or(0);
                    message.truncate(cut);
                    message.push('…');
                }
                state.last_error = Some(LastError { at_ms, message });
            }
            None => state.last_success_ms = Some(at_ms),
        }
    }

    pub fn report(&self) -> HealthReport {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(status: u16, headers: &[(&str, &str)]) -> Result<Response<()>, UpstreamError> {
        let mut b = Response::builder().status(status);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        Ok(b.body(()).unwrap())
    }

    #[test]
    fn remembers_the_last_error_the_last_success_and_the_rate_limit() {
        let health = Health::default();
        health.observe(&response(200, &[("ratelimit-limit", "100;w=21600"), ("ratelimit-remaining", "76;w=21600")]));
        let r = health.report();
        assert!(r.last_error.is_none() && r.last_success_ms.is_some());
        let rl = r.rate_limit.unwrap();
        assert_eq!((rl.remaining, rl.limit), (76, Some(100)));

        health.observe(&response(429, &[("ratelimit-remaining", "0;w=21600")]));
        let r = health.report();
        assert_eq!(r.rate_limit.unwrap().remaining, 0);
        assert!(r.last_error.unwrap().message.contains("429"));

        health.observe::<()>(&Err(UpstreamError::Connect("connection refused".into())));
        assert!(health.report().last_error.unwrap().message.contains("connection refused"));
        health.observe(&response(404, &[]));
        assert!(health.report().last_error.is_some(), "a 404 is an answer, and the last error stays");
    }
}
