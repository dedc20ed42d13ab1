//! Private images, verified per client (`client_credentials = "verify"`):
//! the upstream decides who may pull, even from the cache. The origin is
//! real distribution behind token auth; its token server knows two tenants
//! whose access lists the tests change: alice pulls `team-a/*`, bob
//! `team-b/*`. larder has no credentials of its own, so its fills use the
//! verified client's.

mod common;
mod fake;

use std::time::Duration;

use common::metrics::{ADMIN_LISTEN, metric};
use common::{Credentials, ImageBuilder, KIB, Larder, Origin, PushedImage, Upstream, http, skopeo};

/// The origin's admin (pushes); larder never gets it.
fn admin() -> Credentials {
    Credentials::new("admin", "admin-Pw-0")
}

/// Passwords with colons, as registry tokens may have them.
fn alice() -> Credentials {
    Credentials::new("alice", "alice:S3cret:pw")
}

fn bob() -> Credentials {
    Credentials::new("bob", "bob-S3cret-pw")
}

struct Tenants {
    origin: Origin,
    larder: Larder,
    /// alice's image (`team-a/app:v1`) and bob's (`team-b/app:v1`).
    a: PushedImage,
    b: PushedImage,
}

/// The origin with both tenants' images, and larder verifying clients
/// with `lines` in its upstream table.
async fn tenants(lines: &[&str]) -> Tenants {
    let origin = Origin::with_token_auth(admin()).await;
    origin.token_server().add_user(&alice(), &["team-a/"]);
    origin.token_server().add_user(&bob(), &["team-b/"]);
    let a = ImageBuilder::oci().layers(&[40 * KIB, 160 * KIB]).push(&origin, "team-a/app", "v1").await;
    let b = ImageBuilder::oci().layers(&[24 * KIB]).push(&origin, "team-b/app", "v1").await;
    let mut upstream = Upstream::from(&origin).line("client_credentials = \"verify\"");
    for line in lines {
        upstream = upstream.line(line);
    }
    let larder = Larder::builder().upstream(upstream).server_line(ADMIN_LISTEN).ready_on_tcp().start().await;
    Tenants { origin, larder, a, b }
}

/// Every URL of `image` on `larder`: the manifest by tag and by digest,
/// each blob, the tag list and the referrers of the manifest.
fn urls(larder: &Larder, image: &PushedImage) -> Vec<String> {
    let base = format!("{}/v2/{}", larder.url(), image.repo);
    let mut urls = vec![
        format!("{base}/manifests/{}", image.tag),
        format!("{base}/manifests/{}", image.digest),
        format!("{base}/tags/list"),
        format!("{base}/referrers/{}", image.digest),
    ];
    urls.extend(image.blob_digests().iter().map(|d| format!("{base}/blobs/{d}")));
    urls
}

/// GET or HEAD `url` with `credentials` (none: anonymous): the status,
/// the `WWW-Authenticate` header and the body.
async fn fetch(method: reqwest::Method, url: &str, credentials: Option<&Credentials>) -> (u16, String, Vec<u8>) {
    let client = http::client();
    let mut request =
        http::manifest_get(&client, url).build().unwrap_or_else(|e| panic!("building a request for {url}: {e}"));
    *request.method_mut() = method;
    let mut request = reqwest::RequestBuilder::from_parts(client.clone(), request);
    if let Some(c) = credentials {
        request = request.basic_auth(&c.user, Some(&c.password));
    }
    let response = request.send().await.unwrap_or_else(|e| panic!("{url}: {e}"));
    let status = response.status().as_u16();
    let challenge = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap_or_default().to_owned())
        .unwrap_or_default();
    let body = response.bytes().await.unwrap_or_default().to_vec();
    (status, challenge, body)
}

/// The bytes of every blob and manifest of `image`, which a refused
/// response must not contain.
async fn content(origin: &Origin, image: &PushedImage) -> Vec<Vec<u8>> {
    let mut all = vec![origin.fetch_manifest(&image.repo, &image.digest).await.body];
    let token = origin.token_server().mint(&[(image.repo.as_str(), &["pull"])]);
    for digest in image.blob_digests() {
        let url = format!("{}/v2/{}/blobs/{digest}", origin.url(), image.repo);
        let bytes = http::client().get(&url).bearer_auth(&token).send().await.unwrap().bytes().await.unwrap();
        all.push(bytes.to_vec());
    }
    all
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.len() <= haystack.len() && haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_owner_pulls_and_no_one_else_gets_a_byte_of_it_cached_or_not() {
    let t = tenants(&[]).await;
    let tokens = t.origin.token_server();

    // Anonymous: challenged with Basic, on /v2/ and on every URL.
    let (status, challenge, _) = fetch(reqwest::Method::GET, &format!("{}/v2/", t.larder.url()), None).await;
    assert_eq!((status, challenge.starts_with("Basic ")), (401, true), "/v2/ challenges: {challenge}");
    for url in urls(&t.larder, &t.a) {
        let (status, challenge, _) = fetch(reqwest::Method::GET, &url, None).await;
        assert_eq!(status, 401, "anonymous GET {url}");
        assert_eq!(challenge, "Basic realm=\"origin.test\"", "GET {url}");
    }
    let anonymous = skopeo::pull(&t.larder.image_ref(&t.a.reference()), false).await;
    assert!(anonymous.is_err(), "skopeo without credentials must not pull team-a/app");

    // alice pulls her image, byte-exact; larder has no credentials, so
    // every token it fetched for team-a/app was asked for as alice.
    let mark = tokens.mark();
    let pulled = skopeo::Pull::new(&t.larder.image_ref(&t.a.reference()))
        .credentials(&alice())
        .run()
        .await
        .unwrap_or_else(|e| panic!("alice pulls team-a/app: {e}\n{}", t.larder.log()));
    assert_eq!(pulled.manifest_digest, t.a.digest);
    assert_eq!(pulled.blob_digests(), t.a.blob_digests());
    let asked = tokens.requests_since(mark);
    assert!(!asked.is_empty());
    assert!(
        asked.iter().all(|r| r.user.as_deref() == Some("alice") && r.status == 200),
        "every token request for alice's pull carried alice's credentials (the check and the fills): {asked:#?}"
    );
    assert_eq!(
        metric(&t.larder, "larder_client_verifications_total{result=\"granted\",upstream=\"origin.test\"}").await,
        1.0
    );

    // Everything of team-a/app is cached now. bob's credentials are valid
    // upstream, but not for team-a: refused on every URL, GET and HEAD,
    // with no byte of the content, and not one blob or manifest read
    // from the origin for it.
    let secrets = content(&t.origin, &t.a).await;
    let mark = t.origin.log_mark().await;
    for url in urls(&t.larder, &t.a) {
        for method in [reqwest::Method::GET, reqwest::Method::HEAD] {
            let (status, _, body) = fetch(method.clone(), &url, Some(&bob())).await;
            assert_eq!(status, 403, "bob: {method} {url}: {}", String::from_utf8_lossy(&body));
            assert!(secrets.iter().all(|s| !contains(&body, s)), "{method} {url} leaked content to bob");
            if method == reqwest::Method::GET {
                let text = String::from_utf8_lossy(&body);
                assert!(text.contains("\"DENIED\"") && text.contains("team-a/app"), "{text}");
            }
        }
    }
    let seen = t.origin.requests_since(&mark).await;
    assert_eq!(seen.blob_gets(), 0, "no blob left the origin for bob");
    assert!(
        seen.entries().iter().all(|e| e.method == "HEAD" || e.path().contains("/tags/list")),
        "only checks (HEAD, tags/list?n=1) reached the origin: {:?}",
        seen.entries()
    );
    let skopeo_bob = skopeo::Pull::new(&t.larder.image_ref(&t.a.reference())).credentials(&bob()).run().await;
    assert!(skopeo_bob.is_err(), "skopeo as bob must not pull team-a/app");

    // A wrong password is refused with a challenge (and, remembered, costs
    // no second check).
    let wrong = Credentials::new("alice", "not-her-password");
    let mark = tokens.mark();
    for url in urls(&t.larder, &t.a) {
        let (status, challenge, body) = fetch(reqwest::Method::GET, &url, Some(&wrong)).await;
        assert_eq!((status, challenge.as_str()), (401, "Basic realm=\"origin.test\""), "wrong password: {url}");
        assert!(secrets.iter().all(|s| !contains(&body, s)));
    }
    assert_eq!(
        tokens.requests_since(mark).len(),
        1,
        "one check for the wrong password, then its refusal is remembered"
    );

    // bob pulls his own; asking his repository for alice's blob is a
    // membership question, which upstream answers for bob: not there.
    let pulled = skopeo::Pull::new(&t.larder.image_ref(&t.b.reference())).credentials(&bob()).run().await;
    assert_eq!(pulled.unwrap_or_else(|e| panic!("bob pulls team-b/app: {e}")).manifest_digest, t.b.digest);
    let layer = &t.a.blob_digests()[0];
    let (status, _, body) =
        fetch(reqwest::Method::GET, &format!("{}/v2/team-b/app/blobs/{layer}", t.larder.url()), Some(&bob())).await;
    assert_eq!(status, 404, "alice's blob through bob's repository: {}", String::from_utf8_lossy(&body));

    // No password in any log line (larder logs at debug here).
    let log = t.larder.log();
    for secret in [alice().password, bob().password, wrong.password, admin().password] {
        assert!(!log.contains(&secret), "larder's log holds a password");
    }
    let counted =
        |result: &str| format!("larder_client_verifications_total{{result=\"{result}\",upstream=\"origin.test\"}}");
    assert_eq!(metric(&t.larder, &counted("granted")).await, 2.0, "alice's and bob's own repositories");
    assert_eq!(metric(&t.larder, &counted("rejected")).await, 1.0, "the wrong password");
    assert_eq!(metric(&t.larder, &counted("denied")).await, 1.0, "bob for team-a/app, once");
    assert!(metric(&t.larder, "larder_client_verdicts_cached{upstream=\"origin.test\"}").await >= 3.0);

    // The status page and /status say which upstreams verify their clients.
    let admin = format!("http://{}", common::metrics::admin_address(&t.larder));
    let status = http::client().get(format!("{admin}/status")).send().await.unwrap().bytes().await.unwrap();
    let status: serde_json::Value = serde_json::from_slice(&status).unwrap();
    assert_eq!(status["upstreams"][0]["verifies_clients"], true, "{status}");
    let page = http::client().get(format!("{admin}/")).send().await.unwrap().text().await.unwrap();
    assert!(page.contains("origin.test</b> <span class=muted>(default)</span> <span class=muted>(verifies clients)"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_pull_within_the_ttl_asks_nothing_and_a_revoked_tenant_is_refused_after_it() {
    const TTL: Duration = Duration::from_secs(4);
    let t = tenants(&["client_credentials_ttl = \"4s\""]).await;
    let tokens = t.origin.token_server();
    let reference = t.larder.image_ref(&t.a.reference());
    skopeo::Pull::new(&reference).credentials(&alice()).run().await.expect("alice's first pull");

    // Within the ttl: nothing at all reaches the origin or its token server.
    let (mark, tokens_mark) = (t.origin.log_mark().await, tokens.mark());
    let again = skopeo::Pull::new(&reference).credentials(&alice()).run().await.expect("alice's second pull");
    assert_eq!(again.manifest_digest, t.a.digest);
    let seen = t.origin.requests_since(&mark).await;
    assert!(seen.is_empty(), "the second pull within the ttl sent nothing upstream: {:?}", seen.entries());
    assert!(tokens.requests_since(tokens_mark).is_empty(), "and asked for no token");

    // Revoked upstream: served until the verdict's ttl is over, refused after.
    tokens.set_pulls("alice", &[]);
    tokio::time::sleep(TTL + Duration::from_millis(500)).await;
    let refused = skopeo::Pull::new(&reference).credentials(&alice()).run().await;
    assert!(refused.is_err(), "alice's access was revoked more than a ttl ago");
    let manifest = format!("{}/v2/team-a/app/manifests/{}", t.larder.url(), t.a.digest);
    assert_eq!(fetch(reqwest::Method::GET, &manifest, Some(&alice())).await.0, 403);

    // Granted again: within the negative verdict's 10 s, then served.
    tokens.set_pulls("alice", &["team-a/"]);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(fetch(reqwest::Method::GET, &manifest, Some(&alice())).await.0, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_first_requests_with_one_secret_cost_one_check() {
    let t = tenants(&[]).await;
    let url = format!("{}/v2/team-a/app/manifests/{}", t.larder.url(), t.a.digest);
    let mark = t.origin.log_mark().await;
    let pulls: Vec<_> = (0..100)
        .map(|_| {
            tokio::spawn({
                let url = url.clone();
                async move { fetch(reqwest::Method::HEAD, &url, Some(&alice())).await.0 }
            })
        })
        .collect();
    for pull in pulls {
        assert_eq!(pull.await.unwrap(), 200);
    }
    let seen = t.origin.requests_since(&mark).await;
    let heads: Vec<_> = seen.entries().iter().filter(|e| e.method == "HEAD").collect();
    // The check's HEAD, answered 200 once it carried alice's token (the
    // first, anonymous one collected the challenge).
    assert_eq!(
        heads.iter().filter(|e| e.status == 200).count(),
        1,
        "100 requests with one secret: one check: {heads:?}"
    );
    assert!(heads.len() <= 2, "{heads:?}");
    let granted = "larder_client_verifications_total{result=\"granted\",upstream=\"origin.test\"}";
    assert_eq!(metric(&t.larder, granted).await, 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_upstream_down_a_verified_pair_is_served_and_an_unverified_one_gets_503() {
    let t = tenants(&[]).await;
    skopeo::Pull::new(&t.larder.image_ref(&t.a.reference())).credentials(&alice()).run().await.expect("alice pulls");
    let Tenants { origin, larder, a, .. } = t;
    drop(origin);

    let pulled = skopeo::Pull::new(&larder.image_ref(&a.reference())).credentials(&alice()).run().await;
    assert_eq!(pulled.expect("verified within the ttl: served from the cache").manifest_digest, a.digest);
    for url in urls(&larder, &a).into_iter().filter(|u| u.contains("/blobs/") || u.contains("/manifests/")) {
        for who in [bob(), Credentials::new("alice", "a-guess")] {
            let (status, _, body) = fetch(reqwest::Method::GET, &url, Some(&who)).await;
            assert_eq!(status, 503, "{} unverified, upstream down: {url}", who.user);
            assert!(String::from_utf8_lossy(&body).contains("cannot check these credentials"));
        }
    }
    let unavailable = "larder_client_verifications_total{result=\"unavailable\",upstream=\"origin.test\"}";
    assert!(metric(&larder, unavailable).await >= 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn odd_authorization_headers_are_refused_without_a_check() {
    let t = tenants(&[]).await;
    let url = format!("{}/v2/team-a/app/manifests/{}", t.larder.url(), t.a.digest);
    let tokens_mark = t.origin.token_server().mark();
    let huge = format!("Basic {}", "QUFB".repeat(4096));
    let cases: [&[u8]; 5] = [
        b"Basic \xff\xfe",     // not ASCII
        b"Basic bm8tY29sb24=", // "no-colon"
        b"Basic //79",         // base64 of bytes that are not UTF-8
        b"Bearer some-token",  // another scheme: no credentials
        huge.as_bytes(),       // past MAX_AUTHORIZATION_LEN
    ];
    for value in cases {
        let response = http::client()
            .get(&url)
            .header("authorization", reqwest::header::HeaderValue::from_bytes(value).unwrap())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 401, "{:?}", String::from_utf8_lossy(&value[..value.len().min(40)]));
        assert!(response.headers().contains_key("www-authenticate"));
    }
    // Two Authorization headers, alice's first: which one counts would
    // depend on who reads them (a proxy in front may take the last).
    let basic = |c: &Credentials| {
        use base64::Engine;
        let pair = format!("{}:{}", c.user, c.password);
        format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair))
    };
    let mut two = reqwest::header::HeaderMap::new();
    for c in [alice(), bob()] {
        two.append("authorization", basic(&c).parse().unwrap());
    }
    let response = http::client().get(&url).headers(two).send().await.unwrap();
    assert_eq!(response.status(), 401, "two Authorization headers");
    assert!(t.origin.token_server().requests_since(tokens_mark).is_empty(), "none of them cost a check upstream");
    // A password with colons is the password (alice's has two).
    assert_eq!(fetch(reqwest::Method::GET, &url, Some(&alice())).await.0, 200);
}

/// In a cluster, the replica a client reaches checks the client; the
/// digest's owner, which has no credentials of its own and no client's,
/// is asked only for what it holds, and the replica fills with the
/// client's credentials itself.
#[tokio::test(flavor = "multi_thread")]
async fn in_a_cluster_each_replica_checks_its_clients_and_fills_with_their_credentials() {
    let origin = Origin::with_token_auth(admin()).await;
    origin.token_server().add_user(&alice(), &["team-a/"]);
    origin.token_server().add_user(&bob(), &["team-b/"]);
    let a =
        ImageBuilder::oci().layers(&[40 * KIB, 56 * KIB, 72 * KIB, 88 * KIB]).push(&origin, "team-a/app", "v1").await;
    let upstream = Upstream::from(&origin).line("client_credentials = \"verify\"");
    let cluster = common::Cluster::builder(upstream).replicas(3).each(|b| b.ready_on_tcp()).start().await;
    // Some of the blobs are owned by another replica than the one alice asks.
    let owners: Vec<usize> = a.blob_digests().iter().map(|d| cluster.owner_of(d)).collect();
    assert!(owners.iter().any(|o| *o != 0), "some blob is owned elsewhere: {owners:?}");

    for (i, replica) in cluster.replicas.iter().enumerate() {
        let pulled = skopeo::Pull::new(&replica.image_ref(&a.reference())).credentials(&alice()).run().await;
        let pulled = pulled.unwrap_or_else(|e| panic!("alice through replica {i}: {e}\n{}", replica.log()));
        assert_eq!((pulled.manifest_digest.clone(), pulled.blob_digests()), (a.digest.clone(), a.blob_digests()));
        let refused = skopeo::Pull::new(&replica.image_ref(&a.reference())).credentials(&bob()).run().await;
        assert!(refused.is_err(), "bob through replica {i}");
    }
}

/// With credentials of its own, larder fills with them and only checks
/// its clients: the check carries the client's credentials, the fills
/// larder's.
#[tokio::test(flavor = "multi_thread")]
async fn with_credentials_of_its_own_larder_fills_with_them_and_only_checks_clients() {
    let origin = Origin::with_token_auth(admin()).await;
    origin.token_server().add_user(&alice(), &["team-a/"]);
    origin.token_server().add_user(&bob(), &["team-b/"]);
    let a = ImageBuilder::oci().layers(&[40 * KIB]).push(&origin, "team-a/app", "v1").await;
    let upstream = Upstream::from(&origin).credentials(&admin()).line("client_credentials = \"verify\"");
    let larder = Larder::builder().upstream(upstream).ready_on_tcp().start().await;
    let tokens = origin.token_server();

    let mark = tokens.mark();
    let pulled = skopeo::Pull::new(&larder.image_ref(&a.reference())).credentials(&alice()).run().await.expect("alice");
    assert_eq!(pulled.manifest_digest, a.digest);
    let users: Vec<Option<String>> = tokens.requests_since(mark).into_iter().map(|r| r.user).collect();
    assert!(users.contains(&Some("alice".into())), "the check is alice's: {users:?}");
    assert!(users.contains(&Some("admin".into())), "the fills are larder's: {users:?}");
    assert!(users.iter().all(|u| matches!(u.as_deref(), Some("alice" | "admin"))), "{users:?}");
    // larder's own access does not let bob in.
    let refused = skopeo::Pull::new(&larder.image_ref(&a.reference())).credentials(&bob()).run().await;
    assert!(refused.is_err());
}

/// A flood of made-up credentials from one address: each pair costs at
/// most one check, the address gets at most its share of the checks (the
/// rest `429` at once), and a client verified before is answered
/// throughout without waiting behind the flood.
#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_made_up_credentials_is_bounded_and_spares_verified_clients() {
    let t = tenants(&[]).await;
    let url = format!("{}/v2/team-a/app/manifests/{}", t.larder.url(), t.a.digest);
    assert_eq!(fetch(reqwest::Method::GET, &url, Some(&alice())).await.0, 200);
    let tokens = t.origin.token_server();
    let mark = tokens.mark();

    let flood: Vec<_> = (0..300)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                fetch(reqwest::Method::GET, &url, Some(&Credentials::new(&format!("mallory{i}"), "guess"))).await.0
            })
        })
        .collect();
    let mut alice_served = 0;
    while flood.iter().any(|f| !f.is_finished()) {
        assert_eq!(fetch(reqwest::Method::GET, &url, Some(&alice())).await.0, 200, "alice during the flood");
        alice_served += 1;
    }
    let mut statuses = std::collections::BTreeMap::new();
    for f in flood {
        *statuses.entry(f.await.unwrap()).or_insert(0) += 1;
    }
    eprintln!("flood: {statuses:?}; alice served {alice_served} times meanwhile");
    assert!(statuses.keys().all(|s| *s == 401 || *s == 429), "{statuses:?}");
    assert!(statuses.get(&429).copied().unwrap_or(0) > 0, "one address got no more than its share: {statuses:?}");
    let checks = tokens.requests_since(mark).len();
    assert_eq!(checks, statuses.get(&401).copied().unwrap_or(0), "one check per refused pair, none for a 429");
    let cached = metric(&t.larder, "larder_client_verdicts_cached{upstream=\"origin.test\"}").await;
    assert!(cached <= 1.0 + checks as f64, "{cached} verdicts for {checks} checks");
}

/// Fills use a verified client's credentials only while that client's
/// verdict lasts, and a token fetched with them only while they are the
/// ones lent: carol's fill asks a token with carol's credentials (not
/// alice's cached one), and once alice's verdict is over (she was revoked
/// meanwhile) nothing larder fetches uses her credentials or her token,
/// although she was the last client served.
#[tokio::test(flavor = "multi_thread")]
async fn lent_credentials_and_their_tokens_end_with_the_verdict_that_lent_them() {
    let t = tenants(&["client_credentials_ttl = \"4s\""]).await;
    let carol = Credentials::new("carol", "carol-S3cret-pw");
    let tokens = t.origin.token_server();
    tokens.add_user(&carol, &["team-a/"]);
    ImageBuilder::oci().layers(&[12 * KIB]).push(&t.origin, "team-a/app", "v2").await;
    ImageBuilder::oci().layers(&[14 * KIB]).push(&t.origin, "team-a/app", "v3").await;
    let manifest = |tag: &str| format!("{}/v2/team-a/app/manifests/{tag}", t.larder.url());

    assert_eq!(fetch(reqwest::Method::HEAD, &manifest("v1"), Some(&alice())).await.0, 200);
    // alice's verdict ends at most a ttl from now.
    let alice_verified = std::time::Instant::now();

    // carol's first request: her check, then a fill with her credentials.
    let mark = tokens.mark();
    assert_eq!(fetch(reqwest::Method::HEAD, &manifest("v2"), Some(&carol)).await.0, 200);
    let asked: Vec<_> = tokens.requests_since(mark).into_iter().map(|r| r.user).collect();
    assert_eq!(
        asked,
        [Some("carol".to_owned()), Some("carol".to_owned())],
        "carol's check and carol's fill (alice's token is not carol's)"
    );

    // alice again, on the verdict she got at first: her credentials are
    // lent once more, but only until that verdict ends.
    assert_eq!(fetch(reqwest::Method::HEAD, &manifest("v1"), Some(&alice())).await.0, 200);
    tokens.set_pulls("alice", &[]);
    tokio::time::sleep_until((alice_verified + Duration::from_millis(4500)).into()).await;

    // larder's own request for team-a/app (a prefetch: no client, no
    // credentials of larder's own) after alice's verdict ended.
    let (mark, tokens_mark) = (t.origin.log_mark().await, tokens.mark());
    let admin = format!("http://{}", common::metrics::admin_address(&t.larder));
    let prefetch = http::client()
        .post(format!("{admin}/prefetch?image=team-a/app:v3"))
        .bearer_auth(common::admin::generated_token(&t.larder))
        .send()
        .await
        .unwrap();
    let status = prefetch.status();
    eprintln!("prefetch after alice's verdict: {status} {}", prefetch.text().await.unwrap_or_default());
    let asked = tokens.requests_since(tokens_mark);
    assert!(asked.iter().all(|r| r.user.is_none()), "no token asked with anyone's credentials: {asked:#?}");
    let seen = t.origin.requests_since(&mark).await;
    assert_eq!(seen.blob_gets(), 0, "no blob of v3 fetched with alice's credentials or token: {:?}", seen.entries());
    assert_ne!(status, 200, "larder has no credentials for team-a/app any more");
}

/// A token service that trickles its answer (the headers at once, then a
/// byte a second, each pause within the body idle timeout) holds neither
/// a client's check nor larder's own fill past the upstream's
/// `response_timeout`: the whole token answer must arrive within it. A
/// check held for the whole trickle (here 90 s) would keep one of the
/// upstream's eight places for checks all along.
#[tokio::test(flavor = "multi_thread")]
async fn a_token_answer_trickled_byte_by_byte_ends_at_the_response_timeout() {
    use fake::{FakeUpstream, OCI_MANIFEST, REPO, digest, image_manifest, random_bytes};
    let (config, layer) = (random_bytes(256, 21), random_bytes(4096, 22));
    let manifest = image_manifest((&digest(&config), config.len()), &[(&digest(&layer), layer.len())]);
    let token = format!(r#"{{"token":"tok","expires_in":300}}{}"#, " ".repeat(60));
    let up = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, manifest)
        .blob(layer.clone())
        .token_response(token)
        .token_trickle(Duration::from_secs(1))
        .accept_authorization("Bearer tok")
        .start()
        .await;
    up.set_challenge(Some(&format!(r#"Bearer realm="{}/token",service="fake""#, up.url())));
    let timeout = r#"response_timeout = "2s""#;
    let verifying = Larder::builder()
        .upstream(Upstream::new("trickle.test", &up.url()).line(timeout).line("client_credentials = \"verify\""))
        .ready_on_tcp()
        .start()
        .await;
    let filling = Larder::builder()
        .upstream(Upstream::new("trickle.test", &up.url()).line(timeout).credentials(&Credentials::new("larder", "pw")))
        .start()
        .await;

    let check = format!("{}/v2/{REPO}/manifests/v1?ns=trickle.test", verifying.url());
    let fill = format!("{}/v2/{REPO}/blobs/{}?ns=trickle.test", filling.url(), digest(&layer));
    for (url, credentials, expected) in [(fill, None, 504), (check, Some(alice()), 503)] {
        let started = std::time::Instant::now();
        let (status, _, body) = fetch(reqwest::Method::GET, &url, credentials.as_ref()).await;
        let took = started.elapsed();
        eprintln!("{url}: {status} after {:.1}s", took.as_secs_f64());
        assert!(took < Duration::from_secs(10), "{url}: answered after {took:?}, the token trickled on");
        assert_eq!(status, expected, "{url}: {}", String::from_utf8_lossy(&body));
    }
}

/// A fake registry behind a token realm holding `REPO:v1`, an image of a
/// random config and layer (seeded from `seed`), and its tag list; it
/// accepts the token its realm hands out to anyone. Returns it, the
/// config, the layer and the manifest.
async fn token_registry(seed: u64) -> (fake::FakeUpstream, bytes::Bytes, bytes::Bytes, bytes::Bytes) {
    use fake::{FakeUpstream, OCI_MANIFEST, REPO, digest, image_manifest, random_bytes};
    let (config, layer) = (random_bytes(256, seed), random_bytes(4096, seed + 1));
    let manifest = image_manifest((&digest(&config), config.len()), &[(&digest(&layer), layer.len())]);
    let up = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, manifest.clone())
        .blob(config.clone())
        .blob(layer.clone())
        .tag_list(REPO, &["v1"])
        .token_response(r#"{"token":"tok","expires_in":300}"#)
        .accept_authorization("Bearer tok")
        .start()
        .await;
    up.set_challenge(Some(&format!(r#"Bearer realm="{}/token",service="fake""#, up.url())));
    (up, config, layer, manifest)
}

/// Alice pulls each of `blobs` of `REPO` through `larder` (upstream `ns`),
/// so that everything is cached and no fill is left running: faults set
/// next are met by the checks alone.
async fn pulled_by_alice(larder: &Larder, ns: &str, blobs: &[&[u8]]) {
    for blob in blobs {
        let url = format!("{}/v2/{}/blobs/{}?ns={ns}", larder.url(), fake::REPO, fake::digest(blob));
        let (status, _, body) = fetch(reqwest::Method::GET, &url, Some(&alice())).await;
        assert_eq!((status, body == *blob), (200, true), "alice pulls {url}");
    }
}
/// No spelling of a path reaches alice's cached image for bob: a second
/// namespace form (`/v2/<upstream>/…`, `?ns=`), a repeated `ns`, another
/// case, an encoded or doubled slash, `.` and `..` segments, a trailing
/// slash, an upper-case digest, or alice's digests asked through bob's own
/// repository. Each is refused (or, for bob's own referrers, answered
/// about bob's repository), and none carries a byte of alice's image.
#[tokio::test(flavor = "multi_thread")]
async fn no_spelling_of_the_path_reaches_another_tenants_cached_image() {
    let t = tenants(&[]).await;
    let pulled = skopeo::Pull::new(&t.larder.image_ref(&t.a.reference())).credentials(&alice()).run().await;
    assert_eq!(pulled.unwrap_or_else(|e| panic!("alice pulls team-a/app: {e}")).manifest_digest, t.a.digest);
    let secrets = content(&t.origin, &t.a).await;
    let (base, layer, manifest) = (t.larder.url(), t.a.blob_digests()[0].clone(), t.a.digest.clone());
    let refused = [
        format!("{base}/v2/origin.test/team-a/app/manifests/v1"),
        format!("{base}/v2/origin.test/team-a/app/blobs/{layer}"),
        format!("{base}/v2/team-a/app/manifests/v1?ns=origin.test"),
        format!("{base}/v2/team-a/app/blobs/{layer}?ns=origin.test"),
        format!("{base}/v2/team-a/app/blobs/{layer}?ns=origin.test&ns=other"),
        format!("{base}/v2/Team-A/app/manifests/v1"),
        format!("{base}/v2/team-a%2fapp/manifests/v1"),
        format!("{base}/v2/team-a//app/manifests/v1"),
        format!("{base}/v2//team-a/app/manifests/v1"),
        format!("{base}/v2/team-a/./app/manifests/v1"),
        format!("{base}/v2/team-b/../team-a/app/manifests/v1"),
        format!("{base}/v2/team-a/app/manifests/v1/"),
        format!("{base}/v2/team-a/app/blobs/{}", layer.to_uppercase()),
        format!("{base}/v2/team-b/app/blobs/{layer}"),
        format!("{base}/v2/team-b/app/manifests/{manifest}"),
    ];
    let bobs_referrers = format!("{base}/v2/team-b/app/referrers/{manifest}");
    for url in refused.iter().chain([&bobs_referrers]) {
        for method in [reqwest::Method::GET, reqwest::Method::HEAD] {
            let (status, _, body) = fetch(method.clone(), url, Some(&bob())).await;
            let text = String::from_utf8_lossy(&body);
            assert!(secrets.iter().all(|s| !contains(&body, s)), "{method} {url} leaked content to bob: {text}");
            if *url != bobs_referrers {
                assert!(status >= 400, "bob: {method} {url}: {status} {text}");
            } else {
                assert!(!text.contains("\"mediaType\":\"application/vnd.oci.image.manifest"), "{text}");
            }
        }
    }
}

/// A redirect proves nothing about a client's credentials: a front door
/// (http to https, a regional redirector, a single sign-on proxy) sends
/// every request on, whoever sent it. A check answered `3xx` asks the tag
/// list, which no registry redirects; redirected too, the client gets a
/// `503` and nothing cached. Before, a `3xx` was a grant: anyone whose
/// check was redirected read what larder had cached. A blob sent to its
/// storage (the `HEAD` redirected, the tag list answered) is granted.
#[tokio::test(flavor = "multi_thread")]
async fn a_check_answered_with_a_redirect_grants_nothing() {
    use fake::{REPO, digest};
    let (up, config, layer, manifest) = token_registry(31).await;
    let larder = Larder::builder()
        .upstream(
            Upstream::new("door.test", &up.url())
                .line("client_credentials = \"verify\"")
                .credentials(&Credentials::new("larder", "pw")),
        )
        .ready_on_tcp()
        .start()
        .await;
    let blob = format!("{}/v2/{REPO}/blobs/{}?ns=door.test", larder.url(), digest(&layer));
    let tag = format!("{}/v2/{REPO}/manifests/v1?ns=door.test", larder.url());
    for url in [&blob, &tag] {
        let (status, _, _) = fetch(reqwest::Method::GET, url, Some(&alice())).await;
        assert_eq!(status, 200, "alice fills {url}");
    }
    pulled_by_alice(&larder, "door.test", &[&config, &layer]).await;

    // Every request of mallory's checks is redirected (the HEAD, then the tag list).
    for (i, (url, status)) in [(&blob, 302), (&tag, 301), (&blob, 307), (&tag, 308)].into_iter().enumerate() {
        let mallory = Credentials::new("mallory", &format!("guess-{i}"));
        up.fail_next(2, status, None);
        let (answer, _, body) = fetch(reqwest::Method::GET, url, Some(&mallory)).await;
        assert_eq!(answer, 503, "{status} to mallory's check of {url}: {}", String::from_utf8_lossy(&body));
        assert!(!contains(&body, &layer) && !contains(&body, &manifest), "{url} leaked to mallory");
    }
    // A blob redirected to its storage after the check: the tag list says.
    up.fail_next(1, 307, None);
    let (answer, _, body) = fetch(reqwest::Method::GET, &blob, Some(&bob())).await;
    assert_eq!((answer, body == layer), (200, true), "a blob's HEAD redirected, the tag list answered");
}

/// Whatever upstream answers a check, the client gets what it proves and
/// nothing more: a server error, a `429` or a `400` says nothing about the
/// credentials (`503`, content withheld); a `401` or `403` to a token that
/// was handed out refuses them (`403`); a `404` asks the tag list, which
/// decides. Each answer costs its own check: none is taken for another.
#[tokio::test(flavor = "multi_thread")]
async fn every_answer_upstream_gives_a_check_proves_only_what_it_says() {
    use fake::REPO;
    let (up, config, layer, manifest) = token_registry(41).await;
    let larder = Larder::builder()
        .upstream(Upstream::new("faults.test", &up.url()).line("client_credentials = \"verify\""))
        .ready_on_tcp()
        .start()
        .await;
    let url = format!("{}/v2/{REPO}/manifests/v1?ns=faults.test", larder.url());
    let (status, _, _) = fetch(reqwest::Method::GET, &url, Some(&alice())).await;
    assert_eq!(status, 200, "alice's manifest is cached");
    pulled_by_alice(&larder, "faults.test", &[&config, &layer]).await;

    let answers = [(500, 503), (502, 503), (503, 503), (429, 503), (400, 503), (403, 403), (401, 403), (404, 200)];
    for (i, (upstream_says, client_gets)) in answers.into_iter().enumerate() {
        up.fail_next(1, upstream_says, Some("7"));
        let someone = Credentials::new("someone", &format!("password-{i}"));
        let (status, _, body) = fetch(reqwest::Method::GET, &url, Some(&someone)).await;
        assert_eq!(status, client_gets, "upstream answered {upstream_says}: {}", String::from_utf8_lossy(&body));
        assert_eq!(contains(&body, &manifest), status == 200, "upstream answered {upstream_says}");
    }
}
