//! Makes the index and the blob files agree, after a crash or on demand
//! (`larder verify`). A crash can leave a renamed blob without its index row
//! (killed between rename and commit) or, after outside interference, a row
//! without its file or a file with the wrong content. Temp files are swept
//! by [`Store::prepare`](crate::cache::store::disk::Store::prepare).
//!
//! The work goes one shard folder (`blobs/sha256/<xx>/`) at a time, against
//! the index rows of the same prefix, so memory stays at one folder's worth
//! at 10^6 blobs. [`reconcile`] is the offline pass (`larder verify`, the
//! cache folder to itself); a running larder does the same shard by shard
//! in the background after it is already serving (`Cache::reconcile_live`),
//! with the checks that make it safe beside fills and evictions.
//!
//! Synchronous, like the index: run it inside `spawn_blocking`.

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::cache::index::{Index, Kind};
use crate::cache::store::disk::Store;
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
    /// Rows whose file could not be looked at (EACCES, EIO): left as they
    /// are, for the first open of the file or the next check to settle.
    pub unreadable: u64,
    /// One line per problem, for the operator.
    pub problems: Vec<String>,
    /// Bytes of the blobs found good or adopted.
    pub blob_bytes: u64,
}

impl Report {
    pub fn bad(&self) -> u64 {
        self.bad_rows + self.bad_files + self.unreadable
    }

    pub(super) fn unreadable_row(&mut self, digest: &Digest, error: &std::io::Error) {
        self.unreadable += 1;
        self.problems.push(format!("{digest}: cannot look at its file, row kept: {error}"));
    }

    fn bad_file(&mut self, path: &Path, problem: &str) {
        self.bad_files += 1;
        self.problems.push(format!("{}: {problem}", path.display()));
    }

    pub(super) fn bad_row(&mut self, digest: &Digest, problem: &str) {
        self.bad_rows += 1;
        self.problems.push(format!("{digest}: {problem}"));
    }
}

/// What `larder verify` is told as it works (all no-ops by default; `()`
/// watches nothing), so that it can show progress.
pub trait Watch {
    /// The index was read: `blobs` blob rows of `bytes` in all to hash.
    fn counted(&mut self, _blobs: u64, _bytes: u64) {}
    /// Hashing the file of `digest` starts.
    fn hashing(&mut self, _digest: &Digest) {}
    /// `n` more bytes were hashed.
    fn hashed(&mut self, _n: u64) {}
}

impl Watch for () {}

/// How one shard folder and the index rows of its prefix disagree.
#[derive(Debug, Default)]
pub struct ShardDiff {
    /// Rows whose file is there (and, rehashing, right): count and bytes.
    pub ok: u64,
    pub ok_bytes: u64,
    /// Rows whose file is missing (or, rehashing, wrong), with the problem.
    pub bad_rows: Vec<(Digest, String)>,
    /// Files named like a blob of this shard that have no row.
    pub orphans: Vec<Digest>,
    /// Files in the folder that are not named like one of its blobs.
    pub junk: Vec<PathBuf>,
}

/// Compares shard `shard` (two hex digits) with its rows. The folder is
/// listed before the rows are read, so beside a running larder a blob
/// committed in between shows up as a bad row: the caller checks again.
/// `rehash` re-reads every indexed file and checks size and digest (slow:
/// `larder verify`); without it a row only needs its file to exist (a file
/// of the wrong size is caught when it is first opened, which drops its row).
pub fn compare_shard(
    store: &Store,
    index: &Index,
    shard: &str,
    rehash: bool,
    watch: &mut dyn Watch,
) -> Result<ShardDiff, Error> {
    let mut diff = ShardDiff::default();
    let mut files: HashSet<Digest> = HashSet::new();
    for path in store.shard_files(shard)? {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        match format!("sha256:{name}").parse::<Digest>().ok().filter(|d| store.blob_path(d) == path) {
            Some(d) => {
                files.insert(d);
            }
            None => diff.junk.push(path),
        }
    }
    for (digest, size) in index.blobs_under(shard)? {
        let problem = if !files.remove(&digest) {
            Some("file is missing".to_owned())
        } else if rehash {
            watch.hashing(&digest);
            check_file(&store.blob_path(&digest), &digest, size, watch)
        } else {
            None
        };
        match problem {
            None => {
                diff.ok += 1;
                diff.ok_bytes += size;
            }
            Some(p) => diff.bad_rows.push((digest, p)),
        }
    }
    diff.orphans = files.into_iter().collect();
    diff.orphans.sort();
    Ok(diff)
}

/// Why the file at `path` is not the blob `digest` of `size` bytes, if it is not.
fn check_file(path: &Path, digest: &Digest, size: u64, watch: &mut dyn Watch) -> Option<String> {
    match std::fs::metadata(path) {
        Err(e) => Some(format!("cannot stat: {e}")),
        Ok(m) if m.len() != size => Some(format!("file has {} bytes, index says {size}", m.len())),
        Ok(_) => match hash_file(path, watch) {
            Ok(d) if d == *digest => None,
            Ok(d) => Some(format!("content hashes to {d}")),
            Err(e) => Some(format!("cannot read: {e}")),
        },
    }
}

/// Files without a row: a crash between rename and index commit leaves a
/// correct one, which is indexed (`repair`); anything else is bad and
/// removed (`repair`). A digest that has a row by now (committed meanwhile)
/// is left alone. Returns the bytes newly indexed.
pub fn settle_orphans(
    store: &Store,
    index: &Index,
    orphans: &[Digest],
    repair: bool,
    now_ms: u64,
    report: &mut Report,
    watch: &mut dyn Watch,
) -> Result<u64, Error> {
    let mut adopted = Vec::new();
    for d in orphans {
        if index.blob_size(d)?.is_some() {
            continue;
        }
        let path = store.blob_path(d);
        watch.hashing(d);
        match hash_file(&path, watch) {
            Ok(actual) if actual == *d => {
                let size = std::fs::metadata(&path)?.len();
                report.adopted += 1;
                report.blob_bytes += size;
                adopted.push((*d, size));
            }
            Ok(actual) => {
                report.bad_file(&path, &format!("unindexed file hashes to {actual}"));
                if repair {
                    store.remove_blob(d)?;
                }
            }
            // Gone meanwhile (evicted): nothing to settle.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => report.bad_file(&path, &format!("cannot read: {e}")),
        }
    }
    if repair && !adopted.is_empty() {
        return Ok(index.adopt_blobs(&adopted, now_ms)?);
    }
    Ok(0)
}

/// Removes files that are no blob at all (when repairing), reporting each.
pub fn settle_junk(paths: &[PathBuf], problem: &str, repair: bool, report: &mut Report) -> Result<(), Error> {
    for path in paths {
        report.bad_file(path, problem);
        if repair {
            std::fs::remove_file(path)?;
        }
    }
    Ok(())
}

/// The offline pass over the whole store, shard by shard: `repair` removes
/// bad rows and files and indexes adopted ones; without it, nothing is
/// changed. Needs the cache folder to itself.
/// `watch` is told what it counts and hashes (when it rehashes, the
/// index's rows are counted first: one read per shard).
pub fn reconcile(
    store: &Store,
    index: &Index,
    rehash: bool,
    repair: bool,
    now_ms: u64,
    watch: &mut dyn Watch,
) -> Result<Report, Error> {
    if rehash {
        let (mut blobs, mut bytes) = (0u64, 0u64);
        for shard in Store::shards() {
            for (_, size) in index.blobs_under(&shard)? {
                blobs += 1;
                bytes += size;
            }
        }
        watch.counted(blobs, bytes);
    }
    let mut report = Report::default();
    settle_junk(&store.stray_files()?, "not in a shard folder", repair, &mut report)?;
    for shard in Store::shards() {
        let diff = compare_shard(store, index, &shard, rehash, watch)?;
        report.ok += diff.ok;
        report.blob_bytes += diff.ok_bytes;
        settle_junk(&diff.junk, "not a blob file name", repair, &mut report)?;
        for (digest, problem) in &diff.bad_rows {
            report.bad_row(digest, problem);
        }
        if repair && !diff.bad_rows.is_empty() {
            let keys: Vec<(Kind, Digest)> = diff.bad_rows.iter().map(|(d, _)| (Kind::Blob, *d)).collect();
            index.remove_content(&keys)?;
            for (d, _) in &diff.bad_rows {
                store.remove_blob(d)?;
            }
        }
        settle_orphans(store, index, &diff.orphans, repair, now_ms, &mut report, watch)?;
    }
    Ok(report)
}

fn hash_file(path: &Path, watch: &mut dyn Watch) -> std::io::Result<Digest> {
    let mut file = File::open(path)?;
    let mut hasher = Hasher::default();
    let mut buf = vec![0u8; HASH_CHUNK];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(hasher.finish());
        }
        hasher.update(&buf[..n]);
        watch.hashed(n as u64);
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

        let found = reconcile(&f.store, &f.index, false, true, 5, &mut ()).unwrap();
        assert_eq!((found.ok, found.adopted, found.bad_rows, found.bad_files), (1, 1, 1, 1), "{found:?}");
        assert_eq!(f.index.blob_size(&orphan).unwrap(), Some(6), "the orphan is adopted");
        assert_eq!(f.index.blob_size(&vanished).unwrap(), None);
        assert!(!f.store.blob_path(&corrupt).exists());

        let again = reconcile(&f.store, &f.index, true, false, 6, &mut ()).unwrap();
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
            reconcile(&f.store, &f.index, false, false, 1, &mut ()).unwrap().bad(),
            0,
            "a present file passes the start-up check"
        );
        let report = reconcile(&f.store, &f.index, true, false, 1, &mut ()).unwrap();
        assert_eq!(report.bad_rows, 1, "{report:?}");
        assert!(f.store.blob_path(&d).exists(), "nothing removed without repair");
        reconcile(&f.store, &f.index, true, true, 1, &mut ()).unwrap();
        assert!(!f.store.blob_path(&d).exists());
        assert_eq!(f.index.blob_size(&d).unwrap(), None);
    }
}
