//! What an operator wants to know about one upstream at a glance (the
//! status page, `larder status`): its last failure and when, and its last
//! success. Updated from every upstream response; a std Mutex held only to
//! copy a few fields. (The rate-limit headroom upstream announces is kept
//! by `super::ratelimit` and its gauges.)

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use http::{Response, StatusCode};
use serde::Serialize;

use crate::error::UpstreamError;

/// Longest error message kept (an upstream error can quote a body).
const MAX_MESSAGE: usize = 300;

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct HealthReport {
    pub last_error: Option<LastError>,
    /// Unix millis of the last response that was not an error.
    pub last_success_ms: Option<u64>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct LastError {
    pub at_ms: u64,
    pub message: String,
}

#[derive(Default)]
pub struct Health {
    state: Mutex<HealthReport>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Health {
    /// Records one upstream answer (or the failure to get one).
    pub fn observe<B>(&self, sent: &Result<Response<B>, UpstreamError>) {
        let at_ms = now_ms();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let error = match sent {
            Err(e) => Some(e.to_string()),
            Ok(resp) => match resp.status() {
                StatusCode::TOO_MANY_REQUESTS => Some("rate limited (429 Too Many Requests)".to_owned()),
                s if s.is_server_error() => Some(format!("answered {s}")),
                _ => None,
            },
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

    fn response(status: u16) -> Result<Response<()>, UpstreamError> {
        Ok(Response::builder().status(status).body(()).unwrap())
    }

    #[test]
    fn remembers_the_last_error_and_the_last_success() {
        let health = Health::default();
        health.observe(&response(200));
        let r = health.report();
        assert!(r.last_error.is_none() && r.last_success_ms.is_some());
        health.observe(&response(429));
        assert!(health.report().last_error.unwrap().message.contains("429"));
        health.observe(&response(503));
        assert!(health.report().last_error.unwrap().message.contains("503"));
        health.observe::<()>(&Err(UpstreamError::Connect("connection refused".into())));
        assert!(health.report().last_error.unwrap().message.contains("connection refused"));
        health.observe(&response(404));
        assert!(health.report().last_error.is_some(), "a 404 is an answer, and the last error stays");
    }
}
