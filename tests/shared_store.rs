//! The shared-tier client against a real 3-node Garage cluster: blobs up
//! and down (multipart from a file, whole and by range), manifests with
//! their media type, a killed storage node, the whole store down, and the
//! `max_age` sweep. Uses larder's library directly.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::TryStreamExt;
use larder::cache::shared::{ObjectKind, SharedError, SharedStore};
use larder::oci::{Digest, MediaType};

use common::{Garage, MIB};

/// Writes `size` pseudo-random bytes to `dir/name`; returns the path, the
/// bytes and their digest.
fn blob_file(dir: &Path, name: &str, size: usize, seed: u64) -> (PathBuf, Vec<u8>, Digest) {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut bytes = Vec::with_capacity(size + 8);
    while bytes.len() < size {
        // xorshift64: fast, and no two seeds give the same content.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        bytes.extend_from_slice(&state.to_le_bytes());
    }
    bytes.truncate(size);
    let path = dir.join(name);
    std::fs::write(&path, &bytes).unwrap();
    let digest = Digest::of(&bytes);
    (path, bytes, digest)
}

async fn read_all(store: &SharedStore, digest: &Digest, range: impl std::ops::RangeBounds<u64>) -> (u64, Vec<u8>) {
    let blob = store.get_blob(digest, range).await.unwrap().expect("the blob is in the store");
    let chunks: Vec<Bytes> = blob.body.try_collect().await.unwrap();
    (blob.size, chunks.concat())
}

/// Looks `digest` up until the store answers: after losing a node, Garage
/// stalls the first requests that need it (lookups then fail after
/// LOOKUP_TIMEOUT). Panics if it never recovers.
async fn lookups_answer_again(store: &SharedStore, digest: &Digest, after: &str) {
    let started = Instant::now();
    let mut failed = 0;
    while store.head(ObjectKind::Blob, digest).await.is_err() {
        failed += 1;
        assert!(failed < 20, "the store never recovered after {after}");
    }
    eprintln!("measured: lookups answer again {:?} after {after} ({failed} failed first)", started.elapsed());
}

/// A client for `garage` without a breaker pause: these tests look at
/// every request's own outcome (the breaker is unit-tested in
/// `cache::shared`, and shown with replicas in tests/cluster_store.rs).
fn shared_store(garage: &Garage, prefix: &str) -> Arc<SharedStore> {
    let store = SharedStore::new(&garage.shared_config(prefix)).unwrap();
    Arc::new(store.with_breaker(Duration::ZERO, Duration::ZERO))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_blob_goes_up_multipart_and_comes_back_whole_and_by_range() {
    let garage = Garage::builder().start().await;
    let store = shared_store(&garage, "mirror/v1");
    let dir = tempfile::tempdir().unwrap();
    let (path, bytes, digest) = blob_file(dir.path(), "big", 64 * MIB, 1);

    assert_eq!(store.head(ObjectKind::Blob, &digest).await.unwrap(), None, "not there before the upload");
    assert!(store.get_blob(&digest, ..).await.unwrap().is_none(), "a miss is None, not an error");

    let started = Instant::now();
    assert_eq!(store.put_blob_file(&digest, &path).await.unwrap(), bytes.len() as u64);
    eprintln!("measured: 64 MiB multipart upload took {:?}", started.elapsed());
    assert_eq!(store.head(ObjectKind::Blob, &digest).await.unwrap(), Some(bytes.len() as u64));

    let started = Instant::now();
    let (size, whole) = read_all(&store, &digest, ..).await;
    eprintln!("measured: 64 MiB download took {:?}", started.elapsed());
    assert_eq!(size, bytes.len() as u64);
    assert!(Digest::of(&whole) == digest, "the whole blob comes back byte for byte");

    let (start, end) = (10 * MIB as u64 + 3, 30 * MIB as u64 + 11);
    let (size, part) = read_all(&store, &digest, start..end).await;
    assert_eq!(size, bytes.len() as u64, "the total size comes with a range");
    assert!(part == bytes[start as usize..end as usize], "a middle range");
    let resume_at = 63 * MIB as u64 + 17;
    let (_, tail) = read_all(&store, &digest, resume_at..).await;
    assert!(tail == bytes[resume_at as usize..], "resuming from an offset");

    let blob = store.get_blob(&digest, resume_at..).await.unwrap().unwrap();
    assert_eq!(blob.range, resume_at..bytes.len() as u64);
    let body = http_body_util::BodyExt::collect(blob.into_body()).await.unwrap().to_bytes();
    assert!(body[..] == bytes[resume_at as usize..], "the same bytes as an HTTP body");
}

#[tokio::test]
async fn small_blobs_go_up_in_one_put_and_a_file_that_does_not_match_is_refused() {
    let garage = Garage::builder().start().await;
    let store = shared_store(&garage, "");
    let dir = tempfile::tempdir().unwrap();
    let (path, bytes, digest) = blob_file(dir.path(), "small", 3000, 2);
    store.put_blob_file(&digest, &path).await.unwrap();
    assert_eq!(read_all(&store, &digest, ..).await.1, bytes);

    // A committed file that rotted on disk: hashed while read, not uploaded.
    let (other_path, _, _) = blob_file(dir.path(), "rotted", 12 * MIB, 3);
    let claimed = Digest::of(b"what the file should have held");
    let e = store.put_blob_file(&claimed, &other_path).await.unwrap_err();
    assert!(matches!(e, SharedError::Corrupt { .. }), "{e}");
    assert_eq!(store.head(ObjectKind::Blob, &claimed).await.unwrap(), None, "no wrong object appeared");

    let e = store.put_blob_file(&digest, &dir.path().join("gone")).await.unwrap_err();
    assert!(matches!(e, SharedError::Local { .. }), "{e}");

    // A bucket that does not exist: lookups miss, uploads fail (never
    // taken for done).
    let mut missing = garage.shared_config("");
    missing.bucket = "no-such-bucket".to_owned();
    let nowhere = SharedStore::new(&missing).unwrap();
    assert_eq!(nowhere.head(ObjectKind::Blob, &digest).await.unwrap(), None);
    let e = nowhere.put_blob_file(&digest, &path).await.unwrap_err();
    assert!(matches!(e, SharedError::Store(_)), "{e}");
    let manifest = Bytes::from_static(b"{}");
    assert!(nowhere.put_manifest(&Digest::of(&manifest), MediaType::OciManifest, manifest).await.is_err());
    let (big_path, _, big_digest) = blob_file(dir.path(), "big", 9 * MIB, 11);
    assert!(nowhere.put_blob_file(&big_digest, &big_path).await.is_err(), "multipart too");

    store.delete(ObjectKind::Blob, &digest).await.unwrap();
    assert_eq!(store.head(ObjectKind::Blob, &digest).await.unwrap(), None);
    store.delete(ObjectKind::Blob, &digest).await.unwrap();
}

#[tokio::test]
async fn manifests_keep_their_media_type_and_are_verified() {
    let garage = Garage::builder().start().await;
    let store = shared_store(&garage, "m");
    let index = Bytes::from_static(
        br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}"#,
    );
    let digest = Digest::of(&index);
    store.put_manifest(&digest, MediaType::OciIndex, index.clone()).await.unwrap();
    let got = store.get_manifest(&digest).await.unwrap().expect("stored");
    assert_eq!(got.media_type, MediaType::OciIndex);
    assert_eq!(got.bytes, index);
    assert_eq!(store.head(ObjectKind::Manifest, &digest).await.unwrap(), Some(index.len() as u64));
    assert_eq!(store.head(ObjectKind::Blob, &digest).await.unwrap(), None, "manifests and blobs are apart");

    let docker = Bytes::from_static(br#"{"schemaVersion":2,"config":{}}"#);
    let docker_digest = Digest::of(&docker);
    store.put_manifest(&docker_digest, MediaType::DockerManifest, docker.clone()).await.unwrap();
    assert_eq!(store.get_manifest(&docker_digest).await.unwrap().unwrap().media_type, MediaType::DockerManifest);

    let e = store.put_manifest(&Digest::of(b"else"), MediaType::OciManifest, docker.clone()).await.unwrap_err();
    assert!(matches!(e, SharedError::Corrupt { .. }), "{e}");
    assert!(store.get_manifest(&Digest::of(b"nothing")).await.unwrap().is_none());

    // An object whose bytes do not hash to its key (written around
    // larder's checks) is reported corrupt, not returned.
    let wanted = Digest::of(b"the manifest that should be there");
    raw_put(&garage, &format!("m/manifests/sha256/{}", wanted.hex().as_str()), b"not the bytes").await;
    let e = store.get_manifest(&wanted).await.unwrap_err();
    assert!(matches!(e, SharedError::Corrupt { .. }), "{e}");
}

/// PUTs `body` at `key` in the test bucket, bypassing larder's checks.
async fn raw_put(garage: &Garage, key: &str, body: &'static [u8]) {
    let raw = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(garage.endpoint())
        .with_allow_http(true)
        .with_region(garage.region())
        .with_bucket_name(garage.bucket())
        .with_access_key_id(garage.access_key_id())
        .with_secret_access_key(garage.secret_access_key())
        .build()
        .unwrap();
    let attributes = object_store::Attributes::from_iter([(
        object_store::Attribute::ContentType,
        "application/vnd.oci.image.manifest.v1+json",
    )]);
    let options = object_store::PutOptions { attributes, ..Default::default() };
    object_store::ObjectStore::put_opts(&raw, &object_store::path::Path::from(key), body.into(), options)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_storage_node_killed_reads_and_writes_go_on() {
    let mut garage = Garage::builder().start().await;
    let store = shared_store(&garage, "");
    let dir = tempfile::tempdir().unwrap();
    let (before_path, before, before_digest) = blob_file(dir.path(), "before", 9 * MIB, 5);
    store.put_blob_file(&before_digest, &before_path).await.unwrap();

    garage.kill(2);
    // Garage may stall requests that need the dead node for a few seconds
    // until it notices the dead connection; lookups give up after
    // LOOKUP_TIMEOUT instead of hanging (the caller goes to a peer or
    // upstream meanwhile). Count them until the store answers again.
    lookups_answer_again(&store, &before_digest, "the kill").await;
    let (_, read) = read_all(&store, &before_digest, ..).await;
    assert!(read == before, "a blob written before the failure reads back");

    let (after_path, after, after_digest) = blob_file(dir.path(), "after", 9 * MIB, 6);
    store.put_blob_file(&after_digest, &after_path).await.unwrap();
    assert!(read_all(&store, &after_digest, ..).await.1 == after, "a blob written during the failure reads back");
    let manifest = Bytes::from_static(br#"{"schemaVersion":2}"#);
    store.put_manifest(&Digest::of(&manifest), MediaType::OciManifest, manifest.clone()).await.unwrap();
    assert_eq!(store.get_manifest(&Digest::of(&manifest)).await.unwrap().unwrap().bytes, manifest);

    garage.start_node(2).await;
    assert!(read_all(&store, &after_digest, ..).await.1 == after, "still there after the node is back");
}

#[tokio::test]
async fn one_storage_node_stopped_for_maintenance_is_no_trouble() {
    let mut garage = Garage::builder().start().await;
    let store = shared_store(&garage, "");
    let dir = tempfile::tempdir().unwrap();
    let (before_path, before, before_digest) = blob_file(dir.path(), "before", 1000, 10);
    store.put_blob_file(&before_digest, &before_path).await.unwrap();
    garage.stop(1).await;
    assert!(!garage.is_running(1));
    lookups_answer_again(&store, &before_digest, "the stop").await;
    assert_eq!(read_all(&store, &before_digest, ..).await.1, before);
    let (path, bytes, digest) = blob_file(dir.path(), "during", 1000, 9);
    store.put_blob_file(&digest, &path).await.unwrap();
    assert_eq!(read_all(&store, &digest, ..).await.1, bytes);
}

#[tokio::test]
async fn with_every_node_down_requests_fail_and_do_not_hang() {
    let mut garage = Garage::builder().start().await;
    let store = shared_store(&garage, "");
    let dir = tempfile::tempdir().unwrap();
    let (path, _, digest) = blob_file(dir.path(), "b", 1000, 7);
    store.put_blob_file(&digest, &path).await.unwrap();
    garage.kill_all();

    let started = Instant::now();
    let e = store.head(ObjectKind::Blob, &digest).await.unwrap_err();
    eprintln!("measured: HEAD with the store down failed after {:?}: {e}", started.elapsed());
    let started = Instant::now();
    let e = store.get_blob(&digest, ..).await.err().expect("GET fails");
    eprintln!("measured: GET with the store down failed after {:?}: {e}", started.elapsed());
    let started = Instant::now();
    let e = store.put_blob_file(&digest, &path).await.unwrap_err();
    eprintln!("measured: PUT with the store down failed after {:?}: {e}", started.elapsed());
    assert!(matches!(e, SharedError::Store(_)), "{e}");
    let started = Instant::now();
    let e = store.get_manifest(&digest).await.unwrap_err();
    eprintln!("measured: manifest GET with the store down failed after {:?}: {e}", started.elapsed());
}

#[tokio::test]
async fn a_sweep_deletes_only_objects_older_than_max_age() {
    let garage = Garage::builder().start().await;
    let store = shared_store(&garage, "swept");
    let neighbour = shared_store(&garage, "neighbour");
    let dir = tempfile::tempdir().unwrap();
    let (path, _, digest) = blob_file(dir.path(), "b", 2000, 8);
    store.put_blob_file(&digest, &path).await.unwrap();
    neighbour.put_blob_file(&digest, &path).await.unwrap();
    let manifest = Bytes::from_static(br#"{"schemaVersion":2,"layers":[]}"#);
    store.put_manifest(&Digest::of(&manifest), MediaType::OciManifest, manifest.clone()).await.unwrap();

    let kept = store.sweep(Duration::from_secs(3600)).await.unwrap();
    assert_eq!((kept.listed, kept.deleted), (2, 0), "nothing is an hour old");
    assert!(store.head(ObjectKind::Blob, &digest).await.unwrap().is_some());

    tokio::time::sleep(Duration::from_millis(20)).await;
    let swept = store.sweep(Duration::ZERO).await.unwrap();
    assert_eq!((swept.listed, swept.deleted), (2, 2));
    assert!(store.head(ObjectKind::Blob, &digest).await.unwrap().is_none());
    assert!(store.head(ObjectKind::Manifest, &Digest::of(&manifest)).await.unwrap().is_none());
    assert!(neighbour.head(ObjectKind::Blob, &digest).await.unwrap().is_some(), "other prefixes are left alone");
}
