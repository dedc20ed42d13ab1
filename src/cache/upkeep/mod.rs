//! Keeping the cache within bounds and true to its files, beside the
//! request path: `maintenance` (the background task, eviction's removals,
//! purges), `evict` (usage, access times and the least-recently-used
//! choice between the watermarks), `pins` (what eviction passes over),
//! `reconcile` (the index against the files: `larder verify`) and
//! `reconcile_live` (the same check after start-up, beside live traffic)
//! and `purges` (purges remembered, so that nothing older undoes them).

pub mod evict;
pub mod maintenance;
pub mod pins;
pub mod purges;
pub mod reconcile;
pub mod reconcile_live;
