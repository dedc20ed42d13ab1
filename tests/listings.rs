//! Listings through larder: `tags/list` forwarded with its pagination
//! parameters, sorted and paginated by larder when upstream ignores them
//! (the real origin, distribution 2.8, does), relayed when upstream
//! paginates itself, each page cached for the tag TTL under its own query
//! and served stale when upstream is gone; `referrers` from a registry
//! without the API is the 404 upstream answered, so clients use the
//! `sha256-<hex>` fallback tag.

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

#[tokio::test(flavor = "multi_thread")]
async fn referrers_from_an_upstream_without_the_api_are_404_so_clients_use_the_fallback_tag() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[4 * KIB]).push(&origin, "team/app", "v1").await;
    // A signature stored the pre-referrers way: under the `sha256-<hex>` tag.
    let fallback_tag = image.digest.replace(':', "-");
    let signature = ImageBuilder::oci().layers(&[KIB]).push(&origin, "team/app", &fallback_tag).await;
    let larder = Larder::builder().upstream(&origin).start().await;

    let url = format!("{}/v2/team/app/referrers/{}?artifactType=application%2Fspdx%2Bjson", larder.url(), image.digest);
    for _ in 0..2 {
        let resp = http::client().get(&url).send().await.expect("larder answers");
        assert_eq!(resp.status(), 404, "not an empty 200, which would say \"no referrers\"");
        let body: serde_json::Value = serde_json::from_slice(&resp.bytes().await.expect("body")).expect("JSON");
        assert!(body["errors"][0]["code"].is_string(), "the OCI error envelope: {body}");
    }
    // distribution 2.8 has no referrers API: it was asked once (the 404 is
    // cached for the tag TTL), and answered 404.
    let asked = origin.access_log();
    let referrers: Vec<_> = asked.under("/v2/team/app/referrers/").into_iter().map(|e| e.status).collect();
    assert_eq!(referrers, [404]);

    // The fallback tag is served like any tag.
    let resp = http::client()
        .get(format!("{}/v2/team/app/manifests/{fallback_tag}", larder.url()))
        .header("accept", "application/vnd.oci.image.manifest.v1+json")
        .send()
        .await
        .expect("larder answers");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["docker-content-digest"], signature.digest.as_str());
}
