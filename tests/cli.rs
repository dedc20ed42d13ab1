//! The operator commands against a real larder and a real distribution
//! origin: `larder prefetch` (plain lines when stdout is not a terminal, an
//! indicatif bar on a terminal, run under `script` for a pseudo-terminal),
//! `larder status`, `larder purge`, and what a wrong token or an
//! unreachable larder looks like. Also: text logs are coloured only on a
//! terminal.

mod common;

use std::process::Command;

use common::admin::{stderr, stdout};
use common::{Admin, ImageBuilder, KIB, Larder, MIB, ORIGIN_NAME, Origin, free_port, skopeo, which};

const TOKEN: &str = "cli-test-token-6b0f2d9c84";

/// Runs `shell_command` with a pseudo-terminal as its stdout and stderr
/// (util-linux `script`), 120 columns wide; returns what the terminal got.
fn on_a_terminal(shell_command: &str) -> (bool, String) {
    on_a_terminal_with(shell_command, None)
}

/// [`on_a_terminal`], with `NO_COLOR` set to `no_color` if given.
fn on_a_terminal_with(shell_command: &str, no_color: Option<&str>) -> (bool, String) {
    which("script");
    let mut command = Command::new("script");
    command.args(["-q", "-e", "-c", &format!("stty cols 120 rows 40; {shell_command}"), "/dev/null"]);
    match no_color {
        Some(value) => command.env("NO_COLOR", value),
        None => command.env_remove("NO_COLOR"),
    };
    let output = command.output().expect("run script");
    (output.status.success(), String::from_utf8_lossy(&output.stdout).into_owned())
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[tokio::test(flavor = "multi_thread")]
async fn prefetch_status_and_purge_from_the_command_line() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[3 * MIB, 2 * MIB, 256 * KIB]).push(&origin, "team/app", "v1").await;
    ImageBuilder::oci().layers(&[64 * KIB]).push(&origin, "team/other", "v1").await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let larder = builder.start().await;
    let image_bytes: u64 = image.blobs().iter().map(|b| b.size).sum();

    // Not a terminal: plain progress lines, then a summary.
    let out = admin.cli(&["prefetch", "team/app:v1"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(!text.contains('\x1b'), "no terminal codes when stdout is not a terminal:\n{text:?}");
    assert!(text.starts_with("prefetching team/app:v1 through http://127.0.0.1:"), "{text}");
    let blobs = image.blob_digests().len();
    assert!(text.contains(&format!("/{blobs} blobs")), "plain progress lines:\n{text}");
    let summary = text.lines().last().expect("a summary line");
    assert!(
        summary.starts_with(&format!(
            "prefetched team/app:v1: 1 manifest, {blobs} blobs ({blobs} fetched from upstream), "
        )),
        "{summary}"
    );
    assert!(summary.contains(&common::admin::human_bytes(image_bytes)), "{summary}");
    let mark = origin.log_mark().await;
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("pull after prefetch");
    assert_eq!(origin.requests_since(&mark).await.blob_gets(), 0, "the prefetch warmed every blob");

    // On a terminal: an indicatif bar (drawn with terminal codes) with bytes and blobs.
    let command = format!(
        "{} prefetch {ORIGIN_NAME}/team/other:v1 --admin {} --token-file {}",
        shell_quote(common::larder::binary()),
        admin.url(),
        shell_quote(&admin.token_file().display().to_string())
    );
    let (ok, screen) = on_a_terminal(&command);
    assert!(ok, "{screen}");
    assert!(screen.contains('\x1b'), "a progress bar is drawn on a terminal:\n{screen:?}");
    assert!(screen.contains("blobs") && screen.contains("ETA"), "bar with blobs, rate and ETA:\n{screen:?}");
    assert!(screen.contains("prefetched origin.test/team/other:v1: 1 manifest"), "{screen:?}");

    // Status: what the cache holds, and the repositories.
    let out = admin.cli(&["status"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(text.contains("of 10.0 GiB"), "{text}");
    assert!(text.contains(&format!("{} blobs, ", blobs + 2)), "{text}");
    assert!(text.contains("2 repositories"), "{text}");
    // The warm pull after the prefetch was all hits: a non-zero blob hit ratio.
    let ratio = text.lines().find_map(|l| l.strip_prefix("hit ratio    blobs ")).expect("a hit ratio line");
    let percent: f64 = ratio.split('%').next().and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("{ratio}"));
    assert!(percent > 0.0, "warm blobs count as hits: {ratio}");
    assert!(text.contains("fills        0 in flight"), "{text}");
    // The repository figures say how old their index scan is.
    let scan = text.lines().find(|l| l.starts_with("repositories from an index scan of ")).expect("the scan's age");
    assert!(scan.ends_with(" s ago (one scan at most every 10 s)"), "{scan}");
    assert!(text.contains("origin.test (default) http://127.0.0.1:"), "{text}");
    let largest = text.split("largest repositories").nth(1).expect("largest section");
    let first = largest.lines().nth(1).expect("a repository line");
    assert!(first.trim_start().starts_with("origin.test/team/app "), "largest first:\n{text}");
    let json = admin.cli(&["status", "--json"]);
    let value: serde_json::Value = serde_json::from_slice(&json.stdout).expect("status --json is JSON");
    assert_eq!(value["repositories"]["count"], 2);
    assert_eq!(value["cache"]["blobs"], blobs + 2);

    // Purge one repository: its blobs go, and the next pull refetches them.
    let out = admin.cli(&["purge", ORIGIN_NAME, "team/app"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(text.starts_with("purged origin.test/team/app: 1 tags, "), "{text}");
    assert!(text.contains(&format!(", {blobs} blobs, ")), "{text}");
    let mark = origin.log_mark().await;
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("pull after purge");
    assert_eq!(origin.requests_since(&mark).await.blob_gets(), blobs);

    // A repository never cached (a typo): said so, not a line of zeros.
    let out = admin.cli(&["purge", ORIGIN_NAME, "team/ap"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "nothing cached for origin.test/team/ap: nothing purged here\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_token_or_no_larder_is_a_clear_error() {
    let origin = Origin::start().await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let _larder = builder.start().await;

    let out =
        admin.command(&["purge", ORIGIN_NAME]).env("LARDER_ADMIN_TOKEN", "wrong-token-0123456789").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).starts_with("larder purge: 401 UNAUTHORIZED: "), "{}", stderr(&out));
    let out = admin.command(&["prefetch", "team/app:v1"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("401 UNAUTHORIZED"), "{}", stderr(&out));

    // Status is read-only: no token needed.
    let out = admin.command(&["status"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));

    // An unknown image is the upstream's answer, before any progress.
    let out = admin.cli(&["prefetch", "team/missing:v1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("404 MANIFEST_UNKNOWN"), "{}", stderr(&out));

    let nobody = free_port();
    let out = Command::new(common::larder::binary())
        .args(["status", "--admin", &format!("http://127.0.0.1:{nobody}")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("cannot reach the admin listener"), "{}", stderr(&out));
}

/// Issue 23, item 7: a loopback admin listener without `[admin]
/// token_file` now needs the token larder writes into its cache folder at
/// start-up; the commands find it through `--config`, so they work as
/// they did when the listener was open. Without it they are told what to do.
#[tokio::test(flavor = "multi_thread")]
async fn with_a_generated_token_the_commands_work_unchanged_through_the_config() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[64 * KIB]).push(&origin, "team/app", "v1").await;
    let (builder, admin) = Admin::open(Larder::builder().upstream(&origin));
    let larder = builder.start().await;
    let config = larder.config_path().display().to_string();
    let run = |args: &[&str]| {
        Command::new(common::larder::binary())
            .args(args)
            .args(["--config", &config])
            .env_remove("LARDER_ADMIN")
            .env_remove("LARDER_ADMIN_TOKEN")
            .env_remove("LARDER_ADMIN_TOKEN_FILE")
            .output()
            .expect("run larder")
    };

    let out = run(&["prefetch", "team/app:v1"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let out = run(&["status"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let out = run(&["purge", ORIGIN_NAME, "team/app"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(stdout(&out).contains(&format!(", {} blobs, ", image.blob_digests().len())), "{}", stdout(&out));

    // Without the config (and so without the token), a purge is refused.
    let out = admin.command(&["purge", ORIGIN_NAME]).output().expect("run larder");
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).starts_with("larder purge: 401 UNAUTHORIZED: "), "{}", stderr(&out));
}

#[test]
fn text_logs_are_coloured_only_on_a_terminal() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("larder.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{}\"\n[cache]\ndir = {:?}\n\
             [[upstream]]\nname = \"nowhere.test\"\nurl = \"http://127.0.0.1:9\"\ndefault = true\n",
            free_port(),
            dir.path().join("cache").display().to_string()
        ),
    )
    .expect("write config");
    // Two seconds of running, then SIGINT: larder logs that it listens and stops.
    let run = |format: &str| {
        format!(
            "timeout -s INT 2 {} --config {} --log-format {format}",
            shell_quote(common::larder::binary()),
            shell_quote(&config.display().to_string())
        )
    };

    let (_, screen) = on_a_terminal(&run("text"));
    assert!(screen.contains("larder listening"), "{screen}");
    assert!(screen.contains("\x1b["), "text logs on a terminal are coloured:\n{screen:?}");

    let piped = Command::new("sh").args(["-c", &run("text")]).env_remove("NO_COLOR").output().expect("run larder");
    let log = stderr(&piped);
    assert!(log.contains("larder listening"), "{log}");
    assert!(!log.contains('\x1b'), "text logs into a pipe carry no colour codes:\n{log:?}");

    let (_, screen) = on_a_terminal_with(&run("text"), Some("1"));
    assert!(screen.contains("larder listening"), "{screen}");
    assert!(!screen.contains('\x1b'), "NO_COLOR turns colour off even on a terminal:\n{screen:?}");

    let (_, screen) = on_a_terminal(&run("json"));
    assert!(!screen.contains('\x1b'), "JSON logs never carry colour codes:\n{screen:?}");
    for line in screen.lines().filter(|l| !l.trim().is_empty()) {
        serde_json::from_str::<serde_json::Value>(line.trim()).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    }
}

/// Runs `command` with its stdout (and, with `both`, its stderr) on a
/// pipe whose reader has already gone, as after `| head -1` has read its
/// line; stdin is closed. Returns how it ended and what it wrote on stderr
/// (when that is not the closed pipe).
fn with_reader_gone(mut command: Command, both: bool) -> (std::process::ExitStatus, String) {
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::process::Stdio;
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills `fds` with two new descriptors, each then owned once.
    let (reader, writer) = unsafe {
        assert_eq!(libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC), 0, "pipe2: {}", std::io::Error::last_os_error());
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    };
    drop(reader);
    command.stdin(Stdio::null()).stdout(writer.try_clone().expect("dup the pipe"));
    if both {
        command.stderr(writer);
    } else {
        command.stderr(Stdio::piped());
    }
    let out = command.output().expect("run larder");
    (out.status, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Killed by SIGPIPE (status 141 in a shell), as `cat` or `grep` are, and
/// without a word on stderr: no panic in `println!`.
fn assert_ended_by_sigpipe(what: &str, (status, stderr): (std::process::ExitStatus, String)) {
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{what}: {status}; stderr: {stderr}");
    assert_eq!(stderr, "", "{what}: nothing on stderr");
}

/// `larder check-config | head -1` and the like: every command that
/// prints ends as Unix filters do when its reader stops. Before, each
/// panicked ("failed printing to stdout: Broken pipe") with status 101.
#[tokio::test(flavor = "multi_thread")]
async fn every_command_ends_quietly_when_its_reader_has_gone() {
    let origin = Origin::start().await;
    ImageBuilder::oci().layers(&[64 * KIB]).push(&origin, "team/app", "v1").await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let mut larder = builder.start().await;
    let config = larder.config_path().display().to_string();
    let larder_command = |args: &[&str]| {
        let mut command = Command::new(common::larder::binary());
        command.args(args);
        command
    };
    let operator = |args: &[&str]| {
        let mut command = admin.command(args);
        command.arg("--token-file").arg(admin.token_file());
        command
    };
    let layout = tempfile::tempdir().unwrap();
    let layout_dir = layout.path().join("app");
    let layout_dir = layout_dir.display().to_string();

    assert_ended_by_sigpipe(
        "check-config",
        with_reader_gone(larder_command(&["check-config", "--config", &config]), false),
    );
    assert_ended_by_sigpipe(
        "check-config 2>&1",
        with_reader_gone(larder_command(&["check-config", "--config", &config]), true),
    );
    assert_ended_by_sigpipe("prefetch", with_reader_gone(operator(&["prefetch", "team/app:v1"]), false));
    assert_ended_by_sigpipe("status", with_reader_gone(operator(&["status"]), false));
    assert_ended_by_sigpipe("status --json", with_reader_gone(operator(&["status", "--json"]), false));
    let elsewhere = layout.path().join("cut").display().to_string();
    assert_ended_by_sigpipe(
        "export",
        with_reader_gone(operator(&["export", "team/app:v1", "--output", &elsewhere]), false),
    );
    // A whole layout to import (an export that printed).
    let out = admin.cli(&["export", "team/app:v1", "--output", &layout_dir]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert_ended_by_sigpipe(
        "import",
        with_reader_gone(
            operator(&["import", &layout_dir, "--as", &format!("{ORIGIN_NAME}/team/copy"), "--config", &config]),
            false,
        ),
    );
    assert_ended_by_sigpipe("purge", with_reader_gone(operator(&["purge", ORIGIN_NAME, "team/app"]), false));
    larder.stop();
    // Offline: verify reads the stopped cache folder.
    assert_ended_by_sigpipe("verify", with_reader_gone(larder_command(&["verify", "--config", &config]), false));

    // clap's own output (help, version) already ignores a closed pipe.
    for args in [["--help"], ["--version"]] {
        let (status, stderr) = with_reader_gone(larder_command(&args), false);
        assert!(status.success() && stderr.is_empty(), "{args:?}: {status}; {stderr}");
    }
}

/// `larder ARGS` run from an empty folder (so no `./larder-data` token is
/// found by chance), with none of the `LARDER_ADMIN*` variables.
fn larder_in(dir: &std::path::Path, args: &[&str]) -> Command {
    let mut command = Command::new(common::larder::binary());
    command
        .args(args)
        .current_dir(dir)
        .env_remove("LARDER_ADMIN")
        .env_remove("LARDER_ADMIN_TOKEN")
        .env_remove("LARDER_ADMIN_TOKEN_FILE");
    command
}

/// The operating guide, where the messages of a refused call are shown.
fn operating_guide() -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operating.md"))
        .expect("read docs/operating.md")
}

/// Issue 36, item 1: a 401 says which token the listener expects (the one
/// larder generated and where, or the configured file), and the command
/// says that it sent none and where it looked, or where the token it sent
/// came from. docs/operating.md shows the first case.
#[tokio::test(flavor = "multi_thread")]
async fn a_token_refusal_says_which_token_is_expected_and_where_the_command_looked() {
    let origin = Origin::start().await;
    let (builder, admin) = Admin::open(Larder::builder().upstream(&origin));
    let larder = builder.start().await;
    let empty = tempfile::tempdir().expect("temp dir");
    let generated = larder.cache_dir().join("admin-token");
    // Issue 36, item 6: addresses logged as an operator writes them.
    let log = larder.log();
    let listening = log.lines().find(|l| l.contains("larder listening")).expect("the start-up line");
    assert!(listening.contains(&format!(" admin=127.0.0.1:{} ", admin.port)), "{listening}");
    assert!(listening.contains(" peers=none "), "{listening}");
    assert!(!listening.contains("Some(") && !listening.contains("None"), "{listening}");

    let out = larder_in(empty.path(), &["purge", ORIGIN_NAME, "--admin", &admin.url()]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = stderr(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        [
            format!(
                "larder purge: 401 UNAUTHORIZED: this admin operation needs `Authorization: Bearer <token>` with the \
                 token larder generated at start in {} (there is no [admin] token_file; `larder <command> --config \
                 <larder's config>` reads it, or pass --token-file); no token was sent",
                generated.display()
            ),
            "  this command found no token to send: --token-file (and LARDER_ADMIN_TOKEN_FILE) not given, \
             LARDER_ADMIN_TOKEN not set, no --config given, no token larder generated at \
             ./larder-data/admin-token (the embedded default's cache folder); pass --config with larder's config \
             file (its [admin] token_file, or the token larder generated in its cache folder), or --token-file"
                .to_owned(),
        ]
    );
    let guide = operating_guide();
    let shown = text.replace(&larder.cache_dir().display().to_string(), "/var/lib/larder");
    assert!(guide.contains(shown.trim_end()), "docs/operating.md shows:\n{shown}");

    let wrong = larder_in(empty.path(), &["purge", ORIGIN_NAME, "--admin", &admin.url()])
        .env("LARDER_ADMIN_TOKEN", "wrong-token-0123456789")
        .output()
        .unwrap();
    assert_eq!(wrong.status.code(), Some(1));
    let text = stderr(&wrong);
    assert!(
        text.starts_with(&format!(
            "larder purge: 401 UNAUTHORIZED: the bearer token sent is not the token larder generated at start in {} ",
            generated.display()
        )),
        "{text}"
    );
    assert!(text.ends_with("\n  the token sent came from LARDER_ADMIN_TOKEN\n"), "{text}");
    drop(larder);

    // A configured token file is named as such.
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let _larder = builder.start().await;
    let out = larder_in(empty.path(), &["purge", ORIGIN_NAME, "--admin", &admin.url()]).output().unwrap();
    assert!(
        stderr(&out).starts_with(&format!(
            "larder purge: 401 UNAUTHORIZED: this admin operation needs `Authorization: Bearer <token>` with the \
             token in [admin] token_file ({}); no token was sent\n",
            admin.token_file().display()
        )),
        "{}",
        stderr(&out)
    );
    let elsewhere = empty.path().join("other-token");
    std::fs::write(&elsewhere, "another-token-0123456789\n").unwrap();
    let out = larder_in(empty.path(), &["purge", ORIGIN_NAME, "--admin", &admin.url(), "--token-file"])
        .arg(&elsewhere)
        .output()
        .unwrap();
    assert!(
        stderr(&out).ends_with(&format!(
            "\n  the token sent came from {} (--token-file, or LARDER_ADMIN_TOKEN_FILE)\n",
            elsewhere.display()
        )),
        "{}",
        stderr(&out)
    );
}

/// Issue 36, item 2: a listener that cannot be reached is explained by the
/// likely causes (larder not running, another address, and where the
/// address came from), and TLS is not suggested for a refused connection.
#[test]
fn an_unreachable_admin_listener_is_explained_by_its_likely_causes() {
    let empty = tempfile::tempdir().expect("temp dir");
    let nobody = free_port();
    let url = format!("http://127.0.0.1:{nobody}");
    let out = larder_in(empty.path(), &["status", "--admin", &url]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = stderr(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with(&format!("larder status: cannot reach the admin listener at {url}: ")), "{text}");
    assert!(lines[0].contains("Connection refused"), "{text}");
    assert_eq!(
        &lines[1..],
        [
            "  nothing listens there: is larder running, with its admin listener (server.admin_listen) on this address?",
            "  the address came from --admin (or LARDER_ADMIN)",
        ],
        "{text}"
    );

    let config = empty.path().join("larder.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nadmin_listen = \"127.0.0.1:{nobody}\"\n[cache]\ndir = \"cache\"\n\
             [[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\n"
        ),
    )
    .unwrap();
    let out = larder_in(empty.path(), &["purge", "q.io", "--config", "larder.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = stderr(&out);
    assert!(text.ends_with("\n  the address came from server.admin_listen of larder.toml\n"), "{text}");
    assert!(!text.contains("TLS"), "a refused connection is not a TLS problem: {text}");
    let guide = operating_guide();
    let example = text.lines().skip(1).collect::<Vec<_>>().join("\n");
    assert!(guide.contains(&example), "docs/operating.md shows:\n{example}");
}

/// Issue 36, item 4: a platform the index lacks is refused, naming the
/// platforms it has (a prefetch and an export used to warm nothing and
/// exit 0), and an image upstream lacks is named in the 404.
#[tokio::test(flavor = "multi_thread")]
async fn a_platform_the_index_lacks_and_an_unknown_image_are_refused_by_name() {
    let origin = Origin::start().await;
    ImageBuilder::oci().multi_arch().layers(&[64 * KIB]).push(&origin, "team/multi", "v1").await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let _larder = builder.start().await;

    for platform in ["linux/s390x", "linux/amd46"] {
        let out = admin.cli(&["prefetch", "team/multi:v1", "--platform", platform]);
        assert_eq!(out.status.code(), Some(1), "{}{}", stdout(&out), stderr(&out));
        assert_eq!(
            stderr(&out),
            format!(
                "larder prefetch: 404 MANIFEST_UNKNOWN: team/multi:v1 has no platform {platform}: its index has \
                 linux/amd64, linux/arm64\n"
            )
        );
        assert!(!stdout(&out).contains("prefetched"), "{}", stdout(&out));
    }
    let output = tempfile::tempdir().expect("temp dir");
    let out = admin.cli(&[
        "export",
        "team/multi:v1",
        "--platform",
        "linux/s390x",
        "--output",
        &output.path().display().to_string(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}{}", stdout(&out), stderr(&out));
    assert!(stderr(&out).starts_with("larder export: 404 MANIFEST_UNKNOWN: team/multi:v1 has no platform linux/s390x: its index has linux/amd64, linux/arm64"), "{}", stderr(&out));
    assert!(!output.path().join("index.json").exists(), "nothing exported");
    // A platform the index has still works.
    let out = admin.cli(&["prefetch", "team/multi:v1", "--platform", "linux/arm64"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));

    let out = admin.cli(&["prefetch", "team/missing:v1"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out),
        format!(
            "larder prefetch: 404 MANIFEST_UNKNOWN: manifest unknown: upstream \"{ORIGIN_NAME}\" has no team/missing:v1\n"
        )
    );
    let out = admin.cli(&["prefetch", &format!("{ORIGIN_NAME}/team/missing@sha256:{}", "0".repeat(64))]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains(&format!("has no team/missing@sha256:{}", "0".repeat(64))), "{}", stderr(&out));
}

/// Issue 36, items 9 and 10: `larder verify` shows its progress (a bar on a
/// terminal, a line per phase otherwise) and says what is bad, naming the
/// blob, instead of `1 bad (1 index rows, 0 files)`.
#[tokio::test(flavor = "multi_thread")]
async fn verify_shows_progress_and_names_what_is_bad() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[MIB, 256 * KIB]).push(&origin, "team/app", "v1").await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let mut larder = builder.start().await;
    let out = admin.cli(&["prefetch", "team/app:v1"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    larder.send_sigterm();
    assert!(larder.wait_exit(std::time::Duration::from_secs(40)).await.is_some_and(|s| s.success()));
    let blobs = image.blob_digests().len();
    let total: u64 = image.blobs().iter().map(|b| b.size).sum();
    let config = larder.config_path().display().to_string();
    let verify = |args: &[&str]| larder_in(larder.config_path().parent().unwrap(), args).output().unwrap();

    // Not a terminal: a line per phase, then the summary.
    let out = verify(&["verify", "--config", &config]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    let dir = larder.cache_dir().display().to_string();
    let human = common::admin::human_bytes(total);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], format!("verify: reading the index of {dir}"), "{text}");
    assert_eq!(lines[1], format!("verify: hashing {blobs} blobs ({human})"), "{text}");
    assert!(lines[2].starts_with(&format!("verify: hashing {blobs} blobs ({human}) done: {human} in ")), "{text}");
    assert_eq!(
        lines[3],
        format!(
            "{dir}: {blobs} blobs ok ({human}), 0 bad; 0 unindexed files found (correct blobs without an index row)"
        )
    );

    // On a terminal: a bar with bytes, rate and ETA.
    let (ok, screen) =
        on_a_terminal(&format!("{} verify --config {}", shell_quote(common::larder::binary()), shell_quote(&config)));
    assert!(ok, "{screen}");
    assert!(screen.contains('\x1b') && screen.contains("ETA"), "a progress bar on a terminal:\n{screen:?}");
    assert!(screen.contains(&format!("{blobs} blobs ok")), "{screen:?}");

    // One blob's bytes changed on disk: named, with what is wrong.
    let largest = image.blobs().into_iter().max_by_key(|b| b.size).expect("a blob");
    let layer = largest.digest.clone();
    let path = larder.blob_file(&layer);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let out = verify(&["verify", "--config", &config]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let text = stdout(&out);
    let bad = text.lines().find(|l| l.starts_with("bad: ")).unwrap_or_else(|| panic!("{text}"));
    assert!(bad.starts_with(&format!("bad: {layer}: content hashes to sha256:")), "{text}");
    let summary = text.lines().find(|l| l.starts_with(&format!("{dir}: "))).unwrap_or_else(|| panic!("{text}"));
    assert!(
        summary.starts_with(&format!(
            "{dir}: {} blobs ok ({}), 1 bad (1 indexed blob whose file is missing or wrong: {layer}: content hashes to sha256:",
            blobs - 1,
            common::admin::human_bytes(total - largest.size)
        )),
        "{summary}"
    );
    assert!(
        text.ends_with("run `larder verify --repair` (with larder stopped) to remove them: pulls fetch them again\n"),
        "{text}"
    );
    let out = verify(&["verify", "--repair", "--config", &config]);
    assert!(out.status.success(), "{}", stdout(&out));
    assert!(stdout(&out).contains("repaired: the bad entries were removed"), "{}", stdout(&out));
}

/// Issue 36, item 10: `verify --help` says which cache folder it checks
/// without `--config`, not that larder "runs" its embedded default.
#[test]
fn verify_help_says_which_cache_folder_it_checks_without_a_config() {
    let out = Command::new(common::larder::binary()).args(["verify", "--help"]).output().unwrap();
    let help = stdout(&out);
    assert!(out.status.success(), "{help}");
    assert!(help.contains("Without it, the embedded default config is used (cache folder ./larder-data"), "{help}");
    assert!(!help.contains("runs its embedded default"), "{help}");
}

/// Issue 36, item 10: a mutating admin endpoint asked with GET (or a
/// read-only one with POST) is `405` with `Allow`, not `404`.
#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_method_on_an_admin_endpoint_is_405_with_the_methods_it_takes() {
    let origin = Origin::start().await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let _larder = builder.start().await;
    let client = common::http::client();
    for path in ["/prefetch", "/purge", "/export", "/import"] {
        let resp = client.get(format!("{}{path}", admin.url())).send().await.unwrap();
        assert_eq!(resp.status(), 405, "GET {path}");
        assert_eq!(resp.headers()["allow"], "POST", "GET {path}");
    }
    let resp = client.post(format!("{}/metrics", admin.url())).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(resp.status(), 405, "POST /metrics");
    assert_eq!(resp.headers()["allow"], "GET, HEAD");
    let resp = client.put(format!("{}/purge", admin.url())).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!((resp.status().as_u16(), resp.headers()["allow"].to_str().unwrap()), (405, "POST"));
    let resp = client.get(format!("{}/nothing-here", admin.url())).send().await.unwrap();
    assert_eq!(resp.status(), 404, "an endpoint that does not exist");
}
