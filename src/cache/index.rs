//! The redb index of what the store holds. Synchronous, like redb itself:
//! call it only from the blocking pool (`crate::blocking::blocking`).
//!
//! Besides the rows themselves it keeps two secondary tables, updated in
//! the same transactions as the rows they mirror, so that the operations
//! that used to read every row cost only what they touch:
//! - `access`: (last access, kind, digest), so eviction reads the least
//!   recently used entries in order instead of sorting the whole cache;
//! - `members_by_digest`: membership rows keyed by digest first, so a purge
//!   can tell whether anything still references a digest without scanning
//!   every repository's rows;
//! - `meta["bytes"]`: the sizes of every blob and manifest row added up, so
//!   start-up knows the cache's usage without reading every row.

use std::path::Path;

use redb::{
    Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, Table, TableDefinition, WriteTransaction,
};

use crate::oci::{Digest, MediaType};

/// Committed blobs: digest hex → (size in bytes, last access in unix millis).
const BLOBS: TableDefinition<&str, (u64, u64)> = TableDefinition::new("blobs");
/// Manifests by digest hex → (media type, exact bytes).
const MANIFESTS: TableDefinition<&str, (&str, &[u8])> = TableDefinition::new("manifests");
/// Manifests by digest hex → (size in bytes, last access in unix millis),
/// apart from the bytes so that access times are cheap to update.
const MANIFEST_META: TableDefinition<&str, (u64, u64)> = TableDefinition::new("manifest_meta");
/// Every blob and manifest row again, ordered by last access:
/// (unix millis, kind, digest hex) → ().
const ACCESS: TableDefinition<(u64, u8, &str), ()> = TableDefinition::new("access");
/// Tags: "upstream\0repo\0tag" → (digest, unix millis when upstream last confirmed it).
const TAGS: TableDefinition<&str, (&str, u64)> = TableDefinition::new("tags");
/// Repository membership: "upstream\0repo\0digest hex" → unix millis when
/// recorded. Content is shared across repositories on disk, but served for a
/// repository only if it has a row here (see DESIGN.md).
const MEMBERS: TableDefinition<&str, u64> = TableDefinition::new("members");
/// The same rows keyed "digest hex\0upstream\0repo" → ().
const MEMBERS_BY_DIGEST: TableDefinition<&str, ()> = TableDefinition::new("members_by_digest");
/// Index-wide facts: "schema" → version of the tables above; "bytes" →
/// the running total of content sizes.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const SCHEMA_KEY: &str = "schema";
const BYTES_KEY: &str = "bytes";

/// Version 2 added `access` and `members_by_digest`, version 3 the running
/// byte total; an index written by an older larder gets them built once,
/// when it is opened.
const SCHEMA_VERSION: u64 = 3;

/// The two kinds of content the store keeps and evicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Blob,
    Manifest,
}

impl Kind {
    fn meta(self) -> TableDefinition<'static, &'static str, (u64, u64)> {
        match self {
            Kind::Blob => BLOBS,
            Kind::Manifest => MANIFEST_META,
        }
    }

    fn code(self) -> u8 {
        match self {
            Kind::Blob => 0,
            Kind::Manifest => 1,
        }
    }

    fn from_code(code: u8) -> Option<Kind> {
        match code {
            0 => Some(Kind::Blob),
            1 => Some(Kind::Manifest),
            _ => None,
        }
    }
}

/// One stored item as the evictor sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub kind: Kind,
    pub digest: Digest,
    pub size: u64,
    pub accessed_ms: u64,
}

pub struct Index {
    db: Database,
}

pub struct TagRow {
    pub digest: Digest,
    pub confirmed_ms: u64,
}

/// What a purge removed from the index; the caller unlinks the files of
/// the removed blobs.
#[derive(Debug, Default)]
pub struct PurgedRows {
    pub tags: usize,
    pub members: usize,
    /// Content no remaining membership row referenced.
    pub content: Vec<Entry>,
}

fn parse_hex(hex: &str) -> Option<Digest> {
    format!("sha256:{hex}").parse().ok()
}

/// "upstream\0repo\0hex" → "hex\0upstream\0repo".
fn by_digest_key(member: &str) -> Option<String> {
    let (owner, hex) = member.rsplit_once('\0')?;
    Some(format!("{hex}\0{owner}"))
}

/// Moves the running byte total by `added - removed`.
fn count_bytes(txn: &WriteTransaction, added: u64, removed: u64) -> Result<(), redb::Error> {
    if added == removed {
        return Ok(());
    }
    let mut meta = txn.open_table(META)?;
    let total = meta.get(BYTES_KEY)?.map_or(0, |v| v.value());
    meta.insert(BYTES_KEY, (total + added).saturating_sub(removed))?;
    Ok(())
}

/// The content tables of one write transaction, opened once however many
/// rows it changes (an eviction round removes thousands); the byte total
/// they move is written once, by [`Content::close`].
struct Content<'txn> {
    txn: &'txn WriteTransaction,
    blobs: Table<'txn, &'static str, (u64, u64)>,
    manifest_meta: Table<'txn, &'static str, (u64, u64)>,
    manifests: Table<'txn, &'static str, (&'static str, &'static [u8])>,
    access: Table<'txn, (u64, u8, &'static str), ()>,
    added: u64,
    removed: u64,
}

impl<'txn> Content<'txn> {
    fn open(txn: &'txn WriteTransaction) -> Result<Content<'txn>, redb::Error> {
        Ok(Content {
            txn,
            blobs: txn.open_table(BLOBS)?,
            manifest_meta: txn.open_table(MANIFEST_META)?,
            manifests: txn.open_table(MANIFESTS)?,
            access: txn.open_table(ACCESS)?,
            added: 0,
            removed: 0,
        })
    }

    fn rows(&mut self, kind: Kind) -> &mut Table<'txn, &'static str, (u64, u64)> {
        match kind {
            Kind::Blob => &mut self.blobs,
            Kind::Manifest => &mut self.manifest_meta,
        }
    }

    /// (size, last access) of a row, if it is there.
    fn get(&mut self, kind: Kind, hex: &str) -> Result<Option<(u64, u64)>, redb::Error> {
        Ok(self.rows(kind).get(hex)?.map(|v| v.value()))
    }

    /// Inserts (or refreshes) a content row and its access-order twin.
    /// Returns whether the row is new.
    fn put(&mut self, kind: Kind, hex: &str, size: u64, now_ms: u64) -> Result<bool, redb::Error> {
        let previous = self.rows(kind).insert(hex, (size, now_ms))?.map(|v| v.value());
        if let Some((_, before)) = previous {
            self.access.remove((before, kind.code(), hex))?;
        }
        self.access.insert((now_ms, kind.code(), hex), ())?;
        self.added += size;
        self.removed += previous.map_or(0, |(size, _)| size);
        Ok(previous.is_none())
    }

    /// Removes a content row (and a manifest's bytes) with its
    /// access-order twin; the entry as it was, if there was one.
    fn take(&mut self, kind: Kind, digest: &Digest) -> Result<Option<Entry>, redb::Error> {
        let hex = digest.hex();
        let removed = self.rows(kind).remove(hex.as_str())?.map(|v| v.value());
        let Some((size, accessed_ms)) = removed else { return Ok(None) };
        self.access.remove((accessed_ms, kind.code(), hex.as_str()))?;
        if kind == Kind::Manifest {
            self.manifests.remove(hex.as_str())?;
        }
        self.removed += size;
        Ok(Some(Entry { kind, digest: *digest, size, accessed_ms }))
    }

    /// Closes the tables and moves the running byte total, before the
    /// transaction commits.
    fn close(self) -> Result<(), redb::Error> {
        let Content { txn, blobs, manifest_meta, manifests, access, added, removed } = self;
        drop((blobs, manifest_meta, manifests, access));
        count_bytes(txn, added, removed)
    }
}

fn put_members(txn: &WriteTransaction, members: &[String], now_ms: u64) -> Result<(), redb::Error> {
    let mut table = txn.open_table(MEMBERS)?;
    let mut by_digest = txn.open_table(MEMBERS_BY_DIGEST)?;
    for key in members {
        table.insert(key.as_str(), now_ms)?;
        if let Some(k) = by_digest_key(key) {
            by_digest.insert(k.as_str(), ())?;
        }
    }
    Ok(())
}

/// Keys of `table` that start with `prefix`, in order.
fn keys_under<V: redb::Value + 'static>(
    table: &impl ReadableTable<&'static str, V>,
    prefix: &str,
) -> Result<Vec<String>, redb::Error> {
    let mut keys = Vec::new();
    for row in table.range(prefix..)? {
        let key = row?.0.value().to_owned();
        if !key.starts_with(prefix) {
            break;
        }
        keys.push(key);
    }
    Ok(keys)
}

fn is_referenced(table: &impl ReadableTable<&'static str, ()>, hex: &str) -> Result<bool, redb::Error> {
    let prefix = format!("{hex}\0");
    match table.range(prefix.as_str()..)?.next() {
        Some(row) => Ok(row?.0.value().starts_with(&prefix)),
        None => Ok(false),
    }
}

/// A write transaction whose commit records redb's allocator state ("quick
/// repair", with two-phase commit), so that the first open after a crash
/// (a kill, OOM, power loss) loads that state instead of walking every page
/// of the index to rebuild it: a start after a crash then costs what a
/// clean start costs, not a pass over the whole file (about 2 s at 10^6
/// blobs; benches/scale.rs measures both starts and the commit cost).
fn begin_write(db: &Database) -> Result<WriteTransaction, redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_quick_repair(true);
    Ok(txn)
}

impl Index {
    pub fn open(path: &Path) -> Result<Index, redb::Error> {
        let db = Database::create(path)?;
        // Create the tables up front so read transactions never miss them.
        let txn = begin_write(&db)?;
        txn.open_table(BLOBS)?;
        txn.open_table(MANIFESTS)?;
        txn.open_table(MANIFEST_META)?;
        txn.open_table(ACCESS)?;
        txn.open_table(TAGS)?;
        txn.open_table(MEMBERS)?;
        txn.open_table(MEMBERS_BY_DIGEST)?;
        let version = txn.open_table(META)?.get(SCHEMA_KEY)?.map_or(1, |v| v.value());
        if version < SCHEMA_VERSION {
            migrate(&txn, version)?;
            txn.open_table(META)?.insert(SCHEMA_KEY, SCHEMA_VERSION)?;
        }
        txn.commit()?;
        Ok(Index { db })
    }

    pub fn blob_size(&self, digest: &Digest) -> Result<Option<u64>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(BLOBS)?;
        Ok(table.get(digest.hex().as_str())?.map(|v| v.value().0))
    }

    /// The sizes of the blob rows of `digests`, in order (`None` where there
    /// is no row), read in one transaction.
    pub fn blob_sizes(&self, digests: &[Digest]) -> Result<Vec<Option<u64>>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(BLOBS)?;
        digests.iter().map(|d| Ok(table.get(d.hex().as_str())?.map(|v| v.value().0))).collect()
    }

    /// Records a committed blob and the repository it was fetched for.
    /// Returns whether the blob is new to the index.
    pub fn insert_blob(&self, digest: &Digest, size: u64, member: &str, now_ms: u64) -> Result<bool, redb::Error> {
        let txn = begin_write(&self.db)?;
        let mut content = Content::open(&txn)?;
        let new = content.put(Kind::Blob, digest.hex().as_str(), size, now_ms)?;
        content.close()?;
        put_members(&txn, &[member.to_owned()], now_ms)?;
        txn.commit()?;
        Ok(new)
    }

    /// Removes the tag and membership rows whose key starts with `prefix`
    /// (`"upstream\0"` or `"upstream\0repo\0"`), and the blobs and manifests
    /// that no remaining membership row names, in one transaction. Costs
    /// what the prefix holds, not what the index holds.
    pub fn purge(&self, prefix: &str) -> Result<PurgedRows, redb::Error> {
        let txn = begin_write(&self.db)?;
        let mut purged = PurgedRows::default();
        {
            let mut tags = txn.open_table(TAGS)?;
            let tag_keys = keys_under(&tags, prefix)?;
            for key in &tag_keys {
                tags.remove(key.as_str())?;
            }
            purged.tags = tag_keys.len();

            let mut members = txn.open_table(MEMBERS)?;
            let mut by_digest = txn.open_table(MEMBERS_BY_DIGEST)?;
            let member_keys = keys_under(&members, prefix)?;
            let mut candidates = std::collections::BTreeSet::new();
            for key in &member_keys {
                members.remove(key.as_str())?;
                if let Some(k) = by_digest_key(key) {
                    by_digest.remove(k.as_str())?;
                }
                if let Some((_, hex)) = key.rsplit_once('\0') {
                    candidates.insert(hex.to_owned());
                }
            }
            purged.members = member_keys.len();
            let mut content = Content::open(&txn)?;
            for hex in candidates {
                let Some(digest) = parse_hex(&hex) else { continue };
                if is_referenced(&by_digest, &hex)? {
                    continue;
                }
                for kind in [Kind::Blob, Kind::Manifest] {
                    purged.content.extend(content.take(kind, &digest)?);
                }
            }
            content.close()?;
        }
        txn.commit()?;
        Ok(purged)
    }

    /// Indexes blob files found without their rows (see `reconcile`), in
    /// one transaction. No membership is recorded: a repository gets it
    /// after an upstream check. Returns the bytes of the blobs that were
    /// new to the index (a row committed meanwhile is only refreshed).
    pub fn adopt_blobs(&self, blobs: &[(Digest, u64)], now_ms: u64) -> Result<u64, redb::Error> {
        let txn = begin_write(&self.db)?;
        let mut added = 0;
        let mut content = Content::open(&txn)?;
        for (digest, size) in blobs {
            if content.put(Kind::Blob, digest.hex().as_str(), *size, now_ms)? {
                added += size;
            }
        }
        content.close()?;
        txn.commit()?;
        Ok(added)
    }

    /// Bytes of every blob and manifest row: the running total, read
    /// without visiting the rows.
    pub fn usage(&self) -> Result<u64, redb::Error> {
        let txn = self.db.begin_read()?;
        Ok(txn.open_table(META)?.get(BYTES_KEY)?.map_or(0, |v| v.value()))
    }

    /// The blob rows whose digest hex starts with `prefix`, in order.
    pub fn blobs_under(&self, prefix: &str) -> Result<Vec<(Digest, u64)>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(BLOBS)?;
        let mut out = Vec::new();
        for row in table.range(prefix..)? {
            let (key, value) = row?;
            let hex = key.value();
            if !hex.starts_with(prefix) {
                break;
            }
            out.extend(parse_hex(hex).map(|d| (d, value.value().0)));
        }
        Ok(out)
    }

    /// Every stored item of `kind`, for reconciliation and accounting.
    pub fn entries(&self, kind: Kind) -> Result<Vec<Entry>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(kind.meta())?;
        let mut out = Vec::new();
        for row in table.iter()? {
            let (key, value) = row?;
            let (size, accessed_ms) = value.value();
            if let Some(digest) = parse_hex(key.value()) {
                out.push(Entry { kind, digest, size, accessed_ms });
            }
        }
        Ok(out)
    }

    /// The least recently used entries whose sizes add up to at least
    /// `bytes`, oldest first: reads only those rows of the access order.
    pub fn least_recently_used(&self, bytes: u64) -> Result<Vec<Entry>, redb::Error> {
        let txn = self.db.begin_read()?;
        let access = txn.open_table(ACCESS)?;
        let (blobs, manifests) = (txn.open_table(BLOBS)?, txn.open_table(MANIFEST_META)?);
        let mut out = Vec::new();
        let mut freed = 0;
        for row in access.iter()? {
            if freed >= bytes {
                break;
            }
            let (key, _) = row?;
            let (accessed_ms, code, hex) = key.value();
            let (Some(kind), Some(digest)) = (Kind::from_code(code), parse_hex(hex)) else { continue };
            let table = if kind == Kind::Blob { &blobs } else { &manifests };
            let Some(size) = table.get(hex)?.map(|v| v.value().0) else { continue };
            freed += size;
            out.push(Entry { kind, digest, size, accessed_ms });
        }
        Ok(out)
    }

    /// Records access times, batched; rows that are gone are skipped.
    pub fn touch(&self, accesses: &[(Kind, Digest, u64)]) -> Result<(), redb::Error> {
        let txn = begin_write(&self.db)?;
        let mut content = Content::open(&txn)?;
        for (kind, digest, at) in accesses {
            let hex = digest.hex();
            if let Some((size, before)) = content.get(*kind, hex.as_str())? {
                if *at > before {
                    content.put(*kind, hex.as_str(), size, *at)?;
                }
            }
        }
        content.close()?;
        txn.commit()?;
        Ok(())
    }

    /// Removes content rows (eviction, or a row whose file is missing or
    /// wrong) in one transaction. Returns the entries that were still
    /// there, with their sizes as stored: an entry another removal took
    /// first is not counted twice. Membership rows stay: that upstream
    /// confirmed a repository has a digest is still true after the bytes
    /// left the disk. The caller unlinks blob files afterwards.
    pub fn remove_content(&self, entries: &[(Kind, Digest)]) -> Result<Vec<Entry>, redb::Error> {
        let txn = begin_write(&self.db)?;
        let mut removed = Vec::new();
        let mut content = Content::open(&txn)?;
        for (kind, digest) in entries {
            removed.extend(content.take(*kind, digest)?);
        }
        content.close()?;
        txn.commit()?;
        Ok(removed)
    }

    pub fn is_member(&self, key: &str) -> Result<bool, redb::Error> {
        let txn = self.db.begin_read()?;
        Ok(txn.open_table(MEMBERS)?.get(key)?.is_some())
    }

    pub fn add_members(&self, keys: &[String], now_ms: u64) -> Result<(), redb::Error> {
        let txn = begin_write(&self.db)?;
        put_members(&txn, keys, now_ms)?;
        txn.commit()?;
        Ok(())
    }

    pub fn manifest(&self, digest: &Digest) -> Result<Option<(MediaType, Vec<u8>)>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(MANIFESTS)?;
        let Some(row) = table.get(digest.hex().as_str())? else {
            return Ok(None);
        };
        let (media, bytes) = row.value();
        // A row whose media type is unknown would be from a newer larder;
        // treat it as absent rather than serve it wrongly.
        Ok(MediaType::parse(media).map(|m| (m, bytes.to_vec())))
    }

    /// Stores a manifest and, for a tag, its mapping, in one transaction.
    /// Returns whether the manifest is new to the index.
    pub fn insert_manifest(
        &self,
        digest: &Digest,
        media_type: MediaType,
        bytes: &[u8],
        tag: Option<&str>,
        members: &[String],
        now_ms: u64,
    ) -> Result<bool, redb::Error> {
        let txn = begin_write(&self.db)?;
        let hex = digest.hex();
        let mut content = Content::open(&txn)?;
        content.manifests.insert(hex.as_str(), (media_type.as_str(), bytes))?;
        let new = content.put(Kind::Manifest, hex.as_str(), bytes.len() as u64, now_ms)?;
        content.close()?;
        if let Some(key) = tag {
            txn.open_table(TAGS)?.insert(key, (digest.to_string().as_str(), now_ms))?;
        }
        put_members(&txn, members, now_ms)?;
        txn.commit()?;
        Ok(new)
    }

    pub fn tag(&self, key: &str) -> Result<Option<TagRow>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(TAGS)?;
        let Some(row) = table.get(key)? else {
            return Ok(None);
        };
        let (digest, confirmed_ms) = row.value();
        Ok(digest.parse().ok().map(|digest| TagRow { digest, confirmed_ms }))
    }

    pub fn set_tag(&self, key: &str, digest: &Digest, confirmed_ms: u64) -> Result<(), redb::Error> {
        let txn = begin_write(&self.db)?;
        txn.open_table(TAGS)?.insert(key, (digest.to_string().as_str(), confirmed_ms))?;
        txn.commit()?;
        Ok(())
    }

    pub fn remove_tag(&self, key: &str) -> Result<(), redb::Error> {
        let txn = begin_write(&self.db)?;
        txn.open_table(TAGS)?.remove(key)?;
        txn.commit()?;
        Ok(())
    }

    /// Calls `f` with each membership row ("upstream\0repo\0digest hex",
    /// unix millis recorded) in key order, at most `limit` rows, in one read
    /// transaction. Returns whether every row was visited.
    pub fn for_each_member(&self, limit: usize, mut f: impl FnMut(&str, u64)) -> Result<bool, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(MEMBERS)?;
        for (i, row) in table.iter()?.enumerate() {
            if i == limit {
                return Ok(false);
            }
            let (key, recorded) = row?;
            f(key.value(), recorded.value());
        }
        Ok(true)
    }
}

/// Builds the version-2 secondary tables from the rows of an older index.
fn migrate(txn: &WriteTransaction, from: u64) -> Result<(), redb::Error> {
    if from < 2 {
        migrate_to_2(txn)?;
    }
    // Version 3: the running byte total.
    let mut total = 0;
    for kind in [Kind::Blob, Kind::Manifest] {
        for row in txn.open_table(kind.meta())?.iter()? {
            total += row?.1.value().0;
        }
    }
    txn.open_table(META)?.insert(BYTES_KEY, total)?;
    Ok(())
}

fn migrate_to_2(txn: &WriteTransaction) -> Result<(), redb::Error> {
    let mut access = txn.open_table(ACCESS)?;
    for kind in [Kind::Blob, Kind::Manifest] {
        let rows = txn.open_table(kind.meta())?;
        for row in rows.iter()? {
            let (key, value) = row?;
            access.insert((value.value().1, kind.code(), key.value()), ())?;
        }
    }
    let members = txn.open_table(MEMBERS)?;
    let mut by_digest = txn.open_table(MEMBERS_BY_DIGEST)?;
    if by_digest.len()? == 0 {
        for row in members.iter()? {
            if let Some(k) = by_digest_key(row?.0.value()) {
                by_digest.insert(k.as_str(), ())?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index() -> (tempfile::TempDir, Index) {
        let dir = tempfile::tempdir().unwrap();
        let index = Index::open(&dir.path().join("index.redb")).unwrap();
        (dir, index)
    }

    #[test]
    fn rows_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.redb");
        let d = Digest::of(b"blob");
        let m = Digest::of(b"{}");
        {
            let index = Index::open(&path).unwrap();
            assert_eq!(index.blob_size(&d).unwrap(), None);
            index.insert_blob(&d, 4, &format!("u\0r\0{}", d.hex().as_str()), 1).unwrap();
            index.insert_manifest(&m, MediaType::OciManifest, b"{}", Some("u\0r\0t"), &["u\0r\0m".into()], 42).unwrap();
        }
        let index = Index::open(&path).unwrap();
        assert_eq!(index.blob_size(&d).unwrap(), Some(4));
        assert_eq!(index.blob_sizes(&[m, d]).unwrap(), [None, Some(4)], "a manifest has no blob row");
        assert_eq!(index.manifest(&m).unwrap(), Some((MediaType::OciManifest, b"{}".to_vec())));
        assert!(index.is_member(&format!("u\0r\0{}", d.hex().as_str())).unwrap());
        assert!(index.is_member("u\0r\0m").unwrap());
        assert!(!index.is_member("u\0other\0m").unwrap());
        let tag = index.tag("u\0r\0t").unwrap().unwrap();
        assert_eq!((tag.digest, tag.confirmed_ms), (m, 42));
        let removed = index.remove_content(&[(Kind::Blob, d)]).unwrap();
        assert_eq!(removed.iter().map(|e| e.size).collect::<Vec<_>>(), [4]);
        assert!(index.is_member(&format!("u\0r\0{}", d.hex().as_str())).unwrap(), "membership outlives the bytes");
        assert!(index.remove_content(&[(Kind::Blob, d)]).unwrap().is_empty(), "a second removal counts nothing");
        index.remove_tag("u\0r\0t").unwrap();
        assert_eq!(index.blob_size(&d).unwrap(), None);
        assert!(index.tag("u\0r\0t").unwrap().is_none());
    }

    /// Whether opening the index at `path` repairs it.
    fn repairs_on_open(path: &Path) -> bool {
        let repaired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&repaired);
        Database::builder()
            .set_repair_callback(move |_| flag.store(true, std::sync::atomic::Ordering::Relaxed))
            .create(path)
            .unwrap();
        repaired.load(std::sync::atomic::Ordering::Relaxed)
    }

    #[test]
    fn the_first_open_after_a_crash_needs_no_repair() {
        let dir = tempfile::tempdir().unwrap();
        let (path, crashed) = (dir.path().join("index.redb"), dir.path().join("crashed.redb"));
        let d = Digest::of(b"blob");
        let index = Index::open(&path).unwrap();
        index.insert_blob(&d, 4, &format!("u\0r\0{}", d.hex().as_str()), 1).unwrap();
        index.touch(&[(Kind::Blob, d, 2)]).unwrap();
        // The file as a crash right now leaves it: open, never closed.
        std::fs::copy(&path, &crashed).unwrap();
        drop(index);
        assert!(!repairs_on_open(&crashed), "the allocator state was in the last commit");
        let index = Index::open(&crashed).unwrap();
        assert_eq!(index.blob_size(&d).unwrap(), Some(4), "and so was the row");
        assert_eq!(index.least_recently_used(1).unwrap()[0].accessed_ms, 2);

        // The same crash after a commit without quick repair, as larder
        // made them before: its next open walks the whole file.
        let (plain, plain_crashed) = (dir.path().join("plain.redb"), dir.path().join("plain-crashed.redb"));
        let db = Database::create(&plain).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(BLOBS).unwrap().insert(d.hex().as_str(), (4, 1)).unwrap();
        txn.commit().unwrap();
        std::fs::copy(&plain, &plain_crashed).unwrap();
        drop(db);
        assert!(repairs_on_open(&plain_crashed), "a plain commit leaves the allocator state to rebuild");
    }

    #[test]
    fn eviction_reads_the_access_order_not_every_row() {
        let (_dir, index) = index();
        let d = |n: u8| Digest::of(&[n]);
        for n in 0..10u8 {
            index.insert_blob(&d(n), 10, &format!("u\0r\0{}", d(n).hex().as_str()), 100 + u64::from(n)).unwrap();
        }
        // Touching the oldest makes it the newest.
        index.touch(&[(Kind::Blob, d(0), 500), (Kind::Blob, d(1), 50)]).unwrap();
        let lru: Vec<u64> = index.least_recently_used(25).unwrap().iter().map(|e| e.accessed_ms).collect();
        assert_eq!(lru, [101, 102, 103], "an older access time never moves a row back");
        assert!(index.least_recently_used(0).unwrap().is_empty());
        let all = index.least_recently_used(u64::MAX).unwrap();
        assert_eq!(all.len(), 10);
        assert_eq!(all.last().map(|e| e.digest), Some(d(0)));
    }

    #[test]
    fn purge_removes_only_content_no_other_repository_references() {
        let (_dir, index) = index();
        let (shared, own) = (Digest::of(b"shared"), Digest::of(b"own"));
        let key = |repo: &str, d: &Digest| format!("u\0{repo}\0{}", d.hex().as_str());
        index.insert_blob(&shared, 6, &key("a", &shared), 1).unwrap();
        index.add_members(&[key("b", &shared)], 1).unwrap();
        index.insert_blob(&own, 3, &key("a", &own), 1).unwrap();
        index.set_tag("u\0a\0v1", &own, 1).unwrap();
        let purged = index.purge("u\0a\0").unwrap();
        assert_eq!((purged.tags, purged.members), (1, 2));
        assert_eq!(purged.content.iter().map(|e| e.digest).collect::<Vec<_>>(), [own]);
        assert_eq!(index.blob_size(&shared).unwrap(), Some(6), "b still references it");
        assert!(index.is_member(&key("b", &shared)).unwrap());
        assert_eq!(index.least_recently_used(u64::MAX).unwrap().len(), 1, "the access order follows");
    }

    #[test]
    fn an_older_index_gets_its_secondary_tables_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.redb");
        let d = Digest::of(b"old");
        let member = format!("u\0r\0{}", d.hex().as_str());
        {
            // Rows as a version-1 larder wrote them: no access order, no
            // reverse membership, no schema row.
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(BLOBS).unwrap().insert(d.hex().as_str(), (3, 7)).unwrap();
            txn.open_table(MEMBERS).unwrap().insert(member.as_str(), 7).unwrap();
            txn.commit().unwrap();
        }
        let index = Index::open(&path).unwrap();
        assert_eq!(index.usage().unwrap(), 3, "the byte total was summed from the old rows");
        assert_eq!(index.least_recently_used(1).unwrap().first().map(|e| e.digest), Some(d));
        let purged = index.purge("u\0r\0").unwrap();
        assert_eq!(purged.content.len(), 1, "the reverse membership was built from the old rows");
        assert_eq!(index.usage().unwrap(), 0);
    }

    #[test]
    fn the_byte_total_follows_every_change_and_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.redb");
        let (a, b, m) = (Digest::of(b"a"), Digest::of(b"b"), Digest::of(b"{}"));
        let member = |d: &Digest| format!("u\0r\0{}", d.hex().as_str());
        {
            let index = Index::open(&path).unwrap();
            index.insert_blob(&a, 100, &member(&a), 1).unwrap();
            index.insert_blob(&b, 20, &member(&b), 1).unwrap();
            index.insert_manifest(&m, MediaType::OciManifest, b"{}", None, &[member(&m)], 1).unwrap();
            assert_eq!(index.usage().unwrap(), 122);

            // Committed again, touched, adopted again: counted once.
            index.insert_blob(&a, 100, &member(&a), 2).unwrap();
            index.touch(&[(Kind::Blob, b, 9), (Kind::Manifest, m, 9)]).unwrap();
            assert_eq!(index.adopt_blobs(&[(b, 20)], 10).unwrap(), 0, "b was indexed already");
            assert_eq!(index.usage().unwrap(), 122);

            // Removed twice: subtracted once.
            index.remove_content(&[(Kind::Blob, a)]).unwrap();
            index.remove_content(&[(Kind::Blob, a)]).unwrap();
            assert_eq!(index.usage().unwrap(), 22);
        }
        let index = Index::open(&path).unwrap();
        assert_eq!(index.usage().unwrap(), 22, "read back without visiting rows");
        index.purge("u\0").unwrap();
        assert_eq!(index.usage().unwrap(), 0);
    }

    #[test]
    fn blobs_under_a_prefix_are_exactly_that_shard() {
        let (_dir, index) = index();
        let digests: Vec<Digest> = (0..200u32).map(|i| Digest::of(&i.to_le_bytes())).collect();
        for d in &digests {
            index.insert_blob(d, 1, &format!("u\0r\0{}", d.hex().as_str()), 1).unwrap();
        }
        let shard = &digests[0].hex()[..2];
        let mut expected: Vec<Digest> = digests.iter().filter(|d| d.hex().starts_with(shard)).copied().collect();
        expected.sort();
        let found: Vec<Digest> = index.blobs_under(shard).unwrap().into_iter().map(|(d, _)| d).collect();
        assert_eq!(found, expected);
    }
}
