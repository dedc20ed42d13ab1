//! Keeping the cache within bounds and forgetting on request: the
//! background maintenance (access-time flushes, eviction rounds, the live
//! reconciliation), eviction's removals, and purges — here and, with peers,
//! on every replica.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::purges::lock_purges;
use crate::cache::*;

/// What a purge removed here and, with peers, on each other replica.
#[derive(Debug, serde::Serialize)]
pub struct ClusterPurged {
    /// This replica's counts, at the top level (as without peers).
    #[serde(flatten)]
    pub here: Purged,
    /// One entry per other member of the cluster; absent without peers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<Vec<crate::cluster::purge::ReplicaPurge>>,
}

/// What a purge removed.
#[derive(Debug, Default, serde::Serialize, PartialEq, Eq)]
pub struct Purged {
    pub tags: usize,
    pub members: usize,
    pub blobs: usize,
    pub manifests: usize,
    pub bytes: u64,
}

/// Blocking tasks an eviction round's unlinks are spread over. Victims
/// are least recently used, so scattered over the shard folders and the
/// inode table, and each unlink(2) mostly waits for the disk (about one
/// block per unlink, 300–650 µs apiece on the project's virtual disk); a
/// few at once overlap those waits. Measured there: 10,000 unlinks at 10^6
/// blobs 3.45 s on one thread, 2.36 s on 8 (benches/scale.rs); more
/// threads gained little (cold, 648 µs per unlink on 1, 375 on 4, 285 on 64).
const UNLINK_TASKS: usize = 8;

/// How often access times collected on the request path are written to the index.
const ACCESS_FLUSH_INTERVAL: Duration = Duration::from_secs(10);

impl Cache {
    /// Runs until `shutdown` fires: writes access times in batches and
    /// evicts when usage crosses the high watermark or a write hit ENOSPC.
    /// Access times are flushed once more on the way out. With a shared
    /// tier, its upload queue runs beside, in its own task, so an upload
    /// never delays access times or eviction; so does the start-up check
    /// of the blob files against the index.
    pub fn spawn_maintenance(self: &Arc<Self>, mut shutdown: crate::shutdown::Shutdown) -> tokio::task::JoinHandle<()> {
        let cache = Arc::clone(self);
        if let Some((_, uploads)) = &self.shared {
            uploads.spawn(shutdown.clone());
        }
        let (checker, stop) = (Arc::clone(self), shutdown.clone());
        tokio::spawn(async move { checker.reconcile_live(&stop).await });
        tokio::spawn(async move {
            loop {
                let stopping = tokio::select! {
                    _ = shutdown.changed() => true,
                    () = tokio::time::sleep(ACCESS_FLUSH_INTERVAL) => false,
                    () = cache.evictor.woken() => false,
                };
                if let Err(e) = cache.flush_accesses().await {
                    tracing::warn!(error = %e, "writing access times failed");
                }
                if stopping {
                    return;
                }
                // Within each upstream over its own share first: that may
                // be all the room the cache needed.
                for (upstream, to_free) in cache.evictor.upstreams_to_free() {
                    if let Err(e) = cache.evict_upstream(&upstream, to_free).await {
                        tracing::warn!(error = %e, upstream, "eviction within the upstream's max_size failed");
                    }
                }
                let to_free = cache.evictor.bytes_to_free();
                if to_free > 0 {
                    if let Err(e) = cache.evict(to_free).await {
                        tracing::warn!(error = %e, "eviction failed");
                    }
                }
            }
        })
    }

    pub(in crate::cache) async fn flush_accesses(&self) -> Result<(), Error> {
        let mut accesses = self.evictor.take_accesses();
        if accesses.is_empty() {
            return Ok(());
        }
        // Pinned content keeps the charge of an upstream that pins it.
        let pins = self.pins();
        for a in &mut accesses {
            if a.by.as_deref().is_some_and(|by| !pins.charge_follows(a.kind, &a.digest, by)) {
                a.by = None;
            }
        }
        let index = Arc::clone(&self.index);
        blocking(move || Ok(index.touch(&accesses)?)).await
    }

    /// Removes the least recently used blobs and manifests that are not
    /// pinned until `bytes` are freed: reads only that many rows of the
    /// index's access order (and the pinned ones it passes over). The
    /// maintenance task calls it; public for benches/scale.rs.
    pub async fn evict(&self, bytes: u64) -> Result<(), Error> {
        let (index, pins) = (Arc::clone(&self.index), self.pins());
        let victims = blocking(move || Ok(index.least_recently_used(bytes, &|k, d| pins.contains(k, d))?)).await?;
        let removed = self.remove_content(victims.iter().map(|e| (e.kind, e.digest)).collect()).await?;
        count_evictions(&removed);
        tracing::info!(
            items = removed.len(),
            freed = removed.iter().map(|e| e.size).sum::<u64>(),
            usage = self.evictor.usage(),
            "evicted least recently used content"
        );
        Ok(())
    }

    /// Frees `bytes` of what `upstream` is charged for, least recently used
    /// first, pinned content passed over. An item another upstream's
    /// repositories reference too is handed over to the first of them with
    /// room for it under its own `max_size` (or without one) rather than
    /// removed: see [`index::Charged`] for why.
    pub(super) async fn evict_upstream(&self, upstream: &str, bytes: u64) -> Result<(), Error> {
        // Each other upstream's room under its own high watermark, as of
        // now; the round takes from it what it hands over.
        let mut room: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
        for (other, limits) in self.evictor.quotas() {
            room.insert(other.clone(), limits.high.saturating_sub(self.evictor.charged(other)));
        }
        let (index, pins, name) = (Arc::clone(&self.index), self.pins(), upstream.to_owned());
        let eviction = blocking(move || {
            let victims = index.least_recently_used_of(&name, bytes, &|k, d| pins.contains(k, d))?;
            let keys: Vec<(Kind, Digest)> = victims.iter().map(|e| (e.kind, e.digest)).collect();
            let mut takes = |other: &str, size: u64| match room.get_mut(other) {
                None => true,
                Some(left) if *left >= size => {
                    *left -= size;
                    true
                }
                Some(_) => false,
            };
            Ok(index.evict_for_upstream(&name, &keys, &mut takes)?)
        })
        .await?;
        self.forget_removed(&eviction.removed).await;
        count_evictions(&eviction.removed);
        tracing::info!(
            upstream,
            items = eviction.removed.len(),
            freed = eviction.removed.iter().map(|e| e.size).sum::<u64>(),
            handed_over = eviction.handed_over,
            handed_over_bytes = eviction.handed_over_bytes,
            charged = self.evictor.charged(upstream),
            "evicted least recently used content of an upstream over its max_size"
        );
        Ok(())
    }

    /// Removes content rows, then forgets the removed content (see
    /// [`Cache::forget_removed`]). Returns what was still there to remove.
    pub(in crate::cache) async fn remove_content(&self, keys: Vec<(Kind, Digest)>) -> Result<Vec<Entry>, Error> {
        let index = Arc::clone(&self.index);
        let removed = blocking(move || Ok(index.remove_content(&keys)?)).await?;
        self.forget_removed(&removed).await;
        Ok(removed)
    }

    /// After their rows left the index: drops removed content from memory
    /// (closing open handles, so the space comes back), unlinks the blob
    /// files, and counts the bytes as freed, once per row actually removed.
    ///
    /// Rows go first, so no new reader finds a removed item; a reader that
    /// already opened a blob keeps reading it (an unlinked file lives on
    /// while open). Unlinking is guarded against fills: digests with a
    /// fill in flight are skipped (the fill renames a new file into place),
    /// no fill may start for a digest while its file is being unlinked, and
    /// a digest committed again in the meantime keeps its new file. A file
    /// that cannot be unlinked is logged and the others are still removed;
    /// the next start-up adopts it or removes it.
    pub(super) async fn forget_removed(&self, removed: &[Entry]) {
        // An upload of a removed blob is given up: it would hold the
        // file (and its disk space) open until done.
        if let Some((_, uploads)) = &self.shared {
            for e in removed.iter().filter(|e| e.kind == Kind::Blob) {
                uploads.cancel_blob(e.digest).await;
            }
        }
        for e in removed {
            match e.kind {
                Kind::Blob => self.memory.remove_blob_size(&e.digest),
                Kind::Manifest => self.memory.remove_manifest(&e.digest),
            }
        }
        self.evictor.removed(removed.iter().map(|e| e.size).sum());
        let blobs = removed.iter().filter(|e| e.kind == Kind::Blob).map(|e| e.digest);
        let marked = self.fills.begin_removal(blobs);
        if marked.is_empty() {
            return;
        }
        let (index, digests) = (Arc::clone(&self.index), marked.clone());
        let gone = blocking(move || {
            // One read of the rows for all of them: while they are marked
            // no fill can commit any of them, so this snapshot stays true.
            let sizes = index.blob_sizes(&digests)?;
            let gone = digests.into_iter().zip(sizes).filter_map(|(d, size)| match size {
                None => Some(d),
                Some(_) => {
                    tracing::debug!(digest = %d, "committed again meanwhile; keeping its file");
                    None
                }
            });
            Ok(gone.collect::<Vec<_>>())
        })
        .await;
        let unlinked = match gone {
            Ok(gone) => self.unlink_blobs(gone).await,
            Err(e) => {
                tracing::warn!(error = %e, "index unreadable; keeping the blob files");
                Ok(())
            }
        };
        self.fills.end_removal(&marked);
        if let Err(e) = unlinked {
            tracing::warn!(error = %e, "removing blob files failed");
        }
    }

    /// Unlinks blob files whose rows are gone, spread over
    /// [`UNLINK_TASKS`] blocking tasks, each on its own run of shard
    /// folders (digests sort by their bytes, so in the order of their hex
    /// paths). A file that cannot be unlinked is logged and the others are
    /// still removed.
    async fn unlink_blobs(&self, mut digests: Vec<Digest>) -> Result<(), Error> {
        digests.sort_unstable();
        let chunk = digests.len().div_ceil(UNLINK_TASKS).max(1);
        let tasks = digests.chunks(chunk).map(|part| {
            let (store, part) = (self.store.clone(), part.to_vec());
            blocking(move || {
                for d in &part {
                    if let Err(e) = store.remove_blob(d) {
                        tracing::warn!(digest = %d, error = %e, "cannot remove a blob file; it stays until restart");
                    }
                }
                Ok(())
            })
        });
        futures_util::future::join_all(tasks).await.into_iter().collect()
    }

    /// Forgets an upstream, or one repository of it: its tags and
    /// membership rows, and the blobs and manifests no other repository
    /// still references. Costs what that repository holds. Readers already
    /// streaming a removed blob finish.
    pub async fn purge(&self, upstream: &str, repo: Option<&RepoName>) -> Result<Purged, Error> {
        let prefix = match repo {
            Some(repo) => format!("{upstream}\0{repo}\0"),
            None => format!("{upstream}\0"),
        };
        lock_purges(&self.purges).begin(prefix.clone());
        let index = Arc::clone(&self.index);
        let rows = blocking(move || Ok(index.purge(&prefix)?)).await?;
        {
            // Under the lock a committing fill records its membership row
            // in memory under: it cannot land after this.
            let _purges = lock_purges(&self.purges);
            self.memory.forget_tags_and_members();
        }
        self.forget_removed(&rows.content).await;
        let bytes = rows.content.iter().map(|e| e.size).sum();
        let blobs = rows.content.iter().filter(|e| e.kind == Kind::Blob).count();
        Ok(Purged { tags: rows.tags, members: rows.members, blobs, manifests: rows.content.len() - blobs, bytes })
    }

    /// [`Cache::purge`] here, then on every other replica of the cluster
    /// (see [`crate::cluster::purge`]): the purge takes effect everywhere,
    /// and what each replica did is listed.
    pub async fn purge_everywhere(&self, upstream: &str, repo: Option<&RepoName>) -> Result<ClusterPurged, Error> {
        let here = self.purge(upstream, repo).await?;
        let replicas = match &self.peers {
            Some(link) => {
                let query = {
                    let mut query = form_urlencoded::Serializer::new(String::new());
                    query.append_pair("upstream", upstream);
                    if let Some(repo) = repo {
                        query.append_pair("repo", repo.as_str());
                    }
                    query.finish()
                };
                Some(crate::cluster::purge::everywhere(link, &query).await)
            }
            None => None,
        };
        Ok(ClusterPurged { here, replicas })
    }

    /// Whether `upstream`'s `repo` was purged here after `confirmed`: a
    /// tag mapping a peer confirmed then is from before the purge (the
    /// peer was not purged yet, or was down), and is not taken.
    pub(in crate::cache) fn purged_after(&self, upstream: &str, repo: &RepoName, confirmed: SystemTime) -> bool {
        lock_purges(&self.purges).purged_after(&format!("{upstream}\0{repo}\0"), confirmed)
    }
}

fn count_evictions(removed: &[Entry]) {
    for e in removed {
        let kind = if e.kind == Kind::Blob { "blob" } else { "manifest" };
        metrics().cache_evictions.with_label_values(&[kind]).inc();
    }
}

#[cfg(test)]
mod tests {
    use crate::cache::*;

    /// A blob of `size` bytes of `seed` committed for `upstream/team/app`,
    /// as a fill leaves it, last used at `accessed_ms`.
    fn commit(cache: &Cache, upstream: &str, seed: u8, size: usize, accessed_ms: u64) -> Digest {
        let bytes = vec![seed; size];
        let d = Digest::of(&bytes);
        let path = cache.store.blob_path(&d);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        let member = member_key(upstream, &"team/app".parse().unwrap(), &d);
        if cache.index.insert_blob(&d, size as u64, &member, accessed_ms).unwrap() {
            cache.evictor.added(size as u64);
        }
        d
    }

    #[tokio::test]
    async fn an_upstream_over_its_share_evicts_only_its_own_content_and_hands_shared_content_over() {
        const KB: usize = 1024;
        let (_dir, cache) = crate::cache::test_cache::temporary_with(|c| {
            c.upstream_max_size = vec![("hub".to_owned(), 1 << 20)];
        })
        .await;
        // mirror's content is the oldest in the cache: a global LRU would take it first.
        let mirror: Vec<Digest> = (0..3).map(|n| commit(&cache, "mirror", n, 200 * KB, 1 + u64::from(n))).collect();
        let hub: Vec<Digest> = (10..16).map(|n| commit(&cache, "hub", n, 200 * KB, 100 + u64::from(n))).collect();
        // The oldest of hub's blobs is used by mirror too.
        cache.remember_member("mirror", &"team/app".parse().unwrap(), &hub[0]).await.unwrap();
        assert_eq!(cache.evictor.charged("hub"), 6 * 200 * KB as u64);

        let over = cache.evictor.upstreams_to_free();
        let limits = cache.evictor.quota("hub").unwrap();
        assert_eq!(over, vec![("hub".to_owned(), 6 * 200 * KB as u64 - limits.low)]);
        for (upstream, to_free) in over {
            cache.evict_upstream(&upstream, to_free).await.unwrap();
        }
        let charged = cache.evictor.charged("hub");
        assert!(charged <= limits.low, "hub is down to its low watermark: {charged}");
        assert!(cache.evictor.upstreams_to_free().is_empty());
        for d in &mirror {
            assert!(cache.store.blob_path(d).is_file(), "mirror's content is untouched");
        }
        assert!(cache.store.blob_path(&hub[0]).is_file(), "shared with mirror: handed over, not removed");
        assert_eq!(cache.evictor.charged("mirror"), 4 * 200 * KB as u64);
        assert!(!cache.store.blob_path(&hub[1]).exists(), "hub's least recently used goes");
        assert!(cache.store.blob_path(&hub[5]).is_file(), "its newest stays");
        assert_eq!(cache.usage(), cache.index.usage().unwrap());
        assert_eq!(cache.usage(), cache.evictor.charged("hub") + cache.evictor.charged("mirror"));
    }

    const KB: u64 = 1024;

    /// A request for `upstream` served `d` at `at_ms`, and the uses were
    /// written to the index, as the maintenance task does every 10 s.
    async fn used_by(cache: &Cache, upstream: &str, d: Digest, at_ms: u64) {
        cache.remember_member(upstream, &"team/app".parse().unwrap(), &d).await.unwrap();
        cache.evictor.record_access(Kind::Blob, d, &std::sync::Arc::from(upstream), at_ms);
        cache.flush_accesses().await.unwrap();
    }

    async fn evict_over_quotas(cache: &Cache) {
        for (upstream, to_free) in cache.evictor.upstreams_to_free() {
            cache.evict_upstream(&upstream, to_free).await.unwrap();
        }
    }

    fn cached(cache: &Cache, d: &Digest) -> bool {
        cache.store.blob_path(d).is_file() && cache.index.blob_size(d).unwrap().is_some()
    }

    #[tokio::test]
    async fn shared_content_is_charged_to_the_upstream_whose_use_is_the_most_recent() {
        let (_dir, cache) = crate::cache::test_cache::temporary_with(|c| {
            c.upstream_max_size = vec![("a".to_owned(), 1 << 20), ("b".to_owned(), 1 << 20)];
        })
        .await;
        // A fetched a base layer first; B pulls images on it all day.
        let base = commit(&cache, "a", 1, 300 * KB as usize, 1);
        let own: Vec<Digest> = (10..13).map(|n| commit(&cache, "a", n, 200 * KB as usize, u64::from(n))).collect();
        used_by(&cache, "b", base, 100).await;
        assert_eq!((cache.evictor.charged("a"), cache.evictor.charged("b")), (600 * KB, 300 * KB), "B uses it now");
        // A's fourth image fits its share: B's base layer is not in it.
        let fourth = commit(&cache, "a", 13, 200 * KB as usize, 13);
        assert!(cache.evictor.upstreams_to_free().is_empty(), "A holds 800 KiB of its own, under 0.9 MiB");
        for d in own.iter().chain([&fourth, &base]) {
            assert!(cached(&cache, d));
        }
        // A uses it again: the charge follows.
        used_by(&cache, "a", base, 200).await;
        assert_eq!((cache.evictor.charged("a"), cache.evictor.charged("b")), (1100 * KB, 0));
        assert_eq!(cache.usage(), cache.evictor.charged("a") + cache.evictor.charged("b"), "the charges add up");
    }

    #[tokio::test]
    async fn a_shared_item_its_new_owner_has_no_room_for_goes_back_to_an_upstream_with_older_content() {
        let (_dir, cache) = crate::cache::test_cache::temporary_with(|c| {
            c.upstream_max_size = vec![("a".to_owned(), 1 << 20), ("b".to_owned(), 1 << 20)];
        })
        .await;
        let base = commit(&cache, "a", 1, 300 * KB as usize, 1);
        let a_old: Vec<Digest> = (10..12).map(|n| commit(&cache, "a", n, 200 * KB as usize, u64::from(n))).collect();
        used_by(&cache, "b", base, 100).await;
        let a_new: Vec<Digest> =
            (12..14).map(|n| commit(&cache, "a", n, 200 * KB as usize, 100 + u64::from(n))).collect();
        // B's share fills with newer content: the base layer is its least
        // recently used. A (full too) still uses it and holds older content.
        let b_own: Vec<Digest> =
            (20..23).map(|n| commit(&cache, "b", n, 300 * KB as usize, 200 + u64::from(n))).collect();
        evict_over_quotas(&cache).await;
        evict_over_quotas(&cache).await;
        assert!(cached(&cache, &base), "used by A, whose older content goes first: kept");
        for d in &a_old {
            assert!(!cached(&cache, d), "A's content older than the base layer goes");
        }
        for d in a_new.iter().chain(&b_own[1..]) {
            assert!(cached(&cache, d), "newer content stays");
        }
        assert_eq!(cache.usage(), cache.evictor.charged("a") + cache.evictor.charged("b"), "the charges add up");
        for upstream in ["a", "b"] {
            assert!(cache.evictor.charged(upstream) <= cache.evictor.quota(upstream).unwrap().high, "{upstream}");
        }
    }

    #[tokio::test]
    async fn a_blob_adopted_without_a_row_is_charged_to_the_first_upstream_that_serves_it() {
        let (_dir, cache) = crate::cache::test_cache::temporary().await;
        let d = Digest::of(b"adopted");
        let added = cache.index.adopt_blobs(&[(d, 7)], 1).unwrap();
        cache.evictor.added(added);
        assert_eq!(cache.evictor.charged("hub"), 0);
        used_by(&cache, "hub", d, 50).await;
        assert_eq!(cache.evictor.charged("hub"), 7);
        assert_eq!(cache.usage(), cache.evictor.charged("hub"), "every byte is charged to someone");
    }

    #[tokio::test]
    async fn a_tag_mapping_confirmed_before_a_purge_of_its_repository_is_not_taken_from_a_peer() {
        let (_dir, cache) = crate::cache::test_cache::temporary().await;
        let (app, other) = ("team/app".parse().unwrap(), "team/other".parse().unwrap());
        let before = std::time::SystemTime::now() - std::time::Duration::from_secs(1);
        assert!(!cache.purged_after("hub", &app, before), "nothing purged yet");
        cache.purge("hub", Some(&app)).await.unwrap();
        assert!(cache.purged_after("hub", &app, before), "older than the purge");
        assert!(!cache.purged_after("hub", &app, std::time::SystemTime::now()), "confirmed since");
        assert!(!cache.purged_after("hub", &other, before), "another repository");
        assert!(!cache.purged_after("mirror", &app, before), "another upstream");
        cache.purge("hub", None).await.unwrap();
        assert!(cache.purged_after("hub", &other, before), "a whole upstream's purge covers its repositories");
    }
}
