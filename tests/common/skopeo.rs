//! Driving skopeo: pulls into `dir:` layouts, pushes, `inspect --raw`.
//!
//! Every run uses `--insecure-policy` (no trust policy on the machine is
//! needed) and plain HTTP to 127.0.0.1 (`--*-tls-verify=false`: skopeo tries
//! HTTPS first, then falls back to HTTP).

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tempfile::TempDir;

use super::image::Blob;
use super::origin::sha256_digest;
use super::token_server::Credentials;
use super::tools::which;

/// How long one skopeo run may take before the test fails instead of hanging.
pub const SKOPEO_TIMEOUT: Duration = Duration::from_secs(120);

/// A skopeo run that failed (or timed out), with what it said.
#[derive(Debug)]
pub struct SkopeoError {
    pub command: String,
    /// The exit code; `None` when it was killed or timed out.
    pub code: Option<i32>,
    pub stderr: String,
}

impl fmt::Display for SkopeoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let code = self.code.map_or_else(|| "no exit code".to_owned(), |code| format!("exit code {code}"));
        write!(f, "`{}` failed ({code}):\n{}", self.command, self.stderr.trim_end())
    }
}

impl std::error::Error for SkopeoError {}

/// Runs `skopeo --insecure-policy <args>` and returns its stdout.
pub async fn run(args: &[String]) -> Result<Vec<u8>, SkopeoError> {
    let binary = which("skopeo");
    let command_line = format!("skopeo --insecure-policy {}", args.join(" "));
    let child = tokio::process::Command::new(binary)
        .arg("--insecure-policy")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start `{command_line}`: {e}"));
    let output = match tokio::time::timeout(SKOPEO_TIMEOUT, child.wait_with_output()).await {
        Ok(Ok(output)) => output,
        Ok(Err(e)) => panic!("waiting for `{command_line}` failed: {e}"),
        Err(_) => {
            return Err(SkopeoError {
                command: command_line,
                code: None,
                stderr: format!("timed out after {SKOPEO_TIMEOUT:?}"),
            });
        }
    };
    if output.status.success() {
        Ok(output.stdout)
    } else {
        Err(SkopeoError {
            command: command_line,
            code: output.status.code(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        })
    }
}

/// A `skopeo copy docker://… dir:…` to run; see [`pull`] for the common case.
#[derive(Clone, Debug)]
pub struct Pull {
    source: String,
    all: bool,
    credentials: Option<Credentials>,
    /// Over verified HTTPS: the CA (PEM) that signed larder's certificate,
    /// and a client certificate and key (PEM) to present, if any.
    tls: Option<(String, Option<(String, String)>)>,
}

impl Pull {
    /// Pulls `source` (`docker://host:port/repo:tag`) anonymously.
    pub fn new(source: &str) -> Self {
        Pull { source: source.to_owned(), all: false, credentials: None, tls: None }
    }

    /// Copies every image of an index (`--all`), not just this platform's.
    pub fn all(mut self, all: bool) -> Self {
        self.all = all;
        self
    }

    /// Sends `credentials` (`--src-creds`) instead of pulling anonymously.
    pub fn credentials(mut self, credentials: &Credentials) -> Self {
        self.credentials = Some(credentials.clone());
        self
    }

    /// Over HTTPS verified against `ca_pem`, presenting `client` (a
    /// certificate and its key, PEM) when given (`--src-cert-dir`).
    pub fn tls(mut self, ca_pem: &str, client: Option<(&str, &str)>) -> Self {
        self.tls = Some((ca_pem.to_owned(), client.map(|(c, k)| (c.to_owned(), k.to_owned()))));
        self
    }

    pub async fn run(self) -> Result<PulledImage, SkopeoError> {
        let dir = tempfile::Builder::new()
            .prefix("larder-pull-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a temp dir to pull into: {e}"));
        let target = dir.path().join("image");
        let mut args = vec!["copy".to_owned()];
        match &self.tls {
            None => args.push("--src-tls-verify=false".to_owned()),
            Some((ca, client)) => {
                // containers/image: `ca.crt`, and `<name>.cert` with `<name>.key`.
                let certs = dir.path().join("certs");
                std::fs::create_dir(&certs).expect("a cert dir");
                std::fs::write(certs.join("ca.crt"), ca).expect("write ca.crt");
                if let Some((cert, key)) = client {
                    std::fs::write(certs.join("client.cert"), cert).expect("write client.cert");
                    std::fs::write(certs.join("client.key"), key).expect("write client.key");
                }
                args.push(format!("--src-cert-dir={}", certs.display()));
            }
        }
        match &self.credentials {
            Some(credentials) => args.push(format!("--src-creds={}", credentials.colon_joined())),
            None => args.push("--src-no-creds".to_owned()),
        }
        if self.all {
            args.push("--all".to_owned());
        }
        args.push(self.source.clone());
        args.push(format!("dir:{}", target.display()));
        run(&args).await?;
        Ok(PulledImage::read(dir, target))
    }
}

/// `skopeo copy [--all] <source> dir:<temp>` without credentials.
pub async fn pull(source: &str, all: bool) -> Result<PulledImage, SkopeoError> {
    Pull::new(source).all(all).run().await
}

/// `skopeo inspect --raw <source>`: the manifest bytes as served.
pub async fn inspect_raw(source: &str) -> Result<Vec<u8>, SkopeoError> {
    let args = [
        "inspect".to_owned(),
        "--raw".to_owned(),
        "--tls-verify=false".to_owned(),
        "--no-creds".to_owned(),
        source.to_owned(),
    ];
    run(&args).await
}

/// `skopeo inspect <source>`: what a look at an image fetches (its
/// manifest and config); skopeo's JSON report.
pub async fn inspect(source: &str) -> Result<Vec<u8>, SkopeoError> {
    let args = ["inspect".to_owned(), "--tls-verify=false".to_owned(), "--no-creds".to_owned(), source.to_owned()];
    run(&args).await
}

/// What a `dir:` pull wrote, with digests computed from the files' bytes.
pub struct PulledImage {
    /// `sha256:` of `manifest.json` (the index, for `--all` of an index).
    pub manifest_digest: String,
    pub manifest: Vec<u8>,
    /// Digests of the per-platform manifests an `--all` pull wrote.
    pub child_manifest_digests: Vec<String>,
    /// Every blob file (configs and layers), sorted by digest.
    pub blobs: Vec<Blob>,
    path: PathBuf,
    _dir: TempDir,
}

impl PulledImage {
    fn read(dir: TempDir, path: PathBuf) -> Self {
        let manifest_path = path.join("manifest.json");
        let manifest = read(&manifest_path);
        let mut child_manifest_digests = Vec::new();
        let mut blobs = Vec::new();
        let entries =
            std::fs::read_dir(&path).unwrap_or_else(|e| panic!("cannot list the pulled dir {}: {e}", path.display()));
        for entry in entries {
            let entry = entry.unwrap_or_else(|e| panic!("cannot list {}: {e}", path.display()));
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.strip_suffix(".manifest.json").is_some_and(is_hex_digest) {
                child_manifest_digests.push(sha256_digest(&read(&entry.path())));
            } else if is_hex_digest(&name) {
                let bytes = read(&entry.path());
                blobs.push(Blob { digest: sha256_digest(&bytes), size: bytes.len() as u64 });
            }
        }
        child_manifest_digests.sort();
        blobs.sort();
        PulledImage {
            manifest_digest: sha256_digest(&manifest),
            manifest,
            child_manifest_digests,
            blobs,
            path,
            _dir: dir,
        }
    }

    /// The `dir:` layout on disk (removed when this value is dropped).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The blob digests, sorted.
    pub fn blob_digests(&self) -> Vec<String> {
        self.blobs.iter().map(|blob| blob.digest.clone()).collect()
    }
}

fn is_hex_digest(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit())
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}
