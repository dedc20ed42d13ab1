//! An upstream's credentials, kept current (DESIGN.md rule 6): fixed ones
//! from the config, a `password_file` re-read when it changes (a Kubernetes
//! Secret rotated under a running pod), or a `credential_helper` run again
//! before its answer grows old. When upstream refuses credentials, the
//! next use reads the file or runs the helper again at once. Concurrent
//! users share one read or one helper run.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::helper;
use crate::coalesce::SingleFlight;
use crate::config::{CredentialSource, Credentials, Secret};
use crate::error::{Error, UpstreamError};
use crate::metrics::metrics;

/// How often a `password_file` is read again while it is in use.
pub const PASSWORD_FILE_RECHECK: Duration = Duration::from_secs(2);
/// A changed `password_file` is used only once two reads this far apart
/// agree: a file rewritten in place (rather than by Kubernetes' symlink
/// swap) can be read half-written, and a prefix of the new password sent
/// upstream is a refused login that counts towards a lockout.
pub const PASSWORD_FILE_SETTLE: Duration = Duration::from_millis(250);
/// How long a credential helper's answer is used before the helper runs
/// again. Docker's helpers say nothing about expiry; ECR's passwords last
/// 12 h, and a refused password makes larder run the helper at once.
pub const HELPER_ANSWER_LIFETIME: Duration = Duration::from_secs(300);

pub struct CredentialStore {
    upstream: String,
    /// The registry host (and port) handed to a credential helper.
    server: String,
    source: Source,
    /// Shared with the read task, which may outlive a caller.
    slot: Arc<Mutex<Slot>>,
    reads: SingleFlight<(), Credentials>,
}

enum Source {
    Fixed,
    File {
        username: String,
        path: PathBuf,
    },
    /// The helper program, `docker-credential-<name>`.
    Helper(String),
}

/// The credentials in use. A std Mutex guards it: never held across `.await`.
#[derive(Default)]
struct Slot {
    credentials: Option<Credentials>,
    /// When they were read; `None` once upstream refused them, so that the
    /// next use reads again (a file that cannot be read keeps them).
    read: Option<Instant>,
}

impl CredentialStore {
    pub fn new(upstream: &str, server: &str, config: &CredentialSource) -> CredentialStore {
        let now = Some(Instant::now());
        let (source, slot) = match config {
            CredentialSource::Fixed(c) => (Source::Fixed, Slot { credentials: Some(c.clone()), read: now }),
            CredentialSource::File { username, path, loaded } => (
                Source::File { username: username.clone(), path: path.clone() },
                Slot {
                    credentials: Some(Credentials { username: username.clone(), password: loaded.clone() }),
                    read: now,
                },
            ),
            CredentialSource::Helper(name) => (Source::Helper(helper::program(name)), Slot::default()),
        };
        CredentialStore {
            upstream: upstream.to_owned(),
            server: server.to_owned(),
            source,
            slot: Arc::new(Mutex::new(slot)),
            reads: SingleFlight::default(),
        }
    }

    /// The credentials to send now.
    pub async fn current(&self) -> Result<Credentials, UpstreamError> {
        let fresh_for = match &self.source {
            Source::Fixed => Duration::MAX,
            Source::File { .. } => PASSWORD_FILE_RECHECK,
            Source::Helper(_) => HELPER_ANSWER_LIFETIME,
        };
        {
            let slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
            if let (Some(c), Some(read)) = (&slot.credentials, slot.read) {
                if read.elapsed() < fresh_for || matches!(self.source, Source::Fixed) {
                    return Ok(c.clone());
                }
            }
        }
        let (result, _) = self.reads.run((), || self.read()).await;
        match result {
            Ok(c) => Ok(c),
            Err(Error::Upstream(e)) => Err(e),
            Err(e) => {
                tracing::warn!(upstream = self.upstream, error = %e, "reading the upstream's credentials failed");
                Err(UpstreamError::CredentialsUnavailable { upstream: self.upstream.clone() })
            }
        }
    }

    /// Upstream refused `used`: the next [`Self::current`] reads the file
    /// or runs the helper again, unless someone did since.
    pub fn refused(&self, used: &Credentials) {
        let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        if slot.credentials.as_ref() == Some(used) {
            slot.read = None;
        }
    }

    /// Reads the credentials from their source in a task of its own (the
    /// caller may go away), and keeps them.
    fn read(&self) -> impl Future<Output = Result<Credentials, Error>> + Send + 'static {
        let (upstream, server, slot) = (self.upstream.clone(), self.server.clone(), Arc::clone(&self.slot));
        let (kept, refused) = {
            let slot = slot.lock().unwrap_or_else(|p| p.into_inner());
            (slot.credentials.clone(), slot.read.is_none())
        };
        let source = match &self.source {
            Source::Fixed => None,
            Source::File { username, path } => Some(Err((username.clone(), path.clone()))),
            Source::Helper(program) => Some(Ok(program.clone())),
        };
        async move {
            let fresh = match source {
                None => return kept.ok_or_else(|| Error::Internal("fixed credentials are missing".into())),
                Some(Ok(helper)) => match helper::get(&helper, &server).await {
                    Ok(c) => c,
                    Err(e) => {
                        metrics().upstream_auth_failures.with_label_values(&[&upstream, e.reason()]).inc();
                        match kept.filter(|_| !refused) {
                            // Only grown old, not refused: ECR's passwords
                            // outlive the helper's answer by hours, so a
                            // helper that fails now (its cloud API down)
                            // does not stop pulls. Run again later.
                            Some(c) => {
                                tracing::warn!(upstream, error = %e, "credential helper failed; keeping its last answer");
                                c
                            }
                            // The error quotes at most the first line of
                            // the helper's stderr; it goes to the log only.
                            None => {
                                tracing::warn!(upstream, error = %e, "credential helper failed");
                                return Err(Error::Upstream(UpstreamError::CredentialsUnavailable { upstream }));
                            }
                        }
                    }
                },
                Some(Err((username, path))) => read_password_file(&upstream, username, path, kept).await?,
            };
            let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
            *slot = Slot { credentials: Some(fresh.clone()), read: Some(Instant::now()) };
            Ok(fresh)
        }
    }
}

/// Reads a `password_file` again on the blocking pool. A file that cannot
/// be read or is empty (a Secret mid-rotation, a file truncated to be
/// rewritten) keeps the password read before, and so does a file still
/// changing ([`PASSWORD_FILE_SETTLE`]).
async fn read_password_file(
    upstream: &str,
    username: String,
    path: PathBuf,
    kept: Option<Credentials>,
) -> Result<Credentials, Error> {
    let shown = path.display().to_string();
    let mut read = read_password(path.clone()).await;
    let changed = |text: &String| kept.as_ref().is_some_and(|c| c.password.expose() != text);
    if let (Ok(text), Some(_)) = (&read, &kept) {
        if changed(text) {
            tokio::time::sleep(PASSWORD_FILE_SETTLE).await;
            if read_password(path).await.as_ref().ok() != Some(text) {
                read = Err("it is still being written".to_owned());
            }
        }
    }
    match (read, kept) {
        (Ok(text), kept) => {
            if kept.is_some_and(|c| c.password.expose() != text) {
                tracing::info!(upstream, file = shown, "password_file changed; using the new password");
            }
            Ok(Credentials { username, password: Secret::new(text) })
        }
        (Err(why), Some(c)) => {
            metrics().upstream_auth_failures.with_label_values(&[upstream, "password_file"]).inc();
            tracing::warn!(upstream, file = shown, why, "cannot use password_file; keeping the password read before");
            Ok(c)
        }
        (Err(why), None) => {
            metrics().upstream_auth_failures.with_label_values(&[upstream, "password_file"]).inc();
            tracing::warn!(upstream, file = shown, why, "cannot use password_file");
            Err(Error::Upstream(UpstreamError::CredentialsUnavailable { upstream: upstream.to_owned() }))
        }
    }
}

/// The password in a `password_file`: its text without the trailing line
/// break; an empty file is an error, as an unreadable one.
async fn read_password(path: PathBuf) -> Result<String, String> {
    let read = crate::blocking::blocking(move || Ok(std::fs::read_to_string(&path)?)).await;
    match read {
        Ok(text) => match text.trim_end_matches(['\r', '\n']) {
            "" => Err("the file is empty".to_owned()),
            password => Ok(password.to_owned()),
        },
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A store whose helper prints `user:<contents of secret>`, or fails
    /// while `secret` is missing.
    fn helper_store(dir: &std::path::Path) -> (CredentialStore, PathBuf) {
        let (program, secret) = (dir.join("docker-credential-test"), dir.join("secret"));
        let script = format!(
            "#!/bin/sh\n[ -f {s:?} ] || {{ echo 'no secret'; exit 1; }}\nprintf '{{\"Username\":\"user\",\"Secret\":\"%s\"}}' \"$(cat {s:?})\"\n",
            s = secret
        );
        std::fs::write(&program, script).unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        let store = CredentialStore::new("credentials-test", "r.example", &CredentialSource::Helper("x".into()));
        let store = CredentialStore { source: Source::Helper(program.display().to_string()), ..store };
        (store, secret)
    }

    #[tokio::test]
    async fn a_refused_helper_answer_runs_the_helper_again_and_an_old_one_survives_a_failing_helper() {
        let dir = tempfile::tempdir().unwrap();
        let (store, secret) = helper_store(dir.path());
        std::fs::write(&secret, "one").unwrap();
        let first = store.current().await.unwrap();
        assert_eq!(first.password.expose(), "one");

        std::fs::write(&secret, "two").unwrap();
        assert_eq!(store.current().await.unwrap(), first, "the answer is kept while fresh");
        store.refused(&first);
        let second = store.current().await.unwrap();
        assert_eq!(second.password.expose(), "two", "refused: the helper ran again");
        store.refused(&first);
        assert_eq!(store.current().await.unwrap(), second, "refusing an answer already replaced changes nothing");

        // The answer grows old and the helper fails: the old answer stays.
        std::fs::remove_file(&secret).unwrap();
        store.slot.lock().unwrap().read = Instant::now().checked_sub(HELPER_ANSWER_LIFETIME);
        assert_eq!(store.current().await.unwrap(), second);
        // Refused, and the helper fails: an error that names the upstream
        // and nothing of the helper (its message goes to the log).
        store.refused(&second);
        let e = store.current().await.unwrap_err().to_string();
        assert_eq!(e, "credentials for upstream \"credentials-test\" are unavailable");
    }

    /// How many times the helper of [`helper_store`] ran.
    fn runs(counter: &std::path::Path) -> usize {
        std::fs::read_to_string(counter).map_or(0, |s| s.lines().count())
    }

    #[tokio::test]
    async fn a_helper_answer_grown_old_runs_the_helper_again_without_any_401() {
        let dir = tempfile::tempdir().unwrap();
        let (store, secret) = helper_store(dir.path());
        let counter = dir.path().join("runs");
        // The same helper, counting its runs.
        let Source::Helper(program) = &store.source else { unreachable!("a helper store") };
        let script = std::fs::read_to_string(program).unwrap();
        let counting = script.replacen("#!/bin/sh\n", &format!("#!/bin/sh\necho run >> {counter:?}\n"), 1);
        std::fs::write(program, counting).unwrap();
        std::fs::write(&secret, "one").unwrap();

        assert_eq!(store.current().await.unwrap().password.expose(), "one");
        assert_eq!(runs(&counter), 1);
        std::fs::write(&secret, "two").unwrap();

        // The clock moves (tokio's, which the store reads): just short of
        // the answer's lifetime, it is used as it is.
        tokio::time::pause();
        tokio::time::advance(HELPER_ANSWER_LIFETIME - Duration::from_secs(1)).await;
        tokio::time::resume();
        assert_eq!(store.current().await.unwrap().password.expose(), "one", "still fresh");
        assert_eq!(runs(&counter), 1, "no run while the answer is fresh");

        // Past it, the next use runs the helper once, though nothing refused the old answer.
        tokio::time::pause();
        tokio::time::advance(Duration::from_secs(2)).await;
        tokio::time::resume();
        assert_eq!(store.current().await.unwrap().password.expose(), "two", "the helper's new answer");
        assert_eq!(runs(&counter), 2, "one run for the old answer");
        assert_eq!(store.current().await.unwrap().password.expose(), "two");
        assert_eq!(runs(&counter), 2, "the new answer is fresh again");
    }

    #[tokio::test]
    async fn a_password_file_is_read_again_when_refused_and_kept_when_unreadable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("password");
        std::fs::write(&path, "old\n").unwrap();
        let source = CredentialSource::File { username: "u".into(), path: path.clone(), loaded: Secret::new("old") };
        let store = CredentialStore::new("credentials-test", "r.example", &source);
        let old = store.current().await.unwrap();
        assert_eq!(old.password.expose(), "old");
        std::fs::write(&path, "new\n").unwrap();
        store.refused(&old);
        let new = store.current().await.unwrap();
        assert_eq!(new.password.expose(), "new", "trailing newline trimmed");
        std::fs::remove_file(&path).unwrap();
        store.refused(&new);
        assert_eq!(store.current().await.unwrap(), new, "an unreadable file keeps the password read before");
        std::fs::write(&path, "").unwrap();
        store.refused(&new);
        assert_eq!(store.current().await.unwrap(), new, "an empty file keeps the password read before");
        std::fs::write(&path, "\n").unwrap();
        store.refused(&new);
        assert_eq!(store.current().await.unwrap(), new, "so does a file of one line break");
    }

    #[tokio::test]
    async fn a_password_file_still_being_written_is_not_used_until_it_settles() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("password");
        std::fs::write(&path, "old\n").unwrap();
        let source = CredentialSource::File { username: "u".into(), path: path.clone(), loaded: Secret::new("old") };
        let store = Arc::new(CredentialStore::new("credentials-test", "r.example", &source));
        let old = store.current().await.unwrap();
        // An in-place rewrite, caught half-way: the reader sees a prefix,
        // and the rest lands while it waits to read again.
        std::fs::write(&path, "new-pass").unwrap();
        store.refused(&old);
        let reading = tokio::spawn({
            let store = Arc::clone(&store);
            async move { store.current().await }
        });
        tokio::time::sleep(PASSWORD_FILE_SETTLE / 5).await;
        std::fs::write(&path, "new-password-whole\n").unwrap();
        assert_eq!(reading.await.unwrap().unwrap(), old, "the prefix was never used");
        store.refused(&old);
        assert_eq!(store.current().await.unwrap().password.expose(), "new-password-whole", "settled: used");
    }

    #[tokio::test]
    async fn an_unavailable_helper_is_a_general_error_for_the_client() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _secret) = helper_store(dir.path());
        // The helper prints its answer and then fails.
        let Source::Helper(program) = &store.source else { unreachable!("a helper store") };
        std::fs::write(program, "#!/bin/sh\necho '{\"Username\":\"u\",\"Secret\":\"s3cret\"}'\nexit 1\n").unwrap();
        let e = store.current().await.unwrap_err();
        assert!(matches!(&e, UpstreamError::CredentialsUnavailable { upstream } if upstream == "credentials-test"));
        let shown = crate::error::Error::Upstream(e).to_string();
        assert_eq!(shown, "credentials for upstream \"credentials-test\" are unavailable");
    }
}
