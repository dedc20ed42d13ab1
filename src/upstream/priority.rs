//! Who waits for whom among an upstream's requests: a blob fetched ahead
//! of the client that will ask for it (a client asked for one of its
//! image's layers) must never hold back a request a client is waiting on.
//!
//! A request sent for a fill that runs ahead first takes one of the
//! upstream's *ahead* permits, half of its `max_concurrency` (at least
//! one), then an ordinary permit: fills ahead hold at most half the
//! upstream's connections, and the other half stays for clients. It never
//! queues for the ordinary permit: it takes one only when no request a
//! client waits on is queued for it (a permit released goes to those
//! first), and otherwise waits for the next release. When a client joins
//! such a fill it is promoted: its requests from then on take ordinary
//! permits in order like any other, and one waiting stops waiting for an
//! ahead permit.
//!
//! The same [`Priority`] says how a fill shares its upstream's bandwidth
//! ([`super::bandwidth`]): fills ahead and the warm loop's downloads
//! ([`Class::Background`]) yield to fills a client waits on, until a
//! client joins them.

use std::sync::Arc;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, TryAcquireError, watch};

/// Share of `max_concurrency` that fills ahead of a client may hold: one
/// in this many (rounded down, at least one).
pub const AHEAD_SHARE: usize = 2;

/// Whom a fill runs for now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// A client (or a peer) waits on it.
    Client,
    /// Started ahead of the client that will ask for it.
    Ahead,
    /// Background work (the warm loop): its upstream permits are its own
    /// ([`crate::background`]); it yields bandwidth to clients' fills.
    Background,
}

impl Class {
    /// A label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Client => "client",
            Class::Ahead => "ahead",
            Class::Background => "warm",
        }
    }
}

/// How urgent a fill's requests are; shared by the fill and whoever
/// promotes it.
#[derive(Clone, Debug)]
pub struct Priority(Arc<watch::Sender<Class>>);

impl Priority {
    /// A fill a client (or a peer) is waiting on.
    pub fn client() -> Priority {
        Priority::of(Class::Client)
    }

    /// A fill started ahead of the client that will ask for it.
    pub fn ahead() -> Priority {
        Priority::of(Class::Ahead)
    }

    /// A fill the warm loop started.
    pub fn background() -> Priority {
        Priority::of(Class::Background)
    }

    fn of(class: Class) -> Priority {
        Priority(Arc::new(watch::Sender::new(class)))
    }

    pub fn class(&self) -> Class {
        *self.0.borrow()
    }

    pub fn is_ahead(&self) -> bool {
        self.class() == Class::Ahead
    }

    /// Whether it gives way to clients' fills (ahead, or background work).
    pub fn yields(&self) -> bool {
        self.class() != Class::Client
    }

    /// A client now waits on the fill; whether it ran ahead until now (a
    /// background fill is promoted too, but did not run ahead).
    pub fn promote(&self) -> bool {
        let mut was_ahead = false;
        self.0.send_if_modified(|class| {
            let before = std::mem::replace(class, Class::Client);
            was_ahead = before == Class::Ahead;
            before != Class::Client
        });
        was_ahead
    }

    /// Resolves once the fill is (or already was) promoted from ahead.
    async fn promoted(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|class| *class != Class::Ahead).await;
    }

    /// A receiver that sees its class change (its promotion).
    pub(super) fn watch(&self) -> watch::Receiver<Class> {
        self.0.subscribe()
    }

    /// Identifies the fill (every clone of one fill's priority is the
    /// same), for as long as the fill holds one.
    pub(super) fn id(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }
}

/// The permits one upstream request holds until its body is read or dropped.
#[derive(Debug)]
pub struct Permit {
    open: Option<OwnedSemaphorePermit>,
    _ahead: Option<OwnedSemaphorePermit>,
    /// Told once `open` is back, for requests ahead waiting for one.
    released: Arc<Notify>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        // Back first (to a queued client request, if any), then the
        // requests ahead look whether one is left for them.
        drop(self.open.take());
        self.released.notify_waiters();
    }
}

/// An upstream's concurrency: `max_concurrency` permits, of which fills
/// ahead may hold at most [`AHEAD_SHARE`]'s part.
pub struct Permits {
    open: Arc<Semaphore>,
    ahead: Arc<Semaphore>,
    released: Arc<Notify>,
}

/// The upstream is shutting down (its semaphores were closed).
#[derive(Debug)]
pub struct Closed;

impl Permits {
    pub fn new(max_concurrency: usize) -> Permits {
        Permits {
            open: Arc::new(Semaphore::new(max_concurrency)),
            ahead: Arc::new(Semaphore::new((max_concurrency / AHEAD_SHARE).max(1))),
            released: Arc::new(Notify::new()),
        }
    }

    /// Waits for a permit (waiters are served in order); a request of a
    /// fill ahead waits for an ahead permit first, then for an ordinary
    /// one no client request is queued for, unless promoted meanwhile.
    pub async fn acquire(&self, priority: Option<&Priority>) -> Result<Permit, Closed> {
        let permit = |open, ahead| Permit { open: Some(open), _ahead: ahead, released: Arc::clone(&self.released) };
        let Some(p) = priority.filter(|p| p.is_ahead()) else {
            let open = Arc::clone(&self.open).acquire_owned().await.map_err(|_| Closed)?;
            return Ok(permit(open, None));
        };
        let ahead = tokio::select! {
            biased;
            _ = p.promoted() => None,
            permit = Arc::clone(&self.ahead).acquire_owned() => Some(permit.map_err(|_| Closed)?),
        };
        loop {
            // Registered before looking, so a release in between is not missed.
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            // A released permit goes to queued waiters first: one that is
            // free now is one no client request waits for.
            match Arc::clone(&self.open).try_acquire_owned() {
                Ok(open) => return Ok(permit(open, ahead)),
                Err(TryAcquireError::Closed) => return Err(Closed),
                Err(TryAcquireError::NoPermits) => {}
            }
            tokio::select! {
                biased;
                _ = p.promoted() => {
                    let open = Arc::clone(&self.open).acquire_owned().await.map_err(|_| Closed)?;
                    return Ok(permit(open, ahead));
                }
                _ = &mut released => {}
            }
        }
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
    async fn a_client_request_queued_later_is_served_before_a_request_ahead() {
        let permits = Arc::new(Permits::new(2));
        let held = (permits.acquire(None).await.unwrap(), permits.acquire(None).await.unwrap());
        let ahead = {
            let permits = Arc::clone(&permits);
            tokio::spawn(async move { permits.acquire(Some(&Priority::ahead())).await.map(drop) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (got, tx) = (Arc::new(std::sync::atomic::AtomicBool::new(false)), Arc::clone(&permits));
        let client = {
            let got = Arc::clone(&got);
            tokio::spawn(async move {
                let permit = tx.acquire(None).await.unwrap();
                got.store(true, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                drop(permit);
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held.0);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(got.load(std::sync::atomic::Ordering::SeqCst), "the client request took the released permit");
        assert!(!ahead.is_finished(), "the request ahead, queued first, still waits");
        client.await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), ahead).await.expect("then it goes").unwrap().unwrap();
        drop(held.1);
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
