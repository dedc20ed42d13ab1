//! The process's log writer: whole lines queued in memory by whichever
//! thread logs, written to stderr by a thread of its own in batches.
//!
//! A slow or stalled stderr (a container runtime's full log pipe) never
//! holds up a request: past [`QUEUE_LIMIT`] bytes waiting, new lines are
//! dropped and counted. tracing-appender did this before, with a channel
//! message per line; its writer thread, woken for nearly every line,
//! and the wake-ups themselves were a quarter of larder's CPU serving
//! warm manifests with the request log on (`perf`, benches/README.md).
//! Here a thread that logs wakes the writer only when it is idle; the
//! writer writes what is queued, then lets lines gather for
//! [`BATCH_WINDOW`] before it writes again, so under load it wakes at
//! most 1/[`BATCH_WINDOW`] times a second and a line waits at most that
//! long (a line after a quiet spell goes out at once).
//!
//! Each `write` call is one whole line (tracing-subscriber writes each
//! event with one call; the request log does too), so lines are never
//! interleaved, and one thread writes them all in order.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// Bytes of lines that may wait for the writer: about a second of warm
/// requests (16k request lines of ~260 bytes) behind a stalled stderr.
pub const QUEUE_LIMIT: usize = 4 << 20;
/// How long the writer, once woken, lets lines gather before it writes.
pub const BATCH_WINDOW: Duration = Duration::from_millis(10);
/// A drained buffer larger than this is given back to the allocator, so
/// one burst does not keep its peak in memory for good.
const KEEP_CAPACITY: usize = 256 << 10;

#[derive(Default)]
struct Queue {
    lines: Vec<u8>,
    /// The writer is waiting for a line: the next one must wake it.
    idle: bool,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    dropped: AtomicU64,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        // Every change under the lock is a single append, swap or flag.
        self.queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Where log lines go; cheap to clone, every clone feeds the same writer.
#[derive(Clone)]
pub struct LogWriter {
    shared: Arc<Shared>,
}

/// Stops the writer when dropped, after it has written every queued line.
pub struct Flush {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl LogWriter {
    /// Starts the writer thread, writing to `out`.
    pub fn start(out: impl Write + Send + 'static) -> io::Result<(LogWriter, Flush)> {
        let shared = Arc::new(Shared::default());
        let writer = Arc::clone(&shared);
        let thread = std::thread::Builder::new().name("larder-log".into()).spawn(move || write_lines(&writer, out))?;
        Ok((LogWriter { shared: Arc::clone(&shared) }, Flush { shared, thread: Some(thread) }))
    }

    /// Queues one or more whole lines, or drops them (and counts one) when
    /// [`QUEUE_LIMIT`] bytes already wait.
    pub fn line(&self, line: &[u8]) {
        let mut queue = self.shared.queue();
        if queue.lines.len() + line.len() > QUEUE_LIMIT {
            drop(queue);
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        queue.lines.extend_from_slice(line);
        let wake = std::mem::take(&mut queue.idle);
        drop(queue);
        if wake {
            self.shared.wake.notify_one();
        }
    }

    /// Lines dropped so far because the queue was full.
    pub fn dropped_lines(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }
}

impl Write for &LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.line(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = &'a LogWriter;

    fn make_writer(&'a self) -> &'a LogWriter {
        self
    }
}

/// The writer thread: waits for lines, writes what is queued, then lets
/// more gather for [`BATCH_WINDOW`] before it looks again; only a look
/// that finds nothing makes it idle (and the next line wakes it). A line
/// after a quiet spell goes out at once; under load the writer wakes by
/// itself, at most 1/[`BATCH_WINDOW`] times a second.
fn write_lines(shared: &Shared, mut out: impl Write) {
    let mut batch = Vec::new();
    loop {
        let mut queue = shared.queue();
        while queue.lines.is_empty() && !queue.closed {
            queue.idle = true;
            queue = shared.wake.wait(queue).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        queue.idle = false;
        if queue.lines.is_empty() {
            return; // closed, and everything written
        }
        std::mem::swap(&mut queue.lines, &mut batch);
        let closed = queue.closed;
        drop(queue);
        // A failed write (stderr closed) loses these lines; there is
        // nowhere else to report it.
        let _ = out.write_all(&batch).and_then(|()| out.flush());
        batch.clear();
        if batch.capacity() > KEEP_CAPACITY {
            batch = Vec::new();
        }
        if !closed {
            std::thread::sleep(BATCH_WINDOW);
        }
    }
}

impl Drop for Flush {
    fn drop(&mut self) {
        self.shared.queue().closed = true;
        self.shared.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A stderr stand-in that records what was written and in how many
    /// `write` calls, and can be held up.
    #[derive(Clone, Default)]
    struct Sink {
        bytes: Arc<Mutex<Vec<u8>>>,
        writes: Arc<AtomicUsize>,
        stall: Arc<Mutex<()>>,
    }

    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let _held = self.stall.lock().unwrap();
            self.writes.fetch_add(1, Ordering::Relaxed);
            self.bytes.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_from_many_threads_arrive_whole_in_few_writes() {
        let sink = Sink::default();
        let (log, flush) = LogWriter::start(sink.clone()).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let log = log.clone();
                std::thread::spawn(move || {
                    for i in 0..2500 {
                        log.line(format!("thread {t} line {i}\n").as_bytes());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        drop(flush);
        let text = String::from_utf8(sink.bytes.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 10_000, "every line, once");
        for t in 0..4 {
            let own: Vec<usize> = lines
                .iter()
                .filter_map(|l| l.strip_prefix(&format!("thread {t} line ")))
                .map(|n| n.parse().unwrap())
                .collect();
            assert_eq!(own, (0..2500).collect::<Vec<_>>(), "each thread's lines whole and in order");
        }
        let writes = sink.writes.load(Ordering::Relaxed);
        assert!(writes < 1000, "10,000 lines in batches, not a write each: {writes} writes");
        assert_eq!(log.dropped_lines(), 0);
    }

    #[test]
    fn a_stalled_stderr_drops_and_counts_lines_instead_of_blocking() {
        let sink = Sink::default();
        let stalled = sink.stall.lock().unwrap();
        let (log, flush) = LogWriter::start(sink.clone()).unwrap();
        let line = [b'x'; 1023].iter().chain(b"\n").copied().collect::<Vec<u8>>();
        log.line(&line);
        // The writer takes the first line and blocks writing it; the queue
        // then fills up to its limit and every further line is dropped.
        std::thread::sleep(BATCH_WINDOW * 5);
        let offered = QUEUE_LIMIT / line.len() + 100;
        for _ in 0..offered {
            log.line(&line);
        }
        let dropped = log.dropped_lines();
        assert!((100..=101).contains(&dropped), "the lines over {QUEUE_LIMIT} bytes: {dropped} dropped");
        drop(stalled);
        drop(flush);
        let written = sink.bytes.lock().unwrap().len();
        assert_eq!(written, (offered + 1 - dropped as usize) * line.len(), "every queued line written at the end");
    }

    #[test]
    fn an_idle_writer_sends_a_line_within_the_batch_window() {
        let sink = Sink::default();
        let (log, _flush) = LogWriter::start(sink.clone()).unwrap();
        std::thread::sleep(BATCH_WINDOW * 3);
        log.line(b"one\n");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while sink.bytes.lock().unwrap().is_empty() {
            assert!(std::time::Instant::now() < deadline, "the line was never written");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(&*sink.bytes.lock().unwrap(), b"one\n");
    }
}
