//! dockerd as a Docker host uses a mirror: `registry-mirrors` with larder's
//! root URL, Docker Hub names, no `ns`: larder's default upstream serves it.

mod clients;
mod common;

use clients::dockerd::Dockerd;
use common::{ImageBuilder, KIB, Larder, Origin};

#[tokio::test(flavor = "multi_thread")]
async fn dockerd_pulls_a_docker_hub_name_through_the_default_upstream() {
    let origin = Origin::start().await;
    // `docker pull smoke:v1` means docker.io/library/smoke:v1.
    let image =
        ImageBuilder::docker_schema2().layers(&[64 * KIB, 128 * KIB]).push(&origin, "library/smoke", "v1").await;
    let larder = Larder::builder().upstream(&origin).start().await;
    let docker = Dockerd::start(&larder.url(), &larder.host_port());

    let mark = origin.log_mark().await;
    docker.pull("smoke:v1").unwrap_or_else(|e| panic!("{e}\nlarder log:\n{}", larder.log()));

    let seen = origin.requests_since(&mark).await;
    let mut fetched: Vec<String> =
        seen.blob_get_entries().iter().map(|e| e.path().rsplit('/').next().unwrap_or_default().to_owned()).collect();
    fetched.sort();
    assert_eq!(fetched, image.blob_digests(), "every blob fetched from the origin exactly once");
    let digests = docker.repo_digests("smoke:v1");
    assert!(
        digests.iter().any(|d| d.ends_with(&format!("@{}", image.digest))),
        "dockerd recorded the origin's manifest digest {}, got {digests:?}",
        image.digest
    );
}
