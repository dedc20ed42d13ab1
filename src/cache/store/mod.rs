//! Where this replica keeps what it holds, and how it reads it back:
//! `memory` (moka: manifests, tag mappings, open blob handles), `disk`
//! (the content-addressed files and the temp folder), `index` (redb: what
//! the store holds, access times, membership, each upstream's charged
//! bytes), `pread` (positioned reads of blob files for response bodies)
//! and `residency` (whether a range is in the page cache, for `sendfile`).

pub mod disk;
pub mod index;
pub mod memory;
pub mod pread;
pub mod residency;
