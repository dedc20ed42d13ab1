//! The staging area of one import: a folder of its own under the store's
//! `tmp/` (`tmp/import-*`, removed when the import ends however it ends,
//! and at start-up after a crash), holding each blob of the layout under
//! its hex digest once its bytes hashed to that name, and closed.
//! One file is open at a time, whatever the layout's size: an import never
//! takes the descriptors the listeners need.
//!
//! Where the images go is asked as soon as `index.json` has been read
//! (policy refuses a destination before another byte is staged); what
//! comes before it is staged only up to [`ImportLimits::max_unindexed_bytes`].

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::PathBuf;

use tempfile::TempDir;

use super::limits::ImportLimits;
use super::reader::Visitor;
use super::{ImportError, ImportTarget, ImportWatch, Resolve};
use crate::cache::store::disk::Store;
use crate::oci::layout::LayoutIndex;
use crate::oci::{Digest, Hasher, MAX_MANIFEST_SIZE};

/// Bytes copied at once while staging a blob.
const COPY_CHUNK: usize = 256 << 10;

/// A layout's blobs, verified and waiting in the staging area, and where
/// its images go.
pub struct Staged {
    dir: TempDir,
    /// Each staged blob's size.
    blobs: HashMap<Digest, u64>,
    pub targets: Vec<ImportTarget>,
}

impl Staged {
    /// The size of the staged blob `digest`, if the layout carries it.
    pub fn size(&self, digest: &Digest) -> Option<u64> {
        self.blobs.get(digest).copied()
    }

    /// Where the staged blob `digest` is.
    pub fn path(&self, digest: &Digest) -> PathBuf {
        self.dir.path().join(digest.hex().as_str())
    }

    /// A staged manifest's bytes (at most [`MAX_MANIFEST_SIZE`]).
    pub fn manifest_bytes(&self, digest: &Digest) -> Result<Vec<u8>, ImportError> {
        let mut bytes = Vec::new();
        std::fs::File::open(self.path(digest))?.take(MAX_MANIFEST_SIZE as u64 + 1).read_to_end(&mut bytes)?;
        Ok(bytes)
    }
}

/// Stages what a layout reader hands it (see [`super::reader`]).
pub struct Stager<'a> {
    dir: TempDir,
    limits: &'a ImportLimits,
    resolve: Resolve,
    watch: &'a mut dyn ImportWatch,
    blobs: HashMap<Digest, u64>,
    targets: Option<Vec<ImportTarget>>,
    bytes: u64,
    buf: Vec<u8>,
}

impl<'a> Stager<'a> {
    pub fn new(
        store: &Store,
        limits: &'a ImportLimits,
        resolve: Resolve,
        watch: &'a mut dyn ImportWatch,
    ) -> Result<Stager<'a>, ImportError> {
        let dir = store.create_staging_dir()?;
        Ok(Stager {
            dir,
            limits,
            resolve,
            watch,
            blobs: HashMap::new(),
            targets: None,
            bytes: 0,
            buf: vec![0; COPY_CHUNK],
        })
    }

    /// What was staged. `index.json` was read: the reader refuses a layout without it.
    pub fn finish(self) -> Result<Staged, ImportError> {
        let targets = self.targets.ok_or_else(|| ImportError::NotALayout("no index.json".into()))?;
        Ok(Staged { dir: self.dir, blobs: self.blobs, targets })
    }

    /// Reads `data` to its end, hashing it, into `out` when given.
    fn copy(&mut self, data: &mut dyn Read, mut out: Option<&mut std::fs::File>) -> Result<(Digest, u64), ImportError> {
        let mut hasher = Hasher::default();
        let mut size = 0u64;
        loop {
            let n = data.read(&mut self.buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&self.buf[..n]);
            if let Some(out) = out.as_mut() {
                out.write_all(&self.buf[..n])?;
            }
            size += n as u64;
            self.watch.advance(n as u64);
        }
        Ok((hasher.finish(), size))
    }
}

impl Visitor for Stager<'_> {
    fn index(&mut self, index: LayoutIndex, _bytes: &[u8]) -> Result<(), ImportError> {
        if index.manifests.len() > self.limits.max_images {
            return Err(ImportError::TooLarge(format!("index.json lists over {} images", self.limits.max_images)));
        }
        self.targets = Some((self.resolve)(&index).map_err(ImportError::Refused)?);
        Ok(())
    }

    fn blob(&mut self, named: Digest, path: &str, size: u64, data: &mut dyn Read) -> Result<(), ImportError> {
        self.watch.item(path);
        if self.blobs.contains_key(&named) {
            // The same name again: its bytes must still be that blob's,
            // but one copy is enough.
            let (actual, _) = self.copy(data, None)?;
            return match actual == named {
                true => Ok(()),
                false => Err(ImportError::Tampered { path: path.to_owned(), actual }),
            };
        }
        if self.blobs.len() >= self.limits.max_blobs {
            return Err(ImportError::TooLarge(format!("the layout holds over {} blobs", self.limits.max_blobs)));
        }
        if self.targets.is_none() && self.bytes.saturating_add(size) > self.limits.max_unindexed_bytes {
            return Err(ImportError::TooLarge(format!(
                "over {} bytes of blobs come before index.json, so where they go is not known yet: put index.json \
                 first (`larder import` sends it first)",
                self.limits.max_unindexed_bytes
            )));
        }
        let mut temp = tempfile::Builder::new().prefix("part-").tempfile_in(self.dir.path())?;
        let (actual, written) = self.copy(data, Some(temp.as_file_mut()))?;
        if actual != named {
            return Err(ImportError::Tampered { path: path.to_owned(), actual });
        }
        // Closed once written: the staging area holds names, not
        // descriptors. Made durable at the commit (`Store::commit_staged`).
        temp.into_temp_path().persist(self.dir.path().join(named.hex().as_str())).map_err(|e| e.error)?;
        self.blobs.insert(named, written);
        self.bytes += written;
        Ok(())
    }
}
