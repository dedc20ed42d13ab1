//! Which log lines are written: `RUST_LOG` if it is set and valid, else the
//! config's `log.level`, in `EnvFilter`'s syntax either way.
//!
//! Plain `target=level` directives (the default `warn,larder=info`, and most
//! `RUST_LOG` values) become a static [`Targets`] filter: it decides from a
//! callsite's target and level alone, once per callsite. Directives that
//! name spans or field values (`[request{id=...}]=debug`) need an
//! [`EnvFilter`], which keeps state for every open span behind process-wide
//! locks and takes a read lock each time any span is entered or left. Every
//! request has a `request` span, entered and left on each poll from both
//! worker threads; measured on warm manifest GETs (benches/README.md,
//! "The log filter"), the static filter is the cheaper one.

use tracing_subscriber::filter::{EnvFilter, FilterExt, ParseError, Targets, filter_fn};
use tracing_subscriber::layer::Filter;
use tracing_subscriber::{Layer, Registry};

/// A parsed filter, static when the directives allow it (made once, at
/// start-up: both boxed, whatever their sizes).
#[derive(Debug)]
pub enum LogFilter {
    Static(Box<Targets>),
    Dynamic(Box<EnvFilter>),
}

impl LogFilter {
    /// `RUST_LOG` when it is set and parses, else `config_level` (validated
    /// by this same parser when the config was loaded; if it still fails
    /// here, `warn`).
    pub fn from_env_or(config_level: &str) -> LogFilter {
        std::env::var(EnvFilter::DEFAULT_ENV)
            .ok()
            .and_then(|env| LogFilter::parse(&env).ok())
            .or_else(|| LogFilter::parse(config_level).ok())
            .unwrap_or_else(|| LogFilter::Static(Box::new(Targets::new().with_default(tracing::Level::WARN))))
    }

    /// The config's `log.level` and `RUST_LOG` both go through here: an
    /// error is `EnvFilter`'s, for the directives it refuses.
    pub fn parse(directives: &str) -> Result<LogFilter, ParseError> {
        if is_static(directives)
            && let Ok(targets) = directives.parse::<Targets>()
        {
            return Ok(LogFilter::Static(Box::new(targets)));
        }
        EnvFilter::try_new(directives).map(|env| LogFilter::Dynamic(Box::new(env)))
    }

    pub fn into_layer(self) -> Box<dyn Layer<Registry> + Send + Sync> {
        match self {
            LogFilter::Static(targets) => targets,
            LogFilter::Dynamic(env) => env,
        }
    }

    /// The same filter for one layer (the log's, beside the OpenTelemetry
    /// layer when tracing is on), leaving out the spans made for
    /// OpenTelemetry alone ([`crate::otel::TARGET`]): log lines read the
    /// same with tracing on or off.
    pub fn into_log_filter<S>(self) -> Box<dyn Filter<S> + Send + Sync>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        let not_otel = filter_fn(|meta| meta.target() != crate::otel::TARGET);
        match self {
            LogFilter::Static(targets) => Box::new((*targets).and(not_otel)),
            LogFilter::Dynamic(env) => Box::new((*env).and(not_otel)),
        }
    }
}

/// Only comma-separated `level`, `target` or `target=level`, with targets
/// of Rust paths: anything else (spans, fields, spaces, empty directives)
/// is left to `EnvFilter`, whose reading of it `Targets` does not share.
fn is_static(directives: &str) -> bool {
    let word =
        |s: &str, also: &[char]| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || also.contains(&c));
    directives.split(',').all(|d| match d.split_once('=') {
        Some((target, level)) => word(target, &['_', ':', '-']) && word(level, &[]),
        None => word(d, &['_', ':', '-']),
    })
}

#[cfg(test)]
mod tests {
    use tracing::Level;

    use super::LogFilter;

    fn targets(directives: &str) -> tracing_subscriber::filter::Targets {
        match LogFilter::parse(directives) {
            Ok(LogFilter::Static(t)) => *t,
            other => panic!("{directives:?} should be static, got {other:?}"),
        }
    }

    #[test]
    fn the_default_filter_is_static_and_reads_as_env_filter_would() {
        let t = targets("warn,larder=info");
        assert!(t.would_enable("larder::server", &Level::INFO));
        assert!(!t.would_enable("larder::server", &Level::DEBUG));
        assert!(t.would_enable("hyper", &Level::WARN));
        assert!(!t.would_enable("hyper", &Level::INFO));
        let t = targets("larder::cache=debug,info");
        assert!(t.would_enable("larder::cache::fill", &Level::DEBUG));
        assert!(!t.would_enable("larder::server", &Level::DEBUG));
        assert!(t.would_enable("larder::server", &Level::INFO));
        assert!(!targets("off").would_enable("larder", &Level::ERROR));
    }

    #[test]
    fn spans_fields_and_odd_spellings_go_to_env_filter() {
        for directives in ["larder[request]=debug", "[{id=1}]=trace", "warn, larder=info", "warn,", "=info"] {
            assert!(
                !matches!(LogFilter::parse(directives), Ok(LogFilter::Static(_))),
                "{directives:?} must not be read as a static filter"
            );
        }
        assert!(matches!(LogFilter::parse("larder[request]=debug"), Ok(LogFilter::Dynamic(_))));
        assert!(LogFilter::parse("larder=loud").is_err(), "refused, as EnvFilter refuses it");
    }
}
