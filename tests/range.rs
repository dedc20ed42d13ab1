//! `Range` on blobs: the six conformance cases on a 2048-byte blob, in the
//! three states a blob can be in (cached, being filled, cold), malformed
//! ranges, and ranges in units other than bytes (ignored, as RFC 9110
//! requires). A range never reaches upstream: larder fills the
//! whole blob and answers from it.

mod fake;

use bytes::Bytes;
use fake::client::{self, End, Response, Streaming};
use fake::{FakeUpstream, Larder, blob_path, digest, random_bytes};

const SIZE: usize = 2048;

#[derive(Clone, Copy, Debug)]
enum Expect {
    /// 206 with bytes `first..=last`.
    Partial(usize, usize),
    /// 416 with `Content-Range: bytes */2048`.
    Unsatisfiable,
}
use Expect::{Partial, Unsatisfiable};

const CASES: [(&str, Expect); 6] = [
    ("bytes=500-1499", Partial(500, 1499)),
    ("bytes=500-", Partial(500, 2047)),
    ("bytes=-500", Partial(1548, 2047)),
    ("bytes=2000-5000", Partial(2000, 2047)),
    ("bytes=500-0", Unsatisfiable),
    ("bytes=5000-10000", Unsatisfiable),
];

const MALFORMED: [&str; 2] = ["bytes=abc", "bytes=1-2,3-4"];

/// Checks a response head against the case.
fn check_head(range: &str, expect: Expect, status: u16, header: impl Fn(&str) -> Option<String>) {
    match expect {
        Partial(first, last) => {
            assert_eq!(status, 206, "{range}");
            assert_eq!(
                header("content-range").as_deref(),
                Some(format!("bytes {first}-{last}/{SIZE}").as_str()),
                "{range}"
            );
            assert_eq!(header("content-length").as_deref(), Some((last - first + 1).to_string().as_str()), "{range}");
        }
        Unsatisfiable => {
            assert_eq!(status, 416, "{range}");
            assert_eq!(header("content-range").as_deref(), Some(format!("bytes */{SIZE}").as_str()), "{range}");
        }
    }
}

/// Checks a whole response against the case.
fn check(range: &str, expect: Expect, r: &Response, blob: &Bytes) {
    check_head(range, expect, r.status(), |h| r.header(h).map(str::to_owned));
    assert_eq!(r.end, End::Complete, "{range}");
    match expect {
        Partial(first, last) => assert!(r.body == blob[first..=last], "{range}: exact bytes"),
        Unsatisfiable => {
            let code = r.error_code();
            assert!(!code.is_empty(), "{range}: an OCI error code");
        }
    }
}

async fn ranged(larder: &Larder, path: &str, range: &str) -> Response {
    client::get_with(larder.addr(), path, &[("Range", range)]).await
}

#[tokio::test]
async fn ranges_on_a_cached_blob() {
    let blob = random_bytes(SIZE, 1);
    let d = digest(&blob);
    let path = blob_path(&d);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let larder = Larder::start(&up).await;
    let warm = client::get(larder.addr(), &path).await;
    assert!(warm.status() == 200 && warm.body == blob);
    larder.wait_committed(&d).await;

    for (range, expect) in CASES {
        check(range, expect, &ranged(&larder, &path, range).await, &blob);
    }
    for range in MALFORMED {
        let r = ranged(&larder, &path, range).await;
        check(range, Unsatisfiable, &r, &blob);
    }
    assert_eq!(up.blob_gets(&d), 1, "all served from the cache");
    assert_eq!(up.ranged_requests(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn ranges_on_a_blob_being_filled() {
    let blob = random_bytes(SIZE, 2);
    let d = digest(&blob);
    let path = blob_path(&d);
    // Upstream sends all but the final byte, then waits to be released.
    let up = FakeUpstream::builder().blob(blob.clone()).stall_after(SIZE - 1).start().await;
    let larder = Larder::start(&up).await;
    // A plain GET starts the fill.
    let filler = client::open(larder.addr(), &path).await;
    assert_eq!(filler.status(), 200);

    let mut open: Vec<(&str, Expect, Streaming)> = Vec::new();
    for (range, expect) in CASES {
        let s = client::open_with(larder.addr(), &path, &[("Range", range)]).await;
        check_head(range, expect, s.status(), |h| s.header(h).map(str::to_owned));
        open.push((range, expect, s));
    }
    assert_eq!(up.bodies_finished(&d), 0, "every answer came while filling");

    // Whatever the fill has is served now; a range that reaches the end
    // of the blob waits for its final byte until the digest is verified.
    let mut reaching_the_end = Vec::new();
    for (range, expect, mut s) in open {
        match expect {
            Partial(first, last) if last < SIZE - 1 => {
                let (body, end) = s.read_to_end().await;
                assert_eq!(end, End::Complete, "{range}");
                assert!(body == blob[first..=last], "{range}: exact bytes");
            }
            Partial(first, last) => {
                let head = s.read_exact(last - first).await;
                assert!(head == blob[first..last], "{range}: exact bytes");
                reaching_the_end.push((range, last, s));
            }
            Unsatisfiable => {
                let r = s.into_response().await;
                assert_eq!(r.end, End::Complete, "{range}");
                assert!(!r.error_code().is_empty(), "{range}: an OCI error code");
            }
        }
    }
    assert_eq!(up.bodies_finished(&d), 0, "still filling");

    up.release(&d);
    for (range, last, s) in reaching_the_end {
        let (tail, end) = s.read_to_end().await;
        assert_eq!(end, End::Complete, "{range}");
        assert!(tail == blob[last..], "{range}: the final byte");
    }
    let (body, end) = filler.read_to_end().await;
    assert_eq!(end, End::Complete);
    assert!(body == blob);
    assert_eq!(up.blob_gets(&d), 1, "one fill served every range");
    assert_eq!(up.ranged_requests(), 0, "the fill is a full GET");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_range_on_a_cold_blob_starts_a_full_fill() {
    let blobs: Vec<_> = (0..CASES.len() as u64).map(|i| random_bytes(SIZE, 10 + i)).collect();
    let mut builder = FakeUpstream::builder();
    for b in &blobs {
        builder = builder.blob(b.clone());
    }
    let up = builder.start().await;
    let larder = Larder::start(&up).await;

    // The first request for each blob is one of the ranges.
    for ((range, expect), blob) in CASES.into_iter().zip(&blobs) {
        let d = digest(blob);
        let path = blob_path(&d);
        check(range, expect, &ranged(&larder, &path, range).await, blob);
        assert_eq!(up.blob_gets(&d), 1, "{range}: one upstream GET");

        // The fill ran to the end and the blob is cached.
        larder.wait_committed(&d).await;
        let r = client::get(larder.addr(), &path).await;
        assert!(r.status() == 200 && r.end == End::Complete && r.body == *blob);
        assert_eq!(up.blob_gets(&d), 1, "{range}: served from the cache");
    }
    assert_eq!(up.ranged_requests(), 0, "every upstream GET was a full one");
}

#[tokio::test]
async fn malformed_ranges_on_a_cold_blob_are_416() {
    let blob = random_bytes(SIZE, 3);
    let d = digest(&blob);
    let path = blob_path(&d);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let larder = Larder::start(&up).await;
    for range in MALFORMED {
        let r = ranged(&larder, &path, range).await;
        check(range, Unsatisfiable, &r, &blob);
    }
    assert_eq!(up.ranged_requests(), 0);
}

#[tokio::test]
async fn a_range_in_another_unit_is_ignored_and_the_whole_blob_sent() {
    let blob = random_bytes(SIZE, 7);
    let d = digest(&blob);
    let up = FakeUpstream::builder().blob(blob.clone()).start().await;
    let larder = Larder::start(&up).await;
    for range in ["items=0-1", "pages=1"] {
        let r = ranged(&larder, &blob_path(&d), range).await;
        assert_eq!((r.status(), r.end.clone()), (200, End::Complete), "{range}");
        assert!(r.body == blob, "{range}: the whole blob");
        assert_eq!(r.header("content-range"), None, "{range}");
    }
}

#[tokio::test]
async fn head_of_a_cold_blob_claims_no_length_upstream_did_not_give() {
    let blob = random_bytes(SIZE, 8);
    let d = digest(&blob);
    // Upstream sends no Content-Length, for GET or HEAD.
    let up = FakeUpstream::builder().blob(blob.clone()).chunked().start().await;
    let larder = Larder::start(&up).await;
    let head = client::head(larder.addr(), &blob_path(&d)).await;
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-length"), None, "not `Content-Length: 0`, which would claim an empty blob");
    assert_eq!(head.header("docker-content-digest"), Some(d.as_str()));
}
