//! Single-flight: concurrent requests for the same key share one run of the
//! work. The work runs in its own task, so a caller that goes away (a client
//! that disconnects) never cancels it for the others.
//!
//! Blob fills, which stream to their followers while they run, live in
//! [`crate::cache::fill`]; this module covers the request/response kind of
//! work (manifests, tokens).

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};

use crate::error::Error;

type Flight<T> = Shared<BoxFuture<'static, Result<T, Error>>>;

/// Whether a caller ran the work or joined a run already in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Joined {
    Leader,
    Follower,
}

pub struct SingleFlight<K, T> {
    // A std Mutex: it is held only to look up or insert, never across an
    // `.await`.
    inflight: Arc<Mutex<HashMap<K, Flight<T>>>>,
}

impl<K, T> Default for SingleFlight<K, T> {
    fn default() -> Self {
        SingleFlight { inflight: Arc::default() }
    }
}

impl<K, T> SingleFlight<K, T>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    T: Clone + Send + Sync + 'static,
{
    /// Runs `work` for `key`, or joins the run already in flight for it.
    pub async fn run<F>(&self, key: K, work: impl FnOnce() -> F) -> (Result<T, Error>, Joined)
    where
        F: Future<Output = Result<T, Error>> + Send + 'static,
    {
        let (flight, joined) = {
            let mut map = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            match map.get(&key) {
                Some(flight) => (flight.clone(), Joined::Follower),
                None => {
                    // Spawned while the lock is held, so the task's removal
                    // of its key cannot run before the insert below.
                    let inflight = Arc::clone(&self.inflight);
                    let task_key = key.clone();
                    let fut = work();
                    // The leader's priority goes with the work (clients
                    // first, see `crate::background`).
                    let task = tokio::spawn(crate::background::inherit(async move {
                        // Removes the key however the work ends, a panic
                        // included: a key left behind would hand every
                        // later caller the dead flight's error.
                        let _leave = Leave { inflight, key: task_key };
                        fut.await
                    }));
                    let flight = async move {
                        task.await.unwrap_or_else(|e| Err(Error::Internal(format!("single-flight task failed: {e}"))))
                    }
                    .boxed()
                    .shared();
                    map.insert(key, flight.clone());
                    (flight, Joined::Leader)
                }
            }
        };
        (flight.await, joined)
    }
}

/// Takes a flight's key out of the map when the flight's task ends.
struct Leave<K: Hash + Eq, T> {
    inflight: Arc<Mutex<HashMap<K, Flight<T>>>>,
    key: K,
}

impl<K: Hash + Eq, T> Drop for Leave<K, T> {
    fn drop(&mut self) {
        self.inflight.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn concurrent_callers_share_one_run() {
        let flights: Arc<SingleFlight<&'static str, u32>> = Arc::default();
        let runs = Arc::new(AtomicUsize::new(0));
        let mut handles = Vec::new();
        for _ in 0..10 {
            let (flights, runs) = (flights.clone(), runs.clone());
            handles.push(tokio::spawn(async move {
                flights
                    .run("k", || async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Ok(7)
                    })
                    .await
            }));
        }
        let mut leaders = 0;
        for h in handles {
            let (v, joined) = h.await.unwrap();
            assert_eq!(v.unwrap(), 7);
            leaders += usize::from(joined == Joined::Leader);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(leaders, 1);
        // Once finished, the next call runs again.
        let (v, joined) = flights.run("k", || async { Ok(8) }).await;
        assert_eq!((v.unwrap(), joined), (8, Joined::Leader));
    }

    #[tokio::test]
    async fn work_that_panics_leaves_no_flight_behind() {
        let flights: Arc<SingleFlight<u8, u32>> = Arc::default();
        let (v, _) = flights.run(1, || async { panic!("the work panics") }).await;
        assert!(matches!(v, Err(Error::Internal(_))), "{v:?}");
        let (v, joined) = flights.run(1, || async { Ok(2) }).await;
        assert_eq!((v.unwrap(), joined), (2, Joined::Leader), "a fresh run, not the dead flight's error");
    }

    #[tokio::test]
    async fn a_cancelled_leader_does_not_cancel_the_work() {
        let flights: Arc<SingleFlight<u8, u32>> = Arc::default();
        let leader = {
            let flights = flights.clone();
            tokio::spawn(async move {
                flights
                    .run(1, || async {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Ok(1)
                    })
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        leader.abort();
        let (v, joined) = flights.run(1, || async { Ok(2) }).await;
        assert_eq!((v.unwrap(), joined), (1, Joined::Follower));
    }
}
