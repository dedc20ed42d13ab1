//! Cluster mode: replicas that know each other and give every upstream
//! fetch one owner. This folder holds the pure parts: [`ring`] picks the
//! owner of a key (rendezvous hashing over the live peers) and [`peers`]
//! keeps the peer set (a static list or a DNS name re-resolved
//! periodically) and which peers are down for a while. [`client`] asks an
//! owner, and [`purge`] asks every replica to forget what a purge names.
//! What answers peers is a listener, so it lives with the others in
//! `server::peer`: this folder imports nothing of the server or of `App`,
//! and the cache can use it without a loop between the modules.

pub mod client;
pub mod peers;
pub mod purge;
pub mod ring;

use std::sync::Arc;

pub use client::PeerClient;
pub use peers::{PeerUrl, Peers};

/// This replica's link to the others: who they are, and how to ask them.
#[derive(Clone)]
pub struct PeerLink {
    pub peers: Arc<Peers>,
    pub client: Arc<PeerClient>,
}

impl PeerLink {
    /// The owner of `key` when it is another replica (`None`: this one).
    pub fn owner_elsewhere(&self, key: &str) -> Option<PeerUrl> {
        let owner = self.peers.owner(key);
        (!self.peers.is_me(&owner)).then_some(owner)
    }

    /// The replica to ask about `key` before upstream: its owner, or, when
    /// this replica is the owner, the runner-up: after this replica joined
    /// (or lost its disk) that is who owned the key before and knows it.
    pub fn first_other(&self, key: &str) -> Option<PeerUrl> {
        self.peers.candidates(key).into_iter().find(|p| !self.peers.is_me(p))
    }
}
