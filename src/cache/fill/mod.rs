//! Blob fills: one upstream GET per digest however many clients ask. The
//! fill runs in its own task, writes to a temp file while hashing, and
//! publishes how far it got through a `watch` channel. Every client, the
//! first included, is a reader of that file: it reads with `pread` up to
//! the published offset, so a slow reader never slows the fill or anyone
//! else, and memory does not grow with the number of readers or their
//! backlog. A client that disconnects drops only its reader; the fill goes
//! on and commits, so the next pull is warm.
//!
//! A large blob may be fetched as parallel ranged parts (`parts`):
//! then bytes beyond the contiguous prefix are written too, and a reader
//! whose range starts there reads them as soon as they are (asking the
//! fill for its part first when no connection fetches it yet).
//!
//! A fill never wedges its digest: its task removes its flight and
//! publishes the failure in a drop guard (`spawn_fill`), so a panic or a
//! cancelled task fails the fill like any error, and every fill has a
//! deadline derived from its size ([`deadline`]).

mod ahead;
mod chain;
mod copy;
mod deadline;
pub mod parts;
mod progress;
pub mod ranges;
pub mod source;

use std::collections::HashMap;
use std::fs::File;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::sync::watch;

use crate::body::Body;
use crate::error::Error;
use crate::oci::Digest;
use crate::sendfile::{self, FileSink};
use crate::upstream::Priority;

pub use ahead::Resolved;
pub use copy::{Bounds, Cause, Interrupted, WRITE_CHUNK, Writer, copy_body};
pub use deadline::{FILL_GRACE, FILL_MIN_RATE, deadline};
pub use progress::{Extents, Progress, UNVOUCHED};

/// Largest read a client's body stream makes from a blob file at once
/// (tokio's default 4 KiB reads are several times slower).
pub const READ_CHUNK: usize = 256 << 10;

/// A fill in flight, and the repository it was started for: a failure
/// that depends on the repository (upstream's 404 or 403 for it) is not
/// another repository's answer.
#[derive(Clone)]
pub struct Flight {
    pub progress: watch::Receiver<Progress>,
    /// `upstream\0repo` of the request that started it.
    pub owner: String,
    /// Whether it runs ahead of any client (promoted when one joins).
    pub priority: Priority,
}

/// What [`Fills::join_or_start`] did.
pub enum Attach {
    /// Joined the fill already in flight.
    Joined(Flight),
    /// Registered a new fill and called `start`.
    Started(watch::Receiver<Progress>),
    /// Committed a moment ago: read the committed blob instead.
    Committed,
    /// Its file is being removed (eviction, purge): wait with
    /// [`removal_finished`], then try again.
    Removing(watch::Receiver<u64>),
}

#[derive(Default)]
struct State {
    inflight: HashMap<Digest, Flight>,
    /// Digests whose rows are gone and whose files are being unlinked: no
    /// fill may start (and rename a new file into place) until they are.
    removing: std::collections::HashSet<Digest>,
    /// Digests an import is committing (how many imports): their files are
    /// put in place before their rows, so a removal leaves them alone.
    importing: HashMap<Digest, usize>,
}

/// The fills in flight, by digest, and the removals that must not overlap them.
pub struct Fills {
    // A std Mutex, held only for map lookups and inserts, never across `.await`.
    state: Mutex<State>,
    /// Bumped whenever a removal finishes; waiters subscribe under the lock.
    removals: watch::Sender<u64>,
    /// Upstreams whose ranges proved unreliable lately.
    pub ranges: ranges::RangeTrust,
}

impl Default for Fills {
    fn default() -> Self {
        Fills { state: Mutex::default(), removals: watch::channel(0).0, ranges: ranges::RangeTrust::default() }
    }
}

impl Fills {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The fill in flight for `digest`, if any.
    pub fn get(&self, digest: &Digest) -> Option<Flight> {
        self.lock().inflight.get(digest).cloned()
    }

    /// Joins the fill for `digest`, or registers a new one for `owner` at
    /// `priority` and calls `start` with its sender. `recently_committed`
    /// is checked under the same lock, so a fill that finished a moment
    /// ago is not started again.
    pub fn join_or_start(
        &self,
        digest: Digest,
        (owner, priority): (&str, &Priority),
        recently_committed: impl FnOnce() -> bool,
        start: impl FnOnce(watch::Sender<Progress>),
    ) -> Attach {
        let mut state = self.lock();
        if let Some(flight) = state.inflight.get(&digest) {
            return Attach::Joined(flight.clone());
        }
        if state.removing.contains(&digest) {
            return Attach::Removing(self.removals.subscribe());
        }
        if recently_committed() {
            return Attach::Committed;
        }
        let (tx, rx) = watch::channel(Progress::Connecting);
        let flight = Flight { progress: rx.clone(), owner: owner.to_owned(), priority: priority.clone() };
        state.inflight.insert(digest, flight);
        start(tx);
        Attach::Started(rx)
    }

    pub fn remove(&self, digest: &Digest) {
        self.lock().inflight.remove(digest);
    }

    /// Marks `digests` as being removed, except those with a fill in
    /// flight or an import committing them (either renames a new file
    /// into place itself).
    /// Returns the ones marked; call [`Fills::end_removal`] with them.
    pub fn begin_removal(&self, digests: impl IntoIterator<Item = Digest>) -> Vec<Digest> {
        let mut state = self.lock();
        let marked: Vec<Digest> = digests
            .into_iter()
            .filter(|d| !state.inflight.contains_key(d) && !state.importing.contains_key(d))
            .collect();
        state.removing.extend(marked.iter().copied());
        marked
    }

    /// Marks `digests` as being committed by an import, so that no removal
    /// unlinks a file the import renames into place before its row exists.
    /// If one of them is being removed now, marks nothing and returns what
    /// to wait on ([`removal_finished`]) before trying again.
    pub fn begin_import(&self, digests: &[Digest]) -> Option<watch::Receiver<u64>> {
        let mut state = self.lock();
        if digests.iter().any(|d| state.removing.contains(d)) {
            return Some(self.removals.subscribe());
        }
        for d in digests {
            *state.importing.entry(*d).or_default() += 1;
        }
        None
    }

    /// Ends what [`Fills::begin_import`] marked.
    pub fn end_import(&self, digests: &[Digest]) {
        let mut state = self.lock();
        for d in digests {
            if let Some(n) = state.importing.get_mut(d) {
                *n -= 1;
                if *n == 0 {
                    state.importing.remove(d);
                }
            }
        }
    }

    pub fn end_removal(&self, digests: &[Digest]) {
        let mut state = self.lock();
        for d in digests {
            state.removing.remove(d);
        }
        self.removals.send_modify(|n| *n += 1);
    }

    pub fn len(&self) -> usize {
        self.lock().inflight.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Waits until a removal that was in progress when `rx` was taken ends.
pub async fn removal_finished(mut rx: watch::Receiver<u64>) {
    let _ = rx.changed().await;
}

/// Waits until the fill has response headers (or failed): the file to read
/// and the size if known.
pub async fn wait_for_headers(rx: &mut watch::Receiver<Progress>) -> Result<(Arc<File>, Option<u64>), Error> {
    loop {
        match &*rx.borrow_and_update() {
            Progress::Connecting => {}
            Progress::Streaming { file, size, .. } => return Ok((Arc::clone(file), *size)),
            Progress::Verified { file, size } | Progress::Complete { file, size } => {
                return Ok((Arc::clone(file), Some(*size)));
            }
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
            Progress::Connecting | Progress::Streaming { .. } | Progress::Verified { .. } => {}
        }
        if rx.changed().await.is_err() {
            return Err(Error::Internal("fill ended without a result".into()));
        }
    }
}

/// A response body reading `file` from `start` to `end` (exclusive; `None`:
/// to the end of the blob, learnt from the fill). With `progress`, the file
/// is a fill in flight: reads stop at the published offset and wait for
/// more; a failed fill ends the body with an error, which aborts the
/// client's connection. With a `sink` (a cleartext HTTP/1 connection),
/// ranges already in the page cache are sent from the file with sendfile
/// instead of being read here (see [`crate::sendfile`]).
///
/// `via` says who reads. A client's range (one that starts after byte 0
/// or ends before the blob does) gets bytes of a fill in flight before
/// the digest matched only if they came from upstream itself, no worse
/// than a direct pull: bytes from the shared tier or a peer wait for the
/// digest, because a range that ends cleanly is taken as correct. A read
/// of the whole blob streams at once either way, its final byte held back
/// until the digest matched. A peer's read streams at once too: the peer
/// hashes every byte itself.
pub fn read_body(
    file: Arc<File>,
    progress: Option<watch::Receiver<Progress>>,
    start: u64,
    end: Option<u64>,
    via: crate::cache::Via,
    sink: Option<FileSink>,
) -> Body {
    let source = if progress.is_some() { "fill" } else { "disk" };
    let served = crate::metrics::metrics().bytes_served.with_label_values(&[source]);
    let state = Reader {
        file,
        progress,
        start,
        offset: start,
        end,
        first_total: None,
        client: via == crate::cache::Via::Client,
        served,
        buffers: crate::cache::store::pread::Buffers::default(),
        sink,
        wanted: None,
    };
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
    start: u64,
    offset: u64,
    end: Option<u64>,
    /// The blob's size as the fill first told it: the response promised it.
    first_total: Option<u64>,
    /// A client's read (see [`read_body`]), not a peer's.
    client: bool,
    served: prometheus::IntCounter,
    buffers: crate::cache::store::pread::Buffers,
    sink: Option<FileSink>,
    /// The offset this reader last told a ranged fill it waits for.
    wanted: Option<u64>,
}

/// What a fill in flight offers a reader now.
struct Offer {
    /// Bytes from the reader's offset up to this are written.
    available: u64,
    /// The end of the contiguous prefix.
    prefix: u64,
    total: Option<u64>,
    verified: bool,
    vouched_from: u64,
    /// A ranged fill's extents, to say where the reader waits.
    extents: Option<Arc<Extents>>,
}

impl Offer {
    fn settled(available: u64, total: Option<u64>) -> Offer {
        Offer { available, prefix: available, total, verified: true, vouched_from: 0, extents: None }
    }
}

impl Reader {
    /// What the fill offers now. A fill that started over in a new temp
    /// file (its first source's bytes failed the digest) is followed there
    /// by a reader that has sent nothing yet; one that already sent bytes
    /// of the bad attempt, or that promised another size, is aborted.
    fn offer(&mut self) -> Result<Offer, crate::body::BoxError> {
        let Some(rx) = &mut self.progress else {
            return Ok(Offer::settled(self.end.unwrap_or(0), self.end));
        };
        let (file, offer) = match &*rx.borrow_and_update() {
            Progress::Connecting => {
                let offer = Offer { verified: false, ..Offer::settled(0, None) };
                (None, offer)
            }
            Progress::Streaming { file, written, size, vouched_from, extents } => {
                // Beyond the prefix, a ranged fill may have written the
                // bytes at the reader's offset already.
                let available = match extents {
                    Some(x) => x.reach(self.offset).unwrap_or(*written).max(*written),
                    None => *written,
                };
                let offer = Offer {
                    available,
                    prefix: *written,
                    total: *size,
                    verified: false,
                    vouched_from: *vouched_from,
                    extents: extents.clone(),
                };
                (Some(Arc::clone(file)), offer)
            }
            Progress::Verified { file, size } | Progress::Complete { file, size } => {
                (Some(Arc::clone(file)), Offer::settled(*size, Some(*size)))
            }
            Progress::Failed(e) => return Err(Box::new(e.clone())),
        };
        if let Some(file) = file.filter(|f| !Arc::ptr_eq(f, &self.file)) {
            if self.offset > self.start {
                return Err("the fill started over after its source failed verification".into());
            }
            self.file = file;
        }
        match (self.first_total, offer.total) {
            (Some(a), Some(b)) if a != b => return Err(format!("the blob's size changed from {a} to {b}").into()),
            (None, Some(b)) => self.first_total = Some(b),
            _ => {}
        }
        Ok(offer)
    }

    /// The next chunk, `None` at the end of the range. While the fill is
    /// not verified, a range that reaches the blob's end is held back by
    /// its final byte: an HTTP/1 client that got all `Content-Length`
    /// bytes would take the blob as complete even if the connection is
    /// then aborted, so the last byte goes out only after the digest
    /// matched. It does not wait for the commit's fsyncs (see
    /// [`Progress::Verified`]). A client's partial range waits for the
    /// digest before bytes not vouched for by upstream (see [`read_body`]).
    async fn next(&mut self) -> Result<Option<Bytes>, crate::body::BoxError> {
        loop {
            let Offer { available, prefix, total, verified, vouched_from, extents } = self.offer()?;
            if verified && self.progress.is_some() {
                // The bytes are final: a commit that fails from here on
                // (the disk, the index) does not make them wrong, so the
                // reader stops following the fill and reads to its end.
                self.end = Some(self.end.unwrap_or(available));
                self.progress = None;
            }
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
            let partial = self.start > 0 || !reaches_blob_end;
            if !verified && self.client && partial && self.offset < vouched_from {
                limit = self.offset;
            }
            if self.offset < limit {
                // With a sink, a chunk wholly in the page cache goes by
                // sendfile (which would otherwise wait for the disk).
                let sendable = (limit - self.offset).min(sendfile::MAX_CHUNK as u64);
                let bytes = match &self.sink {
                    Some(sink) if crate::cache::store::residency::cached(&self.file, self.offset, sendable) => {
                        sink.chunk(&self.file, self.offset, sendable as usize)
                    }
                    _ => {
                        let len = (limit - self.offset).min(READ_CHUNK as u64) as usize;
                        crate::cache::store::pread::read_at(&self.file, self.offset, len, &mut self.buffers).await?
                    }
                };
                self.offset += bytes.len() as u64;
                self.served.inc_by(bytes.len() as u64);
                return Ok(Some(bytes));
            }
            let Some(rx) = self.progress.as_mut().filter(|_| !verified) else {
                // Verified, yet the range ends past the blob: ranges are
                // validated against the size first, but never spin on it.
                return Err("blob ended before the requested range".into());
            };
            // Waiting beyond the prefix of a ranged fill: its part goes next.
            if let Some(x) = extents.filter(|_| self.offset > prefix && self.wanted != Some(self.offset)) {
                x.want(self.offset);
                self.wanted = Some(self.offset);
            }
            let terminal =
                |p: &Progress| matches!(p, Progress::Verified { .. } | Progress::Complete { .. } | Progress::Failed(_));
            if rx.changed().await.is_err() && !terminal(&rx.borrow()) {
                return Err("fill ended without a result".into());
            }
        }
    }
}

#[cfg(test)]
mod tests;
