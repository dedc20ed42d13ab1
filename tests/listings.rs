//! Listings through larder against the real origin: `tags/list` forwarded
//! with its pagination parameters, cached for the tag TTL, and served stale
//! when the origin is gone; `referrers` from a registry without the API is
//! an empty index.

mod common;

use common::{ImageBuilder, KIB, Larder, ORIGIN_NAME, Origin, http};

async fn get(url: &str) -> (u16, Option<String>, serde_json::Value) {
    let resp = http::client().get(url).send().await.expect("larder answers");
    let status = resp.status().as_u16();
    let link = resp.headers().get("link").map(|l| l.to_str().expect("ascii link").to_owned());
    let body = resp.bytes().await.expect("body");
    (status, link, serde_json::from_slice(&body).expect("JSON body"))
}

#[tokio::test(flavor = "multi_thread")]
async fn tag_lists_are_forwarded_cached_and_served_stale() {
    let origin = Origin::start().await;
    for tag in ["v1", "v2", "v3"] {
        ImageBuilder::oci().layers(&[4 * KIB]).push(&origin, "team/app", tag).await;
    }
    let larder = Larder::builder().upstream(&origin).tag_ttl("1s").start().await;

    // Through the path prefix, with the pagination parameter forwarded.
    // (distribution 2.8 ignores `n` and answers every tag; the rewriting of
    // upstream's next-page Link to the client's path is unit-tested.)
    let mark = origin.log_mark().await;
    let first = format!("{}/v2/{ORIGIN_NAME}/team/app/tags/list?n=2", larder.url());
    let (status, _, body) = get(&first).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["tags"], serde_json::json!(["v1", "v2", "v3"]));
    let asked = origin.requests_since(&mark).await;
    let targets: Vec<&str> = asked.under("/v2/team/app/tags/list").iter().map(|e| e.target.as_str()).collect();
    assert_eq!(targets, ["/v2/team/app/tags/list?n=2"]);

    // Within the TTL, asking again does not reach the origin.
    let mark = origin.log_mark().await;
    get(&first).await;
    assert!(origin.requests_since(&mark).await.under("/v2/team/app/tags/list").is_empty());

    // Origin gone and TTL over: the last page is served stale, not an error.
    drop(origin);
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    let (status, _, body) = get(&first).await;
    assert_eq!((status, &body["tags"]), (200, &serde_json::json!(["v1", "v2", "v3"])));
}

#[tokio::test(flavor = "multi_thread")]
async fn referrers_from_an_upstream_without_the_api_are_an_empty_index() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[4 * KIB]).push(&origin, "team/app", "v1").await;
    let larder = Larder::builder().upstream(&origin).start().await;

    let url = format!("{}/v2/team/app/referrers/{}?artifactType=application%2Fspdx%2Bjson", larder.url(), image.digest);
    let resp = http::client().get(&url).send().await.expect("larder answers");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/vnd.oci.image.index.v1+json");
    let body: serde_json::Value = serde_json::from_slice(&resp.bytes().await.expect("body")).expect("JSON");
    assert_eq!(body["manifests"], serde_json::json!([]));
    assert_eq!(body["schemaVersion"], 2);

    // distribution 2.8 has no referrers API: it was asked, and answered 404.
    let asked = origin.access_log();
    let referrers: Vec<_> = asked.under("/v2/team/app/referrers/").into_iter().map(|e| e.status).collect();
    assert_eq!(referrers, [404]);
}
