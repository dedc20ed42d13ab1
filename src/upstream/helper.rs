//! The docker credential-helper protocol, `get` only: larder runs
//! `docker-credential-<name> get`, writes the registry host to its stdin,
//! and reads `{"ServerURL","Username","Secret"}` from its stdout (what
//! `docker-credential-ecr-login`, `-gcr`, `-acr-env` and the desktop
//! keychain helpers speak). The helper is bounded in time and output, and
//! killed if it outlives its timeout. Its stdout is never quoted anywhere,
//! not even when it fails: a helper may print its answer, secret included,
//! and then exit non-zero. Only the first line of its stderr, bounded,
//! goes into the error, which larder logs and never shows a client.

use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use crate::config::{Credentials, Secret};

/// Longest a helper may take (ecr-login calls AWS, which can be slow);
/// after it the helper is killed and the request fails with a clear error.
pub const HELPER_TIMEOUT: Duration = Duration::from_secs(10);
/// Most bytes read from a helper's stdout or stderr; more is an error.
const MAX_HELPER_OUTPUT: u64 = 64 << 10;
/// Longest part of a failing helper's stderr quoted in errors (and so in
/// larder's log).
const MAX_QUOTED_MESSAGE: usize = 200;

/// How running a helper failed; each names the program.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HelperError {
    #[error("credential helper {program} is not on PATH")]
    Missing { program: String },
    #[error("credential helper {program} did not answer within {}; it was killed", humantime::format_duration(*timeout))]
    Timeout { program: String, timeout: Duration },
    #[error("credential helper {program} failed ({status}): {message}")]
    Failed { program: String, status: String, message: String },
    #[error("credential helper {program} answered with {what}")]
    BadOutput { program: String, what: &'static str },
}

impl HelperError {
    /// The metrics label for this failure.
    pub fn reason(&self) -> &'static str {
        match self {
            HelperError::Missing { .. } => "helper_missing",
            HelperError::Timeout { .. } => "helper_timeout",
            HelperError::Failed { .. } | HelperError::BadOutput { .. } => "helper_failed",
        }
    }
}

/// What a helper prints. Deliberately not `Debug`: it holds the secret.
#[derive(Deserialize)]
struct Output {
    #[serde(rename = "Username")]
    username: String,
    #[serde(rename = "Secret")]
    secret: String,
}

/// The program a `credential_helper = "<name>"` runs (found on `PATH`).
pub fn program(name: &str) -> String {
    format!("docker-credential-{name}")
}

/// Runs `<program> get` for registry `server` (host[:port]).
pub async fn get(program: &str, server: &str) -> Result<Credentials, HelperError> {
    match tokio::time::timeout(HELPER_TIMEOUT, run(program, server)).await {
        Ok(result) => result,
        // Dropping the future dropped the child, which kills it.
        Err(_) => Err(HelperError::Timeout { program: program.to_owned(), timeout: HELPER_TIMEOUT }),
    }
}

async fn run(program: &str, server: &str) -> Result<Credentials, HelperError> {
    let failed =
        |message: String| HelperError::Failed { program: program.to_owned(), status: "not run".into(), message };
    let mut child = Command::new(program)
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => HelperError::Missing { program: program.to_owned() },
            _ => failed(format!("cannot start it: {e}")),
        })?;
    let (Some(mut stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(failed("its standard streams were not piped".into()));
    };
    // The helper may exit without reading stdin: a failed write is not
    // the error worth reporting, its exit status is.
    let write = async move {
        let _ = stdin.write_all(format!("{server}\n").as_bytes()).await;
        drop(stdin);
    };
    let (_, out, err, status) = tokio::join!(write, read_bounded(stdout), read_bounded(stderr), child.wait());
    let status = status.map_err(|e| failed(format!("waiting for it: {e}")))?;
    let (out, err) = (out.map_err(|e| failed(e.to_string()))?, err.map_err(|e| failed(e.to_string()))?);
    if !status.success() {
        // docker's own helpers print their error on stdout, where a secret
        // may stand too: only stderr is quoted.
        let message = quote(&err);
        return Err(HelperError::Failed { program: program.to_owned(), status: status.to_string(), message });
    }
    // The output holds the secret: it is parsed, never quoted.
    let bad = |what| HelperError::BadOutput { program: program.to_owned(), what };
    let parsed: Output =
        serde_json::from_str(&out).map_err(|_| bad("output that is not JSON with Username and Secret"))?;
    if parsed.username == "<token>" {
        return Err(bad("an identity token (Username \"<token>\"), which larder cannot use"));
    }
    if parsed.username.is_empty() || parsed.secret.is_empty() {
        return Err(bad("an empty Username or Secret"));
    }
    Ok(Credentials { username: parsed.username, password: Secret::new(parsed.secret) })
}

async fn read_bounded(stream: impl AsyncRead + Unpin) -> std::io::Result<String> {
    let mut buf = Vec::new();
    stream.take(MAX_HELPER_OUTPUT + 1).read_to_end(&mut buf).await?;
    if buf.len() as u64 > MAX_HELPER_OUTPUT {
        return Err(std::io::Error::other(format!("it wrote more than {MAX_HELPER_OUTPUT} bytes")));
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// The first line of a failing helper's stderr, printable, bounded.
fn quote(stderr: &str) -> String {
    let line = stderr.trim().lines().next().unwrap_or_default();
    let mut quoted: String =
        line.chars().filter(|c| !c.is_control()).take(MAX_QUOTED_MESSAGE).collect::<String>().trim().to_owned();
    if quoted.is_empty() {
        quoted = "nothing on stderr".into();
    }
    quoted
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Writes `docker-credential-<name>` (a shell script) into `dir`.
    fn helper(dir: &std::path::Path, name: &str, script: &str) {
        let path = dir.join(format!("docker-credential-{name}"));
        std::fs::write(&path, format!("#!/bin/sh\n{script}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[tokio::test]
    async fn speaks_the_protocol_and_reports_failures_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        helper(
            dir.path(),
            "echo",
            r#"read host; printf '{"ServerURL":"%s","Username":"AWS","Secret":"s3cret-%s"}' "$host" "$host""#,
        );
        helper(dir.path(), "fails", "echo 'credentials not found in native keychain' >&2; exit 1");
        // Prints its whole answer, then fails: nothing of stdout may show.
        helper(
            dir.path(),
            "leaks",
            r#"echo '{"Username":"AWS","Secret":"s3cret-leaked"}'; echo 'session expired' >&2; exit 1"#,
        );
        helper(dir.path(), "quiet", r#"echo '{"Username":"AWS","Secret":"s3cret-leaked"}'; exit 3"#);
        helper(dir.path(), "junk", "echo not json");
        helper(dir.path(), "identity", r#"echo '{"Username":"<token>","Secret":"refresh"}'"#);

        // larder finds helpers on PATH; here they are run by absolute path,
        // so that the test does not change the process's environment.
        let run_in = |n: &'static str| {
            let program = format!("{d}/docker-credential-{n}");
            async move { run(&program, "r.example:5000").await }
        };
        let c = run_in("echo").await.unwrap();
        assert_eq!((c.username.as_str(), c.password.expose()), ("AWS", "s3cret-r.example:5000"));

        let e = run_in("fails").await.unwrap_err();
        assert_eq!(e.reason(), "helper_failed");
        assert!(e.to_string().contains("credentials not found in native keychain"), "{e}");
        for (name, says) in [("leaks", "session expired"), ("quiet", "nothing on stderr")] {
            let e = run_in(name).await.unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
            assert!(!e.contains("s3cret") && !e.contains("Username"), "stdout is never quoted: {e}");
        }
        let e = run_in("junk").await.unwrap_err();
        assert!(e.to_string().contains("not JSON"), "{e}");
        assert!(!e.to_string().contains("not json"), "the output itself is never quoted: {e}");
        let e = run_in("identity").await.unwrap_err();
        assert!(e.to_string().contains("identity token"), "{e}");
        assert!(!e.to_string().contains("refresh"), "{e}");

        let e = get(&program("larder-no-such-helper"), "r.example").await.unwrap_err();
        assert_eq!(e.reason(), "helper_missing");
        assert!(e.to_string().contains("docker-credential-larder-no-such-helper is not on PATH"), "{e}");
    }
}
