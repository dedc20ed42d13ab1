//! An upstream's bandwidth, shared by all its fills (client, peer, ahead
//! and warm), with the fills a client waits on first.
//!
//! Each chunk a fill reads from upstream is paid for before the next one
//! is read ([`Pace::take`]); what a fill does not read stays in the
//! kernel's socket buffer and TCP holds the sender back, so the rate is
//! the link's, not only larder's.
//!
//! - **With `max_bandwidth`** (bytes per second for the upstream's fills
//!   together) a token bucket holds the rate: it fills at the rate up to
//!   [`BURST`] of it (at least [`MIN_BURST_BYTES`]). A client's fill takes
//!   whenever the bucket is not in debt and may run it into debt by one
//!   chunk, so over any time `t` the fills read at most `rate × t` plus
//!   the bucket's depth plus one chunk per connection (each reads its
//!   chunk before it pays for it). A fill that yields (ahead, warm)
//!   takes only what clients leave: it waits until the bucket holds its
//!   whole chunk with no client waiting, so while clients can use the
//!   whole rate it reads nothing.
//! - **Without one**, larder cannot know what the link carries, so fills
//!   that yield are held to one at a time while any client fill of the
//!   upstream runs ([`State::lane`]): a shared link gives the client
//!   nearly all of it, and when no client fill runs they go at full width.
//!
//! The wait happens between two reads, outside the body's idle timeout:
//! a fill held back is not a stalled upstream. For the same reason the
//! time a fill is held back ([`Bandwidth::held`], [`Pace::held`]) is not
//! its source's: the fill's deadline and the rule on resumes that bring
//! little leave it out (a fill ahead may yield for as long as clients use
//! the whole rate, and a rate below the fills' minimum rate of 256 KiB/s
//! holds every fill below it).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::priority::{Class, Priority};
use crate::metrics::metrics;

/// How much of its rate the bucket holds: what fills may take at once
/// after a pause (a burst), beyond the rate.
pub const BURST: Duration = Duration::from_millis(100);
/// Smallest bucket depth: one write chunk of a fill (256 KiB), so that a
/// fill that yields can ever take a whole chunk at a low rate.
pub const MIN_BURST_BYTES: u64 = 256 << 10;
/// Shortest wait before a fill held back looks again (a bound on wake-ups
/// at high rates, where a chunk's share is a few microseconds).
const MIN_WAIT: Duration = Duration::from_millis(1);
/// Longest wait before a fill held back looks again (the rate is at least
/// 64 KiB/s, so a chunk's share is at most a few seconds).
const MAX_WAIT: Duration = Duration::from_secs(10);

/// One upstream's bandwidth and the fills sharing it.
pub struct Bandwidth {
    upstream: String,
    /// Bytes per second for all the upstream's fills, if limited.
    rate: Option<u64>,
    /// The bucket's depth, in bytes.
    depth: f64,
    state: Mutex<State>,
    /// Told when a fill ends or the lane is free.
    changed: Notify,
}

struct State {
    /// Bytes the bucket holds now; below zero: in debt (a client's last
    /// chunk was larger than what was there).
    tokens: f64,
    updated: Instant,
    /// Client fills waiting for the bucket now.
    clients_waiting: usize,
    /// The fills of this upstream in flight, by [`Priority::id`].
    fills: HashMap<usize, Fill>,
    /// Without a rate: the one fill that yields and may read while a
    /// client fill runs.
    lane: Option<usize>,
}

/// A fill in flight, as the bandwidth knows it.
struct Fill {
    priority: Priority,
    /// How many [`Registered`] guards hold it.
    holders: usize,
    /// Its reads waiting now (its parts wait each on their own).
    waiting: usize,
    /// Since when at least one of its reads waits.
    since: Option<Instant>,
    /// Wall time at least one of its reads waited, up to `since`.
    held: Duration,
}

impl Fill {
    fn held(&self, now: Instant) -> Duration {
        self.held + self.since.map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }
}

/// What a fill's next chunk must do.
enum Decision {
    Go,
    /// Wait this long, or (`None`) until a fill ends, the lane is free or
    /// this fill is promoted.
    Wait(Option<Duration>),
}

impl Bandwidth {
    /// `rate`: `max_bandwidth` in bytes per second, if set.
    pub fn new(upstream: &str, rate: Option<u64>) -> Bandwidth {
        let depth = rate.map_or(0.0, |r| (r as f64 * BURST.as_secs_f64()).max(MIN_BURST_BYTES as f64));
        metrics()
            .upstream_max_bandwidth
            .with_label_values(&[upstream])
            .set(rate.map_or(0, |r| i64::try_from(r).unwrap_or(i64::MAX)));
        Bandwidth {
            upstream: upstream.to_owned(),
            rate,
            depth,
            state: Mutex::new(State {
                tokens: depth,
                updated: Instant::now(),
                clients_waiting: 0,
                fills: HashMap::new(),
                lane: None,
            }),
            changed: Notify::new(),
        }
    }

    /// The limit, in bytes per second (`None`: unlimited).
    pub fn rate(&self) -> Option<u64> {
        self.rate
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a fill of this upstream in flight until the guard drops
    /// (also when its task panics or is cancelled); a fill may be
    /// registered more than once (before it starts, and while it runs).
    pub fn register(self: &Arc<Self>, priority: &Priority) -> Registered {
        let mut state = self.lock();
        let fill = state.fills.entry(priority.id()).or_insert_with(|| Fill {
            priority: priority.clone(),
            holders: 0,
            waiting: 0,
            since: None,
            held: Duration::ZERO,
        });
        fill.holders += 1;
        Registered { bandwidth: Arc::clone(self), id: priority.id() }
    }

    /// Waits until a fill that yields (registered) may start reading: at
    /// once with a rate or when no client fill runs, else once it holds
    /// the lane. A fill ahead waits here before it opens any connection.
    pub async fn may_start(self: &Arc<Self>, priority: &Priority) {
        self.pace(priority).take(0).await;
    }

    /// What one fill's reads from upstream wait for.
    pub fn pace(self: &Arc<Self>, priority: &Priority) -> Pace {
        Pace { bandwidth: Arc::clone(self), priority: priority.clone(), held: Arc::default() }
    }

    /// How long, in wall time, the reads of the fill registered with
    /// `priority` have been held back so far: while at least one of them
    /// waited for the bucket or the lane (parts waiting together count
    /// once). Zero for a fill not registered.
    pub fn held(&self, priority: &Priority) -> Duration {
        self.lock().fills.get(&priority.id()).map_or(Duration::ZERO, |f| f.held(Instant::now()))
    }

    /// One more read of the fill `id` waits (`true`) or one stopped waiting.
    fn mark_waiting(&self, id: usize, waiting: bool) {
        let mut state = self.lock();
        let Some(fill) = state.fills.get_mut(&id) else { return };
        let now = Instant::now();
        if waiting {
            fill.waiting += 1;
            fill.since.get_or_insert(now);
        } else {
            fill.waiting = fill.waiting.saturating_sub(1);
            if fill.waiting == 0 {
                fill.held = fill.held(now);
                fill.since = None;
            }
        }
    }

    fn decide(&self, state: &mut State, priority: &Priority, bytes: u64) -> Decision {
        let class = priority.class();
        let Some(rate) = self.rate else {
            if class == Class::Client || !state.fills.values().any(|f| f.priority.class() == Class::Client) {
                return Decision::Go;
            }
            let id = priority.id();
            return match state.lane {
                Some(holder) if holder != id && state.fills.get(&holder).is_some_and(|f| f.priority.yields()) => {
                    Decision::Wait(None)
                }
                _ => {
                    state.lane = Some(id);
                    Decision::Go
                }
            };
        };
        let rate = rate as f64;
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(state.updated).as_secs_f64();
        state.tokens = (state.tokens + elapsed * rate).min(self.depth);
        state.updated = now;
        // How long until the bucket holds `missing` more bytes (at least
        // MIN_WAIT: when a client waits, what is there already is its).
        let wait_for = |missing: f64| {
            let seconds = Duration::try_from_secs_f64(missing.max(0.0) / rate).unwrap_or(MAX_WAIT);
            Decision::Wait(Some(seconds.clamp(MIN_WAIT, MAX_WAIT)))
        };
        if class == Class::Client {
            if state.tokens > -1.0 {
                state.tokens -= bytes as f64;
                return Decision::Go;
            }
            return wait_for(-state.tokens);
        }
        let need = (bytes as f64).min(self.depth);
        if state.clients_waiting == 0 && state.tokens + 1.0 > need {
            state.tokens -= bytes as f64;
            return Decision::Go;
        }
        wait_for(need - state.tokens)
    }

    fn deregister(&self, id: usize) {
        let mut state = self.lock();
        let ended = match state.fills.get_mut(&id) {
            Some(fill) if fill.holders > 1 => {
                fill.holders -= 1;
                false
            }
            Some(_) => state.fills.remove(&id).is_some(),
            None => false,
        };
        if !ended {
            return;
        }
        if state.lane == Some(id) {
            state.lane = None;
        }
        drop(state);
        self.changed.notify_waiters();
    }
}

/// A fill in flight, as its upstream's bandwidth counts it.
pub struct Registered {
    bandwidth: Arc<Bandwidth>,
    id: usize,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.bandwidth.deregister(self.id);
    }
}

/// One fill's share of its upstream's bandwidth.
#[derive(Clone)]
pub struct Pace {
    bandwidth: Arc<Bandwidth>,
    priority: Priority,
    /// How long this pace's reads were held back, in nanoseconds.
    held: Arc<AtomicU64>,
}

/// Counts a read of a fill as held back while it waits (also when the
/// wait is cancelled).
struct Held<'a> {
    pace: &'a Pace,
    since: Instant,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let nanos = u64::try_from(self.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.pace.held.fetch_add(nanos, Ordering::Relaxed);
        self.pace.bandwidth.mark_waiting(self.pace.priority.id(), false);
    }
}

/// Counts a client fill as waiting while it waits (also when the wait is
/// cancelled).
struct ClientWaiting<'a>(&'a Bandwidth);

impl Drop for ClientWaiting<'_> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.clients_waiting = state.clients_waiting.saturating_sub(1);
    }
}

impl Pace {
    /// Pays for `bytes` just read from upstream: returns at once when the
    /// fill may read on, or once it may.
    pub async fn take(&self, bytes: u64) {
        let bandwidth = &*self.bandwidth;
        let started = Instant::now();
        let mut held = None;
        let class = loop {
            // Registered before deciding, so that a change in between is seen.
            let changed = bandwidth.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let mut promoted = self.priority.watch();
            let (decision, class, _waiting) = {
                let mut state = bandwidth.lock();
                let class = self.priority.class();
                let decision = bandwidth.decide(&mut state, &self.priority, bytes);
                let waiting = matches!((&decision, class), (Decision::Wait(_), Class::Client)).then(|| {
                    state.clients_waiting += 1;
                    ClientWaiting(bandwidth)
                });
                (decision, class, waiting)
            };
            if matches!(decision, Decision::Wait(_)) && held.is_none() {
                bandwidth.mark_waiting(self.priority.id(), true);
                held = Some(Held { pace: self, since: Instant::now() });
            }
            match decision {
                Decision::Go => break class,
                Decision::Wait(Some(d)) => tokio::select! {
                    () = tokio::time::sleep(d) => {}
                    _ = promoted.changed() => {}
                },
                Decision::Wait(None) => tokio::select! {
                    () = &mut changed => {}
                    _ = promoted.changed() => {}
                },
            }
        };
        drop(held);
        let waited = started.elapsed();
        if !waited.is_zero() {
            metrics()
                .upstream_bandwidth_wait
                .with_label_values(&[&bandwidth.upstream, class.as_str()])
                .inc_by(waited.as_secs_f64());
        }
    }
}

impl Pace {
    /// How long this pace's reads have been held back so far (summed over
    /// its reads, which wait one at a time).
    pub fn held(&self) -> Duration {
        Duration::from_nanos(self.held.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1024;
    const CHUNK: u64 = 256 * KIB;

    /// Reads `chunks` chunks through `pace` and returns when each was
    /// allowed, in (paused, virtual) time since `t0`.
    async fn read(pace: Pace, chunks: usize, t0: Instant) -> Vec<Duration> {
        let mut at = Vec::with_capacity(chunks);
        for _ in 0..chunks {
            pace.take(CHUNK).await;
            at.push(t0.elapsed());
        }
        at
    }

    #[test]
    fn a_fill_that_yields_to_a_waiting_client_waits_however_full_the_bucket_is() {
        // A client's wake-up came late: the bucket is full, and it still
        // waits (it will take what is there).
        let bandwidth = Bandwidth::new("late.test", Some(1 << 20));
        let (ahead, client) = (Priority::ahead(), Priority::client());
        let mut state = bandwidth.lock();
        state.clients_waiting = 1;
        state.tokens = bandwidth.depth;
        state.updated = Instant::now();
        match bandwidth.decide(&mut state, &ahead, 64 * KIB) {
            Decision::Wait(Some(d)) => assert!(d >= MIN_WAIT && d <= MAX_WAIT, "{d:?}"),
            _ => panic!("a fill ahead waits while a client does"),
        }
        assert!(matches!(bandwidth.decide(&mut state, &client, CHUNK), Decision::Go), "the client goes");
    }

    #[tokio::test(start_paused = true)]
    async fn a_rate_holds_over_time_to_the_bucket_and_one_chunk() {
        // 1 MiB/s, a 256 KiB bucket: 40 chunks (10 MiB) take 9.5 s of
        // virtual time: the bucket's 256 KiB and one chunk of debt at
        // once, then the rate.
        let bandwidth = Arc::new(Bandwidth::new("rate.test", Some(1 << 20)));
        let client = Priority::client();
        let _fill = bandwidth.register(&client);
        let t0 = Instant::now();
        let at = read(bandwidth.pace(&client), 40, t0).await;
        for (i, t) in at.iter().enumerate() {
            // After chunk i is allowed, (i + 1) chunks are read: at most
            // the rate times the time so far, plus the bucket and a chunk.
            let read = (i as u64 + 1) * CHUNK;
            let allowed = (t.as_secs_f64() * (1 << 20) as f64) as u64 + MIN_BURST_BYTES + CHUNK;
            assert!(read <= allowed, "chunk {i} at {t:?}: {read} bytes read, {allowed} allowed");
        }
        let last = at[39].as_secs_f64();
        assert!((9.45..=9.55).contains(&last), "10 MiB at 1 MiB/s after a 256 KiB bucket: {last} s");
    }

    #[tokio::test(start_paused = true)]
    async fn with_a_rate_a_fill_ahead_reads_only_what_clients_leave() {
        let bandwidth = Arc::new(Bandwidth::new("order.test", Some(1 << 20)));
        let (client, ahead) = (Priority::client(), Priority::ahead());
        let _fills = (bandwidth.register(&client), bandwidth.register(&ahead));
        let t0 = Instant::now();
        // The client reads 4 MiB as fast as the rate lets it; the fill
        // ahead reads 2 MiB beside it.
        let client_reads = tokio::spawn(read(bandwidth.pace(&client), 16, t0));
        let ahead_reads = tokio::spawn(read(bandwidth.pace(&ahead), 8, t0));
        let client_at = client_reads.await.unwrap();
        let ahead_at = ahead_reads.await.unwrap();
        let client_done = *client_at.last().unwrap();
        assert!(
            ahead_at.iter().all(|t| *t >= client_done),
            "nothing went ahead while the client read: client done at {client_done:?}, ahead {ahead_at:?}"
        );
        assert!(client_done <= Duration::from_millis(3510), "the client had the whole rate: {client_done:?}");
        // Then the fill ahead has the rate to itself (after the client's
        // last chunk of debt).
        let ahead_done = *ahead_at.last().unwrap();
        assert!(ahead_done <= client_done + Duration::from_millis(2260), "{ahead_done:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_promoted_fill_stops_yielding() {
        let bandwidth = Arc::new(Bandwidth::new("promote.test", Some(1 << 20)));
        let (client, ahead) = (Priority::client(), Priority::ahead());
        let _fills = (bandwidth.register(&client), bandwidth.register(&ahead));
        let t0 = Instant::now();
        let client_reads = tokio::spawn(read(bandwidth.pace(&client), 40, t0));
        let ahead_reads = tokio::spawn(read(bandwidth.pace(&ahead), 1, t0));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!ahead_reads.is_finished(), "held back behind the client");
        ahead.promote();
        let at = ahead_reads.await.unwrap();
        assert!(at[0] < Duration::from_millis(1600), "a client's fill now, it shares the rate at once: {at:?}");
        client_reads.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_rate_one_fill_that_yields_reads_while_a_client_fill_runs() {
        let bandwidth = Arc::new(Bandwidth::new("lane.test", None));
        let (a, b, warm) = (Priority::ahead(), Priority::ahead(), Priority::background());
        let regs = (bandwidth.register(&a), bandwidth.register(&b), bandwidth.register(&warm));
        // No client fill runs: all of them read.
        for p in [&a, &b, &warm] {
            tokio::time::timeout(Duration::from_millis(1), bandwidth.pace(p).take(CHUNK)).await.expect("reads");
        }
        let client = Priority::client();
        let client_fill = bandwidth.register(&client);
        tokio::time::timeout(Duration::from_millis(1), bandwidth.pace(&client).take(CHUNK)).await.expect("client");
        // Now one of them has the lane; the others wait.
        tokio::time::timeout(Duration::from_millis(1), bandwidth.pace(&a).take(CHUNK)).await.expect("the lane");
        let b_waits = tokio::spawn({
            let pace = bandwidth.pace(&b);
            async move { pace.take(CHUNK).await }
        });
        let warm_waits = tokio::spawn({
            let pace = bandwidth.pace(&warm);
            async move { pace.take(CHUNK).await }
        });
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!b_waits.is_finished() && !warm_waits.is_finished(), "one fill that yields at a time");
        // The holder ends: the next takes the lane, the third still waits.
        drop(regs.0);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(
            usize::from(b_waits.is_finished()) + usize::from(warm_waits.is_finished()),
            1,
            "the lane passed to exactly one"
        );
        // The client fill ends: everything reads.
        drop(client_fill);
        tokio::time::timeout(Duration::from_millis(1), async {
            let _ = b_waits.await;
            let _ = warm_waits.await;
        })
        .await
        .expect("no client fill: no waiting");
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_rate_a_fill_waiting_for_the_lane_goes_once_a_client_joins_it() {
        let bandwidth = Arc::new(Bandwidth::new("join.test", None));
        let (client, first, second) = (Priority::client(), Priority::ahead(), Priority::ahead());
        let _regs = (bandwidth.register(&client), bandwidth.register(&first), bandwidth.register(&second));
        bandwidth.pace(&first).take(CHUNK).await;
        let waits = tokio::spawn({
            let pace = bandwidth.pace(&second);
            async move { pace.take(CHUNK).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waits.is_finished());
        second.promote();
        tokio::time::timeout(Duration::from_millis(1), waits).await.expect("promoted: reads at once").unwrap();
    }
}
