//! The request log: one line per request, written as tracing-subscriber
//! would write it, but formatted here in one pass.
//!
//! Through `tracing::info!` the line cost about 17 µs of CPU per warm
//! manifest GET (field-by-field formatting through tracing-subscriber's
//! visitors, and its per-event writer handling), more than half of what
//! the rest of the request costs (`perf`, benches/README.md). `main`
//! installs the log's writer and format here; the line then goes straight
//! into the same [`LogWriter`], with the same text or JSON layout,
//! whenever tracing's filter enables `larder::server` at INFO. Coloured
//! terminal logs, and a process that installed nothing (tests, library
//! users), take the `tracing` event as before.

use std::io::Write as _;
use std::sync::OnceLock;
use std::time::SystemTime;

use crate::config::LogFormat;
use crate::log_writer::LogWriter;

struct Installed {
    writer: LogWriter,
    format: LogFormat,
}

static INSTALLED: OnceLock<Installed> = OnceLock::new();

/// Writes request lines straight to `writer` from now on (once per
/// process; a second call changes nothing).
pub fn install(writer: LogWriter, format: LogFormat) {
    let _ = INSTALLED.set(Installed { writer, format });
}

/// What one request line says.
pub struct Line<'a> {
    pub id: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    pub route: &'static str,
    pub status: u16,
    pub bytes: Option<u64>,
    pub cache: Option<&'static str>,
    pub error: Option<&'a str>,
    pub ms: u64,
}

/// Logs `line`, if tracing's filter enables the request lines.
pub fn log(line: &Line<'_>) {
    if !tracing::enabled!(target: "larder::server", tracing::Level::INFO) {
        return;
    }
    let Some(installed) = INSTALLED.get() else {
        return line.log_with_tracing();
    };
    LINE.with_borrow_mut(|text| {
        text.clear();
        match installed.format {
            LogFormat::Text => line.text(text, SystemTime::now()),
            LogFormat::Json => line.json(text, SystemTime::now()),
        }
        // A full queue drops the line and counts it.
        installed.writer.line(text);
    });
}

/// Room for a typical line (about 260 bytes) without growing.
const LINE_CAPACITY: usize = 384;

thread_local! {
    /// Each thread formats its request lines in the same buffer.
    static LINE: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(Vec::with_capacity(LINE_CAPACITY));
}

impl Line<'_> {
    /// The same line as a `tracing` event, in the request's span (which
    /// the caller is in).
    fn log_with_tracing(&self) {
        tracing::info!(
            target: "larder::server",
            method = %self.method,
            path = self.path,
            route = self.route,
            status = self.status,
            bytes = self.bytes,
            cache = self.cache,
            error = self.error,
            ms = self.ms,
            "request"
        );
    }

    /// `<time>  INFO request{id=…}: larder::server: request method=GET path="…" …`
    fn text(&self, out: &mut Vec<u8>, now: SystemTime) {
        timestamp(out, now);
        let _ = write!(out, "  INFO request{{id={}}}: larder::server: request method={} path=", self.id, self.method);
        debug_str(out, self.path);
        out.extend_from_slice(b" route=");
        debug_str(out, self.route);
        let _ = write!(out, " status={}", self.status);
        if let Some(bytes) = self.bytes {
            let _ = write!(out, " bytes={bytes}");
        }
        if let Some(cache) = self.cache {
            out.extend_from_slice(b" cache=");
            debug_str(out, cache);
        }
        if let Some(error) = self.error {
            out.extend_from_slice(b" error=");
            debug_str(out, error);
        }
        let _ = writeln!(out, " ms={}", self.ms);
    }

    /// tracing-subscriber's JSON: fields, target, the request span and the span list.
    fn json(&self, out: &mut Vec<u8>, now: SystemTime) {
        out.extend_from_slice(br#"{"timestamp":""#);
        timestamp(out, now);
        out.extend_from_slice(br#"","level":"INFO","fields":{"message":"request","method":"#);
        json_string(out, self.method);
        out.extend_from_slice(br#","path":"#);
        json_string(out, self.path);
        let _ = write!(out, r#","route":"{}","status":{}"#, self.route, self.status);
        if let Some(bytes) = self.bytes {
            let _ = write!(out, r#","bytes":{bytes}"#);
        }
        if let Some(cache) = self.cache {
            let _ = write!(out, r#","cache":"{cache}""#);
        }
        if let Some(error) = self.error {
            out.extend_from_slice(br#","error":"#);
            json_string(out, error);
        }
        let _ = writeln!(
            out,
            r#","ms":{}}},"target":"larder::server","span":{{"id":"{id}","name":"request"}},"spans":[{{"id":"{id}","name":"request"}}]}}"#,
            self.ms,
            id = self.id
        );
    }
}

thread_local! {
    /// The second a thread last stamped a line in, and its text up to the
    /// fraction (`2026-12-05T04:36:11.`).
    static SECOND: std::cell::Cell<(u64, [u8; 20])> = const { std::cell::Cell::new((u64::MAX, [0; 20])) };
}

/// `now` as `humantime::format_rfc3339_micros` writes it
/// (`2026-12-05T04:36:11.123456Z`), the date and time of day formatted
/// once per second per thread: through `Display` they were most of a
/// line's formatting (issue 35, benches/README.md).
fn timestamp(out: &mut Vec<u8>, now: SystemTime) {
    let Ok(since) = now.duration_since(std::time::UNIX_EPOCH) else {
        let _ = write!(out, "{}", humantime::format_rfc3339_micros(now));
        return;
    };
    let secs = since.as_secs();
    let (cached, mut prefix) = SECOND.get();
    if cached != secs {
        let whole = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
        let mut text = Vec::with_capacity(20);
        let _ = write!(text, "{}", humantime::format_rfc3339_seconds(whole));
        // `YYYY-MM-DDTHH:MM:SSZ`; a year past 9999 takes the slow way.
        if text.len() != 20 {
            let _ = write!(out, "{}", humantime::format_rfc3339_micros(now));
            return;
        }
        prefix[..19].copy_from_slice(&text[..19]);
        prefix[19] = b'.';
        SECOND.set((secs, prefix));
    }
    out.extend_from_slice(&prefix);
    let mut micros = since.subsec_micros();
    let mut digits = [b'0'; 6];
    for d in digits.iter_mut().rev() {
        *d = b'0' + (micros % 10) as u8;
        micros /= 10;
    }
    out.extend_from_slice(&digits);
    out.push(b'Z');
}

/// `s` as Rust's `Debug` writes a string (what tracing-subscriber's text
/// format does with string fields): quoted, escaped. Paths and the fixed
/// words are plain printable ASCII, which needs no escaping and is copied
/// as is; anything else goes through `Debug`.
fn debug_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        let _ = write!(out, "{s:?}");
    }
}

/// `s` as a JSON string, quotes and escapes included: serde_json's, as
/// tracing-subscriber's JSON layer writes it.
fn json_string(out: &mut Vec<u8>, s: &str) {
    let _ = serde_json::to_writer(&mut *out, s);
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::MakeWriter;

    use super::*;

    /// Collects what tracing-subscriber writes.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl MakeWriter<'_> for Captured {
        type Writer = Captured;

        fn make_writer(&self) -> Captured {
            self.clone()
        }
    }

    /// The line as tracing-subscriber writes it, inside a `request` span
    /// made as `server::handle` makes it.
    fn through_tracing(line: &Line<'_>, format: LogFormat) -> String {
        let captured = Captured::default();
        let builder = tracing_subscriber::fmt().with_writer(captured.clone()).with_ansi(false);
        let dispatch = match format {
            LogFormat::Text => tracing::Dispatch::new(builder.finish()),
            LogFormat::Json => tracing::Dispatch::new(builder.json().finish()),
        };
        tracing::dispatcher::with_default(&dispatch, || {
            let span = tracing::info_span!(target: "larder::server", "request", id = %line.id);
            let _entered = span.enter();
            line.log_with_tracing();
        });
        let written = captured.0.lock().unwrap().clone();
        String::from_utf8(written).unwrap()
    }

    fn formatted(line: &Line<'_>, format: LogFormat) -> String {
        let mut out = Vec::new();
        match format {
            LogFormat::Text => line.text(&mut out, SystemTime::now()),
            LogFormat::Json => line.json(&mut out, SystemTime::now()),
        }
        String::from_utf8(out).unwrap()
    }

    /// The line without its timestamp (up to the first space, or the
    /// JSON `timestamp` member).
    fn untimed(line: &str) -> String {
        if line.starts_with('{') {
            let mut value: serde_json::Value = serde_json::from_str(line).unwrap();
            let stamp = value.as_object_mut().unwrap().remove("timestamp").unwrap();
            assert!(humantime::parse_rfc3339(stamp.as_str().unwrap()).is_ok(), "{stamp}");
            value.to_string()
        } else {
            let (stamp, rest) = line.split_once(' ').unwrap();
            assert!(humantime::parse_rfc3339(stamp).is_ok(), "{stamp}");
            rest.to_string()
        }
    }

    #[test]
    fn timestamps_read_as_humantime_writes_them() {
        let base = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_796_000_000);
        for micros in [0, 1, 999_999, 123_456, 1_000_000, 59_000_007, 86_400_000_001] {
            let at = base + std::time::Duration::from_micros(micros);
            let mut out = Vec::new();
            timestamp(&mut out, at);
            assert_eq!(String::from_utf8(out).unwrap(), humantime::format_rfc3339_micros(at).to_string());
        }
        let mut out = Vec::new();
        timestamp(&mut out, std::time::UNIX_EPOCH);
        assert_eq!(out, b"1970-01-01T00:00:00.000000Z");
    }

    #[test]
    fn a_request_line_reads_as_tracing_would_write_it() {
        let full = Line {
            id: "0123456789abcdef",
            method: "GET",
            path: "/v2/library/alpine/blobs/sha256:0a1b",
            route: "blob",
            status: 206,
            bytes: Some(1_048_576),
            cache: Some("coalesced"),
            error: Some("upstream said \"no\" \\ twice\n\tand ü"),
            ms: 12,
        };
        let bare = Line {
            id: "fedcba9876543210",
            method: "PUT",
            path: "/v2/\"odd\"/pa'th",
            route: "invalid",
            status: 405,
            bytes: None,
            cache: None,
            error: None,
            ms: 0,
        };
        for line in [&full, &bare] {
            for format in [LogFormat::Text, LogFormat::Json] {
                let ours = formatted(line, format);
                let theirs = through_tracing(line, format);
                assert!(ours.ends_with('\n') && ours.matches('\n').count() == 1, "one line: {ours:?}");
                assert_eq!(untimed(&ours), untimed(&theirs), "{format:?}");
            }
        }
        assert!(formatted(&full, LogFormat::Text).contains(" bytes=1048576 cache=\"coalesced\" error="));
    }
}
