//! The larder binary under test: config written to a temp dir, started,
//! stopped and restarted on the same config and cache dir.
//!
//! ```ignore
//! let larder = Larder::builder()
//!     .upstream(Upstream::from(&origin).credentials(&creds))
//!     .tag_ttl("1s")
//!     .start()
//!     .await;
//! skopeo::pull(&larder.image_ref("team/app:v1"), false).await?;
//! ```
//!
//! Its stdout and stderr go to `larder.log` in the temp dir; the log is
//! printed when a test fails while the `Larder` is alive, or on demand.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tempfile::TempDir;

use super::origin::{ORIGIN_NAME, Origin};
use super::process::LoggedChild;
use super::token_server::Credentials;
use super::tools::free_port;

/// How many log lines a failing test prints.
const LOG_LINES_ON_FAILURE: usize = 300;
/// Longest a graceful restart waits for larder to exit: more than its
/// default `server.shutdown_grace` (25 s), which bounds its own stop.
const GRACEFUL_EXIT: std::time::Duration = std::time::Duration::from_secs(40);

/// The path of the binary cargo built for this test run.
pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_larder")
}

/// One `[[upstream]]` table of larder's config.
#[derive(Clone, Debug)]
pub struct Upstream {
    name: String,
    url: String,
    /// `urls = [primary, fallback…]`, written instead of `url` when set.
    urls: Option<Vec<String>>,
    default: bool,
    aliases: Vec<String>,
    credentials: Option<Credentials>,
    tag_ttl: Option<String>,
    extra_lines: Vec<String>,
}

impl Upstream {
    /// An upstream called `name` (the `ns=` value and path prefix) at `url`.
    pub fn new(name: &str, url: &str) -> Self {
        Upstream {
            name: name.to_owned(),
            url: url.to_owned(),
            urls: None,
            default: false,
            aliases: Vec::new(),
            credentials: None,
            tag_ttl: None,
            extra_lines: Vec::new(),
        }
    }

    /// Whether requests without `ns=` or a path prefix go here.
    pub fn default(mut self, default: bool) -> Self {
        self.default = default;
        self
    }

    pub fn alias(mut self, alias: &str) -> Self {
        self.aliases.push(alias.to_owned());
        self
    }

    /// `username` plus a `password_file` the builder writes (mode 0600).
    pub fn credentials(mut self, credentials: &Credentials) -> Self {
        self.credentials = Some(credentials.clone());
        self
    }

    /// This upstream's own `tag_ttl` (a human duration such as `"1s"`).
    pub fn tag_ttl(mut self, ttl: &str) -> Self {
        self.tag_ttl = Some(ttl.to_owned());
        self
    }

    /// `urls = [...]` (a primary and its fallbacks) instead of `url`.
    pub fn urls(mut self, urls: &[String]) -> Self {
        self.urls = Some(urls.to_vec());
        self
    }

    /// A raw TOML line for this table, e.g. `max_concurrency = 4`.
    pub fn line(mut self, toml: &str) -> Self {
        self.extra_lines.push(toml.to_owned());
        self
    }

    fn write_toml(&self, out: &mut String, dir: &Path) {
        let _ = writeln!(out, "\n[[upstream]]");
        let _ = writeln!(out, "name = {}", toml_string(&self.name));
        match &self.urls {
            Some(urls) => {
                let urls: Vec<String> = urls.iter().map(|u| toml_string(u)).collect();
                let _ = writeln!(out, "urls = [{}]", urls.join(", "));
            }
            None => {
                let _ = writeln!(out, "url = {}", toml_string(&self.url));
            }
        }
        let _ = writeln!(out, "default = {}", self.default);
        if !self.aliases.is_empty() {
            let aliases: Vec<String> = self.aliases.iter().map(|a| toml_string(a)).collect();
            let _ = writeln!(out, "aliases = [{}]", aliases.join(", "));
        }
        if let Some(credentials) = &self.credentials {
            let password_file = dir.join(format!("{}.password", self.name));
            write_secret(&password_file, &credentials.password);
            let _ = writeln!(out, "username = {}", toml_string(&credentials.user));
            let _ = writeln!(out, "password_file = {}", toml_string(&password_file.to_string_lossy()));
        }
        if let Some(ttl) = &self.tag_ttl {
            let _ = writeln!(out, "tag_ttl = {}", toml_string(ttl));
        }
        for line in &self.extra_lines {
            let _ = writeln!(out, "{line}");
        }
    }
}

/// The origin as larder's default upstream, named [`ORIGIN_NAME`].
impl From<&Origin> for Upstream {
    fn from(origin: &Origin) -> Self {
        Upstream::new(ORIGIN_NAME, &origin.url()).default(true)
    }
}

/// Builds a larder config and starts larder on it; see the module docs.
#[derive(Clone, Debug)]
pub struct LarderBuilder {
    upstreams: Vec<Upstream>,
    tag_ttl: String,
    max_size: String,
    server_lines: Vec<String>,
    cache_lines: Vec<String>,
    appended: Vec<String>,
    env: Vec<(String, String)>,
    tcp_ready: bool,
    /// Run inside this network namespace, listening on this address
    /// (port 5000): see [`LarderBuilder::in_netns`].
    netns: Option<(String, std::net::Ipv4Addr)>,
}

impl Default for LarderBuilder {
    fn default() -> Self {
        LarderBuilder {
            upstreams: Vec::new(),
            tag_ttl: "5m".to_owned(),
            max_size: "10GiB".to_owned(),
            server_lines: Vec::new(),
            cache_lines: Vec::new(),
            appended: Vec::new(),
            env: vec![
                ("RUST_LOG".to_owned(), "larder=debug".to_owned()),
                // Plain logs: they are read from files and printed in test output.
                ("NO_COLOR".to_owned(), "1".to_owned()),
            ],
            tcp_ready: false,
            netns: None,
        }
    }
}

impl LarderBuilder {
    /// Adds an upstream: an [`Upstream`], or `&origin` for the origin as default.
    pub fn upstream(mut self, upstream: impl Into<Upstream>) -> Self {
        self.upstreams.push(upstream.into());
        self
    }

    /// `[cache] tag_ttl` (default `"5m"`).
    pub fn tag_ttl(mut self, ttl: &str) -> Self {
        self.tag_ttl = ttl.to_owned();
        self
    }

    /// `[cache] max_size` (default `"10GiB"`).
    pub fn max_size(mut self, size: &str) -> Self {
        self.max_size = size.to_owned();
        self
    }

    /// A raw TOML line in `[server]`.
    pub fn server_line(mut self, toml: &str) -> Self {
        self.server_lines.push(toml.to_owned());
        self
    }

    /// A raw TOML line in `[cache]`.
    pub fn cache_line(mut self, toml: &str) -> Self {
        self.cache_lines.push(toml.to_owned());
        self
    }

    /// Raw TOML appended after everything else (for whole new tables).
    pub fn append_toml(mut self, toml: &str) -> Self {
        self.appended.push(toml.to_owned());
        self
    }

    /// An environment variable for the larder process (`RUST_LOG` defaults
    /// to `larder=debug`).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Local faults for the larder process to inject into its own I/O on
    /// the fill path: `LARDER_INJECT_FAULTS` (read by a debug build only;
    /// the rules are in src/faults.rs), e.g. `temp_read:EIO:0:1` for one
    /// failed hash read-back.
    pub fn inject_faults(self, rules: &str) -> Self {
        self.env("LARDER_INJECT_FAULTS", rules)
    }

    /// Runs larder inside network namespace `ns` (`ip netns exec`), its
    /// registry listener on `ip:5000`; the test reaches it from a
    /// namespace on the same lab (see `netns::Lab`).
    pub fn in_netns(mut self, ns: &str, ip: std::net::Ipv4Addr) -> Self {
        self.netns = Some((ns.to_owned(), ip));
        self
    }

    /// The address the registry listener binds.
    fn host(&self) -> String {
        self.netns.as_ref().map_or_else(|| "127.0.0.1".to_owned(), |(_, ip)| ip.to_string())
    }

    /// The config file text for a larder on `port` caching in `dir/cache`;
    /// password files are written into `dir`.
    pub fn config_toml(&self, dir: &Path, port: u16) -> String {
        let mut toml = String::new();
        let _ = writeln!(toml, "[server]");
        let _ = writeln!(toml, "listen = \"{}:{port}\"", self.host());
        for line in &self.server_lines {
            let _ = writeln!(toml, "{line}");
        }
        let _ = writeln!(toml, "\n[cache]");
        let cache_dir = dir.join("cache");
        let _ = writeln!(toml, "dir = {}", toml_string(&cache_dir.to_string_lossy()));
        let _ = writeln!(toml, "tag_ttl = {}", toml_string(&self.tag_ttl));
        let _ = writeln!(toml, "max_size = {}", toml_string(&self.max_size));
        for line in &self.cache_lines {
            let _ = writeln!(toml, "{line}");
        }
        for upstream in &self.upstreams {
            upstream.write_toml(&mut toml, dir);
        }
        for extra in &self.appended {
            let _ = writeln!(toml, "\n{extra}");
        }
        toml
    }

    /// Writes the config into a fresh temp dir and runs
    /// `larder check-config --config FILE` on it.
    pub fn check_config(&self) -> Output {
        let dir = larder_temp_dir();
        let config_path = dir.path().join("larder.toml");
        write_file(&config_path, &self.config_toml(dir.path(), free_port()));
        Command::new(binary())
            .arg("check-config")
            .arg("--config")
            .arg(&config_path)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap_or_else(|e| panic!("cannot run `larder check-config`: {e}"))
    }

    /// Readiness by TCP connect instead of `GET /v2/` = 200: for a listener
    /// that speaks TLS or challenges for credentials.
    pub fn ready_on_tcp(mut self) -> Self {
        self.tcp_ready = true;
        self
    }

    /// Writes the config, starts larder and waits until `GET /v2/` answers 200.
    pub async fn start(self) -> Larder {
        assert!(!self.upstreams.is_empty(), "a larder needs at least one upstream");
        let dir = larder_temp_dir();
        let port = if self.netns.is_some() { 5000 } else { free_port() };
        let config_path = dir.path().join("larder.toml");
        write_file(&config_path, &self.config_toml(dir.path(), port));
        let mut larder = Larder {
            host: self.host(),
            netns: self.netns.map(|(ns, _)| ns),
            port,
            config_path,
            log_path: dir.path().join("larder.log"),
            env: self.env,
            process: None,
            starts: 0,
            tcp_ready: self.tcp_ready,
            dir,
        };
        larder.spawn_and_wait().await;
        larder
    }
}

/// A running larder; killed (by PID) on drop.
pub struct Larder {
    /// The registry listener's address (`127.0.0.1`, or an address in `netns`).
    host: String,
    /// The network namespace it runs in, if not the test's own.
    netns: Option<String>,
    port: u16,
    config_path: PathBuf,
    log_path: PathBuf,
    env: Vec<(String, String)>,
    process: Option<LoggedChild>,
    starts: u32,
    tcp_ready: bool,
    // Last, so the process is killed before its files are removed.
    dir: TempDir,
}

impl Larder {
    pub fn builder() -> LarderBuilder {
        LarderBuilder::default()
    }

    /// `http://127.0.0.1:<port>` (or its address in its namespace).
    pub fn url(&self) -> String {
        format!("http://{}:{}", self.host, self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>` (or its address in its namespace).
    pub fn host_port(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// `docker://127.0.0.1:<port>/<repo_and_tag>`: served by the default upstream.
    pub fn image_ref(&self, repo_and_tag: &str) -> String {
        format!("docker://{}/{repo_and_tag}", self.host_port())
    }

    /// `docker://127.0.0.1:<port>/<upstream>/<repo_and_tag>`: the path-prefix form.
    pub fn prefixed_ref(&self, upstream: &str, repo_and_tag: &str) -> String {
        format!("docker://{}/{upstream}/{repo_and_tag}", self.host_port())
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Runs `larder <args> --config <this larder's config>` (stdout not a
    /// terminal) and prints what it said, for the test's log.
    pub fn cli(&self, args: &[&str]) -> Output {
        let out =
            Command::new(binary()).args(args).arg("--config").arg(&self.config_path).output().expect("run larder");
        eprintln!(
            "larder {}: {}\n{}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// The config file as written.
    pub fn config_text(&self) -> String {
        super::process::read_lossy(&self.config_path)
    }

    /// `[cache] dir`.
    pub fn cache_dir(&self) -> PathBuf {
        self.dir.path().join("cache")
    }

    /// Where larder keeps a committed blob (`sha256:<hex>`).
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or_else(|| panic!("not a sha256 digest: {digest}"));
        self.cache_dir().join("blobs/sha256").join(&hex[..2]).join(hex)
    }

    /// Everything larder logged, across restarts, once its log writer has
    /// caught up (it writes in batches).
    pub fn log(&self) -> String {
        super::process::read_settled(&self.log_path)
    }

    /// Prints the last lines of larder's log to the test's output.
    pub fn print_log(&self) {
        eprintln!(
            "===== larder {} log ({}) =====\n{}\n===== end of larder log =====",
            self.host_port(),
            self.log_path.display(),
            super::process::tail(&self.log(), LOG_LINES_ON_FAILURE)
        );
    }

    /// The running process's id.
    pub fn pid(&self) -> u32 {
        self.process.as_ref().and_then(|p| p.pid()).expect("larder is running")
    }

    /// True while the process is up (it has not exited or been stopped).
    pub fn is_running(&mut self) -> bool {
        match self.process.as_mut() {
            Some(process) => process.exit_status().is_none(),
            None => false,
        }
    }

    /// Panics, with the log, if larder has exited (e.g. crashed).
    pub fn assert_running(&mut self, context: &str) {
        match self.process.as_mut() {
            Some(process) => process.assert_running(context),
            None => panic!("larder is stopped {context}"),
        }
    }

    /// Rewrites the config file with `edit` (takes effect at the next
    /// [`Larder::restart`]).
    pub fn edit_config(&self, edit: impl FnOnce(String) -> String) {
        write_file(&self.config_path, &edit(self.config_text()));
    }

    /// Stops the process where it is (SIGSTOP): it keeps its sockets, the
    /// kernel still accepts connections for it, and nothing answers. A
    /// hung replica, not a dead one.
    pub fn pause(&mut self) {
        self.signal("STOP");
    }

    /// Lets a paused process go on (SIGCONT).
    pub fn resume(&mut self) {
        self.signal("CONT");
    }

    fn signal(&mut self, name: &str) {
        let process = self.process.as_mut().expect("larder is running");
        let pid = process.pid().expect("larder has a pid");
        process.write_log_marker(&format!("SIG{name}"));
        let sent = Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).status().expect("run kill");
        assert!(sent.success(), "kill -{name} {pid} failed");
    }

    /// Sends SIGTERM, what Kubernetes sends to stop a pod.
    pub fn send_sigterm(&mut self) {
        let process = self.process.as_mut().expect("larder is running");
        let pid = process.pid().expect("larder has a pid");
        process.write_log_marker("SIGTERM");
        let sent = Command::new("kill").arg("-TERM").arg(pid.to_string()).status().expect("run kill");
        assert!(sent.success(), "kill -TERM {pid} failed");
    }

    /// Waits up to `timeout` for larder to exit: its exit status, or `None`
    /// if it is still running.
    pub async fn wait_exit(&mut self, timeout: std::time::Duration) -> Option<std::process::ExitStatus> {
        let process = self.process.as_mut()?;
        let started = std::time::Instant::now();
        while started.elapsed() < timeout {
            if let Some(status) = process.exit_status() {
                return Some(status);
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        None
    }

    /// Kills larder (SIGKILL, by PID): nothing gets a chance to flush.
    pub fn stop(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.write_log_marker("killing larder");
            process.kill();
        }
    }

    /// Restarts larder on the same config, port and cache dir: a graceful
    /// stop (SIGTERM, which lets the fills of blobs already served commit)
    /// if it is running, then a start. After [`Larder::stop`] (a kill) or
    /// an exit, it only starts it: the restart after a crash.
    pub async fn restart(&mut self) {
        if self.process.as_mut().is_some_and(|p| p.exit_status().is_none()) {
            self.send_sigterm();
            let status = self.wait_exit(GRACEFUL_EXIT).await;
            assert!(status.is_some_and(|s| s.success()), "larder did not exit cleanly on SIGTERM: {status:?}");
        }
        self.process = None;
        self.spawn_and_wait().await;
    }

    async fn spawn_and_wait(&mut self) {
        self.starts += 1;
        let mut command = match &self.netns {
            Some(ns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", ns]).arg(binary());
                command
            }
            None => Command::new(binary()),
        };
        command.arg("--config").arg(&self.config_path).envs(self.env.iter().map(|(k, v)| (k, v)));
        super::process::append_marker(&self.log_path, &format!("larder start #{}", self.starts));
        let process = LoggedChild::spawn("larder", command, &self.log_path);
        let ready_url = format!("{}/v2/", self.url());
        let (port, tcp_ready, host) = (self.port, self.tcp_ready, self.host.clone());
        let process = self.process.insert(process);
        if tcp_ready {
            let started = std::time::Instant::now();
            while tokio::net::TcpStream::connect(format!("{host}:{port}")).await.is_err() {
                process.assert_running("before accepting connections");
                assert!(
                    started.elapsed() < super::process::READY_TIMEOUT,
                    "larder did not accept connections within {:?}; log:\n{}",
                    super::process::READY_TIMEOUT,
                    process.log_tail(80)
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        } else {
            process.wait_ready(&ready_url, 200).await;
        }
    }
}

impl Drop for Larder {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.print_log();
        }
    }
}

fn larder_temp_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("larder-test-")
        .tempdir()
        .unwrap_or_else(|e| panic!("cannot create larder's temp dir: {e}"))
}

fn write_file(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

fn write_secret(path: &Path, secret: &str) {
    use std::os::unix::fs::PermissionsExt;
    write_file(path, secret);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .unwrap_or_else(|e| panic!("cannot chmod {}: {e}", path.display()));
}

/// A TOML basic string.
fn toml_string(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
