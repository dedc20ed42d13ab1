//! Positioned reads of blob files for response bodies.
//!
//! A read first tries `preadv2(RWF_NOWAIT)` on the calling async thread:
//! the kernel copies what is already in the page cache and answers `EAGAIN`
//! instead of waiting for the disk. A warm blob, the common case for a
//! mirror, is then served without a trip to the blocking pool. Those trips
//! (a futex wake-up and a context switch per chunk) were about a third of
//! larder's CPU time serving a 10 MiB blob to 16 connections (`perf`, see
//! benches/README.md). A range that is not cached, or a file system without
//! `RWF_NOWAIT`, is read inside `spawn_blocking` as before, so an async
//! thread never waits for the disk: this is the one exception to "std::fs
//! only on the blocking pool", and it cannot block.
//!
//! `preadv2` reads into initialised memory only, so a fresh buffer must be
//! zeroed first: allocating and zeroing 256 KiB per chunk was 8.9 % (the
//! memset) plus ~3 % (page faults, allocator) of larder's CPU serving a warm
//! 10 MiB blob (`perf`, benches/README.md). A body stream's [`Buffers`]
//! take back the chunks hyper has written and dropped, so a long body
//! cycles through the same few buffers.

use std::collections::VecDeque;
use std::fs::File;
use std::io::IoSliceMut;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use rustix::io::ReadWriteFlags;

use crate::blocking::blocking;
use crate::error::Error;

/// Chunks a body stream remembers for reuse. hyper stops polling a body
/// while about 400 KiB of it wait to be written, so at most two 256 KiB
/// chunks are in its hands when the next is read: with three remembered,
/// the oldest is usually free again.
const REMEMBERED: usize = 3;

/// The chunks one body stream has sent, taken back for the next read once
/// nobody else holds them (hyper drops a chunk when it has written it).
#[derive(Default)]
pub struct Buffers {
    sent: VecDeque<Bytes>,
}

impl Buffers {
    /// `len` initialised bytes to read into: a sent chunk nobody else
    /// holds, else a new zeroed buffer.
    fn take(&mut self, len: usize) -> BytesMut {
        let free = self.sent.iter().position(Bytes::is_unique).and_then(|i| self.sent.remove(i));
        match free.map(Bytes::try_into_mut) {
            Some(Ok(mut buf)) => {
                // Only a shorter last chunk's tail is zeroed again.
                buf.resize(len, 0);
                buf
            }
            _ => BytesMut::zeroed(len),
        }
    }

    fn sent(&mut self, chunk: &Bytes) {
        if self.sent.len() == REMEMBERED {
            self.sent.pop_front();
        }
        self.sent.push_back(chunk.clone());
    }
}

/// Up to `len` bytes of `file` from `offset`, read into one of `buffers`:
/// all of them, or an error if the file ends first. A read served from the
/// page cache may be shorter (never empty); the caller asks again for the
/// rest.
pub async fn read_at(file: &Arc<File>, offset: u64, len: usize, buffers: &mut Buffers) -> Result<Bytes, Error> {
    crate::faults::check(crate::faults::Point::BlobRead)?;
    let mut buf = buffers.take(len);
    let cached = rustix::io::preadv2(&**file, &mut [IoSliceMut::new(&mut buf)], offset, ReadWriteFlags::NOWAIT);
    let chunk = match cached {
        Ok(n @ 1..) => {
            buf.truncate(n);
            buf.freeze()
        }
        // Nothing cached (EAGAIN), RWF_NOWAIT unsupported, or an error the
        // blocking read reports properly: the same buffer, on the blocking pool.
        _ => {
            let file = Arc::clone(file);
            blocking(move || {
                file.read_exact_at(&mut buf, offset)?;
                Ok(buf.freeze())
            })
            .await?
        }
    };
    buffers.sent(&chunk);
    Ok(chunk)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_with(bytes: &[u8]) -> (tempfile::NamedTempFile, Arc<File>) {
        let mut temp = tempfile::NamedTempFile::new().unwrap();
        temp.write_all(bytes).unwrap();
        let file = Arc::new(temp.reopen().unwrap());
        (temp, file)
    }

    #[tokio::test]
    async fn reads_the_range_asked_for() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1 << 20).collect();
        let (_temp, file) = file_with(&data);
        let mut got = Vec::new();
        while got.len() < 300_000 {
            let at = 1000 + got.len() as u64;
            got.extend_from_slice(&read_at(&file, at, 300_000 - got.len(), &mut Buffers::default()).await.unwrap());
        }
        assert_eq!(got, &data[1000..301_000]);
    }

    #[tokio::test]
    async fn a_file_shorter_than_the_range_is_reported_not_padded() {
        let (_temp, file) = file_with(b"0123456789");
        assert_eq!(read_at(&file, 2, 5, &mut Buffers::default()).await.unwrap(), "23456");
        let mut got = Vec::new();
        let err = loop {
            match read_at(&file, 8 + got.len() as u64, 5 - got.len(), &mut Buffers::default()).await {
                Ok(bytes) => got.extend_from_slice(&bytes),
                Err(e) => break e,
            }
        };
        assert_eq!(got, b"89", "what the file holds, then an error");
        assert!(err.to_string().contains("failed to fill whole buffer"), "an end-of-file error: {err}");
    }

    #[tokio::test]
    async fn a_read_past_the_end_is_an_error_not_an_empty_chunk() {
        let (_temp, file) = file_with(b"0123456789");
        assert!(read_at(&file, 10, 1, &mut Buffers::default()).await.is_err());
    }

    #[tokio::test]
    async fn a_chunk_nobody_holds_is_read_into_again_and_a_held_one_never() {
        let data: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
        let (_temp, file) = file_with(&data);
        let mut buffers = Buffers::default();
        let first = read_at(&file, 0, 1024, &mut buffers).await.unwrap();
        let held = first.as_ptr();
        let second = read_at(&file, 1024, 1024, &mut buffers).await.unwrap();
        assert_ne!(second.as_ptr(), held, "the first chunk is still held: a new buffer");
        assert_eq!(first, &data[..1024], "and the held chunk is unchanged");
        drop(first);
        let third = read_at(&file, 2048, 1000, &mut buffers).await.unwrap();
        assert_eq!(third.as_ptr(), held, "the first chunk, dropped, is read into again");
        assert_eq!(third, &data[2048..3048]);
        assert_eq!(second, &data[1024..2048]);
        drop(third);
        let longer = read_at(&file, 3000, 1096, &mut buffers).await.unwrap();
        assert_eq!(longer, &data[3000..], "a reused buffer grown past its last length");
    }
}
