//! `Range` headers: `ByteRange::parse` on arbitrary header values, then
//! `resolve` against blob sizes around every number in the range and the
//! usual edges. A resolved span `[start, end)` always has
//! `start < end <= size` and is exactly what RFC 9110 asks for.
#![no_main]

use http::HeaderValue;
use larder::server::range::ByteRange;
use libfuzzer_sys::fuzz_target;

fn check(range: ByteRange, size: u64) {
    let resolved = range.resolve(size);
    if let Some((start, end)) = resolved {
        assert!(start < end && end <= size, "{range:?} on {size} bytes resolved to {start}..{end}");
    }
    // RFC 9110 §14.1.2, spelled independently of the implementation: a
    // first-last range needs first <= last and first < size and is clipped
    // to the blob; a suffix takes the last n bytes of a non-empty blob.
    let expected = match range {
        ByteRange::FromTo(first, last) => {
            (first <= last && first < size).then(|| (first, last.saturating_add(1).min(size)))
        }
        ByteRange::From(first) => (first < size).then_some((first, size)),
        ByteRange::Suffix(n) => (n > 0 && size > 0).then(|| (size.saturating_sub(n), size)),
    };
    assert_eq!(resolved, expected, "{range:?} on {size} bytes");
}

fuzz_target!(|data: &[u8]| {
    let Ok(value) = HeaderValue::from_bytes(data) else { return };
    let Ok(range) = ByteRange::parse(&value) else { return };

    // Only a single `bytes=` range is accepted; the unit is
    // case-insensitive (RFC 9110 §14.1).
    let text = value.to_str().expect("a parsed range is text");
    let unit_ok = text.trim().get(..6).is_some_and(|u| u.eq_ignore_ascii_case("bytes="));
    assert!(unit_ok && !text.contains(','), "accepted {text:?}");
    // Its canonical spelling parses to the same range.
    let canonical = match range {
        ByteRange::FromTo(a, b) => format!("bytes={a}-{b}"),
        ByteRange::From(a) => format!("bytes={a}-"),
        ByteRange::Suffix(n) => format!("bytes=-{n}"),
    };
    assert_eq!(ByteRange::parse(&HeaderValue::from_str(&canonical).unwrap()), Ok(range));

    let mut sizes = vec![0, 1, 2, 1023, 2048, 1 << 32, u64::MAX - 1, u64::MAX];
    let numbers = match range {
        ByteRange::FromTo(a, b) => vec![a, b],
        ByteRange::From(a) => vec![a],
        ByteRange::Suffix(n) => vec![n],
    };
    for n in numbers {
        sizes.extend([n.saturating_sub(1), n, n.saturating_add(1), n.saturating_add(2)]);
    }
    for size in sizes {
        check(range, size);
    }
});
