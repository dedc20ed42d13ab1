//! Registry warnings: `Warning: 299 - "<text>"` headers (distribution-spec,
//! "Warnings", after RFC 7234 §5.5), as upstream sent them with a
//! manifest, checked and bounded, so that larder relays them to clients
//! with the manifest it serves, also from the cache.
//!
//! The spec allows exactly one form: warn-code `299`, warn-agent `-`, a
//! quoted text and no warn-date, one warning per header line; containerd
//! (which reports them since 2.4) reads each header line alone and drops
//! any other form. A value in another form (an HTTP cache's `110`, a
//! comma-joined list) is not a registry warning and is not relayed.

use http::{HeaderMap, HeaderValue};

use super::headers::WARNING;

/// Warnings kept per manifest: "a few" in any real answer; more are
/// dropped (the first ones kept, in upstream's order).
pub const MAX_WARNINGS: usize = 8;
/// Bytes of warning values per manifest, all headers combined: the
/// spec's own limit on what a registry sends. A warning that would pass
/// it is dropped (later, shorter ones may still fit).
pub const MAX_WARNING_BYTES: usize = 4096;

/// A manifest's warnings, each a whole `299 - "…"` header value, in the
/// order upstream sent them, without duplicates, within [`MAX_WARNINGS`]
/// and [`MAX_WARNING_BYTES`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Warnings(Vec<HeaderValue>);

impl Warnings {
    /// The registry warnings among a response's `Warning` headers.
    pub fn from_headers(headers: &HeaderMap) -> Warnings {
        Self::collect(headers.get_all(WARNING).iter().map(HeaderValue::as_bytes))
    }

    /// Keeps the values that are registry warnings, within the bounds.
    fn collect<'a>(values: impl Iterator<Item = &'a [u8]>) -> Warnings {
        let mut kept: Vec<HeaderValue> = Vec::new();
        let mut bytes = 0;
        for value in values {
            if kept.len() == MAX_WARNINGS {
                break;
            }
            let value = trim(value);
            if !is_registry_warning(value) || kept.iter().any(|k| k.as_bytes() == value) {
                continue;
            }
            if bytes + value.len() > MAX_WARNING_BYTES {
                continue;
            }
            let Ok(header) = HeaderValue::from_bytes(value) else { continue };
            bytes += value.len();
            kept.push(header);
        }
        Warnings(kept)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &HeaderValue> {
        self.0.iter()
    }

    /// Bytes of all values: what they add to a cached manifest.
    pub fn byte_len(&self) -> usize {
        self.0.iter().map(|v| v.len()).sum()
    }

    /// The values one per line, as the index keeps them (a header value
    /// holds no line break).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.byte_len() + self.0.len());
        for (i, v) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(b'\n');
            }
            out.extend_from_slice(v.as_bytes());
        }
        out
    }

    /// What [`Warnings::encode`] wrote, checked again as upstream's
    /// headers are.
    pub fn decode(bytes: &[u8]) -> Warnings {
        Self::collect(bytes.split(|b| *b == b'\n').filter(|line| !line.is_empty()))
    }
}

fn trim(value: &[u8]) -> &[u8] {
    let start = value.iter().position(|b| !matches!(b, b' ' | b'\t')).unwrap_or(value.len());
    let end = value.iter().rposition(|b| !matches!(b, b' ' | b'\t')).map_or(start, |i| i + 1);
    &value[start..end]
}

/// `299 - "<quoted text>"` and nothing else: the text made of qdtext and
/// quoted-pairs (RFC 7230 §3.2.6), no warn-date after it.
fn is_registry_warning(value: &[u8]) -> bool {
    let Some(rest) = value.strip_prefix(b"299 - ") else { return false };
    let rest = trim(rest);
    let [b'"', text @ .., b'"'] = rest else { return false };
    let mut i = 0;
    while i < text.len() {
        match text[i] {
            b'\\' => match text.get(i + 1) {
                Some(&c) if c == b'\t' || c == b' ' || (0x21..=0x7e).contains(&c) || c >= 0x80 => i += 2,
                _ => return false,
            },
            c if is_qdtext(c) => i += 1,
            _ => return false,
        }
    }
    true
}

/// qdtext = HTAB / SP / %x21 / %x23-5B / %x5D-7E / obs-text
fn is_qdtext(c: u8) -> bool {
    matches!(c, b'\t' | b' ' | 0x21 | 0x23..=0x5b | 0x5d..=0x7e | 0x80..=0xff)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(WARNING, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn texts(w: &Warnings) -> Vec<&str> {
        w.iter().map(|v| v.to_str().unwrap()).collect()
    }

    #[test]
    fn registry_warnings_are_kept_in_order_once_each() {
        let w = Warnings::from_headers(&headers(&[
            r#"299 - "This image is deprecated and will be removed soon.""#,
            r#"299 - "Your auth token will expire in 30 seconds.""#,
            r#"299 - "This image is deprecated and will be removed soon.""#,
            r#"  299 - "quoted \"pair\" and \\ backslash"  "#,
        ]));
        assert_eq!(
            texts(&w),
            [
                r#"299 - "This image is deprecated and will be removed soon.""#,
                r#"299 - "Your auth token will expire in 30 seconds.""#,
                r#"299 - "quoted \"pair\" and \\ backslash""#,
            ]
        );
        assert_eq!(Warnings::decode(&w.encode()), w, "what the index keeps reads back the same");
    }

    #[test]
    fn other_forms_are_not_registry_warnings() {
        for v in [
            r#"110 - "Response is Stale""#,
            r#"299 registry.example "agent is not -""#,
            r#"299 - "with a date" "Sat, 25 Aug 2012 23:34:45 GMT""#,
            r#"299 - "a", 299 - "b""#,
            r#"299 - unquoted"#,
            r#"299 - "unterminated"#,
            r#"299 - "bad \"#,
            "299 -  ",
            "",
        ] {
            assert!(Warnings::from_headers(&headers(&[v])).is_empty(), "{v:?}");
        }
        assert!(Warnings::from_headers(&HeaderMap::new()).is_empty());
    }

    #[test]
    fn at_most_a_few_and_4096_bytes_combined() {
        let many: Vec<String> = (0..20).map(|i| format!(r#"299 - "warning {i}""#)).collect();
        let w = Warnings::from_headers(&headers(&many.iter().map(String::as_str).collect::<Vec<_>>()));
        assert_eq!(w.iter().count(), MAX_WARNINGS);
        assert_eq!(texts(&w)[0], r#"299 - "warning 0""#, "the first ones are kept");

        let long = format!(r#"299 - "{}""#, "x".repeat(3000));
        let too_long = format!(r#"299 - "{}""#, "y".repeat(MAX_WARNING_BYTES));
        let w = Warnings::from_headers(&headers(&[&too_long, &long, &long.replace('x', "z"), r#"299 - "short""#]));
        assert_eq!(texts(&w), [long.as_str(), r#"299 - "short""#], "each kept one fits in what is left");
        assert!(w.byte_len() <= MAX_WARNING_BYTES);
    }
}
