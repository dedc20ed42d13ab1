//! `larder import`: an OCI image layout (a folder, or a tar of one as
//! skopeo's `oci-archive:` writes) loaded into the cache, as if each image
//! had just been pulled through larder, by the rules every other way in
//! obeys:
//!
//! - **Membership.** An image's repository gets what the layout carries
//!   (every file hashed against its name) and, of a blob the layout lacks,
//!   only one the repository has already, or that upstream confirms it has
//!   (one `HEAD`: the membership rule); otherwise the import is refused,
//!   naming the blob. A digest alone is never a way into another tenant's
//!   content.
//! - **The operator's destinations.** `--as UPSTREAM/REPO` decides where
//!   every image goes; without it, each image's whole name, routed as a
//!   pull but never by a query, nor to a host that is no configured
//!   upstream. Repository policy is asked as soon as `index.json` is read,
//!   before another byte is staged.
//! - **Bounded.** Memory and work follow [`limits`], not the layout's
//!   claims: each distinct manifest is read once, and an import past a
//!   bound is refused, naming it.
//! - **All or nothing.** Staged ([`staging`]), planned ([`plan`]) and
//!   checked first; then committed by a task of its own, which a client
//!   that hangs up or times out does not cancel: the blob files are renamed
//!   into place, then one index transaction writes every row. A crash
//!   before that transaction leaves correct files without rows, which the
//!   next start adopts with no membership: nothing of the import is served.
//! - **Immutable content.** A row already in the index never changes; a
//!   manifest cached under another media type than the layout declares
//!   refuses the import.
//!
//! With a shared tier, what was imported is queued for it like anything
//! fetched from upstream.

pub mod limits;
pub mod plan;
pub mod reader;
mod staging;

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::blocking::blocking;
use crate::cache::fill::removal_finished;
use crate::cache::index::{ImportCommitError, ImportRows};
use crate::cache::membership::{Content, member_key};
use crate::cache::store::disk::Store;
use crate::cache::store::memory::TagEntry;
use crate::cache::upkeep::purges::lock_purges;
use crate::cache::{Cache, Via, unix_ms};
use crate::error::Error;
use crate::oci::layout::{LayoutImage, LayoutIndex};
use crate::oci::{Digest, MediaType, RepoName, Tag, inspect_manifest};
use crate::upstream::{FetchedManifest, Upstream};
pub use limits::ImportLimits;
use plan::{AbsentBlob, Plan, PlanTarget};
use staging::{Staged, Stager};

/// Upstream `HEAD`s at once while confirming the blobs a layout lacks.
const CONFIRMATIONS_AT_ONCE: usize = 8;

/// Imports that run at once; another waits for its turn before a byte of
/// its layout is read. Each import's memory is bounded by [`limits`];
/// this bounds how many such bounds add up.
pub const MAX_IMPORTS_AT_ONCE: usize = 2;

/// Why an import was refused; nothing was imported.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("not an OCI image layout: {0}")]
    NotALayout(String),
    #[error("{path}: its bytes hash to {actual}, not the digest it is named by; nothing imported")]
    Tampered { path: String, actual: Digest },
    #[error("{0}")]
    Incomplete(String),
    /// Past one of the [`limits`].
    #[error("{0}; nothing imported")]
    TooLarge(String),
    #[error(transparent)]
    Conflict(ImportCommitError),
    /// Where an image would go is refused (policy, a name larder does not route).
    #[error(transparent)]
    Refused(Error),
    #[error("reading the layout: {0}")]
    Io(#[from] std::io::Error),
}

impl From<ImportError> for Error {
    fn from(e: ImportError) -> Error {
        match e {
            ImportError::Io(e) if e.kind() == std::io::ErrorKind::StorageFull => Error::DiskFull,
            ImportError::Io(e) if e.raw_os_error() == Some(libc::EMFILE) => Error::Storage(e.to_string()),
            ImportError::Io(e) => Error::Internal(format!("import: {e}")),
            ImportError::Refused(e) => e,
            ImportError::Conflict(ImportCommitError::Index(e)) => e.into(),
            ImportError::TooLarge(_) => Error::ImportTooLarge(e.to_string()),
            e => Error::LayoutInvalid(e.to_string()),
        }
    }
}

/// Where a layout comes from.
pub enum LayoutSource {
    /// A layout folder (`oci:DIR`).
    Dir(PathBuf),
    /// A tar file (`oci-archive:FILE`): read twice, `index.json` first.
    Archive(PathBuf),
    /// A tar stream (`POST /import`'s body): `index.json` where it comes.
    Tar(Box<dyn Read + Send>),
}

/// An image of the layout and where it goes.
#[derive(Clone)]
pub struct ImportTarget {
    pub upstream: Arc<Upstream>,
    pub repo: RepoName,
    pub tag: Option<Tag>,
    pub image: LayoutImage,
}

/// Decides where a layout's images go once its `index.json` is read
/// (`--as`, or each image's name), refusing what policy refuses.
pub type Resolve = Box<dyn FnMut(&LayoutIndex) -> Result<Vec<ImportTarget>, Error> + Send>;

/// The phases of an import, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for another import to end ([`MAX_IMPORTS_AT_ONCE`]).
    Queued,
    /// Reading the layout and staging its blobs, each hashed.
    Reading,
    /// Walking each image's manifests.
    Checking,
    /// Asking upstream about blobs the layout lacks.
    Confirming,
    /// Putting files in place and writing the rows.
    Committing,
}

/// Who watches an import's progress (the CLI's display); by default, nobody.
pub trait ImportWatch: Send {
    /// A phase starts: what it does, and its total in bytes (0: not known).
    fn phase(&mut self, _phase: Phase, _what: &str, _total: u64) {}
    /// What is worked on now (a blob's path in the layout).
    fn item(&mut self, _item: &str) {}
    /// `n` more bytes done.
    fn advance(&mut self, _n: u64) {}
}

impl ImportWatch for () {}

/// What an import did.
#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Imported {
    pub images: usize,
    pub manifests: usize,
    /// Blobs the layout carried, and their bytes.
    pub blobs: usize,
    pub bytes: u64,
    /// Blobs the layout lacks that the repository had already or that
    /// upstream confirmed it has: recorded, to be fetched when pulled.
    #[serde(default)]
    pub confirmed: usize,
    /// Children of an index that the layout does not hold (a one-platform
    /// copy of a multi-platform image): not imported; a pull of them goes
    /// upstream.
    pub missing_platforms: usize,
    /// Where each image went: `upstream/repository:tag@digest`
    /// (`upstream/repository@digest` without a tag).
    #[serde(default)]
    pub destinations: Vec<String>,
}

/// Stages a layout, `index.json` resolved into targets as soon as it is read.
fn stage(
    store: &Store,
    source: LayoutSource,
    limits: &ImportLimits,
    resolve: Resolve,
    watch: &mut dyn ImportWatch,
) -> Result<Staged, ImportError> {
    let total = match &source {
        LayoutSource::Dir(dir) => blob_bytes(dir),
        LayoutSource::Archive(path) => std::fs::metadata(path).map_or(0, |m| m.len()),
        LayoutSource::Tar(_) => 0,
    };
    watch.phase(Phase::Reading, "reading and hashing the layout", total);
    let mut stager = Stager::new(store, limits, resolve, watch)?;
    match source {
        LayoutSource::Dir(dir) => reader::read_dir(&dir, limits, &mut stager)?,
        LayoutSource::Archive(path) => reader::read_archive(&path, limits, &mut stager)?,
        LayoutSource::Tar(tar) => reader::read_tar(tar, limits, &mut stager)?,
    }
    stager.finish()
}

/// `1 image`, `2 images`.
fn plural(n: usize, one: &str) -> String {
    if n == 1 { format!("{n} {one}") } else { format!("{n} {one}s") }
}

/// The bytes of a layout folder's blob files (for progress; 0 if unknown).
fn blob_bytes(dir: &std::path::Path) -> u64 {
    let Ok(listing) = std::fs::read_dir(dir.join("blobs/sha256")) else { return 0 };
    listing.filter_map(|e| e.ok()?.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
}

/// Holds an import's blob digests against removals until dropped (see
/// [`crate::cache::fill::Fills::begin_import`]).
struct Reserved {
    cache: Arc<Cache>,
    digests: Vec<Digest>,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.cache.fills.end_import(&self.digests);
    }
}

impl Cache {
    /// Imports a layout: staged, planned, checked (the membership rule for
    /// what it lacks), then committed all at once by a task that finishes
    /// even if the caller goes away. Refused as a whole, nothing
    /// committed, if anything fails before the commit.
    pub async fn import_layout(
        self: &Arc<Self>,
        source: LayoutSource,
        resolve: Resolve,
        watch: Box<dyn ImportWatch>,
    ) -> Result<Imported, Error> {
        let mut watch = watch;
        let queue = Arc::clone(&self.imports);
        let permit = match Arc::clone(&queue).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                watch.phase(Phase::Queued, "waiting for another import to end", 0);
                queue.acquire_owned().await.map_err(|_| Error::Internal("the import queue closed".into()))?
            }
        };
        // Purges from here on are barriers: the checks below (memberships,
        // the tags replaced) are from before them (see `commit_import`).
        let purges_seen = lock_purges(&self.purges).count();
        let limits = ImportLimits::of(&self.config);
        let store = self.store.clone();
        let (staged, plan, mut watch) = blocking(move || {
            let mut watch = watch;
            let staged = stage(&store, source, &limits, resolve, &mut *watch)?;
            watch.phase(Phase::Checking, &format!("checking {}", plural(staged.targets.len(), "image")), 0);
            let targets: Vec<PlanTarget<'_>> = staged
                .targets
                .iter()
                .map(|t| PlanTarget {
                    upstream: t.upstream.name(),
                    repo: &t.repo,
                    tag: t.tag.as_ref(),
                    image: &t.image,
                })
                .collect();
            let plan = plan::plan(&targets, &|d| staged.size(d), &mut |d| staged.manifest_bytes(d), &limits)?;
            drop(targets);
            Ok((staged, plan, watch))
        })
        .await?;
        if !plan.absent.is_empty() {
            let what = format!("confirming {} the layout lacks with upstream", plural(plan.absent.len(), "blob"));
            watch.phase(Phase::Confirming, &what, 0);
            self.confirm_absent(&staged.targets, &plan.absent).await?;
        }
        let cache = Arc::clone(self);
        tokio::spawn(async move {
            let _permit = permit;
            cache.commit_import(staged, plan, purges_seen, watch).await
        })
        .await
        .map_err(|e| Error::Internal(format!("the import's commit failed: {e}")))?
    }

    /// The membership rule for each blob an image names and the layout
    /// lacks: the image's repository has it already, or upstream (or the
    /// digest's owner in a cluster) confirms it has it; otherwise the
    /// import is refused, naming the blob.
    async fn confirm_absent(&self, targets: &[ImportTarget], absent: &[AbsentBlob]) -> Result<(), Error> {
        for chunk in absent.chunks(CONFIRMATIONS_AT_ONCE) {
            let mut checks = Vec::with_capacity(chunk.len());
            for a in chunk {
                let t = &targets[a.target];
                checks.push(self.confirm_member(&t.upstream, &t.repo, &a.digest, Content::Blob, Via::Client));
            }
            let answers = futures_util::future::join_all(checks).await;
            for (a, confirmed) in chunk.iter().zip(answers) {
                let t = &targets[a.target];
                let (upstream, repo, digest) = (t.upstream.name(), &t.repo, &a.digest);
                let why = match confirmed {
                    Ok(Some(size)) if a.declared.is_some_and(|d| d != size) => format!(
                        "upstream {upstream} has it in {repo} at {size} bytes where the manifest declares {}",
                        a.declared.unwrap_or_default()
                    ),
                    Ok(_) => continue,
                    Err(Error::BlobUnknown(_)) => format!("upstream {upstream} says {repo} does not have it"),
                    Err(e) => format!("upstream {upstream} could not confirm {repo} has it: {e}"),
                };
                return Err(ImportError::Incomplete(format!(
                    "the layout lacks blob {digest}, which {upstream}/{repo} does not hold here, and {why}; nothing \
                     imported"
                ))
                .into());
            }
        }
        Ok(())
    }

    /// Commits a planned import: its blob files into place, then every
    /// row in one transaction, unless a purge of a destination began after
    /// the import did (`purges_seen`): then nothing (the files stay, members
    /// of no repository, as a fill's do); then what memory and the shared
    /// tier learn.
    async fn commit_import(
        self: Arc<Self>,
        staged: Staged,
        plan: Plan,
        purges_seen: u64,
        mut watch: Box<dyn ImportWatch>,
    ) -> Result<Imported, Error> {
        let what =
            format!("committing {} and {}", plural(plan.blobs.len(), "blob"), plural(plan.manifests.len(), "manifest"));
        watch.phase(Phase::Committing, &what, 0);
        let digests: Vec<Digest> = plan.blobs.iter().map(|b| b.digest).collect();
        let reserved = loop {
            match self.fills.begin_import(&digests) {
                None => break Reserved { cache: Arc::clone(&self), digests },
                Some(removal) => removal_finished(removal).await,
            }
        };
        let now = SystemTime::now();
        let (store, index, purges) = (self.store.clone(), Arc::clone(&self.index), Arc::clone(&self.purges));
        let (staged, plan, committed) = blocking(move || {
            let manifests: Vec<(Digest, MediaType, &str)> =
                plan.manifests.iter().map(|m| (m.digest, m.media_type, m.upstream.as_str())).collect();
            let types: Vec<(Digest, MediaType)> = manifests.iter().map(|m| (m.0, m.1)).collect();
            if let Some(conflict) = index.import_conflict(&types)? {
                return Err(ImportError::Conflict(conflict).into());
            }
            let files: Vec<(PathBuf, Digest)> = plan.blobs.iter().map(|b| (staged.path(&b.digest), b.digest)).collect();
            store.commit_staged(&files)?;
            let blobs: Vec<(Digest, u64, &str)> =
                plan.blobs.iter().map(|b| (b.digest, b.size, b.upstream.as_str())).collect();
            let rows = ImportRows {
                blobs: &blobs,
                manifests: &manifests,
                members: &plan.members,
                tags: &plan.tags,
                now_ms: unix_ms(now),
            };
            // A manifest that is a blob of an image too was renamed already.
            let mut read = |d: &Digest| match staged.manifest_bytes(d) {
                Ok(bytes) => Ok(bytes),
                Err(_) => std::fs::read(store.blob_path(d)).map_err(|e| e.to_string()),
            };
            let purged = |key: &str| lock_purges(&purges).purged_since(key, purges_seen);
            let committed = index.commit_import(&rows, &mut read, &purged).map_err(ImportError::Conflict)?;
            drop((blobs, manifests));
            Ok((staged, plan, committed))
        })
        .await?;
        drop(reserved);

        {
            // Under the purges' lock, which a purge holds while it forgets
            // the memory's rows: what it removed from the index after this
            // commit cannot come back here.
            let purges = lock_purges(&self.purges);
            for key in plan.members.iter().filter(|k| !purges.purged_since(k, purges_seen)) {
                self.memory.insert_member(key.clone());
            }
            for (key, digest) in plan.tags.iter().filter(|(k, _)| !purges.purged_since(k, purges_seen)) {
                self.memory.insert_tag(key.clone(), TagEntry { digest: *digest, confirmed: now });
            }
        }
        for a in &plan.absent {
            let t = &staged.targets[a.target];
            if let Some(size) = a.declared {
                self.memory.insert_declared_size(member_key(t.upstream.name(), &t.repo, &a.digest), size);
            }
        }
        if committed.new_bytes > 0 {
            self.evictor.added(committed.new_bytes);
        }
        if self.shared.is_some() {
            for digest in &committed.new_blobs {
                self.share_blob(*digest).await;
            }
            for digest in &committed.new_manifests {
                let Some(m) = plan.manifests.iter().find(|m| m.digest == *digest) else { continue };
                let Ok(bytes) = staged.manifest_bytes(digest) else { continue };
                if let Ok((media_type, refs)) = inspect_manifest(&bytes, Some(m.media_type)) {
                    let fetched = FetchedManifest {
                        bytes: Bytes::from(bytes),
                        media_type,
                        digest: *digest,
                        refs,
                        warnings: None,
                    };
                    self.share_manifest(&fetched).await;
                }
            }
        }
        let imported = Imported {
            images: staged.targets.len(),
            manifests: plan.manifests.len(),
            blobs: plan.blobs.len(),
            bytes: plan.blobs.iter().map(|b| b.size).sum(),
            confirmed: plan.absent.len(),
            missing_platforms: plan.missing_platforms,
            destinations: plan.destinations,
        };
        Ok(imported)
    }
}
