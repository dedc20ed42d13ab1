//! larder: a pull-through caching proxy for OCI/Docker registries.
//!
//! A request flows listener → [`server::routes`] (parse) → [`server::handlers`]
//! → [`cache`] (memory tier, disk tier, fill in flight) → [`upstream`].

// One `unsafe` block, in `cache::residency` (a syscall neither rustix nor
// libc wraps); everything else is safe code.
#![deny(unsafe_code)]

pub mod app;
pub mod blocking;
pub mod body;
pub mod cache;
pub mod cli;
pub mod client_auth;
pub mod cluster;
pub mod coalesce;
pub mod config;
pub mod error;
pub mod log_filter;
pub mod log_writer;
pub mod metrics;
pub mod oci;
pub mod policy;
pub mod sendfile;
pub mod server;
pub mod shutdown;
pub mod site;
pub mod state;
pub mod upstream;

/// Sent upstream as `User-Agent`.
pub const USER_AGENT: &str = concat!("larder/", env!("CARGO_PKG_VERSION"));
