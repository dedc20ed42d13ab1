//! Tag freshness: a tag is served from the cache for `tag_ttl`, then one
//! upstream `HEAD` revalidates it. A moved tag is fetched by its new digest
//! (the old digest stays servable), an unchanged tag is renewed without a
//! manifest GET, a tag matching `immutable_tags` is never asked about, and a
//! tag gone upstream is 404.
//!
//! The origin is a real distribution registry; its access log shows what
//! larder asked. "Tag gone" is shown twice: with the real origin (the
//! manifest deleted) and with the fake upstream answering the `HEAD` 404
//! while the tag still resolves there otherwise.

mod common;
mod fake;

use std::net::SocketAddr;
use std::time::Duration;

use common::{AccessLog, ImageBuilder, KIB, Larder, Origin, PulledImage, PushedImage, Upstream, http, skopeo};
use fake::client::{self, End};
use fake::{UPSTREAM_NAME, manifest_path};

/// Small layers: these tests are about manifests.
const LAYERS: [usize; 2] = [16 * KIB, 64 * KIB];

/// How long the tests wait for a 1 s `tag_ttl` to pass.
const PAST_TTL: Duration = Duration::from_millis(1500);

#[tokio::test]
async fn a_moved_tag_is_revalidated_with_a_head_then_fetched_by_its_new_digest() {
    let origin = Origin::start().await;
    let old = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/app", "latest").await;
    let larder = Larder::builder().upstream(&origin).tag_ttl("1s").start().await;
    let by_tag = larder.image_ref("team/app:latest");
    assert_same_image(&pull(&by_tag).await, &old, "first pull");

    // The tag moves upstream; larder finds out once its TTL has passed.
    let new = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/app", "latest").await;
    assert_ne!(new.digest, old.digest);
    tokio::time::sleep(PAST_TTL).await;

    let mark = origin.log_mark().await;
    assert_same_image(&pull(&by_tag).await, &new, "pull after the tag moved");
    let requests = origin.requests_since(&mark).await;
    assert_eq!(
        manifest_requests(&requests),
        ["HEAD /v2/team/app/manifests/latest".to_owned(), format!("GET /v2/team/app/manifests/{}", new.digest)],
        "one HEAD of the tag, then a GET of the new digest (not of the tag):\n{requests}"
    );
    assert_eq!(requests.blob_gets(), new.blobs().len(), "the new image's blobs are fetched:\n{requests}");

    // The old image is still served by digest, from the cache alone.
    let mark = origin.log_mark().await;
    assert_same_image(&pull(&larder.image_ref(&old.by_digest())).await, &old, "pull of the old digest");
    let requests = origin.requests_since(&mark).await;
    assert!(requests.is_empty(), "the old digest comes from the cache:\n{requests}");
}

#[tokio::test]
async fn an_unchanged_tag_is_renewed_by_one_head_without_a_manifest_get() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/app", "v1").await;
    // The upstream's own tag_ttl overrides the global 5m.
    let larder = Larder::builder().upstream(Upstream::from(&origin).tag_ttl("1s")).start().await;
    assert_same_image(&pull(&larder.image_ref("team/app:v1")).await, &image, "first pull");
    tokio::time::sleep(PAST_TTL).await;

    let mark = origin.log_mark().await;
    assert_eq!(manifest_digest(&larder, "team/app", "v1").await, image.digest, "after the TTL");
    // Renewed: asking again right away goes nowhere.
    assert_eq!(manifest_digest(&larder, "team/app", "v1").await, image.digest, "right after the renewal");
    let requests = origin.requests_since(&mark).await;
    assert_eq!(
        manifest_requests(&requests),
        ["HEAD /v2/team/app/manifests/v1"],
        "one HEAD renews the tag; no manifest GET:\n{requests}"
    );
    assert_eq!(requests.len(), 1, "nothing else was asked upstream:\n{requests}");
}

#[tokio::test]
async fn an_immutable_tag_is_never_revalidated() {
    let origin = Origin::start().await;
    let pinned = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/app", "v1").await;
    let floating = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/app", "latest").await;
    let upstream = Upstream::from(&origin).line(r"immutable_tags = ['^v\d+$']");
    let larder = Larder::builder().upstream(upstream).tag_ttl("1s").start().await;
    assert_same_image(&pull(&larder.image_ref("team/app:v1")).await, &pinned, "first pull of v1");
    assert_same_image(&pull(&larder.image_ref("team/app:latest")).await, &floating, "first pull of latest");

    // Both tags move upstream (re-pushing a version tag is what immutable_tags
    // declares will not happen), and both TTLs pass.
    ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/app", "v1").await;
    let moved = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/app", "latest").await;
    tokio::time::sleep(PAST_TTL).await;

    let mark = origin.log_mark().await;
    assert_same_image(&pull(&larder.image_ref("team/app:v1")).await, &pinned, "v1 after the TTL");
    let requests = origin.requests_since(&mark).await;
    assert!(requests.is_empty(), "v1 matches immutable_tags: nothing asked upstream:\n{requests}");

    // The TTL did pass: the mutable tag is revalidated and follows the move.
    let mark = origin.log_mark().await;
    assert_same_image(&pull(&larder.image_ref("team/app:latest")).await, &moved, "latest after the TTL");
    let requests = origin.requests_since(&mark).await;
    assert_eq!(
        manifest_requests(&requests),
        ["HEAD /v2/team/app/manifests/latest".to_owned(), format!("GET /v2/team/app/manifests/{}", moved.digest)],
        "latest is revalidated and follows the move:\n{requests}"
    );
}

#[tokio::test]
async fn a_tag_deleted_at_the_origin_is_404_while_its_digest_stays_servable() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/app", "v1").await;
    let larder = Larder::builder().upstream(&origin).tag_ttl("1s").start().await;
    assert_same_image(&pull(&larder.image_ref("team/app:v1")).await, &image, "first pull");

    // Deleting the manifest by digest removes the tags naming it.
    delete_manifest(&origin, "team/app", &image.digest).await;
    tokio::time::sleep(PAST_TTL).await;

    let mark = origin.log_mark().await;
    let response = get_manifest(&larder, "team/app", "v1").await;
    assert_eq!(response.status, 404, "{}", response.body);
    assert_eq!(error_code(&response.body), "MANIFEST_UNKNOWN");
    let requests = origin.requests_since(&mark).await;
    assert_eq!(manifest_requests(&requests), ["HEAD /v2/team/app/manifests/v1"], "{requests}");

    // What was cached by digest is still served, without asking upstream
    // (where it is gone too).
    let mark = origin.log_mark().await;
    assert_same_image(&pull(&larder.image_ref(&image.by_digest())).await, &image, "pull by digest");
    let requests = origin.requests_since(&mark).await;
    assert!(requests.is_empty(), "the digest comes from the cache:\n{requests}");
}

#[tokio::test]
async fn a_head_answered_404_makes_the_tag_404_and_leaves_its_digest_servable() {
    let (manifest, manifest_digest, up) = fake::fake_with_v1().await;
    let larder =
        Larder::builder().upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true)).tag_ttl("1s").start().await;
    let addr: SocketAddr = larder.host_port().parse().expect("larder's address");

    let r = client::get(addr, &manifest_path("v1")).await;
    assert_eq!((r.status(), &r.end), (200, &End::Complete));
    assert!(r.body == manifest);
    tokio::time::sleep(PAST_TTL).await;

    up.fail_next(1, 404, None);
    let r = client::get(addr, &manifest_path("v1")).await;
    assert_eq!(r.status(), 404, "the tag is gone upstream: {:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.error_code(), "MANIFEST_UNKNOWN");
    assert_eq!(up.requests("HEAD", &manifest_path("v1")), 1, "one HEAD revalidated the tag: {:?}", up.log());
    assert_eq!(up.manifest_gets("v1"), 1, "only the first GET by tag: {:?}", up.log());

    let before = up.total_requests();
    let r = client::get(addr, &manifest_path(&manifest_digest)).await;
    assert_eq!((r.status(), &r.end), (200, &End::Complete));
    assert!(r.body == manifest, "the cached manifest's exact bytes");
    assert_eq!(r.header("docker-content-digest"), Some(manifest_digest.as_str()));
    assert_eq!(up.total_requests(), before, "served by digest from the cache: {:?}", up.log());
}

// ---- helpers ----------------------------------------------------------------

async fn pull(source: &str) -> PulledImage {
    skopeo::pull(source, false).await.unwrap_or_else(|e| panic!("pulling {source} through larder failed: {e}"))
}

fn assert_same_image(pulled: &PulledImage, image: &PushedImage, step: &str) {
    assert_eq!(pulled.manifest_digest, image.digest, "{step}: manifest digest");
    assert_eq!(pulled.blob_digests(), image.blob_digests(), "{step}: blobs");
}

/// `"METHOD path"` of every manifest request, in order.
fn manifest_requests(log: &AccessLog) -> Vec<String> {
    log.manifest_requests().iter().map(|e| format!("{} {}", e.method, e.path())).collect()
}

struct Fetched {
    status: u16,
    digest: Option<String>,
    body: String,
}

/// `GET /v2/<repo>/manifests/<reference>` through larder, as skopeo asks.
async fn get_manifest(larder: &Larder, repo: &str, reference: &str) -> Fetched {
    let url = format!("{}/v2/{repo}/manifests/{reference}", larder.url());
    let response = http::manifest_get(&http::client(), &url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url} through larder failed: {e}"));
    let status = response.status().as_u16();
    let digest = response.headers().get("docker-content-digest").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let body = response.text().await.unwrap_or_else(|e| panic!("reading GET {url}: {e}"));
    Fetched { status, digest, body }
}

/// The digest larder serves for `repo:tag`; panics unless it answers 200.
async fn manifest_digest(larder: &Larder, repo: &str, tag: &str) -> String {
    let fetched = get_manifest(larder, repo, tag).await;
    assert_eq!(fetched.status, 200, "GET {repo}:{tag} through larder: {}", fetched.body);
    fetched.digest.unwrap_or_else(|| panic!("GET {repo}:{tag}: no Docker-Content-Digest"))
}

fn error_code(body: &str) -> String {
    let json: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("not an OCI error envelope ({e}): {body}"));
    json["errors"][0]["code"].as_str().unwrap_or_else(|| panic!("no error code in {body}")).to_owned()
}

/// `DELETE /v2/<repo>/manifests/<digest>` at the origin (its config enables
/// deletes); distribution removes the tags that named the manifest too.
async fn delete_manifest(origin: &Origin, repo: &str, digest: &str) {
    let url = format!("{}/v2/{repo}/manifests/{digest}", origin.url());
    let response =
        http::client().delete(&url).send().await.unwrap_or_else(|e| panic!("DELETE {url} at the origin failed: {e}"));
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    assert_eq!(status, 202, "DELETE {url} at the origin: {body}");
}
