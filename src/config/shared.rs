//! `[shared]`: the S3-compatible bucket every replica reads before going
//! upstream and uploads verified content to.

use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, Secret, Validator};

/// Shortest `[shared] max_age`: a sweep must never race the upload of a
/// blob a replica has just fetched.
pub const MIN_SHARED_MAX_AGE: Duration = Duration::from_secs(3600);

/// `[shared]`: an S3-compatible bucket (and key prefix) that every replica
/// reads before going upstream and uploads verified content to.
#[derive(Debug, Clone)]
pub struct SharedConfig {
    /// The bucket, from `url = "s3://<bucket>/<prefix>"`.
    pub bucket: String,
    /// Key prefix without leading or trailing `/`; empty for the bucket root.
    pub prefix: String,
    /// `scheme://host[:port]` of an S3-compatible store; `None` for AWS S3.
    pub endpoint: Option<String>,
    /// Must equal the store's own region name (Garage: `s3_region`).
    pub region: String,
    pub access_key_id: Secret,
    pub secret_access_key: Secret,
    /// `AWS_SESSION_TOKEN`, when the keys come from the environment.
    pub session_token: Option<Secret>,
    /// Objects uploaded longer ago than this are deleted by a sweep; `None`
    /// leaves expiry to the bucket's lifecycle rules.
    pub max_age: Option<Duration>,
}

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawShared {
    url: String,
    endpoint: Option<String>,
    region: Option<String>,
    access_key_id_file: Option<String>,
    secret_access_key_file: Option<String>,
    max_age: Option<String>,
}

impl Validator<'_> {
    pub(super) fn shared(&self, s: RawShared) -> Result<SharedConfig, ConfigError> {
        // Split by hand: a URL parser would resolve `..` and percent-escapes
        // that must instead be refused.
        let rest = s
            .url
            .strip_prefix("s3://")
            .ok_or_else(|| self.err("shared.url", format!("{:?} must be an s3:// URL (s3://bucket/prefix)", s.url)))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if !valid_bucket(bucket) {
            return Err(self.err(
                "shared.url",
                format!("{bucket:?} is not a bucket name (3-63 lowercase letters, digits, dots and hyphens)"),
            ));
        }
        let (bucket, prefix) = (bucket.to_owned(), prefix.trim_end_matches('/').to_owned());
        let segment_ok = |seg: &str| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        };
        if !prefix.is_empty() && !prefix.split('/').all(segment_ok) {
            return Err(self.err(
                "shared.url",
                format!("prefix {prefix:?} must be /-separated segments of letters, digits, '.', '_' and '-'"),
            ));
        }
        let endpoint = s.endpoint.as_deref().map(|e| self.endpoint(e)).transpose()?;
        let region = match (&s.region, &endpoint) {
            (Some(r), _) => r.clone(),
            (None, None) => (self.env)("AWS_REGION").or_else(|| (self.env)("AWS_DEFAULT_REGION")).ok_or_else(|| {
                self.err("shared.region", "set the bucket's region (or AWS_REGION in the environment)")
            })?,
            (None, Some(_)) => {
                return Err(self.err(
                    "shared.region",
                    "set it to the store's own region name (Garage: `s3_region`, often \"garage\")",
                ));
            }
        };
        if region.is_empty() || !region.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(self.err("shared.region", format!("{region:?} is not a region name")));
        }
        let (access_key_id, secret_access_key, session_token) = match (&s.access_key_id_file, &s.secret_access_key_file)
        {
            (Some(id), Some(secret)) => (
                self.secret_file("shared.access_key_id_file", id)?,
                self.secret_file("shared.secret_access_key_file", secret)?,
                None,
            ),
            (None, None) => {
                let id = (self.env)("AWS_ACCESS_KEY_ID").filter(|v| !v.is_empty());
                let secret = (self.env)("AWS_SECRET_ACCESS_KEY").filter(|v| !v.is_empty());
                match (id, secret) {
                    (Some(id), Some(secret)) => (
                        Secret::new(id),
                        Secret::new(secret),
                        (self.env)("AWS_SESSION_TOKEN").filter(|v| !v.is_empty()).map(Secret::new),
                    ),
                    _ => {
                        return Err(self.err(
                            "shared.access_key_id_file",
                            "set access_key_id_file and secret_access_key_file, or \
                                 AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment",
                        ));
                    }
                }
            }
            (Some(_), None) => {
                return Err(self.err("shared.secret_access_key_file", "needed with access_key_id_file"));
            }
            (None, Some(_)) => {
                return Err(self.err("shared.access_key_id_file", "needed with secret_access_key_file"));
            }
        };
        let max_age =
            s.max_age.as_deref().map(|a| self.duration("shared.max_age", Some(a), Duration::ZERO)).transpose()?;
        if let Some(age) = max_age {
            if age < MIN_SHARED_MAX_AGE {
                return Err(self.err(
                    "shared.max_age",
                    format!("must be at least {}", humantime::format_duration(MIN_SHARED_MAX_AGE)),
                ));
            }
        }
        Ok(SharedConfig { bucket, prefix, endpoint, region, access_key_id, secret_access_key, session_token, max_age })
    }

    fn endpoint(&self, e: &str) -> Result<String, ConfigError> {
        let bad = || self.err("shared.endpoint", format!("{e:?} must be http(s)://host[:port] with no path"));
        let url = url::Url::parse(e).map_err(|_| bad())?;
        let ok = matches!(url.scheme(), "http" | "https")
            && url.host_str().is_some_and(|h| !h.is_empty())
            && url.username().is_empty()
            && url.password().is_none()
            && matches!(url.path(), "" | "/")
            && url.query().is_none()
            && url.fragment().is_none();
        if !ok {
            return Err(bad());
        }
        Ok(url.as_str().trim_end_matches('/').to_owned())
    }
}

/// An S3 bucket name: 3-63 lowercase letters, digits, dots and hyphens,
/// starting and ending with a letter or digit.
fn valid_bucket(s: &str) -> bool {
    (3..=63).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::*;

    #[test]
    fn shared_keys_come_from_the_aws_environment_without_files() {
        let dir = secrets_dir();
        let text = "[shared]\nurl = \"s3://bucket-a\"\n";
        let env = env_of(&[
            ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
            ("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI"),
            ("AWS_SESSION_TOKEN", "tok"),
            ("AWS_REGION", "eu-west-3"),
        ]);
        let c = parse_in(dir.path(), text, &env).unwrap();
        let shared = c.shared.unwrap();
        assert_eq!((shared.bucket.as_str(), shared.prefix.as_str()), ("bucket-a", ""));
        assert_eq!(shared.endpoint, None, "AWS S3 itself");
        assert_eq!(shared.region, "eu-west-3");
        assert_eq!(shared.access_key_id.expose(), "AKIDEXAMPLE");
        assert_eq!(shared.session_token.map(|t| t.expose().to_owned()).as_deref(), Some("tok"));
        let e = parse_in(dir.path(), text, &env_of(&[("AWS_REGION", "eu-west-3")])).unwrap_err().to_string();
        assert!(e.contains("`shared.access_key_id_file`") && e.contains("AWS_ACCESS_KEY_ID"), "{e}");
    }
}
