//! Repository membership: a blob cached for one repository is served to
//! another only once upstream confirmed that repository has it; a
//! manifest's references grant nothing by themselves; and a request never
//! inherits another repository's "not found" or "denied".

mod common;
mod fake;

use std::time::Duration;

use common::metrics::{ADMIN_LISTEN, metric};
use common::{Larder, Upstream};
use fake::{FakeUpstream, KIB, MIB, OCI_MANIFEST, UPSTREAM_NAME, digest, image_manifest, random_bytes, wait_until};

async fn get(url: &str) -> (u16, bytes::Bytes) {
    let resp = reqwest::get(url).await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    (resp.status().as_u16(), resp.bytes().await.expect("body"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_manifest_naming_a_digest_its_repository_lacks_does_not_unlock_it() {
    let private = random_bytes(64 * KIB, 1);
    let pd = digest(&private);
    let config = random_bytes(KIB, 2);
    // A registry that does not check references: public/app's manifest
    // names private/app's layer, which public/app does not hold.
    let dangling = image_manifest((&digest(&config), config.len()), &[(&pd, private.len())]);
    let up = FakeUpstream::builder()
        .blob(private.clone())
        .only_in("private/app")
        .blob(config)
        .manifest("public/app", "v1", OCI_MANIFEST, dangling)
        .start()
        .await;
    let larder = Larder::builder().upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true)).start().await;

    let (status, body) = get(&format!("{}/v2/private/app/blobs/{pd}", larder.url())).await;
    assert_eq!((status, body), (200, private), "cached for private/app");
    let (status, _) = get(&format!("{}/v2/public/app/manifests/v1", larder.url())).await;
    assert_eq!(status, 200, "public/app's manifest, which names the private digest");

    let (status, _) = get(&format!("{}/v2/public/app/blobs/{pd}", larder.url())).await;
    assert_eq!(status, 404, "not served to public/app on the strength of its manifest");
    assert_eq!(up.requests("HEAD", &format!("/v2/public/app/blobs/{pd}")), 1, "upstream was asked, once");
    assert_eq!(up.blob_gets(&pd), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_that_joined_another_repositorys_failed_fill_gets_its_own() {
    // One upstream request at a time: a stalled blob holds the slot, so the
    // fill for a/app waits for it while b/app's request joins that fill.
    let holder = random_bytes(4 * MIB, 3);
    let shared = random_bytes(256 * KIB, 4);
    let (hd, sd) = (digest(&holder), digest(&shared));
    let up = FakeUpstream::builder()
        .blob(holder.clone())
        .stall_after(MIB)
        .blob(shared.clone())
        .only_in("b/app")
        .start()
        .await;
    let larder = Larder::builder()
        .upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true).line("max_concurrency = 1"))
        .server_line(ADMIN_LISTEN)
        .start()
        .await;
    let base = larder.url();

    let holding = tokio::spawn(get_owned(format!("{base}/v2/c/app/blobs/{hd}")));
    wait_until("the holder's body is stalled", || up.bytes_sent(&hd) >= MIB as u64).await;
    // a/app, which upstream says lacks the blob, starts the fill ...
    let from_a = tokio::spawn(get_owned(format!("{base}/v2/a/app/blobs/{sd}")));
    let fills = || async { metric(&larder, "larder_fills_in_flight").await };
    while fills().await < 2.0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ... and b/app, which has it, joins that fill (its membership HEAD
    // waits for the slot too).
    let from_b = tokio::spawn(get_owned(format!("{base}/v2/b/app/blobs/{sd}")));
    tokio::time::sleep(Duration::from_secs(1)).await;
    up.release(&hd);

    assert_eq!(holding.await.expect("task").0, 200);
    assert_eq!(from_a.await.expect("task").0, 404, "a/app gets upstream's answer for a/app");
    let (status, body) = from_b.await.expect("task");
    assert_eq!(status, 200, "b/app does not inherit a/app's 404");
    assert_eq!(body, shared);
    assert_eq!(up.requests("GET", &format!("/v2/b/app/blobs/{sd}")), 1, "b/app fetched it for itself");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_that_joined_a_fill_denied_to_another_repository_gets_its_own() {
    // As above, with a 403 instead of a 404: a/app's upstream denies it,
    // b/app's (another upstream, where b/app has it) does not.
    let holder = random_bytes(4 * MIB, 6);
    let shared = random_bytes(256 * KIB, 7);
    let (hd, sd) = (digest(&holder), digest(&shared));
    let denying =
        FakeUpstream::builder().blob(holder.clone()).stall_after(MIB).blob(shared.clone()).status(403).start().await;
    let having = FakeUpstream::builder().blob(shared.clone()).only_in("b/app").start().await;
    let larder = Larder::builder()
        .upstream(Upstream::new(UPSTREAM_NAME, &denying.url()).default(true).line("max_concurrency = 1"))
        .upstream(Upstream::new("second.test", &having.url()))
        .server_line(ADMIN_LISTEN)
        .start()
        .await;
    let base = larder.url();

    let holding = tokio::spawn(get_owned(format!("{base}/v2/c/app/blobs/{hd}")));
    wait_until("the holder's body is stalled", || denying.bytes_sent(&hd) >= MIB as u64).await;
    let from_a = tokio::spawn(get_owned(format!("{base}/v2/a/app/blobs/{sd}")));
    let fills = || async { metric(&larder, "larder_fills_in_flight").await };
    while fills().await < 2.0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // b/app's membership HEAD passes at once and it joins a/app's fill.
    let from_b = tokio::spawn(get_owned(format!("{base}/v2/second.test/b/app/blobs/{sd}")));
    wait_until("b/app was confirmed", || having.requests("HEAD", &format!("/v2/b/app/blobs/{sd}")) == 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    denying.release(&hd);

    assert_eq!(holding.await.expect("task").0, 200);
    assert_eq!(from_a.await.expect("task").0, 403, "a/app gets its upstream's denial");
    let (status, body) = from_b.await.expect("task");
    assert_eq!(status, 200, "b/app does not inherit a/app's 403");
    assert_eq!(body, shared);
    assert_eq!(having.requests("GET", &format!("/v2/b/app/blobs/{sd}")), 1, "b/app fetched it for itself");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_confirmed_membership_is_remembered() {
    let layer = random_bytes(64 * KIB, 5);
    let d = digest(&layer);
    let up = FakeUpstream::builder().blob(layer.clone()).start().await;
    let larder = Larder::builder().upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true)).start().await;

    let (status, body) = get(&format!("{}/v2/a/app/blobs/{d}", larder.url())).await;
    assert_eq!((status, body), (200, layer.clone()), "fetched for a/app");
    for _ in 0..2 {
        let (status, body) = get(&format!("{}/v2/b/app/blobs/{d}", larder.url())).await;
        assert_eq!((status, body), (200, layer.clone()), "served to b/app from the cache");
    }
    assert_eq!(up.requests("HEAD", &format!("/v2/b/app/blobs/{d}")), 1, "one upstream check for two requests");
    assert_eq!(up.blob_gets(&d), 1);
}

async fn get_owned(url: String) -> (u16, bytes::Bytes) {
    get(&url).await
}
