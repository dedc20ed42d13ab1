//! The cold path against a misbehaving upstream and a failing disk (issue
//! 31): no fill wedges its blob, whatever fails.
//!
//! - A local I/O error (the hash's read-back of a ranged fill, a write)
//!   or a panic in a fill's task fails that fill: every client's body is
//!   aborted, nothing stays in flight or in `tmp/`, and the next request
//!   fills the blob again.
//! - An upstream that honours ranges only sometimes (a `200` to a later
//!   part, a `206` longer than asked) is read as one stream from what the
//!   fill has, and not asked for parts again for a while; one that answers
//!   other bytes than asked fails that fill only; shorter `206`s are
//!   resumed from the byte they reached.
//! - A part that trickles and stalls every time fails its fill after a few
//!   idle timeouts, and a fill slower than the minimum rate fails at its
//!   deadline.
//! - A manifest's declared sizes bound its blobs after a restart too, a
//!   declared size is the only size the blob may have, and it never raises
//!   the bound above `max_blob_size`.
//! - A purge of a repository during a fill is not undone by the commit.
//! - Fills ahead meet the same faults (a `200` or a shifted `206` to a
//!   part, a trickle, a failed read-back or commit) and end as cleanly:
//!   no flight left, nothing committed, the next pull fills again; one
//!   held below the minimum rate by `max_bandwidth` is not cut.
//!
//! The fake upstream injects the upstream's faults; larder's own disk
//! faults are injected by its debug build (`fake::INJECT_FAULTS`).

mod common;
mod fake;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::metrics::{ADMIN_LISTEN, metric, wait_for_commits};
use common::{Admin, Larder, LarderBuilder, Upstream, http};
use fake::client::{self, End};
use fake::{
    FakeUpstream, FakeUpstreamBuilder, Faults, KIB, MIB, OCI_MANIFEST, REPO, Ranges, UPSTREAM_NAME, blob_path, digest,
    image_manifest, manifest_path, random_bytes,
};

/// `parts::PART_SIZE`: parts end on multiples of it.
const PART: usize = 8 * MIB;

/// A layer large enough for ranged parts: two parts and a few bytes.
fn large_layer(seed: u64) -> Bytes {
    random_bytes(2 * PART + 7 + seed as usize, seed)
}

/// A fake upstream (not started) serving `test/app:v1`: a config and
/// `layers`, each declared in the manifest with the size in `declared`
/// (its own length where `None`).
fn v1(layers: &[&Bytes], declared: &[Option<usize>]) -> FakeUpstreamBuilder {
    let config = random_bytes(300, 999);
    let described: Vec<(String, usize)> = layers
        .iter()
        .enumerate()
        .map(|(i, l)| (digest(l), declared.get(i).copied().flatten().unwrap_or(l.len())))
        .collect();
    let refs: Vec<(&str, usize)> = described.iter().map(|(d, n)| (d.as_str(), *n)).collect();
    let manifest = image_manifest((&digest(&config), config.len()), &refs);
    let builder = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, manifest).blob(config);
    layers.iter().fold(builder, |b, l| b.blob((*l).clone()))
}

/// Every blob answers ranges as `ranges` says.
fn answering(ranges: Ranges) -> Faults {
    Faults { ranges: Some(ranges), ..Faults::default() }
}

/// larder in front of `up`, blobs of 16 MiB or more in parallel parts,
/// only what clients ask for fetched (no fills ahead), `lines` in the
/// upstream's table.
fn larder(up: &FakeUpstream, lines: &[&str]) -> LarderBuilder {
    let upstream = Upstream::new(UPSTREAM_NAME, &up.url()).default(true).line("fill_ahead = false");
    let upstream = lines.iter().fold(upstream, |u, l| u.line(l));
    Larder::builder().upstream(upstream).cache_line(r#"parallel_fill_min = "16MiB""#).server_line(ADMIN_LISTEN)
}

fn address(larder: &Larder) -> SocketAddr {
    larder.host_port().parse().expect("larder's address")
}

async fn get_manifest(addr: SocketAddr) {
    let resp = client::get_with(addr, &manifest_path("v1"), &[("Accept", OCI_MANIFEST)]).await;
    assert_eq!(resp.status(), 200, "the manifest: {:?}", String::from_utf8_lossy(&resp.body));
}

/// GETs `blob` whole; asserts it arrives complete and exact.
async fn assert_served(addr: SocketAddr, blob: &[u8]) {
    let got = client::open(addr, &blob_path(&digest(blob))).await.compare_to_end(blob).await;
    assert_eq!(got, (blob.len() as u64, End::Complete, None), "the blob, complete and exact");
}

/// GETs `blob` whole; asserts no client could take what it got for the
/// blob: an error status, a body cut off (after its head, or before it),
/// never a clean end.
async fn assert_not_served(addr: SocketAddr, blob: &[u8]) -> String {
    match client::try_open(addr, &blob_path(&digest(blob))).await {
        Ok(streaming) if streaming.status() == 200 => {
            let (len, end, _) = streaming.compare_to_end(blob).await;
            match end {
                End::Aborted(why) => why,
                End::Complete => panic!("{len} bytes served as the whole blob"),
            }
        }
        Ok(streaming) => format!("status {}", streaming.status()),
        // Cut off before its head: closed, or reset (a reset can overtake
        // the closing, and on a loaded machine sometimes does).
        Err(e) => {
            assert!(e.contains("closed before a response head") || e.starts_with("reading the response head"), "{e}");
            e
        }
    }
}

/// The start of a response body, for a failure message (a blob served
/// where an error was due is not printed whole).
fn brief(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
    format!("{} bytes: {text:?}", body.len())
}

/// Files in larder's `tmp/` (fills in flight, or left behind).
fn temp_files(larder: &Larder) -> usize {
    std::fs::read_dir(larder.cache_dir().join("tmp")).map_or(0, |d| d.count())
}

// ---- local faults and panics ---------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_hash_read_back_fails_the_fill_and_the_next_request_fills_again() {
    let layer = large_layer(1);
    let path = blob_path(&digest(&layer));
    // Its first bytes wait a second: every client is on the fill by then.
    let up =
        v1(&[&layer], &[]).delay_body(Duration::from_secs(1)).faults_for_all(answering(Ranges::Honoured)).start().await;
    // The first read-back of what the parts wrote fails with EIO (before:
    // `unreachable!` in parts.rs, a panic, and the blob wedged until restart).
    let larder = larder(&up, &[]).inject_faults("temp_read:EIO:0:1").start().await;
    let addr = address(&larder);
    get_manifest(addr).await;

    // Four clients on the one fill: each is cut off, none hangs.
    let clients = (0..4).map(|_| assert_not_served(addr, &layer));
    futures_util::future::join_all(clients).await;
    wait_for_commits(&larder).await;
    assert!(larder.log().contains("injected I/O error"), "the fault was injected");
    assert_eq!(temp_files(&larder), 0, "the failed fill's temp file is gone");

    // Nothing claims the blob: a HEAD asks upstream, a GET fills it again.
    assert_eq!(client::head(addr, &path).await.status, 200);
    assert_eq!(up.requests("HEAD", &path), 1, "the HEAD was answered by upstream, not by a fill left in flight");
    assert_served(addr, &layer).await;
    wait_for_commits(&larder).await;
    assert!(larder.blob_file(&digest(&layer)).exists(), "committed this time");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fill_task_that_panics_fails_its_fill_instead_of_wedging_the_blob() {
    let layer = random_bytes(3 * MIB, 2);
    let up = FakeUpstream::builder().blob(layer.clone()).start().await;
    // The first fill's task panics once its temp file is open.
    let larder = larder(&up, &[]).inject_faults("fill:panic:0:1").start().await;
    let addr = address(&larder);

    assert_not_served(addr, &layer).await;
    wait_for_commits(&larder).await;
    assert!(larder.log().contains("ended without a result"), "the guard failed the fill");
    assert_eq!(temp_files(&larder), 0);
    assert_served(addr, &layer).await;
    assert_eq!(up.blob_gets(&digest(&layer)), 2, "filled anew");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_write_of_a_part_fails_the_fill_and_the_next_request_fills_again() {
    let layer = large_layer(3);
    let up = v1(&[&layer], &[]).faults_for_all(answering(Ranges::Honoured)).start().await;
    let larder = larder(&up, &[]).inject_faults("temp_write:EIO:5:1").start().await;
    let addr = address(&larder);
    get_manifest(addr).await;

    assert_not_served(addr, &layer).await;
    wait_for_commits(&larder).await;
    assert_eq!(temp_files(&larder), 0);
    assert_served(addr, &layer).await;
}

// ---- ranges honoured only sometimes ----------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_later_part_answered_with_the_whole_blob_goes_on_as_one_stream() {
    let (first, second) = (large_layer(4), large_layer(5));
    // Mixed backends: the first part's range is honoured, later ones get
    // the whole blob (before: three tries per part, then every pull failed).
    let up = v1(&[&first, &second], &[]).faults_for_all(answering(Ranges::FirstOnly)).start().await;
    let larder = larder(&up, &[]).start().await;
    let addr = address(&larder);
    get_manifest(addr).await;

    assert_served(addr, &first).await;
    wait_for_commits(&larder).await;
    let sent = up.bytes_sent(&digest(&first));
    assert!(
        sent < 3 * first.len() as u64,
        "{sent} bytes sent for a {}-byte blob: none fetched again and again",
        first.len()
    );

    // The upstream's ranges are not relied on for a while: the next large
    // blob is asked for as one stream, without a range.
    assert_served(addr, &second).await;
    let path = blob_path(&digest(&second));
    let ranged: Vec<_> = up.log().into_iter().filter(|r| r.path == path && r.range.is_some()).collect();
    assert_eq!(ranged.len(), 0, "{ranged:?}");
    assert_eq!(up.blob_gets(&digest(&second)), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_first_part_answered_with_a_longer_206_is_read_as_one_stream() {
    let layer = large_layer(6);
    let d = digest(&layer);
    // Every range answered from the byte asked to the blob's end (before: 502).
    let up = v1(&[&layer], &[]).faults_for_all(answering(Ranges::Overlong)).start().await;
    let larder = larder(&up, &[]).start().await;
    let addr = address(&larder);
    get_manifest(addr).await;

    assert_served(addr, &layer).await;
    assert_eq!(up.blob_gets(&d), 1, "the first part's answer was the rest of the blob, read as one stream");
    assert_eq!(up.bytes_sent(&d), layer.len() as u64, "nothing fetched twice");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_later_part_answered_with_a_longer_206_goes_on_as_one_stream() {
    let layer = large_layer(7);
    let up = v1(&[&layer], &[]).faults_for_all(answering(Ranges::OverlongLater)).start().await;
    let larder = larder(&up, &[]).start().await;
    let addr = address(&larder);
    get_manifest(addr).await;

    assert_served(addr, &layer).await;
    wait_for_commits(&larder).await;
    assert!(larder.blob_file(&digest(&layer)).exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_range_answered_with_other_bytes_fails_that_fill_and_the_next_pull_goes_as_one_stream() {
    let layer = large_layer(15);
    let d = digest(&layer);
    // Every range answered 100 bytes further on than asked, and said so.
    let up = v1(&[&layer], &[]).faults_for_all(answering(Ranges::Shifted(100))).start().await;
    let larder = larder(&up, &[]).start().await;
    let addr = address(&larder);
    get_manifest(addr).await;

    let resp = client::get(addr, &blob_path(&d)).await;
    assert_eq!(resp.status(), 502, "bytes other than asked are never used: {}", brief(&resp.body));
    // Before: every pull asked for the first part again, and failed again.
    assert_served(addr, &layer).await;
    assert_eq!(up.log().iter().filter(|r| r.path == blob_path(&d) && r.range.is_some()).count(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn short_206s_are_resumed_from_the_byte_they_reached() {
    let layer = large_layer(8);
    let d = digest(&layer);
    let up = v1(&[&layer], &[]).faults_for_all(answering(Ranges::Short(MIB))).start().await;
    let larder = larder(&up, &[]).start().await;
    let addr = address(&larder);
    get_manifest(addr).await;

    assert_served(addr, &layer).await;
    assert_eq!(up.bytes_sent(&d), layer.len() as u64, "each GET asked for what the ones before had not brought");
    assert_eq!(up.blob_gets(&d), layer.len().div_ceil(MIB), "one GET per MiB answered");
}

// ---- trickles and the deadline -------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_part_that_trickles_and_stalls_every_time_fails_its_fill_within_a_minute() {
    let layer = large_layer(9);
    // Each answer brings 64 KiB, then stalls (before: every bit of progress
    // started the count of attempts again, 128 resumes of 2 s per part).
    let up = v1(&[&layer], &[]).ranges(Ranges::Honoured).stall_after(64 * KIB).start().await;
    let larder = larder(&up, &[r#"body_idle_timeout = "2s""#]).start().await;
    let addr = address(&larder);
    get_manifest(addr).await;

    let failed = tokio::time::timeout(Duration::from_secs(60), assert_not_served(addr, &layer)).await;
    assert!(failed.is_ok(), "the fill still ran after a minute");
    wait_for_commits(&larder).await;
    let resumes = metric(&larder, &format!("larder_fill_part_resumes_total{{upstream=\"{UPSTREAM_NAME}\"}}")).await;
    assert!(resumes <= 3.0 * 3.0, "{resumes} resumes for three parts");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fill_slower_than_the_minimum_rate_fails_at_its_deadline() {
    // 2 MiB at 32 KiB/s (a chunk every half second, never idle for long)
    // would take 64 s; its deadline is 30 s plus 2 MiB at 256 KiB/s, 38 s.
    let layer = random_bytes(2 * MIB, 10);
    let up = FakeUpstream::builder().blob(layer.clone()).trickle(16 * KIB, Duration::from_millis(500)).start().await;
    let larder = larder(&up, &[]).start().await;
    let addr = address(&larder);

    let why = assert_not_served(addr, &layer).await;
    assert_eq!(up.bodies_finished(&digest(&layer)), 0, "cut off before upstream's body ended ({why})");
    wait_for_commits(&larder).await;
    assert!(larder.log().contains("deadline"), "the fill failed at its deadline");
    assert_eq!(temp_files(&larder), 0);
}

// ---- fills ahead, and under `max_bandwidth` ------------------------------

/// larder in front of `up` with fills ahead on (as shipped), blobs of
/// 16 MiB or more in parallel parts, `lines` in the upstream's table.
fn larder_ahead(up: &FakeUpstream, lines: &[&str]) -> LarderBuilder {
    let upstream = lines.iter().fold(Upstream::new(UPSTREAM_NAME, &up.url()).default(true), |u, l| u.line(l));
    Larder::builder().upstream(upstream).cache_line(r#"parallel_fill_min = "16MiB""#).server_line(ADMIN_LISTEN)
}

/// Pulls `test/app:v1`'s manifest and its first layer (`first`), which
/// starts the fill ahead of the image's other layer; waits until it has.
async fn pull_first_layer(larder: &Larder, first: &[u8]) {
    let addr = address(larder);
    get_manifest(addr).await;
    assert_served(addr, first).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while metric(larder, r#"larder_fills_total{reason="ahead"}"#).await < 1.0 {
        assert!(tokio::time::Instant::now() < deadline, "the fill ahead never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether `blob` was asked of `up` with a `Range` (as a ranged fill's part).
fn asked_for_parts(up: &FakeUpstream, blob: &[u8]) -> bool {
    up.log().iter().any(|r| r.path == blob_path(&digest(blob)) && r.range.is_some())
}

/// Waits (up to `limit`) until no fill is in flight.
async fn wait_for_no_fills(larder: &Larder, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    while metric(larder, "larder_fills_in_flight").await != 0.0 {
        assert!(tokio::time::Instant::now() < deadline, "a fill still in flight after {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fill_ahead_answered_200_to_a_later_part_commits_and_the_pull_after_it_is_a_hit() {
    let (first, second) = (random_bytes(MIB, 20), large_layer(21));
    let up = v1(&[&first, &second], &[]).start().await;
    up.set_faults(&digest(&second), answering(Ranges::FirstOnly));
    let larder = larder_ahead(&up, &[]).start().await;
    pull_first_layer(&larder, &first).await;

    wait_for_no_fills(&larder, Duration::from_secs(60)).await;
    assert!(asked_for_parts(&up, &second), "the fill ahead asked for parts");
    assert!(larder.blob_file(&digest(&second)).exists(), "the fill ahead went on as one stream and committed");
    let gets = up.blob_gets(&digest(&second));
    assert_served(address(&larder), &second).await;
    assert_eq!(up.blob_gets(&digest(&second)), gets, "the pull was a hit");
    assert_eq!(temp_files(&larder), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fill_ahead_answered_with_shifted_206s_fails_alone_and_the_next_pull_works() {
    let (first, second) = (random_bytes(MIB, 22), large_layer(23));
    let up = v1(&[&first, &second], &[]).start().await;
    up.set_faults(&digest(&second), answering(Ranges::Shifted(100)));
    let larder = larder_ahead(&up, &[]).start().await;
    pull_first_layer(&larder, &first).await;

    // The fill ahead fails (bytes other than asked are never used) and
    // leaves nothing behind: no flight, no temp file, no entry.
    wait_for_no_fills(&larder, Duration::from_secs(60)).await;
    assert!(asked_for_parts(&up, &second), "the fill ahead asked for parts");
    assert!(!larder.blob_file(&digest(&second)).exists());
    assert_eq!(temp_files(&larder), 0);
    // The client's own pull of it goes as one stream, and is served.
    assert_served(address(&larder), &second).await;
    wait_for_no_fills(&larder, Duration::from_secs(30)).await;
    assert!(larder.blob_file(&digest(&second)).exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fill_ahead_that_trickles_under_a_cap_fails_at_its_deadline_and_its_client_is_cut() {
    // 2 MiB at 32 KiB/s would take 64 s; its deadline is 30 s plus 2 MiB at
    // 256 KiB/s, 38 s. The cap (64 MiB/s) never holds it back.
    let (first, second) = (random_bytes(MIB, 24), random_bytes(2 * MIB, 25));
    let d = digest(&second);
    let up = v1(&[&first, &second], &[]).start().await;
    up.set_faults(&d, Faults { trickle: Some((16 * KIB, Duration::from_millis(500))), ..Faults::default() });
    let larder = larder_ahead(&up, &[r#"max_bandwidth = "64MiB""#]).start().await;
    pull_first_layer(&larder, &first).await;

    // A client asking for the layer joins the fill ahead, and is cut off
    // with it at the deadline.
    let why = tokio::time::timeout(Duration::from_secs(90), assert_not_served(address(&larder), &second)).await;
    let why = why.expect("the trickling fill ahead still ran after 90 s");
    assert_eq!(up.bodies_finished(&d), 0, "cut off before upstream's body ended ({why})");
    wait_for_no_fills(&larder, Duration::from_secs(30)).await;
    assert!(larder.log().contains("deadline"), "the fill failed at its deadline");
    assert_eq!(temp_files(&larder), 0);

    // Upstream is asked again on the next pull, which is served.
    let gets = up.blob_gets(&d);
    up.heal(&d);
    assert_served(address(&larder), &second).await;
    assert_eq!(up.blob_gets(&d), gets + 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fill_ahead_held_below_the_minimum_rate_by_max_bandwidth_is_not_cut() {
    // At 64 KiB/s the 4 MiB layer takes about 64 s; its allowance at the
    // minimum rate is 30 s + 16 s. The cap, not the source, holds it.
    let (first, second) = (random_bytes(64 * KIB, 26), random_bytes(4 * MIB, 27));
    let d = digest(&second);
    let up = v1(&[&first, &second], &[]).start().await;
    let larder = larder_ahead(&up, &[r#"max_bandwidth = "64KiB""#]).start().await;
    let started = tokio::time::Instant::now();
    pull_first_layer(&larder, &first).await;

    wait_for_no_fills(&larder, Duration::from_secs(150)).await;
    let took = started.elapsed();
    assert!(took > Duration::from_secs(46), "the cap held the fill past its allowance ({took:?})");
    assert!(!larder.log().contains("deadline"), "not cut at its deadline");
    assert!(larder.blob_file(&d).exists(), "the fill ahead committed after {took:?}");
    assert_eq!(up.blob_gets(&d), 1);
    assert_served(address(&larder), &second).await;
    assert_eq!(up.blob_gets(&d), 1, "the pull was a hit");
}

/// A fill ahead meets the local fault `rule` (the client's own fill of
/// the first layer, 1 MiB in one stream, has long committed when it
/// does): the fill ahead fails, nothing of it is committed or left in
/// flight or in `tmp/`, and the layer's next pull fills it again.
async fn a_fill_ahead_meeting(rule: &str, seed: u64) {
    let (first, second) = (random_bytes(MIB, seed), large_layer(seed + 1));
    let d = digest(&second);
    let up = v1(&[&first, &second], &[]).faults_for_all(answering(Ranges::Honoured)).start().await;
    up.set_faults(&d, Faults { delay_body: Some(Duration::from_secs(1)), ..answering(Ranges::Honoured) });
    let larder = larder_ahead(&up, &[]).inject_faults(rule).start().await;
    pull_first_layer(&larder, &first).await;

    wait_for_no_fills(&larder, Duration::from_secs(60)).await;
    assert!(larder.log().contains("injected I/O error"), "the fault was injected");
    assert!(!larder.blob_file(&d).exists(), "nothing of the failed fill ahead committed");
    assert_eq!(temp_files(&larder), 0, "its temp file is gone");
    let gets = up.blob_gets(&d);
    up.heal(&d);
    assert_served(address(&larder), &second).await;
    assert!(up.blob_gets(&d) > gets, "upstream asked again");
    wait_for_no_fills(&larder, Duration::from_secs(30)).await;
    assert!(larder.blob_file(&d).exists(), "committed this time");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fill_ahead_whose_hash_read_back_fails_leaves_nothing_behind() {
    a_fill_ahead_meeting("temp_read:EIO:0:1", 30).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fill_ahead_whose_commit_fails_leaves_nothing_behind() {
    // The first commit is the client's layer; the second the fill ahead's.
    a_fill_ahead_meeting("commit:ENOSPC:1:1", 32).await;
}

// ---- declared sizes --------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_manifests_declared_size_still_bounds_its_blob_after_a_restart() {
    // Sent without a length, and longer than the manifest declares.
    let layer = random_bytes(300 * KIB, 11);
    let up = v1(&[&layer], &[Some(200 * KIB)]).chunked().start().await;
    let mut larder = larder(&up, &[]).start().await;
    get_manifest(address(&larder)).await;
    assert_not_served(address(&larder), &layer).await;

    // The manifest is served from the index after the restart; its sizes
    // are known there too (before: only in memory, so the same blob was
    // fetched without a bound and committed).
    wait_for_commits(&larder).await;
    larder.restart().await;
    get_manifest(address(&larder)).await;
    assert_not_served(address(&larder), &layer).await;
    wait_for_commits(&larder).await;
    assert!(!larder.blob_file(&digest(&layer)).exists(), "nothing of another size than declared was committed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_declared_size_larger_than_the_blob_fails_its_fill() {
    let layer = random_bytes(100 * KIB, 12);
    let up = v1(&[&layer], &[Some(100 * KIB + 1000)]).start().await;
    let larder = larder(&up, &[]).start().await;
    let addr = address(&larder);
    get_manifest(addr).await;

    let resp = client::get(addr, &blob_path(&digest(&layer))).await;
    assert_eq!(resp.status(), 502, "{}", brief(&resp.body));
    assert!(String::from_utf8_lossy(&resp.body).contains("declares"), "{}", brief(&resp.body));
    wait_for_commits(&larder).await;
    assert!(!larder.blob_file(&digest(&layer)).exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_declared_size_above_max_blob_size_is_refused_before_anything_is_fetched() {
    let layer = random_bytes(2 * MIB, 13);
    let up = v1(&[&layer], &[]).chunked().start().await;
    let larder = larder(&up, &[]).cache_line(r#"max_blob_size = "1MiB""#).start().await;
    let addr = address(&larder);
    get_manifest(addr).await;

    // The manifest declares 2 MiB (before: that raised the bound to 2 MiB).
    let resp = client::get(addr, &blob_path(&digest(&layer))).await;
    assert_eq!(resp.status(), 502, "{}", brief(&resp.body));
    assert_eq!(up.blob_gets(&digest(&layer)), 0, "nothing was asked of upstream");
    assert_eq!(temp_files(&larder), 0);
}

// ---- purges -----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_purge_during_a_fill_is_not_undone_when_the_fill_commits() {
    let layer = random_bytes(MIB, 14);
    let d = digest(&layer);
    let up = FakeUpstream::builder().blob(layer.clone()).stall_after(256 * KIB).start().await;
    let builder = Larder::builder().upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true));
    let (builder, admin) = Admin::with_token(builder, "a-test-token-0123456789");
    let larder = builder.start().await;
    let addr = address(&larder);

    // A client's fill is half way when the repository is purged.
    let mut pulling = client::open(addr, &blob_path(&d)).await;
    assert_eq!(pulling.read_exact(256 * KIB).await, layer[..256 * KIB]);
    let purge = format!("{}/purge?upstream={UPSTREAM_NAME}&repo={REPO}", admin.url());
    let resp = http::client().post(&purge).bearer_auth("a-test-token-0123456789").send().await.expect("purge");
    assert_eq!(resp.status(), 200);

    // Upstream no longer has the blob in that repository; the fill in
    // flight still ends, and commits.
    up.set_faults(&d, Faults { status: Some(404), ..Faults::default() });
    let (rest, end) = pulling.read_to_end().await;
    assert_eq!((rest.len(), end), (layer.len() - 256 * KIB, End::Complete));
    wait_for_commits(&larder).await;
    assert!(larder.blob_file(&d).exists(), "the blob itself is committed");

    // Without a membership row, the repository must ask upstream again
    // (before: the commit wrote the row back, and this was a hit).
    let again = client::get(addr, &blob_path(&d)).await;
    assert_eq!(again.status(), 404, "{}", brief(&again.body));
    assert_eq!(up.requests("HEAD", &blob_path(&d)), 1, "upstream was asked");
}
