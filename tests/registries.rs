//! larder against the shapes in which real registries answer a pull
//! (shared/REGISTRIES.md), each emulated by tests/shapes/ on made-up HTTPS
//! hosts pinned to 127.0.0.1 that record every request and the
//! credentials it carried. (One address for all, not 127.0.0.x each: the
//! realm and credential rules compare origins, scheme, host name and port,
//! never resolved addresses, and every site has its own port; /etc/hosts
//! already pins these names to 127.0.0.1 for the other tests.) Each test
//! is a pull (skopeo, or plain HTTP for counting), then an account of who
//! was sent what:
//!
//! - Docker Hub: tokens from the `auth.` sibling, blobs from a CDN that
//!   refuses credentials, the pull limit as gauges, warm pulls without
//!   manifest GETs, a used-up limit served stale, `docker.io` by name means
//!   `library/`;
//! - registry.k8s.io: a redirect to Artifact Registry under a rewritten
//!   name, answered with an anonymous token for exactly that name; the
//!   upstream's credentials never reach the other host;
//! - Scarf fronts: a realm on another domain refused (clearly, counted,
//!   and never contacted) until `trusted_realms` names it; a redirect to
//!   ghcr answered anonymously;
//! - nvcr.io: no `service`, short-lived tokens reused, a revoked token
//!   retried once, one token request under concurrency;
//! - ECR: Basic credentials from a credential helper whose password
//!   rotates every 2 s, and a rotating `password_file`; secrets never
//!   logged; a missing, failing or hanging helper is a clear error;
//! - outages: the revalidation back-off starts short and is bounded by
//!   `tag_ttl`; a 429 on a moved tag's GET serves the cached digest.

mod common;
#[path = "clients/hosts.rs"]
mod hosts;
mod shapes;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::metrics::{ADMIN_LISTEN, metric};
use common::{Credentials, KIB, Larder, Upstream, http, skopeo};
use shapes::site::Tls;
use shapes::{ecr, foreign, hub, k8s, nvcr, plain, scarf};

const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json";

/// The answer to one request through larder.
#[derive(Debug)]
struct Answer {
    status: u16,
    digest: Option<String>,
    retry_after: Option<String>,
    body: Bytes,
}

impl Answer {
    /// The OCI error envelope's first `(code, message)`.
    fn error(&self) -> (String, String) {
        let json: serde_json::Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not an OCI error envelope ({e}): {:?}", String::from_utf8_lossy(&self.body)));
        let first = &json["errors"][0];
        (
            first["code"].as_str().unwrap_or_default().to_owned(),
            first["message"].as_str().unwrap_or_default().to_owned(),
        )
    }
}

/// `GET <path>` through larder.
async fn get(larder: &Larder, path: &str) -> Answer {
    let url = format!("{}{path}", larder.url());
    let response = http::client()
        .get(&url)
        .header("accept", MANIFEST_ACCEPT)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url} through larder: {e}"));
    let header = |n: &str| response.headers().get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let (status, digest, retry_after) =
        (response.status().as_u16(), header("docker-content-digest"), header("retry-after"));
    let body = response.bytes().await.unwrap_or_else(|e| panic!("reading GET {url}: {e}"));
    Answer { status, digest, retry_after, body }
}

/// An upstream table for a shape: served over HTTPS with the test CA.
/// An upstream of these tests: trusting the fake registries' CA, and
/// without fills ahead, since the tests count the requests each client
/// request makes (fills ahead are counted in tests/cold_fills.rs).
fn upstream(name: &str, url: &str, tls: &Tls) -> Upstream {
    Upstream::new(name, url).line(&format!("ca_file = {:?}", tls.ca_file())).line("fill_ahead = false")
}

fn larder() -> common::LarderBuilder {
    Larder::builder().server_line(ADMIN_LISTEN)
}

/// `larder_upstream_auth_failures_total` for `upstream` and `reason`.
async fn auth_failures(larder: &Larder, upstream: &str, reason: &str) -> f64 {
    metric(larder, &format!(r#"larder_upstream_auth_failures_total{{reason="{reason}",upstream="{upstream}"}}"#)).await
}

async fn pull(source: &str) -> common::PulledImage {
    skopeo::pull(source, false).await.unwrap_or_else(|e| panic!("pulling {source} through larder: {e}"))
}

// ---- Docker Hub ---------------------------------------------------------------

#[tokio::test]
async fn docker_hub_tokens_from_the_auth_host_blobs_from_a_cdn_without_credentials_and_the_pull_limit() {
    let tls = shapes::setup();
    let account = Credentials::new("hub-user", "hub-pat-never-logged");
    let hub = hub::Hub::start(&tls, Some((&account.user, &account.password)), 5).await;
    let image = hub.images.push("library/alpine", "3", &[8 * KIB, 32 * KIB]);
    // Named docker.io but pointed elsewhere (a Hub mirror): library/ by name.
    let upstream = upstream("docker.io", &hub.registry.url(), &tls).default(true).credentials(&account).tag_ttl("1s");
    let larder = larder().upstream(upstream).start().await;

    let pulled = pull(&larder.image_ref("alpine:3")).await;
    assert_eq!(pulled.manifest_digest, image.digest, "alpine:3 is library/alpine:3");
    assert_eq!(pulled.blob_digests().len(), image.blobs.len());

    // Tokens came from the auth sibling, asked with the account, scoped to the repository.
    let token_requests = hub.auth.seen();
    assert!(!token_requests.is_empty());
    for r in &token_requests {
        assert_eq!(r.authorization.as_deref(), Some(shapes::basic(&account.user, &account.password).as_str()));
        assert_eq!(r.params("scope"), ["repository:library/alpine:pull"], "{r:?}");
        assert_eq!(r.params("service"), [hub::SERVICE], "{r:?}");
    }
    // The registry saw Bearer tokens only; the CDN saw no credentials at all.
    assert!(hub.registry.authorizations().iter().all(|a| a.starts_with("Bearer ")), "{:?}", hub.registry.seen());
    let cdn = hub.cdn.seen();
    assert_eq!(cdn.len(), image.blobs.len(), "every blob came from the CDN: {cdn:?}");
    assert!(cdn.iter().all(|r| r.authorization.is_none() && r.status == 200), "{cdn:?}");
    assert_eq!(hub.manifest_requests(), ["GET /v2/library/alpine/manifests/3 200"]);
    let limit = metric(&larder, r#"larder_upstream_ratelimit_limit{upstream="docker.io"}"#).await;
    let remaining = metric(&larder, r#"larder_upstream_ratelimit_remaining{upstream="docker.io"}"#).await;
    assert_eq!((limit, remaining), (5.0, 4.0), "the pull limit as Hub announced it");

    // Warm pulls, within and past the tag's TTL: no manifest GET, at most
    // one (free) HEAD, no blob.
    for round in ["within the TTL", "past the TTL"] {
        if round == "past the TTL" {
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
        hub.registry.clear();
        hub.cdn.clear();
        assert_eq!(pull(&larder.image_ref("alpine:3")).await.manifest_digest, image.digest, "{round}");
        let manifest_requests = hub.manifest_requests();
        assert!(manifest_requests.iter().all(|r| r.starts_with("HEAD ")), "{round}: {manifest_requests:?}");
        assert!(manifest_requests.len() <= 1, "{round}: {manifest_requests:?}");
        assert!(hub.cdn.seen().is_empty(), "{round}: blobs from the cache");
    }

    // The tag moves while the pull limit is used up: the HEAD (free) says
    // so, and larder serves what it has rather than spend a GET.
    let moved = hub.images.push("library/alpine", "3", &[8 * KIB]);
    hub.set_remaining(0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    hub.registry.clear();
    let stale_before = metric(&larder, r#"larder_cache_requests_total{kind="manifest",result="stale"}"#).await;
    let a = get(&larder, "/v2/library/alpine/manifests/3").await;
    assert_eq!((a.status, a.digest.as_deref()), (200, Some(image.digest.as_str())), "the cached digest, stale");
    assert_eq!(hub.manifest_requests(), ["HEAD /v2/library/alpine/manifests/3 200"], "no GET spent");
    let stale = metric(&larder, r#"larder_cache_requests_total{kind="manifest",result="stale"}"#).await;
    assert_eq!(stale, stale_before + 1.0);
    assert_eq!(metric(&larder, r#"larder_upstream_ratelimit_remaining{upstream="docker.io"}"#).await, 0.0);

    // A tag never cached has nothing to fall back on: Hub's 429 is passed
    // on with its Retry-After (not 404, not 502).
    let cold = get(&larder, "/v2/library/alpine/manifests/edge").await;
    assert_eq!((cold.status, cold.retry_after.as_deref()), (429, Some("60")), "{:?}", cold.error());
    assert_eq!(cold.error().0, "TOOMANYREQUESTS");

    // Once the window resets, the moved tag is fetched.
    hub.set_remaining(5);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let a = get(&larder, "/v2/library/alpine/manifests/3").await;
    assert_eq!((a.status, a.digest.as_deref()), (200, Some(moved.digest.as_str())));
    assert!(!larder.log().contains(&account.password), "the Hub token is never logged");
}

// ---- registry.k8s.io -----------------------------------------------------------

#[tokio::test]
async fn registry_k8s_io_redirects_to_a_rewritten_name_that_gets_an_anonymous_token_for_exactly_it() {
    let tls = shapes::setup();
    let account = Credentials::new("k8s-mirror", "k8s-secret-never-elsewhere");
    let k8s = k8s::K8s::start(&tls, (&account.user, &account.password)).await;
    let rewritten = format!("{}/pause", k8s::REWRITTEN_PREFIX);
    let image = k8s.images.push(&rewritten, "3.9", &[8 * KIB, 16 * KIB]);
    let larder =
        larder().upstream(upstream("registry.k8s.io", &k8s.front.url(), &tls).credentials(&account)).start().await;

    let pulled = pull(&larder.prefixed_ref("registry.k8s.io", "pause:3.9")).await;
    assert_eq!(pulled.manifest_digest, image.digest);
    assert_eq!(pulled.blob_digests().len(), image.blobs.len());

    // Artifact Registry's realm was asked anonymously, for the rewritten name only.
    let token_requests = k8s.artifact.seen_under("/v2/token");
    assert!(!token_requests.is_empty());
    for r in &token_requests {
        assert_eq!(r.authorization, None, "anonymous: {r:?}");
        assert_eq!(r.params("scope"), [format!("repository:{rewritten}:pull")], "{r:?}");
        assert_eq!(r.params("service"), [k8s::ARTIFACT], "{r:?}");
        assert_eq!(r.status, 200, "{r:?}");
    }
    // Everything Artifact Registry was sent is a token it issued itself.
    let issued: Vec<String> = k8s.tokens.issued().into_iter().map(|g| format!("Bearer {}", g.token)).collect();
    for a in k8s.artifact.authorizations() {
        assert!(issued.contains(&a), "Artifact Registry was sent {a:?}, which it did not issue");
    }
    // One challenge answered; later requests carried the cached token up front.
    let challenged = k8s.artifact.seen().iter().filter(|r| r.status == 401).count();
    assert_eq!(challenged, 1, "{:#?}", k8s.artifact.seen());
    // Blob downloads followed the relative Location on the same host.
    let downloads = k8s.artifact.seen_under("/artifacts-downloads/");
    assert_eq!(downloads.len(), image.blobs.len(), "{downloads:?}");
    assert!(downloads.iter().all(|r| r.status == 200));

    // The credentials are real: the front's tags/list wants them, and gets them.
    let tags = get(&larder, "/v2/registry.k8s.io/pause/tags/list").await;
    assert_eq!(tags.status, 200, "{:?}", String::from_utf8_lossy(&tags.body));
    let basic = shapes::basic(&account.user, &account.password);
    let front_with_credentials: Vec<String> =
        k8s.front.seen().into_iter().filter(|r| r.authorization.as_deref() == Some(&basic)).map(|r| r.path).collect();
    assert_eq!(front_with_credentials, ["/v2/pause/tags/list"]);
    // ... and never reached the other host.
    assert!(!k8s.artifact.authorizations().contains(&basic));
    assert!(k8s.artifact.authorizations().iter().all(|a| a.starts_with("Bearer ")));

    // Now the front's Basic challenge is remembered, and its credentials go
    // up front with every request to it. Another tag and its blobs: the
    // requests redirected to the other host still carry none of them.
    let next = k8s.images.push(&rewritten, "3.10", &[4 * KIB]);
    k8s.front.clear();
    k8s.artifact.clear();
    let a = get(&larder, "/v2/registry.k8s.io/pause/manifests/3.10").await;
    assert_eq!((a.status, a.digest.as_deref()), (200, Some(next.digest.as_str())));
    for blob in &next.blobs {
        let a = get(&larder, &format!("/v2/registry.k8s.io/pause/blobs/{blob}")).await;
        assert_eq!(a.status, 200, "{blob}: {:?}", String::from_utf8_lossy(&a.body));
    }
    let front = k8s.front.seen();
    assert_eq!(front.len(), 1 + next.blobs.len(), "{front:#?}");
    assert!(
        front.iter().all(|r| r.authorization.as_deref() == Some(&basic)),
        "the front gets them up front: {front:#?}"
    );
    let artifact = k8s.artifact.seen();
    assert!(!artifact.is_empty());
    let issued: Vec<String> = k8s.tokens.issued().into_iter().map(|g| format!("Bearer {}", g.token)).collect();
    for r in &artifact {
        let a = r.authorization.as_deref();
        assert!(a.is_none_or(|a| issued.iter().any(|t| t == a)), "the other host was sent {a:?}: {r:?}");
    }
    assert!(!larder.log().contains(&account.password));
}

// ---- Scarf fronts ----------------------------------------------------------------

#[tokio::test]
async fn a_scarf_front_naming_a_realm_on_another_domain_needs_trusted_realms() {
    let tls = shapes::setup();
    let scarf = scarf::Scarf::start(&tls).await;
    let image = scarf.images.push("linuxserver/nginx", "latest", &[8 * KIB]);
    let account = Credentials::new("lscr-user", "lscr-secret");
    let realm = format!("{}/token", scarf.ghcr.url());

    // Without trusted_realms: refused before anything is sent there.
    let untrusted = upstream("lscr.io", &scarf.challenging.url(), &tls).credentials(&account);
    let larder_a = larder().upstream(untrusted).start().await;
    let a = get(&larder_a, "/v2/lscr.io/linuxserver/nginx/manifests/latest").await;
    assert_eq!(a.status, 502);
    let (code, message) = a.error();
    assert_eq!(code, "UNAVAILABLE");
    assert_eq!(message, "upstream authentication failed (details in larder's log)");
    let log = larder_a.log();
    assert!(log.contains(&format!("token realm host \\\"{}\\\"", scarf::GHCR)), "{log}");
    assert!(log.contains(&format!("trusted_realms = [\\\"{realm}\\\"]")), "names the key to set: {log}");
    assert!(scarf.ghcr.seen().is_empty(), "the realm host received nothing: {:?}", scarf.ghcr.seen());
    assert_eq!(auth_failures(&larder_a, "lscr.io", "realm_refused").await, 1.0);
    assert!(larder_a.log().contains("trusted_realms"), "the refusal is logged");

    // With it: the realm is asked (with the upstream's credentials, which
    // the operator now sends there), and the pull works.
    let trusted = upstream("lscr.io", &scarf.challenging.url(), &tls)
        .credentials(&account)
        .line(&format!("trusted_realms = [{realm:?}]"));
    let larder_b = larder().upstream(trusted).start().await;
    let pulled = pull(&larder_b.prefixed_ref("lscr.io", "linuxserver/nginx:latest")).await;
    assert_eq!(pulled.manifest_digest, image.digest);
    let token_requests = scarf.ghcr.seen_under("/token");
    assert!(!token_requests.is_empty());
    assert!(token_requests.iter().all(|r| r.authorization == Some(shapes::basic(&account.user, &account.password))));
    assert!(token_requests.iter().all(|r| r.params("scope") == ["repository:linuxserver/nginx:pull"]));
}

#[tokio::test]
async fn a_scarf_front_redirecting_to_ghcr_gets_anonymous_tokens_there_and_keeps_its_credentials() {
    let tls = shapes::setup();
    let scarf = scarf::Scarf::start(&tls).await;
    let image = scarf.images.push("linkerd/proxy", "stable", &[8 * KIB, 8 * KIB]);
    let account = Credentials::new("l5d-user", "l5d-secret-stays-home");
    let front = upstream("cr.l5d.io", &scarf.redirecting.url(), &tls).credentials(&account);
    let larder = larder().upstream(front).start().await;

    let pulled = pull(&larder.prefixed_ref("cr.l5d.io", "linkerd/proxy:stable")).await;
    assert_eq!(pulled.manifest_digest, image.digest);
    let token_requests = scarf.ghcr.seen_under("/token");
    assert!(!token_requests.is_empty());
    assert!(token_requests.iter().all(|r| r.authorization.is_none()), "anonymous: {token_requests:?}");
    assert!(scarf.ghcr.authorizations().iter().all(|a| a.starts_with("Bearer ")), "{:?}", scarf.ghcr.seen());
    assert!(scarf.redirecting.authorizations().is_empty(), "the front never challenged");
    assert!(!larder.log().contains(&account.password));
}

// ---- a redirect target naming a foreign realm -------------------------------------

#[tokio::test]
async fn a_redirect_target_naming_a_realm_on_another_domain_is_refused_and_the_realm_never_contacted() {
    let tls = shapes::setup();
    let foreign = foreign::Foreign::start(&tls).await;
    let image = foreign.images.push("team/app", "v1", &[4 * KIB]);
    let account = Credentials::new("mirror-user", "mirror-secret");
    // Even listed in trusted_realms, which is about the upstream's own
    // challenges: a redirect target may name only its own site's realm.
    let front = upstream("mirror.example", &foreign.front.url(), &tls)
        .credentials(&account)
        .line(&format!("trusted_realms = [{:?}]", foreign.realm_url));
    let larder = larder().upstream(front).start().await;

    let a = get(&larder, "/v2/mirror.example/team/app/manifests/v1").await;
    assert_eq!(a.status, 502, "{:?}", String::from_utf8_lossy(&a.body));
    let (code, message) = a.error();
    assert_eq!(code, "UNAVAILABLE");
    // The realm's name is for the operator's log, not the client.
    assert_eq!(message, "upstream authentication failed (details in larder's log)");
    let log = larder.log();
    assert!(log.contains(&format!("token realm host \\\"{}\\\"", foreign::REALM)), "names the realm: {log}");
    assert!(log.contains(&format!("redirect target \\\"{}\\\"", foreign::TARGET)), "{log}");
    let blob = get(&larder, &format!("/v2/mirror.example/team/app/blobs/{}", image.blobs[0])).await;
    assert_eq!(blob.status, 502);

    assert!(foreign.realm.seen().is_empty(), "the foreign realm received: {:#?}", foreign.realm.seen());
    assert_eq!(auth_failures(&larder, "mirror.example", "realm_refused").await, 2.0, "both refusals counted");
    assert!(foreign.target.authorizations().is_empty(), "the target was sent {:?}", foreign.target.authorizations());
    assert!(foreign.front.seen().iter().all(|r| r.status == 307), "{:#?}", foreign.front.seen());
}

// ---- nvcr.io ---------------------------------------------------------------------

#[tokio::test]
async fn nvcr_without_service_short_tokens_reused_and_a_revoked_token_retried_once() {
    let tls = shapes::setup();
    // Tokens live 4 s: reused for 3 s (a quarter of the lifetime is the margin).
    let nvcr = nvcr::Nvcr::start(&tls, 4).await;
    let image = nvcr.images.push("nvidia/cuda", "12", &[4 * KIB]);
    let blobs: Vec<String> = (0..20).map(|i| nvcr.images.add_blob(Bytes::from(format!("nvcr blob {i}")))).collect();
    let registry =
        upstream("nvcr.io", &nvcr.registry.url(), &tls).line(&format!("trusted_realms = [{:?}]", nvcr.realm));
    let larder = larder().upstream(registry).start().await;
    let blob = |i: usize| format!("/v2/nvcr.io/nvidia/cuda/blobs/{}", blobs[i]);

    assert_eq!(get(&larder, "/v2/nvcr.io/nvidia/cuda/manifests/12").await.digest, Some(image.digest.clone()));
    assert_eq!(get(&larder, &blob(0)).await.status, 200);
    assert_eq!(nvcr.tokens.issued().len(), 1, "the short-lived token was reused");
    assert!(nvcr.authn.seen().iter().all(|r| r.params("service").is_empty() && r.status == 200));

    // Past its lifetime the token is not sent any more: a new one is fetched,
    // and no request ever reached the registry with an expired token.
    tokio::time::sleep(Duration::from_millis(4200)).await;
    assert_eq!(get(&larder, &blob(1)).await.status, 200);
    assert_eq!(nvcr.tokens.issued().len(), 2);
    assert_eq!(nvcr.refused_tokens(), 0, "{:#?}", nvcr.registry.seen());

    // Revoked early: one 401, the cached token dropped, one retry with a
    // fresh one; the client never sees the error.
    nvcr.tokens.revoke_all();
    let a = get(&larder, &blob(2)).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(nvcr.tokens.issued().len(), 3);
    assert_eq!(nvcr.refused_tokens(), 1);
    assert_eq!(metric(&larder, r#"larder_upstream_auth_retries_total{upstream="nvcr.io"}"#).await, 1.0);

    // Revoked again under concurrency: still one token request.
    nvcr.tokens.revoke_all();
    let answers = futures_util::future::join_all((3..15).map(|i| {
        let path = blob(i);
        let larder = &larder;
        async move { get(larder, &path).await.status }
    }))
    .await;
    assert!(answers.iter().all(|s| *s == 200), "{answers:?}");
    assert_eq!(nvcr.tokens.issued().len(), 4, "one token request for twelve refused requests");
}

#[tokio::test]
async fn a_fresh_token_refused_again_is_retried_once_and_the_client_gets_denied() {
    let tls = shapes::setup();
    let tokens = shapes::registry::Tokens::new(Some(300));
    let plain = plain::Plain::start(&tls, Some(tokens.clone())).await;
    let first = plain.images.push("team/app", "v1", &[4 * KIB]);
    plain.images.push("team/app", "v2", &[4 * KIB]);
    let larder = larder().upstream(upstream("plain.test", &plain.registry.url(), &tls).default(true)).start().await;
    assert_eq!(get(&larder, "/v2/team/app/manifests/v1").await.digest, Some(first.digest.clone()));
    assert_eq!(tokens.issued().len(), 1, "one token, now cached");

    // The registry refuses every token from now on, fresh ones too (the
    // pull permission withdrawn): the cached token is refused, a fresh one
    // fetched and refused too, and that is the end of it.
    tokens.refuse_all();
    plain.registry.clear();
    let a = get(&larder, "/v2/team/app/manifests/v2").await;
    assert_eq!(a.status, 403, "{:?}", String::from_utf8_lossy(&a.body));
    assert_eq!(a.error().0, "DENIED");
    let tries: Vec<_> = plain.registry.seen().into_iter().filter(|r| r.path == "/v2/team/app/manifests/v2").collect();
    assert_eq!(tries.len(), 2, "the cached token, then one retry with a fresh one: {tries:#?}");
    assert!(tries.iter().all(|r| r.status == 401 && r.authorization.is_some()), "{tries:#?}");
    assert_ne!(tries[0].authorization, tries[1].authorization, "the retry carried the fresh token");
    assert_eq!(plain.registry.seen_under("/token").len(), 1, "one fresh token fetched");
    assert_eq!(tokens.issued().len(), 2, "the token service got exactly two requests in all");
    assert_eq!(metric(&larder, r#"larder_upstream_auth_retries_total{upstream="plain.test"}"#).await, 1.0);
    assert_eq!(auth_failures(&larder, "plain.test", "denied").await, 1.0);
}

// ---- ECR -------------------------------------------------------------------------

/// Rotates `file` (a password shared by the fake ECR and the helper or
/// `password_file`) every `every` until dropped; returns every password used.
struct Rotation {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<String>>,
}

impl Rotation {
    fn start(file: &Path, every: Duration, kubernetes_style: bool) -> Rotation {
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let (file, stop) = (file.to_owned(), Arc::clone(&stop));
            async move {
                let mut used = Vec::new();
                for n in 0.. {
                    let password = format!("rotated-{n}-{:016x}", rand::random::<u64>());
                    if kubernetes_style {
                        swap_secret_dir(&file, &password, n);
                    } else {
                        shapes::replace_file(&file, &password);
                    }
                    used.push(password);
                    tokio::time::sleep(every).await;
                    if stop.load(Ordering::SeqCst) {
                        return used;
                    }
                }
                used
            }
        });
        Rotation { stop, task }
    }

    async fn finish(self) -> Vec<String> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.expect("the rotation task")
    }
}

/// A Kubernetes Secret volume update: a new timestamped folder, then an
/// atomic swap of the `..data` symlink that `file` (a symlink into it) follows.
fn swap_secret_dir(file: &Path, password: &str, n: usize) {
    let dir = file.parent().expect("the secret volume");
    let version = format!("..v{n}");
    std::fs::create_dir(dir.join(&version)).expect("a new secret version");
    std::fs::write(dir.join(&version).join("password"), password).expect("write the secret");
    let next = dir.join("..data_tmp");
    std::os::unix::fs::symlink(&version, &next).expect("symlink the new version");
    std::fs::rename(&next, dir.join("..data")).expect("swap ..data");
    if !file.exists() {
        std::os::unix::fs::symlink("..data/password", file).expect("symlink the key");
    }
}

/// Fetches every blob in `blobs` through `larder` one after the other,
/// `pause` apart; each must be served.
async fn pull_each(larder: &Larder, name: &str, blobs: &[String], pause: Duration) {
    for (i, d) in blobs.iter().enumerate() {
        let a = get(larder, &format!("/v2/{name}/team/app/blobs/{d}")).await;
        assert_eq!(a.status, 200, "blob {i}: {:?}", String::from_utf8_lossy(&a.body));
        tokio::time::sleep(pause).await;
    }
}

#[tokio::test]
async fn ecr_basic_credentials_from_a_helper_whose_password_rotates() {
    let tls = shapes::setup();
    let dir = tempfile::tempdir().expect("a temp dir");
    let (secret, runs) = (dir.path().join("secret"), dir.path().join("helper-runs"));
    let rotation = Rotation::start(&secret, Duration::from_secs(2), false);
    let ecr = ecr::Ecr::start(&tls, &secret).await;
    let blobs: Vec<String> = (0..24).map(|i| ecr.images.add_blob(Bytes::from(format!("ecr layer {i}")))).collect();
    // The helper prints the password it reads; it logs the host it was asked for.
    shapes::credential_helper(
        dir.path(),
        "ecr-test",
        &format!(
            r#"read -r host; echo "$host" >> {runs:?}
printf '{{"ServerURL":"%s","Username":"{user}","Secret":"%s"}}\n' "$host" "$(cat {secret:?})""#,
            user = ecr::USER
        ),
    );
    let registry = upstream("ecr.example", &ecr.registry.url(), &tls).line(r#"credential_helper = "ecr-test""#);
    let larder = larder().upstream(registry).env("PATH", &shapes::path_with(dir.path())).start().await;

    // 24 pulls over about 6 s: three rotations or more.
    pull_each(&larder, "ecr.example", &blobs, Duration::from_millis(250)).await;
    let passwords = rotation.finish().await;

    let runs = std::fs::read_to_string(&runs).expect("the helper ran");
    let hosts: Vec<&str> = runs.lines().collect();
    let registry_host = format!("{}:{}", ecr::REGISTRY, ecr.registry.url().rsplit(':').next().unwrap_or_default());
    assert!(hosts.iter().all(|h| *h == registry_host), "the helper is asked for the registry host: {hosts:?}");
    assert!(hosts.len() >= 3, "run again after each rotation: {hosts:?}");
    assert!(ecr.refused_credentials() >= 2, "rotations made upstream refuse old passwords");
    assert_eq!(
        metric(&larder, r#"larder_upstream_auth_retries_total{upstream="ecr.example"}"#).await,
        ecr.refused_credentials() as f64,
        "each refusal was retried once, with the helper's new answer"
    );
    let log = larder.log();
    for password in &passwords {
        assert!(!log.contains(password.as_str()), "a helper secret is in larder's log");
    }
}

#[tokio::test]
async fn a_password_file_rotated_like_a_kubernetes_secret_is_read_again() {
    let tls = shapes::setup();
    let volume = tempfile::tempdir().expect("a secret volume");
    let file = volume.path().join("password");
    let rotation = Rotation::start(&file, Duration::from_secs(2), true);
    shapes::wait_for_file(&file).await;
    let ecr = ecr::Ecr::start(&tls, &file).await;
    let blobs: Vec<String> = (0..24).map(|i| ecr.images.add_blob(Bytes::from(format!("private layer {i}")))).collect();
    let registry = upstream("private.example", &ecr.registry.url(), &tls)
        .line(&format!("username = {:?}", ecr::USER))
        .line(&format!("password_file = {:?}", file.display().to_string()));
    let larder = larder().upstream(registry).start().await;

    pull_each(&larder, "private.example", &blobs, Duration::from_millis(250)).await;
    let passwords = rotation.finish().await;
    assert!(passwords.len() >= 3, "rotated during the pulls: {passwords:?}");
    let log = larder.log();
    assert!(log.contains("password_file changed"), "the re-read is logged (without the password)");
    for password in &passwords {
        assert!(!log.contains(password.as_str()), "a password is in larder's log");
    }
}

#[tokio::test]
async fn a_missing_failing_or_hanging_credential_helper_is_a_clear_counted_error() {
    let tls = shapes::setup();
    let dir = tempfile::tempdir().expect("a temp dir");
    let secret = dir.path().join("secret");
    shapes::replace_file(&secret, "unused");
    let ecr = ecr::Ecr::start(&tls, &secret).await;
    let blob = ecr.images.add_blob(Bytes::from_static(b"a layer"));
    // It prints an answer, secret included, then fails: nothing of its
    // stdout may reach a client or the log.
    shapes::credential_helper(
        dir.path(),
        "fails",
        r#"echo '{"Username":"AWS","Secret":"helper-stdout-secret"}'; echo 'credentials not found in native keychain' >&2; exit 1"#,
    );
    shapes::credential_helper(dir.path(), "hangs", "sleep 60");
    let helper = |name: &str, helper: &str| {
        upstream(name, &ecr.registry.url(), &tls).line(&format!("credential_helper = {helper:?}"))
    };
    let larder = larder()
        .upstream(helper("missing.example", "larder-test-absent"))
        .upstream(helper("fails.example", "fails"))
        .upstream(helper("hangs.example", "hangs"))
        .env("PATH", &shapes::path_with(dir.path()))
        .start()
        .await;
    assert!(larder.log().contains("credential helper not found on PATH"), "warned at start-up");

    let cases = [
        ("missing.example", "helper_missing", "docker-credential-larder-test-absent is not on PATH"),
        ("fails.example", "helper_failed", "credentials not found in native keychain"),
        ("hangs.example", "helper_timeout", "did not answer within 10s"),
    ];
    for (name, reason, says) in cases {
        let a = get(&larder, &format!("/v2/{name}/team/app/blobs/{blob}")).await;
        assert_eq!(a.status, 502, "{name}");
        let (code, message) = a.error();
        assert_eq!(code, "UNAVAILABLE", "{name}");
        // The client learns what failed in general terms; the operator
        // reads the helper's own words in the log.
        assert_eq!(message, format!("credentials for upstream {name:?} are unavailable"), "{name}");
        assert!(larder.log().contains(says), "{name}: the log says {says:?}");
        assert_eq!(auth_failures(&larder, name, reason).await, 1.0, "{name}");
    }
    assert!(!larder.log().contains("helper-stdout-secret"), "a helper's stdout is never logged");
    assert!(ecr.registry.authorizations().is_empty(), "no credentials were ever sent");
}

// ---- outages and limits ----------------------------------------------------------

#[tokio::test]
async fn after_an_outage_a_moved_tag_is_seen_within_about_one_tag_ttl_and_the_outage_is_not_hammered() {
    let tls = shapes::setup();
    let plain = plain::Plain::start(&tls, None).await;
    let first = plain.images.push("team/app", "v1", &[4 * KIB]);
    let larder = larder()
        .upstream(upstream("plain.test", &plain.registry.url(), &tls).default(true).tag_ttl("2s"))
        .start()
        .await;
    assert_eq!(get(&larder, "/v2/team/app/manifests/v1").await.digest, Some(first.digest.clone()));

    // Down, past the TTL: 30 requests over 3 s are served stale, and ask
    // upstream only a few times (1 s, then 2 s apart).
    plain.set_down(true);
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let heads_before = plain.manifest_heads();
    for _ in 0..30 {
        let a = get(&larder, "/v2/team/app/manifests/v1").await;
        assert_eq!((a.status, a.digest.as_deref()), (200, Some(first.digest.as_str())), "stale during the outage");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let heads = plain.manifest_heads() - heads_before;
    assert!((1..=5).contains(&heads), "{heads} revalidations for 30 requests during the outage");

    // Back, with the tag moved: seen within a few seconds (the back-off is
    // bounded by the 2 s TTL; it used to be a fixed 30 s).
    plain.set_down(false);
    let moved = plain.images.push("team/app", "v1", &[4 * KIB]);
    let mut waited = Duration::ZERO;
    loop {
        let a = get(&larder, "/v2/team/app/manifests/v1").await;
        if a.digest.as_deref() == Some(moved.digest.as_str()) {
            break;
        }
        assert!(waited < Duration::from_secs(10), "the moved tag was not seen 10 s after the upstream recovered");
        tokio::time::sleep(Duration::from_millis(200)).await;
        waited += Duration::from_millis(200);
    }
}

#[tokio::test]
async fn a_moved_tag_whose_get_is_refused_with_429_is_served_from_the_cache() {
    let tls = shapes::setup();
    let plain = plain::Plain::start(&tls, None).await;
    let first = plain.images.push("team/app", "v1", &[4 * KIB]);
    let larder = larder()
        .upstream(upstream("plain.test", &plain.registry.url(), &tls).default(true).tag_ttl("1s"))
        .start()
        .await;
    assert_eq!(get(&larder, "/v2/team/app/manifests/v1").await.digest, Some(first.digest.clone()));

    // The tag moves; the registry (no rate-limit headers) refuses GETs.
    plain.images.push("team/app", "v1", &[4 * KIB]);
    plain.answer_manifest_gets_with(429);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let gets = plain.manifest_gets();
    let a = get(&larder, "/v2/team/app/manifests/v1").await;
    assert_eq!((a.status, a.digest.as_deref()), (200, Some(first.digest.as_str())), "served stale, not 429");
    assert_eq!(plain.manifest_gets(), gets + 1, "one GET, refused");
    // Within the 429's pause no GET is tried again.
    let a = get(&larder, "/v2/team/app/manifests/v1").await;
    assert_eq!((a.status, a.digest.as_deref()), (200, Some(first.digest.as_str())));
    assert_eq!(plain.manifest_gets(), gets + 1, "no GET while rate limited");
    let stale = metric(&larder, r#"larder_cache_requests_total{kind="manifest",result="stale"}"#).await;
    assert_eq!(stale, 2.0);
}

// ---- urls failover -------------------------------------------------------------

#[tokio::test]
async fn urls_are_tried_in_order_on_connect_errors_and_5xx() {
    let tls = shapes::setup();
    let (primary, fallback) = (plain::Plain::start(&tls, None).await, plain::Plain::start(&tls, None).await);
    let image = fallback.images.push("team/app", "v1", &[4 * KIB]);
    primary.images.push("team/app", "v1", &[4 * KIB]);
    // Nothing listens on the first URL.
    let closed = shapes::site::Addr::pick(plain::REGISTRY).url();
    let urls = [closed, primary.registry.url(), fallback.registry.url()];
    let upstream = upstream("plain.test", "", &tls).urls(&urls);
    let larder = larder().upstream(upstream.default(true)).start().await;

    // The closed URL refuses the connection, the primary answers 503: the
    // fallback serves.
    primary.set_down(true);
    let a = get(&larder, "/v2/team/app/manifests/v1").await;
    assert_eq!((a.status, a.digest.as_deref()), (200, Some(image.digest.as_str())));
    assert_eq!(primary.registry.seen().iter().map(|r| r.status).collect::<Vec<_>>(), [503]);
    // The primary back: it serves again, in order.
    primary.set_down(false);
    primary.images.add_blob(fallback.images.bytes(&image.blobs[0]).expect("the config blob"));
    let a = get(&larder, &format!("/v2/team/app/blobs/{}", image.blobs[0])).await;
    assert_eq!(a.status, 200);
    assert_eq!(primary.registry.seen().last().map(|r| r.status), Some(200));
    assert_eq!(fallback.registry.seen().len(), 1, "the fallback only when needed");
}

#[tokio::test]
async fn a_url_that_failed_to_connect_goes_last_but_is_not_dropped() {
    let tls = shapes::setup();
    let fallback = plain::Plain::start(&tls, None).await;
    let image = fallback.images.push("team/app", "v1", &[4 * KIB, 4 * KIB]);
    // The primary accepts connections and hangs up: a connect error.
    let primary = shapes::site::Hangup::start(&shapes::site::Addr::pick(plain::REGISTRY)).await;
    let upstream = upstream("plain.test", "", &tls).urls(&[primary.url(), fallback.registry.url()]);
    let larder = larder().upstream(upstream.default(true)).start().await;

    let a = get(&larder, "/v2/team/app/manifests/v1").await;
    assert_eq!((a.status, a.digest.as_deref()), (200, Some(image.digest.as_str())));
    assert_eq!(primary.accepted(), 1, "tried first");

    // Within the pause (FAILOVER_PAUSE, 30 s) the fallback goes first: the
    // primary costs later requests nothing.
    for blob in &image.blobs {
        assert_eq!(get(&larder, &format!("/v2/team/app/blobs/{blob}")).await.status, 200);
    }
    assert_eq!(primary.accepted(), 1, "demoted after failing to connect");

    // Demoted is last, not gone: with the fallback down, it is tried again.
    fallback.set_down(true);
    let a = get(&larder, "/v2/team/app/manifests/v2").await;
    assert_eq!(a.status, 503, "{:?}", String::from_utf8_lossy(&a.body));
    assert!(a.error().1.contains("cannot connect to upstream"), "the last url's answer: {:?}", a.error());
    assert_eq!(fallback.registry.seen().last().map(|r| r.status), Some(503));
    assert_eq!(primary.accepted(), 2, "tried after the fallback");
}

// ---- the registries guide's snippets ------------------------------------------------

/// Every `config/registries/*.toml` passes `larder check-config` (copied
/// into a folder with placeholder files for the `password_file`s it names,
/// which are relative to the config file), and the registries guide
/// (docs/registries.md), section "A config per registry", shows it verbatim.
#[test]
fn every_registry_snippet_passes_check_config_and_is_in_the_guide() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let guide = std::fs::read_to_string(root.join("docs/registries.md")).expect("read docs/registries.md");
    let section = guide
        .split("\n## ")
        .find(|s| s.starts_with("A config per registry"))
        .expect("a section \"A config per registry\" in docs/registries.md");
    let mut snippets: Vec<_> = std::fs::read_dir(root.join("config/registries"))
        .expect("config/registries/")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    snippets.sort();
    for path in &snippets {
        let text = std::fs::read_to_string(path).expect("read the snippet");
        let dir = tempfile::tempdir().expect("a temp dir");
        let config = dir.path().join(path.file_name().expect("a file name"));
        std::fs::write(&config, &text).expect("copy the snippet");
        for line in text.lines().filter_map(|l| l.strip_prefix("password_file = ")) {
            let secret = dir.path().join(line.trim_matches('"'));
            std::fs::create_dir_all(secret.parent().expect("a folder")).expect("mkdir");
            std::fs::write(&secret, "placeholder").expect("write a placeholder secret");
        }
        let out = std::process::Command::new(common::larder::binary())
            .args(["check-config", "--config"])
            .arg(&config)
            .output()
            .expect("run larder check-config");
        assert!(
            out.status.success(),
            "{}: {}{}",
            path.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(section.contains(text.trim_end()), "docs/registries.md shows {} verbatim", path.display());
    }
    assert_eq!(snippets.len(), 11, "{snippets:?}");
}
