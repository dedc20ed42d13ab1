//! TLS for the registry listener, by rustls: the certificate is re-read
//! when its files change (no restart when cert-manager rotates it), HTTP/2
//! and HTTP/1.1 are offered by ALPN, and client certificates are required
//! when a client CA is configured.

use std::sync::{Arc, RwLock};

use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use tokio_rustls::TlsAcceptor;

use crate::config::TlsConfig;

/// The serving certificate, swapped in place when its files change.
#[derive(Debug)]
pub struct ReloadingCert {
    current: RwLock<Arc<CertifiedKey>>,
    config: TlsConfig,
    provider: Arc<CryptoProvider>,
}

impl ReloadingCert {
    fn load(config: &TlsConfig, provider: &CryptoProvider) -> Result<Arc<CertifiedKey>, String> {
        let read = |p: &std::path::Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let cert_pem = read(&config.cert)?;
        let certs: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut cert_pem.as_slice())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{}: {e}", config.cert.display()))?;
        if certs.is_empty() {
            return Err(format!("{}: no PEM certificate", config.cert.display()));
        }
        let key_pem = read(&config.key)?;
        let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut key_pem.as_slice())
            .map_err(|e| format!("{}: {e}", config.key.display()))?
            .ok_or_else(|| format!("{}: no PEM private key", config.key.display()))?;
        let signing_key =
            provider.key_provider.load_private_key(key).map_err(|e| format!("{}: {e}", config.key.display()))?;
        let certified = CertifiedKey::new(certs, signing_key);
        certified
            .keys_match()
            .map_err(|e| format!("{} does not match {}: {e}", config.key.display(), config.cert.display()))?;
        Ok(Arc::new(certified))
    }

    /// Re-reads the certificate and key; on error the current pair stays.
    pub fn reload(&self) -> Result<(), String> {
        let fresh = ReloadingCert::load(&self.config, &self.provider)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        Ok(())
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.current.read().unwrap_or_else(|p| p.into_inner())))
    }
}

/// The names of a connection's client certificate (verified against
/// `client_ca` during the handshake): its subject's common name and its
/// DNS, e-mail and URI alternative names. `None` without a certificate.
pub fn client_identity(conn: &rustls::ServerConnection) -> Option<crate::policy::ClientIdentity> {
    use x509_parser::extensions::GeneralName;
    let der = conn.peer_certificates()?.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
    let common_name = cert.subject().iter_common_name().next().and_then(|cn| cn.as_str().ok()).map(str::to_owned);
    let alt_names = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    GeneralName::DNSName(s) | GeneralName::RFC822Name(s) | GeneralName::URI(s) => Some((*s).to_owned()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    Some(crate::policy::ClientIdentity { user: None, common_name, alt_names })
}

/// The acceptor for the registry listener, and the certificate holder the
/// reloader refreshes.
pub fn acceptor(config: &TlsConfig) -> Result<(TlsAcceptor, Arc<ReloadingCert>), String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cert = Arc::new(ReloadingCert {
        current: RwLock::new(ReloadingCert::load(config, &provider)?),
        config: config.clone(),
        provider: Arc::clone(&provider),
    });
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match &config.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let pem = std::fs::read(ca).map_err(|e| format!("{}: {e}", ca.display()))?;
            let mut roots = rustls::RootCertStore::empty();
            for c in rustls_pemfile::certs(&mut pem.as_slice()) {
                roots
                    .add(c.map_err(|e| format!("{}: {e}", ca.display()))?)
                    .map_err(|e| format!("{}: {e}", ca.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
                .build()
                .map_err(|e| format!("{}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut server = builder.with_cert_resolver(Arc::clone(&cert) as Arc<dyn ResolvesServerCert>);
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok((TlsAcceptor::from(Arc::new(server)), cert))
}
