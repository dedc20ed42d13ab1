//! Uploads to the shared tier that are given up leave nothing behind in a
//! real 3-node Garage cluster: a proxy in front of Garage holds an
//! upload's body (a store that stopped reading) or lets it trickle (a
//! slow store), keeping the upload in flight, and then the uploader is
//! stopped, or the blob is purged from the cache. The multipart upload is
//! aborted (Garage counts no unfinished one, and the purged blob never
//! appears in the bucket) and the blob's file is closed (a purged blob's
//! disk space comes back).
//!
//! Deadlines, the give-up after repeated deadline failures, a panicking
//! upload and the queue's transitions are unit-tested in
//! `src/cache/upload/tests.rs`.

mod common;
mod fake;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::admin::Admin;
use common::{CutProxy, Garage, Larder, MIB, Upstream};
use fake::{FakeUpstream, UPSTREAM_NAME, blob_path, digest, random_bytes};
use larder::cache::shared::SharedStore;
use larder::cache::upload::{BlobPath, Uploads};
use larder::oci::Digest;

/// How long a test waits for what must happen promptly (a hang guard).
const PATIENCE: Duration = Duration::from_secs(30);

/// Polls `check` until it holds, for at most [`PATIENCE`].
async fn eventually<F: std::future::Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "gave up waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Open descriptors of process `pid` that point at `path` (deleted or not).
fn descriptors_to(pid: u32, path: &Path) -> usize {
    let target = path.display().to_string();
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return 0 };
    entries
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|link| link.display().to_string().starts_with(&target))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_uploader_aborts_the_multipart_upload_in_the_bucket() {
    let garage = Garage::builder().start().await;
    let proxy = CutProxy::start(garage.s3_addr(0)).await;
    let mut config = garage.shared_config("stop");
    config.endpoint = Some(proxy.url());
    let store = Arc::new(SharedStore::new(&config).unwrap());

    let dir = tempfile::tempdir().unwrap();
    let bytes = random_bytes(24 * MIB, 81);
    let d: Digest = digest(&bytes).parse().unwrap();
    let root = dir.path().join("blobs");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join(d.hex().as_str()), &bytes).unwrap();
    let blob_path: BlobPath = Arc::new(move |d: &Digest| root.join(d.hex().as_str()));

    // Small requests pass; an upload's part hangs after 1 MiB.
    proxy.stall_requests_after(MIB as u64);
    let queue = Uploads::open(dir.path(), store, blob_path).await.unwrap();
    let (stop, shutdown) = tokio::sync::watch::channel(());
    let worker = queue.spawn(shutdown);
    queue.enqueue_blob(d).await.unwrap();
    eventually("Garage holds the unfinished upload", || async { garage.incomplete_multipart_uploads().await == 1 })
        .await;

    stop.send(()).unwrap();
    tokio::time::timeout(PATIENCE, worker).await.expect("the uploader stops").unwrap();
    assert_eq!(garage.incomplete_multipart_uploads().await, 0, "aborted, not left in the bucket");
    let marker: PathBuf = dir.path().join("uploads/blob").join(d.hex().as_str());
    assert!(marker.exists(), "it runs again on the next start");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purging_a_blob_whose_upload_is_slow_closes_its_file_and_aborts_the_upload() {
    let blob = random_bytes(17 * MIB, 82);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let garage = Garage::builder().start().await;
    let proxy = CutProxy::start(garage.s3_addr(0)).await;
    let keys = tempfile::tempdir().unwrap();
    let builder = Larder::builder()
        .upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
        .append_toml(&garage.shared_toml_at(keys.path(), "purge", &proxy.url()));
    let (builder, admin) = Admin::open(builder);
    let larder = builder.start().await;

    // A slow store: an upload's parts go at 2 MiB/s, so the upload of
    // 17 MiB (8 + 8 + 1) takes a few seconds, within every timeout.
    proxy.slow_requests_after(MIB as u64, 2 * MIB as u64);
    let fetched = reqwest::get(format!("{}{}", larder.url(), blob_path(&d))).await.unwrap().bytes().await.unwrap();
    assert!(fetched == blob);
    eventually("the upload hangs in Garage", || async { garage.incomplete_multipart_uploads().await == 1 }).await;
    let file = larder.blob_file(&d);
    assert!(descriptors_to(larder.pid(), &file) >= 1, "the upload holds the blob's file open");

    // A loopback admin listener without a token file needs the token larder generated.
    let token = std::fs::read_to_string(larder.cache_dir().join("admin-token")).expect("the generated admin token");
    let purged = reqwest::Client::new()
        .post(format!("{}/purge?upstream={UPSTREAM_NAME}", admin.url()))
        .bearer_auth(token.trim())
        .send()
        .await
        .expect("POST /purge");
    assert_eq!(purged.status(), 200, "{:?}", purged.text().await);
    eventually("the upload queue is idle", || async {
        common::metrics::metric(&larder, "larder_pending_uploads").await == 0.0
    })
    .await;
    assert_eq!(descriptors_to(larder.pid(), &file), 0, "the purged blob's file is closed");
    assert_eq!(garage.incomplete_multipart_uploads().await, 0, "the upload was aborted");
    let key = common::garage::blob_key("purge", &d);
    assert_eq!(common::garage::object_size(&garage, &key).await, None, "a purged blob is not uploaded");
    assert!(!file.exists());
}
