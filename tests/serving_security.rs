//! larder's own listener: TLS (verified by the client, certificate rotated
//! without a restart) and client authentication with an htpasswd file.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Credentials, ImageBuilder, KIB, Larder, Origin, Pull, TestCa, http, skopeo};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

/// Longest wait for a rotated certificate to be served (larder polls every 2 s).
const ROTATION_WAIT: Duration = Duration::from_secs(20);

/// Handshakes with larder, trusting `cas`, and returns the certificate it served.
async fn served_certificate(port: u16, cas: &[&TestCa]) -> CertificateDer<'static> {
    let mut roots = RootCertStore::empty();
    for ca in cas {
        for cert in rustls_pemfile::certs(&mut ca.ca_pem.as_bytes()) {
            roots.add(cert.expect("CA PEM")).expect("add CA");
        }
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let name = ServerName::try_from("127.0.0.1").expect("server name");
    let tls = TlsConnector::from(Arc::new(config)).connect(name, tcp).await.expect("TLS handshake");
    tls.get_ref().1.peer_certificates().expect("a certificate")[0].clone().into_owned()
}

/// `skopeo copy` over verified HTTPS, trusting only `ca`.
async fn pull_verified(larder: &Larder, ca: &TestCa, image: &str) -> Result<Vec<u8>, skopeo::SkopeoError> {
    pull_verified_as(larder, ca, None, image).await
}

/// The same, presenting `client` (a certificate and its key) when given.
async fn pull_verified_as(
    larder: &Larder,
    ca: &TestCa,
    client: Option<&TestCa>,
    image: &str,
) -> Result<Vec<u8>, skopeo::SkopeoError> {
    let certs = tempfile::tempdir().expect("cert dir");
    std::fs::write(certs.path().join("ca.crt"), &ca.ca_pem).expect("write ca.crt");
    if let Some(client) = client {
        // containers/image: `<name>.cert` with `<name>.key` in the cert dir.
        std::fs::write(certs.path().join("client.cert"), &client.client_pem).expect("write client.cert");
        std::fs::write(certs.path().join("client.key"), &client.client_key_pem).expect("write client.key");
    }
    let out = tempfile::tempdir().expect("out dir");
    let args = [
        "copy".to_owned(),
        "--src-cert-dir".to_owned(),
        certs.path().display().to_string(),
        larder.image_ref(image),
        format!("dir:{}", out.path().display()),
    ];
    skopeo::run(&args).await?;
    Ok(std::fs::read(out.path().join("manifest.json")).expect("manifest.json"))
}

#[tokio::test(flavor = "multi_thread")]
async fn skopeo_pulls_over_verified_https_and_a_rotated_certificate_needs_no_restart() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[32 * KIB]).push(&origin, "team/tls", "v1").await;
    let dir = tempfile::tempdir().expect("tls dir");
    let first = TestCa::new();
    let (cert, key) = first.write_leaf(dir.path());
    let larder = Larder::builder()
        .upstream(&origin)
        .server_line(&format!("tls = {{ cert = \"{}\", key = \"{}\" }}", cert.display(), key.display()))
        .ready_on_tcp()
        .start()
        .await;

    let manifest = pull_verified(&larder, &first, "team/tls:v1").await.expect("pull over HTTPS");
    assert_eq!(common::origin::sha256_digest(&manifest), image.digest);
    assert_eq!(served_certificate(larder.port(), &[&first]).await, first.leaf_der);

    // cert-manager style rotation: new files in place, same paths.
    let second = TestCa::new();
    second.write_leaf(dir.path());
    let deadline = Instant::now() + ROTATION_WAIT;
    while served_certificate(larder.port(), &[&first, &second]).await != second.leaf_der {
        assert!(Instant::now() < deadline, "the rotated certificate was not served within {ROTATION_WAIT:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    pull_verified(&larder, &second, "team/tls:v1").await.expect("pull with the rotated certificate");
    assert!(pull_verified(&larder, &first, "team/tls:v1").await.is_err(), "the old CA no longer verifies it");
}

#[tokio::test(flavor = "multi_thread")]
async fn htpasswd_users_must_authenticate() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[16 * KIB]).push(&origin, "team/auth", "v1").await;
    let dir = tempfile::tempdir().expect("auth dir");
    let htpasswd = dir.path().join("htpasswd");
    std::fs::write(&htpasswd, format!("puller:{}\n", bcrypt::hash("s3cret", 4).expect("bcrypt"))).expect("htpasswd");
    let larder = Larder::builder()
        .upstream(&origin)
        .server_line(&format!("auth = {{ htpasswd = \"{}\" }}", htpasswd.display()))
        .ready_on_tcp()
        .start()
        .await;

    // The version check is challenged, with the OCI envelope.
    let resp = http::client().get(format!("{}/v2/", larder.url())).send().await.expect("larder answers");
    assert_eq!(resp.status(), 401);
    assert_eq!(resp.headers()["www-authenticate"], "Basic realm=\"larder\"");
    let body: serde_json::Value = serde_json::from_slice(&resp.bytes().await.expect("body")).expect("JSON");
    assert_eq!(body["errors"][0]["code"], "UNAUTHORIZED");

    let source = larder.image_ref("team/auth:v1");
    assert!(skopeo::pull(&source, false).await.is_err(), "no credentials");
    let wrong = Pull::new(&source).credentials(&Credentials::new("puller", "wrong")).run().await;
    assert!(wrong.is_err(), "wrong password");
    let pulled = Pull::new(&source)
        .credentials(&Credentials::new("puller", "s3cret"))
        .run()
        .await
        .unwrap_or_else(|e| panic!("pull with credentials: {e}\n{}", larder.log()));
    assert_eq!(pulled.manifest_digest, image.digest);
}

#[tokio::test(flavor = "multi_thread")]
async fn client_certificates_are_required_when_a_client_ca_is_configured() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[16 * KIB]).push(&origin, "team/mtls", "v1").await;
    let dir = tempfile::tempdir().expect("tls dir");
    let server = TestCa::new();
    let (cert, key) = server.write_leaf(dir.path());
    let clients = TestCa::new();
    let client_ca = dir.path().join("clients-ca.pem");
    std::fs::write(&client_ca, &clients.ca_pem).expect("client CA");
    let larder = Larder::builder()
        .upstream(&origin)
        .server_line(&format!(
            "tls = {{ cert = \"{}\", key = \"{}\", client_ca = \"{}\" }}",
            cert.display(),
            key.display(),
            client_ca.display()
        ))
        .ready_on_tcp()
        .start()
        .await;

    assert!(pull_verified(&larder, &server, "team/mtls:v1").await.is_err(), "no client certificate");
    let strangers = TestCa::new();
    assert!(
        pull_verified_as(&larder, &server, Some(&strangers), "team/mtls:v1").await.is_err(),
        "a client certificate from another CA"
    );
    let manifest = pull_verified_as(&larder, &server, Some(&clients), "team/mtls:v1")
        .await
        .unwrap_or_else(|e| panic!("pull with a client certificate: {e}\n{}", larder.log()));
    assert_eq!(common::origin::sha256_digest(&manifest), image.digest);
}
