//! A purge on every replica. Each replica keeps its own tags, memberships
//! and blobs, and asks the others before upstream: a purge on one replica
//! alone would be undone by the next request, answered by an owner that
//! still holds the old mapping. So the replica that was asked purges
//! itself, then every other current member through its peer listener
//! ([`super::client::PURGE_PATH`], cluster secret required), all at once,
//! retrying each until it acknowledged or cannot be connected to (down).
//! The result lists every member.
//!
//! A replica that was down keeps what it held; when it is back, a purge
//! run again reaches it (the result names it).

use std::time::Duration;

use serde::Serialize;

use super::PeerLink;
use super::client::PeerError;
use super::peers::PeerUrl;

/// Wait for one replica's answer to a purge: it answers when done, and
/// a large upstream's rows and files take a while to remove.
pub const PEER_PURGE_TIMEOUT: Duration = Duration::from_secs(120);
/// A replica that answers but not with an acknowledgement (an error, no
/// answer in time) is asked again, with a pause doubling from
/// [`RETRY_PAUSE_MIN`] up to [`RETRY_PAUSE_MAX`], until this much time has
/// passed since the first attempt; then it is reported as failed. An
/// operator's purge thus ends within about [`PEER_PURGE_TIMEOUT`] plus this.
pub const PURGE_RETRY_FOR: Duration = Duration::from_secs(60);
pub const RETRY_PAUSE_MIN: Duration = Duration::from_millis(500);
pub const RETRY_PAUSE_MAX: Duration = Duration::from_secs(5);

/// How the purge went on one other replica.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaPurge {
    /// The replica's peer URL.
    pub peer: String,
    /// `purged`, `down` (no connection could be made: it keeps what it
    /// held) or `failed` (it answered, but never acknowledged in time).
    pub result: &'static str,
    /// What it removed, as it reported it (for `purged`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub purged: Option<serde_json::Value>,
    /// Why not (for `down` and `failed`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Asks every other current member to purge what `query` names
/// (`upstream=NAME[&repo=REPO]`), all at once; one entry per member.
pub async fn everywhere(link: &PeerLink, query: &str) -> Vec<ReplicaPurge> {
    let others: Vec<PeerUrl> = link.peers.members().into_iter().filter(|p| !link.peers.is_me(p)).collect();
    futures_util::future::join_all(others.into_iter().map(|peer| one(link, peer, query))).await
}

async fn one(link: &PeerLink, peer: PeerUrl, query: &str) -> ReplicaPurge {
    let started = tokio::time::Instant::now();
    let mut pause = RETRY_PAUSE_MIN;
    let report = |result, purged, error| ReplicaPurge { peer: peer.to_string(), result, purged, error };
    loop {
        match link.client.purge(&peer, query, PEER_PURGE_TIMEOUT).await {
            Ok(purged) => {
                tracing::info!(%peer, %purged, "replica purged");
                return report("purged", Some(purged), None);
            }
            Err(PeerError::Unreachable(e)) => {
                tracing::warn!(%peer, error = e, "replica down: not purged");
                link.peers.mark_down(&peer);
                return report("down", None, Some(e));
            }
            Err(e) if started.elapsed() + pause > PURGE_RETRY_FOR => {
                tracing::warn!(%peer, error = %e, "replica did not acknowledge the purge");
                return report("failed", None, Some(e.to_string()));
            }
            Err(e) => {
                tracing::warn!(%peer, error = %e, retry_in = ?pause, "purge not acknowledged; asking again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(RETRY_PAUSE_MAX);
            }
        }
    }
}
