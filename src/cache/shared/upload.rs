//! The durable upload queue: verified content waiting to go to the shared
//! tier. After a blob or manifest is verified and committed locally, the
//! facade enqueues it; a marker file under `<cache dir>/uploads/` is
//! written and fsynced before `enqueue_*` returns, and removed only after
//! the object is in the store (or there is nothing left to upload). So an
//! upload interrupted by a crash, a restart or a store outage is picked up
//! again on the next start: the markers are the queue.
//!
//! - `uploads/blob/<hex>`: empty; the bytes are the committed blob file.
//! - `uploads/manifest/<hex>`: the media type, a newline, the manifest.
//!
//! A background task uploads [`UPLOAD_CONCURRENCY`] items at a time, skips
//! objects the store already has (a HEAD first: another replica may have
//! uploaded it), and after a failure pauses with a growing backoff, since
//! a failing store fails every item alike. A blob whose file is gone or no
//! longer matches its digest is dropped, not retried.
//!
//! An upload in flight is given up when its deadline passes, when larder
//! stops, or when its blob is removed from the cache (evicted, purged):
//! its file is closed at once (an evicted blob's disk space comes back)
//! and a multipart upload is aborted, so no parts pile up in the bucket. A
//! blob that runs out of time [`MAX_DEADLINE_FAILURES`] times in a row is
//! given up (`larder_shared_uploads_total{result="gave_up"}`, alerted):
//! the store is too slow for it, and retrying from byte 0 for ever would
//! hold an upload slot for ever.
//!
//! Each item moves through `State` under one lock, with the marker's
//! write and removal between two transitions: an enqueue that meets an
//! upload finishing waits for it, and one that meets an upload running
//! makes it run again instead of finishing, so no enqueue is ever lost
//! (see the interleaving test at the bottom).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{ObjectKind, PutFailed, SharedError, SharedStore};
use crate::blocking::blocking;
use crate::error::Error;
use crate::metrics::metrics;
use crate::oci::{Digest, MediaType};

/// Uploads in flight at once. Each multipart upload holds about three
/// parts of memory ([`super::PARTS_IN_FLIGHT`] + 1).
pub const UPLOAD_CONCURRENCY: usize = 2;
/// Pause after the first failed upload; doubled per failure in a row.
pub const RETRY_BACKOFF_MIN: Duration = Duration::from_secs(1);
/// Longest pause between attempts while the store keeps failing.
pub const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(60);
/// Every upload attempt may take this long, plus [`UPLOAD_MIN_RATE`] time
/// for its bytes; a store that stops reading (a full TCP window never
/// trips a read timeout) cannot hold an upload slot for ever.
pub const UPLOAD_DEADLINE_BASE: Duration = Duration::from_secs(30);
/// The slowest upload rate, in bytes per second, an attempt is allowed.
pub const UPLOAD_MIN_RATE: u64 = 1 << 20;
/// Attempts of one item that may run out of time before it is
/// given up: its marker is removed, `result="gave_up"` counted and
/// alerted (`LarderSharedUploadsGivenUp`). The blob stays cached locally;
/// the next replica to fetch it from upstream uploads it again.
pub const MAX_DEADLINE_FAILURES: u32 = 3;
/// How long a stop waits for the uploads in flight to abort their
/// multipart uploads before it leaves them to the bucket's lifecycle rule.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// The queue's limits ([`Limits::default`] in production; tests shrink them).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// See [`UPLOAD_DEADLINE_BASE`].
    pub deadline_base: Duration,
    /// See [`UPLOAD_MIN_RATE`].
    pub min_rate: u64,
    /// See [`MAX_DEADLINE_FAILURES`].
    pub max_deadline_failures: u32,
    /// See [`RETRY_BACKOFF_MIN`].
    pub backoff_min: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            deadline_base: UPLOAD_DEADLINE_BASE,
            min_rate: UPLOAD_MIN_RATE,
            max_deadline_failures: MAX_DEADLINE_FAILURES,
            backoff_min: RETRY_BACKOFF_MIN,
        }
    }
}

impl Limits {
    /// The deadline of one attempt to upload `size` bytes.
    fn deadline(&self, size: u64) -> Duration {
        self.deadline_base + Duration::from_secs(size / self.min_rate.max(1))
    }

    /// The pause after `failures` failures in a row: [`Limits::backoff_min`]
    /// doubled per failure, at most [`RETRY_BACKOFF_MAX`].
    fn backoff(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(16);
        self.backoff_min.saturating_mul(1 << doublings).min(RETRY_BACKOFF_MAX)
    }
}

/// Where the committed file of a blob is (the disk store's layout).
pub type BlobPath = Arc<dyn Fn(&Digest) -> PathBuf + Send + Sync>;

mod markers;
mod queue;

use markers::{marker_path, parse_manifest_marker, remove_marker, scan, write_marker};
use queue::{Cancel, Enqueue, Finish, Job, Queue};

/// Why an attempt was given up before it ended by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// Its blob left the cache (evicted, purged).
    Removed,
    /// larder is stopping.
    Shutdown,
}

/// How one attempt ended.
#[derive(Debug)]
enum Outcome {
    Uploaded,
    Present,
    /// Nothing valid to upload (file gone or wrong); the marker is removed.
    Dropped(String),
    /// The store failed; retried after a pause.
    Failed(SharedError),
    /// Its deadline passed (the multipart upload was aborted).
    TimedOut(Duration),
    /// Given up (see [`Stop`]; a multipart upload was aborted).
    Stopped(Stop),
}

struct Inner {
    dir: PathBuf,
    store: Arc<SharedStore>,
    blob_path: BlobPath,
    limits: Limits,
    // A std Mutex: held for a transition, never across `.await`.
    queue: Mutex<Queue>,
    /// How to stop each attempt in flight.
    stops: Mutex<HashMap<Job, watch::Sender<Option<Stop>>>>,
    /// Wakes the uploader: something was queued.
    wake: Notify,
    /// Bumped after every transition an enqueue may wait for.
    changed: watch::Sender<u64>,
}

/// The queue's handle; clone it freely.
#[derive(Clone)]
pub struct Uploads {
    inner: Arc<Inner>,
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stops(&self) -> std::sync::MutexGuard<'_, HashMap<Job, watch::Sender<Option<Stop>>>> {
        self.stops.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn marker(&self, job: &Job) -> PathBuf {
        marker_path(&self.dir, job)
    }

    /// Runs a transition and updates the gauge.
    fn transition<T>(&self, f: impl FnOnce(&mut Queue) -> T) -> T {
        let mut q = self.lock();
        let out = f(&mut q);
        metrics().pending_uploads.set(q.pending() as i64);
        out
    }

    fn changed(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Removes the marker of a finishing item, then forgets the item.
    async fn remove_marker_and_finish(&self, job: Job) {
        let marker = self.marker(&job);
        if let Err(e) = blocking(move || remove_marker(&marker)).await {
            tracing::warn!(%job.digest, error = %e, "removing an upload marker failed");
        }
        self.transition(|q| q.end_finish(job));
        self.changed();
    }
}

impl Uploads {
    /// Opens the queue under `<cache_dir>/uploads/` and queues every marker
    /// a previous run left. `blob_path` says where a committed blob's file
    /// is. Nothing is uploaded until [`Uploads::spawn`].
    pub async fn open(cache_dir: &Path, store: Arc<SharedStore>, blob_path: BlobPath) -> Result<Uploads, Error> {
        Uploads::open_with(cache_dir, store, blob_path, Limits::default()).await
    }

    /// [`Uploads::open`] with other [`Limits`].
    pub async fn open_with(
        cache_dir: &Path,
        store: Arc<SharedStore>,
        blob_path: BlobPath,
        limits: Limits,
    ) -> Result<Uploads, Error> {
        let dir = cache_dir.join("uploads");
        let scan_dir = dir.clone();
        let found = blocking(move || scan(&scan_dir)).await?;
        let inner = Arc::new(Inner {
            dir,
            store,
            blob_path,
            limits,
            queue: Mutex::default(),
            stops: Mutex::default(),
            wake: Notify::new(),
            changed: watch::channel(0).0,
        });
        let resumed = found.len();
        inner.transition(|q| {
            for job in found {
                if q.begin_enqueue(job) == Enqueue::Write {
                    q.end_enqueue(job, true);
                }
            }
        });
        if resumed > 0 {
            tracing::info!(resumed, "resuming uploads to the shared tier");
        }
        Ok(Uploads { inner })
    }

    /// Items waiting or being uploaded.
    pub fn pending(&self) -> usize {
        self.inner.lock().pending()
    }

    /// Uploads in flight right now.
    pub fn in_flight(&self) -> usize {
        self.inner.stops().len()
    }

    /// Queues the committed blob `digest` for upload. Returns once its
    /// marker is on disk (fsynced), so the upload survives a crash.
    pub async fn enqueue_blob(&self, digest: Digest) -> Result<(), Error> {
        self.enqueue(Job { kind: ObjectKind::Blob, digest }, Vec::new()).await
    }

    /// Queues a verified manifest for upload; the marker keeps its bytes
    /// and media type (the local index is not this queue's to read).
    pub async fn enqueue_manifest(&self, digest: Digest, media_type: MediaType, bytes: Bytes) -> Result<(), Error> {
        if Digest::of(&bytes) != digest {
            return Err(Error::Internal(format!("manifest bytes do not match {digest}: not queued")));
        }
        let mut content = Vec::with_capacity(media_type.as_str().len() + 1 + bytes.len());
        content.extend_from_slice(media_type.as_str().as_bytes());
        content.push(b'\n');
        content.extend_from_slice(&bytes);
        self.enqueue(Job { kind: ObjectKind::Manifest, digest }, content).await
    }

    async fn enqueue(&self, job: Job, content: Vec<u8>) -> Result<(), Error> {
        loop {
            let (step, mut changes) = {
                let changes = self.inner.changed.subscribe();
                (self.inner.transition(|q| q.begin_enqueue(job)), changes)
            };
            match step {
                Enqueue::Done => return Ok(()),
                Enqueue::Wait => {
                    // The sender lives as long as `inner`, which we hold.
                    let _ = changes.changed().await;
                }
                Enqueue::Write => {
                    let (path, content) = (self.inner.marker(&job), content);
                    let written = blocking(move || write_marker(&path, &content)).await;
                    self.inner.transition(|q| q.end_enqueue(job, written.is_ok()));
                    self.inner.changed();
                    self.inner.wake.notify_one();
                    return written;
                }
            }
        }
    }

    /// The blob `digest` left the cache: its upload, waiting or in flight,
    /// is given up (an attempt in flight closes the file and aborts its
    /// multipart upload), and its marker removed.
    pub async fn cancel_blob(&self, digest: Digest) {
        let job = Job { kind: ObjectKind::Blob, digest };
        match self.inner.transition(|q| q.cancel(job)) {
            Cancel::Nothing => {}
            Cancel::RemoveMarker => {
                metrics().shared_uploads.with_label_values(&["blob", "dropped"]).inc();
                tracing::debug!(%digest, "blob removed from the cache; not uploading it");
                self.inner.remove_marker_and_finish(job).await;
            }
            Cancel::StopAttempt => {
                if let Some(stop) = self.inner.stops().get(&job) {
                    stop.send_replace(Some(Stop::Removed));
                }
            }
        }
    }

    /// Uploads queued items until `shutdown`. Then the uploads in flight
    /// are given up: each aborts its multipart upload (waited for up to
    /// [`STOP_GRACE`]); their markers stay, so they run again on the next
    /// start. Only what a crash cuts off is left to the bucket's
    /// `AbortIncompleteMultipartUpload` rule (see README).
    pub fn spawn(&self, mut shutdown: crate::shutdown::Shutdown) -> tokio::task::JoinHandle<()> {
        let inner = Arc::clone(&self.inner);
        tokio::spawn(async move {
            let mut running: JoinSet<(Job, Outcome)> = JoinSet::new();
            let mut tasks: HashMap<tokio::task::Id, Job> = HashMap::new();
            let mut failures: u32 = 0;
            let mut paused_until: Option<Instant> = None;
            loop {
                if paused_until.is_some_and(|t| t <= Instant::now()) {
                    paused_until = None;
                }
                while paused_until.is_none() && running.len() < UPLOAD_CONCURRENCY {
                    let Some(job) = inner.transition(Queue::pop) else { break };
                    let (stop, stopped) = watch::channel(None);
                    inner.stops().insert(job, stop);
                    let attempt_inner = Arc::clone(&inner);
                    let handle = running.spawn(async move { (job, attempt(&attempt_inner, job, stopped).await) });
                    tasks.insert(handle.id(), job);
                }
                let resume = paused_until.unwrap_or_else(Instant::now);
                tokio::select! {
                    _ = shutdown.changed() => {
                        stop_all(&inner, &mut running, &mut tasks).await;
                        return;
                    }
                    Some(done) = running.join_next_with_id(), if !running.is_empty() => {
                        let (job, outcome) = match done {
                            Ok((id, done)) => {
                                tasks.remove(&id);
                                done
                            }
                            // A panic in an attempt: its job is retried, not lost.
                            Err(e) => {
                                let Some(job) = tasks.remove(&e.id()) else { continue };
                                let why = if e.is_panic() { "the upload task panicked" } else { "the upload task was cancelled" };
                                (job, Outcome::Failed(SharedError::Store(why.into())))
                            }
                        };
                        inner.stops().remove(&job);
                        if let Some(pause) = settle(&inner, job, outcome, &mut failures).await {
                            paused_until = Some(Instant::now() + pause);
                        }
                    }
                    () = inner.wake.notified() => {}
                    () = tokio::time::sleep_until(resume), if paused_until.is_some() => {}
                }
            }
        })
    }
}

/// Gives up every upload in flight (they abort their multipart uploads)
/// and waits up to [`STOP_GRACE`] for them to end. Their markers stay.
async fn stop_all(inner: &Inner, running: &mut JoinSet<(Job, Outcome)>, tasks: &mut HashMap<tokio::task::Id, Job>) {
    for stop in inner.stops().values() {
        stop.send_replace(Some(Stop::Shutdown));
    }
    let deadline = Instant::now() + STOP_GRACE;
    loop {
        match tokio::time::timeout_at(deadline, running.join_next()).await {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) => {
                tracing::warn!(
                    left = running.len(),
                    "uploads did not stop in time; leaving their parts to the bucket's lifecycle rule"
                );
                running.shutdown().await;
                break;
            }
        }
    }
    tasks.clear();
    inner.stops().clear();
}

/// Records how an attempt ended; returns the pause before the next
/// attempt after a failure.
async fn settle(inner: &Inner, job: Job, outcome: Outcome, failures: &mut u32) -> Option<Duration> {
    let kind = job.kind.as_str();
    let result = match &outcome {
        Outcome::Uploaded => "uploaded",
        Outcome::Present => "present",
        Outcome::Dropped(_) | Outcome::Stopped(Stop::Removed) => "dropped",
        Outcome::Failed(_) | Outcome::TimedOut(_) => "failed",
        // Not an outcome: it runs again on the next start.
        Outcome::Stopped(Stop::Shutdown) => return None,
    };
    metrics().shared_uploads.with_label_values(&[kind, result]).inc();
    let retry = match outcome {
        Outcome::Failed(e) => {
            tracing::warn!(%job.digest, kind, error = %e, "upload to the shared tier failed");
            true
        }
        Outcome::TimedOut(deadline) => {
            let timed_out = inner.transition(|q| q.ran_out_of_time(job));
            if timed_out >= inner.limits.max_deadline_failures {
                metrics().shared_uploads.with_label_values(&[kind, "gave_up"]).inc();
                tracing::error!(%job.digest, kind, attempts = timed_out, ?deadline,
                    "upload to the shared tier ran out of time every attempt; giving it up");
                false
            } else {
                tracing::warn!(%job.digest, kind, ?deadline, attempt = timed_out, "upload to the shared tier ran out of time");
                true
            }
        }
        Outcome::Dropped(why) => {
            tracing::warn!(%job.digest, kind, reason = %why, "not uploading to the shared tier");
            false
        }
        Outcome::Stopped(_) => {
            tracing::debug!(%job.digest, kind, "removed from the cache during its upload; given up");
            false
        }
        Outcome::Uploaded | Outcome::Present => {
            tracing::debug!(%job.digest, kind, result, "shared tier has it");
            false
        }
    };
    if retry {
        *failures = failures.saturating_add(1);
        inner.transition(|q| q.requeue(job));
        let pause = inner.limits.backoff(*failures);
        tracing::debug!(retry_in = ?pause, "pausing uploads after a failure");
        return Some(pause);
    }
    *failures = 0;
    match inner.transition(|q| q.begin_finish(job)) {
        Finish::Again => inner.changed(),
        Finish::RemoveMarker => inner.remove_marker_and_finish(job).await,
    }
    None
}

/// One upload of `job`, given up when `stopped` says so.
async fn attempt(inner: &Inner, job: Job, mut stopped: watch::Receiver<Option<Stop>>) -> Outcome {
    let stop = async move {
        match stopped.wait_for(Option::is_some).await {
            Ok(stop) => stop.unwrap_or(Stop::Shutdown),
            // The queue is gone: larder is stopping.
            Err(_) => Stop::Shutdown,
        }
    };
    match job.kind {
        ObjectKind::Blob => {
            let path = (inner.blob_path)(&job.digest);
            let stat_path = path.clone();
            let local_size = match blocking(move || Ok(std::fs::metadata(&stat_path)?.len())).await {
                Ok(size) => size,
                Err(e) => return Outcome::Dropped(format!("committed file {}: {e}", path.display())),
            };
            match inner.store.head(ObjectKind::Blob, &job.digest).await {
                // Same size under a digest key: the same bytes (readers hash).
                Ok(Some(size)) if size == local_size => return Outcome::Present,
                Ok(_) => {}
                Err(e) => return Outcome::Failed(e),
            }
            let deadline = inner.limits.deadline(local_size);
            let until = async {
                tokio::select! {
                    () = tokio::time::sleep(deadline) => None,
                    stop = stop => Some(stop),
                }
            };
            match inner.store.put_blob_file_until(&job.digest, &path, until).await {
                Ok(_) => Outcome::Uploaded,
                Err(PutFailed::Stopped(None)) => Outcome::TimedOut(deadline),
                Err(PutFailed::Stopped(Some(stop))) => Outcome::Stopped(stop),
                Err(PutFailed::Store(e @ (SharedError::Local { .. } | SharedError::Corrupt { .. }))) => {
                    Outcome::Dropped(e.to_string())
                }
                Err(PutFailed::Store(e)) => Outcome::Failed(e),
            }
        }
        ObjectKind::Manifest => {
            let marker = inner.marker(&job);
            let read = blocking(move || Ok(std::fs::read(&marker)?)).await;
            let Some((media_type, bytes)) = read.ok().as_deref().and_then(parse_manifest_marker) else {
                return Outcome::Dropped("unreadable manifest marker".into());
            };
            if Digest::of(&bytes) != job.digest {
                return Outcome::Dropped("manifest marker does not match its digest".into());
            }
            match inner.store.head(ObjectKind::Manifest, &job.digest).await {
                Ok(Some(_)) => return Outcome::Present,
                Ok(None) => {}
                Err(e) => return Outcome::Failed(e),
            }
            let deadline = inner.limits.deadline(bytes.len() as u64);
            tokio::select! {
                put = inner.store.put_manifest(&job.digest, media_type, bytes) => match put {
                    Ok(()) => Outcome::Uploaded,
                    Err(e @ SharedError::Corrupt { .. }) => Outcome::Dropped(e.to_string()),
                    Err(e) => Outcome::Failed(e),
                },
                () = tokio::time::sleep(deadline) => Outcome::TimedOut(deadline),
                stop = stop => Outcome::Stopped(stop),
            }
        }
    }
}

#[cfg(test)]
mod tests;
