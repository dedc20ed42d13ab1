//! Blob bytes sent with `sendfile(2)` on cleartext HTTP/1 connections.
//!
//! hyper writes a response body from the `Bytes` chunks it is given, so a
//! blob read with `pread` is copied twice: page cache → buffer → socket.
//! Those two copies were 57 % of larder's CPU samples serving a warm 10 MiB
//! blob, where nginx's sendfile lets the kernel move page-cache pages to
//! the socket itself (`perf`, benches/README.md).
//!
//! hyper cannot be handed a file, but with vectored writes on (the
//! builder's `writev(true)`, documented as not flattening body chunks) it
//! hands each body chunk to the IO's `poll_write_vectored` as the very
//! memory it was given. So a body that can send from a file asks the
//! connection's [`FileSink`] for a *placeholder*: a chunk of one static
//! region that nothing else points into, standing for `len` bytes of the
//! file. When hyper writes that memory, the connection's [`FileStream`]
//! sends the file's bytes in its place with sendfile. Framing (head,
//! `Content-Length`, keep-alive) stays hyper's; only where body bytes come
//! from changes.
//!
//! Placeholders are consumed strictly in the order they were handed out,
//! each from the offset it has reached: a write that does not fit that
//! order (ordinary bytes in the middle of a placeholder, a placeholder
//! with no file behind it, a file that ends early) fails the connection,
//! so a client can get a short body, never a wrong one. The body checks
//! that the range is in the page cache before it asks for a placeholder
//! (`cache::store::residency`): sendfile runs on the async thread and must not
//! wait for the disk.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

/// The most one placeholder stands for: the bytes one body poll hands to
/// hyper, and so the most one `sendfile` call is asked to send (nginx's
/// `sendfile_max_chunk` default is the same 2 MiB). hyper flushes a chunk
/// this size before it polls the body again.
pub const MAX_CHUNK: usize = 2 << 20;

/// The memory every placeholder points into. Never read: its pages stay
/// untouched in `.bss` and cost no resident memory.
static PLACEHOLDER: [u8; MAX_CHUNK] = [0; MAX_CHUNK];

/// File bytes a body has handed to hyper as a placeholder, not yet sent.
struct Segment {
    file: Arc<File>,
    offset: u64,
    len: usize,
    sent: usize,
}

/// Where a response body on this connection registers file ranges to be
/// sent with sendfile. Shared by the connection's [`FileStream`] and its
/// requests (as a request extension).
#[derive(Clone, Default)]
pub struct FileSink(Arc<Mutex<VecDeque<Segment>>>);

impl FileSink {
    /// A chunk for hyper that stands for `len` bytes of `file` from
    /// `offset` (at most [`MAX_CHUNK`]): its bytes are sent from the file
    /// when hyper writes it. The caller checks `len <= MAX_CHUNK`.
    pub fn chunk(&self, file: &Arc<File>, offset: u64, len: usize) -> Bytes {
        debug_assert!(len > 0 && len <= MAX_CHUNK);
        let len = len.min(MAX_CHUNK);
        self.segments().push_back(Segment { file: Arc::clone(file), offset, len, sent: 0 });
        Bytes::from_static(&PLACEHOLDER[..len])
    }

    /// Nothing handed out is still unsent: the connection may be parked or
    /// reused by a new hyper connection.
    pub fn is_empty(&self) -> bool {
        self.segments().is_empty()
    }

    fn segments(&self) -> std::sync::MutexGuard<'_, VecDeque<Segment>> {
        // A panic while holding the lock leaves the queue consistent (every
        // change is a single push, pop or counter update).
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Where `slice` starts within [`PLACEHOLDER`], if it is placeholder memory.
fn placeholder_offset(slice: &[u8]) -> Option<usize> {
    let start = PLACEHOLDER.as_ptr() as usize;
    let at = (slice.as_ptr() as usize).checked_sub(start)?;
    (at < MAX_CHUNK && !slice.is_empty()).then_some(at)
}

fn out_of_order(what: &str) -> io::Error {
    io::Error::other(format!("sendfile: {what}"))
}

/// A cleartext TCP stream that sends placeholder chunks from their files.
pub struct FileStream {
    tcp: TcpStream,
    sink: FileSink,
}

impl FileStream {
    pub fn new(tcp: TcpStream, sink: FileSink) -> FileStream {
        FileStream { tcp, sink }
    }

    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Sends the front segment's next bytes; `slice` is the placeholder
    /// memory hyper is writing, which must be exactly what is left of it.
    fn poll_send_file(&mut self, cx: &mut Context<'_>, slice: &[u8]) -> Poll<io::Result<usize>> {
        let at = placeholder_offset(slice).expect("called with placeholder memory");
        let mut segments = self.sink.segments();
        let Some(front) = segments.front_mut() else {
            return Poll::Ready(Err(out_of_order("placeholder bytes with no file range behind them")));
        };
        if at != front.sent || slice.len() != front.len - front.sent {
            return Poll::Ready(Err(out_of_order("placeholder bytes out of order")));
        }
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            let mut offset = front.offset + front.sent as u64;
            let count = front.len - front.sent;
            let sent = self.tcp.try_io(Interest::WRITABLE, || {
                rustix::fs::sendfile(&self.tcp, &*front.file, Some(&mut offset), count).map_err(io::Error::from)
            });
            match sent {
                Ok(0) => return Poll::Ready(Err(out_of_order("the blob file ended before its range"))),
                Ok(n) => {
                    crate::metrics::metrics().sendfile_bytes.inc_by(n as u64);
                    front.sent += n;
                    if front.sent == front.len {
                        segments.pop_front();
                    }
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Ordinary bytes (a response head) may go out only between segments.
    fn check_between_segments(&self) -> io::Result<()> {
        match self.sink.segments().front() {
            Some(front) if front.sent > 0 => Err(out_of_order("other bytes inside a file range")),
            _ => Ok(()),
        }
    }
}

impl AsyncRead for FileStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for FileStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match bufs.iter().position(|b| placeholder_offset(b).is_some()) {
            Some(0) => this.poll_send_file(cx, &bufs[0]),
            // The bytes before the first placeholder (the head): hyper
            // calls again with the placeholder first.
            first => {
                this.check_between_segments()?;
                let ordinary = &bufs[..first.unwrap_or(bufs.len())];
                Pin::new(&mut this.tcp).poll_write_vectored(cx, ordinary)
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A connected pair on loopback: (client, server side as a FileStream).
    async fn pair() -> (TcpStream, FileStream, FileSink) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let sink = FileSink::default();
        (client, FileStream::new(server, sink.clone()), sink)
    }

    fn file_with(bytes: &[u8]) -> Arc<File> {
        let mut temp = tempfile::tempfile().unwrap();
        temp.write_all(bytes).unwrap();
        Arc::new(temp)
    }

    #[tokio::test]
    async fn a_placeholder_goes_out_as_the_file_bytes_it_stands_for() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let file = file_with(&data);
        let (mut client, mut server, sink) = pair().await;
        let chunk = sink.chunk(&file, 1000, 200_000);
        assert!(chunk.iter().all(|&b| b == 0), "the placeholder itself holds no file bytes");
        server.write_all(b"head:").await.unwrap();
        server.write_all(&chunk).await.unwrap();
        server.write_all(b":tail").await.unwrap();
        server.shutdown().await.unwrap();
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(&got[..5], b"head:");
        assert_eq!(&got[5..200_005], &data[1000..201_000], "the file's bytes, not the placeholder's zeros");
        assert_eq!(&got[200_005..], b":tail");
        assert!(sink.is_empty());
    }

    #[tokio::test]
    async fn a_placeholder_without_its_file_range_fails_the_write() {
        let file = file_with(b"0123456789");
        let (_client, mut server, sink) = pair().await;
        let chunk = sink.chunk(&file, 0, 10);
        let stray = Bytes::from_static(&PLACEHOLDER[..10]);
        server.write_all(&chunk).await.unwrap();
        let err = server.write_all(&stray).await.unwrap_err();
        assert!(err.to_string().contains("no file range"), "{err}");
    }

    #[tokio::test]
    async fn a_file_shorter_than_its_range_fails_the_write_instead_of_sending_zeros() {
        let file = file_with(b"0123456789");
        let (mut client, mut server, sink) = pair().await;
        let chunk = sink.chunk(&file, 4, 100);
        let err = server.write_all(&chunk).await.unwrap_err();
        assert!(err.to_string().contains("ended before its range"), "{err}");
        drop(server);
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"456789", "what the file holds, then the connection ends");
    }
}
