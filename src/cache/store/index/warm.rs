//! The digests of the warm images, kept in the index so that what they pin
//! (the current digest and the one before it, so that a rollback is warm
//! too) is known from the first moment after a restart, before upstream
//! was asked anything.

use redb::{ReadableDatabase, ReadableTable};

use super::{Index, WARM, begin_write};
use crate::oci::Digest;

/// A warm image's digests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WarmRow {
    pub digest: Digest,
    /// The digest before the last move, if the reference moved.
    pub previous: Option<Digest>,
    /// Unix millis when the reference was first seen at `digest`.
    pub seen_ms: u64,
}

impl Index {
    /// Every warm row, by key ("upstream\0repo\0reference").
    pub fn warm_rows(&self) -> Result<Vec<(String, WarmRow)>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(WARM)?;
        let mut rows = Vec::new();
        for row in table.iter()? {
            let (key, value) = row?;
            let (digest, previous, seen_ms) = value.value();
            let Ok(digest) = digest.parse() else { continue };
            let previous = previous.parse().ok();
            rows.push((key.value().to_owned(), WarmRow { digest, previous, seen_ms }));
        }
        Ok(rows)
    }

    /// Records a warm image's digests.
    pub fn set_warm_row(&self, key: &str, row: &WarmRow) -> Result<(), redb::Error> {
        let txn = begin_write(&self.db)?;
        {
            let mut table = txn.open_table(WARM)?;
            let previous = row.previous.map(|d| d.to_string()).unwrap_or_default();
            table.insert(key, (row.digest.to_string().as_str(), previous.as_str(), row.seen_ms))?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Forgets the warm rows not in `keep` (images no longer listed): what
    /// they pinned may be evicted again.
    pub fn retain_warm_rows(&self, keep: &[String]) -> Result<usize, redb::Error> {
        let txn = begin_write(&self.db)?;
        let removed = {
            let mut table = txn.open_table(WARM)?;
            let mut gone = Vec::new();
            for row in table.iter()? {
                let key = row?.0.value().to_owned();
                if !keep.contains(&key) {
                    gone.push(key);
                }
            }
            for key in &gone {
                table.remove(key.as_str())?;
            }
            gone.len()
        };
        txn.commit()?;
        Ok(removed)
    }
}
