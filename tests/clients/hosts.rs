//! `/etc/hosts` entries that pin registry host names to 127.0.0.1, so that
//! a client falling back from the mirror to the "real" registry can never
//! leave the machine (REAL-PEERS.md: made-up hosts for containerd; Docker
//! Hub's hosts for dockerd, which falls back to them on a mirror failure).

use std::io::Write;

const HOSTS: &str = "/etc/hosts";

/// Adds `127.0.0.1 <name>` for each name not yet mapped. Panics if
/// `/etc/hosts` cannot be written: without it the test could reach the
/// network, so it must not run.
pub fn pin_to_loopback(names: &[&str]) {
    let current = std::fs::read_to_string(HOSTS).unwrap_or_default();
    let mapped = |name: &str| {
        current.lines().any(|l| {
            let mut words = l.split_whitespace();
            words.next() == Some("127.0.0.1") && words.any(|w| w == name)
        })
    };
    let missing: Vec<&str> = names.iter().copied().filter(|n| !mapped(n)).collect();
    if missing.is_empty() {
        return;
    }
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(HOSTS)
        .unwrap_or_else(|e| panic!("cannot pin {missing:?} to 127.0.0.1 in {HOSTS} (run as root): {e}"));
    writeln!(file, "127.0.0.1 {}  # larder tests: keep registry fallbacks on loopback", missing.join(" "))
        .unwrap_or_else(|e| panic!("cannot write {HOSTS}: {e}"));
}
