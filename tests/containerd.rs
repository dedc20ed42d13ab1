//! containerd as a kubelet uses it: a `hosts.toml` mirror with pull and
//! resolve, requests carrying `?ns=<registry>`. larder knows the origin
//! only under the registry's name and has no default upstream, so every
//! request it serves here was routed by `ns`.

mod clients;
mod common;

use std::collections::BTreeMap;

use clients::containerd::Containerd;
use common::{ImageBuilder, KIB, Larder, Origin, Upstream};

/// The image's registry host as containerd sees it: made up, and pinned to
/// 127.0.0.1 where nothing listens on 443, so only the mirror can answer.
const REGISTRY: &str = "made-up.test";

/// Origin blob GETs per digest.
fn gets_per_blob(log: &common::AccessLog) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for entry in log.blob_get_entries() {
        let digest = entry.path().rsplit('/').next().unwrap_or_default().to_owned();
        *counts.entry(digest).or_default() += 1;
    }
    counts
}

#[tokio::test(flavor = "multi_thread")]
async fn containerd_pulls_through_larder_by_ns_and_a_second_node_is_served_from_cache() {
    clients::hosts::pin_to_loopback(&[REGISTRY]);
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[64 * KIB, 256 * KIB]).push(&origin, "team/app", "v1").await;
    let larder = Larder::builder().upstream(Upstream::new(REGISTRY, &origin.url())).start().await;

    // Node 1 pulls cold: each blob comes from the origin exactly once.
    let node1 = Containerd::start();
    node1.mirror(REGISTRY, &larder.url());
    let mark = origin.log_mark().await;
    let reference = format!("{REGISTRY}/team/app:v1");
    node1.pull(&reference, None).unwrap_or_else(|e| panic!("{e}\nlarder log:\n{}", larder.log()));
    assert_eq!(node1.image_digest(&reference), image.digest);
    let cold = origin.requests_since(&mark).await;
    let expected: BTreeMap<String, usize> = image.blob_digests().into_iter().map(|d| (d, 1)).collect();
    assert_eq!(gets_per_blob(&cold), expected, "one origin GET per blob on the cold pull");

    // Node 2 (a fresh containerd) pulls the same image: no blob goes upstream.
    let node2 = Containerd::start();
    node2.mirror(REGISTRY, &larder.url());
    let mark = origin.log_mark().await;
    node2.pull(&reference, None).unwrap_or_else(|e| panic!("{e}\nlarder log:\n{}", larder.log()));
    assert_eq!(node2.image_digest(&reference), image.digest);
    assert_eq!(origin.requests_since(&mark).await.blob_gets(), 0, "warm pull must not fetch blobs upstream");
}

#[tokio::test(flavor = "multi_thread")]
async fn containerd_pulls_one_platform_of_a_multi_arch_index() {
    clients::hosts::pin_to_loopback(&[REGISTRY]);
    let origin = Origin::start().await;
    let index = ImageBuilder::oci().multi_arch().layers(&[32 * KIB, 48 * KIB]).push(&origin, "team/multi", "v1").await;
    let larder = Larder::builder().upstream(Upstream::new(REGISTRY, &origin.url())).start().await;

    let node = Containerd::start();
    node.mirror(REGISTRY, &larder.url());
    let mark = origin.log_mark().await;
    let reference = format!("{REGISTRY}/team/multi:v1");
    node.pull(&reference, Some("linux/arm64")).unwrap_or_else(|e| panic!("{e}\nlarder log:\n{}", larder.log()));
    assert_eq!(node.image_digest(&reference), index.digest, "containerd records the index digest");

    let arm64 = index
        .manifests
        .iter()
        .find(|m| m.platform.as_deref() == Some("linux/arm64"))
        .expect("the index has a linux/arm64 entry");
    let expected: BTreeMap<String, usize> =
        std::iter::once(&arm64.config).chain(&arm64.layers).map(|b| (b.digest.clone(), 1)).collect();
    assert_eq!(
        gets_per_blob(&origin.requests_since(&mark).await),
        expected,
        "only the arm64 config and layers are fetched, each once"
    );
}
