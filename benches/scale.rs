//! Scale: what start-up, an eviction round, a purge and warm serving cost
//! with 10^3 … 10^6 blobs cached, side by side in one run.
//!
//! `cargo bench --bench scale` (default sizes 1000 and 1000000; `-- --sizes
//! 1000,100000` picks others, `--reps N` the repetitions, default 5). For
//! every size it generates a synthetic cache (see [`generate`]: files and
//! index rows written directly, about a minute per 10^6 blobs, not through
//! pulls), then measures on that cache:
//!
//! - **start-up to ready**: the release `larder` binary started on the
//!   cache until `GET /v2/` answers 200, and how long the background check
//!   of files against rows then took (from its log line);
//! - **eviction round**: what `Cache::evict` does for 1 % of the blobs:
//!   read the least recently used rows in access order, remove them in one
//!   transaction, unlink their files;
//! - **purge**: one repository's rows (10 blobs each; 10^5 repositories at
//!   10^6 blobs) and the content nobody else references, and its files;
//! - **warm serving** (needs `wrk` on PATH): manifest GET by digest (16
//!   connections) and a 10 MiB blob GET (4 connections), requests/s and the
//!   server's CPU time per request (utime + stime from /proc/<pid>/stat).
//!
//! Each figure is the median of the repetitions with min–max; the last
//! column divides the largest size's median by the smallest's, the ratio
//! issue 13 sets targets on. `cargo test --all-targets` runs it once at
//! 10^4 without the binary-and-wrk rows' repetitions, so it cannot rot.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use larder::cache::index::{Index, Kind};
use larder::oci::{Digest, MediaType};

/// Blobs per synthetic repository.
const BLOBS_PER_REPO: u64 = 10;
/// Index rows per write transaction while generating.
const BATCH: usize = 50_000;
/// The blob the warm throughput rows serve.
const BIG_BLOB: usize = 10 << 20;
const UPSTREAM: &str = "docker.io";
/// Longest wait for the binary to answer.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The `i`th synthetic blob: 8 bytes, so its digest is real and
/// `larder verify` passes on the generated cache.
fn small_blob(i: u64) -> [u8; 8] {
    i.to_le_bytes()
}

fn repo_of(i: u64) -> String {
    format!("bench/r{:06}", i / BLOBS_PER_REPO)
}

fn blob_path(dir: &Path, d: &Digest) -> PathBuf {
    let hex = d.hex();
    dir.join("blobs/sha256").join(&hex[..2]).join(hex.as_str())
}

/// What the warm rows request.
struct Warm {
    manifest: Digest,
    blob: Digest,
}

/// A cache folder holding `n` small blobs (each a file and an index row,
/// with a distinct access time so eviction order is defined) in
/// repositories of [`BLOBS_PER_REPO`], plus `bench/app` with one manifest
/// and its 10 MiB layer, accessed last.
fn generate(dir: &Path, n: u64) -> Warm {
    let blobs = dir.join("blobs/sha256");
    for prefix in 0..=255u8 {
        std::fs::create_dir_all(blobs.join(format!("{prefix:02x}"))).expect("blob folder");
    }
    let index = Index::open(&dir.join("index.redb")).expect("index");
    let mut rows = Vec::with_capacity(BATCH);
    let mut members = Vec::with_capacity(BATCH);
    for i in 0..n {
        let bytes = small_blob(i);
        let d = Digest::of(&bytes);
        std::fs::write(blob_path(dir, &d), bytes).expect("blob file");
        rows.push((d, bytes.len() as u64));
        members.push(format!("{UPSTREAM}\0{}\0{}", repo_of(i), d.hex().as_str()));
        if rows.len() == BATCH || i + 1 == n {
            let at = 1 + i / BATCH as u64;
            index.adopt_blobs(&rows, at).expect("rows");
            index.add_members(&members, at).expect("members");
            rows.clear();
            members.clear();
        }
    }
    let layer: Vec<u8> =
        (0..BIG_BLOB).map(|i| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[7]).collect();
    let blob = Digest::of(&layer);
    std::fs::write(blob_path(dir, &blob), &layer).expect("layer file");
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{}","size":2}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{blob}","size":{BIG_BLOB}}}]}}"#,
        Digest::of(b"{}")
    );
    let manifest_digest = Digest::of(manifest.as_bytes());
    let now = u64::MAX / 2;
    let member = |d: &Digest| format!("{UPSTREAM}\0bench/app\0{}", d.hex().as_str());
    index.adopt_blobs(&[(blob, BIG_BLOB as u64)], now).expect("layer row");
    index.add_members(&[member(&blob)], now).expect("layer member");
    index
        .insert_manifest(
            &manifest_digest,
            MediaType::OciManifest,
            manifest.as_bytes(),
            None,
            &[member(&manifest_digest)],
            now,
        )
        .expect("manifest row");
    Warm { manifest: manifest_digest, blob }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// One HTTP/1.1 GET; the status code, or `None` if nothing answered.
fn status_of(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// The release binary on the cache at `dir`, logging as shipped (info, one
/// line per request) to `log`; its upstream is a closed port, so every
/// answer comes from the cache.
struct Server {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Server {
    /// Starts it and returns how long it took until `GET /v2/` answered 200.
    fn start(dir: &Path) -> (Server, Duration) {
        let port = free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let config = dir.with_extension("toml");
        let log = dir.with_extension("log");
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"{addr}\"\n[cache]\ndir = \"{}\"\nmax_size = \"1TiB\"\n\
                 [[upstream]]\nname = \"{UPSTREAM}\"\nurl = \"http://127.0.0.1:{}\"\ndefault = true\n",
                dir.display(),
                free_port()
            ),
        )
        .expect("config");
        let started = Instant::now();
        let child = Command::new(env!("CARGO_BIN_EXE_larder"))
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start larder");
        while status_of(addr, "/v2/") != Some(200) {
            assert!(started.elapsed() < READY_TIMEOUT, "larder did not answer:\n{}", read(&log));
            std::thread::sleep(Duration::from_millis(1));
        }
        (Server { child, addr, log }, started.elapsed())
    }

    /// How long the background check took, once it has logged.
    fn check_time(&self) -> Duration {
        let started = Instant::now();
        loop {
            let log = read(&self.log);
            let line =
                log.lines().find(|l| l.contains("blob files match the index") || l.contains("reconciled the index"));
            if let Some(ms) = line.and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("elapsed_ms="))) {
                return Duration::from_millis(ms.parse().expect("elapsed_ms"));
            }
            assert!(started.elapsed() < READY_TIMEOUT * 5, "no background check in the log:\n{log}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// utime + stime of the process so far.
    fn cpu(&self) -> Duration {
        let stat = read(Path::new(&format!("/proc/{}/stat", self.child.id())));
        // Fields after the command name, which is in parentheses.
        let fields: Vec<&str> = stat.rsplit_once(')').expect("stat").1.split_whitespace().collect();
        let ticks: u64 = fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
        Duration::from_secs_f64(ticks as f64 / clock_ticks_per_second())
    }
}

/// `getconf CLK_TCK`: the unit of /proc/<pid>/stat's times.
fn clock_ticks_per_second() -> f64 {
    static HZ: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *HZ.get_or_init(|| {
        let out = Command::new("getconf").arg("CLK_TCK").output().expect("getconf");
        String::from_utf8_lossy(&out.stdout).trim().parse().expect("CLK_TCK")
    })
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// One wrk run: requests per second and server CPU per request.
fn wrk(server: &Server, path: &str, connections: u32, seconds: u32) -> (f64, Duration) {
    let cpu_before = server.cpu();
    let out = Command::new("wrk")
        .args(["-t1", &format!("-c{connections}"), &format!("-d{seconds}s")])
        .args(["-H", "Accept: application/vnd.oci.image.manifest.v1+json"])
        .arg(format!("http://{}{path}", server.addr))
        .output()
        .expect("run wrk");
    let cpu = server.cpu() - cpu_before;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("Non-2xx"), "wrk saw errors:\n{text}");
    let rate: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("wrk printed no rate:\n{text}"));
    let requests = (rate * seconds as f64).max(1.0);
    (rate, cpu.div_f64(requests))
}

/// Median, min and max of some measurements.
#[derive(Clone, Copy)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

fn spread(mut xs: Vec<f64>) -> Spread {
    xs.sort_by(f64::total_cmp);
    Spread { median: xs[xs.len() / 2], min: xs[0], max: xs[xs.len() - 1] }
}

/// Every row's measurements at one size.
struct Row {
    n: u64,
    figures: Vec<(&'static str, &'static str, Spread)>,
}

fn measure(n: u64, reps: usize, full: bool) -> Row {
    let scratch = tempfile::tempdir().expect("temp dir");
    let dir = scratch.path().join("cache");
    let generated = Instant::now();
    let warm = generate(&dir, n);
    eprintln!("scale: {n} blobs generated in {:.1} s", generated.elapsed().as_secs_f64());
    let mut figures = Vec::new();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;

    let (mut ready, mut check) = (Vec::new(), Vec::new());
    let (mut manifest_rate, mut manifest_cpu, mut blob_rate, mut blob_cpu) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let has_wrk = Command::new("wrk").arg("--version").output().is_ok();
    for _ in 0..reps {
        let (server, took) = Server::start(&dir);
        ready.push(ms(took));
        check.push(ms(server.check_time()));
        if full && has_wrk {
            let (rate, cpu) = wrk(&server, &format!("/v2/bench/app/manifests/{}", warm.manifest), 16, 5);
            manifest_rate.push(rate);
            manifest_cpu.push(cpu.as_secs_f64() * 1e6);
            let (rate, cpu) = wrk(&server, &format!("/v2/bench/app/blobs/{}", warm.blob), 4, 5);
            blob_rate.push(rate);
            blob_cpu.push(cpu.as_secs_f64() * 1e3);
        }
    }
    figures.push(("start-up to ready", "ms", spread(ready)));
    figures.push(("background check of files vs rows", "ms", spread(check)));
    if !manifest_rate.is_empty() {
        figures.push(("warm manifest GET by digest, 16 conns", "req/s", spread(manifest_rate)));
        figures.push(("  server CPU per manifest GET", "µs", spread(manifest_cpu)));
        figures.push(("warm 10 MiB blob GET, 4 conns", "req/s", spread(blob_rate)));
        figures.push(("  server CPU per 10 MiB GET", "ms", spread(blob_cpu)));
    }

    // Eviction and purge change the cache, so they come after the server
    // rows; each repetition evicts the next 1 % and purges another repository.
    let index = Index::open(&dir.join("index.redb")).expect("index");
    let one_percent = n / 100 * small_blob(0).len() as u64;
    let mut evictions = Vec::new();
    for _ in 0..reps {
        let started = Instant::now();
        let victims = index.least_recently_used(one_percent.max(1)).expect("lru");
        let keys: Vec<(Kind, Digest)> = victims.iter().map(|e| (e.kind, e.digest)).collect();
        let removed = index.remove_content(&keys).expect("remove");
        for e in &removed {
            std::fs::remove_file(blob_path(&dir, &e.digest)).expect("unlink");
        }
        evictions.push(ms(started.elapsed()));
        assert_eq!(removed.len() as u64, (n / 100).max(1), "1 % of the blobs went");
    }
    figures.push(("eviction round, 1 % of the blobs", "ms", spread(evictions)));
    let mut purges = Vec::new();
    for rep in 0..reps as u64 {
        // The last repositories: eviction took the first ones.
        let repo = repo_of(n - 1 - rep * BLOBS_PER_REPO);
        let started = Instant::now();
        let purged = index.purge(&format!("{UPSTREAM}\0{repo}\0")).expect("purge");
        for e in &purged.content {
            std::fs::remove_file(blob_path(&dir, &e.digest)).expect("unlink");
        }
        purges.push(ms(started.elapsed()));
        assert_eq!(purged.content.len() as u64, BLOBS_PER_REPO.min(n), "one repository's blobs went");
    }
    figures.push(("purge of one repository (10 blobs)", "ms", spread(purges)));
    Row { n, figures }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let benchmarking = args.iter().any(|a| a == "--bench");
    let sizes: Vec<u64> = match arg("--sizes") {
        Some(list) => list.split(',').map(|s| s.parse().expect("--sizes N,M")).collect(),
        None if benchmarking => vec![1_000, 1_000_000],
        // `cargo test --all-targets`: one small run, so it keeps working.
        None => vec![10_000],
    };
    let reps: usize = arg("--reps").map_or(if benchmarking { 5 } else { 1 }, |r| r.parse().expect("--reps N"));
    let rows: Vec<Row> = sizes.iter().map(|&n| measure(n, reps, benchmarking)).collect();

    let header: Vec<String> = rows.iter().map(|r| format!("{} blobs", r.n)).collect();
    println!("median (min–max) of {reps}\n");
    println!("| what | unit | {} | largest ÷ smallest |", header.join(" | "));
    println!("|---|---|{}---:|", "---:|".repeat(rows.len()));
    for (i, (what, unit, _)) in rows[0].figures.iter().enumerate() {
        let cells: Vec<String> = rows
            .iter()
            .map(|r| {
                let s = r.figures[i].2;
                format!("{:.1} ({:.1}–{:.1})", s.median, s.min, s.max)
            })
            .collect();
        let ratio = rows[rows.len() - 1].figures[i].2.median / rows[0].figures[i].2.median;
        println!("| {what} | {unit} | {} | {ratio:.2} |", cells.join(" | "));
    }
}
