//! The origin registry: a real CNCF distribution (`docker-registry serve`).
//!
//! Each `Origin` has its own temp dir (config, filesystem storage, log) and
//! port on 127.0.0.1. Its access log is how tests count what larder asked
//! upstream for:
//!
//! ```ignore
//! let mark = origin.log_mark().await;
//! // ... pull through larder ...
//! assert_eq!(origin.requests_since(&mark).await.blob_gets(), 0);
//! ```

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tempfile::TempDir;

use super::access_log::{self, AccessLog, AccessLogEntry, LogMark, SENTINEL_PARAM};
use super::http;
use super::process::LoggedChild;
use super::token_server::{Credentials, TokenServer};
use super::tools::{free_port, which};

/// The upstream name tests give the origin in larder's config (also its
/// token `service`): the `/v2/origin.test/<repo>/…` path prefix.
pub const ORIGIN_NAME: &str = "origin.test";

/// The token `issuer` distribution is configured to trust.
const TOKEN_ISSUER: &str = "larder-test-token-server";

/// How long the harness waits for its own sync request to reach the log.
const LOG_SYNC_TIMEOUT: Duration = Duration::from_secs(5);

/// A running distribution instance; killed (by PID) on drop.
pub struct Origin {
    port: u16,
    process: LoggedChild,
    token_server: Option<TokenServer>,
    credentials: Option<Credentials>,
    next_sentinel: AtomicU64,
    client: reqwest::Client,
    // Last, so the process is killed before its storage is removed.
    dir: TempDir,
}

impl Origin {
    /// An open registry: anyone may pull and push.
    pub async fn start() -> Origin {
        Self::launch(None).await
    }

    /// A registry behind token auth served by an in-process [`TokenServer`]:
    /// `private/…` needs `credentials`, everything else pulls anonymously,
    /// pushes need `credentials`.
    pub async fn with_token_auth(credentials: Credentials) -> Origin {
        let token_server = TokenServer::start(ORIGIN_NAME, TOKEN_ISSUER, credentials.clone());
        Self::launch(Some((token_server, credentials))).await
    }

    async fn launch(auth: Option<(TokenServer, Credentials)>) -> Origin {
        let binary = which("docker-registry");
        let dir = tempfile::Builder::new()
            .prefix("larder-origin-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create the origin temp dir: {e}"));
        let port = free_port();
        let (token_server, credentials) = auth.unzip();
        let config = config_yaml(dir.path(), port, token_server.as_ref());
        let config_path = dir.path().join("config.yml");
        std::fs::write(&config_path, config).unwrap_or_else(|e| panic!("cannot write {}: {e}", config_path.display()));

        let mut command = Command::new(binary);
        command.arg("serve").arg(&config_path);
        let mut process = LoggedChild::spawn("distribution (origin)", command, &dir.path().join("registry.log"));
        let ready_status = if token_server.is_some() { 401 } else { 200 };
        process.wait_ready(&format!("http://127.0.0.1:{port}/v2/"), ready_status).await;
        Origin {
            port,
            process,
            token_server,
            credentials,
            next_sentinel: AtomicU64::new(0),
            client: http::client(),
            dir,
        }
    }

    /// `http://127.0.0.1:<port>`, for larder's `[[upstream]] url`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:<port>`, for `docker://` references.
    pub fn host_port(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `docker://127.0.0.1:<port>/<repo_and_tag>`.
    pub fn image_ref(&self, repo_and_tag: &str) -> String {
        format!("docker://{}/{repo_and_tag}", self.host_port())
    }

    /// The token server, when started with [`Origin::with_token_auth`].
    pub fn token_server(&self) -> &TokenServer {
        self.token_server.as_ref().unwrap_or_else(|| panic!("this origin was started without token auth"))
    }

    /// The credentials pushes need (token-auth origins only).
    pub fn credentials(&self) -> Option<&Credentials> {
        self.credentials.as_ref()
    }

    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The origin's whole log (access log and its own logging).
    pub fn log(&self) -> String {
        self.process.log()
    }

    /// Every request logged so far. Requests that finished a moment ago may
    /// not be in it yet; [`Origin::log_mark`] and [`Origin::requests_since`]
    /// wait for them.
    pub fn access_log(&self) -> AccessLog {
        AccessLog::from_raw(access_log::parse_all(&self.log()))
    }

    /// Blob GETs logged so far (see [`Origin::access_log`]).
    pub fn blob_gets(&self) -> usize {
        self.access_log().blob_gets()
    }

    /// Manifest GETs and HEADs logged so far (see [`Origin::access_log`]).
    pub fn manifest_requests(&self) -> usize {
        self.access_log().manifest_requests().len()
    }

    /// The current end of the access log, after every request that finished
    /// before this call has been logged.
    pub async fn log_mark(&self) -> LogMark {
        LogMark(self.synced_entries().await.len())
    }

    /// The requests logged after `mark` (up to now, once logging caught up).
    pub async fn requests_since(&self, mark: &LogMark) -> AccessLog {
        let entries = self.synced_entries().await;
        AccessLog::from_raw(entries.into_iter().skip(mark.0))
    }

    /// Makes a sentinel request and waits until the log shows it: distribution
    /// logs a request after answering it, so without this a count taken right
    /// after a pull could miss the pull's last request. Returns the raw
    /// entries up to and including the sentinel.
    async fn synced_entries(&self) -> Vec<AccessLogEntry> {
        let n = self.next_sentinel.fetch_add(1, Ordering::Relaxed);
        let target = format!("/v2/?{SENTINEL_PARAM}={n}");
        let url = format!("{}{target}", self.url());
        // Any answer will do (401 behind token auth); it only has to be logged.
        if let Err(e) = self.client.get(&url).send().await {
            panic!("origin did not answer the log sync request {url}: {e}");
        }
        let started = Instant::now();
        loop {
            let entries = access_log::parse_all(&self.log());
            if let Some(position) = entries.iter().position(|entry| entry.target == target) {
                return entries[..=position].to_vec();
            }
            if started.elapsed() > LOG_SYNC_TIMEOUT {
                panic!(
                    "origin never logged the sync request {target} within {LOG_SYNC_TIMEOUT:?}; log tail:\n{}",
                    self.process.log_tail(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Fetches a manifest straight from the origin (not through larder), with
    /// a harness-minted token behind token auth. Returns the
    /// `Docker-Content-Digest`, `Content-Type` and body; panics on any error or
    /// when the body does not hash to the digest.
    pub async fn fetch_manifest(&self, repo: &str, reference: &str) -> FetchedManifest {
        let url = format!("{}/v2/{repo}/manifests/{reference}", self.url());
        let mut request = http::manifest_get(&self.client, &url);
        if let Some(token_server) = &self.token_server {
            let token = token_server.mint(&[(repo, &["pull"])]);
            request = request.bearer_auth(token);
        }
        let response = request.send().await.unwrap_or_else(|e| panic!("GET {url} from the origin failed: {e}"));
        let status = response.status();
        let header = |name: &str| response.headers().get(name).and_then(|value| value.to_str().ok()).map(str::to_owned);
        let digest = header("Docker-Content-Digest");
        let media_type = header("Content-Type");
        let body = response.bytes().await.unwrap_or_else(|e| panic!("reading GET {url} from the origin failed: {e}"));
        if status != 200 {
            panic!("GET {url} from the origin answered {status}: {}", String::from_utf8_lossy(&body));
        }
        let digest = digest.unwrap_or_else(|| panic!("GET {url}: no Docker-Content-Digest"));
        let computed = sha256_digest(&body);
        assert_eq!(digest, computed, "GET {url}: Docker-Content-Digest does not match the body");
        FetchedManifest {
            digest,
            media_type: media_type.unwrap_or_else(|| panic!("GET {url}: no Content-Type")),
            body: body.to_vec(),
        }
    }

    /// Pushes `bytes` as a blob of `repo` with the registry API (a
    /// monolithic upload); returns its digest. Not behind token auth.
    pub async fn push_blob(&self, repo: &str, bytes: &[u8]) -> String {
        let digest = sha256_digest(bytes);
        let start = format!("{}/v2/{repo}/blobs/uploads/", self.url());
        let resp = self.client.post(&start).send().await.unwrap_or_else(|e| panic!("POST {start}: {e}"));
        assert_eq!(resp.status(), 202, "POST {start}");
        let location = resp.headers()["location"].to_str().expect("an ASCII Location").to_owned();
        let location = if location.starts_with('/') { format!("{}{location}", self.url()) } else { location };
        let sep = if location.contains('?') { '&' } else { '?' };
        let put = format!("{location}{sep}digest={digest}");
        let resp = self.client.put(&put).body(bytes.to_vec()).send().await.unwrap_or_else(|e| panic!("PUT {put}: {e}"));
        assert_eq!(resp.status(), 201, "PUT {put}: {}", resp.text().await.unwrap_or_default());
        digest
    }

    /// Pushes `bytes` as a manifest of `repo` under `reference` (a tag or
    /// its digest) with `media_type`; returns its digest.
    pub async fn push_manifest(&self, repo: &str, reference: &str, media_type: &str, bytes: &[u8]) -> String {
        let url = format!("{}/v2/{repo}/manifests/{reference}", self.url());
        let resp = self
            .client
            .put(&url)
            .header("content-type", media_type)
            .body(bytes.to_vec())
            .send()
            .await
            .unwrap_or_else(|e| panic!("PUT {url}: {e}"));
        assert_eq!(resp.status(), 201, "PUT {url}: {}", resp.text().await.unwrap_or_default());
        sha256_digest(bytes)
    }

    /// Panics, with the log, if distribution is no longer running.
    pub fn assert_running(&mut self) {
        self.process.assert_running("while the test still needed it");
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.access_log();
            let shown = &log.entries()[log.len().saturating_sub(60)..];
            let mut text = String::new();
            for entry in shown {
                let _ = writeln!(text, "  {entry}");
            }
            eprintln!(
                "===== origin {} access log (last {} of {} requests) =====\n{text}===== end of origin access log =====",
                self.host_port(),
                shown.len(),
                log.len()
            );
        }
    }
}

/// A manifest as the origin serves it.
#[derive(Clone, Debug)]
pub struct FetchedManifest {
    pub digest: String,
    pub media_type: String,
    pub body: Vec<u8>,
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

fn config_yaml(dir: &Path, port: u16, token_server: Option<&TokenServer>) -> String {
    let storage = dir.join("storage");
    let mut yaml = format!(
        "version: 0.1
log:
  level: info
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
  secret: larder-test-origin-secret
",
        storage = storage.display()
    );
    if let Some(token_server) = token_server {
        let bundle = dir.join("token-cert.pem");
        std::fs::write(&bundle, token_server.cert_pem())
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", bundle.display()));
        let _ = write!(
            yaml,
            "auth:
  token:
    realm: {realm}
    service: {service}
    issuer: {issuer}
    rootcertbundle: {bundle}
",
            realm = token_server.realm(),
            service = token_server.service(),
            issuer = token_server.issuer(),
            bundle = bundle.display()
        );
    }
    yaml
}
