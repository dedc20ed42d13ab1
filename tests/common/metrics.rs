//! Reading larder's admin listener from a test: `/metrics` series.

use super::{Larder, http};

/// `[server]` line: the admin listener (`/metrics`) on a port the OS picks,
/// so it cannot collide with another test's; [`metric`] finds it in the log.
pub const ADMIN_LISTEN: &str = r#"admin_listen = "127.0.0.1:0""#;

/// The value of one series on larder's `/metrics` (`name{labels}` exactly
/// as larder prints it); 0 while the series has not appeared.
pub async fn metric(larder: &Larder, series: &str) -> f64 {
    let text = if admin_tls(larder) {
        any_cert::get(&format!("https://{}/metrics", admin_address(larder))).await
    } else {
        let url = format!("http://{}/metrics", admin_address(larder));
        http::client()
            .get(&url)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .unwrap_or_else(|e| panic!("GET {url}: {e}"))
            .text()
            .await
            .unwrap_or_else(|e| panic!("reading {url}: {e}"))
    };
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.rsplit_once(' '))
        .find(|(name, _)| *name == series)
        .map_or(0.0, |(_, value)| value.parse().unwrap_or_else(|e| panic!("{series} = {value:?}: {e}")))
}

/// Waits until no blob fill is in flight. A client gets a blob's last
/// byte once its digest matched, and the commit (fsyncs, rename, index
/// row) follows: a test that looks at the cache's files or index, or kills
/// larder, right after a cold GET waits for that commit first.
pub async fn wait_for_commits(larder: &Larder) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    while metric(larder, "larder_fills_in_flight").await != 0.0 {
        assert!(tokio::time::Instant::now() < deadline, "gave up waiting for the fills to commit");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// The admin address the latest start of larder logged it listens on
/// (`larder listening addr=… admin=127.0.0.1:PORT`).
pub fn admin_address(larder: &Larder) -> String {
    let log = larder.log();
    let line = log.lines().rev().find(|l| l.contains("larder listening"));
    line.and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("admin=").filter(|a| *a != "none")))
        .unwrap_or_else(|| panic!("larder logged no admin address:\n{log}"))
        .to_owned()
}

/// Whether the latest start of larder logged that its admin listener
/// speaks TLS (`admin_tls=true`: `[server.tls]` or `[admin] tls`).
pub fn admin_tls(larder: &Larder) -> bool {
    let log = larder.log();
    let line = log.lines().rev().find(|l| l.contains("larder listening"));
    line.is_some_and(|l| l.split_whitespace().any(|w| w == "admin_tls=true"))
}

/// An https GET that accepts any certificate: the harness reading its own
/// larder's metrics over TLS. Which certificate larder serves, and that
/// clients verify it, is tested where it matters (tests/admin_tls.rs).
pub mod any_cert {
    use std::sync::Arc;

    use bytes::Bytes;
    use http_body_util::{BodyExt, Empty};
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};

    #[derive(Debug)]
    struct AnyCert(Arc<rustls::crypto::CryptoProvider>);

    impl ServerCertVerifier for AnyCert {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &rustls::DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &rustls::DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }

    /// `GET url` (https): the body of a 2xx answer; panics otherwise.
    pub async fn get(url: &str) -> String {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
            .with_no_client_auth();
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .wrap_connector(tcp);
        let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(https);
        let resp = client.get(url.parse().expect("a URI")).await.unwrap_or_else(|e| panic!("GET {url}: {e:?}"));
        assert!(resp.status().is_success(), "GET {url}: {}", resp.status());
        let body = resp.into_body().collect().await.unwrap_or_else(|e| panic!("reading {url}: {e}")).to_bytes();
        String::from_utf8_lossy(&body).into_owned()
    }
}
