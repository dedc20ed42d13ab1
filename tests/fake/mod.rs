//! Test kit for larder's fault-injection tests: a fake upstream registry
//! with faults to inject ([`FakeUpstream`]: broken, stalled, trickling,
//! lying bodies, and ranges answered wrongly, [`Ranges`]), a larder
//! process per test ([`Larder`]) that can fail its own disk I/O on
//! request ([`INJECT_FAULTS`]), raw-TCP HTTP/1.1 clients that can read
//! slowly, leave early, and tell an aborted body from a complete one
//! ([`client`]), and hosts that only record what reaches them
//! ([`recorder`]).
//!
//! Each test file includes this folder with `mod fake;` and uses a part of
//! it, so items one file does not use are expected.
#![allow(dead_code, unused_imports)]

pub mod client;
mod larder;
pub mod recorder;
// The same file as `common::settle`: some test binaries include `fake`
// without `common`, and those that include both compile it twice.
#[allow(clippy::duplicate_mod)]
#[path = "../common/settle.rs"]
mod settle;
mod upstream;

use std::time::Duration;

use bytes::Bytes;
use sha2::{Digest as _, Sha256};

pub use larder::{Larder, LarderBuilder};
pub use upstream::{FakeUpstream, FakeUpstreamBuilder, Faults, Logged, Ranges};

/// The environment variable a debug build of larder reads its injected
/// local faults from (src/faults.rs): `point:action[:skip[:times]]`, e.g.
/// `temp_read:EIO:0:1` (the first hash read-back of a ranged fill fails
/// with EIO) or `fill:panic:0:1` (the first fill task panics once it has its
/// temp file). Both larder harnesses set it: `inject_faults(rules)`.
pub const INJECT_FAULTS: &str = "LARDER_INJECT_FAULTS";

/// The repository every test asks for.
pub const REPO: &str = "test/app";
/// The upstream name larder is configured with (`?ns=` and path prefix).
pub const UPSTREAM_NAME: &str = "fake.test";
pub const KIB: usize = 1 << 10;
pub const MIB: usize = 1 << 20;
/// Longest a test waits for something that should happen promptly. Only a
/// guard against hangs: no test asserts how long anything took.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// `len` bytes of deterministic noise (xorshift64*), different per seed.
pub fn random_bytes(len: usize, seed: u64) -> Bytes {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    Bytes::from(out)
}

/// `sha256:<hex>` of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// `/v2/test/app/blobs/<digest>`
pub fn blob_path(digest: &str) -> String {
    format!("/v2/{REPO}/blobs/{digest}")
}

/// `/v2/test/app/manifests/<tag or digest>`
pub fn manifest_path(reference: &str) -> String {
    format!("/v2/{REPO}/manifests/{reference}")
}

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// An OCI image manifest naming `config` and `layers` (digest, size).
pub fn image_manifest(config: (&str, usize), layers: &[(&str, usize)]) -> Bytes {
    let descriptor = |media_type: &str, (digest, size): (&str, usize)| serde_json::json!({ "mediaType": media_type, "digest": digest, "size": size });
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": descriptor("application/vnd.oci.image.config.v1+json", config),
        "layers": layers
            .iter()
            .map(|l| descriptor("application/vnd.oci.image.layer.v1.tar+gzip", *l))
            .collect::<Vec<_>>(),
    });
    Bytes::from(serde_json::to_vec_pretty(&manifest).expect("a manifest serializes"))
}

/// Polls `done` until it holds; panics naming `what` after [`PATIENCE`].
pub async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "gave up waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A fake upstream serving `test/app:v1` (a manifest, its config and
/// layer); returns the manifest and its digest too.
pub async fn fake_with_v1() -> (Bytes, String, FakeUpstream) {
    let config = random_bytes(512, 1);
    let layer = random_bytes(8 * KIB, 2);
    let manifest = image_manifest((&digest(&config), config.len()), &[(&digest(&layer), layer.len())]);
    let manifest_digest = digest(&manifest);
    let up = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, manifest.clone())
        .blob(config)
        .blob(layer)
        .start()
        .await;
    (manifest, manifest_digest, up)
}
