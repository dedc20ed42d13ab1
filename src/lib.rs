//! larder: a pull-through caching proxy for OCI/Docker registries.
//!
//! A request flows listener → [`server::routes`] (parse, and the
//! upstream's [`policy`]) → client grants → [`server::handlers`] →
//! [`cache`] (memory → disk → fill in flight → shared tier → the owner
//! among the peers) → [`upstream`].
//!
//! The rooms, from the bottom up:
//!
//! - vocabulary and rules without I/O: [`oci`] (digests, names,
//!   references, media types), [`policy`] (who may pull what), [`site`]
//!   (which hosts are one operator's), [`config`] (one room per section);
//! - plumbing: [`error`] (the one mapping to responses), [`metrics`],
//!   [`blocking`], [`coalesce`], [`background`], [`body`], [`sendfile`],
//!   [`log_filter`], [`log_writer`], [`shutdown`], and [`faults`] (the
//!   test build's injected I/O errors);
//! - [`upstream`]: registries larder pulls from (auth, redirects and the
//!   dial guard, credentials, pull limits);
//! - [`cluster`]: the other replicas (ring, peer set, peer client);
//! - [`cache`]: the facade and its tiers;
//! - [`warm`]: the keep-warm loop (images fetched before anyone asks);
//! - [`client_auth`] and [`state`]: what the server's handlers share;
//! - [`server`]: the registry, admin and peer listeners;
//! - [`app`] (start-up order) and [`cli`] (the operator commands).

// One `unsafe` block, in `cache::store::residency` (a syscall neither rustix nor
// libc wraps); everything else is safe code.
#![deny(unsafe_code)]

pub mod app;
pub mod background;
pub mod blocking;
pub mod body;
pub mod cache;
pub mod cli;
pub mod client_auth;
pub mod cluster;
pub mod coalesce;
pub mod config;
pub mod error;
pub mod faults;
pub mod log_filter;
pub mod log_writer;
pub mod metrics;
pub mod oci;
pub mod peer_slots;
pub mod policy;
pub mod sendfile;
pub mod server;
pub mod shutdown;
pub mod site;
pub mod state;
pub mod upstream;
pub mod warm;

/// Sent upstream as `User-Agent`.
pub const USER_AGENT: &str = concat!("larder/", env!("CARGO_PKG_VERSION"));
