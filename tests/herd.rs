//! The thundering herd against the real origin: many clients pull the same
//! cold image at once, and the origin sees each blob and the manifest once.

mod common;

use std::collections::BTreeMap;

use common::{ImageBuilder, KIB, Larder, Origin, skopeo};

/// Concurrent `skopeo copy` pulls (issue 3 asks for 16).
const CLIENTS: usize = 16;

#[tokio::test(flavor = "multi_thread")]
async fn sixteen_concurrent_cold_pulls_make_one_origin_fetch_per_blob_and_manifest() {
    let origin = Origin::start().await;
    let sizes = [96 * KIB, 160 * KIB, 224 * KIB, 288 * KIB, 352 * KIB, 416 * KIB];
    let image = ImageBuilder::oci().layers(&sizes).push(&origin, "team/herd", "v1").await;
    let larder = Larder::builder().upstream(&origin).start().await;

    let mark = origin.log_mark().await;
    let source = larder.image_ref("team/herd:v1");
    let pulls: Vec<_> = (0..CLIENTS).map(|_| skopeo::pull(&source, false)).collect();
    for (i, pulled) in futures_util::future::join_all(pulls).await.into_iter().enumerate() {
        let pulled = pulled.unwrap_or_else(|e| panic!("pull {i} failed: {e}\nlarder log:\n{}", larder.log()));
        assert_eq!(pulled.manifest_digest, image.digest, "pull {i}");
        assert_eq!(pulled.blob_digests(), image.blob_digests(), "pull {i}");
    }

    let seen = origin.requests_since(&mark).await;
    let mut per_blob: BTreeMap<String, usize> = BTreeMap::new();
    for entry in seen.blob_get_entries() {
        *per_blob.entry(entry.path().rsplit('/').next().unwrap_or_default().to_owned()).or_default() += 1;
    }
    let once: BTreeMap<String, usize> = image.blob_digests().into_iter().map(|d| (d, 1)).collect();
    assert_eq!(per_blob, once, "exactly one origin GET per blob (7 blobs: config + 6 layers)");
    let manifests = seen.manifest_requests();
    assert_eq!(manifests.len(), 1, "one origin manifest fetch for {CLIENTS} clients: {manifests:?}");
}
