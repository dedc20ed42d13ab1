//! Real clients against an upstream with `client_credentials = "verify"`:
//! podman with `--creds`, dockerd with a client logged in to Docker Hub,
//! and containerd's CRI `PullImage` with a pull secret's `AuthConfig`, the
//! way a kubelet pulls for a pod. The origin is real distribution behind
//! token auth; alice may pull `team-a/*`, bob `team-b/*`.
//!
//! Each client also meets a recorder first (its first mirror, which
//! answers every request `401` with a `Basic` challenge, so that the
//! client moves on to larder): what the recorder saw is exactly what that
//! client sends a mirror.

mod clients;
mod common;
mod fake;

use base64::Engine;
use clients::containerd::Containerd;
use clients::cri::{AuthConfig, pull_image};
use clients::dockerd::Dockerd;
use clients::podman::Podman;
use common::{Credentials, ImageBuilder, KIB, Larder, Origin, PushedImage, Upstream};
use fake::recorder::Recorder;

/// containerd's name for the registry: made up, pinned to 127.0.0.1 where
/// nothing listens on 443, so only a mirror can answer.
const REGISTRY: &str = "private.made-up.test";

fn alice() -> Credentials {
    Credentials::new("alice", "alice:S3cret:pw")
}

fn bob() -> Credentials {
    Credentials::new("bob", "bob-S3cret-pw")
}

/// `Basic base64(user:password)`, as a client sends it.
fn basic(c: &Credentials) -> String {
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(c.colon_joined()))
}

/// The origin with alice's and bob's images.
async fn origin() -> (Origin, PushedImage, PushedImage) {
    let origin = Origin::with_token_auth(Credentials::new("admin", "admin-Pw-0")).await;
    origin.token_server().add_user(&alice(), &["team-a/"]);
    origin.token_server().add_user(&bob(), &["team-b/"]);
    let a = ImageBuilder::oci().layers(&[48 * KIB, 96 * KIB]).push(&origin, "team-a/app", "v1").await;
    let b = ImageBuilder::oci().layers(&[32 * KIB]).push(&origin, "team-b/app", "v1").await;
    (origin, a, b)
}

/// A mirror that asks every request for Basic credentials and records
/// what it gets.
async fn challenging_mirror() -> Recorder {
    Recorder::start(
        [127, 0, 0, 1],
        b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"recorder\"\r\n\
          Docker-Distribution-API-Version: registry/2.0\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            .to_vec(),
    )
    .await
}

fn verifying(upstream: Upstream) -> Upstream {
    upstream.line("client_credentials = \"verify\"")
}

#[tokio::test(flavor = "multi_thread")]
async fn podman_with_creds_pulls_its_own_image_and_not_another_tenants() {
    let (origin, a, b) = origin().await;
    let larder = Larder::builder().upstream(verifying(Upstream::from(&origin))).ready_on_tcp().start().await;
    let podman = Podman::new(&larder.host_port());
    let image = |p: &PushedImage| format!("{}/{}:{}", larder.host_port(), p.repo, p.tag);

    podman.pull(&image(&a), &alice().colon_joined()).unwrap_or_else(|e| panic!("{e}\n{}", larder.log()));
    assert_eq!(podman.digest(&image(&a)), a.digest);
    let refused = podman.pull(&image(&a), &bob().colon_joined());
    assert!(refused.is_err(), "bob must not pull team-a/app through larder");
    eprintln!("podman as bob: {}", refused.unwrap_err());
    podman.pull(&image(&b), &bob().colon_joined()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(podman.digest(&image(&b)), b.digest);
}

#[tokio::test(flavor = "multi_thread")]
async fn dockerd_sends_the_docker_hub_login_to_its_mirror_and_larder_checks_it() {
    let (origin, a, _) = origin().await;
    // dockerd's mirror serves Docker Hub names: the default upstream.
    let larder = Larder::builder().upstream(verifying(Upstream::from(&origin))).ready_on_tcp().start().await;
    let recorder = challenging_mirror().await;
    let first = format!("http://{}", recorder.addr());
    let docker = Dockerd::start_with_config(serde_json::json!({
        "registry-mirrors": [first, larder.url()],
        "insecure-registries": [recorder.addr().to_string(), larder.host_port()],
    }));

    // `docker login` checks the credentials with Docker Hub itself (pinned
    // to 127.0.0.1 here: nothing answers), never with a mirror.
    let login = docker.login(&docker.dir().join("client-login"), &alice().user, &alice().password);
    eprintln!("docker login: {login:?}");
    assert!(login.is_err(), "Docker Hub cannot be reached from the test");
    assert!(recorder.heads().is_empty(), "docker login asked no mirror: {:?}", recorder.heads());

    // alice logged in to Docker Hub: dockerd sends those credentials to
    // each mirror that challenges for them.
    let alice_config = docker.hub_login("alice", &alice().user, &alice().password);
    let tokens = origin.token_server().mark();
    docker.pull_as(&alice_config, "team-a/app:v1").unwrap_or_else(|e| panic!("{e}\nlarder log:\n{}", larder.log()));
    let digests = docker.repo_digests("team-a/app:v1");
    assert!(digests.iter().any(|d| d.ends_with(&a.digest)), "{digests:?}");
    let sent = recorder.header_values("authorization");
    eprintln!("what dockerd sent its first mirror: {:#?}", recorder.heads());
    assert!(sent.contains(&basic(&alice())), "dockerd sent alice's Docker Hub login to the mirror: {sent:?}");
    let checked = origin.token_server().requests_since(tokens);
    assert!(checked.iter().any(|r| r.user.as_deref() == Some("alice")), "larder checked alice upstream");

    // bob logged in to Docker Hub: his credentials reach larder too, and
    // are refused for team-a/app (then dockerd tries Docker Hub itself,
    // pinned to 127.0.0.1: nothing there).
    let bob_config = docker.hub_login("bob", &bob().user, &bob().password);
    docker.remove("team-a/app:v1");
    let refused = docker.pull_as(&bob_config, "team-a/app:v1");
    assert!(refused.is_err(), "bob must not pull team-a/app through larder");
    assert!(recorder.header_values("authorization").contains(&basic(&bob())));
}

/// What a CRI pull sent the recorder (its first mirror): the
/// `Authorization` values, and the request lines.
fn seen(recorder: &Recorder) -> (Vec<String>, Vec<String>) {
    let lines = recorder.heads().iter().map(|h| h.lines().next().unwrap_or_default().to_owned()).collect();
    (recorder.header_values("authorization"), lines)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kubelet_pull_secret_reaches_larder_through_containerd_and_only_its_owner_pulls() {
    clients::hosts::pin_to_loopback(&[REGISTRY]);
    let (origin, a, _) = origin().await;
    let larder =
        Larder::builder().upstream(verifying(Upstream::new(REGISTRY, &origin.url()))).ready_on_tcp().start().await;
    let node = Containerd::start_cri();
    let socket = node.socket();
    let image = format!("{REGISTRY}/{}:{}", a.repo, a.tag);

    // alice's pull secret, as the kubelet hands it over: a user name and a
    // password, no server_address. containerd offers them to every host
    // that asks, the recorder and larder alike.
    let recorder = challenging_mirror().await;
    node.mirrors(REGISTRY, &[format!("http://{}", recorder.addr()), larder.url()]);
    let pulled = pull_image(&socket, &image, Some(&AuthConfig::basic(&alice().user, &alice().password))).await;
    let image_ref = pulled
        .unwrap_or_else(|e| panic!("{e}\ncontainerd: {}\nlarder:\n{}", clients::tail(&node.log(), 30), larder.log()));
    assert_eq!(image_ref, a.manifests[0].config.digest, "CRI's image_ref is the image id (its config's digest)");
    let (sent, lines) = seen(&recorder);
    eprintln!("what containerd's CRI pull sent its first mirror: {lines:#?} {sent:?}");
    assert!(
        !sent.is_empty() && sent.iter().all(|s| *s == basic(&alice())),
        "after each challenge, containerd retried with alice's Basic credentials: {sent:?}"
    );
    assert!(lines.iter().all(|l| l.contains(&format!("ns={REGISTRY}"))), "{lines:?}");

    // bob's pull secret: containerd sends it, larder refuses it for team-a.
    let node_b = Containerd::start_cri();
    node_b.mirrors(REGISTRY, &[larder.url()]);
    let refused = pull_image(&node_b.socket(), &image, Some(&AuthConfig::basic(&bob().user, &bob().password))).await;
    eprintln!("bob's CRI pull: {refused:?}");
    assert!(refused.is_err(), "bob's pull secret must not pull team-a/app");

    // No pull secret: nothing is sent, larder challenges, the pull fails.
    let refused = pull_image(&node_b.socket(), &image, None).await;
    assert!(refused.is_err());

    // A server_address naming the registry: containerd (ParseAuth) keeps
    // the credentials from every other host, the mirrors included.
    let recorder = challenging_mirror().await;
    node_b.mirrors(REGISTRY, &[format!("http://{}", recorder.addr()), larder.url()]);
    let named = AuthConfig {
        server_address: format!("https://{REGISTRY}"),
        ..AuthConfig::basic(&alice().user, &alice().password)
    };
    let refused = pull_image(&node_b.socket(), &image, Some(&named)).await;
    let (sent, lines) = seen(&recorder);
    eprintln!("with server_address = https://{REGISTRY}: {lines:#?} {sent:?}; pull: {refused:?}");
    assert!(sent.is_empty(), "containerd sends a mirror no credentials for another server_address: {sent:?}");
    assert!(refused.is_err());
}
