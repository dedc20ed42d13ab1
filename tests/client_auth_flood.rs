//! Client authentication under a flood (issue 23, item 10): made-up users
//! from one address cannot stall the first login of a valid user on
//! another. bcrypt runs one check at a time; each client address may have
//! only a few checks queued, and none waits long: past that the flood is
//! answered `429 TOOMANYREQUESTS` with `Retry-After` at once, while the
//! valid user, from its own address, is let in.
//!
//! The addresses are loopback ones: the flood's client sockets are bound
//! to 127.0.0.3, the valid user's to 127.0.0.2, and larder sees each as
//! the connection's source.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::metrics::{ADMIN_LISTEN, metric};
use common::{Larder, Upstream};
use tokio::sync::Mutex;

/// The flood's address.
const FLOOD: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3));
/// The valid user's address.
const VALID: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
/// Requests the flood keeps in flight at once: well above larder's
/// per-address share of the bcrypt queue (4).
const FLOOD_CONCURRENCY: usize = 32;
/// bcrypt cost of the htpasswd file: the reproduction used 8;
/// checks take milliseconds, so a queue of them is what hurts.
const COST: u32 = 8;
/// The longest the test waits for something that should happen soon.
const PATIENCE: Duration = Duration::from_secs(60);

fn client_from(address: IpAddr) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .local_address(address)
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(120))
        .build()
        .expect("a client bound to a loopback address")
}

/// What the flood got back: status, `Retry-After`, OCI error code.
type Answers = Arc<Mutex<Vec<(u16, Option<String>, Option<String>)>>>;

#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_made_up_users_from_one_address_cannot_stall_a_valid_user_on_another() {
    let dir = tempfile::tempdir().expect("auth dir");
    let htpasswd = dir.path().join("htpasswd");
    let hash = bcrypt::hash("s3cret", COST).expect("bcrypt");
    std::fs::write(&htpasswd, format!("puller:{hash}\n")).expect("htpasswd");
    // The upstream is never contacted: every request here is `GET /v2/`.
    let larder = Larder::builder()
        .upstream(Upstream::new("nowhere.test", "http://127.0.0.1:9").default(true))
        .server_line(&format!("auth = {{ htpasswd = \"{}\" }}", htpasswd.display()))
        .server_line(ADMIN_LISTEN)
        .ready_on_tcp()
        .start()
        .await;
    let base = format!("{}/v2/", larder.url());

    // The flood: made-up users from 127.0.0.3, FLOOD_CONCURRENCY at a time, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let answers: Answers = Arc::default();
    let flood: Vec<_> = (0..FLOOD_CONCURRENCY)
        .map(|worker| {
            let (stop, answers, base) = (Arc::clone(&stop), Arc::clone(&answers), base.clone());
            tokio::spawn(async move {
                let client = client_from(FLOOD);
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    n += 1;
                    let resp = client
                        .get(&base)
                        .basic_auth(format!("mallory-{worker}-{n}"), Some("guess"))
                        .send()
                        .await
                        .expect("larder answers the flood");
                    let status = resp.status().as_u16();
                    let retry_after = resp.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
                    let body = resp.bytes().await.expect("the body");
                    let body: serde_json::Value = serde_json::from_slice(&body).expect("the OCI envelope");
                    let code = body["errors"][0]["code"].as_str().map(str::to_owned);
                    answers.lock().await.push((status, retry_after, code));
                }
            })
        })
        .collect();

    // The flood fills its share of the queue and is turned away.
    let started = Instant::now();
    while !answers.lock().await.iter().any(|(status, ..)| *status == 429) {
        assert!(started.elapsed() < PATIENCE, "the flood was never refused with 429:\n{}", larder.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // While it goes on, a valid user who has not logged in yet, from another address, gets in.
    let valid = client_from(VALID)
        .get(&base)
        .basic_auth("puller", Some("s3cret"))
        .send()
        .await
        .expect("larder answers the valid user");
    let flood_running = flood.iter().all(|f| !f.is_finished());
    stop.store(true, Ordering::SeqCst);
    for f in flood {
        f.await.expect("a flood worker");
    }
    assert_eq!(valid.status(), 200, "the valid user: {:?}\n{}", valid.text().await, larder.log());
    assert!(flood_running, "the flood was still running when the valid user got in");

    // The flood's answers: 401 for the checks that ran, 429 with Retry-After for the rest.
    let answers = answers.lock().await;
    let refused: Vec<_> = answers.iter().filter(|(status, ..)| *status == 429).collect();
    let checked = answers.iter().filter(|(status, ..)| *status == 401).count();
    assert!(checked > 0, "some of the flood's checks ran (and failed)");
    assert!(answers.iter().all(|(status, ..)| *status == 401 || *status == 429), "{answers:?}");
    for (_, retry_after, code) in &refused {
        assert_eq!(retry_after.as_deref(), Some("1"), "a 429 says when to come back");
        assert_eq!(code.as_deref(), Some("TOOMANYREQUESTS"));
    }
    let throttled = metric(&larder, "larder_client_auth_throttled_total{reason=\"peer_limit\"}").await;
    assert!(throttled >= refused.len() as f64, "counted: {throttled} of {} refusals", refused.len());
    println!("flood: {} answers, {checked} checked with bcrypt, {} refused with 429", answers.len(), refused.len());
}
