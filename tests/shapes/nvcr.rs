//! nvcr.io's shape (shared/REGISTRIES.md): challenges name a realm on
//! **another domain** (NVIDIA's authn service) and carry **no `service`**;
//! tokens are short-lived and may be revoked before they expire. The token
//! service refuses a request that names a service, as a strict one would.
//!
//! `nvcr.test` → realm on `authn.nvidia.test`.

use super::registry::{Images, Tokens, parse_v2};
use super::site::{Addr, Reply, Req, Site, Tls, challenge, error};

pub const REGISTRY: &str = "nvcr.test";
pub const AUTHN: &str = "authn.nvidia.test";

pub struct Nvcr {
    pub registry: Site,
    pub authn: Site,
    pub images: Images,
    pub tokens: Tokens,
    /// The realm, for `trusted_realms`.
    pub realm: String,
}

impl Nvcr {
    /// Tokens live `expires_in` seconds.
    pub async fn start(tls: &Tls, expires_in: u64) -> Nvcr {
        let (registry, authn) = (Addr::pick(REGISTRY), Addr::pick(AUTHN));
        let images = Images::default();
        let tokens = Tokens::new(Some(expires_in));
        let realm = format!("{}/token", authn.url());
        let authn_site = Site::start(tls, &authn, {
            let tokens = tokens.clone();
            move |req| {
                if req.path != "/token" {
                    return error(404, "NOT_FOUND");
                }
                if !req.params("service").is_empty() {
                    return error(400, "the challenge named no service");
                }
                tokens.issue(req)
            }
        })
        .await;
        let registry_site = Site::start(tls, &registry, {
            let (images, tokens, realm) = (images.clone(), tokens.clone(), realm.clone());
            move |req| answer(req, &images, &tokens, &realm)
        })
        .await;
        Nvcr { registry: registry_site, authn: authn_site, images, tokens, realm }
    }

    /// Requests the registry answered 401 although they carried a token.
    pub fn refused_tokens(&self) -> usize {
        self.registry.seen().iter().filter(|s| s.status == 401 && s.authorization.is_some()).count()
    }
}

fn answer(req: &Req, images: &Images, tokens: &Tokens, realm: &str) -> Reply {
    let Some((repo, kind, reference)) = parse_v2(&req.path) else { return error(404, "NOT_FOUND") };
    if !tokens.allows(req.authorization.as_deref(), &repo) {
        return challenge(format!(r#"Bearer realm="{realm}",scope="repository:{repo}:pull""#));
    }
    images.answer(req, &repo, kind, &reference, &[])
}
