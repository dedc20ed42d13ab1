//! A plain registry for the tests that are about larder, not about a
//! registry's quirks: content, an outage switch (every request 503), a
//! status for manifest GETs (429: a pull limit without Docker Hub's
//! headers), and optionally Bearer tokens from a realm on its own host (`/token`,
//! anonymous, for any scope: Docker Hub's habit).
//!
//! `plain.test`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};

use super::registry::{Images, Tokens, parse_v2};
use super::site::{Addr, Reply, Req, Site, Tls, challenge, error};

pub const REGISTRY: &str = "plain.test";

pub struct Plain {
    pub registry: Site,
    pub images: Images,
    down: Arc<AtomicBool>,
    manifest_get_status: Arc<AtomicU16>,
}

impl Plain {
    /// `tokens`: challenge for Bearer tokens from `<self>/token`.
    pub async fn start(tls: &Tls, tokens: Option<Tokens>) -> Plain {
        let addr = Addr::pick(REGISTRY);
        let images = Images::default();
        let down = Arc::new(AtomicBool::new(false));
        let manifest_get_status = Arc::new(AtomicU16::new(0));
        let registry = Site::start(tls, &addr, {
            let (images, down, realm) = (images.clone(), Arc::clone(&down), format!("{}/token", addr.url()));
            let get_status = Arc::clone(&manifest_get_status);
            move |req| {
                if down.load(Ordering::SeqCst) {
                    return error(503, "UNAVAILABLE");
                }
                let status = get_status.load(Ordering::SeqCst);
                if status != 0 && req.method == "GET" && req.path.contains("/manifests/") {
                    return error(status, "TOOMANYREQUESTS");
                }
                answer(req, &images, tokens.as_ref(), &realm)
            }
        })
        .await;
        Plain { registry, images, down, manifest_get_status }
    }

    /// Manifest GETs are answered `status` (0: served normally).
    pub fn answer_manifest_gets_with(&self, status: u16) {
        self.manifest_get_status.store(status, Ordering::SeqCst);
    }

    /// GETs of manifests the registry saw.
    pub fn manifest_gets(&self) -> usize {
        self.registry.seen().iter().filter(|s| s.method == "GET" && s.path.contains("/manifests/")).count()
    }

    /// Every request is answered 503 while `down`.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// HEADs of manifests the registry saw.
    pub fn manifest_heads(&self) -> usize {
        self.registry.seen().iter().filter(|s| s.method == "HEAD" && s.path.contains("/manifests/")).count()
    }
}

fn answer(req: &Req, images: &Images, tokens: Option<&Tokens>, realm: &str) -> Reply {
    if let (Some(tokens), "/token") = (tokens, req.path.as_str()) {
        return tokens.issue(req);
    }
    let Some((repo, kind, reference)) = parse_v2(&req.path) else { return error(404, "NOT_FOUND") };
    if let Some(tokens) = tokens {
        if !tokens.allows(req.authorization.as_deref(), &repo) {
            return challenge(format!(r#"Bearer realm="{realm}",service="{REGISTRY}",scope="repository:{repo}:pull""#));
        }
    }
    images.answer(req, &repo, kind, &reference, &[])
}
