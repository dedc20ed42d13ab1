//! An upstream served over HTTPS with a private CA: larder trusts it only
//! through the upstream's `ca_file`, beside the built-in web PKI roots.

mod common;

use common::{ImageBuilder, KIB, Larder, Origin, TestCa, TlsFront, Upstream, http, skopeo};

fn origin_port(origin: &Origin) -> u16 {
    origin.host_port().rsplit(':').next().and_then(|p| p.parse().ok()).expect("origin port")
}

#[tokio::test(flavor = "multi_thread")]
async fn pulls_from_an_https_upstream_trusted_through_ca_file() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[64 * KIB, 96 * KIB]).push(&origin, "team/tls", "v1").await;
    let ca = TestCa::new();
    let front = TlsFront::start(&ca, origin_port(&origin)).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let ca_file = ca.write_ca(dir.path());

    let upstream =
        Upstream::new("secure.test", &front.url()).default(true).line(&format!("ca_file = \"{}\"", ca_file.display()));
    let larder = Larder::builder().upstream(upstream).start().await;

    let pulled = skopeo::pull(&larder.image_ref("team/tls:v1"), false)
        .await
        .unwrap_or_else(|e| panic!("pull over an HTTPS upstream failed: {e}\nlarder log:\n{}", larder.log()));
    assert_eq!(pulled.manifest_digest, image.digest);
    assert_eq!(pulled.blob_digests(), image.blob_digests());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_certificate_from_an_unknown_ca_is_refused_as_unavailable() {
    let origin = Origin::start().await;
    ImageBuilder::oci().layers(&[16 * KIB]).push(&origin, "team/tls", "v1").await;
    let front = TlsFront::start(&TestCa::new(), origin_port(&origin)).await;
    let larder = Larder::builder().upstream(Upstream::new("secure.test", &front.url()).default(true)).start().await;

    let mark = origin.log_mark().await;
    let resp = http::manifest_get(&http::client(), &format!("{}/v2/team/tls/manifests/v1", larder.url()))
        .send()
        .await
        .expect("larder answers");
    let status = resp.status().as_u16();
    let body: serde_json::Value = serde_json::from_slice(&resp.bytes().await.expect("body")).expect("OCI error JSON");
    assert_eq!(status, 503, "a TLS failure is an unavailable upstream, never a 404: {body}");
    assert_eq!(body["errors"][0]["code"], "UNAVAILABLE");
    assert!(origin.requests_since(&mark).await.is_empty(), "nothing got past the TLS handshake");
}
