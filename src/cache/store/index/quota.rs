//! What each upstream is charged for, for per-upstream quotas
//! (`[[upstream]] max_size`).
//!
//! Content is stored once however many repositories and upstreams
//! reference it, so each blob or manifest is charged to **one** upstream:
//! the one that uses it, that is, whose request served it most recently
//! (first the one it was fetched for). When another upstream's use is the
//! most recent, the charge moves to it with the access time: a base layer
//! that upstream B pulls all day is in B's share, not in that of A, which
//! fetched it once. The upstreams' totals then add up to the cache's usage
//! (a file adopted at start-up or by `verify --repair` counts in the total
//! only until the first upstream serves it, which it is then charged to).
//! Charging every referencing upstream in full would count shared bytes
//! twice and let one upstream's eviction take content away from another.
//!
//! Pinned content stays charged to an upstream that pins it (`pins`):
//! another upstream's use moves only its access time, so that one
//! upstream's pins never fill another's share.
//!
//! When an upstream's quota evicts an item that another upstream's
//! repositories also reference, the item is handed over instead of being
//! deleted: to the first of those upstreams that has room for it under its
//! own quota (or has none), else to the first that holds something used
//! less recently than it (that upstream's own eviction takes that first).
//! Only when every other upstream using it holds nothing older is it
//! removed: then it is the least recently used content of all of them.
//! A purge that leaves an item referenced elsewhere hands it over too.

use std::collections::HashMap;
use std::sync::Mutex;

use redb::{Database, ReadableDatabase, ReadableTable};

use super::{
    BLOBS, CHARGED, Content, Entry, Index, Kind, MANIFEST_META, MEMBERS_BY_DIGEST, META, UPSTREAM_ACCESS, Victims,
    begin_write,
};
use crate::oci::Digest;

/// The `meta` key of an upstream's running total.
pub(super) fn bytes_key(upstream: &str) -> String {
    format!("bytes\0{upstream}")
}

/// What each upstream's total moves by in one transaction.
#[derive(Debug, Default)]
pub(super) struct Changes(HashMap<String, i64>);

impl Changes {
    pub(super) fn add(&mut self, upstream: &str, bytes: i64) {
        if bytes != 0 {
            *self.0.entry(upstream.to_owned()).or_default() += bytes;
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&String, &i64)> {
        self.0.iter().filter(|(_, change)| **change != 0)
    }
}

/// Each upstream's running total, in memory, as of the last commit: read
/// when the index opens, moved by every commit. The evictor reads it on
/// every new item (a std Mutex, never held across `.await`).
#[derive(Debug, Default)]
pub struct Charged {
    bytes: Mutex<HashMap<String, u64>>,
}

impl Charged {
    pub(super) fn read(db: &Database) -> Result<Charged, redb::Error> {
        let txn = db.begin_read()?;
        let meta = txn.open_table(META)?;
        let mut bytes = HashMap::new();
        for row in meta.range("bytes\0".."bytes\u{1}")? {
            let (key, value) = row?;
            if let Some(upstream) = key.value().strip_prefix("bytes\0") {
                bytes.insert(upstream.to_owned(), value.value());
            }
        }
        for (upstream, value) in &bytes {
            set_gauge(upstream, *value);
        }
        Ok(Charged { bytes: Mutex::new(bytes) })
    }

    pub(super) fn apply(&self, changes: &Changes) {
        let mut bytes = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        for (upstream, change) in changes.iter() {
            let total = bytes.entry(upstream.clone()).or_default();
            *total = total.saturating_add_signed(*change);
            set_gauge(upstream, *total);
        }
    }

    /// Bytes charged to `upstream`.
    pub fn get(&self, upstream: &str) -> u64 {
        self.bytes.lock().unwrap_or_else(|p| p.into_inner()).get(upstream).copied().unwrap_or(0)
    }
}

fn set_gauge(upstream: &str, bytes: u64) {
    crate::metrics::metrics()
        .upstream_cache_size
        .with_label_values(&[upstream])
        .set(i64::try_from(bytes).unwrap_or(i64::MAX));
}

/// The upstreams whose repositories reference `hex` (membership rows), each
/// once, in key order.
pub(super) fn referencing_upstreams(
    by_digest: &impl ReadableTable<&'static str, ()>,
    hex: &str,
) -> Result<Vec<String>, redb::Error> {
    let prefix = format!("{hex}\0");
    let mut upstreams: Vec<String> = Vec::new();
    for row in by_digest.range(prefix.as_str()..)? {
        let (key, _) = row?;
        let Some(rest) = key.value().strip_prefix(prefix.as_str()) else { break };
        let upstream = rest.split('\0').next().unwrap_or_default();
        if !upstream.is_empty() && upstreams.last().is_none_or(|u| u != upstream) {
            upstreams.push(upstream.to_owned());
        }
    }
    upstreams.dedup();
    Ok(upstreams)
}

impl Content<'_> {
    /// When the least recently used item charged to `upstream` was last used.
    pub(super) fn oldest_use_of(&self, upstream: &str) -> Result<Option<u64>, redb::Error> {
        let Some(row) = self.upstream_access.range((upstream, 0, 0, "")..)?.next() else { return Ok(None) };
        let (key, _) = row?;
        let (owner, at, _, _) = key.value();
        Ok((owner == upstream).then_some(at))
    }

    /// Charges a row that no upstream is charged for (an adopted file) to
    /// `to`, its access time kept.
    pub(super) fn charge_unowned(&mut self, kind: Kind, hex: &str, to: &str) -> Result<(), redb::Error> {
        let Some((size, accessed_ms)) = self.get(kind, hex)? else { return Ok(()) };
        self.upstream_access.insert((to, accessed_ms, kind.code(), hex), ())?;
        self.charged.insert((kind.code(), hex), to)?;
        self.charges.add(to, size as i64);
        Ok(())
    }

    /// Charges a row to `to` instead of `from`, its access time kept.
    pub(super) fn recharge(&mut self, kind: Kind, hex: &str, from: &str, to: &str) -> Result<(), redb::Error> {
        let Some((size, accessed_ms)) = self.get(kind, hex)? else { return Ok(()) };
        self.upstream_access.remove((from, accessed_ms, kind.code(), hex))?;
        self.upstream_access.insert((to, accessed_ms, kind.code(), hex), ())?;
        self.charged.insert((kind.code(), hex), to)?;
        self.charges.add(from, -(size as i64));
        self.charges.add(to, size as i64);
        Ok(())
    }
}

/// A stored item's size, and the upstream it is charged to (`None`: a
/// file adopted for no repository).
pub type Charge = (u64, Option<String>);

/// What a quota's eviction round did.
#[derive(Debug, Default)]
pub struct UpstreamEviction {
    /// Removed from the index (the caller unlinks the blob files).
    pub removed: Vec<Entry>,
    /// Items handed over to another upstream that references them.
    pub handed_over: usize,
    pub handed_over_bytes: u64,
}

impl Index {
    /// [`Index::least_recently_used`] among the items charged to `upstream`.
    pub fn least_recently_used_of(
        &self,
        upstream: &str,
        bytes: u64,
        keep: &dyn Fn(Kind, &Digest) -> bool,
    ) -> Result<Vec<Entry>, redb::Error> {
        let txn = self.db.begin_read()?;
        let access = txn.open_table(UPSTREAM_ACCESS)?;
        let mut victims = Victims::open(&txn, bytes)?;
        for row in access.range((upstream, 0, 0, "")..)? {
            if victims.enough() {
                break;
            }
            let (key, _) = row?;
            let (owner, accessed_ms, code, hex) = key.value();
            if owner != upstream {
                break;
            }
            victims.offer(accessed_ms, code, hex, keep)?;
        }
        Ok(victims.out)
    }

    /// Evicts `victims` for `upstream`'s quota, in one transaction: each one
    /// still charged to `upstream` that another upstream's repositories
    /// reference is handed over to the first of them `takes(name, size)`
    /// accepts (it has room), or else to the first of them that is charged
    /// for an item used less recently than the victim; the others are
    /// removed. Returns what was removed and what was handed over.
    pub fn evict_for_upstream(
        &self,
        upstream: &str,
        victims: &[(Kind, Digest)],
        takes: &mut dyn FnMut(&str, u64) -> bool,
    ) -> Result<UpstreamEviction, redb::Error> {
        let txn = begin_write(&self.db)?;
        let mut done = UpstreamEviction::default();
        let changes = {
            let by_digest = txn.open_table(MEMBERS_BY_DIGEST)?;
            let mut content = Content::open(&txn)?;
            for (kind, digest) in victims {
                let hex = digest.hex();
                if content.charged_to(*kind, hex.as_str())?.as_deref() != Some(upstream) {
                    continue;
                }
                let Some((size, accessed_ms)) = content.get(*kind, hex.as_str())? else { continue };
                let others = referencing_upstreams(&by_digest, hex.as_str())?;
                let others: Vec<&String> = others.iter().filter(|o| o.as_str() != upstream).collect();
                let with_room = others.iter().find(|o| takes(o, size)).copied();
                let with_older = || -> Result<Option<&String>, redb::Error> {
                    for other in &others {
                        if content.oldest_use_of(other)?.is_some_and(|oldest| oldest < accessed_ms) {
                            return Ok(Some(*other));
                        }
                    }
                    Ok(None)
                };
                let to = match with_room {
                    Some(to) => Some(to),
                    None => with_older()?,
                };
                match to {
                    Some(to) => {
                        content.recharge(*kind, hex.as_str(), upstream, to)?;
                        done.handed_over += 1;
                        done.handed_over_bytes += size;
                    }
                    None => done.removed.extend(content.take(*kind, digest)?),
                }
            }
            content.close()?
        };
        self.commit(txn, changes)?;
        Ok(done)
    }

    /// Charges each item to its upstream, unless it is charged to one of
    /// the upstreams `allowed` names for it already (pinned content goes to
    /// an upstream that pins it). One transaction; rows that are gone are
    /// skipped.
    pub fn charge_to(&self, items: &[((Kind, Digest), Vec<String>)]) -> Result<(), redb::Error> {
        let txn = begin_write(&self.db)?;
        let changes = {
            let mut content = Content::open(&txn)?;
            for ((kind, digest), allowed) in items {
                let hex = digest.hex();
                let Some(to) = allowed.first() else { continue };
                match content.charged_to(*kind, hex.as_str())? {
                    Some(owner) if allowed.contains(&owner) => {}
                    Some(owner) => content.recharge(*kind, hex.as_str(), &owner, to)?,
                    None => content.charge_unowned(*kind, hex.as_str(), to)?,
                }
            }
            content.close()?
        };
        self.commit(txn, changes)
    }

    /// The size of each item and the upstream it is charged to (`None`
    /// where there is no row), read in one transaction.
    pub fn charges_of(&self, items: &[(Kind, Digest)]) -> Result<Vec<Option<Charge>>, redb::Error> {
        let txn = self.db.begin_read()?;
        let (blobs, manifests, charged) =
            (txn.open_table(BLOBS)?, txn.open_table(MANIFEST_META)?, txn.open_table(CHARGED)?);
        items
            .iter()
            .map(|(kind, digest)| {
                let hex = digest.hex();
                let table = if *kind == Kind::Blob { &blobs } else { &manifests };
                let Some(size) = table.get(hex.as_str())?.map(|v| v.value().0) else { return Ok(None) };
                let owner = charged.get((kind.code(), hex.as_str()))?.map(|v| v.value().to_owned());
                Ok(Some((size, owner)))
            })
            .collect()
    }
}
