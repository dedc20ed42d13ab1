//! Start-up order: config → store and index → upstreams → listeners; and
//! the future that serves until shutdown. The shared state itself is
//! [`crate::state::App`].

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::cache::Cache;
use crate::config::Config;
use crate::server::admin::AdminAuth;
use crate::server::client_auth::ClientAuth;
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
    #[error("listening on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
}

/// A started server: its bound address, and the future that serves it.
pub struct Started {
    pub addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    pub serve: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
}

/// Opens the cache, binds the listeners and returns the future that
/// serves until `shutdown` fires and connections have drained.
pub async fn start(config: Config, shutdown: crate::shutdown::Shutdown) -> Result<Started, StartError> {
    let cache = Cache::open(config.cache.clone())
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
                .map(|listen| AdminAuth::load(&config.admin, listen))
                .transpose()
                .map_err(StartError::AdminAuth)?;
            Ok((upstreams, tls, auth, admin_auth))
        })
    };
    let (upstreams, tls, auth, admin_auth) =
        setup.await.map_err(|e| StartError::Upstream(format!("start-up task failed: {e}")))??;
    let tls = match (tls, &config.server.tls) {
        (Some((acceptor, cert)), Some(t)) => {
            let paths = vec![t.cert.clone(), t.key.clone()];
            crate::server::reload::watch("TLS certificate", paths, shutdown.clone(), move || cert.reload());
            Some(acceptor)
        }
        _ => None,
    };
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
    let app = Arc::new(App { config, upstreams, cache, auth });
    tracing::info!(%addr, admin = ?admin_addr, cache_dir = %app.config.cache.dir.display(), "larder listening");
    let serve = {
        let grace = app.config.server.shutdown_grace;
        let api = crate::server::serve(listener, Arc::clone(&app), tls, shutdown.clone(), grace);
        let maintenance = app.cache.spawn_maintenance(shutdown.clone());
        async move {
            match admin {
                Some((admin, admin_auth)) => {
                    tokio::join!(api, crate::server::admin::serve(admin, app, admin_auth, shutdown));
                }
                None => api.await,
            }
            // Access times still in memory are written before exit.
            let _ = maintenance.await;
        }
    };
    Ok(Started { addr, admin_addr, serve: Box::pin(serve) })
}
