//! Serving through upstream outages: a cached tag past its TTL is served
//! stale (for up to `stale_if_error`) when the revalidating `HEAD` fails,
//! refused, timed out, 429 or 5xx, also right after a restart, and each
//! such answer is counted as `stale`. A tag that was never cached is an
//! error that says whether to retry, never a 404.

mod common;
mod fake;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::metrics::{ADMIN_LISTEN, metric};
use common::{ImageBuilder, KIB, Larder, Origin, PulledImage, PushedImage, Upstream, skopeo};
use fake::client::{self, End, Response};
use fake::{Faults, UPSTREAM_NAME, manifest_path};

const LAYERS: [usize; 2] = [16 * KIB, 64 * KIB];

/// How long the tests wait for a 1 s `tag_ttl` to pass.
const PAST_TTL: Duration = Duration::from_millis(1500);

const STALE: &str = r#"larder_cache_requests_total{kind="manifest",result="stale"}"#;

#[tokio::test]
async fn with_the_origin_gone_cached_tags_and_digests_are_served_also_after_a_restart() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/app", "v1").await;
    let mut larder = Larder::builder().upstream(&origin).tag_ttl("1s").server_line(ADMIN_LISTEN).start().await;
    let by_tag = larder.image_ref("team/app:v1");
    let by_digest = larder.image_ref(&image.by_digest());
    assert_same_image(&pull(&by_tag).await, &image, "pull with the origin up");
    assert_eq!(metric(&larder, STALE).await, 0.0);

    drop(origin);
    tokio::time::sleep(PAST_TTL).await;

    assert_same_image(&pull(&by_tag).await, &image, "pull by tag with the origin gone");
    assert_same_image(&pull(&by_digest).await, &image, "pull by digest with the origin gone");
    assert_eq!(metric(&larder, STALE).await, 1.0, "the stale tag was counted");

    larder.restart().await;
    assert_same_image(&pull(&by_tag).await, &image, "pull by tag after a restart, origin still gone");
    assert_same_image(&pull(&by_digest).await, &image, "pull by digest after a restart, origin still gone");
    assert_eq!(metric(&larder, STALE).await, 1.0, "the stale tag was counted after the restart");
}

#[tokio::test]
async fn a_failing_revalidation_serves_the_stale_tag_whatever_the_failure() {
    let (manifest, manifest_digest, up) = fake::fake_with_v1().await;
    let upstream = Upstream::new(UPSTREAM_NAME, &up.url()).default(true).line(r#"response_timeout = "1s""#);
    let mut larder = Larder::builder().upstream(upstream).tag_ttl("1s").server_line(ADMIN_LISTEN).start().await;
    let addr = address(&larder);
    assert_manifest(&client::get(addr, &manifest_path("v1")).await, &manifest, &manifest_digest);
    tokio::time::sleep(PAST_TTL).await;

    let failures = [
        Failure::Status(429),
        Failure::Status(500),
        Failure::Status(502),
        Failure::Status(503),
        Failure::Timeout,
        Failure::Refused,
    ];
    for failure in failures {
        // A fresh process for each: after a failed revalidation larder may
        // serve stale for a while without asking upstream again.
        larder.restart().await;
        let heads = up.requests("HEAD", &manifest_path("v1"));
        match failure {
            Failure::Status(status) => up.fail_next(1, status, Some("30")),
            Failure::Timeout => up.set_faults(
                &manifest_digest,
                Faults { stall_headers: Some(Duration::from_secs(60)), ..Faults::default() },
            ),
            Failure::Refused => up.down().await,
        }

        let r = client::get(addr, &manifest_path("v1")).await;
        assert_manifest(&r, &manifest, &manifest_digest);
        assert_eq!(metric(&larder, STALE).await, 1.0, "{failure:?}: counted as stale");
        if failure != Failure::Refused {
            let now = up.requests("HEAD", &manifest_path("v1"));
            assert_eq!(now, heads + 1, "{failure:?}: one HEAD revalidated: {:?}", up.log());
        }

        match failure {
            Failure::Status(_) => {}
            Failure::Timeout => up.heal(&manifest_digest),
            Failure::Refused => up.up().await,
        }
    }

    // Healthy: the HEAD confirms the digest, and that is not stale.
    larder.restart().await;
    let heads = up.requests("HEAD", &manifest_path("v1"));
    assert_manifest(&client::get(addr, &manifest_path("v1")).await, &manifest, &manifest_digest);
    assert_eq!(up.requests("HEAD", &manifest_path("v1")), heads + 1, "{:?}", up.log());
    assert_eq!(metric(&larder, STALE).await, 0.0, "a successful revalidation is not stale");
    assert_eq!(up.manifest_gets("v1"), 1, "the tag was never fetched again: {:?}", up.log());
    assert_eq!(up.manifest_gets(&manifest_digest), 0, "nor its digest: {:?}", up.log());
}

/// How the revalidating `HEAD` fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failure {
    /// Upstream answers with this status.
    Status(u16),
    /// Upstream sends no response headers within `response_timeout`.
    Timeout,
    /// Upstream refuses connections.
    Refused,
}

#[tokio::test]
async fn a_stale_tag_is_served_only_for_stale_if_error_past_its_ttl() {
    let (manifest, manifest_digest, up) = fake::fake_with_v1().await;
    let larder = Larder::builder()
        .upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
        .tag_ttl("1s")
        .cache_line(r#"stale_if_error = "3s""#)
        .start()
        .await;
    let addr = address(&larder);
    assert_manifest(&client::get(addr, &manifest_path("v1")).await, &manifest, &manifest_digest);
    up.down().await;

    // Past the TTL, well within TTL + stale_if_error (4 s).
    tokio::time::sleep(PAST_TTL).await;
    assert_manifest(&client::get(addr, &manifest_path("v1")).await, &manifest, &manifest_digest);

    // Well past TTL + stale_if_error: the outage is reported, not hidden.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let r = client::get(addr, &manifest_path("v1")).await;
    assert_eq!(r.status(), 503, "upstream down, stale window over: {:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.error_code(), "UNAVAILABLE");

    // Digests do not expire.
    assert_manifest(&client::get(addr, &manifest_path(&manifest_digest)).await, &manifest, &manifest_digest);
}

#[tokio::test]
async fn a_cold_tag_with_upstream_failing_says_whether_to_retry_and_is_never_404() {
    let (manifest, manifest_digest, up) = fake::fake_with_v1().await;
    let larder = Larder::builder().upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true)).start().await;
    let addr = address(&larder);

    // (upstream status, Retry-After it sends) → (larder status, Retry-After passed on)
    let cases = [
        (429, Some("7"), 429, Some("7"), "TOOMANYREQUESTS"),
        (503, Some("3"), 503, Some("3"), "UNAVAILABLE"),
        (500, None, 502, None, "UNAVAILABLE"),
    ];
    for (upstream_status, retry_after, status, passed_on, code) in cases {
        up.fail_next(1, upstream_status, retry_after);
        let r = client::get(addr, &manifest_path("v1")).await;
        assert_eq!(r.status(), status, "upstream {upstream_status}: {:?}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("retry-after"), passed_on, "upstream {upstream_status}");
        assert_eq!(r.error_code(), code, "upstream {upstream_status}");
    }
    up.down().await;
    let r = client::get(addr, &manifest_path("v1")).await;
    assert_eq!(r.status(), 503, "upstream refusing connections: {:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.error_code(), "UNAVAILABLE");

    // None of it was cached: upstream back, the tag is fetched and served.
    up.up().await;
    assert_manifest(&client::get(addr, &manifest_path("v1")).await, &manifest, &manifest_digest);
    assert_eq!(up.manifest_gets("v1"), 4, "each failed request asked upstream, then one more: {:?}", up.log());
}

// ---- helpers ----------------------------------------------------------------

fn address(larder: &Larder) -> SocketAddr {
    larder.host_port().parse().expect("larder's address")
}

fn assert_manifest(r: &Response, manifest: &Bytes, manifest_digest: &str) {
    assert_eq!(r.status(), 200, "body: {:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.end, End::Complete);
    assert!(r.body == *manifest, "the manifest's exact bytes");
    assert_eq!(r.header("docker-content-digest"), Some(manifest_digest));
}

async fn pull(source: &str) -> PulledImage {
    skopeo::pull(source, false).await.unwrap_or_else(|e| panic!("pulling {source} through larder failed: {e}"))
}

fn assert_same_image(pulled: &PulledImage, image: &PushedImage, step: &str) {
    assert_eq!(pulled.manifest_digest, image.digest, "{step}: manifest digest");
    assert_eq!(pulled.blob_digests(), image.blob_digests(), "{step}: blobs");
}
