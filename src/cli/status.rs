//! `larder status`: the status page's facts as text (or `--json`).

use std::fmt::Write as _;

use crate::server::admin::status::{Repository, Status};
use crate::server::admin::status_page::{ago, bytes, percent, span};

fn repositories(out: &mut String, title: &str, repos: &[Repository], now_ms: u64) {
    let _ = writeln!(out, "\n{title}");
    if repos.is_empty() {
        let _ = writeln!(out, "  (nothing cached yet)");
        return;
    }
    let width = repos.iter().map(|r| r.upstream.len() + r.repository.len() + 1).max().unwrap_or(0).max(10);
    for r in repos {
        let name = format!("{}/{}", r.upstream, r.repository);
        let _ = writeln!(
            out,
            "  {name:<width$}  {:>10}  {:>5} items  used {}",
            bytes(r.bytes),
            r.items,
            ago(now_ms, r.last_used_ms)
        );
    }
}

/// The text report.
pub fn render(s: &Status, admin: &str) -> String {
    let c = &s.cache;
    let share = if c.max_size_bytes == 0 { 0.0 } else { c.size_bytes as f64 * 100.0 / c.max_size_bytes as f64 };
    let mut out = String::new();
    let _ = writeln!(out, "larder {} at {admin}, up {}", s.version, span(s.uptime_seconds));
    let _ = writeln!(
        out,
        "cache        {} of {} ({share:.1}%), eviction above {}",
        bytes(c.size_bytes),
        bytes(c.max_size_bytes),
        bytes(c.high_watermark_bytes)
    );
    let _ = writeln!(
        out,
        "entries      {} blobs, {} manifests, {} repositories",
        c.blobs, c.manifests, s.repositories.count
    );
    let h = &s.hit_ratio;
    let _ = writeln!(
        out,
        "hit ratio    blobs {} of {} requests, manifests {} of {} requests (since start)",
        percent(h.blob),
        h.blob_requests,
        percent(h.manifest),
        h.manifest_requests
    );
    let _ = writeln!(out, "fills        {} in flight", c.fills_in_flight);
    let _ = writeln!(out, "\nupstreams");
    for u in &s.upstreams {
        let rate = match &u.rate_limit {
            Some(r) => match r.limit {
                Some(limit) => format!("rate limit {} of {limit} left", r.remaining),
                None => format!("rate limit {} left", r.remaining),
            },
            None => "rate limit not announced".to_owned(),
        };
        let last_error = match &u.last_error {
            Some(e) => format!("last error {} ({})", ago(s.now_ms, e.at_ms), e.message),
            None => "no errors".to_owned(),
        };
        let _ = writeln!(
            out,
            "  {}{} {}: {} requests, {} errors, {last_error}; {rate}",
            u.name,
            if u.default { " (default)" } else { "" },
            u.url,
            u.requests,
            u.errors
        );
    }
    let r = &s.repositories;
    repositories(&mut out, "largest repositories", &r.largest, s.now_ms);
    repositories(&mut out, "most recently used", &r.recent, s.now_ms);
    if !r.complete {
        let _ = writeln!(out, "  (partial: the index scan stopped at its row limit)");
    }
    out
}
