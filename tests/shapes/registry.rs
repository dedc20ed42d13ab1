//! The parts every registry shape is made of: image content served under
//! `/v2/<repo>/{manifests,blobs}/…` ([`Images`]), and a token service that
//! issues, checks, expires and revokes Bearer tokens ([`Tokens`]).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sha2::{Digest as _, Sha256};

use super::site::{Reply, Req, error, lock, reply};
use crate::common::ImageBuilder;

/// What a `/v2/` path asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Manifest,
    Blob,
}

/// `(repo, kind, reference)` of `/v2/<repo>/{manifests,blobs}/<reference>`.
pub fn parse_v2(path: &str) -> Option<(String, Kind, String)> {
    let rest = path.strip_prefix("/v2/")?;
    if let Some((repo, digest)) = rest.rsplit_once("/blobs/") {
        return Some((repo.to_owned(), Kind::Blob, digest.to_owned()));
    }
    let (repo, reference) = rest.rsplit_once("/manifests/")?;
    Some((repo.to_owned(), Kind::Manifest, reference.to_owned()))
}

pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// An image stored in [`Images`].
#[derive(Clone, Debug)]
pub struct Image {
    pub repo: String,
    pub tag: String,
    /// The manifest's digest.
    pub digest: String,
    /// Config and layers.
    pub blobs: Vec<String>,
}

#[derive(Default)]
struct Content {
    /// (repo, tag or digest) → manifest digest
    references: HashMap<(String, String), String>,
    /// digest → (bytes, media type); manifests and blobs alike
    blobs: HashMap<String, (Bytes, &'static str)>,
}

/// Image content, shared by the sites that serve it.
#[derive(Clone, Default)]
pub struct Images(Arc<Mutex<Content>>);

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

impl Images {
    /// Builds a real OCI image (gzipped tar layers of `layers` bytes, a
    /// config) and stores it as `repo:tag`, replacing what the tag named.
    pub fn push(&self, repo: &str, tag: &str, layers: &[usize]) -> Image {
        let dir = tempfile::tempdir().expect("a temp dir for the image layout");
        let digest = ImageBuilder::oci().layers(layers).write_layout(dir.path(), tag);
        let mut content = lock(&self.0);
        for (d, bytes) in read_layout_blobs(dir.path()) {
            content.blobs.insert(d, (bytes, "application/octet-stream"));
        }
        let manifest = content.blobs.get_mut(&digest).expect("the layout holds its manifest");
        manifest.1 = OCI_MANIFEST;
        let parsed: serde_json::Value = serde_json::from_slice(&manifest.0).expect("a JSON manifest");
        let blobs = std::iter::once(&parsed["config"])
            .chain(parsed["layers"].as_array().expect("layers"))
            .map(|d| d["digest"].as_str().expect("a digest").to_owned())
            .collect();
        content.references.insert((repo.to_owned(), tag.to_owned()), digest.clone());
        content.references.insert((repo.to_owned(), digest.clone()), digest.clone());
        Image { repo: repo.to_owned(), tag: tag.to_owned(), digest, blobs }
    }

    /// Stores a blob on its own (any repository may fetch it); returns its digest.
    pub fn add_blob(&self, bytes: Bytes) -> String {
        let digest = sha256(&bytes);
        lock(&self.0).blobs.insert(digest.clone(), (bytes, "application/octet-stream"));
        digest
    }

    /// The bytes stored under `digest`.
    pub fn bytes(&self, digest: &str) -> Option<Bytes> {
        lock(&self.0).blobs.get(digest).map(|(b, _)| b.clone())
    }

    /// Answers a manifest or blob request for `repo` (as this site names
    /// it), `extra` headers added to a 200.
    pub fn answer(&self, req: &Req, repo: &str, kind: Kind, reference: &str, extra: &[(&str, String)]) -> Reply {
        let content = lock(&self.0);
        let found = match kind {
            Kind::Manifest => content
                .references
                .get(&(repo.to_owned(), reference.to_owned()))
                .and_then(|d| content.blobs.get(d).map(|b| (d.clone(), b.clone()))),
            Kind::Blob => content.blobs.get(reference).map(|b| (reference.to_owned(), b.clone())),
        };
        let Some((digest, (bytes, media_type))) = found else {
            return error(404, if kind == Kind::Blob { "BLOB_UNKNOWN" } else { "MANIFEST_UNKNOWN" });
        };
        let mut headers = vec![("content-type", media_type.to_owned()), ("docker-content-digest", digest)];
        headers.extend(extra.iter().cloned());
        reply(200, &headers, if req.head() { Bytes::new() } else { bytes })
    }
}

/// Every file under `<layout>/blobs/sha256/`, by digest.
fn read_layout_blobs(layout: &Path) -> Vec<(String, Bytes)> {
    let dir = layout.join("blobs/sha256");
    std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("a layout entry").path();
            let bytes = Bytes::from(std::fs::read(&path).expect("read a layout blob"));
            (sha256(&bytes), bytes)
        })
        .collect()
}

// ---- tokens -----------------------------------------------------------------

/// One token as issued.
#[derive(Clone, Debug)]
pub struct Grant {
    pub token: String,
    pub scopes: Vec<String>,
    pub service: Option<String>,
    /// The `Authorization` the token request carried.
    pub authorization: Option<String>,
    expires: Instant,
    revoked: bool,
}

struct TokenState {
    issued: Vec<Grant>,
    /// `expires_in` sent with each token; `None`: the field is left out.
    expires_in: Option<u64>,
    /// Tokens are padded to this many bytes (a JWT is 1–2 KiB).
    size: usize,
    /// Every token is refused, fresh ones too (the account lost its pull
    /// permission after the token service granted it).
    refuse_all: bool,
}

/// A token service: issues a fresh random token per request, and checks
/// the tokens a registry is sent (known, not expired, not revoked, scoped
/// to the repository).
#[derive(Clone)]
pub struct Tokens(Arc<Mutex<TokenState>>);

impl Tokens {
    /// Tokens valid for `expires_in` seconds (`None`: not said, 60 s).
    pub fn new(expires_in: Option<u64>) -> Tokens {
        Tokens(Arc::new(Mutex::new(TokenState { issued: Vec::new(), expires_in, size: 48, refuse_all: false })))
    }

    /// Pads every token to `bytes` bytes.
    pub fn token_size(self, bytes: usize) -> Tokens {
        lock(&self.0).size = bytes;
        self
    }

    /// Answers a token request with a new token for its `scope`s.
    pub fn issue(&self, req: &Req) -> Reply {
        let mut state = lock(&self.0);
        let n = state.issued.len();
        let mut token = format!("tok-{n}-{:016x}-", rand::random::<u64>());
        while token.len() < state.size {
            token.push('x');
        }
        let lifetime = Duration::from_secs(state.expires_in.unwrap_or(60));
        state.issued.push(Grant {
            token: token.clone(),
            scopes: req.params("scope"),
            service: req.params("service").into_iter().next(),
            authorization: req.authorization.clone(),
            expires: Instant::now() + lifetime,
            revoked: false,
        });
        let body = match state.expires_in {
            Some(s) => serde_json::json!({"token": token, "expires_in": s}),
            None => serde_json::json!({"token": token}),
        };
        reply(200, &[("content-type", "application/json".into())], body.to_string())
    }

    /// Whether `authorization` is `Bearer <a live token>` scoped to pull `repo`.
    pub fn allows(&self, authorization: Option<&str>, repo: &str) -> bool {
        let Some(token) = authorization.and_then(|a| a.strip_prefix("Bearer ")) else { return false };
        let wanted = format!("repository:{repo}:pull");
        let state = lock(&self.0);
        !state.refuse_all
            && state
                .issued
                .iter()
                .any(|g| g.token == token && !g.revoked && Instant::now() < g.expires && g.scopes.contains(&wanted))
    }

    /// From now on every token is refused, those issued later too.
    pub fn refuse_all(&self) {
        lock(&self.0).refuse_all = true;
    }

    /// Revokes every token issued so far (before their `expires_in`).
    pub fn revoke_all(&self) {
        for g in lock(&self.0).issued.iter_mut() {
            g.revoked = true;
        }
    }

    /// Every token issued so far.
    pub fn issued(&self) -> Vec<Grant> {
        lock(&self.0).issued.clone()
    }
}
