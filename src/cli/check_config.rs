//! `larder check-config [--without-secrets]`: validates a config and
//! says what it means: warnings (on stderr), then `FILE: ok (N upstreams)`,
//! the cache's sizes and durations as larder read them, and the admin
//! listener's rules. `--without-secrets` checks everything but the files
//! and environment variables that hold secrets or exist only where larder
//! runs, and lists each one it skipped: for a config repository's CI.

use std::fmt::Write as _;
use std::path::Path;

use crate::config::units::{Size, spelled_duration};
use crate::config::{Config, Skipped};

/// Exit status when the config is wrong.
pub const INVALID: u8 = 2;

/// Checks the config at `path` (the embedded default without one); prints
/// as it goes and returns the exit status.
pub fn run(path: Option<&Path>, without_secrets: bool) -> u8 {
    let source = path.map_or("embedded default config".to_owned(), |p| p.display().to_string());
    let loaded = match (path, without_secrets) {
        (Some(p), true) => Config::load_without_secrets(p),
        (Some(p), false) => Config::load(p).map(|c| (c, Vec::new())),
        (None, _) => Config::embedded_default().map(|c| (c, Vec::new())),
    };
    let (config, skipped) = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("larder: {e}");
            return INVALID;
        }
    };
    let warnings = if without_secrets { config.warnings_without_secrets() } else { config.warnings() };
    for warning in warnings {
        eprintln!("larder: {source}: warning: {warning}");
    }
    // The warm file's bad lines are skipped at run time, not fatal:
    // shown here as warnings.
    if let Some(path) = &config.cache.warm_file {
        let (_, report) = crate::warm::list::read_file(path, &config.upstreams, &config.warm);
        for bad in &report.bad_lines {
            eprintln!("larder: {}: warning: line {}: {} (skipped)", report.path, bad.line, bad.message);
        }
        if let Some(error) = &report.error {
            eprintln!("larder: {}: warning: {error}", report.path);
        }
        if let Some(line) = report.unterminated_line {
            eprintln!(
                "larder: {}: warning: line {line} does not end with a newline: not read until it does",
                report.path
            );
        }
    }
    let n = config.upstreams.len();
    let upstreams = if n == 1 { "upstream" } else { "upstreams" };
    if without_secrets {
        println!("{source}: ok without its secrets ({n} {upstreams})");
    } else {
        println!("{source}: ok ({n} {upstreams})");
    }
    for line in skipped_lines(&skipped) {
        println!("{line}");
    }
    for line in sizes(&config) {
        println!("{line}");
    }
    for line in crate::server::admin::explain(&config) {
        println!("{line}");
    }
    0
}

/// One line per thing `--without-secrets` did not look at.
fn skipped_lines(skipped: &[Skipped]) -> Vec<String> {
    let mut lines: Vec<String> = skipped.iter().map(|s| format!("not checked: {s}")).collect();
    if skipped.iter().any(|s| s.key == "server.auth.htpasswd") {
        lines.push("not checked: that the users [[server.auth.grant]] names are in server.auth.htpasswd".to_owned());
    }
    lines
}

/// The cache's sizes and durations as larder read them (`50 GiB
/// (53687091200 bytes)`, `5m`), and each upstream's own share: what a
/// size written in the config means, in bytes.
fn sizes(config: &Config) -> Vec<String> {
    let c = &config.cache;
    let mut line = format!("cache: {} in {}", Size(c.max_size), c.dir.display());
    let _ = write!(
        line,
        ", evicting above {:.0}% down to {:.0}% of it; memory {}; tags trusted {}, served stale up to {} more when \
         upstream fails",
        c.high_watermark * 100.0,
        c.low_watermark * 100.0,
        Size(c.memory),
        spelled_duration(c.tag_ttl),
        spelled_duration(c.stale_if_error)
    );
    let mut lines = vec![line];
    for u in &config.upstreams {
        if let Some(max) = u.max_size {
            lines.push(format!("upstream {}: its share of the cache is at most {}", u.name, Size(max)));
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_shows_sizes_in_bytes_and_durations_as_written() {
        let text = "[cache]\ndir = \"/data\"\nmax_size = \"50GiB\"\nmemory = \"512MiB\"\ntag_ttl = \"10m\"\n\
                    [[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\nmax_size = \"20GB\"\n";
        let config = Config::parse(text, "t.toml", None).unwrap();
        assert_eq!(
            sizes(&config),
            [
                "cache: 50 GiB (53687091200 bytes) in /data, evicting above 95% down to 85% of it; memory 512 MiB \
                 (536870912 bytes); tags trusted 10m, served stale up to 7d more when upstream fails",
                "upstream q.io: its share of the cache is at most 20 GB (20000000000 bytes)",
            ]
        );
    }
}
