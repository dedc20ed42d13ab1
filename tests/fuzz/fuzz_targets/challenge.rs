//! `WWW-Authenticate` challenges from arbitrary text: no panic; a Bearer
//! challenge has a non-empty realm and survives a print/parse round trip;
//! `from_headers` picks the first line that parses (one header per line).
#![no_main]

use http::header::WWW_AUTHENTICATE;
use http::{HeaderMap, HeaderValue};
use larder::upstream::Challenge;
use libfuzzer_sys::fuzz_target;

fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

fn check_one(s: &str) -> Option<Challenge> {
    let parsed = Challenge::parse(s);
    let scheme = s.trim_start().split(|c: char| c.is_ascii_whitespace()).next().unwrap_or("");
    match &parsed {
        None => {}
        Some(Challenge::Basic) => assert!(scheme.eq_ignore_ascii_case("basic"), "{s:?}"),
        Some(Challenge::Bearer { realm, service, scope }) => {
            assert!(scheme.eq_ignore_ascii_case("bearer"), "{s:?}");
            assert!(!realm.is_empty(), "{s:?}");
            assert!(s.len() <= 4096);
            let mut printed = format!("Bearer realm={}", quoted(realm));
            if let Some(v) = service {
                printed += &format!(",service={}", quoted(v));
            }
            if let Some(v) = scope {
                printed += &format!(",scope={}", quoted(v));
            }
            if printed.len() <= 4096 {
                assert_eq!(Challenge::parse(&printed).as_ref(), parsed.as_ref(), "{s:?} printed as {printed:?}");
            }
        }
    }
    parsed
}

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        check_one(s);
    }
    let mut headers = HeaderMap::new();
    let mut first = None;
    for line in data.split(|&b| b == b'\n') {
        let Ok(value) = HeaderValue::from_bytes(line) else { continue };
        if first.is_none() {
            first = value.to_str().ok().and_then(check_one);
        }
        headers.append(WWW_AUTHENTICATE, value);
    }
    assert_eq!(Challenge::from_headers(&headers), first);
});
