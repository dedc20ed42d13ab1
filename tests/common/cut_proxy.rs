//! A TCP proxy in front of a real server (Garage's S3 port) that can cut a
//! response off in the middle: once it has relayed more than a set number
//! of bytes toward the client on one connection, it closes both sides, as
//! a storage node that dies mid-stream would. It can also stall requests
//! (an upload's body) after a number of bytes, as a store that stops
//! reading would. The server behind it is real; only the fault is injected.
//!
//! ```ignore
//! let proxy = CutProxy::start(garage_s3_addr).await;
//! proxy.cut_after(1 << 20);          // every response longer than 1 MiB breaks
//! // point [shared] endpoint at proxy.url()
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// `cut_after` when nothing is cut.
const NEVER: u64 = u64::MAX;

struct State {
    target: SocketAddr,
    cut_after: AtomicU64,
    stall_after: AtomicU64,
    /// Bytes per second a client may send past `stall_after` (0: none).
    slow_rate: AtomicU64,
    /// While set, nothing goes from the server to the client.
    hold: std::sync::atomic::AtomicBool,
    cuts: AtomicUsize,
}

/// A running proxy on 127.0.0.1; stops listening when dropped.
pub struct CutProxy {
    addr: SocketAddr,
    state: Arc<State>,
    accept: JoinHandle<()>,
}

impl CutProxy {
    /// Listens on a free loopback port and relays every connection to `target`.
    pub async fn start(target: SocketAddr) -> CutProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the cut proxy on 127.0.0.1");
        let addr = listener.local_addr().expect("the proxy's address");
        let state = Arc::new(State {
            target,
            cut_after: AtomicU64::new(NEVER),
            stall_after: AtomicU64::new(NEVER),
            slow_rate: AtomicU64::new(0),
            hold: std::sync::atomic::AtomicBool::new(false),
            cuts: AtomicUsize::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&state)));
        CutProxy { addr, state, accept }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// From now on, a connection is closed once more than `bytes` went
    /// from the server to the client on it.
    pub fn cut_after(&self, bytes: u64) {
        self.state.cut_after.store(bytes, Ordering::SeqCst);
    }

    /// From now on, a connection stops relaying what the client sends
    /// once more than `bytes` went to the server on it (until [`Self::heal`]):
    /// small requests pass, a large upload hangs mid-body.
    pub fn stall_requests_after(&self, bytes: u64) {
        self.state.stall_after.store(bytes, Ordering::SeqCst);
    }

    /// Like [`Self::stall_requests_after`], but what the client sends past
    /// `bytes` goes on at `rate` bytes per second: a slow store that keeps
    /// reading, so no timeout fires.
    pub fn slow_requests_after(&self, bytes: u64, rate: u64) {
        self.state.slow_rate.store(rate, Ordering::SeqCst);
        self.state.stall_after.store(bytes, Ordering::SeqCst);
    }

    /// Holds every answer (nothing goes from the server to the client)
    /// until [`Self::heal`]: a store that is slow to answer.
    pub fn hold_responses(&self) {
        self.state.hold.store(true, Ordering::SeqCst);
    }

    /// Relays everything again.
    pub fn heal(&self) {
        self.state.hold.store(false, Ordering::SeqCst);
        self.state.slow_rate.store(0, Ordering::SeqCst);
        self.state.cut_after.store(NEVER, Ordering::SeqCst);
        self.state.stall_after.store(NEVER, Ordering::SeqCst);
    }

    /// Connections cut so far.
    pub fn cuts(&self) -> usize {
        self.state.cuts.load(Ordering::SeqCst)
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    while let Ok((client, _)) = listener.accept().await {
        tokio::spawn(relay(client, Arc::clone(&state)));
    }
}

async fn relay(client: TcpStream, state: Arc<State>) {
    let Ok(server) = TcpStream::connect(state.target).await else { return };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let requests = Arc::clone(&state);
    let upstream = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 << 10];
        let mut relayed = 0u64;
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut sent = 0;
            while sent < n {
                let limit = requests.stall_after.load(Ordering::SeqCst);
                let mut room = limit.saturating_sub(relayed).min((n - sent) as u64) as usize;
                if room == 0 {
                    // Past the limit: a trickle at the slow rate, or
                    // nothing until healed.
                    let rate = requests.slow_rate.load(Ordering::SeqCst);
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    room = ((rate / 50) as usize).min(n - sent);
                    if room == 0 {
                        continue;
                    }
                }
                if server_write.write_all(&buf[sent..sent + room]).await.is_err() {
                    return;
                }
                sent += room;
                relayed += room as u64;
            }
        }
        let _ = server_write.shutdown().await;
    });
    let downstream = async {
        let mut buf = vec![0u8; 64 << 10];
        let mut relayed = 0u64;
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            while state.hold.load(Ordering::SeqCst) {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            let limit = state.cut_after.load(Ordering::SeqCst);
            let send = if relayed + n as u64 > limit { (limit.saturating_sub(relayed)) as usize } else { n };
            if client_write.write_all(&buf[..send]).await.is_err() {
                break;
            }
            relayed += send as u64;
            if send < n {
                state.cuts.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        let _ = client_write.shutdown().await;
    };
    downstream.await;
    // A cut (or the server closing) drops both halves: the client sees its
    // response end short of its Content-Length.
    upstream.abort();
}
