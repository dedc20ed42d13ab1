//! The OCI image layout (image-spec `image-layout.md`): what `larder
//! export` writes and `larder import` reads, as skopeo's `oci:DIR` and
//! `oci-archive:FILE` do. A folder (or a tar of one) with an `oci-layout`
//! file, an `index.json` whose `manifests` are the images, and every
//! manifest and blob under `blobs/<alg>/<hex>`.
//!
//! An image's name travels in its descriptor's annotations:
//! `org.opencontainers.image.ref.name` (skopeo writes the tag alone,
//! `oci:DIR:v1` → `v1`; others a whole reference) and
//! `io.containerd.image.name` (containerd's `ctr export`: the whole
//! reference, `docker.io/library/alpine:3.20`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Digest, MediaType};

/// The `oci-layout` file's content.
pub const OCI_LAYOUT: &str = r#"{"imageLayoutVersion":"1.0.0"}"#;
/// The annotation naming an image in a layout's `index.json`.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// containerd's annotation with the whole reference.
pub const CONTAINERD_NAME: &str = "io.containerd.image.name";
/// Media type of a layout's `index.json`.
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
/// Largest `index.json` read (it lists images, not layers).
pub const MAX_INDEX_JSON: u64 = 4 << 20;

/// A layout's `index.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LayoutIndex {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    #[serde(rename = "mediaType", default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    #[serde(default)]
    pub manifests: Vec<Descriptor>,
}

impl Default for LayoutIndex {
    fn default() -> Self {
        LayoutIndex { schema_version: 2, media_type: Some(INDEX_MEDIA_TYPE.to_owned()), manifests: Vec::new() }
    }
}

/// One image of a layout: its top manifest (an image manifest or an index).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Descriptor {
    #[serde(rename = "mediaType")]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// Why a layout cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("index.json: {0}")]
    Index(String),
    #[error("index.json names {digest}, a {media_type:?}: not a manifest media type larder serves")]
    NotAManifest { digest: String, media_type: String },
    #[error("index.json names {0:?}: not a sha256 digest")]
    BadDigest(String),
}

/// An image of a layout, checked: a manifest media type and a digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutImage {
    pub digest: Digest,
    pub media_type: MediaType,
    pub size: u64,
    /// The name it carries, if any (see [`LayoutImage::name`]).
    pub name: Option<String>,
}

impl LayoutIndex {
    /// Parses `index.json`.
    pub fn parse(bytes: &[u8]) -> Result<LayoutIndex, LayoutError> {
        serde_json::from_slice(bytes).map_err(|e| LayoutError::Index(e.to_string()))
    }

    /// The images it lists, each checked.
    pub fn images(&self) -> Result<Vec<LayoutImage>, LayoutError> {
        self.manifests
            .iter()
            .map(|d| {
                let digest = d.digest.parse().map_err(|_| LayoutError::BadDigest(d.digest.clone()))?;
                let media_type = MediaType::parse(&d.media_type).ok_or_else(|| LayoutError::NotAManifest {
                    digest: d.digest.clone(),
                    media_type: d.media_type.clone(),
                })?;
                let name = d.annotations.get(CONTAINERD_NAME).or_else(|| d.annotations.get(REF_NAME)).cloned();
                Ok(LayoutImage { digest, media_type, size: d.size, name })
            })
            .collect()
    }
}

/// What an image's name says: a whole reference (`registry/repo:tag`), or
/// only a tag (skopeo's `oci:DIR:tag`), to be joined with `--as`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageName {
    /// `registry/repo[:tag]` as written.
    Whole {
        name: String,
        tag: Option<String>,
    },
    TagOnly(String),
}

impl ImageName {
    /// Reads an annotation's value: a `/` makes it a whole reference.
    pub fn parse(value: &str) -> ImageName {
        if !value.contains('/') {
            return ImageName::TagOnly(value.to_owned());
        }
        let name = value.split_once('@').map_or(value, |(name, _)| name);
        match name.rsplit_once(':').filter(|(_, tag)| !tag.contains('/')) {
            Some((name, tag)) => ImageName::Whole { name: name.to_owned(), tag: Some(tag.to_owned()) },
            None => ImageName::Whole { name: name.to_owned(), tag: None },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_whole_references_or_tags() {
        assert_eq!(ImageName::parse("v1"), ImageName::TagOnly("v1".into()));
        assert_eq!(
            ImageName::parse("docker.io/library/alpine:3.20"),
            ImageName::Whole { name: "docker.io/library/alpine".into(), tag: Some("3.20".into()) }
        );
        assert_eq!(
            ImageName::parse("registry:5000/team/app"),
            ImageName::Whole { name: "registry:5000/team/app".into(), tag: None }
        );
        let digest = format!("ghcr.io/a/b@sha256:{}", "0".repeat(64));
        assert_eq!(ImageName::parse(&digest), ImageName::Whole { name: "ghcr.io/a/b".into(), tag: None });
    }

    #[test]
    fn an_index_lists_checked_images() {
        let hex = "a".repeat(64);
        let json = format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:{hex}","size":7,"annotations":{{"org.opencontainers.image.ref.name":"v1"}}}}]}}"#
        );
        let images = LayoutIndex::parse(json.as_bytes()).unwrap().images().unwrap();
        assert_eq!(images.len(), 1);
        assert_eq!(images[0].name.as_deref(), Some("v1"));
        assert_eq!(images[0].size, 7);
        let bad = json.replace("image.manifest.v1+json", "image.layer.v1.tar");
        assert!(matches!(LayoutIndex::parse(bad.as_bytes()).unwrap().images(), Err(LayoutError::NotAManifest { .. })));
    }
}
