//! The tiers beyond this replica's own memory and disk, as the facade asks
//! them: the shared object store, and the key's owner among the peers. The
//! order they are tried in lives in the facade (`fill_sources`,
//! `fetch_manifest`, `ensure_member`); this file says how each is asked
//! and how its answer is read.
//!
//! An owner's answer is worth what upstream's is: a 404 or 403 it relays
//! is final. An owner that cannot be reached, or answers anything else, is
//! skipped (and marked down if unreachable): this replica then asks
//! upstream itself, correctness before deduplication. Nothing from a peer
//! or the shared tier is trusted: blobs are hashed as they arrive, and
//! manifests must hash to their digest.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{CONTENT_RANGE, CONTENT_TYPE};
use http::{Method, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::fill::source::{SourceBody, Unavailable};
use super::{Cache, Content, Via, digest_owner_key, tag_owner_key};
use crate::cluster::PeerUrl;
use crate::cluster::client::{Ask, PEER_LOOKUP_TIMEOUT, PEER_RESPONSE_MARGIN, PeerError, TAG_CONFIRMED_HEADER};
use crate::error::{Error, UpstreamError};
use crate::metrics::metrics;
use crate::oci::{Digest, MAX_MANIFEST_SIZE, MediaType, Reference, RepoName, Warnings, inspect_manifest};
use crate::upstream::{FetchedManifest, Upstream, content_length};

/// What a peer's error answer means for the asker.
enum Verdict {
    /// Upstream (asked by the owner) says the repository lacks it.
    NotFound,
    /// Upstream (asked by the owner) refused: denied, or rate limited.
    Final(Error),
    /// Anything else: ask the next source.
    Fallback,
}

fn verdict(status: StatusCode, code: &str, retry_after: Option<String>) -> Verdict {
    match (status.as_u16(), code) {
        (404, "BLOB_UNKNOWN" | "MANIFEST_UNKNOWN") => Verdict::NotFound,
        // A HEAD's 404 has no body to tell its code by.
        (404, "") => Verdict::NotFound,
        (403, _) => Verdict::Final(UpstreamError::Denied.into()),
        (429, _) => Verdict::Final(UpstreamError::RateLimited { retry_after }.into()),
        _ => Verdict::Fallback,
    }
}

/// `?ns=<upstream name>`: peers name upstreams by their configured name.
fn ns_query(upstream: &str) -> String {
    form_urlencoded::Serializer::new(String::new()).append_pair("ns", upstream).finish()
}

/// `bytes <first>-<last>/<total>` of a 206: (first, total if known).
pub(super) fn content_range(headers: &http::HeaderMap) -> Option<(u64, Option<u64>)> {
    let value = headers.get(CONTENT_RANGE)?.to_str().ok()?;
    let (range, total) = value.strip_prefix("bytes ")?.split_once('/')?;
    let first = range.split_once('-')?.0.parse().ok()?;
    Some((first, total.parse().ok()))
}

impl Cache {
    /// Who to ask about a manifest, a tag or a membership before upstream,
    /// and how. A client's request goes to the key's owner, which fetches
    /// for everyone. When this replica is the owner (or was asked as one),
    /// it asks the runner-up only what it already holds (a lookup, never a
    /// fetch or a forward): after this replica joined, or lost its disk,
    /// that is who owned the key before, and upstream is spared. Small
    /// answers, so the extra round trip costs little; blobs rely on the
    /// shared tier for the same. An upstream whose fills use the client's
    /// credentials has its owner asked only what it holds: the owner has
    /// none to fetch with.
    fn peer_to_ask(&self, upstream: &Upstream, key: &str, via: Via) -> Option<(PeerUrl, bool)> {
        let link = self.peers.as_ref()?;
        if via == Via::Client {
            if let Some(owner) = link.owner_elsewhere(key) {
                return Some((owner, upstream.fills_with_client_credentials()));
            }
        }
        link.first_other(key).map(|peer| (peer, true))
    }

    /// The response-header wait for a peer asked to fetch (not a lookup):
    /// the owner's worst legitimate wait before its own answer has headers,
    /// plus the round trips between the two. The owner may first look in
    /// the shared tier ([`super::shared::LOOKUP_TIMEOUT`]) and ask its
    /// runner-up ([`PEER_LOOKUP_TIMEOUT`]), then ask upstream: a token
    /// round trip and the request itself, each within upstream's
    /// `response_timeout`. An owner slower than that (a redirect hop, a
    /// long wait for an upstream slot) is given up on for that one request
    /// without being marked down (see [`PeerError`]).
    fn owner_budget(&self, upstream: &Upstream) -> Duration {
        let store = if self.shared.is_some() { super::shared::LOOKUP_TIMEOUT } else { Duration::ZERO };
        store + PEER_LOOKUP_TIMEOUT + 2 * upstream.config.response_timeout + PEER_RESPONSE_MARGIN
    }

    /// The response-header wait for a peer: [`PEER_LOOKUP_TIMEOUT`] for a
    /// lookup, else [`Cache::owner_budget`].
    fn peer_timeout(&self, upstream: &Upstream, lookup: bool) -> Duration {
        if lookup { PEER_LOOKUP_TIMEOUT } else { self.owner_budget(upstream) }
    }

    /// Reads a blob from the shared tier from `offset`, once the
    /// repository is known to have it upstream: the shared tier holds
    /// every repository's content, so having the bytes proves nothing.
    ///
    /// Nor does the object's size: the blob's is learnt from a source that
    /// is trusted before a byte is streamed (`expected`, a manifest's; the
    /// `HEAD` the membership check made, upstream's or the owner's; else
    /// one `HEAD` upstream). An object longer than that is read only up to
    /// it; a shorter one ends where it ends, and the fill resumes from the
    /// byte reached with the next source. Either is counted, and the
    /// verified blob uploaded over it ([`SourceBody::mend`]). Only when no
    /// such source answers (upstream down) is the object's own size used.
    pub(super) async fn open_shared(
        &self,
        (upstream, repo, digest): (&Upstream, &RepoName, &Digest),
        offset: u64,
        via: Via,
        expected: Option<u64>,
    ) -> Result<SourceBody, Unavailable> {
        let Some((store, _)) = &self.shared else {
            return Err(Unavailable::Next(Error::BlobUnknown(*digest)));
        };
        let found = |got: Result<Option<super::shared::SharedBlob>, super::shared::SharedError>| match got {
            Ok(Some(blob)) => Ok(blob),
            Ok(None) => Err(Unavailable::Next(Error::BlobUnknown(*digest))),
            Err(e) => Err(Unavailable::Next(Error::Storage(format!("shared tier: {e}")))),
        };
        let member = |checked: Result<Option<u64>, Error>| match checked {
            Ok(size) => Ok(size),
            Err(e) if e.is_repository_specific() => Err(Unavailable::Final(e)),
            Err(e) => Err(Unavailable::Next(e)),
        };
        // The store's answer and the membership check run at once; no byte
        // is read before both are in. A miss usually comes first (in
        // milliseconds), and then the check is dropped unsent or half way.
        let get = store.get_blob(digest, offset..);
        let check = self.confirm_member(upstream, repo, digest, Content::Blob, via);
        tokio::pin!(get, check);
        let (blob, learnt) = tokio::select! {
            got = &mut get => {
                let blob = found(got)?;
                (blob, member(check.await)?)
            }
            checked = &mut check => {
                let learnt = member(checked)?;
                (found(get.await)?, learnt)
            }
        };
        if blob.range.start != offset {
            let e = format!("shared tier answered from byte {} for {offset}", blob.range.start);
            return Err(Unavailable::Next(Error::Storage(e)));
        }
        let trusted = match expected.or(learnt) {
            Some(size) => Some(size),
            None => self.blob_size_upstream(upstream, repo, digest).await,
        };
        let mend = trusted.is_some_and(|size| size != blob.size);
        if let (true, Some(size)) = (mend, trusted) {
            metrics().shared_corrupt.inc();
            tracing::error!(%digest, object = blob.size, blob = size, "the shared tier's object has the wrong size; reading it up to the blob's size at most, and uploading the verified blob over it");
        }
        let total = trusted.unwrap_or(blob.size);
        let blob = if blob.size > total { blob.take(total.saturating_sub(offset)) } else { blob };
        Ok(SourceBody {
            total: Some(total),
            skip: 0,
            body: blob.into_body(),
            permit: None,
            received: None,
            idle: super::shared::READ_TIMEOUT,
            mend,
        })
    }

    /// The blob's size by one `HEAD` upstream (for the shared tier, when
    /// nothing else said it): `None` when upstream does not say, or fails.
    async fn blob_size_upstream(&self, upstream: &Upstream, repo: &RepoName, digest: &Digest) -> Option<u64> {
        match upstream.head_blob(repo, digest).await {
            Ok(answer) => answer.flatten(),
            Err(e) => {
                tracing::warn!(%digest, error = %e, "cannot learn the blob's size upstream; trusting the shared tier's object");
                None
            }
        }
    }

    /// Asks `peer` (the digest's owner, or after it broke off the next
    /// replica in the digest's ranking) for the blob from `offset`. The
    /// peer joins or starts its one fill and streams while it fills.
    /// `shared_missed`: this fill looked in the shared tier already.
    ///
    /// A peer that cannot be reached is marked down and the next peer
    /// tried; one that connects but does not answer in time is skipped for
    /// this request only. A peer that answers an error relays upstream's
    /// (or its disk's) trouble: another peer would ask upstream the same,
    /// so the fill goes to upstream itself ([`Unavailable::Relayed`]).
    pub(super) async fn open_peer(
        &self,
        peer: PeerUrl,
        upstream: &Upstream,
        repo: &RepoName,
        digest: &Digest,
        offset: u64,
        shared_missed: bool,
    ) -> Result<SourceBody, Unavailable> {
        let Some(link) = &self.peers else { return Err(Unavailable::Next(Error::BlobUnknown(*digest))) };
        let path = format!("/v2/{repo}/blobs/{digest}?{}", ns_query(upstream.name()));
        let ask = Ask {
            method: Method::GET,
            path_and_query: &path,
            accept: None,
            from: Some(offset),
            lookup: false,
            shared_missed,
            timeout: self.owner_budget(upstream),
        };
        let sent = link.client.send(&peer, ask).await;
        let resp = match sent {
            Ok(resp) => resp,
            Err(PeerError::Unreachable(e)) => {
                tracing::warn!(%peer, %digest, error = e, "peer unreachable; marked down, trying the next source");
                link.peers.mark_down(&peer);
                return Err(Unavailable::Next(UpstreamError::Connect(format!("peer {peer}: {e}")).into()));
            }
            Err(PeerError::NoAnswer(e)) => {
                tracing::warn!(%peer, %digest, error = e, "peer did not answer; trying the next source");
                return Err(Unavailable::Next(UpstreamError::Connect(format!("peer {peer}: {e}")).into()));
            }
            Err(PeerError::UnknownUpstream) => {
                tracing::info!(%peer, upstream = upstream.name(), "peer does not know the upstream; trying the next source");
                return Err(Unavailable::Next(Error::UnknownUpstream(upstream.name().to_owned())));
            }
            Err(PeerError::Status { status, code, retry_after }) => {
                return Err(match verdict(status, &code, retry_after) {
                    Verdict::NotFound => Unavailable::Final(Error::BlobUnknown(*digest)),
                    Verdict::Final(e) => Unavailable::Final(e),
                    Verdict::Fallback => {
                        tracing::warn!(%peer, %digest, %status, code, "peer failed; fetching from upstream");
                        Unavailable::Relayed(
                            UpstreamError::Status { status: status.as_u16(), retry_after: None }.into(),
                        )
                    }
                });
            }
        };
        let (total, skip) = if resp.status() == StatusCode::PARTIAL_CONTENT {
            match content_range(resp.headers()) {
                Some((first, total)) if first == offset => (total, 0),
                _ => {
                    let e = UpstreamError::Protocol(format!("peer {peer} answered another range than from {offset}"));
                    return Err(Unavailable::Next(e.into()));
                }
            }
        } else {
            (content_length(resp.headers()), offset)
        };
        let body = resp.into_body().map_err(|e| Box::new(e) as crate::body::BoxError).boxed_unsync();
        Ok(SourceBody {
            body,
            total,
            skip,
            permit: None,
            received: Some(metrics().peer_bytes.clone()),
            idle: upstream.body_idle_timeout(),
            mend: false,
        })
    }

    /// Asks the owner of a manifest (by digest) or of a tag for it: `None`
    /// when there is no other owner or it cannot answer (the caller goes on
    /// alone); otherwise its answer, and for a tag when upstream last
    /// confirmed it.
    pub(super) async fn manifest_from_owner(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        reference: &Reference,
        via: Via,
    ) -> Option<Result<(FetchedManifest, SystemTime), Error>> {
        let key = match reference {
            Reference::Digest(d) => digest_owner_key(d),
            Reference::Tag(t) => tag_owner_key(upstream.name(), repo, t),
        };
        let (owner, lookup) = self.peer_to_ask(upstream, &key, via)?;
        let link = self.peers.as_ref()?;
        let path = format!("/v2/{repo}/manifests/{reference}?{}", ns_query(upstream.name()));
        let ask = Ask {
            method: Method::GET,
            path_and_query: &path,
            accept: Some(MediaType::upstream_accept()),
            from: None,
            lookup,
            shared_missed: false,
            timeout: self.peer_timeout(upstream, lookup),
        };
        match link.client.send(&owner, ask).await {
            Ok(resp) => match read_manifest(resp, reference, upstream.body_idle_timeout()).await {
                Ok((_, confirmed))
                    if matches!(reference, Reference::Tag(_))
                        && self.purged_after(upstream.name(), repo, confirmed) =>
                {
                    tracing::info!(peer = %owner, %repo, %reference, "peer's tag mapping is older than a purge here; asking upstream");
                    None
                }
                Ok(answer) => Some(Ok(answer)),
                Err(e) => {
                    tracing::warn!(peer = %owner, %repo, %reference, error = %e, "owner's manifest refused");
                    None
                }
            },
            Err(PeerError::Unreachable(e)) => {
                tracing::warn!(peer = %owner, %repo, %reference, error = e, "owner unreachable; marked down");
                link.peers.mark_down(&owner);
                None
            }
            Err(e @ (PeerError::NoAnswer(_) | PeerError::UnknownUpstream)) => {
                tracing::warn!(peer = %owner, %repo, %reference, lookup, error = %e, "going on without the peer");
                None
            }
            // A lookup's miss says only that the peer does not hold it.
            Err(PeerError::Status { .. }) if lookup => None,
            Err(PeerError::Status { status, code, retry_after }) => match verdict(status, &code, retry_after) {
                Verdict::NotFound => Some(Err(Error::ManifestUnknown)),
                Verdict::Final(e) => Some(Err(e)),
                Verdict::Fallback => None,
            },
        }
    }

    /// Asks the digest's owner whether `repo` has it: `None` when there is
    /// no other owner or it cannot answer; else, as [`Upstream::head_blob`]
    /// answers, `Some` with the size if the owner sent it.
    pub(super) async fn member_from_owner(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        digest: &Digest,
        content: Content,
        via: Via,
    ) -> Option<Result<Option<Option<u64>>, Error>> {
        let (owner, lookup) = self.peer_to_ask(upstream, &digest_owner_key(digest), via)?;
        let link = self.peers.as_ref()?;
        let what = match content {
            Content::Blob => "blobs",
            Content::Manifest => "manifests",
        };
        let path = format!("/v2/{repo}/{what}/{digest}?{}", ns_query(upstream.name()));
        let ask = Ask {
            method: Method::HEAD,
            path_and_query: &path,
            accept: matches!(content, Content::Manifest).then(MediaType::upstream_accept),
            from: None,
            lookup,
            shared_missed: false,
            timeout: self.peer_timeout(upstream, lookup),
        };
        match link.client.send(&owner, ask).await {
            Ok(resp) => Some(Ok(Some(content_length(resp.headers())))),
            Err(PeerError::Unreachable(e)) => {
                tracing::warn!(peer = %owner, %digest, error = e, "owner unreachable; marked down");
                link.peers.mark_down(&owner);
                None
            }
            // An owner that does not know this upstream yet says nothing
            // about the repository: ask upstream.
            Err(e @ (PeerError::NoAnswer(_) | PeerError::UnknownUpstream)) => {
                tracing::warn!(peer = %owner, %digest, lookup, error = %e, "going on without the peer");
                None
            }
            Err(PeerError::Status { .. }) if lookup => None,
            Err(PeerError::Status { status, code, retry_after }) => match verdict(status, &code, retry_after) {
                Verdict::NotFound => Some(Ok(None)),
                Verdict::Final(e) => Some(Err(e)),
                Verdict::Fallback => None,
            },
        }
    }

    /// For a peer's lookup: the manifest `digest` if this replica holds it
    /// for `repo` (stored, and a member); never fetched.
    pub async fn local_manifest(
        &self,
        upstream: &str,
        repo: &RepoName,
        digest: &Digest,
    ) -> Result<Option<Arc<super::StoredManifest>>, Error> {
        match self.stored_manifest(digest).await? {
            Some(m) if self.local_member(upstream, repo, digest).await? => {
                Ok(Some(self.warned(m, upstream, repo).await?))
            }
            _ => Ok(None),
        }
    }

    /// For a peer's lookup: where `tag` points, while this replica's
    /// mapping is within its TTL, and when upstream confirmed it.
    pub async fn local_tag(
        &self,
        upstream: &Upstream,
        repo: &RepoName,
        tag: &crate::oci::Tag,
    ) -> Result<Option<(Arc<super::StoredManifest>, SystemTime)>, Error> {
        let Some(entry) = self.tag_entry(&super::tag_key(upstream.name(), repo, tag)).await? else { return Ok(None) };
        let age = SystemTime::now().duration_since(entry.confirmed).unwrap_or_default();
        if age >= upstream.config.tag_ttl(&self.config) && !upstream.config.tag_is_immutable(tag.as_str()) {
            return Ok(None);
        }
        let Some(m) = self.stored_manifest(&entry.digest).await? else { return Ok(None) };
        Ok(Some((self.warned(m, upstream.name(), repo).await?, entry.confirmed)))
    }

    /// Whether this replica knows `repo` has `digest` (a membership row,
    /// kept in memory once read).
    pub async fn local_member(&self, upstream: &str, repo: &RepoName, digest: &Digest) -> Result<bool, Error> {
        let key = super::member_key(upstream, repo, digest);
        if self.memory.is_member(&key) {
            return Ok(true);
        }
        let (index, k) = (Arc::clone(&self.index), key.clone());
        let member = crate::blocking::blocking(move || Ok(index.is_member(&k)?)).await?;
        if member {
            self.memory.insert_member(key);
        }
        Ok(member)
    }

    /// A manifest from the shared tier (its digest checked by the store),
    /// or `None` if it is not there or the store fails.
    pub(super) async fn shared_manifest(&self, digest: &Digest) -> Option<FetchedManifest> {
        let (store, _) = self.shared.as_ref()?;
        match store.get_manifest(digest).await {
            Ok(Some(m)) => match inspect_manifest(&m.bytes, Some(m.media_type)) {
                // The shared tier keeps bytes and media type only: warnings come
                // with upstream's or an owner's answer.
                Ok((media_type, refs)) => {
                    Some(FetchedManifest { bytes: m.bytes, media_type, digest: *digest, refs, warnings: None })
                }
                Err(e) => {
                    tracing::warn!(%digest, error = e, "shared tier manifest is not a manifest");
                    None
                }
            },
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(%digest, error = %e, "shared tier lookup failed");
                None
            }
        }
    }

    /// Queues a verified manifest for the shared tier.
    pub(super) async fn share_manifest(&self, m: &FetchedManifest) {
        if let Some((_, uploads)) = &self.shared {
            if let Err(e) = uploads.enqueue_manifest(m.digest, m.media_type, m.bytes.clone()).await {
                tracing::warn!(digest = %m.digest, error = %e, "cannot queue the manifest for the shared tier");
            }
        }
    }

    /// Queues a committed blob for the shared tier.
    pub(super) async fn share_blob(&self, digest: Digest) {
        if let Some((_, uploads)) = &self.shared {
            if let Err(e) = uploads.enqueue_blob(digest).await {
                tracing::warn!(%digest, error = %e, "cannot queue the blob for the shared tier");
            }
        }
    }

    /// The shared tier's copy of `digest` is wrong (`why`: its size or its
    /// digest): count it and delete it (in the background), so that no
    /// replica reads it again and a good copy is uploaded.
    pub(super) fn condemn_shared_blob(&self, digest: Digest, why: &str) {
        let Some((store, _)) = &self.shared else { return };
        metrics().shared_corrupt.inc();
        tracing::error!(%digest, why, "the shared tier's copy is corrupt; deleting it");
        let store = Arc::clone(store);
        tokio::spawn(async move {
            if let Err(e) = store.delete(super::shared::ObjectKind::Blob, &digest).await {
                tracing::warn!(%digest, error = %e, "cannot delete the corrupt shared object");
            }
        });
    }
}

/// When upstream last confirmed a tag, from an owner's
/// [`TAG_CONFIRMED_HEADER`] (unix milliseconds): never later than `now`,
/// so an owner whose clock runs ahead cannot keep a tag fresh past its
/// TTL; `now` when the header is missing or unreadable.
fn confirmed_at(header: Option<&str>, now: SystemTime) -> SystemTime {
    let Some(ms) = header.and_then(|ms| ms.parse::<u64>().ok()) else { return now };
    let Some(at) = UNIX_EPOCH.checked_add(Duration::from_millis(ms)) else { return now };
    at.min(now)
}

/// A manifest as a peer sent it, checked like upstream's: its bytes hash to
/// the digest asked for (or, for a tag, the one the peer named), and its
/// JSON agrees with its `Content-Type`.
async fn read_manifest(
    resp: Response<Incoming>,
    reference: &Reference,
    idle: Duration,
) -> Result<(FetchedManifest, SystemTime), Error> {
    let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let declared = header(CONTENT_TYPE.as_str()).as_deref().and_then(MediaType::parse);
    let named: Option<Digest> = header("docker-content-digest").and_then(|d| d.parse().ok());
    let confirmed = confirmed_at(header(TAG_CONFIRMED_HEADER).as_deref(), SystemTime::now());
    // The owner relays upstream's warnings as a client gets them.
    let warnings = Some(Warnings::from_headers(resp.headers()));
    let body = tokio::time::timeout(idle, Limited::new(resp.into_body(), MAX_MANIFEST_SIZE).collect())
        .await
        .map_err(|_| UpstreamError::Timeout("peer manifest body"))?
        .map_err(|e| UpstreamError::Protocol(format!("peer manifest body: {e}")))?;
    let bytes: Bytes = body.to_bytes();
    let digest = Digest::of(&bytes);
    let expected = match reference {
        Reference::Digest(d) => Some(*d),
        Reference::Tag(_) => named,
    };
    if expected != Some(digest) {
        metrics().digest_mismatch.inc();
        let expected = expected.map_or_else(|| "a Docker-Content-Digest".to_owned(), |d| d.to_string());
        return Err(UpstreamError::Protocol(format!("peer manifest hashes to {digest}, not {expected}")).into());
    }
    let (media_type, refs) = inspect_manifest(&bytes, declared).map_err(UpstreamError::Protocol)?;
    Ok((FetchedManifest { bytes, media_type, digest, refs, warnings }, confirmed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owners_tag_confirmation_is_never_later_than_now() {
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let ms = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_millis().to_string();
        let earlier = now - Duration::from_secs(30);
        assert_eq!(confirmed_at(Some(&ms(earlier)), now), earlier, "as the owner said");
        let ahead = now + Duration::from_secs(3600);
        assert_eq!(confirmed_at(Some(&ms(ahead)), now), now, "a clock an hour ahead does not keep the tag fresh");
        assert_eq!(confirmed_at(None, now), now);
        assert_eq!(confirmed_at(Some("soon"), now), now);
        assert_eq!(confirmed_at(Some(&u64::MAX.to_string()), now), now);
    }
}
