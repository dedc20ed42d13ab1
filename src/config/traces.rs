//! `[tracing]`: where larder sends its OpenTelemetry spans (OTLP over
//! HTTP, protobuf), how many traces it keeps, and under which service name.
//!
//! The collector comes from the config's `otlp_endpoint`, else from the
//! standard environment variables, in this order (the first one set wins):
//!
//! 1. `[tracing] otlp_endpoint`: a base URL, `/v1/traces` appended (as
//!    `OTEL_EXPORTER_OTLP_ENDPOINT` is read);
//! 2. `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: the full URL, used as it is;
//! 3. `OTEL_EXPORTER_OTLP_ENDPOINT`: a base URL, `/v1/traces` appended.
//!
//! The file wins because it is the deliberate, reviewed setting (the
//! chart writes it); the variables are what an OpenTelemetry operator
//! injects into pods, honoured when the file says nothing. With none of
//! them set, or `OTEL_SDK_DISABLED=true`, nothing is exported and larder
//! reads no `traceparent`.

use std::path::PathBuf;

use serde::Deserialize;

use super::{ConfigError, Validator};

/// The service name spans carry unless the config or `OTEL_SERVICE_NAME` says otherwise.
pub const DEFAULT_SERVICE_NAME: &str = "larder";
/// Longest `service_name` accepted.
const MAX_SERVICE_NAME: usize = 255;
/// The path the OTLP/HTTP trace signal goes to, below a base endpoint.
const TRACES_PATH: &str = "v1/traces";

#[derive(Debug, Clone)]
pub struct TracingConfig {
    /// Where spans are sent; `None`: tracing is off (nothing exported,
    /// `traceparent` neither read nor sent).
    pub export: Option<TraceExport>,
    /// Share of new traces recorded (0.0–1.0); a request that carries a
    /// `traceparent` follows its sampled flag instead (parent-based).
    pub sampling_ratio: f64,
    /// The `service.name` resource attribute.
    pub service_name: String,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig { export: None, sampling_ratio: 1.0, service_name: DEFAULT_SERVICE_NAME.to_owned() }
    }
}

/// The collector's trace endpoint, and which setting named it.
#[derive(Debug, Clone)]
pub struct TraceExport {
    /// The full URL spans are POSTed to (`…/v1/traces`).
    pub url: http::Uri,
    pub from: EndpointSource,
    /// CA certificates (PEM) trusted for an https collector, beside the web PKI roots.
    pub ca_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointSource {
    Config,
    TracesEnv,
    Env,
}

impl EndpointSource {
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointSource::Config => "tracing.otlp_endpoint",
            EndpointSource::TracesEnv => "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            EndpointSource::Env => "OTEL_EXPORTER_OTLP_ENDPOINT",
        }
    }
}

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTracing {
    otlp_endpoint: Option<String>,
    sampling_ratio: Option<f64>,
    service_name: Option<String>,
    ca_file: Option<String>,
}

impl Validator<'_> {
    pub(super) fn tracing(&self, raw: Option<RawTracing>) -> Result<TracingConfig, ConfigError> {
        let rt = raw.unwrap_or_default();
        let sampling_ratio = match rt.sampling_ratio {
            None => 1.0,
            Some(r) if r.is_finite() && (0.0..=1.0).contains(&r) => r,
            Some(r) => return Err(self.err("tracing.sampling_ratio", format!("{r} is not a ratio from 0.0 to 1.0"))),
        };
        let service_name = match rt.service_name {
            Some(name) => {
                self.service_name("tracing.service_name", &name)?;
                name
            }
            None => match (self.env)("OTEL_SERVICE_NAME").filter(|n| !n.is_empty()) {
                Some(name) => {
                    self.service_name("tracing.service_name", &name).map_err(|_| {
                        self.err(
                            "tracing.service_name",
                            format!("unset, and OTEL_SERVICE_NAME={name:?} is not a service name"),
                        )
                    })?;
                    name
                }
                None => DEFAULT_SERVICE_NAME.to_owned(),
            },
        };
        let ca_file = rt.ca_file.as_deref().map(|p| self.readable("tracing.ca_file", p)).transpose()?;
        let disabled = (self.env)("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        let endpoint = match (rt.otlp_endpoint, disabled) {
            (_, true) => None,
            (Some(base), false) => {
                Some((self.otlp_endpoint(&base, true, "tracing.otlp_endpoint", None)?, EndpointSource::Config))
            }
            (None, false) => self.endpoint_from_env()?,
        };
        let export = endpoint.map(|(url, from)| TraceExport { url, from, ca_file });
        Ok(TracingConfig { export, sampling_ratio, service_name })
    }

    fn service_name(&self, key: &str, name: &str) -> Result<(), ConfigError> {
        if name.is_empty() || name.len() > MAX_SERVICE_NAME || name.chars().any(char::is_control) {
            return Err(
                self.err(key, format!("{name:?} is not a service name (1 to {MAX_SERVICE_NAME} printable characters)"))
            );
        }
        Ok(())
    }

    /// The standard variables, when the config names no endpoint.
    fn endpoint_from_env(&self) -> Result<Option<(http::Uri, EndpointSource)>, ConfigError> {
        for (source, base) in [(EndpointSource::TracesEnv, false), (EndpointSource::Env, true)] {
            let name = source.as_str();
            if let Some(value) = (self.env)(name).filter(|v| !v.trim().is_empty()) {
                return Ok(Some((
                    self.otlp_endpoint(value.trim(), base, "tracing.otlp_endpoint", Some(name))?,
                    source,
                )));
            }
        }
        Ok(None)
    }

    /// An http(s) URL with a host and nothing else that cannot go in an
    /// OTLP request: no user or password (headers carry credentials:
    /// `OTEL_EXPORTER_OTLP_HEADERS`), no query, no fragment. A `base` gets
    /// `/v1/traces` appended to its path.
    fn otlp_endpoint(&self, value: &str, base: bool, key: &str, env: Option<&str>) -> Result<http::Uri, ConfigError> {
        let bad = |why: &str| match env {
            Some(name) => self.err(key, format!("unset, and {name}={value:?} {why}")),
            None => self.err(key, format!("{value:?} {why}")),
        };
        let url = url::Url::parse(value).map_err(|e| bad(&format!("is not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(bad("is not an http:// or https:// URL (larder sends OTLP over HTTP)"));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(bad("has no host"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(bad("carries credentials: send them as headers (OTEL_EXPORTER_OTLP_HEADERS)"));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(bad("has a query or fragment"));
        }
        let mut text = url.to_string();
        if base {
            if !text.ends_with('/') {
                text.push('/');
            }
            text.push_str(TRACES_PATH);
        }
        text.parse().map_err(|e| bad(&format!("is not a URL: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{MINIMAL, env_of};
    use super::*;
    use crate::config::Config;

    fn parse(text: &str, env: &'static [(&'static str, &'static str)]) -> Result<Config, ConfigError> {
        Config::parse_with_env(&format!("{text}{MINIMAL}"), "t.toml", None, &env_of(env))
    }

    fn export(text: &str, env: &'static [(&'static str, &'static str)]) -> Option<(String, EndpointSource)> {
        parse(text, env).unwrap().tracing.export.map(|e| (e.url.to_string(), e.from))
    }

    #[test]
    fn off_unless_the_config_or_the_environment_names_a_collector() {
        assert!(export("", &[]).is_none());
        let c = parse("", &[]).unwrap().tracing;
        assert_eq!((c.sampling_ratio, c.service_name.as_str()), (1.0, "larder"));
        assert_eq!(
            export("[tracing]\notlp_endpoint = \"http://collector:4318\"\n", &[]),
            Some(("http://collector:4318/v1/traces".into(), EndpointSource::Config))
        );
        assert_eq!(
            export("[tracing]\notlp_endpoint = \"https://otel.example/base/\"\n", &[]),
            Some(("https://otel.example/base/v1/traces".into(), EndpointSource::Config))
        );
    }

    #[test]
    fn the_config_wins_over_the_traces_variable_which_wins_over_the_general_one() {
        let both = &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://general:4318"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/custom/path"),
        ];
        assert_eq!(
            export("[tracing]\notlp_endpoint = \"http://file:4318\"\n", both),
            Some(("http://file:4318/v1/traces".into(), EndpointSource::Config))
        );
        assert_eq!(export("", both), Some(("http://traces:4318/custom/path".into(), EndpointSource::TracesEnv)));
        assert_eq!(
            export("", &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://general:4318")]),
            Some(("http://general:4318/v1/traces".into(), EndpointSource::Env))
        );
        assert!(
            export("[tracing]\notlp_endpoint = \"http://file:4318\"\n", &[("OTEL_SDK_DISABLED", "TRUE")]).is_none()
        );
        assert!(
            export("", &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://general:4318"), ("OTEL_SDK_DISABLED", "true")])
                .is_none()
        );
    }

    #[test]
    fn the_service_name_comes_from_the_config_then_otel_service_name() {
        let name = |text: &str, env| parse(text, env).unwrap().tracing.service_name;
        assert_eq!(name("", &[("OTEL_SERVICE_NAME", "mirror-eu")]), "mirror-eu");
        assert_eq!(name("[tracing]\nservice_name = \"hub\"\n", &[("OTEL_SERVICE_NAME", "mirror-eu")]), "hub");
    }

    #[test]
    fn bad_values_name_the_key_and_the_file() {
        for (text, env, key, says) in [
            ("[tracing]\notlp_endpoint = \"collector:4318\"\n", &[][..], "tracing.otlp_endpoint", "http"),
            ("[tracing]\notlp_endpoint = \"grpc://c:4317\"\n", &[], "tracing.otlp_endpoint", "OTLP over HTTP"),
            ("[tracing]\notlp_endpoint = \"http://u:p@c:4318\"\n", &[], "tracing.otlp_endpoint", "credentials"),
            ("[tracing]\notlp_endpoint = \"http://c:4318/?a=b\"\n", &[], "tracing.otlp_endpoint", "query"),
            (
                "",
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url")],
                "tracing.otlp_endpoint",
                "OTEL_EXPORTER_OTLP_ENDPOINT",
            ),
            ("[tracing]\nsampling_ratio = 1.5\n", &[], "tracing.sampling_ratio", "from 0.0 to 1.0"),
            ("[tracing]\nsampling_ratio = -0.1\n", &[], "tracing.sampling_ratio", "from 0.0 to 1.0"),
            ("[tracing]\nsampling_ratio = nan\n", &[], "tracing.sampling_ratio", "from 0.0 to 1.0"),
            ("[tracing]\nservice_name = \"\"\n", &[], "tracing.service_name", "service name"),
            ("[tracing]\nca_file = \"/nonexistent/ca.pem\"\n", &[], "tracing.ca_file", "cannot read"),
        ] {
            let env: &'static [(&'static str, &'static str)] = env;
            let e = parse(text, env).unwrap_err().to_string();
            assert!(e.starts_with("t.toml: `"), "{text}: {e}");
            assert!(e.contains(&format!("`{key}`")), "{text}: {e}");
            assert!(e.contains(says), "{text}: {e}");
        }
        let e = parse("[tracing]\nendpoint = \"http://c:4318\"\n", &[]).unwrap_err().to_string();
        assert!(e.contains("t.toml") && e.contains("endpoint"), "unknown keys are errors: {e}");
    }
}
