//! Shutdown signalling: one `watch` channel whose sender `main` keeps. When
//! it changes (SIGTERM, SIGINT), listeners stop accepting, open
//! connections finish their in-flight requests, and background tasks
//! (maintenance, file watchers) return. Its own module, as in mini-redis,
//! so that the cache and the server can both depend on it without
//! depending on each other.

/// Signals the listeners and background tasks to stop: once it changes,
/// they stop accepting, let open connections finish their in-flight
/// requests, and return.
pub type Shutdown = tokio::sync::watch::Receiver<()>;
