//! The cache keeps its promises when the machine misbehaves: a transient
//! failure to open a blob changes nothing, `larder verify` cannot disturb a
//! running instance, eviction carries on past a file it cannot remove and
//! counts exactly what it freed, and an upstream that streams without a
//! length cannot fill the disk.

mod common;
mod fake;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use common::metrics::{ADMIN_LISTEN, metric};
use common::{Larder, Upstream};
use fake::client::{self, End};
use fake::{
    FakeUpstream, KIB, MIB, OCI_MANIFEST, REPO, UPSTREAM_NAME, blob_path, digest, image_manifest, manifest_path,
    random_bytes, wait_until,
};

fn address(larder: &Larder) -> SocketAddr {
    larder.host_port().parse().expect("larder's address")
}

fn files_in(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|entries| entries.count()).unwrap_or(0)
}

/// The lowest descriptor number free in `pid`: with the open-files limit
/// set to it, every `open(2)` the process tries fails with EMFILE.
fn lowest_free_fd(pid: u32) -> u32 {
    let used: std::collections::HashSet<u32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("list /proc/<pid>/fd")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    (0..).find(|fd| !used.contains(fd)).expect("a free descriptor")
}

/// Sets `pid`'s open-files limit to its lowest free descriptor, and checks
/// a moment later that none below it was freed meanwhile (a connection
/// the test just dropped is closed by larder a little later), else again.
async fn limit_to_descriptors_in_use(pid: u32) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let lowest = lowest_free_fd(pid);
        set_open_files_limit(pid, u64::from(lowest));
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        if lowest_free_fd(pid) == lowest {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "larder's descriptors kept changing");
    }
}

/// The soft open-files limit of `pid`, from `/proc/<pid>/limits`.
fn open_files_limit(pid: u32) -> u64 {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("read /proc/<pid>/limits");
    let line = limits.lines().find(|l| l.starts_with("Max open files")).expect("a Max open files line");
    line.split_whitespace().nth(3).and_then(|v| v.parse().ok()).expect("a soft limit")
}

/// Sets the soft limit only: lowering and raising it back needs no privilege.
fn set_open_files_limit(pid: u32, limit: u64) {
    let status = Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--nofile={limit}:"))
        .status()
        .expect("prlimit");
    assert!(status.success(), "prlimit --nofile={limit}: on {pid}");
}

/// A body read to its end with reqwest: the bytes, and whether it ended
/// cleanly (a chunked body cut off by larder is an error, not an end).
async fn read_body(resp: reqwest::Response) -> (usize, bool) {
    let mut resp = resp;
    let mut len = 0;
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => len += chunk.len(),
            Ok(None) => return (len, true),
            Err(_) => return (len, false),
        }
    }
}

/// GETs `url` and checks the body is exactly `blob`.
async fn assert_serves(url: &str, blob: &[u8]) {
    let body = reqwest::get(url).await.expect("GET").bytes().await.expect("body");
    assert!(body == blob, "GET {url}: {} bytes, expected exactly the blob's {}", body.len(), blob.len());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_blob_that_cannot_be_opened_for_now_is_a_503_that_changes_nothing() {
    let blob = random_bytes(MIB, 1);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let mut larder = Larder::builder()
        .upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
        .server_line(ADMIN_LISTEN)
        .start()
        .await;
    let url = format!("{}{}", larder.url(), blob_path(&d));
    assert_serves(&url, &blob).await;
    // A restart, so that no handle of the blob is kept open in memory.
    larder.restart().await;
    assert_eq!(metric(&larder, "larder_cache_size_bytes").await, MIB as f64);

    // One kept-alive connection, then no descriptor left for anything else.
    let http = reqwest::Client::builder().pool_max_idle_per_host(1).build().expect("client");
    assert_eq!(http.get(format!("{}/v2/", larder.url())).send().await.expect("GET /v2/").status(), 200);
    let pid = larder.pid();
    let normal = open_files_limit(pid);
    limit_to_descriptors_in_use(pid).await;
    let refused = http.get(&url).send().await.expect("an answer on the open connection");
    set_open_files_limit(pid, normal);
    assert_eq!(refused.status(), 503, "EMFILE is a retryable failure");
    let body: serde_json::Value =
        serde_json::from_slice(&refused.bytes().await.expect("body")).expect("the OCI error envelope");
    assert_eq!(body["errors"][0]["code"], "UNAVAILABLE");

    // The row and the file were kept: served from disk, no second upstream
    // GET, and the size counted once.
    let again = http.get(&url).send().await.expect("GET").bytes().await.expect("body");
    assert!(again == blob, "the cached blob, exactly");
    assert_eq!(up.blob_gets(&d), 1, "never fetched again");
    assert_eq!(metric(&larder, "larder_cache_size_bytes").await, MIB as f64);
}

#[tokio::test(flavor = "multi_thread")]
async fn verify_refuses_a_folder_a_running_larder_holds_and_touches_nothing() {
    let layer = random_bytes(4 * MIB, 2);
    let d = digest(&layer);
    let up = FakeUpstream::builder().blob(layer.clone()).stall_after(MIB).start().await;
    let larder = Larder::builder().upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true)).start().await;
    let tmp = larder.cache_dir().join("tmp");

    // A fill in flight: its temp file is in tmp/.
    let reader = client::open(address(&larder), &blob_path(&d)).await;
    assert_eq!(reader.status(), 200);
    wait_until("the fill has a temp file", || files_in(&tmp) == 1).await;

    let out = Command::new(env!("CARGO_BIN_EXE_larder"))
        .args(["verify", "--repair", "--config"])
        .arg(larder.config_path())
        .output()
        .expect("run larder verify");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "verify must refuse a folder in use:\n{stderr}");
    assert_eq!(files_in(&tmp), 1, "the running fill's temp file is still there");
    assert!(stderr.contains("in use by another larder process"), "a clear reason:\n{stderr}");

    // The fill finishes and commits; its client gets every byte.
    up.release(&d);
    let (len, end, first_difference) = reader.compare_to_end(&layer).await;
    assert_eq!((len, end, first_difference), (layer.len() as u64, End::Complete, None));
    wait_until("the blob is committed", || larder.blob_file(&d).exists()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn eviction_goes_on_past_a_file_it_cannot_remove_and_counts_exactly() {
    let blobs: Vec<_> = (0..3).map(|seed| random_bytes(MIB, 10 + seed)).collect();
    let big = random_bytes(2 * MIB, 20);
    let up = blobs.iter().chain([&big]).fold(FakeUpstream::builder(), |b, blob| b.blob(blob.clone())).start().await;
    // Eviction starts above 95 % of 4 MiB and frees down to 85 %.
    let larder = Larder::builder()
        .upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
        .max_size("4MiB")
        .cache_line(r#"max_blob_size = "4MiB""#)
        .server_line(ADMIN_LISTEN)
        .start()
        .await;
    let url = |blob: &bytes::Bytes| format!("{}{}", larder.url(), blob_path(&digest(blob)));
    for blob in &blobs {
        assert_serves(&url(blob), blob).await;
        // Distinct access times, so the order of eviction is known.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The least recently used blob's file becomes something unlink(2)
    // refuses: a folder with a file in it.
    let stuck = larder.blob_file(&digest(&blobs[0]));
    std::fs::remove_file(&stuck).expect("remove the first blob's file");
    std::fs::create_dir(&stuck).expect("a folder in its place");
    std::fs::write(stuck.join("pinned"), b"x").expect("a file in the folder");

    // 5 MiB now: the two least recently used blobs must go.
    assert_serves(&url(&big), &big).await;
    let second = larder.blob_file(&digest(&blobs[1]));
    wait_until("the second blob's file is removed", || !second.exists()).await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(stuck.is_dir(), "the folder could not be removed");
    for kept in [&blobs[2], &big] {
        assert!(larder.blob_file(&digest(kept)).is_file(), "nothing more recent was evicted");
        assert_serves(&url(kept), kept).await;
        assert_eq!(up.blob_gets(&digest(kept)), 1, "served from the cache");
    }
    assert_eq!(metric(&larder, "larder_cache_size_bytes").await, (3 * MIB) as f64, "exactly what is indexed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_chunked_blob_longer_than_max_blob_size_is_cut_off_and_not_kept() {
    // Far more than socket buffers hold, so stopping early is visible upstream.
    let blob = random_bytes(32 * MIB, 3);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).chunked().start().await;
    let larder = Larder::builder()
        .upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
        .cache_line(r#"max_blob_size = "1MiB""#)
        .start()
        .await;
    let resp = reqwest::get(format!("{}{}", larder.url(), blob_path(&d))).await.expect("GET");
    let (received, clean) = read_body(resp).await;
    assert!(!clean, "aborted, not ended, after {received} bytes");
    assert!(received <= MIB, "never more than the limit reaches a client ({received} bytes)");
    assert!(up.bytes_sent(&d) < blob.len() as u64, "larder stopped reading upstream");
    wait_until("the temp file is removed", || files_in(&larder.cache_dir().join("tmp")) == 0).await;
    assert!(!larder.blob_file(&d).exists(), "nothing committed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_blob_whose_declared_length_is_over_max_blob_size_is_refused_before_its_body() {
    let blob = random_bytes(32 * MIB, 6);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let larder = Larder::builder()
        .upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
        .cache_line(r#"max_blob_size = "1MiB""#)
        .start()
        .await;
    let resp = client::get(address(&larder), &blob_path(&d)).await;
    assert_eq!(resp.status(), 502, "refused on its Content-Length");
    assert!(up.bytes_sent(&d) < blob.len() as u64, "larder did not read the body");
    assert_eq!(files_in(&larder.cache_dir().join("tmp")), 0, "no temp file");
    assert!(!larder.blob_file(&d).exists(), "nothing committed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_chunked_blob_longer_than_its_manifest_says_is_cut_off() {
    let config = random_bytes(KIB, 4);
    let layer = random_bytes(2 * MIB, 5);
    let (cd, ld) = (digest(&config), digest(&layer));
    // The manifest declares the layer at half its real size.
    let manifest = image_manifest((&cd, config.len()), &[(&ld, MIB)]);
    let up = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, manifest)
        .blob(config)
        .blob(layer.clone())
        .chunked()
        .start()
        .await;
    let larder = Larder::builder().upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true)).start().await;
    assert_eq!(client::get(address(&larder), &manifest_path("v1")).await.status(), 200);
    let resp = reqwest::get(format!("{}{}", larder.url(), blob_path(&ld))).await.expect("GET");
    let (received, clean) = read_body(resp).await;
    assert!(!clean, "aborted, not ended, after {received} bytes");
    assert!(received <= MIB, "never more than the declared size reaches a client ({received} bytes)");
    wait_until("the temp file is removed", || files_in(&larder.cache_dir().join("tmp")) == 0).await;
    assert!(!larder.blob_file(&ld).exists(), "nothing committed");
}
