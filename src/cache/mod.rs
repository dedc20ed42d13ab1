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
//!
//! The facade's rooms, in this folder: `manifests` (by digest and by
//! tag), `blobs` (a committed file or a fill to attach to), `membership`
//! (which repository may be served what), `listings` (`tags/list`,
//! `referrers`), `tiers` (how the shared tier and the owners are asked)
//! and [`stats`] (what the status page shows). Beneath them, one folder
//! per path through the cache:
//! - [`fill`]: a blob fetched once however many ask: fills in flight and
//!   their readers (`fill/mod.rs`), what a fill publishes to them
//!   (`progress`), a source's body into the temp file (`copy`), a large
//!   blob as parallel ranged GETs ([`fill::parts`]), the sources a fill
//!   walks (`chain`, [`fill::source`]) and fills started when a client
//!   asks for a layer of an image it resolved (`ahead`).
//! - `store`: what this replica holds: `memory` ([`StoredManifest`],
//!   moka), `disk` (the content-addressed files), [`index`] (redb), and
//!   how blob files are read (`pread`, `residency`).
//! - `upkeep`: keeping it within bounds and true to its files:
//!   `maintenance` (the background task, eviction's removals, purges),
//!   `evict`, [`pins`] (what eviction passes over), `reconcile` and
//!   `reconcile_live`.
//! - `seed`: images put in or taken out before any client asks:
//!   [`prefetch`], [`import`], [`export`] and [`warm`] (what the
//!   keep-warm loop asks of the cache).
//! - [`shared`]: the shared tier's S3 client and its durable [`upload`]
//!   queue.
//!
//! The modules the rest of the crate uses are re-exported here under
//! their own names (`cache::index`, `cache::prefetch`, ...), so callers
//! need not know the folders.

mod blobs;
pub mod fill;
mod listings;
mod manifests;
mod membership;
mod seed;
pub mod shared;
pub mod stats;
mod store;
#[cfg(test)]
mod test_cache;
mod tiers;
mod upkeep;

use std::fs::File;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tempfile::NamedTempFile;
use tokio::sync::watch;

pub use seed::{export, import, prefetch, warm};
pub use shared::upload;
pub use store::index;
pub use store::memory::StoredManifest;
pub use upkeep::maintenance::{ClusterPurged, Purged};
pub use upkeep::pins;
pub use upkeep::reconcile::{Report, Watch as VerifyWatch};

use crate::blocking::blocking;
use crate::cluster::PeerLink;
use crate::coalesce::{Joined, SingleFlight};
use crate::config::CacheConfig;
use crate::error::{Error, UpstreamError};
use crate::metrics::metrics;
use crate::oci::{Digest, Reference, RepoName, Tag, tag_list};
use crate::upstream::{
    FetchedManifest, Listing, Opened, Page, Priority, Span, Upstream, content_length, content_range,
};
use fill::source::{Source, SourceBody, Unavailable};
use fill::{Attach, Cause, Fills, Progress, Writer};
use index::{Entry, Index, Kind};
use membership::{Content, member_key};
use shared::SharedStore;
use store::disk::Store;
use store::memory::{Memory, TagEntry};
use upkeep::evict::{Evictor, Limits};
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
    /// The image manifests clients resolved, for the fills ahead a layer
    /// request starts.
    resolved: fill::Resolved,
    evictor: Arc<Evictor>,
    /// One upstream manifest GET per (upstream, repo, reference).
    manifest_fetches: SingleFlight<String, Arc<StoredManifest>>,
    /// One upstream HEAD per tag being revalidated: where the tag points,
    /// and the registry warnings of the answer.
    revalidations: SingleFlight<String, Option<(Digest, crate::oci::Warnings)>>,
    /// One upstream `tags/list` or `referrers` request per page however many ask.
    listing_fetches: SingleFlight<String, Option<Page>>,
    /// The shared tier and its upload queue (`[shared]`).
    shared: Option<(Arc<SharedStore>, Uploads)>,
    /// The other replicas (`[cluster]`).
    peers: Option<PeerLink>,
    /// Recent purges (see [`upkeep::purges`]): a tag mapping a peer
    /// confirmed before a purge of its repository is not taken from it
    /// ([`Cache::purged_after`]), and a fill started before one commits
    /// without that repository's membership row.
    purges: Arc<std::sync::Mutex<upkeep::purges::Purges>>,
    /// What eviction passes over (the warm images' content), and how much
    /// that is (see [`pins`]).
    pins: std::sync::RwLock<Arc<pins::Pins>>,
    pinned_usage: std::sync::Mutex<pins::PinnedUsage>,
    /// Tags of warm images (their `tag_key`s), and whether the warm loop
    /// last found each gone upstream: served from the cache, within
    /// `stale_if_error`, when upstream says they are gone.
    warm_tags: std::sync::RwLock<std::collections::HashMap<String, bool>>,
    /// Imports running at once (see [`import::MAX_IMPORTS_AT_ONCE`]).
    imports: Arc<tokio::sync::Semaphore>,
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

/// How often a graceful stop checks whether the fills in flight have ended.
const FILLS_POLL: Duration = Duration::from_millis(10);

/// Opens the index first, which locks it against any other larder process
/// (a second `larder`, or `larder verify`), and only then prepares the
/// store, whose start-up sweeps `tmp/`: a running instance's fills live there.
fn open_locked(dir: &std::path::Path) -> Result<(Store, Index), Error> {
    let store = Store::new(dir)?;
    let index = Index::open(&store.index_path()).map_err(|e| match e {
        redb::Error::DatabaseAlreadyOpen => Error::CacheInUse(dir.display().to_string()),
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
        let quotas = config
            .upstream_max_size
            .iter()
            .map(|(upstream, max)| {
                let limits = Limits::new(*max, config.high_watermark, config.low_watermark);
                metrics()
                    .upstream_cache_max_size
                    .with_label_values(&[upstream])
                    .set(i64::try_from(*max).unwrap_or(i64::MAX));
                (upstream.clone(), limits)
            })
            .collect();
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
            evictor: Arc::new(Evictor::new(limits, usage, quotas, Arc::clone(index.charged()))),
            memory: Memory::new(config.memory),
            config,
            store,
            index: Arc::new(index),
            fills: Fills::default(),
            resolved: fill::Resolved::default(),
            manifest_fetches: SingleFlight::default(),
            revalidations: SingleFlight::default(),
            listing_fetches: SingleFlight::default(),
            purges: Arc::default(),
            pins: std::sync::RwLock::default(),
            pinned_usage: std::sync::Mutex::default(),
            warm_tags: std::sync::RwLock::default(),
            imports: Arc::new(tokio::sync::Semaphore::new(import::MAX_IMPORTS_AT_ONCE)),
        }))
    }

    /// Re-hashes every blob against its name and the index (`larder verify`),
    /// removing bad entries when `repair` is set. Needs the cache folder to
    /// itself: redb refuses a second process.
    /// `watch` is told the totals and each blob hashed (progress).
    pub fn verify(
        config: &CacheConfig,
        repair: bool,
        watch: &mut dyn upkeep::reconcile::Watch,
    ) -> Result<Report, Error> {
        let (store, index) = open_locked(&config.dir)?;
        upkeep::reconcile::reconcile(&store, &index, true, repair, unix_ms(SystemTime::now()), watch)
    }

    /// Most bytes one import may read from a layout (`cache.max_import_size`).
    pub fn max_import_size(&self) -> u64 {
        self.config.max_import_size
    }

    /// Bytes of blobs and manifests on disk.
    pub fn usage(&self) -> u64 {
        self.evictor.usage()
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
}
