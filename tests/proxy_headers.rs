//! What the newest clients read in a mirror's response headers:
//!
//! - `OCI-Namespace`: distribution-spec (main, "Registry Proxying", merged
//!   November 2025): a registry that scopes a request by `?ns=` SHOULD
//!   return that value in `OCI-Namespace`. larder echoes it on every
//!   response to a request that carried `ns`, errors included.
//! - `Warning: 299 - "…"`: distribution-spec ("Warnings", since 1.1.0):
//!   one warning per header, at most 4096 bytes of them in all. containerd
//!   reports the ones on the `HEAD` that resolves a tag (and on later
//!   requests) since 2.4. larder relays upstream's with the manifest they
//!   came with: on the fill, on cache hits, after a restart, and as a
//!   tag's revalidation finds them now.
//!
//! The upstream is the in-process fake (distribution sends no warnings);
//! a hub in front of it shows the relay across `via`.

mod common;
mod fake;

use std::time::Duration;

use common::http::{MANIFEST_MEDIA_TYPES, client};
use common::{Larder, Upstream};
use fake::{FakeUpstream, OCI_MANIFEST, REPO, digest, image_manifest, random_bytes};

const NAME: &str = "fake.test";
const W1: &str = r#"299 - "This image is deprecated and will be removed soon.""#;
const W2: &str = r#"299 - "Your auth token will expire in 30 seconds.""#;
const W3: &str = r#"299 - "Moved: use registry.example/team/app.""#;

/// A manifest of its own (a config and one layer made from `seed`).
fn a_manifest(seed: u64) -> bytes::Bytes {
    let config = random_bytes(256, seed);
    let layer = random_bytes(1024, seed + 1);
    image_manifest((&digest(&config), config.len()), &[(&digest(&layer), layer.len())])
}

/// The values of every `name` header of a response, in order.
fn all(resp: &reqwest::Response, name: &str) -> Vec<String> {
    resp.headers().get_all(name).iter().map(|v| v.to_str().expect("an ASCII header").to_owned()).collect()
}

/// `GET` (or `HEAD`) of a manifest from `larder`, with every manifest
/// media type accepted; panics unless it is a 200.
async fn manifest(larder: &Larder, method: reqwest::Method, path: &str) -> reqwest::Response {
    let http = client();
    let url = format!("{}{path}", larder.url());
    let request = MANIFEST_MEDIA_TYPES.iter().fold(http.request(method.clone(), &url), |r, t| r.header("Accept", *t));
    let resp = request.send().await.unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    assert_eq!(resp.status(), 200, "{method} {path}:\n{}", larder.log());
    resp
}

#[tokio::test(flavor = "multi_thread")]
async fn every_response_to_a_request_with_ns_echoes_it_in_oci_namespace() {
    let (_, manifest_digest, up) = fake::fake_with_v1().await;
    let larder = Larder::builder().upstream(Upstream::new(NAME, &up.url()).alias("index.fake.test")).start().await;
    let http = client();
    let blob = digest(&random_bytes(512, 1));
    // (method, path and query, status, ns echoed)
    let cases: Vec<(reqwest::Method, String, u16, Option<&str>)> = vec![
        (reqwest::Method::GET, format!("/v2/{REPO}/manifests/v1?ns={NAME}"), 200, Some(NAME)),
        (reqwest::Method::HEAD, format!("/v2/{REPO}/manifests/v1?ns={NAME}"), 200, Some(NAME)),
        (reqwest::Method::GET, format!("/v2/{REPO}/manifests/{manifest_digest}?ns={NAME}"), 200, Some(NAME)),
        // An alias is echoed as the client sent it.
        (reqwest::Method::HEAD, format!("/v2/{REPO}/manifests/v1?ns=index.fake.test"), 200, Some("index.fake.test")),
        (reqwest::Method::GET, format!("/v2/{REPO}/blobs/{blob}?ns={NAME}"), 200, Some(NAME)),
        (reqwest::Method::HEAD, format!("/v2/{REPO}/blobs/{blob}?ns={NAME}"), 200, Some(NAME)),
        (reqwest::Method::GET, format!("/v2/?ns={NAME}"), 200, Some(NAME)),
        // Errors too: a missing manifest, an unknown ns, a bad digest, a push.
        (reqwest::Method::GET, format!("/v2/{REPO}/manifests/nope?ns={NAME}"), 404, Some(NAME)),
        (reqwest::Method::GET, format!("/v2/{REPO}/manifests/v1?ns=unknown.example"), 404, Some("unknown.example")),
        (reqwest::Method::GET, format!("/v2/{REPO}/blobs/sha256:bad?ns={NAME}"), 400, Some(NAME)),
        (reqwest::Method::PUT, format!("/v2/{REPO}/manifests/v1?ns={NAME}"), 405, Some(NAME)),
        (reqwest::Method::GET, format!("/v2/{REPO}/tags/list?ns={NAME}"), 404, Some(NAME)),
        // Without ns (a path prefix routes it): nothing to echo.
        (reqwest::Method::GET, format!("/v2/{NAME}/{REPO}/manifests/v1"), 200, None),
        (reqwest::Method::GET, format!("/v2/{NAME}/{REPO}/manifests/nope"), 404, None),
    ];
    for (method, path, status, echoed) in cases {
        let request = MANIFEST_MEDIA_TYPES
            .iter()
            .fold(http.request(method.clone(), format!("{}{path}", larder.url())), |r, t| r.header("Accept", *t));
        let resp = request.send().await.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        assert_eq!(resp.status().as_u16(), status, "{method} {path}");
        let expected: Vec<String> = echoed.into_iter().map(str::to_owned).collect();
        assert_eq!(all(&resp, "oci-namespace"), expected, "{method} {path}: exactly one OCI-Namespace, the ns sent");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_warnings_reach_the_client_on_the_fill_on_hits_after_a_restart_and_as_revalidated() {
    let bytes = a_manifest(10);
    let d = digest(&bytes);
    let up = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, bytes.clone())
        // An HTTP cache's warning and a repeat are not registry warnings.
        .warnings(&[W1, r#"110 - "Response is Stale""#, W2, W1])
        .start()
        .await;
    let mut larder = Larder::builder().upstream(Upstream::new(NAME, &up.url()).tag_ttl("1s")).start().await;
    let by_tag = format!("/v2/{REPO}/manifests/v1?ns={NAME}");
    let by_digest = format!("/v2/{REPO}/manifests/{d}?ns={NAME}");
    let both = [W1.to_owned(), W2.to_owned()];

    // The fill, then hits: HEAD by tag (what containerd resolves with) and GET by digest.
    let fill = manifest(&larder, reqwest::Method::GET, &by_tag).await;
    assert_eq!(all(&fill, "warning"), both, "the fill relays upstream's registry warnings, in order, once each");
    assert_eq!(all(&fill, "docker-content-digest"), [d.as_str()]);
    let gets = up.manifest_gets("v1") + up.manifest_gets(&d);
    for (method, path) in [(reqwest::Method::HEAD, &by_tag), (reqwest::Method::GET, &by_digest)] {
        let hit = manifest(&larder, method.clone(), path).await;
        assert_eq!(all(&hit, "warning"), both, "{method} {path}: a cache hit carries them too");
    }
    assert_eq!(up.manifest_gets("v1") + up.manifest_gets(&d), gets, "the hits were served from the cache");

    // After a restart the memory tier is empty: the index kept them.
    larder.restart().await;
    let after = manifest(&larder, reqwest::Method::GET, &by_digest).await;
    assert_eq!(all(&after, "warning"), both, "kept with the manifest on disk");
    assert_eq!(up.manifest_gets("v1") + up.manifest_gets(&d), gets, "from the cache, not upstream");

    // Upstream's warnings change; the tag's revalidation (a HEAD, past
    // the 1 s tag_ttl) brings the new ones, for the digest too.
    up.set_warnings(&d, &[W3]);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let revalidated = manifest(&larder, reqwest::Method::HEAD, &by_tag).await;
    assert_eq!(all(&revalidated, "warning"), [W3], "the revalidation's answer replaces them");
    assert_eq!(all(&manifest(&larder, reqwest::Method::GET, &by_digest).await, "warning"), [W3]);
    assert_eq!(up.manifest_gets("v1") + up.manifest_gets(&d), gets, "a revalidation is a HEAD, no GET");
    larder.restart().await;
    assert_eq!(all(&manifest(&larder, reqwest::Method::GET, &by_digest).await, "warning"), [W3], "and kept so");

    // Upstream stops warning: so does larder, once the tag is revalidated.
    up.set_warnings(&d, &[]);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(all(&manifest(&larder, reqwest::Method::GET, &by_tag).await, "warning").is_empty());
    larder.restart().await;
    assert!(all(&manifest(&larder, reqwest::Method::GET, &by_digest).await, "warning").is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn at_most_4096_bytes_of_warnings_are_relayed() {
    let bytes = a_manifest(20);
    // Ten warnings of 608 bytes each: six fit in 4096, the seventh would not.
    let many: Vec<String> =
        (0..10).map(|i| format!(r#"299 - "{}""#, char::from(b'a' + i).to_string().repeat(600))).collect();
    let refs: Vec<&str> = many.iter().map(String::as_str).collect();
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, bytes).warnings(&refs).start().await;
    let larder = Larder::builder().upstream(Upstream::new(NAME, &up.url())).start().await;
    let resp = manifest(&larder, reqwest::Method::GET, &format!("/v2/{REPO}/manifests/v1?ns={NAME}")).await;
    let relayed = all(&resp, "warning");
    assert_eq!(relayed, many[..6], "the first six, in upstream's order");
    assert!(relayed.iter().map(String::len).sum::<usize>() <= 4096);
}

#[tokio::test(flavor = "multi_thread")]
async fn warnings_cross_a_hub() {
    let bytes = a_manifest(30);
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, bytes).warnings(&[W1]).start().await;
    let hub = Larder::builder().upstream(Upstream::new(NAME, &up.url())).start().await;
    let node = Larder::builder()
        .upstream(Upstream::new(NAME, &up.url()).line(&format!("via = {:?}", hub.url())))
        .start()
        .await;
    let resp = manifest(&node, reqwest::Method::GET, &format!("/v2/{REPO}/manifests/v1?ns={NAME}")).await;
    assert_eq!(all(&resp, "warning"), [W1], "upstream → hub → node → client");
    assert_eq!(all(&resp, "oci-namespace"), [NAME]);
    let head = manifest(&node, reqwest::Method::HEAD, &format!("/v2/{REPO}/manifests/v1?ns={NAME}")).await;
    assert_eq!(all(&head, "warning"), [W1]);
}

/// A warning is upstream's word to the clients of one repository (a
/// deprecation there, a note about the credentials it was asked with):
/// the same manifest pulled from another upstream (another tenant, other
/// credentials) or repository is served with that one's warnings, never
/// with the first one's, and its fill does not wipe the first one's.
#[tokio::test(flavor = "multi_thread")]
async fn warnings_stay_with_the_upstream_and_repository_they_came_from() {
    let bytes = a_manifest(40);
    let d = digest(&bytes);
    let warns = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, bytes.clone()).warnings(&[W2]).start().await;
    let quiet = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, bytes.clone()).start().await;
    let mut larder = Larder::builder()
        .upstream(Upstream::new("warns.test", &warns.url()))
        .upstream(Upstream::new("quiet.test", &quiet.url()))
        .start()
        .await;
    let path = |ns: &str, reference: &str| format!("/v2/{REPO}/manifests/{reference}?ns={ns}");
    let first = manifest(&larder, reqwest::Method::GET, &path("warns.test", "v1")).await;
    assert_eq!(all(&first, "warning"), [W2]);

    // The other upstream: by digest (cached here: only its membership is
    // asked upstream), then by tag (its own fill, without warnings).
    for reference in [d.as_str(), "v1"] {
        let other = manifest(&larder, reqwest::Method::GET, &path("quiet.test", reference)).await;
        assert!(all(&other, "warning").is_empty(), "quiet.test {reference}: another upstream's warning relayed");
    }
    assert_eq!(quiet.manifest_gets("v1"), 1, "its own fill");
    // The first keeps its own, in memory and on disk.
    for reference in [d.as_str(), "v1"] {
        let again = manifest(&larder, reqwest::Method::HEAD, &path("warns.test", reference)).await;
        assert_eq!(all(&again, "warning"), [W2], "warns.test {reference}: its warnings wiped by another's fill");
    }
    larder.restart().await;
    assert_eq!(all(&manifest(&larder, reqwest::Method::GET, &path("warns.test", &d)).await, "warning"), [W2]);
    assert!(all(&manifest(&larder, reqwest::Method::GET, &path("quiet.test", &d)).await, "warning").is_empty());
    assert_eq!(warns.manifest_gets("v1") + warns.manifest_gets(&d), 1, "all from the cache");

    // Another repository of the warning upstream, by digest: cached, and
    // upstream's HEAD that confirms the repository has it brings the
    // warnings it sends for that repository.
    let other = format!("/v2/test/other/manifests/{d}?ns=warns.test");
    assert_eq!(all(&manifest(&larder, reqwest::Method::GET, &other).await, "warning"), [W2]);
    assert_eq!(warns.requests("HEAD", &format!("/v2/test/other/manifests/{d}")), 1, "its membership, asked once");
    assert_eq!(warns.manifest_gets(&d), 0, "the bytes from the cache");
}
