//! distribution's access log (Apache combined format), parsed for counting.
//!
//! A line looks like
//! `127.0.0.1 - - [30/Nov/2026:01:39:07 +0000] "GET /v2/?x=1 HTTP/1.1" 200 2 "" "curl/7.88.1"`;
//! lines of distribution's own logging in the same file are skipped.

use std::fmt;
use std::sync::OnceLock;

use regex::Regex;

/// The query parameter the harness adds to its own sync requests, which are
/// left out of every [`AccessLog`].
pub const SENTINEL_PARAM: &str = "larder-test-sentinel";

/// One request as the origin logged it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessLogEntry {
    pub method: String,
    /// Path including the query string, as sent.
    pub target: String,
    pub status: u16,
    /// Body bytes sent, as logged (`None` for `-`).
    pub bytes: Option<u64>,
    pub user_agent: String,
}

impl AccessLogEntry {
    /// The path without the query string.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or(&self.target)
    }

    /// `GET /v2/<name>/blobs/sha256:<hex>`, whatever the status.
    pub fn is_blob_get(&self) -> bool {
        self.method == "GET" && is_blob_path(self.path())
    }

    /// GET or HEAD of `/v2/<name>/manifests/<reference>`, whatever the status.
    pub fn is_manifest_request(&self) -> bool {
        self.path().starts_with("/v2/") && self.path().contains("/manifests/")
    }

    fn is_sentinel(&self) -> bool {
        self.target.contains(SENTINEL_PARAM)
    }
}

fn is_blob_path(path: &str) -> bool {
    let Some(rest) = path.strip_prefix("/v2/") else {
        return false;
    };
    match rest.rsplit_once("/blobs/") {
        Some((name, digest)) => !name.is_empty() && digest.starts_with("sha256:"),
        None => false,
    }
}

impl fmt::Display for AccessLogEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} -> {} ({})", self.method, self.target, self.status, self.user_agent)
    }
}

/// Parses one access-log line; `None` for any other kind of line.
pub fn parse_line(line: &str) -> Option<AccessLogEntry> {
    static COMBINED: OnceLock<Regex> = OnceLock::new();
    let combined = COMBINED.get_or_init(|| {
        Regex::new(
            r#"^\S+ \S+ \S+ \[[^\]]+\] "(\S+) (\S+) [^"]*" (\d{3}) (\d+|-) "(?:[^"\\]|\\.)*" "((?:[^"\\]|\\.)*)"\s*$"#,
        )
        .unwrap_or_else(|e| panic!("the access-log pattern does not compile: {e}"))
    });
    let captures = combined.captures(line)?;
    Some(AccessLogEntry {
        method: captures[1].to_owned(),
        target: captures[2].to_owned(),
        status: captures[3].parse().ok()?,
        bytes: captures[4].parse().ok(),
        user_agent: captures[5].to_owned(),
    })
}

/// Every access-log entry in `text`, the harness's sync requests included.
pub fn parse_all(text: &str) -> Vec<AccessLogEntry> {
    text.lines().filter_map(parse_line).collect()
}

/// A position in an origin's access log; see `Origin::log_mark`.
#[derive(Clone, Copy, Debug)]
pub struct LogMark(pub(crate) usize);

/// A list of requests the origin served (the harness's own sync requests left out).
#[derive(Clone, Debug, Default)]
pub struct AccessLog(pub Vec<AccessLogEntry>);

impl AccessLog {
    /// Entries from raw parsed entries, dropping sentinels.
    pub fn from_raw(entries: impl IntoIterator<Item = AccessLogEntry>) -> Self {
        AccessLog(entries.into_iter().filter(|e| !e.is_sentinel()).collect())
    }

    pub fn entries(&self) -> &[AccessLogEntry] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The blob GETs (`GET /v2/…/blobs/sha256:…`), any status.
    pub fn blob_get_entries(&self) -> Vec<&AccessLogEntry> {
        self.0.iter().filter(|e| e.is_blob_get()).collect()
    }

    /// How many blob GETs there were.
    pub fn blob_gets(&self) -> usize {
        self.blob_get_entries().len()
    }

    /// The manifest GETs and HEADs, any status.
    pub fn manifest_requests(&self) -> Vec<&AccessLogEntry> {
        self.0.iter().filter(|e| e.is_manifest_request()).collect()
    }

    /// Entries whose path starts with `prefix` (e.g. `/v2/team/app/`).
    pub fn under(&self, prefix: &str) -> Vec<&AccessLogEntry> {
        self.0.iter().filter(|e| e.path().starts_with(prefix)).collect()
    }
}

impl fmt::Display for AccessLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return write!(f, "  (no requests)");
        }
        for (i, entry) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "  {entry}")?;
        }
        Ok(())
    }
}
