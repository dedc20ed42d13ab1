//! `Accept` negotiation and `MediaType::parse` from arbitrary `Accept`
//! lines (one header line per input line): no panic, an `Accept` always
//! allows at least one manifest type, and a type the client listed is
//! always allowed.
#![no_main]

use http::header::ACCEPT;
use http::{HeaderMap, HeaderValue};
use larder::oci::{Accept, MediaType};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut headers = HeaderMap::new();
    let mut listed = Vec::new();
    for line in data.split(|&b| b == b'\n') {
        let Ok(value) = HeaderValue::from_bytes(line) else { continue };
        if let Ok(text) = value.to_str() {
            for item in text.split(',') {
                let essence = item.split(';').next().unwrap_or("").trim();
                if let Some(m) = MediaType::parse(essence) {
                    assert!(m.as_str().eq_ignore_ascii_case(essence), "{essence:?} parsed as {m:?}");
                    listed.push(m);
                }
            }
            if let Some(m) = MediaType::parse(text) {
                assert_eq!(MediaType::parse(m.as_str()), Some(m));
            }
        }
        headers.append(ACCEPT, value);
    }
    let accept = Accept::from_headers(&headers);
    assert!(MediaType::ALL.iter().any(|&m| accept.allows(m)), "nothing allowed by {headers:?}");
    for m in listed {
        assert!(accept.allows(m), "{m:?} listed but not allowed by {headers:?}");
    }
});
