//! A private podman: its own storage (`vfs`, no mounts), run root,
//! registries.conf (larder as an insecure registry), containers.conf,
//! signature policy and auth file, all in a temp dir, passed through
//! podman's flags and `CONTAINERS_*` environment variables.

use std::path::Path;
use std::process::Command;

use tempfile::TempDir;

use super::run;

pub struct Podman {
    dir: TempDir,
}

impl Podman {
    /// A podman that pulls from `registry` (`host:port`, plain HTTP).
    pub fn new(registry: &str) -> Podman {
        crate::common::which("podman");
        let dir = tempfile::Builder::new().prefix("larder-podman-").tempdir().expect("temp dir");
        let d = dir.path();
        let files = [
            ("registries.conf", format!("[[registry]]\nlocation = \"{registry}\"\ninsecure = true\n")),
            (
                "storage.conf",
                format!(
                    "[storage]\ndriver = \"vfs\"\nrunroot = \"{}\"\ngraphroot = \"{}\"\n",
                    d.join("run").display(),
                    d.join("root").display()
                ),
            ),
            ("containers.conf", "[engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n".to_owned()),
            ("policy.json", r#"{"default":[{"type":"insecureAcceptAnything"}]}"#.to_owned()),
            ("auth.json", "{}".to_owned()),
        ];
        for (name, text) in files {
            std::fs::write(d.join(name), text).unwrap_or_else(|e| panic!("write {name}: {e}"));
        }
        Podman { dir }
    }

    fn podman(&self) -> Command {
        let d = self.dir.path();
        let mut c = Command::new("podman");
        c.env("CONTAINERS_REGISTRIES_CONF", d.join("registries.conf"))
            .env("CONTAINERS_STORAGE_CONF", d.join("storage.conf"))
            .env("CONTAINERS_CONF", d.join("containers.conf"))
            .env("REGISTRY_AUTH_FILE", d.join("auth.json"))
            .arg("--root")
            .arg(d.join("root"))
            .arg("--runroot")
            .arg(d.join("run"))
            .arg("--storage-driver")
            .arg("vfs");
        c
    }

    /// `podman pull --creds user:password <image>`.
    pub fn pull(&self, image: &str, creds: &str) -> Result<String, String> {
        let mut c = self.podman();
        c.arg("pull").arg("--signature-policy").arg(self.dir.path().join("policy.json"));
        c.arg("--creds").arg(creds).arg(image);
        run(c)
    }

    /// The manifest digest podman recorded for a pulled image.
    pub fn digest(&self, image: &str) -> String {
        let mut c = self.podman();
        c.args(["image", "inspect", "--format", "{{.Digest}}", image]);
        run(c).unwrap_or_else(|e| panic!("{e}")).trim().to_owned()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}
