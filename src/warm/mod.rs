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
//!
//! The warm file may be read while it is written: a changed file is applied
//! only once two reads at least [`FILE_CHECK_INTERVAL`] apart ([`SETTLE_PAUSE`]
//! at start) find the same bytes, its last line only
//! once it ends with a newline ([`list`]), and an image that leaves the
//! list keeps its digests (the previous one too) and its pins for
//! [`REMOVED_GRACE`]: a list briefly missing it, or larder restarted on
//! such a list, loses nothing.

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
/// At start, the pause between two reads of the warm file that must agree.
pub const SETTLE_PAUSE: Duration = Duration::from_millis(200);
/// At start, reads of the warm file until two agree; past them the file's
/// images wait for the loop (what they pinned stays pinned meanwhile).
pub const SETTLE_READS: usize = 10;
/// How long an image no longer listed keeps its digests (the previous one
/// too) and its pins: a warm file briefly missing it loses nothing.
pub const REMOVED_GRACE: Duration = Duration::from_secs(15 * 60);

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
    /// Unix millis of the first check that found it gone, while it is.
    gone_since_ms: Option<u64>,
    /// The state last logged as a warning: a state is warned about once,
    /// when it is entered, not at every interval.
    warned: Option<WarmState>,
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
            gone_since_ms: None,
            warned: None,
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
    /// Images no longer listed, each kept (its digests, its pins) until
    /// the instant given ([`REMOVED_GRACE`]).
    removed: Vec<(Entry, Instant)>,
    /// The warm file's images as last read well, its report and stamp.
    file_images: Vec<WarmImage>,
    file: Option<FileReport>,
    stamp: Stamp,
    /// What a read of the warm file found, and when, while a change is not
    /// applied yet: a read at least the settle time later must find the same.
    unsettled: Option<(list::Raw, Instant)>,
}

/// What a read of the list did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Listed {
    Changed,
    Unchanged,
    /// The warm file changed since the read before: read it again later.
    Unsettled,
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
            state: Mutex::new(State {
                entries: Vec::new(),
                removed: Vec::new(),
                file_images: Vec::new(),
                file: None,
                stamp: None,
                unsettled: None,
            }),
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
    /// evicted at start-up. The warm file is read until two reads agree
    /// (at most [`SETTLE_READS`]). Recorded digests of images not listed
    /// now are kept, and pinned (every platform: the list that chose them
    /// is gone), for [`REMOVED_GRACE`].
    pub async fn load(&self) -> Result<(), Error> {
        if !self.is_configured() {
            return Ok(());
        }
        for _ in 0..SETTLE_READS {
            if self.read_list(SETTLE_PAUSE).await != Listed::Unsettled {
                break;
            }
            tokio::time::sleep(SETTLE_PAUSE).await;
        }
        let rows: HashMap<String, WarmRow> = self.cache.warm_rows().await?.into_iter().collect();
        {
            let mut state = self.lock();
            for entry in &mut state.entries {
                entry.row = rows.get(&entry.image.key()).copied();
            }
            let until = Instant::now() + REMOVED_GRACE;
            let listed: std::collections::HashSet<String> = state.entries.iter().map(|e| e.image.key()).collect();
            for (key, row) in rows.iter().filter(|(key, _)| !listed.contains(*key)) {
                if let Some(image) = image_of_key(key) {
                    state.removed.push((Entry::new(image, true, Some(*row)), until));
                }
            }
        }
        self.list_changed().await
    }

    /// Reads the warm file (if any) and rebuilds the list: entries still
    /// listed keep what they know, new ones are due now, ones no longer
    /// listed are kept aside for [`REMOVED_GRACE`] (and come back as they
    /// were if listed again meanwhile). A changed file is applied only
    /// when this read finds what a read at least `apart` earlier found.
    async fn read_list(&self, apart: Duration) -> Listed {
        let mut file_images = self.lock().file_images.clone();
        let mut report = None;
        let mut stamp = None;
        if let Some(path) = &self.file {
            let (path, upstreams, known) = (path.clone(), self.upstream_configs.clone(), self.config_images.clone());
            let read = blocking(move || {
                let (stamp, raw) = (list::stamp(&path), list::read_raw(&path));
                let agrees = raw.clone();
                Ok((stamp, agrees, list::parse(&path, &raw, &upstreams, &known)))
            })
            .await;
            let Ok((now, raw, (images, file_report))) = read else { return Listed::Unchanged };
            {
                let mut state = self.lock();
                match &state.unsettled {
                    Some((first, at)) if *first == raw => {
                        if at.elapsed() < apart {
                            return Listed::Unsettled;
                        }
                    }
                    _ => {
                        state.unsettled = Some((raw, Instant::now()));
                        return Listed::Unsettled;
                    }
                }
                state.unsettled = None;
            }
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
            if let Some(line) = file_report.unterminated_line {
                tracing::info!(file = file_report.path, line, "warm_file: last line has no newline yet; not read");
            }
            if let Some(images) = images {
                file_images = images;
            }
            stamp = now;
            report = Some(file_report);
        }
        let now = Instant::now();
        let mut state = self.lock();
        let mut old: HashMap<String, Entry> = state.entries.drain(..).map(|e| (e.image.key(), e)).collect();
        let mut removed: HashMap<String, (Entry, Instant)> =
            state.removed.drain(..).map(|(e, until)| (e.image.key(), (e, until))).collect();
        let listed = self.config_images.iter().map(|i| (i, false)).chain(file_images.iter().map(|i| (i, true)));
        let mut entries = Vec::new();
        let mut changed = false;
        for (image, from_file) in listed {
            let key = image.key();
            let entry = match old.remove(&key) {
                Some(mut e) => {
                    // Platforms or pin may have changed on the same line.
                    let changed = e.image != *image;
                    e.image = image.clone();
                    e.from_file = from_file;
                    if changed {
                        e.next_due = now;
                    }
                    e
                }
                None => {
                    changed = true;
                    match removed.remove(&key) {
                        // Listed again within its grace: as it was, checked now.
                        Some((mut e, _)) => {
                            e.image = image.clone();
                            e.from_file = from_file;
                            e.next_due = now;
                            e
                        }
                        None => Entry::new(image.clone(), from_file, None),
                    }
                }
            };
            entries.push(entry);
        }
        changed |= !old.is_empty() || state.file != report;
        for (key, e) in old {
            tracing::info!(
                image = e.image.image,
                "warm image no longer listed: its digests and pins are kept for a while"
            );
            removed.insert(key, (e, now + REMOVED_GRACE));
        }
        state.entries = entries;
        state.removed = removed.into_values().collect();
        state.file_images = file_images;
        state.file = report;
        state.stamp = stamp;
        if changed { Listed::Changed } else { Listed::Unchanged }
    }

    /// Forgets the images whose grace ended by `now`; whether any did.
    fn expire_removed(&self, now: Instant) -> bool {
        let mut state = self.lock();
        let before = state.removed.len();
        state.removed.retain(|(e, until)| {
            let keep = *until > now;
            if !keep {
                tracing::info!(image = e.image.image, "warm image no longer listed: its digests and pins are dropped");
            }
            keep
        });
        state.removed.len() != before
    }

    /// After the list changed: forgets the digests of images no longer
    /// listed whose grace ended, tells the cache which tags are warm, pins
    /// again.
    async fn list_changed(&self) -> Result<(), Error> {
        let (keys, tags) = {
            let state = self.lock();
            let kept = state.entries.iter().chain(state.removed.iter().map(|(e, _)| e));
            let keys: Vec<String> = kept.map(|e| e.image.key()).collect();
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

    /// Pins every pinned image's current and previous digest (those no
    /// longer listed too, within their grace).
    async fn pin(&self) -> Result<(), Error> {
        let images: Vec<PinnedImage> = {
            let state = self.lock();
            state
                .entries
                .iter()
                .chain(state.removed.iter().map(|(e, _)| e))
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
                let mut changed = warm.expire_removed(Instant::now());
                if warm.file_changed().await {
                    changed |= warm.read_list(FILE_CHECK_INTERVAL).await == Listed::Changed;
                }
                if changed {
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
                let next = {
                    let state = warm.lock();
                    let due = state.entries.iter().map(|e| e.next_due);
                    due.chain(state.removed.iter().map(|(_, until)| *until)).min()
                };
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

    /// Whether the warm file differs from what was applied (by its stamp),
    /// or a change read last time still waits for a second read.
    async fn file_changed(&self) -> bool {
        let Some(path) = self.file.clone() else { return false };
        let now = blocking(move || Ok(list::stamp(&path))).await.ok().flatten();
        let state = self.lock();
        now != state.stamp || state.unsettled.is_some()
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
            state
                .entries
                .iter()
                .find(|e| e.image.key() == key)
                .map(|e| (e.image.clone(), e.row, e.gone_since_ms, e.from_file))
        };
        let Some((image, row, gone_since_ms, from_file)) = found else { return };
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
            // Seen before (a digest is recorded): gone since. Never seen: a
            // name upstream has never had, most likely a typo.
            Ok(Seen::Gone) => match row {
                Some(seen) => Outcome {
                    state: WarmState::MissingUpstream,
                    row,
                    bytes: self.cached_bytes(&image, &upstream, row).await,
                    message: Some(format!(
                        "gone upstream (404) since {}; it was {}: what is cached is still served, as far as \
                         stale_if_error allows",
                        shown_time(gone_since_ms.unwrap_or(started_ms)),
                        seen.digest
                    )),
                },
                None => Outcome {
                    state: WarmState::NotFound,
                    row,
                    bytes: None,
                    message: Some(format!(
                        "not found upstream (404), and never was since it was listed: check the name in {} \
                         (upstream {:?}, repository {}); nothing of it is cached",
                        if from_file { "the warm file" } else { "[[warm]]" },
                        image.upstream,
                        image.repo
                    )),
                },
            },
            Err(e) => Outcome {
                state: WarmState::Failed,
                row,
                bytes: self.cached_bytes(&image, &upstream, row).await,
                message: Some(e.to_string()),
            },
        };
        let interval = self.interval(&image);
        {
            let mut state = self.lock();
            if let Some(e) = state.entries.iter_mut().find(|e| e.image.key() == key) {
                log_change(e, &outcome);
                e.gone_since_ms = match outcome.state {
                    WarmState::MissingUpstream => Some(e.gone_since_ms.unwrap_or(started_ms)),
                    _ => None,
                };
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
            return self.confirmed(upstream, image, &plan, row).await;
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
            Ok(_) => self.confirmed(upstream, image, &plan, row).await,
            Err(e) => {
                let done = tx.borrow().bytes_done;
                failed(Some(row), Some((done, total)), e)
            }
        }
    }

    /// Every manifest and blob of `plan` is cached: ready once each is a
    /// member of the image's repository (see [`Cache::confirm_image`]), so
    /// that it pulls with upstream gone; else failed, and checked again at
    /// the next interval.
    async fn confirmed(
        &self,
        upstream: &Arc<Upstream>,
        image: &WarmImage,
        plan: &prefetch::Plan,
        row: WarmRow,
    ) -> Outcome {
        let total = plan.bytes();
        let manifests: Vec<Digest> =
            std::iter::once(plan.top.digest).chain(plan.children.iter().map(|m| m.digest)).collect();
        match self.cache.confirm_image(upstream, &image.repo, &manifests, &plan.blobs).await {
            Ok(()) => Outcome { state: WarmState::Ready, row: Some(row), bytes: Some((total, total)), message: None },
            Err(e) => {
                let message = format!("cached, but not yet confirmed as content of {}: {e}", image.repo);
                Outcome {
                    state: WarmState::Failed,
                    row: Some(row),
                    bytes: Some((total, total)),
                    message: Some(message),
                }
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

/// Logs a check's outcome: a state other than ready is a warning once,
/// when it is entered (each interval's repeat is debug), and leaving it is
/// logged once too.
fn log_change(entry: &mut Entry, outcome: &Outcome) {
    let image = entry.image.image.as_str();
    let message = outcome.message.as_deref().unwrap_or("");
    match (outcome.state, entry.warned) {
        (WarmState::Ready, None) => tracing::debug!(image, "warm image ready"),
        (WarmState::Ready, Some(was)) => {
            tracing::info!(image, was = was.as_str(), "warm image ready again");
            entry.warned = None;
        }
        (state, Some(was)) if was == state => {
            tracing::debug!(image, state = state.as_str(), message, "warm image still not ready")
        }
        (state, _) => {
            tracing::warn!(image, state = state.as_str(), message, "warm image not ready");
            entry.warned = Some(state);
        }
    }
}

/// Unix millis as an operator reads a time: `2026-12-05T01:15:12Z`.
fn shown_time(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

fn failed(row: Option<WarmRow>, bytes: Option<(u64, u64)>, e: Error) -> Outcome {
    Outcome { state: WarmState::Failed, row, bytes, message: Some(e.to_string()) }
}

/// The image a warm row's key (`upstream\0repo\0reference`) names, for a
/// row whose image is no longer listed: every platform, pinned.
fn image_of_key(key: &str) -> Option<WarmImage> {
    let mut parts = key.splitn(3, '\0');
    let (upstream, repo, reference) = (parts.next()?, parts.next()?, parts.next()?);
    let (repo, reference): (crate::oci::RepoName, Reference) = (repo.parse().ok()?, reference.parse().ok()?);
    let image = match &reference {
        Reference::Digest(d) => format!("{upstream}/{repo}@{d}"),
        Reference::Tag(t) => format!("{upstream}/{repo}:{t}"),
    };
    Some(WarmImage {
        image,
        upstream: upstream.to_owned(),
        repo,
        reference,
        platforms: Vec::new(),
        pin: true,
        referrers: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::warm::WarmRow;

    fn key(repo: &str) -> String {
        format!("u.test\0{repo}\01")
    }

    fn row(seed: u8) -> WarmRow {
        WarmRow { digest: Digest::of(&[seed]), previous: Some(Digest::of(&[seed, seed])), seen_ms: 1 }
    }

    fn listed(warm: &Warm) -> Vec<String> {
        warm.lock().entries.iter().map(|e| e.image.repo.to_string()).collect()
    }

    async fn rows(cache: &Cache) -> HashMap<String, WarmRow> {
        cache.warm_rows().await.unwrap().into_iter().collect()
    }

    #[tokio::test]
    async fn a_warm_file_read_while_written_applies_whole_lines_two_reads_agree_on_and_keeps_removed_images() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("warm.txt");
        let toml = format!(
            "[cache]\ndir = {:?}\nwarm_file = {:?}\n[[upstream]]\nname = \"u.test\"\nurl = \"http://127.0.0.1:9\"\n\
             default = true\n",
            dir.path().join("cache").display().to_string(),
            file.display().to_string()
        );
        let config = Config::parse(&toml, "test.toml", None).unwrap();
        let cache = Cache::open(config.cache.clone()).await.unwrap();
        let upstreams = Upstreams::new(&config).unwrap();
        // Digests recorded by an earlier run, the previous ones too.
        cache.set_warm_row(key("team/a"), row(1)).await.unwrap();
        cache.set_warm_row(key("team/b"), row(2)).await.unwrap();

        // Read while `team/b:10` is being written: `team/b:1` is no image yet.
        std::fs::write(&file, "team/a:1\nteam/b:1").unwrap();
        let warm = Warm::new(&config, Arc::clone(&cache), &upstreams);
        warm.load().await.unwrap();
        assert_eq!(listed(&warm), ["team/a"]);
        assert_eq!(warm.report().file.unwrap().unterminated_line, Some(2));
        assert_eq!(rows(&cache).await.get(&key("team/b")), Some(&row(2)), "not listed, but kept for a while");

        // Rewritten: one read sees it, the next must agree before it applies.
        std::fs::write(&file, "team/b:1\n").unwrap();
        let hour = Duration::from_secs(3600);
        assert_eq!(warm.read_list(hour).await, Listed::Unsettled);
        assert_eq!(warm.read_list(hour).await, Listed::Unsettled, "the same bytes, but read too soon after");
        assert_eq!(listed(&warm), ["team/a"], "not applied after one read");
        assert_eq!(warm.read_list(Duration::ZERO).await, Listed::Changed);
        warm.list_changed().await.unwrap();
        assert_eq!(listed(&warm), ["team/b"]);
        let b = warm.lock().entries[0].row;
        assert_eq!(b, Some(row(2)), "listed again: its digests as they were, the previous one too");
        assert_eq!(rows(&cache).await.get(&key("team/a")), Some(&row(1)), "gone from the list: kept for a while");

        // A read in the middle of a rewrite, then the same bytes again.
        std::fs::write(&file, "team/b:1\nteam/a:").unwrap();
        assert_eq!(warm.read_list(Duration::ZERO).await, Listed::Unsettled);
        std::fs::write(&file, "team/b:1\nteam/a:1\n").unwrap();
        assert_eq!(warm.read_list(Duration::ZERO).await, Listed::Unsettled, "another read, other bytes: not applied");
        assert_eq!(warm.read_list(Duration::ZERO).await, Listed::Changed);
        assert_eq!(listed(&warm), ["team/b", "team/a"]);
        assert_eq!(warm.lock().entries[1].row, Some(row(1)), "back within its grace: nothing lost");

        // Gone for longer than the grace: forgotten.
        std::fs::write(&file, "team/b:1\n").unwrap();
        warm.read_list(Duration::ZERO).await;
        assert_eq!(warm.read_list(Duration::ZERO).await, Listed::Changed);
        warm.list_changed().await.unwrap();
        assert!(!warm.expire_removed(Instant::now()), "within its grace");
        assert!(warm.expire_removed(Instant::now() + REMOVED_GRACE + Duration::from_secs(1)));
        warm.list_changed().await.unwrap();
        let left: Vec<String> = rows(&cache).await.into_keys().collect();
        assert_eq!(left, [key("team/b")]);
    }
}
