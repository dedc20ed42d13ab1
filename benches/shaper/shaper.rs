//! `shaper`: the link model of `link.rs` as a program, for `benches/cold.py`.
//!
//! ```sh
//! cargo build --release --example shaper
//! target/release/examples/shaper serve --listen 127.0.0.1:5001 --target 127.0.0.1:5000 \
//!     --per-connection 25MB --first-byte 50ms
//! target/release/examples/shaper ceiling            # its own ceiling, 1 and 8 connections
//! target/release/examples/shaper ranges --url http://127.0.0.1:5001/v2/r/blobs/sha256:… \
//!     --size 536870912 --chunk 8MiB --parallel 8 --sha256 <hex>
//! ```
//!
//! `serve` prints `listening <addr>` once it accepts, and its counters as
//! one JSON line when it gets SIGTERM or SIGINT. `ranges` is a
//! containerd-style multipart download: the blob in `--chunk` ranges,
//! `--parallel` at a time over keep-alive connections, each checked for
//! `206` and its exact `Content-Range`; it prints the time to the last
//! range as JSON, then (outside the timing) checks the whole blob's
//! SHA-256.

#[path = "link.rs"]
mod link;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use link::{Link, Model, parse_rate};

#[derive(Parser)]
#[command(about = "A link model in front of a real origin, and the clients that measure over it")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
struct ModelArgs {
    /// Throughput cap of each connection toward the client (e.g. 25MB = 25e6 bytes/s).
    #[arg(long, value_parser = parse_rate)]
    per_connection: Option<u64>,
    /// Delay added to every request before it reaches the origin (e.g. 50ms).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
    first_byte: Duration,
    /// Throughput cap of all connections together.
    #[arg(long, value_parser = parse_rate)]
    aggregate: Option<u64>,
}

impl ModelArgs {
    fn model(&self) -> Model {
        Model { per_connection: self.per_connection, first_byte: self.first_byte, aggregate: self.aggregate }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Relays connections on --listen to --target through the link model.
    Serve {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        target: SocketAddr,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Measures the shaper's own ceiling: a source sending as fast as it
    /// can through the shaper to readers in this process.
    Ceiling {
        /// Bytes each connection carries.
        #[arg(long, value_parser = parse_rate, default_value = "512MiB")]
        bytes: u64,
        /// Connection counts to measure, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,8")]
        connections: Vec<usize>,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Downloads one blob as parallel ranges (see the module doc).
    Ranges {
        #[arg(long)]
        url: String,
        #[arg(long, value_parser = parse_rate)]
        size: u64,
        #[arg(long, value_parser = parse_rate, default_value = "8MiB")]
        chunk: u64,
        #[arg(long, default_value_t = 8)]
        parallel: usize,
        /// The blob's SHA-256 (hex), checked after the timing.
        #[arg(long)]
        sha256: Option<String>,
    },
}

fn main() -> Result<(), String> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    runtime.block_on(async move {
        match cli.command {
            Command::Serve { listen, target, model } => serve(listen, target, model.model()).await,
            Command::Ceiling { bytes, connections, model } => ceiling(bytes, &connections, model.model()).await,
            Command::Ranges { url, size, chunk, parallel, sha256 } => {
                ranges(&url, size, chunk, parallel, sha256.as_deref()).await
            }
        }
    })
}

async fn serve(listen: SocketAddr, target: SocketAddr, model: Model) -> Result<(), String> {
    let listener = TcpListener::bind(listen).await.map_err(|e| format!("bind {listen}: {e}"))?;
    let link = Link::new(target, model);
    println!("listening {}", listener.local_addr().map_err(|e| e.to_string())?);
    let _ = std::io::stdout().flush();
    let serving = tokio::spawn(Arc::clone(&link).serve(listener));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("SIGTERM handler: {e}"))?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    serving.abort();
    let c = &link.counters;
    println!(
        "{{\"connections\": {}, \"requests\": {}, \"bytes_down\": {}, \"cuts\": {}}}",
        c.connections.load(Ordering::Relaxed),
        c.requests.load(Ordering::Relaxed),
        c.bytes_down.load(Ordering::Relaxed),
        c.cuts.load(Ordering::Relaxed)
    );
    Ok(())
}

/// This process's CPU time (user + system), in seconds.
fn cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is valid.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

async fn ceiling(bytes: u64, connections: &[usize], model: Model) -> Result<(), String> {
    // The source: every connection gets `bytes` zeros, as fast as it takes them.
    let source = TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
    let source_addr = source.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = source.accept().await {
            tokio::spawn(async move {
                let zeros = vec![0u8; 256 << 10];
                let mut left = bytes;
                // The client's one byte is its "request".
                let mut request = [0u8; 1];
                if s.read_exact(&mut request).await.is_err() {
                    return;
                }
                while left > 0 {
                    let n = left.min(zeros.len() as u64) as usize;
                    if s.write_all(&zeros[..n]).await.is_err() {
                        return;
                    }
                    left -= n as u64;
                }
            });
        }
    });
    let front = TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
    let front_addr = front.local_addr().map_err(|e| e.to_string())?;
    let link = Link::new(source_addr, model);
    tokio::spawn(Arc::clone(&link).serve(front));
    println!("shaper ceiling: {model:?}, {bytes} bytes per connection, source and readers in this process");
    for &n in connections {
        let cpu = cpu_seconds();
        let started = Instant::now();
        let readers: Vec<_> = (0..n)
            .map(|_| {
                tokio::spawn(async move {
                    let mut s = TcpStream::connect(front_addr).await.map_err(|e| e.to_string())?;
                    s.write_all(b"x").await.map_err(|e| e.to_string())?;
                    let mut buf = vec![0u8; 256 << 10];
                    let mut got = 0u64;
                    while got < bytes {
                        match s.read(&mut buf).await {
                            Ok(0) => break,
                            Ok(k) => got += k as u64,
                            Err(e) => return Err(e.to_string()),
                        }
                    }
                    Ok::<u64, String>(got)
                })
            })
            .collect();
        let mut total = 0;
        for r in readers {
            total += r.await.map_err(|e| e.to_string())??;
        }
        let secs = started.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu;
        println!(
            "  {n} connection(s): {:.0} MB/s in all, {:.0} MB/s each; {:.2} s CPU per GB (source, shaper and readers)",
            total as f64 / secs / 1e6,
            total as f64 / secs / 1e6 / n as f64,
            cpu / (total as f64 / 1e9)
        );
    }
    Ok(())
}

async fn ranges(url: &str, size: u64, chunk: u64, parallel: usize, sha256: Option<&str>) -> Result<(), String> {
    let client =
        reqwest::Client::builder().pool_max_idle_per_host(parallel).build().map_err(|e| format!("client: {e}"))?;
    let out = Arc::new(tempfile::tempfile().map_err(|e| format!("temp file: {e}"))?);
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..parallel)
        .map(|_| {
            let (client, url, out, next) = (client.clone(), url.to_owned(), Arc::clone(&out), Arc::clone(&next));
            tokio::spawn(async move {
                let mut requests = 0usize;
                loop {
                    let start = next.fetch_add(chunk, Ordering::SeqCst);
                    if start >= size {
                        return Ok::<usize, String>(requests);
                    }
                    let last = (start + chunk).min(size) - 1;
                    requests += 1;
                    let mut resp = client
                        .get(&url)
                        .header("Range", format!("bytes={start}-{last}"))
                        .send()
                        .await
                        .map_err(|e| format!("GET bytes={start}-{last}: {e}"))?;
                    let expected = format!("bytes {start}-{last}/{size}");
                    let got = resp.headers().get("content-range").and_then(|v| v.to_str().ok()).unwrap_or("");
                    if resp.status() != 206 || got != expected {
                        return Err(format!(
                            "bytes={start}-{last}: {} {got:?}, wanted 206 {expected:?}",
                            resp.status()
                        ));
                    }
                    let mut at = start;
                    while let Some(bytes) = resp.chunk().await.map_err(|e| format!("bytes={start}-{last}: {e}"))? {
                        out.write_all_at(&bytes, at).map_err(|e| e.to_string())?;
                        at += bytes.len() as u64;
                    }
                    if at != last + 1 {
                        return Err(format!("bytes={start}-{last}: body ended at {at}"));
                    }
                }
            })
        })
        .collect();
    let mut requests = 0;
    for w in workers {
        requests += w.await.map_err(|e| e.to_string())??;
    }
    let seconds = started.elapsed().as_secs_f64();
    let verified = match sha256 {
        None => "null".to_owned(),
        Some(want) => {
            let mut hasher = sha2::Sha256::new();
            let mut file = &*out;
            std::io::Seek::rewind(&mut file).map_err(|e| e.to_string())?;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = file.read(&mut buf).map_err(|e| e.to_string())?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
            }
            (hex::encode(hasher.finalize()) == want.trim_start_matches("sha256:")).to_string()
        }
    };
    println!("{{\"seconds\": {seconds:.4}, \"bytes\": {size}, \"requests\": {requests}, \"sha256_ok\": {verified}}}");
    if verified == "false" {
        return Err("the ranges do not add up to the blob's digest".into());
    }
    Ok(())
}
