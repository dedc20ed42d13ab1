//! `Recorder`: a host that only records. It counts every connection it
//! accepts, keeps every request head it reads, and answers each request
//! with a whole HTTP/1.1 response (canned, or chosen by the request line).
//! Attack tests put one wherever larder must not go — a foreign realm, a
//! "CDN", a cloud metadata address — and end by counting what it saw.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Longest a recorder waits for a request head.
const HEAD_WAIT: Duration = Duration::from_secs(30);
/// Largest request head a recorder reads.
const MAX_HEAD: usize = 64 << 10;

/// Chooses the response to a request from its first line (`GET /path HTTP/1.1`).
type Responder = dyn Fn(&str) -> Vec<u8> + Send + Sync;

/// Listens until dropped.
pub struct Recorder {
    addr: SocketAddr,
    seen: Arc<Mutex<Seen>>,
    task: JoinHandle<()>,
}

#[derive(Default)]
struct Seen {
    connections: usize,
    heads: Vec<String>,
}

impl Recorder {
    /// Listens on `ip` (a free port) and answers every request with
    /// `response` (a whole HTTP/1.1 response, head and body).
    pub async fn start(ip: impl Into<IpAddr>, response: Vec<u8>) -> Recorder {
        Recorder::routed(SocketAddr::new(ip.into(), 0), move |_| response.clone()).await
    }

    /// Listens on `addr` and answers each request with what `respond`
    /// makes of its request line.
    pub async fn routed(addr: SocketAddr, respond: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static) -> Recorder {
        let listener = TcpListener::bind(addr).await.unwrap_or_else(|e| panic!("bind a recorder on {addr}: {e}"));
        let addr = listener.local_addr().expect("recorder address");
        let seen = Arc::new(Mutex::new(Seen::default()));
        let respond: Arc<Responder> = Arc::new(respond);
        let task = tokio::spawn({
            let seen = Arc::clone(&seen);
            async move {
                while let Ok((stream, _)) = listener.accept().await {
                    lock(&seen).connections += 1;
                    tokio::spawn(answer(stream, Arc::clone(&seen), Arc::clone(&respond)));
                }
            }
        });
        Recorder { addr, seen, task }
    }

    /// A "token service" that would hand any caller a token.
    pub async fn token_service(ip: impl Into<IpAddr>) -> Recorder {
        Recorder::start(ip, http_response("200 OK", "application/json", br#"{"token":"stolen","expires_in":300}"#))
            .await
    }

    /// A "CDN" that serves `blob` at any path.
    pub async fn cdn(ip: impl Into<IpAddr>, blob: &[u8]) -> Recorder {
        Recorder::start(ip, http_response("200 OK", "application/octet-stream", blob)).await
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn connections(&self) -> usize {
        lock(&self.seen).connections
    }

    /// Every request head read so far (request line and headers).
    pub fn heads(&self) -> Vec<String> {
        lock(&self.seen).heads.clone()
    }

    /// Values of header `name` (case-insensitive) over every request.
    pub fn header_values(&self, name: &str) -> Vec<String> {
        self.heads()
            .iter()
            .flat_map(|head| head.split("\r\n").skip(1).map(str::to_owned).collect::<Vec<_>>())
            .filter_map(|line| {
                let (n, v) = line.split_once(':')?;
                n.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
            })
            .collect()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(mut stream: TcpStream, seen: Arc<Mutex<Seen>>, respond: Arc<Responder>) {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    };
    let _ = tokio::time::timeout(HEAD_WAIT, read).await;
    let end = head.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(head.len());
    let head = String::from_utf8_lossy(&head[..end]).into_owned();
    let response = respond(head.lines().next().unwrap_or_default());
    lock(&seen).heads.push(head);
    let _ = stream.write_all(&response).await;
    let _ = stream.shutdown().await;
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A whole HTTP/1.1 response that closes the connection.
pub fn http_response(status: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// A `307` to `location`.
pub fn redirect_to(location: &str) -> Vec<u8> {
    format!("HTTP/1.1 307 Temporary Redirect\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        .into_bytes()
}
