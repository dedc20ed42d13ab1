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

use std::fs::File;
use std::io::IoSliceMut;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use bytes::Bytes;
use rustix::io::ReadWriteFlags;

use crate::blocking::blocking;
use crate::error::Error;

/// Up to `len` bytes of `file` from `offset`: all of them, or an error if
/// the file ends first. A read served from the page cache may be shorter
/// (never empty); the caller asks again for the rest.
pub async fn read_at(file: &Arc<File>, offset: u64, len: usize) -> Result<Bytes, Error> {
    let mut buf = vec![0u8; len];
    let cached = rustix::io::preadv2(&**file, &mut [IoSliceMut::new(&mut buf)], offset, ReadWriteFlags::NOWAIT);
    if let Ok(n @ 1..) = cached {
        buf.truncate(n);
        return Ok(Bytes::from(buf));
    }
    // Nothing cached (EAGAIN), RWF_NOWAIT unsupported, or an error the
    // blocking read reports properly: the same buffer, on the blocking pool.
    let file = Arc::clone(file);
    blocking(move || {
        file.read_exact_at(&mut buf, offset)?;
        Ok(Bytes::from(buf))
    })
    .await
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
            got.extend_from_slice(&read_at(&file, at, 300_000 - got.len()).await.unwrap());
        }
        assert_eq!(got, &data[1000..301_000]);
    }

    #[tokio::test]
    async fn a_file_shorter_than_the_range_is_reported_not_padded() {
        let (_temp, file) = file_with(b"0123456789");
        assert_eq!(read_at(&file, 2, 5).await.unwrap(), "23456");
        let mut got = Vec::new();
        let err = loop {
            match read_at(&file, 8 + got.len() as u64, 5 - got.len()).await {
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
        assert!(read_at(&file, 10, 1).await.is_err());
    }
}
