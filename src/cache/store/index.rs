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
//!   start-up knows the cache's usage without reading every row;
//! - `charged`, `upstream_access` and `meta["bytes\0<upstream>"]`: the
//!   upstream each item is charged to, each upstream's own access order and
//!   its running total, for per-upstream quotas (see `quota`).
//!
//! The warm images' digests live here too (`warm`), and the blob sizes
//! each repository's manifests declare (`declared`).

use std::path::Path;

use redb::{Database, ReadableDatabase, ReadableTable, Table, TableDefinition, WriteTransaction};

use crate::oci::{Digest, MediaType};

mod declared;
mod import;
mod migrate;
mod quota;
mod warm;

pub use import::{ImportCommitError, ImportCommitted, ImportRows};
pub use quota::Charged;
pub use warm::WarmRow;

/// Committed blobs: digest hex → (size in bytes, last access in unix millis).
const BLOBS: TableDefinition<&str, (u64, u64)> = TableDefinition::new("blobs");
/// Manifests by digest hex → (media type, exact bytes).
const MANIFESTS: TableDefinition<&str, (&str, &[u8])> = TableDefinition::new("manifests");
/// A manifest's registry warnings for one repository: "digest
/// hex\0upstream\0repo" (its membership row's key, digest first, as in
/// `members_by_digest`) → the `Warning` values that upstream last sent
/// with it for that repository, one per line (`oci::Warnings`); no row:
/// none. Per repository, because a warning is upstream's word to one
/// repository's clients (a deprecation there, a note about the
/// credentials it was asked with), not a property of the bytes another
/// repository or upstream shares. Removed with the manifest (every
/// repository's) and with a membership row (a purge). Added after schema
/// version 4 without a migration: an index written before has no rows,
/// which reads as no warnings.
const MANIFEST_WARNINGS: TableDefinition<&str, &[u8]> = TableDefinition::new("manifest_warnings");
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
/// the running total of content sizes; "bytes\0<upstream>" → the total
/// charged to that upstream.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const SCHEMA_KEY: &str = "schema";
const BYTES_KEY: &str = "bytes";
/// Which upstream a blob or manifest is charged to: (kind, digest hex) →
/// upstream name. Content without a row (a file adopted at start-up,
/// fetched for no repository) counts in the total only.
const CHARGED: TableDefinition<(u8, &str), &str> = TableDefinition::new("charged");
/// The rows of `access` again, per upstream charged:
/// (upstream, unix millis, kind, digest hex) → ().
const UPSTREAM_ACCESS: TableDefinition<(&str, u64, u8, &str), ()> = TableDefinition::new("upstream_access");
/// Warm images: "upstream\0repo\0reference" → (digest, previous digest or
/// "", unix millis the digest was last seen upstream).
const WARM: TableDefinition<&str, (&str, &str, u64)> = TableDefinition::new("warm");
/// Blob sizes declared by the manifests of a repository:
/// "upstream\0repo\0blob hex" → size in bytes (see `declared`).
const DECLARED: TableDefinition<&str, u64> = TableDefinition::new("declared");

/// Version 2 added `access` and `members_by_digest`, version 3 the running
/// byte total, version 4 what each upstream is charged, version 5 the
/// declared sizes; an index written by an older larder gets them built
/// once, when it is opened.
const SCHEMA_VERSION: u64 = 5;

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

/// A use of a stored item (a request served it): when, and for which
/// upstream. The item's charge moves to that upstream (see `quota`);
/// `by: None` moves only its access time (an item another upstream pins).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Use {
    pub kind: Kind,
    pub digest: Digest,
    pub at_ms: u64,
    pub by: Option<std::sync::Arc<str>>,
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
    /// Each upstream's running total, as of the last commit.
    charged: std::sync::Arc<Charged>,
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

/// Eviction victims gathered in access order until their sizes add up to
/// `bytes` (the global order and each upstream's share the walk).
struct Victims {
    blobs: redb::ReadOnlyTable<&'static str, (u64, u64)>,
    manifests: redb::ReadOnlyTable<&'static str, (u64, u64)>,
    bytes: u64,
    freed: u64,
    out: Vec<Entry>,
}

impl Victims {
    fn open(txn: &redb::ReadTransaction, bytes: u64) -> Result<Victims, redb::Error> {
        let (blobs, manifests) = (txn.open_table(BLOBS)?, txn.open_table(MANIFEST_META)?);
        Ok(Victims { blobs, manifests, bytes, freed: 0, out: Vec::new() })
    }

    fn enough(&self) -> bool {
        self.freed >= self.bytes
    }

    /// One access row: a victim unless `keep` holds it or it is gone.
    fn offer(
        &mut self,
        accessed_ms: u64,
        code: u8,
        hex: &str,
        keep: &dyn Fn(Kind, &Digest) -> bool,
    ) -> Result<(), redb::Error> {
        let (Some(kind), Some(digest)) = (Kind::from_code(code), parse_hex(hex)) else { return Ok(()) };
        if keep(kind, &digest) {
            return Ok(());
        }
        let table = if kind == Kind::Blob { &self.blobs } else { &self.manifests };
        let Some(size) = table.get(hex)?.map(|v| v.value().0) else { return Ok(()) };
        self.freed += size;
        self.out.push(Entry { kind, digest, size, accessed_ms });
        Ok(())
    }
}

fn parse_hex(hex: &str) -> Option<Digest> {
    format!("sha256:{hex}").parse().ok()
}

/// "upstream\0repo\0hex" → "hex\0upstream\0repo".
fn by_digest_key(member: &str) -> Option<String> {
    let (owner, hex) = member.rsplit_once('\0')?;
    Some(format!("{hex}\0{owner}"))
}

/// Moves the running byte total by `added - removed`, and each upstream's
/// by its change.
fn count_bytes(txn: &WriteTransaction, added: u64, removed: u64, charges: &quota::Changes) -> Result<(), redb::Error> {
    let mut meta = txn.open_table(META)?;
    if added != removed {
        let total = meta.get(BYTES_KEY)?.map_or(0, |v| v.value());
        meta.insert(BYTES_KEY, (total + added).saturating_sub(removed))?;
    }
    for (upstream, change) in charges.iter() {
        let key = quota::bytes_key(upstream);
        let total = meta.get(key.as_str())?.map_or(0, |v| v.value());
        let now = total.saturating_add_signed(*change);
        if now == 0 {
            meta.remove(key.as_str())?;
        } else {
            meta.insert(key.as_str(), now)?;
        }
    }
    Ok(())
}

/// The upstream a membership key ("upstream\0repo\0hex") names.
fn upstream_of(member: &str) -> Option<&str> {
    member.split_once('\0').map(|(upstream, _)| upstream).filter(|u| !u.is_empty())
}

/// The content tables of one write transaction, opened once however many
/// rows it changes (an eviction round removes thousands); the byte totals
/// they move are written once, by [`Content::close`].
struct Content<'txn> {
    txn: &'txn WriteTransaction,
    blobs: Table<'txn, &'static str, (u64, u64)>,
    manifest_meta: Table<'txn, &'static str, (u64, u64)>,
    manifests: Table<'txn, &'static str, (&'static str, &'static [u8])>,
    access: Table<'txn, (u64, u8, &'static str), ()>,
    charged: Table<'txn, (u8, &'static str), &'static str>,
    upstream_access: Table<'txn, (&'static str, u64, u8, &'static str), ()>,
    added: u64,
    removed: u64,
    /// What each upstream's total moves by.
    charges: quota::Changes,
}

impl<'txn> Content<'txn> {
    fn open(txn: &'txn WriteTransaction) -> Result<Content<'txn>, redb::Error> {
        Ok(Content {
            txn,
            blobs: txn.open_table(BLOBS)?,
            manifest_meta: txn.open_table(MANIFEST_META)?,
            manifests: txn.open_table(MANIFESTS)?,
            access: txn.open_table(ACCESS)?,
            charged: txn.open_table(CHARGED)?,
            upstream_access: txn.open_table(UPSTREAM_ACCESS)?,
            added: 0,
            removed: 0,
            charges: quota::Changes::default(),
        })
    }

    /// The upstream a row is charged to.
    fn charged_to(&self, kind: Kind, hex: &str) -> Result<Option<String>, redb::Error> {
        Ok(self.charged.get((kind.code(), hex))?.map(|v| v.value().to_owned()))
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

    /// Inserts (or refreshes) a content row and its access-order twins,
    /// charged to `upstream` (the one it was fetched or stored for now:
    /// its most recent use); without one, a row keeps the upstream it is
    /// charged to. Returns whether the row is new.
    fn put(
        &mut self,
        kind: Kind,
        hex: &str,
        size: u64,
        now_ms: u64,
        upstream: Option<&str>,
    ) -> Result<bool, redb::Error> {
        let previous = self.rows(kind).insert(hex, (size, now_ms))?.map(|v| v.value());
        let charged = self.charged_to(kind, hex)?;
        if let Some((before_size, before)) = previous {
            self.access.remove((before, kind.code(), hex))?;
            if let Some(owner) = &charged {
                self.upstream_access.remove((owner.as_str(), before, kind.code(), hex))?;
                self.charges.add(owner, -(before_size as i64));
            }
        }
        self.access.insert((now_ms, kind.code(), hex), ())?;
        let owner = match (charged, upstream) {
            (Some(owner), Some(upstream)) if owner == upstream => Some(owner),
            (_, Some(upstream)) => {
                self.charged.insert((kind.code(), hex), upstream)?;
                Some(upstream.to_owned())
            }
            (owner, None) => owner,
        };
        if let Some(owner) = &owner {
            self.upstream_access.insert((owner.as_str(), now_ms, kind.code(), hex), ())?;
            self.charges.add(owner, size as i64);
        }
        self.added += size;
        self.removed += previous.map_or(0, |(size, _)| size);
        Ok(previous.is_none())
    }

    /// A use of a row at `at_ms` (later than its last one, else nothing
    /// changes) for upstream `by`: its access time moves, and its charge
    /// moves to `by` (the upstream whose use is the most recent is the one
    /// it is there for). A row charged to no upstream (adopted at start-up
    /// or by `verify --repair`) is charged to the first that uses it.
    fn used(&mut self, kind: Kind, hex: &str, at_ms: u64, by: Option<&str>) -> Result<(), redb::Error> {
        let Some((size, before)) = self.get(kind, hex)? else { return Ok(()) };
        if at_ms <= before {
            return Ok(());
        }
        self.rows(kind).insert(hex, (size, at_ms))?;
        self.access.remove((before, kind.code(), hex))?;
        self.access.insert((at_ms, kind.code(), hex), ())?;
        let owner = self.charged_to(kind, hex)?;
        if let Some(owner) = &owner {
            self.upstream_access.remove((owner.as_str(), before, kind.code(), hex))?;
        }
        let to = by.map(str::to_owned).or(owner.clone());
        if let Some(to) = &to {
            if owner.as_deref() != Some(to.as_str()) {
                self.charged.insert((kind.code(), hex), to.as_str())?;
                if let Some(owner) = &owner {
                    self.charges.add(owner, -(size as i64));
                }
                self.charges.add(to, size as i64);
            }
            self.upstream_access.insert((to.as_str(), at_ms, kind.code(), hex), ())?;
        }
        Ok(())
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
            remove_warnings_of(self.txn, hex.as_str())?;
        }
        let owner = self.charged.remove((kind.code(), hex.as_str()))?.map(|v| v.value().to_owned());
        if let Some(owner) = owner {
            self.upstream_access.remove((owner.as_str(), accessed_ms, kind.code(), hex.as_str()))?;
            self.charges.add(&owner, -(size as i64));
        }
        self.removed += size;
        Ok(Some(Entry { kind, digest: *digest, size, accessed_ms }))
    }

    /// Closes the tables and moves the running byte totals, before the
    /// transaction commits. Returns what each upstream's total moved by,
    /// for [`Charged`] once the transaction committed.
    fn close(self) -> Result<quota::Changes, redb::Error> {
        let Content { txn, blobs, manifest_meta, manifests, access, charged, upstream_access, added, removed, charges } =
            self;
        drop((blobs, manifest_meta, manifests, access, charged, upstream_access));
        count_bytes(txn, added, removed, &charges)?;
        Ok(charges)
    }
}

/// Sets (or, when empty, removes) the warnings row of a manifest's
/// membership row `member` ("upstream\0repo\0hex").
fn put_warnings(txn: &WriteTransaction, member: &str, warnings: &[u8]) -> Result<(), redb::Error> {
    let Some(key) = by_digest_key(member) else { return Ok(()) };
    let mut table = txn.open_table(MANIFEST_WARNINGS)?;
    if warnings.is_empty() {
        table.remove(key.as_str())?;
    } else {
        table.insert(key.as_str(), warnings)?;
    }
    Ok(())
}

/// Removes every repository's warnings of the manifest `hex` (and a row
/// keyed by the digest alone, as a build between this table's start and
/// its keying by repository wrote them).
fn remove_warnings_of(txn: &WriteTransaction, hex: &str) -> Result<(), redb::Error> {
    let mut table = txn.open_table(MANIFEST_WARNINGS)?;
    table.remove(hex)?;
    let prefix = format!("{hex}\0");
    let keys: Vec<String> = table
        .range(prefix.as_str()..)?
        .map(|row| row.map(|(k, _)| k.value().to_owned()))
        .take_while(|k| k.as_ref().map_or(true, |k| k.starts_with(&prefix)))
        .collect::<Result<_, _>>()?;
    for key in keys {
        table.remove(key.as_str())?;
    }
    Ok(())
}

/// Records membership rows, and for those that are manifests the blob
/// sizes they declare for the repository (`declared`).
fn put_members(txn: &WriteTransaction, members: &[String], now_ms: u64) -> Result<(), redb::Error> {
    {
        let mut table = txn.open_table(MEMBERS)?;
        let mut by_digest = txn.open_table(MEMBERS_BY_DIGEST)?;
        for key in members {
            table.insert(key.as_str(), now_ms)?;
            if let Some(k) = by_digest_key(key) {
                by_digest.insert(k.as_str(), ())?;
            }
        }
    }
    declared::record(txn, members)
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
        txn.open_table(MANIFEST_WARNINGS)?;
        txn.open_table(ACCESS)?;
        txn.open_table(TAGS)?;
        txn.open_table(MEMBERS)?;
        txn.open_table(MEMBERS_BY_DIGEST)?;
        txn.open_table(CHARGED)?;
        txn.open_table(UPSTREAM_ACCESS)?;
        txn.open_table(WARM)?;
        txn.open_table(DECLARED)?;
        let version = txn.open_table(META)?.get(SCHEMA_KEY)?.map_or(1, |v| v.value());
        if version < SCHEMA_VERSION {
            migrate::migrate(&txn, version)?;
            txn.open_table(META)?.insert(SCHEMA_KEY, SCHEMA_VERSION)?;
        }
        txn.commit()?;
        let charged = std::sync::Arc::new(Charged::read(&db)?);
        Ok(Index { db, charged })
    }

    /// Each upstream's running total, kept up to date by every commit.
    pub fn charged(&self) -> &std::sync::Arc<Charged> {
        &self.charged
    }

    /// Closes `content`, commits, and only then moves [`Charged`]: what
    /// it says is always what is committed.
    fn commit(&self, txn: WriteTransaction, changes: quota::Changes) -> Result<(), redb::Error> {
        txn.commit()?;
        self.charged.apply(&changes);
        Ok(())
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

    /// Records a committed blob and the repository it was fetched for (a
    /// new blob is charged to that repository's upstream). Returns whether
    /// the blob is new to the index.
    pub fn insert_blob(&self, digest: &Digest, size: u64, member: &str, now_ms: u64) -> Result<bool, redb::Error> {
        Ok(self.insert_fetched_blob(digest, size, member, || true, now_ms)?.0)
    }

    /// [`Index::insert_blob`], with the membership row only if `keep`
    /// says so when asked inside the write transaction: after any write
    /// transaction that began before this one (a purge's) and before any
    /// that begins after it. The blob is charged to the member's upstream
    /// either way. Returns whether the blob is new, and whether the row
    /// was kept.
    pub fn insert_fetched_blob(
        &self,
        digest: &Digest,
        size: u64,
        member: &str,
        keep: impl FnOnce() -> bool,
        now_ms: u64,
    ) -> Result<(bool, bool), redb::Error> {
        let txn = begin_write(&self.db)?;
        let kept = keep();
        let mut content = Content::open(&txn)?;
        let new = content.put(Kind::Blob, digest.hex().as_str(), size, now_ms, upstream_of(member))?;
        let changes = content.close()?;
        if kept {
            put_members(&txn, &[member.to_owned()], now_ms)?;
        }
        self.commit(txn, changes)?;
        Ok((new, kept))
    }

    /// Removes the tag and membership rows whose key starts with `prefix`
    /// (`"upstream\0"` or `"upstream\0repo\0"`), and the blobs and manifests
    /// that no remaining membership row names, in one transaction. Costs
    /// what the prefix holds, not what the index holds.
    pub fn purge(&self, prefix: &str) -> Result<PurgedRows, redb::Error> {
        let txn = begin_write(&self.db)?;
        let mut purged = PurgedRows::default();
        let changes;
        {
            let mut tags = txn.open_table(TAGS)?;
            let tag_keys = keys_under(&tags, prefix)?;
            for key in &tag_keys {
                tags.remove(key.as_str())?;
            }
            purged.tags = tag_keys.len();

            let mut members = txn.open_table(MEMBERS)?;
            let mut by_digest = txn.open_table(MEMBERS_BY_DIGEST)?;
            let mut warnings = txn.open_table(MANIFEST_WARNINGS)?;
            let member_keys = keys_under(&members, prefix)?;
            let mut candidates = std::collections::BTreeSet::new();
            for key in &member_keys {
                members.remove(key.as_str())?;
                if let Some(k) = by_digest_key(key) {
                    by_digest.remove(k.as_str())?;
                    warnings.remove(k.as_str())?;
                }
                if let Some((_, hex)) = key.rsplit_once('\0') {
                    candidates.insert(hex.to_owned());
                }
            }
            purged.members = member_keys.len();
            declared::purge(&txn, prefix)?;
            // Taking a manifest below removes its other warnings rows.
            drop(warnings);
            let mut content = Content::open(&txn)?;
            for hex in candidates {
                let Some(digest) = parse_hex(&hex) else { continue };
                if is_referenced(&by_digest, &hex)? {
                    // Kept for another repository: charged to an upstream
                    // that still references it.
                    let referencing = quota::referencing_upstreams(&by_digest, &hex)?;
                    for kind in [Kind::Blob, Kind::Manifest] {
                        match content.charged_to(kind, &hex)? {
                            Some(owner) if !referencing.contains(&owner) => {
                                content.recharge(kind, &hex, &owner, &referencing[0])?;
                            }
                            _ => {}
                        }
                    }
                    continue;
                }
                for kind in [Kind::Blob, Kind::Manifest] {
                    purged.content.extend(content.take(kind, &digest)?);
                }
            }
            changes = content.close()?;
        }
        self.commit(txn, changes)?;
        Ok(purged)
    }

    /// Indexes blob files found without their rows (see `reconcile`), in
    /// one transaction. No membership is recorded: a repository gets it
    /// after an upstream check. Charged to no upstream until the first one
    /// serves it (see `Content::used`). Returns the bytes of the blobs that
    /// were new to the index (a row committed meanwhile is only refreshed).
    pub fn adopt_blobs(&self, blobs: &[(Digest, u64)], now_ms: u64) -> Result<u64, redb::Error> {
        let txn = begin_write(&self.db)?;
        let mut added = 0;
        let mut content = Content::open(&txn)?;
        for (digest, size) in blobs {
            if content.put(Kind::Blob, digest.hex().as_str(), *size, now_ms, None)? {
                added += size;
            }
        }
        let changes = content.close()?;
        self.commit(txn, changes)?;
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
    /// `bytes`, oldest first, leaving out those `keep` holds (pinned):
    /// reads only those rows of the access order (and the kept ones).
    pub fn least_recently_used(
        &self,
        bytes: u64,
        keep: &dyn Fn(Kind, &Digest) -> bool,
    ) -> Result<Vec<Entry>, redb::Error> {
        let txn = self.db.begin_read()?;
        let access = txn.open_table(ACCESS)?;
        let mut victims = Victims::open(&txn, bytes)?;
        for row in access.iter()? {
            if victims.enough() {
                break;
            }
            let (key, _) = row?;
            let (accessed_ms, code, hex) = key.value();
            victims.offer(accessed_ms, code, hex, keep)?;
        }
        Ok(victims.out)
    }

    /// Records uses, batched: access times, and charges that move to the
    /// upstream of the most recent use (see `Content::used`); rows that
    /// are gone are skipped.
    pub fn touch(&self, uses: &[Use]) -> Result<(), redb::Error> {
        let txn = begin_write(&self.db)?;
        let mut content = Content::open(&txn)?;
        for u in uses {
            content.used(u.kind, u.digest.hex().as_str(), u.at_ms, u.by.as_deref())?;
        }
        let changes = content.close()?;
        self.commit(txn, changes)?;
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
        let changes = content.close()?;
        self.commit(txn, changes)?;
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

    /// The registry warnings kept with a manifest for one repository, by
    /// its membership row's key `member` ("upstream\0repo\0hex"; encoded
    /// `oci::Warnings`; empty: none).
    pub fn manifest_warnings(&self, member: &str) -> Result<Vec<u8>, redb::Error> {
        let Some(key) = by_digest_key(member) else { return Ok(Vec::new()) };
        let txn = self.db.begin_read()?;
        let table = txn.open_table(MANIFEST_WARNINGS)?;
        Ok(table.get(key.as_str())?.map(|v| v.value().to_vec()).unwrap_or_default())
    }

    /// Replaces the registry warnings kept with a stored manifest for the
    /// repository of `member` (upstream answered about it again); nothing
    /// for a manifest not stored.
    pub fn set_manifest_warnings(&self, member: &str, warnings: &[u8]) -> Result<(), redb::Error> {
        let Some((_, hex)) = member.rsplit_once('\0') else { return Ok(()) };
        let txn = begin_write(&self.db)?;
        if txn.open_table(MANIFESTS)?.get(hex)?.is_some() {
            put_warnings(&txn, member, warnings)?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Stores a manifest and, for a tag, its mapping, in one transaction
    /// (a new manifest is charged to the upstream of its first membership
    /// row). Returns whether the manifest is new to the index.
    pub fn insert_manifest(
        &self,
        digest: &Digest,
        media_type: MediaType,
        bytes: &[u8],
        tag: Option<&str>,
        members: &[String],
        now_ms: u64,
    ) -> Result<bool, redb::Error> {
        self.insert_manifest_warned(digest, (media_type, bytes, None), tag, members, now_ms)
    }

    /// [`Index::insert_manifest`], with the registry warnings upstream sent
    /// for the repositories of `members` (`Some`: they replace the kept
    /// ones, in the same transaction; `None`: a source that knows of none,
    /// such as an import, leaves them).
    pub fn insert_manifest_warned(
        &self,
        digest: &Digest,
        (media_type, bytes, warnings): (MediaType, &[u8], Option<&[u8]>),
        tag: Option<&str>,
        members: &[String],
        now_ms: u64,
    ) -> Result<bool, redb::Error> {
        let txn = begin_write(&self.db)?;
        let hex = digest.hex();
        let mut content = Content::open(&txn)?;
        content.manifests.insert(hex.as_str(), (media_type.as_str(), bytes))?;
        let upstream = members.first().and_then(|m| upstream_of(m));
        let new = content.put(Kind::Manifest, hex.as_str(), bytes.len() as u64, now_ms, upstream)?;
        let changes = content.close()?;
        if let Some(warnings) = warnings {
            for member in members {
                put_warnings(&txn, member, warnings)?;
            }
        }
        if let Some(key) = tag {
            txn.open_table(TAGS)?.insert(key, (digest.to_string().as_str(), now_ms))?;
        }
        put_members(&txn, members, now_ms)?;
        self.commit(txn, changes)?;
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

#[cfg(test)]
mod tests;
