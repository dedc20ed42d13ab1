//! `larder import`: an OCI image layout (a folder, or a tar of one as
//! skopeo's `oci-archive:` writes) loaded into the cache, as if each image
//! had just been pulled through larder.
//!
//! All or nothing, in two steps. First every blob file of the layout is
//! copied into a temp file of the store and hashed on the way ([`stage`]);
//! a file whose bytes do not match its name refuses the whole import. Then
//! each image's manifests are read from what was staged and walked, and
//! every blob they name must be staged (or already cached). Only after all
//! of that does anything reach the cache: blobs, then manifests, then tags,
//! each with its membership in the repository imported as, and tags as if
//! revalidated at import time. With a shared tier, what was imported is
//! queued for it like anything fetched from upstream.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tempfile::NamedTempFile;

use crate::blocking::blocking;
use crate::cache::membership::member_key;
use crate::cache::store::disk::Store;
use crate::cache::{Cache, tag_key, unix_ms};
use crate::error::Error;
use crate::oci::layout::{LayoutImage, LayoutIndex, MAX_INDEX_JSON};
use crate::oci::{Digest, Hasher, MAX_MANIFEST_SIZE, MediaType, RepoName, Tag, inspect_manifest};
use crate::upstream::FetchedManifest;

/// Why an import was refused; nothing was imported.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("not an OCI image layout: {0}")]
    NotALayout(String),
    #[error("{path}: its bytes hash to {actual}, not the digest it is named by; nothing imported")]
    Tampered { path: String, actual: Digest },
    #[error("{0}")]
    Incomplete(String),
    #[error("reading the layout: {0}")]
    Io(#[from] std::io::Error),
}

impl From<ImportError> for Error {
    fn from(e: ImportError) -> Error {
        match e {
            ImportError::Io(e) => Error::Internal(format!("import: {e}")),
            e => Error::LayoutInvalid(e.to_string()),
        }
    }
}

/// A layout's content, verified and waiting in temp files of the store.
pub struct Staged {
    pub index: LayoutIndex,
    blobs: HashMap<Digest, (NamedTempFile, u64)>,
}

/// An image of the layout and where it goes.
#[derive(Debug, Clone)]
pub struct ImportTarget {
    /// The upstream's configured name.
    pub upstream: String,
    pub repo: RepoName,
    pub tag: Option<Tag>,
    pub image: LayoutImage,
}

/// What an import did.
#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Imported {
    pub images: usize,
    pub manifests: usize,
    pub blobs: usize,
    pub bytes: u64,
    /// Children of an index that the layout does not hold (a one-platform
    /// copy of a multi-platform image): not imported; a pull of them goes
    /// upstream.
    pub missing_platforms: usize,
}

/// Where a layout comes from.
pub enum LayoutSource {
    Dir(PathBuf),
    Tar(Box<dyn Read + Send>),
}

/// Copies every `blobs/sha256/<hex>` of the layout into temp files of the
/// store, hashing each, and reads `index.json`. Blocking: run it in
/// `spawn_blocking`.
pub fn stage(store: &Store, source: LayoutSource) -> Result<Staged, ImportError> {
    let mut blobs = HashMap::new();
    let mut index = None;
    let mut layout_file = false;
    let mut take = |path: &Path, reader: &mut dyn Read| -> Result<(), ImportError> {
        let parts: Vec<_> = path.components().filter(|c| !matches!(c, Component::CurDir)).collect();
        let names: Vec<&str> = parts.iter().filter_map(|c| c.as_os_str().to_str()).collect();
        match names.as_slice() {
            ["oci-layout"] => layout_file = true,
            ["index.json"] => {
                let mut bytes = Vec::new();
                reader.take(MAX_INDEX_JSON + 1).read_to_end(&mut bytes)?;
                if bytes.len() as u64 > MAX_INDEX_JSON {
                    return Err(ImportError::NotALayout(format!("index.json over {MAX_INDEX_JSON} bytes")));
                }
                index = Some(LayoutIndex::parse(&bytes).map_err(|e| ImportError::NotALayout(e.to_string()))?);
            }
            ["blobs", "sha256", hex] => {
                let Ok(named) = format!("sha256:{hex}").parse::<Digest>() else {
                    return Err(ImportError::NotALayout(format!("{}: not a sha256 digest", path.display())));
                };
                let (temp, digest, size) = copy_hashing(store, reader)?;
                if digest != named {
                    return Err(ImportError::Tampered { path: path.display().to_string(), actual: digest });
                }
                blobs.insert(digest, (temp, size));
            }
            _ => {}
        }
        Ok(())
    };
    match source {
        LayoutSource::Dir(dir) => {
            for name in ["oci-layout", "index.json"] {
                if let Ok(mut f) = std::fs::File::open(dir.join(name)) {
                    take(Path::new(name), &mut f)?;
                }
            }
            let folder = dir.join("blobs/sha256");
            if folder.is_dir() {
                for entry in std::fs::read_dir(&folder)? {
                    let entry = entry?;
                    if entry.file_type()?.is_file() {
                        let relative = Path::new("blobs/sha256").join(entry.file_name());
                        take(&relative, &mut std::fs::File::open(entry.path())?)?;
                    }
                }
            }
        }
        LayoutSource::Tar(reader) => {
            let mut archive = tar::Archive::new(reader);
            for entry in archive.entries()? {
                let mut entry = entry?;
                if entry.header().entry_type().is_file() {
                    let path = entry.path()?.into_owned();
                    take(&path, &mut entry)?;
                }
            }
        }
    }
    if !layout_file {
        return Err(ImportError::NotALayout("no oci-layout file".into()));
    }
    let index = index.ok_or_else(|| ImportError::NotALayout("no index.json".into()))?;
    Ok(Staged { index, blobs })
}

fn copy_hashing(store: &Store, reader: &mut dyn Read) -> Result<(NamedTempFile, Digest, u64), ImportError> {
    use std::io::Write;
    let mut temp = store.create_temp()?;
    let mut hasher = Hasher::default();
    let mut buf = vec![0; 256 << 10];
    let mut size = 0u64;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        temp.write_all(&buf[..n])?;
        size += n as u64;
    }
    Ok((temp, hasher.finish(), size))
}

/// One image's content, walked from its top manifest.
struct Walked {
    /// Children first, the top manifest last.
    manifests: Vec<FetchedManifest>,
    blobs: Vec<Digest>,
    missing_platforms: usize,
}

impl Staged {
    fn manifest(&self, digest: &Digest, media_type: Option<MediaType>) -> Result<FetchedManifest, ImportError> {
        let (temp, size) = self
            .blobs
            .get(digest)
            .ok_or_else(|| ImportError::Incomplete(format!("the layout lacks manifest {digest}")))?;
        if *size > MAX_MANIFEST_SIZE as u64 {
            return Err(ImportError::Incomplete(format!("manifest {digest} is {size} bytes, over the limit")));
        }
        let bytes = Bytes::from(std::fs::read(temp.path())?);
        let (media_type, refs) = inspect_manifest(&bytes, media_type)
            .map_err(|e| ImportError::Incomplete(format!("manifest {digest}: {e}")))?;
        Ok(FetchedManifest { bytes, media_type, digest: *digest, refs, warnings: None })
    }

    /// Reads `image`'s manifests and checks that every blob they name is
    /// staged or in `cached`.
    fn walk(&self, image: &LayoutImage, cached: &dyn Fn(&Digest) -> bool) -> Result<Walked, ImportError> {
        let top = self.manifest(&image.digest, Some(image.media_type))?;
        let mut walked = Walked { manifests: Vec::new(), blobs: top.refs.blobs.clone(), missing_platforms: 0 };
        for child in &top.refs.manifests {
            if !self.blobs.contains_key(child) {
                walked.missing_platforms += 1;
                continue;
            }
            let m = self.manifest(child, None)?;
            if !m.refs.manifests.is_empty() {
                return Err(ImportError::Incomplete(format!("{child}: an index inside an index")));
            }
            walked.blobs.extend(m.refs.blobs.iter().copied());
            walked.manifests.push(m);
        }
        if walked.manifests.is_empty() && !top.refs.manifests.is_empty() {
            return Err(ImportError::Incomplete(format!("{}: none of its platforms is in the layout", image.digest)));
        }
        walked.manifests.push(top);
        walked.blobs.sort();
        walked.blobs.dedup();
        if let Some(missing) = walked.blobs.iter().find(|d| !self.blobs.contains_key(d) && !cached(d)) {
            return Err(ImportError::Incomplete(format!("the layout lacks blob {missing}; nothing imported")));
        }
        Ok(walked)
    }
}

impl Cache {
    /// Stages a layout (see [`stage`]) in this cache's temp folder.
    pub async fn stage_layout(&self, source: LayoutSource) -> Result<Staged, Error> {
        let store = self.store.clone();
        blocking(move || Ok(stage(&store, source)?)).await
    }

    /// Imports the staged layout's images as `targets` say: refused as a
    /// whole (nothing committed) if any image is incomplete.
    pub async fn import(&self, mut staged: Staged, targets: &[ImportTarget]) -> Result<Imported, Error> {
        // Every image is checked before anything is committed; a blob the
        // layout lacks may already be cached (an image sharing base layers).
        let mut walks = Vec::new();
        for target in targets {
            let absent: Vec<Digest> = staged
                .walk(&target.image, &|_| true)?
                .blobs
                .into_iter()
                .filter(|d| !staged.blobs.contains_key(d))
                .collect();
            let index = Arc::clone(&self.index);
            let cached: Vec<Digest> = blocking(move || {
                let sizes = index.blob_sizes(&absent)?;
                Ok(absent.into_iter().zip(sizes).filter_map(|(d, s)| s.map(|_| d)).collect())
            })
            .await?;
            walks.push(staged.walk(&target.image, &|d| cached.contains(d))?);
        }

        let mut imported = Imported { images: targets.len(), ..Imported::default() };
        let now = SystemTime::now();
        for (target, walked) in targets.iter().zip(&walks) {
            imported.missing_platforms += walked.missing_platforms;
            for digest in &walked.blobs {
                let member = member_key(&target.upstream, &target.repo, digest);
                self.memory.insert_member(member.clone());
                let taken = staged.blobs.remove(digest);
                let (store, index) = (self.store.clone(), Arc::clone(&self.index));
                let digest = *digest;
                let size = taken.as_ref().map(|(_, size)| *size);
                let new = blocking(move || match taken {
                    Some((temp, size)) => {
                        store.commit(temp, &digest)?;
                        Ok(index.insert_blob(&digest, size, &member, unix_ms(now))?)
                    }
                    None => {
                        index.add_members(&[member], unix_ms(now))?;
                        Ok(false)
                    }
                })
                .await?;
                if let Some(size) = size {
                    if new {
                        self.evictor.added(size);
                    }
                    imported.blobs += 1;
                    imported.bytes += size;
                    self.share_blob(digest).await;
                }
            }
            for (i, m) in walked.manifests.iter().enumerate() {
                let top = i + 1 == walked.manifests.len();
                let tag = target.tag.as_ref().filter(|_| top).map(|t| tag_key(&target.upstream, &target.repo, t));
                self.share_manifest(m).await;
                self.store_manifest(m.clone(), &target.upstream, &target.repo, tag, now).await?;
                imported.manifests += 1;
            }
        }
        Ok(imported)
    }
}
