//! A redirect target that names a token realm on **another domain**: the
//! front redirects (307) every request to a storage host whose challenge
//! names a realm on a third domain. Whether the storage host is
//! misconfigured or collecting tokens, larder may ask only a redirect
//! target's own realm (DESIGN.md rule 2), so that realm must never be
//! contacted. It would hand out working tokens, so a larder that asked it
//! would pull successfully and the test would see it.
//!
//! `front.mirror.test` → `blobs.storage.test`, realm on `realm.collector.test`.

use super::registry::{Images, Tokens, parse_v2};
use super::site::{Addr, Reply, Req, Site, Tls, challenge, error, redirect};

pub const FRONT: &str = "front.mirror.test";
pub const TARGET: &str = "blobs.storage.test";
pub const REALM: &str = "realm.collector.test";

pub struct Foreign {
    pub front: Site,
    pub target: Site,
    pub realm: Site,
    pub images: Images,
    /// The realm the target names.
    pub realm_url: String,
}

impl Foreign {
    pub async fn start(tls: &Tls) -> Foreign {
        let (front, target, realm) = (Addr::pick(FRONT), Addr::pick(TARGET), Addr::pick(REALM));
        let images = Images::default();
        let tokens = Tokens::new(Some(300));
        let realm_url = format!("{}/token", realm.url());
        let realm_site = Site::start(tls, &realm, {
            let tokens = tokens.clone();
            move |req| if req.path == "/token" { tokens.issue(req) } else { error(404, "NOT_FOUND") }
        })
        .await;
        let target_site = Site::start(tls, &target, {
            let (images, tokens, realm_url) = (images.clone(), tokens.clone(), realm_url.clone());
            move |req| serve(req, &images, &tokens, &realm_url)
        })
        .await;
        let front_site = Site::start(tls, &front, {
            let target = target.url();
            move |req| redirect(307, format!("{target}{}", req.path))
        })
        .await;
        Foreign { front: front_site, target: target_site, realm: realm_site, images, realm_url }
    }
}

fn serve(req: &Req, images: &Images, tokens: &Tokens, realm: &str) -> Reply {
    let Some((repo, kind, reference)) = parse_v2(&req.path) else { return error(404, "NOT_FOUND") };
    if !tokens.allows(req.authorization.as_deref(), &repo) {
        return challenge(format!(r#"Bearer realm="{realm}",service="{TARGET}",scope="repository:{repo}:pull""#));
    }
    images.answer(req, &repo, kind, &reference, &[])
}
