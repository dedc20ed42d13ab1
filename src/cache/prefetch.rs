//! Warming the cache with an image before anyone pulls it (admin
//! `POST /prefetch`, and each round of the keep-warm loop): the same path a
//! client's pull takes through the cache facade, so it is coalesced with
//! concurrent pulls and verified the same way, without sending any bytes
//! anywhere. Progress (blobs and bytes done
//! of the totals the manifests declare) is published on a watch channel as
//! it happens, so that the admin API can stream it to `larder prefetch`.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::fill::Progress;
use super::pins::platform_selected;
use super::{BlobSource, Cache, CacheResult};
use crate::error::Error;
use crate::oci::{Digest, Reference, RepoName, inspect_manifest};
use crate::upstream::Upstream;

/// Blobs of one prefetch fetched at once (each still counts against the
/// upstream's `max_concurrency`).
pub const PREFETCH_PARALLELISM: usize = 4;

/// What a prefetch did, once done.
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

/// Where a prefetch is, published as it goes. Totals are known once the
/// manifests are read (`planned`); `bytes_done` counts the bytes of blobs
/// still downloading as they arrive.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PrefetchProgress {
    /// The manifests are read and the totals below are final.
    pub planned: bool,
    pub manifests: usize,
    pub blobs_total: usize,
    /// Sum of the sizes the manifests declare for the blobs.
    pub bytes_total: u64,
    pub blobs_done: usize,
    pub bytes_done: u64,
    /// Blobs fetched from upstream (not cached before).
    pub fetched: usize,
}

/// An image's manifests, read through the cache, and the blobs they name:
/// what a prefetch or a warm round fetches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The digest of the manifest (or index) the reference resolved to.
    pub digest: Digest,
    /// Image manifests whose blobs are listed (one per selected platform).
    pub manifests: usize,
    /// Each blob once, with the size its manifest declares (0 if none).
    pub blobs: Vec<(Digest, u64)>,
}

impl Plan {
    /// Sum of the sizes the manifests declare for the blobs.
    pub fn bytes(&self) -> u64 {
        self.blobs.iter().map(|(_, size)| size).sum()
    }
}

/// Reads the manifest(s) of `repo:reference` into the cache (from upstream
/// where missing) and lists their blobs. For an index, the platforms of
/// `platforms` (see [`platform_selected`]; empty: every platform).
pub async fn plan(
    cache: &Arc<Cache>,
    upstream: &Arc<Upstream>,
    repo: &RepoName,
    reference: &Reference,
    platforms: &[String],
) -> Result<Plan, Error> {
    let (top, _) = cache.manifest(upstream, repo, reference).await?;
    let (_, refs) = inspect_manifest(&top.bytes, Some(top.media_type)).map_err(Error::Internal)?;
    let mut sizes: HashMap<Digest, u64> = HashMap::new();
    let mut declare = |refs: &crate::oci::ManifestRefs| {
        for (digest, size) in refs.blobs.iter().zip(&refs.blob_sizes) {
            // Sizes only feed the progress totals: a manifest without them
            // counts 0 bytes.
            sizes.insert(*digest, size.unwrap_or(0));
        }
    };
    declare(&refs);
    let mut manifests = usize::from(refs.manifests.is_empty());
    for (child, child_platform) in refs.manifests.iter().zip(&refs.platforms) {
        if !platform_selected(child_platform.as_deref(), platforms) {
            continue;
        }
        let (m, _) = cache.manifest(upstream, repo, &Reference::Digest(*child)).await?;
        let (_, child_refs) = inspect_manifest(&m.bytes, Some(m.media_type)).map_err(Error::Internal)?;
        declare(&child_refs);
        manifests += 1;
    }
    let mut blobs: Vec<(Digest, u64)> = sizes.into_iter().collect();
    blobs.sort();
    Ok(Plan { digest: top.digest, manifests, blobs })
}

/// Fetches every blob of `plan` into the cache, `parallelism` at once, as
/// a client's pull would (coalesced with pulls of the same blobs, verified
/// the same way). Progress goes to `progress`, whose totals are set first.
/// Returns the bytes of the blobs, and how many were fetched (not cached
/// before).
pub async fn fetch_blobs(
    cache: &Arc<Cache>,
    upstream: &Arc<Upstream>,
    repo: &RepoName,
    plan: &Plan,
    parallelism: usize,
    progress: &watch::Sender<PrefetchProgress>,
) -> Result<(u64, usize), Error> {
    progress.send_modify(|p| {
        *p = PrefetchProgress {
            planned: true,
            manifests: plan.manifests,
            blobs_total: plan.blobs.len(),
            bytes_total: plan.bytes(),
            ..PrefetchProgress::default()
        };
    });
    let digests: Vec<Digest> = plan.blobs.iter().map(|(d, _)| *d).collect();
    let mut results = futures_util::stream::iter(digests)
        .map(|digest| async move {
            let (source, result) = cache.blob(upstream, repo, digest).await?;
            let size = match source {
                BlobSource::Committed { size, .. } => {
                    progress.send_modify(|p| p.bytes_done += size);
                    size
                }
                BlobSource::Filling(rx) => follow_fill(rx, progress).await?,
            };
            let fetched = result == CacheResult::Miss;
            progress.send_modify(|p| {
                p.blobs_done += 1;
                p.fetched += usize::from(fetched);
            });
            Ok::<_, Error>((size, fetched))
        })
        .buffer_unordered(parallelism.max(1));
    let (mut bytes, mut fetched) = (0, 0);
    while let Some(result) = results.next().await {
        let (size, was_fetched) = result?;
        bytes += size;
        fetched += usize::from(was_fetched);
    }
    Ok((bytes, fetched))
}

/// Fetches the manifest(s) of `repo:reference` and every blob into the
/// cache. For an index, every platform, or those `platform` selects (see
/// [`platform_selected`]). `image` is only echoed in the report. Progress
/// goes to `progress` (nobody needs to be listening).
pub async fn prefetch(
    cache: &Arc<Cache>,
    upstream: &Arc<Upstream>,
    repo: &RepoName,
    reference: &Reference,
    image: &str,
    platform: Option<&str>,
    progress: &watch::Sender<PrefetchProgress>,
) -> Result<Prefetched, Error> {
    let platforms: Vec<String> = platform.map(str::to_owned).into_iter().collect();
    let plan = plan(cache, upstream, repo, reference, &platforms).await?;
    let (bytes, fetched) = fetch_blobs(cache, upstream, repo, &plan, PREFETCH_PARALLELISM, progress).await?;
    Ok(Prefetched { image: image.to_owned(), manifests: plan.manifests, blobs: plan.blobs.len(), fetched, bytes })
}

/// Waits for a fill to commit, adding its bytes to `bytes_done` as they
/// are written. Returns the blob's size.
async fn follow_fill(
    mut rx: watch::Receiver<Progress>,
    progress: &watch::Sender<PrefetchProgress>,
) -> Result<u64, Error> {
    let mut counted = 0u64;
    loop {
        let (written, outcome) = match &*rx.borrow_and_update() {
            Progress::Connecting => (0, None),
            Progress::Streaming { written, .. } => (*written, None),
            Progress::Verified { size, .. } => (*size, None),
            Progress::Complete { size, .. } => (*size, Some(Ok(*size))),
            Progress::Failed(e) => (counted, Some(Err(e.clone()))),
        };
        if written > counted {
            progress.send_modify(|p| p.bytes_done += written - counted);
            counted = written;
        }
        if let Some(outcome) = outcome {
            return outcome;
        }
        if rx.changed().await.is_err() {
            return Err(Error::Internal("fill ended without a result".into()));
        }
    }
}
