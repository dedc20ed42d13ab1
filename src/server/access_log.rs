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
        let _ = write!(
            out,
            "{}  INFO request{{id={}}}: larder::server: request method={} path=",
            humantime::format_rfc3339_micros(now),
            self.id,
            self.method
        );
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
        let _ = write!(
            out,
            r#"{{"timestamp":"{}","level":"INFO","fields":{{"message":"request","method":"#,
            humantime::format_rfc3339_micros(now)
        );
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
