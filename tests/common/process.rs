//! A child process whose output goes to a log file, killed by PID on drop.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a peer may take to answer its readiness URL with 200.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// A started peer process: stdout and stderr appended to `log_path`.
pub struct LoggedChild {
    name: String,
    child: Option<Child>,
    log_path: PathBuf,
}

impl LoggedChild {
    /// Starts `command` with stdin closed and both output streams appended to
    /// `log_path`. `name` is how panics and printed logs refer to it.
    pub fn spawn(name: &str, mut command: Command, log_path: &Path) -> Self {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .unwrap_or_else(|e| panic!("cannot open {name} log {}: {e}", log_path.display()));
        let log_err = log.try_clone().unwrap_or_else(|e| panic!("cannot clone {name} log handle: {e}"));
        command.stdin(Stdio::null()).stdout(Stdio::from(log)).stderr(Stdio::from(log_err));
        let child = command.spawn().unwrap_or_else(|e| panic!("cannot start {name} ({command:?}): {e}"));
        LoggedChild { name: name.to_owned(), child: Some(child), log_path: log_path.to_owned() }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The process id while it is running under this guard.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `Some(status)` once the process has exited on its own (or was killed).
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        child.try_wait().unwrap_or_else(|e| panic!("cannot poll {} (pid {}): {e}", self.name, child.id()))
    }

    /// Panics, with the log tail, if the process is no longer running.
    pub fn assert_running(&mut self, context: &str) {
        if let Some(status) = self.exit_status() {
            panic!("{} exited ({status}) {context}; last log lines:\n{}", self.name, self.log_tail(80));
        }
    }

    /// Sends SIGKILL to this process (by its PID) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // An error here means it already exited; wait() reaps it either way.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Appends a marker line to the log, e.g. before a restart.
    pub fn write_log_marker(&self, marker: &str) {
        append_marker(&self.log_path, marker);
    }

    /// The whole log so far (lossy UTF-8), once the writer caught up.
    pub fn log(&self) -> String {
        read_settled(&self.log_path)
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log(), lines)
    }

    /// Polls `url` until it answers `expected` (200 for an open registry, 401
    /// behind auth), panicking with the log if the process exits or
    /// [`READY_TIMEOUT`] passes first.
    pub async fn wait_ready(&mut self, url: &str, expected: u16) {
        let client = super::http::client();
        let started = Instant::now();
        let mut last = String::from("no answer yet");
        loop {
            if let Some(status) = self.exit_status() {
                panic!(
                    "{} exited ({status}) before {url} answered {expected} (last: {last}); log:\n{}",
                    self.name,
                    self.log_tail(80)
                );
            }
            match client.get(url).send().await {
                Ok(response) if response.status() == expected => return,
                Ok(response) => last = format!("status {}", response.status()),
                Err(e) => last = format!("error {e}"),
            }
            if started.elapsed() > READY_TIMEOUT {
                panic!(
                    "{} did not answer {expected} on {url} within {READY_TIMEOUT:?} (last: {last}); log:\n{}",
                    self.name,
                    self.log_tail(80)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for LoggedChild {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Appends `----- test harness: <marker> -----` to the log at `path`.
pub fn append_marker(path: &Path, marker: &str) {
    if let Ok(mut log) = OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(log, "----- test harness: {marker} -----");
    }
}

/// A log's text once larder's writer has caught up with what it queued
/// (see [`super::settle`]), so that a line logged just before is in it.
pub fn read_settled(path: &Path) -> String {
    super::settle::settled(|| std::fs::metadata(path).map_or(0, |m| m.len()));
    read_lossy(path)
}

pub fn read_lossy(path: &Path) -> String {
    match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => format!("<cannot read {}: {e}>", path.display()),
    }
}

pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Creates an empty file, panicking with the path if that fails.
pub fn create_file(path: &Path) -> File {
    File::create(path).unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()))
}
