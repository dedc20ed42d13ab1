//! The upload queue's items and their states, as a pure state machine:
//! every transition happens under one lock, with a marker's write or
//! removal between two of them, so the interleaving tests in
//! `upload/tests.rs` can drive it step by step.

use std::collections::{HashMap, VecDeque};

use super::ObjectKind;
use crate::oci::Digest;

/// One item of the queue: a blob or a manifest, by digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) struct Job {
    pub(super) kind: ObjectKind,
    pub(super) digest: Digest,
}

/// Where an item is. Transitions happen under the queue's lock; the
/// marker is written or removed between two of them, never under it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    /// Its marker is being written; not runnable yet.
    Writing,
    /// Marker on disk, in the line.
    Waiting,
    /// Being uploaded. `again`: enqueued once more meanwhile (committed
    /// again after an eviction): it runs again instead of finishing.
    Running { again: bool },
    /// Done; its marker is being removed.
    Finishing,
}

/// What an enqueue does next.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Enqueue {
    /// Write the marker, then [`Queue::end_enqueue`].
    Write,
    /// Already queued (or running, now to run again): nothing to do.
    Done,
    /// The item is between two states: wait for a change, then again.
    Wait,
}

/// What finishing an upload does next.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Finish {
    /// Enqueued again while it ran: back in the line, marker kept.
    Again,
    /// Remove the marker, then [`Queue::end_finish`].
    RemoveMarker,
}

/// What removing an item from the cache does to its upload.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Cancel {
    /// Not queued.
    Nothing,
    /// Taken out of the line: remove its marker, then [`Queue::end_finish`].
    RemoveMarker,
    /// Running: tell the attempt to stop (it then finishes as usual).
    StopAttempt,
}

/// The items and their states; pure, so that its transitions can be
/// tested in every interleaving.
#[derive(Default, Clone)]
pub(super) struct Queue {
    /// Runnable items, in order.
    waiting: VecDeque<Job>,
    states: HashMap<Job, State>,
    /// Attempts of an item that ran out of time, in a row.
    deadline_failures: HashMap<Job, u32>,
}

impl Queue {
    pub(super) fn begin_enqueue(&mut self, job: Job) -> Enqueue {
        match self.states.get_mut(&job) {
            None => {
                self.states.insert(job, State::Writing);
                Enqueue::Write
            }
            Some(State::Waiting) => Enqueue::Done,
            Some(State::Running { again }) => {
                *again = true;
                Enqueue::Done
            }
            Some(State::Writing | State::Finishing) => Enqueue::Wait,
        }
    }

    /// The marker write ended: the item is runnable, or (the write
    /// failed) not queued at all.
    pub(super) fn end_enqueue(&mut self, job: Job, written: bool) {
        if written {
            self.states.insert(job, State::Waiting);
            self.waiting.push_back(job);
        } else {
            self.states.remove(&job);
        }
    }

    /// The next item to upload, now running.
    pub(super) fn pop(&mut self) -> Option<Job> {
        let job = self.waiting.pop_front()?;
        self.states.insert(job, State::Running { again: false });
        Some(job)
    }

    /// An attempt failed: back to the end of the line, marker kept.
    pub(super) fn requeue(&mut self, job: Job) {
        self.states.insert(job, State::Waiting);
        self.waiting.push_back(job);
    }

    pub(super) fn begin_finish(&mut self, job: Job) -> Finish {
        if self.states.get(&job) == Some(&State::Running { again: true }) {
            self.requeue(job);
            return Finish::Again;
        }
        self.states.insert(job, State::Finishing);
        self.deadline_failures.remove(&job);
        Finish::RemoveMarker
    }

    pub(super) fn end_finish(&mut self, job: Job) {
        self.states.remove(&job);
    }

    /// The item left the cache: nothing is left to upload.
    pub(super) fn cancel(&mut self, job: Job) -> Cancel {
        match self.states.get(&job) {
            Some(State::Waiting) => {
                self.waiting.retain(|j| *j != job);
                self.states.insert(job, State::Finishing);
                self.deadline_failures.remove(&job);
                Cancel::RemoveMarker
            }
            Some(State::Running { .. }) => {
                self.states.insert(job, State::Running { again: false });
                Cancel::StopAttempt
            }
            // Being written: an enqueue of a blob committed again after
            // the removal, which must stand. Finishing: already going.
            Some(State::Writing | State::Finishing) | None => Cancel::Nothing,
        }
    }

    /// An attempt of `job` ran out of time: the attempts that did, in a row.
    pub(super) fn ran_out_of_time(&mut self, job: Job) -> u32 {
        let n = self.deadline_failures.entry(job).or_default();
        *n += 1;
        *n
    }

    #[cfg(test)]
    pub(super) fn state(&self, job: &Job) -> Option<State> {
        self.states.get(job).copied()
    }

    #[cfg(test)]
    pub(super) fn waiting(&self) -> &VecDeque<Job> {
        &self.waiting
    }

    /// Items queued, running or between two states.
    pub(super) fn pending(&self) -> usize {
        self.states.len()
    }
}
