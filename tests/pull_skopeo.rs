//! skopeo pulls through larder from a real distribution origin.
//!
//! Each test starts its own origin and larder and pushes one image, then
//! pulls it through larder cold (the digests must be the origin's, each blob
//! fetched from the origin once), and again warm: the second pull must not
//! GET a single blob from the origin.

mod common;

use common::{AccessLog, ImageBuilder, KIB, Larder, ORIGIN_NAME, Origin, PulledImage, PushedImage, skopeo};

/// Three layers from tens of KiB to 1 MiB.
const LAYERS: [usize; 3] = [32 * KIB, 256 * KIB, 1024 * KIB];

#[tokio::test]
async fn oci_image_pulls_through_then_comes_from_the_cache() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/oci-app", "v1").await;
    let larder = Larder::builder().upstream(&origin).start().await;
    let source = larder.image_ref(&image.reference());

    let cold = pull_through(&origin, &source, false).await;
    assert_same_image(&cold.image, &image, "cold pull");
    assert_each_blob_fetched_once(&cold.origin_requests, &image);

    let warm = pull_through(&origin, &source, false).await;
    assert_same_image(&warm.image, &image, "warm pull");
    assert_no_blob_gets(&warm.origin_requests, "the warm pull");
}

#[tokio::test]
async fn multi_arch_index_pulls_through_with_all_then_comes_from_the_cache() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&LAYERS[..2]).multi_arch().push(&origin, "team/multi-arch", "v1").await;
    assert!(image.is_index(), "the origin stores an index: {}", image.media_type);
    let larder = Larder::builder().upstream(&origin).start().await;
    let source = larder.image_ref(&image.reference());

    let cold = pull_through(&origin, &source, true).await;
    assert_same_image(&cold.image, &image, "cold pull --all");
    assert_each_blob_fetched_once(&cold.origin_requests, &image);

    let warm = pull_through(&origin, &source, true).await;
    assert_same_image(&warm.image, &image, "warm pull --all");
    assert_no_blob_gets(&warm.origin_requests, "the warm pull --all");
}

#[tokio::test]
async fn docker_schema2_image_pulls_through_then_comes_from_the_cache() {
    let origin = Origin::start().await;
    let image = ImageBuilder::docker_schema2().layers(&LAYERS).push(&origin, "team/schema2", "v1").await;
    assert_eq!(image.media_type, common::image::DOCKER_MANIFEST);
    let larder = Larder::builder().upstream(&origin).start().await;
    let source = larder.image_ref(&image.reference());

    let cold = pull_through(&origin, &source, false).await;
    assert_same_image(&cold.image, &image, "cold pull");
    assert_each_blob_fetched_once(&cold.origin_requests, &image);

    let warm = pull_through(&origin, &source, false).await;
    assert_same_image(&warm.image, &image, "warm pull");
    assert_no_blob_gets(&warm.origin_requests, "the warm pull");
}

#[tokio::test]
async fn path_prefix_form_pulls_through_and_shares_the_cache() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/prefixed", "v1").await;
    let larder = Larder::builder().upstream(&origin).start().await;
    let prefixed = larder.prefixed_ref(ORIGIN_NAME, &image.reference());

    let cold = pull_through(&origin, &prefixed, false).await;
    assert_same_image(&cold.image, &image, "cold pull via /v2/origin.test/…");
    assert_each_blob_fetched_once(&cold.origin_requests, &image);

    let warm = pull_through(&origin, &prefixed, false).await;
    assert_same_image(&warm.image, &image, "warm pull via /v2/origin.test/…");
    assert_no_blob_gets(&warm.origin_requests, "the warm prefixed pull");

    // Both forms name the same upstream repository, so they share its cache.
    let unprefixed = pull_through(&origin, &larder.image_ref(&image.reference()), false).await;
    assert_same_image(&unprefixed.image, &image, "pull via the default upstream");
    assert_no_blob_gets(&unprefixed.origin_requests, "the default-form pull after the prefixed one");
}

/// Warm blobs sent with sendfile (`server.sendfile = "always"`; the
/// default, `auto`, keeps it for clients on other hosts, and everything
/// here is on loopback): skopeo verifies every blob's digest, so a byte
/// sent wrong fails the pull.
#[tokio::test]
async fn warm_blobs_sent_with_sendfile_pull_intact() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[32 * KIB, 3 * 1024 * KIB]).push(&origin, "team/sendfile", "v1").await;
    let larder = Larder::builder()
        .upstream(&origin)
        .server_line(common::metrics::ADMIN_LISTEN)
        .server_line(r#"sendfile = "always""#)
        .start()
        .await;
    let source = larder.image_ref(&image.reference());

    let cold = pull_through(&origin, &source, false).await;
    assert_same_image(&cold.image, &image, "cold pull");
    let before = common::metrics::metric(&larder, "larder_sendfile_bytes_total").await;
    let warm = pull_through(&origin, &source, false).await;
    assert_same_image(&warm.image, &image, "warm pull with sendfile");
    assert_no_blob_gets(&warm.origin_requests, "the warm pull");
    let sent = common::metrics::metric(&larder, "larder_sendfile_bytes_total").await - before;
    let blob_bytes: u64 = image.blobs().iter().map(|b| b.size).sum();
    assert!(sent >= blob_bytes as f64, "the warm blobs ({blob_bytes} bytes) went out by sendfile: {sent}");
}

#[tokio::test]
async fn cache_survives_a_restart() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&LAYERS[..2]).multi_arch().push(&origin, "team/restarted", "v1").await;
    let mut larder = Larder::builder().upstream(&origin).start().await;
    let source = larder.image_ref(&image.reference());
    let cold = pull_through(&origin, &source, true).await;
    assert_same_image(&cold.image, &image, "cold pull --all");

    larder.restart().await;

    let after = pull_through(&origin, &source, true).await;
    assert_same_image(&after.image, &image, "pull --all after the restart");
    assert_no_blob_gets(&after.origin_requests, "the pull after a restart on the same cache dir");
}

/// A pull through larder and what the origin served meanwhile.
struct PullThrough {
    image: PulledImage,
    origin_requests: AccessLog,
}

async fn pull_through(origin: &Origin, source: &str, all: bool) -> PullThrough {
    let mark = origin.log_mark().await;
    let image =
        skopeo::pull(source, all).await.unwrap_or_else(|e| panic!("pulling {source} through larder failed: {e}"));
    let origin_requests = origin.requests_since(&mark).await;
    // Shown when the test fails (or with --nocapture).
    eprintln!("origin requests during the pull of {source}:\n{origin_requests}");
    PullThrough { image, origin_requests }
}

/// A cold pull goes to the origin once per blob.
fn assert_each_blob_fetched_once(origin_requests: &AccessLog, image: &PushedImage) {
    assert_eq!(
        origin_requests.blob_gets(),
        image.blobs().len(),
        "a cold pull of {} GETs each of its blobs from the origin exactly once:\n{origin_requests}",
        image.reference()
    );
}

fn assert_no_blob_gets(origin_requests: &AccessLog, step: &str) {
    assert_eq!(origin_requests.blob_gets(), 0, "{step} must not GET blobs from the origin:\n{origin_requests}");
}

/// The pulled manifest, per-platform manifests and blobs are the origin's.
fn assert_same_image(pulled: &PulledImage, image: &PushedImage, step: &str) {
    assert_eq!(
        pulled.manifest_digest,
        image.digest,
        "{step} of {}: manifest digest differs from the origin's",
        image.reference()
    );
    assert_eq!(
        pulled.child_manifest_digests,
        image.child_manifest_digests(),
        "{step} of {}: per-platform manifests differ from the origin's",
        image.reference()
    );
    assert_eq!(
        pulled.blob_digests(),
        image.blob_digests(),
        "{step} of {}: blobs differ from the origin's",
        image.reference()
    );
}
