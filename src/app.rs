//! Start-up order: config → the cluster's tiers (shared store, peers) →
//! store and index → upstreams → listeners; and the future that serves
//! until shutdown. The shared state itself is [`crate::state::App`].

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::cache::shared::SharedStore;
use crate::cache::{Cache, Tiers};
use crate::client_auth::ClientAuth;
use crate::cluster::{PeerClient, PeerLink, Peers};
use crate::config::Config;
use crate::server::admin::AdminAuth;
use crate::server::tls::ReloadingCert;
use crate::state::App;
use crate::upstream::Upstreams;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("opening the cache in {dir}: {source}")]
    Cache { dir: String, source: crate::error::Error },
    #[error("{0}")]
    Upstream(String),
    #[error("server.tls: {0}")]
    Tls(String),
    #[error("server.auth: {0}")]
    Auth(String),
    #[error("admin.token_file: {0}")]
    AdminAuth(String),
    #[error("admin.tls: {0}")]
    AdminTls(String),
    #[error("shared: {0}")]
    Shared(String),
    #[error("cluster: {0}")]
    Cluster(String),
    #[error("listening on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
}

/// A started server: its bound address, and the future that serves it.
pub struct Started {
    pub addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    pub peer_addr: Option<SocketAddr>,
    pub serve: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
}

/// Opens the cache, binds the listeners and returns the future that
/// serves until `shutdown` fires and connections have drained.
pub async fn start(config: Config, shutdown: crate::shutdown::Shutdown) -> Result<Started, StartError> {
    // The shared store makes no request until used; a peer set resolves
    // its members in the background. Neither is needed to start serving.
    let shared = match &config.shared {
        Some(c) => Some(Arc::new(SharedStore::new(c).map_err(|e| StartError::Shared(e.to_string()))?)),
        None => None,
    };
    let peers = match &config.cluster {
        Some(c) => {
            let cluster = c.clone();
            let client = tokio::task::spawn_blocking(move || PeerClient::new(&cluster))
                .await
                .map_err(|e| StartError::Cluster(format!("start-up task failed: {e}")))?
                .map_err(StartError::Cluster)?;
            let peers = Peers::new(c);
            peers.spawn(shutdown.clone());
            Some(PeerLink { peers, client })
        }
        None => None,
    };
    if let (Some(store), Some(max_age)) = (&shared, config.shared.as_ref().and_then(|c| c.max_age)) {
        store.spawn_sweeper(max_age, peers.as_ref().map(|l| Arc::clone(&l.peers)), shutdown.clone());
    }
    let cache = Cache::open_with(config.cache.clone(), Tiers { shared, peers })
        .await
        .map_err(|source| StartError::Cache { dir: config.cache.dir.display().to_string(), source })?;
    // Reading CA files, the certificate and the htpasswd file is blocking
    // file I/O: done on the blocking pool like every other.
    let setup = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || -> Result<_, StartError> {
            let upstreams = Upstreams::new(&config).map_err(StartError::Upstream)?;
            let tls =
                config.server.tls.as_ref().map(crate::server::tls::acceptor).transpose().map_err(StartError::Tls)?;
            let auth = config.server.auth.as_ref().map(ClientAuth::load).transpose().map_err(StartError::Auth)?;
            let admin_auth = config
                .server
                .admin_listen
                .map(|listen| AdminAuth::load(&config.admin, listen, &config.cache.dir))
                .transpose()
                .map_err(StartError::AdminAuth)?;
            // The admin listener's certificate ([admin] tls): never asks
            // for client certificates (Prometheus, the kubelet have none).
            let admin_tls = match (&config.server.admin_listen, &config.admin.tls) {
                (Some(_), Some(t)) => Some(crate::server::tls::acceptor(t).map_err(StartError::AdminTls)?),
                _ => None,
            };
            // https peers are served with the registry certificate, but
            // never asked for a client certificate: the secret is theirs.
            let peer_tls = match (&config.cluster, &config.server.tls) {
                (Some(cluster), Some(t)) if cluster.self_url.is_https() => {
                    let t = crate::config::TlsConfig { client_ca: None, ..t.clone() };
                    Some(crate::server::tls::acceptor(&t).map_err(StartError::Tls)?)
                }
                _ => None,
            };
            Ok((upstreams, tls, auth, admin_auth, admin_tls, peer_tls))
        })
    };
    let (upstreams, tls, auth, admin_auth, admin_tls, peer_tls) =
        setup.await.map_err(|e| StartError::Upstream(format!("start-up task failed: {e}")))??;
    // Each acceptor's certificate is re-read when its files change.
    let reloading = |what: &'static str, tls: Option<(TlsAcceptor, Arc<ReloadingCert>)>| {
        let (acceptor, cert) = tls?;
        let t = config.server.tls.as_ref()?;
        let paths = vec![t.cert.clone(), t.key.clone()];
        crate::server::reload::watch(what, paths, shutdown.clone(), move || cert.reload());
        Some(acceptor)
    };
    let tls = reloading("TLS certificate", tls);
    let peer_tls = reloading("peer TLS certificate", peer_tls);
    // The admin certificate may be its own: its files are watched.
    let admin_tls = admin_tls.zip(config.admin.tls.as_ref()).map(|((acceptor, cert), t)| {
        let paths = vec![t.cert.clone(), t.key.clone()];
        crate::server::reload::watch("admin TLS certificate", paths, shutdown.clone(), move || cert.reload());
        acceptor
    });
    if let Some((file, true)) = admin_auth.as_ref().and_then(|a| a.token_file()) {
        tracing::info!(
            path = %file.path().display(),
            "no [admin] token_file: POST /prefetch and /purge need the token written to this file (mode 0600, new \
             at each start); larder prefetch/purge --config read it"
        );
    }
    if let Some(auth) = &auth {
        let watched = Arc::clone(auth);
        crate::server::reload::watch("htpasswd", vec![auth.path()], shutdown.clone(), move || watched.reload());
    }
    let listener = TcpListener::bind(config.server.listen)
        .await
        .map_err(|source| StartError::Listen { addr: config.server.listen, source })?;
    let addr = listener.local_addr().map_err(|source| StartError::Listen { addr: config.server.listen, source })?;
    let admin = match config.server.admin_listen {
        Some(admin_addr) => Some(
            TcpListener::bind(admin_addr).await.map_err(|source| StartError::Listen { addr: admin_addr, source })?,
        ),
        None => None,
    };
    let admin_addr = admin.as_ref().and_then(|l| l.local_addr().ok());
    let admin = admin.zip(admin_auth);
    let peer_listener = match &config.cluster {
        Some(c) => {
            Some(TcpListener::bind(c.listen).await.map_err(|source| StartError::Listen { addr: c.listen, source })?)
        }
        None => None,
    };
    let peer_addr = peer_listener.as_ref().and_then(|l| l.local_addr().ok());
    // The warm images' digests are pinned before the maintenance task
    // could evict anything (and pinned content over the limits is logged).
    let warm = crate::warm::Warm::new(&config, Arc::clone(&cache), &upstreams);
    if let Err(e) = warm.load().await {
        tracing::warn!(error = %e, "reading the warm images' digests failed; they are pinned after their first check");
    }
    let app = Arc::new(App { config, upstreams, cache, auth, warm });
    // Addresses as an operator writes them; `none` for a listener not configured.
    let or_none = |a: Option<std::net::SocketAddr>| a.map_or_else(|| "none".to_owned(), |a| a.to_string());
    tracing::info!(
        %addr,
        admin = %or_none(admin_addr),
        admin_tls = admin_tls.is_some(),
        peers = %or_none(peer_addr),
        shared = app.config.shared.is_some(),
        cache_dir = %app.config.cache.dir.display(),
        "larder listening"
    );
    let serve = {
        let grace = app.config.server.shutdown_grace;
        let api = crate::server::serve(listener, Arc::clone(&app), tls, shutdown.clone(), grace);
        let maintenance = app.cache.spawn_maintenance(shutdown.clone());
        app.warm.spawn(shutdown.clone());
        let peer = peer_listener.map(|l| crate::server::peer::serve(l, Arc::clone(&app), peer_tls, shutdown.clone()));
        async move {
            let peer = async move {
                if let Some(peer) = peer {
                    peer.await;
                }
            };
            match admin {
                Some((admin, admin_auth)) => {
                    let admin = crate::server::admin::serve(admin, app, admin_auth, admin_tls, shutdown);
                    tokio::join!(api, peer, admin);
                }
                None => {
                    tokio::join!(api, peer);
                }
            }
            // Access times still in memory are written before exit.
            let _ = maintenance.await;
        }
    };
    Ok(Started { addr, admin_addr, peer_addr, serve: Box::pin(serve) })
}
