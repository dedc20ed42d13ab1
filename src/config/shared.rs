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
    /// How larder signs its requests to the store.
    pub credentials: SharedCredentials,
    /// Objects uploaded longer ago than this are deleted by a sweep; `None`
    /// leaves expiry to the bucket's lifecycle rules.
    pub max_age: Option<Duration>,
}

/// How the shared tier's requests are signed.
#[derive(Debug, Clone)]
pub enum SharedCredentials {
    /// Keys read once: `access_key_id_file` and `secret_access_key_file`,
    /// or `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` (with
    /// `AWS_SESSION_TOKEN` if set) from the environment, which a running
    /// process cannot see change.
    Static { access_key_id: Secret, secret_access_key: Secret, session_token: Option<Secret> },
    /// The AWS credential chain (`object_store`'s): web identity
    /// (`AWS_WEB_IDENTITY_TOKEN_FILE` and `AWS_ROLE_ARN`, as IRSA sets
    /// them), EKS Pod Identity or ECS container credentials
    /// (`AWS_CONTAINER_CREDENTIALS_*`), else the instance metadata service.
    /// Temporary credentials are fetched again before they expire, so
    /// rotating ones keep working.
    Chain,
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
            (None, None) => (self.env)("AWS_REGION")
                .or_else(|| (self.env)("AWS_DEFAULT_REGION"))
                .or_else(|| self.env_var("shared.region", "AWS_REGION", "us-east-1"))
                .ok_or_else(|| {
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
        let credentials = match (&s.access_key_id_file, &s.secret_access_key_file) {
            (Some(id), Some(secret)) => SharedCredentials::Static {
                access_key_id: self.secret_file("shared.access_key_id_file", id)?,
                secret_access_key: self.secret_file("shared.secret_access_key_file", secret)?,
                session_token: None,
            },
            (None, None) => {
                let var = |name: &str| (self.env)(name).filter(|v| !v.is_empty());
                let chain_source = ["AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"]
                    .iter()
                    .chain(&["AWS_CONTAINER_CREDENTIALS_FULL_URI"])
                    .any(|name| var(name).is_some());
                match (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
                    (Some(id), Some(secret)) => SharedCredentials::Static {
                        access_key_id: Secret::new(id),
                        secret_access_key: Secret::new(secret),
                        session_token: var("AWS_SESSION_TOKEN").map(Secret::new),
                    },
                    // A rotating source, or AWS itself (its instance
                    // metadata); an S3-compatible store needs one of them
                    // named or keys.
                    _ if chain_source || endpoint.is_none() => SharedCredentials::Chain,
                    _ if self.skip("shared.access_key_id_file", || {
                        "not set, and AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set here: checked as if \
                         the environment larder runs in sets them"
                            .to_owned()
                    }) =>
                    {
                        SharedCredentials::Chain
                    }
                    _ => {
                        return Err(self.err(
                            "shared.access_key_id_file",
                            "set access_key_id_file and secret_access_key_file, or AWS_ACCESS_KEY_ID and \
                             AWS_SECRET_ACCESS_KEY (or a web identity, AWS_WEB_IDENTITY_TOKEN_FILE and \
                             AWS_ROLE_ARN) in the environment",
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
        Ok(SharedConfig { bucket, prefix, endpoint, region, credentials, max_age })
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
    use super::SharedCredentials;
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
        let SharedCredentials::Static { access_key_id, session_token, .. } = shared.credentials else {
            panic!("keys in the environment are static")
        };
        assert_eq!(access_key_id.expose(), "AKIDEXAMPLE");
        assert_eq!(session_token.map(|t| t.expose().to_owned()).as_deref(), Some("tok"));
    }

    #[test]
    fn without_keys_the_shared_tier_uses_the_aws_credential_chain_so_temporary_credentials_rotate() {
        let dir = secrets_dir();
        let chain = |text: &str, env: &'static [(&'static str, &'static str)]| {
            let c = parse_in(dir.path(), text, &env_of(env)).map(|c| c.shared.unwrap().credentials);
            matches!(c, Ok(SharedCredentials::Chain))
        };
        let aws = "[shared]\nurl = \"s3://bucket-a\"\nregion = \"eu-west-3\"\n";
        const IRSA: &[(&str, &str)] =
            &[("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/secrets/eks/token"), ("AWS_ROLE_ARN", "arn:aws:iam::1:role/l")];
        assert!(chain(aws, IRSA), "web identity (IRSA)");
        assert!(chain(aws, &[]), "on AWS: the instance's or pod's role");
        let garage = "[shared]\nurl = \"s3://bucket-a\"\nregion = \"garage\"\nendpoint = \"http://garage:3900\"\n";
        assert!(chain(garage, IRSA), "a web identity named for another store");
        assert!(
            chain(garage, &[("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://169.254.170.23/v1/credentials")]),
            "EKS Pod Identity"
        );
        let e = parse_in(dir.path(), garage, &env_of(&[])).unwrap_err().to_string();
        assert!(e.contains("`shared.access_key_id_file`") && e.contains("AWS_ACCESS_KEY_ID"), "{e}");
        const KEYS: &[(&str, &str)] =
            &[("AWS_ACCESS_KEY_ID", "AKID"), ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_WEB_IDENTITY_TOKEN_FILE", "/t")];
        assert!(!chain(aws, KEYS), "keys given are used as they are");
    }
}
