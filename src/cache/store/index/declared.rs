//! The blob sizes manifests declare, per repository, kept with the
//! manifests themselves: a fill for a repository is bounded by the size a
//! manifest of that repository declared for the blob (and fails on any
//! other size), and that bound must hold after a restart as it did
//! before. Rows are written whenever a manifest becomes a member of a
//! repository (stored for it, or confirmed there by upstream), in the
//! same transaction, and go with the repository's membership rows when it
//! is purged. Like membership rows they outlive the manifest's eviction:
//! a blob's size does not change.

use redb::{ReadableDatabase, ReadableTable, Table, WriteTransaction};

use super::{DECLARED, Index, MANIFESTS, MEMBERS, keys_under};
use crate::oci::{MediaType, inspect_manifest};

/// Records the blob sizes declared by each of `members`
/// ("upstream\0repo\0digest hex") that is a stored manifest, under that
/// repository: "upstream\0repo\0blob hex" → size. Members that are blobs
/// (or manifests not stored) cost one lookup.
pub(super) fn record(txn: &WriteTransaction, members: &[String]) -> Result<(), redb::Error> {
    let manifests = txn.open_table(MANIFESTS)?;
    let mut declared = txn.open_table(DECLARED)?;
    for member in members {
        let Some((owner, hex)) = member.rsplit_once('\0') else { continue };
        let Some(row) = manifests.get(hex)? else { continue };
        let (media_type, bytes) = row.value();
        record_manifest(&mut declared, owner, MediaType::parse(media_type), bytes)?;
    }
    Ok(())
}

/// Records what one manifest (`bytes`) declares under `owner`
/// ("upstream\0repo"). A manifest that does not parse declares nothing.
pub(super) fn record_manifest(
    declared: &mut Table<'_, &'static str, u64>,
    owner: &str,
    media_type: Option<MediaType>,
    bytes: &[u8],
) -> Result<(), redb::Error> {
    let Ok((_, refs)) = inspect_manifest(bytes, media_type) else { return Ok(()) };
    for (blob, size) in refs.blobs.iter().zip(&refs.blob_sizes) {
        if let Some(size) = size {
            declared.insert(format!("{owner}\0{}", blob.hex().as_str()).as_str(), *size)?;
        }
    }
    Ok(())
}

/// Version 5: the rows of every manifest that is a member of a repository.
pub(super) fn migrate(txn: &WriteTransaction) -> Result<(), redb::Error> {
    let members = txn.open_table(MEMBERS)?;
    let manifests = txn.open_table(MANIFESTS)?;
    let mut declared = txn.open_table(DECLARED)?;
    for row in members.iter()? {
        let row = row?;
        let Some((owner, hex)) = row.0.value().rsplit_once('\0') else { continue };
        let Some(manifest) = manifests.get(hex)? else { continue };
        let (media_type, bytes) = manifest.value();
        record_manifest(&mut declared, owner, MediaType::parse(media_type), bytes)?;
    }
    Ok(())
}

/// Removes the rows under `prefix` ("upstream\0" or "upstream\0repo\0").
pub(super) fn purge(txn: &WriteTransaction, prefix: &str) -> Result<(), redb::Error> {
    let mut declared = txn.open_table(DECLARED)?;
    for key in keys_under(&declared, prefix)? {
        declared.remove(key.as_str())?;
    }
    Ok(())
}

impl Index {
    /// The size a manifest of the repository declared for a blob, by its
    /// membership key ("upstream\0repo\0blob hex").
    pub fn declared_size(&self, key: &str) -> Result<Option<u64>, redb::Error> {
        let txn = self.db.begin_read()?;
        Ok(txn.open_table(DECLARED)?.get(key)?.map(|v| v.value()))
    }
}
