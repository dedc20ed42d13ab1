//! Warming the cache with an image before anyone pulls it (admin
//! `POST /prefetch`): the same path a client's pull takes through the cache
//! facade, so it is coalesced with concurrent pulls and verified the same
//! way, without sending any bytes anywhere. Progress (blobs and bytes done
//! of the totals the manifests declare) is published on a watch channel as
//! it happens, so that the admin API can stream it to `larder prefetch`.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::cache::fill::Progress;
use crate::cache::pins::platform_selected;
use crate::cache::{BlobSource, Cache, CacheResult, StoredManifest};
use crate::error::Error;
use crate::oci::referrers::ReferrersIndex;
use crate::oci::{Digest, Reference, RepoName, Tag, inspect_manifest};
use crate::upstream::{Listing, Upstream};

/// Blobs of one prefetch fetched at once (each still counts against the
/// upstream's `max_concurrency`).
pub const PREFETCH_PARALLELISM: usize = 4;

/// Referrers of referrers are followed this deep (a signature of an SBOM).
pub const REFERRER_DEPTH: usize = 2;
/// The tags cosign keeps a manifest's signature, attestations and SBOM
/// under on registries without the referrers API: `sha256-<hex>.<suffix>`.
pub const COSIGN_TAG_SUFFIXES: [&str; 3] = ["sig", "att", "sbom"];

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
    /// With referrers: the referrer manifests (signatures, SBOMs,
    /// attestations) cached with their blobs (counted in `blobs`, `fetched`
    /// and `bytes` too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub referrers: Option<usize>,
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

/// The sizes an image manifest declares for its config and layers.
#[derive(Deserialize)]
struct DeclaredSizes {
    config: Option<Sized>,
    #[serde(default)]
    layers: Vec<Sized>,
}

#[derive(Deserialize)]
struct Sized {
    digest: String,
    size: u64,
}

fn declared_sizes(bytes: &[u8], sizes: &mut HashMap<Digest, u64>) {
    // The manifest already passed `inspect_manifest`; sizes only feed the
    // progress totals, so a manifest without them just counts 0 bytes.
    if let Ok(declared) = serde_json::from_slice::<DeclaredSizes>(bytes) {
        for d in declared.config.into_iter().chain(declared.layers) {
            if let Ok(digest) = d.digest.parse() {
                sizes.insert(digest, d.size);
            }
        }
    }
}

/// What an image is made of, for the platforms chosen: its manifests (in
/// the cache now) and the blobs they name.
pub struct Plan {
    pub top: Arc<StoredManifest>,
    /// The child manifests chosen, for an index (empty for an image).
    pub children: Vec<Arc<StoredManifest>>,
    /// Every blob of the chosen image manifests, once each, sorted.
    pub blobs: Vec<Digest>,
    /// The sizes the manifests declare.
    pub sizes: HashMap<Digest, u64>,
}

impl Plan {
    /// Sum of the sizes the manifests declare for the blobs.
    pub fn bytes(&self) -> u64 {
        self.blobs.iter().map(|d| self.sizes.get(d).copied().unwrap_or(0)).sum()
    }
}

/// Reads the manifest(s) of `repo:reference` through the cache: for an
/// index, every platform, or those `platform` selects (`linux/arm64`, or
/// `linux` for every Linux platform: see [`platform_selected`]).
pub async fn plan(
    cache: &Arc<Cache>,
    upstream: &Arc<Upstream>,
    repo: &RepoName,
    reference: &Reference,
    platform: Option<&str>,
) -> Result<Plan, Error> {
    let platforms: Vec<String> = platform.map(str::to_owned).into_iter().collect();
    plan_platforms(cache, upstream, repo, reference, &platforms).await
}

/// [`plan`] for the platforms of `platforms` (empty: every platform), as a
/// warm image lists them.
pub async fn plan_platforms(
    cache: &Arc<Cache>,
    upstream: &Arc<Upstream>,
    repo: &RepoName,
    reference: &Reference,
    platforms: &[String],
) -> Result<Plan, Error> {
    let (top, _) = cache.manifest(upstream, repo, reference).await?;
    let (_, refs) = inspect_manifest(&top.bytes, Some(top.media_type)).map_err(Error::Internal)?;
    let mut sizes = HashMap::new();
    declared_sizes(&top.bytes, &mut sizes);
    let mut blobs: Vec<Digest> = refs.blobs.clone();
    let mut children = Vec::new();
    if !refs.manifests.is_empty() {
        check_platforms(repo, reference, &refs.platforms, platforms)?;
    }
    for (child, child_platform) in refs.manifests.iter().zip(&refs.platforms) {
        if !platform_selected(child_platform.as_deref(), platforms) {
            continue;
        }
        let (m, _) = cache.manifest(upstream, repo, &Reference::Digest(*child)).await?;
        let (_, child_refs) = inspect_manifest(&m.bytes, Some(m.media_type)).map_err(Error::Internal)?;
        declared_sizes(&m.bytes, &mut sizes);
        blobs.extend(child_refs.blobs);
        children.push(m);
    }
    blobs.sort();
    blobs.dedup();
    Ok(Plan { top, children, blobs, sizes })
}

/// Each platform asked for must select an entry of the index: one that
/// selects none (`linux/s390x` of an amd64/arm64 image, a typo such as
/// `linux/amd46`) is refused, naming the platforms the index has, instead
/// of warming nothing.
fn check_platforms(
    repo: &RepoName,
    reference: &Reference,
    have: &[Option<String>],
    wants: &[String],
) -> Result<(), Error> {
    let Some(missing) =
        wants.iter().find(|want| !have.iter().any(|h| platform_selected(h.as_deref(), std::slice::from_ref(*want))))
    else {
        return Ok(());
    };
    // Attestation manifests (`unknown/unknown`) are no platform to ask for.
    let mut listed: Vec<&str> = have.iter().flatten().map(String::as_str).filter(|p| *p != "unknown/unknown").collect();
    listed.sort_unstable();
    listed.dedup();
    let image = match reference {
        Reference::Tag(tag) => format!("{repo}:{tag}"),
        Reference::Digest(digest) => format!("{repo}@{digest}"),
    };
    Err(Error::ImageUnknown(format!(
        "{image} has no platform {missing}: its index has {}",
        if listed.is_empty() { "no platforms listed".to_owned() } else { listed.join(", ") }
    )))
}

/// Fetches the manifest(s) of `repo:reference` and every blob into the
/// cache (see [`plan`] for `platform`). `image` is only echoed in the
/// report. Progress goes to `progress` (nobody needs to be listening).
pub async fn prefetch(
    cache: &Arc<Cache>,
    upstream: &Arc<Upstream>,
    repo: &RepoName,
    reference: &Reference,
    image: &str,
    platform: Option<&str>,
    progress: &watch::Sender<PrefetchProgress>,
) -> Result<Prefetched, Error> {
    let plan = plan(cache, upstream, repo, reference, platform).await?;
    fetch(cache, upstream, repo, &plan, image, progress).await
}

/// Fetches every blob of `plan` into the cache.
pub async fn fetch(
    cache: &Arc<Cache>,
    upstream: &Arc<Upstream>,
    repo: &RepoName,
    plan: &Plan,
    image: &str,
    progress: &watch::Sender<PrefetchProgress>,
) -> Result<Prefetched, Error> {
    let (bytes, fetched) = fetch_blobs(cache, upstream, repo, plan, PREFETCH_PARALLELISM, progress).await?;
    // Every manifest and blob a member of `repo`: it pulls with upstream gone.
    let digests: Vec<Digest> = std::iter::once(plan.top.digest).chain(plan.children.iter().map(|m| m.digest)).collect();
    cache.confirm_image(upstream, repo, &digests, &plan.blobs).await?;
    let manifests = plan.children.len().max(1);
    Ok(Prefetched { image: image.to_owned(), manifests, blobs: plan.blobs.len(), fetched, bytes, referrers: None })
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
    let manifests = plan.children.len().max(1);
    let blobs = plan.blobs.clone();
    let bytes_total = plan.bytes();
    progress.send_modify(|p| {
        *p = PrefetchProgress { planned: true, manifests, blobs_total: blobs.len(), bytes_total, ..p.clone() };
    });
    let mut results = futures_util::stream::iter(blobs)
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

/// Caches the referrers of `plan`'s manifests (signatures, SBOMs,
/// attestations), each with its blobs, and theirs down to
/// [`REFERRER_DEPTH`]: those the referrers API (or larder's answer from the
/// fallback tag) lists, and cosign's `sha256-<hex>.sig|att|sbom` tags. So
/// `cosign verify` and SBOM lookups work with upstream gone. Adds what it
/// cached to `report`.
pub async fn prefetch_referrers(
    cache: &Arc<Cache>,
    upstream: &Arc<Upstream>,
    repo: &RepoName,
    plan: &Plan,
    report: &mut Prefetched,
) -> Result<(), Error> {
    let mut subjects: Vec<Digest> =
        std::iter::once(plan.top.digest).chain(plan.children.iter().map(|m| m.digest)).collect();
    let mut seen: std::collections::HashSet<Digest> = subjects.iter().copied().collect();
    let (progress, _) = watch::channel(PrefetchProgress::default());
    let mut cached = 0;
    for _ in 0..REFERRER_DEPTH {
        let mut next = Vec::new();
        for subject in &subjects {
            let listing = Listing::Referrers(*subject);
            let (page, _) = cache.listing(upstream, repo, &listing, None, crate::cache::Via::Client).await?;
            let listed = ReferrersIndex::parse(&page.body).map_err(Error::Internal)?.digests();
            let mut references: Vec<Reference> = listed.into_iter().map(Reference::Digest).collect();
            for suffix in COSIGN_TAG_SUFFIXES {
                let tag = format!("sha256-{}.{suffix}", subject.hex().as_str());
                references.extend(tag.parse::<Tag>().ok().map(Reference::Tag));
            }
            for reference in references {
                let referrer = match plan_of(cache, upstream, repo, &reference).await? {
                    Some(referrer) if seen.insert(referrer.top.digest) => referrer,
                    _ => continue,
                };
                let fetched = fetch(cache, upstream, repo, &referrer, &reference.to_string(), &progress).await?;
                report.blobs += fetched.blobs;
                report.bytes += fetched.bytes;
                report.fetched += fetched.fetched;
                cached += 1;
                next.push(referrer.top.digest);
            }
        }
        subjects = next;
    }
    report.referrers = Some(cached);
    Ok(())
}

/// [`plan`] of every platform, `None` for a tag or digest upstream does not have.
async fn plan_of(
    cache: &Arc<Cache>,
    upstream: &Arc<Upstream>,
    repo: &RepoName,
    reference: &Reference,
) -> Result<Option<Plan>, Error> {
    match plan(cache, upstream, repo, reference, None).await {
        Ok(plan) => Ok(Some(plan)),
        Err(Error::ManifestUnknown | Error::NotFound) => Ok(None),
        Err(e) => Err(e),
    }
}
