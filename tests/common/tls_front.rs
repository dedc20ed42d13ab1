//! A TLS front for a plain-HTTP peer: terminates TLS with a certificate
//! from a test CA and pipes the bytes to the peer. It lets a test put the
//! real origin behind HTTPS and give larder the CA as `ca_file`. No ALPN is
//! offered, so clients speak HTTP/1.1 through it, which the origin serves.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A test certificate authority and a server certificate for 127.0.0.1.
pub struct TestCa {
    pub ca_pem: String,
    pub leaf_pem: String,
    pub leaf_key_pem: String,
    pub leaf_der: CertificateDer<'static>,
    leaf_key_der: Vec<u8>,
    /// A client certificate (TLS client auth) from the same CA, and its key.
    pub client_pem: String,
    pub client_key_pem: String,
}

impl TestCa {
    pub fn new() -> TestCa {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "larder test CA");
        let ca = ca_params.self_signed(&ca_key).expect("self-sign the CA");
        let leaf_key = KeyPair::generate().expect("leaf key");
        let leaf_params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).expect("leaf params");
        let leaf = leaf_params.signed_by(&leaf_key, &ca, &ca_key).expect("sign the leaf");
        let client_key = KeyPair::generate().expect("client key");
        let mut client_params = CertificateParams::new(Vec::<String>::new()).expect("client params");
        client_params.distinguished_name.push(DnType::CommonName, "larder test client");
        client_params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let client = client_params.signed_by(&client_key, &ca, &ca_key).expect("sign the client certificate");
        TestCa {
            ca_pem: ca.pem(),
            leaf_pem: leaf.pem(),
            leaf_key_pem: leaf_key.serialize_pem(),
            leaf_der: leaf.der().clone(),
            leaf_key_der: leaf_key.serialize_der(),
            client_pem: client.pem(),
            client_key_pem: client_key.serialize_pem(),
        }
    }

    /// Writes the server certificate and key (PEM) as `tls.crt` and
    /// `tls.key` in `dir`, replacing them atomically (as a rotation does).
    pub fn write_leaf(&self, dir: &Path) -> (PathBuf, PathBuf) {
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        for (path, pem) in [(&cert, &self.leaf_pem), (&key, &self.leaf_key_pem)] {
            let tmp = path.with_extension("new");
            std::fs::write(&tmp, pem).expect("write PEM");
            std::fs::rename(&tmp, path).expect("rename PEM into place");
        }
        (cert, key)
    }

    /// Writes the CA certificate (PEM) into `dir` and returns its path.
    pub fn write_ca(&self, dir: &Path) -> PathBuf {
        let path = dir.join("test-ca.pem");
        std::fs::write(&path, &self.ca_pem).expect("write CA file");
        path
    }
}

/// A running TLS front; its task stops with the test's runtime.
pub struct TlsFront {
    pub port: u16,
}

impl TlsFront {
    /// Listens on 127.0.0.1 and forwards every connection to `127.0.0.1:backend_port`.
    pub async fn start(ca: &TestCa, backend_port: u16) -> TlsFront {
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ca.leaf_key_der.clone()));
        let config =
            ServerConfig::builder_with_provider(Arc::new(tokio_rustls::rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("TLS versions")
                .with_no_client_auth()
                .with_single_cert(vec![ca.leaf_der.clone()], key)
                .expect("server certificate");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind TLS front");
        let port = listener.local_addr().expect("local addr").port();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                    let Ok(mut backend) = TcpStream::connect(("127.0.0.1", backend_port)).await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut backend).await;
                });
            }
        });
        TlsFront { port }
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }
}
