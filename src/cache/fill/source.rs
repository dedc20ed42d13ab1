//! Where a fill's bytes come from. The facade tries its sources in order,
//! and when one fails in the middle of a body the next resumes from the
//! byte reached, with the running hash kept (see [`super::copy_body`]):
//! a client sees a pause, not an error.

use std::time::Duration;

use crate::body::Body;
use crate::cluster::PeerUrl;
use crate::error::Error;
use crate::upstream::Permit;

/// One place a blob can be read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The object store all replicas share (its bytes are hashed here too).
    Shared,
    /// The digest's owner among the peers, which fills it once for all;
    /// after it, the next replicas in the digest's ranking, which take
    /// over its keys when it dies.
    Peer(PeerUrl),
    /// The upstream registry itself: the last resort, whose answers are final.
    Upstream,
}

impl Source {
    /// Whether its bytes may reach a client's range before the digest
    /// matched: only upstream's, since a client pulling directly would get
    /// the same. Its word on a blob's size is also final.
    pub fn vouched(&self) -> bool {
        matches!(self, Source::Upstream)
    }

    /// A label for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Source::Shared => "shared",
            Source::Peer(_) => "peer",
            Source::Upstream => "upstream",
        }
    }
}

/// A source's body, from the offset asked for.
pub struct SourceBody {
    pub body: Body,
    /// The blob's whole size, if the source said.
    pub total: Option<u64>,
    /// Bytes at the start of `body` that the fill already has: a source
    /// that answered a range request with the whole blob.
    pub skip: u64,
    /// Held while the body is read (an upstream's concurrency slot).
    pub permit: Option<Permit>,
    /// Counts the bytes received from this source (`None`: it counts them itself).
    pub received: Option<prometheus::IntCounter>,
    /// Longest pause allowed between two chunks of the body.
    pub idle: Duration,
    /// The shared tier's object has another size than the blob's: once
    /// verified, the blob is uploaded over it.
    pub mend: bool,
}

/// Why a source did not give a body.
#[derive(Debug)]
pub enum Unavailable {
    /// Its answer stands: upstream (asked directly, or by the key's owner)
    /// says the blob does not exist in this repository, denies it, or
    /// rate-limits. No other source is tried.
    Final(Error),
    /// It does not have the blob or cannot be reached: try the next one.
    Next(Error),
    /// A peer answered with upstream's (or its disk's) failure: another
    /// peer would only ask upstream the same, so the other peers are
    /// skipped and upstream is asked directly.
    Relayed(Error),
}
