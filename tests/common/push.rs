//! Raw uploads to the origin through the registry API (monolithic blob
//! uploads and a manifest `PUT`), for tests that need blobs of exact sizes
//! and contents without building layer tarballs. distribution checks that
//! a manifest's blobs exist, not what they hold.
//!
//! ```ignore
//! let image = push::image(&origin, "team/big", "v1", &[random(40 << 20)]).await;
//! let layer = &image.layers[0];
//! ```

use serde_json::json;

use super::http;
use super::image::{OCI_CONFIG, OCI_MANIFEST};
use super::origin::{Origin, sha256_digest};

/// Layers pushed this way are declared as uncompressed tars.
pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";

/// A blob pushed as-is: its digest and bytes.
#[derive(Clone)]
pub struct RawBlob {
    pub digest: String,
    pub bytes: Vec<u8>,
}

/// An image pushed from raw blobs.
pub struct RawImage {
    /// The manifest's digest.
    pub digest: String,
    pub config: RawBlob,
    pub layers: Vec<RawBlob>,
}

/// `len` random bytes.
pub fn random(len: usize) -> Vec<u8> {
    use rand::RngCore;
    let mut bytes = vec![0u8; len];
    rand::rng().fill_bytes(&mut bytes);
    bytes
}

/// Uploads `bytes` to `repo` in one request; returns the blob.
pub async fn blob(origin: &Origin, repo: &str, bytes: Vec<u8>) -> RawBlob {
    let client = http::client();
    let digest = sha256_digest(&bytes);
    let start = format!("{}/v2/{repo}/blobs/uploads/", origin.url());
    let started = client.post(&start).send().await.unwrap_or_else(|e| panic!("POST {start}: {e}"));
    assert_eq!(started.status(), 202, "POST {start}");
    let location = started.headers()["location"].to_str().expect("an ASCII Location").to_owned();
    let location = if location.starts_with('/') { format!("{}{location}", origin.url()) } else { location.to_owned() };
    let sep = if location.contains('?') { '&' } else { '?' };
    let put = format!("{location}{sep}digest={digest}");
    let done = client
        .put(&put)
        .header("Content-Type", "application/octet-stream")
        .body(bytes.clone())
        .send()
        .await
        .unwrap_or_else(|e| panic!("PUT {put}: {e}"));
    assert_eq!(done.status(), 201, "PUT of blob {digest}");
    RawBlob { digest, bytes }
}

/// Pushes `layers` and a small config, then an OCI manifest naming them
/// (with their exact sizes) as `repo:tag`.
pub async fn image(origin: &Origin, repo: &str, tag: &str, layers: Vec<Vec<u8>>) -> RawImage {
    let config_json = json!({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}});
    let config = blob(origin, repo, config_json.to_string().into_bytes()).await;
    let mut pushed = Vec::new();
    for layer in layers {
        pushed.push(blob(origin, repo, layer).await);
    }
    let descriptors: Vec<_> =
        pushed.iter().map(|l| json!({"mediaType": OCI_LAYER_TAR, "digest": l.digest, "size": l.bytes.len()})).collect();
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config.digest, "size": config.bytes.len()},
        "layers": descriptors,
    })
    .to_string();
    let url = format!("{}/v2/{repo}/manifests/{tag}", origin.url());
    let put = http::client()
        .put(&url)
        .header("Content-Type", OCI_MANIFEST)
        .body(manifest.clone())
        .send()
        .await
        .unwrap_or_else(|e| panic!("PUT {url}: {e}"));
    assert_eq!(put.status(), 201, "PUT {url}: {}", put.text().await.unwrap_or_default());
    RawImage { digest: sha256_digest(manifest.as_bytes()), config, layers: pushed }
}
