//! Upstream failures as clients see them: a status that says whether to
//! retry (429 with upstream's Retry-After, 502, 503, 504, never 404),
//! bodies that break or lie aborted rather than ended cleanly, and nothing
//! wrong ever cached.

mod fake;

use std::time::Duration;

use bytes::Bytes;
use fake::client::{self, End, Response};
use fake::{
    FakeUpstream, KIB, Larder, OCI_MANIFEST, REPO, blob_path, digest, image_manifest, manifest_path, random_bytes,
};

/// A manifest and its digest.
fn manifest() -> (Bytes, String) {
    let config = random_bytes(512, 1);
    let layer = random_bytes(4 * KIB, 2);
    let m = image_manifest((&digest(&config), config.len()), &[(&digest(&layer), layer.len())]);
    let d = digest(&m);
    (m, d)
}

fn assert_manifest(r: &Response, m: &Bytes, d: &str) {
    assert_eq!(r.status(), 200, "body: {:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.end, End::Complete);
    assert!(r.body == *m, "exact manifest bytes");
    assert_eq!(r.header("docker-content-digest"), Some(d));
    assert_eq!(r.header("content-type"), Some(OCI_MANIFEST));
}

/// Asserts a blob response was cut off: never a clean end of the full length.
/// A failed fill aborts the response: after its head, or, when the fill
/// failed before its first byte could be sent, before it (hyper then closes
/// the connection without writing a head). Either way no blob arrives.
async fn assert_get_aborted(addr: std::net::SocketAddr, path: &str) {
    match client::try_get(addr, path).await {
        Ok(r) => assert_aborted(&r),
        Err(e) => assert!(e.contains("closed before a response head"), "GET {path}: {e}"),
    }
}

fn assert_aborted(r: &Response) {
    assert!(
        matches!(r.end, End::Aborted(_)),
        "expected an aborted body, got {:?} after {} bytes (status {})",
        r.end,
        r.body.len(),
        r.status()
    );
}

#[tokio::test]
async fn rate_limiting_upstream_is_429_with_its_retry_after() {
    let (m, md) = manifest();
    let blob = random_bytes(64 * KIB, 3);
    let bd = digest(&blob);
    let up = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, m.clone())
        .blob(blob.clone())
        .fail_next(2, 429, Some("7"))
        .start()
        .await;
    let larder = Larder::start(&up).await;

    let r = client::get(larder.addr(), &manifest_path("v1")).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.header("retry-after"), Some("7"));
    assert_eq!(r.error_code(), "TOOMANYREQUESTS");

    let r = client::get(larder.addr(), &blob_path(&bd)).await;
    assert_eq!(r.status(), 429, "a cold blob too");
    assert_eq!(r.header("retry-after"), Some("7"));
    assert_eq!(r.error_code(), "TOOMANYREQUESTS");

    // Upstream has recovered; the 429s were not cached.
    let r = client::get(larder.addr(), &manifest_path("v1")).await;
    assert_manifest(&r, &m, &md);
    assert_eq!(up.manifest_gets("v1"), 2);
    let r = client::get(larder.addr(), &blob_path(&bd)).await;
    assert!(r.status() == 200 && r.end == End::Complete && r.body == blob);
    assert_eq!(up.blob_gets(&bd), 2);
}

#[tokio::test]
async fn upstream_500_is_502() {
    let (m, _) = manifest();
    let blob = random_bytes(64 * KIB, 4);
    let bd = digest(&blob);
    let up =
        FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, m).blob(blob).fail_next(2, 500, None).start().await;
    let larder = Larder::start(&up).await;

    for path in [manifest_path("v1"), blob_path(&bd)] {
        let r = client::get(larder.addr(), &path).await;
        assert_eq!(r.status(), 502, "{path}");
        r.error_code();
    }
    assert_eq!(up.manifest_gets("v1"), 1);
    assert_eq!(up.blob_gets(&bd), 1);
}

#[tokio::test]
async fn upstream_down_is_503() {
    let (m, md) = manifest();
    let blob = random_bytes(64 * KIB, 5);
    let bd = digest(&blob);
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, m.clone()).blob(blob.clone()).start().await;
    let larder = Larder::start(&up).await;
    up.down().await;

    for path in [manifest_path("v1"), blob_path(&bd)] {
        let r = client::get(larder.addr(), &path).await;
        assert_eq!(r.status(), 503, "{path} with upstream refusing connections");
        r.error_code();
        // What failed, in words: not hyper-util's `client error (Connect)`.
        let message = r.json()["errors"][0]["message"].as_str().unwrap_or_default().to_owned();
        assert!(
            message.starts_with("cannot connect to upstream: tcp connect error: ")
                && message.contains("Connection refused")
                && !message.contains("client error ("),
            "{path}: {message}"
        );
    }
    assert_eq!(up.total_requests(), 0);

    // Back up: nothing about the outage was cached.
    up.up().await;
    assert_manifest(&client::get(larder.addr(), &manifest_path("v1")).await, &m, &md);
    let r = client::get(larder.addr(), &blob_path(&bd)).await;
    assert!(r.status() == 200 && r.end == End::Complete && r.body == blob);
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_stalling_before_headers_is_504_not_a_hang() {
    let (m, _) = manifest();
    let blob = random_bytes(64 * KIB, 6);
    let bd = digest(&blob);
    let stall = Duration::from_secs(600);
    let up = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, m)
        .stall_headers(stall)
        .blob(blob)
        .stall_headers(stall)
        .start()
        .await;
    let larder = Larder::builder(&up).response_timeout("1s").start().await;

    for path in [manifest_path("v1"), blob_path(&bd)] {
        // A guard against hanging, far below the stall; not a timing check.
        let r = tokio::time::timeout(Duration::from_secs(30), client::get(larder.addr(), &path))
            .await
            .unwrap_or_else(|_| panic!("{path}: larder waited on a stalled upstream"));
        assert_eq!(r.status(), 504, "{path}");
        r.error_code();
    }
}

#[tokio::test]
async fn a_blob_body_longer_than_its_content_length_is_aborted_and_not_cached() {
    let blob = random_bytes(64 * KIB, 7);
    let d = digest(&blob);
    let path = blob_path(&d);
    // Content-Length says 100 bytes fewer than upstream then sends.
    let up = FakeUpstream::builder().blob(blob.clone()).overlong(100).start().await;
    let larder = Larder::start(&up).await;

    assert_get_aborted(larder.addr(), &path).await;
    assert_eq!(up.blob_gets(&d), 1);
    assert_get_aborted(larder.addr(), &path).await;
    assert_eq!(up.blob_gets(&d), 2, "nothing was cached");
    assert!(!larder.blob_file(&d).exists());

    up.heal(&d);
    let r = client::get(larder.addr(), &path).await;
    assert!(r.status() == 200 && r.end == End::Complete && r.body == blob);
    assert_eq!(up.blob_gets(&d), 3);
}

#[tokio::test]
async fn a_truncated_blob_body_is_aborted_and_not_cached() {
    let blob = random_bytes(64 * KIB, 8);
    let d = digest(&blob);
    let path = blob_path(&d);
    // The full Content-Length, then the connection breaks after 32 KiB.
    let up = FakeUpstream::builder().blob(blob.clone()).truncate(32 * KIB).start().await;
    let larder = Larder::start(&up).await;

    assert_get_aborted(larder.addr(), &path).await;
    assert_eq!(up.blob_gets(&d), 1);
    assert_get_aborted(larder.addr(), &path).await;
    assert_eq!(up.blob_gets(&d), 2, "nothing was cached");
    assert!(!larder.blob_file(&d).exists());

    up.heal(&d);
    let r = client::get(larder.addr(), &path).await;
    assert!(r.status() == 200 && r.end == End::Complete && r.body == blob);
    assert_eq!(up.blob_gets(&d), 3);
}

#[tokio::test]
async fn a_manifest_not_matching_its_digest_is_502_and_not_cached() {
    let (m, md) = manifest();
    // Served by digest with other bytes (still valid JSON).
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, m.clone()).wrong_bytes().start().await;
    let larder = Larder::start(&up).await;

    for n in 1..=2 {
        let r = client::get(larder.addr(), &manifest_path(&md)).await;
        assert_eq!(r.status(), 502, "GET by digest #{n}");
        r.error_code();
        assert_eq!(up.manifest_gets(&md), n, "nothing was cached");
    }

    up.heal(&md);
    assert_manifest(&client::get(larder.addr(), &manifest_path(&md)).await, &m, &md);
}

#[tokio::test]
async fn a_tag_whose_docker_content_digest_disagrees_with_its_bytes_is_502() {
    let (m, md) = manifest();
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, m.clone()).wrong_digest_header().start().await;
    let larder = Larder::start(&up).await;

    for n in 1..=2 {
        let r = client::get(larder.addr(), &manifest_path("v1")).await;
        assert_eq!(r.status(), 502, "GET by tag #{n}");
        r.error_code();
        assert_eq!(up.manifest_gets("v1"), n, "nothing was cached");
    }

    up.heal(&md);
    assert_manifest(&client::get(larder.addr(), &manifest_path("v1")).await, &m, &md);
}

#[tokio::test]
async fn an_unknown_ns_is_name_unknown_and_dials_nothing() {
    let (m, md) = manifest();
    let blob = random_bytes(KIB, 9);
    let bd = digest(&blob);
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, m.clone()).blob(blob).start().await;
    let larder = Larder::start(&up).await;

    for path in [manifest_path("v1"), manifest_path(&md), blob_path(&bd)] {
        let path = format!("{path}?ns=evil.example");
        let r = client::get(larder.addr(), &path).await;
        assert_eq!(r.status(), 404, "{path}");
        assert_eq!(r.error_code(), "NAME_UNKNOWN", "{path}");
    }
    assert_eq!(up.total_requests(), 0, "no request reached any upstream");

    // The configured name does select the upstream.
    let r = client::get(larder.addr(), &format!("{}?ns={}", manifest_path("v1"), fake::UPSTREAM_NAME)).await;
    assert_manifest(&r, &m, &md);
}
