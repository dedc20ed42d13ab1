//! The queue's durable half: one marker file per item under
//! `<cache dir>/uploads/<blob|manifest>/<hex>`, written atomically and
//! fsynced before an enqueue returns, removed once the item is done.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use bytes::Bytes;

use super::{Job, ObjectKind};
use crate::error::Error;
use crate::oci::{Digest, MediaType};

pub(super) fn folder(kind: ObjectKind) -> &'static str {
    match kind {
        ObjectKind::Blob => "blob",
        ObjectKind::Manifest => "manifest",
    }
}

pub(super) fn marker_path(dir: &Path, job: &Job) -> PathBuf {
    dir.join(folder(job.kind)).join(job.digest.hex().as_str())
}

pub(super) fn parse_manifest_marker(content: &[u8]) -> Option<(MediaType, Bytes)> {
    let newline = content.iter().position(|b| *b == b'\n')?;
    let media_type = MediaType::parse(std::str::from_utf8(&content[..newline]).ok()?)?;
    Some((media_type, Bytes::copy_from_slice(&content[newline + 1..])))
}

/// Every marker under `dir` (creating the folders); leftover temp files
/// of an interrupted `write_marker` are removed.
pub(super) fn scan(dir: &Path) -> Result<Vec<Job>, Error> {
    let mut jobs = Vec::new();
    for kind in [ObjectKind::Blob, ObjectKind::Manifest] {
        let sub = dir.join(folder(kind));
        std::fs::create_dir_all(&sub)?;
        for entry in std::fs::read_dir(&sub)? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            match format!("sha256:{name}").parse::<Digest>() {
                Ok(digest) => jobs.push(Job { kind, digest }),
                Err(_) => {
                    tracing::debug!(path = %path.display(), "removing a stray file among upload markers");
                    remove_marker(&path)?;
                }
            }
        }
    }
    // Oldest first would need a stat per marker; digest order is as fair.
    jobs.sort_by_key(|j| (j.kind.as_str(), j.digest));
    Ok(jobs)
}

/// Writes `content` to `path` atomically and durably: a temp file beside
/// it, fsynced, renamed into place, and the folder fsynced.
pub(super) fn write_marker(path: &Path, content: &[u8]) -> Result<(), Error> {
    let parent = path.parent().ok_or_else(|| Error::Internal("marker path has no folder".into()))?;
    std::fs::create_dir_all(parent)?;
    let mut temp = tempfile::Builder::new().prefix(".tmp-").tempfile_in(parent)?;
    temp.write_all(content)?;
    temp.as_file().sync_all()?;
    temp.persist(path).map_err(|e| e.error)?;
    File::open(parent)?.sync_all()?;
    Ok(())
}

pub(super) fn remove_marker(path: &Path) -> Result<(), Error> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
        _ => Ok(()),
    }
}
