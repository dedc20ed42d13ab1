//! Reading larder's admin listener from a test: `/metrics` series.

use super::{Larder, http};

/// `[server]` line: the admin listener (`/metrics`) on a port the OS picks,
/// so it cannot collide with another test's; [`metric`] finds it in the log.
pub const ADMIN_LISTEN: &str = r#"admin_listen = "127.0.0.1:0""#;

/// The value of one series on larder's `/metrics` (`name{labels}` exactly
/// as larder prints it); 0 while the series has not appeared.
pub async fn metric(larder: &Larder, series: &str) -> f64 {
    let url = format!("http://{}/metrics", admin_address(larder));
    let text = http::client()
        .get(&url)
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .text()
        .await
        .unwrap_or_else(|e| panic!("reading {url}: {e}"));
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.rsplit_once(' '))
        .find(|(name, _)| *name == series)
        .map_or(0.0, |(_, value)| value.parse().unwrap_or_else(|e| panic!("{series} = {value:?}: {e}")))
}

/// Waits until no blob fill is in flight. A client gets a blob's last
/// byte once its digest matched, and the commit (fsyncs, rename, index
/// row) follows: a test that looks at the cache's files or index, or kills
/// larder, right after a cold GET waits for that commit first.
pub async fn wait_for_commits(larder: &Larder) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    while metric(larder, "larder_fills_in_flight").await != 0.0 {
        assert!(tokio::time::Instant::now() < deadline, "gave up waiting for the fills to commit");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// The admin address the latest start of larder logged it listens on
/// (`larder listening addr=… admin=Some(127.0.0.1:PORT)`).
pub fn admin_address(larder: &Larder) -> String {
    let log = larder.log();
    let line = log.lines().rev().find(|l| l.contains("larder listening"));
    line.and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("admin=Some(")?.strip_suffix(')')))
        .unwrap_or_else(|| panic!("larder logged no admin address:\n{log}"))
        .to_owned()
}
