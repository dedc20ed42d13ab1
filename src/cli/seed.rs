//! `larder export` and `larder import`: images carried into an
//! air-gapped site as OCI image layouts (skopeo's `oci:DIR`, or a tar of
//! one, `oci-archive:FILE`).
//!
//! `export` asks a running larder for each image: a prefetch first (with
//! progress, filling from upstream what the cache lacks), then the layout
//! as a tar (admin `POST /export`), unpacked into `--output` and merged
//! with what the folder already holds, so one folder carries many images.
//!
//! `import` loads a layout into the cache. On a stopped cache folder it
//! opens the cache itself; while larder runs (the folder is locked) it
//! sends the layout as a tar to the admin listener (`POST /import`). Either
//! way every blob is verified before anything is committed.

use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use http::Method;
use http_body_util::BodyExt;

use super::client::{AdminClient, CallError, RequestBody, read_body};
use crate::body::BodyReader;
use crate::cache::Cache;
use crate::cache::import::{Imported, LayoutSource};
use crate::config::Config;
use crate::error::Error;
use crate::oci::layout::{CONTAINERD_NAME, LayoutIndex, OCI_LAYOUT, REF_NAME};
use crate::server::admin::seed::{LAYOUT_TAR, targets};
use crate::upstream::Upstreams;

/// Longest an import's upload and check may take before the answer.
pub const IMPORT_TIMEOUT: Duration = Duration::from_secs(3600);
/// Longest an export waits for the layout's first bytes (the image is
/// cached by the prefetch before it, so this is only the manifests' read).
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(300);
/// Response chunks in flight to the unpacker.
const CHUNKS_IN_FLIGHT: usize = 16;
/// Bytes of a layout tar sent per request body chunk.
const UPLOAD_CHUNK: usize = 256 << 10;

/// `larder export IMAGE... --output DIR [--platform P]`.
pub async fn export(
    client: &AdminClient,
    images: &[String],
    platform: Option<&str>,
    output: &Path,
    terminal: bool,
) -> Result<(), CallError> {
    let usage = |e: std::io::Error| CallError::Usage(format!("{}: {e}", output.display()));
    std::fs::create_dir_all(output.join("blobs/sha256")).map_err(usage)?;
    for image in images {
        super::prefetch::run(client, image, platform, false, terminal).await?;
        let mut query = form_urlencoded::Serializer::new(String::new());
        query.append_pair("image", image);
        if let Some(platform) = platform {
            query.append_pair("platform", platform);
        }
        let path = format!("/export?{}", query.finish());
        let empty = http_body_util::Empty::new().map_err(|never| match never {}).boxed();
        let resp = client.send(Method::POST, &path, LAYOUT_TAR, empty, EXPORT_TIMEOUT).await?;
        let reader = BodyReader::new(resp.into_body(), CHUNKS_IN_FLIGHT);
        let dir = output.to_owned();
        let added = tokio::task::spawn_blocking(move || unpack(reader, &dir))
            .await
            .map_err(|e| CallError::Protocol(format!("unpacking failed: {e}")))??;
        println!("exported {image} into {} ({added})", output.display());
    }
    Ok(())
}

/// Unpacks one image's layout tar into `dir`: blobs it lacks (written
/// beside and renamed, so a cut-off export leaves no partial blob), and
/// the image added to `index.json` (replacing one of the same name).
fn unpack(reader: BodyReader, dir: &Path) -> Result<String, CallError> {
    let failed = |what: &str, e: &dyn std::fmt::Display| CallError::Protocol(format!("{what}: {e}"));
    let mut archive = tar::Archive::new(reader);
    let mut incoming = None;
    // Files newly written, by digest hex, with their sizes: manifests and
    // blobs alike, told apart once index.json is read.
    let mut written: Vec<(String, u64)> = Vec::new();
    for entry in archive.entries().map_err(|e| failed("the export", &e))? {
        let mut entry = entry.map_err(|e| failed("the export was cut off", &e))?;
        let path = entry.path().map_err(|e| failed("the export", &e))?.into_owned();
        if path.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(CallError::Protocol(format!("the export holds a path outside the layout: {}", path.display())));
        }
        match path.to_str() {
            Some("oci-layout") => {
                std::fs::write(dir.join("oci-layout"), OCI_LAYOUT).map_err(|e| failed("oci-layout", &e))?
            }
            Some("index.json") => {
                let mut json = Vec::new();
                std::io::Read::read_to_end(&mut entry, &mut json).map_err(|e| failed("index.json", &e))?;
                incoming = Some(LayoutIndex::parse(&json).map_err(|e| failed("index.json", &e))?);
            }
            Some(name) if name.starts_with("blobs/sha256/") => {
                let target = dir.join(name);
                if target.exists() {
                    continue;
                }
                let mut temp =
                    tempfile::NamedTempFile::new_in(dir.join("blobs/sha256")).map_err(|e| failed(name, &e))?;
                let size = std::io::copy(&mut entry, &mut temp).map_err(|e| failed("the export was cut off", &e))?;
                temp.as_file().sync_all().map_err(|e| failed(name, &e))?;
                temp.persist(&target).map_err(|e| failed(name, &e.error))?;
                written.push((name.trim_start_matches("blobs/sha256/").to_owned(), size));
            }
            _ => {}
        }
    }
    let incoming = incoming.ok_or_else(|| CallError::Protocol("the export has no index.json".into()))?;
    let manifests = manifest_hexes(dir, &incoming);
    let (new_manifests, new_blobs): (Vec<_>, Vec<_>) = written.iter().partition(|(hex, _)| manifests.contains(hex));
    let index_path = dir.join("index.json");
    let mut index = match std::fs::read(&index_path) {
        Ok(json) => LayoutIndex::parse(&json).map_err(|e| failed(&index_path.display().to_string(), &e))?,
        Err(_) => LayoutIndex::default(),
    };
    for image in incoming.manifests {
        let name = |d: &crate::oci::layout::Descriptor| d.annotations.get(CONTAINERD_NAME).cloned();
        let new_name = name(&image);
        index.manifests.retain(|d| new_name.is_none() || name(d) != new_name);
        // Two images under one tag would make skopeo's oci:DIR:TAG ambiguous.
        if let Some(tag) = image.annotations.get(REF_NAME) {
            if index.manifests.iter().any(|d| d.annotations.get(REF_NAME) == Some(tag)) {
                eprintln!(
                    "larder export: note: {} already holds an image tagged {tag:?}; skopeo's oci:DIR:{tag} would be ambiguous",
                    dir.display()
                );
            }
        }
        index.manifests.push(image);
    }
    let json = serde_json::to_vec_pretty(&index).map_err(|e| failed("index.json", &e))?;
    let mut temp = tempfile::NamedTempFile::new_in(dir).map_err(|e| failed("index.json", &e))?;
    temp.write_all(&json).and_then(|()| temp.as_file().sync_all()).map_err(|e| failed("index.json", &e))?;
    temp.persist(&index_path).map_err(|e| failed("index.json", &e.error))?;
    let bytes = |files: &[&(String, u64)]| crate::server::admin::status_page::bytes(files.iter().map(|(_, n)| n).sum());
    let plural = |n: usize, one: &str| if n == 1 { format!("{n} new {one}") } else { format!("{n} new {one}s") };
    Ok(format!(
        "{}, {}; {}",
        plural(new_blobs.len(), "blob"),
        bytes(&new_blobs),
        plural(new_manifests.len(), "manifest")
    ))
}

/// The digest hexes of the manifests an exported image is made of: those
/// index.json names and, for an index, its children (read from `dir`).
fn manifest_hexes(dir: &Path, index: &LayoutIndex) -> std::collections::HashSet<String> {
    let mut found = std::collections::HashSet::new();
    let mut next: Vec<String> = index.manifests.iter().map(|d| d.digest.clone()).collect();
    while let Some(digest) = next.pop() {
        let Some(hex) = digest.strip_prefix("sha256:").map(str::to_owned) else { continue };
        if !found.insert(hex.clone()) {
            continue;
        }
        let Ok(bytes) = std::fs::read(dir.join("blobs/sha256").join(&hex)) else { continue };
        if let Ok((_, refs)) = crate::oci::inspect_manifest(&bytes, None) {
            next.extend(refs.manifests.iter().map(|d| d.to_string()));
        }
    }
    found
}

/// `larder import PATH [--as UPSTREAM/REPO]`: on the stopped cache folder
/// of `config`, or through `client` when larder runs.
pub async fn import(
    config: &Config,
    client: impl FnOnce() -> Result<AdminClient, CallError>,
    path: &Path,
    as_name: Option<&str>,
) -> Result<(), CallError> {
    let is_dir = std::fs::metadata(path).map_err(|e| CallError::Usage(format!("{}: {e}", path.display())))?.is_dir();
    let imported = match Cache::open(config.cache.clone()).await {
        Ok(cache) => {
            let upstreams = Upstreams::new(config).map_err(CallError::Usage)?;
            let source = if is_dir {
                LayoutSource::Dir(path.to_owned())
            } else {
                let file =
                    std::fs::File::open(path).map_err(|e| CallError::Usage(format!("{}: {e}", path.display())))?;
                LayoutSource::Tar(Box::new(file))
            };
            let staged = cache.stage_layout(source).await.map_err(refused)?;
            let targets = targets(&upstreams, &staged.index, as_name).map_err(refused)?;
            let imported = cache.import(staged, &targets).await.map_err(refused)?;
            println!("imported into {} (larder is not running)", config.cache.dir.display());
            imported
        }
        Err(Error::CacheInUse(_)) => {
            let client = client()?;
            let mut query = form_urlencoded::Serializer::new(String::new());
            if let Some(name) = as_name {
                query.append_pair("as", name);
            }
            let body = layout_tar(path.to_owned(), is_dir);
            let resp = client
                .send(Method::POST, &format!("/import?{}", query.finish()), "application/json", body, IMPORT_TIMEOUT)
                .await?;
            let answer = read_body(resp.into_body()).await?;
            println!("imported through {}", client.base());
            serde_json::from_slice(&answer).map_err(|e| CallError::Protocol(format!("the answer is not JSON: {e}")))?
        }
        Err(e) => return Err(CallError::Usage(format!("{}: {e}", config.cache.dir.display()))),
    };
    report(&imported);
    Ok(())
}

fn refused(e: Error) -> CallError {
    CallError::Protocol(e.to_string())
}

fn report(imported: &Imported) {
    println!(
        "{} {}: {} manifests, {} blobs, {}",
        imported.images,
        if imported.images == 1 { "image" } else { "images" },
        imported.manifests,
        imported.blobs,
        crate::server::admin::status_page::bytes(imported.bytes)
    );
    if imported.missing_platforms > 0 {
        println!(
            "{} platforms of a multi-platform image are not in the layout: pulls of them go upstream",
            imported.missing_platforms
        );
    }
}

/// The layout at `path` as a tar request body: a folder tarred on the fly
/// (its `oci-layout`, `index.json` and `blobs/`), an archive as it is.
fn layout_tar(path: PathBuf, is_dir: bool) -> RequestBody {
    let (writer, body) = crate::body::written_body(CHUNKS_IN_FLIGHT);
    tokio::task::spawn_blocking(move || {
        let mut out = std::io::BufWriter::with_capacity(UPLOAD_CHUNK, writer.clone());
        let written = if is_dir {
            let mut tar = tar::Builder::new(&mut out);
            tar.follow_symlinks(false);
            ["oci-layout", "index.json"]
                .iter()
                .try_for_each(|name| tar.append_path_with_name(path.join(name), name))
                .and_then(|()| tar.append_dir_all("blobs", path.join("blobs")))
                .and_then(|()| tar.finish())
        } else {
            std::fs::File::open(&path).and_then(|mut f| std::io::copy(&mut f, &mut out).map(|_| ()))
        };
        if let Err(e) = written.and_then(|()| out.flush()) {
            writer.fail(Box::new(e));
        }
    });
    body
}
