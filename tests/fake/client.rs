//! Raw-TCP HTTP/1.1 clients for talking to larder. Raw, because the tests
//! need what a library client hides: whether a body ended cleanly or was
//! cut off, reading part of a body and then hanging up, and reading slowly
//! enough that TCP backpressure is real.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinHandle;

use super::PATIENCE;

/// Status line and headers of a response.
#[derive(Clone, Debug)]
pub struct Head {
    pub status: u16,
    pub headers: Vec<(String, String)>,
}

impl Head {
    /// The first header called `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn content_length(&self) -> Option<u64> {
        self.header("content-length")?.parse().ok()
    }
}

/// How a response body ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// All the bytes `Content-Length` promised (or a clean close when
    /// there was none).
    Complete,
    /// The connection closed or reset before the body was complete.
    Aborted(String),
}

/// A whole response.
#[derive(Debug)]
pub struct Response {
    pub head: Head,
    pub body: Vec<u8>,
    pub end: End,
}

impl Response {
    pub fn status(&self) -> u16 {
        self.head.status
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.header(name)
    }

    /// The body as JSON; panics if it is not.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("expected a JSON body, got {:?}: {e}", String::from_utf8_lossy(&self.body)))
    }

    /// The `code` of the first error in the OCI error envelope
    /// `{"errors":[{"code","message","detail"}]}`; panics if the body is
    /// not that envelope.
    pub fn error_code(&self) -> String {
        let json = self.json();
        let first = &json["errors"][0];
        for key in ["code", "message", "detail"] {
            assert!(first.get(key).is_some(), "error envelope without {key:?}: {json}");
        }
        first["code"].as_str().unwrap_or_else(|| panic!("error code is not a string: {json}")).to_owned()
    }
}

fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)]) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        req.push_str(&format!("{name}: {value}\r\n"));
    }
    req.push_str("\r\n");
    req.into_bytes()
}

/// A response whose head has been read and whose body is read on demand.
pub struct Streaming {
    head: Head,
    sock: TcpStream,
    /// Body bytes read along with the head, not yet handed out.
    pending: Vec<u8>,
    /// Body bytes still to come, if the length is known.
    remaining: Option<u64>,
    /// Body bytes handed out so far.
    received: u64,
}

impl Streaming {
    pub fn head(&self) -> &Head {
        &self.head
    }

    pub fn status(&self) -> u16 {
        self.head.status
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.header(name)
    }

    /// Body bytes read so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The next piece of the body; `Ok(None)` at a clean end, `Err` if the
    /// connection broke first.
    pub async fn chunk(&mut self) -> Result<Option<Vec<u8>>, String> {
        if self.remaining == Some(0) {
            return Ok(None);
        }
        let mut data = if self.pending.is_empty() {
            let mut buf = vec![0u8; 256 << 10];
            match self.sock.read(&mut buf).await {
                Ok(0) if self.remaining.is_none() => return Ok(None),
                Ok(0) => {
                    return Err(format!(
                        "connection closed after {} body bytes, {} short of Content-Length",
                        self.received,
                        self.remaining.unwrap_or(0)
                    ));
                }
                Ok(n) => {
                    buf.truncate(n);
                    buf
                }
                Err(e) => {
                    return Err(format!("connection broke after {} body bytes: {e}", self.received));
                }
            }
        } else {
            std::mem::take(&mut self.pending)
        };
        if let Some(remaining) = &mut self.remaining {
            data.truncate(data.len().min(*remaining as usize));
            *remaining -= data.len() as u64;
        }
        self.received += data.len() as u64;
        Ok(Some(data))
    }

    /// Reads exactly `n` body bytes; panics if the body ends first.
    pub async fn read_exact(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            match self.chunk().await {
                Ok(Some(mut data)) => {
                    let want = n - out.len();
                    if data.len() > want {
                        self.pending = data.split_off(want);
                        self.received -= self.pending.len() as u64;
                        if let Some(r) = &mut self.remaining {
                            *r += self.pending.len() as u64;
                        }
                    }
                    out.extend_from_slice(&data);
                }
                Ok(None) => panic!("body ended after {} of {n} wanted bytes", out.len()),
                Err(e) => panic!("body broke after {} of {n} wanted bytes: {e}", out.len()),
            }
        }
        out
    }

    /// The rest of the body and how it ended.
    pub async fn read_to_end(mut self) -> (Vec<u8>, End) {
        let mut out = Vec::new();
        loop {
            match self.chunk().await {
                Ok(Some(data)) => out.extend_from_slice(&data),
                Ok(None) => return (out, End::Complete),
                Err(e) => return (out, End::Aborted(e)),
            }
        }
    }

    /// The rest of the body as its length and `sha256:<hex>`, without
    /// keeping it, and how it ended.
    pub async fn hash_to_end(mut self) -> (u64, String, End) {
        let mut hasher = Sha256::new();
        let mut len = 0;
        let end = loop {
            match self.chunk().await {
                Ok(Some(data)) => {
                    len += data.len() as u64;
                    hasher.update(&data);
                }
                Ok(None) => break End::Complete,
                Err(e) => break End::Aborted(e),
            }
        };
        (len, format!("sha256:{}", hex::encode(hasher.finalize())), end)
    }

    /// Reads the rest of the body comparing it with `expected` as it
    /// streams, without keeping it: the length read, how the body ended,
    /// and the offset of the first byte that differs, if any.
    pub async fn compare_to_end(mut self, expected: &[u8]) -> (u64, End, Option<u64>) {
        let mut offset = 0usize;
        let mut first_difference = None;
        let end = loop {
            match self.chunk().await {
                Ok(Some(data)) => {
                    if first_difference.is_none() {
                        let want = expected.get(offset..).unwrap_or_default();
                        let same = data.iter().zip(want).take_while(|(a, b)| a == b).count();
                        if same < data.len() {
                            first_difference = Some((offset + same) as u64);
                        }
                    }
                    offset += data.len();
                }
                Ok(None) => break End::Complete,
                Err(e) => break End::Aborted(e),
            }
        };
        (offset as u64, end, first_difference)
    }

    pub async fn into_response(self) -> Response {
        let head = self.head.clone();
        let (body, end) = self.read_to_end().await;
        Response { head, body, end }
    }
}

/// Reads a response head from `sock`; returns it and the body bytes read
/// along with it.
async fn read_head(sock: &mut TcpStream) -> Result<(Head, Vec<u8>), String> {
    let mut buf = Vec::new();
    let mut tmp = vec![0u8; 16 << 10];
    let end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        let n = sock.read(&mut tmp).await.map_err(|e| format!("reading the response head: {e}"))?;
        if n == 0 {
            return Err(format!(
                "connection closed before a response head ({} bytes: {:?})",
                buf.len(),
                String::from_utf8_lossy(&buf)
            ));
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let text = String::from_utf8_lossy(&buf[..end]).into_owned();
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let headers =
        lines.filter_map(|l| l.split_once(':')).map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned())).collect();
    Ok((Head { status, headers }, buf[end + 4..].to_vec()))
}

async fn try_open_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Streaming, String> {
    let mut sock = TcpStream::connect(addr).await.map_err(|e| format!("connect to larder at {addr}: {e}"))?;
    sock.write_all(&request(addr, method, path, headers)).await.map_err(|e| format!("send request: {e}"))?;
    let (head, pending) = read_head(&mut sock).await?;
    if let Some(te) = head.header("transfer-encoding") {
        return Err(format!("unexpected Transfer-Encoding {te:?}: larder sends Content-Length"));
    }
    let no_body = method == "HEAD" || head.status == 204 || head.status == 304;
    let remaining = if no_body { Some(0) } else { head.content_length() };
    Ok(Streaming { head, sock, pending, remaining, received: 0 })
}

/// Sends `HEAD path` and returns the response head.
pub async fn head(addr: SocketAddr, path: &str) -> Head {
    match tokio::time::timeout(PATIENCE, try_open_with(addr, "HEAD", path, &[])).await {
        Ok(Ok(s)) => s.head,
        Ok(Err(e)) => panic!("HEAD {path}: {e}"),
        Err(_) => panic!("HEAD {path}: no response head within {PATIENCE:?}"),
    }
}

/// Sends `GET path` with `headers` and reads the response head; the body
/// is left to read. Panics if larder does not answer with a head.
pub async fn open_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Streaming {
    match tokio::time::timeout(PATIENCE, try_open_with(addr, "GET", path, headers)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => panic!("GET {path}: {e}"),
        Err(_) => panic!("GET {path}: no response head within {PATIENCE:?}"),
    }
}

/// `GET path`, head read, body left to read.
pub async fn open(addr: SocketAddr, path: &str) -> Streaming {
    open_with(addr, path, &[]).await
}

/// `GET path` with `headers`, whole response.
pub async fn get_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Response {
    let streaming = open_with(addr, path, headers).await;
    match tokio::time::timeout(PATIENCE, streaming.into_response()).await {
        Ok(r) => r,
        Err(_) => panic!("GET {path}: body not finished within {PATIENCE:?}"),
    }
}

/// `GET path`, whole response.
pub async fn get(addr: SocketAddr, path: &str) -> Response {
    get_with(addr, path, &[]).await
}

/// `GET path`, whole response, errors returned instead of panicking.
pub async fn try_get(addr: SocketAddr, path: &str) -> Result<Response, String> {
    try_get_with(addr, path, &[]).await
}

/// `GET path` with `headers`, whole response, errors returned instead of
/// panicking (and no patience of its own: the caller bounds it).
pub async fn try_get_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Result<Response, String> {
    let streaming = try_open_with(addr, "GET", path, headers).await?;
    Ok(streaming.into_response().await)
}

/// `GET path`, head read, body left to read; errors returned instead of
/// panicking (no patience of its own).
pub async fn try_open(addr: SocketAddr, path: &str) -> Result<Streaming, String> {
    try_open_with(addr, "GET", path, &[]).await
}

/// `GET path`: reads `n` body bytes, then hangs up. Returns them.
pub async fn read_then_drop(addr: SocketAddr, path: &str, n: usize) -> Vec<u8> {
    let mut s = open(addr, path).await;
    assert_eq!(s.status(), 200, "GET {path}");
    s.read_exact(n).await
}

/// A client that reads a response at a fixed rate through a socket with a
/// small receive buffer, so that the sender really is held back by TCP.
/// Stops when dropped.
pub struct SlowReader {
    received: Arc<AtomicU64>,
    finished: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl SlowReader {
    /// Sends `GET path` and reads about `bytes_per_sec` bytes a second.
    pub async fn start(addr: SocketAddr, path: &str, bytes_per_sec: usize) -> SlowReader {
        let socket = TcpSocket::new_v4().expect("a socket");
        // Set before connecting, so the window larder sees is small too.
        socket.set_recv_buffer_size(4096).expect("a small receive buffer");
        let mut sock = socket.connect(addr).await.expect("connect to larder");
        sock.write_all(&request(addr, "GET", path, &[])).await.expect("send the request");
        let received = Arc::new(AtomicU64::new(0));
        let finished = Arc::new(AtomicBool::new(false));
        let (r, f) = (Arc::clone(&received), Arc::clone(&finished));
        let ticks_per_sec = 10;
        let per_tick = (bytes_per_sec / ticks_per_sec).max(1);
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; per_tick];
            let mut tick = tokio::time::interval(Duration::from_millis(1000 / ticks_per_sec as u64));
            loop {
                tick.tick().await;
                match sock.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        r.fetch_add(n as u64, Ordering::SeqCst);
                    }
                }
            }
            f.store(true, Ordering::SeqCst);
        });
        SlowReader { received, finished, task }
    }

    /// Bytes read so far, response head included.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::SeqCst)
    }

    /// Whether the connection has ended.
    pub fn finished(&self) -> bool {
        self.finished.load(Ordering::SeqCst)
    }
}

impl Drop for SlowReader {
    fn drop(&mut self) {
        self.task.abort();
    }
}
