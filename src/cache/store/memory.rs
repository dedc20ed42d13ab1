//! The memory tier: manifests by digest (exact bytes plus the header
//! values every response needs, built once) and tag mappings, in moka
//! caches bounded by the `cache.memory` budget; and open handles of the
//! blobs served lately, so a warm blob costs no `open(2)` (a trip to the
//! blocking pool) per request.

use std::fs::File;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::HeaderValue;

use crate::oci::{Digest, MediaType, Warnings};
use crate::upstream::Page;

/// A manifest ready to serve.
#[derive(Debug)]
pub struct StoredManifest {
    pub bytes: Bytes,
    pub media_type: MediaType,
    pub digest: Digest,
    pub content_type: HeaderValue,
    pub digest_header: HeaderValue,
    pub etag: HeaderValue,
    pub content_length: HeaderValue,
    /// Upstream's registry warnings about it for the repository it is
    /// served for, sent with the response. Empty as the memory tier keeps
    /// a manifest: they are kept per repository ([`Memory::warnings`]) and
    /// attached for each request.
    pub warnings: Warnings,
}

impl StoredManifest {
    pub fn new(bytes: Bytes, media_type: MediaType, digest: Digest) -> StoredManifest {
        StoredManifest {
            content_type: HeaderValue::from_static(media_type.as_str()),
            digest_header: digest.header_value(),
            etag: digest.etag(),
            content_length: HeaderValue::from(bytes.len()),
            bytes,
            media_type,
            digest,
            warnings: Warnings::default(),
        }
    }

    /// The same manifest with these warnings.
    pub fn with_warnings(mut self, warnings: Warnings) -> StoredManifest {
        self.warnings = warnings;
        self
    }

    /// A copy with other warnings (the bytes are shared, not copied).
    pub fn rewarned(&self, warnings: Warnings) -> StoredManifest {
        StoredManifest::new(self.bytes.clone(), self.media_type, self.digest).with_warnings(warnings)
    }
}

/// Where upstream last confirmed a tag to point.
#[derive(Clone, Copy, Debug)]
pub struct TagEntry {
    pub digest: Digest,
    pub confirmed: SystemTime,
}

/// The hasher of the memory tier's keys: foldhash, seeded at random per
/// process (so keys a client picks cannot be aimed at one bucket), in
/// place of std's SipHash-1-3. A warm manifest GET hashes three keys here
/// (the digest, and its membership key twice, some 80 bytes each); SipHash
/// was 0.5 % of larder's samples in session 21's profile (issue 35,
/// benches/README.md "Warm manifests at nginx's cost").
type Keys = foldhash::fast::RandomState;
type Cache<K, V> = moka::sync::Cache<K, V, Keys>;

/// Rough per-entry overhead counted against the memory budget.
const ENTRY_OVERHEAD: u32 = 256;
/// Tenths of the memory budget for manifests; the rest holds tags and blob sizes.
const MANIFEST_TENTHS: u64 = 8;

pub struct Memory {
    manifests: Cache<Digest, Arc<StoredManifest>>,
    tags: Cache<String, TagEntry>,
    /// Sizes of committed blobs, so a hit needs no index read.
    blob_sizes: Cache<Digest, u64>,
    /// Repository membership rows known to exist (see the index's MEMBERS).
    members: Cache<String, ()>,
    /// `tags/list` and `referrers` pages by (upstream, repo, listing, query),
    /// with when they were fetched; `None` when upstream answered 404.
    listings: Cache<String, (Option<Page>, Instant)>,
    open_blobs: Cache<Digest, (Arc<File>, u64)>,
    /// Blob sizes the manifests of a repository declared, by
    /// "upstream\0repo\0digest hex": the bound on a fill for that repository.
    declared_sizes: Cache<String, u64>,
    /// Blobs a fill ahead committed before any client asked: the first
    /// client request for one is still its miss (the pull caused the
    /// download), not a hit.
    fetched_ahead: Cache<Digest, ()>,
    /// A manifest's registry warnings for one repository, by its membership
    /// key ("upstream\0repo\0digest hex"), none included (empty), as the
    /// index keeps them.
    warnings: Cache<String, Warnings>,
}

/// Memory for cached listing pages, apart from the budget above: pages are
/// few and short-lived.
const LISTINGS_BYTES: u64 = 16 << 20;
/// Blob files kept open between requests: a small share of the process's
/// file descriptors (larder raises its soft limit at start).
const OPEN_BLOB_HANDLES: u64 = 256;
/// Declared blob sizes remembered in memory; the index has them all.
const DECLARED_SIZES: u64 = 100_000;
/// Blobs fetched ahead and not yet asked for, remembered (a client that
/// never asks leaves them to age out).
const FETCHED_AHEAD: u64 = 10_000;
const FETCHED_AHEAD_TTL: Duration = Duration::from_secs(3600);
/// Memory for manifests' warnings per repository (mostly "none"), apart
/// from the budget above: a forgotten entry is read from the index again.
const WARNINGS_BYTES: u64 = 16 << 20;
/// An open handle unused this long is closed; eviction and purge close
/// theirs at once, so a deleted blob's disk space is not held.
const OPEN_BLOB_IDLE: Duration = Duration::from_secs(60);

impl Memory {
    pub fn new(budget: u64) -> Memory {
        let manifest_budget = budget / 10 * MANIFEST_TENTHS;
        let small_budget = (budget - manifest_budget) / 2;
        Memory {
            manifests: moka::sync::Cache::builder()
                .weigher(|_, m: &Arc<StoredManifest>| {
                    u32::try_from(m.bytes.len() + m.warnings.byte_len())
                        .unwrap_or(u32::MAX)
                        .saturating_add(ENTRY_OVERHEAD)
                })
                .max_capacity(manifest_budget)
                .build_with_hasher(Keys::default()),
            tags: moka::sync::Cache::builder()
                .weigher(|k: &String, _| u32::try_from(k.len()).unwrap_or(u32::MAX).saturating_add(ENTRY_OVERHEAD))
                .max_capacity(small_budget)
                .build_with_hasher(Keys::default()),
            blob_sizes: moka::sync::Cache::builder()
                .max_capacity(small_budget / 2 / u64::from(ENTRY_OVERHEAD))
                .build_with_hasher(Keys::default()),
            members: moka::sync::Cache::builder()
                .weigher(|k: &String, _| u32::try_from(k.len()).unwrap_or(u32::MAX).saturating_add(ENTRY_OVERHEAD))
                .max_capacity(small_budget / 2)
                .build_with_hasher(Keys::default()),
            listings: moka::sync::Cache::builder()
                .weigher(|k: &String, (page, _): &(Option<Page>, Instant)| {
                    let body = page.as_ref().map_or(0, |p| p.body.len());
                    u32::try_from(k.len() + body).unwrap_or(u32::MAX).saturating_add(ENTRY_OVERHEAD)
                })
                .max_capacity(LISTINGS_BYTES)
                .build_with_hasher(Keys::default()),
            open_blobs: moka::sync::Cache::builder()
                .max_capacity(OPEN_BLOB_HANDLES)
                .time_to_idle(OPEN_BLOB_IDLE)
                .build_with_hasher(Keys::default()),
            declared_sizes: moka::sync::Cache::builder()
                .max_capacity(DECLARED_SIZES)
                .build_with_hasher(Keys::default()),
            fetched_ahead: moka::sync::Cache::builder()
                .max_capacity(FETCHED_AHEAD)
                .time_to_live(FETCHED_AHEAD_TTL)
                .build_with_hasher(Keys::default()),
            warnings: moka::sync::Cache::builder()
                .weigher(|k: &String, w: &Warnings| {
                    u32::try_from(k.len() + w.byte_len()).unwrap_or(u32::MAX).saturating_add(ENTRY_OVERHEAD)
                })
                .max_capacity(WARNINGS_BYTES)
                .build_with_hasher(Keys::default()),
        }
    }

    /// A fill ahead of any client committed `digest`.
    pub fn insert_fetched_ahead(&self, digest: Digest) {
        self.fetched_ahead.insert(digest, ());
    }

    /// Whether `digest` was fetched ahead and this is the first ask since.
    pub fn claim_fetched_ahead(&self, digest: &Digest) -> bool {
        self.fetched_ahead.remove(digest).is_some()
    }

    pub fn manifest(&self, digest: &Digest) -> Option<Arc<StoredManifest>> {
        self.manifests.get(digest)
    }

    pub fn insert_manifest(&self, m: Arc<StoredManifest>) {
        self.manifests.insert(m.digest, m);
    }

    /// Drops every cached tag mapping, membership row, declared size and
    /// listing page; they are read again from the index (or upstream) on
    /// demand.
    pub fn forget_tags_and_members(&self) {
        self.tags.invalidate_all();
        self.members.invalidate_all();
        self.declared_sizes.invalidate_all();
        self.listings.invalidate_all();
        self.warnings.invalidate_all();
    }

    pub fn remove_manifest(&self, digest: &Digest) {
        self.manifests.invalidate(digest);
    }

    /// A manifest's warnings for the repository of `member`, if known here.
    pub fn warnings(&self, member: &str) -> Option<Warnings> {
        self.warnings.get(member)
    }

    pub fn insert_warnings(&self, member: String, warnings: Warnings) {
        self.warnings.insert(member, warnings);
    }

    pub fn tag(&self, key: &str) -> Option<TagEntry> {
        self.tags.get(key)
    }

    pub fn insert_tag(&self, key: String, entry: TagEntry) {
        self.tags.insert(key, entry);
    }

    pub fn remove_tag(&self, key: &str) {
        self.tags.invalidate(key);
    }

    pub fn blob_size(&self, digest: &Digest) -> Option<u64> {
        self.blob_sizes.get(digest)
    }

    pub fn insert_blob_size(&self, digest: Digest, size: u64) {
        self.blob_sizes.insert(digest, size);
    }

    pub fn is_member(&self, key: &str) -> bool {
        self.members.contains_key(key)
    }

    pub fn insert_member(&self, key: String) {
        self.members.insert(key, ());
    }

    pub fn listing(&self, key: &str) -> Option<(Option<Page>, Instant)> {
        self.listings.get(key)
    }

    pub fn insert_listing(&self, key: String, page: Option<Page>) {
        self.listings.insert(key, (page, Instant::now()));
    }

    /// Forgets a committed blob: its size and its open handle. The handle
    /// is closed before this returns: moka keeps a removed value until its
    /// pending maintenance runs, and an evicted file's space is only freed
    /// once no descriptor holds it (the disk-full test needs it back).
    pub fn remove_blob_size(&self, digest: &Digest) {
        self.blob_sizes.invalidate(digest);
        if self.open_blobs.remove(digest).is_some() {
            self.open_blobs.run_pending_tasks();
        }
    }

    /// A committed blob's open file and size, if it was served lately.
    pub fn open_blob(&self, digest: &Digest) -> Option<(Arc<File>, u64)> {
        self.open_blobs.get(digest)
    }

    pub fn declared_size(&self, key: &str) -> Option<u64> {
        self.declared_sizes.get(key)
    }

    pub fn insert_declared_size(&self, key: String, size: u64) {
        self.declared_sizes.insert(key, size);
    }

    pub fn insert_open_blob(&self, digest: Digest, file: Arc<File>, size: u64) {
        self.open_blobs.insert(digest, (file, size));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forgetting_a_blob_closes_its_open_handle() {
        let memory = Memory::new(1 << 20);
        let (kept, dropped) = (Digest::of(b"kept"), Digest::of(b"dropped"));
        let file = Arc::new(tempfile::tempfile().unwrap());
        for d in [kept, dropped] {
            memory.insert_blob_size(d, 4);
            memory.insert_open_blob(d, Arc::clone(&file), 4);
        }
        memory.remove_blob_size(&dropped);
        assert_eq!(Arc::strong_count(&file), 2, "the dropped blob's handle is closed at once, the kept one stays");
        assert!(memory.open_blob(&dropped).is_none(), "an evicted or purged blob must not be served from a handle");
        assert!(memory.blob_size(&dropped).is_none());
        assert_eq!(memory.open_blob(&kept).map(|(_, size)| size), Some(4));
    }
}
