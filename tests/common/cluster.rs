//! A larder cluster for tests: replicas that are each other's peers
//! (`[cluster]` with a static peer list on free loopback ports and one
//! secret), optionally sharing a Garage bucket (`[shared]`), in front of
//! one upstream.
//!
//! ```ignore
//! let garage = Garage::builder().start().await;
//! let cluster = Cluster::builder(&origin).replicas(3).shared(&garage, "herd").start().await;
//! let owner = cluster.owner_of(&digest);            // the replica that fills it
//! let late = cluster.joining().await;               // a 4th, empty, that knows the 3
//! ```

use std::fmt::Write as _;

use larder::cluster::ring::Ring;
use tempfile::TempDir;

use super::garage::Garage;
use super::larder::{Larder, LarderBuilder, Upstream};
use super::metrics::ADMIN_LISTEN;
use super::tls_front::TestCa;
use super::tools::free_port;

/// The cluster secret every replica of a test cluster shares.
pub const SECRET: &str = "larder-test-cluster-secret";

/// Builds a [`Cluster`]; see the module docs.
pub struct ClusterBuilder {
    upstream: Upstream,
    /// More upstreams every replica has.
    more: Vec<Upstream>,
    replicas: usize,
    /// Serve the registry and peer listeners over TLS with this CA's leaf.
    tls: Option<TestCa>,
    /// The `[shared]` table, and the folder of the key files it names.
    shared: Option<(String, TempDir)>,
    customize: Vec<fn(LarderBuilder) -> LarderBuilder>,
    /// TOML every replica's config ends with.
    appended: Vec<String>,
}

/// Running replicas, each a [`Larder`] with an admin listener for `/metrics`.
pub struct Cluster {
    pub replicas: Vec<Larder>,
    /// `http://127.0.0.1:<peer port>` of each replica, in order.
    pub peer_urls: Vec<String>,
    upstream: Upstream,
    more: Vec<Upstream>,
    tls: Option<TestCa>,
    shared: Option<(String, TempDir)>,
    customize: Vec<fn(LarderBuilder) -> LarderBuilder>,
    appended: Vec<String>,
    dir: TempDir,
}

impl Cluster {
    pub fn builder(upstream: impl Into<Upstream>) -> ClusterBuilder {
        ClusterBuilder {
            upstream: upstream.into(),
            more: Vec::new(),
            replicas: 3,
            tls: None,
            shared: None,
            customize: Vec::new(),
            appended: Vec::new(),
        }
    }

    /// The index of the replica that owns `key` (a digest, or
    /// `upstream/repo:tag`) when every replica is up.
    pub fn owner_of(&self, key: &str) -> usize {
        let ring = Ring::new(self.peer_urls.iter().map(String::as_str));
        let owner = ring.owner(key).expect("a cluster has replicas");
        self.peer_urls.iter().position(|u| u == owner).expect("the owner is a replica")
    }

    /// Every replica's index, ranked for `key` as every replica ranks them
    /// when all are up: the owner first, then who takes over its keys.
    pub fn ranked(&self, key: &str) -> Vec<usize> {
        let ring = Ring::new(self.peer_urls.iter().map(String::as_str));
        let ranked = ring.ranked(key);
        ranked.into_iter().map(|u| self.peer_urls.iter().position(|p| p == u).expect("a replica")).collect()
    }

    /// An index other than `owner`.
    pub fn other_than(&self, owner: usize) -> usize {
        (owner + 1) % self.replicas.len()
    }

    /// Starts one more replica, with an empty disk, that knows every
    /// replica and itself as peers (the others are not told about it).
    pub async fn joining(&self) -> Larder {
        let port = free_port();
        let me = format!("http://127.0.0.1:{port}");
        let mut peers = self.peer_urls.clone();
        peers.push(me.clone());
        self.replica(port, &me, &peers).start().await
    }
}

impl ClusterBuilder {
    /// Another upstream every replica has.
    pub fn upstream(mut self, upstream: Upstream) -> Self {
        self.more.push(upstream);
        self
    }

    /// How many replicas (default 3).
    pub fn replicas(mut self, n: usize) -> Self {
        self.replicas = n;
        self
    }

    /// Share `garage`'s bucket, under key prefix `prefix`.
    pub fn shared(self, garage: &Garage, prefix: &str) -> Self {
        let endpoint = garage.endpoint();
        self.shared_at(garage, prefix, &endpoint)
    }

    /// Share `garage`'s bucket through another S3 endpoint (a proxy).
    pub fn shared_at(mut self, garage: &Garage, prefix: &str, endpoint: &str) -> Self {
        let dir = tempfile::Builder::new().prefix("larder-s3-keys-").tempdir().expect("a temp dir for S3 keys");
        let toml = garage.shared_toml_at(dir.path(), prefix, endpoint);
        self.shared = Some((toml, dir));
        self
    }

    /// A line for every replica's `[shared]` table (after [`Self::shared`]).
    pub fn shared_line(mut self, line: &str) -> Self {
        let (toml, _) = self.shared.as_mut().expect("call shared() first");
        toml.push_str(line);
        toml.push('\n');
        self
    }

    /// `https://` peers: every replica serves `[server.tls]` with `ca`'s
    /// leaf certificate (on 127.0.0.1) and verifies its peers with `ca`.
    pub fn https(mut self, ca: TestCa) -> Self {
        self.tls = Some(ca);
        self
    }

    /// Raw TOML every replica's config ends with (whole tables).
    pub fn append_toml(mut self, toml: &str) -> Self {
        self.appended.push(toml.to_owned());
        self
    }

    /// A change every replica's builder gets (extra config lines).
    pub fn each(mut self, f: fn(LarderBuilder) -> LarderBuilder) -> Self {
        self.customize.push(f);
        self
    }

    pub async fn start(self) -> Cluster {
        let dir = tempfile::Builder::new().prefix("larder-cluster-").tempdir().expect("a temp dir");
        std::fs::write(dir.path().join("secret"), SECRET).expect("write the cluster secret");
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let ports: Vec<u16> = (0..self.replicas).map(|_| free_port()).collect();
        let peer_urls: Vec<String> = ports.iter().map(|p| format!("{scheme}://127.0.0.1:{p}")).collect();
        let mut cluster = Cluster {
            replicas: Vec::new(),
            peer_urls,
            upstream: self.upstream,
            more: self.more,
            tls: self.tls,
            shared: self.shared,
            customize: self.customize,
            appended: self.appended,
            dir,
        };
        for (port, me) in ports.iter().zip(cluster.peer_urls.clone()) {
            let replica = cluster.replica(*port, &me, &cluster.peer_urls).start().await;
            cluster.replicas.push(replica);
        }
        cluster
    }
}

impl Cluster {
    /// The builder of one replica listening for peers on `port` as `me`.
    fn replica(&self, port: u16, me: &str, peers: &[String]) -> LarderBuilder {
        let dir = self.dir.path();
        let mut table = String::from("[cluster]\n");
        let _ = writeln!(table, "listen = \"127.0.0.1:{port}\"");
        let _ = writeln!(table, "self = {me:?}");
        let list: Vec<String> = peers.iter().map(|p| format!("{p:?}")).collect();
        let _ = writeln!(table, "peers = [{}]", list.join(", "));
        let _ = writeln!(table, "secret_file = {:?}", dir.join("secret").display().to_string());
        let mut builder = Larder::builder().upstream(self.upstream.clone()).server_line(ADMIN_LISTEN);
        for upstream in &self.more {
            builder = builder.upstream(upstream.clone());
        }
        if let Some(ca) = &self.tls {
            // The registry listener's certificate serves the peer listener
            // too; peers are verified with the test CA.
            let (cert, key) = ca.write_leaf(dir);
            let ca_file = ca.write_ca(dir);
            let (cert, key) = (cert.display().to_string(), key.display().to_string());
            builder = builder.server_line(&format!("tls = {{ cert = {cert:?}, key = {key:?} }}")).ready_on_tcp();
            let _ = writeln!(table, "ca_file = {:?}", ca_file.display().to_string());
        }
        builder = builder.append_toml(&table);
        if let Some((toml, _)) = &self.shared {
            builder = builder.append_toml(toml);
        }
        for toml in &self.appended {
            builder = builder.append_toml(toml);
        }
        self.customize.iter().fold(builder, |b, f| f(b))
    }
}
