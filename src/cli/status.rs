//! `larder status`: the status page's facts as text (or `--json`).

use std::fmt::Write as _;

use crate::server::admin::status::{HOLDINGS_TTL, Repository, Status};
use crate::server::admin::status_page::{ago, bytes, images, of_total, percent, short_digest, span};
use crate::warm::status::WarmReport;

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

fn warm(out: &mut String, w: &WarmReport, now_ms: u64) {
    let _ = writeln!(out, "\nkept warm ({})", images(w.images.len()));
    let width = w.images.iter().map(|i| i.image.len()).max().unwrap_or(0).max(10);
    for i in &w.images {
        let digest = i.digest.as_deref().map_or_else(|| "-".to_owned(), short_digest);
        let checked =
            i.last_check_ms.map_or_else(|| "not checked yet".to_owned(), |t| format!("checked {}", ago(now_ms, t)));
        let _ = writeln!(
            out,
            "  {:<width$}  {:<16}  {digest}  {} cached, {checked}{}",
            i.image,
            i.state.as_str(),
            of_total(i.bytes_cached, i.bytes_total),
            if i.pin { ", pinned" } else { "" },
        );
        if let Some(message) = &i.message {
            let _ = writeln!(out, "  {:<width$}  {message}", "");
        }
    }
    if let Some(f) = &w.file {
        let _ = writeln!(out, "  warm file {}: {}", f.path, images(f.images));
        if let Some(e) = &f.error {
            let _ = writeln!(out, "    {e}");
        }
        for bad in &f.bad_lines {
            let _ = writeln!(out, "    line {}: {}", bad.line, bad.message);
        }
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
    let _ = writeln!(out, "pinned       {}", bytes(c.pinned.bytes));
    for sentence in &c.pinned.over_limit {
        let _ = writeln!(out, "  {sentence}");
    }
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
        let mut cached = match u.max_size_bytes {
            Some(max) => format!("{} of {max_size} cached", bytes(u.cache_bytes), max_size = bytes(max)),
            None => format!("{} cached", bytes(u.cache_bytes)),
        };
        if let Some(max) = u.max_bandwidth_bytes_per_second {
            cached.push_str(&format!(", at most {}/s", bytes(max)));
        }
        let _ = writeln!(
            out,
            "  {}{}{} {}: {cached}, {} requests, {} errors, {last_error}; {rate}",
            u.name,
            if u.default { " (default)" } else { "" },
            if u.verifies_clients { " (verifies clients)" } else { "" },
            u.url,
            u.requests,
            u.errors
        );
    }
    if !s.warm.images.is_empty() || s.warm.file.is_some() {
        warm(&mut out, &s.warm, s.now_ms);
    }
    let r = &s.repositories;
    // The repository figures are an index scan reused for a while: say how
    // old, so that a repository evicted a moment ago is not a surprise.
    let _ = writeln!(
        out,
        "\nrepositories from an index scan of {} (one scan at most every {} s)",
        ago(s.now_ms, r.scanned_ms),
        HOLDINGS_TTL.as_secs()
    );
    repositories(&mut out, "largest repositories", &r.largest, s.now_ms);
    repositories(&mut out, "most recently used", &r.recent, s.now_ms);
    if !r.complete {
        let _ = writeln!(out, "  (partial: the index scan stopped at its row limit)");
    }
    out
}
