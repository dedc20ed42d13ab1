//! Cluster mode: replicas that know each other and give every upstream
//! fetch one owner. This folder holds the pure parts: [`ring`] picks the
//! owner of a key (rendezvous hashing over the live peers) and [`peers`]
//! keeps the peer set (a static list or a DNS name re-resolved
//! periodically) and which peers are down for a while. The peer client and
//! the peer endpoint build on them.

pub mod peers;
pub mod ring;

pub use peers::{PeerUrl, Peers};
