//! The state every request handler shares: the config, the upstreams, the
//! cache and client authentication. Built once by [`crate::app::start`];
//! the server reads it, nothing below the server knows it exists.

use std::sync::Arc;

use crate::cache::Cache;
use crate::client_auth::ClientAuth;
use crate::config::Config;
use crate::upstream::Upstreams;

pub struct App {
    pub config: Config,
    pub upstreams: Upstreams,
    pub cache: Arc<Cache>,
    /// Client authentication, when `[server.auth]` is configured.
    pub auth: Option<Arc<ClientAuth>>,
}
