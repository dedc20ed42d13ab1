//! W3C Trace Context on the wire: a client's `traceparent` (and
//! `tracestate`) read, checked, and passed on to the next hop.
//!
//! The parsing is opentelemetry's `TraceContextPropagator`; what reaches
//! it is bounded first. A request with no `traceparent`, more than one,
//! one longer than [`MAX_TRACEPARENT`] or one the propagator refuses
//! (wrong length or version, upper case, an all-zero trace or parent id)
//! starts a new trace. A `tracestate` is kept only when the request
//! carries exactly one of at most [`MAX_TRACESTATE`] bytes (the spec's
//! limit); otherwise it is dropped, never passed on.

use http::HeaderMap;
use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// Longest `traceparent` read: version 00 is 55 bytes; later versions
/// may append fields, which larder does not read.
pub const MAX_TRACEPARENT: usize = 512;
/// Longest `tracestate` kept (W3C Trace Context: vendors propagate at
/// least 512 bytes and may drop longer ones).
pub const MAX_TRACESTATE: usize = 512;

/// The headers of one request, as the propagator may read them.
struct Bounded<'a>(&'a HeaderMap);

impl Bounded<'_> {
    fn single(&self, name: &str, max: usize) -> Option<&str> {
        let mut values = self.0.get_all(name).iter();
        let first = values.next()?;
        if values.next().is_some() || first.len() > max {
            return None;
        }
        first.to_str().ok()
    }
}

/// Whether `value` has the shape of a `traceparent` exactly: two, 32, 16
/// and two lowercase hex digits between dashes (version `ff` is invalid;
/// a later version may go on after a dash). The propagator alone would
/// take a shorter id, or one with a `+`, as it parses them as numbers.
fn well_formed(value: &str) -> bool {
    let b = value.as_bytes();
    let hex = |range: std::ops::Range<usize>| b[range].iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
    b.len() >= 55
        && (b[2], b[35], b[52]) == (b'-', b'-', b'-')
        && hex(0..2)
        && hex(3..35)
        && hex(36..52)
        && hex(53..55)
        && &b[..2] != b"ff"
        && match &b[..2] {
            b"00" => b.len() == 55,
            _ => b.len() == 55 || b[55] == b'-',
        }
}

impl Extractor for Bounded<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => self.single(key, MAX_TRACEPARENT).filter(|v| well_formed(v)),
            "tracestate" => self.single(key, MAX_TRACESTATE),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

/// The trace a request continues: the remote parent its valid
/// `traceparent` names, or an empty context (a new trace).
pub fn extract(headers: &HeaderMap) -> Context {
    if !headers.contains_key("traceparent") {
        return Context::new();
    }
    TraceContextPropagator::new().extract(&Bounded(headers))
}

/// Sets `traceparent` (and `tracestate` when there is one) for `cx` on an
/// outgoing request, replacing any already there.
pub fn inject(cx: &Context, headers: &mut HeaderMap) {
    TraceContextPropagator::new().inject_context(cx, &mut opentelemetry_http::HeaderInjector(headers));
    // An empty `tracestate` says nothing: not sent.
    if headers.get("tracestate").is_some_and(|v| v.is_empty()) {
        headers.remove("tracestate");
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;
    use opentelemetry::trace::TraceContextExt;

    use super::*;

    const VALID: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    fn map(headers: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.append(*k, HeaderValue::from_str(v).unwrap());
        }
        map
    }

    fn parent(headers: &[(&'static str, &str)]) -> Option<(String, String, bool)> {
        let cx = extract(&map(headers));
        let span = cx.span();
        let sc = span.span_context();
        sc.is_valid().then(|| (sc.trace_id().to_string(), sc.span_id().to_string(), sc.is_sampled()))
    }

    #[test]
    fn a_valid_traceparent_is_continued() {
        assert_eq!(
            parent(&[("traceparent", VALID)]),
            Some(("0af7651916cd43dd8448eb211c80319c".into(), "b7ad6b7169203331".into(), true))
        );
        let unsampled = VALID.replace("-01", "-00");
        assert_eq!(parent(&[("traceparent", &unsampled)]).map(|p| p.2), Some(false));
        // A later version is read for its first four fields.
        let later = VALID.replacen("00-", "01-", 1) + "-more";
        assert_eq!(parent(&[("traceparent", &later)]).map(|p| p.0), Some("0af7651916cd43dd8448eb211c80319c".into()));
    }

    #[test]
    fn hostile_traceparents_start_a_new_trace() {
        let long = format!("{VALID}-{}", "a".repeat(MAX_TRACEPARENT));
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-zz",
            "00-+af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01",
            " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\t",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x",
            &long,
        ] {
            assert_eq!(parent(&[("traceparent", bad)]), None, "{bad:?}");
        }
        assert_eq!(parent(&[("traceparent", VALID), ("traceparent", VALID)]), None, "two traceparent headers");
    }

    #[test]
    fn tracestate_is_kept_only_when_single_and_short() {
        let keep =
            |headers: &[(&'static str, &str)]| extract(&map(headers)).span().span_context().trace_state().header();
        assert_eq!(keep(&[("traceparent", VALID), ("tracestate", "vendor=abc")]), "vendor=abc");
        let long = format!("vendor={}", "a".repeat(MAX_TRACESTATE));
        assert_eq!(keep(&[("traceparent", VALID), ("tracestate", &long)]), "");
        assert_eq!(keep(&[("traceparent", VALID), ("tracestate", "a=1"), ("tracestate", "b=2")]), "");
    }

    #[test]
    fn the_next_hop_gets_the_context_and_nothing_empty() {
        let mut incoming = HeaderMap::new();
        incoming.insert("traceparent", HeaderValue::from_static(VALID));
        let cx = extract(&incoming);
        let mut outgoing = HeaderMap::new();
        outgoing.insert("traceparent", HeaderValue::from_static("00-stale"));
        inject(&cx, &mut outgoing);
        assert_eq!(outgoing.get_all("traceparent").iter().count(), 1);
        assert_eq!(outgoing["traceparent"], VALID);
        assert!(!outgoing.contains_key("tracestate"), "an empty tracestate is not sent");
        let mut none = HeaderMap::new();
        inject(&Context::new(), &mut none);
        assert!(none.is_empty(), "no trace, no header");
    }
}
