//! The `larder` command: parse the CLI, load the config, set up logs, run;
//! or, for the operator commands (`prefetch`, `purge`, `status`, `export`,
//! `import`), talk to a running larder's admin listener (see `larder::cli`;
//! `import` loads a stopped cache folder itself).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use larder::cli::Target;
use larder::config::{Config, LogConfig, LogFormat};
use larder::log_filter::LogFilter;
use larder::log_writer::{Flush, LogWriter};
use larder::server::access_log;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

#[derive(Parser)]
#[command(version, about = "A pull-through caching proxy for OCI/Docker registries")]
struct Cli {
    /// Config file (TOML). Without it, the embedded default config is used
    /// (cache folder ./larder-data, admin listener 0.0.0.0:9090).
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
    /// Validate a config file and exit: warnings, then what the config
    /// means (sizes in bytes, the admin listener's rules).
    CheckConfig {
        /// Check everything but what holds secrets or exists only where
        /// larder runs (password, token and key files, certificates,
        /// unset environment variables), and list what was skipped: for a
        /// config repository's CI.
        #[arg(long)]
        without_secrets: bool,
    },
    /// Re-hash every cached blob and compare with the index; run it while
    /// larder is stopped. Exit status 1 if bad entries remain.
    Verify {
        /// Remove bad entries (and index correct files that lost their row).
        #[arg(long)]
        repair: bool,
    },
    /// Warm a running larder's cache with an image (every platform of an
    /// index, or one), showing progress.
    Prefetch {
        /// `[registry/]repository[:tag|@digest]`, routed like a pull.
        image: String,
        /// Only this platform of a multi-platform image, e.g. `linux/arm64`.
        #[arg(long)]
        platform: Option<String>,
        /// Also cache its referrers (signatures, SBOMs, attestations, from
        /// the referrers API or cosign's `sha256-<hex>.sig` tags) and their
        /// blobs, so they are served with upstream gone.
        #[arg(long)]
        referrers: bool,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Forget an upstream, or one repository of it, in a running larder.
    Purge {
        /// The upstream's name or alias, e.g. `docker.io`.
        upstream: String,
        /// Only this repository, e.g. `library/alpine`.
        repo: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Write images as an OCI image layout (skopeo's `oci:DIR`) for an
    /// air-gapped site, through a running larder: each image is fetched
    /// into its cache first (with progress), then written into `--output`.
    Export {
        /// `[registry/]repository[:tag|@digest]`, routed like a pull.
        #[arg(required = true)]
        images: Vec<String>,
        /// The layout folder (created; images already in it are kept).
        #[arg(long)]
        output: PathBuf,
        /// Only this platform of a multi-platform image, e.g. `linux/arm64`.
        #[arg(long)]
        platform: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Load an OCI image layout (a folder, or a tar of one) into the cache,
    /// every blob verified first; into the stopped cache folder of
    /// `--config`, or through the admin listener while larder runs.
    Import {
        /// The layout folder (`oci:DIR`) or archive (`oci-archive:FILE`).
        path: PathBuf,
        /// Where its images go, `UPSTREAM/REPO` (needed when the layout
        /// names them by tag alone, as skopeo's `oci:DIR:TAG` does).
        #[arg(long = "as", value_name = "UPSTREAM/REPO")]
        as_name: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Show a running larder's cache, upstreams and repositories.
    Status {
        /// Print the JSON the admin listener answers instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        admin: AdminArgs,
    },
}

/// Where the running larder's admin listener is, and its token. With
/// `--config`, its `server.admin_listen` and `[admin] token_file` are used
/// unless these say otherwise.
#[derive(Args)]
struct AdminArgs {
    /// Admin listener URL (default: from --config, else http://127.0.0.1:9090).
    #[arg(long, env = "LARDER_ADMIN")]
    admin: Option<String>,
    /// File holding the admin token (or the token itself in LARDER_ADMIN_TOKEN).
    #[arg(long, env = "LARDER_ADMIN_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// CA certificates (PEM) to trust for an https admin listener, beside
    /// the public roots (with --config, larder's own admin certificate is
    /// trusted as it is).
    #[arg(long, env = "LARDER_ADMIN_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// Verify the admin certificate under this DNS name instead of the
    /// URL's host (e.g. the Service's name through a port-forward).
    #[arg(long, env = "LARDER_ADMIN_TLS_NAME")]
    tls_name: Option<String>,
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

/// Descriptors kept for what is not a client connection: blob files being
/// read or filled, the index, upstream and peer connections, the admin port.
const DESCRIPTOR_RESERVE: u64 = 1024;

/// Logs to stderr: `RUST_LOG` if set, else the config's filter. Text logs
/// are coloured only when stderr is a terminal (and `NO_COLOR` is unset),
/// so files and pipes get plain text; JSON never has colour.
///
/// Lines are formatted on the thread that logs and written by a thread of
/// their own ([`LogWriter`]), so a slow or stalled stderr (a full pipe to
/// the container runtime) never blocks serving: lines past its queue limit
/// are dropped and counted. The returned guard writes what is queued when
/// `main` returns.
fn init_logs(config: &LogConfig, cli: Option<CliLogFormat>) -> std::io::Result<Flush> {
    let filter = LogFilter::from_env_or(&config.level).into_layer();
    let format = match cli {
        Some(CliLogFormat::Text) => LogFormat::Text,
        Some(CliLogFormat::Json) => LogFormat::Json,
        None => config.format,
    };
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let ansi = std::io::stderr().is_terminal() && !no_color;
    let (writer, flush) = LogWriter::start(std::io::stderr())?;
    larder::metrics::count_dropped_log_lines(writer.clone());
    // Request lines are formatted by larder itself into the same writer,
    // in the same layout; coloured terminal lines stay tracing's.
    if !ansi {
        access_log::install(writer.clone(), format);
    }
    let logs = tracing_subscriber::registry().with(filter);
    let layer = tracing_subscriber::fmt::layer().with_writer(writer);
    match format {
        LogFormat::Text => logs.with(layer.with_ansi(ansi)).init(),
        LogFormat::Json => logs.with(layer.json().with_ansi(false)).init(),
    }
    Ok(flush)
}

/// Runs an operator command against the admin listener: exit status 0
/// when it succeeded, 1 when larder refused or failed it, 2 for usage errors.
fn operator(command: Command, config_path: Option<&PathBuf>) -> ExitCode {
    let (name, admin) = match &command {
        Command::Prefetch { admin, .. } => ("prefetch", admin),
        Command::Purge { admin, .. } => ("purge", admin),
        Command::Status { admin, .. } => ("status", admin),
        Command::Export { admin, .. } => ("export", admin),
        Command::Import { admin, .. } => ("import", admin),
        _ => return ExitCode::from(2),
    };
    let config = match config_path.map(|p| Config::load(p)).transpose() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("larder {name}: {e}");
            return ExitCode::from(2);
        }
    };
    let target = Target {
        admin: admin.admin.clone(),
        token_file: admin.token_file.clone(),
        token: std::env::var(larder::cli::TOKEN_ENV).ok().filter(|t| !t.is_empty()),
        ca_file: admin.ca_file.clone(),
        tls_name: admin.tls_name.clone(),
        config_path: config_path.cloned(),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("larder {name}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        if let Command::Import { path, as_name, .. } = &command {
            // The cache folder and upstreams are the config's (or the
            // embedded default's); the admin listener only if larder runs.
            let config = match config.clone().map_or_else(Config::embedded_default, Ok) {
                Ok(c) => c,
                Err(e) => return Err(larder::cli::client::CallError::Usage(e.to_string())),
            };
            let client = || target.client(Some(&config));
            return larder::cli::seed::import(&config, client, path, as_name.as_deref()).await;
        }
        let client = target.client(config.as_ref())?;
        match &command {
            Command::Prefetch { image, platform, referrers, .. } => {
                let terminal = std::io::stdout().is_terminal();
                larder::cli::prefetch::run(&client, image, platform.as_deref(), *referrers, terminal).await
            }
            Command::Purge { upstream, repo, .. } => larder::cli::purge(&client, upstream, repo.as_deref()).await,
            Command::Status { json, .. } => larder::cli::status(&client, *json).await,
            Command::Export { images, output, platform, .. } => {
                let terminal = std::io::stdout().is_terminal();
                larder::cli::seed::export(&client, images, platform.as_deref(), output, terminal).await
            }
            _ => Ok(()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("larder {name}: {e}");
            match e {
                larder::cli::client::CallError::Usage(_) => ExitCode::from(2),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, None | Some(Command::Run)) {
        end_on_a_closed_pipe();
    }
    if let Some(
        command @ (Command::Prefetch { .. }
        | Command::Purge { .. }
        | Command::Status { .. }
        | Command::Export { .. }
        | Command::Import { .. }),
    ) = cli.command
    {
        return operator(command, cli.config.as_ref());
    }
    if let Some(Command::CheckConfig { without_secrets }) = cli.command {
        return ExitCode::from(larder::cli::check_config::run(cli.config.as_deref(), without_secrets));
    }
    let config = match load(cli.config.as_ref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("larder: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(Command::Verify { repair }) = cli.command {
        return ExitCode::from(larder::cli::verify::run(&config, repair, std::io::stdout().is_terminal()));
    }
    let _logs = match init_logs(&config.log, cli.log_format) {
        Ok(flush) => flush,
        Err(e) => {
            eprintln!("larder: cannot start the log writer: {e}");
            return ExitCode::FAILURE;
        }
    };
    for warning in config.warnings() {
        tracing::warn!("config: {warning}");
    }
    // Each client connection and each blob being read holds a descriptor;
    // the usual soft limit of 1024 is far below the connection limit.
    let wanted = config.server.max_connections as u64 + DESCRIPTOR_RESERVE;
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) if limit < wanted => tracing::warn!(
            limit,
            max_connections = config.server.max_connections,
            "the open file limit is below server.max_connections plus {DESCRIPTOR_RESERVE} for files and upstreams: \
             past it clients get errors instead of waiting; raise the limit or lower server.max_connections"
        ),
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

/// The operator commands end as Unix filters do when whoever reads their
/// output stops (`larder check-config | head -1`): killed by SIGPIPE,
/// status 141 in a shell, without a word, rather than panicking in
/// `println!`. Rust ignores SIGPIPE, which the server needs (a client or
/// a credential helper that went away is an error to handle, not death);
/// these commands write to sockets only with `MSG_NOSIGNAL` (std does)
/// and run no credential helper (they never dial an upstream themselves),
/// so only stdout and stderr can raise it.
fn end_on_a_closed_pipe() {
    // SAFETY: called before any thread is started; `signal` only sets the
    // disposition of SIGPIPE back to the default.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
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
