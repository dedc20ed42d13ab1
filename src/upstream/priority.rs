//! Who waits for whom among an upstream's requests: a blob fetched ahead
//! of the client that will ask for it (its image's manifest was just
//! served) must never hold back a request a client is waiting on.
//!
//! A request sent for a fill that runs ahead first takes one of the
//! upstream's *ahead* permits, half of its `max_concurrency` (at least
//! one), then an ordinary permit: fills ahead hold at most half the
//! upstream's connections, and the other half stays for clients. When a
//! client joins such a fill it is promoted: its requests from then on
//! take ordinary permits only, and one waiting for an ahead permit stops
//! waiting.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

/// Share of `max_concurrency` that fills ahead of a client may hold: one
/// in this many (rounded down, at least one).
pub const AHEAD_SHARE: usize = 2;

/// How urgent a fill's requests are; shared by the fill and whoever
/// promotes it. `true` inside: ahead of any client.
#[derive(Clone, Debug)]
pub struct Priority(Arc<watch::Sender<bool>>);

impl Priority {
    /// A fill a client (or a peer) is waiting on.
    pub fn client() -> Priority {
        Priority(Arc::new(watch::Sender::new(false)))
    }

    /// A fill started ahead of the client that will ask for it.
    pub fn ahead() -> Priority {
        Priority(Arc::new(watch::Sender::new(true)))
    }

    pub fn is_ahead(&self) -> bool {
        *self.0.borrow()
    }

    /// A client now waits on the fill; whether it ran ahead until now.
    pub fn promote(&self) -> bool {
        self.0.send_if_modified(|ahead| std::mem::replace(ahead, false))
    }

    /// Resolves once the fill is (or already was) promoted.
    async fn promoted(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|ahead| !ahead).await;
    }
}

/// The permits one upstream request holds until its body is read or dropped.
#[derive(Debug)]
pub struct Permit {
    _open: OwnedSemaphorePermit,
    _ahead: Option<OwnedSemaphorePermit>,
}

/// An upstream's concurrency: `max_concurrency` permits, of which fills
/// ahead may hold at most [`AHEAD_SHARE`]'s part.
pub struct Permits {
    open: Arc<Semaphore>,
    ahead: Arc<Semaphore>,
}

/// The upstream is shutting down (its semaphores were closed).
#[derive(Debug)]
pub struct Closed;

impl Permits {
    pub fn new(max_concurrency: usize) -> Permits {
        Permits {
            open: Arc::new(Semaphore::new(max_concurrency)),
            ahead: Arc::new(Semaphore::new((max_concurrency / AHEAD_SHARE).max(1))),
        }
    }

    /// Waits for a permit (waiters are served in order); a request of a
    /// fill ahead waits for an ahead permit first, unless promoted meanwhile.
    pub async fn acquire(&self, priority: Option<&Priority>) -> Result<Permit, Closed> {
        let ahead = match priority.filter(|p| p.is_ahead()) {
            None => None,
            Some(p) => tokio::select! {
                biased;
                _ = p.promoted() => None,
                permit = Arc::clone(&self.ahead).acquire_owned() => Some(permit.map_err(|_| Closed)?),
            },
        };
        let open = Arc::clone(&self.open).acquire_owned().await.map_err(|_| Closed)?;
        Ok(Permit { _open: open, _ahead: ahead })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn fills_ahead_hold_at_most_half_the_permits_and_clients_get_the_rest() {
        let permits = Permits::new(4);
        let ahead = Priority::ahead();
        let a1 = permits.acquire(Some(&ahead)).await.unwrap();
        let a2 = permits.acquire(Some(&ahead)).await.unwrap();
        let third = tokio::time::timeout(Duration::from_millis(50), permits.acquire(Some(&ahead))).await;
        assert!(third.is_err(), "a third request ahead waits");
        let c1 = permits.acquire(None).await.unwrap();
        let c2 = permits.acquire(Some(&Priority::client())).await.unwrap();
        drop((a1, a2, c1, c2));
    }

    #[tokio::test]
    async fn a_promoted_fill_stops_waiting_for_an_ahead_permit() {
        let permits = Arc::new(Permits::new(2));
        let ahead = Priority::ahead();
        let held = permits.acquire(Some(&ahead)).await.unwrap();
        let waiting = {
            let (permits, ahead) = (Arc::clone(&permits), ahead.clone());
            tokio::spawn(async move { permits.acquire(Some(&ahead)).await.map(drop) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "only one permit of two may go ahead");
        ahead.promote();
        tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("promoted: it goes on").unwrap().unwrap();
        assert!(!ahead.is_ahead());
        drop(held);
    }
}
