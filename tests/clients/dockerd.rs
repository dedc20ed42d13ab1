//! A private Docker daemon with larder as its `registry-mirrors` entry.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::{run, wait_until_ready};

/// How long dockerd gets to stop after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// Docker Hub's hosts, pinned to 127.0.0.1 so that a fallback from the
/// mirror cannot leave the machine.
pub const DOCKER_HUB_HOSTS: [&str; 4] =
    ["registry-1.docker.io", "index.docker.io", "auth.docker.io", "production.cloudflare.docker.com"];

pub struct Dockerd {
    child: std::process::Child,
    dir: TempDir,
}

impl Dockerd {
    /// Starts dockerd with its own data root, exec root, pid file and
    /// socket, no iptables and no bridge, the `vfs` storage driver (no
    /// mounts to clean up), and `mirror` as its only registry mirror.
    pub fn start(mirror: &str, mirror_host_port: &str) -> Dockerd {
        Self::start_with_config(serde_json::json!({
            "registry-mirrors": [mirror],
            "insecure-registries": [mirror_host_port],
        }))
    }

    /// Starts dockerd with `daemon` (a daemon.json, e.g. one a Helm chart
    /// rendered) plus what a private test instance needs: no iptables, no
    /// bridge, the `vfs` storage driver.
    pub fn start_with_config(mut daemon: serde_json::Value) -> Dockerd {
        let dockerd = crate::common::which("dockerd");
        crate::common::which("docker");
        super::hosts::pin_to_loopback(&DOCKER_HUB_HOSTS);
        let dir = tempfile::Builder::new().prefix("larder-dockerd-").tempdir().expect("temp dir");
        let d = dir.path();
        for (key, value) in [
            ("iptables", serde_json::json!(false)),
            ("ip6tables", serde_json::json!(false)),
            ("bridge", serde_json::json!("none")),
            ("storage-driver", serde_json::json!("vfs")),
        ] {
            daemon[key] = value;
        }
        std::fs::write(d.join("daemon.json"), daemon.to_string()).expect("write daemon.json");
        let log = std::fs::File::create(d.join("dockerd.log")).expect("dockerd log");
        let child = Command::new(dockerd)
            .arg("--config-file")
            .arg(d.join("daemon.json"))
            .arg("--data-root")
            .arg(d.join("root"))
            .arg("--exec-root")
            .arg(d.join("exec"))
            .arg("--pidfile")
            .arg(d.join("dockerd.pid"))
            .arg("-H")
            .arg(format!("unix://{}", d.join("docker.sock").display()))
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .expect("start dockerd");
        let instance = Dockerd { child, dir };
        wait_until_ready("dockerd", &instance.log(), || {
            let mut c = instance.docker();
            c.arg("version");
            c
        });
        instance
    }

    pub fn log(&self) -> PathBuf {
        self.dir.path().join("dockerd.log")
    }

    fn docker(&self) -> Command {
        let mut c = Command::new("docker");
        c.arg("-H").arg(format!("unix://{}", self.dir.path().join("docker.sock").display()));
        c
    }

    /// `docker pull <image>`: a Docker Hub image name, which dockerd asks
    /// its mirror for (as `library/<name>` for one-component names).
    pub fn pull(&self, image: &str) -> Result<String, String> {
        let mut c = self.docker();
        c.args(["pull", image]);
        run(c)
    }

    /// A docker client config folder (`DOCKER_CONFIG`) holding what
    /// `docker login` leaves after logging in to Docker Hub as `user`: the
    /// `auth` entry under `https://index.docker.io/v1/`. (The login itself
    /// needs Docker Hub: dockerd checks the credentials there, never with
    /// a mirror.) `name` tells folders apart.
    pub fn hub_login(&self, name: &str, user: &str, password: &str) -> PathBuf {
        use base64::Engine;
        let dir = self.dir.path().join(format!("client-{name}"));
        std::fs::create_dir_all(&dir).expect("client config dir");
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        let config = serde_json::json!({"auths": {"https://index.docker.io/v1/": {"auth": auth}}});
        std::fs::write(dir.join("config.json"), config.to_string()).expect("write config.json");
        dir
    }

    /// `docker login` (to Docker Hub) by a client whose config is in
    /// `config`, the password on stdin: its output, or its error.
    pub fn login(&self, config: &Path, user: &str, password: &str) -> Result<String, String> {
        use std::io::Write;
        let mut c = self.docker();
        c.env("DOCKER_CONFIG", config).args(["login", "--username", user, "--password-stdin"]);
        let mut child = c
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run docker login");
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(password.as_bytes());
        }
        let out = child.wait_with_output().expect("docker login");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if out.status.success() { Ok(text) } else { Err(text) }
    }

    /// `docker pull <image>` by a client whose config is in `config`.
    pub fn pull_as(&self, config: &Path, image: &str) -> Result<String, String> {
        let mut c = self.docker();
        c.env("DOCKER_CONFIG", config).args(["pull", image]);
        run(c)
    }

    /// `docker rmi <image>` (whether or not it is there).
    pub fn remove(&self, image: &str) {
        let mut c = self.docker();
        c.args(["rmi", "--force", image]);
        let _ = run(c);
    }

    /// The `RepoDigests` dockerd recorded for a pulled image.
    pub fn repo_digests(&self, image: &str) -> Vec<String> {
        let mut c = self.docker();
        c.args(["image", "inspect", "--format", "{{json .RepoDigests}}", image]);
        let out = run(c).unwrap_or_else(|e| panic!("{e}"));
        serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("RepoDigests {out:?}: {e}"))
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        // SIGTERM lets dockerd stop its own containerd; SIGKILL if it hangs.
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
