//! Start-up time against cache size: `Cache::open` on a cache of N blobs.
//! Opening reconciles the index with the blob files (one `stat` per row, a
//! walk of the blob folders) and sums the sizes for the eviction budget, so
//! it grows with N; this measures by how much.
//!
//! `cargo bench --bench startup` prints a Markdown table for N = 10^4, 10^5
//! and 10^6 (10^6 creates a million 1-byte files first, which take about
//! 4 GiB of disk blocks; `cargo bench --bench startup -- --max 100000`
//! stops earlier). The page cache and dentry cache are warm (the files were just
//! written), as after a process restart; a node reboot starts cold, which
//! this does not measure.

use std::time::{Duration, Instant};

use larder::cache::Cache;
use larder::cache::index::Index;
use larder::config::Config;
use larder::oci::Digest;

#[allow(dead_code)] // only the runtime is needed here
mod support;

const REPS: usize = 3;

fn digest(n: u64) -> Digest {
    Digest::of(&n.to_le_bytes())
}

/// A cache folder holding `n` committed 1-byte blobs and their index rows,
/// laid out as larder lays it out.
fn cache_with(dir: &std::path::Path, n: u64) {
    let blobs = dir.join("blobs/sha256");
    for prefix in 0..=255u8 {
        std::fs::create_dir_all(blobs.join(format!("{prefix:02x}"))).expect("blob folder");
    }
    let index = Index::open(&dir.join("index.redb")).expect("index");
    let all: Vec<(Digest, u64)> = (0..n).map(|i| (digest(i), 1)).collect();
    for (d, _) in &all {
        let hex = d.hex();
        std::fs::write(blobs.join(&hex[..2]).join(hex.as_str()), b"x").expect("blob file");
    }
    for batch in all.chunks(100_000) {
        index.adopt_blobs(batch, 1).expect("index rows");
    }
}

fn open_time(rt: &tokio::runtime::Runtime, dir: &std::path::Path) -> Duration {
    let text = format!(
        "[cache]\ndir = \"{}\"\n[[upstream]]\nname = \"docker.io\"\nurl = \"https://registry-1.docker.io\"\n",
        dir.display()
    );
    let config = Config::parse(&text, "bench.toml", None).expect("config");
    let started = Instant::now();
    let cache = rt.block_on(Cache::open(config.cache.clone())).expect("open");
    let took = started.elapsed();
    drop(cache);
    took
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let benchmarking = args.iter().any(|a| a == "--bench");
    let max: u64 = args
        .iter()
        .position(|a| a == "--max")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("--max N"))
        .unwrap_or(1_000_000);
    // `cargo test --all-targets` runs this once without `--bench`: a small
    // cache, to keep it working.
    let sizes: Vec<u64> = if benchmarking {
        [10_000, 100_000, 1_000_000].into_iter().filter(|n| *n <= max).collect()
    } else {
        vec![1_000]
    };
    let rt = support::runtime();
    println!("| blobs | Cache::open, median of {REPS} (min–max) |\n|---:|---:|");
    for n in sizes {
        let dir = tempfile::tempdir().expect("temp dir");
        cache_with(dir.path(), n);
        let mut times: Vec<Duration> = (0..REPS).map(|_| open_time(&rt, dir.path())).collect();
        times.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!("| {n} | {:.0} ms ({:.0}–{:.0}) |", ms(times[REPS / 2]), ms(times[0]), ms(times[REPS - 1]));
    }
}
