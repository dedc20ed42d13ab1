//! larder's admin listener in a test: a free port, optionally an
//! `[admin] token_file`, and the `larder` operator commands run against it.
//!
//! ```ignore
//! let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), "a-test-token-0123456789");
//! let larder = builder.start().await;
//! let out = admin.cli(&["status"]);
//! ```

use std::path::PathBuf;
use std::process::{Command, Output};

use tempfile::TempDir;

use super::larder::{LarderBuilder, binary};
use super::tools::free_port;

/// Where a test larder's admin listener is, and its token.
pub struct Admin {
    pub port: u16,
    pub token: Option<String>,
    dir: TempDir,
}

impl Admin {
    /// An admin listener on 127.0.0.1 without a token file: larder writes
    /// a token of its own into its cache folder ([`generated_token`]).
    pub fn open(builder: LarderBuilder) -> (LarderBuilder, Admin) {
        Self::setup(builder, None)
    }

    /// An admin listener on 127.0.0.1 with `token` in its `[admin] token_file`.
    pub fn with_token(builder: LarderBuilder, token: &str) -> (LarderBuilder, Admin) {
        Self::setup(builder, Some(token))
    }

    fn setup(builder: LarderBuilder, token: Option<&str>) -> (LarderBuilder, Admin) {
        let dir = tempfile::Builder::new().prefix("larder-admin-").tempdir().expect("temp dir");
        let port = free_port();
        let mut builder = builder.server_line(&format!("admin_listen = \"127.0.0.1:{port}\""));
        if let Some(token) = token {
            let path = dir.path().join("admin-token");
            std::fs::write(&path, format!("{token}\n")).expect("write the token file");
            builder = builder.append_toml(&format!("[admin]\ntoken_file = {:?}", path.display().to_string()));
        }
        (builder, Admin { port, token: token.map(str::to_owned), dir })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A file holding the token, for `--token-file`.
    pub fn token_file(&self) -> PathBuf {
        self.dir.path().join("admin-token")
    }

    /// `larder ARGS --admin URL [--token-file F]`, stdout not a terminal,
    /// `LARDER_ADMIN*` unset: its output.
    pub fn cli(&self, args: &[&str]) -> Output {
        let mut command = self.command(args);
        if self.token.is_some() {
            command.arg("--token-file").arg(self.token_file());
        }
        command.output().unwrap_or_else(|e| panic!("cannot run larder {args:?}: {e}"))
    }

    /// `larder ARGS --admin URL` without any token.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(binary());
        command
            .args(args)
            .arg("--admin")
            .arg(self.url())
            .env_remove("LARDER_ADMIN")
            .env_remove("LARDER_ADMIN_TOKEN")
            .env_remove("LARDER_ADMIN_TOKEN_FILE");
        command
    }
}

/// The token larder wrote at start-up (`cache.dir/admin-token`) because
/// its loopback admin listener has no `[admin] token_file`.
pub fn generated_token(larder: &super::Larder) -> String {
    let path = larder.cache_dir().join("admin-token");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.trim().to_owned()
}

/// stdout of a command, as text.
pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// stderr of a command, as text.
pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Bytes as larder's operator commands print them: `1.5 MiB`.
pub fn human_bytes(n: u64) -> String {
    larder::server::admin::status_page::bytes(n)
}
