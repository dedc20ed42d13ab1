//! Offline seeding: `larder import` loads an OCI image layout that real
//! skopeo wrote (`oci:DIR`, `oci-archive:FILE`) into the cache, through a
//! running larder's admin listener or into a stopped cache folder, so that
//! the image pulls with its origin gone; a tampered layout is refused whole.
//! `larder export` writes a layout that skopeo reads and copies on to a
//! fresh registry, and that another larder imports by the names it carries.

mod common;

use std::time::Duration;

use common::origin::ORIGIN_NAME;
use common::{Admin, ImageBuilder, KIB, Larder, Origin, PulledImage, PushedImage, skopeo};

const LAYERS: [usize; 2] = [48 * KIB, 200 * KIB];

async fn skopeo_copy(args: &[&str]) {
    let mut all = vec!["copy".to_owned(), "--src-tls-verify=false".to_owned(), "--dest-tls-verify=false".to_owned()];
    all.extend(args.iter().map(|a| a.to_string()));
    skopeo::run(&all).await.unwrap_or_else(|e| panic!("{e}"));
}

fn assert_same_image(pulled: &PulledImage, image: &PushedImage, step: &str) {
    assert_eq!(pulled.manifest_digest, image.digest, "{step}: manifest digest");
    assert_eq!(pulled.blob_digests(), image.blob_digests(), "{step}: blobs");
    assert_eq!(pulled.child_manifest_digests, image.child_manifest_digests(), "{step}: platforms");
}

fn cached_blob_files(larder: &Larder, image: &PushedImage) -> usize {
    image.blob_digests().iter().filter(|d| larder.blob_file(d).exists()).count()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_layout_from_skopeo_imported_while_larder_runs_pulls_with_the_origin_gone() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().multi_arch().layers(&LAYERS).push(&origin, "team/app", "v1").await;
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let source = origin.image_ref("team/app:v1");
    skopeo_copy(&["--all", &source, &format!("oci:{}:v1", layout.display())]).await;
    let (builder, admin) = Admin::open(Larder::builder().upstream(&origin));
    let larder = builder.start().await;
    drop(origin);

    // skopeo names the image by its tag alone: --as says where it goes.
    let out = larder.cli(&["import", &layout.display().to_string(), "--as", &format!("{ORIGIN_NAME}/team/app")]);
    assert!(out.status.success(), "import through the admin listener");
    // Its progress, a line per phase (stdout is not a terminal), and where the image went.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let admin = format!("http://127.0.0.1:{}", admin.port);
    let expected = [
        format!("importing {} through {admin}", layout.display()),
        "import: sending the layout".to_owned(),
        "import: sending the layout done: ".to_owned(),
        "import: larder checks and commits it".to_owned(),
        "import: larder checks and commits it done in ".to_owned(),
        "imported 1 image: 3 manifests, 6 blobs, ".to_owned(),
        format!("  {ORIGIN_NAME}/team/app:v1@{}", image.digest),
    ];
    let mut lines = stdout.lines();
    for line in &expected {
        assert!(lines.any(|l| l.starts_with(line.as_str())), "{line:?} in this order:\n{stdout}");
    }

    let pulled = skopeo::pull(&larder.image_ref("team/app:v1"), true).await.expect("pull with the origin gone");
    assert_same_image(&pulled, &image, "pull by tag after the import");
    let by_digest = skopeo::pull(&larder.image_ref(&image.by_digest()), true).await.expect("pull by digest");
    assert_same_image(&by_digest, &image, "pull by digest after the import");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_archive_imported_into_a_stopped_cache_pulls_after_the_start() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/tool", "2.0").await;
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("tool.tar");
    let source = origin.image_ref("team/tool:2.0");
    skopeo_copy(&[&source, &format!("oci-archive:{}:2.0", archive.display())]).await;
    let (builder, _admin) = Admin::open(Larder::builder().upstream(&origin));
    let mut larder = builder.start().await;
    drop(origin);
    larder.send_sigterm();
    assert!(larder.wait_exit(Duration::from_secs(10)).await.is_some_and(|s| s.success()), "larder stopped");

    let out = larder.cli(&["import", &archive.display().to_string(), "--as", &format!("{ORIGIN_NAME}/team/tool")]);
    assert!(out.status.success(), "import into the stopped cache");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let expected = [
        format!("importing {} into {} (larder is not running)", archive.display(), larder.cache_dir().display()),
        "import: reading and hashing the layout".to_owned(),
        "import: reading and hashing the layout done: ".to_owned(),
        "import: checking 1 image".to_owned(),
        "import: checking 1 image done in ".to_owned(),
        "import: committing 3 blobs and 1 manifest".to_owned(),
        "import: committing 3 blobs and 1 manifest done in ".to_owned(),
        "imported 1 image: 1 manifest, 3 blobs, ".to_owned(),
        format!("  {ORIGIN_NAME}/team/tool:2.0@{}", image.digest),
    ];
    let mut lines = stdout.lines();
    for line in &expected {
        assert!(lines.any(|l| l.starts_with(line.as_str())), "{line:?} in this order:\n{stdout}");
    }
    assert_eq!(cached_blob_files(&larder, &image), image.blob_digests().len(), "every blob is in the cache folder");

    larder.restart().await;
    let pulled = skopeo::pull(&larder.image_ref("team/tool:2.0"), false).await.expect("pull with the origin gone");
    assert_same_image(&pulled, &image, "pull after the offline import");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tampered_layout_is_refused_and_nothing_of_it_is_imported() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&LAYERS).push(&origin, "team/app", "v1").await;
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let source = origin.image_ref("team/app:v1");
    skopeo_copy(&[&source, &format!("oci:{}:v1", layout.display())]).await;
    // One byte of the largest layer changed, its name kept.
    let layer = image.manifests[0].layers.iter().max_by_key(|b| b.size).unwrap();
    let file = layout.join("blobs/sha256").join(layer.digest.trim_start_matches("sha256:"));
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[1000] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();
    let (builder, _admin) = Admin::open(Larder::builder().upstream(&origin));
    let mut larder = builder.start().await;
    drop(origin);

    let as_name = format!("{ORIGIN_NAME}/team/app");
    let out = larder.cli(&["import", &layout.display().to_string(), "--as", &as_name]);
    assert_eq!(out.status.code(), Some(1), "refused through the admin listener");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&layer.digest[7..]), "the refusal names the tampered blob: {stderr}");
    assert_eq!(cached_blob_files(&larder, &image), 0, "not even the good blobs were committed");
    let pull = skopeo::pull(&larder.image_ref("team/app:v1"), false).await;
    assert!(pull.is_err(), "the image is not pullable with the origin gone");

    // The same on a stopped cache folder.
    larder.send_sigterm();
    assert!(larder.wait_exit(Duration::from_secs(10)).await.is_some_and(|s| s.success()), "larder stopped");
    let out = larder.cli(&["import", &layout.display().to_string(), "--as", &as_name]);
    assert_eq!(out.status.code(), Some(1), "refused offline");
    assert_eq!(cached_blob_files(&larder, &image), 0, "nothing committed offline either");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_export_is_a_layout_skopeo_copies_on_and_another_larder_imports_by_name() {
    let origin = Origin::start().await;
    let app = ImageBuilder::oci().multi_arch().layers(&LAYERS).push(&origin, "team/app", "v1").await;
    let tool = ImageBuilder::oci().layers(&[32 * KIB]).push(&origin, "team/tool", "2.0").await;
    let (builder, _admin) = Admin::open(Larder::builder().upstream(&origin));
    let larder = builder.start().await;
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("export");
    let out = larder.cli(&["export", "team/app:v1", "team/tool:2.0", "--output", &layout.display().to_string()]);
    assert!(out.status.success(), "export of two images into one folder");
    assert_eq!(origin.blob_gets(), app.blob_digests().len() + tool.blob_digests().len(), "each blob fetched once");
    // Manifests are counted as manifests, not among the new blobs (an
    // index and its two platforms' manifests; one image manifest).
    let exported = String::from_utf8_lossy(&out.stdout);
    for (image, pushed, manifests) in
        [("team/app:v1", &app, "3 new manifests"), ("team/tool:2.0", &tool, "1 new manifest")]
    {
        let line =
            exported.lines().find(|l| l.starts_with(&format!("exported {image} into "))).expect("an export line");
        let bytes: u64 = pushed.blobs().iter().map(|b| b.size).sum();
        let counts =
            format!("({} new blobs, {}; {manifests})", pushed.blob_digests().len(), common::admin::human_bytes(bytes));
        assert!(line.ends_with(&counts), "{line}: {counts}");
    }

    // skopeo reads it by tag and copies it on, digests unchanged.
    let inspected = skopeo::run(&["inspect".into(), "--raw".into(), format!("oci:{}:v1", layout.display())])
        .await
        .expect("skopeo inspect oci:DIR:v1");
    assert_eq!(common::origin::sha256_digest(&inspected), app.digest, "the layout holds the index as served");
    let fresh = Origin::start().await;
    let dest = fresh.image_ref("copied/app:v1");
    skopeo_copy(&["--all", &format!("oci:{}:v1", layout.display()), &dest]).await;
    assert_eq!(fresh.fetch_manifest("copied/app", "v1").await.digest, app.digest, "copied on byte for byte");

    // Another larder, its origin gone, imports it by the names it carries.
    drop(origin);
    // Port 9 (discard) on loopback: nothing listens, every dial is refused.
    let gone = common::larder::Upstream::new(ORIGIN_NAME, "http://127.0.0.1:9").default(true);
    let (builder, _other_admin) = Admin::open(Larder::builder().upstream(gone));
    let other = builder.start().await;
    let out = other.cli(&["import", &layout.display().to_string()]);
    assert!(out.status.success(), "import without --as: names from io.containerd.image.name");
    let pulled = skopeo::pull(&other.image_ref("team/app:v1"), true).await.expect("pull the app");
    assert_same_image(&pulled, &app, "the exported app");
    let pulled = skopeo::pull(&other.image_ref("team/tool:2.0"), false).await.expect("pull the tool");
    assert_same_image(&pulled, &tool, "the exported tool");
}
