//! The redb index of what the store holds. Synchronous, like redb itself:
//! call it only from `spawn_blocking` (the facade's `blocking` helper).

use std::path::Path;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::oci::{Digest, MediaType};

/// Committed blobs: digest hex → (size in bytes, last access in unix millis).
const BLOBS: TableDefinition<&str, (u64, u64)> = TableDefinition::new("blobs");
/// Manifests by digest hex → (media type, exact bytes).
const MANIFESTS: TableDefinition<&str, (&str, &[u8])> = TableDefinition::new("manifests");
/// Manifests by digest hex → (size in bytes, last access in unix millis),
/// apart from the bytes so that access times are cheap to update.
const MANIFEST_META: TableDefinition<&str, (u64, u64)> = TableDefinition::new("manifest_meta");

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
}

/// One stored item as the evictor sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub kind: Kind,
    pub digest: Digest,
    pub size: u64,
    pub accessed_ms: u64,
}
/// Tags: "upstream\0repo\0tag" → (digest, unix millis when upstream last confirmed it).
const TAGS: TableDefinition<&str, (&str, u64)> = TableDefinition::new("tags");
/// Repository membership: "upstream\0repo\0digest" → unix millis when
/// recorded. Content is shared across repositories on disk, but served for a
/// repository only if it has a row here (see DESIGN.md).
const MEMBERS: TableDefinition<&str, u64> = TableDefinition::new("members");

pub struct Index {
    db: Database,
}

pub struct TagRow {
    pub digest: Digest,
    pub confirmed_ms: u64,
}

impl Index {
    pub fn open(path: &Path) -> Result<Index, redb::Error> {
        let db = Database::create(path)?;
        // Create the tables up front so read transactions never miss them.
        let txn = db.begin_write()?;
        txn.open_table(BLOBS)?;
        txn.open_table(MANIFESTS)?;
        txn.open_table(MANIFEST_META)?;
        txn.open_table(TAGS)?;
        txn.open_table(MEMBERS)?;
        txn.commit()?;
        Ok(Index { db })
    }

    pub fn blob_size(&self, digest: &Digest) -> Result<Option<u64>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(BLOBS)?;
        Ok(table.get(digest.hex().as_str())?.map(|v| v.value().0))
    }

    /// Records a committed blob and the repository it was fetched for.
    /// Returns whether the blob is new to the index.
    pub fn insert_blob(&self, digest: &Digest, size: u64, member: &str, now_ms: u64) -> Result<bool, redb::Error> {
        let txn = self.db.begin_write()?;
        let new = txn.open_table(BLOBS)?.insert(digest.hex().as_str(), (size, now_ms))?.is_none();
        txn.open_table(MEMBERS)?.insert(member, now_ms)?;
        txn.commit()?;
        Ok(new)
    }

    /// Removes the tag and membership rows whose key starts with `prefix`
    /// (`"upstream\0"` or `"upstream\0repo\0"`), and the blobs and manifests
    /// that no remaining membership row names. Returns (tags removed,
    /// membership rows removed, content removed); the caller unlinks files.
    pub fn purge(&self, prefix: &str) -> Result<(usize, usize, Vec<Entry>), redb::Error> {
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
        let txn = self.db.begin_write()?;
        let (tags, members, content);
        {
            let mut tag_table = txn.open_table(TAGS)?;
            let tag_keys = keys_under(&tag_table, prefix)?;
            for key in &tag_keys {
                tag_table.remove(key.as_str())?;
            }
            tags = tag_keys.len();

            let mut member_table = txn.open_table(MEMBERS)?;
            let member_keys = keys_under(&member_table, prefix)?;
            let mut candidates: std::collections::HashSet<String> = std::collections::HashSet::new();
            for key in &member_keys {
                member_table.remove(key.as_str())?;
                if let Some((_, hex)) = key.rsplit_once('\0') {
                    candidates.insert(hex.to_owned());
                }
            }
            members = member_keys.len();
            for row in member_table.iter()? {
                let row = row?;
                if let Some((_, hex)) = row.0.value().rsplit_once('\0') {
                    candidates.remove(hex);
                }
            }
            let mut removed = Vec::new();
            let mut blobs = txn.open_table(BLOBS)?;
            let mut meta = txn.open_table(MANIFEST_META)?;
            let mut manifests = txn.open_table(MANIFESTS)?;
            for hex in candidates {
                let Ok(digest) = format!("sha256:{hex}").parse::<Digest>() else { continue };
                if let Some(v) = blobs.remove(hex.as_str())? {
                    let (size, accessed_ms) = v.value();
                    removed.push(Entry { kind: Kind::Blob, digest, size, accessed_ms });
                }
                manifests.remove(hex.as_str())?;
                if let Some(v) = meta.remove(hex.as_str())? {
                    let (size, accessed_ms) = v.value();
                    removed.push(Entry { kind: Kind::Manifest, digest, size, accessed_ms });
                }
            }
            content = removed;
        }
        txn.commit()?;
        Ok((tags, members, content))
    }

    /// Indexes blob files found without their rows (see `reconcile`), in
    /// one transaction. No membership is recorded: a repository gets it
    /// after an upstream check.
    pub fn adopt_blobs(&self, blobs: &[(Digest, u64)], now_ms: u64) -> Result<(), redb::Error> {
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(BLOBS)?;
            for (digest, size) in blobs {
                table.insert(digest.hex().as_str(), (*size, now_ms))?;
            }
        }
        txn.commit()?;
        Ok(())
    }

    /// Every stored item of `kind`, for eviction and accounting.
    pub fn entries(&self, kind: Kind) -> Result<Vec<Entry>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(kind.meta())?;
        let mut out = Vec::new();
        for row in table.iter()? {
            let (key, value) = row?;
            let (size, accessed_ms) = value.value();
            if let Ok(digest) = format!("sha256:{}", key.value()).parse() {
                out.push(Entry { kind, digest, size, accessed_ms });
            }
        }
        Ok(out)
    }

    /// Records access times, batched; rows that are gone are skipped.
    pub fn touch(&self, accesses: &[(Kind, Digest, u64)]) -> Result<(), redb::Error> {
        let txn = self.db.begin_write()?;
        {
            let mut blobs = txn.open_table(BLOBS)?;
            let mut manifests = txn.open_table(MANIFEST_META)?;
            for (kind, digest, at) in accesses {
                let table = match kind {
                    Kind::Blob => &mut blobs,
                    Kind::Manifest => &mut manifests,
                };
                let hex = digest.hex();
                let current = table.get(hex.as_str())?.map(|v| v.value());
                if let Some((size, before)) = current {
                    if *at > before {
                        table.insert(hex.as_str(), (size, *at))?;
                    }
                }
            }
        }
        txn.commit()?;
        Ok(())
    }

    /// Removes entries (and a manifest's bytes) in one transaction; the
    /// caller unlinks blob files afterwards. Returns the bytes removed.
    pub fn remove_entries(&self, entries: &[Entry]) -> Result<u64, redb::Error> {
        let txn = self.db.begin_write()?;
        let mut removed = 0;
        {
            let mut blobs = txn.open_table(BLOBS)?;
            let mut meta = txn.open_table(MANIFEST_META)?;
            let mut manifests = txn.open_table(MANIFESTS)?;
            for e in entries {
                let hex = e.digest.hex();
                let gone = match e.kind {
                    Kind::Blob => blobs.remove(hex.as_str())?.map(|v| v.value().0),
                    Kind::Manifest => {
                        manifests.remove(hex.as_str())?;
                        meta.remove(hex.as_str())?.map(|v| v.value().0)
                    }
                };
                removed += gone.unwrap_or(0);
            }
        }
        txn.commit()?;
        Ok(removed)
    }

    pub fn is_member(&self, key: &str) -> Result<bool, redb::Error> {
        let txn = self.db.begin_read()?;
        Ok(txn.open_table(MEMBERS)?.get(key)?.is_some())
    }

    pub fn add_members(&self, keys: &[String], now_ms: u64) -> Result<(), redb::Error> {
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(MEMBERS)?;
            for key in keys {
                table.insert(key.as_str(), now_ms)?;
            }
        }
        txn.commit()?;
        Ok(())
    }

    pub fn remove_blob(&self, digest: &Digest) -> Result<(), redb::Error> {
        let txn = self.db.begin_write()?;
        txn.open_table(BLOBS)?.remove(digest.hex().as_str())?;
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
        let txn = self.db.begin_write()?;
        txn.open_table(MANIFESTS)?.insert(digest.hex().as_str(), (media_type.as_str(), bytes))?;
        let new = txn.open_table(MANIFEST_META)?.insert(digest.hex().as_str(), (bytes.len() as u64, now_ms))?.is_none();
        if let Some(key) = tag {
            txn.open_table(TAGS)?.insert(key, (digest.to_string().as_str(), now_ms))?;
        }
        {
            let mut table = txn.open_table(MEMBERS)?;
            for key in members {
                table.insert(key.as_str(), now_ms)?;
            }
        }
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
        let txn = self.db.begin_write()?;
        txn.open_table(TAGS)?.insert(key, (digest.to_string().as_str(), confirmed_ms))?;
        txn.commit()?;
        Ok(())
    }

    pub fn remove_tag(&self, key: &str) -> Result<(), redb::Error> {
        let txn = self.db.begin_write()?;
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
mod tests {
    use super::*;

    #[test]
    fn rows_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.redb");
        let d = Digest::of(b"blob");
        let m = Digest::of(b"{}");
        {
            let index = Index::open(&path).unwrap();
            assert_eq!(index.blob_size(&d).unwrap(), None);
            index.insert_blob(&d, 4, "u\0r\0blob", 1).unwrap();
            index.insert_manifest(&m, MediaType::OciManifest, b"{}", Some("u\0r\0t"), &["u\0r\0m".into()], 42).unwrap();
        }
        let index = Index::open(&path).unwrap();
        assert_eq!(index.blob_size(&d).unwrap(), Some(4));
        assert_eq!(index.manifest(&m).unwrap(), Some((MediaType::OciManifest, b"{}".to_vec())));
        assert!(index.is_member("u\0r\0blob").unwrap());
        assert!(index.is_member("u\0r\0m").unwrap());
        assert!(!index.is_member("u\0other\0m").unwrap());
        let tag = index.tag("u\0r\0t").unwrap().unwrap();
        assert_eq!((tag.digest, tag.confirmed_ms), (m, 42));
        index.remove_blob(&d).unwrap();
        index.remove_tag("u\0r\0t").unwrap();
        assert_eq!(index.blob_size(&d).unwrap(), None);
        assert!(index.tag("u\0r\0t").unwrap().is_none());
    }
}
