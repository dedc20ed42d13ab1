//! Registry response headers, built without parsing or copying per
//! request: static names and values, and a digest's header values encoded
//! straight into the bytes the header keeps.

use bytes::Bytes;
use http::{HeaderName, HeaderValue};

use super::Digest;

pub const DOCKER_CONTENT_DIGEST: HeaderName = HeaderName::from_static("docker-content-digest");
pub const API_VERSION: HeaderName = HeaderName::from_static("docker-distribution-api-version");
pub const API_VERSION_V2: HeaderValue = HeaderValue::from_static("registry/2.0");
/// The `ns` a request was scoped by, echoed (distribution-spec, "Registry
/// Proxying": a registry that uses `ns` SHOULD return it in this header).
pub const OCI_NAMESPACE: HeaderName = HeaderName::from_static("oci-namespace");
/// Upstream's informational warnings (distribution-spec, "Warnings").
pub const WARNING: HeaderName = http::header::WARNING;

impl Digest {
    /// `sha256:<hex>`, for `Docker-Content-Digest`.
    pub fn header_value(&self) -> HeaderValue {
        joined(&["sha256:", &self.hex()])
    }

    /// `"sha256:<hex>"`, a strong `ETag`.
    pub fn etag(&self) -> HeaderValue {
        joined(&["\"sha256:", &self.hex(), "\""])
    }
}

fn joined(parts: &[&str]) -> HeaderValue {
    let mut text = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    parts.iter().for_each(|p| text.push_str(p));
    HeaderValue::from_maybe_shared(Bytes::from(text)).expect("digest text is a valid header value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_headers_carry_the_digest_text() {
        let d = Digest::of(b"hello");
        assert_eq!(d.header_value(), d.to_string().as_str());
        assert_eq!(d.etag(), format!("\"{d}\"").as_str());
        assert_eq!(d.hex().len(), 64);
        assert_eq!(format!("sha256:{}", &*d.hex()), d.to_string());
    }
}
