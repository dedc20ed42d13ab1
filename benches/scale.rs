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

impl Server {
    /// Stops it the way an operator or Kubernetes does (SIGTERM) and waits
    /// for it to exit; it must exit 0 and leave an index that needs no
    /// repair on the next open.
    fn stop(mut self, dir: &Path) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
        assert!(sent.success(), "kill -TERM {pid}");
        let status = self.child.wait().expect("wait for larder");
        assert!(status.success(), "larder exited with {status} on SIGTERM:\n{}", read(&self.log));
        assert!(!needs_repair(&dir.join("index.redb")), "a SIGTERM left an index that needs repair");
    }

    /// Kills it without warning (SIGKILL: an OOM kill, a power cut as far
    /// as the index is concerned).
    fn crash(mut self) {
        self.child.kill().expect("kill larder");
        self.child.wait().expect("wait for larder");
    }
}

/// Whether opening the index would repair it: what a process that did not
/// close it (a crash) leaves behind. Opens and closes it cleanly.
fn needs_repair(path: &Path) -> bool {
    let repaired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = std::sync::Arc::clone(&repaired);
    let db = redb::Database::builder()
        .set_repair_callback(move |_| flag.store(true, std::sync::atomic::Ordering::Relaxed))
        .create(path)
        .expect("open the index");
    drop(db);
    repaired.load(std::sync::atomic::Ordering::Relaxed)
}

/// A server that is neither stopped nor crashed on purpose (a failed
/// assertion) is killed.
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

/// Bytes this process has read with read(2) and pread(2) so far (`rchar`
/// in /proc/self/io, every thread). redb reads its file that way, so around
/// an operation on a freshly opened index (redb's page cache still empty)
/// the difference is what that operation read from the index: a count, not
/// a timing, so CI can hold the big-O to it.
fn bytes_read() -> u64 {
    let io = read(Path::new("/proc/self/io"));
    io.lines().find_map(|l| l.strip_prefix("rchar:")).and_then(|v| v.trim().parse().ok()).expect("rchar")
}

/// At most what opening the cache may read, whatever it holds: redb's
/// header, allocator state and table roots, and the running byte total. One
/// pass over the blob rows at 10^4 blobs reads several times this.
const OPEN_READ_LIMIT: u64 = 256 << 10;
/// Entries the exact eviction check asks for, and at most what reading
/// them in access order may read: a root-to-leaf path in each of the two
/// tables plus a leaf per entry, with room to spare, and a small share of
/// one pass over the rows at 10^4 blobs.
const LRU_PROBE: u64 = 10;
const LRU_READ_LIMIT: u64 = (2 * LRU_PROBE + 16) * 4096;

/// The cache folder at `dir` as the bench's server has it.
fn cache_config(dir: &Path) -> larder::config::CacheConfig {
    larder::config::CacheConfig {
        dir: dir.to_owned(),
        max_size: 1 << 40,
        max_blob_size: 1 << 30,
        max_import_size: 1 << 40,
        high_watermark: 0.9,
        low_watermark: 0.8,
        memory: 1 << 20,
        tag_ttl: Duration::from_secs(60),
        stale_if_error: Duration::from_secs(60),
        warm_file: None,
        warm_interval: None,
        upstream_max_size: Vec::new(),
        parallel_fill_min: larder::config::DEFAULT_PARALLEL_FILL_MIN,
    }
}

/// The exact checks, at every size: what opening the cache and reading the
/// least recently used entries read from the index does not grow with the
/// number of blobs. Returns the bytes read by the open, by the LRU read,
/// and by one pass over the blob rows.
fn read_counts(dir: &Path, n: u64) -> (u64, u64, u64) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let before = bytes_read();
    let cache = runtime.block_on(larder::cache::Cache::open(cache_config(dir))).expect("open the cache");
    let open = bytes_read() - before;
    assert!(cache.usage() >= n * small_blob(0).len() as u64, "usage came from the running total");
    drop(cache);
    drop(runtime);
    assert!(open <= OPEN_READ_LIMIT, "opening the cache read {open} bytes of its index at {n} blobs");

    let index = Index::open(&dir.join("index.redb")).expect("index");
    let before = bytes_read();
    let victims = index.least_recently_used(LRU_PROBE * small_blob(0).len() as u64, &|_, _| false).expect("lru");
    let lru = bytes_read() - before;
    assert_eq!(victims.len() as u64, LRU_PROBE.min(n));
    assert!(lru <= LRU_READ_LIMIT, "reading {LRU_PROBE} entries in access order read {lru} bytes at {n} blobs");
    drop(index);

    // What the limits stand against: one pass over the blob rows, which
    // neither may take. From 10^4 blobs it reads more than either limit.
    let index = Index::open(&dir.join("index.redb")).expect("index");
    let before = bytes_read();
    assert!(index.entries(Kind::Blob).expect("rows").len() as u64 > n);
    let pass = bytes_read() - before;
    if n >= 10_000 {
        assert!(pass > OPEN_READ_LIMIT.max(LRU_READ_LIMIT), "a pass over the rows read only {pass} bytes");
    }
    (open, lru, pass)
}

/// One-row commits timed per setting by [`commit_costs`].
const COMMITS: u64 = 50;

/// One-row commits into a scratch table of the index at `path`, with
/// redb's quick repair off and on, interleaved: what recording the
/// allocator state in every commit costs (so that a start after a crash
/// loads it instead of walking the whole file to rebuild it).
fn commit_costs(path: &Path) -> (Spread, Spread) {
    const SCRATCH: redb::TableDefinition<u64, u64> = redb::TableDefinition::new("bench_commits");
    let db = redb::Database::create(path).expect("index");
    let mut costs = [Vec::new(), Vec::new()];
    for i in 0..COMMITS {
        for (quick, costs) in [false, true].into_iter().zip(costs.iter_mut()) {
            let started = Instant::now();
            let mut txn = db.begin_write().expect("write");
            txn.set_quick_repair(quick);
            txn.open_table(SCRATCH).expect("table").insert(i, i).expect("insert");
            txn.commit().expect("commit");
            costs.push(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    let txn = db.begin_write().expect("write");
    txn.delete_table(SCRATCH).expect("drop the scratch table");
    txn.commit().expect("commit");
    let [plain, quick] = costs;
    (spread(plain), spread(quick))
}

fn measure(n: u64, reps: usize, full: bool) -> Row {
    let scratch = tempfile::tempdir().expect("temp dir");
    let dir = scratch.path().join("cache");
    let generated = Instant::now();
    let warm = generate(&dir, n);
    eprintln!("scale: {n} blobs generated in {:.1} s", generated.elapsed().as_secs_f64());
    let (open_read, lru_read, pass_read) = read_counts(&dir, n);
    eprintln!(
        "scale: {n} blobs: read from the index by opening the cache {open_read} B, by {LRU_PROBE} LRU entries \
         {lru_read} B, by one pass over the blob rows {pass_read} B"
    );
    let mut figures = Vec::new();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;

    let (mut ready, mut check) = (Vec::new(), Vec::new());
    let (mut manifest_rate, mut manifest_cpu, mut blob_rate, mut blob_cpu) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let has_wrk = Command::new("wrk").arg("--version").output().is_ok();
    for _ in 0..reps {
        // Every start here follows a clean stop (or the generator's close).
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
        server.stop(&dir);
    }
    let mut after_crash = Vec::new();
    for _ in 0..reps {
        let (server, _) = Server::start(&dir);
        server.crash();
        let (server, took) = Server::start(&dir);
        after_crash.push(ms(took));
        server.check_time();
        server.stop(&dir);
    }
    figures.push(("start-up to ready, after a clean stop", "ms", spread(ready)));
    figures.push(("start-up to ready, after a crash (SIGKILL)", "ms", spread(after_crash)));
    figures.push(("background check of files vs rows", "ms", spread(check)));
    if !manifest_rate.is_empty() {
        figures.push(("warm manifest GET by digest, 16 conns", "req/s", spread(manifest_rate)));
        figures.push(("  server CPU per manifest GET", "µs", spread(manifest_cpu)));
        figures.push(("warm 10 MiB blob GET, 4 conns", "req/s", spread(blob_rate)));
        figures.push(("  server CPU per 10 MiB GET", "ms", spread(blob_cpu)));
    }

    // Eviction and purge change the cache, so they come after the server
    // rows; each repetition evicts the next 1 % and purges another
    // repository. The round is timed in the steps `Cache::evict` takes.
    let index = Index::open(&dir.join("index.redb")).expect("index");
    let one_percent = n / 100 * small_blob(0).len() as u64;
    let (mut evictions, mut lru, mut commit, mut unlink) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        let started = Instant::now();
        let victims = index.least_recently_used(one_percent.max(1), &|_, _| false).expect("lru");
        let read = Instant::now();
        let keys: Vec<(Kind, Digest)> = victims.iter().map(|e| (e.kind, e.digest)).collect();
        let removed = index.remove_content(&keys).expect("remove");
        let committed = Instant::now();
        let digests: Vec<Digest> = removed.iter().map(|e| e.digest).collect();
        for (d, size) in digests.iter().zip(index.blob_sizes(&digests).expect("lookup")) {
            assert_eq!(size, None, "removed");
            std::fs::remove_file(blob_path(&dir, d)).expect("unlink");
        }
        let done = Instant::now();
        evictions.push(ms(done - started));
        lru.push(ms(read - started));
        commit.push(ms(committed - read));
        unlink.push(ms(done - committed));
        assert_eq!(removed.len() as u64, (n / 100).max(1), "1 % of the blobs went");
    }
    figures.push(("eviction round, 1 % of the blobs", "ms", spread(evictions)));
    figures.push(("  reading them in access order", "ms", spread(lru)));
    figures.push(("  removing their rows (one commit)", "ms", spread(commit)));
    figures.push(("  unlinking their files, one thread", "ms", spread(unlink)));
    drop(index);

    // The same round as larder's maintenance task runs it.
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let cache = runtime.block_on(larder::cache::Cache::open(cache_config(&dir))).expect("open the cache");
    let mut rounds = Vec::new();
    for _ in 0..reps {
        let before = cache.usage();
        let started = Instant::now();
        runtime.block_on(cache.evict(one_percent.max(1))).expect("evict");
        rounds.push(ms(started.elapsed()));
        assert_eq!(before - cache.usage(), one_percent.max(1), "1 % of the blobs went");
    }
    drop(cache);
    drop(runtime);
    figures.push(("eviction round as larder runs it (Cache::evict)", "ms", spread(rounds)));

    let index = Index::open(&dir.join("index.redb")).expect("index");
    let mut purges = Vec::new();
    for rep in 0..reps as u64 {
        // The last repositories: eviction took the least recently used,
        // which may include some of their blobs.
        let first = n - BLOBS_PER_REPO * (rep + 1);
        let repo = repo_of(first);
        let digests: Vec<Digest> = (first..first + BLOBS_PER_REPO).map(|i| Digest::of(&small_blob(i))).collect();
        let left = index.blob_sizes(&digests).expect("lookup").iter().flatten().count();
        let started = Instant::now();
        let purged = index.purge(&format!("{UPSTREAM}\0{repo}\0")).expect("purge");
        for e in &purged.content {
            std::fs::remove_file(blob_path(&dir, &e.digest)).expect("unlink");
        }
        purges.push(ms(started.elapsed()));
        assert_eq!(purged.content.len(), left, "the repository's remaining blobs went");
    }
    figures.push(("purge of one repository (10 blobs)", "ms", spread(purges)));
    drop(index);
    let (plain, quick) = commit_costs(&dir.join("index.redb"));
    figures.push(("one-row commit, redb quick repair off", "ms", plain));
    figures.push(("one-row commit, redb quick repair on", "ms", quick));
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
