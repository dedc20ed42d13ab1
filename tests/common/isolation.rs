//! Runs a test in network and mount namespaces of its own, so that its
//! loopback can carry addresses no test may give the machine — the cloud
//! metadata addresses (169.254.169.254, fd00:ec2::254), public-looking
//! documentation addresses (203.0.113.0/24), a private network — and made-up
//! names can resolve to them through an /etc/hosts of its own. Nothing can
//! leave: the namespace has nothing but its loopback, and the machine's own
//! namespaces are never changed.
//!
//! The test runs twice. Run by cargo, [`isolated`] starts the test binary
//! again for this one test under `unshare --net --mount` and passes or fails
//! with it (returning `None`: the outer run is done). Inside, it checks that
//! it really is in a namespace of its own before it adds a single address,
//! sets up the loopback and the hosts file, and returns a guard: the test
//! goes on there. The namespaces end with the inner process, whatever way
//! it ends, so there is nothing to clean up.
//!
//! ```ignore
//! let Some(_ns) = isolation::isolated("my_test", &["169.254.169.254/32"], &[("metadata.test", "169.254.169.254")])
//! else { return };
//! ```

use std::process::Command;

/// Set for the inner run: the outer run's network namespace, which the
/// inner run must not be in.
const OUTER_NETNS: &str = "LARDER_TEST_OUTER_NETNS";

/// The inner run's hosts file, bound over /etc/hosts in its own mount
/// namespace; kept for as long as the test runs.
pub struct Isolated {
    _hosts: tempfile::NamedTempFile,
}

/// This process's network namespace, as `net:[<inode>]`.
fn netns() -> String {
    std::fs::read_link("/proc/self/ns/net").expect("read /proc/self/ns/net").display().to_string()
}

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(out.status.success(), "{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

/// `test` is the test's own name (as `cargo test -- --exact` takes it),
/// `addresses` go onto the namespace's loopback (`"169.254.169.254/32"`),
/// `hosts` are (name, address) lines of its /etc/hosts, beside localhost.
pub fn isolated(test: &str, addresses: &[&str], hosts: &[(&str, &str)]) -> Option<Isolated> {
    let Ok(outer) = std::env::var(OUTER_NETNS) else {
        let exe = std::env::current_exe().expect("the test binary's path");
        let mut unshare = Command::new("unshare");
        // root (as CI runs) needs no user namespace; anyone else maps to root in one.
        if !is_root() {
            unshare.args(["--user", "--map-root-user"]);
        }
        let status = unshare
            .args(["--net", "--mount", "--"])
            .arg(exe)
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(OUTER_NETNS, netns())
            .status()
            .expect("run unshare (util-linux)");
        assert!(status.success(), "{test} failed in its own network namespace ({status}); its output is above");
        return None;
    };
    assert_ne!(netns(), outer, "not in a network namespace of its own: refusing to add addresses");
    run("ip", &["link", "set", "lo", "up"]);
    for address in addresses {
        run("ip", &["address", "add", address, "dev", "lo"]);
    }
    let mut lines = String::from("127.0.0.1 localhost\n::1 localhost\n");
    for (name, address) in hosts {
        lines.push_str(&format!("{address} {name}\n"));
    }
    let file = tempfile::NamedTempFile::new().expect("a hosts file");
    std::fs::write(file.path(), lines).expect("write the hosts file");
    run("mount", &["--bind", &file.path().display().to_string(), "/etc/hosts"]);
    Some(Isolated { _hosts: file })
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Uid:").map(|v| v.split_whitespace().nth(1) == Some("0"))))
        .unwrap_or(false)
}
