//! Heap allocations per operation on larder's hot paths: exact counts, not
//! timings, so they do not depend on how busy the machine is.
//!
//! `cargo bench --bench allocs` prints a Markdown table: allocations and
//! bytes allocated per operation, averaged over many operations after a
//! warm-up. Counted with dhat (testing mode: nothing is written to disk)
//! as the global allocator, so every thread's allocations count, the
//! blocking pool's included.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Method, Uri};
use http_body_util::BodyExt;
use larder::cache::fill::{Writer, read_body};
use larder::config::Config;
use larder::server::{handlers, routes};
use larder::upstream::Upstreams;

mod support;

use support::{BLOB, CHUNK, runtime};

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// Allocations and bytes allocated per call of `op`, over `n` calls.
fn per_op(n: u64, mut op: impl FnMut()) -> (f64, f64) {
    op(); // warm-up: lazily built state is not the hot path
    let before = dhat::HeapStats::get();
    for _ in 0..n {
        op();
    }
    let after = dhat::HeapStats::get();
    let per = |a: u64, b: u64| (a - b) as f64 / n as f64;
    (per(after.total_blocks, before.total_blocks), per(after.total_bytes, before.total_bytes))
}

fn main() {
    let _profiler = dhat::Profiler::builder().testing().build();
    // `cargo test --all-targets` runs this once without `--bench`: a few
    // operations each, just to keep it working.
    let n: u64 = if std::env::args().any(|a| a == "--bench") { 2_000 } else { 3 };
    let rt = runtime();
    let mut rows: Vec<(String, f64, f64)> = Vec::new();

    let config = Config::parse(
        "[[upstream]]\nname = \"docker.io\"\nurl = \"https://registry-1.docker.io\"\ndefault = true\n",
        "bench.toml",
        None,
    )
    .expect("config");
    let upstreams = Upstreams::new(&config).expect("upstreams");
    let uri: Uri = "/v2/library/alpine/blobs/sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        .parse()
        .expect("uri");
    let (a, b) = per_op(n, || assert!(routes::parse(&Method::GET, &uri, &upstreams).is_ok()));
    rows.push(("route parse, blob GET".into(), a, b));

    let dir = tempfile::tempdir().expect("temp dir");
    let (app, digest) = rt.block_on(support::manifest_app(dir.path()));
    for (name, path) in support::manifest_paths(&digest) {
        let (route, reference) = support::manifest_route(&app, &path);
        let headers = HeaderMap::new();
        let (a, b) = per_op(n, || {
            rt.block_on(async {
                let (resp, _) =
                    handlers::manifest(&app, &route, &reference, (&Method::GET, &headers), None).await.expect("hit");
                resp.into_body().collect().await.expect("body").to_bytes()
            });
        });
        rows.push((format!("warm manifest GET {name}: handler + body (memory tier)"), a, b));
    }

    let path = dir.path().join("blob");
    std::fs::write(&path, vec![0x33u8; BLOB]).expect("blob file");
    let file = Arc::new(std::fs::File::open(&path).expect("open"));
    let chunks = (BLOB / CHUNK) as f64;
    let (a, b) = per_op(n.div_ceil(10), || {
        rt.block_on(async {
            let mut body = read_body(Arc::clone(&file), None, 0, Some(BLOB as u64), larder::cache::Via::Client, None);
            while let Some(frame) = body.frame().await {
                frame.expect("frame");
            }
        })
    });
    rows.push(("committed blob body, per 256 KiB chunk".into(), a / chunks, b / chunks));

    let chunk = Bytes::from(vec![0x5au8; CHUNK]);
    let (a, b) = per_op(n.div_ceil(10), || {
        rt.block_on(async {
            let mut w = Writer::new(tempfile::NamedTempFile::new_in(dir.path()).expect("temp file"));
            for _ in 0..BLOB / CHUNK {
                w = w.write(chunk.clone()).await.expect("write");
            }
            w.finish()
        });
    });
    rows.push(("fill writer (write + sha256), per 256 KiB chunk".into(), a / chunks, b / chunks));

    println!("| operation | allocations | bytes allocated |\n|---|---:|---:|");
    for (name, allocs, bytes) in rows {
        println!("| {name} | {allocs:.2} | {bytes:.0} |");
    }
}
