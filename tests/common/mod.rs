//! Integration-test harness for larder: real peers, started per test.
//!
//! Each test file does `mod common;` and reads like a script:
//!
//! ```ignore
//! let origin = Origin::start().await;                       // real distribution
//! let image = ImageBuilder::oci().push(&origin, "team/app", "v1").await;
//! let larder = Larder::builder().upstream(&origin).start().await;
//! let pulled = skopeo::pull(&larder.image_ref(&image.reference()), false).await?;
//! let mark = origin.log_mark().await;
//! // ... pull again ...
//! assert_eq!(origin.requests_since(&mark).await.blob_gets(), 0);
//! ```
//!
//! Every process the harness starts (distribution, larder) is killed by PID
//! when its guard is dropped, also while a failing test unwinds; logs of the
//! peers are printed when a test fails.

// Every test file compiles this module on its own and uses a different part
// of it, so the parts one file leaves unused are not dead code.
#![allow(dead_code, unused_imports)]

pub mod access_log;
pub mod admin;
pub mod cluster;
pub mod cut_proxy;
pub mod garage;
pub mod http;
pub mod image;
pub mod isolation;
pub mod larder;
pub mod metrics;
pub mod netns;
pub mod origin;
pub mod process;
pub mod push;
pub mod settle;
pub mod shaper;
pub mod skopeo;
pub mod tls_front;
pub mod token_server;
pub mod tools;

pub use access_log::{AccessLog, AccessLogEntry, LogMark};
pub use admin::Admin;
pub use cluster::Cluster;
pub use cut_proxy::CutProxy;
pub use garage::{Garage, GarageBuilder};
pub use image::{Blob, ImageBuilder, ManifestFormat, PushedImage, PushedManifest};
pub use larder::{Larder, LarderBuilder, Upstream};
pub use origin::{ORIGIN_NAME, Origin};
pub use shaper::{Model as LinkModel, Shaper};
pub use skopeo::{Pull, PulledImage};
pub use tls_front::{TestCa, TlsFront};
pub use token_server::{Credentials, TokenRequest, TokenServer};
pub use tools::{free_port, which};

/// One kibibyte, for layer sizes.
pub const KIB: usize = 1024;
/// One mebibyte, for layer sizes.
pub const MIB: usize = 1024 * 1024;
