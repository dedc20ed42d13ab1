//! The admin listener's operations: `POST /prefetch?image=REF[&platform=os/arch][&referrers=true]`
//! and `POST /purge?upstream=NAME[&repo=REPO]`. Callers have passed the
//! token check already (see [`super::auth`]).
//!
//! A prefetch answers with its JSON summary once done, or, when the client
//! sends `Accept: application/x-ndjson`, streams one JSON object per line
//! as it goes: `{"event":"progress",…}` at most every
//! [`PROGRESS_INTERVAL`] while something moves and at least every
//! [`HEARTBEAT_INTERVAL`] (so that neither side's idle timeout cuts a long
//! download), then `{"event":"done",…summary}` or
//! `{"event":"error","status":…,"errors":[…]}`. Until the manifests are
//! read the response is held back, so an unknown image or upstream is a
//! plain 4xx/5xx with the OCI envelope. A client that goes away stops the
//! prefetch; blobs already downloading finish and stay cached.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Method, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Frame;
use tokio::sync::watch;

use crate::body::{self, Body, BoxError};
use crate::cache::prefetch::{PrefetchProgress, Prefetched};
use crate::error::Error;
use crate::oci::{Reference, RepoName};
use crate::server::routes::{self, Endpoint, Parsed, Route};
use crate::state::App;
use crate::upstream::Upstreams;

/// Media type of the streamed prefetch progress.
pub const NDJSON: &str = "application/x-ndjson";
/// Shortest time between two progress lines.
pub const PROGRESS_INTERVAL: Duration = Duration::from_millis(250);
/// Longest time without a line: well below the watchdog's idle timeout.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(body::full(Bytes::from(value.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// The query parameters of an admin request.
pub struct Params(Vec<(String, String)>);

impl Params {
    pub fn of(uri: &http::Uri) -> Params {
        Params(form_urlencoded::parse(uri.query().unwrap_or("").as_bytes()).into_owned().collect())
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// Resolves `image` (`[registry/]repo[:tag|@digest]`) as a client's pull
/// would be routed: a registry that names a configured upstream selects it,
/// anything else goes to the default upstream.
pub fn route_image(upstreams: &Upstreams, image: &str) -> Result<(Route, Reference), Error> {
    let (name, reference) = match image.split_once('@') {
        Some((name, digest)) => (name, digest.to_owned()),
        None => match image.rsplit_once(':').filter(|(_, tag)| !tag.contains('/')) {
            Some((name, tag)) => (name, tag.to_owned()),
            None => (image, "latest".to_owned()),
        },
    };
    let uri: http::Uri = format!("/v2/{name}/manifests/{reference}")
        .parse()
        .map_err(|_| Error::NameInvalid(crate::oci::NameError::BadComponent(image.chars().take(64).collect())))?;
    match routes::parse(&Method::GET, &uri, upstreams)? {
        Parsed::Repo(route) => match route.endpoint.clone() {
            Endpoint::Manifest(reference) => Ok((route, reference)),
            _ => Err(Error::NotFound),
        },
        Parsed::Base => Err(Error::NotFound),
    }
}

/// A manifest upstream lacks, named for the operator who asked: which
/// upstream and repository the image was routed to, and as what it was
/// asked when that differs (`postgres:16` is `library/postgres:16` of the
/// default upstream).
pub fn named_unknown(e: Error, asked: &str, route: &Route, reference: &Reference) -> Error {
    if !matches!(e, Error::ManifestUnknown | Error::NameUnknown) {
        return e;
    }
    let routed = match reference {
        Reference::Tag(tag) => format!("{}:{tag}", route.repo),
        Reference::Digest(digest) => format!("{}@{digest}", route.repo),
    };
    let name = route.upstream.name();
    let mut message = format!("manifest unknown: upstream {name:?} has no {routed}");
    if asked != routed && asked != format!("{name}/{routed}") {
        message.push_str(&format!(" ({asked} is routed there)"));
    }
    Error::ImageUnknown(message)
}

/// Aborts the prefetch task when the response (or the handler) is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<Result<Prefetched, Error>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `POST /prefetch`.
pub async fn prefetch(app: &Arc<App>, params: &Params, stream: bool) -> Result<Response<Body>, Error> {
    let image = params.get("image").ok_or(Error::NameInvalid(crate::oci::NameError::Empty))?.to_owned();
    let platform = params.get("platform").map(str::to_owned);
    let referrers = matches!(params.get("referrers"), Some("1" | "true"));
    let (route, reference) = route_image(&app.upstreams, &image)?;
    let (tx, mut rx) = watch::channel(PrefetchProgress::default());
    let task = {
        let app = Arc::clone(app);
        tokio::spawn(async move {
            use crate::cache::prefetch::{fetch, plan, prefetch_referrers};
            let cache = &app.cache;
            let (upstream, repo) = (&route.upstream, &route.repo);
            let plan = plan(cache, upstream, repo, &reference, platform.as_deref())
                .await
                .map_err(|e| named_unknown(e, &image, &route, &reference))?;
            let mut report = fetch(cache, upstream, repo, &plan, &image, &tx).await?;
            if referrers {
                prefetch_referrers(cache, upstream, repo, &plan, &mut report).await?;
            }
            Ok(report)
        })
    };
    let mut task = AbortOnDrop(task);
    if !stream {
        let report = (&mut task.0).await.map_err(|e| Error::Internal(format!("prefetch task failed: {e}")))??;
        log_done(&report);
        return Ok(json(StatusCode::OK, &serde_json::json!(report)));
    }
    // Hold the response until the manifests are read: failures up to there
    // get their own status.
    loop {
        if rx.borrow_and_update().planned {
            break;
        }
        tokio::select! {
            biased;
            done = &mut task.0 => {
                let report = done.map_err(|e| Error::Internal(format!("prefetch task failed: {e}")))??;
                // Done before the first progress was seen (nothing to fetch).
                log_done(&report);
                let lines = Bytes::from([progress_line(&rx.borrow()), done_line(&report)].concat());
                return Ok(ndjson(futures_util::stream::iter([Ok::<_, BoxError>(Frame::data(lines))]).boxed()));
            }
            _ = rx.changed() => {}
        }
    }
    Ok(ndjson(progress_stream(task, rx).boxed()))
}

fn log_done(report: &Prefetched) {
    tracing::info!(image = %report.image, blobs = report.blobs, fetched = report.fetched, bytes = report.bytes, "prefetched");
}

fn ndjson(frames: futures_util::stream::BoxStream<'static, Result<Frame<Bytes>, BoxError>>) -> Response<Body> {
    let mut resp = Response::new(http_body_util::StreamBody::new(frames).boxed_unsync());
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(NDJSON));
    resp
}

fn line(value: serde_json::Value) -> Bytes {
    let mut text = value.to_string();
    text.push('\n');
    Bytes::from(text)
}

fn progress_line(p: &PrefetchProgress) -> Bytes {
    let mut value = serde_json::json!(p);
    value["event"] = "progress".into();
    line(value)
}

fn done_line(report: &Prefetched) -> Bytes {
    let mut value = serde_json::json!(report);
    value["event"] = "done".into();
    line(value)
}

/// The error as its OCI envelope, in a line: `{"event":"error","status":502,"errors":[…]}`.
async fn error_line(e: Error) -> Bytes {
    tracing::warn!(error = %e, "prefetch failed");
    let resp = e.into_response(false);
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let mut value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_else(|_| serde_json::json!({}));
    value["event"] = "error".into();
    value["status"] = status.into();
    line(value)
}

/// Progress lines until the prefetch ends, then its outcome.
fn progress_stream(
    task: AbortOnDrop,
    rx: watch::Receiver<PrefetchProgress>,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>> + Send + 'static {
    let first = progress_line(&rx.borrow());
    let state = Some((task, rx));
    futures_util::stream::once(async move { Ok(Frame::data(first)) }).chain(futures_util::stream::unfold(
        state,
        |state| async move {
            let (mut task, mut rx) = state?;
            let changed = tokio::select! {
                biased;
                done = &mut task.0 => {
                    let last = progress_line(&rx.borrow());
                    let outcome = match done.map_err(|e| Error::Internal(format!("prefetch task failed: {e}"))) {
                        Ok(Ok(report)) => {
                            log_done(&report);
                            done_line(&report)
                        }
                        Ok(Err(e)) | Err(e) => error_line(e).await,
                    };
                    return Some((Ok(Frame::data([last, outcome].concat().into())), None));
                }
                changed = tokio::time::timeout(HEARTBEAT_INTERVAL, rx.changed()) => changed,
            };
            if changed.is_ok() {
                // Let more progress gather before the next line. (The task
                // is not awaited here: a finished JoinHandle must not be
                // polled again in the next round.)
                tokio::time::sleep(PROGRESS_INTERVAL).await;
            }
            let progress = progress_line(&rx.borrow_and_update());
            Some((Ok(Frame::data(progress)), Some((task, rx))))
        },
    ))
}

/// `POST /purge`.
pub async fn purge(app: &App, params: &Params) -> Result<Response<Body>, Error> {
    let name = params.get("upstream").ok_or(Error::NotFound)?;
    // The canonical name, so that an alias purges the same rows.
    let upstream = app.upstreams.get(name).ok_or_else(|| Error::UnknownUpstream(name.to_owned()))?;
    let repo = params.get("repo").map(|r| r.parse::<RepoName>().map_err(Error::NameInvalid)).transpose()?;
    // Here, then on every other replica of a cluster (listed in `replicas`).
    let purged = app.cache.purge_everywhere(upstream.name(), repo.as_ref()).await?;
    tracing::info!(
        upstream = upstream.name(),
        repo = repo.as_ref().map_or("every repository", |r| r.as_str()),
        tags = purged.here.tags,
        members = purged.here.members,
        blobs = purged.here.blobs,
        manifests = purged.here.manifests,
        bytes = purged.here.bytes,
        "purged"
    );
    Ok(json(StatusCode::OK, &serde_json::json!(purged)))
}
