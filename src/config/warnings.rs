//! What is valid but worth an operator's second look, one line each,
//! naming the key: `check-config` prints these, and larder logs them at
//! start.

use std::collections::BTreeSet;

use super::Config;
use crate::policy::Principal;

impl Config {
    /// Every warning: credentials of an upstream sent across sites (or a
    /// fallback on another site that pulls without them), a grant naming a
    /// user no password file has, and passwords sent in the clear.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = self.fallback_warnings();
        warnings.extend(self.grant_user_warnings());
        warnings.extend(self.cleartext_password_warning());
        warnings
    }

    /// [`Config::warnings`] but the ones read from secret files, for
    /// `check-config --without-secrets`: the htpasswd file (password
    /// hashes) is not opened, and the grant users it would check are
    /// listed as not checked instead.
    pub fn warnings_without_secrets(&self) -> Vec<String> {
        let mut warnings = self.fallback_warnings();
        warnings.extend(self.cleartext_password_warning());
        warnings
    }

    /// A grant that names a user the htpasswd file lacks gives nothing to
    /// anyone: nobody can sign in as them (a typo, or a user removed). The
    /// file is read here; one that cannot be read is left to start-up.
    fn grant_user_warnings(&self) -> Vec<String> {
        let Some(auth) = &self.server.auth else { return Vec::new() };
        let Ok(text) = std::fs::read_to_string(&auth.htpasswd) else { return Vec::new() };
        let users: BTreeSet<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .filter_map(|l| l.split_once(':').map(|(user, _)| user))
            .collect();
        let mut warnings = Vec::new();
        for (i, grant) in self.server.grants.iter().enumerate() {
            for who in &grant.who {
                if let Principal::User(user) = who {
                    if !users.contains(user.as_str()) {
                        warnings.push(format!(
                            "`server.auth.grant[{i}].who`: user {user:?} is in no password file: {} \
                             (server.auth.htpasswd) has no such user, so nobody can sign in as {user:?} and this \
                             grant gives them nothing; add them with `htpasswd -B`, or fix the name",
                            auth.htpasswd.display()
                        ));
                    }
                }
            }
        }
        warnings
    }

    /// HTTP Basic without TLS: every pull carries a password readable by
    /// anyone on the network path (a pod network, a node's neighbours).
    /// Quiet when the registry port is loopback (a TLS proxy in front).
    fn cleartext_password_warning(&self) -> Option<String> {
        let server = &self.server;
        if server.auth.is_none() || server.tls.is_some() || server.listen.ip().is_loopback() {
            return None;
        }
        Some(format!(
            "`server.auth.htpasswd`: clients send their passwords in the clear: HTTP Basic authentication on \
             server.listen {} without [server.tls], so anyone on the network path (the pod network, the node) can \
             read them; set [server.tls], or put a TLS proxy in front and listen on a loopback address",
            server.listen
        ))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn warnings_of(dir: &std::path::Path, text: &str) -> Vec<String> {
        let config = format!("{text}\n[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\n");
        Config::parse(&config, "t.toml", Some(dir)).unwrap().warnings()
    }

    #[test]
    fn a_grant_user_missing_from_the_password_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("htpasswd"), "# users\nteam-a:$2y$05$abcdefghijklmnopqrstuu\n").unwrap();
        let auth = "[server]\nlisten = \"127.0.0.1:5000\"\n[server.auth]\nhtpasswd = \"htpasswd\"\n";
        let grants =
            "[[server.auth.grant]]\nwho = [\"team-a\"]\n[[server.auth.grant]]\nwho = [\"team-a\", \"team-b\"]\n";
        let warnings = warnings_of(dir.path(), &format!("{auth}{grants}"));
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with("`server.auth.grant[1].who`: user \"team-b\" is in no password file"),
            "{warnings:?}"
        );
    }

    #[test]
    fn basic_authentication_without_tls_off_loopback_is_warned_about() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("htpasswd"), "team-a:$2y$05$abcdefghijklmnopqrstuu\n").unwrap();
        let on = |listen: &str| {
            warnings_of(
                dir.path(),
                &format!("[server]\nlisten = \"{listen}\"\n[server.auth]\nhtpasswd = \"htpasswd\"\n"),
            )
        };
        let warned = on("0.0.0.0:5000");
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(
            warned[0].starts_with("`server.auth.htpasswd`: clients send their passwords in the clear"),
            "{warned:?}"
        );
        assert!(on("127.0.0.1:5000").is_empty(), "loopback: a TLS proxy in front");
    }
}
