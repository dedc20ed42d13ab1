//! Migrations: the secondary tables and totals an index written by an
//! older larder lacks, built once from its rows when it is opened.

use std::collections::HashMap;

use redb::{ReadableTable, ReadableTableMetadata, Table, WriteTransaction};

use super::{
    ACCESS, BYTES_KEY, CHARGED, Kind, MEMBERS, MEMBERS_BY_DIGEST, META, UPSTREAM_ACCESS, by_digest_key, quota,
};

/// Builds the secondary tables and totals from the rows of an older index.
pub(super) fn migrate(txn: &WriteTransaction, from: u64) -> Result<(), redb::Error> {
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
    if from < 4 {
        migrate_to_4(txn)?;
    }
    if from < 5 {
        super::declared::migrate(txn)?;
    }
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

/// Version 4: every row charged to the first upstream (in key order) whose
/// repositories reference it, with each upstream's access order and total.
fn migrate_to_4(txn: &WriteTransaction) -> Result<(), redb::Error> {
    let by_digest = txn.open_table(MEMBERS_BY_DIGEST)?;
    let mut charged: Table<(u8, &str), &str> = txn.open_table(CHARGED)?;
    let mut access = txn.open_table(UPSTREAM_ACCESS)?;
    let mut totals: HashMap<String, u64> = HashMap::new();
    for kind in [Kind::Blob, Kind::Manifest] {
        let rows = txn.open_table(kind.meta())?;
        for row in rows.iter()? {
            let (key, value) = row?;
            let (hex, (size, accessed_ms)) = (key.value(), value.value());
            let Some(upstream) = quota::referencing_upstreams(&by_digest, hex)?.into_iter().next() else { continue };
            charged.insert((kind.code(), hex), upstream.as_str())?;
            access.insert((upstream.as_str(), accessed_ms, kind.code(), hex), ())?;
            *totals.entry(upstream).or_default() += size;
        }
    }
    let mut meta = txn.open_table(META)?;
    for (upstream, total) in totals {
        meta.insert(quota::bytes_key(&upstream).as_str(), total)?;
    }
    Ok(())
}
