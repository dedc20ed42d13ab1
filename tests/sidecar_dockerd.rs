//! The Helm sidecar as it runs in a pod: charts/examples/dind-runner is
//! rendered by Helm's engine (charts/test_operator_chart.py --emit), and
//! the rendered larder.toml and dockerd daemon.json are run as they are,
//! with only what a test must change: ports (free ones on 127.0.0.1, also
//! for the admin listener the pod binds on all addresses), the cache folder,
//! and Docker Hub's URL pointed at the test origin. dockerd then pulls a
//! Docker Hub name through the sidecar.

mod clients;
mod common;

use std::path::Path;
use std::process::Command;

use clients::dockerd::Dockerd;
use common::process::LoggedChild;
use common::{ImageBuilder, KIB, Origin, free_port, which};

/// Renders the example chart into `dir`: larder.toml and daemon.json.
fn render_example(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/test_operator_chart.py");
    let out = Command::new(which("python3")).arg(&script).arg("--emit").arg(dir).output().expect("run python3");
    assert!(
        out.status.success(),
        "rendering the example chart failed (tests/run.sh installs helm-python-sdk):\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Replaces `from` with `to` in `text`, insisting that `from` is there.
fn swap(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "expected {from:?} in:\n{text}");
    text.replace(from, to)
}

#[tokio::test(flavor = "multi_thread")]
async fn dockerd_pulls_through_the_rendered_sidecar_config() {
    let dir = tempfile::Builder::new().prefix("larder-sidecar-").tempdir().expect("temp dir");
    render_example(dir.path());
    let rendered_toml = std::fs::read_to_string(dir.path().join("larder.toml")).expect("larder.toml");
    let daemon: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("daemon.json")).expect("daemon.json")).expect("JSON");
    assert_eq!(daemon["registry-mirrors"], serde_json::json!(["http://127.0.0.1:5000"]));
    // The mirror's own host:port, not dockerd's loopback default (moby PR
    // #52279 proposes dropping 127.0.0.0/8 and ::1 from it).
    assert_eq!(daemon["insecure-registries"], serde_json::json!(["127.0.0.1:5000"]));

    let origin = Origin::start().await;
    let image = ImageBuilder::docker_schema2().layers(&[64 * KIB, 96 * KIB]).push(&origin, "library/smoke", "v1").await;

    let (port, admin_port) = (free_port(), free_port());
    let toml = swap(&rendered_toml, "listen = \"127.0.0.1:5000\"", &format!("listen = \"127.0.0.1:{port}\""));
    let toml = swap(&toml, "admin_listen = \"[::]:9090\"", &format!("admin_listen = \"127.0.0.1:{admin_port}\""));
    let cache = dir.path().join("cache");
    let toml = swap(&toml, "dir = \"/var/lib/larder\"", &format!("dir = {:?}", cache.display().to_string()));
    let toml = swap(&toml, "url = \"https://registry-1.docker.io\"", &format!("url = \"{}\"", origin.url()));
    let config = dir.path().join("larder.test.toml");
    std::fs::write(&config, &toml).expect("write the test config");

    // larder as the pod runs it: the container's args.
    let mut command = Command::new(common::larder::binary());
    command.args(["--config", &config.display().to_string(), "--log-format", "json"]).env("RUST_LOG", "larder=debug");
    let mut larder = LoggedChild::spawn("larder (sidecar config)", command, &dir.path().join("larder.log"));
    larder.wait_ready(&format!("http://127.0.0.1:{admin_port}/readyz"), 200).await;

    let mirror = format!("http://127.0.0.1:{port}");
    let mut daemon = daemon;
    daemon["registry-mirrors"] = serde_json::json!([mirror]);
    daemon["insecure-registries"] = serde_json::json!([format!("127.0.0.1:{port}")]); // the same, on the test's port
    let docker = Dockerd::start_with_config(daemon);

    let mark = origin.log_mark().await;
    docker.pull("smoke:v1").unwrap_or_else(|e| panic!("{e}\nlarder log:\n{}", larder.log_tail(60)));
    let fetched = origin.requests_since(&mark).await.blob_gets();
    assert_eq!(fetched, image.blob_digests().len(), "every blob fetched from the origin once, through the sidecar");
    let digests = docker.repo_digests("smoke:v1");
    assert!(digests.iter().any(|d| d.ends_with(&format!("@{}", image.digest))), "{digests:?}");
    let served = larder.log();
    assert!(served.contains("\"route\":\"blob\""), "dockerd's blob requests went through larder:\n{served}");
    larder.assert_running("after the pull");
}
