//! The token cache is bounded (issue 15, item 7). Any client can make
//! larder fetch a token for a repository it made up, and Docker Hub hands
//! out anonymous tokens for any scope: with a cache that never shrank,
//! 12,000 requests for made-up repositories grew larder from 2 to 66 MiB.
//!
//! Here a registry hands out 256 KiB tokens (an extreme but legal size:
//! larder reads token responses up to 1 MiB) for any scope, and a client
//! asks for 400 made-up repositories: 100 MiB of tokens. larder's
//! anonymous memory must grow by far less, and the cache report no more
//! tokens than fit its byte bound.

mod common;
#[path = "clients/hosts.rs"]
mod hosts;
mod shapes;

use common::metrics::{ADMIN_LISTEN, metric};
use common::{Larder, Upstream, http};
use shapes::plain::Plain;
use shapes::registry::Tokens;

const TOKEN_SIZE: usize = 256 << 10;
const MADE_UP_REPOSITORIES: usize = 400;
/// What the tokens alone would hold if every one were kept.
const UNBOUNDED: u64 = (TOKEN_SIZE * MADE_UP_REPOSITORIES) as u64;
/// larder's byte bound on cached tokens (`MAX_TOKEN_CACHE_BYTES`).
const BOUND: u64 = 8 << 20;

#[tokio::test]
async fn tokens_for_made_up_repositories_do_not_grow_larder_without_bound() {
    let tls = shapes::setup();
    let tokens = Tokens::new(Some(300)).token_size(TOKEN_SIZE);
    let registry = Plain::start(&tls, Some(tokens.clone())).await;
    let upstream = Upstream::new("plain.test", &registry.registry.url())
        .default(true)
        .line(&format!("ca_file = {:?}", tls.ca_file()));
    let larder = Larder::builder().upstream(upstream).server_line(ADMIN_LISTEN).start().await;
    let client = http::client();
    let ask = |i: usize| {
        let (client, url) = (client.clone(), format!("{}/v2/made-up/repo-{i}/manifests/latest", larder.url()));
        async move {
            let status = client.get(&url).send().await.unwrap_or_else(|e| panic!("GET {url}: {e}")).status();
            assert_eq!(status, 404, "{url}: a made-up repository is unknown upstream");
        }
    };

    // Warm up (allocator arenas, connection pools), then measure.
    for i in 0..40 {
        ask(i).await;
    }
    let before = rss_anon(&larder);
    for batch in (40..40 + MADE_UP_REPOSITORIES).collect::<Vec<_>>().chunks(8) {
        futures_util::future::join_all(batch.iter().map(|i| ask(*i))).await;
    }
    let grown = rss_anon(&larder).saturating_sub(before);
    eprintln!("larder's anonymous memory grew by {} KiB", grown >> 10);

    assert_eq!(tokens.issued().len(), 40 + MADE_UP_REPOSITORIES, "one token per made-up repository");
    assert!(
        grown < UNBOUNDED / 2,
        "larder grew by {} MiB for {} MiB of tokens it should not keep",
        grown >> 20,
        UNBOUNDED >> 20
    );
    let cached = metric(&larder, r#"larder_upstream_tokens_cached{upstream="plain.test"}"#).await;
    assert!(cached > 0.0 && cached * TOKEN_SIZE as f64 <= BOUND as f64, "{cached} tokens of 256 KiB cached");
}

/// Resident anonymous memory (`RssAnon`) of larder: its heap.
fn rss_anon(larder: &Larder) -> u64 {
    let pid = larder.pid();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/<pid>/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("RssAnon in /proc/<pid>/status");
    kib * 1024
}
