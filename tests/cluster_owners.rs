//! Cluster mode when an owner is lost, slow, hung, or configured
//! differently: replicas of larder (real processes, real peer listeners on
//! loopback) in front of a fault-injecting fake upstream that counts every
//! request, with more than one asker each time.
//!
//! The bounds shown, for N replicas:
//! - an owner killed mid-fill costs upstream at most 2 GETs of the blob
//!   (the owner's, and the runner-up's resume), however many replicas were
//!   streaming it from the owner (here N = 4, 3 askers; the code before
//!   this test cost N);
//! - an owner that is slow but alive (a slow token service and a slow
//!   upstream, each within upstream's timeout) is waited for and not
//!   marked down: 1 upstream GET per blob for the cluster;
//! - a hung runner-up (SIGSTOP) delays an owner's answer by at most a
//!   lookup's timeout, and the owner is not marked down: 1 upstream GET;
//! - an owner that does not know an upstream yet (a rolling config change)
//!   is not taken to say "this repository lacks it": the asker asks
//!   upstream, and the client gets the blob.

mod common;
mod fake;

use std::net::SocketAddr;
use std::time::Duration;

use common::metrics::metric;
use common::{Cluster, KIB, Larder, MIB, Upstream};
use fake::client::{self, End};
use fake::{FakeUpstream, OCI_MANIFEST, REPO, UPSTREAM_NAME, blob_path, digest, image_manifest, random_bytes};
use futures_util::future::join_all;

fn address(larder: &Larder) -> SocketAddr {
    larder.host_port().parse().expect("larder's address")
}

fn upstream(up: &FakeUpstream) -> Upstream {
    Upstream::new(UPSTREAM_NAME, &up.url()).default(true)
}

/// The sum of one series over the replicas at `indexes`.
async fn total(cluster: &Cluster, indexes: &[usize], series: &str) -> f64 {
    let mut sum = 0.0;
    for &i in indexes {
        sum += metric(&cluster.replicas[i], series).await;
    }
    sum
}

#[tokio::test(flavor = "multi_thread")]
async fn an_owner_killed_mid_fill_costs_upstream_two_gets_whatever_the_number_of_askers() {
    let layer = random_bytes(64 * MIB, 51);
    let d = digest(&layer);
    // The origin stops after 16 MiB until released.
    let up = FakeUpstream::builder().blob(layer.clone()).stall_after(16 * MIB).start().await;
    let mut cluster = Cluster::builder(upstream(&up)).replicas(4).start().await;
    let ranked = cluster.ranked(&d);
    let (owner, askers) = (ranked[0], ranked[1..].to_vec());

    // Every other replica streams the blob from the owner.
    let mut readers = Vec::new();
    for &i in &askers {
        let mut reader = client::open(address(&cluster.replicas[i]), &blob_path(&d)).await;
        assert_eq!(reader.status(), 200);
        assert!(reader.read_exact(4 * MIB).await == layer[..4 * MIB], "the first bytes, through the owner");
        readers.push(reader);
    }
    assert_eq!(up.blob_gets(&d), 1, "only the owner asked the origin");

    cluster.replicas[owner].stop();
    up.release(&d);
    let rests = readers.into_iter().map(|r| r.compare_to_end(&layer[4 * MIB..]));
    for (len, end, first_difference) in join_all(rests).await {
        assert_eq!((len, end, first_difference), ((60 * MIB) as u64, End::Complete, None), "the rest, exact");
    }
    let gets: Vec<_> = up.log().into_iter().filter(|l| l.method == "GET" && l.path.ends_with(&d)).collect();
    assert_eq!(gets.len(), 2, "the owner's GET and one resume by the runner-up, for 3 askers: {gets:?}");
    assert!(gets[1].range.is_some(), "the runner-up resumed with a Range: {gets:?}");
    let from_runner_up = metric(
        &cluster.replicas[askers[1]],
        "larder_peer_requests_total{direction=\"out\",kind=\"blob\",result=\"ok\"}",
    );
    assert_eq!(from_runner_up.await, 2.0, "the third replica followed the runner-up after the owner died");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_owner_is_waited_for_not_marked_down_one_upstream_get_per_blob() {
    // Each step of the owner's fetch is within upstream's 4 s timeout, but
    // a token round trip plus the request take about 7 s: more than the
    // response timeout plus a margin, less than what an owner may take.
    let slow = Duration::from_millis(3500);
    let blob = random_bytes(256 * KIB, 52);
    let d = digest(&blob);
    let up = FakeUpstream::builder()
        .blob(blob.clone())
        .stall_headers(slow)
        .token_response(r#"{"token":"slow-token","expires_in":300}"#)
        .token_delay(slow)
        .accept_authorization("Bearer slow-token")
        .start()
        .await;
    up.set_challenge(Some(&format!(
        r#"Bearer realm="{}/token",service="fake",scope="repository:{REPO}:pull""#,
        up.url()
    )));
    let cluster = Cluster::builder(upstream(&up).line(r#"response_timeout = "4s""#)).replicas(3).start().await;
    let ranked = cluster.ranked(&d);
    let askers = &ranked[1..];

    let path = blob_path(&d);
    let asked = askers.iter().map(|&i| client::get(address(&cluster.replicas[i]), &path));
    for resp in join_all(asked).await {
        assert_eq!((resp.status(), &resp.end), (200, &End::Complete));
        assert!(resp.body == blob, "the blob, exact");
    }
    // (Each fetch is a GET answered 401, a token, and the GET with it.)
    let with_token =
        up.log().into_iter().filter(|l| l.method == "GET" && l.path.ends_with(&d) && l.authorization.is_some());
    assert_eq!(with_token.count(), 1, "one upstream GET for the cluster: the askers waited for the owner");
    assert_eq!(total(&cluster, askers, "larder_peers_marked_down_total").await, 0.0, "the owner was not marked down");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hung_runner_up_does_not_get_a_healthy_owner_marked_down() {
    let config = random_bytes(512, 53);
    let layer = random_bytes(4 * KIB, 54);
    let manifest = image_manifest((&digest(&config), config.len()), &[(&digest(&layer), layer.len())]);
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, manifest.clone()).start().await;
    let mut cluster = Cluster::builder(upstream(&up).line(r#"response_timeout = "4s""#)).replicas(4).start().await;
    // The tag's owner asks its runner-up what it holds before upstream.
    let ranked = cluster.ranked(&format!("{UPSTREAM_NAME}/{REPO}:v1"));
    let (owner, runner_up, askers) = (ranked[0], ranked[1], ranked[2..].to_vec());
    cluster.replicas[runner_up].pause();

    let path = format!("/v2/{REPO}/manifests/v1");
    let asked =
        askers.iter().map(|&i| client::get_with(address(&cluster.replicas[i]), &path, &[("Accept", OCI_MANIFEST)]));
    for resp in join_all(asked).await {
        assert_eq!(resp.status(), 200);
        assert!(resp.body == manifest, "the manifest, exact");
    }
    cluster.replicas[runner_up].resume();
    assert_eq!(up.manifest_gets("v1"), 1, "one upstream GET of the tag for the cluster");
    assert_eq!(total(&cluster, &askers, "larder_peers_marked_down_total").await, 0.0, "the owner was not marked down");
    assert_eq!(metric(&cluster.replicas[owner], "larder_peers_marked_down_total").await, 0.0, "nor the runner-up");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_owner_that_does_not_know_an_upstream_yet_is_not_taken_to_say_a_repository_lacks_a_blob() {
    let blob = random_bytes(64 * KIB, 55);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    // Every replica has the fake as "fake.test" and, added in a config
    // change being rolled out, as "other.test".
    let mut cluster =
        Cluster::builder(upstream(&up)).upstream(Upstream::new("other.test", &up.url())).replicas(3).start().await;
    let ranked = cluster.ranked(&d);
    let (owner, askers) = (ranked[0], ranked[1..].to_vec());
    // The owner has not got the change yet.
    cluster.replicas[owner].edit_config(|text| {
        let start = text.find("[[upstream]]\nname = \"other.test\"").expect("the new upstream's table");
        let end = text[start..].find("\n\n").map_or(text.len(), |e| start + e);
        format!("{}{}", &text[..start], &text[end..])
    });
    cluster.replicas[owner].restart().await;

    for &i in &askers {
        let asker = address(&cluster.replicas[i]);
        // Cached for one repository (the owner's 404 for the unknown
        // upstream sent the asker to upstream), then asked for another:
        // membership is checked with the owner first.
        let first = client::get(asker, &format!("/v2/other.test/team/one/blobs/{d}")).await;
        assert_eq!((first.status(), first.body == blob), (200, true));
        let second = client::get(asker, &format!("/v2/other.test/team/two/blobs/{d}")).await;
        assert_eq!(second.status(), 200, "the owner's unknown upstream is no answer about team/two");
        assert!(second.body == blob);
    }
    assert_eq!(up.requests("HEAD", &format!("/v2/team/two/blobs/{d}")), 2, "each asker confirmed with upstream");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_owner_remembers_what_it_confirmed_with_upstream_for_a_peer() {
    let blob = random_bytes(64 * KIB, 56);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let mut cluster = Cluster::builder(upstream(&up)).replicas(3).start().await;
    let ranked = cluster.ranked(&d);
    let (owner, askers) = (ranked[0], ranked[1..].to_vec());
    for &i in &askers {
        let got = client::get(address(&cluster.replicas[i]), &format!("/v2/team/one/blobs/{d}")).await;
        assert_eq!((got.status(), got.body == blob), (200, true));
    }
    // The owner lost its disk: the askers hold the blob, it does not.
    cluster.replicas[owner].stop();
    std::fs::remove_dir_all(cluster.replicas[owner].cache_dir()).expect("wipe the owner's cache");
    cluster.replicas[owner].restart().await;

    // Each asker asks the owner whether team/two has it before serving it.
    for &i in &askers {
        let got = client::get(address(&cluster.replicas[i]), &format!("/v2/team/two/blobs/{d}")).await;
        assert_eq!((got.status(), got.body == blob), (200, true));
    }
    assert_eq!(
        up.requests("HEAD", &format!("/v2/team/two/blobs/{d}")),
        1,
        "the owner asked upstream for the first asker and remembered the answer for the second"
    );
}

/// A "replica" that answers every request with error headers and then
/// never sends the body it announced.
async fn stalling_peer() -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind on 127.0.0.1");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf).await;
            let head =
                "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n";
            let _ = stream.write_all(head.as_bytes()).await;
            held.push(stream);
        }
    });
    (url, task)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_peer_that_stalls_its_error_body_costs_a_bounded_wait_not_a_hang() {
    let (stalling, task) = stalling_peer().await;
    let ports = [common::free_port(), common::free_port()];
    let mine: Vec<String> = ports.iter().map(|p| format!("http://127.0.0.1:{p}")).collect();
    let members = [mine[0].clone(), mine[1].clone(), stalling.clone()];
    let ring = larder::cluster::ring::Ring::new(members.iter().map(String::as_str));
    // A blob the stalling "replica" owns.
    let blob = (0..)
        .map(|seed| random_bytes(16 * KIB, 200 + seed))
        .find(|b| ring.owner(&digest(b)).copied() == Some(stalling.as_str()))
        .expect("some blob is owned by the stalling peer");
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let dir = tempfile::tempdir().expect("a temp dir");
    std::fs::write(dir.path().join("secret"), common::cluster::SECRET).expect("the secret");
    let list: Vec<String> = members.iter().map(|m| format!("{m:?}")).collect();
    let mut askers = Vec::new();
    for (port, me) in ports.iter().zip(&mine) {
        let table = format!(
            "[cluster]\nlisten = \"127.0.0.1:{port}\"\nself = {me:?}\npeers = [{}]\nsecret_file = {:?}\n",
            list.join(", "),
            dir.path().join("secret").display().to_string()
        );
        askers.push(Larder::builder().upstream(upstream(&up)).append_toml(&table).start().await);
    }
    let path = blob_path(&digest(&blob));
    for asker in &askers {
        let got = tokio::time::timeout(fake::PATIENCE, client::get(address(asker), &path))
            .await
            .expect("no hang: the owner's stalled error body is given up on");
        assert_eq!((got.status(), got.body == blob), (200, true), "fetched from upstream instead");
    }
    assert_eq!(up.blob_gets(&digest(&blob)), 2, "each asker went upstream after the owner failed");
    task.abort();
}
