//! `[cluster]`: this replica's peers, how they reach it, and how they
//! prove they are peers.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use rustls::pki_types::ServerName;
use serde::Deserialize;

use super::server::ServerConfig;
use super::{ConfigError, Secret, Validator, valid_host};

/// Default `[cluster] listen`: the peer listener, apart from the client port.
pub const DEFAULT_CLUSTER_LISTEN: &str = "0.0.0.0:5001";
/// Shortest cluster secret accepted: it is all that stands between the
/// peer listener and anyone who can reach it.
pub const MIN_CLUSTER_SECRET_LEN: usize = 16;

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

/// A peer's base URL, normalized to `scheme://host:port` so that two
/// replicas naming the same peer hash it the same way.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerUrl(Arc<str>);

impl PeerUrl {
    /// Parses `http(s)://host[:port]` (no path, query or credentials).
    pub fn parse(s: &str) -> Result<PeerUrl, String> {
        let url = url::Url::parse(s).map_err(|e| format!("{s:?} is not a URL: {e}"))?;
        let scheme = url.scheme();
        if scheme != "http" && scheme != "https" {
            return Err(format!("{s:?} must be an http:// or https:// URL"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(format!("{s:?} must not carry credentials"));
        }
        if !matches!(url.path(), "" | "/") || url.query().is_some() || url.fragment().is_some() {
            return Err(format!("{s:?} must be scheme://host:port with no path"));
        }
        let host = url.host_str().filter(|h| !h.is_empty()).ok_or_else(|| format!("{s:?} has no host"))?;
        let port = url.port_or_known_default().ok_or_else(|| format!("{s:?} has no port"))?;
        Ok(PeerUrl(format!("{scheme}://{host}:{port}").into()))
    }

    /// The URL of a peer found at `addr` (a resolved `peers_dns` address).
    pub fn from_addr(https: bool, addr: SocketAddr) -> PeerUrl {
        let scheme = if https { "https" } else { "http" };
        PeerUrl(format!("{scheme}://{addr}").into())
    }

    /// `scheme://host:port`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn is_https(&self) -> bool {
        self.0.starts_with("https://")
    }

    /// `host:port`, as sent in a `Host` header.
    pub fn authority(&self) -> &str {
        self.0.split_once("://").map_or(&self.0, |(_, rest)| rest)
    }
}

impl FromStr for PeerUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PeerUrl::parse(s)
    }
}

impl AsRef<str> for PeerUrl {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PeerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for PeerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
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

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCluster {
    listen: Option<String>,
    #[serde(rename = "self")]
    self_url: String,
    peers: Option<Vec<String>>,
    peers_dns: Option<String>,
    secret_file: String,
    ca_file: Option<String>,
    tls_name: Option<String>,
}

impl Validator<'_> {
    pub(super) fn cluster(&self, c: RawCluster, server: &ServerConfig) -> Result<ClusterConfig, ConfigError> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;
    use std::path::Path;
    use std::time::Duration;

    #[test]
    fn shared_and_cluster_parse_into_types_with_redacted_secrets() {
        let dir = secrets_dir();
        let c = parse_in(dir.path(), SHARED_AND_CLUSTER, &env_of(&[("POD_IP", "10.0.0.2")])).unwrap();
        let shared = c.shared.as_ref().unwrap();
        assert_eq!((shared.bucket.as_str(), shared.prefix.as_str()), ("larder-cache", "mirror/v1"));
        assert_eq!(shared.endpoint.as_deref(), Some("http://garage.storage:3900"));
        assert_eq!(shared.region, "garage");
        let crate::config::SharedCredentials::Static { access_key_id, .. } = &shared.credentials else {
            panic!("keys from files")
        };
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
