//! Manifests: by digest (immutable, memory then disk), and by tag (a
//! mapping trusted for its TTL, revalidated with a `HEAD`, served stale when
//! upstream fails); the owner of a tag or digest asked first in a cluster.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::*;

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
        match reference {
            Reference::Digest(digest) => match self.stored_manifest(digest).await? {
                Some(m) => {
                    self.ensure_member(upstream, repo, digest, Content::Manifest, via).await?;
                    self.evictor.record_access(
                        Kind::Manifest,
                        *digest,
                        upstream.shared_name(),
                        unix_ms(SystemTime::now()),
                    );
                    Ok((m, CacheResult::Hit))
                }
                None => self.fetch_manifest(upstream, repo, reference, via).await,
            },
            Reference::Tag(tag) => self.manifest_by_tag(upstream, repo, tag, via).await,
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
        let head = {
            let (upstream, repo, reference) = (Arc::clone(upstream), repo.clone(), Reference::Tag(tag.clone()));
            move || async move { upstream.head_manifest(&repo, &reference).await.map_err(Error::Upstream) }
        };
        let answer = self.revalidations.run(key.clone(), head).await.0;
        upstream.revalidation_backoff().record(matches!(answer, Err(Error::Upstream(_))), ttl);
        match answer {
            Ok(Some(digest)) if digest == entry.digest => {
                self.set_tag(key, digest).await?;
                Ok((cached, CacheResult::Hit))
            }
            // Moved. A GET counts against Docker Hub's pull limit (the HEAD
            // did not): with the limit used up, what is cached is served.
            Ok(Some(_)) if may_serve_stale && upstream.rate_limited() => {
                tracing::warn!(upstream = upstream.name(), %repo, %tag, "tag moved, but the pull limit is used up: serving stale");
                Ok((cached, CacheResult::Stale))
            }
            Ok(Some(digest)) => match self.fetch_manifest(upstream, repo, &Reference::Digest(digest), via).await {
                Ok((m, result)) => {
                    self.set_tag(key, digest).await?;
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
                let tag = match &reference {
                    Reference::Tag(t) => Some(tag_key(upstream.name(), &repo, t)),
                    Reference::Digest(_) => None,
                };
                // A fetch that ended between the caller's miss and this
                // one's start (a herd's straggler) left the tag fresh: no
                // second upstream GET for it.
                if let Some(fresh) = cache.fresh_tag(&upstream, tag.as_deref()).await? {
                    return Ok(fresh);
                }
                if let Some(answer) = cache.manifest_from_owner(&upstream, &repo, &reference, via).await {
                    let (fetched, confirmed) = answer?;
                    return cache.store_manifest(fetched, upstream.name(), &repo, tag, confirmed).await;
                }
                if let Reference::Digest(digest) = &reference {
                    if let Some(fetched) = cache.shared_manifest(digest).await {
                        cache.ensure_member(&upstream, &repo, digest, Content::Manifest, via).await?;
                        return cache.store_manifest(fetched, upstream.name(), &repo, None, SystemTime::now()).await;
                    }
                }
                let fetched = upstream.get_manifest(&repo, &reference).await?.ok_or(Error::ManifestUnknown)?;
                cache.share_manifest(&fetched).await;
                cache.store_manifest(fetched, upstream.name(), &repo, tag, SystemTime::now()).await
            }
        };
        let (result, joined) = self.manifest_fetches.run(key, fetch).await;
        Ok((result?, CacheResult::of(joined)))
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
        let stored = Arc::new(StoredManifest::new(m.bytes.clone(), m.media_type, m.digest));
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
        let new = blocking(move || {
            let tag = tag_row.as_deref();
            Ok(index.insert_manifest(&m.digest, m.media_type, &m.bytes, tag, &member_rows, unix_ms(now))?)
        })
        .await?;
        if new {
            self.evictor.added(size);
        }
        for key in members {
            self.memory.insert_member(key);
        }
        self.memory.insert_manifest(Arc::clone(&stored));
        if let Some(key) = tag {
            self.memory.insert_tag(key, TagEntry { digest: stored.digest, confirmed: now });
        }
        Ok(stored)
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
        let fetched = FetchedManifest { digest: Digest::of(&bytes), bytes, media_type, refs };
        // Another client's fetch stored the tag just now...
        let key = tag_key(upstream.name(), &repo, &tag);
        cache.store_manifest(fetched.clone(), upstream.name(), &repo, Some(key), SystemTime::now()).await.unwrap();
        // ... after this client found it missing: its fetch finds it fresh.
        let (m, _) = cache.fetch_manifest(&upstream, &repo, &Reference::Tag(tag), Via::Client).await.unwrap();
        assert_eq!(m.digest, fetched.digest, "served from the tag just stored, upstream not asked");
    }
}
