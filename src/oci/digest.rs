//! Content digests (`sha256:<64 hex>`), the keys of the content store.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

/// A validated `sha256` digest. Other algorithms are refused at the edge:
/// every registry larder fronts uses sha256, and the store is keyed by it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; 32]);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigestError {
    #[error("digest must have the form <algorithm>:<encoded>")]
    Malformed,
    #[error("digest algorithm {0:?} is not supported (only sha256)")]
    UnsupportedAlgorithm(String),
    #[error("sha256 digest must be 64 lowercase hex characters")]
    BadHex,
}

impl Digest {
    /// Digest of a complete byte slice.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(Sha256::digest(bytes).into())
    }

    /// The 64 lowercase hex characters without the algorithm prefix,
    /// encoded on the stack (a digest is formatted on every request).
    pub fn hex(&self) -> Hex {
        let mut out = [0u8; 64];
        hex::encode_to_slice(self.0, &mut out).expect("64 bytes hold 32 bytes in hex");
        Hex(out)
    }
}

/// A digest's hex text, without an allocation.
#[derive(Clone, Copy)]
pub struct Hex([u8; 64]);

impl Hex {
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits are ASCII")
    }
}

impl std::ops::Deref for Hex {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl FromStr for Digest {
    type Err = DigestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (algorithm, encoded) = s.split_once(':').ok_or(DigestError::Malformed)?;
        // OCI grammar: algorithm-component ([a-z0-9]+) joined by [+._-].
        let algorithm_ok = !algorithm.is_empty()
            && algorithm
                .split(['+', '.', '_', '-'])
                .all(|c| !c.is_empty() && c.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()));
        if !algorithm_ok || encoded.is_empty() {
            return Err(DigestError::Malformed);
        }
        if algorithm != "sha256" {
            return Err(DigestError::UnsupportedAlgorithm(algorithm.to_owned()));
        }
        if encoded.len() != 64 || !encoded.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(DigestError::BadHex);
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(encoded, &mut out).map_err(|_| DigestError::BadHex)?;
        Ok(Digest(out))
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("sha256:")?;
        f.write_str(&self.hex())
    }
}

/// In JSON (descriptors), a digest is its `sha256:<hex>` string.
impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Digest, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Incremental hashing of a stream, compared against the expected digest at
/// the end. Each byte is hashed exactly once, as it passes through.
#[derive(Default)]
pub struct Hasher(Sha256);

impl Hasher {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub fn finish(self) -> Digest {
        Digest(self.0.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn parses_and_prints_sha256() {
        let d: Digest = EMPTY.parse().unwrap();
        assert_eq!(d.to_string(), EMPTY);
        assert_eq!(d, Digest::of(b""));
    }

    #[test]
    fn streaming_hash_equals_one_shot() {
        let mut h = Hasher::default();
        h.update(b"hello ");
        h.update(b"world");
        assert_eq!(h.finish(), Digest::of(b"hello world"));
    }

    #[test]
    fn rejects_bad_digests() {
        assert_eq!("sha256:totallywrong".parse::<Digest>(), Err(DigestError::BadHex));
        assert_eq!("sha256".parse::<Digest>(), Err(DigestError::Malformed));
        assert_eq!(":abc".parse::<Digest>(), Err(DigestError::Malformed));
        assert_eq!("sha256:".parse::<Digest>(), Err(DigestError::Malformed));
        assert_eq!("sha512:abcd".parse::<Digest>(), Err(DigestError::UnsupportedAlgorithm("sha512".into())));
        let upper = EMPTY.to_uppercase().replace("SHA256", "sha256");
        assert_eq!(upper.parse::<Digest>(), Err(DigestError::BadHex));
        assert_eq!(format!("{EMPTY}0").parse::<Digest>(), Err(DigestError::BadHex));
        assert_eq!("SHA256:00".parse::<Digest>(), Err(DigestError::Malformed));
    }
}
