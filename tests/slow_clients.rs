//! Slow-header and silent connections (slowloris): they neither starve a
//! healthy client nor stay open past larder's first-request deadline.

mod common;

use std::time::{Duration, Instant};

use common::{Larder, Upstream, http};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Connections the attacker holds open (issue 5 asks for 1,000).
const ATTACKERS: usize = 1000;
/// larder's deadline for a connection's first request (server::watchdog).
const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_slow_connections_do_not_starve_a_healthy_client_and_are_closed() {
    rlimit::increase_nofile_limit(u64::MAX).expect("raise the test's open file limit");
    // The upstream is never contacted: only /v2/ is asked.
    let larder =
        Larder::builder().upstream(Upstream::new("nowhere.test", "http://127.0.0.1:9").default(true)).start().await;

    let mut held = Vec::with_capacity(ATTACKERS);
    for i in 0..ATTACKERS {
        let mut conn = TcpStream::connect(("127.0.0.1", larder.port())).await.expect("connect");
        if i % 2 == 1 {
            // Half send an unfinished request head, the rest nothing at all.
            conn.write_all(b"GET /v2/ HTTP/1.1\r\nHost: larder\r\nX-Slow: ").await.expect("partial head");
        }
        held.push(conn);
    }
    let opened = Instant::now();

    let resp = http::client().get(format!("{}/v2/", larder.url())).send().await.expect("healthy client");
    assert_eq!(resp.status(), 200, "a healthy client is served while {ATTACKERS} slow ones wait");

    // Every held connection is closed by larder (EOF or reset), none answered.
    let deadline = FIRST_REQUEST_TIMEOUT + Duration::from_secs(15);
    let mut closed = 0;
    for mut conn in held {
        let remaining = deadline.saturating_sub(opened.elapsed());
        let mut byte = [0u8; 1];
        match tokio::time::timeout(remaining, conn.read(&mut byte)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed += 1,
            Ok(Ok(_)) => panic!("a slow connection got a response"),
            Err(_) => break,
        }
    }
    assert_eq!(closed, ATTACKERS, "connections still open {deadline:?} after they were opened");
    assert!(opened.elapsed() >= FIRST_REQUEST_TIMEOUT - Duration::from_secs(1), "not closed before the deadline");
}
