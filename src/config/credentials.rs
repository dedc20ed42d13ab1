//! An upstream's credentials as the config gives them: a username with
//! exactly one password source (`password`, `password_file`,
//! `password_env`), or a `credential_helper`. Read here once; kept current
//! at run time by `crate::upstream`'s credential store.

use std::path::PathBuf;

use super::{ConfigError, Secret, Validator};

/// Longest `credential_helper` name (the program is `docker-credential-<name>`).
const MAX_HELPER_NAME: usize = 64;

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

/// The credential keys of an `[[upstream]]` table as written: all that
/// this module reads of it.
pub(super) struct RawCredentials {
    pub(super) username: Option<String>,
    pub(super) password: Option<String>,
    pub(super) password_file: Option<String>,
    pub(super) password_env: Option<String>,
    pub(super) credential_helper: Option<String>,
}

impl Validator<'_> {
    /// The upstream's credential source: a username with exactly one
    /// password source, or a credential helper, or nothing.
    pub(super) fn credentials(
        &self,
        key: &dyn Fn(&str) -> String,
        u: &RawCredentials,
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
                let text =
                    self.secret_text(&key("password_file"), &path)?.unwrap_or_else(|| super::SKIPPED_SECRET.into());
                let password = text.trim_end_matches(['\r', '\n']);
                if password.is_empty() {
                    return Err(self.err(key("password_file"), format!("{} is empty", path.display())));
                }
                Some(Ok((path, Secret::new(password))))
            }
            (None, None, Some(var)) => Some(Err(Secret::new(
                self.env_var(&key("password_env"), var, super::SKIPPED_SECRET)
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

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
}
