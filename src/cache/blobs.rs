//! Blobs for a client or a peer: committed on disk, or a fill in flight to
//! attach to (one fill per digest, started here when none runs).

use std::fs::File;
use std::sync::Arc;
use std::time::SystemTime;

use tracing::Instrument;

use super::*;

/// Times a request may find that the fill it joined, started for another
/// repository, failed for a reason about that repository, before it takes
/// that answer as its own.
const FOREIGN_FILL_RETRIES: usize = 3;

impl Cache {
    /// A committed blob: the handle kept open since it was last served, or
    /// the file opened and checked against its index row. Only a file that
    /// is genuinely missing, or of the wrong size, drops its row (with
    /// exact accounting, see [`Cache::forget_removed`]); any other failure
    /// to open it (too many open files, EIO) is a 503 that changes nothing.
    pub(super) async fn committed_blob(&self, digest: &Digest) -> Result<Option<(Arc<File>, u64)>, Error> {
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
                        self.evictor.record_access(
                            Kind::Blob,
                            digest,
                            upstream.shared_name(),
                            unix_ms(SystemTime::now()),
                        );
                        let result =
                            if self.memory.claim_fetched_ahead(&digest) { CacheResult::Miss } else { CacheResult::Hit };
                        return Ok((BlobSource::Committed { file, size }, result));
                    }
                    // The warm loop's downloads yield bandwidth until a client joins.
                    let priority =
                        if crate::background::active() { Priority::background() } else { Priority::client() };
                    let attach = self.fills.join_or_start(
                        digest,
                        (&owner, &priority),
                        || self.memory.blob_size(&digest).is_some(),
                        |tx| self.spawn_fill(Arc::clone(upstream), repo.clone(), digest, (via, priority.clone()), tx),
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
            // A fill started ahead of the client: someone waits on it now,
            // and for that first client it is its miss (the bytes were not
            // cached when it asked), not a request coalesced onto another's.
            let result = if joined.priority.promote() {
                metrics().fills_ahead_joined.inc();
                CacheResult::Miss
            } else {
                CacheResult::Coalesced
            };
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
            return Ok((BlobSource::Filling(rx), result));
        }
    }

    /// Runs the fill of `digest` for `repo` in its own task, for a client
    /// or a peer (`via`), and ahead of any client or not (`priority`).
    /// The fill fails at its deadline ([`fill::deadline`]); a task that
    /// panics, or is dropped, fails it too ([`FlightGuard`]), so the digest
    /// is never left with a flight nobody finishes.
    pub(super) fn spawn_fill(
        self: &Arc<Self>,
        upstream: Arc<Upstream>,
        repo: RepoName,
        digest: Digest,
        (via, priority): (Via, Priority),
        tx: watch::Sender<Progress>,
    ) {
        let cache = Arc::clone(self);
        let reason = match via {
            Via::Peer { .. } => "peer",
            Via::Client if priority.is_ahead() => "ahead",
            Via::Client => "client",
        };
        metrics().fills.with_label_values(&[reason]).inc();
        metrics().fills_in_flight.inc();
        let trace = crate::otel::fill(&digest, reason, upstream.name());
        // Counted among its upstream's fills (whom those ahead yield to)
        // until its task ends, however it ends.
        let registered = upstream.bandwidth().register(&priority);
        // Its bytes count toward eviction from now on: the size its
        // manifest declared, then the size its source declared.
        let declared = self.memory.declared_size(&member_key(upstream.name(), &repo, &digest));
        let mut in_flight = self.evictor.in_flight(upstream.name(), declared.unwrap_or(0));
        let progress = tx.subscribe();
        let guard = FlightGuard { cache: Arc::clone(self), digest, tx, ended: false };
        let purges_seen = upkeep::purges::lock_purges(&self.purges).count();
        // A fill the warm loop starts stays background work (clients first).
        tokio::spawn(crate::background::inherit(async move {
            let mut guard = guard;
            let tx = &guard.tx;
            // Time the upstream's bandwidth held the fill's reads back is
            // larder's, not the source's: it does not count toward the
            // deadline (see fill::deadline).
            let held = || upstream.bandwidth().held(&priority);
            let timer = fill::deadline(tx.subscribe(), cache.config.max_blob_size, held);
            let filling =
                cache.fill(&upstream, &repo, digest, (via, &priority), purges_seen, tx).instrument(trace.clone());
            let result = tokio::select! {
                filled = filling => filled,
                late = timer => Err(late),
                never = count_in_flight(progress, &mut in_flight) => match never {},
            };
            match &result {
                Ok((_, size)) => crate::otel::filled(&trace, Ok(*size)),
                Err(e) => crate::otel::filled(&trace, Err(e)),
            }
            drop(in_flight);
            match result {
                Ok((file, size)) => {
                    if priority.is_ahead() {
                        cache.memory.insert_fetched_ahead(digest);
                    }
                    cache.memory.insert_blob_size(digest, size);
                    cache.memory.insert_open_blob(digest, Arc::clone(&file), size);
                    guard.end(Progress::Complete { file, size });
                    tracing::debug!(%digest, size, upstream = upstream.name(), "fill committed");
                }
                Err(e) => {
                    if matches!(e, Error::DiskFull) {
                        cache.evictor.disk_full();
                    }
                    tracing::warn!(%digest, upstream = upstream.name(), %repo, error = %e, "fill failed");
                    guard.end(Progress::Failed(e));
                }
            }
            drop(registered);
        }));
    }

    /// The size a manifest of `repo` declared for `digest`: remembered in
    /// memory, else read from the index (where it outlives restarts).
    pub(super) async fn declared_size(
        &self,
        upstream: &str,
        repo: &RepoName,
        digest: &Digest,
    ) -> Result<Option<u64>, Error> {
        let key = member_key(upstream, repo, digest);
        if let Some(size) = self.memory.declared_size(&key) {
            return Ok(Some(size));
        }
        let (index, k) = (Arc::clone(&self.index), key.clone());
        let size = blocking(move || Ok(index.declared_size(&k)?)).await?;
        if let Some(size) = size {
            self.memory.insert_declared_size(key, size);
        }
        Ok(size)
    }
}

/// A fill in flight, owned by its task: it leaves the map of fills (and
/// the in-flight gauge) when the task ends, however it ends. Dropped
/// without [`FlightGuard::end`] (the task panicked, or was cancelled), it
/// publishes a failure, so readers abort their bodies, and the next
/// request starts a new fill instead of joining one nobody finishes.
struct FlightGuard {
    cache: Arc<Cache>,
    digest: Digest,
    tx: watch::Sender<Progress>,
    ended: bool,
}

impl FlightGuard {
    /// Publishes how the fill ended. Out of the map first: a follower that
    /// retries (for its own repository, or after a failure) must not find
    /// this fill again.
    fn end(&mut self, outcome: Progress) {
        self.cache.fills.remove(&self.digest);
        self.tx.send_replace(outcome);
        self.ended = true;
    }
}

impl Drop for FlightGuard {
    fn drop(&mut self) {
        if !self.ended {
            tracing::error!(digest = %self.digest, "a fill's task ended without a result (it panicked or was cancelled); failing the fill");
            self.end(Progress::Failed(Error::Internal("the fill's task ended without a result".into())));
        }
        metrics().fills_in_flight.dec();
    }
}

/// Keeps a fill's bytes in flight at the size its source declared, until
/// the blob is verified (its commit then counts it as usage) or the fill
/// fails. Never returns: it runs beside the fill.
async fn count_in_flight(
    mut progress: watch::Receiver<Progress>,
    in_flight: &mut upkeep::evict::InFlight,
) -> std::convert::Infallible {
    loop {
        match &*progress.borrow_and_update() {
            Progress::Connecting => {}
            Progress::Streaming { size, .. } => {
                if let Some(size) = size {
                    in_flight.set(*size);
                }
            }
            Progress::Verified { .. } | Progress::Complete { .. } | Progress::Failed(_) => in_flight.set(0),
        }
        if progress.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}
