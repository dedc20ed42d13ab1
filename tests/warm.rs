//! Keep-warm and pinned images, with the real distribution origin and
//! skopeo: a warm tag is fetched before anyone asks, again when it moves at
//! the origin (the next pull asks the origin for no blob), its current and
//! previous digests survive eviction by other images, and it still pulls
//! with the origin gone. A warm file is re-read when it changes, its bad
//! lines skipped (quoted whole); a warm tag deleted at the origin is
//! counted as `missing_upstream` and still served, one that never existed
//! as `not_found`, each warned about once. Clients go first: a warm download
//! that stalls never holds a client back. Per-upstream `max_size`: an
//! upstream over its share evicts only its own content; one over it because
//! a shared base layer moved to it evicts neither another upstream's images
//! on that base nor its own pinned image.

mod common;
mod fake;

use std::time::{Duration, Instant};

use common::metrics::{metric, wait_for_commits};
use common::{Admin, ImageBuilder, KIB, Larder, Origin, PushedImage, Upstream, http, skopeo};
use fake::FakeUpstream;
use serde_json::Value;

const TOKEN: &str = "warm-test-admin-token-0123456789";
/// Longest a test waits for the warm loop or eviction to get somewhere.
const PATIENCE: Duration = Duration::from_secs(60);
const WARM_INTERVAL: &str = r#"warm_interval = "1s""#;

const READY: &str = r#"larder_warm_images{state="ready"}"#;
const FAILED: &str = r#"larder_warm_images{state="failed"}"#;
const MISSING: &str = r#"larder_warm_images{state="missing_upstream"}"#;
const NOT_FOUND: &str = r#"larder_warm_images{state="not_found"}"#;
const EVICTED_BLOBS: &str = r#"larder_cache_evictions_total{kind="blob"}"#;

#[tokio::test]
async fn a_warm_tag_is_cached_before_anyone_asks_survives_eviction_and_pulls_with_the_origin_gone() {
    let origin = Origin::start().await;
    let v1 = ImageBuilder::oci().layers(&[512 * KIB, 256 * KIB]).push(&origin, "team/base", "stable").await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let larder = builder
        .max_size("4MiB")
        // The other images' 1.5 MiB layers, above the default 1 MiB.
        .cache_line(r#"max_blob_size = "2MiB""#)
        .tag_ttl("1s")
        .cache_line(WARM_INTERVAL)
        .append_toml("[[warm]]\nimage = \"origin.test/team/base:stable\"")
        .start()
        .await;

    // Nobody pulled: the warm loop fetched it.
    wait_until("v1 is cached and ready", || async { all_cached(&larder, &v1) && metric(&larder, READY).await == 1.0 })
        .await;

    // The tag moves at the origin: the new blobs arrive before anyone asks.
    let v2 = ImageBuilder::oci().layers(&[512 * KIB, 256 * KIB]).push(&origin, "team/base", "stable").await;
    assert_ne!(v1.digest, v2.digest);
    wait_until("v2 is cached", || async { all_cached(&larder, &v2) }).await;
    wait_for_commits(&larder).await;
    let mark = origin.log_mark().await;
    let pulled = skopeo::pull(&larder.image_ref("team/base:stable"), false).await.expect("pull of the moved tag");
    assert_eq!(pulled.manifest_digest, v2.digest);
    assert_eq!(pulled.blob_digests(), v2.blob_digests());
    let asked = origin.requests_since(&mark).await;
    assert_eq!(asked.blob_gets(), 0, "the warm loop had fetched every blob:\n{asked}");

    // /status and `larder status` show it, with the digest it was before.
    wait_until("v2 is ready", || async { metric(&larder, READY).await == 1.0 }).await;
    let report = status(&admin).await;
    let warm = &report["warm"]["images"][0];
    assert_eq!(warm["state"], "ready", "{warm}");
    assert_eq!(warm["digest"], v2.digest.as_str(), "{warm}");
    assert_eq!(warm["previous_digest"], v1.digest.as_str(), "{warm}");
    assert!(warm["bytes_total"].as_u64().unwrap() > 768 * KIB as u64, "{warm}");
    assert_eq!(warm["bytes_cached"], warm["bytes_total"], "{warm}");
    assert!(warm["last_check_ms"].as_u64().is_some(), "{warm}");
    let out = admin.cli(&["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let line = text.lines().find(|l| l.contains("origin.test/team/base:stable")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("ready") && line.contains("pinned") && line.contains("checked"), "{line}");
    let page = page(&admin).await;
    let row =
        page.split("<tr>").find(|r| r.contains("origin.test/team/base:stable")).unwrap_or_else(|| panic!("{page}"));
    let short = &v2.digest[..19];
    assert!(row.contains(">ready<") && row.contains(short) && row.contains(">yes<"), "status page row: {row}");

    // Other images fill the cache past max_size: only they are evicted.
    let mut others = Vec::new();
    for n in 0..4 {
        let image = ImageBuilder::oci().layers(&[1536 * KIB]).push(&origin, "team/other", &format!("v{n}")).await;
        skopeo::pull(&larder.image_ref(&image.reference()), false).await.expect("pull of another image");
        wait_for_commits(&larder).await;
        others.push(image);
    }
    wait_until("eviction ran", || async { metric(&larder, EVICTED_BLOBS).await >= 1.0 }).await;
    wait_until("usage is under the high watermark", || async {
        metric(&larder, "larder_cache_size_bytes").await <= (4u64 << 20) as f64 * 0.95
    })
    .await;
    assert!(!all_cached(&larder, &others[0]), "the least recently used other image was evicted");
    for (image, what) in [(&v2, "current"), (&v1, "previous")] {
        for d in image.blob_digests() {
            assert!(larder.blob_file(&d).exists(), "the {what} digest's blob {d} is pinned, never evicted");
        }
    }
    assert!(metric(&larder, "larder_cache_pinned_bytes").await >= (1536 * KIB) as f64);
    assert_eq!(metric(&larder, "larder_cache_pinned_over_limit").await, 0.0);

    // The origin goes away: the pinned image still pulls, by tag and the
    // previous one by digest, and the warm image is reported failed.
    drop(origin);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let pulled = skopeo::pull(&larder.image_ref("team/base:stable"), false).await.expect("pull with the origin gone");
    assert_eq!(pulled.manifest_digest, v2.digest);
    assert_eq!(pulled.blob_digests(), v2.blob_digests());
    let pulled = skopeo::pull(&larder.image_ref(&v1.by_digest()), false).await.expect("previous digest");
    assert_eq!(pulled.blob_digests(), v1.blob_digests());
    wait_until("the warm image is failed", || async { metric(&larder, FAILED).await == 1.0 }).await;
    assert_eq!(metric(&larder, READY).await, 0.0);
}

#[tokio::test]
async fn a_warm_file_is_reread_its_bad_lines_skipped_and_a_tag_deleted_upstream_is_missing_but_served() {
    let origin = Origin::start().await;
    let base = ImageBuilder::oci().layers(&[128 * KIB]).push(&origin, "team/base", "1").await;
    let tools = ImageBuilder::oci().layers(&[128 * KIB]).push(&origin, "team/tools", "1").await;
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("warm.txt");
    std::fs::write(&file, "# base images\norigin.test/team/base:1\nquay.io/not/configured:1\n").unwrap();
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let larder = builder
        .tag_ttl("1s")
        .cache_line(WARM_INTERVAL)
        .cache_line(&format!("warm_file = {:?}", file.display().to_string()))
        .start()
        .await;

    wait_until("team/base is ready", || async { all_cached(&larder, &base) && metric(&larder, READY).await == 1.0 })
        .await;
    let report = status(&admin).await;
    let bad = &report["warm"]["file"]["bad_lines"];
    assert_eq!(bad[0]["line"], 3, "{report}");
    assert!(bad[0]["message"].as_str().unwrap().contains("quay.io"), "{report}");
    assert!(larder.log().contains("line=3"), "the bad line is logged with its number");

    // The file changes (a ConfigMap rewritten): the new image is fetched; a
    // line that is no image is quoted whole; a tag that never existed
    // upstream (a typo) is `not_found`, told from one that is gone.
    std::fs::write(
        &file,
        "origin.test/team/base:1\norigin.test/team/tools:1 pin=false\norigin.test/team/toosl:1\nthis is not an image\n",
    )
    .unwrap();
    wait_until("team/tools is ready", || async { all_cached(&larder, &tools) && metric(&larder, READY).await == 2.0 })
        .await;
    wait_until("team/toosl is not found", || async { metric(&larder, NOT_FOUND).await == 1.0 }).await;
    let report = status(&admin).await;
    let bad = &report["warm"]["file"]["bad_lines"];
    assert_eq!(bad[0]["line"], 4, "{report}");
    assert_eq!(
        bad[0]["message"],
        "\"this is not an image\": \"is\" is not understood: a line is an image, then only `platforms=os/arch,…`, \
         `pin=true|false` and `referrers=true|false`",
        "{report}"
    );
    let typo = warm_image(&report, "origin.test/team/toosl:1");
    assert_eq!(typo["state"], "not_found", "{typo}");
    assert_eq!(
        typo["message"],
        "not found upstream (404), and never was since it was listed: check the name in the warm file (upstream \
         \"origin.test\", repository team/toosl); nothing of it is cached",
        "{typo}"
    );

    // The warm tag is deleted at the origin: counted, said since when and
    // what it was, and still served.
    let url = format!("{}/v2/team/base/manifests/{}", origin.url(), base.digest);
    let deleted = http::client().delete(&url).send().await.expect("DELETE at the origin");
    assert_eq!(deleted.status(), 202, "distribution deleted the manifest");
    wait_until("team/base is missing upstream", || async { metric(&larder, MISSING).await == 1.0 }).await;
    let warm = warm_image(&status(&admin).await, "origin.test/team/base:1");
    assert_eq!(warm["state"], "missing_upstream", "{warm}");
    let message = warm["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("gone upstream (404) since 20"), "{warm}");
    assert!(
        message.ends_with(&format!(
            "; it was {}: what is cached is still served, as far as stale_if_error allows",
            base.digest
        )),
        "{warm}"
    );
    let pulled = skopeo::pull(&larder.image_ref("team/base:1"), false).await.expect("the deleted warm tag still pulls");
    assert_eq!(pulled.manifest_digest, base.digest);

    // Checked every second, each is warned about once, when its state
    // changed, not at every check.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let log = larder.log();
    for image in ["origin.test/team/toosl:1", "origin.test/team/base:1"] {
        let warnings =
            log.lines().filter(|l| l.contains("warm image not ready") && l.contains(&format!("\"{image}\""))).count();
        assert_eq!(warnings, 1, "{image}: one warning, at the change:\n{log}");
    }
}

/// The warm image listed as `image` in a `/status` answer.
fn warm_image(report: &Value, image: &str) -> Value {
    let images = report["warm"]["images"].as_array().cloned().unwrap_or_default();
    images.into_iter().find(|i| i["image"] == image).unwrap_or_else(|| panic!("{image} in {report}"))
}

#[tokio::test]
async fn only_the_chosen_platforms_of_a_warm_index_are_fetched() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().multi_arch().layers(&[64 * KIB, 32 * KIB]).push(&origin, "team/multi", "1").await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let larder = builder
        .cache_line(WARM_INTERVAL)
        .append_toml("[[warm]]\nimage = \"origin.test/team/multi:1\"\nplatforms = [\"linux/arm64\"]")
        .start()
        .await;
    wait_until("ready", || async { metric(&larder, READY).await == 1.0 }).await;
    let blobs = |m: &common::PushedManifest| {
        std::iter::once(&m.config).chain(&m.layers).map(|b| b.digest.clone()).collect::<Vec<_>>()
    };
    let (arm, amd): (Vec<_>, Vec<_>) =
        image.manifests.iter().partition(|m| m.platform.as_deref() == Some("linux/arm64"));
    assert_eq!((arm.len(), amd.len()), (1, 1), "{:?}", image.manifests);
    for d in blobs(arm[0]) {
        assert!(larder.blob_file(&d).exists(), "arm64 blob {d} is cached");
    }
    for d in blobs(amd[0]) {
        assert!(!larder.blob_file(&d).exists(), "amd64 blob {d} was not chosen");
    }
    let warm = status(&admin).await["warm"]["images"][0].clone();
    let arm_bytes: u64 = std::iter::once(&arm[0].config).chain(&arm[0].layers).map(|b| b.size).sum();
    assert_eq!(warm["bytes_total"], arm_bytes, "{warm}");
    assert_eq!(warm["bytes_cached"], arm_bytes, "{warm}");
    assert_eq!(warm["platforms"], serde_json::json!(["linux/arm64"]), "{warm}");
}

#[tokio::test]
async fn pinned_content_over_max_size_is_reported_at_start_on_status_and_in_a_metric_and_kept() {
    const OVER: &str = "above the cache's high watermark";
    let origin = Origin::start().await;
    // Six 200 KiB layers (each under max_size / 4, so each is cached):
    // 1.2 MiB pinned in a 1 MiB cache.
    let big = ImageBuilder::oci().layers(&[200 * KIB; 6]).push(&origin, "team/big", "1").await;
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let mut larder = builder
        .max_size("1MiB")
        .cache_line(WARM_INTERVAL)
        .append_toml("[[warm]]\nimage = \"origin.test/team/big:1\"")
        .start()
        .await;

    wait_until("the pinned image is cached and reported over the limit", || async {
        all_cached(&larder, &big) && metric(&larder, "larder_cache_pinned_over_limit").await == 1.0
    })
    .await;
    let over = status(&admin).await["cache"]["pinned"]["over_limit"].clone();
    assert!(over[0].as_str().is_some_and(|s| s.contains(OVER)), "/status: {over}");
    assert!(larder.log().contains(OVER), "logged");
    let out = admin.cli(&["status"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains(OVER), "larder status says so too");

    // Restarted with the origin gone: said again at start, from the index
    // alone, and nothing pinned was evicted.
    drop(origin);
    let said = larder.log().matches(OVER).count();
    larder.restart().await;
    wait_until("said again at start", || async { larder.log().matches(OVER).count() > said }).await;
    assert_eq!(metric(&larder, "larder_cache_pinned_over_limit").await, 1.0);
    assert!(all_cached(&larder, &big), "pinned content stays, over the limit or not");
}

#[tokio::test]
async fn a_stalled_warm_download_never_holds_back_a_clients_fill_and_warm_work_stays_bounded() {
    // A warm image of four layers that the upstream stalls after 1 KiB, and
    // an upstream that allows clients one open request at a time.
    let layers: Vec<_> = (0..4).map(|n| fake::random_bytes(256 * KIB, 10 + n)).collect();
    let config = fake::random_bytes(512, 9);
    let descriptors: Vec<(String, usize)> = layers.iter().map(|l| (fake::digest(l), l.len())).collect();
    let descriptors: Vec<(&str, usize)> = descriptors.iter().map(|(d, n)| (d.as_str(), *n)).collect();
    let manifest = fake::image_manifest((&fake::digest(&config), config.len()), &descriptors);
    let wanted = fake::random_bytes(512 * KIB, 20);
    let mut builder = FakeUpstream::builder()
        .manifest(fake::REPO, "warm", fake::OCI_MANIFEST, manifest)
        .blob(config)
        .blob(wanted.clone());
    for layer in &layers {
        builder = builder.blob(layer.clone());
    }
    let up = builder.start().await;
    for layer in &layers {
        up.set_faults(&fake::digest(layer), fake::Faults { stall_after: Some(KIB), ..Default::default() });
    }
    let upstream = Upstream::new(fake::UPSTREAM_NAME, &up.url()).default(true).line("max_concurrency = 1");
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(upstream), TOKEN);
    let larder =
        builder.cache_line(WARM_INTERVAL).append_toml("[[warm]]\nimage = \"fake.test/test/app:warm\"").start().await;

    // The warm loop is stuck on two layers at once, never more.
    wait_until("two warm layers are downloading", || async {
        layers.iter().filter(|l| up.bytes_sent(&fake::digest(l)) > 0).count() == 2
    })
    .await;
    assert_eq!(status(&admin).await["warm"]["images"][0]["state"], "fetching");

    // A client's blob: its own permit, not one the stalled downloads hold.
    let addr = ([127, 0, 0, 1], larder.port()).into();
    let got = tokio::time::timeout(PATIENCE, fake::client::get(addr, &fake::blob_path(&fake::digest(&wanted))))
        .await
        .expect("the client's fill waited for the warm loop");
    assert_eq!(got.status(), 200);
    assert_eq!(got.body, wanted.to_vec());

    // Released, the warm image completes, each layer fetched once, and the
    // upstream never saw more than the warm loop's two requests plus the
    // client's one.
    for layer in &layers {
        up.release(&fake::digest(layer));
    }
    wait_until("the warm image is ready", || async { metric(&larder, READY).await == 1.0 }).await;
    for layer in &layers {
        assert_eq!(up.blob_gets(&fake::digest(layer)), 1);
    }
    assert!(up.max_open_requests() <= 3, "{} requests open at once", up.max_open_requests());
}

#[tokio::test]
async fn an_upstream_over_its_own_max_size_evicts_only_its_own_content() {
    let hub = Origin::start().await;
    let other = Origin::start().await;
    let kept = ImageBuilder::oci().layers(&[1024 * KIB]).push(&other, "team/kept", "1").await;
    let mut images = Vec::new();
    for n in 0..4 {
        images.push(ImageBuilder::oci().layers(&[768 * KIB]).push(&hub, "team/app", &format!("v{n}")).await);
    }
    let (builder, admin) = Admin::with_token(
        Larder::builder()
            .upstream(Upstream::from(&hub).line(r#"max_size = "2MiB""#))
            .upstream(Upstream::new("other.test", &other.url())),
        TOKEN,
    );
    let larder = builder.start().await;

    // The other upstream's image is the least recently used in the cache.
    skopeo::pull(&larder.prefixed_ref("other.test", &kept.reference()), false).await.expect("pull from other.test");
    wait_for_commits(&larder).await;
    for image in &images {
        skopeo::pull(&larder.image_ref(&image.reference()), false).await.expect("pull from origin.test");
        wait_for_commits(&larder).await;
    }
    let hub_size = r#"larder_upstream_cache_size_bytes{upstream="origin.test"}"#;
    wait_until("origin.test is under its high watermark", || async {
        metric(&larder, hub_size).await <= (2u64 << 20) as f64 * 0.95
    })
    .await;
    assert!(metric(&larder, EVICTED_BLOBS).await >= 1.0);
    assert!(all_cached(&larder, &kept), "other.test's content is untouched");
    assert!(!all_cached(&larder, &images[0]), "origin.test's least recently used image went");
    assert!(all_cached(&larder, &images[3]), "its newest stays");
    let other_size = metric(&larder, r#"larder_upstream_cache_size_bytes{upstream="other.test"}"#).await;
    assert!(other_size >= (1024 * KIB) as f64, "{other_size}");
    assert_eq!(metric(&larder, r#"larder_upstream_cache_max_size_bytes{upstream="origin.test"}"#).await, 2097152.0);

    let report = status(&admin).await;
    let upstreams = report["upstreams"].as_array().unwrap();
    let hub_status = upstreams.iter().find(|u| u["name"] == "origin.test").unwrap();
    assert_eq!(hub_status["max_size_bytes"], 2097152, "{hub_status}");
    assert!(hub_status["cache_bytes"].as_u64().unwrap() <= 2 << 20, "{hub_status}");
    let other_status = upstreams.iter().find(|u| u["name"] == "other.test").unwrap();
    assert_eq!(other_status["max_size_bytes"], Value::Null, "{other_status}");
    assert!(other_status["cache_bytes"].as_u64().unwrap() >= 1024 * KIB as u64, "{other_status}");
    let page = page(&admin).await;
    let row = page.split("<tr>").find(|r| r.contains("<b>origin.test</b>")).unwrap_or_else(|| panic!("{page}"));
    assert!(row.contains(" of 2.0 MiB<"), "the status page shows origin.test's usage of its max_size: {row}");
}

#[tokio::test]
async fn a_shared_layer_is_charged_to_the_upstream_that_uses_it_and_pinned_content_to_the_one_pinning_it() {
    // Two upstreams (two teams' names for one registry) whose images share
    // a 512 KiB base layer.
    let origin = Origin::start().await;
    let base = common::push::random(512 * KIB);
    common::push::image(&origin, "team/a", "1", vec![base.clone(), common::push::random(16 * KIB)]).await;
    common::push::image(&origin, "team/b", "1", vec![base.clone(), common::push::random(16 * KIB)]).await;
    let (builder, admin) = Admin::with_token(
        Larder::builder().upstream(&origin).upstream(Upstream::new("mirror.test", &origin.url())),
        TOKEN,
    );
    let mut larder = builder.start().await;
    let charged = |report: &Value, name: &str| {
        let upstreams = report["upstreams"].as_array().unwrap();
        upstreams.iter().find(|u| u["name"] == name).unwrap()["cache_bytes"].as_u64().unwrap()
    };
    let shared = 512 * KIB as u64;

    skopeo::pull(&larder.image_ref("team/a:1"), false).await.expect("pull through origin.test");
    wait_for_commits(&larder).await;
    // mirror.test pulls an image on the same base: its use is the most recent.
    skopeo::pull(&larder.prefixed_ref("mirror.test", "team/b:1"), false).await.expect("pull through mirror.test");
    wait_for_commits(&larder).await;
    larder.restart().await; // uses are written at shutdown (and every 10 s)
    let report = status(&admin).await;
    let (hub, mirror) = (charged(&report, "origin.test"), charged(&report, "mirror.test"));
    assert!(mirror > shared && hub < shared, "the base layer moved to mirror.test: {hub} / {mirror}");
    assert_eq!(hub + mirror, report["cache"]["size_bytes"].as_u64().unwrap(), "the charges add up to the usage");

    // mirror.test keeps team/b warm: pinned, charged to and reported by
    // mirror.test, however much origin.test uses the base layer.
    larder.edit_config(|toml| format!("{toml}\n[[warm]]\nimage = \"mirror.test/team/b:1\"\n"));
    larder.restart().await;
    wait_until("team/b is ready", || async { metric(&larder, READY).await == 1.0 }).await;
    skopeo::pull(&larder.image_ref("team/a:1"), false).await.expect("pull through origin.test again");
    larder.restart().await;
    wait_until("team/b is ready again", || async { metric(&larder, READY).await == 1.0 }).await;
    let report = status(&admin).await;
    let pinned = &report["cache"]["pinned"];
    let by_upstream = pinned["by_upstream"].as_array().unwrap();
    assert_eq!(by_upstream.len(), 1, "{pinned}");
    assert_eq!(by_upstream[0][0], "mirror.test", "{pinned}");
    assert!(by_upstream[0][1].as_u64().unwrap() > shared, "{pinned}");
    assert!(charged(&report, "mirror.test") > shared, "still mirror.test's: {report}");
}

#[tokio::test]
async fn a_warm_file_line_without_its_newline_is_not_an_image_until_it_ends() {
    let origin = Origin::start().await;
    let base = ImageBuilder::oci().layers(&[64 * KIB]).push(&origin, "team/base", "1").await;
    ImageBuilder::oci().layers(&[64 * KIB]).push(&origin, "team/base", "10").await;
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("warm.txt");
    // Read while `team/base:10` is being written: `team/base:1` is no image.
    std::fs::write(&file, "origin.test/team/base:1\norigin.test/team/base:1").unwrap();
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let larder = builder
        .cache_line(WARM_INTERVAL)
        .cache_line(&format!("warm_file = {:?}", file.display().to_string()))
        .start()
        .await;
    wait_until("team/base:1 is ready", || async { all_cached(&larder, &base) && metric(&larder, READY).await == 1.0 })
        .await;
    let report = status(&admin).await;
    assert_eq!(report["warm"]["images"].as_array().unwrap().len(), 1, "{report}");
    assert_eq!(report["warm"]["file"]["unterminated_line"], 2, "{report}");
    assert_eq!(report["warm"]["file"]["bad_lines"], serde_json::json!([]), "not a bad line either: {report}");

    std::fs::write(&file, "origin.test/team/base:1\norigin.test/team/base:10\n").unwrap();
    wait_until("both are ready", || async { metric(&larder, READY).await == 2.0 }).await;
    let report = status(&admin).await;
    let references: Vec<&str> =
        report["warm"]["images"].as_array().unwrap().iter().map(|i| i["reference"].as_str().unwrap()).collect();
    assert_eq!(references, ["1", "10"], "{report}");
}

#[tokio::test]
async fn a_warm_image_whose_layers_came_through_another_repository_pulls_with_the_origin_gone() {
    // The same image in two repositories: a team's app built on a base
    // image (the common case of shared base layers).
    let origin = Origin::start().await;
    let app = ImageBuilder::oci().layers(&[128 * KIB, 64 * KIB]).push(&origin, "acme/app", "1").await;
    let copy = [
        "copy",
        "--src-tls-verify=false",
        "--dest-tls-verify=false",
        &origin.image_ref("acme/app:1"),
        &origin.image_ref("library/alpine:3.20"),
    ];
    skopeo::run(&copy.map(str::to_owned)).await.expect("copy acme/app:1 to library/alpine:3.20 at the origin");
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let mut larder = builder.cache_line(WARM_INTERVAL).start().await;
    skopeo::pull(&larder.image_ref("acme/app:1"), false).await.expect("pull of acme/app:1");
    wait_for_commits(&larder).await;

    // Then the base image is kept warm: every byte of it is cached already.
    larder.edit_config(|toml| format!("{toml}\n[[warm]]\nimage = \"origin.test/library/alpine:3.20\"\n"));
    larder.restart().await;
    wait_until("library/alpine:3.20 is ready", || async { metric(&larder, READY).await == 1.0 }).await;
    let warm = status(&admin).await["warm"]["images"][0].clone();
    assert_eq!((warm["state"].as_str(), warm["pin"].as_bool()), (Some("ready"), Some(true)), "{warm}");

    // Ready means it pulls with the origin gone.
    drop(origin);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let pulled = skopeo::pull(&larder.image_ref("library/alpine:3.20"), false)
        .await
        .unwrap_or_else(|e| panic!("pull of the warm image with the origin gone: {e}\n{}", larder.log()));
    assert_eq!(pulled.manifest_digest, app.digest);
    assert_eq!(pulled.blob_digests(), app.blob_digests());
}

// ---- helpers ----------------------------------------------------------------

fn all_cached(larder: &Larder, image: &PushedImage) -> bool {
    image.blob_digests().iter().all(|d| larder.blob_file(d).exists())
}

/// `GET /status` on the admin listener, as JSON.
async fn status(admin: &Admin) -> Value {
    let url = format!("{}/status", admin.url());
    let response = http::client().get(&url).bearer_auth(TOKEN).send().await.expect("GET /status");
    assert_eq!(response.status(), 200, "GET /status");
    let body = response.text().await.expect("the /status body");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("/status is not JSON ({e}): {body}"))
}

/// The status page (`GET /` on the admin listener), as HTML.
async fn page(admin: &Admin) -> String {
    let url = format!("{}/", admin.url());
    let response = http::client().get(&url).bearer_auth(TOKEN).send().await.expect("GET /");
    assert_eq!(response.status(), 200, "GET /");
    response.text().await.expect("the status page")
}

/// Polls `check` until it holds, or fails the test after [`PATIENCE`].
async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !check().await {
        assert!(started.elapsed() < PATIENCE, "gave up after {PATIENCE:?} waiting until {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_warm_image_with_referrers_keeps_its_signature_served_with_the_origin_gone() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[16 * KIB]).push(&origin, "team/signed", "1").await;
    let subject = origin.fetch_manifest("team/signed", &image.digest).await;
    let signature = origin
        .push_referrer(
            "team/signed",
            &image.digest,
            subject.body.len(),
            "application/vnd.dev.cosign.simplesigning.v1+json",
        )
        .await;
    // Kept as distribution 2.8 keeps referrers: an index under the fallback tag.
    let fallback = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2, "mediaType": common::image::OCI_INDEX, "manifests": [signature],
    }))
    .unwrap();
    let fallback_tag = image.digest.replace(':', "-");
    origin.push_manifest("team/signed", &fallback_tag, common::image::OCI_INDEX, &fallback).await;
    let signature_digest = signature["digest"].as_str().unwrap().to_owned();
    let signed = origin.fetch_manifest("team/signed", &signature_digest).await;
    let payload: Value = serde_json::from_slice(&signed.body).unwrap();
    let payload = payload["layers"][0]["digest"].as_str().unwrap().to_owned();
    let (builder, _admin) = Admin::with_token(Larder::builder().upstream(&origin), TOKEN);
    let mut larder = builder
        .cache_line(WARM_INTERVAL)
        .append_toml("[[warm]]\nimage = \"origin.test/team/signed:1\"\nreferrers = true")
        .start()
        .await;
    wait_until("the signature's payload is cached", || async { larder.blob_file(&payload).exists() }).await;
    drop(origin);
    larder.restart().await;

    let base = larder.url();
    let resp = http::client().get(format!("{base}/v2/team/signed/referrers/{}", image.digest)).send().await.unwrap();
    assert_eq!(resp.status(), 200, "the referrers, with the origin gone");
    let index: Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!(index["manifests"], serde_json::json!([signature]));
    let resp = http::client()
        .get(format!("{base}/v2/team/signed/manifests/{signature_digest}"))
        .header("accept", common::image::OCI_MANIFEST)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "the signature manifest");
    let resp = http::client().get(format!("{base}/v2/team/signed/blobs/{payload}")).send().await.unwrap();
    assert_eq!(resp.status(), 200, "its payload");
}

#[tokio::test]
async fn a_shared_base_layer_moving_to_a_tight_upstream_evicts_neither_the_others_images_nor_pinned_content() {
    // Two upstreams (two teams' names for one registry), each with a tight
    // max_size; their images share a 768 KiB base layer, and mirror.test
    // keeps team/b:1 warm (pinned).
    let origin = Origin::start().await;
    let base = common::push::random(768 * KIB);
    let own = |n: u64| common::push::random(128 * KIB + n as usize);
    let mut team_a = Vec::new();
    for n in 1..=3 {
        team_a.push(common::push::image(&origin, "team/a", &n.to_string(), vec![base.clone(), own(n)]).await);
    }
    let pinned = common::push::image(&origin, "team/b", "1", vec![base.clone(), own(4)]).await;
    let unpinned = common::push::image(&origin, "team/b", "2", vec![base.clone(), own(5)]).await;
    let cached = |larder: &Larder, image: &common::push::RawImage| {
        std::iter::once(&image.config).chain(&image.layers).all(|b| larder.blob_file(&b.digest).exists())
    };
    let (builder, admin) = Admin::with_token(
        Larder::builder()
            .upstream(Upstream::from(&origin).line(r#"max_size = "2MiB""#))
            .upstream(Upstream::new("mirror.test", &origin.url()).line(r#"max_size = "1MiB""#))
            .append_toml("[[warm]]\nimage = \"mirror.test/team/b:1\""),
        TOKEN,
    );
    let larder = builder.start().await;
    wait_until("team/b:1 is ready", || async { metric(&larder, READY).await == 1.0 }).await;

    // Team A pulls its three images: the base layer's use is A's now.
    for n in 1..=3 {
        skopeo::pull(&larder.image_ref(&format!("team/a:{n}")), false).await.expect("pull through origin.test");
        wait_for_commits(&larder).await;
    }
    // Team B pulls an image on the same base: the base's use is B's, and B
    // (1 MiB) has no room for the base, its pinned image and this one.
    skopeo::pull(&larder.prefixed_ref("mirror.test", "team/b:2"), false).await.expect("pull through mirror.test");
    wait_for_commits(&larder).await;
    // mirror.test is over its max_size: it evicts (its own unpinned blobs).
    wait_until("mirror.test evicted", || async { metric(&larder, EVICTED_BLOBS).await >= 1.0 }).await;
    wait_for_commits(&larder).await;

    for (n, image) in team_a.iter().enumerate() {
        assert!(cached(&larder, image), "team/a:{} (origin.test's, recently pulled) is whole", n + 1);
    }
    assert!(cached(&larder, &pinned), "the pinned team/b:1 is whole");
    assert!(larder.blob_file(&unpinned.layers[0].digest).exists(), "the shared base stays");
    let report = status(&admin).await;
    let upstreams = report["upstreams"].as_array().unwrap();
    let total: u64 = upstreams.iter().map(|u| u["cache_bytes"].as_u64().unwrap()).sum();
    assert_eq!(total, report["cache"]["size_bytes"].as_u64().unwrap(), "the charges add up: {report}");
    let mirror = upstreams.iter().find(|u| u["name"] == "mirror.test").unwrap()["cache_bytes"].as_u64().unwrap();
    assert!(mirror > 768 * KIB as u64, "the base layer is mirror.test's, the most recent user: {report}");
}
