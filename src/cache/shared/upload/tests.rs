//! The upload queue's tests: its transitions in every interleaving of an
//! enqueue with an upload finishing, and attempts given up (deadline,
//! stop, removal) or crashing (a panic) against an in-memory object store
//! that can hold multipart parts, count aborts and panic on a PUT.

use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, ObjectStoreExt,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, UploadPart,
};

use super::*;

// ---- transitions, in every interleaving ---------------------------------

const DONE: u8 = u8::MAX;

fn job() -> Job {
    Job { kind: ObjectKind::Blob, digest: Digest::of(b"committed again") }
}

/// The queue, the item's marker on disk, and how far each enqueue and the
/// upload finishing (`w`) got.
#[derive(Clone)]
struct World {
    q: Queue,
    marker: bool,
    enqueues: Vec<u8>,
    w: u8,
}

/// One step of enqueue `i` as `Uploads::enqueue` runs it: a transition,
/// the marker's write, a transition. False when it would only wait.
fn enqueue_step(world: &mut World, i: usize) -> bool {
    match world.enqueues[i] {
        0 => match world.q.begin_enqueue(job()) {
            Enqueue::Write => world.enqueues[i] = 1,
            Enqueue::Done => world.enqueues[i] = DONE,
            Enqueue::Wait => return false,
        },
        1 => {
            world.marker = true;
            world.enqueues[i] = 2;
        }
        _ => {
            world.q.end_enqueue(job(), true);
            world.enqueues[i] = DONE;
        }
    }
    true
}

/// One step of the upload finishing as `settle` runs it (the upload ended:
/// uploaded, present, or its file was gone).
fn finish_step(world: &mut World) {
    match world.w {
        0 => match world.q.begin_finish(job()) {
            Finish::Again => world.w = DONE,
            Finish::RemoveMarker => world.w = 1,
        },
        1 => {
            world.marker = false;
            world.w = 2;
        }
        _ => {
            world.q.end_finish(job());
            world.w = DONE;
        }
    }
}

/// Every end state reachable from `world`, over all interleavings.
fn every_end(world: World, ends: &mut Vec<World>) {
    if world.w == DONE && world.enqueues.iter().all(|e| *e == DONE) {
        ends.push(world);
        return;
    }
    let mut progressed = false;
    for i in 0..world.enqueues.len() {
        if world.enqueues[i] != DONE {
            let mut next = world.clone();
            if enqueue_step(&mut next, i) {
                progressed = true;
                every_end(next, ends);
            }
        }
    }
    if world.w != DONE {
        progressed = true;
        let mut next = world.clone();
        finish_step(&mut next);
        every_end(next, ends);
    }
    assert!(progressed, "deadlock: an enqueue waits for nothing");
}

#[test]
fn an_enqueue_that_races_an_upload_finishing_is_never_lost() {
    // The item is being uploaded (its marker on disk); the blob is
    // committed again, twice, and enqueued while the upload ends.
    let mut q = Queue::default();
    assert_eq!(q.begin_enqueue(job()), Enqueue::Write);
    q.end_enqueue(job(), true);
    assert_eq!(q.pop(), Some(job()));
    let mut ends = Vec::new();
    every_end(World { q, marker: true, enqueues: vec![0, 0], w: 0 }, &mut ends);
    // An enqueue that meets the item finishing waits for it, so the
    // orders differ in where each enqueue's first step falls.
    assert!(ends.len() >= 6, "every order of the three operations' steps: {}", ends.len());
    for end in &ends {
        assert_eq!(end.q.state(&job()), Some(queue::State::Waiting), "queued again");
        assert_eq!(*end.q.waiting(), [job()], "once");
        assert!(end.marker, "with its marker on disk: it survives a crash");
    }
}

/// The protocol before this queue, as a model: an enqueue returned at once
/// when the item was pending, and an upload ending removed the marker, then
/// forgot the item.
#[derive(Clone)]
struct OldWorld {
    pending: bool,
    marker: bool,
    e: u8,
    w: u8,
}

fn old_ends(world: OldWorld, ends: &mut Vec<OldWorld>) {
    if world.e == DONE && world.w == DONE {
        ends.push(world);
        return;
    }
    if world.e != DONE {
        let mut next = world.clone();
        match next.e {
            0 if next.pending => next.e = DONE,
            0 => next.e = 1,
            1 => {
                next.marker = true;
                next.e = 2;
            }
            _ => {
                next.pending = true;
                next.e = DONE;
            }
        }
        old_ends(next, ends);
    }
    if world.w != DONE {
        let mut next = world.clone();
        match next.w {
            0 => {
                next.marker = false;
                next.w = 1;
            }
            _ => {
                next.pending = false;
                next.w = DONE;
            }
        }
        old_ends(next, ends);
    }
}

#[test]
fn the_same_check_finds_the_race_of_the_protocol_before() {
    let mut ends = Vec::new();
    old_ends(OldWorld { pending: true, marker: true, e: 0, w: 0 }, &mut ends);
    let lost = ends.iter().filter(|w| !w.pending || !w.marker).count();
    assert!(lost > 0, "some interleaving loses the enqueue (returned OK, nothing queued or no marker)");
}

#[test]
fn removing_a_waiting_item_takes_it_out_of_the_line_and_an_enqueue_meanwhile_waits() {
    let mut q = Queue::default();
    assert_eq!(q.begin_enqueue(job()), Enqueue::Write);
    q.end_enqueue(job(), true);
    assert_eq!(q.cancel(job()), Cancel::RemoveMarker);
    assert!(q.waiting().is_empty());
    assert_eq!(q.begin_enqueue(job()), Enqueue::Wait, "its marker is being removed");
    q.end_finish(job());
    assert_eq!(q.begin_enqueue(job()), Enqueue::Write, "then written again");
    q.end_enqueue(job(), true);
    assert_eq!(q.pop(), Some(job()));
    assert_eq!(q.cancel(job()), Cancel::StopAttempt, "a running one is told to stop");
    assert_eq!(q.begin_finish(job()), Finish::RemoveMarker);
}

// ---- attempts given up, against an in-memory store -----------------------

/// What the test store does and saw.
#[derive(Debug)]
struct Hooks {
    /// Multipart parts wait while this is false.
    parts_open: watch::Sender<bool>,
    parts_started: AtomicUsize,
    completes: AtomicUsize,
    aborts: AtomicUsize,
    /// PUTs to panic on.
    panics_left: AtomicUsize,
}

/// `object_store`'s in-memory store, with [`Hooks`].
#[derive(Debug)]
struct TestStore {
    inner: InMemory,
    hooks: Arc<Hooks>,
}

impl std::fmt::Display for TestStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TestStore")
    }
}

#[derive(Debug)]
struct HeldUpload {
    inner: Box<dyn MultipartUpload>,
    hooks: Arc<Hooks>,
}

#[async_trait::async_trait]
impl MultipartUpload for HeldUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        self.hooks.parts_started.fetch_add(1, Ordering::SeqCst);
        let mut open = self.hooks.parts_open.subscribe();
        let part = self.inner.put_part(data);
        Box::pin(async move {
            let _ = open.wait_for(|o| *o).await;
            part.await
        })
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        self.hooks.completes.fetch_add(1, Ordering::SeqCst);
        self.inner.complete().await
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        self.hooks.aborts.fetch_add(1, Ordering::SeqCst);
        self.inner.abort().await
    }
}

#[async_trait::async_trait]
impl ObjectStore for TestStore {
    async fn put_opts(
        &self,
        location: &ObjectPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        let panic = self.hooks.panics_left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        assert!(panic.is_err(), "the store client panicked (a bug somewhere below the queue)");
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjectPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(HeldUpload { inner, hooks: Arc::clone(&self.hooks) }))
    }

    async fn get_opts(&self, location: &ObjectPath, options: GetOptions) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjectPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjectPath>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&ObjectPath>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&ObjectPath>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &ObjectPath, to: &ObjectPath, options: CopyOptions) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

/// A queue over a [`TestStore`], a cache folder with one committed blob of
/// `size` bytes, and the uploader running.
struct Rig {
    dir: tempfile::TempDir,
    hooks: Arc<Hooks>,
    store: Arc<TestStore>,
    uploads: Uploads,
    digest: Digest,
    stop: watch::Sender<()>,
    worker: tokio::task::JoinHandle<()>,
}

/// How long a test waits for what must happen promptly (a guard against
/// hangs, not a timing assertion).
const PATIENCE: Duration = Duration::from_secs(30);

fn blob_path_in(dir: &Path) -> BlobPath {
    let root = dir.join("blobs");
    Arc::new(move |d: &Digest| root.join(d.hex().as_str()))
}

impl Rig {
    async fn start(size: usize, limits: Limits) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..size).map(|i| (i as u64).wrapping_mul(2_654_435_761) as u8).collect();
        let digest = Digest::of(&bytes);
        std::fs::create_dir_all(dir.path().join("blobs")).unwrap();
        std::fs::write((blob_path_in(dir.path()))(&digest), &bytes).unwrap();
        let hooks = Arc::new(Hooks {
            parts_open: watch::channel(false).0,
            parts_started: AtomicUsize::new(0),
            completes: AtomicUsize::new(0),
            aborts: AtomicUsize::new(0),
            panics_left: AtomicUsize::new(0),
        });
        let store = Arc::new(TestStore { inner: InMemory::new(), hooks: Arc::clone(&hooks) });
        let shared = Arc::new(SharedStore::from_object_store(Arc::clone(&store) as Arc<dyn ObjectStore>, "b", ""));
        let uploads = Uploads::open_with(dir.path(), shared, blob_path_in(dir.path()), limits).await.unwrap();
        let (stop, shutdown) = watch::channel(());
        let worker = uploads.spawn(shutdown);
        Rig { dir, hooks, store, uploads, digest, stop, worker }
    }

    fn marker(&self) -> PathBuf {
        self.dir.path().join("uploads/blob").join(self.digest.hex().as_str())
    }

    fn file(&self) -> PathBuf {
        (blob_path_in(self.dir.path()))(&self.digest)
    }

    async fn until(&self, what: &str, done: impl Fn(&Rig) -> bool) {
        let started = Instant::now();
        while !done(self) {
            assert!(started.elapsed() < PATIENCE, "gave up waiting until {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn in_store(&self) -> bool {
        let key = ObjectPath::from(format!("blobs/sha256/{}", self.digest.hex().as_str()));
        self.store.inner.head(&key).await.is_ok()
    }
}

/// Open descriptors of this process that point at `path` (deleted or not).
fn open_descriptors_to(path: &Path) -> usize {
    let target = path.display().to_string();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|link| link.display().to_string().starts_with(&target))
        .count()
}

/// A multipart upload of three parts: more than are sent at once, so the
/// upload still reads the file while its first parts are held.
const MULTIPART: usize = 2 * crate::cache::shared::PART_SIZE as usize + 1024;

#[tokio::test]
async fn an_upload_that_runs_out_of_time_is_aborted_each_time_and_given_up_after_the_limit() {
    let gave_up = || metrics().shared_uploads.with_label_values(&["blob", "gave_up"]).get();
    let before = gave_up();
    let limits = Limits {
        deadline_base: Duration::from_millis(100),
        min_rate: u64::MAX,
        max_deadline_failures: 3,
        backoff_min: Duration::from_millis(10),
    };
    let rig = Rig::start(MULTIPART, limits).await;
    rig.uploads.enqueue_blob(rig.digest).await.unwrap();
    rig.until("the upload is given up", |r| r.uploads.pending() == 0).await;
    assert_eq!(rig.hooks.aborts.load(Ordering::SeqCst), 3, "every attempt's multipart upload was aborted");
    assert_eq!(rig.hooks.completes.load(Ordering::SeqCst), 0);
    assert_eq!(gave_up() - before, 1, "counted once");
    assert!(!rig.marker().exists(), "not retried on the next start either");
    assert!(!rig.in_store().await);
}

#[tokio::test]
async fn stopping_aborts_the_multipart_upload_in_flight_and_keeps_its_marker() {
    let mut rig = Rig::start(MULTIPART, Limits::default()).await;
    rig.uploads.enqueue_blob(rig.digest).await.unwrap();
    rig.until("a part is being sent", |r| r.hooks.parts_started.load(Ordering::SeqCst) > 0).await;
    rig.stop.send(()).unwrap();
    tokio::time::timeout(PATIENCE, &mut rig.worker).await.expect("the uploader stops").unwrap();
    assert_eq!(rig.hooks.aborts.load(Ordering::SeqCst), 1, "the multipart upload was aborted");
    assert_eq!(rig.hooks.completes.load(Ordering::SeqCst), 0);
    assert!(rig.marker().exists(), "it runs again on the next start");
}

#[tokio::test]
async fn a_blob_removed_from_the_cache_stops_its_upload_and_its_file_is_closed() {
    let rig = Rig::start(MULTIPART, Limits::default()).await;
    rig.uploads.enqueue_blob(rig.digest).await.unwrap();
    rig.until("a part is being sent", |r| r.hooks.parts_started.load(Ordering::SeqCst) > 0).await;
    assert_eq!(open_descriptors_to(&rig.file()), 1, "the upload holds the file open");

    // Evicted: the file is unlinked, then its upload cancelled.
    std::fs::remove_file(rig.file()).unwrap();
    rig.uploads.cancel_blob(rig.digest).await;
    rig.until("the upload is given up", |r| r.uploads.pending() == 0).await;
    assert_eq!(rig.hooks.aborts.load(Ordering::SeqCst), 1, "its multipart upload was aborted");
    // (A read already on the blocking pool may hold it a moment longer.)
    rig.until("the file is closed: its disk space is free again", |r| open_descriptors_to(&r.file()) == 0).await;
    assert!(!rig.marker().exists(), "nothing left to upload");
    assert!(!rig.in_store().await);
}

#[tokio::test]
async fn an_upload_whose_task_panics_is_retried_not_left_pending_for_ever() {
    let limits = Limits { backoff_min: Duration::from_millis(10), ..Limits::default() };
    let rig = Rig::start(4096, limits).await;
    rig.hooks.panics_left.store(1, Ordering::SeqCst);
    rig.uploads.enqueue_blob(rig.digest).await.unwrap();
    rig.until("the upload is done", |r| r.uploads.pending() == 0).await;
    assert_eq!(rig.hooks.panics_left.load(Ordering::SeqCst), 0, "the first attempt panicked");
    assert!(rig.in_store().await, "the second uploaded it");
    assert!(!rig.marker().exists());
}

#[tokio::test]
async fn an_enqueue_while_the_upload_runs_makes_it_run_again() {
    let rig = Rig::start(MULTIPART, Limits::default()).await;
    rig.uploads.enqueue_blob(rig.digest).await.unwrap();
    rig.until("a part is being sent", |r| r.hooks.parts_started.load(Ordering::SeqCst) > 0).await;
    rig.uploads.enqueue_blob(rig.digest).await.unwrap();
    assert_eq!(rig.uploads.pending(), 1, "one item");
    rig.hooks.parts_open.send_replace(true);
    rig.until("both runs are done", |r| r.uploads.pending() == 0).await;
    assert_eq!(rig.hooks.completes.load(Ordering::SeqCst), 1, "uploaded once; the second run found it present");
    assert!(rig.in_store().await);
    assert!(!rig.marker().exists());
}

#[test]
fn markers_are_found_again_and_strays_removed() {
    let dir = tempfile::tempdir().unwrap();
    let blob = Job { kind: ObjectKind::Blob, digest: Digest::of(b"blob") };
    let manifest = Job { kind: ObjectKind::Manifest, digest: Digest::of(b"{}") };
    write_marker(&marker_path(dir.path(), &blob), &[]).unwrap();
    write_marker(&marker_path(dir.path(), &manifest), b"application/vnd.oci.image.manifest.v1+json\n{}").unwrap();
    std::fs::write(dir.path().join("blob/.tmp-half-written"), b"x").unwrap();
    let mut found = scan(dir.path()).unwrap();
    found.sort_by_key(|j| j.kind.as_str());
    assert_eq!(found, vec![blob, manifest]);
    assert!(!dir.path().join("blob/.tmp-half-written").exists());
    let content = std::fs::read(marker_path(dir.path(), &manifest)).unwrap();
    let (media_type, bytes) = parse_manifest_marker(&content).unwrap();
    assert_eq!((media_type, &bytes[..]), (MediaType::OciManifest, &b"{}"[..]));
    assert!(parse_manifest_marker(b"text/plain\n{}").is_none());
}

#[test]
fn backoff_doubles_up_to_the_cap() {
    let limits = Limits::default();
    assert_eq!(limits.backoff(1), RETRY_BACKOFF_MIN);
    assert_eq!(limits.backoff(2), RETRY_BACKOFF_MIN * 2);
    assert_eq!(limits.backoff(3), RETRY_BACKOFF_MIN * 4);
    assert_eq!(limits.backoff(40), RETRY_BACKOFF_MAX);
}
