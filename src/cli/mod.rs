//! The operator commands (`larder prefetch`, `larder purge`,
//! `larder status`): clients of a running larder's admin listener. Where
//! to find it and which token to send come from flags, the environment, or
//! larder's own config file (`--config`: its `server.admin_listen` and
//! `[admin] token_file`), in that order; the default is
//! `http://127.0.0.1:9090` without a token.

pub mod client;
pub mod prefetch;
pub mod status;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use http::Method;

use crate::config::{Config, Secret, parse_admin_token};
use crate::server::admin::status::Status;
use crate::server::admin::status_page::bytes;
use client::{AdminClient, CallError};

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
}

/// The URL clients use for a listen address: a wildcard becomes loopback.
fn url_of(listen: SocketAddr) -> String {
    let ip = match listen.ip() {
        std::net::IpAddr::V4(v4) if v4.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(v6) if v6.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    format!("http://{}", SocketAddr::new(ip, listen.port()))
}

fn read_token(path: &Path) -> Result<Secret, CallError> {
    let text = std::fs::read_to_string(path).map_err(|e| CallError::Usage(format!("{}: {e}", path.display())))?;
    parse_admin_token(&text).map_err(|e| CallError::Usage(format!("{}: {e}", path.display())))
}

impl Target {
    /// The client for this target; `config` is larder's config when `--config` was given.
    pub fn client(&self, config: Option<&Config>) -> Result<AdminClient, CallError> {
        let admin = match (&self.admin, config.and_then(|c| c.server.admin_listen)) {
            (Some(url), _) => url.clone(),
            (None, Some(listen)) => url_of(listen),
            (None, None) => DEFAULT_ADMIN.to_owned(),
        };
        let token = match (&self.token_file, &self.token, config.and_then(|c| c.admin.token_file.as_ref())) {
            (Some(path), _, _) => Some(read_token(path)?),
            (None, Some(token), _) => {
                Some(parse_admin_token(token).map_err(|e| CallError::Usage(format!("{TOKEN_ENV}: {e}")))?)
            }
            (None, None, Some(path)) => Some(read_token(path)?),
            (None, None, None) => None,
        };
        AdminClient::new(&admin, token)
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
    println!(
        "purged {what}: {} tags, {} membership rows, {} blobs, {} manifests, {} freed",
        n("tags"),
        n("members"),
        n("blobs"),
        n("manifests"),
        bytes(n("bytes"))
    );
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
        assert_eq!(url_of("0.0.0.0:9090".parse().unwrap()), "http://127.0.0.1:9090");
        assert_eq!(url_of("[::]:9090".parse().unwrap()), "http://[::1]:9090");
        assert_eq!(url_of("10.1.2.3:9191".parse().unwrap()), "http://10.1.2.3:9191");
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
