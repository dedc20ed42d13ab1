//! A real Garage cluster (the shared tier's object store): three nodes on
//! 127.0.0.1, each with its own S3, RPC and admin port, `replication_factor
//! = 3`, lmdb with fsync off, config files mode 0600 (Garage refuses
//! world-readable secrets). The layout is assigned and applied, and one
//! bucket and one access key (read, write, owner) are created.
//!
//! ```ignore
//! let garage = Garage::builder().start().await;          // about a second
//! let store = SharedStore::new(&garage.shared_config("mirror"))?;
//! garage.kill(2);                                        // SIGKILL one node
//! garage.start_node(2).await;                            // and bring it back
//! garage.stop(1).await;                                  // SIGTERM, wait for exit
//! ```
//!
//! Clients talk to node 0's S3 port ([`Garage::endpoint`]); kill another node
//! to test a storage node failure. Every node is killed (by PID) on drop.
//! The binary comes from tests/run.sh, which installs Garage once into a
//! cache folder (`cargo install garage` with only the LMDB engine, at
//! opt-level 1: about 21 CPU-minutes).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::process::{self, LoggedChild};
use super::tools::free_port;

/// The Garage release tests/run.sh installs.
pub const GARAGE_VERSION: &str = "2.5.0";
/// The folder under `~/.cache/larder-tests` tests/run.sh installs it into
/// (the version and how it was built).
pub const GARAGE_FOLDER: &str = "garage-2.5.0-lmdb-o1";
/// The `s3_region` of the test cluster; clients must sign for it.
pub const REGION: &str = "garage";
/// How long the cluster may take to come up (or a node to rejoin).
pub const GARAGE_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between two tries of a CLI command while nodes connect.
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// How many log lines of each node a failing harness step prints.
const LOG_LINES_ON_FAILURE: usize = 60;

/// The Garage binary: `$LARDER_TEST_GARAGE`, else the cache folder
/// tests/run.sh installs into, else `garage` on `PATH`.
pub fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("LARDER_TEST_GARAGE") {
        return PathBuf::from(path);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
    if let Some(cache) = cache {
        let installed = cache.join(format!("larder-tests/{GARAGE_FOLDER}/bin/garage"));
        if installed.is_file() {
            return installed;
        }
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|dir| dir.join("garage")).find(|c| c.is_file()).unwrap_or_else(|| {
        panic!(
            "Garage {GARAGE_VERSION} is not installed; run tests/run.sh, which installs it \
             into ~/.cache/larder-tests/{GARAGE_FOLDER}"
        )
    })
}

/// Builds a Garage cluster; see the module docs.
#[derive(Clone, Debug)]
pub struct GarageBuilder {
    nodes: usize,
    bucket: String,
    /// Each node in its own network namespace, on its own address.
    netns: Option<Vec<(String, std::net::Ipv4Addr)>>,
}

impl Default for GarageBuilder {
    fn default() -> Self {
        GarageBuilder { nodes: 3, bucket: "larder-test".to_owned(), netns: None }
    }
}

impl GarageBuilder {
    /// Storage nodes (default 3, the replication factor; at least 3).
    pub fn nodes(mut self, nodes: usize) -> Self {
        assert!(nodes >= 3, "replication_factor = 3 needs at least 3 nodes");
        self.nodes = nodes;
        self
    }

    /// One node per `(namespace, address)`, each run with `ip netns exec`
    /// and listening on its address (S3 3900, RPC 3901, admin 3903); the
    /// test must reach those addresses (a runtime in a lab namespace).
    pub fn in_netns(mut self, places: Vec<(String, std::net::Ipv4Addr)>) -> Self {
        self.nodes = places.len();
        self.netns = Some(places);
        self
    }

    /// The bucket to create (default `larder-test`).
    pub fn bucket(mut self, bucket: &str) -> Self {
        self.bucket = bucket.to_owned();
        self
    }

    /// Starts the nodes, connects them, applies the layout, creates the
    /// bucket and key, and waits until every node reports a healthy cluster.
    pub async fn start(self) -> Garage {
        let started = Instant::now();
        let dir = tempfile::Builder::new()
            .prefix("larder-garage-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create the Garage temp dir: {e}"));
        let rpc_secret = hex::encode(rand::random::<[u8; 32]>());
        let mut nodes = Vec::with_capacity(self.nodes);
        for index in 0..self.nodes {
            let place = self.netns.as_ref().map(|places| places[index].clone());
            let node = Node::configure(dir.path(), index, &rpc_secret, place);
            nodes.push(node);
        }
        let mut garage = Garage {
            binary: binary(),
            nodes,
            bucket: self.bucket,
            access_key_id: format!("GK{}", hex::encode(rand::random::<[u8; 12]>())),
            secret_access_key: hex::encode(rand::random::<[u8; 32]>()),
            dir,
        };
        for index in 0..garage.nodes.len() {
            garage.spawn(index);
        }
        for index in 0..garage.nodes.len() {
            let id = garage.cli_retry(index, &["node", "id", "-q"]).await;
            garage.nodes[index].id = id.trim().to_owned();
        }
        let first = garage.nodes[0].id.clone();
        for index in 1..garage.nodes.len() {
            let id = garage.nodes[index].id.clone();
            garage.cli_retry(0, &["node", "connect", &id]).await;
        }
        for index in 0..garage.nodes.len() {
            let short = garage.nodes[index].short_id().to_owned();
            let zone = format!("z{}", index + 1);
            garage.cli_retry(0, &["layout", "assign", "-z", &zone, "-c", "1G", &short]).await;
        }
        garage.cli_retry(0, &["layout", "apply", "--version", "1"]).await;
        let bucket = garage.bucket.clone();
        let (key_id, secret) = (garage.access_key_id.clone(), garage.secret_access_key.clone());
        garage.cli_retry(0, &["bucket", "create", &bucket]).await;
        garage.cli_retry(0, &["key", "import", "--yes", "-n", "larder", &key_id, &secret]).await;
        garage.cli_retry(0, &["bucket", "allow", "--read", "--write", "--owner", &bucket, "--key", "larder"]).await;
        for index in 0..garage.nodes.len() {
            garage.wait_healthy(index).await;
        }
        eprintln!(
            "garage: {}-node cluster ready in {:?} (node ids from {first:.16})",
            garage.nodes.len(),
            started.elapsed()
        );
        garage
    }
}

/// One storage node's files and ports.
struct Node {
    index: usize,
    config_path: PathBuf,
    log_path: PathBuf,
    s3_port: u16,
    admin_port: u16,
    /// The address it listens on: 127.0.0.1, or its own in `netns`.
    host: String,
    /// The network namespace it runs in, if not the test's own.
    netns: Option<String>,
    /// `<hex id>@127.0.0.1:<rpc port>`, once known.
    id: String,
    process: Option<LoggedChild>,
}

impl Node {
    fn configure(root: &Path, index: usize, rpc_secret: &str, place: Option<(String, std::net::Ipv4Addr)>) -> Node {
        let dir = root.join(format!("node{index}"));
        for sub in ["meta", "data"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        }
        let (s3_port, rpc_port, admin_port) = match place {
            Some(_) => (3900, 3901, 3903),
            None => (free_port(), free_port(), free_port()),
        };
        let host = place.as_ref().map_or_else(|| "127.0.0.1".to_owned(), |(_, ip)| ip.to_string());
        let mut toml = String::new();
        let _ = writeln!(toml, "metadata_dir = {:?}", dir.join("meta").display().to_string());
        let _ = writeln!(toml, "data_dir = {:?}", dir.join("data").display().to_string());
        let _ = writeln!(toml, "db_engine = \"lmdb\"");
        let _ = writeln!(toml, "metadata_fsync = false");
        let _ = writeln!(toml, "data_fsync = false");
        let _ = writeln!(toml, "replication_factor = 3");
        let _ = writeln!(toml, "rpc_bind_addr = \"{host}:{rpc_port}\"");
        let _ = writeln!(toml, "rpc_public_addr = \"{host}:{rpc_port}\"");
        let _ = writeln!(toml, "rpc_secret = \"{rpc_secret}\"");
        let _ = writeln!(toml, "\n[s3_api]\ns3_region = \"{REGION}\"\napi_bind_addr = \"{host}:{s3_port}\"");
        let _ = writeln!(toml, "\n[admin]\napi_bind_addr = \"{host}:{admin_port}\"");
        let config_path = dir.join("garage.toml");
        write_private(&config_path, &toml);
        Node {
            index,
            config_path,
            log_path: dir.join("garage.log"),
            s3_port,
            admin_port,
            host,
            netns: place.map(|(ns, _)| ns),
            id: String::new(),
            process: None,
        }
    }

    /// `binary`, run in this node's namespace if it has one.
    fn command(&self, binary: &Path) -> Command {
        match &self.netns {
            Some(ns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", ns]).arg(binary);
                command
            }
            None => Command::new(binary),
        }
    }

    /// The hex node id without the address (what `layout assign` takes).
    fn short_id(&self) -> &str {
        self.id.split('@').next().unwrap_or(&self.id)
    }
}

/// Writes a file readable by its owner only.
fn write_private(path: &Path, text: &str) {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
    std::io::Write::write_all(&mut file, text.as_bytes())
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

/// A running Garage cluster; every node is killed (by PID) on drop.
pub struct Garage {
    binary: PathBuf,
    nodes: Vec<Node>,
    bucket: String,
    access_key_id: String,
    secret_access_key: String,
    // Last, so the processes are killed before their files are removed.
    dir: TempDir,
}

impl Garage {
    pub fn builder() -> GarageBuilder {
        GarageBuilder::default()
    }

    /// Node 0's S3 endpoint, `http://127.0.0.1:<port>` (or its address in
    /// its namespace): what clients use.
    pub fn endpoint(&self) -> String {
        self.s3_url(0)
    }

    /// Node `index`'s S3 endpoint.
    pub fn s3_url(&self, index: usize) -> String {
        format!("http://{}:{}", self.nodes[index].host, self.nodes[index].s3_port)
    }

    /// Node `index`'s S3 address.
    pub fn s3_addr(&self, index: usize) -> std::net::SocketAddr {
        let host: std::net::IpAddr = self.nodes[index].host.parse().expect("an IP address");
        std::net::SocketAddr::new(host, self.nodes[index].s3_port)
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    pub fn region(&self) -> &str {
        REGION
    }

    pub fn access_key_id(&self) -> &str {
        &self.access_key_id
    }

    pub fn secret_access_key(&self) -> &str {
        &self.secret_access_key
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// `[shared]` settings for larder's library, under key prefix `prefix`.
    pub fn shared_config(&self, prefix: &str) -> larder::config::SharedConfig {
        larder::config::SharedConfig {
            bucket: self.bucket.clone(),
            prefix: prefix.to_owned(),
            endpoint: Some(self.endpoint()),
            region: REGION.to_owned(),
            credentials: larder::config::SharedCredentials::Static {
                access_key_id: larder::config::Secret::new(self.access_key_id.clone()),
                secret_access_key: larder::config::Secret::new(self.secret_access_key.clone()),
                session_token: None,
            },
            max_age: None,
        }
    }

    /// A `[shared]` table for a larder config file under key prefix
    /// `prefix`; the key files are written into `dir` (mode 0600).
    pub fn shared_toml(&self, dir: &Path, prefix: &str) -> String {
        self.shared_toml_at(dir, prefix, &self.endpoint())
    }

    /// [`Garage::shared_toml`] with another S3 endpoint (a proxy in front
    /// of node 0).
    pub fn shared_toml_at(&self, dir: &Path, prefix: &str, endpoint: &str) -> String {
        let id_file = dir.join("s3-access-key-id");
        let secret_file = dir.join("s3-secret-access-key");
        write_private(&id_file, &self.access_key_id);
        write_private(&secret_file, &self.secret_access_key);
        let url =
            if prefix.is_empty() { format!("s3://{}", self.bucket) } else { format!("s3://{}/{prefix}", self.bucket) };
        format!(
            "[shared]\nurl = {url:?}\nendpoint = {:?}\nregion = {REGION:?}\naccess_key_id_file = {:?}\nsecret_access_key_file = {:?}\n",
            endpoint,
            id_file.display().to_string(),
            secret_file.display().to_string(),
        )
    }

    /// Kills node `index` (SIGKILL, by PID): a storage node failure.
    pub fn kill(&mut self, index: usize) {
        let node = &mut self.nodes[index];
        if let Some(mut process) = node.process.take() {
            process.write_log_marker("killing node");
            process.kill();
        }
    }

    /// Stops node `index` gracefully (SIGTERM, by PID) and waits for it to
    /// exit; killed if it takes longer than [`GARAGE_READY_TIMEOUT`].
    pub async fn stop(&mut self, index: usize) {
        let Some(mut process) = self.nodes[index].process.take() else { return };
        process.write_log_marker("stopping node (SIGTERM)");
        if let Some(pid) = process.pid() {
            let _ = Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
        }
        let started = Instant::now();
        while process.exit_status().is_none() && started.elapsed() < GARAGE_READY_TIMEOUT {
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        process.kill();
    }

    /// Kills every node: the shared tier is gone.
    pub fn kill_all(&mut self) {
        for index in 0..self.nodes.len() {
            self.kill(index);
        }
    }

    /// Whether node `index` is running under this harness.
    pub fn is_running(&mut self, index: usize) -> bool {
        self.nodes[index].process.as_mut().is_some_and(|p| p.exit_status().is_none())
    }

    /// Starts a killed node again on its config and data, and waits until
    /// every running node reports a healthy cluster.
    pub async fn start_node(&mut self, index: usize) {
        assert!(self.nodes[index].process.is_none(), "node {index} is already running");
        self.spawn(index);
        self.cli_retry(index, &["node", "id", "-q"]).await;
        // The others back off before redialing a node that died, and the
        // node may not have saved its peer list: dial them from here.
        for other in 0..self.nodes.len() {
            if other != index && self.nodes[other].process.is_some() {
                let id = self.nodes[other].id.clone();
                self.cli_retry(index, &["node", "connect", &id]).await;
            }
        }
        for i in 0..self.nodes.len() {
            if self.nodes[i].process.is_some() {
                self.wait_healthy(i).await;
            }
        }
    }

    fn spawn(&mut self, index: usize) {
        let node = &mut self.nodes[index];
        let mut command = node.command(&self.binary);
        command.arg("-c").arg(&node.config_path).arg("server").env("RUST_LOG", "garage=info").env("NO_COLOR", "1");
        process::append_marker(&node.log_path, "starting node");
        node.process = Some(LoggedChild::spawn(&format!("garage node {index}"), command, &node.log_path));
    }

    /// Runs `garage -c <node's config> ARGS` until it succeeds (nodes take
    /// a moment to listen and to connect to each other); its stdout.
    async fn cli_retry(&mut self, index: usize, args: &[&str]) -> String {
        let started = Instant::now();
        loop {
            if let Some(process) = self.nodes[index].process.as_mut() {
                if let Some(status) = process.exit_status() {
                    self.fail(&format!("garage node {index} exited ({status}) during `garage {}`", args.join(" ")));
                }
            }
            let output = tokio::process::Command::from(self.nodes[index].command(&self.binary))
                .arg("-c")
                .arg(&self.nodes[index].config_path)
                .args(args)
                .env("NO_COLOR", "1")
                .output()
                .await
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.binary.display()));
            if output.status.success() {
                return String::from_utf8_lossy(&output.stdout).into_owned();
            }
            if started.elapsed() > GARAGE_READY_TIMEOUT {
                let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
                self.fail(&format!("`garage {}` kept failing: {stderr}", args.join(" ")));
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    /// Waits until node `index`'s admin `/health` answers 200: it sees
    /// quorum for every partition.
    async fn wait_healthy(&mut self, index: usize) {
        let url = format!("http://{}:{}/health", self.nodes[index].host, self.nodes[index].admin_port);
        let client = super::http::client();
        let started = Instant::now();
        loop {
            let last = match client.get(&url).send().await {
                Ok(r) if r.status() == 200 => return,
                Ok(r) => format!("status {}", r.status()),
                Err(e) => format!("error {e}"),
            };
            if started.elapsed() > GARAGE_READY_TIMEOUT {
                self.fail(&format!("garage node {index} not healthy within {GARAGE_READY_TIMEOUT:?} ({last})"));
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    /// Multipart uploads begun in the bucket and neither completed nor
    /// aborted (what `garage bucket info` reports).
    pub async fn incomplete_multipart_uploads(&self) -> u64 {
        let output = tokio::process::Command::from(self.nodes[0].command(&self.binary))
            .arg("-c")
            .arg(&self.nodes[0].config_path)
            .args(["bucket", "info", &self.bucket])
            .env("NO_COLOR", "1")
            .output()
            .await
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.binary.display()));
        assert!(output.status.success(), "garage bucket info: {}", String::from_utf8_lossy(&output.stderr));
        let info = String::from_utf8_lossy(&output.stdout).into_owned();
        // Garage lists unfinished uploads only when there are some.
        let Some(line) = info.lines().find(|l| l.to_lowercase().contains("multipart")) else { return 0 };
        line.split(|c: char| !c.is_ascii_digit())
            .find(|w| !w.is_empty())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no count in {line:?}"))
    }

    /// Prints the last lines of every node's log.
    pub fn print_logs(&self) {
        for node in &self.nodes {
            eprintln!(
                "===== garage node {} log ({}) =====\n{}\n===== end =====",
                node.index,
                node.log_path.display(),
                process::tail(&process::read_lossy(&node.log_path), LOG_LINES_ON_FAILURE)
            );
        }
    }

    fn fail(&self, message: &str) -> ! {
        self.print_logs();
        panic!("{message} (Garage files in {})", self.dir.path().display());
    }
}

/// Writes `bytes` under `key` in `garage`'s bucket directly (bypassing
/// larder: to plant a corrupt object).
pub async fn put_object(garage: &Garage, key: &str, bytes: Vec<u8>) {
    use object_store::ObjectStoreExt as _;
    // object_store's TLS stack has no default crypto provider of its own.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let store = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(garage.endpoint())
        .with_allow_http(true)
        .with_region(REGION)
        .with_bucket_name(garage.bucket())
        .with_access_key_id(garage.access_key_id())
        .with_secret_access_key(garage.secret_access_key())
        .build()
        .unwrap_or_else(|e| panic!("an S3 client for Garage: {e}"));
    store
        .put(&object_store::path::Path::from(key), bytes.into())
        .await
        .unwrap_or_else(|e| panic!("PUT {key} into Garage: {e}"));
}

/// The size of the object under `key` in `garage`'s bucket, or `None` if
/// there is none (read directly, bypassing larder).
pub async fn object_size(garage: &Garage, key: &str) -> Option<u64> {
    use object_store::ObjectStoreExt as _;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let store = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(garage.endpoint())
        .with_allow_http(true)
        .with_region(REGION)
        .with_bucket_name(garage.bucket())
        .with_access_key_id(garage.access_key_id())
        .with_secret_access_key(garage.secret_access_key())
        .build()
        .unwrap_or_else(|e| panic!("an S3 client for Garage: {e}"));
    match store.head(&object_store::path::Path::from(key)).await {
        Ok(meta) => Some(meta.size),
        Err(object_store::Error::NotFound { .. }) => None,
        Err(e) => panic!("HEAD {key} in Garage: {e}"),
    }
}

/// The key of blob `digest` (`sha256:<hex>`) under `prefix`.
pub fn blob_key(prefix: &str, digest: &str) -> String {
    let hex = digest.strip_prefix("sha256:").unwrap_or_else(|| panic!("not a sha256 digest: {digest}"));
    format!("{prefix}/blobs/sha256/{hex}")
}
