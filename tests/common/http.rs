//! A plain HTTP client for talking to peers directly (never through a proxy).

use std::time::Duration;

/// Every manifest media type a registry may store, for `Accept`.
pub const MANIFEST_MEDIA_TYPES: [&str; 4] = [
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];

/// A fresh client: no proxies from the environment, no pooled connections
/// (so each request is its own connection and nothing outlives a test's
/// runtime), and a timeout so a hung peer fails the test instead of hanging it.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap_or_else(|e| panic!("cannot build the test HTTP client: {e}"))
}

/// A GET with one `Accept` line per manifest media type, like skopeo sends.
pub fn manifest_get(client: &reqwest::Client, url: &str) -> reqwest::RequestBuilder {
    MANIFEST_MEDIA_TYPES.iter().fold(client.get(url), |request, media_type| request.header("Accept", *media_type))
}
