//! Fills ahead of the client follow a pull, not a look. When a client
//! first asks for one of an image's **layers**, the fills of that image's
//! other layers that are neither cached nor being filled start, so that a
//! client fetching them one at a time (skopeo does) finds each one in
//! flight, or done, when it asks.
//!
//! - A manifest alone starts nothing. Renovate, Flux image automation,
//!   `skopeo inspect`, `crane manifest` and `docker manifest inspect` read
//!   manifests (and sometimes the config) of images they never pull; a
//!   download per look would cost every image they look at.
//! - Which image: the one **this client** resolved ([`Resolved`]): a GET
//!   of an image manifest of the same repository from the same address in
//!   the last [`RESOLVED_TTL`]. Another client's look at another tag
//!   sharing the layer starts nothing for this one.
//! - Never when the image's declared layers do not fit under the cache's
//!   low watermark (or the upstream's own `max_size`'s): its layers would
//!   evict each other, and the client's own requests would fetch them again.
//! - They are fills like any other (one per digest, the same sources,
//!   verified and committed the same way, joined by the client when it
//!   asks), counted `reason="ahead"`, in the manifest's order, at most
//!   `fill_connections` at once. They yield to clients' fills: connections
//!   (at most half of `max_concurrency`, never one a client request is
//!   queued for: `crate::upstream::priority`) and bandwidth (what clients
//!   leave of `max_bandwidth`, or without one, one fill ahead at a time
//!   while any client fill of the upstream runs: `crate::upstream::bandwidth`).
//!   A client joining one promotes it.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt;

use crate::cache::*;
use crate::oci::{MediaType, inspect_manifest};
use crate::upstream::Priority;

/// How long a client's resolution of an image manifest is remembered: a
/// pull asks for its layers within moments of its manifest.
pub const RESOLVED_TTL: Duration = Duration::from_secs(600);
/// Most layers remembered in all, over every client's resolutions (about
/// 48 bytes each); past it the least recently used clients' resolutions
/// are forgotten (a pull that old gets no fills ahead, only its own fills).
pub const MAX_RESOLVED_LAYERS: u64 = 1 << 20;
/// Image manifests remembered per (client, repository), most recent first:
/// a client pulling several tags of one repository at once.
pub const RESOLVED_PER_CLIENT: usize = 4;
/// Layers of one image that fills ahead consider, the first ones (an image
/// of more, rare, fills the rest when its client asks): bounds what one
/// manifest can make larder remember.
pub const MAX_AHEAD_LAYERS: usize = 256;

/// An image manifest a client resolved: its layers, and whether a request
/// for one of them started their fills ahead.
struct Image {
    manifest: Digest,
    layers: Vec<(Digest, Option<u64>)>,
    started: AtomicBool,
}

/// The image manifests one client resolved lately in one repository, most
/// recent first.
type Recent = Arc<[Arc<Image>]>;

/// Which client resolved which image manifests, for the image a layer
/// request belongs to. Looked up on every manifest and blob GET, so keyed
/// without allocating: the client's address and a hash of upstream and
/// repository (a collision costs at most fills ahead of an image the layer
/// belongs to anyway, in another repository of the same client). Bounded
/// by the layers it holds.
pub struct Resolved {
    clients: moka::sync::Cache<(IpAddr, u64), Recent>,
}

impl Default for Resolved {
    fn default() -> Self {
        let weigh = |_: &(IpAddr, u64), recent: &Recent| -> u32 {
            let layers: usize = recent.iter().map(|i| i.layers.len()).sum();
            u32::try_from(layers + 1).unwrap_or(u32::MAX)
        };
        Resolved {
            clients: moka::sync::Cache::builder()
                .max_capacity(MAX_RESOLVED_LAYERS)
                .weigher(weigh)
                .time_to_live(RESOLVED_TTL)
                .build(),
        }
    }
}

impl Resolved {
    /// Remembers that the client of `key` (whose resolutions were
    /// `recent`) resolved `manifest` with `layers`. An image of fewer than
    /// two layers starts no fills ahead, so it is not remembered: each
    /// entry would weigh one layer yet hold an image's worth of memory,
    /// and a million such entries (a client resolving a repository of
    /// layerless artifacts, or clients at many addresses) would cost far
    /// more than the bound says.
    fn remember(
        &self,
        key: (IpAddr, u64),
        recent: Option<Recent>,
        manifest: Digest,
        layers: Vec<(Digest, Option<u64>)>,
    ) {
        if layers.len() < 2 {
            return;
        }
        let image = Arc::new(Image { manifest, layers, started: AtomicBool::new(false) });
        let earlier = recent.iter().flat_map(|r| r.iter()).filter(|i| i.manifest != manifest).cloned();
        let list: Recent = std::iter::once(image).chain(earlier).take(RESOLVED_PER_CLIENT).collect();
        self.clients.insert(key, list);
    }
}

/// The key of `client`'s resolutions in `repo` of `upstream`.
fn client_key(client: IpAddr, upstream: &str, repo: &RepoName) -> (IpAddr, u64) {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    (client, BuildHasherDefault::<DefaultHasher>::default().hash_one((upstream, repo.as_str())))
}

impl Cache {
    /// A client at `client` was served `manifest` of `repo` (a GET): if it
    /// is an image manifest, its layers are remembered for the fills ahead
    /// that a request for one of them starts. Starts nothing itself. A
    /// manifest the client resolved last already costs one lookup.
    pub fn resolved(&self, upstream: &Upstream, repo: &RepoName, client: IpAddr, manifest: &StoredManifest) {
        if !upstream.config.fill_ahead
            || !matches!(manifest.media_type, MediaType::OciManifest | MediaType::DockerManifest)
        {
            return;
        }
        let key = client_key(client, upstream.name(), repo);
        let recent = self.resolved.clients.get(&key);
        if recent.as_ref().and_then(|r| r.first()).is_some_and(|i| i.manifest == manifest.digest) {
            return;
        }
        let Ok((_, refs)) = inspect_manifest(&manifest.bytes, Some(manifest.media_type)) else { return };
        self.resolved.remember(key, recent, manifest.digest, refs.layers().take(MAX_AHEAD_LAYERS).collect());
    }

    /// A client at `client` asked for blob `digest` of `repo`: if it is a
    /// layer of an image manifest that client resolved (the most recent
    /// one that has it), and the first of that image's layers it asked
    /// for, the fills of the image's other layers start in the background
    /// (see the module's rules).
    pub fn layer_requested(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        client: IpAddr,
        digest: Digest,
    ) {
        let Some(recent) = self.resolved.clients.get(&client_key(client, upstream.name(), repo)) else { return };
        let Some(image) = recent.iter().find(|i| i.layers.iter().any(|(layer, _)| *layer == digest)) else {
            return;
        };
        if image.layers.len() < 2 || image.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let declared: u64 = image.layers.iter().filter_map(|(_, size)| *size).sum();
        let room = match self.evictor.quota(upstream.name()) {
            Some(quota) => quota.low.min(self.evictor.limits().low),
            None => self.evictor.limits().low,
        };
        if declared > room {
            tracing::info!(
                upstream = upstream.name(),
                %repo,
                manifest = %image.manifest,
                declared,
                room,
                "no fills ahead: the image's layers do not fit under the low watermark"
            );
            return;
        }
        let (cache, upstream, repo, image) = (Arc::clone(self), Arc::clone(upstream), repo.clone(), Arc::clone(image));
        // In a trace, the fills ahead are the layer request's.
        tokio::spawn(crate::otel::follow(async move {
            let at_once = upstream.config.fill_connections.get();
            let layers = image.layers.iter().map(|(layer, _)| *layer).filter(|layer| *layer != digest);
            futures_util::stream::iter(layers)
                .for_each_concurrent(at_once, |layer| {
                    let (cache, upstream, repo) = (&cache, &upstream, &repo);
                    async move { cache.fill_one_ahead(upstream, repo, layer).await }
                })
                .await;
        }));
    }

    /// Starts the fill of `digest` for `repo` unless it is cached or in
    /// flight, and waits for it to end.
    async fn fill_one_ahead(self: &Arc<Self>, upstream: &Arc<Upstream>, repo: &RepoName, digest: Digest) {
        if self.fills.get(&digest).is_some() {
            return;
        }
        match self.committed_blob(&digest).await {
            Ok(None) => {}
            // Cached (the client's request checks its membership), or the
            // disk cannot tell now: the client's request will.
            Ok(Some(_)) | Err(_) => return,
        }
        // While a client fill of the upstream runs, a fill ahead opens no
        // connection before it may read (without `max_bandwidth`: one at a time).
        let priority = Priority::ahead();
        let _waiting = upstream.bandwidth().register(&priority);
        upstream.bandwidth().may_start(&priority).await;
        if self.fills.get(&digest).is_some() {
            return;
        }
        let owner = format!("{}\0{repo}", upstream.name());
        let attach = self.fills.join_or_start(
            digest,
            (&owner, &priority),
            || self.memory.blob_size(&digest).is_some(),
            |tx| self.spawn_fill(Arc::clone(upstream), repo.clone(), digest, (Via::Client, priority.clone()), tx),
        );
        if let Attach::Started(mut rx) = attach {
            let _ = fill::wait_until_committed(&mut rx).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> Digest {
        Digest::of(&[n])
    }

    fn key(n: u32) -> (IpAddr, u64) {
        (IpAddr::from([10, 0, (n >> 8) as u8, n as u8]), 7)
    }

    #[test]
    fn an_image_of_fewer_than_two_layers_is_not_remembered() {
        let resolved = Resolved::default();
        // Thousands of clients resolve an image with one layer (or none):
        // nothing of theirs can ever start a fill ahead.
        for n in 0..4096 {
            resolved.remember(key(n), None, digest(1), vec![(digest(2), Some(10))]);
            resolved.remember(key(n), None, digest(3), vec![]);
        }
        resolved.clients.run_pending_tasks();
        assert_eq!(resolved.clients.entry_count(), 0, "nothing remembered for images that start nothing");

        // An image of two layers is.
        resolved.remember(key(1), None, digest(4), vec![(digest(5), Some(10)), (digest(6), Some(10))]);
        resolved.clients.run_pending_tasks();
        assert_eq!(resolved.clients.entry_count(), 1);
        assert_eq!(resolved.clients.weighted_size(), 3);
    }
}
