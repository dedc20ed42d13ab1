//! Background work (the keep-warm loop) and clients' requests to the same
//! upstream: clients go first. Background requests take their permits from
//! a pool of their own ([`CONCURRENCY`] per upstream) instead
//! of the upstream's `max_concurrency`, so a client never waits for a
//! permit that a background download holds, however long it runs.
//!
//! Whether a request is background work is a property of the task that
//! makes it: the warm loop runs inside [`run`], and a fill it
//! starts, which runs in a task of its own so that it survives its first
//! reader, takes the priority along ([`inherit`]). A client that joins such
//! a fill reads it as it is (it started already); one that asks for
//! something else has the upstream's permits to itself.

use std::future::Future;

/// Requests to one upstream that background work has open at most; the
/// warm loop fetches this many blobs at once, so its fills never wait for
/// a background permit either (and a client joining one is not delayed).
pub const CONCURRENCY: usize = 2;

tokio::task_local! {
    static BACKGROUND: bool;
}

/// Runs `f` as background work.
pub async fn run<F: Future>(f: F) -> F::Output {
    BACKGROUND.scope(true, f).await
}

/// Whether the current task is background work.
pub fn active() -> bool {
    BACKGROUND.try_with(|b| *b).unwrap_or(false)
}

/// `f`, with the current task's priority: for a task spawned on its
/// behalf. Its trace goes along too (see [`crate::otel::follow`]).
pub fn inherit<F: Future>(f: F) -> impl Future<Output = F::Output> {
    BACKGROUND.scope(active(), crate::otel::follow(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_priority_follows_the_work_into_spawned_tasks() {
        assert!(!active(), "a client's task");
        let inside = run(async {
            let spawned = tokio::spawn(inherit(async { active() }));
            let plain = tokio::spawn(async { active() });
            (active(), spawned.await.unwrap(), plain.await.unwrap())
        })
        .await;
        assert_eq!(inside, (true, true, false), "inherited only where asked");
        assert!(!tokio::spawn(inherit(async { active() })).await.unwrap(), "a client's spawn stays a client's");
    }
}
