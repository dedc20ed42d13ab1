//! `larder export`: an image in the cache written as an OCI image layout,
//! in a tar stream (admin `POST /export`; the CLI unpacks it into a
//! folder that skopeo reads as `oci:DIR`). The image's content was made
//! whole in the cache first (a prefetch of its [`Plan`]); here it is only
//! read: manifests from the index, blobs from their committed files.
//!
//! The layout's `index.json` names the image twice: the tag alone in
//! `org.opencontainers.image.ref.name` (what `skopeo ... oci:DIR:TAG`
//! looks up) and the whole reference, `<upstream>/<repo>:<tag>`, in
//! `io.containerd.image.name` (what `larder import` routes by).

use std::collections::BTreeMap;
use std::io::Write;

use super::prefetch::Plan;
use crate::cache::Cache;
use crate::error::Error;
use crate::oci::layout::{CONTAINERD_NAME, Descriptor, LayoutIndex, OCI_LAYOUT, REF_NAME};
use crate::oci::{Digest, Reference};

/// Which manifest of a plan is the layout's image: the one platform
/// chosen from an index, else the top manifest.
fn image_of(plan: &Plan, platform_chosen: bool) -> &crate::cache::StoredManifest {
    match plan.children.as_slice() {
        [only] if platform_chosen => only,
        _ => &plan.top,
    }
}

/// The `index.json` of a layout holding `plan`'s image as `name`
/// (`<upstream>/<repo>`) and `reference`.
pub fn layout_index(plan: &Plan, platform_chosen: bool, name: &str, reference: &Reference) -> LayoutIndex {
    let image = image_of(plan, platform_chosen);
    let mut annotations = BTreeMap::new();
    match reference {
        Reference::Tag(tag) => {
            annotations.insert(REF_NAME.to_owned(), tag.as_str().to_owned());
            annotations.insert(CONTAINERD_NAME.to_owned(), format!("{name}:{}", tag.as_str()));
        }
        Reference::Digest(digest) => {
            annotations.insert(CONTAINERD_NAME.to_owned(), format!("{name}@{digest}"));
        }
    }
    let descriptor = Descriptor {
        media_type: image.media_type.as_str().to_owned(),
        digest: image.digest.to_string(),
        size: image.bytes.len() as u64,
        annotations,
    };
    LayoutIndex { manifests: vec![descriptor], ..LayoutIndex::default() }
}

/// The header of a regular file of `size` bytes in a layout's tar, as
/// `larder export` and the `larder import` upload write them (mode 0644,
/// no time, so the same layout is the same bytes).
pub fn tar_file_header(size: u64) -> tar::Header {
    let mut header = tar::Header::new_ustar();
    header.set_size(size);
    header.set_mode(0o644);
    header.set_mtime(0);
    header.set_entry_type(tar::EntryType::Regular);
    header
}

fn blob_name(digest: &Digest) -> String {
    format!("blobs/sha256/{}", digest.hex().as_str())
}

impl Cache {
    /// Writes the layout of `plan`'s image (see [`layout_index`]) as a tar
    /// to `out`. Blocking: run it in `spawn_blocking`. A blob evicted since
    /// the plan was fetched fails it.
    pub fn write_layout(&self, plan: &Plan, index: &LayoutIndex, out: impl Write) -> Result<(), Error> {
        let io = |e: std::io::Error| Error::Internal(format!("writing the layout: {e}"));
        let mut tar = tar::Builder::new(out);
        tar.append_data(&mut tar_file_header(OCI_LAYOUT.len() as u64), "oci-layout", OCI_LAYOUT.as_bytes())
            .map_err(io)?;
        let json = serde_json::to_vec(index).map_err(|e| Error::Internal(format!("index.json: {e}")))?;
        tar.append_data(&mut tar_file_header(json.len() as u64), "index.json", json.as_slice()).map_err(io)?;
        let image_is_top = index.manifests.first().is_some_and(|d| d.digest == plan.top.digest.to_string());
        let manifests = plan.children.iter().chain(image_is_top.then_some(&plan.top));
        for m in manifests {
            tar.append_data(&mut tar_file_header(m.bytes.len() as u64), blob_name(&m.digest), m.bytes.as_ref())
                .map_err(io)?;
        }
        for digest in &plan.blobs {
            let file = self.store.open_blob(digest).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Error::BlobUnknown(*digest),
                _ => io(e),
            })?;
            let size = file.metadata().map_err(io)?.len();
            tar.append_data(&mut tar_file_header(size), blob_name(digest), file).map_err(io)?;
        }
        tar.into_inner().map_err(io)?.flush().map_err(io)
    }
}
