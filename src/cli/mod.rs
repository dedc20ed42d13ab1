//! The operator commands (`larder prefetch`, `larder purge`,
//! `larder status`): clients of a running larder's admin listener. Where
//! to find it, which token to send and which certificate to trust come
//! from flags, the environment, or larder's own config file (`--config`:
//! its `server.admin_listen`, `[admin] token_file` or else the token larder
//! generates in `cache.dir`, and `[admin] tls`), in that order; the default
//! is `http://127.0.0.1:9090` with the token generated in the default
//! config's cache folder (`./larder-data/admin-token`) if there is one.

pub mod check_config;
pub mod client;
pub mod prefetch;
pub mod progress;
pub mod seed;
pub mod status;
pub mod verify;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use http::Method;

use crate::config::{Config, GENERATED_ADMIN_TOKEN_FILE, Secret, parse_admin_token};
use crate::server::admin::status::Status;
use crate::server::admin::status_page::bytes;
use client::{AdminClient, CallError, Found, Trust};

/// The admin URL when nothing says otherwise.
pub const DEFAULT_ADMIN: &str = "http://127.0.0.1:9090";
/// Environment variable holding the token itself.
pub const TOKEN_ENV: &str = "LARDER_ADMIN_TOKEN";

/// Where the admin listener is and how to authenticate, as given.
#[derive(Debug, Default)]
pub struct Target {
    /// `--admin` (or `LARDER_ADMIN`).
    pub admin: Option<String>,
    /// `--token-file` (or `LARDER_ADMIN_TOKEN_FILE`).
    pub token_file: Option<PathBuf>,
    /// `LARDER_ADMIN_TOKEN`.
    pub token: Option<String>,
    /// `--ca-file` (or `LARDER_ADMIN_CA_FILE`): CA certificates (PEM) to
    /// trust for an https admin listener, beside the web PKI roots.
    pub ca_file: Option<PathBuf>,
    /// `--tls-name` (or `LARDER_ADMIN_TLS_NAME`): the DNS name the admin
    /// certificate is verified under, instead of the URL's host.
    pub tls_name: Option<String>,
    /// `--config`, as given: named in messages.
    pub config_path: Option<PathBuf>,
}

/// The URL clients use for a listen address: a wildcard becomes loopback.
fn url_of(listen: SocketAddr, tls: bool) -> String {
    let ip = match listen.ip() {
        std::net::IpAddr::V4(v4) if v4.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(v6) if v6.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    format!("{}://{}", if tls { "https" } else { "http" }, SocketAddr::new(ip, listen.port()))
}

fn read_token(path: &Path) -> Result<Secret, CallError> {
    let text = std::fs::read_to_string(path).map_err(|e| CallError::Usage(format!("{}: {e}", path.display())))?;
    parse_admin_token(&text).map_err(|e| CallError::Usage(format!("{}: {e}", path.display())))
}

/// The token larder generated at start-up, when `config` (or, without
/// `--config`, the embedded default config) names no `[admin] token_file`
/// and the file exists; with the file's path either way (`None` when a
/// token file is configured). One that exists but cannot be read (another
/// user's mode 0600 file) is an error that says so.
fn generated_token(config: Option<&Config>) -> Result<(Option<Secret>, Option<PathBuf>), CallError> {
    let dir = match config {
        Some(c) if c.admin.token_file.is_some() => return Ok((None, None)),
        Some(c) => c.cache.dir.clone(),
        None => match Config::embedded_default() {
            Ok(c) => c.cache.dir,
            Err(_) => return Ok((None, None)),
        },
    };
    let path = dir.join(GENERATED_ADMIN_TOKEN_FILE);
    match std::fs::metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((None, Some(path))),
        _ => read_token(&path).map(|t| (Some(t), Some(path.clone()))).map_err(|e| {
            CallError::Usage(format!(
                "{e} (the token larder writes when its admin listener is on loopback without [admin] \
                 token_file: run as larder's user, or pass --token-file)"
            ))
        }),
    }
}

/// Reads the PEM certificates of `path`.
fn read_certs(path: &Path) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, CallError> {
    let usage = |e: &dyn std::fmt::Display| CallError::Usage(format!("{}: {e}", path.display()));
    let pem = std::fs::read(path).map_err(|e| usage(&e))?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice()).collect::<Result<Vec<_>, _>>().map_err(|e| usage(&e))?;
    if certs.is_empty() {
        return Err(usage(&"no PEM certificate"));
    }
    Ok(certs)
}

impl Target {
    /// The client for this target; `config` is larder's config when `--config` was given.
    pub fn client(&self, config: Option<&Config>) -> Result<AdminClient, CallError> {
        let admin_tls = config.and_then(|c| c.admin.tls.as_ref());
        let admin = match (&self.admin, config.and_then(|c| c.server.admin_listen)) {
            (Some(url), _) => url.clone(),
            (None, Some(listen)) => url_of(listen, admin_tls.is_some()),
            (None, None) => DEFAULT_ADMIN.to_owned(),
        };
        let config_name = self.config_path.as_ref().map(|p| p.display().to_string());
        let mut found = Found {
            url_from: match (&self.admin, config.and_then(|c| c.server.admin_listen)) {
                (Some(_), _) => Some("--admin (or LARDER_ADMIN)".to_owned()),
                (None, Some(_)) => {
                    Some(format!("server.admin_listen of {}", config_name.as_deref().unwrap_or("larder's config")))
                }
                (None, None) => None,
            },
            tls_in_config: admin_tls.is_some(),
            ..Found::default()
        };
        let token = match (&self.token_file, &self.token, config.and_then(|c| c.admin.token_file.as_ref())) {
            (Some(path), _, _) => {
                found.token_from = Some(format!("{} (--token-file, or LARDER_ADMIN_TOKEN_FILE)", path.display()));
                Some(read_token(path)?)
            }
            (None, Some(token), _) => {
                found.token_from = Some(TOKEN_ENV.to_owned());
                Some(parse_admin_token(token).map_err(|e| CallError::Usage(format!("{TOKEN_ENV}: {e}")))?)
            }
            (None, None, Some(path)) => {
                found.token_from = Some(format!(
                    "{} ([admin] token_file of {})",
                    path.display(),
                    config_name.as_deref().unwrap_or("--config")
                ));
                Some(read_token(path)?)
            }
            (None, None, None) => {
                let (token, path) = generated_token(config)?;
                found.token_looked = vec![
                    "--token-file (and LARDER_ADMIN_TOKEN_FILE) not given".to_owned(),
                    format!("{TOKEN_ENV} not set"),
                    match &config_name {
                        Some(name) => format!("{name} has no [admin] token_file"),
                        None => "no --config given".to_owned(),
                    },
                ];
                if let Some(path) = &path {
                    match &token {
                        Some(_) => found.token_from = Some(format!("{} (generated by larder)", path.display())),
                        None => found.token_looked.push(format!(
                            "no token larder generated at {}{}",
                            path.display(),
                            if config.is_none() { " (the embedded default's cache folder)" } else { "" }
                        )),
                    }
                }
                token
            }
        };
        let name = self
            .tls_name
            .as_deref()
            .map(|n| {
                rustls::pki_types::ServerName::try_from(n.to_owned())
                    .map_err(|e| CallError::Usage(format!("--tls-name {n:?}: {e}")))
            })
            .transpose()?;
        let trust = Trust {
            name,
            extra_roots: self.ca_file.as_deref().map(read_certs).transpose()?.unwrap_or_default(),
            // With --config, larder's own admin certificate is trusted as
            // itself, whatever names it carries (127.0.0.1 rarely is one).
            pinned: admin_tls.map(|t| read_certs(&t.cert)).transpose()?.and_then(|certs| certs.into_iter().next()),
        };
        Ok(AdminClient::new(&admin, token, trust)?.with_found(found))
    }
}

/// `larder purge UPSTREAM [REPO]`.
pub async fn purge(client: &AdminClient, upstream: &str, repo: Option<&str>) -> Result<(), CallError> {
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("upstream", upstream);
    if let Some(repo) = repo {
        query.append_pair("repo", repo);
    }
    let purged = client.call_json(Method::POST, &format!("/purge?{}", query.finish())).await?;
    let n = |k: &str| purged[k].as_u64().unwrap_or(0);
    let what = match repo {
        Some(repo) => format!("{upstream}/{repo}"),
        None => upstream.to_owned(),
    };
    if ["tags", "members", "blobs", "manifests", "bytes"].iter().all(|k| n(k) == 0) {
        // Rather than a line of zeros: a name never pulled (or purged
        // already), perhaps a typo.
        println!("nothing cached for {what}: nothing purged here");
    } else {
        println!(
            "purged {what}: {} tags, {} membership rows, {} blobs, {} manifests, {} freed",
            n("tags"),
            n("members"),
            n("blobs"),
            n("manifests"),
            bytes(n("bytes"))
        );
    }
    // In a cluster, every other replica was asked to purge the same.
    let replicas = purged["replicas"].as_array().cloned().unwrap_or_default();
    let mut missed = Vec::new();
    for r in &replicas {
        let peer = r["peer"].as_str().unwrap_or("?");
        match r["result"].as_str() {
            Some("purged") => {
                let n = |k: &str| r["purged"][k].as_u64().unwrap_or(0);
                println!(
                    "  replica {peer}: {} tags, {} membership rows, {} blobs, {} manifests, {} freed",
                    n("tags"),
                    n("members"),
                    n("blobs"),
                    n("manifests"),
                    bytes(n("bytes"))
                );
            }
            result => {
                let result = result.unwrap_or("?");
                println!("  replica {peer}: {result}: {}", r["error"].as_str().unwrap_or(""));
                missed.push(peer.to_owned());
            }
        }
    }
    if !missed.is_empty() {
        return Err(CallError::Protocol(format!(
            "not purged on {}; it keeps what it held: run the purge again once it is up",
            missed.join(", ")
        )));
    }
    Ok(())
}

/// `larder status [--json]`.
pub async fn status(client: &AdminClient, json: bool) -> Result<(), CallError> {
    let value = client.call_json(Method::GET, "/status").await?;
    if json {
        println!("{value:#}");
        return Ok(());
    }
    let status: Status = serde_json::from_value(value)
        .map_err(|e| CallError::Protocol(format!("the status answer has an unexpected shape: {e}")))?;
    print!("{}", status::render(&status, client.base()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_listen_address_is_reached_on_loopback() {
        assert_eq!(url_of("0.0.0.0:9090".parse().unwrap(), false), "http://127.0.0.1:9090");
        assert_eq!(url_of("[::]:9090".parse().unwrap(), false), "http://[::1]:9090");
        assert_eq!(url_of("10.1.2.3:9191".parse().unwrap(), false), "http://10.1.2.3:9191");
        assert_eq!(url_of("0.0.0.0:9090".parse().unwrap(), true), "https://127.0.0.1:9090");
    }

    #[test]
    fn flags_win_over_the_environment_and_the_config() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("t"), "file-token-0123456789\n").unwrap();
        let text = "[server]\nadmin_listen = \"0.0.0.0:9191\"\n[admin]\ntoken_file = \"t\"\n\
                    [[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\n";
        let config = Config::parse(text, "c.toml", Some(dir.path())).unwrap();
        let from_config = Target::default().client(Some(&config)).unwrap();
        assert_eq!(from_config.base(), "http://127.0.0.1:9191");
        let flagged = Target { admin: Some("http://127.0.0.1:1/".into()), ..Default::default() };
        assert_eq!(flagged.client(Some(&config)).unwrap().base(), "http://127.0.0.1:1");
        assert_eq!(Target::default().client(None).unwrap().base(), DEFAULT_ADMIN);
        let short = Target { token: Some("short".into()), ..Default::default() };
        assert!(matches!(short.client(None), Err(CallError::Usage(_))));
    }
}
