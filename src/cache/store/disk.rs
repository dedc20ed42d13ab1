//! The content-addressed files: `blobs/sha256/<2 hex>/<64 hex>` for
//! committed blobs, `tmp/` for fills in progress. Synchronous `std::fs`
//! code, run only inside `spawn_blocking`.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use tempfile::NamedTempFile;

use crate::oci::Digest;

#[derive(Clone)]
pub struct Store {
    root: PathBuf,
}

impl Store {
    /// The store under `root`, creating only `root` itself: nothing inside
    /// it is touched until the caller holds the index's lock (another
    /// larder may be running on the same folder) and calls [`Store::prepare`].
    pub fn new(root: &Path) -> io::Result<Store> {
        std::fs::create_dir_all(root)?;
        Ok(Store { root: root.to_owned() })
    }

    /// With the index lock held: creates the folders and removes temp files
    /// a previous run left behind (a crash mid-fill): nothing in `tmp/` was
    /// ever committed.
    pub fn prepare(&self) -> io::Result<()> {
        std::fs::create_dir_all(self.root.join("blobs/sha256"))?;
        let tmp = self.tmp_dir();
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)?;
        }
        std::fs::create_dir_all(&tmp)
    }

    fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    pub fn index_path(&self) -> PathBuf {
        self.root.join("index.redb")
    }

    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        let hex = digest.hex();
        self.root.join("blobs/sha256").join(&hex[..2]).join(hex.as_str())
    }

    /// A new temp file for a fill; it deletes itself when dropped uncommitted.
    pub fn create_temp(&self) -> io::Result<NamedTempFile> {
        tempfile::Builder::new().prefix("fill-").tempfile_in(self.tmp_dir())
    }

    /// Makes a verified temp file the blob for `digest`: data fsynced,
    /// renamed into place, and the folder fsynced so the rename survives a
    /// crash. The caller inserts the index row afterwards.
    pub fn commit(&self, temp: NamedTempFile, digest: &Digest) -> io::Result<()> {
        crate::faults::check(crate::faults::Point::Commit)?;
        temp.as_file().sync_all()?;
        let path = self.blob_path(digest);
        let parent = path.parent().ok_or_else(|| io::Error::other("blob path has no parent"))?;
        std::fs::create_dir_all(parent)?;
        temp.persist(&path).map_err(|e| e.error)?;
        File::open(parent)?.sync_all()
    }

    /// The names of the shard folders blobs go to (`00` … `ff`): the first
    /// two hex digits of the digest.
    pub fn shards() -> impl Iterator<Item = String> {
        (0..=255u8).map(|b| format!("{b:02x}"))
    }

    /// Every file in one shard folder, whatever its name; none if the
    /// folder was never created.
    pub fn shard_files(&self, shard: &str) -> io::Result<Vec<PathBuf>> {
        let dir = self.root.join("blobs/sha256").join(shard);
        let entries = match std::fs::read_dir(&dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            other => other?,
        };
        entries.map(|e| e.map(|e| e.path())).collect()
    }

    /// Files under `blobs/sha256/` that are in no shard folder: nothing
    /// larder writes, so every one of them is out of place.
    pub fn stray_files(&self) -> io::Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(self.root.join("blobs/sha256"))? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            let is_shard = name.len() == 2 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
            if !path.is_dir() {
                out.push(path);
            } else if !is_shard {
                for file in std::fs::read_dir(&path)? {
                    out.push(file?.path());
                }
            }
        }
        Ok(out)
    }

    /// Removes a blob file; one that is already gone is not an error.
    pub fn remove_blob(&self, digest: &Digest) -> io::Result<()> {
        match std::fs::remove_file(self.blob_path(digest)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    pub fn open_blob(&self, digest: &Digest) -> io::Result<File> {
        File::open(self.blob_path(digest))
    }
}
