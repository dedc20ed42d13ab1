//! Admin operations on the real origin: prefetch warms the cache so the
//! first pull makes no origin blob request; purge forgets a repository so
//! the next pull fetches again.

mod common;

use common::{ImageBuilder, KIB, Larder, ORIGIN_NAME, Origin, free_port, http, skopeo};

async fn post(url: &str) -> (u16, serde_json::Value) {
    let resp = http::client().post(url).send().await.expect("admin listener answers");
    let status = resp.status().as_u16();
    (status, serde_json::from_slice(&resp.bytes().await.expect("body")).expect("JSON"))
}

#[tokio::test(flavor = "multi_thread")]
async fn prefetch_warms_one_platform_and_purge_forgets_a_repository() {
    let origin = Origin::start().await;
    let index = ImageBuilder::oci().multi_arch().layers(&[40 * KIB, 80 * KIB]).push(&origin, "team/multi", "v1").await;
    let single = ImageBuilder::oci().layers(&[64 * KIB]).push(&origin, "team/single", "v1").await;
    let admin_port = free_port();
    let larder = Larder::builder()
        .upstream(&origin)
        .server_line(&format!("admin_listen = \"127.0.0.1:{admin_port}\""))
        .start()
        .await;
    let admin = format!("http://127.0.0.1:{admin_port}");

    // Prefetch only linux/arm64 of the index, through the path-prefix name.
    let (status, summary) =
        post(&format!("{admin}/prefetch?image={ORIGIN_NAME}/team/multi:v1&platform=linux/arm64")).await;
    assert_eq!(status, 200, "{summary}");
    let arm64 = index.manifests.iter().find(|m| m.platform.as_deref() == Some("linux/arm64")).expect("arm64");
    assert_eq!(summary["manifests"], 1);
    assert_eq!(summary["blobs"], arm64.layers.len() + 1, "{summary}");
    assert_eq!(summary["fetched"], summary["blobs"], "all cold before");

    // Prefetch the single-arch image, then pull it: no blob goes upstream.
    let (status, summary) = post(&format!("{admin}/prefetch?image=team/single:v1")).await;
    assert_eq!(status, 200, "{summary}");
    let mark = origin.log_mark().await;
    let pulled = skopeo::pull(&larder.image_ref("team/single:v1"), false).await.expect("pull after prefetch");
    assert_eq!(pulled.manifest_digest, single.digest);
    assert_eq!(origin.requests_since(&mark).await.blob_gets(), 0, "prefetched blobs are served from cache");

    // Purge the repository: its blobs are gone, and the next pull refetches them.
    let (status, purged) = post(&format!("{admin}/purge?upstream={ORIGIN_NAME}&repo=team/single")).await;
    assert_eq!(status, 200, "{purged}");
    assert_eq!(purged["blobs"], single.blob_digests().len(), "{purged}");
    assert_eq!(purged["tags"], 1, "{purged}");
    let mark = origin.log_mark().await;
    let pulled = skopeo::pull(&larder.image_ref("team/single:v1"), false).await.expect("pull after purge");
    assert_eq!(pulled.manifest_digest, single.digest);
    assert_eq!(origin.requests_since(&mark).await.blob_gets(), single.blob_digests().len());

    // Bad requests answer with the OCI envelope.
    let (status, body) = post(&format!("{admin}/purge?upstream=evil.example")).await;
    assert_eq!((status, body["errors"][0]["code"].as_str()), (404, Some("NAME_UNKNOWN")));
    let (status, _) = post(&format!("{admin}/prefetch")).await;
    assert_eq!(status, 400);
}
