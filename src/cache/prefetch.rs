//! Warming the cache with an image before anyone pulls it (admin
//! `POST /prefetch`): the same path a client's pull takes through the cache
//! facade, so it is coalesced with concurrent pulls and verified the same
//! way, without sending any bytes anywhere.

use std::sync::Arc;

use futures_util::StreamExt;
use serde::Serialize;

use super::fill::wait_until_committed;
use super::{BlobSource, Cache, CacheResult};
use crate::error::Error;
use crate::oci::{Digest, Reference, RepoName, inspect_manifest};
use crate::upstream::Upstream;

/// Blobs of one prefetch fetched at once (each still counts against the
/// upstream's `max_concurrency`).
pub const PREFETCH_PARALLELISM: usize = 4;

#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct Prefetched {
    pub image: String,
    /// Image manifests whose blobs were warmed (one per selected platform).
    pub manifests: usize,
    pub blobs: usize,
    /// Blobs that were not cached before (fetched from upstream now).
    pub fetched: usize,
    pub bytes: u64,
}

/// Fetches the manifest(s) of `repo:reference` and every blob into the
/// cache. For an index, every platform, or those whose `os/arch[/variant]`
/// starts with `platform`. `image` is only echoed in the report.
pub async fn prefetch(
    cache: &Arc<Cache>,
    upstream: &Arc<Upstream>,
    repo: &RepoName,
    reference: &Reference,
    image: &str,
    platform: Option<&str>,
) -> Result<Prefetched, Error> {
    let (top, _) = cache.manifest(upstream, repo, reference).await?;
    let (_, refs) = inspect_manifest(&top.bytes, Some(top.media_type)).map_err(Error::Internal)?;
    let mut blobs: Vec<Digest> = refs.blobs.clone();
    let mut manifests = usize::from(refs.manifests.is_empty());
    for (child, child_platform) in refs.manifests.iter().zip(&refs.platforms) {
        let selected = match (platform, child_platform) {
            (None, _) => true,
            (Some(want), Some(have)) => have.starts_with(want),
            (Some(_), None) => false,
        };
        if !selected {
            continue;
        }
        let (m, _) = cache.manifest(upstream, repo, &Reference::Digest(*child)).await?;
        let (_, child_refs) = inspect_manifest(&m.bytes, Some(m.media_type)).map_err(Error::Internal)?;
        blobs.extend(child_refs.blobs);
        manifests += 1;
    }
    blobs.sort();
    blobs.dedup();

    let mut report = Prefetched { image: image.to_owned(), manifests, blobs: blobs.len(), ..Prefetched::default() };
    let mut results = futures_util::stream::iter(blobs)
        .map(|digest| async move {
            let (source, result) = cache.blob(upstream, repo, digest).await?;
            let size = match source {
                BlobSource::Committed { size, .. } => size,
                BlobSource::Filling(mut rx) => wait_until_committed(&mut rx).await?,
            };
            Ok::<_, Error>((size, result == CacheResult::Miss))
        })
        .buffer_unordered(PREFETCH_PARALLELISM);
    while let Some(result) = results.next().await {
        let (size, fetched) = result?;
        report.bytes += size;
        report.fetched += usize::from(fetched);
    }
    Ok(report)
}
