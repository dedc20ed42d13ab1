//! larder behind an origin that uses token auth (distribution `auth.token`
//! with an in-process token server): anonymous tokens for public images,
//! Basic-authenticated tokens with configured credentials for `private/…`,
//! and a clean refusal without them.

mod common;

use common::{Credentials, ImageBuilder, KIB, Larder, Origin, PushedImage, Upstream, http, skopeo};

const LAYERS: [usize; 2] = [24 * KIB, 128 * KIB];

fn credentials() -> Credentials {
    Credentials::new("larder", "s3cret")
}

async fn origin_with(repo: &str) -> (Origin, PushedImage) {
    let origin = Origin::with_token_auth(credentials()).await;
    let image = ImageBuilder::oci().layers(&LAYERS).push(&origin, repo, "v1").await;
    (origin, image)
}

#[tokio::test]
async fn public_image_pulls_with_anonymous_tokens() {
    let (origin, image) = origin_with("public/app").await;
    let larder = Larder::builder().upstream(&origin).start().await;
    let tokens = origin.token_server();
    let mark = tokens.mark();

    let pulled = skopeo::pull(&larder.image_ref(&image.reference()), false)
        .await
        .unwrap_or_else(|e| panic!("pulling public/app through larder failed: {e}"));
    assert_eq!(pulled.manifest_digest, image.digest);
    assert_eq!(pulled.blob_digests(), image.blob_digests());

    let requests = tokens.requests_since(mark);
    eprintln!("token requests during the pull: {requests:#?}");
    assert!(
        requests.iter().any(|r| r.asks_for("public/app")),
        "larder asked the token server for public/app: {requests:#?}"
    );
    assert!(
        requests.iter().all(|r| !r.carried_basic),
        "larder has no credentials, so its token requests are anonymous: {requests:#?}"
    );
}

#[tokio::test]
async fn private_image_pulls_with_configured_credentials() {
    let (origin, image) = origin_with("private/app").await;
    let larder = Larder::builder().upstream(Upstream::from(&origin).credentials(&credentials())).start().await;
    let tokens = origin.token_server();
    let mark = tokens.mark();

    let pulled = skopeo::pull(&larder.image_ref(&image.reference()), false)
        .await
        .unwrap_or_else(|e| panic!("pulling private/app through larder with credentials failed: {e}"));
    assert_eq!(pulled.manifest_digest, image.digest);
    assert_eq!(pulled.blob_digests(), image.blob_digests());

    let requests = tokens.requests_since(mark);
    eprintln!("token requests during the pull: {requests:#?}");
    assert!(
        requests.iter().any(|r| r.carried_basic && r.credentials_valid && r.asks_for("private/app")),
        "larder sent its Basic credentials for private/app: {requests:#?}"
    );
    assert!(requests.iter().all(|r| r.status == 200), "no token request was refused: {requests:#?}");
}

#[tokio::test]
async fn private_image_without_credentials_is_refused_without_crashing() {
    let (origin, image) = origin_with("private/app").await;
    let mut larder = Larder::builder().upstream(&origin).start().await;

    let refused = skopeo::pull(&larder.image_ref(&image.reference()), false).await;
    assert!(refused.is_err(), "larder without credentials must not serve private/app");

    let client = http::client();
    let manifest_url = format!("{}/v2/{}/manifests/{}", larder.url(), image.repo, image.tag);
    let response = http::manifest_get(&client, &manifest_url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {manifest_url} from larder failed: {e}"));
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    eprintln!("larder answered GET {manifest_url}: {status} {body}");
    assert_ne!(status, 200, "GET {manifest_url} must not succeed: {body}");

    let blob = &image.manifests[0].layers[0].digest;
    let blob_url = format!("{}/v2/{}/blobs/{blob}", larder.url(), image.repo);
    let response =
        client.get(&blob_url).send().await.unwrap_or_else(|e| panic!("GET {blob_url} from larder failed: {e}"));
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    eprintln!("larder answered GET {blob_url}: {status} {body}");
    assert_ne!(status, 200, "GET {blob_url} must not succeed");

    larder.assert_running("after refusing private/app");
    let ping = client
        .get(format!("{}/v2/", larder.url()))
        .send()
        .await
        .unwrap_or_else(|e| panic!("larder stopped answering after refusing private/app: {e}"));
    assert_eq!(ping.status(), 200, "larder still answers /v2/");
}
