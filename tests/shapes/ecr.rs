//! Private ECR's shape (shared/REGISTRIES.md): a **Basic** challenge, and a
//! password (`AWS:<token>`) that changes. The registry reads the password
//! it accepts from a file on every request, the same file the test's
//! credential helper (or larder's `password_file`) reads, so a rotation is
//! one atomic rename and there is never a moment where the two disagree.
//!
//! `ecr.test`.

use std::path::{Path, PathBuf};

use super::registry::{Images, parse_v2};
use super::site::{Addr, Reply, Req, Site, Tls, challenge, error};

pub const REGISTRY: &str = "ecr.test";
pub const USER: &str = "AWS";

pub struct Ecr {
    pub registry: Site,
    pub images: Images,
}

impl Ecr {
    /// Accepts `AWS:<contents of password_file>`.
    pub async fn start(tls: &Tls, password_file: &Path) -> Ecr {
        let addr = Addr::pick(REGISTRY);
        let images = Images::default();
        let registry = Site::start(tls, &addr, {
            let (images, file) = (images.clone(), password_file.to_owned());
            move |req| answer(req, &images, &file)
        })
        .await;
        Ecr { registry, images }
    }

    /// Requests refused although they carried credentials (a rotated password).
    pub fn refused_credentials(&self) -> usize {
        self.registry.seen().iter().filter(|s| s.status == 401 && s.authorization.is_some()).count()
    }
}

fn answer(req: &Req, images: &Images, password_file: &PathBuf) -> Reply {
    let password = std::fs::read_to_string(password_file).unwrap_or_default();
    let valid = super::basic(USER, password.trim_end());
    if req.authorization.as_deref() != Some(valid.as_str()) {
        return challenge(format!(r#"Basic realm="https://{REGISTRY}",service="ecr.amazonaws.com""#));
    }
    let Some((repo, kind, reference)) = parse_v2(&req.path) else { return error(404, "NOT_FOUND") };
    images.answer(req, &repo, kind, &reference, &[])
}
