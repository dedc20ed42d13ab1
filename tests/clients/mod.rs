//! Private instances of the real clients a cluster uses: containerd (with
//! `ctr` and a `hosts.toml` mirror, as a kubelet's CRI would) and dockerd
//! (with `registry-mirrors`). Each runs as its own process with its own
//! root, state and socket in a temp dir, is stopped on drop, and is pointed
//! at 127.0.0.1 only.

#![allow(dead_code)]

pub mod containerd;
pub mod cri;
pub mod dockerd;
pub mod hosts;
pub mod podman;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// How long a daemon may take to answer on its socket.
pub const DAEMON_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one pull may take before the test gives up on it.
pub const PULL_TIMEOUT: Duration = Duration::from_secs(120);

/// Polls `probe` until it exits 0, panicking with `log` after the timeout.
pub fn wait_until_ready(what: &str, log: &Path, mut probe: impl FnMut() -> Command) {
    let deadline = Instant::now() + DAEMON_READY_TIMEOUT;
    loop {
        let ok = probe().output().map(|o| o.status.success()).unwrap_or(false);
        if ok {
            return;
        }
        if Instant::now() > deadline {
            panic!("{what} did not become ready in {DAEMON_READY_TIMEOUT:?}; log:\n{}", tail(log, 60));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Runs a command to completion, bounded by [`PULL_TIMEOUT`] (killed
/// after it): its output, whatever its exit status.
pub fn run_output(mut command: Command) -> Result<std::process::Output, String> {
    let child = command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(PULL_TIMEOUT) {
        Ok(output) => Ok(output.unwrap_or_else(|e| panic!("waiting for {command:?}: {e}"))),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            Err(format!("{command:?} did not finish in {PULL_TIMEOUT:?}"))
        }
    }
}

/// Runs a client command to completion (bounded by [`PULL_TIMEOUT`]) and
/// returns its combined output, or the output as the error if it failed.
pub fn run(command: Command) -> Result<String, String> {
    let described = format!("{command:?}");
    let output = run_output(command)?;
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    if output.status.success() { Ok(text) } else { Err(format!("{described} failed ({}):\n{text}", output.status)) }
}

pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
