//! Manifests: by digest (immutable, memory then disk), and by tag (a
//! mapping trusted for its TTL, revalidated with a `HEAD`, served stale when
//! upstream fails); the owner of a tag or digest asked first in a cluster.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::*;
use crate::oci::Warnings;

/// Longest a manifest fetch may run, however its upstream trickles: the
/// fetch goes on after its clients' deadlines (it fills the cache for
/// the next request) but never holds an upstream slot longer than this.
pub const MANIFEST_FETCH_LIMIT: Duration = Duration::from_secs(120);

impl Cache {
    /// A manifest for a client.
    pub async fn manifest(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        reference: &Reference,
    ) -> Result<(Arc<StoredManifest>, CacheResult), Error> {
        self.manifest_via(upstream, repo, reference, Via::Client).await
    }

    /// A manifest: memory → disk → (a tag's or digest's owner among the
    /// peers) → shared tier (by digest) → upstream.
    pub async fn manifest_via(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        reference: &Reference,
        via: Via,
    ) -> Result<(Arc<StoredManifest>, CacheResult), Error> {
        self.manifest_lookup(upstream, repo, reference, via).await
    }

    /// [`Cache::manifest_via`] answered by `deadline` (a client's request,
    /// `server.manifest_deadline` after it arrived), whatever upstream, a
    /// hub or an owner does: a tag whose revalidation cannot finish by then
    /// is served stale when `stale_if_error` allows, anything else is a
    /// `504`. Fetches and revalidations run on in the background and fill
    /// the cache for the next request.
    pub async fn manifest_by(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        reference: &Reference,
        via: Via,
        deadline: tokio::time::Instant,
    ) -> Result<(Arc<StoredManifest>, CacheResult), Error> {
        let lookup = self.manifest_lookup(upstream, repo, reference, via);
        if let Ok(answer) = tokio::time::timeout_at(deadline, lookup).await {
            let (m, result) = answer?;
            return Ok((self.warned(m, upstream.name(), repo).await?, result));
        }
        if let Reference::Tag(tag) = reference {
            if let Some(stale) = self.stale_tag(upstream, repo, tag).await? {
                // As a failed revalidation would: the next requests are
                // served stale at once for a while, not after a deadline each.
                upstream.revalidation_backoff().record(true, upstream.config.tag_ttl(&self.config));
                tracing::warn!(upstream = upstream.name(), %repo, %tag, "revalidation did not finish by the manifest deadline: serving stale");
                return Ok((self.warned(stale, upstream.name(), repo).await?, CacheResult::Stale));
            }
        }
        tracing::warn!(upstream = upstream.name(), %repo, %reference, "no manifest by the manifest deadline");
        Err(Error::Upstream(UpstreamError::Timeout("manifest deadline")))
    }

    /// The cached manifest of a tag past its TTL but within `stale_if_error`.
    async fn stale_tag(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        tag: &Tag,
    ) -> Result<Option<Arc<StoredManifest>>, Error> {
        let Some(entry) = self.tag_entry(&tag_key(upstream.name(), repo, tag)).await? else { return Ok(None) };
        let age = SystemTime::now().duration_since(entry.confirmed).unwrap_or_default();
        if age >= upstream.config.tag_ttl(&self.config) + self.config.stale_if_error {
            return Ok(None);
        }
        self.stored_manifest(&entry.digest).await
    }

    async fn manifest_lookup(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        reference: &Reference,
        via: Via,
    ) -> Result<(Arc<StoredManifest>, CacheResult), Error> {
        match reference {
            Reference::Digest(digest) => self.manifest_by_digest(upstream, repo, digest, via).await,
            Reference::Tag(tag) => self.manifest_by_tag(upstream, repo, tag, via).await,
        }
    }

    /// A manifest by digest: cached (once `repo` is known to have it), or fetched.
    async fn manifest_by_digest(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        digest: &Digest,
        via: Via,
    ) -> Result<(Arc<StoredManifest>, CacheResult), Error> {
        match self.stored_manifest(digest).await? {
            Some(m) => {
                self.ensure_member(upstream, repo, digest, Content::Manifest, via).await?;
                self.evictor.record_access(Kind::Manifest, *digest, upstream.shared_name(), unix_ms(SystemTime::now()));
                Ok((m, CacheResult::Hit))
            }
            None => self.fetch_manifest(upstream, repo, &Reference::Digest(*digest), via).await,
        }
    }

    /// When upstream (or the tag's owner) last confirmed where `tag` points.
    pub fn tag_confirmed(&self, upstream: &str, repo: &RepoName, tag: &Tag) -> Option<SystemTime> {
        self.memory.tag(&tag_key(upstream, repo, tag)).map(|e| e.confirmed)
    }

    pub(super) async fn stored_manifest(&self, digest: &Digest) -> Result<Option<Arc<StoredManifest>>, Error> {
        if let Some(m) = self.memory.manifest(digest) {
            return Ok(Some(m));
        }
        let (index, d) = (Arc::clone(&self.index), *digest);
        let row = blocking(move || Ok(index.manifest(&d)?)).await?;
        Ok(row.map(|(media_type, bytes)| {
            let m = Arc::new(StoredManifest::new(Bytes::from(bytes), media_type, d));
            self.memory.insert_manifest(Arc::clone(&m));
            m
        }))
    }

    /// The registry warnings upstream last sent with `digest` for `repo`.
    async fn warnings_of(&self, upstream: &str, repo: &RepoName, digest: &Digest) -> Result<Warnings, Error> {
        let member = member_key(upstream, repo, digest);
        if let Some(w) = self.memory.warnings(&member) {
            return Ok(w);
        }
        let (index, key) = (Arc::clone(&self.index), member.clone());
        let encoded = blocking(move || Ok(index.manifest_warnings(&key)?)).await?;
        let warnings = Warnings::decode(&encoded);
        self.memory.insert_warnings(member, warnings.clone());
        Ok(warnings)
    }

    /// `m` as served for `repo` of `upstream`: with the warnings upstream
    /// sent for that repository, and only those (the bytes are shared with
    /// every repository that has them; upstream's words to one are not).
    pub(super) async fn warned(
        &self,
        m: Arc<StoredManifest>,
        upstream: &str,
        repo: &RepoName,
    ) -> Result<Arc<StoredManifest>, Error> {
        let warnings = self.warnings_of(upstream, repo, &m.digest).await?;
        if m.warnings == warnings {
            return Ok(m);
        }
        Ok(Arc::new(m.rewarned(warnings)))
    }

    /// Upstream answered about a stored manifest for `repo` again, with
    /// `warnings`: they replace the ones kept for that repository (memory
    /// and index).
    pub(super) async fn rewarn(
        &self,
        upstream: &str,
        repo: &RepoName,
        digest: &Digest,
        warnings: Warnings,
    ) -> Result<(), Error> {
        if self.warnings_of(upstream, repo, digest).await? == warnings {
            return Ok(());
        }
        let member = member_key(upstream, repo, digest);
        let (index, key, encoded) = (Arc::clone(&self.index), member.clone(), warnings.encode());
        blocking(move || Ok(index.set_manifest_warnings(&key, &encoded)?)).await?;
        self.memory.insert_warnings(member, warnings);
        Ok(())
    }

    pub(super) async fn tag_entry(&self, key: &str) -> Result<Option<TagEntry>, Error> {
        if let Some(e) = self.memory.tag(key) {
            return Ok(Some(e));
        }
        let (index, k) = (Arc::clone(&self.index), key.to_owned());
        let row = blocking(move || Ok(index.tag(&k)?)).await?;
        Ok(row.map(|r| {
            let e = TagEntry { digest: r.digest, confirmed: UNIX_EPOCH + Duration::from_millis(r.confirmed_ms) };
            self.memory.insert_tag(key.to_owned(), e);
            e
        }))
    }

    /// The manifest a tag points to, if the tag was confirmed within its
    /// TTL and the manifest is cached.
    async fn fresh_tag(&self, upstream: &Upstream, key: Option<&str>) -> Result<Option<Arc<StoredManifest>>, Error> {
        let Some(entry) = key.and_then(|k| self.memory.tag(k)) else { return Ok(None) };
        let age = SystemTime::now().duration_since(entry.confirmed).unwrap_or_default();
        if age >= upstream.config.tag_ttl(&self.config) {
            return Ok(None);
        }
        self.stored_manifest(&entry.digest).await
    }

    /// Upstream says the tag is gone: forget it, in memory and the index.
    async fn forget_tag(&self, key: String) -> Result<(), Error> {
        self.memory.remove_tag(&key);
        let index = Arc::clone(&self.index);
        blocking(move || Ok(index.remove_tag(&key)?)).await
    }

    pub(super) async fn set_tag(&self, key: String, digest: Digest) -> Result<(), Error> {
        let now = SystemTime::now();
        self.memory.insert_tag(key.clone(), TagEntry { digest, confirmed: now });
        let index = Arc::clone(&self.index);
        blocking(move || Ok(index.set_tag(&key, &digest, unix_ms(now))?)).await
    }

    /// A tag within its TTL is served from the cache. Past it, one `HEAD`
    /// asks upstream where the tag points now: unchanged renews the TTL,
    /// changed fetches the new digest, and an upstream failure serves the
    /// old mapping for up to `stale_if_error`.
    async fn manifest_by_tag(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        tag: &Tag,
        via: Via,
    ) -> Result<(Arc<StoredManifest>, CacheResult), Error> {
        let key = tag_key(upstream.name(), repo, tag);
        let Some(entry) = self.tag_entry(&key).await? else {
            return self.fetch_manifest(upstream, repo, &Reference::Tag(tag.clone()), via).await;
        };
        let Some(cached) = self.stored_manifest(&entry.digest).await? else {
            return self.fetch_manifest(upstream, repo, &Reference::Tag(tag.clone()), via).await;
        };
        let age = SystemTime::now().duration_since(entry.confirmed).unwrap_or_default();
        let ttl = upstream.config.tag_ttl(&self.config);
        self.evictor.record_access(Kind::Manifest, cached.digest, upstream.shared_name(), unix_ms(SystemTime::now()));
        if age < ttl || upstream.config.tag_is_immutable(tag.as_str()) {
            return Ok((cached, CacheResult::Hit));
        }
        let may_serve_stale = age < ttl + self.config.stale_if_error;
        // In a cluster the tag's owner revalidates it for everyone: its
        // answer carries when upstream last confirmed the tag.
        if let Some(answer) = self.manifest_from_owner(upstream, repo, &Reference::Tag(tag.clone()), via).await {
            return match answer {
                Ok((fetched, confirmed)) => {
                    let m = self.store_manifest(fetched, upstream.name(), repo, Some(key), confirmed).await?;
                    let result = if m.digest == cached.digest { CacheResult::Hit } else { CacheResult::Miss };
                    Ok((m, result))
                }
                Err(Error::ManifestUnknown) if may_serve_stale && self.is_warm_tag(&key) => {
                    tracing::warn!(upstream = upstream.name(), %repo, %tag, "warm tag gone upstream: serving it from the cache");
                    Ok((cached, CacheResult::Stale))
                }
                Err(Error::ManifestUnknown) => {
                    self.forget_tag(key).await?;
                    Err(Error::ManifestUnknown)
                }
                Err(Error::Upstream(e)) if may_serve_stale => {
                    tracing::warn!(upstream = upstream.name(), %repo, %tag, error = %e, "serving stale tag");
                    Ok((cached, CacheResult::Stale))
                }
                Err(e) => Err(e),
            };
        }
        // After a failed revalidation, and for a warm tag the warm loop
        // found gone (it asks again every interval), clients get what is
        // cached without asking upstream each time.
        if may_serve_stale && (upstream.revalidation_backoff().active() || self.warm_tag_gone(&key)) {
            return Ok((cached, CacheResult::Stale));
        }
        let revalidate = {
            let (cache, upstream, repo, tag) = (Arc::clone(self), Arc::clone(upstream), repo.clone(), tag.clone());
            move || async move { cache.revalidate_tag(&upstream, &repo, &tag, via).await }
        };
        let (answer, joined) = self.revalidations.run(key.clone(), revalidate).await;
        match answer {
            // Unchanged: confirmed now, with the answer's warnings.
            Ok(Some((digest, _))) if digest == entry.digest => {
                Ok((self.stored_manifest(&digest).await?.unwrap_or(cached), CacheResult::Hit))
            }
            // Moved. A GET counts against Docker Hub's pull limit (the HEAD
            // did not): with the limit used up, what is cached is served.
            Ok(Some(_)) if may_serve_stale && upstream.rate_limited() => {
                tracing::warn!(upstream = upstream.name(), %repo, %tag, "tag moved, but the pull limit is used up: serving stale");
                Ok((cached, CacheResult::Stale))
            }
            // Moved: the revalidation fetched it and moved the tag (unless
            // the pull limit was used up: then it is fetched here).
            Ok(Some((digest, _))) => match self.manifest_by_digest(upstream, repo, &digest, via).await {
                Ok((m, result)) => {
                    self.set_tag(key, digest).await?;
                    let result = if result == CacheResult::Hit { CacheResult::of(joined) } else { result };
                    Ok((m, result))
                }
                Err(Error::Upstream(e @ UpstreamError::RateLimited { .. })) if may_serve_stale => {
                    tracing::warn!(upstream = upstream.name(), %repo, %tag, error = %e, "tag moved, but fetching it was refused: serving stale");
                    Ok((cached, CacheResult::Stale))
                }
                Err(e) => Err(e),
            },
            // A warm image's tag is kept, as through an outage: the
            // cluster depends on it, and the warm status reports it gone.
            Ok(None) if may_serve_stale && self.is_warm_tag(&key) => {
                tracing::warn!(upstream = upstream.name(), %repo, %tag, "warm tag gone upstream: serving it from the cache");
                Ok((cached, CacheResult::Stale))
            }
            Ok(None) => {
                self.forget_tag(key).await?;
                Err(Error::ManifestUnknown)
            }
            Err(Error::Upstream(e)) if may_serve_stale => {
                tracing::warn!(upstream = upstream.name(), %repo, %tag, error = %e, "serving stale tag");
                Ok((cached, CacheResult::Stale))
            }
            Err(e) => Err(e),
        }
    }

    /// A tag's revalidation, run once however many ask (clients and the
    /// warm loop share it) in a task of its own, so that it runs to its
    /// end and what it finds is applied even when every client waiting on
    /// it reached its manifest deadline: one `HEAD`, the pause after a
    /// failure recorded; unchanged, the tag is confirmed now and the
    /// answer's warnings kept; moved, the new manifest is fetched and the
    /// tag moved to it, unless the pull limit is used up (the caller
    /// decides: what is cached may be served). Gone (`None`) and failures
    /// are the caller's to handle.
    pub(super) async fn revalidate_tag(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        tag: &Tag,
        via: Via,
    ) -> Result<Option<(Digest, Warnings)>, Error> {
        let answer = upstream.head_manifest_warned(repo, &Reference::Tag(tag.clone())).await;
        upstream.revalidation_backoff().record(answer.is_err(), upstream.config.tag_ttl(&self.config));
        let Some((digest, warnings)) = answer.map_err(Error::Upstream)? else { return Ok(None) };
        let key = tag_key(upstream.name(), repo, tag);
        let known = self.tag_entry(&key).await?.map(|e| e.digest);
        if known != Some(digest) {
            if upstream.rate_limited() {
                return Ok(Some((digest, warnings)));
            }
            self.fetch_manifest(upstream, repo, &Reference::Digest(digest), via).await?;
        }
        self.rewarn(upstream.name(), repo, &digest, warnings.clone()).await?;
        self.set_tag(key, digest).await?;
        Ok(Some((digest, warnings)))
    }

    /// Fetches a manifest (one fetch per reference however many ask):
    /// from its owner among the peers, else by digest from the shared tier
    /// (once upstream or the owner confirms the repository has it), else
    /// from upstream; stores it, and for a tag records the mapping.
    async fn fetch_manifest(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        reference: &Reference,
        via: Via,
    ) -> Result<(Arc<StoredManifest>, CacheResult), Error> {
        let key = format!("{}\0{repo}\0{reference}", upstream.name());
        let fetch = {
            let (cache, upstream, repo, reference) =
                (Arc::clone(self), Arc::clone(upstream), repo.clone(), reference.clone());
            move || async move {
                tokio::time::timeout(MANIFEST_FETCH_LIMIT, cache.fetch_manifest_now(&upstream, &repo, &reference, via))
                    .await
                    .unwrap_or(Err(Error::Upstream(UpstreamError::Timeout("manifest fetch"))))
            }
        };
        let (result, joined) = self.manifest_fetches.run(key, fetch).await;
        Ok((result?, CacheResult::of(joined)))
    }

    /// The work of one [`Cache::fetch_manifest`].
    async fn fetch_manifest_now(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        reference: &Reference,
        via: Via,
    ) -> Result<Arc<StoredManifest>, Error> {
        let tag = match reference {
            Reference::Tag(t) => Some(tag_key(upstream.name(), repo, t)),
            Reference::Digest(_) => None,
        };
        // A fetch that ended between the caller's miss and this one's start
        // (a herd's straggler) left the tag fresh: no second upstream GET.
        if let Some(fresh) = self.fresh_tag(upstream, tag.as_deref()).await? {
            return Ok(fresh);
        }
        if let Some(answer) = self.manifest_from_owner(upstream, repo, reference, via).await {
            let (fetched, confirmed) = answer?;
            return self.store_manifest(fetched, upstream.name(), repo, tag, confirmed).await;
        }
        if let Reference::Digest(digest) = reference {
            if let Some(fetched) = self.shared_manifest(digest).await {
                self.ensure_member(upstream, repo, digest, Content::Manifest, via).await?;
                return self.store_manifest(fetched, upstream.name(), repo, None, SystemTime::now()).await;
            }
        }
        let fetched = upstream.get_manifest(repo, reference).await?.ok_or(Error::ManifestUnknown)?;
        self.share_manifest(&fetched).await;
        self.store_manifest(fetched, upstream.name(), repo, tag, SystemTime::now()).await
    }

    /// Stores a manifest fetched for `repo`, its tag mapping, and its
    /// membership in `repo`. What it references gains no membership from
    /// being named: a registry that does not check references could serve
    /// a manifest naming another repository's private digest. Each blob
    /// becomes a member when it is fetched for `repo`, or confirmed there
    /// by one upstream `HEAD` ([`Cache::ensure_member`]). The sizes it
    /// declares for its blobs bound their fills for `repo`.
    pub(super) async fn store_manifest(
        &self,
        m: FetchedManifest,
        upstream: &str,
        repo: &RepoName,
        tag: Option<String>,
        confirmed: SystemTime,
    ) -> Result<Arc<StoredManifest>, Error> {
        let stored = StoredManifest::new(m.bytes.clone(), m.media_type, m.digest);
        let now = confirmed;
        for (digest, size) in m.refs.blobs.iter().zip(&m.refs.blob_sizes) {
            if let Some(size) = size {
                self.memory.insert_declared_size(member_key(upstream, repo, digest), *size);
            }
        }
        let members = vec![member_key(upstream, repo, &m.digest)];
        let index = Arc::clone(&self.index);
        let (tag_row, member_rows) = (tag.clone(), members.clone());
        let size = m.bytes.len() as u64;
        // Upstream's (or an owner's) warnings for `repo` replace the ones
        // kept for it; a source without any (the shared tier, an import)
        // leaves them.
        let told = m.warnings.clone();
        let member = members[0].clone();
        let (new, kept) = blocking(move || {
            let tag = tag_row.as_deref();
            let encoded = m.warnings.as_ref().map(Warnings::encode);
            let row = (m.media_type, &m.bytes[..], encoded.as_deref());
            let new = index.insert_manifest_warned(&m.digest, row, tag, &member_rows, unix_ms(now))?;
            let kept = if m.warnings.is_some() { Vec::new() } else { index.manifest_warnings(&member_rows[0])? };
            Ok((new, kept))
        })
        .await?;
        let warnings = told.unwrap_or_else(|| Warnings::decode(&kept));
        if new {
            self.evictor.added(size);
        }
        for key in members {
            self.memory.insert_member(key);
        }
        let stored = Arc::new(stored);
        self.memory.insert_manifest(Arc::clone(&stored));
        self.memory.insert_warnings(member, warnings.clone());
        if let Some(key) = tag {
            self.memory.insert_tag(key, TagEntry { digest: stored.digest, confirmed: now });
        }
        // As served for `repo`; the memory tier keeps it without them.
        if warnings.is_empty() {
            return Ok(stored);
        }
        Ok(Arc::new(stored.rewarned(warnings)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::oci::inspect_manifest;
    use crate::upstream::Upstreams;

    /// An upstream nothing listens for (port 9 on loopback): any request to
    /// it fails.
    fn unreachable_upstream() -> Arc<Upstream> {
        let toml = "[[upstream]]\nname = \"u.test\"\nurl = \"http://127.0.0.1:9\"\ndefault = true\n";
        let config = Config::parse(toml, "test.toml", None).unwrap();
        Arc::clone(Upstreams::new(&config).unwrap().get("u.test").unwrap())
    }

    #[tokio::test]
    async fn a_fetch_that_starts_after_another_stored_the_tag_asks_upstream_nothing() {
        let (_dir, cache) = super::super::test_cache::temporary().await;
        let upstream = unreachable_upstream();
        let repo: RepoName = "team/app".parse().unwrap();
        let tag: Tag = "v1".parse().unwrap();
        let bytes = Bytes::from_static(br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2},"layers":[]}"#);
        let (media_type, refs) = inspect_manifest(&bytes, None).unwrap();
        let fetched = FetchedManifest { digest: Digest::of(&bytes), bytes, media_type, refs, warnings: None };
        // Another client's fetch stored the tag just now...
        let key = tag_key(upstream.name(), &repo, &tag);
        cache.store_manifest(fetched.clone(), upstream.name(), &repo, Some(key), SystemTime::now()).await.unwrap();
        // ... after this client found it missing: its fetch finds it fresh.
        let (m, _) = cache.fetch_manifest(&upstream, &repo, &Reference::Tag(tag), Via::Client).await.unwrap();
        assert_eq!(m.digest, fetched.digest, "served from the tag just stored, upstream not asked");
    }
}
