//! Admin operations on the real origin: prefetch warms the cache so the
//! first pull makes no origin blob request; purge forgets a repository so
//! the next pull fetches again.

mod common;
mod fake;

use common::admin::generated_token;
use common::{Admin, ImageBuilder, KIB, Larder, ORIGIN_NAME, Origin, Upstream, free_port, http, skopeo};

/// `POST url` with the admin token.
async fn post(url: &str, token: &str) -> (u16, serde_json::Value) {
    let resp = http::client().post(url).bearer_auth(token).send().await.expect("admin listener answers");
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
    // A loopback admin listener without [admin] token_file: larder wrote a token of its own.
    let token = generated_token(&larder);
    let operate = |url: String| {
        let token = token.clone();
        async move { post(&url, &token).await }
    };

    // Prefetch only linux/arm64 of the index, through the path-prefix name.
    let (status, summary) =
        operate(format!("{admin}/prefetch?image={ORIGIN_NAME}/team/multi:v1&platform=linux/arm64")).await;
    assert_eq!(status, 200, "{summary}");
    let arm64 = index.manifests.iter().find(|m| m.platform.as_deref() == Some("linux/arm64")).expect("arm64");
    assert_eq!(summary["manifests"], 1);
    assert_eq!(summary["blobs"], arm64.layers.len() + 1, "{summary}");
    assert_eq!(summary["fetched"], summary["blobs"], "all cold before");

    // Prefetch the single-arch image, then pull it: no blob goes upstream.
    let (status, summary) = operate(format!("{admin}/prefetch?image=team/single:v1")).await;
    assert_eq!(status, 200, "{summary}");
    let mark = origin.log_mark().await;
    let pulled = skopeo::pull(&larder.image_ref("team/single:v1"), false).await.expect("pull after prefetch");
    assert_eq!(pulled.manifest_digest, single.digest);
    assert_eq!(origin.requests_since(&mark).await.blob_gets(), 0, "prefetched blobs are served from cache");

    // Purge the repository: its blobs are gone, and the next pull refetches them.
    let (status, purged) = operate(format!("{admin}/purge?upstream={ORIGIN_NAME}&repo=team/single")).await;
    assert_eq!(status, 200, "{purged}");
    assert_eq!(purged["blobs"], single.blob_digests().len(), "{purged}");
    assert_eq!(purged["tags"], 1, "{purged}");
    let mark = origin.log_mark().await;
    let pulled = skopeo::pull(&larder.image_ref("team/single:v1"), false).await.expect("pull after purge");
    assert_eq!(pulled.manifest_digest, single.digest);
    assert_eq!(origin.requests_since(&mark).await.blob_gets(), single.blob_digests().len());

    // Bad requests answer with the OCI envelope.
    let (status, body) = operate(format!("{admin}/purge?upstream=evil.example")).await;
    assert_eq!((status, body["errors"][0]["code"].as_str()), (404, Some("NAME_UNKNOWN")));
    let (status, _) = operate(format!("{admin}/prefetch")).await;
    assert_eq!(status, 400);
}

/// A prefetch over an origin that trickles its layer (64 KiB every 200 ms,
/// so at least 3 s for 1 MiB) streams its progress: progress lines with
/// part of the bytes done arrive well before the final `done` line. A
/// response buffered until the end would bring them all at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_streamed_prefetch_reports_progress_while_a_slow_origin_sends() {
    use fake::{FakeUpstream, OCI_MANIFEST, REPO, digest, image_manifest, random_bytes};
    use std::time::{Duration, Instant};

    let config = random_bytes(512, 1);
    let layer = random_bytes(fake::MIB, 2);
    let manifest = image_manifest((&digest(&config), config.len()), &[(&digest(&layer), layer.len())]);
    let slow = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, manifest)
        .blob(config)
        .blob(layer.clone())
        .trickle(64 * KIB, Duration::from_millis(200))
        .start()
        .await;
    let (builder, admin) =
        Admin::open(Larder::builder().upstream(Upstream::new("slow.test", &slow.url()).default(true)));
    let larder = builder.start().await;

    let mut resp = http::client()
        .post(format!("{}/prefetch?image={REPO}:v1", admin.url()))
        .bearer_auth(generated_token(&larder))
        .header("Accept", "application/x-ndjson")
        .send()
        .await
        .expect("the admin listener answers");
    assert_eq!(resp.status(), 200);
    let (mut lines, mut pending) = (Vec::<(Instant, serde_json::Value)>::new(), Vec::new());
    while let Some(chunk) = resp.chunk().await.expect("the stream") {
        pending.extend_from_slice(&chunk);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            lines.push((Instant::now(), serde_json::from_slice(&line).expect("a JSON line")));
        }
    }
    let (done_at, done) = lines.last().expect("lines").clone();
    assert_eq!(done["event"], "done", "{done}");
    assert_eq!(done["fetched"], 2, "{done}");
    let partial: Vec<_> = lines
        .iter()
        .filter(|(_, l)| {
            l["event"] == "progress" && l["bytes_done"].as_u64().is_some_and(|b| b > 0 && b < layer.len() as u64)
        })
        .collect();
    let (first_at, first) = partial.first().unwrap_or_else(|| panic!("no partial progress line: {lines:?}"));
    assert_eq!(first["blobs_total"], 2, "{first}");
    assert!(
        done_at.duration_since(*first_at) >= Duration::from_secs(1),
        "progress came {:?} before done",
        done_at - *first_at
    );
}
