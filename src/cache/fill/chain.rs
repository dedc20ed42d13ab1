//! A blob's fill walking its source chain — the shared tier, the owner,
//! upstream (`fill_sources`) — resuming with the next source from the byte
//! the last one reached, verifying, and committing. Upstream's part of a
//! large blob may be fetched as parallel ranged parts (`parts`).

use std::fs::File;
use std::sync::Arc;
use std::time::SystemTime;

use super::parts;
use crate::cache::*;

/// Times a fill starts over in a new temp file because bytes from the
/// shared tier or a peer failed the digest (or a size bound). Two: a
/// corrupt shared object can reach a fill twice, read directly and through
/// the owner (which streams it before it could know); a third failure can
/// only be upstream's, whose answer is final.
const MAX_START_OVERS: usize = 2;

/// The blob a fill wants, and for whom.
#[derive(Clone, Copy)]
struct Want<'a> {
    upstream: &'a Upstream,
    repo: &'a RepoName,
    digest: &'a Digest,
    via: Via,
    priority: &'a Priority,
    /// The blob's size as its manifest declared it, if seen.
    expected: Option<u64>,
}

/// A source's body, and for upstream's answer to the first part of a
/// ranged fill, where that part ends (the rest is fetched in parts).
type Opening = (SourceBody, Option<u64>);

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

impl Cache {
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
    /// never passed on (one hop). Nor is a fill with a client's
    /// credentials (`Upstream::fills_with_client_credentials`): no peer
    /// has them.
    fn fill_sources(&self, upstream: &Upstream, digest: &Digest, via: Via) -> Vec<Source> {
        let mut sources = Vec::with_capacity(3);
        if self.shared.is_some() && via != (Via::Peer { shared_missed: true }) {
            sources.push(Source::Shared);
        }
        let peers_fill = via == Via::Client && !upstream.fills_with_client_credentials();
        if let Some(link) = self.peers.as_ref().filter(|_| peers_fill) {
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
    ) -> Result<Opening, Unavailable> {
        let Want { upstream, repo, digest, via, .. } = want;
        match source {
            Source::Shared => Ok((self.open_shared((upstream, repo, digest), offset, via, want.expected).await?, None)),
            Source::Peer(peer) => {
                Ok((self.open_peer(peer, upstream, repo, digest, offset, shared_missed).await?, None))
            }
            Source::Upstream => self.open_upstream(want, offset).await,
        }
    }

    /// Asks upstream for the blob from byte `offset`. When what is left of
    /// it is at least `parallel_fill_min` (by the size its manifest
    /// declared), the upstream may use more than one connection and its
    /// ranges were not found unreliable lately ([`super::ranges`]), only
    /// the first part is asked for: a `206` for it means upstream answers
    /// ranges and the rest comes in parts; a `200` (an upstream that
    /// ignores `Range`) is the whole blob, read as one stream from
    /// `offset` on, so nothing is fetched twice, and so is a `206` from
    /// `offset` that runs past the part (after which the upstream's ranges
    /// are not relied on for a while).
    async fn open_upstream(&self, want: Want<'_>, offset: u64) -> Result<Opening, Unavailable> {
        let Want { upstream, repo, digest, priority, expected, .. } = want;
        let ranged = upstream.config.fill_connections.get() > 1
            && expected.is_some_and(|size| size > offset && size - offset >= self.config.parallel_fill_min)
            && self.fills.ranges.trusted(upstream.name());
        let span = match expected.filter(|_| ranged) {
            Some(size) => Span { start: offset, end: Some(parts::part_end(offset, size)) },
            None => Span::from(offset),
        };
        let opened = upstream.get_blob(repo, digest, span, priority).await.map_err(|e| Unavailable::Final(e.into()))?;
        let Opened { response, permit } = opened.ok_or(Unavailable::Final(Error::BlobUnknown(*digest)))?;
        let protocol = |e: String| Unavailable::Final(UpstreamError::Protocol(e).into());
        // A 206 starts where asked; a 200 is the whole blob again.
        let (total, skip, part_end) = if response.status() == http::StatusCode::PARTIAL_CONTENT {
            match (content_range(response.headers()), span.end) {
                (Some((first, _, total)), None) if first == offset => (total, 0, None),
                (Some((first, last, Some(total))), Some(end)) if first == offset && last < end => {
                    (Some(total), 0, Some(last + 1))
                }
                (Some((first, _, Some(total))), Some(_)) if first == offset => {
                    self.fills.ranges.distrust(upstream.name());
                    (Some(total), 0, None)
                }
                (range, _) => {
                    // Other bytes than asked: this fill fails, and the
                    // upstream's next fills ask for no parts.
                    self.fills.ranges.distrust(upstream.name());
                    let answered = crate::upstream::described_range(range);
                    return Err(protocol(format!("upstream answered {answered} to a GET of {span}")));
                }
            }
        } else {
            (content_length(response.headers()), offset, None)
        };
        let body = http_body_util::BodyExt::boxed_unsync(http_body_util::BodyExt::map_err(response.into_body(), |e| {
            Box::new(e) as crate::body::BoxError
        }));
        let body = SourceBody {
            body,
            total,
            skip,
            permit: Some(permit),
            received: Some(metrics().upstream_bytes.with_label_values(&[upstream.name()])),
            idle: upstream.body_idle_timeout(),
            mend: false,
        };
        Ok((body, part_end))
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
    ///
    /// A size a manifest of `repo` declared for the blob is the only size
    /// it may have: upstream answering another fails the fill, and one
    /// above `max_blob_size` fails it before anything is asked. Without
    /// one, `max_blob_size` bounds what is written.
    ///
    /// `purges_seen`: [`Purges::count`](crate::cache::upkeep::purges::Purges::count)
    /// when the fill started; a purge of `repo` since then keeps the fill
    /// from recording `repo`'s membership when it commits.
    pub(in crate::cache) async fn fill(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        digest: Digest,
        (via, priority): (Via, &Priority),
        purges_seen: u64,
        tx: &watch::Sender<Progress>,
    ) -> Result<(Arc<File>, u64), Error> {
        let expected = self.declared_size(upstream.name(), repo, &digest).await?;
        let max = self.config.max_blob_size;
        if let Some(size) = expected.filter(|size| *size > max) {
            return Err(UpstreamError::Protocol(format!(
                "blob {digest} is {size} bytes by its manifest, more than cache.max_blob_size ({max} bytes)"
            ))
            .into());
        }
        let limit = expected.unwrap_or(max);
        // The shared tier's object was of the wrong size: the verified
        // blob is uploaded over it.
        let mut mend_shared = false;
        let mut sources: std::collections::VecDeque<Source> = self.fill_sources(upstream, &digest, via).into();
        let mut partial: Option<Partial> = None;
        let mut start_overs = 0;
        let mut last_error = None;
        let mut shared_missed = via == (Via::Peer { shared_missed: true });
        while let Some(source) = sources.pop_front() {
            let offset = partial.as_ref().map_or(0, |p| p.writer.written());
            let want = Want { upstream, repo, digest: &digest, via, priority, expected };
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
            let (SourceBody { body, total, skip, permit, received, idle, mend }, part_end) = opened;
            mend_shared |= mend;
            let known = partial.as_ref().and_then(|p| p.declared);
            if let (true, Some(declared), Some(len)) = (source.vouched(), expected, total) {
                if len != declared {
                    return Err(UpstreamError::Protocol(format!(
                        "blob {digest} is {len} bytes, but its manifest declares {declared}"
                    ))
                    .into());
                }
            }
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
            // The manifest's size, or an earlier source's, that this one's disagrees with.
            let contradicted = total.and_then(|t| [expected, known].into_iter().flatten().find(|size| *size != t));
            if let (false, Some(declared), Some(said)) = (source.vouched(), total, contradicted) {
                let why = format!("declares {declared} bytes where the manifest or an earlier source says {said}");
                self.refuse_source(&source, digest, &why);
                last_error = Some(UpstreamError::Protocol(format!("{} {why}", source.name())).into());
                continue;
            }
            if contradicts(known) {
                // Upstream contradicts the sources before it: they were wrong.
                let p = partial.take().expect("an earlier source declared a size");
                tracing::warn!(%digest, before = known.unwrap_or_default(), upstream = total.unwrap_or_default(), "upstream's size differs from what earlier sources sent; starting over");
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
                        extents: None,
                    };
                    tx.send_replace(progress);
                    crate::faults::check(crate::faults::Point::Fill)?;
                    Partial { writer: Writer::new(temp), file, declared: total, used: Vec::new() }
                }
            };
            // A body without a length is held to the manifest's size.
            let declared = declared.or(total).or(expected);
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
            let copied = match (part_end, permit, declared) {
                (Some(first_end), Some(permit), Some(size)) => {
                    let job = parts::PartsJob {
                        upstream,
                        repo,
                        digest: &digest,
                        priority,
                        size,
                        connections: upstream.config.fill_connections.get(),
                        file: Arc::clone(&file),
                        tx,
                        idle,
                        ranges: &self.fills.ranges,
                    };
                    job.run(writer, parts::OpenedPart { body, permit }, first_end).await
                }
                (_, permit, _) => {
                    let pace = vouched.then(|| upstream.bandwidth().pace(priority));
                    let bounds = fill::Bounds { declared, limit, idle, pace };
                    let copied = fill::copy_body(body, writer, skip, bounds, tx, received.as_slice()).await;
                    drop(permit);
                    copied
                }
            };
            match copied {
                Ok(writer) => {
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
                        let upload = used.contains(&Source::Upstream) || mend_shared;
                        self.commit_fill(temp, size, (upstream, repo, digest), purges_seen, upload).await?;
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
                    let used_names: Vec<&str> = used.iter().map(Source::name).collect();
                    tracing::warn!(%digest, sources = %used_names.join(","), "bytes from the shared tier or a peer failed the digest; starting over");
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

    /// Commits a verified blob: fsync, rename, then the index row and
    /// `repo`'s membership row, unless a purge of `repo` came after the
    /// fill started (`purges_seen`): that is checked inside the index's
    /// write transaction, which the purge's own is ordered with, so a
    /// purge either removes the row or keeps it from being written.
    /// `upload`: the blob goes to the shared tier.
    async fn commit_fill(
        &self,
        temp: NamedTempFile,
        size: u64,
        (upstream, repo, digest): (&Upstream, &RepoName, Digest),
        purges_seen: u64,
        upload: bool,
    ) -> Result<(), Error> {
        let (store, index, purges) = (self.store.clone(), Arc::clone(&self.index), Arc::clone(&self.purges));
        let member = member_key(upstream.name(), repo, &digest);
        let row = member.clone();
        let (new, member_kept) = blocking(move || {
            store.commit(temp, &digest)?;
            let keep = || !upkeep::purges::lock_purges(&purges).purged_since(&row, purges_seen);
            Ok(index.insert_fetched_blob(&digest, size, &row, keep, unix_ms(SystemTime::now()))?)
        })
        .await?;
        if new {
            self.evictor.added(size);
        }
        if member_kept {
            // Under the purges' lock, which a purge holds while it forgets
            // the memory's rows: this one cannot come back after that.
            let purges = upkeep::purges::lock_purges(&self.purges);
            if !purges.purged_since(&member, purges_seen) {
                self.memory.insert_member(member);
            }
        } else {
            tracing::info!(%digest, upstream = upstream.name(), %repo, "the repository was purged during the fill: committed without its membership");
        }
        // Membership was proven on the way: upstream served it for `repo`,
        // the owner checked for it, or it was confirmed before the shared
        // tier's bytes were read. Only the replica that got bytes from
        // upstream uploads, in the background (or one that found the
        // shared tier's object of the wrong size): a replica that read the
        // blob from its owner leaves it to the owner (whose upload queue
        // survives restarts), so the store is written once, not once per
        // replica that streamed it.
        if upload {
            self.share_blob(digest).await;
        }
        Ok(())
    }
}
