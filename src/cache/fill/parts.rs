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
//! new ranged GET; [`PART_ATTEMPTS`] attempts in a row that each bring
//! less than [`RESUME_MIN_PROGRESS`] fail the fill, so a part that
//! trickles a little and stalls, every time, fails within a few idle
//! timeouts. A local failure (a write, or the hash's read-back) fails the
//! fill at once. Memory per fill is bounded by the connections, not the
//! blob: each part holds one chunk being read and one being written
//! ([`super::copy::WRITE_CHUNK`] each), the hash one read buffer.
//!
//! An upstream that answers a part's range with the whole blob (`200`) or
//! with a `206` that starts where asked but runs on past the part is not
//! relied on for ranges any more ([`super::ranges`]): the other parts are
//! dropped and the rest of the blob comes as one stream from the end of
//! the hashed prefix, from that very answer when it starts at or before
//! that byte (what precedes it is skipped), else from a GET of the rest.
//! A `206` that starts elsewhere than asked (or has no valid
//! `Content-Range`) fails the fill, and the upstream's next fills go as
//! one stream too.

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
use super::ranges::RangeTrust;
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
/// GETs of one part (or of the one stream a fill falls back to) in a row
/// that bring less than [`RESUME_MIN_PROGRESS`] each before the fill
/// fails; one that brings more starts the count again.
pub const PART_ATTEMPTS: usize = 3;
/// What a GET of a part must bring before it breaks off (stalls, is cut,
/// or ends short) for it not to count as one of [`PART_ATTEMPTS`]: a part
/// that trickles a few KiB and stalls every time thus fails its fill after
/// three idle timeouts instead of resuming once per trickle.
pub const RESUME_MIN_PROGRESS: u64 = 256 << 10;

/// How one GET of a part went before it broke off.
#[derive(Clone, Copy, Debug)]
struct Attempt {
    /// Bytes it brought.
    brought: u64,
    /// How long it ran, from its answer to its break.
    took: Duration,
    /// How much of that larder held its reads back, waiting on the
    /// upstream's bandwidth ([`crate::upstream::bandwidth::Pace::held`]).
    held: Duration,
}

/// The next attempt count after a GET that broke off after `attempts`
/// weak ones in a row. One that brought [`RESUME_MIN_PROGRESS`] starts the
/// count again. One that brought less counts only if the source had the
/// time: a GET larder held back for at least half its time (a rate below
/// the minimum, or a fill ahead yielding while clients use the whole
/// rate) brought little because of larder's own cap, and a far end may cut
/// a connection that is not read; it neither counts nor starts the count
/// again. A source that trickles is waited on, not held back, so it still
/// fails within [`PART_ATTEMPTS`] idle timeouts.
fn after_break(attempt: Attempt, attempts: usize) -> usize {
    if attempt.brought >= RESUME_MIN_PROGRESS {
        0
    } else if attempt.held.saturating_mul(2) >= attempt.took && !attempt.held.is_zero() {
        attempts
    } else {
        attempts + 1
    }
}

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
            crate::faults::check(crate::faults::Point::TempWrite)?;
            let (file, at) = (&self.file, self.at);
            if !self.extents.write_if_open(|| file.write_all_at(&chunk, at))? {
                return Err(Error::Internal("the fill went on as one stream without this part".into()));
            }
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
    /// Where an upstream whose ranges proved unreliable is remembered.
    pub ranges: &'a RangeTrust,
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
    /// Upstream's answer stands (404, 403, 429), or it sent what it must
    /// not: the fill fails.
    Failed(Error),
    /// The disk failed (a write of the temp file): the fill fails.
    Local(Error),
    /// Upstream answered the part's range with more than asked: the whole
    /// blob (`from` 0), or a `206` from the part's start that runs past its
    /// end. The fill goes on as one stream.
    Unranged {
        opened: OpenedPart,
        from: u64,
    },
}

/// How the parts of a fill ended.
enum Ended {
    /// Every part is written.
    Written,
    /// Upstream failed a part for good: what the hash holds may be resumed
    /// by another source.
    Failed(Error),
    /// The disk failed.
    Local(Error),
    /// Upstream's ranges are unreliable: the rest as one stream.
    Unranged { opened: OpenedPart, from: u64 },
}

/// Why a GET of the rest of a blob as one stream gave no body.
enum StreamOpen {
    /// The connection or the server failed: another GET may do.
    Retry(Error),
    /// Upstream's answer stands, or it answered other bytes than asked.
    Fail(Error),
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
        let ended = loop {
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
                break Ended::Written;
            }
            tokio::select! {
                Some(outcome) = parts.next() => match outcome {
                    Outcome::Done => {}
                    Outcome::Broke { rest, error, attempts } if attempts < PART_ATTEMPTS => {
                        tracing::warn!(digest = %self.digest, from = rest.0, to = rest.1, %error, "a part broke off; resuming it");
                        metrics().fill_part_resumes.with_label_values(&[name]).inc();
                        parts.push(self.fetch(extents, rest, None, attempts));
                    }
                    Outcome::Broke { error, .. } | Outcome::Failed(error) => break Ended::Failed(error),
                    Outcome::Local(error) => break Ended::Local(error),
                    Outcome::Unranged { opened, from } => break Ended::Unranged { opened, from },
                },
                done = async { hashing.as_mut().expect("guarded").await }, if hashing.is_some() => {
                    hashing = None;
                    // The hash reads back what the parts wrote: a failed
                    // read is the disk's failure, and fails the fill.
                    match done {
                        Ok(Ok(w)) => writer = Some(w),
                        Ok(Err(e)) => return Err(Interrupted::local(e)),
                        Err(e) => return Err(Interrupted::local(Error::Internal(format!("fill hash task failed: {e}")))),
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
            (None, None) => return Err(Interrupted::local(Error::Internal("a ranged fill lost its hash".into()))),
        };
        match ended {
            Ended::Written => {
                debug_assert_eq!(extents.contiguous(), self.size);
                writer.absorb(self.size).await.map_err(Interrupted::local)
            }
            Ended::Failed(error) => Err(Interrupted { error, cause: Cause::Broke(writer) }),
            Ended::Local(error) => Err(Interrupted::local(error)),
            Ended::Unranged { opened, from } => self.stream(writer, extents, Some((opened, from))).await,
        }
    }

    /// The rest of the blob as one stream, once upstream answered a part's
    /// range with more than asked: from the end of the hashed prefix,
    /// reading `answer` (that answer, from byte `from`) if it starts at or
    /// before it, else a new GET of the rest. A stream that breaks off
    /// resumes from the byte it reached, [`PART_ATTEMPTS`] weak GETs in a
    /// row at most, like a part. Bytes beyond the prefix that parts wrote
    /// already are written again, the same bytes.
    async fn stream(
        &self,
        writer: Writer,
        extents: &Arc<Extents>,
        mut answer: Option<(OpenedPart, u64)>,
    ) -> Result<Writer, Interrupted> {
        let name = self.upstream.name();
        self.ranges.distrust(name);
        // The dropped parts' writes still running end first, and none
        // starts after: the stream rewrites their bytes, and hashes its own.
        let closing = Arc::clone(extents);
        blocking(move || {
            closing.close();
            Ok(())
        })
        .await
        .map_err(Interrupted::local)?;
        let mut writer = writer.absorb(extents.contiguous()).await.map_err(Interrupted::local)?;
        tracing::info!(digest = %self.digest, from = writer.written(), "upstream's ranges are unreliable: the rest of the blob as one stream");
        let mut attempts = 0;
        loop {
            let at = writer.written();
            let opened = match answer.take().filter(|(_, from)| *from <= at) {
                Some(opened) => Ok(opened),
                None => self.open_rest(at).await,
            };
            let (OpenedPart { body, permit }, from) = match opened {
                Ok(opened) => opened,
                Err(StreamOpen::Retry(error)) => {
                    attempts += 1;
                    if attempts >= PART_ATTEMPTS {
                        return Err(Interrupted { error, cause: Cause::Broke(writer) });
                    }
                    continue;
                }
                Err(StreamOpen::Fail(error)) => return Err(Interrupted { error, cause: Cause::Broke(writer) }),
            };
            let pace = self.upstream.bandwidth().pace(self.priority);
            let bounds =
                Bounds { declared: Some(self.size), limit: self.size, idle: self.idle, pace: Some(pace.clone()) };
            let received = [metrics().upstream_bytes.with_label_values(&[name])];
            let began = tokio::time::Instant::now();
            let copied = copy_body(body, writer, at - from, bounds, self.tx, &received).await;
            drop(permit);
            match copied {
                Ok(w) => return Ok(w),
                Err(Interrupted { error, cause: Cause::Broke(w) }) => {
                    let attempt = Attempt { brought: w.written() - at, took: began.elapsed(), held: pace.held() };
                    attempts = after_break(attempt, attempts);
                    writer = w;
                    if attempts >= PART_ATTEMPTS {
                        return Err(Interrupted { error, cause: Cause::Broke(writer) });
                    }
                    tracing::warn!(digest = %self.digest, from = writer.written(), %error, "the stream broke off; resuming it");
                    metrics().fill_part_resumes.with_label_values(&[name]).inc();
                }
                Err(other) => return Err(other),
            }
        }
    }

    /// A GET of the blob from `at` to its end, checked: a `206` from `at`
    /// of a blob of the size the first part said, or a `200` (the whole
    /// blob, whose first `at` bytes are then skipped). Returns the answer
    /// and the offset its body starts at.
    async fn open_rest(&self, at: u64) -> Result<(OpenedPart, u64), StreamOpen> {
        let opened = match self.upstream.get_blob(self.repo, self.digest, Span::from(at), self.priority).await {
            Ok(Some(opened)) => opened,
            Ok(None) => return Err(StreamOpen::Fail(Error::BlobUnknown(*self.digest))),
            Err(e) if retryable(&e) => return Err(StreamOpen::Retry(e.into())),
            Err(e) => return Err(StreamOpen::Fail(e.into())),
        };
        let from = if opened.response.status() == http::StatusCode::PARTIAL_CONTENT {
            match content_range(opened.response.headers()) {
                Some((first, _, Some(total))) if first == at && total == self.size => at,
                other => {
                    let answered = crate::upstream::described_range(other);
                    let e = format!(
                        "upstream answered {answered} to a GET of {} of a {}-byte blob",
                        Span::from(at),
                        self.size
                    );
                    return Err(StreamOpen::Fail(UpstreamError::Protocol(e).into()));
                }
            }
        } else {
            0
        };
        let Opened { response, permit } = opened;
        let body = response.into_body().map_err(|e| Box::new(e) as crate::body::BoxError).boxed_unsync();
        Ok((OpenedPart { body, permit }, from))
    }

    /// One GET of the part `[start, end)` (or the answer already opened for
    /// it), written at its offset. `attempts`: GETs of this part in a row
    /// that brought less than [`RESUME_MIN_PROGRESS`] so far.
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
        let pace = self.upstream.bandwidth().pace(self.priority);
        let bounds = Bounds { declared: Some(end), limit: end, idle: self.idle, pace: Some(pace.clone()) };
        let (upstream_bytes, part_bytes) =
            (metrics().upstream_bytes.with_label_values(&[name]), metrics().fill_part_bytes.with_label_values(&[name]));
        let began = tokio::time::Instant::now();
        let copied = copy_body(body, sink, 0, bounds, self.tx, &[upstream_bytes, part_bytes]).await;
        drop(permit);
        match copied {
            Ok(_) => Outcome::Done,
            Err(Interrupted { cause: Cause::Broke(sink), .. }) if sink.at >= end => Outcome::Done,
            Err(Interrupted { error, cause: Cause::Broke(sink) }) => {
                let attempt = Attempt { brought: sink.at - start, took: began.elapsed(), held: pace.held() };
                Outcome::Broke { rest: (sink.at, end), error, attempts: after_break(attempt, attempts) }
            }
            Err(Interrupted { error, cause: Cause::Lied }) => Outcome::Failed(error),
            Err(Interrupted { error, cause: Cause::Local }) => Outcome::Local(error),
        }
    }

    /// A ranged GET of `[start, end)`, checked: a `206` from `start` of a
    /// blob of the size the first part said, ending at `end` or before (a
    /// short answer: the rest is asked for again). A `200`, or a `206`
    /// from `start` that runs past `end`, is [`Outcome::Unranged`]; one
    /// from elsewhere, or of a blob of another size, fails the fill.
    async fn open(&self, start: u64, end: u64) -> Result<OpenedPart, Outcome> {
        let span = Span { start, end: Some(end) };
        let broke = |error: Error| Outcome::Broke { rest: (start, end), error, attempts: 0 };
        let opened = match self.upstream.get_blob(self.repo, self.digest, span, self.priority).await {
            Ok(Some(opened)) => opened,
            Ok(None) => return Err(Outcome::Failed(Error::BlobUnknown(*self.digest))),
            Err(e) if retryable(&e) => return Err(broke(e.into())),
            Err(e) => return Err(Outcome::Failed(e.into())),
        };
        let ranged = opened.response.status() == http::StatusCode::PARTIAL_CONTENT;
        let from = match (ranged, content_range(opened.response.headers())) {
            (false, _) => Some(0),
            (true, Some((first, last, Some(total)))) if first == start && total == self.size => {
                (last >= end).then_some(start)
            }
            (true, other) => {
                // Other bytes than asked: this fill cannot use them, and the
                // next ones go as one stream.
                self.ranges.distrust(self.upstream.name());
                let (answered, asked) = (crate::upstream::described_range(other), Span { start, end: Some(end) });
                let e = format!("upstream answered {answered} to a GET of {asked} of a {}-byte blob", self.size);
                return Err(Outcome::Failed(UpstreamError::Protocol(e).into()));
            }
        };
        let Opened { response, permit } = opened;
        let body = response.into_body().map_err(|e| Box::new(e) as crate::body::BoxError).boxed_unsync();
        let opened = OpenedPart { body, permit };
        match from {
            Some(from) => Err(Outcome::Unranged { opened, from }),
            None => Ok(opened),
        }
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
    fn a_get_that_brings_little_counts_only_when_the_source_not_the_bandwidth_held_it() {
        let s = Duration::from_secs;
        let attempt = |brought, took, held| Attempt { brought, took: s(took), held: s(held) };
        // A trickle: 64 KiB, then the idle timeout; never held back.
        assert_eq!(after_break(attempt(64 << 10, 2, 0), 1), 2);
        // Enough bytes start the count again, however it was held.
        assert_eq!(after_break(attempt(RESUME_MIN_PROGRESS, 2, 0), 2), 0);
        assert_eq!(after_break(attempt(RESUME_MIN_PROGRESS, 60, 59), 2), 0);
        // Held back by max_bandwidth (or while clients use all of it) for
        // most of its time: larder's cap, not the source; it does not count.
        assert_eq!(after_break(attempt(64 << 10, 60, 59), 2), 2);
        assert_eq!(after_break(attempt(0, 40, 20), 2), 2);
        // Held a little, waited on the source the most: it counts.
        assert_eq!(after_break(attempt(64 << 10, 40, 1), 2), 3);
    }

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
