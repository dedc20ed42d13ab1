//! Cluster mode and the shared tier when the store misbehaves: a real
//! 3-node Garage cluster holding objects larder did not write (planted
//! with wrong bytes, the wrong size), or answering through a proxy that
//! cuts responses off mid-stream, and replicas of larder in front of a
//! fault-injecting fake upstream that counts its requests.
//!
//! What it shows, for every replica asking at once (N = 3): a client's
//! range never ends cleanly with a byte that was not verified; an object
//! of the wrong size is counted, read only up to the blob's size (learnt
//! from its manifest, or from the membership check's `HEAD` when the
//! replica never saw the manifest), resumed from the byte it reached when
//! shorter, and mended with the verified blob; a response cut off
//! mid-stream is resumed from the byte reached.

mod common;
mod fake;

use std::net::SocketAddr;

use common::garage::{blob_key, object_size, put_object};
use common::metrics::metric;
use common::{Cluster, CutProxy, Garage, Larder, Upstream};
use fake::client::{self, End};
use fake::{FakeUpstream, MIB, OCI_MANIFEST, REPO, UPSTREAM_NAME, blob_path, digest, image_manifest, random_bytes};
use futures_util::future::join_all;

fn address(larder: &Larder) -> SocketAddr {
    larder.host_port().parse().expect("larder's address")
}

fn upstream(up: &FakeUpstream) -> Upstream {
    Upstream::new(UPSTREAM_NAME, &up.url()).default(true)
}

/// The sum of one series over every replica.
async fn total(cluster: &Cluster, series: &str) -> f64 {
    let mut sum = 0.0;
    for r in &cluster.replicas {
        sum += metric(r, series).await;
    }
    sum
}

/// Waits until the object under `key` has `size` bytes (a replica uploaded
/// a good copy), for at most a minute.
async fn object_becomes(garage: &Garage, key: &str, size: Option<u64>) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let now = object_size(garage, key).await;
        if now == size {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{key} is {now:?} bytes, never {size:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_range_never_ends_cleanly_with_a_wrong_byte_from_a_corrupt_shared_object() {
    let blob = random_bytes(4 * MIB, 21);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let garage = Garage::builder().start().await;
    let cluster = Cluster::builder(upstream(&up)).replicas(3).shared(&garage, "ranges").start().await;

    // The right size, one wrong byte inside the first MiB: what a lazy
    // pulling snapshotter asks for first.
    let mut bad = blob.to_vec();
    bad[100_000] ^= 0xff;
    put_object(&garage, &blob_key("ranges", &d), bad).await;

    let (range, path) = ([("Range", "bytes=0-1048575")], blob_path(&d));
    let asked = cluster.replicas.iter().map(|r| client::get_with(address(r), &path, &range));
    for (i, resp) in join_all(asked).await.into_iter().enumerate() {
        assert_eq!(resp.status(), 206, "replica {i}");
        assert_eq!(resp.end, End::Complete, "replica {i}: the range is served once verified");
        assert!(resp.body == blob[..MIB], "replica {i} ended a range cleanly with bytes that are not the blob's");
    }
    assert!(total(&cluster, "larder_shared_corrupt_total").await >= 1.0, "the corrupt object was counted");

    // The object was replaced by a good copy; every replica serves the blob.
    object_becomes(&garage, &blob_key("ranges", &d), Some(blob.len() as u64)).await;
    for r in &cluster.replicas {
        let (len, end, first_difference) = client::open(address(r), &blob_path(&d)).await.compare_to_end(&blob).await;
        assert_eq!((len, end, first_difference), (blob.len() as u64, End::Complete, None));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_shared_object_of_the_wrong_size_is_read_up_to_the_blobs_size_counted_and_mended() {
    let config = random_bytes(512, 31);
    let longer = random_bytes(2 * MIB, 32);
    let shorter = random_bytes(3 * MIB, 33);
    let manifest = image_manifest(
        (&digest(&config), config.len()),
        &[(&digest(&longer), longer.len()), (&digest(&shorter), shorter.len())],
    );
    let up = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, manifest)
        .blob(config)
        .blob(longer.clone())
        .blob(shorter.clone())
        .start()
        .await;
    let garage = Garage::builder().start().await;
    let cluster = Cluster::builder(upstream(&up)).replicas(3).shared(&garage, "sizes").start().await;

    // One object longer than its manifest says, one shorter (truncated):
    // both start with the right bytes.
    let mut long_object = longer.to_vec();
    long_object.extend_from_slice(&[0u8; 4096]);
    put_object(&garage, &blob_key("sizes", &digest(&longer)), long_object).await;
    put_object(&garage, &blob_key("sizes", &digest(&shorter)), shorter[..MIB].to_vec()).await;

    // Every replica pulls: the manifest (which declares the sizes), then both layers.
    let pulls = cluster.replicas.iter().map(|r| async {
        let manifest = client::get_with(address(r), "/v2/test/app/manifests/v1", &[("Accept", OCI_MANIFEST)]).await;
        assert_eq!(manifest.status(), 200);
        let mut ends = Vec::new();
        for layer in [&longer, &shorter] {
            ends.push(client::open(address(r), &blob_path(&digest(layer))).await.compare_to_end(layer).await);
        }
        ends
    });
    for ends in join_all(pulls).await {
        assert_eq!(ends[0], (longer.len() as u64, End::Complete, None), "the longer object's blob, exact");
        assert_eq!(ends[1], (shorter.len() as u64, End::Complete, None), "the truncated object's blob, exact");
    }
    // The longer object was read up to the blob's size, and its bytes
    // verified: upstream sent nothing. The shorter one was resumed from
    // the byte it reached: one upstream GET for the whole cluster.
    assert_eq!(up.blob_gets(&digest(&longer)), 0, "read up to the declared size only");
    assert_eq!(up.blob_gets(&digest(&shorter)), 1, "one upstream GET for the whole cluster");
    for layer in [&longer, &shorter] {
        // Mended: a replica uploaded the verified blob over it.
        object_becomes(&garage, &blob_key("sizes", &digest(layer)), Some(layer.len() as u64)).await;
    }
    assert!(total(&cluster, "larder_shared_corrupt_total").await >= 2.0, "both objects were counted");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replica_that_never_saw_the_manifest_learns_the_blobs_size_before_streaming_a_shared_object() {
    let longer = random_bytes(MIB + 1, 34);
    let shorter = random_bytes(3 * MIB, 35);
    let up = FakeUpstream::builder().blob(longer.clone()).blob(shorter.clone()).start().await;
    let garage = Garage::builder().start().await;
    let cluster = Cluster::builder(upstream(&up)).replicas(3).shared(&garage, "unseen").start().await;
    let mut long_object = longer.to_vec();
    long_object.extend_from_slice(&[0u8; 4096]);
    put_object(&garage, &blob_key("unseen", &digest(&longer)), long_object).await;
    put_object(&garage, &blob_key("unseen", &digest(&shorter)), shorter[..MIB].to_vec()).await;

    // Clients ask for the blobs alone, as after another replica served
    // their manifest behind a Service: no replica knows a declared size.
    // The size comes from the membership check's HEAD (before: the
    // object's own length was streamed, and the connection cut at its end).
    let pulls = cluster.replicas.iter().map(|r| async {
        let mut ends = Vec::new();
        for layer in [&longer, &shorter] {
            ends.push(client::open(address(r), &blob_path(&digest(layer))).await.compare_to_end(layer).await);
        }
        ends
    });
    for ends in join_all(pulls).await {
        assert_eq!(ends[0], (longer.len() as u64, End::Complete, None), "the longer object's blob, exact");
        assert_eq!(ends[1], (shorter.len() as u64, End::Complete, None), "the truncated object's blob, exact");
    }
    assert_eq!(up.blob_gets(&digest(&longer)), 0, "read up to the blob's size only");
    for layer in [&longer, &shorter] {
        object_becomes(&garage, &blob_key("unseen", &digest(layer)), Some(layer.len() as u64)).await;
    }
    assert!(total(&cluster, "larder_shared_corrupt_total").await >= 2.0, "both objects were counted");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_shared_object_cut_off_mid_stream_is_resumed_from_the_byte_reached() {
    let blob = random_bytes(8 * MIB, 41);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let garage = Garage::builder().start().await;
    let proxy = CutProxy::start(garage.s3_addr(0)).await;
    let cluster = Cluster::builder(upstream(&up)).replicas(3).shared_at(&garage, "cut", &proxy.url()).start().await;
    put_object(&garage, &blob_key("cut", &d), blob.to_vec()).await;

    // Every response from the store breaks after 1 MiB.
    proxy.cut_after(MIB as u64);
    let asked = cluster
        .replicas
        .iter()
        .map(|r| async { client::open(address(r), &blob_path(&d)).await.compare_to_end(&blob).await });
    for got in join_all(asked).await {
        assert_eq!(got, (blob.len() as u64, End::Complete, None), "exact, after a pause");
    }
    assert!(proxy.cuts() >= 1, "the store's answer was cut");
    let gets: Vec<_> = up.log().into_iter().filter(|l| l.method == "GET" && l.path.ends_with(&d)).collect();
    assert_eq!(gets.len(), 1, "one upstream GET for the cluster: {gets:?}");
    let from: u64 = gets[0]
        .range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes=")?.strip_suffix('-')?.parse().ok())
        .unwrap_or_else(|| panic!("the owner resumed with a Range from the byte reached: {gets:?}"));
    assert!(from > 0, "not from byte 0: {gets:?}");
}

/// Waits until no replica has uploads pending for the shared tier.
async fn uploads_settled(cluster: &Cluster) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    while total(cluster, "larder_pending_uploads").await > 0.0 {
        assert!(tokio::time::Instant::now() < deadline, "uploads still pending after 60 s");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// One series' value on each replica, in order.
async fn each(cluster: &Cluster, series: &str) -> Vec<f64> {
    let mut values = Vec::new();
    for r in &cluster.replicas {
        values.push(metric(r, series).await);
    }
    values
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cold_blob_costs_the_store_one_lookup_per_asker_and_one_upload() {
    let blob = random_bytes(2 * MIB, 61);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let garage = Garage::builder().start().await;
    let cluster = Cluster::builder(upstream(&up)).replicas(3).shared(&garage, "once").start().await;
    let ranked = cluster.ranked(&d);
    let (owner, askers) = (ranked[0], &ranked[1..]);

    let path = blob_path(&d);
    let asked = askers.iter().map(|&i| client::get(address(&cluster.replicas[i]), &path));
    for resp in join_all(asked).await {
        assert_eq!((resp.status(), resp.body == blob), (200, true));
    }
    uploads_settled(&cluster).await;
    assert_eq!(up.blob_gets(&d), 1);

    // Each asker looked in the store once; the owner, told they had, not at all.
    let gets = ["ok", "not_found", "error", "skipped"]
        .map(|result| format!("larder_shared_requests_total{{op=\"get\",result=\"{result}\"}}"));
    let mut looked = vec![0.0; cluster.replicas.len()];
    for series in &gets {
        for (i, v) in each(&cluster, series).await.into_iter().enumerate() {
            looked[i] += v;
        }
    }
    assert_eq!(looked[owner], 0.0, "the owner repeated no asker's miss: {looked:?}");
    for &i in askers {
        assert_eq!(looked[i], 1.0, "one lookup per asker: {looked:?}");
    }

    // Only the owner, which got the bytes from upstream, uploaded.
    let uploads = ["uploaded", "present", "failed", "dropped"]
        .map(|result| format!("larder_shared_uploads_total{{kind=\"blob\",result=\"{result}\"}}"));
    let mut queued = vec![0.0; cluster.replicas.len()];
    for series in &uploads {
        for (i, v) in each(&cluster, series).await.into_iter().enumerate() {
            queued[i] += v;
        }
    }
    assert_eq!(queued[owner], 1.0, "the owner uploaded it: {queued:?}");
    for &i in askers {
        assert_eq!(queued[i], 0.0, "a replica that streamed it from the owner uploads nothing: {queued:?}");
    }
    assert_eq!(object_size(&garage, &blob_key("once", &d)).await, Some(blob.len() as u64));
}

/// A store endpoint that accepts connections and never answers: lookups
/// time out. Counts the connections it accepted.
struct Blackhole {
    addr: SocketAddr,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Blackhole {
    async fn start() -> Blackhole {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind on 127.0.0.1");
        let addr = listener.local_addr().expect("address");
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = std::sync::Arc::clone(&accepted);
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(stream);
            }
        });
        Blackhole { addr, accepted, task }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_that_does_not_answer_is_skipped_for_a_while_not_waited_on_per_miss() {
    let blobs: Vec<_> = (0..6).map(|i| random_bytes(64 * 1024, 70 + i)).collect();
    let mut builder = FakeUpstream::builder();
    for b in &blobs {
        builder = builder.blob(b.clone());
    }
    let up = builder.start().await;
    let garage = Garage::builder().start().await;
    let hole = Blackhole::start().await;
    let cluster = Cluster::builder(upstream(&up))
        .replicas(3)
        .shared_at(&garage, "hole", &format!("http://{}", hole.addr))
        .start()
        .await;

    // Each blob through two replicas that do not own it, one after the other.
    for b in &blobs {
        let d = digest(b);
        for &i in &cluster.ranked(&d)[1..] {
            let resp = client::get(address(&cluster.replicas[i]), &blob_path(&d)).await;
            assert_eq!((resp.status(), resp.body == *b), (200, true));
        }
    }
    let fills = 2 * blobs.len();
    let skipped = total(&cluster, "larder_shared_requests_total{op=\"get\",result=\"skipped\"}").await;
    let waited = total(&cluster, "larder_shared_requests_total{op=\"get\",result=\"error\"}").await;
    eprintln!(
        "measured: {fills} cold fills at askers: {waited} store lookups waited out, {skipped} skipped; \
         the dead store got {} connections (uploads' HEADs included)",
        hole.accepted()
    );
    assert!(skipped > 0.0, "lookups skipped the dead store after it failed");
    assert!(waited < fills as f64, "fewer lookups waited out than fills: {waited} for {fills}");
    assert!(total(&cluster, "larder_shared_down").await >= 1.0, "the store is shown as down");
}

/// A stand-in for the EKS Pod Identity agent (the AWS credential chain's
/// `AWS_CONTAINER_CREDENTIALS_FULL_URI`): answers every GET with `keys`
/// already expired (so every request fetches them again), and
/// records the `Authorization` each request carried (the token file's text).
struct CredentialsAgent {
    url: String,
    seen: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl CredentialsAgent {
    async fn start(key_id: &str, secret: &str) -> CredentialsAgent {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind on 127.0.0.1");
        let url = format!("http://{}/v1/credentials", listener.local_addr().expect("address"));
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (key_id, secret, log) = (key_id.to_owned(), secret.to_owned(), std::sync::Arc::clone(&seen));
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                let authorization = head
                    .lines()
                    .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("authorization")))
                    .map(|(_, v)| v.trim().to_owned())
                    .unwrap_or_default();
                log.lock().unwrap().push(authorization);
                // Already expired: object_store's cache holds a key that is not
                // yet expired for 100 ms after fetching it, and this test's
                // requests can come closer together than that.
                let expires = std::time::SystemTime::now() - std::time::Duration::from_secs(1);
                let expires = humantime::format_rfc3339_seconds(expires);
                let body = format!(
                    r#"{{"AccessKeyId":"{key_id}","SecretAccessKey":"{secret}","Token":"","Expiration":"{expires}"}}"#
                );
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(resp.as_bytes()).await;
            }
        });
        CredentialsAgent { url, seen, task }
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for CredentialsAgent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn temporary_credentials_from_the_aws_chain_are_fetched_again_as_they_expire() {
    let blobs = [random_bytes(64 * 1024, 101), random_bytes(64 * 1024, 102)];
    let up = FakeUpstream::builder().blob(blobs[0].clone()).blob(blobs[1].clone()).start().await;
    let garage = Garage::builder().start().await;
    let agent = CredentialsAgent::start(garage.access_key_id(), garage.secret_access_key()).await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let token_file = dir.path().join("eks-pod-identity-token");
    std::fs::write(&token_file, "token-1").unwrap();
    // No keys in the config: the credential chain finds the agent.
    let shared = format!(
        "[shared]\nurl = \"s3://{}/chain\"\nendpoint = {:?}\nregion = \"garage\"\n",
        garage.bucket(),
        garage.endpoint()
    );
    let larder = Larder::builder()
        .upstream(upstream(&up))
        .server_line(common::metrics::ADMIN_LISTEN)
        .append_toml(&shared)
        .env("AWS_CONTAINER_CREDENTIALS_FULL_URI", &agent.url)
        .env("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", &token_file.display().to_string())
        .start()
        .await;

    for (i, blob) in blobs.iter().enumerate() {
        if i == 1 {
            // The agent's token rotates (the kubelet rewrites the file).
            std::fs::write(&token_file, "token-2").unwrap();
        }
        let d = digest(blob);
        let got = client::get(address(&larder), &blob_path(&d)).await;
        assert_eq!((got.status(), got.body == *blob), (200, true));
        object_becomes(&garage, &blob_key("chain", &d), Some(blob.len() as u64)).await;
    }
    let seen = agent.seen();
    assert!(seen.contains(&"token-1".to_owned()), "credentials fetched with the first token: {seen:?}");
    assert!(seen.contains(&"token-2".to_owned()), "and fetched again, with the rotated one: {seen:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_store_read_and_the_membership_check_run_at_once() {
    let blob = random_bytes(256 * 1024, 111);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let garage = Garage::builder().start().await;
    let proxy = CutProxy::start(garage.s3_addr(0)).await;
    put_object(&garage, &blob_key("both", &d), blob.to_vec()).await;
    // Two replicas sharing the store, without peers: upstream alone can
    // say whether a repository has the blob.
    let dir = tempfile::tempdir().expect("a temp dir");
    let shared = garage.shared_toml_at(dir.path(), "both", &proxy.url());
    let replica =
        || Larder::builder().upstream(upstream(&up)).server_line(common::metrics::ADMIN_LISTEN).append_toml(&shared);
    let replicas = [replica().start().await, replica().start().await];

    // The store holds its answers: the membership HEADs reach upstream
    // meanwhile (one after the other, they would wait for the store).
    proxy.hold_responses();
    let head = format!("/v2/{}/blobs/{d}", fake::REPO);
    let asked: Vec<_> = replicas
        .iter()
        .map(|r| {
            let (addr, path) = (address(r), blob_path(&d));
            tokio::spawn(async move { client::get(addr, &path).await })
        })
        .collect();
    fake::wait_until("both membership HEADs reached upstream", || up.requests("HEAD", &head) == 2).await;
    proxy.heal();
    for got in asked {
        let got = got.await.expect("the request task");
        assert_eq!((got.status(), got.body == blob), (200, true));
    }
    assert_eq!(up.blob_gets(&d), 0, "both read the store once upstream confirmed the repository");
}

#[tokio::test(flavor = "multi_thread")]
async fn one_replica_sweeps_the_shared_tier_for_the_cluster() {
    let up = FakeUpstream::builder().start().await;
    let garage = Garage::builder().start().await;
    let cluster = Cluster::builder(upstream(&up))
        .replicas(3)
        .shared(&garage, "swept")
        .shared_line("max_age = \"1h\"")
        .start()
        .await;
    // A sweep lists the blob and the manifest folders.
    let lists = "larder_shared_requests_total{op=\"list\",result=\"ok\"}";
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    while total(&cluster, lists).await < 2.0 {
        assert!(tokio::time::Instant::now() < deadline, "nobody swept");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // Every replica's first round runs at start: give the others a moment.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let each = each(&cluster, lists).await;
    let sweeper = cluster.owner_of(larder::cache::shared::SWEEPER_KEY);
    for (i, n) in each.iter().enumerate() {
        let expected = if i == sweeper { 2.0 } else { 0.0 };
        assert_eq!(*n, expected, "only the owner of the sweeper key lists the prefix: {each:?}");
    }
}
