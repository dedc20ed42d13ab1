//! Makes the index and the blob files agree, after a crash or on demand
//! (`larder verify`). A crash can leave a renamed blob without its index row
//! (killed between rename and commit) or, after outside interference, a row
//! without its file or a file with the wrong content. Temp files are swept
//! by [`Store::prepare`](super::disk::Store::prepare).
//!
//! Synchronous, like the index: run it inside `spawn_blocking`.

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use super::disk::Store;
use super::index::{Entry, Index, Kind};
use crate::error::Error;
use crate::oci::{Digest, Hasher};

/// Read size when re-hashing blob files.
const HASH_CHUNK: usize = 1 << 20;

/// What a reconciliation found (and, when repairing, fixed).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Indexed blobs whose file is present (and, when verifying, correct).
    pub ok: u64,
    /// Files without a row whose content matched their name: indexed now.
    pub adopted: u64,
    /// Rows whose file was missing or of the wrong size or content.
    pub bad_rows: u64,
    /// Files that are not a blob of their name (or not a blob name at all).
    pub bad_files: u64,
    /// One line per problem, for the operator.
    pub problems: Vec<String>,
    /// Bytes of the blobs found good or adopted.
    pub blob_bytes: u64,
}

impl Report {
    pub fn bad(&self) -> u64 {
        self.bad_rows + self.bad_files
    }
}

/// Compares the index with the files. `rehash` re-reads every indexed file
/// and checks its size and digest (slow: `larder verify`). Without it
/// (start-up) a row only needs its file to exist: one walk of the blob
/// folders instead of a `stat` per row, which was most of the start-up
/// time at 10^6 blobs (benches/startup.rs). A file of the wrong size is
/// then caught when it is first opened, which drops its row. `repair`
/// removes bad rows and files and indexes adopted ones; without it,
/// nothing is changed.
pub fn reconcile(store: &Store, index: &Index, rehash: bool, repair: bool, now_ms: u64) -> Result<Report, Error> {
    let mut report = Report::default();

    // Every file named like a blob, in its right folder; others are bad.
    let mut files: HashSet<Digest> = HashSet::new();
    store.visit_blob_files(|path| {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        match format!("sha256:{name}").parse::<Digest>().ok().filter(|d| store.blob_path(d) == path) {
            Some(d) => {
                files.insert(d);
            }
            None => {
                report.bad_files += 1;
                report.problems.push(format!("{}: not a blob file name", path.display()));
                if repair {
                    std::fs::remove_file(&path)?;
                }
            }
        }
        Ok(())
    })?;

    // Every row against its file; what is left in `files` has no row.
    let mut bad_entries: Vec<Entry> = Vec::new();
    for row in index.entries(Kind::Blob)? {
        let problem = if !files.remove(&row.digest) {
            Some("file is missing".to_owned())
        } else if rehash {
            let path = store.blob_path(&row.digest);
            match std::fs::metadata(&path) {
                Err(e) => Some(format!("cannot stat: {e}")),
                Ok(m) if m.len() != row.size => Some(format!("file has {} bytes, index says {}", m.len(), row.size)),
                Ok(_) => match hash_file(&path) {
                    Ok(d) if d == row.digest => None,
                    Ok(d) => Some(format!("content hashes to {d}")),
                    Err(e) => Some(format!("cannot read: {e}")),
                },
            }
        } else {
            None
        };
        match problem {
            None => {
                report.ok += 1;
                report.blob_bytes += row.size;
            }
            Some(p) => {
                report.bad_rows += 1;
                report.problems.push(format!("{}: {p}", row.digest));
                bad_entries.push(row);
            }
        }
    }
    if repair && !bad_entries.is_empty() {
        let keys: Vec<(Kind, Digest)> = bad_entries.iter().map(|e| (e.kind, e.digest)).collect();
        index.remove_content(&keys)?;
        for e in &bad_entries {
            let _ = std::fs::remove_file(store.blob_path(&e.digest));
        }
    }

    // Files without a row: a crash between rename and index commit leaves
    // a correct one; anything else is bad.
    let mut adopted = Vec::new();
    for d in files {
        let path = store.blob_path(&d);
        match hash_file(&path) {
            Ok(actual) if actual == d => {
                let size = std::fs::metadata(&path)?.len();
                report.adopted += 1;
                report.blob_bytes += size;
                adopted.push((d, size));
            }
            Ok(actual) => {
                report.bad_files += 1;
                report.problems.push(format!("{}: unindexed file hashes to {actual}", path.display()));
                if repair {
                    std::fs::remove_file(&path)?;
                }
            }
            Err(e) => {
                report.bad_files += 1;
                report.problems.push(format!("{}: cannot read: {e}", path.display()));
            }
        }
    }
    if repair && !adopted.is_empty() {
        index.adopt_blobs(&adopted, now_ms)?;
    }
    Ok(report)
}

fn hash_file(path: &Path) -> std::io::Result<Digest> {
    let mut file = File::open(path)?;
    let mut hasher = Hasher::default();
    let mut buf = vec![0u8; HASH_CHUNK];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(hasher.finish());
        }
        hasher.update(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixture {
        _dir: tempfile::TempDir,
        store: Store,
        index: Index,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path()).unwrap();
        store.prepare().unwrap();
        let index = Index::open(&store.index_path()).unwrap();
        Fixture { _dir: dir, store, index }
    }

    /// Writes `bytes` as the blob file for `digest` (right or wrong).
    fn plant(f: &Fixture, digest: &Digest, bytes: &[u8]) {
        let path = f.store.blob_path(digest);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn crash_leftovers_are_repaired() {
        let f = fixture();
        let good = Digest::of(b"good");
        plant(&f, &good, b"good");
        f.index.insert_blob(&good, 4, "u\0r\0x", 1).unwrap();
        // Killed between rename and index commit: a correct file without a row.
        let orphan = Digest::of(b"orphan");
        plant(&f, &orphan, b"orphan");
        // A row whose file vanished, and a file whose bytes are wrong.
        let vanished = Digest::of(b"vanished");
        f.index.insert_blob(&vanished, 8, "u\0r\0y", 1).unwrap();
        let corrupt = Digest::of(b"expected");
        plant(&f, &corrupt, b"something else");

        let found = reconcile(&f.store, &f.index, false, true, 5).unwrap();
        assert_eq!((found.ok, found.adopted, found.bad_rows, found.bad_files), (1, 1, 1, 1), "{found:?}");
        assert_eq!(f.index.blob_size(&orphan).unwrap(), Some(6), "the orphan is adopted");
        assert_eq!(f.index.blob_size(&vanished).unwrap(), None);
        assert!(!f.store.blob_path(&corrupt).exists());

        let again = reconcile(&f.store, &f.index, true, false, 6).unwrap();
        assert_eq!((again.ok, again.bad()), (2, 0), "{again:?}");
        assert_eq!(again.blob_bytes, 4 + 6, "good + adopted");
    }

    #[test]
    fn verify_rehashes_indexed_files_and_reports_without_repair() {
        let f = fixture();
        let d = Digest::of(b"12345");
        plant(&f, &d, b"12X45");
        f.index.insert_blob(&d, 5, "u\0r\0x", 1).unwrap();
        assert_eq!(
            reconcile(&f.store, &f.index, false, false, 1).unwrap().bad(),
            0,
            "a present file passes the start-up check"
        );
        let report = reconcile(&f.store, &f.index, true, false, 1).unwrap();
        assert_eq!(report.bad_rows, 1, "{report:?}");
        assert!(f.store.blob_path(&d).exists(), "nothing removed without repair");
        reconcile(&f.store, &f.index, true, true, 1).unwrap();
        assert!(!f.store.blob_path(&d).exists());
        assert_eq!(f.index.blob_size(&d).unwrap(), None);
    }
}
