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
    File { username: String, path: PathBuf },
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
            CredentialSource::Helper(name) => (Source::Helper(name.clone()), Slot::default()),
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
            Err(e) => Err(UpstreamError::Auth(e.to_string())),
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
        let kept = slot.lock().unwrap_or_else(|p| p.into_inner()).credentials.clone();
        let source = match &self.source {
            Source::Fixed => None,
            Source::File { username, path } => Some(Err((username.clone(), path.clone()))),
            Source::Helper(name) => Some(Ok(name.clone())),
        };
        async move {
            let fresh = match source {
                None => return kept.ok_or_else(|| Error::Internal("fixed credentials are missing".into())),
                Some(Ok(helper)) => helper::get(&helper, &server).await.map_err(|e| {
                    metrics().upstream_auth_failures.with_label_values(&[&upstream, e.reason()]).inc();
                    Error::Upstream(UpstreamError::Auth(e.to_string()))
                })?,
                Some(Err((username, path))) => read_password_file(&upstream, username, path, kept).await?,
            };
            let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
            *slot = Slot { credentials: Some(fresh.clone()), read: Some(Instant::now()) };
            Ok(fresh)
        }
    }
}

/// Reads a `password_file` again on the blocking pool. A file that cannot
/// be read (a Secret mid-rotation) keeps the password read before.
async fn read_password_file(
    upstream: &str,
    username: String,
    path: PathBuf,
    kept: Option<Credentials>,
) -> Result<Credentials, Error> {
    let shown = path.display().to_string();
    let read = crate::blocking::blocking(move || Ok(std::fs::read_to_string(&path)?)).await;
    match (read, kept) {
        (Ok(text), kept) => {
            let password = Secret::new(text.trim_end_matches(['\r', '\n']));
            if kept.is_some_and(|c| c.password != password) {
                tracing::info!(upstream, file = shown, "password_file changed; using the new password");
            }
            Ok(Credentials { username, password })
        }
        (Err(e), Some(c)) => {
            metrics().upstream_auth_failures.with_label_values(&[upstream, "password_file"]).inc();
            tracing::warn!(upstream, file = shown, error = %e, "cannot read password_file; keeping the password read before");
            Ok(c)
        }
        (Err(e), None) => {
            metrics().upstream_auth_failures.with_label_values(&[upstream, "password_file"]).inc();
            Err(Error::Upstream(UpstreamError::Auth(format!("cannot read password_file {shown}: {e}"))))
        }
    }
}
