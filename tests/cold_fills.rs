//! Cold pulls over a modelled internet link (issue 27): the real origin
//! behind the link shaper of benches/shaper (a throughput cap per
//! connection, a delay before each request's first byte), larder in front.
//!
//! - A large blob comes in parallel ranged parts, each fetched once,
//!   byte-exact, counted exactly in the metrics and the origin's log.
//! - A client range far ahead of the fill gets its part at once, on a
//!   connection of its own, before the parts below it.
//! - A part whose connection breaks resumes from the byte it reached.
//! - An upstream that ignores `Range` is read as one stream, nothing twice;
//!   one that redirects to a CDN gets each part's range asked of the CDN.
//! - Many clients pulling at once still make one fill per blob.
//! - Fills ahead follow a pull, not a look: a manifest (and config) GET
//!   fetches no layer; a client's first layer request starts the other
//!   layers of the image that client resolved, if the image fits the cache.
//! - containerd 2.1's parallel layer fetch (its transfer service with
//!   `concurrent_layer_fetch_buffer`): open-ended 8 MiB ranges of one cold
//!   blob, each read for its chunk and hung up on, get exactly their bytes.

mod common;
mod fake;

use std::collections::BTreeMap;
use std::time::Duration;

use common::metrics::{ADMIN_LISTEN, metric, wait_for_commits};
use common::push::{self, random};
use common::{ImageBuilder, KIB, Larder, LinkModel, MIB, ORIGIN_NAME, Origin, Shaper, Upstream, http, skopeo};

/// `parts::PART_SIZE`: parts end on multiples of it.
const PART: usize = 8 * MIB;

/// 8 MB/s per connection and 20 ms before each first byte: slow enough
/// that parts overlap, fast enough for a test.
const LINK: LinkModel =
    LinkModel { per_connection: Some(8_000_000), first_byte: Duration::from_millis(20), aggregate: None };

/// `larder_<name>{upstream="origin.test"}`.
fn per_upstream(name: &str) -> String {
    format!("larder_{name}{{upstream=\"{ORIGIN_NAME}\"}}")
}

/// larder with the origin (behind `url`) as its default upstream, blobs of
/// 16 MiB or more in parallel parts, and `lines` in the upstream's table.
async fn larder_over(url: &str, lines: &[&str]) -> Larder {
    let upstream = lines.iter().fold(Upstream::new(ORIGIN_NAME, url).default(true), |u, l| u.line(l));
    Larder::builder()
        .upstream(upstream)
        .cache_line(r#"parallel_fill_min = "16MiB""#)
        .server_line(ADMIN_LISTEN)
        .start()
        .await
}

async fn get_manifest(larder: &Larder, repo: &str, reference: &str) {
    let url = format!("{}/v2/{repo}/manifests/{reference}", larder.url());
    let resp = http::manifest_get(&http::client(), &url).send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert_eq!(resp.status(), 200, "GET {url}");
}

async fn get_blob(larder: &Larder, repo: &str, digest: &str, range: Option<&str>) -> (u16, Vec<u8>) {
    let url = format!("{}/v2/{repo}/blobs/{digest}", larder.url());
    let mut request = http::client().get(&url);
    if let Some(range) = range {
        request = request.header("Range", range);
    }
    let resp = request.send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = resp.status().as_u16();
    let body = resp.bytes().await.unwrap_or_else(|e| panic!("reading GET {url}: {e}"));
    (status, body.to_vec())
}

/// The origin's blob GETs after `mark`, as (status, bytes sent), sorted.
async fn blob_gets_since(origin: &Origin, mark: &common::LogMark) -> Vec<(u16, u64)> {
    let log = origin.requests_since(mark).await;
    let mut gets: Vec<(u16, u64)> =
        log.blob_get_entries().iter().map(|e| (e.status, e.bytes.unwrap_or_default())).collect();
    gets.sort();
    gets
}

/// Waits until `n` fills ahead of the client have started.
async fn wait_for_fills_ahead(larder: &Larder, n: f64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while metric(larder, r#"larder_fills_total{reason="ahead"}"#).await < n {
        assert!(tokio::time::Instant::now() < deadline, "the fills ahead never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_large_blob_comes_in_parallel_ranged_parts_each_fetched_once() {
    let origin = Origin::start().await;
    let size = 2 * PART + PART / 2 + 123;
    let image = push::image(&origin, "team/big", "v1", vec![random(size)]).await;
    let layer = &image.layers[0];
    let link = Shaper::start(&origin.host_port(), LINK);
    let larder = larder_over(&link.url(), &["fill_ahead = false"]).await;

    // The manifest declares the layer's size: large enough for parts.
    get_manifest(&larder, "team/big", "v1").await;
    let mark = origin.log_mark().await;
    let (status, body) = get_blob(&larder, "team/big", &layer.digest, None).await;
    assert_eq!(status, 200);
    assert!(body == layer.bytes, "the blob arrives byte for byte");
    wait_for_commits(&larder).await;

    let half = (PART / 2 + 123) as u64;
    assert_eq!(
        blob_gets_since(&origin, &mark).await,
        vec![(206, half), (206, PART as u64), (206, PART as u64)],
        "three ranged GETs, one per part, none repeated"
    );
    assert_eq!(metric(&larder, &per_upstream("fill_parts_total")).await, 3.0);
    assert_eq!(metric(&larder, &per_upstream("fill_part_bytes_total")).await, size as f64);
    assert_eq!(metric(&larder, &per_upstream("upstream_bytes_total")).await, size as f64, "no byte twice");
    assert_eq!(metric(&larder, &per_upstream("fill_part_resumes_total")).await, 0.0);
    assert_eq!(metric(&larder, r#"larder_fills_total{reason="client"}"#).await, 1.0);

    let (_, again) = get_blob(&larder, "team/big", &layer.digest, None).await;
    assert!(again == layer.bytes, "what was committed is the blob");
    assert!(blob_gets_since(&origin, &mark).await.len() == 3, "the second pull is warm");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_range_far_ahead_of_the_fill_is_fetched_at_once_on_a_connection_of_its_own() {
    let origin = Origin::start().await;
    let size = 5 * PART;
    let image = push::image(&origin, "team/lazy", "v1", vec![random(size)]).await;
    let layer = &image.layers[0];
    // 4 MB/s per connection: each 8 MiB part takes two seconds.
    let slow = LinkModel { per_connection: Some(4_000_000), ..LINK };
    let link = Shaper::start(&origin.host_port(), slow);
    let larder = larder_over(&link.url(), &["fill_ahead = false", "fill_connections = 2"]).await;
    get_manifest(&larder, "team/lazy", "v1").await;
    let mark = origin.log_mark().await;

    // A whole-blob client starts the fill: parts 0 and 1 run.
    let url = format!("{}/v2/team/lazy/blobs/{}", larder.url(), layer.digest);
    let mut whole = http::client().get(&url).send().await.expect("GET the whole blob");
    let first = whole.chunk().await.expect("the first bytes").expect("a chunk");
    assert!(!first.is_empty());

    // A lazy-pull client wants half a MiB near the end (in part 4).
    let start = 4 * PART + 1000;
    let end = start + 512 * KIB;
    let (status, far) =
        get_blob(&larder, "team/lazy", &layer.digest, Some(&format!("bytes={start}-{}", end - 1))).await;
    assert_eq!(status, 206);
    assert!(far == layer.bytes[start..end], "the far range, byte for byte");
    assert_eq!(
        metric(&larder, &per_upstream("fill_parts_total")).await,
        3.0,
        "served from a part of its own, started before parts 2 and 3 (which wait for a free connection)"
    );

    let mut got = first.to_vec();
    while let Some(chunk) = whole.chunk().await.expect("the rest of the blob") {
        got.extend_from_slice(&chunk);
    }
    assert!(got == layer.bytes, "the whole blob, byte for byte");
    wait_for_commits(&larder).await;
    // [0,8) [8,16) background; [32+,40) for the far range; then [16,24)
    // [24,32) and what the far range left of [32,40).
    let gets = blob_gets_since(&origin, &mark).await;
    assert_eq!(gets.len(), 6, "{gets:?}");
    assert!(gets.iter().all(|(status, _)| *status == 206), "{gets:?}");
    assert_eq!(gets.iter().map(|(_, b)| b).sum::<u64>(), size as u64, "no byte twice: {gets:?}");
    assert_eq!(metric(&larder, &per_upstream("fill_part_bytes_total")).await, size as f64);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_part_whose_connection_breaks_resumes_from_the_byte_it_reached() {
    let origin = Origin::start().await;
    let size = 2 * PART + 5000;
    let image = push::image(&origin, "team/cut", "v1", vec![random(size)]).await;
    let layer = &image.layers[0];
    let link = Shaper::start(&origin.host_port(), LinkModel { per_connection: Some(16_000_000), ..LINK });
    let larder = larder_over(&link.url(), &["fill_ahead = false"]).await;
    get_manifest(&larder, "team/cut", "v1").await;

    link.cut_once_after(3 * MIB as u64);
    let (status, body) = get_blob(&larder, "team/cut", &layer.digest, None).await;
    assert_eq!(status, 200);
    assert!(body == layer.bytes, "the client never saw the break: the blob, byte for byte");
    wait_for_commits(&larder).await;

    assert_eq!(link.cuts(), 1, "one connection was cut mid-part");
    assert_eq!(metric(&larder, &per_upstream("fill_part_resumes_total")).await, 1.0);
    assert_eq!(metric(&larder, &per_upstream("fill_parts_total")).await, 3.0);
    assert_eq!(
        metric(&larder, &per_upstream("fill_part_bytes_total")).await,
        size as f64,
        "the resume asked only for what the broken GET had not brought"
    );
    assert_eq!(metric(&larder, &per_upstream("upstream_bytes_total")).await, size as f64);
    let (_, again) = get_blob(&larder, "team/cut", &layer.digest, None).await;
    assert!(again == layer.bytes, "the committed blob is the blob");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_ignores_range_is_read_as_one_stream_without_refetching() {
    let (blob, d, up) = one_layer_v1(27);
    let up = up.start().await;
    let larder = larder_over(&up.url(), &["fill_ahead = false"]).await;
    get_manifest(&larder, fake::REPO, "v1").await;

    let (status, body) = get_blob(&larder, fake::REPO, &d, None).await;
    assert_eq!(status, 200);
    assert!(body == blob, "the blob, byte for byte");
    wait_for_commits(&larder).await;
    assert_eq!(up.blob_gets(&d), 1, "the 200 to the first ranged GET was read to its end");
    assert_eq!(up.ranged_requests(), 1, "only the first part was asked for by range");
    assert_eq!(up.bytes_sent(&d), blob.len() as u64, "nothing fetched twice");
    assert_eq!(metric(&larder, &per_upstream("fill_parts_total")).await, 0.0, "no parts");
    assert_eq!(metric(&larder, &per_upstream("upstream_bytes_total")).await, blob.len() as f64);
}

#[tokio::test(flavor = "multi_thread")]
async fn parts_follow_the_redirect_to_a_cdn_that_answers_ranges() {
    let (blob, d, up) = one_layer_v1(29);
    let up = up.redirect(&format!("/cdn/{d}")).start().await;
    let larder = larder_over(&up.url(), &["fill_ahead = false"]).await;
    get_manifest(&larder, fake::REPO, "v1").await;

    let (status, body) = get_blob(&larder, fake::REPO, &d, None).await;
    assert_eq!(status, 200);
    assert!(body == blob, "the blob, byte for byte");
    wait_for_commits(&larder).await;
    let mut cdn_ranges: Vec<String> =
        up.log().into_iter().filter(|r| r.path == format!("/cdn/{d}")).filter_map(|r| r.range).collect();
    cdn_ranges.sort();
    let (p, end) = (PART, 2 * PART + 7);
    let mut parts =
        vec![format!("bytes=0-{}", p - 1), format!("bytes={p}-{}", 2 * p - 1), format!("bytes={}-{}", 2 * p, end - 1)];
    parts.sort();
    assert_eq!(cdn_ranges, parts, "each part asked of the CDN by range, once");
    assert_eq!(up.blob_gets(&d), 3, "one GET of the registry per part, each redirected");
    assert_eq!(metric(&larder, &per_upstream("fill_parts_total")).await, 3.0);
    assert_eq!(metric(&larder, &per_upstream("fill_part_bytes_total")).await, blob.len() as f64);
    assert_eq!(metric(&larder, &per_upstream("upstream_bytes_total")).await, blob.len() as f64);
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_cold_pulls_make_one_fill_per_blob_and_one_get_per_part() {
    const CLIENTS: usize = 8;
    let origin = Origin::start().await;
    let image =
        ImageBuilder::oci().layers(&[2 * PART + PART / 4, 96 * KIB, 160 * KIB]).push(&origin, "team/herd", "v1").await;
    let link = Shaper::start(&origin.host_port(), LINK);
    // Fills ahead on, as shipped: the first layer asked for starts the others.
    let larder = larder_over(&link.url(), &[]).await;

    let mark = origin.log_mark().await;
    let source = larder.image_ref("team/herd:v1");
    let pulls: Vec<_> = (0..CLIENTS).map(|_| skopeo::pull(&source, false)).collect();
    for (i, pulled) in futures_util::future::join_all(pulls).await.into_iter().enumerate() {
        let pulled = pulled.unwrap_or_else(|e| panic!("pull {i} failed: {e}\nlarder log:\n{}", larder.log()));
        assert_eq!(pulled.manifest_digest, image.digest, "pull {i}");
        assert_eq!(pulled.blob_digests(), image.blob_digests(), "pull {i}");
    }
    wait_for_commits(&larder).await;

    let seen = origin.requests_since(&mark).await;
    let mut per_blob: BTreeMap<String, Vec<u16>> = BTreeMap::new();
    for entry in seen.blob_get_entries() {
        let digest = entry.path().rsplit('/').next().unwrap_or_default().to_owned();
        per_blob.entry(digest).or_default().push(entry.status);
    }
    let expected: BTreeMap<String, Vec<u16>> = image
        .blobs()
        .into_iter()
        .map(|b| {
            let parts = b.size.div_ceil(PART as u64) as usize;
            let statuses = if b.size >= 16 * MIB as u64 { vec![206; parts] } else { vec![200] };
            (b.digest, statuses)
        })
        .collect();
    assert_eq!(per_blob, expected, "one GET per part of the large layer, one GET per other blob");
    assert_eq!(seen.manifest_requests().len(), 1, "one manifest fetch for {CLIENTS} clients");
    let fills = metric(&larder, r#"larder_fills_total{reason="ahead"}"#).await
        + metric(&larder, r#"larder_fills_total{reason="client"}"#).await;
    assert_eq!(fills, image.blobs().len() as f64, "exactly one fill per blob");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_look_at_an_image_costs_only_what_was_looked_at() {
    // skopeo inspect, Renovate, crane manifest: manifests (and the config),
    // never the layers. Before issue 31 one manifest GET fetched the image.
    let origin = Origin::start().await;
    let image = push::image(&origin, "team/look", "v1", vec![random(3 * MIB), random(2 * MIB)]).await;
    let larder = larder_over(&origin.url(), &[]).await;
    let mark = origin.log_mark().await;

    skopeo::inspect(&larder.image_ref("team/look:v1")).await.expect("skopeo inspect");
    for _ in 0..3 {
        get_manifest(&larder, "team/look", "v1").await;
    }
    get_manifest(&larder, "team/look", &image.digest).await;
    let (status, body) = get_blob(&larder, "team/look", &image.config.digest, None).await;
    assert_eq!((status, body == image.config.bytes), (200, true));
    // Nothing to wait for: give a wrongly started fill time to show.
    tokio::time::sleep(Duration::from_millis(500)).await;
    wait_for_commits(&larder).await;

    let config = image.config.bytes.len() as u64;
    assert_eq!(blob_gets_since(&origin, &mark).await, vec![(200, config)], "the config, once: no layer");
    assert_eq!(metric(&larder, &per_upstream("upstream_bytes_total")).await, config as f64);
    assert_eq!(metric(&larder, r#"larder_fills_total{reason="ahead"}"#).await, 0.0);
}

/// An HTTP client whose connections come from `address` (a loopback
/// address: larder tells clients apart by theirs).
fn client_from(address: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .local_address(address.parse::<std::net::IpAddr>().unwrap())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

async fn get_from(client: &reqwest::Client, url: &str, manifest: bool) -> Vec<u8> {
    let request = if manifest { http::manifest_get(client, url) } else { client.get(url) };
    let resp = request.send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert_eq!(resp.status(), 200, "GET {url}");
    resp.bytes().await.unwrap().to_vec()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_first_layer_a_client_asks_for_starts_the_other_layers_of_the_image_it_resolved() {
    let origin = Origin::start().await;
    let image =
        push::image(&origin, "team/ahead", "v1", vec![random(300 * KIB), random(200 * KIB), random(100 * KIB)]).await;
    let larder = larder_over(&origin.url(), &[]).await;
    let (a, b) = (client_from("127.0.0.1"), client_from("127.0.0.2"));
    let blob_url = |d: &str| format!("{}/v2/team/ahead/blobs/{d}", larder.url());
    let mark = origin.log_mark().await;

    // Client A resolves the image; client B, which did not, asks for its
    // first layer: that starts nothing beyond B's own layer.
    get_from(&a, &format!("{}/v2/team/ahead/manifests/v1", larder.url()), true).await;
    assert!(get_from(&b, &blob_url(&image.layers[0].digest), false).await == image.layers[0].bytes);
    tokio::time::sleep(Duration::from_millis(500)).await;
    wait_for_commits(&larder).await;
    assert_eq!(metric(&larder, r#"larder_fills_total{reason="ahead"}"#).await, 0.0, "B resolved no image");
    assert_eq!(blob_gets_since(&origin, &mark).await.len(), 1, "B's layer only");

    // A asks for its second layer: the image's other layers start ahead
    // (the first is cached already), and A finds them fetched.
    assert!(get_from(&a, &blob_url(&image.layers[1].digest), false).await == image.layers[1].bytes);
    wait_for_fills_ahead(&larder, 1.0).await;
    wait_for_commits(&larder).await;
    let mut sizes: Vec<u64> = blob_gets_since(&origin, &mark).await.iter().map(|(_, bytes)| *bytes).collect();
    sizes.sort();
    assert_eq!(sizes, vec![100 * KIB as u64, 200 * KIB as u64, 300 * KIB as u64], "each layer once, no config");
    assert!(get_from(&a, &blob_url(&image.layers[2].digest), false).await == image.layers[2].bytes);
    assert_eq!(blob_gets_since(&origin, &mark).await.len(), 3, "A found its last layer fetched");
    // The pull caused that download: its first ask is a miss, not a hit.
    let misses = metric(&larder, r#"larder_cache_requests_total{kind="blob",result="miss"}"#).await;
    assert_eq!(misses, 3.0);

    // A's further requests start nothing again (once per resolved image).
    get_from(&a, &blob_url(&image.layers[0].digest), false).await;
    assert_eq!(metric(&larder, r#"larder_fills_total{reason="ahead"}"#).await, 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_image_that_does_not_fit_under_the_low_watermark_gets_no_fills_ahead() {
    let origin = Origin::start().await;
    // 7.5 MiB of layers; the cache's low watermark is 0.85 × 8 MiB = 6.8 MiB.
    let image = push::image(&origin, "team/huge", "v1", vec![random(4 * MIB), random(7 * MIB / 2)]).await;
    let larder = Larder::builder()
        .upstream(Upstream::new(ORIGIN_NAME, &origin.url()).default(true))
        .max_size("8MiB")
        .cache_line(r#"max_blob_size = "4MiB""#)
        .server_line(ADMIN_LISTEN)
        .start()
        .await;
    let mark = origin.log_mark().await;
    for _ in 0..3 {
        get_manifest(&larder, "team/huge", "v1").await;
    }
    let (status, body) = get_blob(&larder, "team/huge", &image.layers[0].digest, None).await;
    assert_eq!((status, body == image.layers[0].bytes), (200, true));
    tokio::time::sleep(Duration::from_millis(500)).await;
    wait_for_commits(&larder).await;
    assert_eq!(metric(&larder, r#"larder_fills_total{reason="ahead"}"#).await, 0.0);
    assert_eq!(blob_gets_since(&origin, &mark).await, vec![(200, 4 * MIB as u64)], "the layer asked for, once");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_asking_for_a_layer_being_filled_ahead_joins_that_fill() {
    let origin = Origin::start().await;
    let image = push::image(&origin, "team/join", "v1", vec![random(64 * KIB), random(3 * MIB)]).await;
    let layer = &image.layers[1];
    // 1 MB/s: the second layer is still downloading when the client asks.
    let link = Shaper::start(&origin.host_port(), LinkModel { per_connection: Some(1_000_000), ..LINK });
    let larder = larder_over(&link.url(), &[]).await;
    let mark = origin.log_mark().await;

    get_manifest(&larder, "team/join", "v1").await;
    // As skopeo does, the client asks for the layers one at a time: the
    // first starts the second's fill ahead.
    let (status, _) = get_blob(&larder, "team/join", &image.layers[0].digest, None).await;
    assert_eq!(status, 200);
    wait_for_fills_ahead(&larder, 1.0).await;
    let (status, body) = get_blob(&larder, "team/join", &layer.digest, None).await;
    assert_eq!(status, 200);
    assert!(body == layer.bytes);
    wait_for_commits(&larder).await;
    assert_eq!(metric(&larder, "larder_fills_ahead_joined_total").await, 1.0, "the client joined the fill ahead");
    assert_eq!(metric(&larder, r#"larder_fills_total{reason="client"}"#).await, 1.0, "its first layer only");
    let layer_gets = origin
        .requests_since(&mark)
        .await
        .blob_get_entries()
        .iter()
        .filter(|e| e.path().ends_with(&layer.digest))
        .count();
    assert_eq!(layer_gets, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_fill_ahead_off_only_what_clients_ask_for_is_fetched() {
    let origin = Origin::start().await;
    let image = push::image(&origin, "team/quiet", "v1", vec![random(100 * KIB), random(100 * KIB)]).await;
    let larder = larder_over(&origin.url(), &["fill_ahead = false"]).await;
    let mark = origin.log_mark().await;
    get_manifest(&larder, "team/quiet", "v1").await;
    get_blob(&larder, "team/quiet", &image.layers[0].digest, None).await;
    // Nothing to wait for: give a wrongly started fill time to show.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(blob_gets_since(&origin, &mark).await.len(), 1, "only the layer asked for");
    assert_eq!(metric(&larder, r#"larder_fills_total{reason="ahead"}"#).await, 0.0);
}

/// A fake upstream (not started) whose `v1` is a config and one layer of
/// two parts and 7 bytes, random from `seed`: the layer and its digest.
fn one_layer_v1(seed: u64) -> (bytes::Bytes, String, fake::FakeUpstreamBuilder) {
    let blob = fake::random_bytes(2 * PART + 7, seed);
    let config = fake::random_bytes(300, seed + 1);
    let d = fake::digest(&blob);
    let manifest = fake::image_manifest((&fake::digest(&config), config.len()), &[(&d, blob.len())]);
    let up = fake::FakeUpstream::builder()
        .manifest(fake::REPO, "v1", fake::OCI_MANIFEST, manifest)
        .blob(config)
        .blob(blob.clone());
    (blob, d, up)
}

/// A raw HTTP/1.1 response with `headers` (name, value) and `body`.
fn raw_response(status: &str, headers: &[(&str, String)], body: &[u8]) -> Vec<u8> {
    let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n", body.len());
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    out
}

/// A first part answered with other bytes than asked fails the fill, and
/// the client's `502` says what was asked and what came, as an operator
/// writes byte ranges, not in Rust's notation for larder's own types
/// (before: `… bytes Some((100, 8388707, Some(33554432))) to a GET of
/// Span { start: 0, end: Some(8388608) }`).
#[tokio::test]
async fn a_first_part_answered_with_other_bytes_is_a_502_naming_both_ranges() {
    use fake::recorder::Recorder;
    let size = 4 * PART;
    // Two layers that are never sent: only their first parts are asked for.
    let (shifted, unlabelled) = (format!("sha256:{}", "a1".repeat(32)), format!("sha256:{}", "b2".repeat(32)));
    let config = fake::random_bytes(300, 41);
    let manifest =
        fake::image_manifest((&fake::digest(&config), config.len()), &[(&shifted, size), (&unlabelled, size)]);
    let manifest_digest = fake::digest(&manifest);
    let (layer_a, layer_b) = (shifted.clone(), unlabelled.clone());
    let origin = Recorder::routed("127.0.0.1:0".parse().unwrap(), move |line| {
        let path = line.split_whitespace().nth(1).unwrap_or_default();
        if path == "/v2/team/app/manifests/v1" {
            let headers =
                [("Content-Type", fake::OCI_MANIFEST.to_owned()), ("Docker-Content-Digest", manifest_digest.clone())];
            return raw_response("200 OK", &headers, &manifest);
        }
        if path == format!("/v2/team/app/blobs/{layer_a}") {
            // The part asked for is bytes 0-8388607: this is 100 bytes further on.
            let range = format!("bytes 100-{}/{size}", PART + 99);
            return raw_response("206 Partial Content", &[("Content-Range", range)], b"");
        }
        if path == format!("/v2/team/app/blobs/{layer_b}") {
            return raw_response("206 Partial Content", &[], b"");
        }
        raw_response("404 Not Found", &[("Content-Type", "application/json".to_owned())], br#"{"errors":[]}"#)
    })
    .await;

    for (layer, answered) in [
        (&shifted, format!("bytes 100-{}/{size}", PART + 99)),
        (&unlabelled, "a 206 without a valid Content-Range".to_owned()),
    ] {
        // A larder each: after such an answer the upstream's next fills
        // ask for no range.
        let larder = larder_over(&format!("http://{}", origin.addr()), &["fill_ahead = false"]).await;
        get_manifest(&larder, "team/app", "v1").await;
        let resp = http::client().get(format!("{}/v2/team/app/blobs/{layer}", larder.url())).send().await.unwrap();
        assert_eq!(resp.status(), 502);
        let want = serde_json::json!({"errors": [{
            "code": "UNAVAILABLE",
            "message": format!(
                "upstream sent an invalid response: upstream answered {answered} to a GET of bytes 0-{}",
                PART - 1
            ),
            "detail": null,
        }]});
        let body: serde_json::Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
        assert_eq!(body, want);
    }
}

/// containerd 2.1+ with `concurrent_layer_fetch_buffer = 8388608` under
/// `plugins."io.containerd.transfer.v1.local"` (core/remotes/docker/
/// fetcher.go, `dockerFetcher.open`, v2.1.0): the first GET carries
/// `Range: bytes=0-` (`setOffset` always sets it) and gives the length;
/// then up to `max_concurrent_downloads` (3 by default) requests at once,
/// chunk `i` asked as `Range: bytes=<i * 8 MiB>-` (open-ended), each read
/// for exactly its chunk (`io.LimitReader`) and then closed, chunk 0 from
/// the first response. larder's parts end on the same 8 MiB boundaries.
#[tokio::test(flavor = "multi_thread")]
async fn containerd_2_1_parallel_layer_fetch_gets_each_8_mib_range_exactly() {
    const CHUNK: usize = PART; // concurrent_layer_fetch_buffer
    const PARALLELISM: usize = 3; // max_concurrent_downloads
    let origin = Origin::start().await;
    let size = 4 * CHUNK + CHUNK / 2 + 77;
    let image = push::image(&origin, "team/parallel", "v1", vec![random(size)]).await;
    let layer = image.layers[0].clone();
    let link = Shaper::start(&origin.host_port(), LINK);
    // Fills ahead on, as shipped.
    let larder = larder_over(&link.url(), &[]).await;
    let addr: std::net::SocketAddr = larder.host_port().parse().expect("larder's address");
    let path = format!("/v2/team/parallel/blobs/{}", layer.digest);

    // containerd resolves the tag and reads the manifest first.
    get_manifest(&larder, "team/parallel", "v1").await;
    let mark = origin.log_mark().await;
    let first = fake::client::open_with(addr, &path, &[("Range", "bytes=0-")]).await;
    assert_eq!(first.status(), 206, "bytes=0- is a range like any other");
    assert_eq!(first.header("content-range"), Some(format!("bytes 0-{}/{size}", size - 1).as_str()));
    assert_eq!(first.head().content_length(), Some(size as u64), "the length containerd cuts its chunks from");
    let chunks = size.div_ceil(CHUNK);
    let first = std::sync::Arc::new(tokio::sync::Mutex::new(Some(first)));
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let workers = (0..PARALLELISM).map(|_| {
        let (first, next, path) = (first.clone(), next.clone(), path.clone());
        tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= chunks {
                    return got;
                }
                let offset = i * CHUNK;
                let reused = if i == 0 { first.lock().await.take() } else { None };
                let mut resp = match reused {
                    Some(resp) => resp,
                    None => fake::client::open_with(addr, &path, &[("Range", &format!("bytes={offset}-"))]).await,
                };
                let head =
                    (resp.status(), resp.header("content-range").map(str::to_owned), resp.head().content_length());
                let bytes = resp.read_exact(CHUNK.min(size - offset)).await;
                drop(resp); // hung up on before the end, as io.LimitReader and Close do
                got.push((i, head, bytes));
            }
        })
    });
    let mut received = Vec::new();
    for worker in futures_util::future::join_all(workers).await {
        received.extend(worker.expect("a chunk worker"));
    }
    received.sort_by_key(|(i, _, _)| *i);
    assert_eq!(received.len(), chunks);
    for (i, (status, content_range, content_length), bytes) in received {
        let offset = i * CHUNK;
        let expected_range = format!("bytes {offset}-{}/{size}", size - 1);
        assert_eq!(
            (status, content_range.as_deref(), content_length),
            (206, Some(expected_range.as_str()), Some((size - offset) as u64)),
            "chunk {i}"
        );
        let end = (offset + CHUNK).min(size);
        assert!(bytes == layer.bytes[offset..end], "chunk {i}: exactly bytes {offset}..{end} of the layer");
    }
    wait_for_commits(&larder).await;

    // One ranged GET per 8 MiB part upstream, no byte twice, whatever the
    // clients hung up on.
    let seen = origin.requests_since(&mark).await;
    let gets: Vec<(u16, u64)> = seen
        .blob_get_entries()
        .iter()
        .filter(|e| e.path().ends_with(&layer.digest))
        .map(|e| (e.status, e.bytes.unwrap_or_default()))
        .collect();
    assert_eq!(gets.len(), chunks, "one upstream GET per part: {gets:?}");
    assert!(gets.iter().all(|(status, _)| *status == 206), "{gets:?}");
    assert_eq!(gets.iter().map(|(_, b)| b).sum::<u64>(), size as u64, "no byte twice: {gets:?}");
    let (status, again) = get_blob(&larder, "team/parallel", &layer.digest, None).await;
    assert!(status == 200 && again == layer.bytes, "the committed blob is the layer");
    let after = origin.requests_since(&mark).await;
    assert_eq!(after.blob_get_entries().iter().filter(|e| e.path().ends_with(&layer.digest)).count(), chunks, "warm");
}
