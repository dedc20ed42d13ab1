//! Crash safety: larder SIGKILLed in the middle of a fill, or right after
//! one committed, starts again with nothing in `tmp/`, serves the exact
//! bytes, and `larder verify` finds nothing wrong. Damage done by hand to a
//! stopped cache (files deleted, truncated, corrupted, or planted without
//! an index row) is found by the check larder runs in the background once
//! it is serving, when a file is first opened, or by `larder verify`;
//! repaired, and the blob fetched again.
//!
//! The kill lands mid-fill deterministically: the fake upstream stalls the
//! body at a chosen byte, and the test waits until the fill has written
//! exactly that much to its temp file.

mod common;
mod fake;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use bytes::Bytes;
use common::metrics::{ADMIN_LISTEN, metric, wait_for_commits};
use common::{Larder, Upstream};
use fake::client::{self, End};
use fake::{FakeUpstream, KIB, MIB, UPSTREAM_NAME, blob_path, digest, random_bytes, wait_until};
use regex::Regex;

/// The blob the kill tests fill: large enough that a fill takes many writes.
const LAYER: usize = 48 * MIB;

#[tokio::test(flavor = "multi_thread")]
async fn killed_a_quarter_into_a_fill() {
    killed_mid_fill(LAYER / 4).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_three_quarters_into_a_fill() {
    killed_mid_fill(LAYER * 3 / 4).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_one_byte_before_the_end_of_a_fill() {
    killed_mid_fill(LAYER - 1).await;
}

/// Starts a fill of [`LAYER`] bytes, SIGKILLs larder once exactly `at`
/// bytes are in its temp file, and starts it again on the same cache.
async fn killed_mid_fill(at: usize) {
    let layer = random_bytes(LAYER, at as u64);
    let layer_digest = digest(&layer);
    let path = blob_path(&layer_digest);
    let up = FakeUpstream::builder().blob(layer.clone()).stall_after(at).start().await;
    let mut larder = start_larder(&up).await;
    let tmp = larder.cache_dir().join("tmp");

    let reader = client::open(address(&larder), &path).await;
    assert_eq!(reader.status(), 200, "GET {path}");
    wait_until(&format!("the fill has written {at} bytes to tmp/"), || bytes_in(&tmp) == at as u64).await;
    larder.stop();

    let (received, end, first_difference) = reader.compare_to_end(&layer).await;
    assert!(matches!(end, End::Aborted(_)), "the client's body ends aborted, got {end:?} after {received} bytes");
    assert!(received < LAYER as u64, "the client never got the whole blob ({received} bytes)");
    assert_eq!(first_difference, None, "what the client got is the blob's beginning");
    assert_eq!(files_in(&tmp).len(), 1, "the kill left the partial temp file behind");
    assert!(!larder.blob_file(&layer_digest).exists(), "nothing was committed");

    up.release(&layer_digest);
    larder.restart().await;
    assert_eq!(files_in(&tmp), Vec::<PathBuf>::new(), "start-up removed the temp file");
    assert!(!larder.blob_file(&layer_digest).exists(), "the partial fill was not adopted");

    let (len, end, first_difference) = client::open(address(&larder), &path).await.compare_to_end(&layer).await;
    assert_eq!((len, end, first_difference), (LAYER as u64, End::Complete, None), "GET after the restart");
    assert_eq!(up.blob_gets(&layer_digest), 2, "fetched again from the start");
    assert!(larder.blob_file(&layer_digest).exists());

    stop_and_verify_clean(&mut larder, 1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_right_after_a_commit() {
    let layer = random_bytes(LAYER, 1);
    let layer_digest = digest(&layer);
    let path = blob_path(&layer_digest);
    let up = FakeUpstream::builder().blob(layer.clone()).start().await;
    let mut larder = start_larder(&up).await;

    // The last byte reaches a client once the digest matched; the commit
    // (fsyncs, index row) follows, and the kill comes right after it.
    let (len, end, first_difference) = client::open(address(&larder), &path).await.compare_to_end(&layer).await;
    assert_eq!((len, end, first_difference), (LAYER as u64, End::Complete, None));
    stop_once_committed(&mut larder).await;

    larder.restart().await;
    assert_eq!(files_in(&larder.cache_dir().join("tmp")), Vec::<PathBuf>::new());
    let (len, end, first_difference) = client::open(address(&larder), &path).await.compare_to_end(&layer).await;
    assert_eq!((len, end, first_difference), (LAYER as u64, End::Complete, None), "GET after the restart");
    assert_eq!(up.blob_gets(&layer_digest), 1, "served from the cache: the commit survived the kill");

    stop_and_verify_clean(&mut larder, 1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_graceful_stop_lets_a_fill_in_flight_commit_before_the_exit() {
    let layer = random_bytes(LAYER, 5);
    let layer_digest = digest(&layer);
    let path = blob_path(&layer_digest);
    let up = FakeUpstream::builder().blob(layer.clone()).stall_after(LAYER / 2).start().await;
    let mut larder = start_larder(&up).await;
    let tmp = larder.cache_dir().join("tmp");

    // A client starts the fill and goes away; the fill goes on for nobody.
    let reader = client::open(address(&larder), &path).await;
    assert_eq!(reader.status(), 200, "GET {path}");
    wait_until("the fill has written half the blob", || bytes_in(&tmp) == (LAYER / 2) as u64).await;
    drop(reader);

    // SIGTERM: no connection is left to drain, yet larder waits for the
    // fill, which upstream lets finish only once the stop has begun.
    larder.send_sigterm();
    wait_until("larder stops accepting", || std::net::TcpStream::connect(address(&larder)).is_err()).await;
    up.release(&layer_digest);
    let status = larder.wait_exit(std::time::Duration::from_secs(30)).await;
    assert!(status.is_some_and(|s| s.success()), "exit after SIGTERM: {status:?}\n{}", larder.log());
    assert!(larder.blob_file(&layer_digest).exists(), "committed before the exit\n{}", larder.log());

    larder.restart().await;
    assert_served(&larder, &layer).await;
    assert_eq!(up.blob_gets(&layer_digest), 1, "served from the cache after the restart");
    stop_and_verify_clean(&mut larder, 1).await;
}

#[tokio::test]
async fn blob_files_deleted_or_truncated_while_stopped_are_dropped_and_fetched_again() {
    let blobs = [random_bytes(256 * KIB, 1), random_bytes(256 * KIB, 2), random_bytes(256 * KIB, 3)];
    let [deleted, truncated, intact] = blobs.each_ref().map(|b| digest(b));
    let up = fake_serving(&blobs).await;
    let mut larder = Larder::builder()
        .upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
        .server_line(ADMIN_LISTEN)
        .start()
        .await;
    for blob in &blobs {
        assert_served(&larder, blob).await;
    }
    stop_once_committed(&mut larder).await;

    remove(&larder.blob_file(&deleted));
    truncate(&larder.blob_file(&truncated), 100 * KIB as u64);
    let report = verify(&larder, false);
    assert_eq!((report.ok, report.bad, report.code), (1, 2, Some(1)), "larder verify:\n{}", report.output);
    assert!(report.names_bad(&deleted) && report.names_bad(&truncated), "larder verify:\n{}", report.output);

    // Started without repairing: start-up drops the row whose file is
    // missing, opening the truncated file finds its size wrong and drops
    // that row, and the next GET fetches each of them again.
    larder.restart().await;
    for blob in &blobs {
        assert_served(&larder, blob).await;
    }
    assert_eq!(up.blob_gets(&deleted), 2, "the deleted blob was fetched again");
    assert_eq!(up.blob_gets(&truncated), 2, "the truncated blob was fetched again");
    assert_eq!(up.blob_gets(&intact), 1, "the intact blob came from the cache");
    // Each dropped row gave back its bytes, and each refetch counted them
    // once: usage is exactly the three files, once the check is done.
    while metric(&larder, "larder_cache_reconcile_running").await != 0.0 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let on_disk: u64 =
        blobs.iter().map(|b| std::fs::metadata(larder.blob_file(&digest(b))).expect("blob file").len()).sum();
    assert_eq!(on_disk, 3 * 256 * KIB as u64);
    assert_eq!(metric(&larder, "larder_cache_size_bytes").await, on_disk as f64, "usage is exact");

    stop_and_verify_clean(&mut larder, 3).await;
}

#[tokio::test]
async fn verify_finds_a_corrupted_blob_and_repair_removes_it() {
    let blobs = [random_bytes(256 * KIB, 4), random_bytes(256 * KIB, 5)];
    let [corrupted, intact] = blobs.each_ref().map(|b| digest(b));
    let up = fake_serving(&blobs).await;
    let mut larder = start_larder(&up).await;
    for blob in &blobs {
        assert_served(&larder, blob).await;
    }
    stop_once_committed(&mut larder).await;

    // Same length, one byte changed: only re-hashing can tell.
    flip_a_byte(&larder.blob_file(&corrupted));
    let report = verify(&larder, false);
    assert_eq!((report.ok, report.bad, report.code), (1, 1, Some(1)), "larder verify:\n{}", report.output);
    assert!(report.names_bad(&corrupted), "larder verify:\n{}", report.output);
    assert!(larder.blob_file(&corrupted).exists(), "verify without --repair changes nothing");

    let repaired = verify(&larder, true);
    assert_eq!(repaired.code, Some(0), "larder verify --repair:\n{}", repaired.output);
    assert!(!larder.blob_file(&corrupted).exists(), "--repair removed the bad blob");
    let report = verify(&larder, false);
    assert_eq!((report.ok, report.bad, report.code), (1, 0, Some(0)), "after --repair:\n{}", report.output);

    larder.restart().await;
    for blob in &blobs {
        assert_served(&larder, blob).await;
    }
    assert_eq!(up.blob_gets(&corrupted), 2, "the repaired blob was fetched again");
    assert_eq!(up.blob_gets(&intact), 1, "the intact blob came from the cache");
}

#[tokio::test]
async fn files_without_an_index_row_are_adopted_when_they_match_their_name_and_removed_otherwise() {
    let blobs = [random_bytes(256 * KIB, 6), random_bytes(256 * KIB, 7)];
    let [orphan, impostor] = blobs.each_ref().map(|b| digest(b));
    let up = fake_serving(&blobs).await;
    let mut larder = start_larder(&up).await;
    larder.stop();

    // A correct blob without its index row is what a kill between the
    // rename and the index write leaves; the other file is not its name's
    // content; and a fill's temp file is left in tmp/.
    plant(&larder.blob_file(&orphan), &blobs[0]);
    plant(&larder.blob_file(&impostor), &random_bytes(256 * KIB, 8));
    plant(&larder.cache_dir().join("tmp/fill-left-by-a-crash"), &blobs[1][..KIB]);

    larder.restart().await;
    assert_eq!(files_in(&larder.cache_dir().join("tmp")), Vec::<PathBuf>::new(), "tmp/ is emptied");
    // Serving already; the files are checked against the index meanwhile.
    wait_until("the background check reports", || larder.log().contains("reconciled the index with the blob files"))
        .await;
    assert!(larder.blob_file(&orphan).exists(), "the correct file is kept");
    assert!(!larder.blob_file(&impostor).exists(), "the wrong file is removed");

    for blob in &blobs {
        assert_served(&larder, blob).await;
    }
    assert_eq!(up.blob_gets(&orphan), 0, "the adopted blob is served from the cache");
    assert_eq!(up.blob_gets(&impostor), 1, "the removed one is fetched");

    stop_and_verify_clean(&mut larder, 2).await;
}

// ---- helpers ----------------------------------------------------------------

async fn fake_serving(blobs: &[Bytes]) -> FakeUpstream {
    blobs.iter().fold(FakeUpstream::builder(), |builder, blob| builder.blob(blob.clone())).start().await
}

/// larder in front of the fake, via the harness that can stop (SIGKILL)
/// and restart it on the same cache folder.
async fn start_larder(up: &FakeUpstream) -> Larder {
    Larder::builder()
        .upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
        .server_line(ADMIN_LISTEN)
        .start()
        .await
}

/// Kills larder once what it served is committed, then `larder verify`
/// must find `ok` good blobs and nothing bad.
async fn stop_and_verify_clean(larder: &mut Larder, ok: u64) {
    stop_once_committed(larder).await;
    let report = verify(larder, false);
    assert_eq!((report.ok, report.bad, report.code), (ok, 0, Some(0)), "larder verify:\n{}", report.output);
}

/// Kills larder once what it served is committed.
async fn stop_once_committed(larder: &mut Larder) {
    wait_for_commits(larder).await;
    larder.stop();
}

fn address(larder: &Larder) -> SocketAddr {
    larder.host_port().parse().expect("larder's address")
}

/// GETs the blob through larder and checks every byte.
async fn assert_served(larder: &Larder, blob: &Bytes) {
    let path = blob_path(&digest(blob));
    let (len, end, first_difference) = client::open(address(larder), &path).await.compare_to_end(blob).await;
    assert_eq!((len, end, first_difference), (blob.len() as u64, End::Complete, None), "GET {path}");
}

/// The files in `dir` (none if it does not exist).
fn files_in(dir: &Path) -> Vec<PathBuf> {
    match std::fs::read_dir(dir) {
        Ok(entries) => entries.map(|e| e.expect("a directory entry").path()).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("cannot list {}: {e}", dir.display()),
    }
}

/// Total size of the files in `dir`.
fn bytes_in(dir: &Path) -> u64 {
    files_in(dir).iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum()
}

fn plant(path: &Path, bytes: &[u8]) {
    let parent = path.parent().expect("a parent folder");
    std::fs::create_dir_all(parent).unwrap_or_else(|e| panic!("cannot create {}: {e}", parent.display()));
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

fn remove(path: &Path) {
    std::fs::remove_file(path).unwrap_or_else(|e| panic!("cannot remove {}: {e}", path.display()));
}

fn truncate(path: &Path, len: u64) {
    let file = std::fs::OpenOptions::new().write(true).open(path);
    file.and_then(|f| f.set_len(len)).unwrap_or_else(|e| panic!("cannot truncate {}: {e}", path.display()));
}

fn flip_a_byte(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

/// What `larder verify` printed and how it exited.
struct Verified {
    /// The exit status: 1 while bad entries remain.
    code: Option<i32>,
    ok: u64,
    bad: u64,
    /// The `bad: …` lines.
    bad_lines: Vec<String>,
    output: String,
}

impl Verified {
    fn names_bad(&self, digest: &str) -> bool {
        let hex = digest.trim_start_matches("sha256:");
        self.bad_lines.iter().any(|line| line.contains(hex))
    }
}

/// Runs `larder verify --config <larder's config> [--repair]`; larder must
/// be stopped.
fn verify(larder: &Larder, repair: bool) -> Verified {
    let mut command = Command::new(env!("CARGO_BIN_EXE_larder"));
    command.arg("verify").arg("--config").arg(larder.config_path());
    if repair {
        command.arg("--repair");
    }
    let out = command.output().unwrap_or_else(|e| panic!("cannot run larder verify: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let output = format!("{stdout}{}(exit status {})", String::from_utf8_lossy(&out.stderr), out.status);
    let summary = Regex::new(r"(?m): (\d+) blobs? ok \([^)]*\), (\d+) bad\b").expect("a valid pattern");
    let counts = summary.captures(&stdout).unwrap_or_else(|| panic!("no `N blobs ok (…), M bad` summary:\n{output}"));
    Verified {
        code: out.status.code(),
        ok: counts[1].parse().expect("a count"),
        bad: counts[2].parse().expect("a count"),
        bad_lines: stdout.lines().filter(|l| l.starts_with("bad: ")).map(str::to_owned).collect(),
        output,
    }
}
