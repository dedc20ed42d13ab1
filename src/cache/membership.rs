//! Repository membership: a cached blob or manifest is served for a
//! repository only if it was fetched for it or upstream (or, in a cluster,
//! its owner) confirmed the repository has it, so private content never
//! leaks between repositories while storage stays deduplicated.

use std::sync::Arc;
use std::time::SystemTime;

use super::*;

/// Membership `HEAD`s one [`Cache::confirm_image`] has open at once.
pub const CONFIRMATIONS_AT_ONCE: usize = 4;

pub(super) fn member_key(upstream: &str, repo: &RepoName, digest: &Digest) -> String {
    // Built to its exact length: it is made on every warm blob and manifest
    // request, where `format!` cost 3 % of samples (benches/README.md).
    let hex = digest.hex();
    let parts = [upstream, "\0", repo.as_str(), "\0", hex.as_str()];
    let mut key = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    parts.iter().for_each(|p| key.push_str(p));
    key
}

/// What a membership check confirms upstream, if it must.
#[derive(Clone, Copy)]
pub(super) enum Content {
    Manifest,
    Blob,
}

impl Cache {
    /// The membership rule: content on disk is shared by digest, but it is
    /// served for `(upstream, repo)` only if it was fetched for that repo or
    /// upstream confirmed that repo has it. Otherwise one upstream `HEAD`
    /// must confirm it (then it is remembered), so that cached private
    /// content never leaks to a repository that cannot see it upstream.
    pub(super) async fn ensure_member(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        digest: &Digest,
        content: Content,
        via: Via,
    ) -> Result<(), Error> {
        // A fill in flight for this very repository settles it: its
        // upstream (or owner) request is the check, and its failure is this
        // request's too.
        // Compared in place: a warm manifest GET (no fill to look at) used
        // to format this `upstream\0repo` string for nothing.
        let started_here = |owner: &str| {
            owner.strip_prefix(upstream.name()).and_then(|rest| rest.strip_prefix('\0')) == Some(repo.as_str())
        };
        if matches!(content, Content::Blob) && self.fills.get(digest).is_some_and(|f| started_here(&f.owner)) {
            return Ok(());
        }
        self.confirm_member(upstream, repo, digest, content, via).await.map(drop)
    }

    /// [`Cache::ensure_member`] without taking a fill in flight as proof:
    /// what a fill reading the shared tier must ask before it serves a byte
    /// (the shared tier holds every repository's content). Returns the
    /// content's size when the check learnt it (the `Content-Length` of
    /// upstream's or the owner's `HEAD`): a size from a source that is
    /// trusted, unlike the shared tier's object.
    pub(super) async fn confirm_member(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        digest: &Digest,
        content: Content,
        via: Via,
    ) -> Result<Option<u64>, Error> {
        if self.local_member(upstream.name(), repo, digest).await? {
            return Ok(None);
        }
        // The digest's owner may know already (it fetched it for this
        // repository); otherwise it, or this replica, asks upstream.
        // Upstream's answer about a manifest carries its warnings for `repo`.
        let mut warnings = None;
        let confirmed = match self.member_from_owner(upstream, repo, digest, content, via).await {
            Some(answer) => answer?,
            None => match content {
                Content::Blob => upstream.head_blob(repo, digest).await?,
                Content::Manifest => {
                    let answer = upstream.head_manifest_warned(repo, &Reference::Digest(*digest)).await?;
                    answer.map(|(_, w)| {
                        warnings = Some(w);
                        None
                    })
                }
            },
        };
        let Some(size) = confirmed else {
            return Err(match content {
                Content::Blob => Error::BlobUnknown(*digest),
                Content::Manifest => Error::ManifestUnknown,
            });
        };
        self.remember_member(upstream.name(), repo, digest).await?;
        if let Some(warnings) = warnings {
            self.rewarn(upstream.name(), repo, digest, warnings).await?;
        }
        Ok(size)
    }

    /// Makes every manifest and blob of an image a member of `repo`, the
    /// way the membership rule allows: each is a member already (fetched
    /// for `repo`, or confirmed before) or is confirmed now by one upstream
    /// `HEAD` (or the owner's word, in a cluster), which is remembered.
    /// What the warm loop and a prefetch check before they call an image
    /// ready: then every request of a pull of it in `repo` is answered from
    /// the cache, with upstream gone too. Content cached through another
    /// repository (a shared base layer) is the common case.
    pub async fn confirm_image(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        manifests: &[Digest],
        blobs: &[Digest],
    ) -> Result<(), Error> {
        use futures_util::{StreamExt, TryStreamExt};
        let mut items: Vec<(Digest, Content)> = Vec::with_capacity(manifests.len() + blobs.len());
        items.extend(manifests.iter().map(|d| (*d, Content::Manifest)));
        items.extend(blobs.iter().map(|d| (*d, Content::Blob)));
        futures_util::stream::iter(items)
            .map(|(digest, content)| async move {
                self.confirm_member(upstream, repo, &digest, content, Via::Client).await.map(drop)
            })
            .buffer_unordered(CONFIRMATIONS_AT_ONCE)
            .try_collect::<()>()
            .await
    }

    /// Records that upstream confirmed `repo` has `digest`.
    pub(super) async fn remember_member(&self, upstream: &str, repo: &RepoName, digest: &Digest) -> Result<(), Error> {
        let key = member_key(upstream, repo, digest);
        let (index, k) = (Arc::clone(&self.index), key.clone());
        blocking(move || Ok(index.add_members(&[k], unix_ms(SystemTime::now()))?)).await?;
        self.memory.insert_member(key);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::member_key;
    use crate::oci::Digest;

    #[test]
    fn a_member_key_is_upstream_repository_and_hex_apart_by_nul_and_exactly_as_long() {
        let digest = Digest::of(b"layer");
        let key = member_key("registry-1.docker.io", &"library/alpine".parse().unwrap(), &digest);
        assert_eq!(key, format!("registry-1.docker.io\0library/alpine\0{}", digest.hex().as_str()));
        assert_eq!(key.capacity(), key.len(), "one allocation of the exact length");
    }
}
