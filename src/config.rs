//! Configuration: raw serde structs (`deny_unknown_fields`) parsed from
//! TOML, then `validate()` into typed values. Every error names the file and
//! the key. Secrets are read here and kept in a redacting [`Secret`].

use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::time::Duration;

use regex::Regex;
use rustls::pki_types::ServerName;
use serde::Deserialize;

use crate::cluster::PeerUrl;

/// The configuration used when `larder` runs without `--config`.
pub const EMBEDDED_DEFAULT: &str = include_str!("../config/default.toml");
const EMBEDDED_NAME: &str = "<embedded default config>";

/// Default time in-flight responses get after SIGTERM; below Kubernetes'
/// default 30 s `terminationGracePeriodSeconds`, so larder exits on its own.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(25);
/// Default cap on open client connections of the registry listener: room
/// for a hub serving thousands of kubelets, each keeping a connection open.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16_384;
/// Largest `server.max_connections` accepted (each connection holds a
/// descriptor; Linux's default hard limit is 2^20).
pub const MAX_MAX_CONNECTIONS: usize = 1 << 20;
/// Default share of `max_size` above which eviction starts.
pub const DEFAULT_HIGH_WATERMARK: f64 = 0.95;
/// Default share of `max_size` eviction brings usage down to.
pub const DEFAULT_LOW_WATERMARK: f64 = 0.85;
/// Longest duration accepted anywhere in the config.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 86_400);
/// Longest duration text, and longest run of digits in it, accepted: with
/// these no sum of its parts can overflow while parsing.
const MAX_DURATION_TEXT: usize = 64;
const MAX_DURATION_DIGITS: usize = 10;
/// Largest `max_concurrency` accepted (tokio's semaphore has a limit, and
/// more open requests than this to one registry is a mistake).
pub const MAX_MAX_CONCURRENCY: usize = 65_536;
/// Default number of open upstream requests per upstream.
pub const DEFAULT_MAX_CONCURRENCY: usize = 32;
/// Default time allowed to establish an upstream connection (TCP + TLS).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default wait for upstream response headers. containerd gives up on a
/// mirror after 30 s without headers, so larder must answer well before.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(20);
/// Default longest pause between two chunks of an upstream body.
pub const DEFAULT_BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Most URLs one upstream may list in `urls` (a primary and its fallbacks):
/// each is tried in turn while the ones before it fail.
pub const MAX_UPSTREAM_URLS: usize = 8;
/// Longest `credential_helper` name (the program is `docker-credential-<name>`).
const MAX_HELPER_NAME: usize = 64;
/// Names that mean Docker Hub, where one-component repositories live under
/// `library/`.
const DOCKER_HUB_NAMES: [&str; 3] = ["docker.io", "index.docker.io", "registry-1.docker.io"];
/// Longest upstream timeout accepted (connect, response headers, body
/// idle). A client connection sees no byte while larder waits on upstream,
/// and the connection watchdog closes connections idle for longer than its
/// own limit: upstream waits must end first, so the client gets a 504
/// instead of a cut connection (checked against the watchdog at compile time).
pub const MAX_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(100);
/// Smallest `cache.max_size` accepted: below this every commit would
/// trigger an eviction of everything.
pub const MIN_MAX_SIZE: u64 = 1 << 20;
/// `cache.max_blob_size` when not set: this share of `max_size`.
pub const DEFAULT_MAX_BLOB_SIZE_DIVISOR: u64 = 4;
/// Shortest `[shared] max_age`: a sweep must never race the upload of a
/// blob a replica has just fetched.
pub const MIN_SHARED_MAX_AGE: Duration = Duration::from_secs(3600);
/// Default `[cluster] listen`: the peer listener, apart from the client port.
pub const DEFAULT_CLUSTER_LISTEN: &str = "0.0.0.0:5001";
/// Shortest cluster secret accepted: it is all that stands between the
/// peer listener and anyone who can reach it.
pub const MIN_CLUSTER_SECRET_LEN: usize = 16;

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub cache: CacheConfig,
    pub upstreams: Vec<UpstreamConfig>,
    pub log: LogConfig,
    pub admin: AdminConfig,
    /// The object store shared by all replicas (`[shared]`), if any.
    pub shared: Option<SharedConfig>,
    /// Peers and the cluster secret (`[cluster]`), if any.
    pub cluster: Option<ClusterConfig>,
}

/// `[shared]`: an S3-compatible bucket (and key prefix) that every replica
/// reads before going upstream and uploads verified content to.
#[derive(Debug, Clone)]
pub struct SharedConfig {
    /// The bucket, from `url = "s3://<bucket>/<prefix>"`.
    pub bucket: String,
    /// Key prefix without leading or trailing `/`; empty for the bucket root.
    pub prefix: String,
    /// `scheme://host[:port]` of an S3-compatible store; `None` for AWS S3.
    pub endpoint: Option<String>,
    /// Must equal the store's own region name (Garage: `s3_region`).
    pub region: String,
    /// How larder signs its requests to the store.
    pub credentials: SharedCredentials,
    /// Objects uploaded longer ago than this are deleted by a sweep; `None`
    /// leaves expiry to the bucket's lifecycle rules.
    pub max_age: Option<Duration>,
}

/// How the shared tier's requests are signed.
#[derive(Debug, Clone)]
pub enum SharedCredentials {
    /// Keys read once: `access_key_id_file` and `secret_access_key_file`,
    /// or `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` (with
    /// `AWS_SESSION_TOKEN` if set) from the environment, which a running
    /// process cannot see change.
    Static { access_key_id: Secret, secret_access_key: Secret, session_token: Option<Secret> },
    /// The AWS credential chain (`object_store`'s): web identity
    /// (`AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN`, as IRSA sets
    /// them), EKS Pod Identity or ECS container credentials
    /// (`AWS_CONTAINER_CREDENTIALS_*`), else the instance metadata service.
    /// Temporary credentials are fetched again before they expire, so
    /// rotating ones keep working.
    Chain,
}

/// `[cluster]`: this replica's peers and how they prove they are peers.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The peer listener; not part of the client-facing Service.
    pub listen: SocketAddr,
    /// How the other replicas reach this one (`self`, `${ENV}` expanded).
    pub self_url: PeerUrl,
    pub peers: PeerSource,
    /// Sent and checked on every peer request.
    pub secret: Secret,
    /// Extra CA certificates (PEM) trusted for https peers, beside the web
    /// PKI roots. Only with https peers (`self = "https://..."`): their
    /// peer listener serves TLS with `[server.tls]`'s certificate.
    pub ca_file: Option<PathBuf>,
    /// The one name every https peer's certificate is verified under (and
    /// sent as SNI), instead of the host of each peer's URL. Peers found by
    /// `peers_dns` or listed by pod IP have addresses no ordinary
    /// certificate names, and they all serve the same `[server.tls]`
    /// certificate: one fixed name on it (e.g. the peers' headless Service,
    /// `larder-peers.<namespace>.svc`) verifies every replica. `None`: each
    /// peer is verified against the host in its URL.
    pub tls_name: Option<ServerName<'static>>,
}

/// Where the member list comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerSource {
    /// `peers = [...]`, this replica included.
    Static(Vec<PeerUrl>),
    /// `peers_dns = "host:port"`, resolved again periodically; every
    /// address found is a peer at that port, with `self`'s scheme.
    Dns { name: String },
}

/// `[admin]`: who may use the admin listener's mutating endpoints.
#[derive(Debug, Clone, Default)]
pub struct AdminConfig {
    /// File holding the bearer token `POST /prefetch` and `/purge` need;
    /// re-read when it changes. Without it they are refused unless the
    /// admin listener is on a loopback address.
    pub token_file: Option<PathBuf>,
}

/// Shortest admin token accepted: long enough that guessing it over the
/// network is hopeless (`openssl rand -hex 32` gives 64 characters).
pub const MIN_ADMIN_TOKEN_LEN: usize = 16;

/// Parses the contents of an admin `token_file`: one line of at least
/// [`MIN_ADMIN_TOKEN_LEN`] visible ASCII characters (it travels in an HTTP
/// header); a trailing newline is ignored.
pub fn parse_admin_token(text: &str) -> Result<Secret, String> {
    let token = text.trim_end_matches(['\r', '\n']);
    if token.len() < MIN_ADMIN_TOKEN_LEN {
        return Err(format!("the token must be at least {MIN_ADMIN_TOKEN_LEN} characters long"));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the token must be one line of visible ASCII characters, without spaces".to_owned());
    }
    Ok(Secret::new(token))
}

#[derive(Debug, Clone)]
pub struct LogConfig {
    /// A `tracing` filter (`"info"`, `"warn,larder=debug"`); `RUST_LOG` wins.
    pub level: String,
    pub format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Default log filter: larder's own lines at info, other crates' warnings.
pub const DEFAULT_LOG_LEVEL: &str = "warn,larder=info";

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// `/metrics`, `/healthz`, `/readyz`; none when not configured.
    pub admin_listen: Option<SocketAddr>,
    /// After SIGTERM, how long in-flight responses, then the fills in flight, may take in all.
    pub shutdown_grace: Duration,
    /// Open client connections at most; further clients wait in the
    /// kernel's accept queue until one closes.
    pub max_connections: usize,
    /// Serve the registry API over TLS.
    pub tls: Option<TlsConfig>,
    /// Require HTTP Basic credentials from clients.
    pub auth: Option<ClientAuthConfig>,
    /// When cached blob bytes go out with sendfile (cleartext HTTP/1).
    pub sendfile: SendfileMode,
}

/// `server.sendfile`: which cleartext HTTP/1 clients get cached blob bytes
/// with `sendfile(2)` (see `crate::sendfile`) instead of read and written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SendfileMode {
    /// Clients on other hosts. A client on this host (loopback, or this
    /// host's own address) reads its bytes on the same CPUs, and there a
    /// sendfile costs that reader more than the copies save (benches/README.md).
    #[default]
    Auto,
    /// Every cleartext HTTP/1 client.
    Always,
    /// None: every blob is read and written.
    Never,
}

#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// PEM certificate chain and private key; re-read when they change.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Require client certificates signed by this CA (PEM).
    pub client_ca: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct ClientAuthConfig {
    /// htpasswd file with bcrypt hashes (`htpasswd -B`); re-read when it changes.
    pub htpasswd: PathBuf,
    /// Realm named in the `WWW-Authenticate: Basic` challenge.
    pub realm: String,
}

#[derive(Debug, Clone)]
pub struct CacheConfig {
    pub dir: PathBuf,
    /// Disk budget for cached content, in bytes.
    pub max_size: u64,
    /// Largest blob a fill may write when no manifest declared its size
    /// (an upstream streaming without `Content-Length` is cut off here).
    pub max_blob_size: u64,
    /// Share of `max_size` above which eviction starts.
    pub high_watermark: f64,
    /// Share of `max_size` eviction brings usage down to.
    pub low_watermark: f64,
    /// Memory budget of the in-memory manifest tier, in bytes.
    pub memory: u64,
    /// How long a tag → digest mapping is trusted before a `HEAD` revalidates it.
    pub tag_ttl: Duration,
    /// How long past its TTL a tag may still be served when upstream fails.
    pub stale_if_error: Duration,
}

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Lookup key for `?ns=` and the `/v2/<name>/…` path prefix.
    pub name: String,
    pub aliases: Vec<String>,
    /// Scheme and authority of the registry; larder only ever dials this
    /// (and `fallback_urls`), plus the token realms and redirect targets
    /// they name under the rules in `crate::upstream`.
    pub url: http::Uri,
    /// Further URLs from `urls = [primary, fallback…]`, tried in order when
    /// the ones before fail to connect or answer 5xx. They are the
    /// upstream's own origins, as trusted as `url`.
    pub fallback_urls: Vec<http::Uri>,
    /// Another larder (a cluster's hub) this upstream's requests go to
    /// instead, with `?ns=<name>`: node → hub → registry, one upstream
    /// fetch for the whole cluster. `url` is then never dialed.
    pub via: Option<http::Uri>,
    pub default: bool,
    /// Docker Hub keeps one-component names under `library/`.
    pub library_namespace: bool,
    /// Where the upstream's credentials come from; `None`: anonymous.
    pub credentials: Option<CredentialSource>,
    /// Token realms on other domains that may receive the upstream's
    /// credentials (`trusted_realms`): scheme, host and port must match, and
    /// the path too unless the entry has none.
    pub trusted_realms: Vec<http::Uri>,
    pub tag_ttl: Option<Duration>,
    pub immutable_tags: Vec<Regex>,
    /// Open upstream requests allowed at once; further requests wait in order.
    pub max_concurrency: NonZeroUsize,
    pub ca_file: Option<PathBuf>,
    pub connect_timeout: Duration,
    pub response_timeout: Duration,
    pub body_idle_timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: Secret,
}

/// Where an upstream's credentials come from.
#[derive(Debug, Clone)]
pub enum CredentialSource {
    /// `password` or `password_env`: fixed for the life of the process.
    Fixed(Credentials),
    /// `password_file`: read at load, and again whenever it changes
    /// (a Kubernetes Secret rotated under a running pod).
    File { username: String, path: PathBuf, loaded: Secret },
    /// `credential_helper = "NAME"`: `docker-credential-NAME get`, run
    /// again before its answer grows old or when upstream refuses it.
    Helper(String),
}

/// A secret string whose `Debug` and `Display` never show the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }
    /// The secret itself; call only where it is sent to its destination.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Read { file: String, source: std::io::Error },
    #[error("{file}: {message}")]
    Parse { file: String, message: String },
    #[error("{file}: `{key}`: {message}")]
    Invalid { file: String, key: String, message: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: Option<RawServer>,
    cache: Option<RawCache>,
    log: Option<RawLog>,
    admin: Option<RawAdmin>,
    #[serde(default)]
    upstream: Vec<RawUpstream>,
    shared: Option<RawShared>,
    cluster: Option<RawCluster>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawShared {
    url: String,
    endpoint: Option<String>,
    region: Option<String>,
    access_key_id_file: Option<String>,
    secret_access_key_file: Option<String>,
    max_age: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    listen: Option<String>,
    #[serde(rename = "self")]
    self_url: String,
    peers: Option<Vec<String>>,
    peers_dns: Option<String>,
    secret_file: String,
    ca_file: Option<String>,
    tls_name: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    token_file: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    admin_listen: Option<String>,
    shutdown_grace: Option<String>,
    max_connections: Option<usize>,
    tls: Option<RawTls>,
    auth: Option<RawAuth>,
    sendfile: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    cert: String,
    key: String,
    client_ca: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAuth {
    htpasswd: String,
    realm: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLog {
    level: Option<String>,
    format: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawCache {
    dir: Option<String>,
    max_size: Option<String>,
    max_blob_size: Option<String>,
    high_watermark: Option<f64>,
    low_watermark: Option<f64>,
    memory: Option<String>,
    tag_ttl: Option<String>,
    stale_if_error: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    name: String,
    url: Option<String>,
    urls: Option<Vec<String>>,
    via: Option<String>,
    #[serde(default)]
    default: bool,
    #[serde(default)]
    aliases: Vec<String>,
    library_namespace: Option<bool>,
    username: Option<String>,
    password: Option<String>,
    password_file: Option<String>,
    password_env: Option<String>,
    credential_helper: Option<String>,
    #[serde(default)]
    trusted_realms: Vec<String>,
    tag_ttl: Option<String>,
    #[serde(default)]
    immutable_tags: Vec<String>,
    max_concurrency: Option<usize>,
    ca_file: Option<String>,
    connect_timeout: Option<String>,
    response_timeout: Option<String>,
    body_idle_timeout: Option<String>,
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { file: file.clone(), source })?;
        Config::parse(&text, &file, path.parent())
    }

    /// The embedded default configuration.
    pub fn embedded_default() -> Result<Config, ConfigError> {
        Config::parse(EMBEDDED_DEFAULT, EMBEDDED_NAME, None)
    }

    /// Parses config text. `file` names it in errors; relative paths in it
    /// are resolved against `base_dir` (the file's folder) when given.
    pub fn parse(text: &str, file: &str, base_dir: Option<&Path>) -> Result<Config, ConfigError> {
        Config::parse_with_env(text, file, base_dir, &|name| std::env::var(name).ok())
    }

    /// As [`Config::parse`], reading environment variables (`password_env`,
    /// `AWS_*`, `${VAR}` in `[cluster]`) through `env` instead of the
    /// process environment.
    pub fn parse_with_env(
        text: &str,
        file: &str,
        base_dir: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let raw: RawConfig =
            toml::from_str(text).map_err(|e| ConfigError::Parse { file: file.to_owned(), message: e.to_string() })?;
        Validator { file, base_dir, env }.config(raw)
    }

    pub fn default_upstream(&self) -> Option<&UpstreamConfig> {
        self.upstreams.iter().find(|u| u.default)
    }
}

impl UpstreamConfig {
    pub fn tag_ttl(&self, cache: &CacheConfig) -> Duration {
        self.tag_ttl.unwrap_or(cache.tag_ttl)
    }

    /// Whether a tag matches one of the `immutable_tags` patterns.
    pub fn tag_is_immutable(&self, tag: &str) -> bool {
        self.immutable_tags.iter().any(|r| r.is_match(tag))
    }

    /// The host (and port) larder dials for this upstream.
    pub fn authority(&self) -> &str {
        self.url.authority().map(|a| a.as_str()).unwrap_or_default()
    }
}

struct Validator<'a> {
    file: &'a str,
    base_dir: Option<&'a Path>,
    env: &'a dyn Fn(&str) -> Option<String>,
}

impl Validator<'_> {
    fn err(&self, key: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid { file: self.file.to_owned(), key: key.into(), message: message.into() }
    }

    fn path(&self, p: &str) -> PathBuf {
        match self.base_dir {
            Some(base) if Path::new(p).is_relative() && !base.as_os_str().is_empty() => base.join(p),
            _ => PathBuf::from(p),
        }
    }

    fn duration(&self, key: &str, v: Option<&str>, default: Duration) -> Result<Duration, ConfigError> {
        let Some(s) = v else { return Ok(default) };
        // humantime panics on sums that overflow a Duration (found by
        // fuzzing): bound the text before parsing, and the value after, so
        // that durations can be added to each other anywhere.
        let digit_run_too_long = s.split(|c: char| !c.is_ascii_digit()).any(|run| run.len() > MAX_DURATION_DIGITS);
        if s.len() > MAX_DURATION_TEXT || digit_run_too_long {
            return Err(self.err(key, format!("{s:?} is far too long for a duration")));
        }
        let d = humantime::parse_duration(s)
            .map_err(|e| self.err(key, format!("{s:?} is not a duration like \"30s\", \"5m\" or \"7d\": {e}")))?;
        if d > MAX_DURATION {
            return Err(self.err(key, format!("{s:?} is longer than 100 years")));
        }
        Ok(d)
    }

    /// An upstream timeout: more than zero (zero fails every request) and
    /// at most [`MAX_UPSTREAM_TIMEOUT`].
    fn upstream_timeout(&self, key: &str, v: Option<&str>, default: Duration) -> Result<Duration, ConfigError> {
        let d = self.duration(key, v, default)?;
        if d.is_zero() || d > MAX_UPSTREAM_TIMEOUT {
            return Err(self.err(
                key,
                format!(
                    "must be more than 0s and at most {}s (clients are cut off by the connection idle limit \
                     beyond that)",
                    MAX_UPSTREAM_TIMEOUT.as_secs()
                ),
            ));
        }
        Ok(d)
    }

    fn size(&self, key: &str, v: Option<&str>, default: u64) -> Result<u64, ConfigError> {
        match v {
            None => Ok(default),
            Some(s) => s
                .parse::<bytesize::ByteSize>()
                .map(|b| b.as_u64())
                .map_err(|e| self.err(key, format!("{s:?} is not a size like \"256MiB\" or \"50GiB\": {e}"))),
        }
    }

    fn addr(&self, key: &str, v: &str) -> Result<SocketAddr, ConfigError> {
        v.parse().map_err(|_| self.err(key, format!("{v:?} is not an address like \"0.0.0.0:5000\"")))
    }

    fn readable(&self, key: &str, p: &str) -> Result<PathBuf, ConfigError> {
        let path = self.path(p);
        std::fs::File::open(&path).map_err(|e| self.err(key, format!("cannot read {}: {e}", path.display())))?;
        Ok(path)
    }

    fn tls(&self, t: &RawTls) -> Result<TlsConfig, ConfigError> {
        Ok(TlsConfig {
            cert: self.readable("server.tls.cert", &t.cert)?,
            key: self.readable("server.tls.key", &t.key)?,
            client_ca: t.client_ca.as_deref().map(|c| self.readable("server.tls.client_ca", c)).transpose()?,
        })
    }

    fn auth(&self, a: &RawAuth) -> Result<ClientAuthConfig, ConfigError> {
        let realm = a.realm.clone().unwrap_or_else(|| "larder".to_owned());
        if realm.is_empty() || realm.contains(['"', '\\']) || realm.chars().any(char::is_control) {
            return Err(
                self.err("server.auth.realm", "must be non-empty, without quotes, backslashes or control characters")
            );
        }
        Ok(ClientAuthConfig { htpasswd: self.readable("server.auth.htpasswd", &a.htpasswd)?, realm })
    }

    fn config(&self, raw: RawConfig) -> Result<Config, ConfigError> {
        let rs = raw.server.unwrap_or_default();
        let server = ServerConfig {
            listen: self.addr("server.listen", rs.listen.as_deref().unwrap_or("0.0.0.0:5000"))?,
            admin_listen: rs.admin_listen.as_deref().map(|a| self.addr("server.admin_listen", a)).transpose()?,
            shutdown_grace: self.duration(
                "server.shutdown_grace",
                rs.shutdown_grace.as_deref(),
                DEFAULT_SHUTDOWN_GRACE,
            )?,
            max_connections: match rs.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS) {
                n @ 1..=MAX_MAX_CONNECTIONS => n,
                _ => {
                    return Err(
                        self.err("server.max_connections", format!("must be between 1 and {MAX_MAX_CONNECTIONS}"))
                    );
                }
            },
            tls: rs.tls.as_ref().map(|t| self.tls(t)).transpose()?,
            auth: rs.auth.as_ref().map(|a| self.auth(a)).transpose()?,
            sendfile: match rs.sendfile.as_deref() {
                None | Some("auto") => SendfileMode::Auto,
                Some("always") => SendfileMode::Always,
                Some("never") => SendfileMode::Never,
                Some(other) => {
                    return Err(
                        self.err("server.sendfile", format!("{other:?} is not \"auto\", \"always\" or \"never\""))
                    );
                }
            },
        };
        let rc = raw.cache.unwrap_or_default();
        let max_size = self.size("cache.max_size", rc.max_size.as_deref(), 50 << 30)?;
        if max_size < MIN_MAX_SIZE {
            return Err(self.err("cache.max_size", format!("{max_size} bytes is less than the minimum of 1MiB")));
        }
        let max_blob_size =
            self.size("cache.max_blob_size", rc.max_blob_size.as_deref(), max_size / DEFAULT_MAX_BLOB_SIZE_DIVISOR)?;
        if max_blob_size == 0 || max_blob_size > max_size {
            return Err(self.err(
                "cache.max_blob_size",
                format!("must be more than 0 and at most cache.max_size ({max_size} bytes), not {max_blob_size}"),
            ));
        }
        let cache = CacheConfig {
            dir: self.path(rc.dir.as_deref().unwrap_or("./larder-data")),
            max_size,
            max_blob_size,
            high_watermark: rc.high_watermark.unwrap_or(DEFAULT_HIGH_WATERMARK),
            low_watermark: rc.low_watermark.unwrap_or(DEFAULT_LOW_WATERMARK),
            memory: self.size("cache.memory", rc.memory.as_deref(), 256 << 20)?,
            tag_ttl: self.duration("cache.tag_ttl", rc.tag_ttl.as_deref(), Duration::from_secs(300))?,
            stale_if_error: self.duration(
                "cache.stale_if_error",
                rc.stale_if_error.as_deref(),
                Duration::from_secs(7 * 86400),
            )?,
        };
        if !(0.0 < cache.low_watermark && cache.low_watermark < cache.high_watermark && cache.high_watermark <= 1.0) {
            return Err(self.err(
                "cache.high_watermark",
                format!(
                    "watermarks must satisfy 0 < low_watermark ({}) < high_watermark ({}) <= 1",
                    cache.low_watermark, cache.high_watermark
                ),
            ));
        }
        if raw.upstream.is_empty() {
            return Err(self.err("upstream", "at least one [[upstream]] is required"));
        }
        let upstreams =
            raw.upstream.into_iter().enumerate().map(|(i, u)| self.upstream(i, u)).collect::<Result<Vec<_>, _>>()?;

        let mut seen = std::collections::HashSet::new();
        for (i, u) in upstreams.iter().enumerate() {
            for key in std::iter::once(&u.name).chain(&u.aliases) {
                if !seen.insert(key.clone()) {
                    return Err(self.err(format!("upstream[{i}]"), format!("name or alias {key:?} is used twice")));
                }
            }
        }
        if upstreams.iter().filter(|u| u.default).count() > 1 {
            return Err(self.err("upstream.default", "only one upstream can be `default = true`"));
        }
        let rl = raw.log.unwrap_or_default();
        let level = rl.level.unwrap_or_else(|| DEFAULT_LOG_LEVEL.to_owned());
        crate::log_filter::LogFilter::parse(&level)
            .map_err(|e| self.err("log.level", format!("{level:?} is not a log filter like \"info\": {e}")))?;
        let format = match rl.format.as_deref() {
            None | Some("text") => LogFormat::Text,
            Some("json") => LogFormat::Json,
            Some(other) => return Err(self.err("log.format", format!("{other:?} is not \"text\" or \"json\""))),
        };
        let admin = self.admin(raw.admin.unwrap_or_default())?;
        let shared = raw.shared.map(|s| self.shared(s)).transpose()?;
        let cluster = raw.cluster.map(|c| self.cluster(c, &server)).transpose()?;
        Ok(Config { server, cache, upstreams, log: LogConfig { level, format }, admin, shared, cluster })
    }

    /// A secret read from a file: trailing line breaks and spaces dropped
    /// (files written by `echo` or a Kubernetes Secret), never empty.
    fn secret_file(&self, key: &str, p: &str) -> Result<Secret, ConfigError> {
        let path = self.path(p);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| self.err(key, format!("cannot read {}: {e}", path.display())))?;
        let value = text.trim_end();
        if value.is_empty() {
            return Err(self.err(key, format!("{} is empty", path.display())));
        }
        Ok(Secret::new(value))
    }

    /// Replaces each `${NAME}` in `v` with that environment variable.
    fn expand_env(&self, key: &str, v: &str) -> Result<String, ConfigError> {
        let mut out = String::with_capacity(v.len());
        let mut rest = v;
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let end = after.find('}').ok_or_else(|| self.err(key, format!("{v:?} has an unclosed `${{`")))?;
            let name = &after[..end];
            let name_ok = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !name_ok {
                return Err(self.err(key, format!("{name:?} is not an environment variable name")));
            }
            let value =
                (self.env)(name).ok_or_else(|| self.err(key, format!("environment variable {name} is not set")))?;
            out.push_str(&value);
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }

    fn shared(&self, s: RawShared) -> Result<SharedConfig, ConfigError> {
        // Split by hand: a URL parser would resolve `..` and percent-escapes
        // that must instead be refused.
        let rest = s
            .url
            .strip_prefix("s3://")
            .ok_or_else(|| self.err("shared.url", format!("{:?} must be an s3:// URL (s3://bucket/prefix)", s.url)))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if !valid_bucket(bucket) {
            return Err(self.err(
                "shared.url",
                format!("{bucket:?} is not a bucket name (3-63 lowercase letters, digits, dots and hyphens)"),
            ));
        }
        let (bucket, prefix) = (bucket.to_owned(), prefix.trim_end_matches('/').to_owned());
        let segment_ok = |seg: &str| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        };
        if !prefix.is_empty() && !prefix.split('/').all(segment_ok) {
            return Err(self.err(
                "shared.url",
                format!("prefix {prefix:?} must be /-separated segments of letters, digits, '.', '_' and '-'"),
            ));
        }
        let endpoint = s.endpoint.as_deref().map(|e| self.endpoint(e)).transpose()?;
        let region = match (&s.region, &endpoint) {
            (Some(r), _) => r.clone(),
            (None, None) => (self.env)("AWS_REGION").or_else(|| (self.env)("AWS_DEFAULT_REGION")).ok_or_else(|| {
                self.err("shared.region", "set the bucket's region (or AWS_REGION in the environment)")
            })?,
            (None, Some(_)) => {
                return Err(self.err(
                    "shared.region",
                    "set it to the store's own region name (Garage: `s3_region`, often \"garage\")",
                ));
            }
        };
        if region.is_empty() || !region.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(self.err("shared.region", format!("{region:?} is not a region name")));
        }
        let credentials = match (&s.access_key_id_file, &s.secret_access_key_file) {
            (Some(id), Some(secret)) => SharedCredentials::Static {
                access_key_id: self.secret_file("shared.access_key_id_file", id)?,
                secret_access_key: self.secret_file("shared.secret_access_key_file", secret)?,
                session_token: None,
            },
            (None, None) => {
                let var = |name: &str| (self.env)(name).filter(|v| !v.is_empty());
                let chain_source = ["AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"]
                    .iter()
                    .chain(&["AWS_CONTAINER_CREDENTIALS_FULL_URI"])
                    .any(|name| var(name).is_some());
                match (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
                    (Some(id), Some(secret)) => SharedCredentials::Static {
                        access_key_id: Secret::new(id),
                        secret_access_key: Secret::new(secret),
                        session_token: var("AWS_SESSION_TOKEN").map(Secret::new),
                    },
                    // A rotating source, or AWS itself (its instance
                    // metadata); an S3-compatible store needs one of them
                    // named or keys.
                    _ if chain_source || endpoint.is_none() => SharedCredentials::Chain,
                    _ => {
                        return Err(self.err(
                            "shared.access_key_id_file",
                            "set access_key_id_file and secret_access_key_file, or AWS_ACCESS_KEY_ID and \
                             AWS_SECRET_ACCESS_KEY (or a web identity, AWS_WEB_IDENTITY_TOKEN_FILE and \
                             AWS_ROLE_ARN) in the environment",
                        ));
                    }
                }
            }
            (Some(_), None) => {
                return Err(self.err("shared.secret_access_key_file", "needed with access_key_id_file"));
            }
            (None, Some(_)) => {
                return Err(self.err("shared.access_key_id_file", "needed with secret_access_key_file"));
            }
        };
        let max_age =
            s.max_age.as_deref().map(|a| self.duration("shared.max_age", Some(a), Duration::ZERO)).transpose()?;
        if let Some(age) = max_age {
            if age < MIN_SHARED_MAX_AGE {
                return Err(self.err(
                    "shared.max_age",
                    format!("must be at least {}", humantime::format_duration(MIN_SHARED_MAX_AGE)),
                ));
            }
        }
        Ok(SharedConfig { bucket, prefix, endpoint, region, credentials, max_age })
    }

    fn endpoint(&self, e: &str) -> Result<String, ConfigError> {
        let bad = || self.err("shared.endpoint", format!("{e:?} must be http(s)://host[:port] with no path"));
        let url = url::Url::parse(e).map_err(|_| bad())?;
        let ok = matches!(url.scheme(), "http" | "https")
            && url.host_str().is_some_and(|h| !h.is_empty())
            && url.username().is_empty()
            && url.password().is_none()
            && matches!(url.path(), "" | "/")
            && url.query().is_none()
            && url.fragment().is_none();
        if !ok {
            return Err(bad());
        }
        Ok(url.as_str().trim_end_matches('/').to_owned())
    }

    fn cluster(&self, c: RawCluster, server: &ServerConfig) -> Result<ClusterConfig, ConfigError> {
        let listen = self.addr("cluster.listen", c.listen.as_deref().unwrap_or(DEFAULT_CLUSTER_LISTEN))?;
        let clashes = |other: SocketAddr| {
            other.port() == listen.port()
                && (other.ip() == listen.ip() || other.ip().is_unspecified() || listen.ip().is_unspecified())
        };
        if clashes(server.listen) || server.admin_listen.is_some_and(clashes) {
            return Err(self.err("cluster.listen", format!("{listen} overlaps server.listen or server.admin_listen")));
        }
        let self_url =
            PeerUrl::parse(&self.expand_env("cluster.self", &c.self_url)?).map_err(|e| self.err("cluster.self", e))?;
        let peers = match (c.peers, c.peers_dns) {
            (Some(list), None) => {
                if list.is_empty() {
                    return Err(self.err("cluster.peers", "list every replica, this one included"));
                }
                let mut peers: Vec<PeerUrl> = Vec::with_capacity(list.len());
                for (i, p) in list.iter().enumerate() {
                    let key = format!("cluster.peers[{i}]");
                    let peer = PeerUrl::parse(&self.expand_env(&key, p)?).map_err(|e| self.err(&key, e))?;
                    if peer.is_https() != self_url.is_https() {
                        return Err(
                            self.err(&key, format!("{peer} does not use the scheme of cluster.self ({self_url})"))
                        );
                    }
                    if peers.contains(&peer) {
                        return Err(self.err(&key, format!("{peer} is listed twice")));
                    }
                    peers.push(peer);
                }
                if !peers.contains(&self_url) {
                    return Err(self.err(
                        "cluster.self",
                        format!("{self_url} is not in cluster.peers: list every replica, this one included"),
                    ));
                }
                PeerSource::Static(peers)
            }
            (None, Some(name)) => {
                let name = self.expand_env("cluster.peers_dns", &name)?;
                // Without a port, peers listen where this replica does.
                let self_port = || self_url.authority().rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok());
                let (host, port) = match name.rsplit_once(':') {
                    Some((host, port)) => (host, port.parse::<u16>().ok().filter(|p| *p > 0)),
                    None => (name.as_str(), self_port()),
                };
                let port = port.ok_or_else(|| self.err("cluster.peers_dns", format!("{name:?} has a bad port")))?;
                if !valid_host(host) {
                    return Err(self.err("cluster.peers_dns", format!("{host:?} is not a DNS name")));
                }
                PeerSource::Dns { name: format!("{host}:{port}") }
            }
            (Some(_), Some(_)) => return Err(self.err("cluster.peers", "set either peers or peers_dns, not both")),
            (None, None) => return Err(self.err("cluster.peers", "set peers (a list) or peers_dns (a DNS name)")),
        };
        let secret = self.secret_file("cluster.secret_file", &c.secret_file)?;
        if secret.expose().chars().count() < MIN_CLUSTER_SECRET_LEN {
            return Err(self.err(
                "cluster.secret_file",
                format!(
                    "the secret must be at least {MIN_CLUSTER_SECRET_LEN} characters (e.g. `openssl rand -hex 32`)"
                ),
            ));
        }
        // The scheme of `self` (and so of every peer) says whether peers
        // talk TLS; https peers serve `[server.tls]`'s certificate on the
        // peer listener, so they need it. http peers with `[server.tls]`
        // stay allowed: a service mesh may already encrypt pod traffic.
        if self_url.is_https() && server.tls.is_none() {
            return Err(
                self.err("cluster.self", "https peers need [server.tls]: its certificate serves the peer listener")
            );
        }
        let plain = |key: &str| {
            self.err(key, format!("only for https peers, and cluster.self is {self_url}: peers talk plain http"))
        };
        let ca_file = match c.ca_file.as_deref() {
            Some(_) if !self_url.is_https() => return Err(plain("cluster.ca_file")),
            Some(f) => Some(self.readable("cluster.ca_file", f)?),
            None => None,
        };
        let tls_name = match c.tls_name.as_deref() {
            Some(_) if !self_url.is_https() => return Err(plain("cluster.tls_name")),
            Some(name) => Some(self.peer_tls_name(name)?),
            None => None,
        };
        Ok(ClusterConfig { listen, self_url, peers, secret, ca_file, tls_name })
    }

    /// `cluster.tls_name`: a DNS name (`${ENV}` expanded, lowercased), not
    /// an address, a port or a wildcard: it is what the certificate names.
    fn peer_tls_name(&self, raw: &str) -> Result<ServerName<'static>, ConfigError> {
        let key = "cluster.tls_name";
        let name = self.expand_env(key, raw)?.to_ascii_lowercase();
        if name.parse::<std::net::IpAddr>().is_ok() {
            return Err(self.err(
                key,
                format!("{name:?} is an address: leave tls_name out to verify each peer against its URL's host"),
            ));
        }
        if name.contains(':') || !valid_host(&name) {
            return Err(self.err(
                key,
                format!("{name:?} is not a DNS name like \"larder-peers.mirror.svc\" (no port, scheme or wildcard)"),
            ));
        }
        ServerName::try_from(name.clone()).map_err(|e| self.err(key, format!("{name:?}: {e}")))
    }

    fn admin(&self, raw: RawAdmin) -> Result<AdminConfig, ConfigError> {
        let Some(file) = raw.token_file else { return Ok(AdminConfig::default()) };
        let path = self.path(&file);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| self.err("admin.token_file", format!("cannot read {}: {e}", path.display())))?;
        parse_admin_token(&text).map_err(|e| self.err("admin.token_file", format!("{}: {e}", path.display())))?;
        Ok(AdminConfig { token_file: Some(path) })
    }

    fn upstream(&self, i: usize, u: RawUpstream) -> Result<UpstreamConfig, ConfigError> {
        let key = |k: &str| format!("upstream[{i}].{k}");
        for (k, host) in std::iter::once(("name", &u.name)).chain(u.aliases.iter().map(|a| ("aliases", a))) {
            if !valid_host(host) {
                return Err(self.err(key(k), format!("{host:?} is not a registry host name like \"ghcr.io\"")));
            }
        }
        let (url, fallback_urls) = self.upstream_urls(&key, u.url.as_deref(), u.urls.as_deref())?;
        let via = match u.via.as_deref() {
            None => None,
            Some(text) => {
                let (via, more) = self.upstream_urls(&|_| key("via"), Some(text), None)?;
                debug_assert!(more.is_empty());
                if !fallback_urls.is_empty() {
                    return Err(self.err(key("via"), "`via` sends every request to one larder: drop `urls`"));
                }
                Some(via)
            }
        };
        let is_docker_hub = |h: &str| DOCKER_HUB_NAMES.contains(&h);
        let host = url.host().unwrap_or_default().to_ascii_lowercase();
        // Docker Hub by its name or an alias as much as by its URL: users
        // point `docker.io` at mirror.gcr.io or a corporate Hub mirror.
        let library_namespace = u
            .library_namespace
            .unwrap_or(is_docker_hub(&host) || is_docker_hub(&u.name) || u.aliases.iter().any(|a| is_docker_hub(a)));
        let credentials = self.credentials(&key, &u)?;
        let trusted_realms = u
            .trusted_realms
            .iter()
            .enumerate()
            .map(|(j, r)| self.trusted_realm(&format!("upstream[{i}].trusted_realms[{j}]"), r, &url))
            .collect::<Result<Vec<_>, _>>()?;

        let immutable_tags = u
            .immutable_tags
            .iter()
            .enumerate()
            .map(|(j, p)| {
                Regex::new(p).map_err(|e| self.err(format!("upstream[{i}].immutable_tags[{j}]"), e.to_string()))
            })
            .collect::<Result<_, _>>()?;
        let max_concurrency = NonZeroUsize::new(u.max_concurrency.unwrap_or(DEFAULT_MAX_CONCURRENCY))
            .filter(|n| n.get() <= MAX_MAX_CONCURRENCY)
            .ok_or_else(|| self.err(key("max_concurrency"), format!("must be between 1 and {MAX_MAX_CONCURRENCY}")))?;
        let ca_file = u.ca_file.as_deref().map(|f| self.path(f));
        if let Some(ca) = &ca_file {
            if !ca.is_file() {
                return Err(self.err(key("ca_file"), format!("{} is not a readable file", ca.display())));
            }
        }
        Ok(UpstreamConfig {
            name: u.name,
            aliases: u.aliases,
            url,
            fallback_urls,
            via,
            default: u.default,
            library_namespace,
            credentials,
            trusted_realms,
            tag_ttl: u
                .tag_ttl
                .as_deref()
                .map(|t| self.duration(&key("tag_ttl"), Some(t), Duration::ZERO))
                .transpose()?,
            immutable_tags,
            max_concurrency,
            ca_file,
            connect_timeout: self.upstream_timeout(
                &key("connect_timeout"),
                u.connect_timeout.as_deref(),
                DEFAULT_CONNECT_TIMEOUT,
            )?,
            response_timeout: self.upstream_timeout(
                &key("response_timeout"),
                u.response_timeout.as_deref(),
                DEFAULT_RESPONSE_TIMEOUT,
            )?,
            body_idle_timeout: self.upstream_timeout(
                &key("body_idle_timeout"),
                u.body_idle_timeout.as_deref(),
                DEFAULT_BODY_IDLE_TIMEOUT,
            )?,
        })
    }
}

/// An S3 bucket name: 3-63 lowercase letters, digits, dots and hyphens,
/// starting and ending with a letter or digit.
fn valid_bucket(s: &str) -> bool {
    (3..=63).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

impl Validator<'_> {
    /// `url`, or `urls = [primary, fallback…]`: exactly one of the two.
    fn upstream_urls(
        &self,
        key: &dyn Fn(&str) -> String,
        url: Option<&str>,
        urls: Option<&[String]>,
    ) -> Result<(http::Uri, Vec<http::Uri>), ConfigError> {
        let (k, list): (String, Vec<&str>) = match (url, urls) {
            (Some(u), None) => (key("url"), vec![u]),
            (None, Some(list)) => (key("urls"), list.iter().map(String::as_str).collect()),
            (None, None) => return Err(self.err(key("url"), "required (or `urls` for a primary and fallbacks)")),
            (Some(_), Some(_)) => return Err(self.err(key("urls"), "set either `url` or `urls`, not both")),
        };
        if list.is_empty() || list.len() > MAX_UPSTREAM_URLS {
            return Err(self.err(k, format!("must list between 1 and {MAX_UPSTREAM_URLS} URLs")));
        }
        let mut parsed: Vec<http::Uri> = Vec::with_capacity(list.len());
        for text in list {
            let uri: http::Uri = text.parse().map_err(|e| self.err(&k, format!("{text:?} is not a URL: {e}")))?;
            let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
            let path_ok = matches!(uri.path(), "" | "/") && uri.query().is_none();
            let userinfo = uri.authority().is_some_and(|a| a.as_str().contains('@'));
            if !scheme_ok || uri.authority().is_none() || !path_ok || userinfo {
                return Err(self.err(&k, format!("{text:?} must be http(s)://host[:port] with no path")));
            }
            if parsed.iter().any(|p| p.scheme() == uri.scheme() && p.authority() == uri.authority()) {
                return Err(self.err(&k, format!("{text:?} is listed twice")));
            }
            parsed.push(uri);
        }
        let primary = parsed.remove(0);
        Ok((primary, parsed))
    }

    /// The upstream's credential source: a username with exactly one
    /// password source, or a credential helper, or nothing.
    fn credentials(
        &self,
        key: &dyn Fn(&str) -> String,
        u: &RawUpstream,
    ) -> Result<Option<CredentialSource>, ConfigError> {
        if let Some(name) = &u.credential_helper {
            let valid = !name.is_empty()
                && name.len() <= MAX_HELPER_NAME
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
                && !name.starts_with(['.', '-']);
            if !valid {
                return Err(self.err(
                    key("credential_helper"),
                    format!("{name:?} is not a helper name like \"ecr-login\" (runs docker-credential-<name>)"),
                ));
            }
            if u.username.is_some() || u.password.is_some() || u.password_file.is_some() || u.password_env.is_some() {
                return Err(self.err(
                    key("credential_helper"),
                    "set either credential_helper or a username and password, not both",
                ));
            }
            return Ok(Some(CredentialSource::Helper(name.clone())));
        }
        let source = match (&u.password, &u.password_file, &u.password_env) {
            (None, None, None) => None,
            (Some(p), None, None) => Some(Err(Secret::new(p.clone()))),
            (None, Some(f), None) => {
                let path = self.path(f);
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| self.err(key("password_file"), format!("cannot read {}: {e}", path.display())))?;
                Some(Ok((path, Secret::new(text.trim_end_matches(['\r', '\n'])))))
            }
            (None, None, Some(var)) => Some(Err(Secret::new(
                (self.env)(var)
                    .ok_or_else(|| self.err(key("password_env"), format!("environment variable {var} is not set")))?,
            ))),
            _ => {
                return Err(self.err(key("password"), "set only one of password, password_file, password_env"));
            }
        };
        match (u.username.clone(), source) {
            (None, None) => Ok(None),
            (Some(username), Some(Err(password))) => {
                Ok(Some(CredentialSource::Fixed(Credentials { username, password })))
            }
            (Some(username), Some(Ok((path, loaded)))) => Ok(Some(CredentialSource::File { username, path, loaded })),
            (Some(_), None) => Err(self.err(key("username"), "a username needs a password source")),
            (None, Some(_)) => Err(self.err(key("password"), "a password needs a username")),
        }
    }

    /// One `trusted_realms` entry: an absolute http(s) URL, https unless
    /// the upstream itself is http, without userinfo or query.
    fn trusted_realm(&self, key: &str, text: &str, upstream: &http::Uri) -> Result<http::Uri, ConfigError> {
        let uri: http::Uri = text.parse().map_err(|e| self.err(key, format!("{text:?} is not a URL: {e}")))?;
        let Some(authority) = uri.authority() else {
            return Err(self.err(key, format!("{text:?} must be a URL like \"https://auth.example.com/token\"")));
        };
        if authority.as_str().contains('@') || uri.query().is_some() || authority.host().is_empty() {
            return Err(self.err(key, format!("{text:?} must be scheme://host[:port][/path], without user or query")));
        }
        match (uri.scheme_str(), upstream.scheme_str()) {
            (Some("https"), _) | (Some("http"), Some("http")) => Ok(uri),
            (Some("http"), _) => {
                Err(self.err(key, format!("{text:?} must be https: credentials never travel in clear text")))
            }
            _ => Err(self.err(key, format!("{text:?} is not an http(s) URL"))),
        }
    }
}

/// A registry host as clients name it: DNS labels, optionally `:port`.
fn valid_host(s: &str) -> bool {
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (s, None),
    };
    let port_ok = port.is_none_or(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()));
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    };
    port_ok && !host.is_empty() && host.len() <= 253 && host.split('.').all(label_ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, "test.toml", None)
    }

    const MINIMAL: &str = r#"
        [[upstream]]
        name = "docker.io"
        url = "https://registry-1.docker.io"
        default = true
    "#;

    #[test]
    fn embedded_default_is_valid() {
        let c = Config::embedded_default().unwrap();
        let names: Vec<_> = c.upstreams.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["docker.io", "ghcr.io", "quay.io", "registry.k8s.io"]);
        assert_eq!(c.default_upstream().unwrap().name, "docker.io");
        assert!(c.default_upstream().unwrap().library_namespace);
        assert_eq!(c.cache.dir, PathBuf::from("./larder-data"));
    }

    /// Loads every example in `config/`. Secret files an example names
    /// (`password_file = "/run/secrets/..."`, uncommented) are created under
    /// a temp dir and the text pointed there, as a pod would have them
    /// mounted; `${POD_IP}` and friends come from a made-up environment.
    #[test]
    fn every_example_in_config_dir_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        let file_key = Regex::new(r#"(?m)^\s*\w+_file\s*=\s*"([^"]+)""#).unwrap();
        let env = |name: &str| match name {
            "POD_IP" => Some("10.0.0.7".to_owned()),
            "POD_NAMESPACE" => Some("larder".to_owned()),
            _ => None,
        };
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let mut text = std::fs::read_to_string(&path).unwrap();
                let mounts = tempfile::tempdir().unwrap();
                for named in file_key.captures_iter(&text.clone()) {
                    let named = &named[1];
                    let mounted = mounts.path().join(named.trim_start_matches('/'));
                    std::fs::create_dir_all(mounted.parent().unwrap()).unwrap();
                    std::fs::write(&mounted, "an-example-secret-of-some-length\n").unwrap();
                    text = text.replace(&format!("\"{named}\""), &format!("{:?}", mounted.display().to_string()));
                }
                Config::parse_with_env(&text, &path.display().to_string(), Some(&dir), &env)
                    .unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
        }
        assert!(n >= 5, "expected the documented examples in config/, found {n}");
    }

    #[test]
    fn sendfile_is_auto_unless_set() {
        assert_eq!(parse(MINIMAL).unwrap().server.sendfile, SendfileMode::Auto);
        for (value, mode) in
            [("auto", SendfileMode::Auto), ("always", SendfileMode::Always), ("never", SendfileMode::Never)]
        {
            let c = parse(&format!("[server]\nsendfile = \"{value}\"\n{MINIMAL}")).unwrap();
            assert_eq!(c.server.sendfile, mode);
        }
    }

    #[test]
    fn defaults_and_human_values() {
        let c = parse(&format!("[cache]\nmax_size = \"2GiB\"\ntag_ttl = \"90s\"\n{MINIMAL}")).unwrap();
        assert_eq!(c.cache.max_size, 2 << 30);
        assert_eq!(c.cache.tag_ttl, Duration::from_secs(90));
        assert_eq!(c.cache.stale_if_error, Duration::from_secs(7 * 86400));
        assert_eq!(c.upstreams[0].max_concurrency.get(), DEFAULT_MAX_CONCURRENCY);
        assert_eq!(c.server.listen, "0.0.0.0:5000".parse().unwrap());
    }

    #[test]
    fn unknown_keys_are_errors_naming_file_and_key() {
        let e = parse(&format!("[cache]\nttl = \"5m\"\n{MINIMAL}")).unwrap_err().to_string();
        assert!(e.starts_with("test.toml:"), "{e}");
        assert!(e.contains("ttl"), "{e}");
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            ("[cache]\ntag_ttl = \"soon\"\n", "cache.tag_ttl"),
            ("[cache]\nmax_size = \"lots\"\n", "cache.max_size"),
            ("[server]\nlisten = \"nowhere\"\n", "server.listen"),
            ("[log]\nlevel = \"larder=loud\"\n", "log.level"),
            // Found by fuzzing: humantime panics on these.
            ("[server]\nshutdown_grace = \"18446744073709551615s 500ms 500ms\"\n", "server.shutdown_grace"),
            ("[cache]\ntag_ttl = \"101y\"\n", "cache.tag_ttl"),
            ("[log]\nformat = \"xml\"\n", "log.format"),
            ("[cache]\nmax_size = \"0\"\n", "cache.max_size"),
            ("[cache]\nmax_size = \"1GiB\"\nmax_blob_size = \"2GiB\"\n", "cache.max_blob_size"),
            ("[cache]\nmax_blob_size = \"0\"\n", "cache.max_blob_size"),
            ("[server]\nmax_connections = 0\n", "server.max_connections"),
            ("[server]\nsendfile = \"yes\"\n", "server.sendfile"),
            ("[server]\nmax_connections = 1048577\n", "server.max_connections"),
        ];
        for (prefix, key) in cases {
            let e = parse(&format!("{prefix}{MINIMAL}")).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")), "{e}");
        }
        let e = parse("[[upstream]]\nname = \"x.io\"\nurl = \"ftp://x.io\"\n").unwrap_err().to_string();
        assert!(e.contains("`upstream[0].url`"), "{e}");
        let e = parse("[[upstream]]\nname = \"X IO\"\nurl = \"https://x.io\"\n").unwrap_err().to_string();
        assert!(e.contains("`upstream[0].name`"), "{e}");
        let e =
            parse(&format!("{MINIMAL}\n[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\nmax_concurrency = 0\n"))
                .unwrap_err()
                .to_string();
        assert!(e.contains("`upstream[1].max_concurrency`"), "{e}");
        let e = parse(&format!(
            "{MINIMAL}\n[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\nmax_concurrency = 9223372036854775807\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("`upstream[1].max_concurrency`"), "{e}");
        let e = parse(&format!(
            "{MINIMAL}\n[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\nimmutable_tags = [\"(\"]\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("`upstream[1].immutable_tags[0]`"), "{e}");
    }

    #[test]
    fn upstream_timeouts_must_end_before_the_client_idle_limit() {
        for key in ["connect_timeout", "response_timeout", "body_idle_timeout"] {
            for value in ["0s", "101s", "10m"] {
                let text = format!("{MINIMAL}{key} = \"{value}\"\n");
                let e = parse(&text).unwrap_err().to_string();
                assert!(e.contains(&format!("`upstream[0].{key}`")), "{key} = {value}: {e}");
            }
            assert!(parse(&format!("{MINIMAL}{key} = \"100s\"\n")).is_ok());
        }
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.cache.max_blob_size, c.cache.max_size / 4, "a quarter of max_size by default");
    }

    #[test]
    fn duplicate_names_and_defaults_are_refused() {
        let twice = format!("{MINIMAL}{MINIMAL}");
        assert!(parse(&twice).unwrap_err().to_string().contains("used twice"));
        let two_defaults =
            format!("{MINIMAL}\n[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\ndefault = true\n");
        assert!(parse(&two_defaults).unwrap_err().to_string().contains("only one upstream"));
        assert!(parse("").unwrap_err().to_string().contains("at least one"));
    }

    #[test]
    fn credentials_from_a_file_are_redacted() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pw"), "hunter2\n").unwrap();
        let text =
            "[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\nusername = \"bob\"\npassword_file = \"pw\"\n";
        let c = Config::parse(text, "t.toml", Some(dir.path())).unwrap();
        let Some(CredentialSource::File { username, path, loaded }) = &c.upstreams[0].credentials else {
            panic!("a password_file source: {:?}", c.upstreams[0].credentials);
        };
        assert_eq!((username.as_str(), loaded.expose()), ("bob", "hunter2"));
        assert_eq!(path, &dir.path().join("pw"));
        assert!(!format!("{c:?}").contains("hunter2"));
        let missing =
            "[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\nusername = \"bob\"\npassword_file = \"nope\"\n";
        let e = Config::parse(missing, "t.toml", Some(dir.path())).unwrap_err().to_string();
        assert!(e.contains("`upstream[0].password_file`"), "{e}");
    }

    #[test]
    fn admin_token_file_is_read_checked_and_never_shown() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "0123456789abcdef0123\n").unwrap();
        std::fs::write(dir.path().join("short"), "abc\n").unwrap();
        std::fs::write(dir.path().join("spaces"), "0123456789 abcdef0123\n").unwrap();
        let with = |file: &str| format!("[admin]\ntoken_file = \"{file}\"\n{MINIMAL}");
        let c = Config::parse(&with("token"), "t.toml", Some(dir.path())).unwrap();
        assert_eq!(c.admin.token_file, Some(dir.path().join("token")));
        assert!(!format!("{c:?}").contains("0123456789abcdef"));
        for bad in ["short", "spaces", "missing"] {
            let e = Config::parse(&with(bad), "t.toml", Some(dir.path())).unwrap_err().to_string();
            assert!(e.contains("`admin.token_file`"), "{e}");
        }
        assert_eq!(parse(MINIMAL).unwrap().admin.token_file, None);
        let e = parse(&format!("[admin]\ntoken = \"x\"\n{MINIMAL}")).unwrap_err().to_string();
        assert!(e.contains("token"), "{e}");
    }

    #[test]
    fn docker_io_by_name_or_alias_defaults_to_the_library_namespace() {
        let upstream = |extra: &str| {
            let c = parse(&format!("[[upstream]]\n{extra}\n")).unwrap();
            c.upstreams[0].library_namespace
        };
        assert!(upstream("name = \"docker.io\"\nurl = \"https://mirror.gcr.io\""));
        assert!(upstream("name = \"hub.corp.example\"\naliases = [\"docker.io\"]\nurl = \"https://hub.corp.example\""));
        assert!(upstream("name = \"hub.corp.example\"\nurl = \"https://registry-1.docker.io\""));
        assert!(!upstream("name = \"docker.io\"\nurl = \"https://mirror.gcr.io\"\nlibrary_namespace = false"));
        assert!(!upstream("name = \"ghcr.io\"\nurl = \"https://ghcr.io\""));
    }

    #[test]
    fn trusted_realms_credential_helper_and_urls() {
        let c = parse(
            "[[upstream]]\nname = \"nvcr.io\"\nurl = \"https://nvcr.io\"\n\
             trusted_realms = [\"https://authn.nvidia.com/token\"]\n\
             [[upstream]]\nname = \"ecr.example\"\nurls = [\"https://a.example\", \"https://b.example:8443\"]\n\
             credential_helper = \"ecr-login\"\n",
        )
        .unwrap();
        assert_eq!(c.upstreams[0].trusted_realms[0].to_string(), "https://authn.nvidia.com/token");
        let ecr = &c.upstreams[1];
        assert!(matches!(&ecr.credentials, Some(CredentialSource::Helper(n)) if n == "ecr-login"));
        assert_eq!(ecr.url.to_string(), "https://a.example/");
        assert_eq!(ecr.fallback_urls.iter().map(|u| u.to_string()).collect::<Vec<_>>(), ["https://b.example:8443/"]);

        let cases = [
            (
                "url = \"https://q.io\"\ntrusted_realms = [\"http://auth.q.io/token\"]",
                "upstream[0].trusted_realms[0]",
                "https",
            ),
            ("url = \"https://q.io\"\ntrusted_realms = [\"auth.q.io/token\"]", "upstream[0].trusted_realms[0]", "URL"),
            (
                "url = \"https://q.io\"\ntrusted_realms = [\"https://u@auth.q.io/token\"]",
                "upstream[0].trusted_realms[0]",
                "without user",
            ),
            ("url = \"https://q.io\"\ncredential_helper = \"../evil\"", "upstream[0].credential_helper", "helper name"),
            (
                "url = \"https://q.io\"\ncredential_helper = \"x\"\nusername = \"u\"\npassword = \"p\"",
                "upstream[0].credential_helper",
                "not both",
            ),
            ("url = \"https://q.io\"\nurls = [\"https://q.io\"]", "upstream[0].urls", "not both"),
            ("urls = []", "upstream[0].urls", "between 1 and"),
            ("urls = [\"https://q.io\", \"https://q.io\"]", "upstream[0].urls", "twice"),
            ("urls = [\"https://q.io/v2\"]", "upstream[0].urls", "no path"),
            ("username = \"u\"", "upstream[0].url", "required"),
        ];
        for (lines, key, words) in cases {
            let e = parse(&format!("[[upstream]]\nname = \"q.io\"\n{lines}\n")).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")) && e.contains(words), "{lines}: {e}");
        }
        // An http upstream may name http realms.
        let c = parse("[[upstream]]\nname = \"q.io\"\nurl = \"http://q.io\"\ntrusted_realms = [\"http://a.q.io\"]\n");
        assert!(c.is_ok(), "{c:?}");
    }

    #[test]
    fn immutable_tags_and_per_upstream_ttl() {
        let text = "[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\ntag_ttl = \"1s\"\nimmutable_tags = ['^v?\\d+\\.\\d+\\.\\d+$']\n";
        let c = parse(text).unwrap();
        let u = &c.upstreams[0];
        assert_eq!(u.tag_ttl(&c.cache), Duration::from_secs(1));
        assert!(u.tag_is_immutable("v1.2.3"));
        assert!(!u.tag_is_immutable("latest"));
    }

    const SHARED_AND_CLUSTER: &str = r#"
        [shared]
        url = "s3://larder-cache/mirror/v1"
        endpoint = "http://garage.storage:3900"
        region = "garage"
        access_key_id_file = "s3-id"
        secret_access_key_file = "s3-secret"
        max_age = "90d"

        [cluster]
        listen = "0.0.0.0:5001"
        self = "http://${POD_IP}:5001"
        peers = ["http://10.0.0.1:5001", "http://10.0.0.2:5001/"]
        secret_file = "cluster-secret"
    "#;

    /// A dir with the secret files [`SHARED_AND_CLUSTER`] names.
    fn secrets_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("s3-id"), "GK31c2f218a2e44f485b94239e\n").unwrap();
        std::fs::write(
            dir.path().join("s3-secret"),
            "b892c0665f0ada8a4755dae98baa3b133590e11dae3bcc1f9d769d67f16c3835\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("cluster-secret"), "4f1e6b5e0d9c8a7b6c5d4e3f2a1b0c9d\n").unwrap();
        dir
    }

    fn env_of(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
    }

    fn parse_in(dir: &Path, text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        Config::parse_with_env(&format!("{text}{MINIMAL}"), "t.toml", Some(dir), env)
    }

    #[test]
    fn shared_and_cluster_parse_into_types_with_redacted_secrets() {
        let dir = secrets_dir();
        let c = parse_in(dir.path(), SHARED_AND_CLUSTER, &env_of(&[("POD_IP", "10.0.0.2")])).unwrap();
        let shared = c.shared.as_ref().unwrap();
        assert_eq!((shared.bucket.as_str(), shared.prefix.as_str()), ("larder-cache", "mirror/v1"));
        assert_eq!(shared.endpoint.as_deref(), Some("http://garage.storage:3900"));
        assert_eq!(shared.region, "garage");
        let SharedCredentials::Static { access_key_id, .. } = &shared.credentials else { panic!("keys from files") };
        assert_eq!(access_key_id.expose(), "GK31c2f218a2e44f485b94239e");
        assert_eq!(shared.max_age, Some(Duration::from_secs(90 * 86400)));
        let cluster = c.cluster.as_ref().unwrap();
        assert_eq!(cluster.listen, "0.0.0.0:5001".parse().unwrap());
        assert_eq!(cluster.self_url.as_str(), "http://10.0.0.2:5001");
        let expected: Vec<PeerUrl> =
            ["http://10.0.0.1:5001", "http://10.0.0.2:5001"].iter().map(|p| p.parse().unwrap()).collect();
        assert_eq!(cluster.peers, PeerSource::Static(expected));
        assert_eq!(cluster.secret.expose(), "4f1e6b5e0d9c8a7b6c5d4e3f2a1b0c9d");
        let debug = format!("{c:?}");
        for secret in ["b892c0665f", "4f1e6b5e0d"] {
            assert!(!debug.contains(secret), "secret in Debug output: {debug}");
        }
        assert!(parse(MINIMAL).unwrap().shared.is_none() && parse(MINIMAL).unwrap().cluster.is_none());
    }

    #[test]
    fn shared_keys_come_from_the_aws_environment_without_files() {
        let dir = secrets_dir();
        let text = "[shared]\nurl = \"s3://bucket-a\"\n";
        let env = env_of(&[
            ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
            ("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI"),
            ("AWS_SESSION_TOKEN", "tok"),
            ("AWS_REGION", "eu-west-3"),
        ]);
        let c = parse_in(dir.path(), text, &env).unwrap();
        let shared = c.shared.unwrap();
        assert_eq!((shared.bucket.as_str(), shared.prefix.as_str()), ("bucket-a", ""));
        assert_eq!(shared.endpoint, None, "AWS S3 itself");
        assert_eq!(shared.region, "eu-west-3");
        let SharedCredentials::Static { access_key_id, session_token, .. } = shared.credentials else {
            panic!("keys in the environment are static")
        };
        assert_eq!(access_key_id.expose(), "AKIDEXAMPLE");
        assert_eq!(session_token.map(|t| t.expose().to_owned()).as_deref(), Some("tok"));
    }

    #[test]
    fn without_keys_the_shared_tier_uses_the_aws_credential_chain_so_temporary_credentials_rotate() {
        let dir = secrets_dir();
        let chain = |text: &str, env: &'static [(&'static str, &'static str)]| {
            let c = parse_in(dir.path(), text, &env_of(env)).map(|c| c.shared.unwrap().credentials);
            matches!(c, Ok(SharedCredentials::Chain))
        };
        let aws = "[shared]\nurl = \"s3://bucket-a\"\nregion = \"eu-west-3\"\n";
        const IRSA: &[(&str, &str)] =
            &[("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/secrets/eks/token"), ("AWS_ROLE_ARN", "arn:aws:iam::1:role/l")];
        assert!(chain(aws, IRSA), "web identity (IRSA)");
        assert!(chain(aws, &[]), "on AWS: the instance's or pod's role");
        let garage = "[shared]\nurl = \"s3://bucket-a\"\nregion = \"garage\"\nendpoint = \"http://garage:3900\"\n";
        assert!(chain(garage, IRSA), "a web identity named for another store");
        assert!(
            chain(garage, &[("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://169.254.170.23/v1/credentials")]),
            "EKS Pod Identity"
        );
        let e = parse_in(dir.path(), garage, &env_of(&[])).unwrap_err().to_string();
        assert!(e.contains("`shared.access_key_id_file`") && e.contains("AWS_ACCESS_KEY_ID"), "{e}");
        const KEYS: &[(&str, &str)] =
            &[("AWS_ACCESS_KEY_ID", "AKID"), ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_WEB_IDENTITY_TOKEN_FILE", "/t")];
        assert!(!chain(aws, KEYS), "keys given are used as they are");
    }

    #[test]
    fn bad_shared_and_cluster_values_name_their_key() {
        let dir = secrets_dir();
        let env = env_of(&[("POD_IP", "10.0.0.1"), ("AWS_ACCESS_KEY_ID", "a"), ("AWS_SECRET_ACCESS_KEY", "b")]);
        let shared = |extra: &str| format!("[shared]\nendpoint = \"http://s3:3900\"\n{extra}\n");
        let cluster = |lines: &str| format!("[cluster]\nsecret_file = \"cluster-secret\"\n{lines}\n");
        let cases = [
            (shared("url = \"gs://bucket\"\nregion = \"garage\""), "shared.url"),
            (shared("url = \"s3://Bucket\"\nregion = \"garage\""), "shared.url"),
            (shared("url = \"s3://bucket/a//b\"\nregion = \"garage\""), "shared.url"),
            (shared("url = \"s3://bucket/../b\"\nregion = \"garage\""), "shared.url"),
            (shared("url = \"s3://bucket\""), "shared.region"),
            (shared("url = \"s3://bucket\"\nregion = \"garage\"\nmax_age = \"10m\""), "shared.max_age"),
            (
                shared("url = \"s3://bucket\"\nregion = \"garage\"\naccess_key_id_file = \"s3-id\""),
                "shared.secret_access_key_file",
            ),
            (
                shared(
                    "url = \"s3://bucket\"\nregion = \"garage\"\naccess_key_id_file = \"nope\"\nsecret_access_key_file = \"s3-secret\"",
                ),
                "shared.access_key_id_file",
            ),
            (shared("url = \"s3://bucket\"\nregion = \"garage\"\nbucket = \"x\""), "bucket"),
            (
                "[shared]\nurl = \"s3://bucket\"\nregion = \"garage\"\nendpoint = \"http://s3:3900/path\"\n".to_owned(),
                "shared.endpoint",
            ),
            (cluster("self = \"http://${POD_IP}:5001\"\npeers = [\"http://10.0.0.2:5001\"]"), "cluster.self"),
            (cluster("self = \"http://${NODE_IP}:5001\"\npeers = [\"http://10.0.0.1:5001\"]"), "cluster.self"),
            (cluster("self = \"http://${POD_IP:5001\"\npeers = [\"http://10.0.0.1:5001\"]"), "cluster.self"),
            (
                cluster(
                    "self = \"http://${POD_IP}:5001\"\npeers = [\"http://10.0.0.1:5001\", \"http://10.0.0.1:5001/\"]",
                ),
                "cluster.peers[1]",
            ),
            (
                cluster(
                    "self = \"http://${POD_IP}:5001\"\npeers = [\"http://10.0.0.1:5001\", \"https://10.0.0.2:5001\"]",
                ),
                "cluster.peers[1]",
            ),
            (cluster("self = \"http://${POD_IP}:5001\"\npeers = [\"http://10.0.0.1:5001/v2/\"]"), "cluster.peers[0]"),
            (cluster("self = \"http://${POD_IP}:5001\"\npeers = []"), "cluster.peers"),
            (cluster("self = \"http://${POD_IP}:5001\""), "cluster.peers"),
            (
                cluster(
                    "self = \"http://${POD_IP}:5001\"\npeers = [\"http://10.0.0.1:5001\"]\npeers_dns = \"larder:5001\"",
                ),
                "cluster.peers",
            ),
            (cluster("self = \"http://${POD_IP}:5001\"\npeers_dns = \"Not A Name:5001\""), "cluster.peers_dns"),
            (cluster("self = \"http://${POD_IP}:5001\"\npeers_dns = \"larder:http\""), "cluster.peers_dns"),
            (
                cluster("listen = \"127.0.0.1:5000\"\nself = \"http://${POD_IP}:5001\"\npeers_dns = \"larder:5001\""),
                "cluster.listen",
            ),
            (cluster("self = \"ftp://${POD_IP}:5001\"\npeers_dns = \"larder:5001\""), "cluster.self"),
        ];
        for (text, key) in cases {
            let e = parse_in(dir.path(), &text, &env).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")) || e.contains(key), "{text}\n=> {e}");
            assert!(e.starts_with("t.toml"), "{e}");
        }
        std::fs::write(dir.path().join("short"), "hunter2\n").unwrap();
        let text =
            "[cluster]\nself = \"http://${POD_IP}:5001\"\npeers_dns = \"larder:5001\"\nsecret_file = \"short\"\n";
        let e = parse_in(dir.path(), text, &env).unwrap_err().to_string();
        assert!(e.contains("`cluster.secret_file`") && e.contains("at least"), "{e}");
    }

    /// `[server.tls]` (dummy files: only readability is checked here) and
    /// an https `[cluster]` with `lines` added.
    fn https_cluster(dir: &Path, lines: &str) -> String {
        std::fs::write(dir.join("tls.crt"), "-----BEGIN CERTIFICATE-----\n").unwrap();
        std::fs::write(dir.join("tls.key"), "-----BEGIN PRIVATE KEY-----\n").unwrap();
        std::fs::write(dir.join("peers-ca.crt"), "-----BEGIN CERTIFICATE-----\n").unwrap();
        format!(
            "[server.tls]\ncert = \"tls.crt\"\nkey = \"tls.key\"\n\n[cluster]\nself = \"https://${{POD_IP}}:5001\"\n\
             peers_dns = \"larder-peers.mirror.svc:5001\"\nsecret_file = \"cluster-secret\"\n{lines}\n"
        )
    }

    #[test]
    fn https_peers_are_verified_under_one_fixed_name() {
        let dir = secrets_dir();
        let env = env_of(&[("POD_IP", "10.0.0.1"), ("POD_NAMESPACE", "Mirror")]);
        let text =
            https_cluster(dir.path(), "tls_name = \"Larder-Peers.${POD_NAMESPACE}.svc\"\nca_file = \"peers-ca.crt\"");
        let c = parse_in(dir.path(), &text, &env).unwrap().cluster.unwrap();
        assert_eq!(c.tls_name, Some(ServerName::try_from("larder-peers.mirror.svc").unwrap()), "expanded, lowercased");
        assert_eq!(c.ca_file, Some(dir.path().join("peers-ca.crt")));
        assert!(c.self_url.is_https());

        let c = parse_in(dir.path(), &https_cluster(dir.path(), ""), &env).unwrap().cluster.unwrap();
        assert_eq!((c.tls_name, c.ca_file), (None, None), "each peer verified against its URL's host");
    }

    #[test]
    fn bad_peer_tls_settings_name_their_key() {
        let dir = secrets_dir();
        let env = env_of(&[("POD_IP", "10.0.0.1")]);
        let http = |lines: &str| {
            format!(
                "[cluster]\nself = \"http://${{POD_IP}}:5001\"\npeers_dns = \"larder:5001\"\n\
                 secret_file = \"cluster-secret\"\n{lines}\n"
            )
        };
        std::fs::write(dir.path().join("peers-ca.crt"), "-----BEGIN CERTIFICATE-----\n").unwrap();
        let cases = [
            (http("tls_name = \"larder-peers.mirror.svc\""), "cluster.tls_name", "only for https peers"),
            (http("ca_file = \"peers-ca.crt\""), "cluster.ca_file", "only for https peers"),
            (https_cluster(dir.path(), "tls_name = \"10.0.0.1\""), "cluster.tls_name", "is an address"),
            (https_cluster(dir.path(), "tls_name = \"::1\""), "cluster.tls_name", "is an address"),
            (https_cluster(dir.path(), "tls_name = \"larder-peers:5001\""), "cluster.tls_name", "not a DNS name"),
            (https_cluster(dir.path(), "tls_name = \"*.mirror.svc\""), "cluster.tls_name", "not a DNS name"),
            (https_cluster(dir.path(), "tls_name = \"https://larder\""), "cluster.tls_name", "not a DNS name"),
            (https_cluster(dir.path(), "tls_name = \"\""), "cluster.tls_name", "not a DNS name"),
            (https_cluster(dir.path(), "tls_name = \"${NAMESPACE}.svc\""), "cluster.tls_name", "NAMESPACE"),
            (https_cluster(dir.path(), "ca_file = \"missing.crt\""), "cluster.ca_file", "cannot read"),
        ];
        for (text, key, why) in cases {
            let e = parse_in(dir.path(), &text, &env).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")) && e.contains(why), "{text}\n=> {e}");
        }
        let no_tls = "[cluster]\nself = \"https://${POD_IP}:5001\"\npeers_dns = \"larder:5001\"\n\
                      secret_file = \"cluster-secret\"\ntls_name = \"larder-peers.mirror.svc\"\n";
        let e = parse_in(dir.path(), no_tls, &env).unwrap_err().to_string();
        assert!(e.contains("`cluster.self`") && e.contains("[server.tls]"), "https peers need a certificate: {e}");
    }

    #[test]
    fn peers_dns_takes_the_port_of_self_when_it_names_none() {
        let dir = secrets_dir();
        let env = env_of(&[("POD_IP", "10.0.0.1"), ("POD_NAMESPACE", "mirror")]);
        let text = "[cluster]\nself = \"http://${POD_IP}:5101\"\npeers_dns = \"larder-headless.${POD_NAMESPACE}.svc.cluster.local\"\nsecret_file = \"cluster-secret\"\n";
        let c = parse_in(dir.path(), text, &env).unwrap().cluster.unwrap();
        assert_eq!(c.peers, PeerSource::Dns { name: "larder-headless.mirror.svc.cluster.local:5101".into() });
        assert_eq!(c.listen, DEFAULT_CLUSTER_LISTEN.parse().unwrap());
    }
}
