//! A referrers answer (`GET /v2/<name>/referrers/<digest>`) as the OCI
//! distribution spec has it: an image index of descriptors. larder parses
//! upstream's answer and writes its own, so that whatever else a body holds
//! (an answer from somewhere a redirect led) never reaches a client.
//! Pure functions, no I/O.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Digest, MediaType};

#[derive(Deserialize)]
struct RawIndex {
    #[serde(rename = "schemaVersion")]
    schema_version: u32,
    #[serde(rename = "mediaType")]
    media_type: Option<String>,
    manifests: Vec<Descriptor>,
}

/// The fields of a descriptor a referrers answer carries.
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
}

#[derive(Serialize)]
struct Index<'a> {
    #[serde(rename = "schemaVersion")]
    schema_version: u32,
    #[serde(rename = "mediaType")]
    media_type: &'a str,
    manifests: &'a [Descriptor],
}

/// Upstream's referrers answer, checked and written anew; an error says
/// why it is not an image index.
pub fn reserialize(body: &[u8]) -> Result<Vec<u8>, String> {
    let raw: RawIndex = serde_json::from_slice(body).map_err(|e| format!("not an image index: {e}"))?;
    if raw.schema_version != 2 {
        return Err(format!("schemaVersion {} is not 2", raw.schema_version));
    }
    if let Some(t) = raw.media_type.as_deref().filter(|t| *t != MediaType::OciIndex.as_str()) {
        return Err(format!("mediaType {t:?} is not an OCI image index"));
    }
    let index = Index { schema_version: 2, media_type: MediaType::OciIndex.as_str(), manifests: &raw.manifests };
    serde_json::to_vec(&index).map_err(|e| e.to_string())
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
