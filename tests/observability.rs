//! Operability: the metrics move as pulls happen (misses, then hits; each
//! blob's bytes fetched upstream once; coalescing under concurrency), the
//! admin page parses as Prometheus text, and SIGTERM lets a download finish.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::metrics::wait_for_commits;
use common::{ImageBuilder, KIB, Larder, MIB, Origin, Upstream, free_port, http, skopeo};
use sha2::{Digest, Sha256};

/// Concurrent pulls in the coalescing step.
const HERD: usize = 8;

/// `/metrics`, parsed as Prometheus text: samples by "name{sorted labels}".
async fn scrape(admin: &str) -> HashMap<String, f64> {
    let text = http::client().get(format!("{admin}/metrics")).send().await.expect("scrape").text().await.expect("text");
    let scrape =
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("Prometheus text format");
    let mut samples = HashMap::new();
    for s in scrape.samples {
        let mut labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        let value = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => continue,
        };
        samples.insert(format!("{}{{{}}}", s.metric, labels.join(",")), value);
    }
    samples
}

fn get(samples: &HashMap<String, f64>, key: &str) -> f64 {
    samples.get(key).copied().unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_misses_then_hits_and_upstream_bytes_once() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[64 * KIB, 128 * KIB]).push(&origin, "team/app", "v1").await;
    let herd_image = ImageBuilder::oci().layers(&[96 * KIB, 160 * KIB]).push(&origin, "team/herd", "v1").await;
    let admin_port = free_port();
    let admin = format!("http://127.0.0.1:{admin_port}");
    // Only what clients ask for is fetched (no fills ahead, which may have
    // a blob committed before its client asks: a hit), so that the counts
    // below are exact; tests/cold_fills.rs counts the fills ahead.
    let larder = Larder::builder()
        .upstream(Upstream::from(&origin).line("fill_ahead = false"))
        .server_line(&format!("admin_listen = \"127.0.0.1:{admin_port}\""))
        .start()
        .await;
    let blobs = image.blob_digests().len() as f64;
    let image_bytes: u64 = image.blobs().iter().map(|b| b.size).sum();

    // Cold: one miss per blob, and upstream bytes = the image's blob bytes.
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("cold pull");
    // The last blob's commit may still be landing when skopeo is done.
    wait_for_commits(&larder).await;
    let cold = scrape(&admin).await;
    assert_eq!(get(&cold, "larder_cache_requests_total{kind=blob,result=miss}"), blobs);
    assert_eq!(get(&cold, "larder_cache_requests_total{kind=manifest,result=miss}"), 1.0);
    assert_eq!(get(&cold, "larder_upstream_bytes_total{upstream=origin.test}"), image_bytes as f64);
    assert_eq!(get(&cold, "larder_fills_in_flight{}"), 0.0);

    // Warm: hits, and no more upstream bytes.
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("warm pull");
    let warm = scrape(&admin).await;
    assert_eq!(get(&warm, "larder_cache_requests_total{kind=blob,result=hit}"), blobs);
    assert_eq!(get(&warm, "larder_cache_requests_total{kind=manifest,result=hit}"), 1.0);
    assert_eq!(get(&warm, "larder_upstream_bytes_total{upstream=origin.test}"), image_bytes as f64);
    assert!(get(&warm, "larder_bytes_served_total{source=disk}") >= image_bytes as f64);
    assert!(get(&warm, "larder_cache_size_bytes{}") >= image_bytes as f64);

    // A herd on a cold image: exactly one miss per blob; every other blob
    // request was coalesced onto a fill or hit after it.
    let source = larder.image_ref("team/herd:v1");
    let pulls: Vec<_> = (0..HERD).map(|_| skopeo::pull(&source, false)).collect();
    for pulled in futures_util::future::join_all(pulls).await {
        assert_eq!(pulled.expect("herd pull").manifest_digest, herd_image.digest);
    }
    let after = scrape(&admin).await;
    let herd_blobs = herd_image.blob_digests().len() as f64;
    let delta = |key: &str| get(&after, key) - get(&warm, key);
    assert_eq!(delta("larder_cache_requests_total{kind=blob,result=miss}"), herd_blobs);
    assert_eq!(
        delta("larder_cache_requests_total{kind=blob,result=hit}")
            + delta("larder_cache_requests_total{kind=blob,result=coalesced}"),
        herd_blobs * (HERD as f64 - 1.0)
    );
    let herd_bytes: u64 = herd_image.blobs().iter().map(|b| b.size).sum();
    assert_eq!(delta("larder_upstream_bytes_total{upstream=origin.test}"), herd_bytes as f64);
    assert!(get(&after, "larder_requests_total{method=GET,route=blob,status=200}") > 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_a_large_download_finish_then_exits_zero() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[48 * MIB]).push(&origin, "team/big", "v1").await;
    let layer = image.manifests[0].layers[0].clone();
    let mut larder = Larder::builder().upstream(&origin).start().await;

    // Start a download and read it slowly, so that it is in flight at SIGTERM.
    let url = format!("{}/v2/team/big/blobs/{}", larder.url(), layer.digest);
    let mut resp = http::client().get(&url).send().await.expect("blob response");
    assert_eq!(resp.status(), 200);
    let mut hasher = Sha256::new();
    let mut received = 0usize;
    let first = resp.chunk().await.expect("first chunk").expect("some bytes");
    hasher.update(&first);
    received += first.len();

    // SIGTERM: once larder refuses new connections, shutdown has begun, and
    // the download is still far from done.
    larder.send_sigterm();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", larder.port())).await.is_ok() {
        assert!(std::time::Instant::now() < deadline, "larder kept accepting after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!((received as u64) < layer.size, "the download must still be in flight at shutdown");

    while let Some(chunk) = resp.chunk().await.expect("the download completes despite SIGTERM") {
        hasher.update(&chunk);
        received += chunk.len();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(received as u64, layer.size);
    assert_eq!(format!("sha256:{}", hex::encode(hasher.finalize())), layer.digest);

    let status = larder.wait_exit(Duration::from_secs(30)).await;
    let status = status.unwrap_or_else(|| panic!("larder still running 30 s after SIGTERM\n{}", larder.log()));
    assert_eq!(status.code(), Some(0), "exit status after SIGTERM\n{}", larder.log());
    assert!(larder.log().contains("all connections drained"), "{}", larder.log());
    // The blob's commit, which follows its last byte, landed before the exit.
    assert!(larder.blob_file(&layer.digest).exists(), "the blob served during the stop is cached\n{}", larder.log());
}
