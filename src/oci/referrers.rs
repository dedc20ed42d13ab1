//! A referrers answer (`GET /v2/<name>/referrers/<digest>`) as the OCI
//! distribution spec has it: an image index of descriptors. larder parses
//! upstream's answer and writes its own, so that whatever else a body holds
//! (an answer from somewhere a redirect led) never reaches a client.
//! Pure functions, no I/O.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Digest, MediaType};

/// An image index as a referrers answer carries it.
#[derive(Deserialize, Serialize)]
pub struct ReferrersIndex {
    #[serde(rename = "schemaVersion")]
    schema_version: u32,
    #[serde(rename = "mediaType", default, skip_deserializing)]
    media_type: IndexMediaType,
    manifests: Vec<Descriptor>,
    #[serde(skip_serializing_if = "Option::is_none")]
    annotations: Option<BTreeMap<String, String>>,
}

/// Always the OCI image index's media type when written.
#[derive(Default)]
struct IndexMediaType;

impl Serialize for IndexMediaType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(MediaType::OciIndex.as_str())
    }
}

/// The fields of a descriptor a referrers answer carries (an image
/// manifest's `platform` included, as an image index may have it).
#[derive(Deserialize, Serialize)]
struct Descriptor {
    #[serde(rename = "mediaType")]
    media_type: String,
    #[serde(rename = "artifactType", skip_serializing_if = "Option::is_none")]
    artifact_type: Option<String>,
    digest: Digest,
    size: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    annotations: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    platform: Option<Platform>,
}

#[derive(Deserialize, Serialize)]
struct Platform {
    architecture: String,
    os: String,
    #[serde(rename = "os.version", skip_serializing_if = "Option::is_none")]
    os_version: Option<String>,
    #[serde(rename = "os.features", skip_serializing_if = "Option::is_none")]
    os_features: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    variant: Option<String>,
}

impl ReferrersIndex {
    /// An index with no referrers.
    pub fn empty() -> ReferrersIndex {
        ReferrersIndex { schema_version: 2, media_type: IndexMediaType, manifests: Vec::new(), annotations: None }
    }

    /// The digests of the referrers it lists.
    pub fn digests(&self) -> Vec<Digest> {
        self.manifests.iter().map(|d| d.digest).collect()
    }

    /// Parses an image index; an error says why it is not one.
    pub fn parse(body: &[u8]) -> Result<ReferrersIndex, String> {
        #[derive(Deserialize)]
        struct MediaTypeOnly {
            #[serde(rename = "mediaType")]
            media_type: Option<String>,
        }
        let declared: MediaTypeOnly = serde_json::from_slice(body).map_err(|e| format!("not an image index: {e}"))?;
        if let Some(t) = declared.media_type.as_deref().filter(|t| *t != MediaType::OciIndex.as_str()) {
            return Err(format!("mediaType {t:?} is not an OCI image index"));
        }
        let index: ReferrersIndex = serde_json::from_slice(body).map_err(|e| format!("not an image index: {e}"))?;
        if index.schema_version != 2 {
            return Err(format!("schemaVersion {} is not 2", index.schema_version));
        }
        Ok(index)
    }

    /// Keeps only the referrers of `artifact_type` (the `artifactType`
    /// query filter).
    pub fn filter(&mut self, artifact_type: &str) {
        self.manifests.retain(|d| d.artifact_type.as_deref() == Some(artifact_type));
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("an index of strings and numbers serializes")
    }
}

/// Upstream's referrers answer, checked and written anew; an error says
/// why it is not an image index.
pub fn reserialize(body: &[u8]) -> Result<Vec<u8>, String> {
    Ok(ReferrersIndex::parse(body)?.to_bytes())
}

/// The tag a registry without the referrers API keeps a digest's referrers
/// under (the OCI distribution spec's tag schema): `sha256-<hex>`.
pub fn fallback_tag(digest: &Digest) -> String {
    format!("sha256-{}", digest.hex().as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";

    #[test]
    fn an_index_is_written_anew_with_only_its_descriptors() {
        let body = format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","extra":"dropped",
               "manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{D}","size":7,
               "artifactType":"application/vnd.dev.cosign.simplesigning.v1+json","annotations":{{"a":"b"}},
               "urls":["http://169.254.169.254/"]}}]}}"#
        );
        let out: serde_json::Value = serde_json::from_slice(&reserialize(body.as_bytes()).unwrap()).unwrap();
        assert_eq!(out["mediaType"], "application/vnd.oci.image.index.v1+json");
        assert_eq!(out["manifests"][0]["digest"], D);
        assert_eq!(out["manifests"][0]["size"], 7);
        assert_eq!(out["manifests"][0]["annotations"]["a"], "b");
        assert!(out.get("extra").is_none() && out["manifests"][0].get("urls").is_none(), "{out}");
        let empty = reserialize(br#"{"schemaVersion":2,"manifests":[]}"#).unwrap();
        assert_eq!(
            empty,
            br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}"#
        );
    }

    #[test]
    fn anything_else_is_refused() {
        let metadata = br#"{"Code":"Success","AccessKeyId":"ASIA","SecretAccessKey":"s3cret","Token":"t"}"#;
        for body in [
            &metadata[..],
            b"not json",
            br#"{"schemaVersion":1,"manifests":[]}"#,
            br#"{"schemaVersion":2,"mediaType":"text/html","manifests":[]}"#,
            br#"{"schemaVersion":2,"manifests":[{"mediaType":"x","digest":"md5:0","size":1}]}"#,
            br#"{"schemaVersion":2,"manifests":[{"mediaType":"x","digest":"sha256:00","size":-1}]}"#,
        ] {
            assert!(reserialize(body).is_err(), "{}", String::from_utf8_lossy(body));
        }
    }
}
