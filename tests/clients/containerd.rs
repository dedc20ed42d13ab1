//! A private containerd, pulled through with `ctr images pull --hosts-dir`,
//! the same resolver path (`hosts.toml`, `?ns=`) that the CRI plugin uses
//! for kubelet pulls.

use std::path::{Path, PathBuf};
use std::process::Command;

use tempfile::TempDir;

use super::{run, wait_until_ready};

pub struct Containerd {
    child: std::process::Child,
    dir: TempDir,
}

impl Containerd {
    /// Starts containerd with its own root, state, sockets and `opt` path,
    /// and the CRI plugin disabled (ctr does not need it).
    pub fn start() -> Containerd {
        Containerd::start_with(false)
    }

    /// Starts containerd with the CRI plugin on, as a kubelet's node runs
    /// it: `hosts.toml` files from [`Containerd::mirror`] configure its
    /// registries, the native snapshotter unpacks, and [`Containerd::socket`]
    /// serves CRI's `ImageService` (see [`super::cri`]).
    pub fn start_cri() -> Containerd {
        Containerd::start_with(true)
    }

    fn start_with(cri: bool) -> Containerd {
        let containerd = crate::common::which("containerd");
        crate::common::which("ctr");
        let dir = tempfile::Builder::new().prefix("larder-containerd-").tempdir().expect("temp dir");
        let d = dir.path();
        let plugins = if cri {
            format!(
                r#"[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni}/bin"
    conf_dir = "{cni}/conf"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{hosts}"
"#,
                cni = d.join("cni").display(),
                hosts = d.join("certs.d").display(),
            )
        } else {
            "disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n".to_owned()
        };
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
{plugins}[grpc]
  address = "{sock}"
[ttrpc]
  address = "{ttrpc}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
"#,
            root = d.join("root").display(),
            state = d.join("state").display(),
            sock = d.join("containerd.sock").display(),
            ttrpc = d.join("containerd-ttrpc.sock").display(),
            opt = d.join("opt").display(),
        );
        std::fs::write(d.join("config.toml"), config).expect("write containerd config");
        let log = std::fs::File::create(d.join("containerd.log")).expect("containerd log");
        let child = Command::new(containerd)
            .arg("--config")
            .arg(d.join("config.toml"))
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .expect("start containerd");
        let instance = Containerd { child, dir };
        wait_until_ready("containerd", &instance.log(), || {
            let mut c = Command::new("ctr");
            c.arg("--address").arg(instance.socket()).arg("version");
            c
        });
        instance
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    pub fn log(&self) -> PathBuf {
        self.dir.path().join("containerd.log")
    }

    fn hosts_dir(&self) -> PathBuf {
        self.dir.path().join("certs.d")
    }

    /// Writes `certs.d/<registry>/hosts.toml`: the registry's own server is
    /// a made-up https host (pinned to 127.0.0.1, nothing listens there),
    /// and larder is the one mirror, with pull and resolve.
    pub fn mirror(&self, registry: &str, larder_url: &str) {
        let dir = self.hosts_dir().join(registry);
        std::fs::create_dir_all(&dir).expect("certs.d dir");
        let hosts = format!(
            "server = \"https://{registry}\"\n\n[host.\"{larder_url}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
        );
        std::fs::write(dir.join("hosts.toml"), hosts).expect("write hosts.toml");
    }

    /// Writes `certs.d/<registry>/hosts.toml` with `mirrors` in order, each
    /// with pull and resolve (containerd tries the next when one fails).
    pub fn mirrors(&self, registry: &str, mirrors: &[String]) {
        let dir = self.hosts_dir().join(registry);
        std::fs::create_dir_all(&dir).expect("certs.d dir");
        let mut hosts = format!("server = \"https://{registry}\"\n");
        for m in mirrors {
            hosts.push_str(&format!("\n[host.\"{m}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"));
        }
        std::fs::write(dir.join("hosts.toml"), hosts).expect("write hosts.toml");
    }

    /// `ctr images pull` (unpacked with the native snapshotter).
    pub fn pull(&self, image: &str, platform: Option<&str>) -> Result<String, String> {
        let mut c = self.ctr();
        c.args(["images", "pull", "--snapshotter", "native", "--hosts-dir"]).arg(self.hosts_dir());
        if let Some(p) = platform {
            c.args(["--platform", p]);
        }
        c.arg(image);
        run(c)
    }

    /// The digest containerd recorded for an image (its manifest or index).
    pub fn image_digest(&self, image: &str) -> String {
        let mut c = self.ctr();
        c.args(["images", "ls", "--quiet"]);
        let listed = run(c).unwrap_or_else(|e| panic!("{e}"));
        assert!(listed.lines().any(|l| l.trim() == image), "{image} not in `ctr images ls`:\n{listed}");
        let mut c = self.ctr();
        c.args(["images", "ls"]);
        let table = run(c).unwrap_or_else(|e| panic!("{e}"));
        table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(image))
            .and_then(|l| l.split_whitespace().find(|w| w.starts_with("sha256:")))
            .unwrap_or_else(|| panic!("no digest for {image} in:\n{table}"))
            .to_owned()
    }

    fn ctr(&self) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address").arg(self.socket());
        c
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The native snapshotter mounts nothing; the temp dir goes with `dir`.
    }
}
