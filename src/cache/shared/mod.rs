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
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{BoxStream, StreamExt, TryStreamExt};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{
    Attribute, Attributes, BackoffConfig, ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutOptions,
    RetryConfig,
};

use crate::config::{SharedConfig, SharedCredentials};
use crate::metrics::metrics;
use crate::oci::{Digest, MAX_MANIFEST_SIZE, MediaType};

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

mod breaker;
mod put;
mod sweep;
pub mod upload;

use breaker::Breaker;
pub use breaker::{BREAKER_MAX, BREAKER_MIN};
pub use put::{ABORT_TIMEOUT, MAX_PARTS, PART_SIZE, PARTS_IN_FLIGHT, PutFailed, SINGLE_PUT_MAX};
pub use sweep::{SWEEP_INTERVAL, SWEEPER_KEY, Swept};

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
    /// The first `len` bytes of the body at most (an object longer than
    /// the blob it is stored as): it ends there without reading on.
    pub fn take(self, len: u64) -> SharedBlob {
        let SharedBlob { size, range, body } = self;
        let body = futures_util::stream::unfold((body, len), |(mut body, left)| async move {
            if left == 0 {
                return None;
            }
            match body.next().await? {
                Ok(mut chunk) => {
                    let n = (chunk.len() as u64).min(left);
                    chunk.truncate(n as usize);
                    Some((Ok(chunk), (body, left - n)))
                }
                Err(e) => Some((Err(e), (body, 0))),
            }
        })
        .boxed();
        let range = range.start..range.end.min(range.start + len);
        SharedBlob { size, range, body }
    }

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
            Err(_) => {
                Err(SharedError::Store(format!("no answer within {}", humantime::format_duration(self.lookup_timeout))))
            }
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
}

async fn delete_counted(store: &dyn ObjectStore, path: &ObjectPath) -> Result<(), SharedError> {
    let result = found(store.delete(path).await);
    count("delete", &result);
    result.map(|_| ())
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
#[cfg(test)]
mod tests;
