//! The configured upstreams, looked up by name or alias. A lookup key is
//! never an address: nothing a client sends can make larder dial a host
//! that is not configured here.

use std::collections::HashMap;
use std::sync::Arc;

use super::Upstream;
use crate::config::Config;

pub struct Upstreams {
    by_name: HashMap<String, Arc<Upstream>>,
    default: Option<Arc<Upstream>>,
}

impl Upstreams {
    pub fn new(config: &Config) -> Result<Upstreams, String> {
        let mut by_name = HashMap::new();
        let mut default = None;
        for c in &config.upstreams {
            let upstream = Arc::new(Upstream::new(c.clone()).map_err(|e| format!("upstream {}: {e}", c.name))?);
            for key in std::iter::once(&c.name).chain(&c.aliases) {
                by_name.insert(key.clone(), Arc::clone(&upstream));
            }
            if c.default {
                default = Some(upstream);
            }
        }
        Ok(Upstreams { by_name, default })
    }

    /// The upstream whose name or alias is `key` (case-insensitive, as
    /// host names are).
    pub fn get(&self, key: &str) -> Option<&Arc<Upstream>> {
        self.by_name.get(key).or_else(|| self.by_name.get(&key.to_ascii_lowercase()))
    }

    pub fn default_upstream(&self) -> Option<&Arc<Upstream>> {
        self.default.as_ref()
    }
}
