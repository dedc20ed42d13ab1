//! Docker Hub's shape (shared/REGISTRIES.md): the registry challenges for
//! a Bearer token from a realm on an `auth.` sibling host (same registrable
//! domain), serves manifests with `ratelimit-limit`/`ratelimit-remaining`
//! on GET and HEAD, counts only GETs, answers 429 once the limit is used
//! up, and redirects blobs (307) to a CDN on another domain that refuses
//! any request carrying `Authorization`.
//!
//! `registry.hub.test` / `auth.hub.test` / `cdn.hubstatic.test`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use super::registry::{Images, Kind, Tokens, parse_v2};
use super::site::{Addr, Reply, Req, Site, Tls, challenge, error, redirect, reply};

pub const REGISTRY: &str = "registry.hub.test";
pub const AUTH: &str = "auth.hub.test";
pub const CDN: &str = "cdn.hubstatic.test";
/// The `service` of the challenge (Docker Hub's is `registry.docker.io`).
pub const SERVICE: &str = "registry.hub.test";

pub struct Hub {
    pub registry: Site,
    pub auth: Site,
    pub cdn: Site,
    pub images: Images,
    pub tokens: Tokens,
    limit: Arc<Limit>,
}

/// The pull limit: GETs of manifests left in the window.
struct Limit {
    limit: u64,
    remaining: AtomicU64,
}

impl Hub {
    /// A Hub whose token service accepts anonymous requests, and Basic
    /// `user:password` when given; `limit` manifest GETs per window.
    pub async fn start(tls: &Tls, account: Option<(&str, &str)>, limit: u64) -> Hub {
        let (registry, auth, cdn) = (Addr::pick(REGISTRY), Addr::pick(AUTH), Addr::pick(CDN));
        let images = Images::default();
        let tokens = Tokens::new(Some(300));
        let limit = Arc::new(Limit { limit, remaining: AtomicU64::new(limit) });
        let account = account.map(|(u, p)| super::basic(u, p));

        let auth_site = Site::start(tls, &auth, {
            let tokens = tokens.clone();
            move |req| {
                if req.path != "/token" || req.params("service") != [SERVICE] {
                    return error(404, "NOT_FOUND");
                }
                match (&req.authorization, &account) {
                    (None, _) => tokens.issue(req),
                    (Some(given), Some(valid)) if given == valid => tokens.issue(req),
                    (Some(_), _) => error(401, "UNAUTHORIZED"),
                }
            }
        })
        .await;
        let cdn_site = Site::start(tls, &cdn, {
            let images = images.clone();
            move |req| {
                // A signed URL: sending credentials here is an error.
                if req.authorization.is_some() {
                    return error(400, "Authorization is not allowed on a signed CDN URL");
                }
                let digest = req.path.strip_prefix("/blobs/").unwrap_or_default();
                match images.bytes(digest) {
                    Some(b) => reply(200, &[], if req.head() { Bytes::new() } else { b }),
                    None => error(404, "NOT_FOUND"),
                }
            }
        })
        .await;
        let registry_site = Site::start(tls, &registry, {
            let (images, tokens, limit) = (images.clone(), tokens.clone(), Arc::clone(&limit));
            let (realm, cdn) = (format!("{}/token", auth.url()), cdn.url());
            move |req| answer(req, &images, &tokens, &limit, &realm, &cdn)
        })
        .await;
        Hub { registry: registry_site, auth: auth_site, cdn: cdn_site, images, tokens, limit }
    }

    /// Sets the pulls left in the window.
    pub fn set_remaining(&self, n: u64) {
        self.limit.remaining.store(n, Ordering::SeqCst);
    }

    /// Manifest GETs and HEADs the registry answered, as `"METHOD path status"`.
    pub fn manifest_requests(&self) -> Vec<String> {
        self.registry
            .seen()
            .into_iter()
            .filter(|s| s.path.contains("/manifests/") && s.status != 401)
            .map(|s| format!("{} {} {}", s.method, s.path, s.status))
            .collect()
    }
}

fn answer(req: &Req, images: &Images, tokens: &Tokens, limit: &Limit, realm: &str, cdn: &str) -> Reply {
    let Some((repo, kind, reference)) = parse_v2(&req.path) else {
        return challenge(format!(r#"Bearer realm="{realm}",service="{SERVICE}""#));
    };
    if !tokens.allows(req.authorization.as_deref(), &repo) {
        return challenge(format!(r#"Bearer realm="{realm}",service="{SERVICE}",scope="repository:{repo}:pull""#));
    }
    match kind {
        Kind::Blob => redirect(307, format!("{cdn}/blobs/{reference}?X-Signature=abc&expires=300")),
        Kind::Manifest => {
            let remaining = &limit.remaining;
            let counted = req.method == "GET";
            if counted && remaining.load(Ordering::SeqCst) == 0 {
                let headers = rate_headers(limit.limit, 0);
                let mut r = error(429, "TOOMANYREQUESTS");
                for (k, v) in headers {
                    r.headers_mut().insert(k, v.parse().expect("a header value"));
                }
                r.headers_mut().insert("retry-after", "60".parse().expect("a header value"));
                return r;
            }
            let left =
                if counted { remaining.fetch_sub(1, Ordering::SeqCst) - 1 } else { remaining.load(Ordering::SeqCst) };
            images.answer(req, &repo, kind, &reference, &rate_headers(limit.limit, left))
        }
    }
}

fn rate_headers(limit: u64, remaining: u64) -> Vec<(&'static str, String)> {
    vec![
        ("ratelimit-limit", format!("{limit};w=21600")),
        ("ratelimit-remaining", format!("{remaining};w=21600")),
        ("docker-ratelimit-source", "127.0.0.1".into()),
    ]
}
