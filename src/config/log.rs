//! `[log]`: the log filter and format.

use serde::Deserialize;

use super::{ConfigError, Validator};

#[derive(Debug, Clone)]
pub struct LogConfig {
    /// A `tracing` filter (`"info"`, `"warn,larder=debug"`); `RUST_LOG` wins.
    pub level: String,
    pub format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Default log filter: larder's own lines at info, other crates' warnings.
pub const DEFAULT_LOG_LEVEL: &str = "warn,larder=info";

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    level: Option<String>,
    format: Option<String>,
}

impl Validator<'_> {
    pub(super) fn log(&self, raw: Option<RawLog>) -> Result<LogConfig, ConfigError> {
        let rl = raw.unwrap_or_default();
        let level = rl.level.unwrap_or_else(|| DEFAULT_LOG_LEVEL.to_owned());
        crate::log_filter::LogFilter::parse(&level)
            .map_err(|e| self.err("log.level", format!("{level:?} is not a log filter like \"info\": {e}")))?;
        let format = match rl.format.as_deref() {
            None | Some("text") => LogFormat::Text,
            Some("json") => LogFormat::Json,
            Some(other) => return Err(self.err("log.format", format!("{other:?} is not \"text\" or \"json\""))),
        };
        Ok(LogConfig { level, format })
    }
}
