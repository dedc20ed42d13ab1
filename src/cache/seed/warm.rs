//! What the warm loop (`crate::warm`) asks of the cache: a warm tag
//! revalidated with one `HEAD` as a client's would be (coalesced with
//! clients' revalidations of the same tag, and renewing its TTL for them),
//! the warm images' digests kept in the index, and which tags are warm —
//! a warm tag that upstream says is gone is served from the cache for as
//! long as `stale_if_error` allows, instead of being forgotten.

use std::sync::Arc;
use std::time::SystemTime;

use crate::cache::*;
pub use index::WarmRow;

/// What upstream said about a warm reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// It has this digest; its manifest is cached (fetched if it moved),
    /// and a tag's mapping points at it, confirmed now.
    At(Digest),
    /// It is gone upstream (404). A tag's mapping is kept.
    Gone,
}

impl Cache {
    /// Revalidates a warm reference. A tag costs one `HEAD` (free on
    /// Docker Hub's pull limit) and, when it moved, one GET of the new
    /// manifest; a digest already cached costs nothing. An upstream failure
    /// is an error; a 404 is [`Seen::Gone`].
    pub async fn check_warm(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        reference: &Reference,
    ) -> Result<Seen, Error> {
        let (digest, warnings) = match reference {
            Reference::Digest(digest) => (*digest, None),
            Reference::Tag(tag) => {
                let key = tag_key(upstream.name(), repo, tag);
                let revalidate = {
                    let (cache, upstream, repo, tag) =
                        (Arc::clone(self), Arc::clone(upstream), repo.clone(), tag.clone());
                    move || async move { cache.revalidate_tag(&upstream, &repo, &tag, Via::Client).await }
                };
                let answer = match self.revalidations.run(key.clone(), revalidate).await.0 {
                    // The HEAD named a manifest its GET did not find.
                    Err(Error::ManifestUnknown) => Ok(None),
                    answer => answer,
                };
                let gone = matches!(answer, Ok(None));
                if let Some(known) = self.warm_tags.write().unwrap_or_else(|p| p.into_inner()).get_mut(&key) {
                    *known = gone;
                }
                match answer? {
                    Some((digest, warnings)) => (digest, Some(warnings)),
                    None => return Ok(Seen::Gone),
                }
            }
        };
        match self.manifest_via(upstream, repo, &Reference::Digest(digest), Via::Client).await {
            // The tag's answer speaks for the manifest it points to now.
            Ok(_) => {
                if let Some(warnings) = warnings {
                    self.rewarn(upstream.name(), repo, &digest, warnings).await?;
                }
            }
            Err(Error::ManifestUnknown) => return Ok(Seen::Gone),
            Err(e) => return Err(e),
        }
        if let Reference::Tag(tag) = reference {
            self.set_tag(tag_key(upstream.name(), repo, tag), digest).await?;
        }
        Ok(Seen::At(digest))
    }

    /// The tags of the warm images now listed (`(upstream, repo, tag)`).
    pub fn set_warm_tags(&self, tags: impl IntoIterator<Item = (String, RepoName, Tag)>) {
        let mut warm = self.warm_tags.write().unwrap_or_else(|p| p.into_inner());
        let keys: std::collections::HashMap<String, bool> = tags
            .into_iter()
            .map(|(upstream, repo, tag)| {
                let key = tag_key(&upstream, &repo, &tag);
                let gone = warm.get(&key).copied().unwrap_or(false);
                (key, gone)
            })
            .collect();
        *warm = keys;
    }

    pub(in crate::cache) fn is_warm_tag(&self, key: &str) -> bool {
        self.warm_tags.read().unwrap_or_else(|p| p.into_inner()).contains_key(key)
    }

    /// Whether `key` is a warm tag the warm loop last found gone upstream.
    pub(in crate::cache) fn warm_tag_gone(&self, key: &str) -> bool {
        self.warm_tags.read().unwrap_or_else(|p| p.into_inner()).get(key).copied().unwrap_or(false)
    }

    /// The warm images' digests as recorded, by key.
    pub async fn warm_rows(&self) -> Result<Vec<(String, WarmRow)>, Error> {
        let index = Arc::clone(&self.index);
        blocking(move || Ok(index.warm_rows()?)).await
    }

    /// Records a warm image's digests.
    pub async fn set_warm_row(&self, key: String, row: WarmRow) -> Result<(), Error> {
        let index = Arc::clone(&self.index);
        blocking(move || Ok(index.set_warm_row(&key, &row)?)).await
    }

    /// Forgets the digests of images no longer warm.
    pub async fn retain_warm_rows(&self, keep: Vec<String>) -> Result<usize, Error> {
        let index = Arc::clone(&self.index);
        blocking(move || Ok(index.retain_warm_rows(&keep)?)).await
    }

    /// The sizes of the blobs of `digests` that are cached, in order.
    pub async fn cached_blob_sizes(&self, digests: Vec<Digest>) -> Result<Vec<Option<u64>>, Error> {
        let index = Arc::clone(&self.index);
        blocking(move || Ok(index.blob_sizes(&digests)?)).await
    }
}

/// Unix millis now.
pub fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}
