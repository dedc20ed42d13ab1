//! `[[server.auth.grant]]`: which clients may pull which repositories of
//! which upstreams. Read after the upstreams (a grant names them) and
//! `[server]` (a grant names htpasswd users or certificate names, and the
//! server must have a way to learn them).

use super::server::{RawGrant, ServerConfig};
use super::upstream::UpstreamConfig;
use super::{ConfigError, Validator};
use crate::policy::{Grant, Principal, RepoGlob};

impl Validator<'_> {
    pub(super) fn grants(
        &self,
        raw: &[RawGrant],
        upstreams: &[UpstreamConfig],
        server: &ServerConfig,
    ) -> Result<Vec<Grant>, ConfigError> {
        let mut grants = Vec::with_capacity(raw.len());
        for (i, g) in raw.iter().enumerate() {
            let key = |k: &str| format!("server.auth.grant[{i}].{k}");
            if g.who.is_empty() {
                return Err(self.err(key("who"), "name at least one user, cn:<name> or san:<name>"));
            }
            let who = g
                .who
                .iter()
                .map(|w| Principal::parse(w).map_err(|e| self.err(key("who"), e)))
                .collect::<Result<Vec<_>, _>>()?;
            for w in &who {
                let missing = match w {
                    Principal::User(_) if server.auth.is_none() => {
                        Some("an htpasswd user needs [server.auth] htpasswd")
                    }
                    Principal::CommonName(_) | Principal::AltName(_)
                        if server.tls.as_ref().is_none_or(|t| t.client_ca.is_none()) =>
                    {
                        Some("a certificate name needs [server.tls] client_ca (verified client certificates)")
                    }
                    _ => None,
                };
                if let Some(why) = missing {
                    return Err(self.err(key("who"), format!("{:?}: {why}", w.to_string())));
                }
            }
            let upstreams = match &g.upstreams {
                None => None,
                Some(names) => Some(
                    names
                        .iter()
                        .map(|n| {
                            upstreams
                                .iter()
                                .find(|u| &u.name == n || u.aliases.contains(n))
                                .map(|u| u.name.clone())
                                .ok_or_else(|| {
                                    self.err(key("upstreams"), format!("{n:?} is not an upstream's name or alias"))
                                })
                        })
                        .collect::<Result<Vec<_>, _>>()?,
                ),
            };
            let repositories = g
                .repositories
                .iter()
                .flatten()
                .enumerate()
                .map(|(j, r)| RepoGlob::parse(r).map_err(|e| self.err(format!("{}[{j}]", key("repositories")), e)))
                .collect::<Result<Vec<_>, _>>()?;
            grants.push(Grant { who, upstreams, repositories });
        }
        Ok(grants)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::*;
    use crate::policy::Principal;

    #[test]
    fn grants_name_known_upstreams_and_identities_the_server_can_learn() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("htpasswd"),
            "team-a:$2y$05$abcdefghijklmnopqrstuuJ1Y4y0v7yqzQG4bQ3p5n3mM2eUe0xW2\n",
        )
        .unwrap();
        let parse = |grants: &str| {
            let text = format!(
                "[server.auth]\nhtpasswd = \"htpasswd\"\n{grants}\n[[upstream]]\nname = \"ghcr.io\"\nurl = \"https://ghcr.io\"\naliases = [\"ghcr.example\"]\n"
            );
            crate::config::Config::parse(&text, "t.toml", Some(dir.path()))
        };
        let c = parse("[[server.auth.grant]]\nwho = [\"team-a\"]\nupstreams = [\"ghcr.example\"]\nrepositories = [\"team-a/**\"]\n").unwrap();
        let g = &c.server.grants[0];
        assert_eq!(g.who, [Principal::User("team-a".into())]);
        assert_eq!(g.upstreams.as_deref(), Some(&["ghcr.io".to_owned()][..]), "an alias names its upstream");
        assert_eq!(g.repositories[0].as_str(), "team-a/**");
        let cases = [
            ("who = []", "server.auth.grant[0].who", "at least one"),
            ("who = [\"cn:ci\"]", "server.auth.grant[0].who", "client_ca"),
            ("who = [\"x\"]\nupstreams = [\"quay.io\"]", "server.auth.grant[0].upstreams", "not an upstream"),
            ("who = [\"x\"]\nrepositories = [\"team/**x\"]", "server.auth.grant[0].repositories[0]", "whole segment"),
            ("who = [\"uid:7\"]", "server.auth.grant[0].who", "cn:"),
        ];
        for (lines, key, words) in cases {
            let e = parse(&format!("[[server.auth.grant]]\n{lines}\n")).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")) && e.contains(words), "{lines}: {e}");
        }
        // Grants for certificate names alone need no htpasswd.
        let e = parse_in_without_htpasswd("[[server.auth.grant]]\nwho = [\"team-a\"]\n");
        assert!(e.contains("htpasswd"), "{e}");
    }

    fn parse_in_without_htpasswd(lines: &str) -> String {
        let text = format!("[server.auth]\n{lines}\n{MINIMAL}");
        parse(&text).unwrap_err().to_string()
    }
}
