//! Configuration: raw serde structs (`deny_unknown_fields`) parsed from
//! TOML, then validated into typed values. Every error names the file and
//! the key. Secrets are read here and kept in a redacting [`Secret`].
//!
//! One room per section, each holding its raw struct, its typed struct and
//! its own validation: `server`, `cache`, `log`, `admin`,
//! `upstream` (with its `credentials`), `shared`, `cluster`, `warm`. Here: loading, the error type, the
//! validator's common parsers (durations, sizes, paths, secret files,
//! `${ENV}`), and the order sections are checked in, where one depends on
//! another (`[admin] tls` and `[cluster]` on `[server]`, `grants` on the
//! upstreams and `[server]`'s ways of identifying clients, `[[warm]]` and
//! each upstream's `max_size` on the upstreams and `[cache]`). What is
//! valid but worth a second look is in `warnings`; sizes and durations in
//! `units`.

mod admin;
mod cache;
mod cluster;
mod credentials;
mod grants;
mod log;
mod parse_error;
mod secret;
mod server;
mod shared;
pub mod units;
mod upstream;
mod warm;
mod warnings;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub use admin::{AdminConfig, AdminHost, GENERATED_ADMIN_TOKEN_FILE, MIN_ADMIN_TOKEN_LEN, parse_admin_token};
pub use cache::{
    CacheConfig, DEFAULT_HIGH_WATERMARK, DEFAULT_LOW_WATERMARK, DEFAULT_MAX_BLOB_SIZE_DIVISOR,
    DEFAULT_PARALLEL_FILL_MIN, MIN_MAX_SIZE, MIN_WARM_INTERVAL,
};
pub use cluster::{ClusterConfig, DEFAULT_CLUSTER_LISTEN, MIN_CLUSTER_SECRET_LEN, PeerSource, PeerUrl};
pub use credentials::{CredentialSource, Credentials};
pub use log::{DEFAULT_LOG_LEVEL, LogConfig, LogFormat};
pub use secret::Secret;
pub use server::{
    ClientAuthConfig, DEFAULT_MAX_CONNECTIONS, DEFAULT_SHUTDOWN_GRACE, MAX_MAX_CONNECTIONS, SendfileMode, ServerConfig,
    TlsConfig,
};
pub use shared::{MIN_SHARED_MAX_AGE, SharedConfig, SharedCredentials};
pub use upstream::{
    ClientCredentialsMode, DEFAULT_BODY_IDLE_TIMEOUT, DEFAULT_CLIENT_CREDENTIALS_TTL, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_FILL_CONNECTIONS, DEFAULT_MAX_CONCURRENCY, DEFAULT_RESPONSE_TIMEOUT, FallbackUrl, MAX_FILL_CONNECTIONS,
    MAX_MAX_CONCURRENCY, MAX_UPSTREAM_TIMEOUT, MAX_UPSTREAM_URLS, UpstreamConfig,
};
pub use warm::{MAX_WARM_IMAGES, MAX_WARM_LINE, WarmFile, WarmImage, parse_warm_file, parse_warm_line, resolve_image};

/// The configuration used when `larder` runs without `--config`.
pub const EMBEDDED_DEFAULT: &str = include_str!("../../config/default.toml");
const EMBEDDED_NAME: &str = "<embedded default config>";
/// Longest duration accepted anywhere in the config.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 86_400);
/// Longest duration text, and longest run of digits in it, accepted: with
/// these no sum of its parts can overflow while parsing.
const MAX_DURATION_TEXT: usize = 64;
const MAX_DURATION_DIGITS: usize = 10;

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
    /// Images kept warm and pinned (`[[warm]]`); `cache.warm_file` adds more.
    pub warm: Vec<WarmImage>,
}

/// What `larder check-config --without-secrets` did not look at: a file
/// or an environment variable that holds a secret or is set where larder
/// runs (a pod's mounts and downward API), not where a config is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The config key, e.g. `upstream[0].password_file`.
    pub key: String,
    /// What was not done, e.g. `secrets/hub-token was not read`.
    pub what: String,
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}`: {}", self.key, self.what)
    }
}

/// What a secret skipped by `--without-secrets` is checked as: long
/// enough for every length rule (tokens, cluster secrets).
const SKIPPED_SECRET: &str = "a-placeholder-for-a-secret-not-read-by-check-config";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Read { file: String, source: std::io::Error },
    #[error("{file}: {message}")]
    Parse { file: String, message: String },
    #[error("{file}: `{key}`: {message}")]
    Invalid { file: String, key: String, message: String },
}

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: Option<server::RawServer>,
    cache: Option<cache::RawCache>,
    log: Option<log::RawLog>,
    admin: Option<admin::RawAdmin>,
    #[serde(default)]
    upstream: Vec<upstream::RawUpstream>,
    shared: Option<shared::RawShared>,
    cluster: Option<cluster::RawCluster>,
    #[serde(default)]
    warm: Vec<warm::RawWarm>,
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
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            file: file.to_owned(),
            message: parse_error::describe_parse_error(text, &e),
        })?;
        Validator { file, base_dir, env, skipped: None }.config(raw)
    }

    /// Reads and validates a config file as [`Config::load`] does, but
    /// without reading what holds secrets or is set only where larder runs:
    /// the files of `password_file`, `token_file`, `secret_file`, the S3
    /// key files, `htpasswd`, certificates, keys and CA files, and
    /// environment variables that are not set here (`password_env`,
    /// `${POD_IP}`, `AWS_*`). Every other rule is checked. For a config
    /// repository's CI; the config returned is for checking only, never
    /// for running (its secrets are placeholders).
    pub fn load_without_secrets(path: &Path) -> Result<(Config, Vec<Skipped>), ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { file: file.clone(), source })?;
        Config::parse_without_secrets(&text, &file, path.parent(), &|name| std::env::var(name).ok())
    }

    /// [`Config::load_without_secrets`] of config text.
    pub fn parse_without_secrets(
        text: &str,
        file: &str,
        base_dir: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(Config, Vec<Skipped>), ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            file: file.to_owned(),
            message: parse_error::describe_parse_error(text, &e),
        })?;
        let skipped = std::cell::RefCell::new(Vec::new());
        let config = Validator { file, base_dir, env, skipped: Some(&skipped) }.config(raw)?;
        Ok((config, skipped.into_inner()))
    }

    pub fn default_upstream(&self) -> Option<&UpstreamConfig> {
        self.upstreams.iter().find(|u| u.default)
    }
}

struct Validator<'a> {
    file: &'a str,
    base_dir: Option<&'a Path>,
    env: &'a dyn Fn(&str) -> Option<String>,
    /// With `--without-secrets`: what was not read, noted as it goes.
    skipped: Option<&'a std::cell::RefCell<Vec<Skipped>>>,
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
        // Bound the text before parsing (its suggestions add up parts),
        // and the value after, so that durations can be added to each
        // other anywhere.
        let digit_run_too_long = s.split(|c: char| !c.is_ascii_digit()).any(|run| run.len() > MAX_DURATION_DIGITS);
        if s.len() > MAX_DURATION_TEXT || digit_run_too_long {
            return Err(self.err(key, format!("{s:?} is far too long for a duration")));
        }
        let d = units::parse_duration(s).map_err(|e| self.err(key, e))?;
        if d > MAX_DURATION {
            return Err(self.err(key, format!("{s:?} is longer than 100 years")));
        }
        Ok(d)
    }

    fn size(&self, key: &str, v: Option<&str>, default: u64) -> Result<u64, ConfigError> {
        match v {
            None => Ok(default),
            Some(s) => units::parse_size(s).map_err(|e| self.err(key, e)),
        }
    }

    fn addr(&self, key: &str, v: &str) -> Result<SocketAddr, ConfigError> {
        v.parse().map_err(|_| self.err(key, format!("{v:?} is not an address like \"0.0.0.0:5000\"")))
    }

    /// Without secrets: notes that `key`'s `what` was skipped, and says so.
    fn skip(&self, key: &str, what: impl FnOnce() -> String) -> bool {
        let Some(skipped) = self.skipped else { return false };
        skipped.borrow_mut().push(Skipped { key: key.to_owned(), what: what() });
        true
    }

    /// A secret file's text, or `None` when skipped (without secrets).
    fn secret_text(&self, key: &str, path: &Path) -> Result<Option<String>, ConfigError> {
        if self.skip(key, || format!("{} was not read", path.display())) {
            return Ok(None);
        }
        let text =
            std::fs::read_to_string(path).map_err(|e| self.err(key, format!("cannot read {}: {e}", path.display())))?;
        Ok(Some(text))
    }

    /// An environment variable; `None` when unset, or a placeholder when
    /// unset and skipped (without secrets).
    fn env_var(&self, key: &str, name: &str, placeholder: &str) -> Option<String> {
        match (self.env)(name) {
            Some(v) => Some(v),
            None if self
                .skip(key, || format!("${name} is not set here; checked with {placeholder:?} in its place")) =>
            {
                Some(placeholder.to_owned())
            }
            None => None,
        }
    }

    fn readable(&self, key: &str, p: &str) -> Result<PathBuf, ConfigError> {
        let path = self.path(p);
        if self.skip(key, || format!("{} was not opened", path.display())) {
            return Ok(path);
        }
        std::fs::File::open(&path).map_err(|e| self.err(key, format!("cannot read {}: {e}", path.display())))?;
        Ok(path)
    }

    fn config(&self, raw: RawConfig) -> Result<Config, ConfigError> {
        let (mut server, raw_grants) = self.server(raw.server)?;
        let mut cache = self.cache(raw.cache)?;
        let upstreams = self.upstreams(raw.upstream)?;
        // Grants name upstreams, and users or certificates `[server]` must
        // be able to tell apart.
        server.grants = self.grants(&raw_grants, &upstreams, &server)?;
        // Both would read the client's one Authorization header.
        if server.auth.is_some() {
            if let Some(i) = upstreams.iter().position(|u| u.client_credentials != ClientCredentialsMode::Ignore) {
                return Err(self.err(
                    format!("upstream[{i}].client_credentials"),
                    "\"verify\" checks the client's Basic credentials with the registry, and [server.auth] htpasswd \
                     checks the same Authorization header against larder's own users: use one of them (grants can \
                     still name clients by certificate, without htpasswd)",
                ));
            }
        }
        let log = self.log(raw.log)?;
        let admin = self.admin(raw.admin.unwrap_or_default(), &server)?;
        let shared = raw.shared.map(|s| self.shared(s)).transpose()?;
        let cluster = raw.cluster.map(|c| self.cluster(c, &server)).transpose()?;
        // An upstream's share is a part of the whole.
        for (i, u) in upstreams.iter().enumerate() {
            if let Some(size) = u.max_size.filter(|s| *s > cache.max_size) {
                return Err(self.err(
                    format!("upstream[{i}].max_size"),
                    format!("{} is more than cache.max_size, {}", units::Size(size), units::Size(cache.max_size)),
                ));
            }
        }
        cache.upstream_max_size = upstreams.iter().filter_map(|u| Some((u.name.clone(), u.max_size?))).collect();
        // Warm images name upstreams, and obey their allow/deny.
        let warm = self.warm(raw.warm, &upstreams)?;
        Ok(Config { server, cache, upstreams, log, admin, shared, cluster, warm })
    }

    /// A secret read from a file: trailing line breaks and spaces dropped
    /// (files written by `echo` or a Kubernetes Secret), never empty.
    fn secret_file(&self, key: &str, p: &str) -> Result<Secret, ConfigError> {
        let path = self.path(p);
        let Some(text) = self.secret_text(key, &path)? else { return Ok(Secret::new(SKIPPED_SECRET)) };
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
            // Without secrets, an unset variable becomes a name that is a
            // valid host: `${POD_IP}` → `pod-ip`.
            let placeholder = name.to_ascii_lowercase().replace('_', "-");
            let value = self
                .env_var(key, name, &placeholder)
                .ok_or_else(|| self.err(key, format!("environment variable {name} is not set")))?;
            out.push_str(&value);
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        Ok(out)
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

/// What the tests of every section share: a parser, the smallest valid
/// config, and a folder of secret files with a made-up environment.
#[cfg(test)]
pub(crate) mod test_support {
    use std::path::Path;

    use super::{Config, ConfigError};

    pub(crate) fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, "test.toml", None)
    }

    pub(crate) const MINIMAL: &str = r#"
        [[upstream]]
        name = "docker.io"
        url = "https://registry-1.docker.io"
        default = true
    "#;

    pub(crate) const SHARED_AND_CLUSTER: &str = r#"
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
    pub(crate) fn secrets_dir() -> tempfile::TempDir {
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

    pub(crate) fn env_of(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
    }

    pub(crate) fn parse_in(
        dir: &Path,
        text: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        Config::parse_with_env(&format!("{text}{MINIMAL}"), "t.toml", Some(dir), env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regex::Regex;
    use test_support::*;

    /// Every key the config accepts, as dotted paths (`server.tls.cert`,
    /// `upstream.name`, `upstream.urls[].credentials`), read from the raw
    /// structs' schema: nested tables add `.`, arrays of tables inside a
    /// table add `[].`, and the top-level arrays of tables (`[[upstream]]`)
    /// are named as their table. A key that is also a table (`admin.tls`,
    /// a string or `{ cert, key }`) is listed both ways.
    fn accepted_keys() -> std::collections::BTreeSet<String> {
        let schema = serde_json::to_value(schemars::schema_for!(RawConfig)).unwrap();
        let defs = schema.get("$defs").cloned().unwrap_or_default();
        fn resolve<'a>(v: &'a serde_json::Value, defs: &'a serde_json::Value) -> &'a serde_json::Value {
            match v.get("$ref").and_then(|r| r.as_str()).and_then(|r| r.strip_prefix("#/$defs/")) {
                Some(name) => resolve(&defs[name], defs),
                None => v,
            }
        }
        /// The object schemas a value may be (through Option, anyOf, arrays),
        /// each with whether it came through an array.
        fn tables<'a>(
            v: &'a serde_json::Value,
            defs: &'a serde_json::Value,
            array: bool,
            out: &mut Vec<(&'a serde_json::Value, bool)>,
        ) {
            let v = resolve(v, defs);
            for branch in ["anyOf", "oneOf"] {
                for b in v.get(branch).and_then(|b| b.as_array()).into_iter().flatten() {
                    tables(b, defs, array, out);
                }
            }
            if let Some(items) = v.get("items") {
                tables(items, defs, true, out);
            }
            if v.get("properties").is_some() {
                out.push((v, array));
            }
        }
        fn is_leaf(v: &serde_json::Value, defs: &serde_json::Value) -> bool {
            let v = resolve(v, defs);
            let types: Vec<&str> = match &v["type"] {
                serde_json::Value::String(t) => vec![t.as_str()],
                serde_json::Value::Array(ts) => ts.iter().filter_map(|t| t.as_str()).collect(),
                _ => Vec::new(),
            };
            let scalar = types.iter().any(|t| !matches!(*t, "object" | "null" | "array"))
                || v.get("items").is_some_and(|i| !is_table(i, defs));
            let branches =
                ["anyOf", "oneOf"].iter().flat_map(|b| v.get(*b).and_then(|b| b.as_array()).into_iter().flatten());
            scalar || branches.into_iter().any(|b| is_leaf(b, defs))
        }
        fn is_table(v: &serde_json::Value, defs: &serde_json::Value) -> bool {
            resolve(v, defs).get("properties").is_some()
        }
        fn walk(
            prefix: &str,
            table: &serde_json::Value,
            defs: &serde_json::Value,
            keys: &mut std::collections::BTreeSet<String>,
        ) {
            for (name, value) in table["properties"].as_object().into_iter().flatten() {
                let key = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
                if is_leaf(value, defs) {
                    keys.insert(key.clone());
                }
                let mut found = Vec::new();
                tables(value, defs, false, &mut found);
                for (sub, array) in found {
                    // `[[upstream]]` is named `upstream.<key>`; an array of
                    // tables inside a table is `<key>[].<key>`.
                    let sub_prefix = if array && !prefix.is_empty() { format!("{key}[]") } else { key.clone() };
                    walk(&sub_prefix, sub, defs, keys);
                }
            }
        }
        let mut keys = std::collections::BTreeSet::new();
        walk("", &schema, &defs, &mut keys);
        keys
    }

    /// The keys docs/configuration.md documents: the first column of its
    /// tables, in backticks.
    fn documented_keys() -> std::collections::BTreeSet<String> {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md"))
            .expect("read docs/configuration.md");
        doc.lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split_once('`'))
            .map(|(key, _)| key.to_owned())
            .filter(|k| !k.starts_with("larder") && !k.contains(' '))
            .collect()
    }

    #[test]
    fn the_configuration_reference_documents_exactly_the_keys_larder_accepts() {
        let accepted = accepted_keys();
        assert!(
            accepted.contains("server.tls.cert") && accepted.contains("upstream.urls[].credentials"),
            "{accepted:?}"
        );
        assert!(
            accepted.contains("cluster.self") && accepted.contains("admin.tls") && accepted.contains("admin.tls.cert")
        );
        let documented = documented_keys();
        let tables: std::collections::BTreeSet<String> = accepted
            .iter()
            .flat_map(|k| {
                k.match_indices('.').map(|(i, _)| k[..i].trim_end_matches("[]").to_owned()).collect::<Vec<_>>()
            })
            .collect();
        let missing: Vec<&String> = accepted.difference(&documented).collect();
        let unknown: Vec<&String> =
            documented.iter().filter(|k| !accepted.contains(*k) && !tables.contains(*k)).collect();
        assert!(missing.is_empty(), "keys larder accepts that docs/configuration.md does not document: {missing:?}");
        assert!(unknown.is_empty(), "keys docs/configuration.md documents that larder does not accept: {unknown:?}");
    }

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
            // Each watermark under its own key.
            ("[cache]\nlow_watermark = 0.97\n", "cache.low_watermark"),
            ("[cache]\nlow_watermark = 0\n", "cache.low_watermark"),
            ("[cache]\nhigh_watermark = 1.5\n", "cache.high_watermark"),
            ("[cache]\nmax_size = \"50G\"\n", "cache.max_size"),
            ("[cache]\ntag_ttl = \"7 days\"\n", "cache.tag_ttl"),
        ];
        for (prefix, key) in cases {
            let e = parse(&format!("{prefix}{MINIMAL}")).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")), "{e}");
        }
        let e = parse(&format!("[cache]\nmax_size = \"1KiB\"\n{MINIMAL}")).unwrap_err().to_string();
        assert!(
            e.ends_with("`cache.max_size`: 1 KiB (1024 bytes) is less than the minimum, 1 MiB (1048576 bytes)"),
            "{e}"
        );
        let e = parse(&format!("[cache]\nmax_size = \"1GiB\"\nmax_blob_size = \"2GiB\"\n{MINIMAL}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most cache.max_size, 1 GiB (1073741824 bytes), not 2 GiB (2147483648 bytes)"), "{e}");
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
}
