//! Fills ahead of the client: serving an image manifest starts the fills
//! of the blobs it names that are neither cached nor being filled, so
//! that a client fetching them one at a time (skopeo does) finds each one
//! already in flight, or done, when it asks.
//!
//! They are fills like any other (one per digest, the same sources,
//! verified and committed the same way, joined by the client when it
//! asks), counted `reason="ahead"`. A manifest's blobs go in its order
//! (config, then layers), at most `fill_connections` of them at once, so
//! that on a link whose total bandwidth is what limits the blob the
//! client asks for next comes first. Their upstream requests take at most
//! half the upstream's connections and never keep a request a client
//! waits on from starting (`crate::upstream::priority`); a client joining
//! one promotes it. A client that never asks for them costs at most the
//! bytes of the image whose manifest it fetched, once.

use std::sync::Arc;

use futures_util::StreamExt;

use crate::cache::*;
use crate::oci::{MediaType, inspect_manifest};
use crate::upstream::Priority;

impl Cache {
    /// Starts the fills ahead for `manifest`, just served to a client of
    /// `repo`, in the background. An index names no blobs: the platform
    /// manifest the client picks from it starts them when it is served.
    pub fn fill_ahead(self: &Arc<Self>, upstream: &Arc<Upstream>, repo: &RepoName, manifest: &StoredManifest) {
        if !upstream.config.fill_ahead
            || !matches!(manifest.media_type, MediaType::OciManifest | MediaType::DockerManifest)
        {
            return;
        }
        let Ok((_, refs)) = inspect_manifest(&manifest.bytes, Some(manifest.media_type)) else { return };
        let (cache, upstream, repo) = (Arc::clone(self), Arc::clone(upstream), repo.clone());
        // In a trace, the fills ahead are the manifest request's.
        tokio::spawn(crate::otel::follow(async move {
            let at_once = upstream.config.fill_connections.get();
            futures_util::stream::iter(refs.blobs)
                .for_each_concurrent(at_once, |digest| {
                    let (cache, upstream, repo) = (&cache, &upstream, &repo);
                    async move { cache.fill_one_ahead(upstream, repo, digest).await }
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
        let owner = format!("{}\0{repo}", upstream.name());
        let priority = Priority::ahead();
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
