//! The OCI distribution vocabulary: digests, repository names, references
//! and media types. Pure parsing, no I/O: everything past the router works
//! on these types, never on raw path segments.

mod digest;
pub mod headers;
pub mod layout;
mod manifest;
mod media;
mod reference;
pub mod referrers;
pub mod tag_list;
mod warning;

pub use digest::{Digest, DigestError, Hasher, Hex};
pub use manifest::{MAX_MANIFEST_SIZE, ManifestRefs, inspect as inspect_manifest};
pub use media::{Accept, MediaType};
pub use reference::{NameError, Reference, RepoName, Tag};
pub use warning::{MAX_WARNING_BYTES, MAX_WARNINGS, Warnings};
