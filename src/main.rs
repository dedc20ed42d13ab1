//! The `larder` command: parse the CLI, load the config, set up logs, run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use larder::config::{Config, LogConfig, LogFormat};

#[derive(Parser)]
#[command(version, about = "A pull-through caching proxy for OCI/Docker registries")]
struct Cli {
    /// Config file (TOML). Without it, larder runs its embedded default.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Log format; overrides the config's `log.format`.
    #[arg(long, value_enum, global = true)]
    log_format: Option<CliLogFormat>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy (the default).
    Run,
    /// Validate a config file and exit.
    CheckConfig,
    /// Re-hash every cached blob and compare with the index; run it while
    /// larder is stopped. Exit status 1 if bad entries remain.
    Verify {
        /// Remove bad entries (and index correct files that lost their row).
        #[arg(long)]
        repair: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum CliLogFormat {
    Text,
    Json,
}

fn load(path: Option<&PathBuf>) -> Result<Config, larder::config::ConfigError> {
    match path {
        Some(p) => Config::load(p),
        None => Config::embedded_default(),
    }
}

/// Logs to stderr: `RUST_LOG` if set, else the config's filter.
fn init_logs(config: &LogConfig, cli: Option<CliLogFormat>) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&config.level));
    let format = match cli {
        Some(CliLogFormat::Text) => LogFormat::Text,
        Some(CliLogFormat::Json) => LogFormat::Json,
        None => config.format,
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match load(cli.config.as_ref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("larder: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(Command::CheckConfig) = cli.command {
        let source = cli.config.as_ref().map_or("embedded default config".to_owned(), |p| p.display().to_string());
        println!("{source}: ok ({} upstreams)", config.upstreams.len());
        return ExitCode::SUCCESS;
    }
    if let Some(Command::Verify { repair }) = cli.command {
        return verify(&config, repair);
    }
    init_logs(&config.log, cli.log_format);
    // Each client connection and each blob being read holds a descriptor;
    // the usual soft limit of 1024 is far below the connection limit.
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => tracing::debug!(limit, "open file limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open file limit"),
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("larder: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let (stop, shutdown) = tokio::sync::watch::channel(());
        let started = match larder::app::start(config, shutdown).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot start");
                return ExitCode::FAILURE;
            }
        };
        let mut serve = tokio::spawn(started.serve);
        tokio::select! {
            _ = &mut serve => return ExitCode::FAILURE,
            signal = termination() => tracing::info!(signal, "shutting down"),
        }
        let _ = stop.send(());
        match serve.await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, "server task failed");
                ExitCode::FAILURE
            }
        }
    })
}

fn verify(config: &Config, repair: bool) -> ExitCode {
    let report = match larder::cache::Cache::verify(&config.cache, repair) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("larder verify: {}: {e}", config.cache.dir.display());
            return ExitCode::FAILURE;
        }
    };
    for problem in &report.problems {
        println!("bad: {problem}");
    }
    println!(
        "{}: {} ok, {} bad ({} index rows, {} files), {} unindexed files {}",
        config.cache.dir.display(),
        report.ok,
        report.bad(),
        report.bad_rows,
        report.bad_files,
        report.adopted,
        if repair { "indexed" } else { "found" },
    );
    if repair {
        if report.bad() > 0 {
            println!("repaired: bad entries removed");
        }
        ExitCode::SUCCESS
    } else if report.bad() > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Waits for SIGTERM (Kubernetes, systemd) or SIGINT (Ctrl-C).
async fn termination() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        // Without signal handlers there is nothing to wait for but Ctrl-C.
        let _ = tokio::signal::ctrl_c().await;
        return "SIGINT";
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}
