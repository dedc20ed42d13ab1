//! Test images: OCI layouts generated on disk, pushed to an origin by skopeo.
//!
//! Layers are gzip'd tars holding one file of random bytes (so they do not
//! compress and every image is distinct). The layout's `index.json` only
//! holds OCI media types, because skopeo 1.9's `oci:` transport ignores
//! entries with Docker ones; a Docker schema2 image is made by pushing with
//! `--format v2s2`, which converts on the way.
//!
//! ```ignore
//! let image = ImageBuilder::oci().multi_arch().push(&origin, "team/app", "v1").await;
//! assert!(image.is_index());
//! ```

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;

use flate2::Compression;
use flate2::write::GzEncoder;
use rand::RngCore;
use serde_json::{Value, json};

use super::origin::{Origin, sha256_digest};
use super::skopeo;

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// The platforms of a multi-arch image, as (os, architecture).
pub const MULTI_ARCH_PLATFORMS: [(&str, &str); 2] = [("linux", "amd64"), ("linux", "arm64")];

/// Layer content sizes used unless a test picks its own: small, medium, and
/// one large enough to take several reads.
pub const DEFAULT_LAYER_SIZES: [usize; 3] = [24 * 1024, 160 * 1024, 768 * 1024];

/// The manifest format the origin ends up storing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ManifestFormat {
    /// OCI image manifest / OCI index, pushed unchanged.
    Oci,
    /// Docker schema2 manifest / manifest list (`skopeo copy --format v2s2`).
    DockerV2S2,
}

/// A content-addressed blob: digest and size in bytes.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Blob {
    pub digest: String,
    pub size: u64,
}

/// Describes a test image; [`ImageBuilder::push`] makes and pushes it.
#[derive(Clone, Debug)]
pub struct ImageBuilder {
    layer_sizes: Vec<usize>,
    multi_arch: bool,
    format: ManifestFormat,
}

impl ImageBuilder {
    /// An OCI image for linux/amd64 with [`DEFAULT_LAYER_SIZES`].
    pub fn oci() -> Self {
        ImageBuilder { layer_sizes: DEFAULT_LAYER_SIZES.to_vec(), multi_arch: false, format: ManifestFormat::Oci }
    }

    /// Like [`ImageBuilder::oci`], stored at the origin as Docker schema2.
    pub fn docker_schema2() -> Self {
        Self::oci().format(ManifestFormat::DockerV2S2)
    }

    /// Layer content sizes in bytes, one layer per entry (per platform).
    pub fn layers(mut self, sizes: &[usize]) -> Self {
        self.layer_sizes = sizes.to_vec();
        self
    }

    /// An index of linux/amd64 and linux/arm64 images, each with its own
    /// config and layers (a Docker manifest list with `DockerV2S2`).
    pub fn multi_arch(mut self) -> Self {
        self.multi_arch = true;
        self
    }

    pub fn format(mut self, format: ManifestFormat) -> Self {
        self.format = format;
        self
    }

    /// Writes the image as an OCI layout in `dir`, tagged `tag` in its
    /// `index.json`; returns the digest of the top manifest (or index).
    pub fn write_layout(&self, dir: &Path, tag: &str) -> String {
        let layout = Layout::create(dir);
        let top = if self.multi_arch {
            let manifests: Vec<Value> = MULTI_ARCH_PLATFORMS
                .iter()
                .map(|(os, arch)| {
                    let (digest, size) = self.write_image(&layout, os, arch);
                    json!({
                        "mediaType": OCI_MANIFEST,
                        "digest": digest,
                        "size": size,
                        "platform": {"architecture": arch, "os": os},
                    })
                })
                .collect();
            let index = json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests});
            let (digest, size) = layout.write_json(&index);
            (OCI_INDEX, digest, size)
        } else {
            let (digest, size) = self.write_image(&layout, "linux", "amd64");
            (OCI_MANIFEST, digest, size)
        };
        let (media_type, digest, size) = top;
        let index_json = json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": media_type,
                "digest": digest,
                "size": size,
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }],
        });
        layout.write_file("index.json", index_json.to_string().as_bytes());
        digest
    }

    /// Writes config, layers and manifest for one platform; returns the
    /// manifest's digest and size.
    fn write_image(&self, layout: &Layout, os: &str, arch: &str) -> (String, u64) {
        let mut layers = Vec::new();
        let mut diff_ids = Vec::new();
        for (i, size) in self.layer_sizes.iter().enumerate() {
            let (gzipped, diff_id) = random_layer(*size, &format!("layer-{i}.bin"));
            let (digest, size) = layout.write_blob(&gzipped);
            layers.push(json!({"mediaType": OCI_LAYER_GZIP, "digest": digest, "size": size}));
            diff_ids.push(diff_id);
        }
        let config = json!({
            "architecture": arch,
            "os": os,
            "config": {"Cmd": ["/layer-0.bin"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        });
        let (config_digest, config_size) = layout.write_json(&config);
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config_size},
            "layers": layers,
        });
        layout.write_json(&manifest)
    }

    /// Builds the image and pushes it to `origin` as `repo:tag` (with the
    /// origin's credentials behind token auth), then reads back what the
    /// origin stores.
    pub async fn push(&self, origin: &Origin, repo: &str, tag: &str) -> PushedImage {
        let dir = tempfile::Builder::new()
            .prefix("larder-image-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a temp dir for the image layout: {e}"));
        self.write_layout(dir.path(), tag);
        let mut args = vec!["copy".to_owned(), "--dest-tls-verify=false".to_owned()];
        if self.multi_arch {
            args.push("--all".to_owned());
        }
        if self.format == ManifestFormat::DockerV2S2 {
            args.push("--format=v2s2".to_owned());
        }
        if let Some(credentials) = origin.credentials() {
            args.push(format!("--dest-creds={}", credentials.colon_joined()));
        }
        args.push(format!("oci:{}:{tag}", dir.path().display()));
        args.push(origin.image_ref(&format!("{repo}:{tag}")));
        if let Err(e) = skopeo::run(&args).await {
            panic!("pushing the test image {repo}:{tag} to the origin failed: {e}");
        }
        PushedImage::read_back(origin, repo, tag).await
    }
}

/// An image as the origin stores it.
#[derive(Clone, Debug)]
pub struct PushedImage {
    pub repo: String,
    pub tag: String,
    /// The origin's `Docker-Content-Digest` for `repo:tag`.
    pub digest: String,
    pub media_type: String,
    /// The image manifests: the one manifest, or every entry of the index.
    pub manifests: Vec<PushedManifest>,
}

/// One image manifest (one platform) as the origin stores it.
#[derive(Clone, Debug)]
pub struct PushedManifest {
    pub digest: String,
    pub media_type: String,
    /// `os/architecture` from the index entry; `None` for a lone manifest.
    pub platform: Option<String>,
    pub config: Blob,
    pub layers: Vec<Blob>,
}

impl PushedImage {
    async fn read_back(origin: &Origin, repo: &str, tag: &str) -> Self {
        let top = origin.fetch_manifest(repo, tag).await;
        let json = parse_json(&top.body, &format!("{repo}:{tag}"));
        let manifests = match json.get("manifests").and_then(Value::as_array) {
            Some(entries) => {
                let mut manifests = Vec::new();
                for entry in entries {
                    let digest = string_field(entry, "digest");
                    let platform = entry.get("platform").map(|platform| {
                        format!("{}/{}", string_field(platform, "os"), string_field(platform, "architecture"))
                    });
                    let child = origin.fetch_manifest(repo, &digest).await;
                    let child_json = parse_json(&child.body, &format!("{repo}@{digest}"));
                    manifests.push(image_manifest(child.digest, child.media_type, platform, &child_json));
                }
                manifests
            }
            None => vec![image_manifest(top.digest.clone(), top.media_type.clone(), None, &json)],
        };
        PushedImage {
            repo: repo.to_owned(),
            tag: tag.to_owned(),
            digest: top.digest,
            media_type: top.media_type,
            manifests,
        }
    }

    /// `repo:tag`.
    pub fn reference(&self) -> String {
        format!("{}:{}", self.repo, self.tag)
    }

    /// `repo@digest`.
    pub fn by_digest(&self) -> String {
        format!("{}@{}", self.repo, self.digest)
    }

    /// True for an OCI index or Docker manifest list.
    pub fn is_index(&self) -> bool {
        self.media_type == OCI_INDEX || self.media_type == DOCKER_MANIFEST_LIST
    }

    /// Every config and layer blob of every platform, sorted, no duplicates.
    pub fn blobs(&self) -> Vec<Blob> {
        let unique: BTreeSet<Blob> = self
            .manifests
            .iter()
            .flat_map(|manifest| std::iter::once(&manifest.config).chain(&manifest.layers))
            .cloned()
            .collect();
        unique.into_iter().collect()
    }

    /// The blob digests, sorted.
    pub fn blob_digests(&self) -> Vec<String> {
        self.blobs().into_iter().map(|blob| blob.digest).collect()
    }

    /// The per-platform manifest digests, sorted (empty for a lone manifest).
    pub fn child_manifest_digests(&self) -> Vec<String> {
        if !self.is_index() {
            return Vec::new();
        }
        let mut digests: Vec<String> = self.manifests.iter().map(|m| m.digest.clone()).collect();
        digests.sort();
        digests
    }
}

fn image_manifest(digest: String, media_type: String, platform: Option<String>, json: &Value) -> PushedManifest {
    let config = json.get("config").map(blob_of).unwrap_or_else(|| panic!("manifest {digest} has no config: {json}"));
    let layers = json
        .get("layers")
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("manifest {digest} has no layers: {json}"))
        .iter()
        .map(blob_of)
        .collect();
    PushedManifest { digest, media_type, platform, config, layers }
}

fn blob_of(descriptor: &Value) -> Blob {
    Blob {
        digest: string_field(descriptor, "digest"),
        size: descriptor
            .get("size")
            .and_then(Value::as_u64)
            .unwrap_or_else(|| panic!("descriptor without a size: {descriptor}")),
    }
}

fn string_field(value: &Value, key: &str) -> String {
    value.get(key).and_then(Value::as_str).map(str::to_owned).unwrap_or_else(|| panic!("no string `{key}` in {value}"))
}

fn parse_json(bytes: &[u8], what: &str) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|e| {
        panic!("the origin's manifest for {what} is not JSON ({e}): {}", String::from_utf8_lossy(bytes))
    })
}

/// A gzip'd tar holding one file of `size` random bytes; returns the gzip
/// bytes and the tar's digest (the config's diff_id).
fn random_layer(size: usize, file_name: &str) -> (Vec<u8>, String) {
    let mut content = vec![0u8; size];
    rand::rng().fill_bytes(&mut content);
    let mut tar_bytes = Vec::with_capacity(size + 2048);
    {
        let mut builder = tar::Builder::new(&mut tar_bytes);
        let mut header = tar::Header::new_gnu();
        header.set_size(size as u64);
        header.set_mode(0o644);
        header.set_mtime(0);
        header.set_cksum();
        builder
            .append_data(&mut header, file_name, content.as_slice())
            .unwrap_or_else(|e| panic!("cannot build a layer tar: {e}"));
        builder.finish().unwrap_or_else(|e| panic!("cannot finish a layer tar: {e}"));
    }
    let diff_id = sha256_digest(&tar_bytes);
    let mut gzip = GzEncoder::new(Vec::with_capacity(tar_bytes.len() + 1024), Compression::fast());
    gzip.write_all(&tar_bytes).and_then(|()| gzip.flush()).unwrap_or_else(|e| panic!("cannot gzip a layer: {e}"));
    let gzipped = gzip.finish().unwrap_or_else(|e| panic!("cannot finish gzipping a layer: {e}"));
    (gzipped, diff_id)
}

/// An OCI image layout directory being written.
struct Layout<'a> {
    dir: &'a Path,
}

impl<'a> Layout<'a> {
    fn create(dir: &'a Path) -> Self {
        let blobs = dir.join("blobs").join("sha256");
        std::fs::create_dir_all(&blobs).unwrap_or_else(|e| panic!("cannot create {}: {e}", blobs.display()));
        let layout = Layout { dir };
        layout.write_file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
        layout
    }

    fn write_file(&self, name: &str, bytes: &[u8]) {
        let path = self.dir.join(name);
        std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    }

    /// Stores `bytes` under `blobs/sha256/`; returns its digest and size.
    fn write_blob(&self, bytes: &[u8]) -> (String, u64) {
        let digest = sha256_digest(bytes);
        let hex = digest.trim_start_matches("sha256:");
        self.write_file(&format!("blobs/sha256/{hex}"), bytes);
        (digest, bytes.len() as u64)
    }

    fn write_json(&self, value: &Value) -> (String, u64) {
        self.write_blob(value.to_string().as_bytes())
    }
}
