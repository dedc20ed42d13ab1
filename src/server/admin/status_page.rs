//! `GET /` on the admin listener: one small server-rendered HTML page with
//! the facts of [`Status`]. No JavaScript, no
//! external assets (styles inline), so it works from a port-forward or an
//! air-gapped cluster; it reloads itself every [`REFRESH_SECONDS`].
//! Everything that came from outside (repository names, upstream errors)
//! is HTML-escaped.

use std::fmt::Write as _;

use super::status::{Repository, Status};
use crate::warm::status::{WarmReport, WarmState};

/// The page's `<meta http-equiv="refresh">` interval.
pub const REFRESH_SECONDS: u32 = 10;

const STYLE: &str = "
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;background:#f5f6f8;color:#1d2330}
header{background:#1d2330;color:#fff;padding:14px 28px;display:flex;align-items:baseline;gap:16px}
header h1{font-size:20px;margin:0}header span{color:#b8c0d0}
main{padding:20px 28px;display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:18px}
section{background:#fff;border-radius:8px;padding:14px 18px;box-shadow:0 1px 3px rgba(0,0,0,.08)}
h2{font-size:15px;margin:0 0 10px;color:#3a4356;text-transform:uppercase;letter-spacing:.04em}
table{border-collapse:collapse;width:100%}td,th{text-align:left;padding:4px 8px 4px 0;vertical-align:top}
th{color:#68718a;font-weight:600;font-size:12px}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.bar{height:14px;background:#e4e7ee;border-radius:7px;position:relative;margin:6px 0 4px;overflow:hidden}
.fill{height:100%;background:#3b82f6}.fill.warn{background:#f59e0b}.mark{position:absolute;top:0;bottom:0;width:2px;background:#d9480f}
.kpis{display:flex;gap:24px;flex-wrap:wrap}.kpi b{display:block;font-size:22px}.kpi span{color:#68718a;font-size:12px}
.err{color:#b42318}.ok{color:#067647}.muted{color:#68718a}code{font-size:12px}
.warn-text{color:#b54708}
";

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `1.5 GiB`: binary units, one decimal.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{n} B") } else { format!("{value:.1} {}", UNITS[unit]) }
}

/// `12 s`, `3 min`, `2 h`, `5 d`.
pub fn span(seconds: u64) -> String {
    match seconds {
        0..=59 => format!("{seconds} s"),
        60..=3599 => format!("{} min", seconds / 60),
        3600..=86_399 => format!("{} h", seconds / 3600),
        _ => format!("{} d", seconds / 86_400),
    }
}

/// `12 s ago`, `3 min ago`, …
pub fn ago(now_ms: u64, then_ms: u64) -> String {
    format!("{} ago", span(now_ms.saturating_sub(then_ms) / 1000))
}

/// `87.5%`, or `–` before any request.
pub fn percent(ratio: Option<f64>) -> String {
    ratio.map_or_else(|| "–".to_owned(), |r| format!("{:.1}%", r * 100.0))
}

fn repo_table(out: &mut String, title: &str, repos: &[Repository], now_ms: u64) {
    let _ = write!(out, "<section><h2>{title}</h2>");
    if repos.is_empty() {
        out.push_str("<p class=muted>Nothing cached yet.</p></section>");
        return;
    }
    out.push_str("<table><tr><th>repository</th><th>upstream</th><th class=n>items</th><th class=n>size</th><th class=n>last used</th></tr>");
    for r in repos {
        let _ = write!(
            out,
            "<tr><td><code>{}</code></td><td>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td></tr>",
            escape(&r.repository),
            escape(&r.upstream),
            r.items,
            bytes(r.bytes),
            ago(now_ms, r.last_used_ms)
        );
    }
    out.push_str("</table></section>");
}

/// `sha256:0123456789ab…`: enough of a digest to tell it apart.
pub fn short_digest(digest: &str) -> String {
    match digest.split_once(':') {
        Some((alg, hex)) if hex.len() > 12 => format!("{alg}:{}…", &hex[..12]),
        _ => digest.to_owned(),
    }
}

/// `1.2 GiB of 2.0 GiB`, or the bytes alone when the total is unknown.
pub fn of_total(cached: u64, total: u64) -> String {
    if total == 0 { bytes(cached) } else { format!("{} of {}", bytes(cached), bytes(total)) }
}

/// `1 image`, `3 images`.
pub fn images(n: usize) -> String {
    format!("{n} image{}", if n == 1 { "" } else { "s" })
}

fn warm_section(out: &mut String, w: &WarmReport, now_ms: u64) {
    let _ = write!(out, "<section style=\"grid-column:1/-1\"><h2>Kept warm ({})</h2>", images(w.images.len()));
    if w.images.is_empty() {
        out.push_str("<p class=muted>No warm images: list them with [[warm]] or cache.warm_file.</p>");
    } else {
        out.push_str(
            "<table><tr><th>image</th><th>state</th><th>digest</th><th class=n>cached</th><th class=n>last check</th>\
             <th>pinned</th></tr>",
        );
        for i in &w.images {
            let class = match i.state {
                WarmState::Ready => "ok",
                WarmState::Fetching => "muted",
                WarmState::MissingUpstream => "warn-text",
                WarmState::NotFound | WarmState::Failed => "err",
            };
            let message = match &i.message {
                Some(m) => format!("<br><span class={class}>{}</span>", escape(m)),
                None => String::new(),
            };
            let platforms = if i.platforms.is_empty() {
                String::new()
            } else {
                format!(" <span class=muted>{}</span>", escape(&i.platforms.join(", ")))
            };
            let _ = write!(
                out,
                "<tr><td><code>{}</code>{platforms}{message}</td><td class={class}>{}</td><td><code>{}</code></td>\
                 <td class=n>{}</td><td class=n>{}</td><td>{}</td></tr>",
                escape(&i.image),
                i.state.as_str().replace('_', " "),
                i.digest.as_deref().map_or_else(|| "–".to_owned(), |d| escape(&short_digest(d))),
                of_total(i.bytes_cached, i.bytes_total),
                i.last_check_ms.map_or_else(|| "not yet".to_owned(), |t| ago(now_ms, t)),
                if i.pin { "yes" } else { "no" },
            );
        }
        out.push_str("</table>");
    }
    if let Some(f) = &w.file {
        let _ = write!(out, "<p class=muted>Warm file <code>{}</code>: {}", escape(&f.path), images(f.images));
        if let Some(e) = &f.error {
            let _ = write!(out, "; <span class=warn-text>{}</span>", escape(e));
        }
        out.push_str("</p>");
        for bad in &f.bad_lines {
            let _ = write!(out, "<p class=err>line {}: {}</p>", bad.line, escape(&bad.message));
        }
    }
    out.push_str("</section>");
}

/// The whole page.
pub fn render(s: &Status) -> String {
    let c = &s.cache;
    let mut out = String::with_capacity(8 << 10);
    let _ = write!(
        out,
        "<!doctype html><html lang=en><head><meta charset=utf-8><meta name=viewport content=\"width=device-width\">\
         <meta http-equiv=refresh content={REFRESH_SECONDS}><title>larder status</title><style>{STYLE}</style></head><body>\
         <header><h1>larder</h1><span>version {} · up {} · refreshed every {REFRESH_SECONDS} s</span></header><main>",
        escape(&s.version),
        span(s.uptime_seconds),
    );

    // Cache: size against the limit, with the eviction watermark marked.
    let share =
        |n: u64| if c.max_size_bytes == 0 { 0.0 } else { (n as f64 / c.max_size_bytes as f64).min(1.0) * 100.0 };
    let warn = if c.size_bytes >= c.high_watermark_bytes { " warn" } else { "" };
    let _ = write!(
        out,
        "<section><h2>Cache</h2><div class=kpis>\
         <div class=kpi><b>{}</b><span>of {} ({:.1}%)</span></div>\
         <div class=kpi><b>{}</b><span>blobs</span></div><div class=kpi><b>{}</b><span>manifests</span></div>\
         <div class=kpi><b>{}</b><span>fills in flight</span></div>\
         <div class=kpi><b>{}</b><span>pinned</span></div></div>\
         <div class=bar title=\"eviction starts at {}\"><div class=\"fill{warn}\" style=\"width:{:.2}%\"></div>\
         <div class=mark style=\"left:{:.2}%\"></div></div><span class=muted>eviction starts at {}</span>",
        bytes(c.size_bytes),
        bytes(c.max_size_bytes),
        share(c.size_bytes),
        c.blobs,
        c.manifests,
        c.fills_in_flight,
        bytes(c.pinned.bytes),
        bytes(c.high_watermark_bytes),
        share(c.size_bytes),
        share(c.high_watermark_bytes),
        bytes(c.high_watermark_bytes),
    );
    for sentence in &c.pinned.over_limit {
        let _ = write!(out, "<p class=err>{}</p>", escape(sentence));
    }
    out.push_str("</section>");

    let h = &s.hit_ratio;
    let _ = write!(
        out,
        "<section><h2>Hit ratio since start</h2><div class=kpis>\
         <div class=kpi><b>{}</b><span>blobs ({} requests)</span></div>\
         <div class=kpi><b>{}</b><span>manifests ({} requests)</span></div></div>\
         <p class=muted>Share of requests served without a new upstream download (hits, coalesced, stale).</p></section>",
        percent(h.blob),
        h.blob_requests,
        percent(h.manifest),
        h.manifest_requests,
    );

    out.push_str(
        "<section style=\"grid-column:1/-1\"><h2>Upstreams</h2><table><tr><th>name</th><th>url</th>\
         <th class=n>cached</th><th class=n>bandwidth</th><th class=n>requests</th><th class=n>errors</th>\
         <th>last error</th><th>rate limit</th></tr>",
    );
    for u in &s.upstreams {
        let last_error = match &u.last_error {
            Some(e) => format!(
                "<span class=err>{}</span> <span class=muted>{}</span>",
                escape(&e.message),
                ago(s.now_ms, e.at_ms)
            ),
            None => "<span class=ok>none</span>".to_owned(),
        };
        let rate = match &u.rate_limit {
            Some(r) => match r.limit {
                Some(limit) => format!("{} of {limit} left", r.remaining),
                None => format!("{} left", r.remaining),
            },
            None => "<span class=muted>not announced</span>".to_owned(),
        };
        let cached = match u.max_size_bytes {
            Some(max) => format!("{} of {}", bytes(u.cache_bytes), bytes(max)),
            None => bytes(u.cache_bytes),
        };
        let bandwidth = match u.max_bandwidth_bytes_per_second {
            Some(max) => format!("{}/s", bytes(max)),
            None => "<span class=muted>unlimited</span>".to_owned(),
        };
        let _ = write!(
            out,
            "<tr><td><b>{}</b>{}{}</td><td><code>{}</code></td><td class=n>{cached}</td><td class=n>{bandwidth}</td><td class=n>{}</td><td class=n>{}</td><td>{last_error}</td><td>{rate}</td></tr>",
            escape(&u.name),
            if u.default { " <span class=muted>(default)</span>" } else { "" },
            if u.verifies_clients { " <span class=muted>(verifies clients)</span>" } else { "" },
            escape(&u.url),
            u.requests,
            u.errors,
        );
    }
    out.push_str(
        "</table><p class=muted>Cached: bytes each upstream is charged for (shared content counts once, for \
                  the upstream that used it most recently or pins it), of its own max_size where it has one. \
                  Bandwidth: its max_bandwidth, shared by all its downloads, clients' first. Verifies clients: \
                  each client's own credentials are checked with that upstream before anything of it is served \
                  (client_credentials = \"verify\").</p></section>",
    );

    if !s.warm.images.is_empty() || s.warm.file.is_some() {
        warm_section(&mut out, &s.warm, s.now_ms);
    }

    let r = &s.repositories;
    repo_table(&mut out, &format!("Largest repositories ({} in all)", r.count), &r.largest, s.now_ms);
    repo_table(&mut out, "Most recently used", &r.recent, s.now_ms);
    let _ = write!(
        out,
        "</main><p class=muted style=\"padding:0 28px 20px\">Repository figures from an index scan {}{}. \
         Content shared by repositories counts for each. JSON: <code>/status</code> · metrics: <code>/metrics</code></p></body></html>",
        ago(s.now_ms, r.scanned_ms),
        if r.complete { "" } else { " (stopped at its row limit: partial)" },
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_text_is_escaped_and_units_read_well() {
        assert_eq!(escape("<script>alert('x')</script>&"), "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(50 << 30), "50.0 GiB");
        assert_eq!(ago(100_000, 88_000), "12 s ago");
        assert_eq!(ago(10_000_000, 0), "2 h ago");
        assert_eq!(percent(Some(0.875)), "87.5%");
        assert_eq!(percent(None), "–");
        assert_eq!(short_digest(&format!("sha256:{}", "ab".repeat(32))), "sha256:abababababab…");
        assert_eq!(of_total(1536, 3072), "1.5 KiB of 3.0 KiB");
        assert_eq!(of_total(7, 0), "7 B");
    }
}
