//! Micro-benchmarks of larder's hot paths (criterion):
//! - verifying a blob while streaming it (write + sha256) against raw sha2,
//!   larder's hasher and the temp-file write alone,
//! - parsing a request into a route,
//! - the redb index with 10^4 and 10^6 blobs: lookup and insert,
//! - a follower reading a blob file (the path every blob response takes),
//! - a manifest served from the memory tier, by digest and by tag.
//!
//! `cargo bench --bench micro`; numbers depend on the machine, so compare
//! them within one run (see benches/README.md).

use std::sync::Arc;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use http::{HeaderMap, Method, Uri};
use http_body_util::BodyExt;
use larder::cache::fill::{Writer, read_body};
use larder::cache::index::Index;
use larder::config::Config;
use larder::oci::{Digest, Hasher};
use larder::server::{handlers, routes};
use larder::upstream::Upstreams;

mod support;

use support::{BLOB, CHUNK, runtime};

fn streaming_verification(c: &mut Criterion) {
    let rt = runtime();
    let dir = tempfile::tempdir().expect("temp dir");
    let chunk = Bytes::from(vec![0x5au8; CHUNK]);
    let mut group = c.benchmark_group("verify_while_streaming_8MiB");
    group.throughput(Throughput::Bytes(BLOB as u64));
    group.bench_function("raw_sha2", |b| {
        b.iter(|| {
            let mut h = <sha2::Sha256 as sha2::Digest>::new();
            for _ in 0..BLOB / CHUNK {
                sha2::Digest::update(&mut h, &chunk);
            }
            sha2::Digest::finalize(h)
        })
    });
    group.bench_function("sha256_only", |b| {
        b.iter(|| {
            let mut h = Hasher::default();
            for _ in 0..BLOB / CHUNK {
                h.update(&chunk);
            }
            h.finish()
        })
    });
    group.bench_function("temp_file_write_only", |b| {
        b.iter(|| {
            let mut f = tempfile::NamedTempFile::new_in(dir.path()).expect("temp file");
            for _ in 0..BLOB / CHUNK {
                std::io::Write::write_all(&mut f, &chunk).expect("write");
            }
            f
        })
    });
    group.bench_function("fill_writer_write_and_hash", |b| {
        b.to_async(&rt).iter(|| async {
            let mut w = Writer::new(tempfile::NamedTempFile::new_in(dir.path()).expect("temp file"));
            for _ in 0..BLOB / CHUNK {
                w = w.write(chunk.clone()).await.expect("write");
            }
            w.finish()
        })
    });
    group.finish();
}

const CONFIG: &str = r#"
[[upstream]]
name = "docker.io"
url = "https://registry-1.docker.io"
default = true
[[upstream]]
name = "ghcr.io"
url = "https://ghcr.io"
"#;

fn route_parsing(c: &mut Criterion) {
    let config = Config::parse(CONFIG, "bench.toml", None).expect("config");
    let upstreams = Upstreams::new(&config).expect("upstreams");
    let uris: Vec<Uri> = [
        "/v2/library/alpine/manifests/3.20?ns=docker.io",
        "/v2/ghcr.io/org/app/blobs/sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "/v2/nginx/manifests/sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    ]
    .iter()
    .map(|u| u.parse().expect("uri"))
    .collect();
    c.bench_function("route_parse_3_requests", |b| {
        b.iter(|| {
            for uri in &uris {
                std::hint::black_box(routes::parse(&Method::GET, uri, &upstreams).is_ok());
            }
        })
    });
}

fn digest(n: u64) -> Digest {
    Digest::of(&n.to_le_bytes())
}

fn index_at_scale(c: &mut Criterion) {
    let mut group = c.benchmark_group("redb_index");
    group.sample_size(20);
    // `cargo test --all-targets` runs each benchmark once, without `--bench`,
    // on a debug build: there, the 10^6-row setup would only cost time.
    let benchmarking = std::env::args().any(|a| a == "--bench");
    let sizes: &[u64] = if benchmarking { &[10_000, 1_000_000] } else { &[10_000] };
    for &rows in sizes {
        let dir = tempfile::tempdir().expect("temp dir");
        let index = Index::open(&dir.path().join("index.redb")).expect("index");
        let all: Vec<(Digest, u64)> = (0..rows).map(|n| (digest(n), n)).collect();
        for batch in all.chunks(100_000) {
            index.adopt_blobs(batch, 1).expect("fill the index");
        }
        let mut probe = 0u64;
        group.bench_with_input(BenchmarkId::new("lookup", rows), &rows, |b, rows| {
            b.iter(|| {
                probe = (probe + 7919) % rows;
                index.blob_size(&digest(probe)).expect("lookup")
            })
        });
        let mut next = rows;
        group.bench_with_input(BenchmarkId::new("insert_committed", rows), &rows, |b, _| {
            b.iter(|| {
                next += 1;
                index.insert_blob(&digest(next), next, "docker.io\0library/x\0bench", 1).expect("insert")
            })
        });
    }
    group.finish();
}

fn follower_read(c: &mut Criterion) {
    let rt = runtime();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("blob");
    std::fs::write(&path, vec![0x33u8; BLOB]).expect("blob file");
    let mut group = c.benchmark_group("blob_read_8MiB");
    group.throughput(Throughput::Bytes(BLOB as u64));
    group.bench_function("read_body_committed", |b| {
        b.to_async(&rt).iter(|| async {
            let file = Arc::new(std::fs::File::open(&path).expect("open"));
            let mut body = read_body(file, None, 0, Some(BLOB as u64), larder::cache::Via::Client, None);
            let mut n = 0;
            while let Some(frame) = body.frame().await {
                n += frame.expect("frame").into_data().map_or(0, |d| d.len());
            }
            assert_eq!(n, BLOB);
        })
    });
    group.finish();
}

fn memory_tier_hit(c: &mut Criterion) {
    let rt = runtime();
    let dir = tempfile::tempdir().expect("temp dir");
    let (app, digest) = rt.block_on(support::manifest_app(dir.path()));
    let mut group = c.benchmark_group("manifest_memory_hit");
    for (name, path) in support::manifest_paths(&digest) {
        let (route, reference) = support::manifest_route(&app, &path);
        let headers = HeaderMap::new();
        // Warm: the first request fetches from the one-manifest upstream.
        rt.block_on(handlers::manifest(&app, &route, &reference, (&Method::GET, &headers), None)).expect("warm");
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| async {
                let (resp, _) =
                    handlers::manifest(&app, &route, &reference, (&Method::GET, &headers), None).await.expect("hit");
                resp.into_body().collect().await.expect("body").to_bytes()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, streaming_verification, route_parsing, index_at_scale, follower_read, memory_tier_hit);
criterion_main!(benches);
