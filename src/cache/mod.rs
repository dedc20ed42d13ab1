//! The cache facade, one chain where the first tier that has it answers:
//!
//! memory → disk → fill (or fetch) in flight → shared tier → the key's
//! owner among the peers → upstream.
//!
//! - Blobs take it in that order (`fill_sources`: shared tier,
//!   owner, upstream). A source that breaks off mid-body is resumed from
//!   the byte reached by the next one, so after the owner only upstream
//!   remains.
//! - Manifests by digest ask the owner before the shared tier
//!   (`fetch_manifest`): the owner answers with the membership rule
//!   applied and reads the shared tier itself on its miss, so one peer
//!   round trip stands in for a shared-tier GET plus a membership check.
//!   When this replica is the owner, the runner-up (if there are peers) is
//!   asked what it already holds, then the shared tier, then upstream.
//! - Tags: the owner, then upstream (tags are never in the shared tier).
//!
//! A peer's request takes the same chain but is never forwarded for a fetch
//! (one hop; at most a lookup of what another replica holds). Handlers ask
//! the facade for a manifest or a blob and get back
//! something to serve plus how it was served (hit, miss, coalesced, stale).

mod disk;
mod evict;
pub mod fill;
pub mod index;
mod memory;
mod pread;
pub mod prefetch;
mod reconcile;
mod reconcile_live;
mod residency;
pub mod shared;
pub mod source;
pub mod stats;
#[cfg(test)]
mod test_cache;
mod tiers;
pub mod upload;

use std::fs::File;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tempfile::NamedTempFile;
use tokio::sync::watch;

pub use memory::StoredManifest;
pub use reconcile::Report;

use crate::blocking::blocking;
use crate::cluster::PeerLink;
use crate::coalesce::{Joined, SingleFlight};
use crate::config::CacheConfig;
use crate::error::{Error, UpstreamError};
use crate::metrics::metrics;
use crate::oci::{Digest, Reference, RepoName, Tag, tag_list};
use crate::upstream::{FetchedManifest, Listing, Opened, Page, Upstream, content_length};
use disk::Store;
use evict::{Evictor, Limits};
use fill::{Attach, Cause, Fills, Progress, Writer};
use index::{Entry, Index, Kind};
use memory::{Memory, TagEntry};
use shared::SharedStore;
use source::{Source, SourceBody, Unavailable};
use upload::Uploads;

/// How a request was served; a label for metrics and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheResult {
    Hit,
    Miss,
    /// Joined a fetch or fill another request had started.
    Coalesced,
    /// Served past its TTL because upstream failed.
    Stale,
}

impl CacheResult {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheResult::Hit => "hit",
            CacheResult::Miss => "miss",
            CacheResult::Coalesced => "coalesced",
            CacheResult::Stale => "stale",
        }
    }

    fn of(joined: Joined) -> CacheResult {
        match joined {
            Joined::Leader => CacheResult::Miss,
            Joined::Follower => CacheResult::Coalesced,
        }
    }
}

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

/// A blob to serve: committed on disk, or a fill in flight.
pub enum BlobSource {
    Committed { file: Arc<File>, size: u64 },
    Filling(watch::Receiver<Progress>),
}

pub struct Cache {
    config: CacheConfig,
    store: Store,
    index: Arc<Index>,
    memory: Memory,
    fills: Fills,
    evictor: Evictor,
    /// One upstream manifest GET per (upstream, repo, reference).
    manifest_fetches: SingleFlight<String, Arc<StoredManifest>>,
    /// One upstream HEAD per tag being revalidated.
    revalidations: SingleFlight<String, Option<Digest>>,
    /// One upstream `tags/list` or `referrers` request per page however many ask.
    listing_fetches: SingleFlight<String, Option<Page>>,
    /// The shared tier and its upload queue (`[shared]`).
    shared: Option<(Arc<SharedStore>, Uploads)>,
    /// The other replicas (`[cluster]`).
    peers: Option<PeerLink>,
    /// Recent purges: the index prefix purged and when, newest last (at
    /// most [`MAX_PURGE_BARRIERS`]). A tag mapping a peer confirmed before
    /// a purge of its repository is not taken from it (see
    /// [`Cache::purged_after`]).
    purges: std::sync::Mutex<std::collections::VecDeque<(String, SystemTime)>>,
}

/// The tiers beyond this replica's own memory and disk: both optional,
/// and independent of each other.
#[derive(Clone, Default)]
pub struct Tiers {
    /// An object store every replica shares (`[shared]`).
    pub shared: Option<Arc<SharedStore>>,
    /// The other replicas, each the owner of some keys (`[cluster]`).
    pub peers: Option<PeerLink>,
}

/// Who a request comes from. A peer's request is served from what this
/// replica has, the shared tier or upstream, and never asked of another
/// peer again: one hop, so two replicas that disagree on the owner cannot
/// bounce a request between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    Client,
    /// `shared_missed`: the peer looked in the shared tier for this blob
    /// already, so a fill started for it does not look again.
    Peer {
        shared_missed: bool,
    },
}

/// The key whose owner fetches a digest (blob or manifest) for the cluster.
fn digest_owner_key(digest: &Digest) -> String {
    digest.to_string()
}

/// The key whose owner resolves a tag for the cluster.
fn tag_owner_key(upstream: &str, repo: &RepoName, tag: &Tag) -> String {
    format!("{upstream}/{repo}:{tag}")
}

/// Times a request may find that the fill it joined, started for another
/// repository, failed for a reason about that repository, before it takes
/// that answer as its own.
const FOREIGN_FILL_RETRIES: usize = 3;
/// Blocking tasks an eviction round's unlinks are spread over. Victims
/// are least recently used, so scattered over the shard folders and the
/// inode table, and each unlink(2) mostly waits for the disk (about one
/// block per unlink, 300–650 µs apiece on the project's virtual disk); a
/// few at once overlap those waits. Measured there: 10,000 unlinks at 10^6
/// blobs 3.45 s on one thread, 2.36 s on 8 (benches/scale.rs); more
/// threads gained little (cold, 648 µs per unlink on 1, 375 on 4, 285 on 64).
const UNLINK_TASKS: usize = 8;
/// Times a fill starts over in a new temp file because bytes from the
/// shared tier or a peer failed the digest (or a size bound). Two: a
/// corrupt shared object can reach a fill twice, read directly and through
/// the owner (which streams it before it could know); a third failure can
/// only be upstream's, whose answer is final.
const MAX_START_OVERS: usize = 2;
/// Purges remembered as barriers against older tag mappings from peers.
/// Past this, the oldest is forgotten: a replica down through that many
/// purges may hand out a mapping the oldest one removed, until its TTL.
const MAX_PURGE_BARRIERS: usize = 1024;
/// How often a graceful stop checks whether the fills in flight have ended.
const FILLS_POLL: Duration = Duration::from_millis(10);
/// How often access times collected on the request path are written to the index.
const ACCESS_FLUSH_INTERVAL: Duration = Duration::from_secs(10);

/// Opens the index first, which locks it against any other larder process
/// (a second `larder`, or `larder verify`), and only then prepares the
/// store, whose start-up sweeps `tmp/`: a running instance's fills live there.
fn open_locked(dir: &std::path::Path) -> Result<(Store, Index), Error> {
    let store = Store::new(dir)?;
    let index = Index::open(&store.index_path()).map_err(|e| match e {
        redb::Error::DatabaseAlreadyOpen => Error::Internal(format!(
            "{} is in use by another larder process (its index is locked); stop it first",
            dir.display()
        )),
        e => e.into(),
    })?;
    store.prepare()?;
    Ok((store, index))
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn tag_key(upstream: &str, repo: &RepoName, tag: &Tag) -> String {
    format!("{upstream}\0{repo}\0{tag}")
}

fn member_key(upstream: &str, repo: &RepoName, digest: &Digest) -> String {
    // Built to its exact length: it is made on every warm blob and manifest
    // request, where `format!` cost 3 % of samples (benches/README.md).
    let hex = digest.hex();
    let parts = [upstream, "\0", repo.as_str(), "\0", hex.as_str()];
    let mut key = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    parts.iter().for_each(|p| key.push_str(p));
    key
}

/// A `tags/list` page as the client asked for it: upstream's own when it
/// paginated (sent a `Link`) or already fits, else sorted and cut to the
/// client's `n` after its `last`, with a `Link` to the next page.
fn paginate_tags(page: Page, repo: &RepoName, query: Option<&str>) -> Page {
    if page.link.is_some() {
        return page;
    }
    let want = tag_list::Pagination::from_query(query);
    let Some(paginated) = tag_list::paginate(&page.body, &want) else { return page };
    let link = paginated
        .next_last
        .and_then(|last| http::HeaderValue::from_str(&tag_list::next_link(repo.as_str(), want.n, &last)).ok());
    Page { body: Bytes::from(paginated.body), link, ..page }
}

/// The blob a fill wants, and for whom.
#[derive(Clone, Copy)]
struct Want<'a> {
    upstream: &'a Upstream,
    repo: &'a RepoName,
    digest: &'a Digest,
    via: Via,
}

/// What the sources of a fill wrote so far: resumed by the next source
/// when one breaks off.
struct Partial {
    writer: Writer,
    /// The temp file's handle readers use.
    file: Arc<File>,
    /// The blob's size as the sources so far declared it.
    declared: Option<u64>,
    /// The sources whose bytes are in the file, in order.
    used: Vec<Source>,
}

/// What a membership check confirms upstream, if it must.
#[derive(Clone, Copy)]
enum Content {
    Manifest,
    Blob,
}

impl Cache {
    /// Opens (or creates) the store under `config.dir`, on its own.
    pub async fn open(config: CacheConfig) -> Result<Arc<Cache>, Error> {
        Cache::open_with(config, Tiers::default()).await
    }

    /// Opens the store with the cluster's tiers; uploads still pending
    /// from an earlier run are queued again.
    pub async fn open_with(config: CacheConfig, tiers: Tiers) -> Result<Arc<Cache>, Error> {
        let dir = config.dir.clone();
        // Nothing per blob before serving: the usage is the index's running
        // total, and the files are checked against the rows in the
        // background (`reconcile_live`, started by `spawn_maintenance`).
        let (store, index, usage) = blocking(move || {
            let (store, index) = open_locked(&dir)?;
            let usage = index.usage()?;
            Ok((store, index, usage))
        })
        .await?;
        let limits = Limits::new(config.max_size, config.high_watermark, config.low_watermark);
        let shared = match tiers.shared {
            Some(shared) => {
                let files = store.clone();
                let blob_path: upload::BlobPath = Arc::new(move |d: &Digest| files.blob_path(d));
                let uploads = Uploads::open(&config.dir, Arc::clone(&shared), blob_path).await?;
                Some((shared, uploads))
            }
            None => None,
        };
        Ok(Arc::new(Cache {
            shared,
            peers: tiers.peers,
            evictor: Evictor::new(limits, usage),
            memory: Memory::new(config.memory),
            config,
            store,
            index: Arc::new(index),
            fills: Fills::default(),
            manifest_fetches: SingleFlight::default(),
            revalidations: SingleFlight::default(),
            listing_fetches: SingleFlight::default(),
            purges: std::sync::Mutex::default(),
        }))
    }

    /// Re-hashes every blob against its name and the index (`larder verify`),
    /// removing bad entries when `repair` is set. Needs the cache folder to
    /// itself: redb refuses a second process.
    pub fn verify(config: &CacheConfig, repair: bool) -> Result<Report, Error> {
        let (store, index) = open_locked(&config.dir)?;
        reconcile::reconcile(&store, &index, true, repair, unix_ms(SystemTime::now()))
    }

    /// Bytes of blobs and manifests on disk.
    pub fn usage(&self) -> u64 {
        self.evictor.usage()
    }

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
                let to_free = cache.evictor.bytes_to_free();
                if to_free > 0 {
                    if let Err(e) = cache.evict(to_free).await {
                        tracing::warn!(error = %e, "eviction failed");
                    }
                }
            }
        })
    }

    async fn flush_accesses(&self) -> Result<(), Error> {
        let accesses = self.evictor.take_accesses();
        if accesses.is_empty() {
            return Ok(());
        }
        let index = Arc::clone(&self.index);
        blocking(move || Ok(index.touch(&accesses)?)).await
    }

    /// Removes the least recently used blobs and manifests until `bytes` are
    /// freed: reads only that many rows of the index's access order. The
    /// maintenance task calls it; public for benches/scale.rs.
    pub async fn evict(&self, bytes: u64) -> Result<(), Error> {
        let index = Arc::clone(&self.index);
        let victims = blocking(move || Ok(index.least_recently_used(bytes)?)).await?;
        let removed = self.remove_content(victims.iter().map(|e| (e.kind, e.digest)).collect()).await?;
        for e in &removed {
            let kind = if e.kind == Kind::Blob { "blob" } else { "manifest" };
            metrics().cache_evictions.with_label_values(&[kind]).inc();
        }
        tracing::info!(
            items = removed.len(),
            freed = removed.iter().map(|e| e.size).sum::<u64>(),
            usage = self.evictor.usage(),
            "evicted least recently used content"
        );
        Ok(())
    }

    /// Removes content rows, then forgets the removed content (see
    /// [`Cache::forget_removed`]). Returns what was still there to remove.
    async fn remove_content(&self, keys: Vec<(Kind, Digest)>) -> Result<Vec<Entry>, Error> {
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
    async fn forget_removed(&self, removed: &[Entry]) {
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
        {
            let mut purges = self.purges.lock().unwrap_or_else(|p| p.into_inner());
            if purges.len() >= MAX_PURGE_BARRIERS {
                purges.pop_front();
            }
            purges.push_back((prefix.clone(), SystemTime::now()));
        }
        let index = Arc::clone(&self.index);
        let rows = blocking(move || Ok(index.purge(&prefix)?)).await?;
        self.memory.forget_tags_and_members();
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
    fn purged_after(&self, upstream: &str, repo: &RepoName, confirmed: SystemTime) -> bool {
        let key = format!("{upstream}\0{repo}\0");
        let purges = self.purges.lock().unwrap_or_else(|p| p.into_inner());
        purges.iter().any(|(prefix, at)| key.starts_with(prefix.as_str()) && confirmed < *at)
    }

    /// Readiness: the index answers a read and the temp folder takes a file.
    pub async fn check_ready(&self) -> Result<(), Error> {
        let (store, index) = (self.store.clone(), Arc::clone(&self.index));
        blocking(move || {
            index.blob_size(&Digest::of(b""))?;
            drop(store.create_temp()?);
            Ok(())
        })
        .await
    }

    /// Number of blob fills in flight.
    pub fn fills_in_flight(&self) -> usize {
        self.fills.len()
    }

    /// Waits up to `within` for the fills in flight to end (committed or
    /// failed); returns how many are still running. A client gets a
    /// blob's last byte once its digest matched, before the commit, so a
    /// graceful stop waits here for the commits of blobs already served.
    pub async fn finish_fills(&self, within: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + within;
        while !self.fills.is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(FILLS_POLL).await;
        }
        self.fills.len()
    }

    // ---- manifests -------------------------------------------------------

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
                    self.evictor.record_access(Kind::Manifest, *digest, unix_ms(SystemTime::now()));
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

    async fn stored_manifest(&self, digest: &Digest) -> Result<Option<Arc<StoredManifest>>, Error> {
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

    async fn tag_entry(&self, key: &str) -> Result<Option<TagEntry>, Error> {
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

    /// Upstream says the tag is gone: forget it, in memory and the index.
    async fn forget_tag(&self, key: String) -> Result<(), Error> {
        self.memory.remove_tag(&key);
        let index = Arc::clone(&self.index);
        blocking(move || Ok(index.remove_tag(&key)?)).await
    }

    async fn set_tag(&self, key: String, digest: Digest) -> Result<(), Error> {
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
        self.evictor.record_access(Kind::Manifest, cached.digest, unix_ms(SystemTime::now()));
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
        if may_serve_stale && upstream.revalidation_backoff().active() {
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
    async fn store_manifest(
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

    /// The membership rule: content on disk is shared by digest, but it is
    /// served for `(upstream, repo)` only if it was fetched for that repo or
    /// upstream confirmed that repo has it. Otherwise one upstream `HEAD`
    /// must confirm it (then it is remembered), so that cached private
    /// content never leaks to a repository that cannot see it upstream.
    async fn ensure_member(
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
        let repo_owner = format!("{}\0{repo}", upstream.name());
        if matches!(content, Content::Blob) && self.fills.get(digest).is_some_and(|f| f.owner == repo_owner) {
            return Ok(());
        }
        self.confirm_member(upstream, repo, digest, content, via).await
    }

    /// [`Cache::ensure_member`] without taking a fill in flight as proof:
    /// what a fill reading the shared tier must ask before it serves a byte
    /// (the shared tier holds every repository's content).
    async fn confirm_member(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        digest: &Digest,
        content: Content,
        via: Via,
    ) -> Result<(), Error> {
        if !self.local_member(upstream.name(), repo, digest).await? {
            // The digest's owner may know already (it fetched it for this
            // repository); otherwise it, or this replica, asks upstream.
            let confirmed = match self.member_from_owner(upstream, repo, digest, content, via).await {
                Some(answer) => answer?,
                None => match content {
                    Content::Blob => upstream.head_blob(repo, digest).await?.is_some(),
                    Content::Manifest => upstream.head_manifest(repo, &Reference::Digest(*digest)).await?.is_some(),
                },
            };
            if !confirmed {
                return Err(match content {
                    Content::Blob => Error::BlobUnknown(*digest),
                    Content::Manifest => Error::ManifestUnknown,
                });
            }
            self.remember_member(upstream.name(), repo, digest).await?;
        }
        Ok(())
    }

    // ---- tags/list and referrers ------------------------------------------

    /// A page of `tags/list` or `referrers`: cached in memory for the
    /// upstream's tag TTL, fetched once however many ask, and served stale
    /// (up to `stale_if_error`) when upstream fails. Upstream's 404 is
    /// cached and answered as a 404 too: for referrers it means "no
    /// referrers API", and clients then use the `sha256-<hex>` fallback
    /// tag, which an empty 200 would hide from them. Each query is its own
    /// page; a tag list upstream did not paginate is sorted and paginated
    /// here ([`crate::oci::tag_list`]).
    pub async fn listing(
        &self,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        listing: &Listing,
        query: Option<&str>,
    ) -> Result<(Page, CacheResult), Error> {
        let what = match listing {
            Listing::Tags => "tags".to_owned(),
            Listing::Referrers(d) => format!("referrers/{d}"),
        };
        let key = format!("{}\0{repo}\0{what}\0{}", upstream.name(), query.unwrap_or(""));
        let ttl = upstream.config.tag_ttl(&self.config);
        let not_found = || match listing {
            Listing::Tags => Error::NameUnknown,
            Listing::Referrers(_) => Error::NotFound,
        };
        let cached = self.memory.listing(&key);
        if let Some((page, fetched)) = &cached {
            if fetched.elapsed() < ttl {
                return page.clone().map(|p| (p, CacheResult::Hit)).ok_or_else(not_found);
            }
        }
        let fetch = {
            let (upstream, repo, listing, query) =
                (Arc::clone(upstream), repo.clone(), listing.clone(), query.map(str::to_owned));
            move || async move {
                let page = upstream.get_listing(&repo, &listing, query.as_deref()).await?;
                Ok(match (page, &listing) {
                    (Some(page), Listing::Tags) => Some(paginate_tags(page, &repo, query.as_deref())),
                    (page, _) => page,
                })
            }
        };
        let (answer, joined) = self.listing_fetches.run(key.clone(), fetch).await;
        match (answer, cached) {
            (Ok(page), _) => {
                self.memory.insert_listing(key, page.clone());
                page.map(|p| (p, CacheResult::of(joined))).ok_or_else(not_found)
            }
            (Err(Error::Upstream(e)), Some((page, fetched)))
                if fetched.elapsed() < ttl + self.config.stale_if_error =>
            {
                tracing::warn!(upstream = upstream.name(), %repo, what, error = %e, "serving a stale listing");
                page.map(|p| (p, CacheResult::Stale)).ok_or_else(not_found)
            }
            (Err(e), _) => Err(e),
        }
    }

    // ---- blobs -----------------------------------------------------------

    /// A committed blob: the handle kept open since it was last served, or
    /// the file opened and checked against its index row. Only a file that
    /// is genuinely missing, or of the wrong size, drops its row (with
    /// exact accounting, see [`Cache::forget_removed`]); any other failure
    /// to open it (too many open files, EIO) is a 503 that changes nothing.
    async fn committed_blob(&self, digest: &Digest) -> Result<Option<(Arc<File>, u64)>, Error> {
        if let Some(open) = self.memory.open_blob(digest) {
            return Ok(Some(open));
        }
        let size = match self.memory.blob_size(digest) {
            Some(size) => Some(size),
            None => {
                let (index, d) = (Arc::clone(&self.index), *digest);
                blocking(move || Ok(index.blob_size(&d)?)).await?
            }
        };
        let Some(size) = size else { return Ok(None) };
        let (store, d) = (self.store.clone(), *digest);
        let opened = blocking(move || {
            let storage = |e: std::io::Error| Error::Storage(format!("opening blob {d}: {e}"));
            match store.open_blob(&d) {
                Ok(f) => {
                    let len = f.metadata().map_err(storage)?.len();
                    Ok(if len == size { Some(f) } else { None })
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(storage(e)),
            }
        })
        .await?;
        match opened {
            Some(f) => {
                let file = Arc::new(f);
                self.memory.insert_blob_size(*digest, size);
                self.memory.insert_open_blob(*digest, Arc::clone(&file), size);
                Ok(Some((file, size)))
            }
            None => {
                tracing::warn!(%digest, "index row without a matching blob file; dropping it");
                self.memory.remove_blob_size(digest);
                self.remove_content(vec![(Kind::Blob, *digest)]).await?;
                Ok(None)
            }
        }
    }

    /// `HEAD` of a blob, which never starts a fill: its size when it is
    /// cached (or being filled) for `repo`, else upstream's answer to one
    /// `HEAD` (`None` inside: upstream sent no length). Upstream's yes is
    /// remembered as a membership row. A peer's `HEAD` is the question
    /// "does this repository have it" that the owner answers for the
    /// cluster: a remembered yes answers it without upstream (and without
    /// a length, which the asker does not need), so each repository costs
    /// upstream one `HEAD` however many replicas ask.
    pub async fn head_blob(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        digest: &Digest,
        via: Via,
    ) -> Result<(Option<u64>, CacheResult), Error> {
        if let Some(size) = self.blob_size_via(upstream, repo, digest, via).await? {
            return Ok((Some(size), CacheResult::Hit));
        }
        if matches!(via, Via::Peer { .. }) && self.local_member(upstream.name(), repo, digest).await? {
            return Ok((None, CacheResult::Hit));
        }
        let size = upstream.head_blob(repo, digest).await?.ok_or(Error::BlobUnknown(*digest))?;
        self.remember_member(upstream.name(), repo, digest).await?;
        Ok((size, CacheResult::Miss))
    }

    /// Records that upstream confirmed `repo` has `digest`.
    async fn remember_member(&self, upstream: &str, repo: &RepoName, digest: &Digest) -> Result<(), Error> {
        let key = member_key(upstream, repo, digest);
        let (index, k) = (Arc::clone(&self.index), key.clone());
        blocking(move || Ok(index.add_members(&[k], unix_ms(SystemTime::now()))?)).await?;
        self.memory.insert_member(key);
        Ok(())
    }

    /// The size of a blob cached (or being filled) for `repo`, for `HEAD`,
    /// which never starts a fill.
    pub async fn blob_size(&self, upstream: &Upstream, repo: &RepoName, digest: &Digest) -> Result<Option<u64>, Error> {
        self.blob_size_via(upstream, repo, digest, Via::Client).await
    }

    /// [`Cache::blob_size`], for a client or a peer.
    pub async fn blob_size_via(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        digest: &Digest,
        via: Via,
    ) -> Result<Option<u64>, Error> {
        let filling = self.fills.get(digest).and_then(|flight| match &*flight.progress.borrow() {
            Progress::Streaming { size: Some(size), .. }
            | Progress::Verified { size, .. }
            | Progress::Complete { size, .. } => Some(*size),
            _ => None,
        });
        let size = match filling {
            Some(size) => Some(size),
            None => self.committed_blob(digest).await?.map(|(_, size)| size),
        };
        if size.is_some() {
            self.ensure_member(upstream, repo, digest, Content::Blob, via).await?;
        }
        Ok(size)
    }

    /// A blob to serve: committed, joined to the fill in flight, or a new
    /// fill from `upstream`.
    ///
    /// A fill is shared by digest, but its failure may be about the
    /// repository it was started for (upstream's 404 or 403 there): a
    /// request for another repository that joined it, and that upstream
    /// confirmed has the blob, then starts (or joins) a fill of its own
    /// instead of inheriting that answer.
    pub async fn blob(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        digest: Digest,
    ) -> Result<(BlobSource, CacheResult), Error> {
        self.blob_via(upstream, repo, digest, Via::Client).await
    }

    /// [`Cache::blob`], for a client or a peer: a fill started for a peer
    /// reads the shared tier or upstream, never another peer.
    pub async fn blob_via(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        digest: Digest,
        via: Via,
    ) -> Result<(BlobSource, CacheResult), Error> {
        let owner = format!("{}\0{repo}", upstream.name());
        let mut foreign_failures = 0;
        loop {
            let joined = match self.fills.get(&digest) {
                Some(flight) => flight,
                None => {
                    if let Some((file, size)) = self.committed_blob(&digest).await? {
                        self.ensure_member(upstream, repo, &digest, Content::Blob, via).await?;
                        self.evictor.record_access(Kind::Blob, digest, unix_ms(SystemTime::now()));
                        return Ok((BlobSource::Committed { file, size }, CacheResult::Hit));
                    }
                    let attach = self.fills.join_or_start(
                        digest,
                        &owner,
                        || self.memory.blob_size(&digest).is_some(),
                        |tx| self.spawn_fill(Arc::clone(upstream), repo.clone(), digest, via, tx),
                    );
                    match attach {
                        Attach::Started(rx) => return Ok((BlobSource::Filling(rx), CacheResult::Miss)),
                        Attach::Joined(flight) => flight,
                        // Committed between our index read and the lock: read it again.
                        Attach::Committed => continue,
                        Attach::Removing(done) => {
                            fill::removal_finished(done).await;
                            continue;
                        }
                    }
                }
            };
            self.ensure_member(upstream, repo, &digest, Content::Blob, via).await?;
            let mut rx = joined.progress;
            if joined.owner != owner && foreign_failures < FOREIGN_FILL_RETRIES {
                if let Err(e) = fill::wait_for_headers(&mut rx).await {
                    if e.is_repository_specific() {
                        foreign_failures += 1;
                        tracing::debug!(%digest, %repo, error = %e, "another repository's fill failed; fetching for this one");
                        continue;
                    }
                }
            }
            return Ok((BlobSource::Filling(rx), CacheResult::Coalesced));
        }
    }

    fn spawn_fill(
        self: &Arc<Self>,
        upstream: Arc<Upstream>,
        repo: RepoName,
        digest: Digest,
        via: Via,
        tx: watch::Sender<Progress>,
    ) {
        let cache = Arc::clone(self);
        metrics().fills_in_flight.inc();
        tokio::spawn(async move {
            match cache.fill(&upstream, &repo, digest, via, &tx).await {
                Ok((file, size)) => {
                    cache.memory.insert_blob_size(digest, size);
                    cache.memory.insert_open_blob(digest, Arc::clone(&file), size);
                    tx.send_replace(Progress::Complete { file, size });
                    cache.fills.remove(&digest);
                    tracing::debug!(%digest, size, upstream = upstream.name(), "fill committed");
                }
                Err(e) => {
                    if matches!(e, Error::DiskFull) {
                        cache.evictor.disk_full();
                    }
                    tracing::warn!(%digest, upstream = upstream.name(), %repo, error = %e, "fill failed");
                    // Out of the map first: a follower that retries for its
                    // own repository must not find this fill again.
                    cache.fills.remove(&digest);
                    tx.send_replace(Progress::Failed(e));
                }
            }
            metrics().fills_in_flight.dec();
        });
    }

    /// The most bytes a fill of `digest` for `repo` may write: the size a
    /// manifest of that repository declared for it, else `max_blob_size`.
    /// Bounds an upstream that streams without `Content-Length`.
    fn fill_limit(&self, upstream: &str, repo: &RepoName, digest: &Digest) -> u64 {
        self.memory.declared_size(&member_key(upstream, repo, digest)).unwrap_or(self.config.max_blob_size)
    }

    /// The sources of a fill, in the order they are tried: the shared tier
    /// (unless a peer asking this replica already missed there), then for
    /// a client's request the digest's live owner among the peers and the
    /// replicas ranked after it, up to this one, then upstream.
    ///
    /// The replicas after the owner are for an owner that dies (or cannot
    /// be reached): every replica ranks them the same way, so every asker
    /// goes to the same runner-up, which itself goes upstream (it comes
    /// right before this replica in its own list). An owner lost mid-fill
    /// thus costs upstream one more GET (the runner-up's resume) whatever
    /// the number of replicas, not one per asker. A peer's request is
    /// never passed on (one hop).
    fn fill_sources(&self, digest: &Digest, via: Via) -> Vec<Source> {
        let mut sources = Vec::with_capacity(3);
        if self.shared.is_some() && via != (Via::Peer { shared_missed: true }) {
            sources.push(Source::Shared);
        }
        if let Some(link) = self.peers.as_ref().filter(|_| via == Via::Client) {
            let ranked = link.peers.candidates(&digest_owner_key(digest));
            let before_me = ranked.into_iter().take_while(|p| !link.peers.is_me(p));
            sources.extend(before_me.map(Source::Peer));
        }
        sources.push(Source::Upstream);
        sources
    }

    /// Opens `source` for the blob `want` names from byte `offset`;
    /// `shared_missed`: the shared tier was tried before.
    async fn open_source(
        &self,
        source: Source,
        want: Want<'_>,
        offset: u64,
        shared_missed: bool,
    ) -> Result<SourceBody, Unavailable> {
        let Want { upstream, repo, digest, via } = want;
        match source {
            Source::Shared => self.open_shared(upstream, repo, digest, offset, via).await,
            Source::Peer(peer) => self.open_peer(peer, upstream, repo, digest, offset, shared_missed).await,
            Source::Upstream => {
                let opened =
                    upstream.get_blob_from(repo, digest, offset).await.map_err(|e| Unavailable::Final(e.into()))?;
                let Opened { response, permit } = opened.ok_or(Unavailable::Final(Error::BlobUnknown(*digest)))?;
                // A 206 starts where asked; a 200 is the whole blob again.
                let (total, skip) = if response.status() == http::StatusCode::PARTIAL_CONTENT {
                    match tiers::content_range(response.headers()) {
                        Some((first, total)) if first == offset => (total, 0),
                        _ => {
                            let e = format!("upstream answered another range than from byte {offset}");
                            return Err(Unavailable::Final(UpstreamError::Protocol(e).into()));
                        }
                    }
                } else {
                    (content_length(response.headers()), offset)
                };
                let body = http_body_util::BodyExt::boxed_unsync(http_body_util::BodyExt::map_err(
                    response.into_body(),
                    |e| Box::new(e) as crate::body::BoxError,
                ));
                Ok(SourceBody {
                    body,
                    total,
                    skip,
                    permit: Some(permit),
                    received: Some(metrics().upstream_bytes.with_label_values(&[upstream.name()])),
                    idle: upstream.body_idle_timeout(),
                })
            }
        }
    }

    /// Streams one blob into a temp file from the first source that has
    /// it, verifies size and digest, and commits it: fsync, rename, then
    /// the index row.
    ///
    /// Sources are tried in order ([`Cache::fill_sources`]); one that
    /// breaks off mid-body is resumed from the byte reached by the next,
    /// with the running hash kept. Upstream's word is final, but the shared
    /// tier's and a peer's are checked before a byte of theirs is kept: one
    /// whose size disagrees with the manifest's (or with the sources before
    /// it), or that sends more than it declared, is skipped, and a shared
    /// object of the wrong size is deleted and counted. A blob that then
    /// fails its digest with such bytes in it deletes the shared object
    /// and starts over (at most [`MAX_START_OVERS`] times), in a new temp
    /// file, from the sources not yet tried (or upstream again): readers
    /// that sent nothing yet follow it there, the others are aborted.
    async fn fill(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        digest: Digest,
        via: Via,
        tx: &watch::Sender<Progress>,
    ) -> Result<(Arc<File>, u64), Error> {
        let limit = self.fill_limit(upstream.name(), repo, &digest);
        let expected = self.memory.declared_size(&member_key(upstream.name(), repo, &digest));
        let mut sources: std::collections::VecDeque<Source> = self.fill_sources(&digest, via).into();
        let mut partial: Option<Partial> = None;
        let mut start_overs = 0;
        let mut last_error = None;
        let mut shared_missed = via == (Via::Peer { shared_missed: true });
        while let Some(source) = sources.pop_front() {
            let offset = partial.as_ref().map_or(0, |p| p.writer.written());
            let want = Want { upstream, repo, digest: &digest, via };
            let opened = self.open_source(source.clone(), want, offset, shared_missed).await;
            shared_missed |= source == Source::Shared;
            let opened = match opened {
                Ok(opened) => opened,
                Err(Unavailable::Final(e)) => return Err(e),
                Err(Unavailable::Next(e)) => {
                    tracing::debug!(%digest, source = source.name(), error = %e, "source unavailable; trying the next");
                    last_error = Some(e);
                    continue;
                }
                Err(Unavailable::Relayed(e)) => {
                    sources.retain(|s| !matches!(s, Source::Peer(_)));
                    last_error = Some(e);
                    continue;
                }
            };
            let SourceBody { body, total, skip, permit, received, idle } = opened;
            let known = partial.as_ref().and_then(|p| p.declared);
            if let Some(len) = total.filter(|len| *len > limit) {
                let e = UpstreamError::Protocol(format!(
                    "blob {digest} is {len} bytes, more than the {limit} allowed (its manifest's size, or \
                     cache.max_blob_size)"
                ));
                if source.vouched() {
                    return Err(e.into());
                }
                self.refuse_source(&source, digest, &format!("declares {len} bytes, more than the {limit} allowed"));
                last_error = Some(e.into());
                continue;
            }
            let contradicts = |size: Option<u64>| matches!((size, total), (Some(a), Some(b)) if a != b);
            if !source.vouched() && (contradicts(expected) || contradicts(known)) {
                let why = format!(
                    "declares {total:?} bytes where the manifest or an earlier source says {:?}",
                    expected.or(known)
                );
                self.refuse_source(&source, digest, &why);
                last_error = Some(UpstreamError::Protocol(format!("{} {why}", source.name())).into());
                continue;
            }
            if contradicts(known) {
                // Upstream contradicts the sources before it: they were wrong.
                let p = partial.take().expect("an earlier source declared a size");
                tracing::warn!(%digest, before = ?known, upstream = ?total, "upstream's size differs from what earlier sources sent; starting over");
                if p.used.contains(&Source::Shared) {
                    self.condemn_shared_blob(digest, "its size differs from upstream's");
                }
                start_overs += 1;
            }
            let Partial { writer, file, declared, mut used } = match partial.take() {
                Some(p) => p,
                None => {
                    let store = self.store.clone();
                    let temp = blocking(move || Ok(store.create_temp()?)).await?;
                    let file = Arc::new(temp.as_file().try_clone()?);
                    let progress = Progress::Streaming {
                        file: Arc::clone(&file),
                        size: total,
                        written: 0,
                        vouched_from: fill::UNVOUCHED,
                    };
                    tx.send_replace(progress);
                    Partial { writer: Writer::new(temp), file, declared: total, used: Vec::new() }
                }
            };
            let declared = declared.or(total);
            let vouched = source.vouched();
            tx.send_modify(|p| {
                if let Progress::Streaming { size, vouched_from, .. } = p {
                    *size = declared;
                    *vouched_from = match (vouched, *vouched_from) {
                        (false, _) => fill::UNVOUCHED,
                        (true, fill::UNVOUCHED) => offset,
                        (true, from) => from,
                    };
                }
            });
            used.push(source.clone());
            let bounds = fill::Bounds { declared, limit, idle };
            match fill::copy_body(body, writer, skip, bounds, tx, received.as_ref()).await {
                Ok(writer) => {
                    drop(permit);
                    let (temp, actual, size) = writer.finish();
                    if actual == digest {
                        // Readers send the last byte now; the commit's fsyncs
                        // (134 ms for 256 MiB on the project's disk, more on a
                        // slow volume) are no longer on a client's path. A
                        // client that has the blob may thus find it uncached
                        // after a crash right after: it is fetched again, and
                        // nothing committed is lost. A graceful stop waits for
                        // the commit (`Cache::finish_fills`).
                        tx.send_replace(Progress::Verified { file: Arc::clone(&file), size });
                        self.commit_fill(temp, size, upstream, repo, digest, &used).await?;
                        return Ok((file, size));
                    }
                    metrics().digest_mismatch.inc();
                    let e: Error =
                        UpstreamError::DigestMismatch { expected: digest, actual: actual.to_string() }.into();
                    if used.contains(&Source::Shared) {
                        self.condemn_shared_blob(digest, "its bytes failed the digest check");
                    }
                    if used.iter().all(Source::vouched) || start_overs >= MAX_START_OVERS {
                        return Err(e);
                    }
                    tracing::warn!(%digest, sources = ?used, "bytes from the shared tier or a peer failed the digest; starting over");
                    start_overs += 1;
                    if sources.is_empty() {
                        sources.push_back(Source::Upstream);
                    }
                    last_error = Some(e);
                }
                Err(fill::Interrupted { error, cause: Cause::Broke(writer) }) if !sources.is_empty() => {
                    tracing::warn!(%digest, source = source.name(), written = writer.written(), error = %error,
                        "source broke off; resuming from the next");
                    partial = Some(Partial { writer, file, declared, used });
                }
                Err(fill::Interrupted { error, cause: Cause::Lied }) if !vouched && start_overs < MAX_START_OVERS => {
                    self.refuse_source(&source, digest, &error.to_string());
                    start_overs += 1;
                    if sources.is_empty() {
                        sources.push_back(Source::Upstream);
                    }
                    last_error = Some(error);
                }
                Err(fill::Interrupted { error, .. }) => return Err(error),
            }
        }
        Err(last_error.unwrap_or_else(|| Error::Internal(format!("no source could serve {digest}"))))
    }

    /// Skips a source other than upstream that sent what the blob cannot be:
    /// a shared object is deleted and counted, a peer's answer logged.
    fn refuse_source(&self, source: &Source, digest: Digest, why: &str) {
        match source {
            Source::Shared => self.condemn_shared_blob(digest, why),
            Source::Peer(peer) => {
                tracing::warn!(%digest, %peer, why, "refusing the peer's bytes; trying the next source")
            }
            Source::Upstream => {}
        }
    }

    /// Commits a verified blob: fsync, rename, then the index row.
    async fn commit_fill(
        &self,
        temp: NamedTempFile,
        size: u64,
        upstream: &Upstream,
        repo: &RepoName,
        digest: Digest,
        used: &[Source],
    ) -> Result<(), Error> {
        let (store, index) = (self.store.clone(), Arc::clone(&self.index));
        let member = member_key(upstream.name(), repo, &digest);
        self.memory.insert_member(member.clone());
        let new = blocking(move || {
            store.commit(temp, &digest)?;
            Ok(index.insert_blob(&digest, size, &member, unix_ms(SystemTime::now()))?)
        })
        .await?;
        if new {
            self.evictor.added(size);
        }
        // Membership was proven on the way: upstream served it for `repo`,
        // the owner checked for it, or it was confirmed before the shared
        // tier's bytes were read. Only the replica that got bytes from
        // upstream uploads, in the background: a replica that read the
        // blob from its owner leaves it to the owner (whose upload queue
        // survives restarts), so the store is written once, not once per
        // replica that streamed it.
        if used.contains(&Source::Upstream) {
            self.share_blob(digest).await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::member_key;
    use crate::oci::Digest;

    #[tokio::test]
    async fn a_tag_mapping_confirmed_before_a_purge_of_its_repository_is_not_taken_from_a_peer() {
        let (_dir, cache) = super::test_cache::temporary().await;
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

    #[test]
    fn a_member_key_is_upstream_repository_and_hex_apart_by_nul_and_exactly_as_long() {
        let digest = Digest::of(b"layer");
        let key = member_key("registry-1.docker.io", &"library/alpine".parse().unwrap(), &digest);
        assert_eq!(key, format!("registry-1.docker.io\0library/alpine\0{}", digest.hex().as_str()));
        assert_eq!(key.capacity(), key.len(), "one allocation of the exact length");
    }
}
