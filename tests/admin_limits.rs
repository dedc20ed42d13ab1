//! The admin listener has the registry listener's limits (issue 15, item
//! 5): silent and partial-header connections are closed at the
//! first-request deadline, and at most `MAX_ADMIN_CONNECTIONS` are open at
//! once, so idle admin connections cannot take the descriptors the
//! registry port needs. Checked on a running larder with real sockets and
//! its descriptor table in /proc.

mod common;

use std::time::{Duration, Instant};

use common::{Admin, Larder, Upstream, http};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// larder's deadline for a connection's first request (server::watchdog).
const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// larder's cap on open admin connections (server::admin).
const MAX_ADMIN_CONNECTIONS: usize = 256;
/// Connections the test holds: more than the cap.
const HELD: usize = MAX_ADMIN_CONNECTIONS + 64;

fn open_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).expect("read larder's descriptor table").count()
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_admin_connections_are_capped_and_closed_at_the_first_request_deadline() {
    // The upstream is never contacted.
    let (builder, admin) =
        Admin::open(Larder::builder().upstream(Upstream::new("nowhere.test", "http://127.0.0.1:9").default(true)));
    let larder = builder.start().await;
    let before = open_descriptors(larder.pid());

    let mut held = Vec::with_capacity(HELD);
    for i in 0..HELD {
        let mut conn = TcpStream::connect(("127.0.0.1", admin.port)).await.expect("connect");
        if i % 3 == 1 {
            // A third send an unfinished request head, the rest nothing at all.
            conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: larder\r\nX-Slow: ").await.expect("partial head");
        }
        held.push(conn);
    }
    let opened = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let grown = open_descriptors(larder.pid()).saturating_sub(before);
    assert!(
        grown <= MAX_ADMIN_CONNECTIONS + 8,
        "{HELD} idle admin connections took {grown} descriptors; the cap is {MAX_ADMIN_CONNECTIONS}"
    );

    // The accepted ones are closed by larder (EOF or reset) at the deadline, none answered.
    let deadline = FIRST_REQUEST_TIMEOUT + Duration::from_secs(15);
    let mut closed = 0;
    for conn in held.iter_mut() {
        let remaining = deadline.saturating_sub(opened.elapsed());
        let mut byte = [0u8; 1];
        match tokio::time::timeout(remaining, conn.read(&mut byte)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed += 1,
            Ok(Ok(_)) => panic!("an idle admin connection got a response"),
            Err(_) => break,
        }
        // The rest were accepted only as these closed: their own deadline is later.
        if closed == MAX_ADMIN_CONNECTIONS {
            break;
        }
    }
    assert!(
        closed >= MAX_ADMIN_CONNECTIONS,
        "only {closed} of {HELD} idle admin connections were closed {deadline:?} after they were opened"
    );
    assert!(opened.elapsed() >= FIRST_REQUEST_TIMEOUT - Duration::from_secs(1), "not closed before the deadline");

    // Once they are gone, the admin listener serves again.
    drop(held);
    let resp = http::client().get(format!("{}/healthz", admin.url())).send().await.expect("healthz");
    assert_eq!(resp.status(), 200);
}
