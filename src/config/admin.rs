//! `[admin]`: who may use the admin listener's mutating endpoints (the
//! token, the hosts a request may name), and whether it speaks TLS.

use std::path::PathBuf;

use serde::Deserialize;

use super::server::{ServerConfig, TlsConfig};
use super::{ConfigError, Secret, Validator, valid_host};

/// `[admin]`: who may use the admin listener's mutating endpoints, and
/// whether it speaks TLS.
#[derive(Debug, Clone, Default)]
pub struct AdminConfig {
    /// File holding the bearer token `POST /prefetch` and `/purge` need;
    /// re-read when it changes (a missing, empty or invalid file then
    /// means no token is accepted). Without it, a loopback admin listener
    /// writes a token of its own at start-up (see
    /// [`GENERATED_ADMIN_TOKEN_FILE`]); any other refuses them.
    pub token_file: Option<PathBuf>,
    /// `allowed_hosts`: the `Host` names, beyond loopback addresses,
    /// `localhost` and the listener's own bound address, that a mutating
    /// admin request may carry (DNS rebinding defence).
    pub allowed_hosts: Vec<AdminHost>,
    /// The admin listener's certificate: `[server.tls]`'s by default when
    /// that is set (`tls = "server"`), its own (`tls = { cert, key }`), or
    /// none (`tls = "off"`, or no `[server.tls]`). Never asks for client
    /// certificates: Prometheus and the kubelet's probes have none.
    pub tls: Option<TlsConfig>,
    /// Whether [`AdminConfig::tls`] is `[server.tls]`'s certificate (for
    /// `check-config`'s explanation).
    pub tls_is_server: bool,
}

/// File name, in `cache.dir`, of the admin token larder writes at start-up
/// when its admin listener is on loopback and `[admin] token_file` is not
/// set (mode 0600, a new token each start). `larder prefetch` and `purge`
/// read it through `--config`.
pub const GENERATED_ADMIN_TOKEN_FILE: &str = "admin-token";

/// One entry of `[admin] allowed_hosts`: matched against the host of a
/// mutating admin request's `Host` (port ignored), case-insensitively.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminHost {
    /// `larder-admin.larder.svc`: exactly this name.
    Name(String),
    /// `*.larder-headless.larder.svc`: any name ending in `.` + this.
    Subdomains(String),
    /// `10.0.0.5` or `fd00::5`: this address.
    Ip(std::net::IpAddr),
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

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    token_file: Option<String>,
    allowed_hosts: Option<Vec<String>>,
    /// `"server"`, `"off"` or `{ cert, key }`: read in [`Validator::admin_tls`].
    #[cfg_attr(test, schemars(with = "Option<AdminTlsForms>"))]
    tls: Option<toml::Value>,
}

/// `[admin] tls = { cert, key }`: the admin listener's own certificate.
#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdminTls {
    cert: String,
    key: String,
}

/// The forms `[admin] tls` takes, for the config reference's test.
#[cfg(test)]
#[derive(schemars::JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum AdminTlsForms {
    Mode(String),
    Own(RawAdminTls),
}

impl Validator<'_> {
    pub(super) fn admin(&self, raw: RawAdmin, server: &ServerConfig) -> Result<AdminConfig, ConfigError> {
        let token_file = match raw.token_file {
            None => None,
            Some(file) => {
                let path = self.path(&file);
                if let Some(text) = self.secret_text("admin.token_file", &path)? {
                    parse_admin_token(&text)
                        .map_err(|e| self.err("admin.token_file", format!("{}: {e}", path.display())))?;
                }
                Some(path)
            }
        };
        let allowed_hosts =
            raw.allowed_hosts.unwrap_or_default().iter().map(|h| self.admin_host(h)).collect::<Result<Vec<_>, _>>()?;
        let (tls, tls_is_server) = self.admin_tls(raw.tls.as_ref(), server)?;
        Ok(AdminConfig { token_file, allowed_hosts, tls, tls_is_server })
    }

    /// An `allowed_hosts` entry: a DNS name, `*.` and a DNS name, or an IP
    /// address; no port (the port of a request's `Host` is ignored).
    fn admin_host(&self, entry: &str) -> Result<AdminHost, ConfigError> {
        let key = "admin.allowed_hosts";
        let lower = entry.trim_end_matches('.').to_ascii_lowercase();
        if let Ok(ip) = lower.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() {
            return Ok(AdminHost::Ip(ip.to_canonical()));
        }
        let (name, wildcard) = match lower.strip_prefix("*.") {
            Some(rest) => (rest, true),
            None => (lower.as_str(), false),
        };
        if name.contains(':') || !valid_host(name) {
            return Err(self.err(
                key,
                format!(
                    "{entry:?} is not a host name like \"larder-admin.larder.svc\", \"*.larder.svc\" or an IP \
                     address (no scheme, port or path)"
                ),
            ));
        }
        Ok(if wildcard { AdminHost::Subdomains(name.to_owned()) } else { AdminHost::Name(name.to_owned()) })
    }

    /// `[admin] tls`: `"server"` (the default: `[server.tls]`'s certificate
    /// when that is set, else plain HTTP), `"off"`, or `{ cert, key }`.
    /// Returns the certificate and whether it is `[server.tls]`'s.
    fn admin_tls(
        &self,
        raw: Option<&toml::Value>,
        server: &ServerConfig,
    ) -> Result<(Option<TlsConfig>, bool), ConfigError> {
        // The admin listener never asks for client certificates.
        let from_server = || server.tls.as_ref().map(|t| TlsConfig { client_ca: None, ..t.clone() });
        match raw {
            None => Ok((from_server(), server.tls.is_some())),
            Some(toml::Value::String(mode)) if mode == "server" => {
                match from_server() {
                    Some(tls) => Ok((Some(tls), true)),
                    None => Err(self
                        .err("admin.tls", "\"server\" uses [server.tls]'s certificate, and there is no [server.tls]")),
                }
            }
            Some(toml::Value::String(mode)) if mode == "off" => Ok((None, false)),
            Some(toml::Value::Table(table)) => {
                let own: RawAdminTls = toml::Value::Table(table.clone())
                    .try_into()
                    .map_err(|e| self.err("admin.tls", format!("expected {{ cert = \"...\", key = \"...\" }}: {e}")))?;
                Ok((
                    Some(TlsConfig {
                        cert: self.readable("admin.tls.cert", &own.cert)?,
                        key: self.readable("admin.tls.key", &own.key)?,
                        client_ca: None,
                    }),
                    false,
                ))
            }
            Some(other) => Err(self.err(
                "admin.tls",
                format!("{other} is not \"server\", \"off\" or {{ cert = \"...\", key = \"...\" }}"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::config::test_support::*;

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
    fn admin_allowed_hosts_and_tls_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["tls.crt", "tls.key", "admin.crt", "admin.key"] {
            std::fs::write(dir.path().join(f), "pem").unwrap();
        }
        let parse_in = |text: &str| Config::parse(&format!("{text}\n{MINIMAL}"), "t.toml", Some(dir.path()));
        let hosts =
            parse_in("[admin]\nallowed_hosts = [\"Larder-Admin.larder.svc.\", \"*.larder.svc\", \"[fd00::5]\"]")
                .unwrap()
                .admin
                .allowed_hosts;
        assert_eq!(
            hosts,
            vec![
                AdminHost::Name("larder-admin.larder.svc".into()),
                AdminHost::Subdomains("larder.svc".into()),
                AdminHost::Ip("fd00::5".parse().unwrap()),
            ]
        );
        for bad in ["larder:9090", "http://larder", "*", "a/b", "*.*.x", ""] {
            let e = parse_in(&format!("[admin]\nallowed_hosts = [{bad:?}]")).unwrap_err().to_string();
            assert!(e.contains("`admin.allowed_hosts`"), "{bad}: {e}");
        }

        let server_tls = "[server]\ntls = { cert = \"tls.crt\", key = \"tls.key\", client_ca = \"tls.crt\" }";
        let follows = parse_in(server_tls).unwrap().admin;
        let tls = follows.tls.expect("[server.tls]'s certificate by default");
        assert_eq!((tls.cert, tls.client_ca, follows.tls_is_server), (dir.path().join("tls.crt"), None, true));
        assert!(parse_in(&format!("{server_tls}\n[admin]\ntls = \"off\"")).unwrap().admin.tls.is_none());
        assert!(parse_in("").unwrap().admin.tls.is_none(), "no [server.tls]: plain");
        let own = parse_in("[admin.tls]\ncert = \"admin.crt\"\nkey = \"admin.key\"").unwrap().admin;
        assert_eq!((own.tls.unwrap().key, own.tls_is_server), (dir.path().join("admin.key"), false));
        for (bad, says) in [
            ("[admin]\ntls = \"server\"", "no [server.tls]"),
            ("[admin]\ntls = \"on\"", "is not \"server\", \"off\""),
            ("[admin]\ntls = true", "is not \"server\", \"off\""),
            ("[admin.tls]\ncert = \"admin.crt\"", "missing field `key`"),
            ("[admin.tls]\ncert = \"admin.crt\"\nkey = \"admin.key\"\nclient_ca = \"x\"", "unknown field"),
            ("[admin.tls]\ncert = \"nope.crt\"\nkey = \"admin.key\"", "`admin.tls.cert`"),
        ] {
            let e = parse_in(bad).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("admin.tls"), "{bad}: {e}");
        }
    }
}
