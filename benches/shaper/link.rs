//! A model of an internet link to a registry, as a TCP proxy in front of a
//! real origin: what a client pays per connection and per request on the
//! way to a CDN, without touching the machine's network.
//!
//! - **Per-connection throughput cap**: a token bucket per accepted
//!   connection paces what goes from the origin to the client, as the
//!   throughput one TCP connection gets over a long, lossy path is capped
//!   by RTT and loss (not by the bandwidth of either end).
//! - **First-byte delay per request**: each request's first byte is held
//!   for a fixed time before it goes on to the origin, as the round trip
//!   and the CDN's time to first byte add to every request, on a new or a
//!   reused connection alike. A request is a client write that follows
//!   response bytes (or starts the connection): HTTP/1.1 without pipelining,
//!   which is what every registry client sends.
//! - **Aggregate cap** (optional): one more bucket, shared by every
//!   connection, for a link whose total bandwidth is what limits.
//!
//! The client-to-origin direction is relayed as it comes (requests are
//! small). Nothing is parsed or changed: the same bytes arrive, later.
//!
//! Tests and `benches/cold.py` use the same code: tests in-process (see
//! `tests/common/shaper.rs`), the bench as the `shaper` example binary.
//! For fault injection, [`Counters::cut_once_after`] cuts the first
//! connection that relays more than a set number of bytes, as a path that
//! drops mid-transfer would.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// Largest read from either side at once. Small enough that pacing stays
/// smooth at 25 MB/s (one read is 2.6 ms of traffic there).
const CHUNK: usize = 64 << 10;
/// Least a bucket may bank: a whole [`CHUNK`], so one read never waits
/// for more tokens than the bucket can hold.
const MIN_BURST: f64 = CHUNK as f64;
/// Traffic a bucket may bank beyond [`MIN_BURST`], in seconds of its
/// rate: more than tokio's 1 ms timer resolution, so a sleep that
/// overshoots is credited instead of lowering the rate.
const BURST_SECONDS: f64 = 0.004;
/// `cut_once_after` when no cut is armed.
const NO_CUT: u64 = u64::MAX;

/// What the link does to traffic.
#[derive(Clone, Copy, Debug, Default)]
pub struct Model {
    /// Bytes per second one connection may carry toward the client.
    pub per_connection: Option<u64>,
    /// Added before each request reaches the origin.
    pub first_byte: Duration,
    /// Bytes per second all connections together may carry toward the client.
    pub aggregate: Option<u64>,
}

/// What went over the link, and the one fault it can inject.
#[derive(Debug)]
pub struct Counters {
    pub connections: AtomicUsize,
    /// Requests seen (see the module doc for what counts as one).
    pub requests: AtomicUsize,
    /// Bytes relayed from the origin to clients (headers included).
    pub bytes_down: AtomicU64,
    /// Connections cut by [`Counters::cut_once_after`].
    pub cuts: AtomicUsize,
    cut_after: AtomicU64,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            connections: AtomicUsize::new(0),
            requests: AtomicUsize::new(0),
            bytes_down: AtomicU64::new(0),
            cuts: AtomicUsize::new(0),
            cut_after: AtomicU64::new(NO_CUT),
        }
    }
}

impl Counters {
    /// The next connection to relay more than `bytes` toward its client
    /// (counted from its start, over all its responses) is closed on both
    /// sides at that point; one connection, once. (Tests inject this
    /// fault; the `shaper` program never does.)
    #[allow(dead_code)]
    pub fn cut_once_after(&self, bytes: u64) {
        self.cut_after.store(bytes, Ordering::SeqCst);
    }

    /// Whether a connection that has relayed `sent` bytes is the one to cut.
    fn take_cut(&self, sent: u64) -> bool {
        let at = self.cut_after.load(Ordering::SeqCst);
        sent > at && self.cut_after.compare_exchange(at, NO_CUT, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }
}

/// A token bucket: `rate` bytes per second, banking at most `burst`.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn new(rate: u64) -> Bucket {
        let rate = rate as f64;
        let burst = MIN_BURST + rate * BURST_SECONDS;
        Bucket { rate, burst, tokens: burst, last: Instant::now() }
    }

    /// Takes `n` tokens (going into debt if need be) and says how long to
    /// wait before the bytes may go: until the debt is paid.
    fn take(&mut self, n: usize) -> Duration {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.last).as_secs_f64() * self.rate).min(self.burst);
        self.last = now;
        self.tokens -= n as f64;
        if self.tokens >= 0.0 { Duration::ZERO } else { Duration::from_secs_f64(-self.tokens / self.rate) }
    }
}

/// A running link: accepts on `listener`, relays each connection to `target`.
pub struct Link {
    model: Model,
    target: SocketAddr,
    aggregate: Option<Mutex<Bucket>>,
    pub counters: Counters,
}

impl Link {
    pub fn new(target: SocketAddr, model: Model) -> Arc<Link> {
        Arc::new(Link {
            model,
            target,
            aggregate: model.aggregate.map(|rate| Mutex::new(Bucket::new(rate))),
            counters: Counters::default(),
        })
    }

    /// Accepts connections until the task is dropped or aborted.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        while let Ok((client, _)) = listener.accept().await {
            let link = Arc::clone(&self);
            tokio::spawn(async move {
                link.counters.connections.fetch_add(1, Ordering::Relaxed);
                if let Ok(origin) = TcpStream::connect(link.target).await {
                    link.relay(client, origin).await;
                }
            });
        }
    }

    async fn relay(self: &Arc<Self>, client: TcpStream, origin: TcpStream) {
        let _ = client.set_nodelay(true);
        let _ = origin.set_nodelay(true);
        let (client_read, client_write) = client.into_split();
        let (origin_read, origin_write) = origin.into_split();
        // Set by the downstream pump whenever response bytes went out: the
        // client's next write is then a new request.
        let responded = Arc::new(AtomicBool::new(true));
        let link = Arc::clone(self);
        let flag = Arc::clone(&responded);
        let up = tokio::spawn(async move { link.pump_up(client_read, origin_write, flag).await });
        // The connection lives as long as responses flow (a client that
        // half-closes still gets its answer); then both sockets close,
        // also mid-body after a cut.
        self.pump_down(origin_read, client_write, responded).await;
        up.abort();
    }

    /// Client to origin: each request held for the first-byte delay.
    async fn pump_up(&self, mut from: OwnedReadHalf, mut to: OwnedWriteHalf, responded: Arc<AtomicBool>) {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if responded.swap(false, Ordering::SeqCst) {
                self.counters.requests.fetch_add(1, Ordering::Relaxed);
                if !self.model.first_byte.is_zero() {
                    tokio::time::sleep(self.model.first_byte).await;
                }
            }
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    }

    /// Origin to client, paced by the connection's bucket and the shared one.
    async fn pump_down(&self, mut from: OwnedReadHalf, mut to: OwnedWriteHalf, responded: Arc<AtomicBool>) {
        let mut own = self.model.per_connection.map(Bucket::new);
        let mut buf = vec![0u8; CHUNK];
        let mut sent: u64 = 0;
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut wait = own.as_mut().map_or(Duration::ZERO, |b| b.take(n));
            if let Some(shared) = &self.aggregate {
                let shared_wait = shared.lock().unwrap_or_else(|p| p.into_inner()).take(n);
                wait = wait.max(shared_wait);
            }
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            if self.counters.take_cut(sent + n as u64) {
                self.counters.cuts.fetch_add(1, Ordering::Relaxed);
                return;
            }
            responded.store(true, Ordering::SeqCst);
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
            sent += n as u64;
            self.counters.bytes_down.fetch_add(n as u64, Ordering::Relaxed);
        }
        let _ = to.shutdown().await;
    }
}

/// Parses a rate such as `25MB` (per second; k/M/G are powers of 1000,
/// KiB/MiB/GiB of 1024) or a plain number of bytes per second.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let s = s.trim().trim_end_matches("/s");
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: f64 = number.parse().map_err(|e| format!("{s:?}: {e}"))?;
    let factor = match unit.trim() {
        "" | "B" => 1.0,
        "k" | "kB" | "K" | "KB" => 1e3,
        "M" | "MB" => 1e6,
        "G" | "GB" => 1e9,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("{s:?}: unknown unit {other:?}")),
    };
    Ok((number * factor) as u64)
}
