//! A full disk: the cache folder is a small tmpfs and `max_size` is larger
//! than it, so the watermarks never help. A fill that hits ENOSPC fails
//! cleanly (the client's body is aborted, nothing is committed, the temp
//! file is removed), cached blobs keep being served, and the failure makes
//! an eviction round free space at once, after which a new blob that fits
//! is fetched and served.
//!
//! Mounting needs root (CAP_SYS_ADMIN); without it the test fails with a
//! message saying so rather than skipping.

mod common;
mod fake;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::metrics::{ADMIN_LISTEN, metric, wait_for_commits};
use common::{Larder, Upstream};
use fake::client::{self, End};
use fake::{FakeUpstream, KIB, MIB, UPSTREAM_NAME, blob_path, digest, random_bytes};

/// The tmpfs the cache lives on.
const DISK: &str = "8m";
/// Blobs cached first: six of them nearly fill the disk.
const CACHED: usize = 1 << 20;
/// A blob that cannot fit in what is left.
const TOO_BIG: usize = 4 * MIB;
/// A blob that fits only once the eviction round has freed a cached blob.
const FITS_AFTER_EVICTION: usize = 2 * MIB + 512 * KIB;
/// Longest the test waits for the eviction round.
const EVICTION_PATIENCE: Duration = Duration::from_secs(30);

const EVICTED_BLOBS: &str = r#"larder_cache_evictions_total{kind="blob"}"#;

#[tokio::test(flavor = "multi_thread")]
async fn a_fill_that_hits_enospc_fails_cleanly_and_makes_room_for_the_next() {
    let cached: Vec<Bytes> = (0..6).map(|seed| random_bytes(CACHED, seed)).collect();
    let too_big = random_bytes(TOO_BIG, 100);
    let fits = random_bytes(FITS_AFTER_EVICTION, 101);
    let up = cached
        .iter()
        .chain([&too_big, &fits])
        .fold(FakeUpstream::builder(), |builder, blob| builder.blob(blob.clone()))
        .start()
        .await;
    let mut larder = Larder::builder()
        .upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
        .max_size("1GiB")
        .server_line(ADMIN_LISTEN)
        .start()
        .await;
    // Started again on a small tmpfs mounted over its cache folder.
    larder.stop();
    let disk = Tmpfs::mount(&larder.cache_dir(), DISK);
    larder.restart().await;
    let addr: SocketAddr = larder.host_port().parse().expect("larder's address");
    let tmp = larder.cache_dir().join("tmp");

    for blob in &cached {
        let r = client::get(addr, &blob_path(&digest(blob))).await;
        assert!(r.status() == 200 && r.end == End::Complete && r.body == *blob, "caching {}", digest(blob));
    }
    wait_for_commits(&larder).await;
    let free = disk.free_bytes();
    assert!(free < TOO_BIG as u64, "test setup: {free} bytes free, the big blob must not fit");
    assert!(free < FITS_AFTER_EVICTION as u64, "test setup: {free} bytes free, the last blob must need room");

    // The fill runs out of disk: the client is cut off, nothing is kept.
    let too_big_digest = digest(&too_big);
    let r = client::get(addr, &blob_path(&too_big_digest)).await;
    assert!(
        !(r.status() == 200 && r.end == End::Complete),
        "a blob larger than the free space was served as complete ({} bytes, {:?})",
        r.body.len(),
        r.end
    );
    assert!(r.body.len() < TOO_BIG, "the client never got the whole blob");
    assert!(!larder.blob_file(&too_big_digest).exists(), "nothing was committed");
    wait_for("tmp/ to be empty", || files_in(&tmp).is_empty()).await;

    // The ENOSPC made an eviction round run, under the watermarks.
    wait_for_metric(&larder, EVICTED_BLOBS, 1.0).await;
    let evicted: Vec<&Bytes> = cached.iter().filter(|b| !larder.blob_file(&digest(b)).exists()).collect();
    assert!(!evicted.is_empty(), "some cached blob file was removed");
    assert!(evicted.contains(&&cached[0]), "the least recently used blob is among those evicted");

    let fits_digest = digest(&fits);
    let r = client::get(addr, &blob_path(&fits_digest)).await;
    assert_eq!((r.status(), &r.end), (200, &End::Complete), "a blob that fits now");
    assert!(r.body == fits, "exact bytes");
    wait_for_commits(&larder).await;
    assert!(larder.blob_file(&fits_digest).exists(), "committed");

    // What was not evicted is still served from the cache.
    for blob in cached.iter().filter(|b| !evicted.contains(b)) {
        let d = digest(blob);
        let r = client::get(addr, &blob_path(&d)).await;
        assert!(r.status() == 200 && r.end == End::Complete && r.body == *blob, "serving {d}");
        assert_eq!(up.blob_gets(&d), 1, "{d} came from the cache");
    }
    assert_eq!(files_in(&tmp), Vec::<PathBuf>::new(), "no temp file left behind");

    larder.stop();
    drop(disk);
}

// ---- helpers ----------------------------------------------------------------

/// A tmpfs mounted for the test; unmounted when dropped (lazily, if
/// something still has files open on it).
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .unwrap_or_else(|e| panic!("cannot run mount: {e}"));
        assert!(
            out.status.success(),
            "cannot mount a {size} tmpfs on {}: {} — this test needs root (CAP_SYS_ADMIN) to give the cache a \
             small disk; it does not skip itself",
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Tmpfs { dir: dir.to_owned() }
    }

    /// Bytes an unprivileged writer can still use (`statfs` `f_bavail`).
    fn free_bytes(&self) -> u64 {
        let out = Command::new("stat")
            .args(["-f", "-c", "%a %S"])
            .arg(&self.dir)
            .output()
            .unwrap_or_else(|e| panic!("cannot run stat -f: {e}"));
        let text = String::from_utf8_lossy(&out.stdout);
        let numbers: Vec<u64> = text.split_whitespace().filter_map(|n| n.parse().ok()).collect();
        match numbers[..] {
            [blocks, block_size] => blocks * block_size,
            _ => panic!("unexpected `stat -f` output for {}: {text:?}", self.dir.display()),
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let unmounted = Command::new("umount").arg(&self.dir).status().is_ok_and(|s| s.success());
        if !unmounted {
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
    entries.map(|e| e.expect("a directory entry").path()).collect()
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < EVICTION_PATIENCE, "gave up waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls larder's `/metrics` until `series` is at least `at_least`.
async fn wait_for_metric(larder: &Larder, series: &str, at_least: f64) {
    let started = Instant::now();
    loop {
        let value = metric(larder, series).await;
        if value >= at_least {
            return;
        }
        assert!(
            started.elapsed() < EVICTION_PATIENCE,
            "{series} is {value} after {EVICTION_PATIENCE:?}, expected at least {at_least}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
