//! The admin listener over TLS (issue 23, item 9): with `[server.tls]` it
//! serves the same certificate (re-read when rotated), so the bearer token
//! never crosses the network in the clear; plain HTTP gets no answer. The
//! operator commands reach it with `--admin https://…` and `--ca-file`,
//! or with `--config`, which trusts larder's own certificate as it is.
//! `[admin] tls = "off"` keeps it plain; `[admin] tls = { cert, key }`
//! gives it a certificate of its own.

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::admin::{stderr, stdout};
use common::{Admin, ImageBuilder, KIB, Larder, ORIGIN_NAME, Origin, TestCa, http};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

const TOKEN: &str = "tls-admin-token-8e41c07b5d";
/// Longest wait for a rotated certificate to be served (larder looks every 2 s).
const ROTATION_WAIT: Duration = Duration::from_secs(20);

fn client_config(cas: &[&TestCa]) -> ClientConfig {
    let mut roots = RootCertStore::empty();
    for ca in cas {
        for cert in rustls_pemfile::certs(&mut ca.ca_pem.as_bytes()) {
            roots.add(cert.expect("CA PEM")).expect("add CA");
        }
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// `GET https://127.0.0.1:<port><path>`, verifying the certificate
/// against `ca` under the name 127.0.0.1: the status and the body.
async fn https_get(port: u16, path: &str, ca: &TestCa) -> (u16, String) {
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(client_config(&[ca]))
        .https_only()
        .enable_http1()
        .wrap_connector(tcp);
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(https);
    let url = format!("https://127.0.0.1:{port}{path}");
    let resp = client.get(url.parse().expect("a URI")).await.unwrap_or_else(|e| panic!("GET {url}: {e:?}"));
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("the body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Handshakes with 127.0.0.1:`port`, trusting `cas`, and returns the certificate it served.
async fn served_certificate(port: u16, cas: &[&TestCa]) -> CertificateDer<'static> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let name = ServerName::try_from("127.0.0.1").expect("server name");
    let tls = TlsConnector::from(Arc::new(client_config(cas))).connect(name, tcp).await.expect("TLS handshake");
    tls.get_ref().1.peer_certificates().expect("a certificate")[0].clone().into_owned()
}

/// `larder ARGS` with no `LARDER_ADMIN*` from the environment.
fn cli(args: &[&str]) -> Output {
    Command::new(common::larder::binary())
        .args(args)
        .env_remove("LARDER_ADMIN")
        .env_remove("LARDER_ADMIN_TOKEN")
        .env_remove("LARDER_ADMIN_TOKEN_FILE")
        .env_remove("LARDER_ADMIN_CA_FILE")
        .env_remove("LARDER_ADMIN_TLS_NAME")
        .output()
        .expect("run larder")
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn with_server_tls_the_admin_listener_speaks_tls_and_the_cli_reaches_it() {
    let origin = Origin::start().await;
    ImageBuilder::oci().layers(&[32 * KIB]).push(&origin, "team/app", "v1").await;
    let dir = tempfile::tempdir().expect("tls dir");
    let ca = TestCa::new();
    let (cert, key) = ca.write_leaf(dir.path());
    let ca_file = ca.write_ca(dir.path());
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let larder = builder
        .server_line(&format!("tls = {{ cert = \"{}\", key = \"{}\" }}", cert.display(), key.display()))
        .ready_on_tcp()
        .start()
        .await;

    // /metrics over verified https, with the registry's certificate.
    let (status, metrics) = https_get(admin.port, "/metrics", &ca).await;
    assert_eq!(status, 200);
    assert!(metrics.contains("larder_ready"), "{metrics}");
    assert_eq!(served_certificate(admin.port, &[&ca]).await, ca.leaf_der, "the [server.tls] certificate");
    assert_eq!(https_get(admin.port, "/readyz", &ca).await.0, 200, "probes over https");

    // Plain HTTP gets no answer at all.
    let plain = http::client().get(format!("{}/metrics", admin.url())).send().await;
    assert!(plain.is_err(), "plain HTTP must not be served: {plain:?}");

    // The CLI: https with --ca-file (verified under 127.0.0.1) and the token.
    let url = format!("https://127.0.0.1:{}", admin.port);
    let out = cli(&["status", "--admin", &url, "--ca-file", &path(&ca_file)]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains(&format!("at {url}")), "{}", stdout(&out));
    let token = path(&admin.token_file());
    let purge = ["purge", ORIGIN_NAME, "--admin", &url, "--ca-file", &path(&ca_file), "--token-file", &token];
    let out = cli(&purge);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    // Nothing was pulled through this larder: the purge says so.
    assert_eq!(stdout(&out), format!("nothing cached for {ORIGIN_NAME}: nothing purged here\n"));

    // --tls-name: verified under another name the certificate carries (as through a
    // port-forward to the Service); a name it does not carry fails.
    let out = cli(&["status", "--admin", &url, "--ca-file", &path(&ca_file), "--tls-name", "localhost"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let out = cli(&["status", "--admin", &url, "--ca-file", &path(&ca_file), "--tls-name", "other.example"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));

    // Without trust in the certificate, the CLI refuses to talk (and says why).
    let out = cli(&["status", "--admin", &url]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("cannot reach the admin listener"), "{}", stderr(&out));
    assert!(stderr(&out).to_lowercase().contains("certificate"), "{}", stderr(&out));
    assert!(stderr(&out).contains("\n  its certificate is not trusted: pass --ca-file"), "{}", stderr(&out));
    // Plain http:// against it: the error suggests https.
    let out = cli(&["status", "--admin", &admin.url()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("\n  if the admin listener speaks TLS"), "{}", stderr(&out));

    // With --config: https, larder's own certificate trusted as it is, the token from [admin] token_file.
    let config = path(larder.config_path());
    let out = cli(&["status", "--config", &config]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let out = cli(&["prefetch", "team/app:v1", "--config", &config]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let out = cli(&["purge", ORIGIN_NAME, "team/app", "--config", &config]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains(", 2 blobs, "), "the prefetched image was purged: {}", stdout(&out));

    // A rotated certificate is served without a restart, and --config follows it.
    let next = TestCa::new();
    next.write_leaf(dir.path());
    let started = Instant::now();
    while served_certificate(admin.port, &[&ca, &next]).await != next.leaf_der {
        assert!(started.elapsed() < ROTATION_WAIT, "the rotated certificate was not served");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let out = cli(&["status", "--config", &config]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let stale = cli(&["status", "--admin", &url, "--ca-file", &path(&ca_file)]);
    assert_eq!(stale.status.code(), Some(1), "the old CA no longer verifies it");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_admin_listener_can_stay_plain_or_have_its_own_certificate() {
    let origin = Origin::start().await;
    let dir = tempfile::tempdir().expect("tls dir");
    let registry = TestCa::new();
    let (cert, key) = registry.write_leaf(dir.path());

    // [admin] tls = "off": plain HTTP even though the registry port is TLS.
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let builder = builder
        .server_line(&format!("tls = {{ cert = \"{}\", key = \"{}\" }}", cert.display(), key.display()))
        .append_toml("tls = \"off\"")
        .ready_on_tcp();
    // check-config says what that means.
    let check = builder.check_config();
    assert!(stdout(&check).contains("plain HTTP although [server.tls] is set"), "{}", stdout(&check));
    let _plain = builder.start().await;
    let resp = http::client().get(format!("{}/metrics", admin.url())).send().await.expect("plain HTTP");
    assert_eq!(resp.status(), 200);

    // [admin] tls = { cert, key }: its own certificate, without any [server.tls].
    let own = TestCa::new();
    let own_dir = tempfile::tempdir().expect("own tls dir");
    let (own_cert, own_key) = own.write_leaf(own_dir.path());
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let larder = builder
        .append_toml(&format!("tls = {{ cert = \"{}\", key = \"{}\" }}", own_cert.display(), own_key.display()))
        .start()
        .await;
    assert_eq!(served_certificate(admin.port, &[&own]).await, own.leaf_der);
    assert_eq!(https_get(admin.port, "/healthz", &own).await.0, 200);
    let out = cli(&["status", "--config", &path(larder.config_path())]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
}
