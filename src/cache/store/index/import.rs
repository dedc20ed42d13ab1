//! An import's rows (`larder import`), written in one transaction: its
//! blobs, manifests, membership rows and tags become visible together, or
//! (a refusal, an error, a crash before the commit) none of them does.
//!
//! Content is immutable by digest: a row already in the index is never
//! rewritten (only its access time moves, as a pull would move it). A
//! manifest the index holds under another media type than the layout
//! declares refuses the whole import. A new membership row of a manifest
//! records the blob sizes it declares for its repository (`declared`), as
//! a fill's does; an imported manifest carries no upstream warnings, so
//! it adds no `manifest_warnings` row and removes none.

use redb::{ReadableDatabase, ReadableTable};

use super::{Content, Index, Kind, MANIFESTS, MEMBERS, MEMBERS_BY_DIGEST, TAGS, begin_write, by_digest_key, declared};
use crate::oci::{Digest, MediaType};

/// What an import writes. Blob files are in place already.
pub struct ImportRows<'a> {
    /// Blobs: digest, size, the upstream charged for a new row.
    pub blobs: &'a [(Digest, u64, &'a str)],
    /// Manifests: digest, media type, the upstream charged for a new row
    /// (the bytes are read during the commit, one at a time).
    pub manifests: &'a [(Digest, MediaType, &'a str)],
    /// Membership keys ("upstream\0repo\0hex"); those already there stay as they are.
    pub members: &'a [String],
    /// Tag keys and the digests they now map to, confirmed at `now_ms`.
    pub tags: &'a [(String, Digest)],
    pub now_ms: u64,
}

/// What the commit added: content new to the index.
#[derive(Debug, Default)]
pub struct ImportCommitted {
    pub new_blobs: Vec<Digest>,
    pub new_manifests: Vec<Digest>,
    /// Bytes of the new rows, for the cache's usage.
    pub new_bytes: u64,
}

/// Why an import's rows were not written: nothing was.
#[derive(Debug, thiserror::Error)]
pub enum ImportCommitError {
    #[error(
        "manifest {digest} is cached as {stored}, and the layout declares it {declared}: content is immutable by \
         digest, so nothing was imported"
    )]
    Conflict { digest: Digest, stored: String, declared: &'static str },
    /// A purge of a destination began after the import did: what the
    /// import checked (a membership it relied on, the tag it replaces) is
    /// from before it, and committing would bring back what it removed.
    #[error("{0} was purged while the import ran; nothing was imported: import the layout again")]
    Purged(String),
    /// Reading a manifest's bytes for its row failed.
    #[error("manifest {0}: {1}")]
    Read(Digest, String),
    #[error("index: {0}")]
    Index(#[from] redb::Error),
}

fn db<T, E: Into<redb::Error>>(r: Result<T, E>) -> Result<T, ImportCommitError> {
    r.map_err(|e| ImportCommitError::Index(e.into()))
}

impl Index {
    /// The first manifest of `manifests` the index holds under another
    /// media type, read without writing (checked before any file of the
    /// import is put in place; the commit checks again).
    pub fn import_conflict(&self, manifests: &[(Digest, MediaType)]) -> Result<Option<ImportCommitError>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(MANIFESTS)?;
        for (digest, media_type) in manifests {
            if let Some(row) = table.get(digest.hex().as_str())? {
                let stored = row.value().0;
                if stored != media_type.as_str() {
                    return Ok(Some(ImportCommitError::Conflict {
                        digest: *digest,
                        stored: stored.to_owned(),
                        declared: media_type.as_str(),
                    }));
                }
            }
        }
        Ok(None)
    }

    /// Writes an import's rows in one transaction; `read` gives a
    /// manifest's bytes. `purged` says whether a purge that began after the
    /// import started covers a membership or tag key: asked inside the
    /// write transaction, which a purge's own is ordered with, so a purge
    /// either removes the import's rows or refuses the import. On any
    /// error nothing is written.
    pub fn commit_import(
        &self,
        rows: &ImportRows<'_>,
        read: &mut dyn FnMut(&Digest) -> Result<Vec<u8>, String>,
        purged: &dyn Fn(&str) -> bool,
    ) -> Result<ImportCommitted, ImportCommitError> {
        let txn = begin_write(&self.db)?;
        let keys = rows.members.iter().map(String::as_str).chain(rows.tags.iter().map(|(k, _)| k.as_str()));
        for key in keys {
            if purged(key) {
                let mut parts = key.split('\0');
                let (upstream, repo) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
                return Err(ImportCommitError::Purged(format!("{upstream}/{repo}")));
            }
        }
        let mut committed = ImportCommitted::default();
        let mut content = Content::open(&txn)?;
        for (digest, media_type, upstream) in rows.manifests {
            let hex = digest.hex();
            let stored = db(content.manifests.get(hex.as_str()))?.map(|row| row.value().0.to_owned());
            match stored {
                Some(stored) if stored != media_type.as_str() => {
                    return Err(ImportCommitError::Conflict { digest: *digest, stored, declared: media_type.as_str() });
                }
                Some(_) => touch(&mut content, Kind::Manifest, hex.as_str(), rows.now_ms)?,
                None => {
                    let bytes = read(digest).map_err(|e| ImportCommitError::Read(*digest, e))?;
                    db(content.manifests.insert(hex.as_str(), (media_type.as_str(), bytes.as_slice())))?;
                    let size = bytes.len() as u64;
                    if content.put(Kind::Manifest, hex.as_str(), size, rows.now_ms, Some(upstream))? {
                        committed.new_manifests.push(*digest);
                        committed.new_bytes += size;
                    }
                }
            }
        }
        for (digest, size, upstream) in rows.blobs {
            let hex = digest.hex();
            if content.get(Kind::Blob, hex.as_str())?.is_some() {
                touch(&mut content, Kind::Blob, hex.as_str(), rows.now_ms)?;
            } else if content.put(Kind::Blob, hex.as_str(), *size, rows.now_ms, Some(upstream))? {
                committed.new_blobs.push(*digest);
                committed.new_bytes += size;
            }
        }
        let changes = content.close()?;
        let mut new_members = Vec::new();
        {
            let mut members = db(txn.open_table(MEMBERS))?;
            let mut by_digest = db(txn.open_table(MEMBERS_BY_DIGEST))?;
            for key in rows.members {
                if db(members.get(key.as_str()))?.is_some() {
                    continue;
                }
                db(members.insert(key.as_str(), rows.now_ms))?;
                if let Some(k) = by_digest_key(key) {
                    db(by_digest.insert(k.as_str(), ()))?;
                }
                new_members.push(key.clone());
            }
            let mut tags = db(txn.open_table(TAGS))?;
            for (key, digest) in rows.tags {
                db(tags.insert(key.as_str(), (digest.to_string().as_str(), rows.now_ms)))?;
            }
        }
        // The blob sizes the new members' manifests declare, for their
        // repositories (as a fill's manifest records them).
        declared::record(&txn, &new_members)?;
        self.commit(txn, changes)?;
        Ok(committed)
    }
}

/// Moves an existing row's access time forward (imported content is
/// wanted), its size and charge kept.
fn touch(content: &mut Content<'_>, kind: Kind, hex: &str, now_ms: u64) -> Result<(), redb::Error> {
    if let Some((size, before)) = content.get(kind, hex)? {
        if now_ms > before {
            content.put(kind, hex, size, now_ms, None)?;
        }
    }
    Ok(())
}
