//! Unit tests of fills: readers of a fill in flight, ranges, aborts, removals.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use http_body_util::BodyExt;

use super::*;
use crate::cache::Via;

/// A fill in progress over a temp file: the test plays the fill's part.
struct FakeFill {
    temp: tempfile::NamedTempFile,
    file: Arc<File>,
    tx: watch::Sender<Progress>,
}

impl FakeFill {
    /// A fill from upstream.
    fn new(size: u64) -> (FakeFill, watch::Receiver<Progress>) {
        FakeFill::vouched_from(size, 0)
    }

    /// A fill whose bytes before `vouched_from` come from the shared
    /// tier or a peer.
    fn vouched_from(size: u64, vouched_from: u64) -> (FakeFill, watch::Receiver<Progress>) {
        let temp = tempfile::NamedTempFile::new().unwrap();
        let file = Arc::new(temp.as_file().try_clone().unwrap());
        let progress =
            Progress::Streaming { file: Arc::clone(&file), size: Some(size), written: 0, vouched_from, extents: None };
        let (tx, rx) = watch::channel(progress);
        (FakeFill { temp, file, tx }, rx)
    }

    /// Starts over in a new temp file (the first source failed the digest).
    fn start_over(&mut self, size: u64) {
        self.temp = tempfile::NamedTempFile::new().unwrap();
        self.file = Arc::new(self.temp.as_file().try_clone().unwrap());
        let file = Arc::clone(&self.file);
        let progress = Progress::Streaming { file, size: Some(size), written: 0, vouched_from: 0, extents: None };
        self.tx.send_replace(progress);
    }

    fn write(&mut self, bytes: &[u8]) {
        self.temp.write_all(bytes).unwrap();
        let len = self.temp.as_file().metadata().unwrap().len();
        self.tx.send_modify(|p| {
            if let Progress::Streaming { written, .. } = p {
                *written = len;
            }
        });
    }
}

/// Polls a body for a frame, giving up (None) if none comes promptly.
async fn next_frame(body: &mut Body) -> Option<Result<Bytes, String>> {
    let frame = tokio::time::timeout(Duration::from_millis(200), body.frame()).await.ok()??;
    Some(frame.map(|f| f.into_data().unwrap_or_default()).map_err(|e| e.to_string()))
}

#[tokio::test]
async fn the_last_byte_waits_for_verification() {
    let (mut fill, rx) = FakeFill::new(10);
    let mut body = read_body(Arc::clone(&fill.file), Some(rx), 0, Some(10), Via::Client, None);
    fill.write(b"0123456789");
    assert_eq!(next_frame(&mut body).await.unwrap().unwrap(), "012345678");
    assert!(next_frame(&mut body).await.is_none(), "the final byte must wait for the digest");
    fill.tx.send_replace(Progress::Verified { file: Arc::clone(&fill.file), size: 10 });
    assert_eq!(next_frame(&mut body).await.unwrap().unwrap(), "9", "not for the commit");
    assert!(body.frame().await.is_none(), "then the body ends cleanly");
}

#[tokio::test]
async fn a_reader_that_saw_the_digest_match_finishes_even_if_the_commit_then_fails() {
    let size = 2 * READ_CHUNK as u64 + 10;
    let (mut fill, rx) = FakeFill::new(size);
    let mut body = read_body(Arc::clone(&fill.file), Some(rx), 0, None, Via::Client, None);
    fill.write(&vec![b'x'; size as usize]);
    let mut got = next_frame(&mut body).await.unwrap().unwrap().len() as u64;
    fill.tx.send_replace(Progress::Verified { file: Arc::clone(&fill.file), size });
    got += next_frame(&mut body).await.unwrap().unwrap().len() as u64;
    fill.tx.send_replace(Progress::Failed(Error::Internal("fsync failed".into())));
    while let Some(frame) = next_frame(&mut body).await {
        got += frame.expect("verified bytes are not aborted by the commit's failure").len() as u64;
    }
    assert_eq!(got, size);
}

#[tokio::test]
async fn a_range_before_the_end_needs_no_verification() {
    let (mut fill, rx) = FakeFill::new(10);
    let mut body = read_body(Arc::clone(&fill.file), Some(rx), 2, Some(5), Via::Client, None);
    fill.write(b"0123456789");
    assert_eq!(next_frame(&mut body).await.unwrap().unwrap(), "234");
    assert!(body.frame().await.is_none());
}

#[tokio::test]
async fn a_client_range_gets_bytes_from_the_shared_tier_or_a_peer_only_once_the_digest_matched() {
    let (mut fill, rx) = FakeFill::vouched_from(10, UNVOUCHED);
    let mut range = read_body(Arc::clone(&fill.file), Some(rx.clone()), 2, Some(5), Via::Client, None);
    let mut resume = read_body(Arc::clone(&fill.file), Some(rx.clone()), 4, Some(10), Via::Client, None);
    let mut whole = read_body(Arc::clone(&fill.file), Some(rx.clone()), 0, Some(10), Via::Client, None);
    let mut peer = read_body(Arc::clone(&fill.file), Some(rx), 2, Some(5), Via::Peer { shared_missed: false }, None);
    fill.write(b"0123456789");
    assert!(next_frame(&mut range).await.is_none(), "a range ends cleanly: it must not get unverified bytes");
    assert!(next_frame(&mut resume).await.is_none(), "nor a resume from a byte after the first");
    assert_eq!(next_frame(&mut whole).await.unwrap().unwrap(), "012345678", "the whole blob streams");
    assert_eq!(next_frame(&mut peer).await.unwrap().unwrap(), "234", "a peer hashes them itself");
    fill.tx.send_replace(Progress::Verified { file: Arc::clone(&fill.file), size: 10 });
    assert_eq!(next_frame(&mut range).await.unwrap().unwrap(), "234");
    assert!(range.frame().await.is_none());
    assert_eq!(next_frame(&mut resume).await.unwrap().unwrap(), "456789");
}

#[tokio::test]
async fn a_client_range_gets_what_upstream_sent_after_a_resume_at_once() {
    // Bytes 0..4 came from the shared tier, 4.. from upstream.
    let (mut fill, rx) = FakeFill::vouched_from(10, 4);
    let mut before = read_body(Arc::clone(&fill.file), Some(rx.clone()), 2, Some(6), Via::Client, None);
    let mut after = read_body(Arc::clone(&fill.file), Some(rx.clone()), 5, Some(8), Via::Client, None);
    fill.write(b"0123456789");
    assert_eq!(next_frame(&mut after).await.unwrap().unwrap(), "567");
    assert!(after.frame().await.is_none());
    assert!(next_frame(&mut before).await.is_none(), "its first bytes are not vouched for");
    fill.tx.send_replace(Progress::Complete { file: Arc::clone(&fill.file), size: 10 });
    assert_eq!(next_frame(&mut before).await.unwrap().unwrap(), "2345");
}

#[tokio::test]
async fn a_fill_that_starts_over_keeps_the_readers_that_sent_nothing_and_aborts_the_others() {
    let (mut fill, rx) = FakeFill::vouched_from(10, UNVOUCHED);
    let mut streamed = read_body(Arc::clone(&fill.file), Some(rx.clone()), 0, Some(10), Via::Client, None);
    let mut waiting = read_body(Arc::clone(&fill.file), Some(rx), 3, Some(6), Via::Client, None);
    fill.write(b"XXXXXXXXXX");
    assert_eq!(next_frame(&mut streamed).await.unwrap().unwrap(), "XXXXXXXXX");
    assert!(next_frame(&mut waiting).await.is_none());
    fill.start_over(10);
    fill.write(b"0123456789");
    fill.tx.send_replace(Progress::Verified { file: Arc::clone(&fill.file), size: 10 });
    assert!(next_frame(&mut streamed).await.unwrap().is_err(), "it sent bytes of the bad attempt");
    assert_eq!(next_frame(&mut waiting).await.unwrap().unwrap(), "345", "it reads the new file");
    assert!(waiting.frame().await.is_none());
}

#[tokio::test]
async fn a_range_beyond_the_prefix_of_a_ranged_fill_reads_its_bytes_as_they_are_written() {
    let (fill, rx) = FakeFill::new(10);
    let extents = Arc::new(Extents::new(0));
    fill.tx.send_modify(|p| {
        if let Progress::Streaming { extents: e, .. } = p {
            *e = Some(Arc::clone(&extents));
        }
    });
    let mut far = read_body(Arc::clone(&fill.file), Some(rx.clone()), 6, Some(8), Via::Client, None);
    let mut whole = read_body(Arc::clone(&fill.file), Some(rx), 0, Some(10), Via::Client, None);
    assert!(next_frame(&mut far).await.is_none(), "nothing written there yet");
    assert_eq!(extents.pop_want(), Some(6), "the reader said where it waits");
    // A part writes bytes 6..10 before anything before them.
    fill.temp.as_file().write_all_at(b"6789", 6).unwrap();
    extents.record(6, 10);
    fill.tx.send_modify(|_| {});
    assert_eq!(next_frame(&mut far).await.unwrap().unwrap(), "67", "served before the prefix reaches it");
    assert!(far.frame().await.is_none());
    assert!(next_frame(&mut whole).await.is_none(), "the whole blob waits for its prefix");
    fill.temp.as_file().write_all_at(b"012345", 0).unwrap();
    extents.record(0, 6);
    fill.tx.send_modify(|p| {
        if let Progress::Streaming { written, .. } = p {
            *written = 10;
        }
    });
    assert_eq!(next_frame(&mut whole).await.unwrap().unwrap(), "012345678", "the last byte waits for the digest");
    assert_eq!(extents.pop_want(), None, "a reader at the prefix asks for nothing");
}

#[tokio::test]
async fn a_failed_fill_aborts_every_reader() {
    let (mut fill, rx) = FakeFill::new(10);
    let mut first = read_body(Arc::clone(&fill.file), Some(rx.clone()), 0, None, Via::Client, None);
    let mut second = read_body(Arc::clone(&fill.file), Some(rx), 0, Some(10), Via::Client, None);
    fill.write(b"01234");
    assert_eq!(next_frame(&mut first).await.unwrap().unwrap(), "01234");
    fill.tx.send_replace(Progress::Failed(Error::Internal("digest mismatch".into())));
    assert!(next_frame(&mut first).await.unwrap().is_err());
    assert!(next_frame(&mut second).await.unwrap().is_err());
}

#[tokio::test]
async fn readers_start_mid_fill_and_follow_it() {
    let (mut fill, rx) = FakeFill::new(6);
    fill.write(b"abc");
    let mut late = read_body(Arc::clone(&fill.file), Some(rx), 0, None, Via::Client, None);
    assert_eq!(next_frame(&mut late).await.unwrap().unwrap(), "abc");
    assert!(next_frame(&mut late).await.is_none(), "waits for more bytes");
    fill.write(b"def");
    assert_eq!(next_frame(&mut late).await.unwrap().unwrap(), "de");
    fill.tx.send_replace(Progress::Complete { file: Arc::clone(&fill.file), size: 6 });
    assert_eq!(next_frame(&mut late).await.unwrap().unwrap(), "f");
    assert!(late.frame().await.is_none());
}

#[tokio::test]
async fn no_fill_starts_while_its_digest_is_being_removed() {
    let fills = Fills::default();
    let d = Digest::of(b"evicted");
    let marked = fills.begin_removal([d]);
    assert_eq!(marked, [d]);
    let client = Priority::client();
    let Attach::Removing(done) = fills.join_or_start(d, ("u\0r", &client), || false, |_| panic!("no fill may start"))
    else {
        panic!("a digest being removed is neither joined nor started");
    };
    let waiter = tokio::spawn(removal_finished(done));
    fills.end_removal(&marked);
    tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("the waiter is woken").unwrap();
    assert!(matches!(fills.join_or_start(d, ("u\0r", &client), || false, |_| {}), Attach::Started(_)));
    assert!(fills.begin_removal([d]).is_empty(), "a digest with a fill in flight is left to the fill");
}

#[tokio::test]
async fn a_fill_whose_sender_vanishes_is_an_error_not_a_hang() {
    let (mut fill, rx) = FakeFill::new(10);
    let mut body = read_body(Arc::clone(&fill.file), Some(rx), 0, None, Via::Client, None);
    fill.write(b"01");
    assert_eq!(next_frame(&mut body).await.unwrap().unwrap(), "01");
    drop(fill);
    assert!(next_frame(&mut body).await.unwrap().is_err());
}
