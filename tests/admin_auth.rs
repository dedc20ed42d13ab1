//! The admin API's guard, from outside: with `[admin] token_file`, purge
//! and prefetch need `Authorization: Bearer <token>`; a missing or wrong
//! token is 401 with a Bearer challenge, counted in a metric, and changes
//! nothing; read-only endpoints stay open; a rotated token file takes
//! effect without a restart.

mod common;

use std::time::{Duration, Instant};

use common::metrics::metric;
use common::{Admin, ImageBuilder, KIB, Larder, ORIGIN_NAME, Origin, http, skopeo};

const TOKEN: &str = "test-admin-token-5f1c9a7e3b";

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

#[tokio::test(flavor = "multi_thread")]
async fn without_a_token_file_a_loopback_admin_listener_is_open() {
    let origin = Origin::start().await;
    let (builder, admin) = Admin::open(Larder::builder().upstream(&origin));
    let _larder = builder.start().await;
    let resp = post(&format!("{}/purge?upstream={ORIGIN_NAME}", admin.url()), None).await;
    assert_eq!(resp.status(), 200, "loopback without a token file: local processes may operate");
}

fn base64_of(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}
