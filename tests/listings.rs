//! Listings through larder: `tags/list` forwarded with its pagination
//! parameters, sorted and paginated by larder when upstream ignores them
//! (the real origin, distribution 2.8, does), relayed when upstream
//! paginates itself, each page cached for the tag TTL under its own query
//! and served stale when upstream is gone; `referrers` from a registry
//! without the API answered by larder itself from the `sha256-<hex>`
//! fallback tag (an empty index when there is none), filtered by
//! `artifactType`.

mod common;
mod fake;

use common::{ImageBuilder, KIB, Larder, ORIGIN_NAME, Origin, Upstream, http};
use fake::{FakeUpstream, UPSTREAM_NAME};

async fn get(url: &str) -> (u16, Option<String>, serde_json::Value) {
    let resp = http::client().get(url).send().await.expect("larder answers");
    let status = resp.status().as_u16();
    let link = resp.headers().get("link").map(|l| l.to_str().expect("ascii link").to_owned());
    let body = resp.bytes().await.expect("body");
    (status, link, serde_json::from_slice(&body).expect("JSON body"))
}

#[tokio::test(flavor = "multi_thread")]
async fn tag_lists_are_sorted_paginated_cached_and_served_stale() {
    let origin = Origin::start().await;
    // Pushed out of order: distribution 2.8 lists them unsorted, and ignores `n` and `last`.
    for tag in ["v3", "latest", "v1", "v2"] {
        ImageBuilder::oci().layers(&[4 * KIB]).push(&origin, "team/app", tag).await;
    }
    let larder = Larder::builder().upstream(&origin).tag_ttl("1s").start().await;

    // The first page, through the path prefix: sorted, cut to n, with a
    // Link on the client's own path to the next page.
    let mark = origin.log_mark().await;
    let first = format!("{}/v2/{ORIGIN_NAME}/team/app/tags/list?n=2", larder.url());
    let (status, link, body) = get(&first).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["tags"], serde_json::json!(["latest", "v1"]));
    let link = link.expect("a Link to the next page");
    assert_eq!(link, format!("</v2/{ORIGIN_NAME}/team/app/tags/list?n=2&last=v1>; rel=\"next\""));
    let asked = origin.requests_since(&mark).await;
    let targets: Vec<&str> = asked.under("/v2/team/app/tags/list").iter().map(|e| e.target.as_str()).collect();
    assert_eq!(targets, ["/v2/team/app/tags/list?n=2"], "forwarded with the client's parameters");

    // Following the Link: its own query, so its own upstream request and
    // cache entry, not the first page's.
    let next = format!("{}{}", larder.url(), link.trim_start_matches('<').split_once('>').expect("<target>").0);
    let mark = origin.log_mark().await;
    let (status, link, body) = get(&next).await;
    assert_eq!((status, &body["tags"], link), (200, &serde_json::json!(["v2", "v3"]), None));
    assert_eq!(origin.requests_since(&mark).await.under("/v2/team/app/tags/list").len(), 1);

    // Without parameters: every tag, sorted.
    let (_, _, body) = get(&format!("{}/v2/team/app/tags/list", larder.url())).await;
    assert_eq!(body["tags"], serde_json::json!(["latest", "v1", "v2", "v3"]));

    // Within the TTL, asking again does not reach the origin.
    let mark = origin.log_mark().await;
    get(&first).await;
    assert!(origin.requests_since(&mark).await.under("/v2/team/app/tags/list").is_empty());

    // Origin gone and TTL over: the last page is served stale, not an error.
    drop(origin);
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    let (status, _, body) = get(&first).await;
    assert_eq!((status, &body["tags"]), (200, &serde_json::json!(["latest", "v1"])));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paginating_upstream_is_relayed_page_by_page() {
    let up = FakeUpstream::builder().tag_list("team/app", &["c", "a", "e", "b", "d"]).start().await;
    let larder = Larder::builder().upstream(Upstream::new(UPSTREAM_NAME, &up.url()).default(true)).start().await;

    let mut url = format!("{}/v2/team/app/tags/list?n=2", larder.url());
    let mut pages = Vec::new();
    loop {
        let (status, link, body) = get(&url).await;
        assert_eq!(status, 200, "{body}");
        pages.push(body["tags"].clone());
        let Some(link) = link else { break };
        url = format!("{}{}", larder.url(), link.trim_start_matches('<').split_once('>').expect("<target>").0);
    }
    assert_eq!(pages, [serde_json::json!(["a", "b"]), serde_json::json!(["c", "d"]), serde_json::json!(["e"])]);
    let queries: Vec<Option<String>> =
        up.log().into_iter().filter(|l| l.path == "/v2/team/app/tags/list").map(|l| l.query).collect();
    assert_eq!(
        queries,
        [Some("n=2".to_owned()), Some("n=2&last=b".to_owned()), Some("n=2&last=d".to_owned())],
        "one upstream request per page, each with its own query"
    );
    // Each page is cached under its own query.
    let (_, _, body) = get(&format!("{}/v2/team/app/tags/list?n=2&last=b", larder.url())).await;
    assert_eq!(body["tags"], serde_json::json!(["c", "d"]));
    assert_eq!(up.requests("GET", "/v2/team/app/tags/list"), 3);
}

use common::image::{OCI_INDEX, OCI_MANIFEST};
const SIGNATURE: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
const SBOM: &str = "application/spdx+json";

#[tokio::test(flavor = "multi_thread")]
async fn referrers_from_an_upstream_without_the_api_come_from_the_fallback_tag() {
    let origin = Origin::start().await;
    let (image, signature, sbom) = signed_image(&origin).await;
    let bare = ImageBuilder::oci().layers(&[4 * KIB]).push(&origin, "team/app", "v2").await;
    let fallback_tag = image.digest.replace(':', "-");
    let mut larder = Larder::builder().upstream(&origin).start().await;

    let base = larder.url();
    let referrers = |digest: &str, query: &str| format!("{base}/v2/team/app/referrers/{digest}{query}");
    for _ in 0..2 {
        let resp = http::client().get(referrers(&image.digest, "")).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], OCI_INDEX);
        let index: serde_json::Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
        assert_eq!(index["mediaType"], OCI_INDEX);
        assert_eq!(index["manifests"], serde_json::json!([signature, sbom]), "both referrers, as the tag lists them");
    }
    // The artifactType filter, applied by larder and said so.
    let resp =
        http::client().get(referrers(&image.digest, "?artifactType=application%2Fspdx%2Bjson")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["oci-filters-applied"], "artifactType");
    let index: serde_json::Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!(index["manifests"], serde_json::json!([sbom]));
    // A manifest without referrers: an empty index, not a 404.
    let resp = http::client().get(referrers(&bare.digest, "")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let index: serde_json::Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!(index["manifests"], serde_json::json!([]));

    // distribution was asked for its referrers API once per query (404:
    // none), and for the fallback tag once (then cached like a tag).
    let asked = origin.access_log();
    let api: Vec<_> =
        asked.under(&format!("/v2/team/app/referrers/{}", image.digest)).into_iter().map(|e| e.status).collect();
    assert_eq!(api, [404, 404], "unfiltered and filtered: {api:?}");
    let tag_requests: Vec<_> = asked
        .under(&format!("/v2/team/app/manifests/{fallback_tag}"))
        .into_iter()
        .filter(|e| e.method != "PUT")
        .collect();
    assert_eq!(tag_requests.len(), 1, "{tag_requests:?}");

    // Each referrer's manifest is pulled through larder by digest, and
    // with the origin gone the referrers are served from the cache.
    let signature_digest = signature["digest"].as_str().unwrap();
    let resp = http::client()
        .get(format!("{}/v2/team/app/manifests/{signature_digest}", larder.url()))
        .header("accept", OCI_MANIFEST)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    drop(origin);
    larder.restart().await;
    let resp = http::client().get(referrers(&image.digest, "")).send().await.unwrap();
    assert_eq!(resp.status(), 200, "served from the cached fallback tag with the origin gone");
    let index: serde_json::Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!(index["manifests"], serde_json::json!([signature, sbom]));
}

#[tokio::test(flavor = "multi_thread")]
async fn referrers_from_an_upstream_with_the_api_are_relayed_as_it_answered() {
    use fake::recorder::Recorder;
    let subject = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [{
            "mediaType": OCI_MANIFEST,
            "artifactType": SBOM,
            "digest": "sha256:2222222222222222222222222222222222222222222222222222222222222222",
            "size": 812,
            "annotations": { "org.opencontainers.image.created": "2026-12-03T00:00:00Z" },
        }],
        "annotations": { "org.example.page": "1" },
    });
    let body = serde_json::to_vec(&index).unwrap();
    // A registry with the referrers API, filtering by itself.
    let upstream = Recorder::routed("127.0.0.1:0".parse().unwrap(), move |line| {
        let mut resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: {OCI_INDEX}\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        if line.contains("artifactType=") {
            resp.push_str("OCI-Filters-Applied: artifactType\r\n");
        }
        let mut resp = format!("{resp}\r\n").into_bytes();
        resp.extend_from_slice(&body);
        resp
    })
    .await;
    let larder = Larder::builder()
        .upstream(Upstream::new("api.test", &format!("http://{}", upstream.addr())).default(true))
        .start()
        .await;

    let resp = http::client().get(format!("{}/v2/team/app/referrers/{subject}", larder.url())).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let relayed: serde_json::Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!(relayed, index, "larder relays the referrers upstream answered");
    let filtered = format!("{}/v2/team/app/referrers/{subject}?artifactType=application%2Fspdx%2Bjson", larder.url());
    let resp = http::client().get(filtered).send().await.unwrap();
    assert_eq!(resp.headers()["oci-filters-applied"], "artifactType", "upstream's filter, said so");
    let heads = upstream.heads();
    assert!(
        heads.iter().any(|h| h.contains("artifactType=application%2Fspdx%2Bjson")),
        "the filter forwarded: {heads:?}"
    );
    assert!(!heads.iter().any(|h| h.contains("sha256-")), "no fallback tag asked of a registry with the API");
}

#[tokio::test(flavor = "multi_thread")]
async fn prefetch_with_referrers_keeps_signatures_and_sboms_served_with_the_origin_gone() {
    let origin = Origin::start().await;
    let (image, signature, sbom) = signed_image(&origin).await;
    let subject = origin.fetch_manifest("team/app", &image.digest).await;
    // cosign's own scheme: the signature under the `sha256-<hex>.sig` tag.
    let cosign_tag = format!("{}.sig", image.digest.replace(':', "-"));
    let cosign_type = "application/vnd.dev.cosign.artifact.sig.v1+json";
    let cosign = origin.push_referrer("team/app", &image.digest, subject.body.len(), cosign_type).await;
    let cosign_manifest = origin.fetch_manifest("team/app", cosign["digest"].as_str().unwrap()).await;
    origin.push_manifest("team/app", &cosign_tag, OCI_MANIFEST, &cosign_manifest.body).await;
    let (builder, admin) = common::Admin::open(Larder::builder().upstream(&origin));
    let mut larder = builder.start().await;

    let config = larder.config_path().display().to_string();
    let out = admin.command(&["prefetch", "--referrers", "team/app:v1", "--config", &config]).output().unwrap();
    let stdout = common::admin::stdout(&out);
    assert!(out.status.success(), "{stdout}{}", common::admin::stderr(&out));
    assert!(stdout.contains("with 3 referrers"), "two from the fallback tag, one from cosign's tag: {stdout}");
    drop(origin);
    larder.restart().await;

    let base = larder.url();
    let resp = http::client().get(format!("{base}/v2/team/app/referrers/{}", image.digest)).send().await.unwrap();
    assert_eq!(resp.status(), 200, "the referrers, with the origin gone");
    let index: serde_json::Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!(index["manifests"], serde_json::json!([signature, sbom]));
    for referrer in [&signature, &sbom, &cosign] {
        let digest = referrer["digest"].as_str().unwrap();
        let resp = http::client()
            .get(format!("{base}/v2/team/app/manifests/{digest}"))
            .header("accept", OCI_MANIFEST)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "referrer {digest}");
        let manifest: serde_json::Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
        let layer = manifest["layers"][0]["digest"].as_str().unwrap();
        let resp = http::client().get(format!("{base}/v2/team/app/blobs/{layer}")).send().await.unwrap();
        assert_eq!(resp.status(), 200, "its payload {layer}");
    }
    let resp = http::client()
        .get(format!("{base}/v2/team/app/manifests/{cosign_tag}"))
        .header("accept", OCI_MANIFEST)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "cosign's signature tag, with the origin gone");
}

/// `team/app:v1` with a signature and an SBOM, kept the way a client keeps
/// them on a registry without the referrers API (distribution 2.8): an
/// index under the `sha256-<hex>` tag. The image, and the two descriptors.
async fn signed_image(origin: &Origin) -> (common::PushedImage, serde_json::Value, serde_json::Value) {
    let image = ImageBuilder::oci().layers(&[4 * KIB]).push(origin, "team/app", "v1").await;
    let subject = origin.fetch_manifest("team/app", &image.digest).await;
    let signature = origin.push_referrer("team/app", &image.digest, subject.body.len(), SIGNATURE).await;
    let sbom = origin.push_referrer("team/app", &image.digest, subject.body.len(), SBOM).await;
    let fallback = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [signature, sbom],
    }))
    .unwrap();
    origin.push_manifest("team/app", &image.digest.replace(':', "-"), OCI_INDEX, &fallback).await;
    (image, signature, sbom)
}
