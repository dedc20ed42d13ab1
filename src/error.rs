//! Errors, and the one place that turns them into HTTP responses with the
//! OCI error envelope `{"errors":[{"code","message","detail"}]}`.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

use crate::body::{self, Body};
use crate::oci::{Digest, DigestError, NameError};

/// Everything a request can fail with. Client-caused errors carry what the
/// client sent wrong; upstream failures say how upstream failed, so that the
/// status tells a client whether to retry (502/503/504/429), and an upstream
/// failure is never reported as "not found".
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("invalid repository name: {0}")]
    NameInvalid(NameError),
    #[error("no upstream is configured for {0:?}")]
    UnknownUpstream(String),
    #[error("repository not known upstream")]
    NameUnknown,
    #[error("manifest unknown")]
    ManifestUnknown,
    /// An image an operator asked for (a prefetch, an export, a warm
    /// image) that upstream lacks, or a platform its index lacks: the text
    /// names the image, and for a platform the ones the index has.
    #[error("{0}")]
    ImageUnknown(String),
    #[error("blob unknown")]
    BlobUnknown(Digest),
    #[error("invalid digest: {0}")]
    DigestInvalid(DigestError),
    #[error("requested range is not satisfiable")]
    RangeNotSatisfiable { size: u64 },
    #[error("this is a read-only mirror")]
    Unsupported,
    #[error("no such endpoint")]
    NotFound,
    #[error("the manifest's media type is not acceptable to the client")]
    NotAcceptable,
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("authentication required")]
    Unauthorized { realm: String },
    /// An upstream with `client_credentials = "verify"` needs the client's
    /// own Basic credentials, and it sent none, or ones upstream does not
    /// accept. Answered with a `Basic` challenge naming `realm` (the
    /// upstream); `message` says which, and never quotes the credentials.
    #[error("{message}")]
    CredentialsRequired { realm: String, message: String },
    /// A client's credentials could not be checked with the upstream now
    /// (unreachable, 5xx, 429) and no verdict within the ttl covers them:
    /// nothing is served until they are.
    #[error("larder cannot check these credentials with upstream {upstream:?} now; try again later")]
    CredentialsUnverified { upstream: String },
    /// An admin operation without the right `Authorization: Bearer`
    /// token: the text says which token the listener expects (the
    /// configured file, or the one larder generated, and where).
    #[error("{0}")]
    AdminUnauthorized(String),
    /// An admin operation on a non-loopback admin listener without `[admin] token_file`.
    #[error("admin operations are disabled: set [admin] token_file, or bind server.admin_listen to a loopback address")]
    AdminDisabled,
    /// An admin operation refused whatever token it carries (a browser's
    /// cross-site request, an unexpected `Host`, a revoked token file):
    /// the message says why and what to change.
    #[error("{0}")]
    AdminForbidden(String),
    /// larder itself is too busy for this request now (client password
    /// checks queued past their bound): come back after `retry_after` seconds.
    #[error("too many requests waiting for a password check; retry after {retry_after} s")]
    TooManyRequests { retry_after: u64 },
    /// Who-may-pull-what refused the request (`crate::policy`): the
    /// upstream's `allow`/`deny`, or no grant for the client. The text
    /// names the repository, the upstream and the rule.
    #[error("{0}")]
    Denied(String),
    /// An image layout given to `larder import` is incomplete, tampered
    /// with or not a layout: nothing of it was imported.
    #[error("{0}")]
    LayoutInvalid(String),
    /// Another larder process holds the cache folder (its index's lock).
    #[error("{0} is in use by another larder process (its index is locked); stop it first")]
    CacheInUse(String),
    #[error("the cache disk is full")]
    DiskFull,
    /// The cache's own storage failed in a way that may pass (too many open
    /// files, an I/O error): retryable, and nothing was changed.
    #[error("cache storage unavailable: {0}")]
    Storage(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// How talking to an upstream registry failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot connect to upstream: {0}")]
    Connect(String),
    #[error("upstream timed out: {0}")]
    Timeout(&'static str),
    #[error("upstream answered {status}")]
    Status { status: u16, retry_after: Option<String> },
    #[error("upstream denied access")]
    Denied,
    #[error("upstream is rate limiting")]
    RateLimited { retry_after: Option<String> },
    #[error("upstream sent an invalid response: {0}")]
    Protocol(String),
    #[error("upstream content does not match digest {expected} (got {actual})")]
    DigestMismatch { expected: Digest, actual: String },
    /// Authentication with upstream failed. The text is for larder's log
    /// (it may name realms, files or helpers); a client is told only
    /// that authentication failed ([`Error::into_response`]).
    #[error("upstream authentication failed: {0}")]
    Auth(String),
    /// The upstream's credentials could not be read (a credential helper or
    /// `password_file` failed). What failed is logged where it failed;
    /// this text is all a client sees.
    #[error("credentials for upstream {upstream:?} are unavailable")]
    CredentialsUnavailable { upstream: String },
    /// A redirect target or token realm larder refused to dial: a
    /// downgrade to http, or an address that is not public
    /// (`crate::upstream::dial`). `reason` is the metric label.
    #[error("upstream sent larder to where it does not follow ({reason})")]
    Refused { reason: &'static str },
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        if e.kind() == std::io::ErrorKind::StorageFull {
            return Error::DiskFull;
        }
        Error::Internal(format!("i/o: {e}"))
    }
}

impl From<redb::Error> for Error {
    fn from(e: redb::Error) -> Error {
        Error::Internal(format!("index: {e}"))
    }
}

impl Error {
    /// Status, OCI error code, and extra headers for this error.
    fn classify(&self) -> (StatusCode, &'static str, Option<(header::HeaderName, String)>) {
        use StatusCode as S;
        match self {
            Error::NameInvalid(_) => (S::BAD_REQUEST, "NAME_INVALID", None),
            Error::UnknownUpstream(_) | Error::NameUnknown => (S::NOT_FOUND, "NAME_UNKNOWN", None),
            Error::ManifestUnknown | Error::NotAcceptable | Error::ImageUnknown(_) => {
                (S::NOT_FOUND, "MANIFEST_UNKNOWN", None)
            }
            Error::BlobUnknown(_) => (S::NOT_FOUND, "BLOB_UNKNOWN", None),
            Error::DigestInvalid(_) => (S::BAD_REQUEST, "DIGEST_INVALID", None),
            Error::LayoutInvalid(_) => (S::BAD_REQUEST, "MANIFEST_INVALID", None),
            Error::RangeNotSatisfiable { size } => {
                (S::RANGE_NOT_SATISFIABLE, "RANGE_INVALID", Some((header::CONTENT_RANGE, format!("bytes */{size}"))))
            }
            Error::Unsupported => (S::METHOD_NOT_ALLOWED, "UNSUPPORTED", None),
            Error::NotFound => (S::NOT_FOUND, "NOT_FOUND", None),
            Error::Upstream(u) => match u {
                UpstreamError::Connect(_) => (S::SERVICE_UNAVAILABLE, "UNAVAILABLE", None),
                UpstreamError::Timeout(_) => (S::GATEWAY_TIMEOUT, "UNAVAILABLE", None),
                UpstreamError::Status { status: 503, retry_after } => {
                    (S::SERVICE_UNAVAILABLE, "UNAVAILABLE", retry_after.clone().map(|r| (header::RETRY_AFTER, r)))
                }
                UpstreamError::Denied => (S::FORBIDDEN, "DENIED", None),
                UpstreamError::RateLimited { retry_after } => {
                    (S::TOO_MANY_REQUESTS, "TOOMANYREQUESTS", retry_after.clone().map(|r| (header::RETRY_AFTER, r)))
                }
                UpstreamError::Status { .. }
                | UpstreamError::Protocol(_)
                | UpstreamError::DigestMismatch { .. }
                | UpstreamError::Auth(_)
                | UpstreamError::CredentialsUnavailable { .. }
                | UpstreamError::Refused { .. } => (S::BAD_GATEWAY, "UNAVAILABLE", None),
            },
            Error::Unauthorized { realm } => {
                (S::UNAUTHORIZED, "UNAUTHORIZED", Some((header::WWW_AUTHENTICATE, format!("Basic realm=\"{realm}\""))))
            }
            Error::CredentialsRequired { realm, .. } => {
                (S::UNAUTHORIZED, "UNAUTHORIZED", Some((header::WWW_AUTHENTICATE, format!("Basic realm=\"{realm}\""))))
            }
            Error::CredentialsUnverified { .. } => (S::SERVICE_UNAVAILABLE, "UNAVAILABLE", None),
            Error::AdminUnauthorized(_) => (
                S::UNAUTHORIZED,
                "UNAUTHORIZED",
                Some((header::WWW_AUTHENTICATE, "Bearer realm=\"larder-admin\"".to_owned())),
            ),
            Error::AdminDisabled | Error::AdminForbidden(_) | Error::Denied(_) => (S::FORBIDDEN, "DENIED", None),
            Error::TooManyRequests { retry_after } => {
                (S::TOO_MANY_REQUESTS, "TOOMANYREQUESTS", Some((header::RETRY_AFTER, retry_after.to_string())))
            }
            // Retryable: eviction is making room.
            Error::DiskFull | Error::Storage(_) | Error::CacheInUse(_) => (S::SERVICE_UNAVAILABLE, "UNAVAILABLE", None),
            Error::Internal(_) => (S::INTERNAL_SERVER_ERROR, "UNKNOWN", None),
        }
    }

    /// Whether upstream's answer was about the repository asked through
    /// (it lacks the blob there, or denies it), rather than about the blob
    /// or upstream itself: another repository may well get it.
    pub fn is_repository_specific(&self) -> bool {
        matches!(self, Error::BlobUnknown(_) | Error::ManifestUnknown | Error::Upstream(UpstreamError::Denied))
    }

    pub fn status(&self) -> StatusCode {
        self.classify().0
    }

    /// What a client is told. The same as `Display` (what the log says),
    /// except for upstream authentication failures, whose details (realms,
    /// helper messages, file names) stay in larder's log.
    fn client_message(&self) -> String {
        match self {
            Error::Upstream(UpstreamError::Auth(_)) => {
                "upstream authentication failed (details in larder's log)".into()
            }
            _ => self.to_string(),
        }
    }

    /// The response for this error. `head` omits the body (HEAD requests).
    pub fn into_response(self, head: bool) -> Response<Body> {
        let (status, code, extra) = self.classify();
        let detail = match &self {
            Error::BlobUnknown(d) => serde_json::json!({ "digest": d.to_string() }),
            Error::UnknownUpstream(ns) => serde_json::json!({ "ns": ns }),
            _ => serde_json::Value::Null,
        };
        let envelope = serde_json::json!({
            "errors": [{ "code": code, "message": self.client_message(), "detail": detail }]
        });
        let bytes = Bytes::from(envelope.to_string());
        let mut builder = Response::builder()
            .status(status)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CONTENT_LENGTH, bytes.len())
            .header(crate::oci::headers::API_VERSION, crate::oci::headers::API_VERSION_V2);
        if let Some((name, value)) = extra {
            if let Ok(v) = HeaderValue::from_str(&value) {
                builder = builder.header(name, v);
            }
        }
        let body = if head { body::empty() } else { body::full(bytes) };
        builder.body(body).unwrap_or_else(|_| Response::new(body::empty()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn json(e: Error) -> (StatusCode, serde_json::Value) {
        let r = e.into_response(false);
        let status = r.status();
        let bytes = r.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn envelope_has_code_message_detail() {
        let (status, v) = json(Error::ManifestUnknown).await;
        assert_eq!(status, 404);
        assert_eq!(v["errors"][0]["code"], "MANIFEST_UNKNOWN");
        assert!(v["errors"][0]["message"].is_string());
        assert!(v["errors"][0].get("detail").is_some());
    }

    #[tokio::test]
    async fn upstream_failures_are_never_404() {
        let cases = [
            (UpstreamError::Connect("refused".into()), 503),
            (UpstreamError::Timeout("headers"), 504),
            (UpstreamError::Status { status: 500, retry_after: None }, 502),
            (UpstreamError::Status { status: 503, retry_after: None }, 503),
            (UpstreamError::RateLimited { retry_after: Some("30".into()) }, 429),
            (UpstreamError::Protocol("junk".into()), 502),
        ];
        for (e, want) in cases {
            assert_eq!(Error::Upstream(e).status(), want);
        }
        let r = Error::Upstream(UpstreamError::RateLimited { retry_after: Some("30".into()) }).into_response(false);
        assert_eq!(r.headers()["retry-after"], "30");
    }

    #[tokio::test]
    async fn range_errors_carry_content_range() {
        let r = Error::RangeNotSatisfiable { size: 2048 }.into_response(false);
        assert_eq!(r.status(), 416);
        assert_eq!(r.headers()["content-range"], "bytes */2048");
    }
}
