//! Peers over TLS as on Kubernetes: replicas address each other by IP
//! (here 127.0.0.1, there the pod IPs `peers_dns` finds), and their one
//! certificate names Services only, never an IP. `[cluster] tls_name`
//! verifies every peer under the peers' Service name.
//!
//! What it shows: with `tls_name`, a pull through a replica that does not
//! own the blob is served by the owner over TLS (one origin GET, the peer
//! request counted on both sides); an owner whose certificate lacks that
//! name is refused before it sees a request (so it never gets the secret)
//! and the asker fetches the blob itself, counting the owner unreachable;
//! without `tls_name` the same certificates fail against the peers' IPs,
//! which is why the option exists.

mod common;
mod fake;

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_rustls::{FixedServerNameResolver, HttpsConnector};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use larder::cluster::ring::Ring;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use tempfile::TempDir;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

use common::metrics::{ADMIN_LISTEN, metric};
use common::{Larder, Upstream, free_port};
use fake::{FakeUpstream, KIB, UPSTREAM_NAME, blob_path, digest, random_bytes};

/// The client-facing Service's name: on every certificate, so clients reach
/// each replica's registry listener.
const SERVICE: &str = "larder.mirror.svc";
/// The peers' headless Service: the `tls_name` peers are verified under.
const PEERS: &str = "larder-peers.mirror.svc";
/// What a right certificate names: both Services.
const RIGHT: &[&str] = &[SERVICE, PEERS];

const PEER_OK: &str = "larder_peer_requests_total{direction=\"out\",kind=\"blob\",result=\"ok\"}";
const PEER_UNREACHABLE: &str = "larder_peer_requests_total{direction=\"out\",kind=\"blob\",result=\"unreachable\"}";
const SERVED_TO_PEER: &str = "larder_peer_requests_total{direction=\"in\",kind=\"blob\",result=\"ok\"}";
const REFUSED_PEER: &str = "larder_peer_requests_total{direction=\"in\",kind=\"blob\",result=\"refused\"}";

#[tokio::test(flavor = "multi_thread")]
async fn a_non_owner_is_served_by_the_owner_over_tls_verified_under_the_fixed_name() {
    let ca = Ca::new();
    let (blobs, up) = blobs_and_upstream(24).await;
    let cluster = TlsCluster::start(&ca, &up, Some(PEERS), &[RIGHT; 3]).await;

    // Through replica 0, one blob owned by each replica.
    let picked: Vec<&Bytes> = (0..3).map(|i| cluster.first_owned_by(i, &blobs)).collect();
    let client = TlsClient::new(&ca);
    for blob in &picked {
        let (status, body) = client.get(&cluster.replicas[0], &blob_path(&digest(blob))).await;
        assert_eq!(status, 200);
        assert!(body == **blob, "the blob's exact bytes");
    }
    for blob in &picked {
        assert_eq!(up.blob_gets(&digest(blob)), 1, "one origin GET, by the blob's owner");
    }
    let asker = &cluster.replicas[0];
    assert_eq!(metric(asker, PEER_OK).await, 2.0, "the two blobs replicas 1 and 2 own came from them");
    assert_eq!(metric(asker, PEER_UNREACHABLE).await, 0.0);
    for owner in &cluster.replicas[1..] {
        assert_eq!(metric(owner, SERVED_TO_PEER).await, 1.0, "each owner served its blob to a peer, over TLS");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_owner_whose_certificate_lacks_the_name_is_refused_and_the_asker_fetches_itself() {
    let ca = Ca::new();
    let (blobs, up) = blobs_and_upstream(24).await;
    // Replica 1's certificate, from the same CA, names the client Service
    // and another name, not the peers' one: the SAN an operator forgot.
    let cluster = TlsCluster::start(&ca, &up, Some(PEERS), &[RIGHT, &[SERVICE, "other.mirror.svc"]]).await;
    let (asker, impostor) = (&cluster.replicas[0], &cluster.replicas[1]);
    let client = TlsClient::new(&ca);

    let blob = cluster.first_owned_by(1, &blobs);
    let (status, body) = client.get(asker, &blob_path(&digest(blob))).await;
    assert_eq!(status, 200, "the pull goes on without the owner");
    assert!(body == *blob, "the blob's exact bytes");
    assert_eq!(up.blob_gets(&digest(blob)), 1, "fetched from the origin once, by the asker itself");
    assert_eq!(metric(asker, PEER_UNREACHABLE).await, 1.0, "the refused owner counts as unreachable");
    assert_eq!(metric(asker, "larder_peers_marked_down_total").await, 1.0, "and is marked down");
    assert!(asker.log().contains("invalid peer certificate"), "the asker's log says why");
    assert_eq!(
        metric(impostor, SERVED_TO_PEER).await + metric(impostor, REFUSED_PEER).await,
        0.0,
        "the handshake failed before any request, so the secret was never sent"
    );

    // The other way round the certificate is right: verified and served.
    let blob = cluster.first_owned_by(0, &blobs);
    let (status, _) = client.get(impostor, &blob_path(&digest(blob))).await;
    assert_eq!(status, 200);
    assert_eq!(metric(impostor, PEER_OK).await, 1.0, "served by its owner over TLS");
    assert_eq!(up.blob_gets(&digest(blob)), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn without_tls_name_peers_addressed_by_ip_are_refused() {
    let ca = Ca::new();
    let (blobs, up) = blobs_and_upstream(24).await;
    let cluster = TlsCluster::start(&ca, &up, None, &[RIGHT; 2]).await;
    let blob = cluster.first_owned_by(1, &blobs);
    let (status, _) = TlsClient::new(&ca).get(&cluster.replicas[0], &blob_path(&digest(blob))).await;
    assert_eq!(status, 200, "served, by the asker itself");
    assert_eq!(metric(&cluster.replicas[0], PEER_UNREACHABLE).await, 1.0, "verified against 127.0.0.1: refused");
    assert_eq!(metric(&cluster.replicas[0], PEER_OK).await, 0.0);
    assert_eq!(metric(&cluster.replicas[1], SERVED_TO_PEER).await, 0.0);
    assert!(cluster.replicas[0].log().contains("invalid peer certificate"));
}

/// `n` small distinct blobs, and a fake upstream serving them.
async fn blobs_and_upstream(n: u64) -> (Vec<Bytes>, FakeUpstream) {
    let blobs: Vec<Bytes> = (0..n).map(|seed| random_bytes(64 * KIB, 500 + seed)).collect();
    let up = blobs.iter().fold(FakeUpstream::builder(), |b, blob| b.blob(blob.clone())).start().await;
    (blobs, up)
}

/// A test CA that issues certificates for DNS names only (no IP SAN).
struct Ca {
    key: KeyPair,
    cert: rcgen::Certificate,
}

impl Ca {
    fn new() -> Ca {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, "larder peers test CA");
        let cert = params.self_signed(&key).expect("self-sign the CA");
        Ca { key, cert }
    }

    /// Writes a certificate for `names` and its key as `tls.crt` and `tls.key`.
    fn issue(&self, names: &[&str], dir: &Path) {
        let key = KeyPair::generate().expect("leaf key");
        let params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).expect("params");
        let cert = params.signed_by(&key, &self.cert, &self.key).expect("sign the leaf");
        std::fs::write(dir.join("tls.crt"), cert.pem()).expect("write tls.crt");
        std::fs::write(dir.join("tls.key"), key.serialize_pem()).expect("write tls.key");
    }

    fn write_pem(&self, path: &Path) {
        std::fs::write(path, self.cert.pem()).expect("write the CA certificate");
    }
}

/// Replicas with `https://127.0.0.1:<port>` peer URLs, each serving the
/// certificate for its entry of `names`, with the CA as `cluster.ca_file`.
struct TlsCluster {
    replicas: Vec<Larder>,
    peer_urls: Vec<String>,
    _dir: TempDir,
}

impl TlsCluster {
    async fn start(ca: &Ca, up: &FakeUpstream, tls_name: Option<&str>, names: &[&[&str]]) -> TlsCluster {
        let dir = tempfile::Builder::new().prefix("larder-cluster-tls-").tempdir().expect("a temp dir");
        std::fs::write(dir.path().join("secret"), common::cluster::SECRET).expect("write the cluster secret");
        ca.write_pem(&dir.path().join("ca.crt"));
        let ports: Vec<u16> = names.iter().map(|_| free_port()).collect();
        let peer_urls: Vec<String> = ports.iter().map(|p| format!("https://127.0.0.1:{p}")).collect();
        let peer_list: Vec<String> = peer_urls.iter().map(|u| format!("{u:?}")).collect();
        let mut replicas = Vec::new();
        for (i, (port, names)) in ports.iter().zip(names).enumerate() {
            let certs = dir.path().join(format!("replica-{i}"));
            std::fs::create_dir(&certs).expect("a cert dir");
            ca.issue(names, &certs);
            let path = |file: &str| format!("{:?}", certs.join(file).display().to_string());
            let mut table = String::from("[cluster]\n");
            let _ = writeln!(table, "listen = \"127.0.0.1:{port}\"");
            let _ = writeln!(table, "self = {:?}", peer_urls[i]);
            let _ = writeln!(table, "peers = [{}]", peer_list.join(", "));
            let _ = writeln!(table, "secret_file = {:?}", dir.path().join("secret").display().to_string());
            let _ = writeln!(table, "ca_file = {:?}", dir.path().join("ca.crt").display().to_string());
            if let Some(name) = tls_name {
                let _ = writeln!(table, "tls_name = {name:?}");
            }
            let replica = Larder::builder()
                .upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true))
                .server_line(ADMIN_LISTEN)
                .server_line(&format!("tls = {{ cert = {}, key = {} }}", path("tls.crt"), path("tls.key")))
                .ready_on_tcp()
                .append_toml(&table)
                .start()
                .await;
            replicas.push(replica);
        }
        TlsCluster { replicas, peer_urls, _dir: dir }
    }

    /// The first of `blobs` whose owner is replica `i`.
    fn first_owned_by<'a>(&self, i: usize, blobs: &'a [Bytes]) -> &'a Bytes {
        let ring = Ring::new(self.peer_urls.iter().map(String::as_str));
        blobs
            .iter()
            .find(|b| ring.owner(&digest(b)) == Some(&self.peer_urls[i].as_str()))
            .unwrap_or_else(|| panic!("no blob of {} is owned by replica {i}", blobs.len()))
    }
}

/// An https client for the registry listeners: trusts the CA and verifies
/// every replica as the client Service ([`SERVICE`]), as a client inside
/// the cluster would, while connecting to 127.0.0.1.
struct TlsClient {
    http: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

impl TlsClient {
    fn new(ca: &Ca) -> TlsClient {
        let mut roots = RootCertStore::empty();
        roots.add(CertificateDer::from(ca.cert.der().to_vec())).expect("the CA as a root");
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let tls = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = ServerName::try_from(SERVICE).expect("a DNS name");
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .with_server_name_resolver(FixedServerNameResolver::new(name))
            .enable_http1()
            .wrap_connector(tcp);
        TlsClient { http: Client::builder(TokioExecutor::new()).build(https) }
    }

    /// `GET https://<replica>/<path>`: the status and the whole body.
    async fn get(&self, replica: &Larder, path: &str) -> (u16, Bytes) {
        let uri = format!("https://{}{path}", replica.host_port());
        let resp = self.http.get(uri.parse().expect("a URI")).await.unwrap_or_else(|e| panic!("GET {uri}: {e:?}"));
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap_or_else(|e| panic!("reading {uri}: {e}")).to_bytes();
        (status, body)
    }
}
