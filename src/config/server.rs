//! `[server]`: the registry listener, its TLS and client authentication,
//! the admin listener's address, shutdown and sendfile.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, Validator};

/// Default time in-flight responses get after SIGTERM; below Kubernetes'
/// default 30 s `terminationGracePeriodSeconds`, so larder exits on its own.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(25);
/// Default cap on open client connections of the registry listener: room
/// for a hub serving thousands of kubelets, each keeping a connection open.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16_384;
/// Default `server.manifest_deadline`: a manifest's response headers go
/// out within this of its request, whatever upstream, a hub (`via`) or a
/// cluster owner does. containerd 2.3 (and Docker 29.7, which builds on
/// it) gives up on any response whose headers take 30 s; 25 s leaves
/// room for the client's own round trips.
pub const DEFAULT_MANIFEST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(25);
/// Range accepted for `server.manifest_deadline`.
pub const MANIFEST_DEADLINE_RANGE: std::ops::RangeInclusive<std::time::Duration> =
    std::time::Duration::from_secs(1)..=std::time::Duration::from_secs(120);
/// Largest `server.max_connections` accepted (each connection holds a
/// descriptor; Linux's default hard limit is 2^20).
pub const MAX_MAX_CONNECTIONS: usize = 1 << 20;

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
    /// `[[server.auth.grant]]`: when any exists, a client pulls only what
    /// some grant gives it (see `crate::policy`).
    pub grants: Vec<crate::policy::Grant>,
    /// When cached blob bytes go out with sendfile (cleartext HTTP/1).
    pub sendfile: SendfileMode,
    /// A manifest request is answered within this: from the cache, stale
    /// if a revalidation cannot finish in time (within `stale_if_error`),
    /// else `504`. A fetch still running goes on and fills the cache.
    pub manifest_deadline: Duration,
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

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    listen: Option<String>,
    admin_listen: Option<String>,
    shutdown_grace: Option<String>,
    max_connections: Option<usize>,
    manifest_deadline: Option<String>,
    tls: Option<RawTls>,
    auth: Option<RawAuth>,
    sendfile: Option<String>,
}

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    cert: String,
    key: String,
    client_ca: Option<String>,
}

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAuth {
    htpasswd: Option<String>,
    realm: Option<String>,
    /// Read once the upstreams are known (`super::grants`).
    #[serde(default)]
    grant: Vec<RawGrant>,
}

/// One `[[server.auth.grant]]` as written (validated in `super::grants`).
#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGrant {
    pub(super) who: Vec<String>,
    pub(super) upstreams: Option<Vec<String>>,
    pub(super) repositories: Option<Vec<String>>,
}

impl Validator<'_> {
    /// `[server]`, and the raw grants of `[server.auth]`, which are read
    /// once the upstreams are known (`super::grants`).
    pub(super) fn server(&self, raw: Option<RawServer>) -> Result<(ServerConfig, Vec<RawGrant>), ConfigError> {
        let rs = raw.unwrap_or_default();
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
            manifest_deadline: match self.duration(
                "server.manifest_deadline",
                rs.manifest_deadline.as_deref(),
                DEFAULT_MANIFEST_DEADLINE,
            )? {
                d if MANIFEST_DEADLINE_RANGE.contains(&d) => d,
                _ => return Err(self.err("server.manifest_deadline", "must be between 1s and 120s")),
            },
            tls: rs.tls.as_ref().map(|t| self.tls(t)).transpose()?,
            auth: rs.auth.as_ref().map(|a| self.auth(a)).transpose()?.flatten(),
            grants: Vec::new(),
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
        Ok((server, rs.auth.map(|a| a.grant).unwrap_or_default()))
    }

    fn tls(&self, t: &RawTls) -> Result<TlsConfig, ConfigError> {
        Ok(TlsConfig {
            cert: self.readable("server.tls.cert", &t.cert)?,
            key: self.readable("server.tls.key", &t.key)?,
            client_ca: t.client_ca.as_deref().map(|c| self.readable("server.tls.client_ca", c)).transpose()?,
        })
    }

    /// `[server.auth]`: Basic credentials when it names an `htpasswd`
    /// (it may hold only grants, for clients identified by certificate).
    fn auth(&self, a: &RawAuth) -> Result<Option<ClientAuthConfig>, ConfigError> {
        let Some(htpasswd) = &a.htpasswd else {
            if a.grant.is_empty() {
                return Err(self.err("server.auth.htpasswd", "required (or grants, for certificate identities)"));
            }
            return Ok(None);
        };
        let realm = a.realm.clone().unwrap_or_else(|| "larder".to_owned());
        if realm.is_empty() || realm.contains(['"', '\\']) || realm.chars().any(char::is_control) {
            return Err(
                self.err("server.auth.realm", "must be non-empty, without quotes, backslashes or control characters")
            );
        }
        Ok(Some(ClientAuthConfig { htpasswd: self.readable("server.auth.htpasswd", htpasswd)?, realm }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn the_manifest_deadline_is_25s_unless_set_between_1s_and_120s() {
        assert_eq!(parse(MINIMAL).unwrap().server.manifest_deadline, DEFAULT_MANIFEST_DEADLINE);
        let c = parse(&format!("[server]\nmanifest_deadline = \"10s\"\n{MINIMAL}")).unwrap();
        assert_eq!(c.server.manifest_deadline, Duration::from_secs(10));
        for bad in ["0s", "500ms", "121s", "1h"] {
            let e = parse(&format!("[server]\nmanifest_deadline = \"{bad}\"\n{MINIMAL}")).unwrap_err().to_string();
            assert!(e.contains("server.manifest_deadline"), "{bad}: {e}");
        }
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
}
