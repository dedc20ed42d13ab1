//! Who may pull what (README "Who may pull what"): an upstream's `allow`
//! and `deny`, and `[[server.auth.grant]]`s per client, against the real
//! distribution origin and real skopeo with each client's own credentials
//! or client certificate. The rules hold for cached content too: a cached
//! image is never a way around them, and a refusal costs no upstream
//! request.

mod common;

use common::metrics::{ADMIN_LISTEN, metric};
use common::{Credentials, ImageBuilder, KIB, Larder, ORIGIN_NAME, Origin, Pull, TestCa, Upstream, http};

/// `[server] auth = { htpasswd }` with these users (bcrypt cost 4).
fn htpasswd(dir: &std::path::Path, users: &[&Credentials]) -> String {
    let path = dir.join("htpasswd");
    let lines: String =
        users.iter().map(|c| format!("{}:{}\n", c.user, bcrypt::hash(&c.password, 4).expect("bcrypt"))).collect();
    std::fs::write(&path, lines).expect("write htpasswd");
    path.display().to_string()
}

async fn denied(larder: &Larder, series: &str) -> f64 {
    metric(larder, &format!("{series}{{upstream=\"{ORIGIN_NAME}\"}}")).await
}

#[tokio::test(flavor = "multi_thread")]
async fn allow_and_deny_refuse_before_the_cache_and_before_any_dial() {
    let origin = Origin::start().await;
    let nginx = ImageBuilder::oci().layers(&[8 * KIB]).push(&origin, "library/nginx", "1").await;
    let ubuntu = ImageBuilder::oci().layers(&[8 * KIB]).push(&origin, "library/ubuntu", "22").await;
    ImageBuilder::oci().layers(&[8 * KIB]).push(&origin, "evil/app", "1").await;
    let mut larder = Larder::builder().upstream(&origin).server_line(ADMIN_LISTEN).start().await;
    // Without a policy, both are pulled, and so cached.
    for (image, pushed) in [("library/ubuntu:22", &ubuntu), ("library/nginx:1", &nginx)] {
        let pulled = Pull::new(&larder.image_ref(image)).run().await.unwrap_or_else(|e| panic!("{image}: {e}"));
        assert_eq!(pulled.manifest_digest, pushed.digest);
    }

    // The operator adds a policy; the cache still holds library/ubuntu.
    let config = larder.config_text().replace(
        &format!("name = \"{ORIGIN_NAME}\""),
        &format!("name = \"{ORIGIN_NAME}\"\nallow = [\"library/*\", \"team-*/**\"]\ndeny = [\"library/ubuntu\"]"),
    );
    std::fs::write(larder.config_path(), config).expect("rewrite the config");
    larder.restart().await;
    let mark = origin.log_mark().await;

    let e = Pull::new(&larder.image_ref("library/ubuntu:22")).run().await.err().expect("denied, though cached");
    assert!(e.stderr.contains("denied") || e.stderr.contains("403"), "{e}");
    let by_digest = http::client()
        .get(format!("{}/v2/library/ubuntu/blobs/{}", larder.url(), ubuntu.blob_digests()[0]))
        .send()
        .await
        .unwrap();
    assert_eq!(by_digest.status(), 403, "a cached blob by digest too");
    let body: serde_json::Value = serde_json::from_slice(&by_digest.bytes().await.unwrap()).unwrap();
    assert_eq!(body["errors"][0]["code"], "DENIED");
    let message = body["errors"][0]["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("library/ubuntu") && message.contains(ORIGIN_NAME) && message.contains("deny rule"),
        "{message}"
    );
    let e = Pull::new(&larder.image_ref("evil/app:1")).run().await.err().expect("not in allow");
    assert!(e.stderr.contains("denied") || e.stderr.contains("403"), "{e}");

    // Allowed content is served as before.
    let pulled = Pull::new(&larder.image_ref("library/nginx:1")).run().await.expect("allowed");
    assert_eq!(pulled.manifest_digest, nginx.digest);
    let refused_requests = origin.requests_since(&mark).await;
    assert!(
        refused_requests.entries().iter().all(|r| !r.path().contains("ubuntu") && !r.path().contains("evil")),
        "a refused repository reached the origin: {:?}",
        refused_requests.entries()
    );
    assert!(denied(&larder, "larder_policy_denied_total").await >= 3.0);
    // A denied request is a valid route that was refused: counted under its
    // route with status 403, not as `invalid`.
    let requests = |route: &str, status: &str| {
        format!("larder_requests_total{{method=\"GET\",route=\"{route}\",status=\"{status}\"}}")
    };
    assert!(metric(&larder, &requests("manifest", "403")).await >= 2.0, "the two refused pulls' manifests");
    assert!(metric(&larder, &requests("blob", "403")).await >= 1.0, "the cached blob by digest");
    assert_eq!(metric(&larder, &requests("invalid", "403")).await, 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_tenants_each_pull_their_own_and_never_the_others_even_when_cached() {
    let origin = Origin::start().await;
    let a_image = ImageBuilder::oci().layers(&[8 * KIB]).push(&origin, "team-a/app", "v1").await;
    let b_image = ImageBuilder::oci().layers(&[8 * KIB]).push(&origin, "team-b/app", "v1").await;
    let dir = tempfile::tempdir().unwrap();
    let (team_a, team_b) = (Credentials::new("team-a", "a-secret"), Credentials::new("team-b", "b-secret"));
    let htpasswd = htpasswd(dir.path(), &[&team_a, &team_b]);
    let larder = Larder::builder()
        .upstream(&origin)
        .server_line(ADMIN_LISTEN)
        .append_toml(&format!(
            "[server.auth]\nhtpasswd = {htpasswd:?}\n\
             [[server.auth.grant]]\nwho = [\"team-a\"]\nupstreams = [\"{ORIGIN_NAME}\"]\nrepositories = [\"team-a/**\"]\n\
             [[server.auth.grant]]\nwho = [\"team-b\"]\nrepositories = [\"team-b/**\"]\n"
        ))
        .ready_on_tcp()
        .start()
        .await;

    // Each tenant pulls its own image with its own credentials (and
    // caches it).
    for (who, image, pushed) in [(&team_a, "team-a/app:v1", &a_image), (&team_b, "team-b/app:v1", &b_image)] {
        let pulled = Pull::new(&larder.image_ref(image))
            .credentials(who)
            .run()
            .await
            .unwrap_or_else(|e| panic!("{} pulling {image}: {e}\n{}", who.user, larder.log()));
        assert_eq!(pulled.manifest_digest, pushed.digest);
    }
    let mark = origin.log_mark().await;
    // Neither pulls the other's, though both are cached now.
    for (who, image) in [(&team_a, "team-b/app:v1"), (&team_b, "team-a/app:v1")] {
        let e = Pull::new(&larder.image_ref(image)).credentials(who).run().await.err().expect("not granted");
        assert!(e.stderr.contains("denied") || e.stderr.contains("403"), "{e}");
    }
    let blob = http::client()
        .get(format!("{}/v2/team-b/app/blobs/{}", larder.url(), b_image.blob_digests()[0]))
        .basic_auth("team-a", Some("a-secret"))
        .send()
        .await
        .unwrap();
    assert_eq!(blob.status(), 403, "a cached blob of the other tenant");
    assert_eq!(origin.requests_since(&mark).await.entries().len(), 0, "a refusal costs no upstream request");
    assert!(denied(&larder, "larder_grant_denied_total").await >= 3.0);
    // The denial is logged with the client's names as a grant writes them,
    // never as Rust debug text.
    let log = larder.log();
    let line = log.lines().find(|l| l.contains("no grant for this client")).expect("a denial logged");
    assert!(line.contains("user=\"team-a\"") || line.contains("user=team-a"), "{line}");
    assert!(line.contains("certificate=none"), "{line}");
    assert!(!log.contains("ClientIdentity") && !log.contains("Some(") && !log.contains("=None"), "{log}");
    // The version check stays open to any authenticated client.
    let base = http::client().get(format!("{}/v2/", larder.url())).basic_auth("team-a", Some("a-secret")).send().await;
    assert_eq!(base.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_certificate_common_name_is_granted_what_its_grant_names() {
    let origin = Origin::start().await;
    let mine = ImageBuilder::oci().layers(&[8 * KIB]).push(&origin, "ci/runner", "v1").await;
    ImageBuilder::oci().layers(&[8 * KIB]).push(&origin, "team-b/app", "v1").await;
    let dir = tempfile::tempdir().unwrap();
    let server = TestCa::new();
    let (cert, key) = server.write_leaf(dir.path());
    let clients = TestCa::new();
    let client_ca = dir.path().join("clients-ca.pem");
    std::fs::write(&client_ca, &clients.ca_pem).unwrap();
    let larder = Larder::builder()
        .upstream(Upstream::from(&origin))
        .server_line(ADMIN_LISTEN)
        .server_line(&format!(
            "tls = {{ cert = {:?}, key = {:?}, client_ca = {:?} }}",
            cert.display().to_string(),
            key.display().to_string(),
            client_ca.display().to_string()
        ))
        .append_toml("[[server.auth.grant]]\nwho = [\"cn:larder test client\"]\nrepositories = [\"ci/**\"]\n")
        .ready_on_tcp()
        .start()
        .await;
    let client = Some((clients.client_pem.as_str(), clients.client_key_pem.as_str()));

    let pulled = Pull::new(&larder.image_ref("ci/runner:v1"))
        .tls(&server.ca_pem, client)
        .run()
        .await
        .unwrap_or_else(|e| panic!("the granted certificate: {e}\n{}", larder.log()));
    assert_eq!(pulled.manifest_digest, mine.digest);
    let e = Pull::new(&larder.image_ref("team-b/app:v1")).tls(&server.ca_pem, client).run().await;
    let e = e.err().expect("a repository no grant names");
    assert!(e.stderr.contains("denied") || e.stderr.contains("403"), "{e}");
    assert!(denied(&larder, "larder_grant_denied_total").await >= 1.0);
}
