//! The one way blocking work (redb, `std::fs`, bcrypt) runs from async
//! code: on tokio's blocking pool, never on an async worker thread.

use crate::error::Error;

/// Runs blocking work (redb, `std::fs`) on tokio's blocking pool.
pub async fn blocking<T, F>(f: F) -> Result<T, Error>
where
    F: FnOnce() -> Result<T, Error> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f).await.map_err(|e| Error::Internal(format!("blocking task failed: {e}")))?
}
