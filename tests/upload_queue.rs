//! The durable upload queue against a real 3-node Garage cluster: markers
//! on disk outlive the uploader (a store outage, then a restart), objects
//! the store already has are not uploaded again, and a blob whose file is
//! gone is dropped. One test in this file: it reads process-wide metrics.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use larder::cache::shared::{ObjectKind, SharedStore};
use larder::cache::upload::{BlobPath, Uploads};
use larder::metrics::metrics;
use larder::oci::{Digest, MediaType};

use common::{Garage, MIB};

/// How long the queue may take to drain in this test.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);

/// A cache dir with committed blob files at `blobs/<hex>`.
struct CacheDir {
    dir: tempfile::TempDir,
}

impl CacheDir {
    fn new() -> CacheDir {
        CacheDir { dir: tempfile::tempdir().unwrap() }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn blob_path(&self) -> BlobPath {
        let root = self.dir.path().join("blobs");
        Arc::new(move |d: &Digest| root.join(d.hex().as_str()))
    }

    /// Commits `size` bytes derived from `seed`; returns their digest.
    fn commit(&self, size: usize, seed: u8) -> (Digest, Vec<u8>) {
        let bytes: Vec<u8> = (0..size).map(|i| ((i as u64 * 2654435761) >> 7) as u8 ^ seed).collect();
        let digest = Digest::of(&bytes);
        std::fs::create_dir_all(self.path().join("blobs")).unwrap();
        std::fs::write((self.blob_path())(&digest), &bytes).unwrap();
        (digest, bytes)
    }

    fn markers(&self) -> Vec<PathBuf> {
        let mut found = Vec::new();
        for kind in ["blob", "manifest"] {
            if let Ok(entries) = std::fs::read_dir(self.path().join("uploads").join(kind)) {
                found.extend(entries.map(|e| e.unwrap().path()));
            }
        }
        found.sort();
        found
    }
}

fn uploads(kind: &str, result: &str) -> u64 {
    metrics().shared_uploads.with_label_values(&[kind, result]).get()
}

/// PUT requests (single and multipart) that reached the store.
fn puts() -> u64 {
    ["put", "put_multipart"].iter().map(|op| metrics().shared_requests.with_label_values(&[op, "ok"]).get()).sum()
}

async fn drained(queue: &Uploads) {
    let started = Instant::now();
    while queue.pending() > 0 {
        assert!(started.elapsed() < DRAIN_TIMEOUT, "{} uploads still pending after {DRAIN_TIMEOUT:?}", queue.pending());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_uploads_survive_a_restart_and_present_objects_are_not_uploaded_again() {
    let garage = Garage::builder().start().await;
    let store = Arc::new(SharedStore::new(&garage.shared_config("q")).unwrap());
    let cache = CacheDir::new();
    let (big, big_bytes) = cache.commit(20 * MIB, 1);
    let (small, _) = cache.commit(5000, 2);
    let (already, _) = cache.commit(7000, 3);
    let manifest =
        Bytes::from_static(br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json"}"#);
    let manifest_digest = Digest::of(&manifest);

    // 1. The store is unreachable: items are queued durably, attempts fail
    //    and are retried later, and nothing is lost when the uploader stops.
    let dead_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut dead_config = garage.shared_config("q");
    dead_config.endpoint = Some(format!("http://127.0.0.1:{dead_port}"));
    let dead = Arc::new(SharedStore::new(&dead_config).unwrap());
    let queue = Uploads::open(cache.path(), dead, cache.blob_path()).await.unwrap();
    let (stop, shutdown) = tokio::sync::watch::channel(());
    let worker = queue.spawn(shutdown);
    let failed_before = uploads("blob", "failed");
    for digest in [big, small, already] {
        queue.enqueue_blob(digest).await.unwrap();
    }
    queue.enqueue_manifest(manifest_digest, MediaType::OciManifest, manifest.clone()).await.unwrap();
    queue.enqueue_blob(small).await.unwrap();
    assert_eq!(queue.pending(), 4, "an item is queued once");
    assert_eq!(cache.markers().len(), 4, "one marker per item, on disk before enqueue returns");
    let started = Instant::now();
    while uploads("blob", "failed") == failed_before {
        assert!(started.elapsed() < DRAIN_TIMEOUT, "no upload was attempted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), worker).await.expect("the uploader stops on shutdown").unwrap();
    assert_eq!(cache.markers().len(), 4, "failed uploads keep their markers");
    drop(queue);

    // 2. Another replica uploaded one of them meanwhile.
    store.put_blob_file(&already, &(cache.blob_path())(&already)).await.unwrap();

    // 3. Restart: the markers are the queue.
    let (puts_before, present_before, uploaded_before) =
        (puts(), uploads("blob", "present"), uploads("blob", "uploaded"));
    let manifests_before = uploads("manifest", "uploaded");
    let queue = Uploads::open(cache.path(), Arc::clone(&store), cache.blob_path()).await.unwrap();
    assert_eq!(queue.pending(), 4, "every marker is pending again after the restart");
    assert_eq!(metrics().pending_uploads.get(), 4);
    let (_stop, shutdown) = tokio::sync::watch::channel(());
    let _worker = queue.spawn(shutdown);
    drained(&queue).await;

    assert_eq!(cache.markers(), Vec::<PathBuf>::new(), "markers go once the objects are in the store");
    assert_eq!(metrics().pending_uploads.get(), 0);
    assert_eq!(uploads("blob", "present") - present_before, 1, "the blob another replica uploaded is skipped");
    assert_eq!(uploads("blob", "uploaded") - uploaded_before, 2);
    assert_eq!(uploads("manifest", "uploaded") - manifests_before, 1);
    assert_eq!(puts() - puts_before, 3, "three PUTs: the present object is not uploaded again");
    assert_eq!(store.head(ObjectKind::Blob, &big).await.unwrap(), Some(big_bytes.len() as u64));
    assert_eq!(store.head(ObjectKind::Blob, &small).await.unwrap(), Some(5000));
    let got = store.get_manifest(&manifest_digest).await.unwrap().expect("the manifest was uploaded");
    assert_eq!((got.media_type, got.bytes), (MediaType::OciManifest, manifest.clone()));

    // 4. Enqueued again (a second fill of the same blob): HEAD, no PUT.
    let puts_before = puts();
    queue.enqueue_blob(big).await.unwrap();
    queue.enqueue_manifest(manifest_digest, MediaType::OciManifest, manifest).await.unwrap();
    drained(&queue).await;
    assert_eq!(puts(), puts_before, "nothing is uploaded twice");

    // 5. A blob evicted before its turn: dropped, not retried forever.
    let (gone, _) = cache.commit(3000, 4);
    std::fs::remove_file((cache.blob_path())(&gone)).unwrap();
    let dropped_before = uploads("blob", "dropped");
    queue.enqueue_blob(gone).await.unwrap();
    drained(&queue).await;
    assert_eq!(uploads("blob", "dropped") - dropped_before, 1);
    assert_eq!(store.head(ObjectKind::Blob, &gone).await.unwrap(), None);
    assert!(cache.markers().is_empty());

    let e = queue.enqueue_manifest(Digest::of(b"other"), MediaType::OciManifest, Bytes::from_static(b"{}")).await;
    assert!(e.is_err(), "bytes that do not match the digest are refused");
}
