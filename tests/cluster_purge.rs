//! A purge in a cluster: asked of one replica, it takes effect on every
//! replica (through the peer listener, with the cluster secret), so the
//! next pull through any replica resolves the tag with upstream again
//! instead of getting the old mapping back from an owner. A replica that
//! is down is reported, and `larder purge` says so and fails. Real larder
//! processes, a real 3-node Garage cluster as the shared tier, and a fake
//! upstream that counts requests.

mod common;
mod fake;

use std::net::SocketAddr;
use std::process::Command;

use common::metrics::admin_address;
use common::{Cluster, Garage, Larder, Upstream};
use fake::client;
use fake::{FakeUpstream, KIB, OCI_MANIFEST, REPO, UPSTREAM_NAME, blob_path, digest, image_manifest, random_bytes};

fn address(larder: &Larder) -> SocketAddr {
    larder.host_port().parse().expect("larder's address")
}

/// An image `test/app:v1` (a config and two layers) on a fake upstream.
async fn image() -> (FakeUpstream, Vec<String>) {
    let config = random_bytes(512, 91);
    let layers = [random_bytes(256 * KIB, 92), random_bytes(64 * KIB, 93)];
    let manifest = image_manifest(
        (&digest(&config), config.len()),
        &[(&digest(&layers[0]), layers[0].len()), (&digest(&layers[1]), layers[1].len())],
    );
    let blobs = vec![digest(&config), digest(&layers[0]), digest(&layers[1])];
    let up = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, manifest)
        .blob(config)
        .blob(layers[0].clone())
        .blob(layers[1].clone())
        .start()
        .await;
    (up, blobs)
}

/// Pulls `test/app:v1` through `larder`: the manifest by tag, then each blob.
async fn pull(larder: &Larder, blobs: &[String]) {
    let m = client::get_with(address(larder), &format!("/v2/{REPO}/manifests/v1"), &[("Accept", OCI_MANIFEST)]).await;
    assert_eq!(m.status(), 200, "the manifest through {}", larder.url());
    for b in blobs {
        let got = client::get(address(larder), &blob_path(b)).await;
        assert_eq!(got.status(), 200);
        assert_eq!(digest(&got.body), *b, "the blob, exact");
    }
}

/// `POST /purge` on `larder`'s admin listener: the JSON it answers.
async fn purge(larder: &Larder) -> serde_json::Value {
    let url = format!("http://{}/purge?upstream={UPSTREAM_NAME}&repo={REPO}", admin_address(larder));
    // A loopback admin listener without a token file needs the token larder generated.
    let token = std::fs::read_to_string(larder.cache_dir().join("admin-token")).expect("the generated admin token");
    let resp = reqwest::Client::new().post(url).bearer_auth(token.trim()).send().await.expect("POST /purge");
    assert_eq!(resp.status(), 200);
    serde_json::from_slice(&resp.bytes().await.expect("body")).expect("JSON")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_purge_on_one_replica_takes_effect_on_every_replica() {
    let (up, blobs) = image().await;
    let garage = Garage::builder().start().await;
    let cluster = Cluster::builder(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
        .replicas(3)
        .shared(&garage, "purge")
        .start()
        .await;
    for r in &cluster.replicas {
        pull(r, &blobs).await;
    }
    assert_eq!(up.manifest_gets("v1"), 1, "the tag was resolved once for the cluster");

    let answer = purge(&cluster.replicas[0]).await;
    assert_eq!(answer["tags"], 1, "this replica's own counts, as without peers: {answer}");
    let replicas = answer["replicas"].as_array().expect("a list of the other replicas");
    assert_eq!(replicas.len(), 2, "{answer}");
    for r in replicas {
        assert_eq!(r["result"], "purged", "{answer}");
        assert!(r["purged"]["members"].as_u64().unwrap_or(0) > 0, "each had memberships to forget: {answer}");
    }

    // Every replica asks again: the tag goes to upstream once more (the
    // owner resolves it for all), nothing comes back from an old mapping.
    let tags_before = up.manifest_gets("v1");
    for r in &cluster.replicas {
        pull(r, &blobs).await;
    }
    assert_eq!(up.manifest_gets("v1") - tags_before, 1, "the tag resolved with upstream again, once for the cluster");
    for b in &blobs {
        // The shared tier's objects are left: the blobs come back from it,
        // once upstream confirmed the repository has them.
        assert_eq!(up.blob_gets(b), 1, "{b} was not fetched from upstream again");
    }
    assert!(up.requests("HEAD", &blob_path(&blobs[1])) >= 1, "membership was confirmed with upstream again");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replica_that_is_down_during_a_purge_is_reported_and_the_cli_fails() {
    let (up, blobs) = image().await;
    let mut cluster = Cluster::builder(Upstream::new(UPSTREAM_NAME, &up.url()).default(true)).replicas(3).start().await;
    for r in &cluster.replicas {
        pull(r, &blobs).await;
    }
    cluster.replicas[2].stop();

    let out = Command::new(common::larder::binary())
        .args(["purge", UPSTREAM_NAME, REPO, "--admin"])
        .arg(format!("http://{}", admin_address(&cluster.replicas[0])))
        .arg("--token-file")
        .arg(cluster.replicas[0].cache_dir().join("admin-token"))
        .env_remove("LARDER_ADMIN")
        .env_remove("LARDER_ADMIN_TOKEN")
        .env_remove("LARDER_ADMIN_TOKEN_FILE")
        .output()
        .expect("run larder purge");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "a purge that missed a replica fails:\n{stdout}\n{stderr}");
    let (purged, down) = (&cluster.peer_urls[1], &cluster.peer_urls[2]);
    assert!(stdout.contains(&format!("replica {purged}: 1 tags")), "the live replica purged:\n{stdout}");
    assert!(stdout.contains(&format!("replica {down}: down")), "the stopped one reported down:\n{stdout}");
    assert!(stderr.contains(down.as_str()), "and named in the error:\n{stderr}");
}
