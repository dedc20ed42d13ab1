//! The start-up check of the blob files against the index, done after
//! larder is already serving: start-up itself reads only the index's
//! running byte total, so it costs the same at 10^6 blobs as at none
//! (benches/scale.rs). Shard by shard, in the blocking pool, with what
//! makes it safe beside live traffic:
//! - a row whose file was missing when the folder was listed is looked at
//!   again (a fill may have committed it since) and then removed the way
//!   eviction removes content;
//! - files without a row are judged while marked as being removed, so no
//!   fill renames a file into place meanwhile; a digest with a fill in
//!   flight is that fill's business, and one committed meanwhile is left.
//!
//! Only a file that is genuinely not there (NotFound) drops its row; one
//! that cannot be looked at (EACCES, EIO, ENOTDIR) keeps it and is
//! counted as unreadable, so a transient error never loses a blob.
//!
//! Until it is done, a missing file is still found when it is first opened
//! (which drops its row), and an orphan is merely not served yet.

use std::io;
use std::time::{Instant, SystemTime};

use super::reconcile::{self, Report};
use crate::blocking::blocking;
use crate::cache::index::Kind;
use crate::cache::store::disk::Store;
use crate::cache::{Cache, unix_ms};
use crate::error::Error;
use crate::metrics::metrics;
use crate::oci::Digest;
use crate::shutdown::Shutdown;

impl Cache {
    /// Runs the check over every shard, or until `shutdown`; logs what it
    /// found and repaired.
    pub(super) async fn reconcile_live(&self, shutdown: &Shutdown) {
        let started = Instant::now();
        metrics().cache_reconcile_running.set(1);
        let result = self.reconcile_shards(shutdown).await;
        metrics().cache_reconcile_running.set(0);
        match result {
            Ok(report) if report.adopted > 0 || report.bad() > 0 => {
                tracing::warn!(
                    ?report,
                    elapsed_ms = started.elapsed().as_millis(),
                    "reconciled the index with the blob files"
                )
            }
            Ok(report) => {
                tracing::info!(
                    blobs = report.ok,
                    elapsed_ms = started.elapsed().as_millis(),
                    "blob files match the index"
                )
            }
            Err(e) => tracing::warn!(error = %e, "checking the blob files against the index failed"),
        }
    }

    async fn reconcile_shards(&self, shutdown: &Shutdown) -> Result<Report, Error> {
        let mut report = Report::default();
        let store = self.store.clone();
        report = blocking(move || {
            reconcile::settle_junk(&store.stray_files()?, "not in a shard folder", true, &mut report)?;
            Ok(report)
        })
        .await?;
        for shard in Store::shards() {
            if shutdown.has_changed().unwrap_or(true) {
                break;
            }
            report = self.reconcile_shard(shard, report).await?;
        }
        Ok(report)
    }

    async fn reconcile_shard(&self, shard: String, mut report: Report) -> Result<Report, Error> {
        let (store, index) = (self.store.clone(), self.index.clone());
        let (diff, missing, mut report) = blocking(move || {
            let diff = reconcile::compare_shard(&store, &index, &shard, false, &mut ())?;
            report.ok += diff.ok;
            report.blob_bytes += diff.ok_bytes;
            reconcile::settle_junk(&diff.junk, "not a blob file name", true, &mut report)?;
            // Listed before the rows were read: a blob committed in between
            // looks missing, so look again.
            let missing = still_missing(&diff.bad_rows, |d| store.blob_path(d).try_exists(), &mut report);
            Ok((diff, missing, report))
        })
        .await?;
        if !missing.is_empty() {
            for removed in self.remove_content(missing).await? {
                report.bad_row(&removed.digest, "file is missing");
            }
        }
        if diff.orphans.is_empty() {
            return Ok(report);
        }
        let marked = self.fills.begin_removal(diff.orphans);
        let (store, index, digests) = (self.store.clone(), self.index.clone(), marked.clone());
        let settled = blocking(move || {
            let now = unix_ms(SystemTime::now());
            let added = reconcile::settle_orphans(&store, &index, &digests, true, now, &mut report, &mut ())?;
            Ok((added, report))
        })
        .await;
        self.fills.end_removal(&marked);
        let (added, report) = settled?;
        self.evictor.added(added);
        Ok(report)
    }
}

/// The rows of `bad_rows` whose file `exists` says, looked at again, is
/// genuinely not there: a file that is there again (committed meanwhile)
/// keeps its row, and so does one that cannot be looked at (any error but
/// NotFound, which `Path::try_exists` reports as `Ok(false)`), counted in
/// `report` and logged.
fn still_missing(
    bad_rows: &[(Digest, String)],
    exists: impl Fn(&Digest) -> io::Result<bool>,
    report: &mut Report,
) -> Vec<(Kind, Digest)> {
    let mut missing = Vec::new();
    for (digest, _) in bad_rows {
        match exists(digest) {
            Ok(false) => missing.push((Kind::Blob, *digest)),
            Ok(true) => {}
            Err(e) => {
                tracing::warn!(%digest, error = %e, "cannot look at a blob file; keeping its row");
                report.unreadable_row(digest, &e);
            }
        }
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> Digest {
        Digest::of(&[n])
    }

    #[test]
    fn only_a_file_that_is_not_there_drops_its_row() {
        let (gone, back, denied, broken) = (digest(1), digest(2), digest(3), digest(4));
        let rows: Vec<_> = [gone, back, denied, broken].iter().map(|d| (*d, "file is missing".to_owned())).collect();
        let mut report = Report::default();
        let missing = still_missing(
            &rows,
            |d| match d {
                d if *d == gone => Ok(false),
                d if *d == back => Ok(true),
                d if *d == denied => Err(io::Error::from(io::ErrorKind::PermissionDenied)),
                _ => Err(io::Error::other("EIO")),
            },
            &mut report,
        );
        assert_eq!(missing, vec![(Kind::Blob, gone)], "EACCES and EIO keep the row");
        assert_eq!(report.unreadable, 2);
        assert_eq!(report.problems.len(), 2, "each one is reported");
    }

    #[test]
    fn a_path_that_cannot_be_looked_at_is_not_reported_missing() {
        // As root no permission stops stat(2); a path through a regular
        // file gives ENOTDIR, an error that is not NotFound.
        let dir = tempfile::tempdir().expect("temp dir");
        let shard = dir.path().join("ab");
        std::fs::write(&shard, b"not a folder").expect("a file where the shard folder goes");
        let through_file = shard.join("abcd");
        let absent = dir.path().join("cd").join("cdef");
        let (unreadable, gone) = (digest(5), digest(6));
        let rows = vec![(unreadable, String::new()), (gone, String::new())];
        let mut report = Report::default();
        let missing = still_missing(
            &rows,
            |d| if *d == unreadable { through_file.try_exists() } else { absent.try_exists() },
            &mut report,
        );
        assert_eq!(missing, vec![(Kind::Blob, gone)]);
        assert_eq!(report.unreadable, 1, "ENOTDIR keeps the row");
    }
}
