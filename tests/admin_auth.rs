//! The admin API's guard, from outside: with `[admin] token_file`, purge
//! and prefetch need `Authorization: Bearer <token>`; a missing or wrong
//! token is 401 with a Bearer challenge, counted in a metric, and changes
//! nothing; read-only endpoints stay open; a rotated token file takes
//! effect without a restart, and a deleted or emptied one revokes the
//! token. Without a token file, a loopback listener needs the token larder
//! writes into its cache folder, and any other refuses purge and prefetch
//! (403). Whatever the token, a request from a web page (`Origin`,
//! cross-site `Sec-Fetch-Site`) or for a foreign `Host` (DNS rebinding) is
//! refused (403).

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use common::admin::generated_token;
use common::metrics::metric;
use common::{Admin, ImageBuilder, KIB, Larder, ORIGIN_NAME, Origin, free_port, http, skopeo};

const TOKEN: &str = "test-admin-token-5f1c9a7e3b";
/// The longest a test waits for larder to notice a changed token file
/// (it looks every 2 s, and settles a new token for 0.5 s).
const PATIENCE: Duration = Duration::from_secs(60);

/// POSTs `url` with `token` until the answer's status is `want`; panics
/// after [`PATIENCE`]. Returns the last answer's OCI error code, if any.
async fn until_status(url: &str, token: &str, want: u16, what: &str) -> Option<String> {
    let started = Instant::now();
    loop {
        let resp = post(url, Some(token)).await;
        if resp.status() == want {
            let body: serde_json::Value = serde_json::from_slice(&resp.bytes().await.expect("body")).expect("JSON");
            return body["errors"][0]["code"].as_str().map(str::to_owned);
        }
        assert!(started.elapsed() < PATIENCE, "{what}: still {} after {PATIENCE:?}", resp.status());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn post(url: &str, token: Option<&str>) -> reqwest::Response {
    let mut request = http::client().post(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    request.send().await.expect("the admin listener answers")
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unauthenticated_purge_is_refused_and_changes_nothing() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[48 * KIB, 96 * KIB]).push(&origin, "team/app", "v1").await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let larder = builder.start().await;
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("warm the cache");
    let purge = format!("{}/purge?upstream={ORIGIN_NAME}&repo=team/app", admin.url());

    // No token, a wrong one, another scheme: 401, a Bearer challenge, the OCI envelope.
    for (token, header) in [
        (None, None),
        (Some("not-the-token-0123456789"), None),
        (Some(&TOKEN[..TOKEN.len() - 1]), None),
        (None, Some(format!("Basic {}", base64_of(&format!("admin:{TOKEN}"))))),
    ] {
        let mut request = http::client().post(&purge);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(header) = &header {
            request = request.header("Authorization", header);
        }
        let resp = request.send().await.expect("answer");
        assert_eq!(resp.status(), 401, "token {token:?} header {header:?}");
        assert_eq!(resp.headers()["www-authenticate"], "Bearer realm=\"larder-admin\"");
        let body: serde_json::Value = serde_json::from_slice(&resp.bytes().await.expect("body")).expect("OCI envelope");
        assert_eq!(body["errors"][0]["code"], "UNAUTHORIZED");
    }
    // Other methods and unknown paths are guarded too; so is prefetch.
    for method in [reqwest::Method::PUT, reqwest::Method::DELETE, reqwest::Method::PATCH] {
        let resp = http::client().request(method.clone(), &purge).send().await.expect("answer");
        assert_eq!(resp.status(), 401, "{method}");
    }
    assert_eq!(post(&format!("{}/anything-new", admin.url()), None).await.status(), 401);
    assert_eq!(post(&format!("{}/prefetch?image=team/app:v1", admin.url()), None).await.status(), 401);

    // Counted, and nothing changed: the next pull is still served from the cache.
    assert_eq!(metric(&larder, "larder_admin_auth_failures_total{endpoint=\"purge\",reason=\"missing\"}").await, 5.0);
    assert_eq!(metric(&larder, "larder_admin_auth_failures_total{endpoint=\"purge\",reason=\"wrong\"}").await, 2.0);
    assert_eq!(
        metric(&larder, "larder_admin_auth_failures_total{endpoint=\"prefetch\",reason=\"missing\"}").await,
        1.0
    );
    assert_eq!(metric(&larder, "larder_admin_auth_failures_total{endpoint=\"other\",reason=\"missing\"}").await, 1.0);
    let mark = origin.log_mark().await;
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("pull after refused purges");
    assert_eq!(origin.requests_since(&mark).await.blob_gets(), 0, "a refused purge removed nothing");

    // With the token, the purge happens.
    let resp = post(&purge, Some(TOKEN)).await;
    assert_eq!(resp.status(), 200);
    let purged: serde_json::Value = serde_json::from_slice(&resp.bytes().await.expect("body")).expect("JSON");
    assert_eq!(purged["blobs"], image.blob_digests().len());
}

#[tokio::test(flavor = "multi_thread")]
async fn read_only_endpoints_stay_open_and_a_rotated_token_takes_effect() {
    let origin = Origin::start().await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let _larder = builder.start().await;
    for path in ["/metrics", "/healthz", "/readyz", "/", "/status"] {
        let resp = http::client().get(format!("{}{path}", admin.url())).send().await.expect("answer");
        assert_eq!(resp.status(), 200, "GET {path} without a token");
    }
    let purge = format!("{}/purge?upstream={ORIGIN_NAME}", admin.url());
    assert_eq!(post(&purge, Some(TOKEN)).await.status(), 200);

    // Kubernetes rotates a Secret by swapping the file: the new token is
    // read within the reload interval (2 s), the old one refused.
    let rotated = "rotated-admin-token-8d2e4f6a1c";
    let next = admin.token_file().with_extension("next");
    std::fs::write(&next, format!("{rotated}\n")).expect("write");
    std::fs::rename(&next, admin.token_file()).expect("swap the token file");
    let deadline = Instant::now() + Duration::from_secs(10);
    while post(&purge, Some(rotated)).await.status() != 200 {
        assert!(Instant::now() < deadline, "the rotated token was not picked up");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(post(&purge, Some(TOKEN)).await.status(), 401, "the old token is refused after rotation");
}

/// Issue 23, item 8: deleting or emptying the token file revokes the
/// token (no fall-back to an open listener); a valid token written to it
/// is adopted.
#[tokio::test(flavor = "multi_thread")]
async fn deleting_or_emptying_the_token_file_revokes_the_token() {
    let origin = Origin::start().await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let larder = builder.start().await;
    let purge = format!("{}/purge?upstream={ORIGIN_NAME}", admin.url());
    assert_eq!(post(&purge, Some(TOKEN)).await.status(), 200);

    // Deleted: within the watcher's period the token is refused, 403 DENIED (no token would help).
    std::fs::remove_file(admin.token_file()).expect("delete the token file");
    let code = until_status(&purge, TOKEN, 403, "the token after its file was deleted").await;
    assert_eq!(code.as_deref(), Some("DENIED"));
    assert_eq!(post(&purge, None).await.status(), 403, "and no token at all is not let in either");
    assert!(
        metric(&larder, "larder_admin_auth_failures_total{endpoint=\"purge\",reason=\"revoked\"}").await >= 2.0,
        "refusals are counted"
    );
    let log = larder.log();
    let revoked = log.matches("admin token file unusable").count();
    assert_eq!(revoked, 1, "the revocation is logged once, not per request:\n{log}");

    // The same token written back is adopted again; emptying the file then revokes it again.
    std::fs::write(admin.token_file(), format!("{TOKEN}\n")).expect("restore");
    until_status(&purge, TOKEN, 200, "the restored token").await;
    std::fs::write(admin.token_file(), "").expect("empty the token file");
    let code = until_status(&purge, TOKEN, 403, "the token after its file was emptied").await;
    assert_eq!(code.as_deref(), Some("DENIED"));

    // A new token: it works, and the old one is wrong.
    let fresh = "fresh-admin-token-3c9d1e7f22";
    std::fs::write(admin.token_file(), format!("{fresh}\n")).expect("write a new token");
    until_status(&purge, fresh, 200, "the new token").await;
    assert_eq!(post(&purge, Some(TOKEN)).await.status(), 401, "the old token is refused");
}

/// Issue 23, item 7: a page in a browser (`Origin`, `Sec-Fetch-Site`) or
/// a DNS-rebinding page (`Host: attacker.example`) cannot operate, not
/// even with the right token; loopback, `localhost` and `allowed_hosts`
/// names can.
#[tokio::test(flavor = "multi_thread")]
async fn a_web_page_or_a_rebound_host_cannot_operate_even_with_the_token() {
    let origin = Origin::start().await;
    ImageBuilder::oci().layers(&[48 * KIB]).push(&origin, "team/app", "v1").await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let larder = builder.append_toml("allowed_hosts = [\"larder-admin.test\"]").start().await;
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("warm the cache");
    let purge = format!("{}/purge?upstream={ORIGIN_NAME}&repo=team/app", admin.url());
    let port = admin.port;

    // The reproduction, with the token added: every one refused, 403 DENIED.
    for (headers, reason) in [
        (vec![("Origin", "https://evil.example".to_owned())], "cross_site"),
        (vec![("Origin", "null".to_owned())], "cross_site"),
        (vec![("Sec-Fetch-Site", "cross-site".to_owned())], "cross_site"),
        (vec![("Host", format!("attacker.example:{port}"))], "host"),
        (
            vec![("Origin", "https://evil.example".to_owned()), ("Host", format!("attacker.example:{port}"))],
            "cross_site",
        ),
    ] {
        let mut request = http::client().post(&purge).bearer_auth(TOKEN);
        for (name, value) in &headers {
            request = request.header(*name, value);
        }
        let resp = request.send().await.expect("answer");
        assert_eq!(resp.status(), 403, "{headers:?}");
        let body: serde_json::Value = serde_json::from_slice(&resp.bytes().await.expect("body")).expect("OCI envelope");
        assert_eq!(body["errors"][0]["code"], "DENIED", "{headers:?}: {body}");
        let series = format!("larder_admin_auth_failures_total{{endpoint=\"purge\",reason=\"{reason}\"}}");
        assert!(metric(&larder, &series).await >= 1.0, "{headers:?} counted as {reason}");
    }
    assert_eq!(
        metric(&larder, "larder_admin_auth_failures_total{endpoint=\"purge\",reason=\"cross_site\"}").await,
        4.0
    );
    assert_eq!(metric(&larder, "larder_admin_auth_failures_total{endpoint=\"purge\",reason=\"host\"}").await, 1.0);
    // A page may still read the metrics: read-only endpoints are not guarded.
    let read = http::client().get(format!("{}/metrics", admin.url())).header("Origin", "https://evil.example");
    assert_eq!(read.send().await.expect("answer").status(), 200);

    // Nothing was purged: the next pull is served from the cache.
    let mark = origin.log_mark().await;
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("pull after refused purges");
    assert_eq!(origin.requests_since(&mark).await.blob_gets(), 0, "a refused purge removed nothing");

    // The names the listener answers to: localhost, an allowed_hosts name, a same-origin fetch.
    for (name, value) in [
        ("Host", format!("localhost:{port}")),
        ("Host", format!("larder-admin.test:{port}")),
        ("Sec-Fetch-Site", "same-origin".to_owned()),
    ] {
        let resp = http::client().post(&purge).bearer_auth(TOKEN).header(name, &value).send().await.expect("answer");
        assert_eq!(resp.status(), 200, "{name}: {value}");
    }
}

/// Issue 23, item 7: a loopback admin listener without a token file was
/// open to every local process (on a hostNetwork node, every hostNetwork
/// pod). It now writes a token of its own (mode 0600) and needs it.
#[tokio::test(flavor = "multi_thread")]
async fn without_a_token_file_a_loopback_admin_listener_needs_the_token_it_generated() {
    use std::os::unix::fs::PermissionsExt;
    let origin = Origin::start().await;
    let (builder, admin) = Admin::open(Larder::builder().upstream(&origin));
    let larder = builder.start().await;
    let purge = format!("{}/purge?upstream={ORIGIN_NAME}", admin.url());
    let resp = post(&purge, None).await;
    assert_eq!(resp.status(), 401, "no longer open to every local process");
    let file = larder.cache_dir().join("admin-token");
    let mode = std::fs::metadata(&file).expect("the generated token file").permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "readable by larder's user only");
    assert!(larder.log().contains(&file.display().to_string()), "its path is logged");
    assert!(!larder.log().contains(&generated_token(&larder)), "the token itself is not");
    assert_eq!(post(&purge, Some(&generated_token(&larder))).await.status(), 200);
}

/// larder decides "loopback" from the configured `admin_listen` address
/// (`IpAddr::is_loopback`: 127.0.0.0/8 and `::1`), and these tests may only
/// listen on loopback. The IPv4-mapped form of 127.0.0.1 is the one address
/// that satisfies both: std does not call it loopback, so larder takes the
/// "others can reach it" branch, yet the socket accepts only connections
/// to 127.0.0.1 (an IPv6 socket bound to `::ffff:127.0.0.1`). A wildcard
/// bind would reach the same branch but listen on every interface.
const MAPPED_LOOPBACK: &str = "::ffff:127.0.0.1";

#[tokio::test(flavor = "multi_thread")]
async fn without_a_token_file_a_listener_others_can_reach_refuses_purge_and_prefetch() {
    let mapped: IpAddr = MAPPED_LOOPBACK.parse().expect("an IPv6 address");
    assert!(!mapped.is_loopback(), "the premise: larder's loopback rule does not cover {mapped}");
    assert_eq!(mapped.to_canonical(), IpAddr::V4(Ipv4Addr::LOCALHOST), "and it is 127.0.0.1 all the same");

    let origin = Origin::start().await;
    ImageBuilder::oci().layers(&[48 * KIB, 96 * KIB]).push(&origin, "team/app", "v1").await;
    let port = free_port();
    let larder = Larder::builder()
        .upstream(&origin)
        .server_line(&format!("admin_listen = \"[{MAPPED_LOOPBACK}]:{port}\""))
        .start()
        .await;
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("warm the cache");
    let admin = format!("http://127.0.0.1:{port}");

    // Even the right-looking request is refused: 403 DENIED in the OCI
    // envelope, telling the operator what to change. No token helps.
    let purge = format!("{admin}/purge?upstream={ORIGIN_NAME}&repo=team/app");
    let prefetch = format!("{admin}/prefetch?image=team/app:v1");
    for (url, token) in [(&purge, None), (&purge, Some(TOKEN)), (&prefetch, None)] {
        let resp = post(url, token).await;
        assert_eq!(resp.status(), 403, "POST {url} with token {token:?}");
        let body: serde_json::Value = serde_json::from_slice(&resp.bytes().await.expect("body")).expect("OCI envelope");
        assert_eq!(body["errors"][0]["code"], "DENIED", "{body}");
        let message = body["errors"][0]["message"].as_str().unwrap_or_default();
        assert!(message.contains("token_file") && message.contains("loopback"), "{message}");
    }

    // Counted with its own reason; the read-only endpoints stay open.
    let metrics = http::client().get(format!("{admin}/metrics")).send().await.expect("GET /metrics");
    assert_eq!(metrics.status(), 200);
    let metrics = metrics.text().await.expect("metrics text");
    let series = |name: &str| -> f64 {
        let line = metrics.lines().find(|l| l.rsplit_once(' ').is_some_and(|(n, _)| n == name));
        line.and_then(|l| l.rsplit_once(' ')).map_or(0.0, |(_, v)| v.parse().expect("a number"))
    };
    assert_eq!(series("larder_admin_auth_failures_total{endpoint=\"purge\",reason=\"disabled\"}"), 2.0);
    assert_eq!(series("larder_admin_auth_failures_total{endpoint=\"prefetch\",reason=\"disabled\"}"), 1.0);
    for path in ["/healthz", "/readyz", "/", "/status"] {
        let resp = http::client().get(format!("{admin}{path}")).send().await.expect("answer");
        assert_eq!(resp.status(), 200, "GET {path}");
    }

    // Nothing was purged: the next pull is served from the cache.
    let mark = origin.log_mark().await;
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("pull after refused purges");
    assert_eq!(origin.requests_since(&mark).await.blob_gets(), 0, "a refused purge removed nothing");
}

fn base64_of(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}
