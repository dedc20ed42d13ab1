//! Parallel ranged fills: one fill of a large blob fetching it from
//! upstream as several ranged GETs at once, because on a long path the
//! throughput of one TCP connection, not either end's bandwidth, is what
//! limits a download.
//!
//! The blob (from where earlier sources left off) is cut into parts that
//! end on multiples of [`PART_SIZE`], as containerd cuts its own multipart
//! downloads, so a client's ranges line up with parts. The first part's
//! `206` proves upstream answers ranges and gives the size; then up to
//! `fill_connections` parts run at once, lowest offset first, each written
//! at its offset ([`PartWriter`]). What is written is published in
//! [`Extents`]: readers read any byte as soon as it is written, and the
//! fill hashes the contiguous prefix as it grows (reading it back from the
//! page cache), so the digest is checked before the last byte goes out,
//! exactly as for one stream.
//!
//! A reader waiting for bytes beyond what is fetched (a client's range far
//! ahead) says so ([`Extents::want`]): the part holding its offset starts
//! at once at that offset, on a connection of its own beside the
//! `fill_connections` (at most [`MAX_PART_CONNECTIONS`] in all), just as
//! that client would have opened one pulling directly.
//!
//! A part whose connection breaks resumes from the byte it reached with a
//! new ranged GET; [`PART_ATTEMPTS`] attempts in a row that bring nothing
//! fail the fill. Memory per fill is bounded by the connections, not the
//! blob: each part holds one chunk being read and one being written
//! ([`super::copy::WRITE_CHUNK`] each), the hash one read buffer.

use std::fs::File;
use std::future::Future;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use http_body_util::BodyExt;
use tokio::sync::watch;

use super::copy::{Bounds, Cause, Interrupted, Sink, Writer, copy_body};
use super::progress::{Extents, Progress};
use crate::blocking::blocking;
use crate::body::Body;
use crate::error::{Error, UpstreamError};
use crate::metrics::metrics;
use crate::oci::{Digest, RepoName};
use crate::upstream::{Opened, Permit, Priority, Span, Upstream, content_range};

/// Parts end on multiples of this (containerd's multipart chunk size, so
/// its ranges map onto parts one to one). Each part costs a request (a
/// round trip, a time to first byte): 8 MiB at 25 MB/s is 335 ms of
/// transfer for one such wait.
pub const PART_SIZE: u64 = 8 << 20;
/// Most ranged GETs one fill keeps open at once, those started for
/// readers waiting far ahead included; a want beyond it waits for a part
/// to finish. The upstream's `max_concurrency` bounds them too.
pub const MAX_PART_CONNECTIONS: usize = 16;
/// GETs of one part in a row that bring no byte before the fill fails
/// (a GET that brought some starts the count again).
pub const PART_ATTEMPTS: usize = 3;

/// The end of the part that holds `offset`: the next multiple of
/// [`PART_SIZE`] after it, within `size`.
pub fn part_end(offset: u64, size: u64) -> u64 {
    ((offset / PART_SIZE + 1) * PART_SIZE).min(size)
}

/// The spans no part has taken yet: sorted, disjoint.
#[derive(Debug)]
struct Pending(Vec<(u64, u64)>);

impl Pending {
    fn new(start: u64, end: u64) -> Pending {
        Pending(if start < end { vec![(start, end)] } else { Vec::new() })
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The lowest span not taken, up to the end of its part (or to the end
    /// of the span when `whole`: one connection needs one GET).
    fn take_lowest(&mut self, size: u64, whole: bool) -> Option<(u64, u64)> {
        let (start, end) = *self.0.first()?;
        let stop = if whole { end } else { part_end(start, size).min(end) };
        if stop == end {
            self.0.remove(0);
        } else {
            self.0[0].0 = stop;
        }
        Some((start, stop))
    }

    /// The span from `offset` to the end of its part, if no part took
    /// `offset` yet; what is before it stays to be taken.
    fn take_at(&mut self, offset: u64, size: u64) -> Option<(u64, u64)> {
        let i = self.0.iter().position(|&(s, e)| s <= offset && offset < e)?;
        let (start, end) = self.0[i];
        let stop = part_end(offset, size).min(end);
        let mut rest = Vec::with_capacity(2);
        if start < offset {
            rest.push((start, offset));
        }
        if stop < end {
            rest.push((stop, end));
        }
        self.0.splice(i..=i, rest);
        Some((offset, stop))
    }
}

/// Writes one part at its offset and records what it wrote.
pub struct PartWriter {
    file: Arc<File>,
    at: u64,
    extents: Arc<Extents>,
}

impl Sink for PartWriter {
    fn written(&self) -> u64 {
        self.at
    }

    fn write(mut self, chunk: Bytes) -> impl Future<Output = Result<Self, Error>> + Send + 'static {
        blocking(move || {
            self.file.write_all_at(&chunk, self.at)?;
            let start = self.at;
            self.at += chunk.len() as u64;
            self.extents.record(start, self.at);
            Ok(self)
        })
    }

    fn publish(&self, tx: &watch::Sender<Progress>) {
        // Always a change: readers far ahead wait for bytes the prefix
        // does not show.
        let contiguous = self.extents.contiguous();
        tx.send_modify(|p| {
            if let Progress::Streaming { written, .. } = p {
                *written = contiguous;
            }
        });
    }
}

/// One fill's ranged download of a blob from upstream.
pub struct PartsJob<'a> {
    pub upstream: &'a Upstream,
    pub repo: &'a RepoName,
    pub digest: &'a Digest,
    pub priority: &'a Priority,
    /// The blob's size, as the first part's `Content-Range` said.
    pub size: u64,
    /// Ranged GETs kept open at once (`fill_connections`).
    pub connections: usize,
    /// The temp file (a handle of its own: parts write at offsets).
    pub file: Arc<File>,
    pub tx: &'a watch::Sender<Progress>,
    pub idle: Duration,
}

/// How one GET of a part ended.
enum Outcome {
    Done,
    /// Broke off (or could not start): `rest` is what is left of the part.
    Broke {
        rest: (u64, u64),
        error: Error,
        attempts: usize,
    },
    /// Upstream's answer stands (404, 403, 429), it sent what it must
    /// not, or the disk failed: the fill fails.
    Failed(Error),
}

/// A ranged GET's body for a part, and the permit it holds.
pub struct OpenedPart {
    pub body: Body,
    pub permit: Permit,
}

impl PartsJob<'_> {
    /// Fetches `[from, size)` into the file, the first part (`[from,
    /// first_end)`, already answered) included, and hashes it into
    /// `writer` (which holds the bytes before `from`). Returns the writer
    /// once every byte is written and hashed.
    pub async fn run(&self, writer: Writer, first: OpenedPart, first_end: u64) -> Result<Writer, Interrupted> {
        let from = writer.written();
        let extents = Arc::new(Extents::new(from));
        self.tx.send_modify(|p| {
            if let Progress::Streaming { extents: e, .. } = p {
                *e = Some(Arc::clone(&extents));
            }
        });
        let result = self.schedule(writer, first, (from, first_end), &extents).await;
        if result.is_err() {
            // A source after this one (there is none after upstream today)
            // would write from the hashed prefix on: readers must not take
            // the parts' bytes beyond it for that source's.
            self.tx.send_modify(|p| {
                if let Progress::Streaming { extents: e, .. } = p {
                    *e = None;
                }
            });
        }
        result
    }

    async fn schedule(
        &self,
        writer: Writer,
        first: OpenedPart,
        first_part: (u64, u64),
        extents: &Arc<Extents>,
    ) -> Result<Writer, Interrupted> {
        let name = self.upstream.name();
        let whole = self.connections == 1;
        let mut pending = Pending::new(first_part.1, self.size);
        let mut parts = FuturesUnordered::new();
        metrics().fill_parts.with_label_values(&[name]).inc();
        parts.push(self.fetch(extents, first_part, Some(first), 0));
        let mut writer = Some(writer);
        let mut hashing: Option<tokio::task::JoinHandle<Result<Writer, Error>>> = None;
        let failed = loop {
            // Readers waiting far ahead first, each on a connection of its own.
            while parts.len() < MAX_PART_CONNECTIONS {
                let Some(offset) = extents.pop_want() else { break };
                if let Some(span) = pending.take_at(offset, self.size) {
                    tracing::debug!(digest = %self.digest, offset, "a reader waits far ahead: fetching its part now");
                    metrics().fill_parts.with_label_values(&[name]).inc();
                    parts.push(self.fetch(extents, span, None, 0));
                }
            }
            while parts.len() < self.connections {
                let Some(span) = pending.take_lowest(self.size, whole) else { break };
                metrics().fill_parts.with_label_values(&[name]).inc();
                parts.push(self.fetch(extents, span, None, 0));
            }
            let contiguous = extents.contiguous();
            if let Some(w) = writer.take_if(|w| w.written() < contiguous) {
                hashing = Some(tokio::spawn(w.absorb(contiguous)));
            }
            if parts.is_empty() {
                // Every part is written: only the hash may be left.
                debug_assert!(pending.is_empty());
                break None;
            }
            tokio::select! {
                Some(outcome) = parts.next() => match outcome {
                    Outcome::Done => {}
                    Outcome::Broke { rest, error, attempts } if attempts < PART_ATTEMPTS => {
                        tracing::warn!(digest = %self.digest, from = rest.0, to = rest.1, %error, "a part broke off; resuming it");
                        metrics().fill_part_resumes.with_label_values(&[name]).inc();
                        parts.push(self.fetch(extents, rest, None, attempts));
                    }
                    Outcome::Broke { error, .. } | Outcome::Failed(error) => break Some(error),
                },
                done = async { hashing.as_mut().expect("guarded").await }, if hashing.is_some() => {
                    hashing = None;
                    match done {
                        Ok(Ok(w)) => writer = Some(w),
                        Ok(Err(e)) => break Some(e),
                        Err(e) => break Some(Error::Internal(format!("fill hash task failed: {e}"))),
                    }
                }
                _ = extents.wanted.notified() => {}
            }
        };
        // Parts still running are dropped (their connections close).
        drop(parts);
        let writer = match (writer, hashing) {
            (Some(w), _) => w,
            (None, Some(task)) => match task.await {
                Ok(Ok(w)) => w,
                Ok(Err(e)) => return Err(Interrupted::local(e)),
                Err(e) => return Err(Interrupted::local(Error::Internal(format!("fill hash task failed: {e}")))),
            },
            (None, None) => unreachable!("the writer is either idle or hashing"),
        };
        if let Some(error) = failed {
            return Err(Interrupted { error, cause: Cause::Broke(writer) });
        }
        debug_assert_eq!(extents.contiguous(), self.size);
        writer.absorb(self.size).await.map_err(Interrupted::local)
    }

    /// One GET of the part `[start, end)` (or the answer already opened for
    /// it), written at its offset. `attempts`: GETs of this part in a row
    /// that brought nothing so far.
    async fn fetch(
        &self,
        extents: &Arc<Extents>,
        (start, end): (u64, u64),
        opened: Option<OpenedPart>,
        attempts: usize,
    ) -> Outcome {
        let name = self.upstream.name();
        let OpenedPart { body, permit } = match opened {
            Some(opened) => opened,
            None => match self.open(start, end).await {
                Ok(opened) => opened,
                Err(Outcome::Broke { rest, error, .. }) => {
                    return Outcome::Broke { rest, error, attempts: attempts + 1 };
                }
                Err(other) => return other,
            },
        };
        let sink = PartWriter { file: Arc::clone(&self.file), at: start, extents: Arc::clone(extents) };
        let pace = Some(self.upstream.bandwidth().pace(self.priority));
        let bounds = Bounds { declared: Some(end), limit: end, idle: self.idle, pace };
        let (upstream_bytes, part_bytes) =
            (metrics().upstream_bytes.with_label_values(&[name]), metrics().fill_part_bytes.with_label_values(&[name]));
        let copied = copy_body(body, sink, 0, bounds, self.tx, &[upstream_bytes, part_bytes]).await;
        drop(permit);
        match copied {
            Ok(_) => Outcome::Done,
            Err(Interrupted { cause: Cause::Broke(sink), .. }) if sink.at >= end => Outcome::Done,
            Err(Interrupted { error, cause: Cause::Broke(sink) }) => {
                let attempts = if sink.at > start { 0 } else { attempts + 1 };
                Outcome::Broke { rest: (sink.at, end), error, attempts }
            }
            Err(Interrupted { error, .. }) => Outcome::Failed(error),
        }
    }

    /// A ranged GET of `[start, end)`, checked: a `206` for exactly that
    /// range of a blob of the size the first part said.
    async fn open(&self, start: u64, end: u64) -> Result<OpenedPart, Outcome> {
        let span = Span { start, end: Some(end) };
        let broke = |error: Error| Outcome::Broke { rest: (start, end), error, attempts: 0 };
        let opened = match self.upstream.get_blob(self.repo, self.digest, span, self.priority).await {
            Ok(Some(opened)) => opened,
            Ok(None) => return Err(Outcome::Failed(Error::BlobUnknown(*self.digest))),
            Err(e) if retryable(&e) => return Err(broke(e.into())),
            Err(e) => return Err(Outcome::Failed(e.into())),
        };
        let response = &opened.response;
        if response.status() != http::StatusCode::PARTIAL_CONTENT {
            let e = format!("upstream answered {} to a ranged GET after answering ranges", response.status());
            return Err(broke(UpstreamError::Protocol(e).into()));
        }
        match content_range(response.headers()) {
            Some((first, last, Some(total))) if first == start && last < end && total == self.size => {}
            other => {
                let (answered, asked) = (crate::upstream::described_range(other), Span { start, end: Some(end) });
                let e = format!("upstream answered {answered} to a GET of {asked} of a {}-byte blob", self.size);
                return Err(Outcome::Failed(UpstreamError::Protocol(e).into()));
            }
        }
        let Opened { response, permit } = opened;
        let body = response.into_body().map_err(|e| Box::new(e) as crate::body::BoxError).boxed_unsync();
        Ok(OpenedPart { body, permit })
    }
}

/// Whether a failed GET of a part may be tried again: the connection or
/// the server failed, not upstream's answer about the blob.
fn retryable(e: &UpstreamError) -> bool {
    match e {
        UpstreamError::Connect(_) | UpstreamError::Timeout(_) | UpstreamError::Protocol(_) => true,
        UpstreamError::Status { status, .. } => *status >= 500,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = PART_SIZE;

    #[test]
    fn parts_end_on_multiples_of_the_part_size() {
        let size = 3 * M + 5;
        let mut p = Pending::new(M / 2, size);
        assert_eq!(p.take_lowest(size, false), Some((M / 2, M)));
        assert_eq!(p.take_lowest(size, false), Some((M, 2 * M)));
        assert_eq!(p.take_lowest(size, false), Some((2 * M, 3 * M)));
        assert_eq!(p.take_lowest(size, false), Some((3 * M, size)));
        assert_eq!(p.take_lowest(size, false), None);
        let mut one = Pending::new(10, size);
        assert_eq!(one.take_lowest(size, true), Some((10, size)), "one connection: one GET for the rest");
    }

    #[test]
    fn a_want_takes_its_part_from_its_offset_and_leaves_the_rest() {
        let size = 4 * M;
        let mut p = Pending::new(M, size);
        assert_eq!(p.take_at(2 * M + 100, size), Some((2 * M + 100, 3 * M)));
        assert_eq!(p.0, vec![(M, 2 * M + 100), (3 * M, size)]);
        assert_eq!(p.take_at(2 * M + 200, size), None, "taken already");
        assert_eq!(p.take_at(3 * M, size), Some((3 * M, size)));
        assert_eq!(p.take_lowest(size, false), Some((M, 2 * M)));
        assert_eq!(p.take_lowest(size, false), Some((2 * M, 2 * M + 100)));
        assert!(p.is_empty());
    }
}
