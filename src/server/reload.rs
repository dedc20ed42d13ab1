//! Noticing that files changed on disk (cert-manager rotating a
//! certificate, an edited htpasswd file): a stamp of each file's length and
//! modification time, compared on a timer. Kubernetes updates a mounted
//! Secret by swapping a symlink, which changes what the path resolves to,
//! so the stamp follows the path, not an open file.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

/// How often watched files are checked for changes.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(2);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stamp(Vec<Option<(u64, SystemTime)>>);

/// The current stamp of `paths` (a missing file is part of the stamp).
pub fn stamp(paths: &[PathBuf]) -> Stamp {
    Stamp(paths.iter().map(|p| std::fs::metadata(p).ok().and_then(|m| Some((m.len(), m.modified().ok()?)))).collect())
}

/// Calls `reload` (on the blocking pool) whenever the stamp of `paths`
/// changes, until `shutdown` fires. A failed reload keeps what was loaded
/// before and is retried at the next change.
pub fn watch(
    what: &'static str,
    paths: Vec<PathBuf>,
    mut shutdown: crate::shutdown::Shutdown,
    reload: impl Fn() -> Result<(), String> + Send + Sync + 'static,
) {
    let reload = std::sync::Arc::new(reload);
    let paths = std::sync::Arc::new(paths);
    let stamp_now = move || {
        let paths = std::sync::Arc::clone(&paths);
        async move { tokio::task::spawn_blocking(move || stamp(&paths)).await.ok() }
    };
    tokio::spawn(async move {
        let mut last = stamp_now().await;
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                () = tokio::time::sleep(RELOAD_INTERVAL) => {}
            }
            let now = stamp_now().await;
            if now == last {
                continue;
            }
            last = now;
            let reload = std::sync::Arc::clone(&reload);
            match tokio::task::spawn_blocking(move || reload()).await {
                Ok(Ok(())) => tracing::info!(what, "reloaded"),
                Ok(Err(e)) => tracing::warn!(what, error = %e, "reload failed; keeping the previous version"),
                Err(e) => tracing::warn!(what, error = %e, "reload task failed"),
            }
        }
    });
}
