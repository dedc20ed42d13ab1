//! Scarf front-ends' shape (lscr.io, cr.l5d.io; shared/REGISTRIES.md):
//! either the front itself answers 401 naming a token realm on **another
//! domain** (ghcr's), or it redirects (307) to ghcr, which then challenges
//! with its own realm. ghcr's token responses carry no `expires_in`.
//!
//! `lscr.test` (challenges, realm on `ghcr.test`), `cr.l5d.test`
//! (redirects to `ghcr.test`), `ghcr.test`.

use super::registry::{Images, Kind, Tokens, parse_v2};
use super::site::{Addr, Reply, Req, Site, Tls, challenge, error, redirect};

pub const CHALLENGING_FRONT: &str = "lscr.test";
pub const REDIRECTING_FRONT: &str = "cr.l5d.test";
pub const GHCR: &str = "ghcr.test";

pub struct Scarf {
    /// Answers 401 naming ghcr's realm.
    pub challenging: Site,
    /// Redirects every request to ghcr.
    pub redirecting: Site,
    pub ghcr: Site,
    pub images: Images,
    pub tokens: Tokens,
}

impl Scarf {
    pub async fn start(tls: &Tls) -> Scarf {
        let (lscr, l5d, ghcr) = (Addr::pick(CHALLENGING_FRONT), Addr::pick(REDIRECTING_FRONT), Addr::pick(GHCR));
        let images = Images::default();
        let tokens = Tokens::new(None);
        let realm = format!("{}/token", ghcr.url());
        let ghcr_site = Site::start(tls, &ghcr, {
            let (images, tokens, realm) = (images.clone(), tokens.clone(), realm.clone());
            move |req| {
                if req.path == "/token" {
                    return tokens.issue(req);
                }
                serve(req, &images, &tokens, &realm)
            }
        })
        .await;
        let challenging = Site::start(tls, &lscr, {
            let (images, tokens, realm) = (images.clone(), tokens.clone(), realm.clone());
            move |req| serve(req, &images, &tokens, &realm)
        })
        .await;
        let redirecting = Site::start(tls, &l5d, {
            let target = ghcr.url();
            move |req| redirect(307, format!("{target}{}", req.path))
        })
        .await;
        Scarf { challenging, redirecting, ghcr: ghcr_site, images, tokens }
    }
}

/// Serves content to holders of a ghcr token, challenging others.
fn serve(req: &Req, images: &Images, tokens: &Tokens, realm: &str) -> Reply {
    let Some((repo, kind, reference)) = parse_v2(&req.path) else { return error(404, "NOT_FOUND") };
    if !tokens.allows(req.authorization.as_deref(), &repo) {
        return challenge(format!(r#"Bearer realm="{realm}",service="{GHCR}",scope="repository:{repo}:pull""#));
    }
    match kind {
        Kind::Blob | Kind::Manifest => images.answer(req, &repo, kind, &reference, &[]),
    }
}
