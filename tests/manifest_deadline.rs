//! A manifest's response headers reach the client within 28 s, whatever
//! upstream does. containerd 2.3 fails any pull whose response headers take
//! 30 s (`ResponseHeaderTimeout: 30 * time.Second` in
//! core/remotes/docker/registry.go, v2.3.0; Docker 29.7 builds on it), so a
//! mirror that answers later breaks pulls instead of letting the client
//! fall back. larder's `server.manifest_deadline` (25 s) bounds the whole
//! answer: a tag whose revalidation has not finished is served stale, a
//! manifest it does not have is a `504`; fetches go on in the background.
//!
//! Each case here would take longer than 30 s without that bound, because
//! upstream's own timeouts are longer or add up: a raised
//! `response_timeout`, a body trickled a byte at a time (each byte within
//! the idle timeout), a slow token service before a slow answer, a hub
//! (`via`) in front of such an upstream, a cluster owner asked first.
//! The bound is a correctness bound on the wire (real time, a fake
//! upstream that stalls), not a performance figure. `Docker-Content-Digest`
//! is on every manifest response, stale ones included.

mod common;
mod fake;

use std::time::{Duration, Instant};

use common::http::MANIFEST_MEDIA_TYPES;
use common::{Cluster, Larder, Upstream};
use fake::{FakeUpstream, Faults, OCI_MANIFEST, REPO, digest, image_manifest, random_bytes};
use futures_util::future::join_all;

/// When the response headers must have arrived, at the latest.
const BOUND: Duration = Duration::from_secs(28);
/// Longer than any upstream wait here: only larder's deadline answers sooner.
const FOREVER: Duration = Duration::from_secs(100);
/// Just under larder's default `response_timeout` (20 s): each step alone
/// is within it, the steps together are not within 30 s.
const SLOW: Duration = Duration::from_secs(19);

/// A manifest of its own, from `seed`.
fn a_manifest(seed: u64) -> bytes::Bytes {
    let config = random_bytes(256, seed);
    let layer = random_bytes(1024, seed + 1);
    image_manifest((&digest(&config), config.len()), &[(&digest(&layer), layer.len())])
}

/// The answer to one request: status, headers, and how long the headers took.
struct Timed {
    what: String,
    status: u16,
    headers: reqwest::header::HeaderMap,
    took: Duration,
    /// The body of an error answer to a GET.
    error: Option<serde_json::Value>,
}

impl Timed {
    fn digest_header(&self) -> Option<&str> {
        self.headers.get("docker-content-digest").and_then(|v| v.to_str().ok())
    }
}

/// Sends `method url` (every manifest media type accepted) and times the
/// arrival of the response headers; the body is left unread.
async fn timed(method: reqwest::Method, url: String) -> Timed {
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(90))
        .build()
        .expect("an HTTP client");
    let request = MANIFEST_MEDIA_TYPES.iter().fold(http.request(method.clone(), &url), |r, t| r.header("Accept", *t));
    let started = Instant::now();
    let resp = request.send().await.unwrap_or_else(|e| panic!("{method} {url}: no response headers: {e}"));
    let took = started.elapsed();
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    let error = if method == reqwest::Method::GET && status >= 400 {
        resp.bytes().await.ok().and_then(|b| serde_json::from_slice(&b).ok())
    } else {
        None
    };
    Timed { what: format!("{method} {url}"), status, headers, took, error }
}

/// A `504` in the OCI envelope (larder's answer at the deadline) within [`BOUND`].
fn assert_gateway_timeout_in_time(t: &Timed) {
    assert!(t.took < BOUND, "{}: response headers after {:?}, more than {BOUND:?}", t.what, t.took);
    assert_eq!(t.status, 504, "{}: answered in {:?}", t.what, t.took);
    if let Some(body) = &t.error {
        assert_eq!(body["errors"][0]["code"], "UNAVAILABLE", "{}: the OCI error envelope: {body}", t.what);
    }
    eprintln!("{}: {} after {:.1}s", t.what, t.status, t.took.as_secs_f64());
}

/// A fake upstream with `test/app:v1` that wants a token from a token
/// service taking [`SLOW`], then takes [`SLOW`] to answer with it.
async fn slow_token_upstream(seed: u64) -> FakeUpstream {
    let up = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, a_manifest(seed))
        .stall_headers(SLOW)
        .token_response(r#"{"token":"slow-token","expires_in":300}"#)
        .token_delay(SLOW)
        .accept_authorization("Bearer slow-token")
        .start()
        .await;
    up.set_challenge(Some(&format!(r#"Bearer realm="{}/token",service="fake""#, up.url())));
    up
}

fn manifest_url(larder: &Larder, ns: &str, reference: &str) -> String {
    format!("{}/v2/{REPO}/manifests/{reference}?ns={ns}", larder.url())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stalling_trickling_or_slow_to_authorize_upstream_gets_a_504_within_28s() {
    // Headers never come, and the operator raised response_timeout to 60 s.
    let stalled_manifest = a_manifest(1);
    let stalled = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, stalled_manifest.clone())
        .stall_headers(FOREVER)
        .start()
        .await;
    // Headers at once, then a byte a second: each pause is within the
    // 30 s body idle timeout, the whole body is not within 30 s.
    let trickled = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, a_manifest(3))
        .trickle(1, Duration::from_secs(1))
        .start()
        .await;
    let token = slow_token_upstream(5).await;
    let larder = Larder::builder()
        .upstream(Upstream::new("stalled.test", &stalled.url()).line(r#"response_timeout = "60s""#))
        .upstream(Upstream::new("trickled.test", &trickled.url()))
        .upstream(Upstream::new("token.test", &token.url()))
        .start()
        .await;
    let stalled_digest = digest(&stalled_manifest);
    let mut asks = Vec::new();
    for ns in ["stalled.test", "trickled.test", "token.test"] {
        for method in [reqwest::Method::HEAD, reqwest::Method::GET] {
            asks.push(timed(method, manifest_url(&larder, ns, "v1")));
        }
    }
    asks.push(timed(reqwest::Method::GET, manifest_url(&larder, "stalled.test", &stalled_digest)));
    for answer in join_all(asks).await {
        assert_gateway_timeout_in_time(&answer);
        if answer.what.starts_with("GET") {
            assert!(answer.error.is_some(), "{}: an OCI error body", answer.what);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tag_whose_revalidation_stalls_is_served_stale_within_28s_with_its_digest() {
    let bytes = a_manifest(7);
    let d = digest(&bytes);
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, bytes.clone()).start().await;
    let larder = Larder::builder()
        .upstream(Upstream::new("stale.test", &up.url()).tag_ttl("1s").line(r#"response_timeout = "60s""#))
        .start()
        .await;
    let fill = timed(reqwest::Method::GET, manifest_url(&larder, "stale.test", "v1")).await;
    assert_eq!((fill.status, fill.digest_header()), (200, Some(d.as_str())));

    // Past the tag's TTL upstream stops answering: the revalidation (a
    // HEAD) stalls, and the cached manifest is served at the deadline.
    up.set_faults(&d, Faults { stall_headers: Some(FOREVER), ..Faults::default() });
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let asks = [reqwest::Method::HEAD, reqwest::Method::GET]
        .map(|method| timed(method, manifest_url(&larder, "stale.test", "v1")));
    for answer in join_all(asks).await {
        assert!(answer.took < BOUND, "{}: headers after {:?}", answer.what, answer.took);
        assert_eq!(answer.status, 200, "{}: the stale manifest", answer.what);
        assert_eq!(answer.digest_header(), Some(d.as_str()), "{}: Docker-Content-Digest", answer.what);
        eprintln!("{}: {} after {:.1}s", answer.what, answer.status, answer.took.as_secs_f64());
    }
    // By digest, from the cache, with its digest too.
    let by_digest = timed(reqwest::Method::HEAD, manifest_url(&larder, "stale.test", &d)).await;
    assert_eq!((by_digest.status, by_digest.digest_header()), (200, Some(d.as_str())));
}

#[tokio::test(flavor = "multi_thread")]
async fn through_a_hub_and_from_a_cluster_owner_the_answer_still_comes_within_28s() {
    // A node whose hub asks a slow-to-authorize upstream; the node would
    // wait for the hub up to its (raised) response_timeout.
    let behind_hub = slow_token_upstream(9).await;
    let hub = Larder::builder().upstream(Upstream::new("token.test", &behind_hub.url())).start().await;
    let node = Larder::builder()
        .upstream(
            Upstream::new("token.test", &behind_hub.url())
                .line(&format!("via = {:?}", hub.url()))
                .line(r#"response_timeout = "60s""#),
        )
        .start()
        .await;

    // Two replicas: the one that does not own the tag asks the owner
    // first, and waits for it as long as the owner may need for a token
    // and a request (two response timeouts and more).
    let behind_cluster = slow_token_upstream(11).await;
    let cluster = Cluster::builder(Upstream::new("token.test", &behind_cluster.url())).replicas(2).start().await;
    let owner = cluster.owner_of(&format!("token.test/{REPO}:v1"));
    let asker = &cluster.replicas[cluster.other_than(owner)];

    let asks = [
        timed(reqwest::Method::HEAD, manifest_url(&node, "token.test", "v1")),
        timed(reqwest::Method::GET, manifest_url(&node, "token.test", "v1")),
        timed(reqwest::Method::HEAD, manifest_url(asker, "token.test", "v1")),
        timed(reqwest::Method::GET, manifest_url(asker, "token.test", "v1")),
    ];
    for answer in join_all(asks).await {
        assert_gateway_timeout_in_time(&answer);
    }
}

/// A revalidation that outlasts the deadline still lands. The client is
/// served stale at the deadline; the `HEAD` goes on in the background,
/// and what it finds is applied there: an unchanged tag is confirmed (the
/// next request is a hit, no second `HEAD`), a moved one is fetched and
/// moved (the next request gets the new manifest). Applied by the waiting
/// client instead, it was lost with it: every request revalidated again
/// and waited out the deadline, and a moved tag was never moved while
/// upstream's `HEAD` stayed slower than the deadline.
#[tokio::test(flavor = "multi_thread")]
async fn a_revalidation_that_outlasts_the_deadline_still_confirms_or_moves_the_tag() {
    const DEADLINE: Duration = Duration::from_secs(2);
    const HEAD_TAKES: Duration = Duration::from_secs(4);
    const TTL: Duration = Duration::from_secs(5);
    let (old, new) = (a_manifest(13), a_manifest(15));
    let (old_digest, new_digest) = (digest(&old), digest(&new));
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, old.clone()).start().await;
    let larder = Larder::builder()
        .server_line(r#"manifest_deadline = "2s""#)
        .upstream(Upstream::new("slow.test", &up.url()).tag_ttl("5s"))
        .start()
        .await;
    let url = manifest_url(&larder, "slow.test", "v1");
    let heads = || up.requests("HEAD", &format!("/v2/{REPO}/manifests/v1"));
    let fill = timed(reqwest::Method::GET, url.clone()).await;
    assert_eq!((fill.status, fill.digest_header()), (200, Some(old_digest.as_str())));

    // Unchanged, but upstream takes longer than the deadline to say so.
    up.set_faults(&old_digest, Faults { stall_headers: Some(HEAD_TAKES), ..Faults::default() });
    tokio::time::sleep(TTL + Duration::from_millis(200)).await;
    let stale = timed(reqwest::Method::GET, url.clone()).await;
    assert_eq!((stale.status, stale.digest_header()), (200, Some(old_digest.as_str())), "stale at the deadline");
    assert_eq!(heads(), 1);
    // The HEAD answers (4 s after it started); the tag is confirmed then.
    tokio::time::sleep(HEAD_TAKES - DEADLINE + Duration::from_secs(1)).await;
    let hit = timed(reqwest::Method::GET, url.clone()).await;
    assert_eq!((hit.status, hit.digest_header()), (200, Some(old_digest.as_str())));
    assert_eq!(heads(), 1, "the tag was confirmed by the HEAD that outlasted the deadline: no second one");

    // Moved, and upstream is as slow (the HEAD, then the GET of the new manifest).
    up.add_manifest(REPO, "v1", OCI_MANIFEST, new.clone());
    up.set_faults(&new_digest, Faults { stall_headers: Some(HEAD_TAKES), ..Faults::default() });
    tokio::time::sleep(TTL).await;
    let stale = timed(reqwest::Method::GET, url.clone()).await;
    assert_eq!((stale.status, stale.digest_header()), (200, Some(old_digest.as_str())), "stale at the deadline");
    // The HEAD (4 s) and the GET (4 s) go on; then the tag has moved.
    tokio::time::sleep(2 * HEAD_TAKES - DEADLINE + Duration::from_secs(1)).await;
    let moved = timed(reqwest::Method::GET, url.clone()).await;
    assert_eq!(
        (moved.status, moved.digest_header()),
        (200, Some(new_digest.as_str())),
        "the background revalidation fetched the new manifest and moved the tag:\n{}",
        larder.log()
    );
    assert_eq!(heads(), 2, "one HEAD for each revalidation");
    assert_eq!(up.manifest_gets(&new_digest), 1, "the new manifest fetched once, by the background revalidation");
}
