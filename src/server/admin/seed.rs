//! Offline seeding through the admin listener (token-guarded like every
//! POST): `POST /export?image=REF[&platform=os/arch]` answers an OCI image
//! layout as a tar (the image is fetched into the cache first, as a
//! prefetch would), and `POST /import[?as=UPSTREAM/REPO]` takes one as its
//! body and loads it into the cache, all or nothing
//! ([`crate::cache::import`]). `larder export` and `larder import` are
//! their clients.

use std::io::Write;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::watch;

use super::operations::{Params, named_unknown, route_image};
use crate::body::{self, Body};
use crate::cache::import::{ImportTarget, Imported, LayoutSource};
use crate::cache::prefetch::{self, PrefetchProgress};
use crate::error::Error;
use crate::oci::layout::{ImageName, LayoutIndex};
use crate::oci::{NameError, Reference};
use crate::state::App;
use crate::upstream::Upstreams;

/// Media type of a tar of an OCI image layout.
pub const LAYOUT_TAR: &str = "application/x-tar";
/// Bytes the layout writer hands to the response at once.
const EXPORT_CHUNK: usize = 256 << 10;
/// Chunks in flight between the layout writer and the response.
const EXPORT_CHUNKS_IN_FLIGHT: usize = 8;
/// Request body chunks in flight between the connection and the importer.
const IMPORT_CHUNKS_IN_FLIGHT: usize = 16;

/// `POST /export`.
pub async fn export(app: &Arc<App>, params: &Params) -> Result<Response<Body>, Error> {
    let image = params.get("image").ok_or(Error::NameInvalid(NameError::Empty))?.to_owned();
    let platform = params.get("platform").map(str::to_owned);
    let (route, reference) = route_image(&app.upstreams, &image)?;
    let (cache, upstream, repo) = (&app.cache, &route.upstream, &route.repo);
    let plan = prefetch::plan(cache, upstream, repo, &reference, platform.as_deref())
        .await
        .map_err(|e| named_unknown(e, &image, &route, &reference))?;
    let (progress, _) = watch::channel(PrefetchProgress::default());
    let fetched = prefetch::fetch(cache, upstream, repo, &plan, &image, &progress).await?;
    let name = format!("{}/{}", upstream.name(), repo);
    let index = crate::cache::export::layout_index(&plan, platform.is_some(), &name, &reference);
    tracing::info!(image, blobs = fetched.blobs, bytes = fetched.bytes, "exporting an image layout");

    let (writer, body) = body::written_body(EXPORT_CHUNKS_IN_FLIGHT);
    let cache = Arc::clone(cache);
    tokio::task::spawn_blocking(move || {
        let mut out = std::io::BufWriter::with_capacity(EXPORT_CHUNK, writer.clone());
        let written = cache
            .write_layout(&plan, &index, &mut out)
            .and_then(|()| out.flush().map_err(|e| Error::Internal(format!("writing the layout: {e}"))));
        if let Err(e) = written {
            tracing::warn!(image, error = %e, "export cut off");
            // The response ends with an error, never as a short tar.
            writer.fail(Box::new(e));
        }
    });
    let mut resp = Response::new(body.boxed_unsync());
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(LAYOUT_TAR));
    Ok(resp)
}

/// `POST /import`.
pub async fn import(app: &Arc<App>, params: &Params, body: Incoming) -> Result<Response<Body>, Error> {
    let as_name = params.get("as").map(str::to_owned);
    let reader = crate::body::BodyReader::new(body, IMPORT_CHUNKS_IN_FLIGHT);
    let staged = app.cache.stage_layout(LayoutSource::Tar(Box::new(reader))).await;
    let staged = staged?;
    let targets = targets(&app.upstreams, &staged.index, as_name.as_deref())?;
    let imported = app.cache.import(staged, &targets).await?;
    log_imported(&imported);
    let mut resp = Response::new(body::full(Bytes::from(serde_json::to_vec(&imported).unwrap_or_default())));
    *resp.status_mut() = StatusCode::OK;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(resp)
}

pub fn log_imported(imported: &Imported) {
    tracing::info!(
        images = imported.images,
        manifests = imported.manifests,
        blobs = imported.blobs,
        bytes = imported.bytes,
        missing_platforms = imported.missing_platforms,
        "imported an image layout"
    );
}

/// Where each image of a layout goes: `as_name` (`UPSTREAM/REPO`) for
/// every image, else the whole reference each one is named by, routed
/// like a pull (a first component that names an upstream selects it).
pub fn targets(upstreams: &Upstreams, index: &LayoutIndex, as_name: Option<&str>) -> Result<Vec<ImportTarget>, Error> {
    let invalid = |m: String| Error::LayoutInvalid(m);
    let images = index.images().map_err(|e| invalid(e.to_string()))?;
    if images.is_empty() {
        return Err(invalid("index.json lists no image".into()));
    }
    images
        .into_iter()
        .map(|image| {
            let named = image.name.as_deref().map(ImageName::parse);
            let (name, tag) = match (as_name, named) {
                (Some(name), Some(ImageName::TagOnly(tag))) => (name.to_owned(), Some(tag)),
                (Some(name), Some(ImageName::Whole { tag, .. })) => (name.to_owned(), tag),
                (Some(name), None) => (name.to_owned(), None),
                (None, Some(ImageName::Whole { name, tag })) => (name, tag),
                (None, _) => {
                    return Err(invalid(format!(
                        "{} is not named with its repository in index.json: say where it goes with --as UPSTREAM/REPO",
                        image.digest
                    )));
                }
            };
            let reference = match &tag {
                Some(tag) => format!("{name}:{tag}"),
                None => format!("{name}@{}", image.digest),
            };
            let (route, parsed) = route_image(upstreams, &reference)?;
            let tag = match parsed {
                Reference::Tag(tag) => Some(tag),
                Reference::Digest(_) => None,
            };
            Ok(ImportTarget { upstream: route.upstream.name().to_owned(), repo: route.repo, tag, image })
        })
        .collect()
}
