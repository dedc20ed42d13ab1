//! registry.k8s.io's shape (shared/REGISTRIES.md): `/v2/` answers 200
//! without a challenge; manifests and blobs are redirected (307) to
//! Artifact Registry under a **rewritten** name
//! (`k8s-artifacts-prod/images/<name>`), which challenges with its own realm
//! on its own host and hands out tokens only anonymously, scoped to exactly
//! the rewritten repository; its blob URLs answer 302 with a **relative**
//! `Location` on the same host.
//!
//! The front also keeps `tags/list` behind Basic credentials, so that the
//! upstream's configured credentials are really in use (on its own origin)
//! while the test shows they never reach the other host.
//!
//! `registry.k8s.test` → `artifact.pkg.test`.

use bytes::Bytes;

use super::registry::{Images, Tokens, parse_v2};
use super::site::{Addr, Reply, Req, Site, Tls, challenge, error, redirect, reply};

pub const FRONT: &str = "registry.k8s.test";
pub const ARTIFACT: &str = "artifact.pkg.test";
/// Where Artifact Registry keeps the images the front names `<name>`.
pub const REWRITTEN_PREFIX: &str = "k8s-artifacts-prod/images";

pub struct K8s {
    pub front: Site,
    pub artifact: Site,
    /// Content under the rewritten names.
    pub images: Images,
    pub tokens: Tokens,
}

impl K8s {
    /// `account` guards the front's `tags/list` (Basic).
    pub async fn start(tls: &Tls, account: (&str, &str)) -> K8s {
        let (front, artifact) = (Addr::pick(FRONT), Addr::pick(ARTIFACT));
        let images = Images::default();
        let tokens = Tokens::new(Some(300));
        let artifact_site = Site::start(tls, &artifact, {
            let (images, tokens, realm) = (images.clone(), tokens.clone(), format!("{}/v2/token", artifact.url()));
            move |req| answer_artifact(req, &images, &tokens, &realm)
        })
        .await;
        let basic = super::basic(account.0, account.1);
        let front_site = Site::start(tls, &front, {
            let target = artifact.url();
            move |req| answer_front(req, &target, &basic)
        })
        .await;
        K8s { front: front_site, artifact: artifact_site, images, tokens }
    }
}

fn answer_front(req: &Req, artifact: &str, basic: &str) -> Reply {
    if req.path == "/v2/" {
        return reply(200, &[("content-type", "application/json".into())], "{}");
    }
    if let Some(name) = req.path.strip_prefix("/v2/").and_then(|p| p.strip_suffix("/tags/list")) {
        if req.authorization.as_deref() != Some(basic) {
            return challenge(format!(r#"Basic realm="{FRONT}""#));
        }
        let body = serde_json::json!({"name": name, "tags": ["3.9"]}).to_string();
        return reply(200, &[("content-type", "application/json".into())], body);
    }
    let Some(rest) = req.path.strip_prefix("/v2/") else { return error(404, "NOT_FOUND") };
    redirect(307, format!("{artifact}/v2/{REWRITTEN_PREFIX}/{rest}"))
}

fn answer_artifact(req: &Req, images: &Images, tokens: &Tokens, realm: &str) -> Reply {
    if req.path == "/v2/token" {
        // Public images: tokens are only ever handed out anonymously.
        if req.authorization.is_some() {
            return error(401, "UNAUTHORIZED");
        }
        return tokens.issue(req);
    }
    if let Some(digest) = req.path.strip_prefix("/artifacts-downloads/") {
        return match images.bytes(digest) {
            Some(b) => reply(200, &[], if req.head() { Bytes::new() } else { b }),
            None => error(404, "NOT_FOUND"),
        };
    }
    let Some((repo, kind, reference)) = parse_v2(&req.path) else { return error(404, "NOT_FOUND") };
    if !tokens.allows(req.authorization.as_deref(), &repo) {
        return challenge(format!(r#"Bearer realm="{realm}",service="{ARTIFACT}",scope="repository:{repo}:pull""#));
    }
    match kind {
        super::registry::Kind::Blob => redirect(302, format!("/artifacts-downloads/{reference}?sig=k8s")),
        super::registry::Kind::Manifest => images.answer(req, &repo, kind, &reference, &[]),
    }
}
