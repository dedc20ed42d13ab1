//! The state every request handler shares: the config, the upstreams, the
//! cache, client authentication and the keep-warm loop. Built once by [`crate::app::start`];
//! the server reads it, nothing below the server knows it exists.

use std::sync::Arc;

use crate::cache::Cache;
use crate::client_auth::ClientAuth;
use crate::config::Config;
use crate::upstream::Upstreams;
use crate::warm::Warm;

pub struct App {
    pub config: Config,
    pub upstreams: Upstreams,
    pub cache: Arc<Cache>,
    /// Client authentication, when `[server.auth]` is configured.
    pub auth: Option<Arc<ClientAuth>>,
    /// The keep-warm loop (`[[warm]]`, `cache.warm_file`); idle without them.
    pub warm: Arc<Warm>,
}
