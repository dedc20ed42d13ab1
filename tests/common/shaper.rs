//! The link shaper of `benches/shaper/link.rs` (the same code
//! `benches/cold.py` runs as a program) in front of a test's real origin:
//! a per-connection throughput cap, a first-byte delay per request, and a
//! connection cut on request. It runs on a thread of its own, so a test
//! that blocks its runtime cannot slow the link.
//!
//! ```ignore
//! let origin = Origin::start().await;
//! let link = Shaper::start(&origin.host_port(), Model { per_connection: Some(8_000_000), ..Model::default() });
//! let larder = Larder::builder().upstream(Upstream::new(ORIGIN_NAME, &link.url()).default(true)).start().await;
//! ```

#[path = "../../benches/shaper/link.rs"]
mod link;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub use link::Model;
use link::{Counters, Link};

/// A running shaper on 127.0.0.1; stops (and closes its connections) when dropped.
pub struct Shaper {
    addr: SocketAddr,
    link: Arc<Link>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Shaper {
    /// Relays a free loopback port to `target` (`host:port`) through `model`.
    pub fn start(target: &str, model: Model) -> Shaper {
        let target: SocketAddr = target.parse().unwrap_or_else(|e| panic!("shaper target {target:?}: {e}"));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the shaper on 127.0.0.1");
        listener.set_nonblocking(true).expect("a non-blocking listener");
        let addr = listener.local_addr().expect("the shaper's address");
        let link = Link::new(target, model);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = Arc::clone(&link);
        let thread = std::thread::Builder::new()
            .name("link-shaper".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                    .expect("the shaper's runtime");
                runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener).expect("a tokio listener");
                    tokio::select! {
                        _ = serving.serve(listener) => {}
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime ends every relay task: connections close.
            })
            .expect("start the shaper's thread");
        Shaper { addr, link, stop: Some(stop), thread: Some(thread) }
    }

    /// `http://127.0.0.1:<port>`, for larder's `[[upstream]] url`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn counters(&self) -> &Counters {
        &self.link.counters
    }

    /// The next connection to relay more than `bytes` toward larder is
    /// closed mid-response, once.
    pub fn cut_once_after(&self, bytes: u64) {
        self.counters().cut_once_after(bytes);
    }

    /// Connections cut so far.
    pub fn cuts(&self) -> usize {
        self.counters().cuts.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.counters().connections.load(Ordering::SeqCst)
    }
}

impl Drop for Shaper {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
