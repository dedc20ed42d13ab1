//! `Larder`: the larder binary as a child process with its own cache
//! folder, pointed at a [`FakeUpstream`]. Killed when dropped; a failing
//! test prints its stderr.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::sync::oneshot;

use super::{FakeUpstream, PATIENCE, UPSTREAM_NAME, client};

#[must_use]
pub struct LarderBuilder {
    upstream_url: String,
    /// Extra `key = value` lines for the `[[upstream]]` table.
    upstream_lines: Vec<String>,
    /// `LARDER_INJECT_FAULTS` for the process, if set.
    faults: Option<String>,
}

impl LarderBuilder {
    /// Local faults for larder to inject into its own I/O on the fill
    /// path (`LARDER_INJECT_FAULTS`, read by a debug build only; the rules
    /// are in src/faults.rs), e.g. `temp_read:EIO:0:1`.
    pub fn inject_faults(mut self, rules: &str) -> Self {
        self.faults = Some(rules.to_owned());
        self
    }

    /// An extra `[[upstream]]` setting, `value` written as TOML.
    pub fn upstream_setting(mut self, key: &str, value: &str) -> Self {
        self.upstream_lines.push(format!("{key} = {value}"));
        self
    }

    pub fn max_concurrency(self, n: usize) -> Self {
        self.upstream_setting("max_concurrency", &n.to_string())
    }

    /// `response_timeout`, e.g. `"1s"`.
    pub fn response_timeout(self, d: &str) -> Self {
        self.upstream_setting("response_timeout", &format!("{d:?}"))
    }

    pub async fn start(self) -> Larder {
        let dir = tempfile::tempdir().expect("a temp dir");
        let cache_dir = dir.path().join("cache");
        let config_path = dir.path().join("larder.toml");
        let config = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\n\
             [cache]\ndir = {cache:?}\ntag_ttl = \"5m\"\n\n\
             [[upstream]]\nname = {UPSTREAM_NAME:?}\nurl = {url:?}\ndefault = true\n{extra}\n",
            cache = cache_dir.display().to_string(),
            url = self.upstream_url,
            extra = self.upstream_lines.join("\n"),
        );
        std::fs::write(&config_path, config).expect("write larder.toml");

        let mut child = Command::new(env!("CARGO_BIN_EXE_larder"))
            .arg("--config")
            .arg(&config_path)
            .env("RUST_LOG", "larder=debug")
            .env("NO_COLOR", "1")
            .envs(self.faults.iter().map(|rules| (super::INJECT_FAULTS, rules)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the larder binary");

        let logs = Arc::new(Mutex::new(String::new()));
        let (addr_tx, addr_rx) = oneshot::channel();
        let stderr = child.stderr.take().expect("piped stderr");
        // A thread of its own, not a task: `logs()` waits for the log to
        // settle with blocking sleeps, which would stall a task on the
        // test's single-threaded runtime.
        let stderr = std::fs::File::from(stderr.into_owned_fd().expect("a blocking stderr pipe"));
        let collected = Arc::clone(&logs);
        std::thread::spawn(move || collect_logs(stderr, collected, addr_tx));

        let mut larder = Larder { addr: None, child, cache_dir, logs, _dir: dir };
        let addr = match tokio::time::timeout(PATIENCE, addr_rx).await {
            Ok(Ok(addr)) => addr,
            _ => panic!("larder did not start listening:\n{}", larder.logs()),
        };
        larder.addr = Some(addr);
        larder.wait_ready().await;
        larder
    }
}

/// Copies larder's stderr into `logs`, and sends the address from the
/// "larder listening" line (larder is configured with port 0).
fn collect_logs(stderr: std::fs::File, logs: Arc<Mutex<String>>, addr_tx: oneshot::Sender<SocketAddr>) {
    use std::io::BufRead as _;
    let mut addr_tx = Some(addr_tx);
    for line in std::io::BufReader::new(stderr).lines() {
        let Ok(line) = line else { break };
        let line = strip_ansi(&line);
        if line.contains("larder listening") {
            let addr = line.split_whitespace().find_map(|w| w.strip_prefix("addr=")).and_then(|a| a.parse().ok());
            if let (Some(addr), Some(tx)) = (addr, addr_tx.take()) {
                let _ = tx.send(addr);
            }
        }
        let mut logs = logs.lock().unwrap_or_else(|p| p.into_inner());
        logs.push_str(&line);
        logs.push('\n');
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

pub struct Larder {
    addr: Option<SocketAddr>,
    child: Child,
    cache_dir: PathBuf,
    logs: Arc<Mutex<String>>,
    _dir: tempfile::TempDir,
}

impl Larder {
    pub fn builder(upstream: &FakeUpstream) -> LarderBuilder {
        LarderBuilder { upstream_url: upstream.url(), upstream_lines: Vec::new(), faults: None }
    }

    /// A larder in front of `upstream` with the default settings.
    pub async fn start(upstream: &FakeUpstream) -> Larder {
        Larder::builder(upstream).start().await
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr.expect("larder is listening")
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("larder is running")
    }

    /// Resident memory of the larder process, in bytes (`VmRSS`).
    pub fn rss(&self) -> u64 {
        self.proc_status("VmRSS")
    }

    /// Resident anonymous memory (`RssAnon`): the heap and stacks, without
    /// the pages of the binary itself that larder touches as it runs.
    pub fn rss_anon(&self) -> u64 {
        self.proc_status("RssAnon")
    }

    /// A `kB` field of `/proc/<pid>/status`, in bytes.
    fn proc_status(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("read /proc/<pid>/status");
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc/<pid>/status"));
        kib * 1024
    }

    /// Everything larder wrote to stderr so far, once its log writer has
    /// caught up (it writes in batches: a line logged just before a call
    /// may not be out yet).
    pub fn logs(&self) -> String {
        let read = || self.logs.lock().unwrap_or_else(|p| p.into_inner());
        super::settle::settled(|| read().len() as u64);
        read().clone()
    }

    /// Where larder keeps a committed blob.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
        self.cache_dir.join("blobs/sha256").join(&hex[..2]).join(hex)
    }

    /// Waits until larder has committed the blob to its cache folder.
    pub async fn wait_committed(&self, digest: &str) {
        let file = self.blob_file(digest);
        super::wait_until(&format!("larder commits {digest}"), || file.exists()).await;
    }

    async fn wait_ready(&self) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(5), client::try_get(self.addr(), "/v2/")).await
            {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "larder never answered GET /v2/ with 200:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Larder {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        if std::thread::panicking() {
            eprintln!("---- larder stderr ----\n{}", self.logs());
        }
    }
}
