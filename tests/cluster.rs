//! Cluster mode with real components: replicas of larder that are each
//! other's peers, a real 3-node Garage cluster as the shared tier, the real
//! distribution registry as the origin, and skopeo as the client; a fault
//! injecting fake upstream where a fill must be stalled or counted.
//!
//! What it shows: one origin GET per blob and per manifest for a herd over
//! three replicas; a replica with an empty disk served by the cluster and
//! Garage with no origin request at all; an owner killed mid-fill costs its
//! asker a pause, not an error; Garage losing a node, or going away, does
//! not stop pulls; a corrupt shared object is caught, counted and replaced;
//! the peer listener answers nobody without the secret and names no host a
//! peer sends; an owner serves a peer nothing its repository cannot see
//! upstream; a replica without peers reads manifests by digest from Garage;
//! a node mirror through a hub costs the origin one GET per blob.

mod common;
mod fake;

use std::net::SocketAddr;
use std::time::Duration;

use common::metrics::metric;
use common::{Cluster, Garage, ImageBuilder, KIB, Larder, MIB, Origin, Upstream, skopeo};
use fake::client::{self, End};
use fake::{FakeUpstream, UPSTREAM_NAME, blob_path, digest, random_bytes, wait_until};

fn address(larder: &Larder) -> SocketAddr {
    larder.host_port().parse().expect("larder's address")
}

/// Waits until every replica has uploaded what it queued for the shared tier.
async fn uploads_settled(replicas: &[&Larder]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut pending = 0.0;
        for r in replicas {
            pending += metric(r, "larder_pending_uploads").await;
        }
        if pending == 0.0 {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{pending} uploads still pending after 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_herd_over_three_replicas_costs_the_origin_one_get_per_blob_and_a_new_replica_none() {
    let origin = Origin::start().await;
    let layers = [512 * KIB, MIB, 2 * MIB, 256 * KIB, 3 * MIB, 64 * KIB];
    let image = ImageBuilder::oci().layers(&layers).push(&origin, "team/app", "v1").await;
    let garage = Garage::builder().start().await;
    let cluster = Cluster::builder(&origin).replicas(3).shared(&garage, "herd").start().await;

    // 30 cold pulls at once, spread over the replicas.
    let mark = origin.log_mark().await;
    let pulls = (0..30).map(|i| {
        let source = cluster.replicas[i % 3].image_ref("team/app:v1");
        async move { skopeo::pull(&source, false).await }
    });
    for pulled in futures_util::future::join_all(pulls).await {
        let pulled = pulled.expect("every pull succeeds");
        assert_eq!(pulled.manifest_digest, image.digest, "the image as the origin has it");
    }
    let asked = origin.requests_since(&mark).await;
    assert_eq!(asked.blob_gets(), image.blobs().len(), "one origin GET per blob for the whole cluster:\n{asked}");
    let manifest_gets = asked.manifest_requests().iter().filter(|e| e.method == "GET").count();
    assert_eq!(manifest_gets, 1, "one origin GET of the manifest:\n{asked}");

    // Everything verified was uploaded; a replica with an empty disk that
    // joins is served by the cluster and Garage alone.
    uploads_settled(&cluster.replicas.iter().collect::<Vec<_>>()).await;
    let late = cluster.joining().await;
    let mark = origin.log_mark().await;
    let pulled = skopeo::pull(&late.image_ref("team/app:v1"), false).await.expect("the new replica pulls");
    assert_eq!(pulled.manifest_digest, image.digest);
    let asked = origin.requests_since(&mark).await;
    assert!(asked.is_empty(), "no origin request at all:\n{asked}");
    assert!(metric(&late, "larder_shared_bytes_total{direction=\"download\"}").await > 0.0, "read from Garage");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_owner_killed_mid_fill_costs_its_asker_a_pause_not_an_error() {
    let layer = random_bytes(64 * MIB, 7);
    let d = digest(&layer);
    // The origin stops after 16 MiB until released.
    let up = FakeUpstream::builder().blob(layer.clone()).stall_after(16 * MIB).start().await;
    let mut cluster = Cluster::builder(Upstream::new(UPSTREAM_NAME, &up.url()).default(true)).replicas(2).start().await;
    let owner = cluster.owner_of(&d);
    let asker = cluster.other_than(owner);

    let mut reader = client::open(address(&cluster.replicas[asker]), &blob_path(&d)).await;
    assert_eq!(reader.status(), 200);
    let first = reader.read_exact(8 * MIB).await;
    assert!(first == layer[..8 * MIB], "the first bytes, through the owner");
    assert_eq!(up.blob_gets(&d), 1, "only the owner asked the origin");

    cluster.replicas[owner].stop();
    up.release(&d);
    let (len, end, first_difference) = reader.compare_to_end(&layer[8 * MIB..]).await;
    assert_eq!((len, end, first_difference), ((56 * MIB) as u64, End::Complete, None), "the rest, exact");
    let resumed: Vec<_> = up.log().into_iter().filter(|l| l.method == "GET" && l.range.is_some()).collect();
    assert_eq!(resumed.len(), 1, "the asker resumed from the origin with a Range: {resumed:?}");
    let asker = &cluster.replicas[asker];
    let hex = d.trim_start_matches("sha256:");
    wait_until("the asker commits the blob", || {
        asker.cache_dir().join("blobs/sha256").join(&hex[..2]).join(hex).exists()
    })
    .await;

    // The broken body alone marks nothing down (the owner may have been
    // relaying its own source's failure); the next request for a key the
    // dead owner owns finds it unreachable, counts it and marks it down,
    // and the one after skips it without dialing.
    let unreachable = "larder_peer_requests_total{direction=\"out\",kind=\"blob\",result=\"unreachable\"}";
    assert_eq!(metric(asker, "larder_peers_marked_down_total").await, 0.0);
    let owned_by_dead: Vec<String> = (0..)
        .map(|seed| digest(&random_bytes(KIB, 100 + seed)))
        .filter(|other| cluster.owner_of(other) == owner)
        .take(2)
        .collect();
    for other in &owned_by_dead {
        let missing = reqwest::get(format!("{}{}", asker.url(), blob_path(other))).await.expect("GET");
        assert_eq!(missing.status(), 404, "fetched from upstream itself, which lacks it");
    }
    assert_eq!(metric(asker, unreachable).await, 1.0, "one attempt at the dead owner");
    assert_eq!(metric(asker, "larder_peers_marked_down_total").await, 1.0, "marked down once");
    assert_eq!(metric(asker, "larder_peers_down").await, 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_owner_serves_a_peer_nothing_the_peer_repository_cannot_see_upstream() {
    let private = random_bytes(256 * KIB, 17);
    let d = digest(&private);
    let up = FakeUpstream::builder().blob(private.clone()).only_in("private/app").start().await;
    let cluster = Cluster::builder(Upstream::new(UPSTREAM_NAME, &up.url()).default(true)).replicas(2).start().await;
    let owner = cluster.owner_of(&d);
    let url = format!("{}/v2/private/app/blobs/{d}", cluster.replicas[owner].url());
    let fetched = reqwest::get(url).await.expect("GET").bytes().await.expect("body");
    assert!(fetched == private, "the owner holds it, for private/app");

    // A peer asks the owner for it through another repository, and, for
    // contrast, through its own.
    let peer = &cluster.peer_urls[owner];
    let ask = |repo: &str| {
        reqwest::Client::new()
            .get(format!("{peer}/v2/{repo}/blobs/{d}?ns={UPSTREAM_NAME}"))
            .header("larder-cluster-secret", common::cluster::SECRET)
            .send()
    };
    let own = ask("private/app").await.expect("the peer listener answers");
    assert_eq!(own.status(), 200, "served to a peer for the repository that has it");
    let asked = ask("public/app").await.expect("the peer listener answers");
    assert_eq!(asked.status(), 404, "public/app does not have it upstream");
    assert!(asked.bytes().await.expect("body").len() < 1024, "an error, not the blob");
    assert_eq!(up.requests("HEAD", &format!("/v2/public/app/blobs/{d}")), 1, "the owner asked upstream");
    assert_eq!(up.blob_gets(&d), 1, "still the one origin GET");
    let not_found = metric(
        &cluster.replicas[owner],
        "larder_peer_requests_total{direction=\"in\",kind=\"blob\",result=\"not_found\"}",
    );
    assert_eq!(not_found.await, 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replica_without_peers_reads_a_manifest_by_digest_from_garage() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[256 * KIB, 64 * KIB]).push(&origin, "team/app", "v1").await;
    let garage = Garage::builder().start().await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let table = garage.shared_toml(dir.path(), "manifests");
    let replica = || Larder::builder().upstream(&origin).server_line(common::metrics::ADMIN_LISTEN).append_toml(&table);
    let first = replica().start().await;
    let pulled = skopeo::pull(&first.image_ref("team/app:v1"), false).await.expect("pull");
    assert_eq!(pulled.manifest_digest, image.digest);
    uploads_settled(&[&first]).await;

    let second = replica().start().await;
    let mark = origin.log_mark().await;
    let got = reqwest::Client::new()
        .get(format!("{}/v2/team/app/manifests/{}", second.url(), image.digest))
        .header("accept", "application/vnd.oci.image.manifest.v1+json")
        .send()
        .await
        .expect("GET");
    assert_eq!(got.status(), 200);
    assert_eq!(digest(&got.bytes().await.expect("body")), image.digest, "the manifest's bytes");
    let asked = origin.requests_since(&mark).await;
    let gets = asked.manifest_requests().iter().filter(|e| e.method == "GET").count();
    assert_eq!(gets, 0, "no origin manifest GET: read from Garage\n{asked}");
    let heads = asked.manifest_requests().iter().filter(|e| e.method == "HEAD").count();
    assert_eq!(heads, 1, "one HEAD confirms the repository has it\n{asked}");
}

#[tokio::test(flavor = "multi_thread")]
async fn pulls_go_on_when_garage_loses_a_node_and_when_it_is_gone() {
    let origin = Origin::start().await;
    let one = ImageBuilder::oci().layers(&[MIB, 256 * KIB]).push(&origin, "team/one", "v1").await;
    let two = ImageBuilder::oci().layers(&[MIB, 512 * KIB]).push(&origin, "team/two", "v1").await;
    let mut garage = Garage::builder().start().await;
    let cluster = Cluster::builder(&origin).replicas(2).shared(&garage, "outage").start().await;

    // One storage node down: reads and writes of the other two go on.
    garage.kill(1);
    let pulled = skopeo::pull(&cluster.replicas[0].image_ref("team/one:v1"), false).await.expect("pull");
    assert_eq!(pulled.manifest_digest, one.digest);
    uploads_settled(&[&cluster.replicas[0], &cluster.replicas[1]]).await;

    // The whole store gone: served from peers and the origin, still ready,
    // and the failures are in the metrics.
    garage.kill_all();
    let pulled = skopeo::pull(&cluster.replicas[1].image_ref("team/two:v1"), false).await.expect("pull");
    assert_eq!(pulled.manifest_digest, two.digest);
    let pulled = skopeo::pull(&cluster.replicas[1].image_ref("team/one:v1"), false).await.expect("pull");
    assert_eq!(pulled.manifest_digest, one.digest);
    for replica in &cluster.replicas {
        let ready = reqwest::get(format!("http://{}/readyz", common::metrics::admin_address(replica)))
            .await
            .expect("readyz answers");
        assert_eq!(ready.status(), 200, "ready without the shared tier");
    }
    let errors = metric(&cluster.replicas[1], "larder_shared_requests_total{op=\"get\",result=\"error\"}").await;
    assert!(errors > 0.0, "the shared tier's failures are counted");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_shared_object_is_caught_counted_and_replaced() {
    let blob = random_bytes(2 * MIB, 9);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let garage = Garage::builder().start().await;
    let cluster = Cluster::builder(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
        .replicas(2)
        .shared(&garage, "corrupt")
        .start()
        .await;
    let (owner, other) = {
        let owner = cluster.owner_of(&d);
        (&cluster.replicas[owner], &cluster.replicas[cluster.other_than(owner)])
    };
    let (len, end, _) = client::open(address(owner), &blob_path(&d)).await.compare_to_end(&blob).await;
    assert_eq!((len, end), (blob.len() as u64, End::Complete));
    uploads_settled(&[owner, other]).await;

    // Same length, one byte flipped, written straight into the bucket.
    let mut bad = blob.to_vec();
    bad[MIB] ^= 0xff;
    common::garage::put_object(&garage, &format!("corrupt/blobs/sha256/{}", d.trim_start_matches("sha256:")), bad)
        .await;

    // The other replica reads the shared copy first: the digest check
    // fails, the client's body is aborted, nothing is kept, it is counted.
    let (_, end, _) = client::open(address(other), &blob_path(&d)).await.compare_to_end(&blob).await;
    assert!(matches!(end, End::Aborted(_)), "never a clean end with wrong bytes: {end:?}");
    assert_eq!(metric(other, "larder_shared_corrupt_total").await, 1.0);
    // Fetched again, from the owner: exact, and the bad object is gone.
    let (len, end, first_difference) = client::open(address(other), &blob_path(&d)).await.compare_to_end(&blob).await;
    assert_eq!((len, end, first_difference), (blob.len() as u64, End::Complete, None));
    assert_eq!(up.blob_gets(&d), 1, "the origin was asked once, by the owner");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_shared_tier_unlocks_nothing_a_repository_cannot_see_upstream() {
    let private = random_bytes(256 * KIB, 13);
    let d = digest(&private);
    let up = FakeUpstream::builder().blob(private.clone()).only_in("private/app").start().await;
    let garage = Garage::builder().start().await;
    // Two replicas sharing Garage, without peers: nothing but upstream can
    // tell them what a repository holds.
    let upstream = || Upstream::new(UPSTREAM_NAME, &up.url()).default(true);
    let shared = |builder: common::LarderBuilder| builder.server_line(common::metrics::ADMIN_LISTEN);
    let dir = tempfile::tempdir().expect("a temp dir");
    let table = garage.shared_toml(dir.path(), "membership");
    let first = shared(Larder::builder().upstream(upstream()).append_toml(&table)).start().await;
    let second = shared(Larder::builder().upstream(upstream()).append_toml(&table)).start().await;

    let url = |larder: &Larder, repo: &str| format!("{}/v2/{repo}/blobs/{d}", larder.url());
    let fetched = reqwest::get(url(&first, "private/app")).await.expect("GET").bytes().await.expect("body");
    assert!(fetched == private, "cached for private/app, and uploaded");
    uploads_settled(&[&first]).await;

    let refused = reqwest::get(url(&second, "public/app")).await.expect("GET");
    assert_eq!(refused.status(), 404, "public/app does not have it upstream: not served from the shared tier");
    assert_eq!(up.requests("HEAD", &format!("/v2/public/app/blobs/{d}")), 1, "upstream was asked first");
    assert_eq!(metric(&second, "larder_shared_bytes_total{direction=\"download\"}").await, 0.0, "not a byte read");

    // For the repository that has it, the second replica reads Garage.
    let served = reqwest::get(url(&second, "private/app")).await.expect("GET").bytes().await.expect("body");
    assert!(served == private);
    assert_eq!(up.blob_gets(&d), 1, "still the one origin GET");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_peer_listener_answers_nobody_without_the_secret_and_dials_nothing_a_peer_names() {
    let blob = random_bytes(64 * KIB, 11);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let cluster = Cluster::builder(Upstream::new(UPSTREAM_NAME, &up.url()).default(true).alias("fake-alias.test"))
        .replicas(2)
        .start()
        .await;
    let peer = &cluster.peer_urls[0];
    let http = reqwest::Client::new();
    let get = |ns: &str, secret: Option<&str>| {
        let mut req = http.get(format!("{peer}/v2/test/app/blobs/{d}?ns={ns}"));
        if let Some(secret) = secret {
            req = req.header("larder-cluster-secret", secret);
        }
        async move { req.send().await.expect("the peer listener answers").status().as_u16() }
    };
    assert_eq!(get(UPSTREAM_NAME, None).await, 401, "no secret");
    assert_eq!(get(UPSTREAM_NAME, Some("not-the-secret")).await, 401, "a wrong secret");
    assert_eq!(get("evil.example", Some(common::cluster::SECRET)).await, 404, "an upstream that is not configured");
    assert_eq!(get("127.0.0.1:1", Some(common::cluster::SECRET)).await, 404, "an address");
    assert_eq!(get("fake-alias.test", Some(common::cluster::SECRET)).await, 404, "an alias, not the name");
    assert_eq!(up.total_requests(), 0, "nothing was fetched or dialed");
    let refused =
        metric(&cluster.replicas[0], "larder_peer_requests_total{direction=\"in\",kind=\"blob\",result=\"refused\"}");
    assert_eq!(refused.await, 5.0);

    // With the secret and the upstream's name: served, as to a peer.
    assert_eq!(get(UPSTREAM_NAME, Some(common::cluster::SECRET)).await, 200);
    assert_eq!(up.blob_gets(&d), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn peers_talk_tls_when_the_registry_listener_does() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[MIB, 256 * KIB, 64 * KIB, 32 * KIB]).push(&origin, "team/tls", "v1").await;
    let ca = common::TestCa::new();
    let certs = tempfile::tempdir().expect("a cert dir");
    std::fs::write(certs.path().join("ca.crt"), &ca.ca_pem).expect("write ca.crt");
    let cluster = Cluster::builder(&origin).replicas(2).https(ca).start().await;

    // Pull through the replica that owns fewer of the blobs: most come
    // from its peer, over TLS. skopeo verifies the replica's certificate,
    // the replica its peer's.
    let owned_by = |i: usize| image.blobs().iter().filter(|b| cluster.owner_of(&b.digest) == i).count();
    let (asker, peer) = if owned_by(0) <= owned_by(1) { (0, 1) } else { (1, 0) };
    let out = tempfile::tempdir().expect("an output dir");
    let args = [
        "copy".to_owned(),
        "--src-cert-dir".to_owned(),
        certs.path().display().to_string(),
        cluster.replicas[asker].image_ref("team/tls:v1"),
        format!("dir:{}", out.path().display()),
    ];
    skopeo::run(&args).await.expect("a pull over https");
    let asked = origin.access_log();
    assert_eq!(asked.blob_gets(), image.blobs().len(), "one origin GET per blob:\n{asked}");
    let from_peer =
        metric(&cluster.replicas[asker], "larder_peer_requests_total{direction=\"out\",kind=\"blob\",result=\"ok\"}");
    assert_eq!(from_peer.await, owned_by(peer) as f64, "each blob its peer owns came from the peer, over TLS");
}

#[tokio::test(flavor = "multi_thread")]
async fn node_mirrors_through_a_hub_cost_the_origin_one_get_per_blob() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[MIB, 256 * KIB, 64 * KIB]).push(&origin, "team/app", "v1").await;
    let hub = Larder::builder().upstream(&origin).start().await;
    let via = format!("via = {:?}", hub.url());
    let nodes = [
        Larder::builder().upstream(Upstream::from(&origin).line(&via)).start().await,
        Larder::builder().upstream(Upstream::from(&origin).line(&via)).start().await,
    ];
    let mark = origin.log_mark().await;
    for node in &nodes {
        let pulled = skopeo::pull(&node.image_ref("team/app:v1"), false).await.expect("pull through the node");
        assert_eq!(pulled.manifest_digest, image.digest);
    }
    let asked = origin.requests_since(&mark).await;
    // Had a node dialed the origin itself, each blob would have cost two.
    assert_eq!(asked.blob_gets(), image.blobs().len(), "one GET per blob for both nodes:\n{asked}");
}
