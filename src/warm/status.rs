//! What an operator sees of each warm image (`/status`, the status page,
//! `larder status`) and the `larder_warm_images{state}` gauges.

use serde::{Deserialize, Serialize};

use super::list::FileReport;

/// Where a warm image is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WarmState {
    /// Its manifests and every blob of the chosen platforms are cached.
    Ready,
    /// Being checked for the first time, or its blobs are being fetched.
    Fetching,
    /// Upstream says it is gone (404), and it was there before (larder
    /// has a digest for it): what is cached is still served, as far as
    /// `stale_if_error` allows.
    MissingUpstream,
    /// Upstream has never had it (404 at every check since it was listed):
    /// a typo in the list, or an image not pushed yet. Nothing is cached.
    NotFound,
    /// Upstream failed the check or a fetch; retried at the next interval.
    Failed,
}

impl WarmState {
    pub fn as_str(self) -> &'static str {
        match self {
            WarmState::Ready => "ready",
            WarmState::Fetching => "fetching",
            WarmState::MissingUpstream => "missing_upstream",
            WarmState::NotFound => "not_found",
            WarmState::Failed => "failed",
        }
    }
}

/// One warm image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmStatus {
    /// As listed (`docker.io/library/postgres:16`).
    pub image: String,
    pub upstream: String,
    pub repository: String,
    /// The tag or digest listed.
    pub reference: String,
    /// Platforms chosen (empty: all).
    pub platforms: Vec<String>,
    pub pin: bool,
    /// Listed in the warm file (otherwise in the config's `[[warm]]`).
    pub from_file: bool,
    pub state: WarmState,
    /// The digest the reference last resolved to, and the one before.
    pub digest: Option<String>,
    pub previous_digest: Option<String>,
    /// Bytes of its blobs (chosen platforms) cached, of what its manifests declare.
    pub bytes_cached: u64,
    pub bytes_total: u64,
    /// Unix millis of the last check with upstream, and of the next.
    pub last_check_ms: Option<u64>,
    pub next_check_ms: Option<u64>,
    /// What went wrong at the last check, when something did.
    pub message: Option<String>,
}

/// The warm set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmReport {
    pub images: Vec<WarmStatus>,
    /// `cache.warm_file`, if set, as last read.
    pub file: Option<FileReport>,
}

/// Sets `larder_warm_images{state}` from the images' states.
pub fn count(images: &[WarmStatus]) {
    let m = crate::metrics::metrics();
    for state in
        [WarmState::Ready, WarmState::Fetching, WarmState::MissingUpstream, WarmState::NotFound, WarmState::Failed]
    {
        let n = images.iter().filter(|i| i.state == state).count();
        m.warm_images.with_label_values(&[state.as_str()]).set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}
