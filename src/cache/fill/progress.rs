//! How far a fill is, as its readers see it: what the fill publishes on
//! its `watch` channel ([`Progress`]) and, when it fetches the blob as
//! ranged parts, which spans of the temp file are written and which
//! offsets its readers wait for ([`Extents`]). The fill's writers
//! (`copy`, `parts`) and its readers (`read_body`) both use these; this
//! module uses neither.

use std::collections::VecDeque;
use std::fs::File;
use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::Notify;

use crate::error::Error;

/// How far a fill is, as its readers see it.
#[derive(Clone, Debug)]
pub enum Progress {
    /// Waiting for upstream's response headers.
    Connecting,
    /// Bytes `0..written` of the temp file are final; `size` is the
    /// source's `Content-Length` if it sent one. Bytes from `vouched_from`
    /// on came from upstream itself; those before it came from the shared
    /// tier or a peer, and a client's range gets them only once the digest
    /// matched ([`UNVOUCHED`]: none came from upstream yet). With
    /// `extents` (a ranged fill), bytes beyond `written` may be written
    /// too, all from upstream.
    Streaming { file: Arc<File>, size: Option<u64>, written: u64, vouched_from: u64, extents: Option<Arc<Extents>> },
    /// Every byte is written and the digest matched; the commit (fsync,
    /// rename, index row) is under way. Readers may send the last byte,
    /// and one that has seen this reads on to its end whatever the commit
    /// does (`Failed` after this only fails readers that had not looked).
    Verified { file: Arc<File>, size: u64 },
    /// Verified and committed.
    Complete { file: Arc<File>, size: u64 },
    /// Nothing was committed; readers abort their responses.
    Failed(Error),
}

/// `vouched_from` of a fill whose bytes so far all came from the shared
/// tier or a peer.
pub const UNVOUCHED: u64 = u64::MAX;

/// Offsets readers may be waiting for at once, per fill; the oldest want
/// is dropped past it (its reader asks again when it waits elsewhere).
const MAX_WANTS: usize = 64;

/// What a ranged fill has written, and what its readers wait for. Shared
/// by the fill and its readers (through [`Progress::Streaming`]).
#[derive(Debug)]
pub struct Extents {
    inner: Mutex<Inner>,
    /// Notified on each [`Extents::want`]: wakes the ranged fill (`parts`).
    pub(super) wanted: Notify,
    /// Whether parts may still write to the file, read-locked by each
    /// part's write while it runs: false once the fill went on as one
    /// stream ([`Extents::close`]), so that a write of a part that was
    /// dropped (its task runs on) can never land after the stream's bytes
    /// were hashed.
    open: RwLock<bool>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Written spans `[start, end)`: sorted, disjoint and not touching.
    runs: Vec<(u64, u64)>,
    wants: VecDeque<u64>,
}

impl Extents {
    /// Extents whose first `prefix` bytes are written (by earlier sources).
    pub(super) fn new(prefix: u64) -> Extents {
        let runs = if prefix > 0 { vec![(0, prefix)] } else { Vec::new() };
        Extents {
            inner: Mutex::new(Inner { runs, wants: VecDeque::new() }),
            wanted: Notify::new(),
            open: RwLock::new(true),
        }
    }

    /// Runs a part's `write` (on the blocking pool) unless the parts are
    /// closed; `false` if they are.
    pub(super) fn write_if_open(&self, write: impl FnOnce() -> std::io::Result<()>) -> std::io::Result<bool> {
        let open = self.open.read().unwrap_or_else(|p| p.into_inner());
        if !*open {
            return Ok(false);
        }
        write()?;
        Ok(true)
    }

    /// No part writes to the file from now on: waits (on the blocking
    /// pool) for the writes running now to end.
    pub(super) fn close(&self) {
        *self.open.write().unwrap_or_else(|p| p.into_inner()) = false;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The end of the written prefix: every byte before it is written.
    pub fn contiguous(&self) -> u64 {
        match self.lock().runs.first() {
            Some(&(0, end)) => end,
            _ => 0,
        }
    }

    /// The end of the written span holding `offset`, if it is written.
    pub fn reach(&self, offset: u64) -> Option<u64> {
        let inner = self.lock();
        let i = inner.runs.partition_point(|&(_, end)| end <= offset);
        inner.runs.get(i).filter(|&&(start, _)| start <= offset).map(|&(_, end)| end)
    }

    /// A reader waits for `offset`, beyond what is written.
    pub fn want(&self, offset: u64) {
        let mut inner = self.lock();
        if inner.wants.len() >= MAX_WANTS {
            inner.wants.pop_front();
        }
        inner.wants.push_back(offset);
        drop(inner);
        self.wanted.notify_one();
    }

    pub(super) fn pop_want(&self) -> Option<u64> {
        self.lock().wants.pop_front()
    }

    /// Records `[start, end)` as written.
    pub(super) fn record(&self, start: u64, end: u64) {
        let mut inner = self.lock();
        let runs = &mut inner.runs;
        let first = runs.partition_point(|&(_, e)| e < start);
        let mut last = first;
        let (mut s, mut e) = (start, end);
        while last < runs.len() && runs[last].0 <= end {
            s = s.min(runs[last].0);
            e = e.max(runs[last].1);
            last += 1;
        }
        runs.splice(first..last, [(s, e)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = super::super::parts::PART_SIZE;

    #[test]
    fn extents_merge_into_a_prefix_and_answer_how_far_a_reader_may_read() {
        let x = Extents::new(0);
        x.record(2 * M, 3 * M);
        assert_eq!(x.contiguous(), 0);
        assert_eq!(x.reach(2 * M + 5), Some(3 * M));
        assert_eq!(x.reach(M), None);
        x.record(0, 10);
        x.record(10, M);
        assert_eq!(x.contiguous(), M);
        x.record(M, 2 * M);
        assert_eq!(x.contiguous(), 3 * M, "the part far ahead joins the prefix");
        assert_eq!(x.reach(0), Some(3 * M));
        assert_eq!(x.lock().runs, vec![(0, 3 * M)]);
    }

    #[test]
    fn extents_start_with_the_bytes_earlier_sources_wrote() {
        let x = Extents::new(100);
        assert_eq!(x.contiguous(), 100);
        x.record(100, 200);
        assert_eq!(x.contiguous(), 200);
    }

    #[test]
    fn once_closed_no_part_writes() {
        let x = Extents::new(0);
        assert!(x.write_if_open(|| Ok(())).unwrap());
        x.close();
        assert!(!x.write_if_open(|| panic!("a write after the close")).unwrap());
    }

    #[test]
    fn wants_are_kept_in_order_and_bounded() {
        let x = Extents::new(0);
        for i in 0..(MAX_WANTS as u64 + 3) {
            x.want(i);
        }
        assert_eq!(x.pop_want(), Some(3), "the oldest wants were dropped");
    }
}
