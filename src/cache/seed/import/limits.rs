//! What one import may hold. A layout is operator input, but it can come
//! from anywhere (a USB stick, a colleague, a vendor), and a small tar can
//! describe an enormous graph: thirty indexes of 40,000 references each fit
//! in 4 MB. Every count the import keeps in memory or writes to the index
//! is bounded here, and an import past a bound is refused whole, saying
//! which bound and by how much, before anything is committed.

use crate::config::CacheConfig;

/// Blob files (manifests included) an import stages. Past it: refused.
/// A layout of 500 images of 50 layers each holds 25,000.
pub const MAX_IMPORT_BLOBS: usize = 100_000;

/// Images `index.json` may list. Past it: refused.
pub const MAX_IMPORT_IMAGES: usize = 10_000;

/// Distinct manifests an import reads (each is read once, however many
/// images share it). Past it: refused.
pub const MAX_IMPORT_MANIFESTS: usize = 10_000;

/// Descriptors an import reads in those manifests, summed over the
/// distinct manifests: what the walk holds in memory (about 100 bytes
/// each). Past it: refused. A multi-platform image of 10 platforms with
/// 30 layers each is about 330.
pub const MAX_IMPORT_REFERENCES: usize = 200_000;

/// Descriptors one manifest of the layout may hold: real indexes list a
/// few dozen platforms and images carry at most about 127 layers, while a
/// 4 MiB manifest has room for 40,000 references, all to one child if it
/// likes. Past it: refused, naming the manifest.
pub const MAX_MANIFEST_REFERENCES: usize = 10_000;

/// Blobs an import's images name that its layout lacks: each is checked
/// against the repository's membership and, failing that, with one
/// upstream `HEAD`. A layout carries its content; this bounds the
/// requests a layout can make larder send. Past it: refused.
pub const MAX_IMPORT_ABSENT_BLOBS: usize = 10_000;

/// Membership rows an import writes (a digest in a repository). Past it:
/// refused. Many images imported into many repositories multiply here.
pub const MAX_IMPORT_MEMBERSHIPS: usize = 200_000;

/// Entries of any kind a layout's tar may hold (blobs, folders, other
/// files, duplicates). Past it: refused.
pub const MAX_LAYOUT_ENTRIES: usize = 4 * MAX_IMPORT_BLOBS;

/// Bytes of tar headers (and their GNU long-name and PAX extension
/// records, which the tar reader holds in memory) before one entry's
/// data. Real layouts need a few hundred bytes. Past it: refused.
pub const MAX_TAR_HEADER_BYTES: u64 = 256 << 10;

/// Bytes of blobs staged before `index.json` has been read, while nothing
/// says yet where the images go or whether policy admits them. An
/// `oci-archive` from skopeo has `index.json` after its blobs; `larder
/// import` sends it first, so only a tar posted by other means meets this.
/// Past it, or past a quarter of [`ImportLimits::max_bytes`] if that is
/// less: refused.
pub const MAX_UNINDEXED_BYTES: u64 = 1 << 30;

/// The bounds of one import: the named limits above, and the bytes the
/// config allows (`cache.max_import_size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportLimits {
    /// Bytes read from the layout (its tar, or its files): `cache.max_import_size`.
    pub max_bytes: u64,
    pub max_unindexed_bytes: u64,
    pub max_blobs: usize,
    pub max_images: usize,
    pub max_manifests: usize,
    pub max_references: usize,
    pub max_manifest_references: usize,
    pub max_memberships: usize,
    pub max_absent_blobs: usize,
    pub max_entries: usize,
    pub max_header_bytes: u64,
}

impl ImportLimits {
    /// The named limits, with `max_bytes` read from the config.
    pub fn of(config: &CacheConfig) -> ImportLimits {
        ImportLimits::with_max_bytes(config.max_import_size)
    }

    /// The named limits, with `max_bytes`.
    pub fn with_max_bytes(max_bytes: u64) -> ImportLimits {
        ImportLimits {
            max_bytes,
            max_unindexed_bytes: MAX_UNINDEXED_BYTES.min(max_bytes / 4),
            max_blobs: MAX_IMPORT_BLOBS,
            max_images: MAX_IMPORT_IMAGES,
            max_manifests: MAX_IMPORT_MANIFESTS,
            max_references: MAX_IMPORT_REFERENCES,
            max_manifest_references: MAX_MANIFEST_REFERENCES,
            max_memberships: MAX_IMPORT_MEMBERSHIPS,
            max_absent_blobs: MAX_IMPORT_ABSENT_BLOBS,
            max_entries: MAX_LAYOUT_ENTRIES,
            max_header_bytes: MAX_TAR_HEADER_BYTES,
        }
    }
}
