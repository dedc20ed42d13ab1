//! Blob fills: one upstream GET per digest however many clients ask. The
//! fill runs in its own task, writes to a temp file while hashing, and
//! publishes how far it got through a `watch` channel. Every client, the
//! first included, is a reader of that file: it reads with `pread` up to
//! the published offset, so a slow reader never slows the fill or anyone
//! else, and memory does not grow with the number of readers or their
//! backlog. A client that disconnects drops only its reader; the fill goes
//! on and commits, so the next pull is warm.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use tokio::sync::watch;

use crate::blocking::blocking;
use crate::body::Body;
use crate::error::{Error, UpstreamError};
use crate::oci::{Digest, Hasher};

/// Bytes gathered from upstream before one write to the temp file. Frames
/// that are already buffered are batched up to this; a trickling upstream
/// is written (and published to readers) as it arrives.
pub const WRITE_CHUNK: usize = 256 << 10;
/// Largest read a client's body stream makes from a blob file at once
/// (tokio's default 4 KiB reads are several times slower).
pub const READ_CHUNK: usize = 256 << 10;

/// How far a fill is, as its readers see it.
#[derive(Clone, Debug)]
pub enum Progress {
    /// Waiting for upstream's response headers.
    Connecting,
    /// Bytes `0..written` of the temp file are final; `size` is upstream's
    /// `Content-Length` if it sent one.
    Streaming { file: Arc<File>, size: Option<u64>, written: u64 },
    /// Verified and committed.
    Complete { file: Arc<File>, size: u64 },
    /// Nothing was committed; readers abort their responses.
    Failed(Error),
}

/// The fills in flight, by digest.
#[derive(Default)]
pub struct Fills {
    // A std Mutex, held only for map lookups and inserts, never across `.await`.
    inflight: Mutex<HashMap<Digest, watch::Receiver<Progress>>>,
}

impl Fills {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Digest, watch::Receiver<Progress>>> {
        self.inflight.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The fill in flight for `digest`, if any.
    pub fn get(&self, digest: &Digest) -> Option<watch::Receiver<Progress>> {
        self.lock().get(digest).cloned()
    }

    /// Joins the fill for `digest`, or registers a new one and calls
    /// `start` with its sender. `recently_committed` is checked under the
    /// same lock, so a fill that finished a moment ago is not started again.
    pub fn join_or_start(
        &self,
        digest: Digest,
        recently_committed: impl FnOnce() -> bool,
        start: impl FnOnce(watch::Sender<Progress>),
    ) -> Option<(watch::Receiver<Progress>, bool)> {
        let mut map = self.lock();
        if let Some(rx) = map.get(&digest) {
            return Some((rx.clone(), false));
        }
        if recently_committed() {
            return None;
        }
        let (tx, rx) = watch::channel(Progress::Connecting);
        map.insert(digest, rx.clone());
        start(tx);
        Some((rx, true))
    }

    pub fn remove(&self, digest: &Digest) {
        self.lock().remove(digest);
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Waits until the fill has response headers (or failed): the file to read
/// and the size if known.
pub async fn wait_for_headers(rx: &mut watch::Receiver<Progress>) -> Result<(Arc<File>, Option<u64>), Error> {
    loop {
        match &*rx.borrow_and_update() {
            Progress::Connecting => {}
            Progress::Streaming { file, size, .. } => return Ok((Arc::clone(file), *size)),
            Progress::Complete { file, size } => return Ok((Arc::clone(file), Some(*size))),
            Progress::Failed(e) => return Err(e.clone()),
        }
        if rx.changed().await.is_err() {
            return Err(Error::Internal("fill ended without a result".into()));
        }
    }
}

/// Waits until the fill is verified and committed (its size) or failed.
pub async fn wait_until_committed(rx: &mut watch::Receiver<Progress>) -> Result<u64, Error> {
    loop {
        match &*rx.borrow_and_update() {
            Progress::Complete { size, .. } => return Ok(*size),
            Progress::Failed(e) => return Err(e.clone()),
            Progress::Connecting | Progress::Streaming { .. } => {}
        }
        if rx.changed().await.is_err() {
            return Err(Error::Internal("fill ended without a result".into()));
        }
    }
}

/// The temp file being written and the hash of what was written so far.
/// Moved into `spawn_blocking` for each write and back.
pub struct Writer {
    temp: tempfile::NamedTempFile,
    hasher: Hasher,
    written: u64,
}

impl Writer {
    pub fn new(temp: tempfile::NamedTempFile) -> Writer {
        Writer { temp, hasher: Hasher::default(), written: 0 }
    }

    pub fn written(&self) -> u64 {
        self.written
    }

    pub async fn write(mut self, chunk: Bytes) -> Result<Writer, Error> {
        blocking(move || {
            self.temp.as_file_mut().write_all(&chunk)?;
            self.hasher.update(&chunk);
            self.written += chunk.len() as u64;
            Ok(self)
        })
        .await
    }

    pub fn finish(self) -> (tempfile::NamedTempFile, Digest, u64) {
        (self.temp, self.hasher.finish(), self.written)
    }
}

/// The writer between chunks: idle, or busy writing and hashing one chunk
/// on the blocking pool while the next one is read from upstream.
enum Slot {
    Idle(Writer),
    Busy(tokio::task::JoinHandle<Result<Writer, Error>>),
}

/// What happened first while a write was in flight.
enum Step {
    Wrote(Result<Result<Writer, Error>, tokio::task::JoinError>),
    Read(Result<(Bytes, bool), Error>),
}

impl Slot {
    /// The writer once its chunk (if any) is written and hashed.
    async fn settle(self) -> Result<Writer, Error> {
        match self {
            Slot::Idle(w) => Ok(w),
            Slot::Busy(task) => task.await.map_err(|e| Error::Internal(format!("fill write task failed: {e}")))?,
        }
    }
}

/// Streams a blob body from upstream into `writer`, publishing progress,
/// and checks the length against `declared`. Returns the writer at EOF.
///
/// One chunk is written and hashed while the next is read from upstream,
/// so hashing overlaps the network instead of adding to it; chunks stay in
/// order because at most one write is in flight.
pub async fn copy_body(
    mut body: Incoming,
    writer: Writer,
    declared: Option<u64>,
    idle: Duration,
    tx: &watch::Sender<Progress>,
    received: &prometheus::IntCounter,
) -> Result<Writer, Error> {
    let publish = |written: u64| {
        tx.send_modify(|p| {
            if let Progress::Streaming { written: w, .. } = p {
                *w = written;
            }
        })
    };
    let mut slot = Slot::Idle(writer);
    loop {
        // Read the next chunk; a write finishing meanwhile is published at
        // once, so followers see bytes as soon as they are on disk even
        // while upstream stalls.
        let (chunk, eof) = {
            let next = next_chunk(&mut body, idle);
            tokio::pin!(next);
            loop {
                let step = match &mut slot {
                    Slot::Busy(task) => tokio::select! {
                        done = task => Step::Wrote(done),
                        read = &mut next => Step::Read(read),
                    },
                    Slot::Idle(_) => Step::Read((&mut next).await),
                };
                match step {
                    Step::Read(read) => break read?,
                    Step::Wrote(done) => {
                        let writer = done.map_err(|e| Error::Internal(format!("fill write task failed: {e}")))??;
                        publish(writer.written());
                        slot = Slot::Idle(writer);
                    }
                }
            }
        };
        let writer = slot.settle().await?;
        publish(writer.written());
        slot = if chunk.is_empty() {
            Slot::Idle(writer)
        } else {
            if declared.is_some_and(|d| writer.written() + chunk.len() as u64 > d) {
                return Err(UpstreamError::Protocol("blob body is longer than its Content-Length".into()).into());
            }
            received.inc_by(chunk.len() as u64);
            Slot::Busy(tokio::spawn(writer.write(chunk)))
        };
        if eof {
            break;
        }
    }
    let writer = slot.settle().await?;
    publish(writer.written());
    if let Some(d) = declared.filter(|d| *d != writer.written()) {
        let got = writer.written();
        return Err(UpstreamError::Protocol(format!("blob body ended after {got} of {d} bytes")).into());
    }
    Ok(writer)
}

/// Waits for the next data frame, then takes the frames already buffered
/// behind it, up to [`WRITE_CHUNK`]. Returns the bytes and whether the body ended.
async fn next_chunk(body: &mut Incoming, idle: Duration) -> Result<(Bytes, bool), Error> {
    let mut buf = BytesMut::new();
    let first = match tokio::time::timeout(idle, body.frame()).await {
        Err(_) => return Err(UpstreamError::Timeout("blob body stalled").into()),
        Ok(frame) => frame,
    };
    let mut next = Some(first);
    while let Some(frame) = next.take() {
        match frame {
            None => return Ok((buf.freeze(), true)),
            Some(Err(e)) => return Err(UpstreamError::Protocol(format!("blob body: {e}")).into()),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    if buf.is_empty() && data.len() >= WRITE_CHUNK {
                        return Ok((data, false));
                    }
                    buf.extend_from_slice(&data);
                }
            }
        }
        if buf.len() < WRITE_CHUNK {
            // Dropping a pending `frame()` future loses nothing.
            next = body.frame().now_or_never();
        }
    }
    Ok((buf.freeze(), false))
}

/// A response body reading `file` from `start` to `end` (exclusive; `None`:
/// to the end of the blob, learnt from the fill). With `progress`, the file
/// is a fill in flight: reads stop at the published offset and wait for
/// more; a failed fill ends the body with an error, which aborts the
/// client's connection.
pub fn read_body(file: Arc<File>, progress: Option<watch::Receiver<Progress>>, start: u64, end: Option<u64>) -> Body {
    let source = if progress.is_some() { "fill" } else { "disk" };
    let served = crate::metrics::metrics().bytes_served.with_label_values(&[source]);
    let state = Reader { file, progress, offset: start, end, served };
    let stream = futures_util::stream::try_unfold(state, |mut reader| async move {
        match reader.next().await? {
            Some(bytes) => Ok(Some((Frame::data(bytes), reader))),
            None => Ok(None),
        }
    });
    StreamBody::new(stream).boxed_unsync()
}

struct Reader {
    file: Arc<File>,
    progress: Option<watch::Receiver<Progress>>,
    offset: u64,
    end: Option<u64>,
    served: prometheus::IntCounter,
}

impl Reader {
    /// The next chunk, `None` at the end of the range. While the fill is
    /// not verified, a range that reaches the blob's end is held back by
    /// its final byte: an HTTP/1 client that got all `Content-Length`
    /// bytes would take the blob as complete even if the connection is
    /// then aborted, so the last byte goes out only after the digest matched.
    async fn next(&mut self) -> Result<Option<Bytes>, crate::body::BoxError> {
        loop {
            let (available, total, verified) = match &mut self.progress {
                None => (self.end.unwrap_or(0), self.end, true),
                Some(rx) => match &*rx.borrow_and_update() {
                    Progress::Connecting => (0, None, false),
                    Progress::Streaming { written, size, .. } => (*written, *size, false),
                    Progress::Complete { size, .. } => (*size, Some(*size), true),
                    Progress::Failed(e) => return Err(Box::new(e.clone())),
                },
            };
            let end = self.end.or(total);
            let reaches_blob_end = end.is_none() || end == total;
            let done = end.is_some_and(|e| self.offset >= e);
            if done && (verified || !reaches_blob_end) {
                return Ok(None);
            }
            let mut limit = end.map_or(available, |e| e.min(available));
            if !verified && reaches_blob_end && total.is_some_and(|t| limit >= t) {
                limit = limit.saturating_sub(1);
            }
            if self.offset < limit {
                let len = (limit - self.offset).min(READ_CHUNK as u64) as usize;
                let bytes = super::pread::read_at(&self.file, self.offset, len).await?;
                self.offset += bytes.len() as u64;
                self.served.inc_by(bytes.len() as u64);
                return Ok(Some(bytes));
            }
            let Some(rx) = self.progress.as_mut().filter(|_| !verified) else {
                // Verified, yet the range ends past the blob: ranges are
                // validated against the size first, but never spin on it.
                return Err("blob ended before the requested range".into());
            };
            let terminal = |p: &Progress| matches!(p, Progress::Complete { .. } | Progress::Failed(_));
            if rx.changed().await.is_err() && !terminal(&rx.borrow()) {
                return Err("fill ended without a result".into());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A fill in progress over a temp file: the test plays the fill's part.
    struct FakeFill {
        temp: tempfile::NamedTempFile,
        file: Arc<File>,
        tx: watch::Sender<Progress>,
    }

    impl FakeFill {
        fn new(size: u64) -> (FakeFill, watch::Receiver<Progress>) {
            let temp = tempfile::NamedTempFile::new().unwrap();
            let file = Arc::new(temp.as_file().try_clone().unwrap());
            let (tx, rx) =
                watch::channel(Progress::Streaming { file: Arc::clone(&file), size: Some(size), written: 0 });
            (FakeFill { temp, file, tx }, rx)
        }

        fn write(&mut self, bytes: &[u8]) {
            self.temp.write_all(bytes).unwrap();
            let len = self.temp.as_file().metadata().unwrap().len();
            self.tx.send_modify(|p| {
                if let Progress::Streaming { written, .. } = p {
                    *written = len;
                }
            });
        }
    }

    /// Polls a body for a frame, giving up (None) if none comes promptly.
    async fn next_frame(body: &mut Body) -> Option<Result<Bytes, String>> {
        let frame = tokio::time::timeout(Duration::from_millis(200), body.frame()).await.ok()??;
        Some(frame.map(|f| f.into_data().unwrap_or_default()).map_err(|e| e.to_string()))
    }

    #[tokio::test]
    async fn the_last_byte_waits_for_verification() {
        let (mut fill, rx) = FakeFill::new(10);
        let mut body = read_body(Arc::clone(&fill.file), Some(rx), 0, Some(10));
        fill.write(b"0123456789");
        assert_eq!(next_frame(&mut body).await.unwrap().unwrap(), "012345678");
        assert!(next_frame(&mut body).await.is_none(), "the final byte must wait for Complete");
        fill.tx.send_replace(Progress::Complete { file: Arc::clone(&fill.file), size: 10 });
        assert_eq!(next_frame(&mut body).await.unwrap().unwrap(), "9");
        assert!(body.frame().await.is_none(), "then the body ends cleanly");
    }

    #[tokio::test]
    async fn a_range_before_the_end_needs_no_verification() {
        let (mut fill, rx) = FakeFill::new(10);
        let mut body = read_body(Arc::clone(&fill.file), Some(rx), 2, Some(5));
        fill.write(b"0123456789");
        assert_eq!(next_frame(&mut body).await.unwrap().unwrap(), "234");
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_failed_fill_aborts_every_reader() {
        let (mut fill, rx) = FakeFill::new(10);
        let mut first = read_body(Arc::clone(&fill.file), Some(rx.clone()), 0, None);
        let mut second = read_body(Arc::clone(&fill.file), Some(rx), 0, Some(10));
        fill.write(b"01234");
        assert_eq!(next_frame(&mut first).await.unwrap().unwrap(), "01234");
        fill.tx.send_replace(Progress::Failed(Error::Internal("digest mismatch".into())));
        assert!(next_frame(&mut first).await.unwrap().is_err());
        assert!(next_frame(&mut second).await.unwrap().is_err());
    }

    #[tokio::test]
    async fn readers_start_mid_fill_and_follow_it() {
        let (mut fill, rx) = FakeFill::new(6);
        fill.write(b"abc");
        let mut late = read_body(Arc::clone(&fill.file), Some(rx), 0, None);
        assert_eq!(next_frame(&mut late).await.unwrap().unwrap(), "abc");
        assert!(next_frame(&mut late).await.is_none(), "waits for more bytes");
        fill.write(b"def");
        assert_eq!(next_frame(&mut late).await.unwrap().unwrap(), "de");
        fill.tx.send_replace(Progress::Complete { file: Arc::clone(&fill.file), size: 6 });
        assert_eq!(next_frame(&mut late).await.unwrap().unwrap(), "f");
        assert!(late.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_fill_whose_sender_vanishes_is_an_error_not_a_hang() {
        let (mut fill, rx) = FakeFill::new(10);
        let mut body = read_body(Arc::clone(&fill.file), Some(rx), 0, None);
        fill.write(b"01");
        assert_eq!(next_frame(&mut body).await.unwrap().unwrap(), "01");
        drop(fill);
        assert!(next_frame(&mut body).await.unwrap().is_err());
    }
}
