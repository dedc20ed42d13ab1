//! Just enough of a manifest's JSON to check its media type and find the
//! descriptors it references. The bytes themselves are stored and served
//! exactly as received, never re-serialized.

use serde::Deserialize;

use super::{Digest, MediaType};

/// Largest manifest accepted from upstream (the OCI spec suggests 4 MiB).
pub const MAX_MANIFEST_SIZE: usize = 4 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestRefs {
    /// Config and layers of an image manifest.
    pub blobs: Vec<Digest>,
    /// The `size` each of `blobs` was declared with, where given.
    pub blob_sizes: Vec<Option<u64>>,
    /// Whether `blobs` starts with a config (the rest are layers).
    pub has_config: bool,
    /// Child manifests of an index / manifest list.
    pub manifests: Vec<Digest>,
    /// `os/architecture[/variant]` of each child manifest, where given.
    pub platforms: Vec<Option<String>>,
}

#[derive(Deserialize)]
struct Raw {
    #[serde(rename = "mediaType")]
    media_type: Option<String>,
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
    #[serde(default)]
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct Descriptor {
    digest: String,
    size: Option<u64>,
    platform: Option<Platform>,
}

#[derive(Deserialize)]
struct Platform {
    os: String,
    architecture: String,
    variant: Option<String>,
}

impl Platform {
    fn name(&self) -> String {
        match &self.variant {
            Some(v) => format!("{}/{}/{v}", self.os, self.architecture),
            None => format!("{}/{}", self.os, self.architecture),
        }
    }
}

/// Checks `bytes` against the media type upstream declared and lists its
/// references. The JSON's own `mediaType`, when present, must agree with
/// the declared type; without a declared type, the JSON's must be known.
pub fn inspect(bytes: &[u8], declared: Option<MediaType>) -> Result<(MediaType, ManifestRefs), String> {
    let raw: Raw = serde_json::from_slice(bytes).map_err(|e| format!("manifest is not valid JSON: {e}"))?;
    let embedded = match raw.media_type.as_deref() {
        None => None,
        Some(s) => Some(MediaType::parse(s).ok_or_else(|| format!("unsupported manifest media type {s:?}"))?),
    };
    let media_type = match (declared, embedded) {
        (Some(d), Some(e)) if d != e => {
            return Err(format!("Content-Type {} disagrees with mediaType {}", d.as_str(), e.as_str()));
        }
        (Some(d), _) => d,
        (None, Some(e)) => e,
        (None, None) => return Err("manifest has no known media type".into()),
    };
    let digest = |d: &Descriptor| d.digest.parse::<Digest>().map_err(|e| format!("descriptor {:?}: {e}", d.digest));
    let blobs = raw.config.iter().chain(&raw.layers).map(digest).collect::<Result<_, _>>()?;
    let blob_sizes = raw.config.iter().chain(&raw.layers).map(|d| d.size).collect();
    let manifests = raw.manifests.iter().map(digest).collect::<Result<_, _>>()?;
    let platforms = raw.manifests.iter().map(|d| d.platform.as_ref().map(Platform::name)).collect();
    let has_config = raw.config.is_some();
    Ok((media_type, ManifestRefs { blobs, blob_sizes, has_config, manifests, platforms }))
}

impl ManifestRefs {
    /// The layers of an image manifest (its blobs after the config), each
    /// with its declared size where given.
    pub fn layers(&self) -> impl Iterator<Item = (Digest, Option<u64>)> + '_ {
        let skip = usize::from(self.has_config);
        self.blobs.iter().copied().zip(self.blob_sizes.iter().copied()).skip(skip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D1: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
    const D2: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";

    #[test]
    fn image_manifest_references() {
        let json = format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",
               "config":{{"digest":"{D1}","size":1}},"layers":[{{"digest":"{D2}","size":2}}]}}"#
        );
        let (m, refs) = inspect(json.as_bytes(), Some(MediaType::OciManifest)).unwrap();
        assert_eq!(m, MediaType::OciManifest);
        assert_eq!(refs.blobs, vec![D1.parse().unwrap(), D2.parse().unwrap()]);
        assert_eq!(refs.blob_sizes, vec![Some(1), Some(2)]);
        assert_eq!(
            refs.layers().collect::<Vec<_>>(),
            vec![(D2.parse().unwrap(), Some(2))],
            "the config is not a layer"
        );
        assert!(refs.manifests.is_empty());
    }

    #[test]
    fn index_without_embedded_media_type_uses_content_type() {
        let json = format!(
            r#"{{"schemaVersion":2,"manifests":[{{"digest":"{D1}"}},
               {{"digest":"{D2}","platform":{{"os":"linux","architecture":"arm64","variant":"v8"}}}}]}}"#
        );
        let (m, refs) = inspect(json.as_bytes(), Some(MediaType::OciIndex)).unwrap();
        assert_eq!(m, MediaType::OciIndex);
        assert_eq!(refs.manifests, vec![D1.parse().unwrap(), D2.parse().unwrap()]);
        assert_eq!(refs.platforms, vec![None, Some("linux/arm64/v8".to_owned())]);
    }

    #[test]
    fn disagreeing_or_unknown_types_are_refused() {
        let json = r#"{"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}"#;
        assert!(inspect(json.as_bytes(), Some(MediaType::DockerManifest)).is_err());
        assert!(inspect(br#"{"schemaVersion":2}"#, None).is_err());
        assert!(inspect(b"not json", Some(MediaType::OciIndex)).is_err());
        let bad = r#"{"mediaType":"application/vnd.oci.image.manifest.v1+json","layers":[{"digest":"md5:x"}]}"#;
        assert!(inspect(bad.as_bytes(), None).is_err());
    }
}
