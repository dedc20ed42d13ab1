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
//! a failing store fails every item alike. A blob whose file is gone
//! (evicted or purged before its turn) or no longer matches its digest is
//! dropped, not retried.

use std::collections::{HashSet, VecDeque};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::shared::{ObjectKind, SharedError, SharedStore};
use crate::blocking::blocking;
use crate::error::Error;
use crate::metrics::metrics;
use crate::oci::{Digest, MediaType};

/// Uploads in flight at once. Each multipart upload holds about three
/// parts of memory ([`super::shared::PARTS_IN_FLIGHT`] + 1).
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

/// Where the committed file of a blob is (the disk store's layout).
pub type BlobPath = Arc<dyn Fn(&Digest) -> PathBuf + Send + Sync>;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Job {
    kind: ObjectKind,
    digest: Digest,
}

/// How one attempt ended.
enum Outcome {
    Uploaded,
    Present,
    /// Nothing valid to upload (file gone or wrong); the marker is removed.
    Dropped(String),
    /// The store failed; retried after a pause.
    Failed(SharedError),
}

#[derive(Default)]
struct Queue {
    /// Waiting, in order.
    waiting: VecDeque<Job>,
    /// Waiting or being uploaded: an item is enqueued once.
    pending: HashSet<Job>,
}

struct Inner {
    dir: PathBuf,
    store: Arc<SharedStore>,
    blob_path: BlobPath,
    // A std Mutex: held for a push or pop, never across `.await`.
    queue: Mutex<Queue>,
    wake: Notify,
}

/// The queue's handle; clone it freely.
#[derive(Clone)]
pub struct Uploads {
    inner: Arc<Inner>,
}

fn folder(kind: ObjectKind) -> &'static str {
    match kind {
        ObjectKind::Blob => "blob",
        ObjectKind::Manifest => "manifest",
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn marker(&self, job: &Job) -> PathBuf {
        marker_path(&self.dir, job)
    }

    /// Queues `job` unless it is already pending; true if it was new.
    fn push(&self, job: Job) -> bool {
        let added = {
            let mut q = self.lock();
            let added = q.pending.insert(job);
            if added {
                q.waiting.push_back(job);
            }
            metrics().pending_uploads.set(q.pending.len() as i64);
            added
        };
        if added {
            self.wake.notify_one();
        }
        added
    }

    fn pop(&self) -> Option<Job> {
        self.lock().waiting.pop_front()
    }

    /// Puts a failed job back at the end of the line.
    fn requeue(&self, job: Job) {
        self.lock().waiting.push_back(job);
    }

    fn finish(&self, job: &Job) {
        let mut q = self.lock();
        q.pending.remove(job);
        metrics().pending_uploads.set(q.pending.len() as i64);
    }

    fn is_pending(&self, job: &Job) -> bool {
        self.lock().pending.contains(job)
    }
}

fn marker_path(dir: &Path, job: &Job) -> PathBuf {
    dir.join(folder(job.kind)).join(job.digest.hex().as_str())
}

impl Uploads {
    /// Opens the queue under `<cache_dir>/uploads/` and queues every marker
    /// a previous run left. `blob_path` says where a committed blob's file
    /// is. Nothing is uploaded until [`Uploads::spawn`].
    pub async fn open(cache_dir: &Path, store: Arc<SharedStore>, blob_path: BlobPath) -> Result<Uploads, Error> {
        let dir = cache_dir.join("uploads");
        let scan_dir = dir.clone();
        let found = blocking(move || scan(&scan_dir)).await?;
        let inner = Arc::new(Inner { dir, store, blob_path, queue: Mutex::default(), wake: Notify::new() });
        let resumed = found.len();
        for job in found {
            inner.push(job);
        }
        metrics().pending_uploads.set(inner.lock().pending.len() as i64);
        if resumed > 0 {
            tracing::info!(resumed, "resuming uploads to the shared tier");
        }
        Ok(Uploads { inner })
    }

    /// Items waiting or being uploaded.
    pub fn pending(&self) -> usize {
        self.inner.lock().pending.len()
    }

    /// Queues the committed blob `digest` for upload. Returns once its
    /// marker is on disk (fsynced), so the upload survives a crash.
    pub async fn enqueue_blob(&self, digest: Digest) -> Result<(), Error> {
        let job = Job { kind: ObjectKind::Blob, digest };
        if self.inner.is_pending(&job) {
            return Ok(());
        }
        let path = self.inner.marker(&job);
        blocking(move || write_marker(&path, &[])).await?;
        self.inner.push(job);
        Ok(())
    }

    /// Queues a verified manifest for upload; the marker keeps its bytes
    /// and media type (the local index is not this queue's to read).
    pub async fn enqueue_manifest(&self, digest: Digest, media_type: MediaType, bytes: Bytes) -> Result<(), Error> {
        let job = Job { kind: ObjectKind::Manifest, digest };
        if self.inner.is_pending(&job) {
            return Ok(());
        }
        if Digest::of(&bytes) != digest {
            return Err(Error::Internal(format!("manifest bytes do not match {digest}: not queued")));
        }
        let path = self.inner.marker(&job);
        blocking(move || {
            let mut content = Vec::with_capacity(media_type.as_str().len() + 1 + bytes.len());
            content.extend_from_slice(media_type.as_str().as_bytes());
            content.push(b'\n');
            content.extend_from_slice(&bytes);
            write_marker(&path, &content)
        })
        .await?;
        self.inner.push(job);
        Ok(())
    }

    /// Uploads queued items until `shutdown`. Uploads in flight then are
    /// abandoned; their markers stay, so they run again on the next start
    /// (an abandoned multipart upload is cleaned by the bucket's
    /// `AbortIncompleteMultipartUpload` rule, see README).
    pub fn spawn(&self, mut shutdown: crate::shutdown::Shutdown) -> tokio::task::JoinHandle<()> {
        let inner = Arc::clone(&self.inner);
        tokio::spawn(async move {
            let mut running: JoinSet<(Job, Outcome)> = JoinSet::new();
            let mut failures: u32 = 0;
            let mut paused_until: Option<Instant> = None;
            loop {
                if paused_until.is_some_and(|t| t <= Instant::now()) {
                    paused_until = None;
                }
                while paused_until.is_none() && running.len() < UPLOAD_CONCURRENCY {
                    let Some(job) = inner.pop() else { break };
                    let inner = Arc::clone(&inner);
                    running.spawn(async move { (job, attempt(&inner, job).await) });
                }
                let resume = paused_until.unwrap_or_else(Instant::now);
                tokio::select! {
                    _ = shutdown.changed() => {
                        running.shutdown().await;
                        return;
                    }
                    Some(done) = running.join_next(), if !running.is_empty() => {
                        let Ok((job, outcome)) = done else { continue };
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

/// Records how an attempt ended; returns the pause before the next
/// attempt after a failure.
async fn settle(inner: &Arc<Inner>, job: Job, outcome: Outcome, failures: &mut u32) -> Option<Duration> {
    let kind = job.kind.as_str();
    let result = match &outcome {
        Outcome::Uploaded => "uploaded",
        Outcome::Present => "present",
        Outcome::Dropped(_) => "dropped",
        Outcome::Failed(_) => "failed",
    };
    metrics().shared_uploads.with_label_values(&[kind, result]).inc();
    match outcome {
        Outcome::Failed(e) => {
            *failures = failures.saturating_add(1);
            let pause = backoff(*failures);
            tracing::warn!(%job.digest, kind, error = %e, retry_in = ?pause, "upload to the shared tier failed");
            inner.requeue(job);
            Some(pause)
        }
        done => {
            *failures = 0;
            if let Outcome::Dropped(why) = &done {
                tracing::warn!(%job.digest, kind, reason = %why, "not uploading to the shared tier");
            } else {
                tracing::debug!(%job.digest, kind, result, "shared tier has it");
            }
            let marker = inner.marker(&job);
            if let Err(e) = blocking(move || remove_marker(&marker)).await {
                tracing::warn!(%job.digest, error = %e, "removing an upload marker failed");
            }
            inner.finish(&job);
            None
        }
    }
}

/// [`RETRY_BACKOFF_MIN`] doubled per failure in a row, at most [`RETRY_BACKOFF_MAX`].
fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    RETRY_BACKOFF_MIN.saturating_mul(1 << doublings).min(RETRY_BACKOFF_MAX)
}

/// [`UPLOAD_DEADLINE_BASE`] plus `size` at [`UPLOAD_MIN_RATE`].
fn upload_deadline(size: u64) -> Duration {
    UPLOAD_DEADLINE_BASE + Duration::from_secs(size / UPLOAD_MIN_RATE)
}

async fn attempt(inner: &Inner, job: Job) -> Outcome {
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
            let deadline = upload_deadline(local_size);
            match tokio::time::timeout(deadline, inner.store.put_blob_file(&job.digest, &path)).await {
                Ok(Ok(_)) => Outcome::Uploaded,
                Ok(Err(e @ (SharedError::Local { .. } | SharedError::Corrupt { .. }))) => {
                    Outcome::Dropped(e.to_string())
                }
                Ok(Err(e)) => Outcome::Failed(e),
                Err(_) => Outcome::Failed(SharedError::Store(format!("upload not done within {deadline:?}"))),
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
            let deadline = upload_deadline(bytes.len() as u64);
            match tokio::time::timeout(deadline, inner.store.put_manifest(&job.digest, media_type, bytes)).await {
                Ok(Ok(())) => Outcome::Uploaded,
                Ok(Err(e @ SharedError::Corrupt { .. })) => Outcome::Dropped(e.to_string()),
                Ok(Err(e)) => Outcome::Failed(e),
                Err(_) => Outcome::Failed(SharedError::Store(format!("upload not done within {deadline:?}"))),
            }
        }
    }
}

fn parse_manifest_marker(content: &[u8]) -> Option<(MediaType, Bytes)> {
    let newline = content.iter().position(|b| *b == b'\n')?;
    let media_type = MediaType::parse(std::str::from_utf8(&content[..newline]).ok()?)?;
    Some((media_type, Bytes::copy_from_slice(&content[newline + 1..])))
}

/// Every marker under `dir` (creating the folders); leftover temp files
/// of an interrupted `write_marker` are removed.
fn scan(dir: &Path) -> Result<Vec<Job>, Error> {
    let mut jobs = Vec::new();
    for kind in [ObjectKind::Blob, ObjectKind::Manifest] {
        let sub = dir.join(folder(kind));
        std::fs::create_dir_all(&sub)?;
        for entry in std::fs::read_dir(&sub)? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            match format!("sha256:{name}").parse::<Digest>() {
                Ok(digest) => jobs.push(Job { kind, digest }),
                Err(_) => {
                    tracing::debug!(path = %path.display(), "removing a stray file among upload markers");
                    remove_marker(&path)?;
                }
            }
        }
    }
    // Oldest first would need a stat per marker; digest order is as fair.
    jobs.sort_by_key(|j| (j.kind.as_str(), j.digest));
    Ok(jobs)
}

/// Writes `content` to `path` atomically and durably: a temp file beside
/// it, fsynced, renamed into place, and the folder fsynced.
fn write_marker(path: &Path, content: &[u8]) -> Result<(), Error> {
    let parent = path.parent().ok_or_else(|| Error::Internal("marker path has no folder".into()))?;
    std::fs::create_dir_all(parent)?;
    let mut temp = tempfile::Builder::new().prefix(".tmp-").tempfile_in(parent)?;
    temp.write_all(content)?;
    temp.as_file().sync_all()?;
    temp.persist(path).map_err(|e| e.error)?;
    File::open(parent)?.sync_all()?;
    Ok(())
}

fn remove_marker(path: &Path) -> Result<(), Error> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        assert_eq!(backoff(1), RETRY_BACKOFF_MIN);
        assert_eq!(backoff(2), RETRY_BACKOFF_MIN * 2);
        assert_eq!(backoff(3), RETRY_BACKOFF_MIN * 4);
        assert_eq!(backoff(40), RETRY_BACKOFF_MAX);
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
}
