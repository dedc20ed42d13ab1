//! Keep-warm: images larder fetches before anyone asks, and keeps.
//!
//! The warm list is the config's `[[warm]]` plus the lines of
//! `cache.warm_file` ([`list`], read again when the file changes). At
//! start, and then every `warm_interval` (default: the upstream's
//! `tag_ttl`), each image is checked: a tag is revalidated with one `HEAD`
//! as a client's pull would revalidate it ([`Cache::check_warm`]); when it
//! moved, the new manifest, the manifests of the chosen platforms and
//! every blob they name are fetched through the cache facade, the same
//! path a pull takes, before any client asks. A digest is fetched once;
//! later checks only see that its blobs are still cached (an unpinned
//! image may have been evicted) and fetch what is missing.
//!
//! Clients go first: the loop is background work ([`crate::background`]),
//! whose upstream requests use permits of their own, and it fetches
//! [`BACKGROUND_CONCURRENCY`] blobs at once, one image at a time.
//!
//! A pinned image's current digest and the one before it are pinned
//! ([`crate::cache::pins`]): never evicted. The digests are kept in the
//! index, so a restart pins them before upstream is asked anything.
//!
//! A tag gone upstream (404) or an upstream that fails keeps being served
//! from the cache as far as `stale_if_error` allows, and is reported
//! ([`status`]): `larder_warm_images{state}`, `/status`, the status page
//! and `larder status`.

pub mod list;
pub mod status;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::background::CONCURRENCY as BACKGROUND_CONCURRENCY;
use crate::blocking::blocking;
use crate::cache::Cache;
use crate::cache::pins::PinnedImage;
use crate::cache::prefetch::{self, PrefetchProgress};
use crate::cache::warm::{Seen, WarmRow, now_ms};
use crate::config::{CacheConfig, Config, UpstreamConfig, WarmImage};
use crate::error::Error;
use crate::oci::{Digest, Reference};
use crate::upstream::{Upstream, Upstreams};
use list::{FileReport, Stamp};
use status::{WarmReport, WarmState, WarmStatus};

/// How often the warm file is checked for changes.
pub const FILE_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// One image of the list and where it is.
struct Entry {
    image: WarmImage,
    from_file: bool,
    row: Option<WarmRow>,
    state: WarmState,
    bytes_cached: u64,
    bytes_total: u64,
    last_check_ms: Option<u64>,
    next_due: Instant,
    message: Option<String>,
    /// The blob fetch in flight, whose progress is the bytes cached.
    progress: Option<watch::Receiver<PrefetchProgress>>,
}

impl Entry {
    fn new(image: WarmImage, from_file: bool, row: Option<WarmRow>) -> Entry {
        Entry {
            image,
            from_file,
            row,
            state: WarmState::Fetching,
            bytes_cached: 0,
            bytes_total: 0,
            last_check_ms: None,
            next_due: Instant::now(),
            message: None,
            progress: None,
        }
    }

    fn status(&self) -> WarmStatus {
        let now = Instant::now();
        let next_check_ms = now_ms() + self.next_due.saturating_duration_since(now).as_millis() as u64;
        let bytes_cached = match &self.progress {
            Some(rx) => rx.borrow().bytes_done.min(self.bytes_total.max(rx.borrow().bytes_total)),
            None => self.bytes_cached,
        };
        WarmStatus {
            image: self.image.image.clone(),
            upstream: self.image.upstream.clone(),
            repository: self.image.repo.to_string(),
            reference: self.image.reference.to_string(),
            platforms: self.image.platforms.clone(),
            pin: self.image.pin,
            from_file: self.from_file,
            state: self.state,
            digest: self.row.map(|r| r.digest.to_string()),
            previous_digest: self.row.and_then(|r| r.previous).map(|d| d.to_string()),
            bytes_cached,
            bytes_total: self.bytes_total,
            last_check_ms: self.last_check_ms,
            next_check_ms: Some(next_check_ms),
            message: self.message.clone(),
        }
    }
}

struct State {
    entries: Vec<Entry>,
    /// The warm file's images as last read well, its report and stamp.
    file_images: Vec<WarmImage>,
    file: Option<FileReport>,
    stamp: Stamp,
}

/// The keep-warm loop and what it knows.
pub struct Warm {
    cache: Arc<Cache>,
    upstreams: HashMap<String, Arc<Upstream>>,
    upstream_configs: Vec<UpstreamConfig>,
    cache_config: CacheConfig,
    config_images: Vec<WarmImage>,
    file: Option<PathBuf>,
    state: Mutex<State>,
}

/// What one check found, applied to the entry afterwards.
struct Outcome {
    state: WarmState,
    row: Option<WarmRow>,
    bytes: Option<(u64, u64)>,
    message: Option<String>,
}

impl Warm {
    pub fn new(config: &Config, cache: Arc<Cache>, upstreams: &Upstreams) -> Arc<Warm> {
        let upstreams = config
            .upstreams
            .iter()
            .filter_map(|u| Some((u.name.clone(), Arc::clone(upstreams.get(&u.name)?))))
            .collect();
        Arc::new(Warm {
            cache,
            upstreams,
            upstream_configs: config.upstreams.clone(),
            cache_config: config.cache.clone(),
            config_images: config.warm.clone(),
            file: config.cache.warm_file.clone(),
            state: Mutex::new(State { entries: Vec::new(), file_images: Vec::new(), file: None, stamp: None }),
        })
    }

    /// Whether there is anything to keep warm, now or once a file appears.
    pub fn is_configured(&self) -> bool {
        !self.config_images.is_empty() || self.file.is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the list and the digests recorded for it, and pins them: run
    /// before the cache's maintenance starts, so that nothing pinned is
    /// evicted at start-up.
    pub async fn load(&self) -> Result<(), Error> {
        if !self.is_configured() {
            return Ok(());
        }
        self.read_list().await;
        let rows: HashMap<String, WarmRow> = self.cache.warm_rows().await?.into_iter().collect();
        {
            let mut state = self.lock();
            for entry in &mut state.entries {
                entry.row = rows.get(&entry.image.key()).copied();
            }
        }
        self.list_changed().await
    }

    /// Reads the warm file (if any) and rebuilds the list: entries still
    /// listed keep what they know, new ones are due now. Returns whether
    /// the list changed.
    async fn read_list(&self) -> bool {
        let mut file_images = self.lock().file_images.clone();
        let mut report = None;
        let mut stamp = None;
        if let Some(path) = &self.file {
            let (path, upstreams, known) = (path.clone(), self.upstream_configs.clone(), self.config_images.clone());
            let read = blocking(move || Ok((list::stamp(&path), list::read_file(&path, &upstreams, &known)))).await;
            if let Ok((now, (images, file_report))) = read {
                for bad in &file_report.bad_lines {
                    tracing::warn!(
                        file = file_report.path,
                        line = bad.line,
                        error = bad.message,
                        "warm_file: line skipped"
                    );
                }
                if let Some(error) = &file_report.error {
                    tracing::warn!(file = file_report.path, error, "warm_file");
                }
                if let Some(images) = images {
                    file_images = images;
                }
                stamp = now;
                report = Some(file_report);
            }
        }
        let mut state = self.lock();
        let mut old: HashMap<String, Entry> = state.entries.drain(..).map(|e| (e.image.key(), e)).collect();
        let listed = self.config_images.iter().map(|i| (i, false)).chain(file_images.iter().map(|i| (i, true)));
        let mut entries = Vec::new();
        for (image, from_file) in listed {
            let entry = match old.remove(&image.key()) {
                Some(mut e) => {
                    // Platforms or pin may have changed on the same line.
                    let changed = e.image != *image;
                    e.image = image.clone();
                    e.from_file = from_file;
                    if changed {
                        e.next_due = Instant::now();
                    }
                    e
                }
                None => Entry::new(image.clone(), from_file, None),
            };
            entries.push(entry);
        }
        let changed = !old.is_empty() || entries.len() != state.entries.len() || state.file != report;
        state.entries = entries;
        state.file_images = file_images;
        state.file = report;
        state.stamp = stamp;
        changed
    }

    /// After the list changed: forgets the digests of images no longer
    /// listed, tells the cache which tags are warm, pins again.
    async fn list_changed(&self) -> Result<(), Error> {
        let (keys, tags) = {
            let state = self.lock();
            let keys: Vec<String> = state.entries.iter().map(|e| e.image.key()).collect();
            let tags: Vec<_> = state
                .entries
                .iter()
                .filter_map(|e| match &e.image.reference {
                    Reference::Tag(t) => Some((e.image.upstream.clone(), e.image.repo.clone(), t.clone())),
                    Reference::Digest(_) => None,
                })
                .collect();
            (keys, tags)
        };
        self.cache.set_warm_tags(tags);
        self.cache.retain_warm_rows(keys).await?;
        self.publish();
        self.pin().await
    }

    /// Pins every pinned image's current and previous digest.
    async fn pin(&self) -> Result<(), Error> {
        let images: Vec<PinnedImage> = {
            let state = self.lock();
            state
                .entries
                .iter()
                .filter(|e| e.image.pin)
                .filter_map(|e| Some((e.row?, &e.image)))
                .flat_map(|(row, image)| {
                    std::iter::once(row.digest).chain(row.previous).map(|digest| PinnedImage {
                        upstream: image.upstream.clone(),
                        digest,
                        platforms: image.platforms.clone(),
                    })
                })
                .collect()
        };
        self.cache.pin(&images).await.map(|_| ())
    }

    /// The warm set, for `/status`.
    pub fn report(&self) -> WarmReport {
        let state = self.lock();
        WarmReport { images: state.entries.iter().map(Entry::status).collect(), file: state.file.clone() }
    }

    /// Sets `larder_warm_images{state}`.
    fn publish(&self) {
        status::count(&self.report().images);
    }

    /// Runs the loop until `shutdown`: each image when due, one at a time,
    /// as background work; the warm file checked every [`FILE_CHECK_INTERVAL`].
    pub fn spawn(self: &Arc<Self>, mut shutdown: crate::shutdown::Shutdown) {
        if !self.is_configured() {
            return;
        }
        let warm = Arc::clone(self);
        tokio::spawn(crate::background::run(async move {
            loop {
                if warm.file_changed().await && warm.read_list().await {
                    if let Err(e) = warm.list_changed().await {
                        tracing::warn!(error = %e, "applying the new warm list failed");
                    }
                }
                let due: Vec<String> = {
                    let now = Instant::now();
                    warm.lock().entries.iter().filter(|e| e.next_due <= now).map(|e| e.image.key()).collect()
                };
                for key in due {
                    tokio::select! {
                        _ = shutdown.changed() => return,
                        () = warm.check(&key) => {}
                    }
                }
                let next = warm.lock().entries.iter().map(|e| e.next_due).min();
                let mut wake = next.unwrap_or_else(|| Instant::now() + FILE_CHECK_INTERVAL);
                if warm.file.is_some() {
                    wake = wake.min(Instant::now() + FILE_CHECK_INTERVAL);
                }
                tokio::select! {
                    _ = shutdown.changed() => return,
                    () = tokio::time::sleep_until(wake) => {}
                }
            }
        }));
    }

    async fn file_changed(&self) -> bool {
        let Some(path) = self.file.clone() else { return false };
        let now = blocking(move || Ok(list::stamp(&path))).await.ok().flatten();
        now != self.lock().stamp
    }

    fn interval(&self, image: &WarmImage) -> Duration {
        let upstream = self.upstream_configs.iter().find(|u| u.name == image.upstream);
        self.cache_config
            .warm_interval
            .or_else(|| upstream.map(|u| u.tag_ttl(&self.cache_config)))
            .unwrap_or(self.cache_config.tag_ttl)
    }

    /// Checks one image, fetching what it needs, and records the outcome.
    async fn check(&self, key: &str) {
        let found = {
            let state = self.lock();
            state.entries.iter().find(|e| e.image.key() == key).map(|e| (e.image.clone(), e.row))
        };
        let Some((image, row)) = found else { return };
        let Some(upstream) = self.upstreams.get(&image.upstream).cloned() else { return };
        let started_ms = now_ms();
        let outcome = match self.cache.check_warm(&upstream, &image.repo, &image.reference).await {
            Ok(Seen::At(digest)) => {
                let outcome = self.fetch(key, &image, &upstream, row, digest).await;
                if image.referrers && outcome.state == WarmState::Ready {
                    self.fetch_referrers(&image, &upstream, digest).await;
                }
                outcome
            }
            Ok(Seen::Gone) => Outcome {
                state: WarmState::MissingUpstream,
                row,
                bytes: self.cached_bytes(&image, &upstream, row).await,
                message: Some(
                    "gone upstream (404): what is cached is still served, as far as stale_if_error allows".to_owned(),
                ),
            },
            Err(e) => Outcome {
                state: WarmState::Failed,
                row,
                bytes: self.cached_bytes(&image, &upstream, row).await,
                message: Some(e.to_string()),
            },
        };
        match outcome.state {
            WarmState::Ready => tracing::debug!(image = image.image, "warm image ready"),
            state => tracing::warn!(
                image = image.image,
                state = state.as_str(),
                message = outcome.message.as_deref().unwrap_or(""),
                "warm image not ready"
            ),
        }
        let interval = self.interval(&image);
        {
            let mut state = self.lock();
            if let Some(e) = state.entries.iter_mut().find(|e| e.image.key() == key) {
                e.state = outcome.state;
                e.row = outcome.row.or(e.row);
                if let Some((cached, total)) = outcome.bytes {
                    (e.bytes_cached, e.bytes_total) = (cached, total);
                }
                e.message = outcome.message;
                e.last_check_ms = Some(started_ms);
                e.next_due = Instant::now() + interval;
                e.progress = None;
            }
        }
        self.publish();
        // What is pinned may have grown (new digest, blobs arrived).
        if let Err(e) = self.pin().await {
            tracing::warn!(error = %e, "pinning the warm images failed");
        }
    }

    /// Upstream has the image at `digest`: records a move, reads its
    /// manifests, pins them, and fetches the blobs not cached.
    async fn fetch(
        &self,
        key: &str,
        image: &WarmImage,
        upstream: &Arc<Upstream>,
        row: Option<WarmRow>,
        digest: Digest,
    ) -> Outcome {
        let row = match row {
            Some(row) if row.digest == digest => row,
            before => {
                let moved = WarmRow { digest, previous: before.map(|r| r.digest), seen_ms: now_ms() };
                if let Some(before) = before {
                    tracing::info!(image = image.image, from = %before.digest, to = %digest, "warm image moved upstream");
                }
                if let Err(e) = self.cache.set_warm_row(key.to_owned(), moved).await {
                    return failed(Some(moved), None, e);
                }
                self.set_row(key, moved);
                moved
            }
        };
        let reference = Reference::Digest(digest);
        let plan =
            match prefetch::plan_platforms(&self.cache, upstream, &image.repo, &reference, &image.platforms).await {
                Ok(plan) => plan,
                Err(e) => return failed(Some(row), None, e),
            };
        // The manifests are cached now: pin what they name before fetching.
        if let Err(e) = self.pin().await {
            return failed(Some(row), None, e);
        }
        let total = plan.bytes();
        let digests: Vec<Digest> = plan.blobs.clone();
        let cached = match self.cache.cached_blob_sizes(digests).await {
            Ok(sizes) => sizes.iter().flatten().sum::<u64>(),
            Err(e) => return failed(Some(row), None, e),
        };
        if plan.blobs.is_empty() || cached >= total {
            return Outcome { state: WarmState::Ready, row: Some(row), bytes: Some((total, total)), message: None };
        }
        let (tx, rx) =
            watch::channel(PrefetchProgress { bytes_total: total, bytes_done: cached, ..Default::default() });
        {
            let mut state = self.lock();
            if let Some(e) = state.entries.iter_mut().find(|e| e.image.key() == key) {
                e.state = WarmState::Fetching;
                e.bytes_total = total;
                e.progress = Some(rx);
            }
        }
        self.publish();
        tracing::info!(image = image.image, bytes = total - cached, "fetching a warm image's blobs");
        match prefetch::fetch_blobs(&self.cache, upstream, &image.repo, &plan, BACKGROUND_CONCURRENCY, &tx).await {
            Ok(_) => Outcome { state: WarmState::Ready, row: Some(row), bytes: Some((total, total)), message: None },
            Err(e) => {
                let done = tx.borrow().bytes_done;
                failed(Some(row), Some((done, total)), e)
            }
        }
    }

    /// With `referrers = true`: the image's signatures, SBOMs and
    /// attestations, with their blobs (see [`prefetch::prefetch_referrers`]).
    /// A failure is logged; the image itself stays ready.
    async fn fetch_referrers(&self, image: &WarmImage, upstream: &Arc<Upstream>, digest: Digest) {
        let reference = Reference::Digest(digest);
        let fetched = async {
            let plan =
                prefetch::plan_platforms(&self.cache, upstream, &image.repo, &reference, &image.platforms).await?;
            let mut report = prefetch::Prefetched::default();
            prefetch::prefetch_referrers(&self.cache, upstream, &image.repo, &plan, &mut report).await?;
            Ok::<_, Error>(report)
        };
        match crate::background::run(fetched).await {
            Ok(report) => {
                tracing::debug!(image = image.image, referrers = report.referrers, "warm image's referrers cached")
            }
            Err(e) => tracing::warn!(image = image.image, error = %e, "fetching a warm image's referrers failed"),
        }
    }

    fn set_row(&self, key: &str, row: WarmRow) {
        if let Some(e) = self.lock().entries.iter_mut().find(|e| e.image.key() == key) {
            e.row = Some(row);
        }
    }

    /// Bytes cached of the total, for the digest last seen, from what the
    /// cache holds (upstream is asked only for manifests not cached).
    async fn cached_bytes(
        &self,
        image: &WarmImage,
        upstream: &Arc<Upstream>,
        row: Option<WarmRow>,
    ) -> Option<(u64, u64)> {
        let reference = Reference::Digest(row?.digest);
        let plan =
            prefetch::plan_platforms(&self.cache, upstream, &image.repo, &reference, &image.platforms).await.ok()?;
        let digests: Vec<Digest> = plan.blobs.clone();
        let sizes = self.cache.cached_blob_sizes(digests).await.ok()?;
        Some((sizes.iter().flatten().sum(), plan.bytes()))
    }
}

fn failed(row: Option<WarmRow>, bytes: Option<(u64, u64)>, e: Error) -> Outcome {
    Outcome { state: WarmState::Failed, row, bytes, message: Some(e.to_string()) }
}
