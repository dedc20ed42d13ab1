//! The container image: `charts/build-image.sh` builds it (a static binary
//! on `FROM scratch`) with a private dockerd; `docker run` then starts it on
//! its default entrypoint and command with a mounted config whose upstream
//! is a real origin named by host name (an `/etc/hosts` entry, resolved by
//! the static binary inside the scratch image). A skopeo pull through it
//! gets the origin's exact manifest; the process runs as 65532:65532, can
//! write its cache, and `docker stop` (SIGTERM) ends it with exit code 0.

mod clients;
mod common;

use std::fs::File;
use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clients::dockerd::Dockerd;
use common::{ImageBuilder, KIB, Origin, free_port, skopeo};

/// The tag the build script gives the image (`larder:<tag>`) in the
/// test's private dockerd.
const TAG: &str = "image-test";
/// The static build of a cold target dir takes minutes on a loaded 2-core
/// machine; give it plenty before calling it hung.
const BUILD_TIMEOUT: Duration = Duration::from_secs(40 * 60);
/// How long the container may take to answer `/v2/`.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// `docker stop -t`: SIGTERM, then SIGKILL (exit code 137) after this long.
const STOP_GRACE_SECS: u64 = 30;
/// The name the config gives the origin; `--add-host` maps it to 127.0.0.1
/// in the container's `/etc/hosts`.
const ORIGIN_HOST: &str = "larder-origin.test";
/// A second upstream name for the same origin, dialled as `localhost`.
const VIA_LOCALHOST: &str = "via-localhost.test";
/// The image's non-root user and group.
const IMAGE_UID: &str = "65532";

#[tokio::test(flavor = "multi_thread")]
async fn the_image_serves_pulls_as_non_root_and_stops_cleanly_on_sigterm() {
    let test_started = Instant::now();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let work = tempfile::Builder::new().prefix("larder-image-test-").tempdir().expect("temp dir");

    let larder_port = free_port();
    let admin_port = free_port();
    let larder_host_port = format!("127.0.0.1:{larder_port}");

    let step = Instant::now();
    let dockerd = PrivateDockerd::start(&format!("http://{larder_host_port}"), &larder_host_port);
    let docker = DockerCli::new(dockerd.dir());
    note(&format!("private dockerd ready in {:.1?}", step.elapsed()));

    // 1. Build the image. The static build gets its own target dir next to
    // the one running this test: cargo holds that one's lock meanwhile.
    let step = Instant::now();
    let target_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().expect("target dir").join("image");
    let image = build_image(repo, &target_dir, &docker.host, work.path());
    note(&format!("charts/build-image.sh built {image} in {:.1?}", step.elapsed()));

    let config: serde_json::Value =
        serde_json::from_str(&docker.ok(&["image", "inspect", "--format", "{{json .Config}}", &image]))
            .expect("image config JSON");
    assert_eq!(config["User"], "65532:65532", "image config: {config:#}");
    assert_eq!(config["Entrypoint"], serde_json::json!(["/usr/local/bin/larder"]), "image config: {config:#}");
    assert_eq!(config["Cmd"], serde_json::json!(["--config", "/etc/larder/larder.toml"]), "image config: {config:#}");
    for port in ["5000/tcp", "9090/tcp"] {
        assert!(config["ExposedPorts"].get(port).is_some(), "image does not expose {port}: {config:#}");
    }
    assert_eq!(config["Labels"]["org.opencontainers.image.title"], "larder", "image config: {config:#}");
    assert_eq!(
        config["Labels"]["org.opencontainers.image.version"],
        env!("CARGO_PKG_VERSION"),
        "image config: {config:#}"
    );
    let size: u64 = docker.ok(&["image", "inspect", "--format", "{{.Size}}", &image]).trim().parse().expect("size");
    note(&format!("image size: {:.1} MiB", size as f64 / (1024.0 * 1024.0)));

    // 2. A real origin with an image, named by host name in larder's config.
    let origin = Origin::start().await;
    let pushed = ImageBuilder::docker_schema2().layers(&[48 * KIB, 320 * KIB]).push(&origin, "team/app", "v1").await;
    let origin_port = origin.host_port().rsplit(':').next().expect("origin port").to_owned();
    let config_path = work.path().join("larder.toml");
    std::fs::write(
        &config_path,
        format!(
            "[server]\n\
             listen = \"{larder_host_port}\"\n\
             admin_listen = \"127.0.0.1:{admin_port}\"\n\
             shutdown_grace = \"10s\"\n\
             \n\
             [cache]\n\
             dir = \"/var/lib/larder\"\n\
             \n\
             [[upstream]]\n\
             name = \"origin.test\"\n\
             url = \"http://{ORIGIN_HOST}:{origin_port}\"\n\
             default = true\n\
             \n\
             [[upstream]]\n\
             name = \"{VIA_LOCALHOST}\"\n\
             url = \"http://localhost:{origin_port}\"\n"
        ),
    )
    .expect("write larder.toml");
    // The container's user reads it through the bind mount.
    std::fs::set_permissions(&config_path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).expect("chmod");

    // 3. Run the image on its own entrypoint and command.
    let step = Instant::now();
    let container = Container { docker: &docker, name: format!("larder-image-test-{}", std::process::id()) };
    docker.ok(&[
        "run",
        "--detach",
        "--name",
        &container.name,
        "--network",
        "host",
        "--add-host",
        &format!("{ORIGIN_HOST}:127.0.0.1"),
        "--volume",
        &format!("{}:/etc/larder/larder.toml:ro", config_path.display()),
        &image,
    ]);
    wait_for_v2(&container, &format!("http://{larder_host_port}/v2/")).await;
    note(&format!("container answered /v2/ in {:.1?}", step.elapsed()));

    // 4. Pull through it: larder dialled the origin by host name.
    let mark = origin.log_mark().await;
    let step = Instant::now();
    let pulled = skopeo::pull(&format!("docker://{larder_host_port}/{}", pushed.reference()), false)
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainer log:\n{}", container.logs()));
    note(&format!("skopeo pull through the container in {:.1?}", step.elapsed()));
    assert_eq!(pulled.manifest_digest, pushed.digest, "the manifest served is not the origin's");
    assert_eq!(pulled.blob_digests(), pushed.blob_digests(), "the blobs served are not the origin's");
    let mut fetched: Vec<String> = origin
        .requests_since(&mark)
        .await
        .blob_get_entries()
        .iter()
        .map(|entry| entry.path().rsplit('/').next().unwrap_or_default().to_owned())
        .collect();
    fetched.sort();
    assert_eq!(fetched, pushed.blob_digests(), "larder fetched every blob from the origin once");
    // `localhost` resolves too (from the host's /etc/hosts, which Docker
    // copies for host networking).
    let raw = skopeo::inspect_raw(&format!("docker://{larder_host_port}/{VIA_LOCALHOST}/{}", pushed.reference()))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainer log:\n{}", container.logs()));
    assert_eq!(common::origin::sha256_digest(&raw), pushed.digest, "the manifest via localhost");

    // The cache directory is writable: /readyz creates a file in it.
    let ready = common::http::client()
        .get(format!("http://127.0.0.1:{admin_port}/readyz"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("/readyz: {e}\ncontainer log:\n{}", container.logs()));
    assert_eq!(ready.status(), 200, "/readyz\ncontainer log:\n{}", container.logs());

    // 5. Not root: the configured user, and the process itself.
    assert_eq!(container.inspect("{{.Config.User}}"), "65532:65532");
    let top = docker.ok(&["top", &container.name, "-o", "pid,uid,gid,comm"]);
    let row: Vec<&str> = top
        .lines()
        .find(|line| line.split_whitespace().last() == Some("larder"))
        .unwrap_or_else(|| panic!("no larder process in docker top:\n{top}"))
        .split_whitespace()
        .collect();
    assert_eq!(&row[1..3], [IMAGE_UID, IMAGE_UID], "docker top: uid and gid of larder:\n{top}");
    let pid = container.inspect("{{.State.Pid}}");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/<pid>/status");
    for key in ["Uid:", "Gid:"] {
        let ids: Vec<&str> = status
            .lines()
            .find_map(|line| line.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
            .split_whitespace()
            .collect();
        assert_eq!(ids, [IMAGE_UID; 4], "{key} (real, effective, saved, fs) of the container's process");
    }

    // 6. `docker stop` sends SIGTERM; larder drains and exits 0 (a SIGKILL
    // after the grace period would be 137).
    let step = Instant::now();
    docker.ok(&["stop", "--time", &STOP_GRACE_SECS.to_string(), &container.name]);
    let stopped_in = step.elapsed();
    note(&format!("docker stop took {stopped_in:.1?}"));
    assert_eq!(container.inspect("{{.State.Status}}"), "exited");
    assert_eq!(
        container.inspect("{{.State.ExitCode}}"),
        "0",
        "exit code after SIGTERM; container log:\n{}",
        container.logs()
    );
    assert!(stopped_in < Duration::from_secs(STOP_GRACE_SECS), "larder took {stopped_in:?} to stop");
    note(&format!("container image test finished in {:.1?}", test_started.elapsed()));
}

/// Progress lines straight to stderr, past the test harness's capture, so the
/// build's durations show in every run.
fn note(line: &str) {
    let _ = writeln!(std::io::stderr(), "container_image: {line}");
}

/// Runs `charts/build-image.sh TAG` against `docker_host` and returns the
/// image reference; its output goes to a log that a failure prints.
fn build_image(repo: &Path, target_dir: &Path, docker_host: &str, work: &Path) -> String {
    let log_path = work.join("build-image.log");
    let log = File::create(&log_path).expect("build log");
    let mut command = Command::new("bash");
    command
        .arg(repo.join("charts/build-image.sh"))
        .arg(TAG)
        .current_dir(repo)
        .env("DOCKER_HOST", docker_host)
        .env_remove("DOCKER_CONTEXT")
        .env("LARDER_IMAGE_TARGET_DIR", target_dir)
        // The image is what is tested here, not its speed: the unoptimized
        // static build takes a fraction of the release build's time.
        .env("LARDER_IMAGE_PROFILE", "dev")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        // Its own process group, so a timeout stops cargo too.
        .process_group(0);
    let mut child = command.spawn().unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let status = wait_with_timeout(&mut child, BUILD_TIMEOUT).unwrap_or_else(|| {
        let _ = Command::new("kill").arg("-KILL").arg(format!("-{}", child.id())).status();
        let _ = child.wait();
        panic!("charts/build-image.sh did not finish in {BUILD_TIMEOUT:?}; log:\n{}", clients::tail(&log_path, 80))
    });
    let mut stdout = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().expect("stdout"), &mut stdout).expect("script stdout");
    assert!(status.success(), "charts/build-image.sh failed ({status}); log:\n{}", clients::tail(&log_path, 80));
    for line in std::fs::read_to_string(&log_path).unwrap_or_default().lines() {
        if line.starts_with("build-image:") {
            note(line);
        }
    }
    let image = stdout.lines().last().unwrap_or_default().trim().to_owned();
    assert_eq!(image, format!("larder:{TAG}"), "the script's last stdout line names the image");
    image
}

/// `Some(status)` once `child` exits, `None` after `timeout`.
fn wait_with_timeout(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("wait for the build script") {
            return Some(status);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Polls `url` until it answers 200, failing early if the container exits.
async fn wait_for_v2(container: &Container<'_>, url: &str) {
    let client = common::http::client();
    let started = Instant::now();
    loop {
        let last = match client.get(url).send().await {
            Ok(response) if response.status() == 200 => return,
            Ok(response) => format!("status {}", response.status()),
            Err(e) => format!("error {e}"),
        };
        let state = container.inspect("{{.State.Status}}");
        if state != "running" || started.elapsed() > READY_TIMEOUT {
            panic!(
                "the container ({state}) did not answer {url} with 200 in {:.1?} (last: {last}); log:\n{}",
                started.elapsed(),
                container.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The shared private [`Dockerd`], plus the cleanup it lacks for this test:
/// for `--network host` libnetwork bind-mounts the host's network namespace
/// at `<exec-root>/netns/default` and leaves it mounted when dockerd exits,
/// so removing dockerd's temp dir would fail and leave it behind.
struct PrivateDockerd {
    dockerd: Option<Dockerd>,
    dir: PathBuf,
}

impl PrivateDockerd {
    fn start(mirror: &str, mirror_host_port: &str) -> PrivateDockerd {
        let dockerd = Dockerd::start(mirror, mirror_host_port);
        let dir = dockerd.dir().to_owned();
        PrivateDockerd { dockerd: Some(dockerd), dir }
    }

    fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for PrivateDockerd {
    fn drop(&mut self) {
        // Stops dockerd (its own drop), then unmounts what it left mounted
        // under its dir, deepest first, and removes the dir.
        drop(self.dockerd.take());
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let mut points: Vec<&str> = mounts
            .lines()
            .filter_map(|line| line.split_whitespace().nth(1))
            .filter(|point| Path::new(point).starts_with(&self.dir))
            .collect();
        points.sort_by_key(|point| std::cmp::Reverse(point.len()));
        for point in points {
            let _ = Command::new("umount").arg(point).stderr(Stdio::null()).status();
        }
        match std::fs::remove_dir_all(&self.dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                eprintln!("container_image: cannot remove {}: {e}", self.dir.display());
            }
            _ => {}
        }
    }
}

/// The docker CLI, talking to the private dockerd's socket only.
struct DockerCli {
    host: String,
}

impl DockerCli {
    fn new(dockerd_dir: &Path) -> DockerCli {
        let socket = dockerd_dir.join("docker.sock");
        assert!(socket.exists(), "no dockerd socket at {}", socket.display());
        DockerCli { host: format!("unix://{}", socket.display()) }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new("docker");
        command.arg("--host").arg(&self.host).args(args).env_remove("DOCKER_CONTEXT");
        command
    }

    /// Runs `docker <args>` (bounded by [`clients::PULL_TIMEOUT`]); its
    /// stdout, or a panic with everything it said.
    fn ok(&self, args: &[&str]) -> String {
        let command = self.command(args);
        let described = format!("{command:?}");
        let output = clients::run_output(command).unwrap_or_else(|e| panic!("{e}"));
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        if !output.status.success() {
            panic!("{described} failed ({}):\n{stdout}{}", output.status, String::from_utf8_lossy(&output.stderr));
        }
        stdout
    }
}

/// A started container; removed (`docker rm --force`) on drop.
struct Container<'a> {
    docker: &'a DockerCli,
    name: String,
}

impl Container<'_> {
    fn inspect(&self, format: &str) -> String {
        self.docker.ok(&["inspect", "--format", format, &self.name]).trim().to_owned()
    }

    fn logs(&self) -> String {
        clients::run(self.docker.command(&["logs", "--tail", "200", &self.name])).unwrap_or_else(|e| e)
    }
}

impl Drop for Container<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("===== container {} log =====\n{}\n===== end of container log =====", self.name, self.logs());
        }
        let _ = clients::run(self.docker.command(&["rm", "--force", &self.name]));
    }
}
