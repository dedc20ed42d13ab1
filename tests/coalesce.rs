//! Single-flight blob fills: one upstream GET per digest however many
//! clients ask, clients that leave never cancel the fill, a failed fill
//! aborts every reader and is never cached, a slow reader slows nobody
//! else, and `max_concurrency` bounds the requests open upstream.

mod fake;

use fake::client::{self, End, SlowReader};
use fake::{FakeUpstream, KIB, Larder, MIB, blob_path, digest, random_bytes, wait_until};
use tokio::sync::mpsc;

#[tokio::test(flavor = "multi_thread")]
async fn thirty_two_clients_share_one_fill_while_half_of_them_leave() {
    let bytes = random_bytes(32 * MIB, 1);
    let d = digest(&bytes);
    let path = blob_path(&d);
    // Upstream holds the body at 2 MiB until every client has joined.
    let up = FakeUpstream::builder().blob(bytes.clone()).stall_after(2 * MIB).start().await;
    let larder = Larder::start(&up).await;

    // The very first client starts the fill; it will leave after 1 MiB.
    let mut first = client::open(larder.addr(), &path).await;
    assert_eq!(first.status(), 200);
    assert_eq!(up.blob_gets(&d), 1);

    // 31 more join the fill in flight; 15 of them leave after 1 MiB too.
    let leaves = |i: usize| i % 2 == 0;
    let (joined_tx, mut joined) = mpsc::unbounded_channel::<usize>();
    let (left_tx, mut left) = mpsc::unbounded_channel::<usize>();
    let mut clients = Vec::new();
    for i in 1..32 {
        let (addr, path, bytes) = (larder.addr(), path.clone(), bytes.clone());
        let (joined_tx, left_tx) = (joined_tx.clone(), left_tx.clone());
        clients.push(tokio::spawn(async move {
            let mut s = client::open(addr, &path).await;
            assert_eq!(s.status(), 200, "client {i}");
            joined_tx.send(i).unwrap();
            if leaves(i) {
                assert!(s.read_exact(MIB).await == bytes[..MIB], "client {i}");
                drop(s);
                left_tx.send(i).unwrap();
                None
            } else {
                // Compared byte for byte with the blob whose sha256 is `d`
                // (hashing 16 × 32 MiB in a debug build takes many seconds).
                Some(s.compare_to_end(&bytes).await)
            }
        }));
    }
    drop((joined_tx, left_tx));
    assert!(first.read_exact(MIB).await == bytes[..MIB]);
    drop(first);
    for _ in 0..31 {
        joined.recv().await.expect("every client gets a response head");
    }
    for _ in 0..15 {
        left.recv().await.expect("every leaver reads 1 MiB");
    }

    up.release(&d);
    let mut stayed = 0;
    for (i, task) in (1..32).zip(clients) {
        let Some((len, end, first_difference)) = task.await.expect("client task") else {
            continue;
        };
        assert_eq!(end, End::Complete, "client {i}");
        assert_eq!(len, bytes.len() as u64, "client {i}");
        assert_eq!(first_difference, None, "client {i}: exact bytes");
        stayed += 1;
    }
    assert_eq!(stayed, 16);
    assert_eq!(up.blob_gets(&d), 1, "one upstream GET for 32 clients");

    // Warm now: served without asking upstream again, sha256 checked.
    let (len, got, end) = client::open(larder.addr(), &path).await.hash_to_end().await;
    assert_eq!((len, got, end), (bytes.len() as u64, d.clone(), End::Complete));
    assert_eq!(up.blob_gets(&d), 1, "a warm GET makes no upstream GET");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_fill_aborts_every_reader_and_the_next_request_fills_afresh() {
    let bytes = random_bytes(4 * MIB, 2);
    let d = digest(&bytes);
    let path = blob_path(&d);
    // Same length, wrong content; held at 1 MiB until all readers are in.
    let up = FakeUpstream::builder().blob(bytes.clone()).wrong_bytes().stall_after(MIB).start().await;
    let larder = Larder::start(&up).await;

    let mut readers = Vec::new();
    for _ in 0..4 {
        let s = client::open(larder.addr(), &path).await;
        assert_eq!(s.status(), 200);
        readers.push(s);
    }
    assert_eq!(up.blob_gets(&d), 1);
    up.release(&d);
    for (i, s) in readers.into_iter().enumerate() {
        let declared = s.head().content_length();
        let (body, end) = s.read_to_end().await;
        assert!(
            matches!(end, End::Aborted(_)),
            "reader {i}: a failed fill must abort the body, got {end:?} after {} bytes",
            body.len()
        );
        assert!((body.len() as u64) < declared.unwrap_or(u64::MAX), "reader {i}: never the full length");
    }
    assert_eq!(up.blob_gets(&d), 1);
    assert!(!larder.blob_file(&d).exists(), "nothing committed");

    // Upstream serves the right bytes now: the next request fills afresh.
    up.heal(&d);
    let r = client::get(larder.addr(), &path).await;
    assert_eq!((r.status(), &r.end), (200, &End::Complete));
    assert!(r.body == bytes, "exact bytes after the fresh fill");
    assert_eq!(up.blob_gets(&d), 2, "a fresh upstream GET");

    let r = client::get(larder.addr(), &path).await;
    assert!(r.body == bytes);
    assert_eq!(up.blob_gets(&d), 2, "the fresh fill was committed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_follower_does_not_hold_back_a_fast_client_or_grow_memory() {
    let bytes = random_bytes(8 * MIB, 3);
    let d = digest(&bytes);
    let path = blob_path(&d);
    let warm_up = random_bytes(8 * MIB, 30);
    let up = FakeUpstream::builder().blob(bytes.clone()).stall_after(MIB).blob(warm_up.clone()).start().await;
    let larder = Larder::start(&up).await;
    // One fast client alone first, so that the baseline includes what any
    // 8 MiB fill needs (buffers, threads, allocator arenas).
    let r = client::get(larder.addr(), &blob_path(&digest(&warm_up))).await;
    assert!(r.status() == 200 && r.body == warm_up);
    let rss_before = larder.rss();

    let fast = client::open(larder.addr(), &path).await;
    assert_eq!(fast.status(), 200);
    // The follower reads 1 KiB/s through a 4 KiB receive buffer.
    let slow = SlowReader::start(larder.addr(), &path, KIB).await;
    wait_until("the slow reader has its first bytes", || slow.received() > 0).await;
    assert_eq!(up.blob_gets(&d), 1, "the slow reader joined the fill");

    up.release(&d);
    let (body, end) = fast.read_to_end().await;
    let slow_at_fast_end = slow.received();
    assert_eq!(end, End::Complete);
    assert!(body == bytes, "the fast client got the exact blob");
    assert!(
        slow_at_fast_end < MIB as u64,
        "the fast client finished while the slow one had {slow_at_fast_end} of {} bytes",
        bytes.len()
    );
    assert!(!slow.finished());

    // Were the slow reader's backlog (nearly the whole blob) held in
    // memory, RSS would grow by about the blob's size; reading it from the
    // file as the reader asks grows it by little (1-2.5 MiB measured).
    let grown = larder.rss().saturating_sub(rss_before);
    eprintln!("larder VmRSS {rss_before} bytes, grew by {grown} while the slow reader had {slow_at_fast_end}");
    assert!(
        grown < (bytes.len() * 3 / 4) as u64,
        "larder's RSS grew by {grown} bytes while a reader lagged by most of an {} byte blob",
        bytes.len()
    );

    // The slow reader is still being served, just slowly.
    wait_until("the slow reader makes progress", || slow.received() > slow_at_fast_end).await;
    assert_eq!(up.blob_gets(&d), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_fill_finishes_when_every_client_has_left() {
    let bytes = random_bytes(4 * MIB, 4);
    let d = digest(&bytes);
    let path = blob_path(&d);
    let up = FakeUpstream::builder().blob(bytes.clone()).stall_after(MIB).start().await;
    let larder = Larder::start(&up).await;

    for _ in 0..3 {
        let got = client::read_then_drop(larder.addr(), &path, 64 * KIB).await;
        assert!(got == bytes[..64 * KIB]);
    }
    assert_eq!(up.blob_gets(&d), 1);

    // Nobody is reading any more; upstream sends the rest.
    up.release(&d);
    larder.wait_committed(&d).await;
    assert_eq!(up.bodies_finished(&d), 1);

    let r = client::get(larder.addr(), &path).await;
    assert_eq!((r.status(), &r.end), (200, &End::Complete));
    assert!(r.body == bytes);
    assert_eq!(up.blob_gets(&d), 1, "no new upstream GET");
}

#[tokio::test(flavor = "multi_thread")]
async fn max_concurrency_bounds_the_requests_open_upstream() {
    let blobs: Vec<_> = (0..6).map(|i| random_bytes(256 * KIB, 100 + i)).collect();
    let mut builder = FakeUpstream::builder();
    for b in &blobs {
        // 16 pieces 20 ms apart: each body stays open a while.
        builder = builder.blob(b.clone()).trickle(16 * KIB, std::time::Duration::from_millis(20));
    }
    let up = builder.start().await;
    let larder = Larder::builder(&up).max_concurrency(2).start().await;

    let gets = blobs.iter().map(|b| {
        let (addr, path) = (larder.addr(), blob_path(&digest(b)));
        async move { client::get(addr, &path).await }
    });
    let responses = futures_util::future::join_all(gets).await;

    for (b, r) in blobs.iter().zip(&responses) {
        assert_eq!((r.status(), &r.end), (200, &End::Complete));
        assert!(r.body == *b, "exact bytes");
        assert_eq!(up.blob_gets(&digest(b)), 1);
    }
    assert_eq!(up.max_open_requests(), 2, "at most 2 requests open upstream at once, and the 2 were used");
}
