//! The `Range` request header: a single `bytes=` range, validated at the
//! edge. Multiple ranges are not supported and answered 416 like any other
//! unsatisfiable or malformed range. A range in another unit is ignored,
//! as RFC 9110 (section 14.2) requires: the whole blob is sent.

use http::HeaderValue;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ByteRange {
    /// `bytes=a-b` (inclusive).
    FromTo(u64, u64),
    /// `bytes=a-`
    From(u64),
    /// `bytes=-n`: the last n bytes.
    Suffix(u64),
}

/// The header could not be parsed as one byte range.
#[derive(Debug, PartialEq, Eq)]
pub struct Malformed;

impl ByteRange {
    /// The range a request's `Range` header asks for: `None` when its unit
    /// is not `bytes` (to be ignored), else the parsed byte range.
    pub fn requested(value: &HeaderValue) -> Option<Result<ByteRange, Malformed>> {
        let unit = value.to_str().ok().and_then(|s| s.trim().split_once('=')).map(|(unit, _)| unit.trim());
        match unit {
            Some(unit) if !unit.eq_ignore_ascii_case("bytes") && is_token(unit) => None,
            _ => Some(ByteRange::parse(value)),
        }
    }

    /// A `bytes=` range (the unit is case-insensitive).
    pub fn parse(value: &HeaderValue) -> Result<ByteRange, Malformed> {
        let s = value.to_str().map_err(|_| Malformed)?.trim();
        let (unit, spec) = s.split_once('=').ok_or(Malformed)?;
        if !unit.eq_ignore_ascii_case("bytes") {
            return Err(Malformed);
        }
        let spec = spec.trim();
        let (first, last) = spec.split_once('-').ok_or(Malformed)?;
        let num = |t: &str| -> Result<u64, Malformed> {
            let t = t.trim();
            if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
                return Err(Malformed);
            }
            t.parse().map_err(|_| Malformed)
        };
        match (first.trim().is_empty(), last.trim().is_empty()) {
            (false, false) => Ok(ByteRange::FromTo(num(first)?, num(last)?)),
            (false, true) => Ok(ByteRange::From(num(first)?)),
            (true, false) => Ok(ByteRange::Suffix(num(last)?)),
            (true, true) => Err(Malformed),
        }
    }

    /// The half-open byte span `[start, end)` this range selects from a
    /// blob of `size` bytes, clipped to its end; `None` if unsatisfiable.
    pub fn resolve(self, size: u64) -> Option<(u64, u64)> {
        match self {
            ByteRange::FromTo(a, b) if a <= b && a < size => Some((a, b.min(size - 1) + 1)),
            ByteRange::From(a) if a < size => Some((a, size)),
            ByteRange::Suffix(n) if n > 0 && size > 0 => Some((size - n.min(size), size)),
            _ => None,
        }
    }
}

/// An RFC 9110 token (what a range unit is).
fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(h: &str, size: u64) -> Option<(u64, u64)> {
        ByteRange::parse(&HeaderValue::from_str(h).unwrap()).ok()?.resolve(size)
    }

    #[test]
    fn conformance_cases_on_a_2048_byte_blob() {
        assert_eq!(resolve("bytes=500-1499", 2048), Some((500, 1500)));
        assert_eq!(resolve("bytes=500-", 2048), Some((500, 2048)));
        assert_eq!(resolve("bytes=-500", 2048), Some((1548, 2048)));
        assert_eq!(resolve("bytes=2000-5000", 2048), Some((2000, 2048)));
        assert_eq!(resolve("bytes=500-0", 2048), None);
        assert_eq!(resolve("bytes=5000-10000", 2048), None);
    }

    #[test]
    fn edges() {
        assert_eq!(resolve("bytes=0-0", 1), Some((0, 1)));
        assert_eq!(resolve("bytes=-5000", 2048), Some((0, 2048)));
        assert_eq!(resolve("bytes=-0", 2048), None);
        assert_eq!(resolve("bytes=0-", 0), None);
        assert_eq!(resolve("bytes=2048-", 2048), None);
    }

    #[test]
    fn malformed_headers() {
        for h in ["bytes=", "bytes=-", "bytes=a-b", "bytes=1-2,3-4", "bytes=+1-2", "bytes=99999999999999999999-", "0-1"]
        {
            assert_eq!(ByteRange::parse(&HeaderValue::from_str(h).unwrap()), Err(Malformed), "{h}");
            assert_eq!(ByteRange::requested(&HeaderValue::from_str(h).unwrap()), Some(Err(Malformed)), "{h}");
        }
    }

    #[test]
    fn other_units_are_ignored_and_bytes_is_case_insensitive() {
        let requested = |h: &str| ByteRange::requested(&HeaderValue::from_str(h).unwrap());
        assert_eq!(requested("items=0-1"), None);
        assert_eq!(requested("pages = 3"), None);
        assert_eq!(requested("Bytes=0-1"), Some(Ok(ByteRange::FromTo(0, 1))));
        assert_eq!(requested("bytes=0-1"), Some(Ok(ByteRange::FromTo(0, 1))));
        assert_eq!(requested("i tems=0-1"), Some(Err(Malformed)), "not a unit: malformed");
    }
}
