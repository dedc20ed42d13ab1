//! A network lab made of Linux network namespaces: one namespace per node
//! (a larder replica, a Garage node, the origin, the test's own clients),
//! each with one veth whose other end sits on a bridge in a switch
//! namespace of its own. Every address lives inside namespaces the lab
//! made (10.77.0.0/24); nothing is added to the machine's own namespace,
//! so no test packet can reach a real network. The lab deletes its
//! namespaces when dropped, also when a test fails, and removes those a
//! crashed earlier run left.
//!
//! ```ignore
//! let lab = Lab::new(&["r0", "r1", "origin", "client"]);   // needs root
//! let runtime = lab.runtime("client");    // threads whose sockets are in `client`
//! lab.partition("r0", &["r1"]);           // drop r0 <-> r1 (nft, both ways)
//! lab.slow("r1", "8mbit");                // tbf on both directions of r1's link
//! lab.heal_all();
//! ```
//!
//! Faults use what these machines have: `nft` rules inside a node's
//! namespace for partitions, `tc qdisc tbf` for slow links (no netem).

use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::Command;

/// The lab's addresses: node `i` is `10.77.0.(10 + i)`.
const SUBNET: [u8; 3] = [10, 77, 0];
/// Prefix of every namespace a lab makes; the pid follows, so a run can
/// tell its own namespaces from a dead run's.
const PREFIX: &str = "lchaos";

/// One node of the lab.
#[derive(Clone, Debug)]
pub struct Node {
    /// The short name the test uses (`r0`, `origin`).
    pub name: String,
    /// The namespace's name (`lchaos<pid>-r0`).
    pub ns: String,
    pub ip: Ipv4Addr,
    /// The veth end in the switch namespace.
    port: String,
}

/// The namespaces and links of one test; deleted on drop.
pub struct Lab {
    switch: String,
    nodes: Vec<Node>,
}

/// Runs `program args`, panicking with its output if it fails.
fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} (the chaos test needs iproute2 and nft, as root): {e}"));
    assert!(
        out.status.success(),
        "{program} {} failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Like [`run`], but a failure is only returned.
fn try_run(program: &str, args: &[&str]) -> bool {
    Command::new(program).args(args).output().is_ok_and(|o| o.status.success())
}

/// Deletes the namespaces earlier runs left behind (their pid is gone).
fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(rest) = name.strip_prefix(PREFIX) else { continue };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()) {
            try_run("ip", &["netns", "del", name]);
        }
    }
}

impl Lab {
    /// Makes a switch and one namespace per name, linked to it.
    pub fn new(names: &[&str]) -> Lab {
        remove_stale();
        let pid = std::process::id();
        let switch = format!("{PREFIX}{pid}-sw");
        let mut lab = Lab { switch: switch.clone(), nodes: Vec::new() };
        run("ip", &["netns", "add", &switch]);
        run("ip", &["-n", &switch, "link", "set", "lo", "up"]);
        run("ip", &["-n", &switch, "link", "add", "br0", "type", "bridge"]);
        run("ip", &["-n", &switch, "link", "set", "br0", "up"]);
        for (i, name) in names.iter().enumerate() {
            let ns = format!("{PREFIX}{pid}-{name}");
            let ip = Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], 10 + i as u8);
            let port = format!("p{i}");
            run("ip", &["netns", "add", &ns]);
            lab.nodes.push(Node { name: (*name).to_owned(), ns: ns.clone(), ip, port: port.clone() });
            run("ip", &["-n", &ns, "link", "set", "lo", "up"]);
            // Created inside the node's namespace with its peer placed in
            // the switch's: the machine's own namespace never sees it.
            run("ip", &["-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns", &switch]);
            run("ip", &["-n", &ns, "addr", "add", &format!("{ip}/24"), "dev", "eth0"]);
            run("ip", &["-n", &ns, "link", "set", "eth0", "up"]);
            run("ip", &["-n", &switch, "link", "set", &port, "master", "br0"]);
            run("ip", &["-n", &switch, "link", "set", &port, "up"]);
            // Room for the rules of `partition`.
            run("ip", &["netns", "exec", &ns, "nft", "add", "table", "inet", "chaos"]);
            for (chain, hook) in [("in", "input"), ("out", "output")] {
                let spec = format!("{{ type filter hook {hook} priority 0; }}");
                run("ip", &["netns", "exec", &ns, "nft", "add", "chain", "inet", "chaos", chain, &spec]);
            }
        }
        lab
    }

    pub fn node(&self, name: &str) -> &Node {
        self.nodes.iter().find(|n| n.name == name).unwrap_or_else(|| panic!("no node {name} in the lab"))
    }

    pub fn ip(&self, name: &str) -> Ipv4Addr {
        self.node(name).ip
    }

    pub fn ns(&self, name: &str) -> &str {
        &self.node(name).ns
    }

    /// A tokio runtime whose threads (workers and the blocking pool) live
    /// in `name`'s namespace: every socket a task opens is there.
    pub fn runtime(&self, name: &str) -> tokio::runtime::Runtime {
        let path = format!("/var/run/netns/{}", self.ns(name));
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .on_thread_start(move || enter(&path))
            .build()
            .expect("a runtime in the client namespace")
    }

    /// A TCP listener on `name`'s address, made in its namespace (it stays
    /// there whichever thread uses it).
    pub fn listener(&self, name: &str, port: u16) -> std::net::TcpListener {
        let (path, addr) = (format!("/var/run/netns/{}", self.ns(name)), (self.ip(name), port));
        std::thread::spawn(move || {
            enter(&path);
            let listener = std::net::TcpListener::bind(addr).expect("bind in the namespace");
            listener.set_nonblocking(true).expect("non-blocking");
            listener
        })
        .join()
        .expect("the namespace thread")
    }

    /// Drops every packet between `name` and each of `others` (both ways),
    /// silently: connections to them time out, as across a real partition.
    pub fn partition(&self, name: &str, others: &[&str]) {
        for other in others {
            let (a, b) = (self.node(name), self.node(other));
            for (node, peer) in [(a, b), (b, a)] {
                let ip = peer.ip.to_string();
                run(
                    "ip",
                    &[
                        "netns", "exec", &node.ns, "nft", "add", "rule", "inet", "chaos", "in", "ip", "saddr", &ip,
                        "drop",
                    ],
                );
                run(
                    "ip",
                    &[
                        "netns", "exec", &node.ns, "nft", "add", "rule", "inet", "chaos", "out", "ip", "daddr", &ip,
                        "drop",
                    ],
                );
            }
        }
    }

    /// Limits `name`'s link to `rate` (e.g. `8mbit`) in both directions.
    pub fn slow(&self, name: &str, rate: &str) {
        let node = self.node(name);
        let tbf = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "200ms"];
        let mut out = vec!["netns", "exec", &node.ns, "tc", "qdisc", "replace", "dev", "eth0"];
        out.extend(tbf);
        run("ip", &out);
        let mut back = vec!["netns", "exec", &self.switch, "tc", "qdisc", "replace", "dev", &node.port];
        back.extend(tbf);
        run("ip", &back);
    }

    /// Removes every partition rule and rate limit.
    pub fn heal_all(&self) {
        for node in &self.nodes {
            for chain in ["in", "out"] {
                run("ip", &["netns", "exec", &node.ns, "nft", "flush", "chain", "inet", "chaos", chain]);
            }
            try_run("ip", &["netns", "exec", &node.ns, "tc", "qdisc", "del", "dev", "eth0", "root"]);
            try_run("ip", &["netns", "exec", &self.switch, "tc", "qdisc", "del", "dev", &node.port, "root"]);
        }
    }

    /// `command` run inside `name`'s namespace (`ip netns exec`, which
    /// execs it: the child's pid is the command's).
    pub fn command(&self, name: &str, program: &std::path::Path) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", self.ns(name)]).arg(program);
        command
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for node in &self.nodes {
            try_run("ip", &["netns", "del", &node.ns]);
        }
        try_run("ip", &["netns", "del", &self.switch]);
    }
}

/// Moves the calling thread into the network namespace at `path`.
fn enter(path: &str) {
    let file = File::open(path).unwrap_or_else(|e| panic!("open {path}: {e}"));
    // SAFETY: setns on a valid namespace fd affects only the calling
    // thread's network namespace; the fd outlives the call.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns({path}): {}", std::io::Error::last_os_error());
}
