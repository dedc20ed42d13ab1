//! Images put into the cache, or taken out, before or beside any client's
//! pull: `prefetch` (an image fetched through the facade, with progress),
//! `import` and `export` (an OCI image layout loaded into or written from
//! the cache) and `warm` (what the keep-warm loop asks of the cache).

pub mod export;
pub mod import;
pub mod prefetch;
pub mod warm;
