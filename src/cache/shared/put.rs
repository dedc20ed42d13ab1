//! Uploads of committed blob files to the shared tier: one PUT for a small
//! file, a multipart upload streamed from the file for a large one, hashed
//! as it is read, and abandoned (the multipart upload aborted) when the
//! file no longer matches its digest or the caller gives up.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::stream::StreamExt;
use object_store::{Attribute, Attributes, MultipartUpload, PutMultipartOptions, PutOptions, PutPayload};

use super::{ObjectKind, SharedError, SharedStore, store_err, written};
use crate::blocking::blocking;
use crate::metrics::metrics;
use crate::oci::{Digest, Hasher};

/// Files up to this size are uploaded with one PUT; larger ones as a
/// multipart upload streamed from the file.
pub const SINGLE_PUT_MAX: u64 = 8 << 20;
/// Part size of a multipart upload (S3 needs at least 5 MiB but the last).
/// Raised for huge files so that no upload needs more than [`MAX_PARTS`].
pub const PART_SIZE: u64 = 8 << 20;
/// S3's limit on the parts of one multipart upload.
pub const MAX_PARTS: u64 = 10_000;
/// Parts of one upload in flight at once; memory per upload is about
/// (this + 1) x the part size.
pub const PARTS_IN_FLIGHT: usize = 2;
/// Longest wait for the store to abort a multipart upload that failed or
/// was given up; past it the parts are left to the bucket's lifecycle rule.
pub const ABORT_TIMEOUT: Duration = Duration::from_secs(5);

/// How a cancellable upload ended without the object in the store.
#[derive(Debug)]
pub enum PutFailed<C> {
    /// The store, or the local file, failed.
    Store(SharedError),
    /// Given up because the stop future resolved (with this).
    Stopped(C),
}

impl<C> From<SharedError> for PutFailed<C> {
    fn from(e: SharedError) -> Self {
        PutFailed::Store(e)
    }
}

impl SharedStore {
    /// Uploads the committed blob file at `path` as the object for
    /// `digest`: one PUT up to [`SINGLE_PUT_MAX`], else a multipart upload
    /// streamed from the file. The file is hashed as it is read; if it no
    /// longer matches `digest` the upload is abandoned (a multipart upload
    /// is aborted before it completes, so no wrong object ever appears).
    /// Returns the bytes uploaded.
    pub async fn put_blob_file(&self, digest: &Digest, path: &Path) -> Result<u64, SharedError> {
        match self.put_blob_file_until(digest, path, std::future::pending::<()>()).await {
            Ok(size) => Ok(size),
            Err(PutFailed::Store(e)) => Err(e),
            Err(PutFailed::Stopped(())) => unreachable!("a pending future never resolves"),
        }
    }

    /// [`SharedStore::put_blob_file`], given up when `stop` resolves first
    /// (a deadline, a shutdown, the blob's removal): the file is closed at
    /// once and a multipart upload is aborted (within [`ABORT_TIMEOUT`]),
    /// as it is after any failure, so no parts are left in the bucket.
    /// Only a stop that lands while the store is creating the upload (one
    /// short request) cannot abort it, since its id is not known yet: the
    /// bucket's `AbortIncompleteMultipartUpload` rule cleans that one, as
    /// it does after a crash.
    pub async fn put_blob_file_until<C>(
        &self,
        digest: &Digest,
        path: &Path,
        stop: impl std::future::Future<Output = C>,
    ) -> Result<u64, PutFailed<C>> {
        tokio::pin!(stop);
        let local = |detail: String| SharedError::Local { path: path.display().to_string(), detail };
        let file_path = path.to_owned();
        let (file, size) = blocking(move || {
            let file = std::fs::File::open(&file_path)?;
            let size = file.metadata()?.len();
            Ok((Arc::new(file), size))
        })
        .await
        .map_err(|e| local(e.to_string()))?;
        let location = self.path(ObjectKind::Blob, digest);
        let attributes = Attributes::from_iter([(Attribute::ContentType, "application/octet-stream")]);
        if size <= SINGLE_PUT_MAX {
            let (bytes, hasher) =
                read_chunk(Arc::clone(&file), 0, size as usize, Hasher::default()).await.map_err(local)?;
            drop(file);
            verify(digest, hasher, "local file", path)?;
            let options = PutOptions { attributes, ..PutOptions::default() };
            let result = tokio::select! {
                result = self.store.put_opts(&location, PutPayload::from(bytes), options) => result,
                stopped = &mut stop => return Err(PutFailed::Stopped(stopped)),
            };
            written("put", result).map_err(|e| self.log_failure("put", digest, e))?;
        } else {
            let options = PutMultipartOptions { attributes, ..PutMultipartOptions::default() };
            let created = tokio::select! {
                created = self.store.put_multipart_opts(&location, options) => created,
                stopped = &mut stop => return Err(PutFailed::Stopped(stopped)),
            };
            let mut upload = match created {
                Ok(upload) => upload,
                Err(e) => {
                    metrics().shared_requests.with_label_values(&["put_multipart", "error"]).inc();
                    return Err(PutFailed::Store(self.log_failure("put_multipart", digest, store_err(e))));
                }
            };
            let result = tokio::select! {
                result = stream_parts(&mut *upload, digest, path, file, size) => result.map_err(PutFailed::Store),
                stopped = &mut stop => Err(PutFailed::Stopped(stopped)),
            };
            let label = if result.is_ok() { "ok" } else { "error" };
            metrics().shared_requests.with_label_values(&["put_multipart", label]).inc();
            if let Err(failed) = &result {
                if let PutFailed::Store(e) = failed {
                    tracing::debug!(%digest, error = %e, "multipart upload failed; aborting it");
                }
                let aborted = match tokio::time::timeout(ABORT_TIMEOUT, upload.abort()).await {
                    Ok(Ok(())) => "ok",
                    Ok(Err(e)) => {
                        tracing::warn!(%digest, error = %e, "aborting a multipart upload failed; the bucket's lifecycle rule will");
                        "error"
                    }
                    Err(_) => {
                        tracing::warn!(%digest, "aborting a multipart upload timed out; the bucket's lifecycle rule will");
                        "error"
                    }
                };
                metrics().shared_requests.with_label_values(&["abort_multipart", aborted]).inc();
            }
            result?;
        }
        metrics().shared_bytes.with_label_values(&["upload"]).inc_by(size);
        Ok(size)
    }

    fn log_failure(&self, op: &str, digest: &Digest, e: SharedError) -> SharedError {
        tracing::debug!(op, %digest, error = %e, "shared store request failed");
        e
    }
}

/// Sends the file's parts, at most [`PARTS_IN_FLIGHT`] at once, hashing
/// them as they are read, and completes the upload if the file matched
/// `digest`. The caller aborts the upload when this fails or is dropped.
async fn stream_parts(
    upload: &mut dyn MultipartUpload,
    digest: &Digest,
    path: &Path,
    file: Arc<std::fs::File>,
    size: u64,
) -> Result<(), SharedError> {
    let part = part_size(size);
    let mut in_flight: futures_util::stream::FuturesUnordered<object_store::UploadPart> =
        futures_util::stream::FuturesUnordered::new();
    let mut hasher = Hasher::default();
    let mut offset = 0;
    while offset < size {
        while in_flight.len() >= PARTS_IN_FLIGHT {
            if let Some(done) = in_flight.next().await {
                done.map_err(store_err)?;
            }
        }
        let len = part.min(size - offset);
        let (bytes, next) = read_chunk(Arc::clone(&file), offset, len as usize, hasher)
            .await
            .map_err(|detail| SharedError::Local { path: path.display().to_string(), detail })?;
        hasher = next;
        in_flight.push(upload.put_part(PutPayload::from(bytes)));
        offset += len;
    }
    drop(file);
    while let Some(done) = in_flight.next().await {
        done.map_err(store_err)?;
    }
    verify(digest, hasher, "local file", path)?;
    upload.complete().await.map(|_| ()).map_err(store_err)
}

/// whole MiB) when that would need more than [`MAX_PARTS`] parts.
fn part_size(size: u64) -> u64 {
    let needed = size.div_ceil(MAX_PARTS).div_ceil(1 << 20) << 20;
    PART_SIZE.max(needed)
}

/// Reads `len` bytes at `offset` on the blocking pool, hashing them there.
async fn read_chunk(
    file: Arc<std::fs::File>,
    offset: u64,
    len: usize,
    mut hasher: Hasher,
) -> Result<(Bytes, Hasher), String> {
    blocking(move || {
        use std::os::unix::fs::FileExt;
        let mut buf = BytesMut::zeroed(len);
        file.read_exact_at(&mut buf, offset)?;
        hasher.update(&buf);
        Ok((buf.freeze(), hasher))
    })
    .await
    .map_err(|e| e.to_string())
}

fn verify(digest: &Digest, hasher: Hasher, what: &str, path: &Path) -> Result<(), SharedError> {
    let actual = hasher.finish();
    if actual == *digest {
        return Ok(());
    }
    metrics().digest_mismatch.inc();
    Err(SharedError::Corrupt {
        what: format!("{what} {}", PathBuf::from(path).display()),
        detail: format!("expected {digest}, found {actual}; not uploaded"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_size_keeps_uploads_under_the_part_limit() {
        assert_eq!(part_size(64 << 20), PART_SIZE);
        let huge = 200u64 << 30;
        let part = part_size(huge);
        assert!(huge.div_ceil(part) <= MAX_PARTS, "{part}");
        assert_eq!(part % (1 << 20), 0);
    }
}
