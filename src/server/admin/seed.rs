//! Offline seeding through the admin listener (token-guarded like every
//! POST): `POST /export?image=REF[&platform=os/arch]` answers an OCI image
//! layout as a tar (the image is fetched into the cache first, as a
//! prefetch would), and `POST /import[?as=UPSTREAM/REPO]` takes one as its
//! body and loads it into the cache, all or nothing, within
//! `cache.max_import_size` ([`crate::cache::import`]). `larder export` and `larder import` are
//! their clients.

use std::io::Write;
use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::watch;

use super::operations::{Params, named_unknown, route_image};
use crate::body::{self, Body};
use crate::cache::import::{ImportTarget, ImportWatch, Imported, LayoutSource, Phase};
use crate::cache::prefetch::{self, PrefetchProgress};
use crate::error::Error;
use crate::oci::layout::{ImageName, LayoutIndex};
use crate::oci::{NameError, RepoName, Tag};
use crate::server::watchdog::{Activity, Working};
use crate::state::App;
use crate::upstream::{Upstream, Upstreams};

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

/// What `POST /import` does while it works: while it waits for its turn
/// and from the end of the upload on, the connection is marked as working,
/// so that the queue, the checks and the commit take the time they need
/// rather than the idle timeout.
struct HoldWhileWorking {
    activity: Arc<Activity>,
    working: Option<Working>,
}

impl ImportWatch for HoldWhileWorking {
    fn phase(&mut self, phase: Phase, _what: &str, _total: u64) {
        match phase {
            // The upload moves bytes: the idle timeout watches it.
            Phase::Reading => self.working = None,
            _ if self.working.is_none() => self.working = Some(self.activity.working()),
            _ => {}
        }
    }
}

/// `POST /import[?as=UPSTREAM/REPO]`: a layout's tar as the body, at
/// most `cache.max_import_size` bytes (`413` above, before a byte is read
/// when `Content-Length` says so). A destination policy refuses is refused
/// before the body is read (`as`), or as soon as `index.json` is (the
/// images' own names). The answer lists where each image went.
pub async fn import(
    app: &Arc<App>,
    params: &Params,
    headers: &HeaderMap,
    activity: Arc<Activity>,
    body: Incoming,
) -> Result<Response<Body>, Error> {
    let max = app.cache.max_import_size();
    if let Some(len) = crate::upstream::content_length(headers).filter(|len| *len > max) {
        return Err(Error::ImportTooLarge(format!(
            "the layout is {len} bytes, over cache.max_import_size ({max} bytes); nothing imported"
        )));
    }
    let as_name = params.get("as").map(str::to_owned);
    if let Some(name) = &as_name {
        destination(&app.upstreams, name, "as")?;
    }
    let reader = crate::body::BodyReader::new(body, IMPORT_CHUNKS_IN_FLIGHT);
    let resolver = {
        let app = Arc::clone(app);
        Box::new(move |index: &LayoutIndex| targets(&app.upstreams, index, as_name.as_deref()))
    };
    let watch = Box::new(HoldWhileWorking { activity, working: None });
    let imported = app.cache.import_layout(LayoutSource::Tar(Box::new(reader)), resolver, watch).await?;
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
        confirmed = imported.confirmed,
        missing_platforms = imported.missing_platforms,
        destinations = %imported.destinations.join(" "),
        "imported an image layout"
    );
}

/// Where each image of a layout goes. With `as_name` (`UPSTREAM/REPO`,
/// the operator's), every image goes there, keeping only the tag its
/// annotation gives; without it, each image's whole name from its
/// annotations (`upstream/repo:tag`, as `larder export` and `ctr export`
/// write them). Either way the text is held to a name's characters before
/// it is routed (see [`destination`]), a tag must be a plain tag, and
/// repository policy refuses what it refuses.
pub fn targets(upstreams: &Upstreams, index: &LayoutIndex, as_name: Option<&str>) -> Result<Vec<ImportTarget>, Error> {
    let invalid = |m: String| Error::LayoutInvalid(m);
    let images = index.images().map_err(|e| invalid(e.to_string()))?;
    if images.is_empty() {
        return Err(invalid("index.json lists no image".into()));
    }
    let fixed = as_name.map(|name| destination(upstreams, name, "--as")).transpose()?;
    images
        .into_iter()
        .map(|image| {
            let named = image.name.as_deref().map(ImageName::parse);
            let ((upstream, repo), tag) = match (&fixed, named) {
                (Some(to), Some(ImageName::TagOnly(tag))) => (to.clone(), Some(tag)),
                (Some(to), Some(ImageName::Whole { tag, .. })) => (to.clone(), tag),
                (Some(to), None) => (to.clone(), None),
                (None, Some(ImageName::Whole { name, tag })) => {
                    (destination(upstreams, &name, &format!("index.json's name for {}", image.digest))?, tag)
                }
                (None, _) => {
                    return Err(invalid(format!(
                        "{} is not named with its repository in index.json: say where it goes with --as UPSTREAM/REPO",
                        image.digest
                    )));
                }
            };
            let tag = match tag {
                None => None,
                Some(text) => Some(text.parse::<Tag>().map_err(|_| {
                    let shown: String = text.chars().take(140).collect();
                    invalid(format!("index.json tags {} {shown:?}, which is not a tag", image.digest))
                })?),
            };
            Ok(ImportTarget { upstream, repo, tag, image })
        })
        .collect()
}

/// `UPSTREAM/REPO` (`--as`, or a whole name from a layout without its
/// tag), routed as a pull would be, after its text is held to what a
/// registry host and repository name may hold (letters, digits, `.`, `_`,
/// `-`, `/`, and `:` for a host's port): no query such as `?ns=`, no
/// fragment, escape or space reaches the router, so only the name picks
/// the upstream, and a host that is no configured upstream is refused.
pub fn destination(upstreams: &Upstreams, name: &str, what: &str) -> Result<(Arc<Upstream>, RepoName), Error> {
    let shown: String = name.chars().take(140).collect();
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._-/:".contains(c);
    if name.is_empty() || !name.chars().all(allowed) {
        return Err(Error::LayoutInvalid(format!("{what} {shown:?} is not UPSTREAM/REPO")));
    }
    if name.rsplit('/').next().is_some_and(|last| last.contains(':')) {
        return Err(Error::LayoutInvalid(format!(
            "{what} {shown:?} names a tag: give the repository only (each image keeps its own tag)"
        )));
    }
    let (route, _) = route_image(upstreams, &format!("{name}:latest"))?;
    Ok((route.upstream, route.repo))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::oci::layout::{CONTAINERD_NAME, Descriptor, REF_NAME};

    fn upstreams() -> Upstreams {
        let toml = "[[upstream]]\nname = \"u.test\"\nurl = \"https://u.test\"\ndefault = true\n\
                    [[upstream]]\nname = \"other.local\"\nurl = \"https://other.local\"\n\
                    deny = [\"private/**\"]\n";
        Upstreams::new(&Config::parse(toml, "t.toml", None).unwrap()).unwrap()
    }

    fn index(annotation: (&str, &str)) -> LayoutIndex {
        let mut annotations = std::collections::BTreeMap::new();
        annotations.insert(annotation.0.to_owned(), annotation.1.to_owned());
        let descriptor = Descriptor {
            media_type: "application/vnd.oci.image.manifest.v1+json".into(),
            digest: format!("sha256:{}", "a".repeat(64)),
            size: 2,
            annotations,
        };
        LayoutIndex { manifests: vec![descriptor], ..LayoutIndex::default() }
    }

    fn landed(annotation: (&str, &str), as_name: Option<&str>) -> Result<String, String> {
        let t = targets(&upstreams(), &index(annotation), as_name).map_err(|e| e.to_string())?;
        Ok(format!("{}/{}:{}", t[0].upstream.name(), t[0].repo, t[0].tag.as_ref().map_or("-", |t| t.as_str())))
    }

    #[test]
    fn as_decides_the_destination_and_nothing_in_the_layout_picks_another_upstream() {
        assert_eq!(landed((REF_NAME, "v1"), Some("team-a/app")), Ok("u.test/team-a/app:v1".into()));
        let ns = landed((REF_NAME, "v1?ns=other.local"), Some("team-a/app")).unwrap_err();
        assert!(ns.contains("which is not a tag"), "{ns}");
        let whole = landed((CONTAINERD_NAME, "other.local/team-a/app:v1"), Some("team-a/app"));
        assert_eq!(whole, Ok("u.test/team-a/app:v1".into()), "--as wins over the layout's whole name");
        let query = landed((CONTAINERD_NAME, "team-a/app?ns=other.local:v1"), None).unwrap_err();
        assert!(query.contains("is not UPSTREAM/REPO"), "{query}");
        let unknown = landed((CONTAINERD_NAME, "evil.example/team-a/app:v1"), None).unwrap_err();
        assert!(unknown.contains("evil.example"), "{unknown}");
        assert_eq!(
            landed((CONTAINERD_NAME, "other.local/team-a/app:v1"), None),
            Ok("other.local/team-a/app:v1".into())
        );
        let denied = landed((CONTAINERD_NAME, "other.local/private/b:v1"), None).unwrap_err();
        assert!(denied.contains("deny rule"), "{denied}");
        assert!(landed((REF_NAME, "v1"), Some("team-a/app:v2")).unwrap_err().contains("names a tag"));
        assert!(landed((REF_NAME, "v1"), Some("team-a/app?ns=other.local")).is_err());
    }
}
