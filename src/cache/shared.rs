//! The shared tier: an S3-compatible bucket (Garage, Ceph RGW, MinIO, AWS
//! S3) that every replica reads before it costs upstream anything, and
//! uploads verified content to. Objects are keyed by digest,
//! `<prefix>/blobs/sha256/<hex>` and `<prefix>/manifests/sha256/<hex>` (a
//! manifest's media type is its `Content-Type`), so an upload is
//! idempotent and two replicas uploading the same blob race harmlessly.
//! The store is never used as a lock: Garage ignores conditional PUTs.
//!
//! The client is `object_store`'s S3 store with a short retry policy and
//! short connect timeout: the shared tier is an optimisation, and a dead
//! store must cost a request well under a second before larder moves on
//! to a peer or upstream, not the crate's default ten retries.
//!
//! What this module checks: a manifest read back is hashed here; an upload
//! from a committed file is hashed while it is read, and a file that no
//! longer matches its digest is not uploaded. A blob read back is hashed by
//! the caller as it streams (it tees into a fill).

use std::ops::{Bound, Range, RangeBounds};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use futures_util::stream::{BoxStream, StreamExt, TryStreamExt};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{
    Attribute, Attributes, BackoffConfig, ClientOptions, GetOptions, GetRange, MultipartUpload, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, RetryConfig,
};

use crate::blocking::blocking;
use crate::config::{SharedConfig, SharedCredentials};
use crate::metrics::metrics;
use crate::oci::{Digest, Hasher, MAX_MANIFEST_SIZE, MediaType};

/// Time allowed to open a TCP (and TLS) connection to the store. A store
/// in the same cluster or region connects in milliseconds; a blackholed
/// one costs this much per attempt.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest wait for any read from the store's connection (response
/// headers or the next body bytes). Generous, because a Garage cluster
/// that just lost a node answers its first request after ~3 s; a request
/// stalled longer than this fails and the caller moves on. There is no
/// overall request timeout: a large blob may take long to stream.
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest wait for a lookup (HEAD, a GET until its headers, a whole
/// manifest) before it counts as failed and the caller moves on. Measured
/// on Garage 2.5: after a storage node is SIGKILLed, the first requests
/// that need it stall about 8 s until Garage notices the dead connection;
/// a client should not wait that out on a miss.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);
/// Retries of a failed request (connection refused, 5xx, 429).
pub const MAX_RETRIES: usize = 2;
/// No retry starts after this much time since the first attempt, so a dead
/// store costs about a second at most, not object_store's default minutes.
pub const RETRY_TIMEOUT: Duration = Duration::from_secs(1);
/// First pause before a retry; doubled (with jitter) up to [`MAX_BACKOFF`].
pub const INIT_BACKOFF: Duration = Duration::from_millis(50);
pub const MAX_BACKOFF: Duration = Duration::from_millis(400);
/// Files up to this size are uploaded with one PUT; larger ones as a
/// multipart upload streamed from the file.
pub const SINGLE_PUT_MAX: u64 = 8 << 20;
/// Part size of a multipart upload (S3 needs at least 5 MiB but the last).
/// Raised for huge files so that no upload needs more than [`MAX_PARTS`].
pub const PART_SIZE: u64 = 8 << 20;
/// S3's limit on the parts of one multipart upload.
pub const MAX_PARTS: u64 = 10_000;
/// Parts of one upload in flight at once; memory per upload is about
/// (this + 1) x the part size.
pub const PARTS_IN_FLIGHT: usize = 2;
/// How long lookups skip the store after one timed out or failed: the
/// first pause, doubled per failure in a row up to [`BREAKER_MAX`]. A
/// dead store then costs one [`LOOKUP_TIMEOUT`] per pause, not one per
/// miss (and a client's retries do not multiply it); the first lookup
/// after a pause tries the store again, and one that answers closes the
/// breaker.
pub const BREAKER_MIN: Duration = Duration::from_secs(1);
/// Longest pause of lookups while the store keeps failing: how late a
/// store that came back is used again at worst.
pub const BREAKER_MAX: Duration = Duration::from_secs(30);
/// Longest wait for the store to abort a multipart upload that failed or
/// was given up; past it the parts are left to the bucket's lifecycle rule.
pub const ABORT_TIMEOUT: Duration = Duration::from_secs(5);
/// Deletions in flight at once during a `max_age` sweep.
const SWEEP_DELETES_IN_FLIGHT: usize = 8;
/// The key whose owner among the peers runs the `max_age` sweeper.
pub const SWEEPER_KEY: &str = "larder/shared-sweeper";
/// How often the `max_age` sweeper lists the prefix.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(3600);

/// How a cancellable upload ended without the object in the store.
#[derive(Debug)]
pub enum PutFailed<C> {
    /// The store, or the local file, failed.
    Store(SharedError),
    /// Given up because the stop future resolved (with this).
    Stopped(C),
}

impl<C> From<SharedError> for PutFailed<C> {
    fn from(e: SharedError) -> Self {
        PutFailed::Store(e)
    }
}

/// How talking to the shared store failed. Any of these means "not from
/// the shared tier this time": the caller moves on to a peer or upstream.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SharedError {
    /// The store refused, failed or could not be reached.
    #[error("shared store: {0}")]
    Store(String),
    /// What the store holds (or the local file) does not match its digest.
    #[error("{what} does not match its digest: {detail}")]
    Corrupt { what: String, detail: String },
    /// The committed local file could not be read.
    #[error("reading {path}: {detail}")]
    Local { path: String, detail: String },
    /// The `[shared]` settings cannot make a client.
    #[error("shared store settings: {0}")]
    Config(String),
}

/// What a shared object holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ObjectKind {
    Blob,
    Manifest,
}

impl ObjectKind {
    fn folder(self) -> &'static str {
        match self {
            ObjectKind::Blob => "blobs",
            ObjectKind::Manifest => "manifests",
        }
    }

    /// The `kind` label of metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectKind::Blob => "blob",
            ObjectKind::Manifest => "manifest",
        }
    }
}

/// A blob (or part of one) streaming from the shared store.
pub struct SharedBlob {
    /// The whole object's size.
    pub size: u64,
    /// The bytes `body` yields, as offsets into the object.
    pub range: Range<u64>,
    /// The bytes, unverified: hash them before serving or keeping them.
    pub body: BoxStream<'static, Result<Bytes, SharedError>>,
}

impl SharedBlob {
    /// The bytes as an HTTP body (what a fill reads its sources as); a
    /// store error ends it with that error, never cleanly.
    pub fn into_body(self) -> crate::body::Body {
        use http_body_util::BodyExt;
        let frames = self.body.map_ok(hyper::body::Frame::data).map_err(|e| Box::new(e) as crate::body::BoxError);
        http_body_util::StreamBody::new(frames).boxed_unsync()
    }
}

/// A manifest read back from the shared store; its digest was checked.
#[derive(Clone, Debug)]
pub struct SharedManifest {
    pub media_type: MediaType,
    pub bytes: Bytes,
}

/// What a `max_age` sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    pub listed: u64,
    pub deleted: u64,
}

/// Skips lookups for a growing pause after they fail (see [`BREAKER_MIN`]).
struct Breaker {
    min: Duration,
    max: Duration,
    // A std Mutex: held for a read or an update, never across `.await`.
    state: std::sync::Mutex<BreakerState>,
}

#[derive(Default)]
struct BreakerState {
    /// Lookups skip the store until then.
    open_until: Option<tokio::time::Instant>,
    /// Failures in a row.
    failures: u32,
}

impl Breaker {
    fn new(min: Duration, max: Duration) -> Breaker {
        Breaker { min, max, state: std::sync::Mutex::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BreakerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether lookups skip the store now.
    fn is_open(&self) -> bool {
        self.lock().open_until.is_some_and(|until| tokio::time::Instant::now() < until)
    }

    /// A lookup failed: skip the store for the next pause.
    fn failed(&self) {
        let pause = {
            let mut state = self.lock();
            state.failures = state.failures.saturating_add(1);
            let doublings = state.failures.saturating_sub(1).min(16);
            let pause = self.min.saturating_mul(1 << doublings).min(self.max);
            state.open_until = Some(tokio::time::Instant::now() + pause);
            pause
        };
        metrics().shared_down.set(1);
        tracing::warn!(skip_for = ?pause, "shared tier failing; lookups skip it for a while");
    }

    /// A lookup was answered (found or not): the store works.
    fn answered(&self) {
        let was_failing = {
            let mut state = self.lock();
            let was = state.failures > 0;
            *state = BreakerState::default();
            was
        };
        if was_failing {
            metrics().shared_down.set(0);
            tracing::info!("shared tier answers again");
        }
    }
}

/// The shared store client; cheap to share behind an `Arc`.
pub struct SharedStore {
    store: Arc<dyn ObjectStore>,
    /// See [`LOOKUP_TIMEOUT`].
    lookup_timeout: Duration,
    breaker: Breaker,
    bucket: String,
    /// `""` or `"a/b/"`: prepended to every key.
    prefix: String,
}

impl std::fmt::Debug for SharedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedStore(s3://{}/{})", self.bucket, self.prefix)
    }
}

fn store_err(e: object_store::Error) -> SharedError {
    SharedError::Store(e.to_string())
}

/// Counts one request by operation and result.
fn count<T>(op: &str, result: &Result<Option<T>, SharedError>) {
    let label = match result {
        Ok(Some(_)) => "ok",
        Ok(None) => "not_found",
        Err(_) => "error",
    };
    metrics().shared_requests.with_label_values(&[op, label]).inc();
}

/// A write's outcome, counted: any error (a missing bucket included) fails it.
fn written<T>(op: &str, result: Result<T, object_store::Error>) -> Result<T, SharedError> {
    let label = if result.is_ok() { "ok" } else { "error" };
    metrics().shared_requests.with_label_values(&[op, label]).inc();
    result.map_err(store_err)
}

/// `Ok(None)` for a missing object, the error otherwise.
fn found<T>(result: Result<T, object_store::Error>) -> Result<Option<T>, SharedError> {
    match result {
        Ok(v) => Ok(Some(v)),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(store_err(e)),
    }
}

impl SharedStore {
    /// A client for `[shared]`. Makes no request: a store that is down at
    /// start-up is a slow path, not a reason to refuse to start.
    pub fn new(config: &SharedConfig) -> Result<SharedStore, SharedError> {
        // reqwest (inside object_store) takes rustls' process default
        // provider; larder's is ring. Already installed is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut options = ClientOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_read_timeout(READ_TIMEOUT)
            .with_timeout_disabled()
            .with_user_agent(http::HeaderValue::from_static(crate::USER_AGENT));
        let builder = match &config.credentials {
            SharedCredentials::Static { access_key_id, secret_access_key, session_token } => {
                let builder = AmazonS3Builder::new()
                    .with_access_key_id(access_key_id.expose())
                    .with_secret_access_key(secret_access_key.expose());
                match session_token {
                    Some(token) => builder.with_token(token.expose()),
                    None => builder,
                }
            }
            // The `AWS_*` environment: object_store picks web identity,
            // container credentials or instance metadata from it, and
            // fetches temporary credentials again before they expire.
            SharedCredentials::Chain => AmazonS3Builder::from_env(),
        };
        let mut builder =
            builder.with_bucket_name(&config.bucket).with_region(&config.region).with_retry(RetryConfig {
                backoff: BackoffConfig { init_backoff: INIT_BACKOFF, max_backoff: MAX_BACKOFF, base: 2.0 },
                max_retries: MAX_RETRIES,
                retry_timeout: RETRY_TIMEOUT,
            });
        if let Some(endpoint) = &config.endpoint {
            // S3-compatible stores are addressed path-style (Garage needs a
            // root domain for virtual hosts); a plain-http endpoint must be
            // allowed explicitly or every request fails with "builder error".
            options = options.with_allow_http(endpoint.starts_with("http://"));
            builder = builder.with_endpoint(endpoint).with_virtual_hosted_style_request(false);
        }
        let store = builder.with_client_options(options).build().map_err(|e| SharedError::Config(e.to_string()))?;
        Ok(SharedStore::from_object_store(Arc::new(store), &config.bucket, &config.prefix))
    }

    /// A client over any object store (`object_store`'s in-memory one in
    /// tests), keys under `prefix` (`""`, or `a/b` without a trailing `/`).
    pub fn from_object_store(store: Arc<dyn ObjectStore>, bucket: &str, prefix: &str) -> SharedStore {
        let prefix = if prefix.is_empty() { String::new() } else { format!("{prefix}/") };
        SharedStore {
            store,
            lookup_timeout: LOOKUP_TIMEOUT,
            breaker: Breaker::new(BREAKER_MIN, BREAKER_MAX),
            bucket: bucket.to_owned(),
            prefix,
        }
    }

    /// Replaces [`LOOKUP_TIMEOUT`] for this client.
    pub fn with_lookup_timeout(mut self, timeout: Duration) -> SharedStore {
        self.lookup_timeout = timeout;
        self
    }

    /// Replaces [`BREAKER_MIN`] and [`BREAKER_MAX`] for this client.
    pub fn with_breaker(mut self, min: Duration, max: Duration) -> SharedStore {
        self.breaker = Breaker::new(min, max);
        self
    }

    /// Whether lookups skip the store now, after it failed (see [`BREAKER_MIN`]).
    pub fn is_down(&self) -> bool {
        self.breaker.is_open()
    }

    /// Runs a lookup with the lookup deadline, unless the breaker is open:
    /// then it fails at once without a request. A timeout or an error
    /// other than "not found" opens the breaker; an answer closes it.
    async fn lookup<T>(
        &self,
        op: &str,
        request: impl std::future::Future<Output = Result<T, object_store::Error>>,
    ) -> Result<Option<T>, SharedError> {
        if self.breaker.is_open() {
            metrics().shared_requests.with_label_values(&[op, "skipped"]).inc();
            return Err(SharedError::Store("skipped: the store failed a moment ago".into()));
        }
        let result = match tokio::time::timeout(self.lookup_timeout, request).await {
            Ok(result) => found(result),
            Err(_) => Err(SharedError::Store(format!("no answer within {:?}", self.lookup_timeout))),
        };
        match &result {
            Ok(_) => self.breaker.answered(),
            Err(_) => self.breaker.failed(),
        }
        count(op, &result);
        result
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The object key of `digest`: `<prefix>/<blobs|manifests>/sha256/<hex>`.
    pub fn key(&self, kind: ObjectKind, digest: &Digest) -> String {
        format!("{}{}/sha256/{}", self.prefix, kind.folder(), digest.hex().as_str())
    }

    fn path(&self, kind: ObjectKind, digest: &Digest) -> ObjectPath {
        ObjectPath::from(self.key(kind, digest))
    }

    /// The size of the object for `digest`, or `None` if there is none.
    pub async fn head(&self, kind: ObjectKind, digest: &Digest) -> Result<Option<u64>, SharedError> {
        self.lookup("head", self.store.head(&self.path(kind, digest))).await.map(|m| m.map(|m| m.size))
    }

    /// Streams the blob `digest`, or the part of it in `range` (`..` for
    /// all of it, `n..` to resume at byte `n`, `a..b`). `None` if the store
    /// does not have it. The bytes are not verified here.
    pub async fn get_blob(
        &self,
        digest: &Digest,
        range: impl RangeBounds<u64>,
    ) -> Result<Option<SharedBlob>, SharedError> {
        let range = get_range(range)?;
        let options = GetOptions { range, ..GetOptions::default() };
        let result = self.lookup("get", self.store.get_opts(&self.path(ObjectKind::Blob, digest), options)).await;
        let Some(got) = result? else { return Ok(None) };
        let (size, range) = (got.meta.size, got.range.clone());
        let downloaded = metrics().shared_bytes.with_label_values(&["download"]);
        let body = got
            .into_stream()
            .map_ok(move |chunk| {
                downloaded.inc_by(chunk.len() as u64);
                chunk
            })
            .map_err(store_err)
            .boxed();
        Ok(Some(SharedBlob { size, range, body }))
    }

    /// Uploads the committed blob file at `path` as the object for
    /// `digest`: one PUT up to [`SINGLE_PUT_MAX`], else a multipart upload
    /// streamed from the file. The file is hashed as it is read; if it no
    /// longer matches `digest` the upload is abandoned (a multipart upload
    /// is aborted before it completes, so no wrong object ever appears).
    /// Returns the bytes uploaded.
    pub async fn put_blob_file(&self, digest: &Digest, path: &Path) -> Result<u64, SharedError> {
        match self.put_blob_file_until(digest, path, std::future::pending::<()>()).await {
            Ok(size) => Ok(size),
            Err(PutFailed::Store(e)) => Err(e),
            Err(PutFailed::Stopped(())) => unreachable!("a pending future never resolves"),
        }
    }

    /// [`SharedStore::put_blob_file`], given up when `stop` resolves first
    /// (a deadline, a shutdown, the blob's removal): the file is closed at
    /// once and a multipart upload is aborted (within [`ABORT_TIMEOUT`]),
    /// as it is after any failure, so no parts are left in the bucket.
    /// Only a stop that lands while the store is creating the upload (one
    /// short request) cannot abort it, since its id is not known yet: the
    /// bucket's `AbortIncompleteMultipartUpload` rule cleans that one, as
    /// it does after a crash.
    pub async fn put_blob_file_until<C>(
        &self,
        digest: &Digest,
        path: &Path,
        stop: impl std::future::Future<Output = C>,
    ) -> Result<u64, PutFailed<C>> {
        tokio::pin!(stop);
        let local = |detail: String| SharedError::Local { path: path.display().to_string(), detail };
        let file_path = path.to_owned();
        let (file, size) = blocking(move || {
            let file = std::fs::File::open(&file_path)?;
            let size = file.metadata()?.len();
            Ok((Arc::new(file), size))
        })
        .await
        .map_err(|e| local(e.to_string()))?;
        let location = self.path(ObjectKind::Blob, digest);
        let attributes = Attributes::from_iter([(Attribute::ContentType, "application/octet-stream")]);
        if size <= SINGLE_PUT_MAX {
            let (bytes, hasher) =
                read_chunk(Arc::clone(&file), 0, size as usize, Hasher::default()).await.map_err(local)?;
            drop(file);
            verify(digest, hasher, "local file", path)?;
            let options = PutOptions { attributes, ..PutOptions::default() };
            let result = tokio::select! {
                result = self.store.put_opts(&location, PutPayload::from(bytes), options) => result,
                stopped = &mut stop => return Err(PutFailed::Stopped(stopped)),
            };
            written("put", result).map_err(|e| self.log_failure("put", digest, e))?;
        } else {
            let options = PutMultipartOptions { attributes, ..PutMultipartOptions::default() };
            let created = tokio::select! {
                created = self.store.put_multipart_opts(&location, options) => created,
                stopped = &mut stop => return Err(PutFailed::Stopped(stopped)),
            };
            let mut upload = match created {
                Ok(upload) => upload,
                Err(e) => {
                    metrics().shared_requests.with_label_values(&["put_multipart", "error"]).inc();
                    return Err(PutFailed::Store(self.log_failure("put_multipart", digest, store_err(e))));
                }
            };
            let result = tokio::select! {
                result = stream_parts(&mut *upload, digest, path, file, size) => result.map_err(PutFailed::Store),
                stopped = &mut stop => Err(PutFailed::Stopped(stopped)),
            };
            let label = if result.is_ok() { "ok" } else { "error" };
            metrics().shared_requests.with_label_values(&["put_multipart", label]).inc();
            if let Err(failed) = &result {
                if let PutFailed::Store(e) = failed {
                    tracing::debug!(%digest, error = %e, "multipart upload failed; aborting it");
                }
                let aborted = match tokio::time::timeout(ABORT_TIMEOUT, upload.abort()).await {
                    Ok(Ok(())) => "ok",
                    Ok(Err(e)) => {
                        tracing::warn!(%digest, error = %e, "aborting a multipart upload failed; the bucket's lifecycle rule will");
                        "error"
                    }
                    Err(_) => {
                        tracing::warn!(%digest, "aborting a multipart upload timed out; the bucket's lifecycle rule will");
                        "error"
                    }
                };
                metrics().shared_requests.with_label_values(&["abort_multipart", aborted]).inc();
            }
            result?;
        }
        metrics().shared_bytes.with_label_values(&["upload"]).inc_by(size);
        Ok(size)
    }

    fn log_failure(&self, op: &str, digest: &Digest, e: SharedError) -> SharedError {
        tracing::debug!(op, %digest, error = %e, "shared store request failed");
        e
    }

    /// Stores a manifest under its digest, with its media type as the
    /// object's `Content-Type`. Refuses bytes that do not match `digest`.
    pub async fn put_manifest(&self, digest: &Digest, media_type: MediaType, bytes: Bytes) -> Result<(), SharedError> {
        if Digest::of(&bytes) != *digest {
            return Err(SharedError::Corrupt {
                what: format!("manifest {digest}"),
                detail: "refused to upload".into(),
            });
        }
        let len = bytes.len() as u64;
        let attributes = Attributes::from_iter([(Attribute::ContentType, media_type.as_str())]);
        let options = PutOptions { attributes, ..PutOptions::default() };
        let result = self.store.put_opts(&self.path(ObjectKind::Manifest, digest), bytes.into(), options).await;
        written("put", result)?;
        metrics().shared_bytes.with_label_values(&["upload"]).inc_by(len);
        Ok(())
    }

    /// The manifest `digest` with its media type, or `None`. Its bytes are
    /// hashed here: a wrong or truncated object is [`SharedError::Corrupt`].
    pub async fn get_manifest(&self, digest: &Digest) -> Result<Option<SharedManifest>, SharedError> {
        let path = self.path(ObjectKind::Manifest, digest);
        let what = || format!("shared manifest {digest}");
        let read = async {
            let got = self.store.get_opts(&path, GetOptions::default()).await?;
            if got.meta.size > MAX_MANIFEST_SIZE as u64 {
                return Ok(Err(got.meta.size));
            }
            let content_type = got.attributes.get(&Attribute::ContentType).map(|v| v.as_ref().to_owned());
            Ok(Ok((content_type, got.bytes().await?)))
        };
        let result = self.lookup("get", read).await;
        let (content_type, bytes) = match result? {
            None => return Ok(None),
            Some(Err(size)) => return Err(SharedError::Corrupt { what: what(), detail: format!("{size} bytes") }),
            Some(Ok(got)) => got,
        };
        metrics().shared_bytes.with_label_values(&["download"]).inc_by(bytes.len() as u64);
        if Digest::of(&bytes) != *digest {
            return Err(SharedError::Corrupt {
                what: what(),
                detail: format!("{} bytes with another hash", bytes.len()),
            });
        }
        let media_type = content_type.as_deref().and_then(MediaType::parse).ok_or_else(|| SharedError::Corrupt {
            what: what(),
            detail: format!("Content-Type {content_type:?} is not a manifest media type"),
        })?;
        Ok(Some(SharedManifest { media_type, bytes }))
    }

    /// Deletes the object for `digest`; a missing one is not an error.
    pub async fn delete(&self, kind: ObjectKind, digest: &Digest) -> Result<(), SharedError> {
        delete_counted(&self.store, &self.path(kind, digest)).await
    }

    /// Deletes every blob and manifest object uploaded more than `max_age`
    /// ago (by the store's `Last-Modified`). Other keys under the prefix
    /// are left alone.
    pub async fn sweep(&self, max_age: Duration) -> Result<Swept, SharedError> {
        let cutoff = SystemTime::now().checked_sub(max_age).unwrap_or(UNIX_EPOCH);
        let cutoff = cutoff.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        let (listed, deleted) = (AtomicU64::new(0), AtomicU64::new(0));
        for kind in [ObjectKind::Blob, ObjectKind::Manifest] {
            let folder = ObjectPath::from(format!("{}{}/sha256", self.prefix, kind.folder()));
            // Streamed page by page, deleting as it goes: a bucket of
            // millions of objects is never listed into memory at once.
            let result = self
                .store
                .list(Some(&folder))
                .map_err(store_err)
                .try_for_each_concurrent(SWEEP_DELETES_IN_FLIGHT, |meta| {
                    listed.fetch_add(1, Ordering::Relaxed);
                    let (store, deleted) = (&self.store, &deleted);
                    async move {
                        if meta.last_modified.timestamp_millis() < cutoff
                            && delete_counted(store, &meta.location).await.is_ok()
                        {
                            deleted.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(())
                    }
                })
                .await;
            let label = if result.is_ok() { "ok" } else { "error" };
            metrics().shared_requests.with_label_values(&["list", label]).inc();
            result?;
        }
        let swept = Swept { listed: listed.into_inner(), deleted: deleted.into_inner() };
        Ok(swept)
    }

    /// Sweeps objects older than `max_age` now and every [`SWEEP_INTERVAL`]
    /// until `shutdown`. With `peers`, only the replica that owns
    /// [`SWEEPER_KEY`] among the live peers sweeps (once the member set is
    /// known): listing a large prefix on every replica would cost the store
    /// N times for nothing. If that replica goes, the next owner sweeps at
    /// its next round.
    pub fn spawn_sweeper(
        self: &Arc<Self>,
        max_age: Duration,
        peers: Option<Arc<crate::cluster::Peers>>,
        mut shutdown: crate::shutdown::Shutdown,
    ) -> tokio::task::JoinHandle<()> {
        let store = Arc::clone(self);
        tokio::spawn(async move {
            if let Some(peers) = &peers {
                tokio::select! {
                    _ = shutdown.changed() => return,
                    () = peers.settled() => {}
                }
            }
            loop {
                if peers.as_ref().is_none_or(|p| p.owns(SWEEPER_KEY)) {
                    let swept = tokio::select! {
                        _ = shutdown.changed() => return,
                        swept = store.sweep(max_age) => swept,
                    };
                    match swept {
                        Ok(s) => {
                            tracing::info!(listed = s.listed, deleted = s.deleted, ?max_age, "swept the shared tier")
                        }
                        Err(e) => tracing::warn!(error = %e, "sweeping the shared tier failed"),
                    }
                } else {
                    tracing::debug!("another replica sweeps the shared tier");
                }
                tokio::select! {
                    _ = shutdown.changed() => return,
                    () = tokio::time::sleep(SWEEP_INTERVAL) => {}
                }
            }
        })
    }
}

async fn delete_counted(store: &dyn ObjectStore, path: &ObjectPath) -> Result<(), SharedError> {
    let result = found(store.delete(path).await);
    count("delete", &result);
    result.map(|_| ())
}

/// Sends the file's parts, at most [`PARTS_IN_FLIGHT`] at once, hashing
/// them as they are read, and completes the upload if the file matched
/// `digest`. The caller aborts the upload when this fails or is dropped.
async fn stream_parts(
    upload: &mut dyn MultipartUpload,
    digest: &Digest,
    path: &Path,
    file: Arc<std::fs::File>,
    size: u64,
) -> Result<(), SharedError> {
    let part = part_size(size);
    let mut in_flight: futures_util::stream::FuturesUnordered<object_store::UploadPart> =
        futures_util::stream::FuturesUnordered::new();
    let mut hasher = Hasher::default();
    let mut offset = 0;
    while offset < size {
        while in_flight.len() >= PARTS_IN_FLIGHT {
            if let Some(done) = in_flight.next().await {
                done.map_err(store_err)?;
            }
        }
        let len = part.min(size - offset);
        let (bytes, next) = read_chunk(Arc::clone(&file), offset, len as usize, hasher)
            .await
            .map_err(|detail| SharedError::Local { path: path.display().to_string(), detail })?;
        hasher = next;
        in_flight.push(upload.put_part(PutPayload::from(bytes)));
        offset += len;
    }
    drop(file);
    while let Some(done) = in_flight.next().await {
        done.map_err(store_err)?;
    }
    verify(digest, hasher, "local file", path)?;
    upload.complete().await.map(|_| ()).map_err(store_err)
}

/// `..` → whole object, `n..` → from `n`, `a..b` → bytes `a` to `b - 1`.
fn get_range(range: impl RangeBounds<u64>) -> Result<Option<GetRange>, SharedError> {
    let start = match range.start_bound() {
        Bound::Included(s) => *s,
        Bound::Excluded(s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(e) => Some(e.saturating_add(1)),
        Bound::Excluded(e) => Some(*e),
        Bound::Unbounded => None,
    };
    match end {
        None if start == 0 => Ok(None),
        None => Ok(Some(GetRange::Offset(start))),
        Some(end) if end > start => Ok(Some(GetRange::Bounded(start..end))),
        Some(end) => Err(SharedError::Store(format!("empty range {start}..{end}"))),
    }
}

/// The part size for a file of `size` bytes: [`PART_SIZE`], or more (in
/// whole MiB) when that would need more than [`MAX_PARTS`] parts.
fn part_size(size: u64) -> u64 {
    let needed = size.div_ceil(MAX_PARTS).div_ceil(1 << 20) << 20;
    PART_SIZE.max(needed)
}

/// Reads `len` bytes at `offset` on the blocking pool, hashing them there.
async fn read_chunk(
    file: Arc<std::fs::File>,
    offset: u64,
    len: usize,
    mut hasher: Hasher,
) -> Result<(Bytes, Hasher), String> {
    blocking(move || {
        use std::os::unix::fs::FileExt;
        let mut buf = BytesMut::zeroed(len);
        file.read_exact_at(&mut buf, offset)?;
        hasher.update(&buf);
        Ok((buf.freeze(), hasher))
    })
    .await
    .map_err(|e| e.to_string())
}

fn verify(digest: &Digest, hasher: Hasher, what: &str, path: &Path) -> Result<(), SharedError> {
    let actual = hasher.finish();
    if actual == *digest {
        return Ok(());
    }
    metrics().digest_mismatch.inc();
    Err(SharedError::Corrupt {
        what: format!("{what} {}", PathBuf::from(path).display()),
        detail: format!("expected {digest}, found {actual}; not uploaded"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    fn config(prefix: &str, endpoint: Option<&str>) -> SharedConfig {
        SharedConfig {
            bucket: "larder-cache".into(),
            prefix: prefix.into(),
            endpoint: endpoint.map(str::to_owned),
            region: "garage".into(),
            credentials: SharedCredentials::Static {
                access_key_id: Secret::new("GK0000"),
                secret_access_key: Secret::new("s3cret"),
                session_token: None,
            },
            max_age: None,
        }
    }

    #[test]
    fn keys_follow_the_documented_layout() {
        let d = Digest::of(b"x");
        let hex = d.hex();
        let with_prefix = SharedStore::new(&config("mirror/v1", Some("http://127.0.0.1:3900"))).unwrap();
        assert_eq!(with_prefix.key(ObjectKind::Blob, &d), format!("mirror/v1/blobs/sha256/{}", hex.as_str()));
        assert_eq!(with_prefix.key(ObjectKind::Manifest, &d), format!("mirror/v1/manifests/sha256/{}", hex.as_str()));
        let at_root = SharedStore::new(&config("", None)).unwrap();
        assert_eq!(at_root.key(ObjectKind::Blob, &d), format!("blobs/sha256/{}", hex.as_str()));
        assert!(!format!("{at_root:?}").contains("s3cret"));
    }

    #[test]
    fn ranges_map_to_object_store_ranges() {
        assert_eq!(get_range(..).unwrap(), None);
        assert_eq!(get_range(0..).unwrap(), None);
        assert_eq!(get_range(10..).unwrap(), Some(GetRange::Offset(10)));
        assert_eq!(get_range(10..20).unwrap(), Some(GetRange::Bounded(10..20)));
        assert_eq!(get_range(10..=19).unwrap(), Some(GetRange::Bounded(10..20)));
        assert_eq!(get_range(..5).unwrap(), Some(GetRange::Bounded(0..5)));
        assert!(get_range(5..5).is_err());
    }

    #[test]
    fn part_size_keeps_uploads_under_the_part_limit() {
        assert_eq!(part_size(64 << 20), PART_SIZE);
        let huge = 200u64 << 30;
        let part = part_size(huge);
        assert!(huge.div_ceil(part) <= MAX_PARTS, "{part}");
        assert_eq!(part % (1 << 20), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_breaker_pauses_longer_while_the_store_keeps_failing_and_closes_on_an_answer() {
        let breaker = Breaker::new(Duration::from_secs(1), Duration::from_secs(3));
        assert!(!breaker.is_open());
        let mut pauses = Vec::new();
        for _ in 0..4 {
            breaker.failed();
            let started = tokio::time::Instant::now();
            while breaker.is_open() {
                tokio::time::advance(Duration::from_millis(100)).await;
            }
            pauses.push(started.elapsed().as_millis());
        }
        assert_eq!(pauses, [1000, 2000, 3000, 3000], "doubled per failure in a row, up to the cap");
        breaker.failed();
        breaker.answered();
        assert!(!breaker.is_open(), "an answer closes it at once");
        breaker.failed();
        assert_eq!(breaker.lock().failures, 1, "and the count starts again");
    }

    #[tokio::test]
    async fn a_store_that_does_not_answer_costs_one_lookup_until_the_pause_ends() {
        // Accepts connections, never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        let hole = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                held.push(stream);
            }
        });
        let store = SharedStore::new(&config("", Some(&format!("http://127.0.0.1:{port}"))))
            .unwrap()
            .with_lookup_timeout(Duration::from_millis(200))
            .with_breaker(Duration::from_secs(600), Duration::from_secs(600));
        for _ in 0..5 {
            assert!(store.head(ObjectKind::Blob, &Digest::of(b"x")).await.is_err());
            assert!(store.get_blob(&Digest::of(b"y"), ..).await.is_err());
        }
        assert!(store.is_down());
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one request reached the store; the other nine were skipped");
        hole.abort();
    }

    #[tokio::test]
    async fn a_dead_endpoint_is_an_error() {
        // A port nothing listens on: connection refused, retried briefly.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let store = SharedStore::new(&config("", Some(&format!("http://127.0.0.1:{port}")))).unwrap();
        let started = std::time::Instant::now();
        let e = store.head(ObjectKind::Blob, &Digest::of(b"x")).await.unwrap_err();
        assert!(matches!(e, SharedError::Store(_)), "{e}");
        // Measured, not asserted (timings belong in benches).
        eprintln!("dead endpoint: HEAD failed after {:?}: {e}", started.elapsed());
    }
}
