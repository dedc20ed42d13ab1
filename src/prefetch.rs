//! Warming the cache with an image before anyone pulls it (admin
//! `POST /prefetch`): the same path a client's pull takes through the cache
//! facade, so it is coalesced with concurrent pulls and verified the same
//! way, without sending any bytes anywhere.

use std::sync::Arc;

use futures_util::StreamExt;
use http::{Method, Uri};
use serde::Serialize;

use crate::app::App;
use crate::cache::fill::wait_until_committed;
use crate::cache::{BlobSource, CacheResult};
use crate::error::Error;
use crate::oci::{Digest, Reference, inspect_manifest};
use crate::server::routes::{self, Endpoint, Parsed, Route};

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

/// Resolves `image` (`[registry/]repo[:tag|@digest]`) as a client's pull
/// would be routed: a registry that names a configured upstream selects it,
/// anything else goes to the default upstream.
fn resolve(app: &App, image: &str) -> Result<(Route, Reference), Error> {
    let (name, reference) = match image.split_once('@') {
        Some((name, digest)) => (name, digest.to_owned()),
        None => match image.rsplit_once(':').filter(|(_, tag)| !tag.contains('/')) {
            Some((name, tag)) => (name, tag.to_owned()),
            None => (image, "latest".to_owned()),
        },
    };
    let uri: Uri = format!("/v2/{name}/manifests/{reference}")
        .parse()
        .map_err(|_| Error::NameInvalid(crate::oci::NameError::BadComponent(image.chars().take(64).collect())))?;
    match routes::parse(&Method::GET, &uri, &app.upstreams)? {
        Parsed::Repo(route) => match route.endpoint.clone() {
            Endpoint::Manifest(reference) => Ok((route, reference)),
            _ => Err(Error::NotFound),
        },
        Parsed::Base => Err(Error::NotFound),
    }
}

/// Fetches `image`'s manifest(s) and every blob into the cache. For an
/// index, every platform, or those whose `os/arch[/variant]` starts with
/// `platform`.
pub async fn prefetch(app: &Arc<App>, image: &str, platform: Option<&str>) -> Result<Prefetched, Error> {
    let (route, reference) = resolve(app, image)?;
    let (top, _) = app.cache.manifest(&route.upstream, &route.repo, &reference).await?;
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
        let (m, _) = app.cache.manifest(&route.upstream, &route.repo, &Reference::Digest(*child)).await?;
        let (_, child_refs) = inspect_manifest(&m.bytes, Some(m.media_type)).map_err(Error::Internal)?;
        blobs.extend(child_refs.blobs);
        manifests += 1;
    }
    blobs.sort();
    blobs.dedup();

    let mut report = Prefetched { image: image.to_owned(), manifests, blobs: blobs.len(), ..Prefetched::default() };
    let mut results = futures_util::stream::iter(blobs)
        .map(|digest| {
            let (app, route) = (Arc::clone(app), &route);
            async move {
                let (source, result) = app.cache.blob(&route.upstream, &route.repo, digest).await?;
                let size = match source {
                    BlobSource::Committed { size, .. } => size,
                    BlobSource::Filling(mut rx) => wait_until_committed(&mut rx).await?,
                };
                Ok::<_, Error>((size, result == CacheResult::Miss))
            }
        })
        .buffer_unordered(PREFETCH_PARALLELISM);
    while let Some(result) = results.next().await {
        let (size, fetched) = result?;
        report.bytes += size;
        report.fetched += usize::from(fetched);
    }
    Ok(report)
}
