//! Bounded disk: with `max_size = "4MiB"` and images of about 1.5 MiB, each
//! pull past the high watermark (0.95) evicts the least recently used
//! content down to the low watermark (0.85). The blob files on disk stay
//! within `max_size`, evictions are counted, the newest image stays whole,
//! and an evicted image is fetched again on its next pull. A download in
//! flight counts too: room is made before its blob is committed.

mod common;
mod fake;

use std::path::Path;
use std::time::{Duration, Instant};

use common::metrics::{ADMIN_LISTEN, metric, wait_for_commits};
use common::{AccessLog, ImageBuilder, KIB, Larder, Origin, PulledImage, PushedImage, skopeo};

const MAX_SIZE: u64 = 4 << 20;
/// `max_size × high_watermark` (the default 0.95): above it, eviction runs.
const HIGH_WATERMARK: u64 = MAX_SIZE * 95 / 100;
/// `max_size × low_watermark` (the default 0.85): where eviction stops.
const LOW_WATERMARK: u64 = MAX_SIZE * 85 / 100;
/// One layer per image: two images fit under the high watermark, three do not.
const LAYER: usize = 1536 * KIB;
/// `cache.max_blob_size`: above the default (a quarter of `max_size`,
/// 1 MiB), which the layer's declared size no longer raises.
const MAX_BLOB_SIZE: &str = r#"max_blob_size = "2MiB""#;
/// Longest a test waits for the maintenance task to finish evicting.
const EVICTION_PATIENCE: Duration = Duration::from_secs(30);

const EVICTED_BLOBS: &str = r#"larder_cache_evictions_total{kind="blob"}"#;
const EVICTED_MANIFESTS: &str = r#"larder_cache_evictions_total{kind="manifest"}"#;

#[tokio::test]
async fn pulls_past_max_size_evict_the_oldest_images_and_keep_the_newest_whole() {
    let origin = Origin::start().await;
    let mut images = Vec::new();
    for tag in ["v1", "v2", "v3", "v4"] {
        images.push(ImageBuilder::oci().layers(&[LAYER]).push(&origin, "team/app", tag).await);
    }
    let larder = Larder::builder()
        .upstream(&origin)
        .max_size("4MiB")
        .cache_line(MAX_BLOB_SIZE)
        .server_line(ADMIN_LISTEN)
        .start()
        .await;

    for (n, image) in images.iter().enumerate() {
        let pulled = pull_through(&origin, &larder, image).await;
        assert_same_image(&pulled.image, image, "cold pull");
        assert_eq!(pulled.origin_requests.blob_gets(), image.blobs().len(), "{}: cold", image.reference());

        wait_for_eviction(&larder).await;
        let on_disk = bytes_under(&larder.cache_dir().join("blobs"));
        assert!(on_disk <= MAX_SIZE, "after pulling {}: {on_disk} bytes of blobs on disk", image.reference());
        let evicted = metric(&larder, EVICTED_BLOBS).await;
        if n < 2 {
            assert_eq!(evicted, 0.0, "{} images fit", n + 1);
        } else {
            // At least one old layer per image past the second (configs are
            // small and may outlive their layer: eviction frees bytes).
            assert!(evicted >= (n - 1) as f64, "after {} images: {evicted} blobs evicted", n + 1);
            assert!(metric(&larder, EVICTED_MANIFESTS).await >= (n - 1) as f64, "and old manifests");
            let size = metric(&larder, "larder_cache_size_bytes").await as u64;
            assert!(size <= LOW_WATERMARK, "eviction stops at the low watermark; larder_cache_size_bytes = {size}");
        }
    }

    // The newest image is whole: a warm pull asks the origin for no blob.
    let newest = &images[3];
    let pulled = pull_through(&origin, &larder, newest).await;
    assert_same_image(&pulled.image, newest, "warm pull of the newest image");
    assert_eq!(pulled.origin_requests.blob_gets(), 0, "{}", pulled.origin_requests);

    // The oldest was evicted: it is fetched again, with the right content.
    let oldest = &images[0];
    assert!(!blob_file(&larder.cache_dir(), &layer(oldest)).exists(), "the oldest layer was evicted");
    let pulled = pull_through(&origin, &larder, oldest).await;
    assert_same_image(&pulled.image, oldest, "pull of the evicted image");
    assert!(fetched(&pulled.origin_requests, &layer(oldest)), "refetched:\n{}", pulled.origin_requests);
    wait_for_eviction(&larder).await;
    assert!(bytes_under(&larder.cache_dir().join("blobs")) <= MAX_SIZE);
}

#[tokio::test]
async fn the_least_recently_used_image_goes_first_not_the_oldest() {
    let origin = Origin::start().await;
    let first = ImageBuilder::oci().layers(&[LAYER]).push(&origin, "team/app", "first").await;
    let second = ImageBuilder::oci().layers(&[LAYER]).push(&origin, "team/app", "second").await;
    let third = ImageBuilder::oci().layers(&[LAYER]).push(&origin, "team/app", "third").await;
    let larder = Larder::builder()
        .upstream(&origin)
        .max_size("4MiB")
        .cache_line(MAX_BLOB_SIZE)
        .server_line(ADMIN_LISTEN)
        .start()
        .await;

    pull_through(&origin, &larder, &first).await;
    pull_through(&origin, &larder, &second).await;
    // The first image is used again, so the second is now the least recent.
    let warm = pull_through(&origin, &larder, &first).await;
    assert_eq!(warm.origin_requests.blob_gets(), 0, "{}", warm.origin_requests);

    pull_through(&origin, &larder, &third).await;
    wait_for_eviction(&larder).await;
    assert!(metric(&larder, EVICTED_BLOBS).await >= 1.0, "the third image pushed usage past the high watermark");
    let cache_dir = larder.cache_dir();
    assert!(all_cached(&cache_dir, &first), "the recently used first image stays");
    assert!(!blob_file(&cache_dir, &layer(&second)).exists(), "the least recently used layer is evicted");
    assert!(all_cached(&cache_dir, &third), "the newest image stays");

    let pulled = pull_through(&origin, &larder, &first).await;
    assert_same_image(&pulled.image, &first, "pull of the first image");
    assert_eq!(pulled.origin_requests.blob_gets(), 0, "{}", pulled.origin_requests);
    let pulled = pull_through(&origin, &larder, &second).await;
    assert_same_image(&pulled.image, &second, "pull of the evicted second image");
    assert!(fetched(&pulled.origin_requests, &layer(&second)), "refetched:\n{}", pulled.origin_requests);
}

// ---- helpers ----------------------------------------------------------------

struct PullThrough {
    image: PulledImage,
    origin_requests: AccessLog,
}

async fn pull_through(origin: &Origin, larder: &Larder, image: &PushedImage) -> PullThrough {
    let source = larder.image_ref(&image.reference());
    let mark = origin.log_mark().await;
    let pulled =
        skopeo::pull(&source, false).await.unwrap_or_else(|e| panic!("pulling {source} through larder failed: {e}"));
    PullThrough { image: pulled, origin_requests: origin.requests_since(&mark).await }
}

fn assert_same_image(pulled: &PulledImage, image: &PushedImage, step: &str) {
    assert_eq!(pulled.manifest_digest, image.digest, "{step} of {}: manifest digest", image.reference());
    assert_eq!(pulled.blob_digests(), image.blob_digests(), "{step} of {}: blobs", image.reference());
}

/// Where larder keeps a committed blob.
fn blob_file(cache_dir: &Path, digest: &str) -> std::path::PathBuf {
    let hex = digest.strip_prefix("sha256:").unwrap_or_else(|| panic!("not a sha256 digest: {digest}"));
    cache_dir.join("blobs/sha256").join(&hex[..2]).join(hex)
}

fn all_cached(cache_dir: &Path, image: &PushedImage) -> bool {
    image.blob_digests().iter().all(|d| blob_file(cache_dir, d).exists())
}

/// The digest of an image's one layer.
fn layer(image: &PushedImage) -> String {
    image.manifests[0].layers[0].digest.clone()
}

/// Whether the origin served a GET of this blob.
fn fetched(origin_requests: &AccessLog, digest: &str) -> bool {
    origin_requests.blob_get_entries().iter().any(|e| e.path().ends_with(&format!("/blobs/{digest}")))
}

/// Bytes of the regular files under `dir`, recursively.
fn bytes_under(dir: &Path) -> u64 {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
    entries
        .map(|entry| {
            let entry = entry.unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
            let meta = entry.metadata().unwrap_or_else(|e| panic!("cannot stat {}: {e}", entry.path().display()));
            if meta.is_dir() { bytes_under(&entry.path()) } else { meta.len() }
        })
        .sum()
}

/// Waits until the fills of what was pulled have committed (their sizes
/// are counted at the commit, which follows the client's last byte), then
/// until `larder_cache_size_bytes` is at or under the high watermark: no
/// eviction is due, or the due one has finished.
async fn wait_for_eviction(larder: &Larder) {
    wait_for_commits(larder).await;
    let started = Instant::now();
    loop {
        let size = metric(larder, "larder_cache_size_bytes").await as u64;
        if size <= HIGH_WATERMARK {
            return;
        }
        assert!(
            started.elapsed() < EVICTION_PATIENCE,
            "larder_cache_size_bytes is still {size} after {EVICTION_PATIENCE:?}, above the high watermark \
             {HIGH_WATERMARK}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_download_in_flight_makes_room_before_its_blob_is_committed() {
    const MIB: usize = 1 << 20;
    let cached: Vec<bytes::Bytes> = (1..=3).map(|seed| fake::random_bytes(2 * MIB, seed)).collect();
    let big = fake::random_bytes(3 * MIB, 9);
    let mut builder = fake::FakeUpstream::builder();
    for blob in &cached {
        builder = builder.blob(blob.clone());
    }
    let upstream = builder.blob(big.clone()).stall_after(64 * KIB).start().await;
    let larder = Larder::builder()
        .upstream(common::Upstream::new("fake.test", &upstream.url()).default(true))
        .max_size("8MiB")
        .cache_line(r#"max_blob_size = "4MiB""#)
        .server_line(ADMIN_LISTEN)
        .start()
        .await;
    let get = |blob: &bytes::Bytes| format!("{}{}", larder.url(), fake::blob_path(&fake::digest(blob)));
    let client = common::http::client();
    for blob in &cached {
        let body = client.get(get(blob)).send().await.unwrap().bytes().await.unwrap();
        assert!(body == *blob);
    }
    wait_for_commits(&larder).await;
    assert_eq!(metric(&larder, "larder_cache_size_bytes").await, (6 * MIB) as f64, "under the high watermark");

    // 3 MiB more on their way: 9 MiB with the 6 cached, over the high
    // watermark (7.6 MiB). Room is made while the download is in flight
    // (down to the low watermark, 6.8 MiB, counting it), not after.
    let download = tokio::spawn({
        let (client, url) = (client.clone(), get(&big));
        async move { client.get(url).send().await.unwrap().bytes().await }
    });
    let started = Instant::now();
    while metric(&larder, "larder_cache_size_bytes").await > (6.8 * MIB as f64) - (3 * MIB) as f64 {
        assert!(started.elapsed() < EVICTION_PATIENCE, "nothing was evicted while the 3 MiB were in flight");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(metric(&larder, "larder_fills_in_flight").await, 1.0, "the download still waits on upstream");
    upstream.release(&fake::digest(&big));
    assert!(download.await.unwrap().unwrap() == big);
    wait_for_commits(&larder).await;
    let usage = metric(&larder, "larder_cache_size_bytes").await;
    assert!(usage <= (8 * MIB) as f64 * 0.95, "the committed blob fits: {usage}");
}
