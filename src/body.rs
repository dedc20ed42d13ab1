//! The response body type shared by every handler: a boxed stream of
//! `Bytes` whose error aborts the connection (hyper does not end a
//! response cleanly after a body error, so a client never mistakes a
//! truncated blob for a complete one).

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

pub fn empty() -> Body {
    Empty::<Bytes>::new().map_err(|never| match never {}).boxed_unsync()
}

pub fn full(bytes: Bytes) -> Body {
    Full::new(bytes).map_err(|never| match never {}).boxed_unsync()
}

/// A blocking `Read` over a body's data, for a parser that runs in
/// `spawn_blocking` (a tar of an image layout). A task pumps the body into
/// a channel of `chunks_in_flight`; dropping the reader stops it.
pub struct BodyReader {
    rx: tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>,
    chunk: Bytes,
    pump: tokio::task::JoinHandle<()>,
}

impl BodyReader {
    /// Starts pumping `body`; call from within the runtime.
    pub fn new(mut body: hyper::body::Incoming, chunks_in_flight: usize) -> BodyReader {
        let (tx, rx) = tokio::sync::mpsc::channel(chunks_in_flight);
        let pump = tokio::spawn(async move {
            while let Some(frame) = body.frame().await {
                let chunk = match frame {
                    Ok(frame) => match frame.into_data() {
                        Ok(data) => Ok(data),
                        Err(_) => continue, // trailers
                    },
                    Err(e) => Err(std::io::Error::other(e.to_string())),
                };
                let failed = chunk.is_err();
                if tx.send(chunk).await.is_err() || failed {
                    return;
                }
            }
        });
        BodyReader { rx, chunk: Bytes::new(), pump }
    }
}

impl std::io::Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.chunk.is_empty() {
            match self.rx.blocking_recv() {
                Some(chunk) => self.chunk = chunk?,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len());
        buf[..n].copy_from_slice(&self.chunk.split_to(n));
        Ok(n)
    }
}

impl Drop for BodyReader {
    fn drop(&mut self) {
        self.pump.abort();
    }
}

/// The writing end of [`written_body`]: a blocking `Write` whose bytes
/// become the body's chunks (one per `write`: wrap it in a `BufWriter`).
pub struct ChannelWriter(tokio::sync::mpsc::Sender<Result<Bytes, BoxError>>);

impl ChannelWriter {
    /// Ends the body with `error` instead of cleanly.
    pub fn fail(&self, error: BoxError) {
        let _ = self.0.blocking_send(Err(error));
    }
}

impl std::io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the other side went away"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Clone for ChannelWriter {
    fn clone(&self) -> Self {
        ChannelWriter(self.0.clone())
    }
}

/// A body written by blocking code (a tar being built) through the
/// returned writer, `chunks_in_flight` chunks ahead of the reader.
pub fn written_body(chunks_in_flight: usize) -> (ChannelWriter, http_body_util::combinators::BoxBody<Bytes, BoxError>) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, BoxError>>(chunks_in_flight);
    let frames = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
    let frames = futures_util::StreamExt::map(frames, |r| r.map(hyper::body::Frame::data));
    (ChannelWriter(tx), http_body_util::StreamBody::new(frames).boxed())
}
