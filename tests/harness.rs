//! Checks the test harness itself against the real peers, without larder:
//! images pushed to distribution come back byte-for-byte through skopeo,
//! the access log counts what happened, and the token-auth origin enforces
//! its policy. When these fail, larder's tests cannot be trusted.

mod common;

use common::{Credentials, ImageBuilder, KIB, Origin, skopeo};

#[tokio::test]
async fn origin_serves_pushed_images_and_logs_each_request() {
    let origin = Origin::start().await;
    let oci = ImageBuilder::oci().layers(&[16 * KIB, 48 * KIB]).push(&origin, "harness/oci", "v1").await;
    let index = ImageBuilder::oci().layers(&[16 * KIB]).multi_arch().push(&origin, "harness/index", "v1").await;
    let schema2 = ImageBuilder::docker_schema2().layers(&[16 * KIB]).push(&origin, "harness/schema2", "v1").await;

    assert_eq!(oci.media_type, common::image::OCI_MANIFEST);
    assert_eq!(index.media_type, common::image::OCI_INDEX);
    assert_eq!(index.manifests.len(), 2, "index entries: {:?}", index.manifests);
    assert_eq!(schema2.media_type, common::image::DOCKER_MANIFEST);

    for (image, all) in [(&oci, false), (&index, true), (&schema2, false)] {
        let mark = origin.log_mark().await;
        let pulled = skopeo::pull(&origin.image_ref(&image.reference()), all)
            .await
            .unwrap_or_else(|e| panic!("pulling {} straight from the origin: {e}", image.reference()));
        assert_eq!(pulled.manifest_digest, image.digest, "{}", image.reference());
        assert_eq!(pulled.blob_digests(), image.blob_digests(), "{}", image.reference());
        assert_eq!(pulled.child_manifest_digests, image.child_manifest_digests());
        let requests = origin.requests_since(&mark).await;
        assert_eq!(
            requests.blob_gets(),
            image.blobs().len(),
            "one origin GET per blob of {}:\n{requests}",
            image.reference()
        );
    }

    let raw = skopeo::inspect_raw(&origin.image_ref(&index.reference()))
        .await
        .unwrap_or_else(|e| panic!("inspecting the index: {e}"));
    assert_eq!(common::origin::sha256_digest(&raw), index.digest);
}

#[tokio::test]
async fn token_origin_lets_anyone_pull_public_and_only_users_pull_private() {
    let credentials = Credentials::new("larder", "s3cret");
    let origin = Origin::with_token_auth(credentials.clone()).await;
    let public = ImageBuilder::oci().layers(&[16 * KIB]).push(&origin, "public/app", "v1").await;
    let private = ImageBuilder::oci().layers(&[16 * KIB]).push(&origin, "private/app", "v1").await;
    let tokens = origin.token_server();
    assert!(tokens.requests().iter().all(|r| r.credentials_valid), "pushes authenticate: {:#?}", tokens.requests());

    let mark = tokens.mark();
    let pulled = skopeo::pull(&origin.image_ref(&public.reference()), false)
        .await
        .unwrap_or_else(|e| panic!("anonymous pull of the public image: {e}"));
    assert_eq!(pulled.manifest_digest, public.digest);
    let anonymous = tokens.requests_since(mark);
    assert!(
        !anonymous.is_empty() && anonymous.iter().all(|r| !r.carried_basic),
        "anonymous token requests only: {anonymous:#?}"
    );

    let refused = skopeo::pull(&origin.image_ref(&private.reference()), false).await;
    assert!(refused.is_err(), "an anonymous pull of private/app must fail");

    let mark = tokens.mark();
    let pulled = skopeo::Pull::new(&origin.image_ref(&private.reference()))
        .credentials(&credentials)
        .run()
        .await
        .unwrap_or_else(|e| panic!("pull of the private image with credentials: {e}"));
    assert_eq!(pulled.manifest_digest, private.digest);
    let with_basic = tokens.requests_since(mark);
    assert!(
        with_basic.iter().any(|r| r.carried_basic && r.credentials_valid && r.asks_for("private/app")),
        "a Basic-authenticated token request for private/app: {with_basic:#?}"
    );

    let wrong = skopeo::Pull::new(&origin.image_ref(&private.reference()))
        .credentials(&Credentials::new("larder", "wrong"))
        .run()
        .await;
    assert!(wrong.is_err(), "wrong credentials must not pull private/app");
}
