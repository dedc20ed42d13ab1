//! Read-only figures about what the cache holds, for the status page and
//! `larder status`: size against the limit, entries, and the largest and
//! most recently used repositories. Repositories are not a table of their
//! own: they are computed from the membership rows
//! ("upstream\0repo\0digest") and the blob and manifest rows (size, last
//! access), in one bounded scan on the blocking pool. The caller caches
//! the result briefly; nothing here is on a request path.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;

use super::Cache;
use super::index::{Entry, Kind};
use crate::blocking::blocking;
use crate::error::Error;

/// Membership rows one scan visits at most; beyond it the repository
/// figures cover the rows visited and say so (`complete: false`). Measured
/// at about 2 µs per row all told on 2 busy cores (10^5 rows with 2*10^4
/// blobs: 0.2 s), so the bound keeps one scan near 2 s of one
/// blocking-pool thread.
pub const MAX_MEMBER_ROWS_SCANNED: usize = 1_000_000;

/// What the cache holds, as of one scan.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Holdings {
    pub blobs: u64,
    pub manifests: u64,
    /// Membership rows: (upstream, repository, digest) triples.
    pub memberships: u64,
    pub repositories: u64,
    /// Largest repositories first (bytes of the content they reference;
    /// content shared between repositories counts for each).
    pub largest: Vec<RepositoryUsage>,
    /// Most recently used first.
    pub recent: Vec<RepositoryUsage>,
    /// Every membership row was visited (see [`MAX_MEMBER_ROWS_SCANNED`]).
    pub complete: bool,
}

/// One repository's share of the cache.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct RepositoryUsage {
    pub upstream: String,
    pub repository: String,
    /// Blobs and manifests cached for it.
    pub items: u64,
    pub bytes: u64,
    /// Latest access (unix millis) of any of its content, or when it was
    /// last granted content if that is later. Access times reach the index
    /// in batches, so this may lag by the flush interval.
    pub last_used_ms: u64,
}

impl Cache {
    /// `cache.max_size` in bytes.
    pub fn max_size(&self) -> u64 {
        self.config.max_size
    }

    /// The usage above which eviction starts, in bytes.
    pub fn high_watermark_bytes(&self) -> u64 {
        (self.config.max_size as f64 * self.config.high_watermark) as u64
    }

    /// Bytes charged to `upstream` (content it used most recently, or pins;
    /// see [`super::index::Charged`]).
    pub fn upstream_usage(&self, upstream: &str) -> u64 {
        self.evictor.charged(upstream)
    }

    /// `upstream`'s own `max_size`, if it has one.
    pub fn upstream_max_size(&self, upstream: &str) -> Option<u64> {
        self.config.upstream_max_size.iter().find(|(u, _)| u == upstream).map(|(_, max)| *max)
    }

    /// Scans the index for [`Holdings`], keeping the `top` largest and most
    /// recently used repositories.
    pub async fn holdings(&self, top: usize) -> Result<Holdings, Error> {
        let index = Arc::clone(&self.index);
        blocking(move || {
            let blobs = index.entries(Kind::Blob)?;
            let manifests = index.entries(Kind::Manifest)?;
            let mut holdings =
                Holdings { blobs: blobs.len() as u64, manifests: manifests.len() as u64, ..Default::default() };
            let content: HashMap<[u8; 64], Entry> =
                blobs.into_iter().chain(manifests).map(|e| (hex_key(e.digest.hex().as_str()), e)).collect();
            // Keyed by the row's "upstream\0repo" prefix: one allocation per
            // repository, not per row.
            let mut repos: HashMap<String, RepositoryUsage> = HashMap::new();
            holdings.complete = index.for_each_member(MAX_MEMBER_ROWS_SCANNED, |key, recorded_ms| {
                holdings.memberships += 1;
                let Some((prefix, hex)) = key.rsplit_once('\0') else { return };
                let Some(entry) = content.get(&hex_key(hex)) else { return };
                let usage = match repos.get_mut(prefix) {
                    Some(usage) => usage,
                    None => {
                        let Some((upstream, repo)) = prefix.split_once('\0') else { return };
                        let usage = RepositoryUsage {
                            upstream: upstream.to_owned(),
                            repository: repo.to_owned(),
                            ..Default::default()
                        };
                        repos.entry(prefix.to_owned()).or_insert(usage)
                    }
                };
                usage.items += 1;
                usage.bytes += entry.size;
                usage.last_used_ms = usage.last_used_ms.max(entry.accessed_ms).max(recorded_ms);
            })?;
            holdings.repositories = repos.len() as u64;
            let mut all: Vec<RepositoryUsage> = repos.into_values().collect();
            all.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.repository.cmp(&b.repository)));
            holdings.largest = all.iter().take(top).cloned().collect();
            all.sort_by(|a, b| b.last_used_ms.cmp(&a.last_used_ms).then_with(|| a.repository.cmp(&b.repository)));
            all.truncate(top);
            holdings.recent = all;
            Ok(holdings)
        })
        .await
    }
}

/// A digest's hex as a fixed-size map key (no allocation per row).
fn hex_key(hex: &str) -> [u8; 64] {
    let mut key = [0u8; 64];
    let n = hex.len().min(64);
    key[..n].copy_from_slice(&hex.as_bytes()[..n]);
    key
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::test_cache::temporary as cache;
    use crate::oci::Digest;

    #[tokio::test]
    async fn repositories_are_summed_from_membership_rows() {
        let (_dir, cache) = cache().await;
        let (a, b, m) = (Digest::of(b"a"), Digest::of(b"b"), Digest::of(b"{}"));
        let member = |repo: &str, d: &Digest| format!("hub\0{repo}\0{}", d.hex().as_str());
        let index = &cache.index;
        index.insert_blob(&a, 100, &member("team/app", &a), 1_000).unwrap();
        index.insert_blob(&b, 30, &member("team/app", &b), 2_000).unwrap();
        let media = crate::oci::MediaType::OciManifest;
        index.insert_manifest(&m, media, b"{}", None, &[member("team/app", &m)], 3_000).unwrap();
        // team/other shares blob b, recorded later: it is the most recent.
        index.add_members(&[member("team/other", &b)], 5_000).unwrap();

        let h = cache.holdings(10).await.unwrap();
        assert_eq!((h.blobs, h.manifests, h.memberships, h.repositories), (2, 1, 4, 2));
        assert!(h.complete);
        let app = RepositoryUsage {
            upstream: "hub".into(),
            repository: "team/app".into(),
            items: 3,
            bytes: 132,
            last_used_ms: 3_000,
        };
        let other = RepositoryUsage {
            upstream: "hub".into(),
            repository: "team/other".into(),
            items: 1,
            bytes: 30,
            last_used_ms: 5_000,
        };
        assert_eq!(h.largest, vec![app.clone(), other.clone()]);
        assert_eq!(h.recent, vec![other, app]);
        assert_eq!(cache.holdings(1).await.unwrap().largest.len(), 1);
        assert_eq!(cache.high_watermark_bytes(), (0.9 * (1u64 << 30) as f64) as u64);
    }
}
