//! Set-up shared by the benchmarks: a runtime, and an `App` whose memory
//! tier holds one manifest fetched from a real (in-process) upstream.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Uri};
use http_body_util::Full;
use larder::cache::Cache;
use larder::config::Config;
use larder::oci::{Digest, Reference};
use larder::server::routes;
use larder::state::App;
use larder::upstream::Upstreams;

pub const CHUNK: usize = 256 << 10;
pub const BLOB: usize = 8 << 20;

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// A one-manifest upstream on loopback; returns its URL.
async fn manifest_upstream(manifest: Bytes) -> String {
    let digest = Digest::of(&manifest).to_string();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (manifest, digest) = (manifest.clone(), digest.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |_req| {
                    let resp = http::Response::builder()
                        .header("content-type", "application/vnd.oci.image.manifest.v1+json")
                        .header("docker-content-digest", digest.as_str())
                        .body(Full::new(manifest.clone()))
                        .expect("response");
                    async move { Ok::<_, Infallible>(resp) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
            });
        }
    });
    url
}

/// An `App` over a cache in `dir` with one upstream serving one small OCI
/// manifest as `team/app:v1`; returns the app and the manifest's digest.
pub async fn manifest_app(dir: &std::path::Path) -> (Arc<App>, Digest) {
    let manifest = Bytes::from(format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{}","size":2}},"layers":[]}}"#,
        Digest::of(b"{}")
    ));
    let digest = Digest::of(&manifest);
    let url = manifest_upstream(manifest).await;
    let text = format!(
        "[cache]\ndir = \"{}\"\n[[upstream]]\nname = \"bench.test\"\nurl = \"{url}\"\ndefault = true\n",
        dir.display()
    );
    let config = Config::parse(&text, "bench.toml", None).expect("config");
    let upstreams = Upstreams::new(&config).expect("upstreams");
    let cache = Cache::open(config.cache.clone()).await.expect("cache");
    let warm = larder::warm::Warm::new(&config, Arc::clone(&cache), &upstreams);
    (Arc::new(App { config, upstreams, cache, auth: None, warm }), digest)
}

/// The parsed route and reference of a manifest GET for `path`.
pub fn manifest_route(app: &App, path: &str) -> (routes::Route, Reference) {
    let uri: Uri = path.parse().expect("uri");
    let routes::Parsed::Repo(route) = routes::parse(&Method::GET, &uri, &app.upstreams).expect("route") else {
        panic!("a repository route")
    };
    let routes::Endpoint::Manifest(reference) = route.endpoint.clone() else { panic!("a manifest route") };
    (route, reference)
}

/// The paths of the two warm manifest requests the benchmarks measure.
pub fn manifest_paths(digest: &Digest) -> [(&'static str, String); 2] {
    [("by_digest", format!("/v2/team/app/manifests/{digest}")), ("by_tag", "/v2/team/app/manifests/v1".into())]
}
