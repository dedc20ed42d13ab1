//! Copying a source's body into a fill's temp file: in order from the
//! blob's start, hashing as it goes ([`Writer`]), or one ranged part at its
//! offset (see `super::parts`). Either way one chunk is written while the
//! next is read, the length is held to what the source declared, and a
//! copy that stops short says whose fault it was and where to resume.

use std::future::Future;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http_body_util::BodyExt;
use tokio::sync::watch;

use super::progress::Progress;
use crate::blocking::blocking;
use crate::body::Body;
use crate::error::{Error, UpstreamError};
use crate::oci::{Digest, Hasher};

/// Bytes gathered from upstream before one write to the temp file. Frames
/// that are already buffered are batched up to this; a trickling upstream
/// is written (and published to readers) as it arrives.
pub const WRITE_CHUNK: usize = 256 << 10;
/// Largest read when hashing bytes that parts wrote ahead of the hash.
const HASH_READ: usize = 256 << 10;

/// Where a copy puts the bytes it reads.
pub trait Sink: Sized + Send + 'static {
    /// The offset of the next byte: every byte before it is written.
    fn written(&self) -> u64;
    /// Writes `chunk` at [`Sink::written`] (on the blocking pool).
    fn write(self, chunk: Bytes) -> impl Future<Output = Result<Self, Error>> + Send + 'static;
    /// Tells the fill's readers what is written now.
    fn publish(&self, tx: &watch::Sender<Progress>);
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
            crate::faults::check(crate::faults::Point::TempWrite)?;
            self.temp.as_file().write_all_at(&chunk, self.written)?;
            self.hasher.update(&chunk);
            self.written += chunk.len() as u64;
            Ok(self)
        })
        .await
    }

    /// Hashes the bytes from [`Writer::written`] up to `upto`, which
    /// ranged parts already wrote into the file, reading them back (from
    /// the page cache, where they just went).
    pub async fn absorb(mut self, upto: u64) -> Result<Writer, Error> {
        blocking(move || {
            let mut buf = vec![0u8; HASH_READ];
            while self.written < upto {
                let n = (upto - self.written).min(HASH_READ as u64) as usize;
                crate::faults::check(crate::faults::Point::TempRead)?;
                self.temp.as_file().read_exact_at(&mut buf[..n], self.written)?;
                self.hasher.update(&buf[..n]);
                self.written += n as u64;
            }
            Ok(self)
        })
        .await
    }

    pub fn finish(self) -> (tempfile::NamedTempFile, Digest, u64) {
        (self.temp, self.hasher.finish(), self.written)
    }
}

impl Sink for Writer {
    fn written(&self) -> u64 {
        self.written
    }

    fn write(self, chunk: Bytes) -> impl Future<Output = Result<Self, Error>> + Send + 'static {
        Writer::write(self, chunk)
    }

    fn publish(&self, tx: &watch::Sender<Progress>) {
        let written = self.written;
        tx.send_modify(|p| {
            if let Progress::Streaming { written: w, .. } = p {
                *w = written;
            }
        })
    }
}

/// The sink between chunks: idle, or busy writing one chunk on the
/// blocking pool while the next one is read from the source.
enum Slot<W> {
    Idle(W),
    Busy(tokio::task::JoinHandle<Result<W, Error>>),
}

/// What happened first while a write was in flight.
enum Step<W> {
    Wrote(Result<Result<W, Error>, tokio::task::JoinError>),
    Read(Result<(Bytes, bool), Error>),
}

impl<W: Sink> Slot<W> {
    /// The sink once its chunk (if any) is written.
    async fn settle(self) -> Result<W, Error> {
        match self {
            Slot::Idle(w) => Ok(w),
            Slot::Busy(task) => task.await.map_err(|e| Error::Internal(format!("fill write task failed: {e}")))?,
        }
    }
}

/// What a fill's body may be, and how fast it may be read.
#[derive(Clone)]
pub struct Bounds {
    /// Where the body must end (the offset after its last byte), if its
    /// source said: the blob's whole size for a copy from its start (the
    /// bytes written, from the first source and any that resumed it, must
    /// add up to exactly this), a part's end for a part.
    pub declared: Option<u64>,
    /// The most bytes written before the fill is aborted, whatever the
    /// source declared (a chunked body has no length to hold it to).
    pub limit: u64,
    /// Longest pause between two chunks.
    pub idle: Duration,
    /// For bytes from upstream: its bandwidth, which each chunk read
    /// waits for its share of (`max_bandwidth`; fills ahead and warm
    /// downloads yield to clients'), outside the `idle` wait.
    pub pace: Option<crate::upstream::bandwidth::Pace>,
}

/// A copy that stopped short.
pub struct Interrupted<W = Writer> {
    pub error: Error,
    pub cause: Cause<W>,
}

/// Whose fault an interruption was, and what can still be done.
pub enum Cause<W = Writer> {
    /// The source broke, stalled or ended early: what was written so far
    /// is in the sink, and another request can resume from `written()`.
    Broke(W),
    /// The source sent more than it declared or than is allowed: its bytes
    /// cannot be trusted, and nothing it wrote is worth resuming.
    Lied,
    /// The fill's own failure (the disk): no other source mends it.
    Local,
}

impl<W: Sink> std::fmt::Debug for Interrupted<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cause = match &self.cause {
            Cause::Broke(w) => format!("broke after {} bytes", w.written()),
            Cause::Lied => "lied".to_owned(),
            Cause::Local => "local".to_owned(),
        };
        f.debug_struct("Interrupted").field("error", &self.error).field("cause", &cause).finish()
    }
}

impl<W> Interrupted<W> {
    pub fn local(error: Error) -> Interrupted<W> {
        Interrupted { error, cause: Cause::Local }
    }

    fn lied(error: Error) -> Interrupted<W> {
        Interrupted { error, cause: Cause::Lied }
    }
}

/// The source's part in an interruption: its error, and the sink to
/// resume with once its write in flight (if any) has landed.
async fn resumable<W: Sink>(error: Error, slot: Slot<W>) -> Interrupted<W> {
    match slot.settle().await {
        Ok(sink) => Interrupted { error, cause: Cause::Broke(sink) },
        Err(write_error) => Interrupted::local(write_error),
    }
}

/// Streams a blob body into `sink` (which may already hold the start of
/// the blob, from a source that failed), publishing progress, and checks
/// the length against the `bounds`. The first `skip` bytes of `body` are
/// dropped (a source that answered a range request with the whole blob).
/// Returns the sink at EOF.
///
/// One chunk is written (and hashed) while the next is read, so the disk
/// and the hash overlap the network instead of adding to it; chunks stay
/// in order because at most one write is in flight.
pub async fn copy_body<W: Sink>(
    mut body: Body,
    sink: W,
    mut skip: u64,
    bounds: Bounds,
    tx: &watch::Sender<Progress>,
    received: &[prometheus::IntCounter],
) -> Result<W, Interrupted<W>> {
    let Bounds { declared, limit, idle, pace } = bounds;
    let mut slot = Slot::Idle(sink);
    loop {
        // Read the next chunk; a write finishing meanwhile is published at
        // once, so followers see bytes as soon as they are on disk even
        // while the source stalls.
        let (mut chunk, eof) = {
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
                    Step::Read(Ok(read)) => break read,
                    Step::Read(Err(e)) => return Err(resumable(e, slot).await),
                    Step::Wrote(done) => {
                        let sink = match done {
                            Ok(Ok(sink)) => sink,
                            Ok(Err(e)) => return Err(Interrupted::local(e)),
                            Err(e) => {
                                let e = Error::Internal(format!("fill write task failed: {e}"));
                                return Err(Interrupted::local(e));
                            }
                        };
                        sink.publish(tx);
                        slot = Slot::Idle(sink);
                    }
                }
            }
        };
        if skip > 0 {
            let dropped = skip.min(chunk.len() as u64);
            skip -= dropped;
            chunk = chunk.slice(dropped as usize..);
        }
        let sink = slot.settle().await.map_err(Interrupted::local)?;
        sink.publish(tx);
        slot = if chunk.is_empty() {
            Slot::Idle(sink)
        } else {
            if declared.is_some_and(|d| sink.written() + chunk.len() as u64 > d) {
                let e = UpstreamError::Protocol("blob body is longer than its Content-Length".into());
                return Err(Interrupted::lied(e.into()));
            }
            if sink.written() + chunk.len() as u64 > limit {
                let e = UpstreamError::Protocol(format!(
                    "blob body is longer than the {limit} bytes allowed (its manifest's size, or cache.max_blob_size)"
                ));
                return Err(Interrupted::lied(e.into()));
            }
            for counter in received {
                counter.inc_by(chunk.len() as u64);
            }
            let len = chunk.len() as u64;
            let slot = Slot::Busy(tokio::spawn(sink.write(chunk)));
            // Paid for while it is written, before the next one is read.
            if let Some(pace) = &pace {
                pace.take(len).await;
            }
            slot
        };
        if eof {
            break;
        }
    }
    let sink = slot.settle().await.map_err(Interrupted::local)?;
    sink.publish(tx);
    if let Some(d) = declared.filter(|d| *d != sink.written()) {
        let got = sink.written();
        let e = UpstreamError::Protocol(format!("blob body ended after {got} of {d} bytes"));
        return Err(Interrupted { error: e.into(), cause: Cause::Broke(sink) });
    }
    Ok(sink)
}

/// Waits for the next data frame, then takes the frames already buffered
/// behind it, up to [`WRITE_CHUNK`]. Returns the bytes and whether the body ended.
async fn next_chunk(body: &mut Body, idle: Duration) -> Result<(Bytes, bool), Error> {
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
