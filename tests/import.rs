//! An import is content like any other (docs/security.md, "Imports"):
//! a layout that only names another tenant's blob gets nothing of it; a
//! small tar describing an enormous graph is refused within bounds; an
//! import interrupted at any point (a client gone mid-upload, larder
//! killed mid-commit) leaves everything or nothing; a cached manifest
//! never changes; `--as` alone decides where images go; an import holds
//! one file open at a time; and `POST /import` refuses what it must
//! before it stores the body. Against the real distribution origin and
//! real skopeo where a client pulls.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::origin::{ORIGIN_NAME, sha256_digest};
use common::{Admin, Credentials, ImageBuilder, KIB, Larder, Origin, Pull, http, skopeo};
use serde_json::{Value, json};

const TOKEN: &str = "an-import-test-token-0123456789";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const OCI_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";
const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Waits (polling every 10 ms) until `done`, at most `within`.
async fn wait_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "gave up waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// An OCI image layout written by hand.
struct Layout {
    dir: PathBuf,
    images: Vec<Value>,
}

impl Layout {
    fn create(dir: &Path) -> Layout {
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        Layout { dir: dir.to_owned(), images: Vec::new() }
    }

    /// Writes `bytes` as a blob; its digest.
    fn blob(&self, bytes: &[u8]) -> String {
        let digest = sha256_digest(bytes);
        std::fs::write(self.dir.join("blobs/sha256").join(&digest[7..]), bytes).unwrap();
        digest
    }

    /// Lists an image in index.json.
    fn image(&mut self, media_type: &str, digest: &str, size: usize, annotations: Value) -> &mut Layout {
        self.images.push(json!({"mediaType": media_type, "digest": digest, "size": size, "annotations": annotations}));
        self.write_index();
        self
    }

    fn write_index(&self) {
        let index = json!({"schemaVersion": 2, "manifests": self.images});
        std::fs::write(self.dir.join("index.json"), index.to_string()).unwrap();
    }

    fn path(&self) -> String {
        self.dir.display().to_string()
    }
}

/// An OCI image manifest naming `config` and `layers` (digest, size).
fn image_manifest(config: (&str, usize), layers: &[(String, usize)]) -> Vec<u8> {
    let layers: Vec<Value> =
        layers.iter().map(|(d, s)| json!({"mediaType": OCI_LAYER, "digest": d, "size": s})).collect();
    json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config.0, "size": config.1},
        "layers": layers,
    })
    .to_string()
    .into_bytes()
}

/// The layout's files as a tar, `oci-layout` and `index.json` first (as
/// the CLI sends them), then its blobs.
fn layout_tar(layout: &Layout) -> Vec<u8> {
    let mut files = vec![
        ("oci-layout".to_owned(), std::fs::read(layout.dir.join("oci-layout")).unwrap()),
        ("index.json".to_owned(), std::fs::read(layout.dir.join("index.json")).unwrap()),
    ];
    for entry in std::fs::read_dir(layout.dir.join("blobs/sha256")).unwrap() {
        let entry = entry.unwrap();
        files.push((
            format!("blobs/sha256/{}", entry.file_name().to_string_lossy()),
            std::fs::read(entry.path()).unwrap(),
        ));
    }
    tar_of(&files)
}

/// A tar of `files` (path, bytes), in that order, as a client would post it.
fn tar_of(files: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut tar = tar::Builder::new(Vec::new());
    for (path, bytes) in files {
        let mut header = tar::Header::new_ustar();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut header, path, bytes.as_slice()).unwrap();
    }
    tar.into_inner().unwrap()
}

/// `blobs/sha256/<hex>` of a digest.
fn blob_path(digest: &str) -> String {
    format!("blobs/sha256/{}", &digest[7..])
}

/// A larder in front of `origin` with its admin listener and [`TOKEN`].
async fn larder_with_admin(
    origin: &Origin,
    edit: impl FnOnce(common::LarderBuilder) -> common::LarderBuilder,
) -> (Larder, Admin) {
    let (builder, admin) = Admin::with_token(edit(Larder::builder().upstream(origin)), TOKEN);
    (builder.start().await, admin)
}

/// `POST /import[?as=…]` with `tar` as the body.
async fn post_import(admin: &Admin, as_name: Option<&str>, tar: Vec<u8>) -> (u16, Value) {
    let query = as_name.map(|a| format!("?as={a}")).unwrap_or_default();
    let resp = http::client()
        .post(format!("{}/import{query}", admin.url()))
        .bearer_auth(TOKEN)
        .body(tar)
        .send()
        .await
        .expect("POST /import");
    let status = resp.status().as_u16();
    let body = resp.bytes().await.expect("the answer");
    (status, serde_json::from_slice(&body).unwrap_or_else(|_| Value::String(text(&body))))
}

/// `/proc/<pid>/status`'s `VmHWM` (peak resident set size), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/<pid>/status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("a VmHWM line");
    let kib: u64 = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmHWM in kB");
    kib * 1024
}

/// `[server] auth = { htpasswd }` with these users (bcrypt cost 4).
fn htpasswd(dir: &Path, users: &[&Credentials]) -> String {
    let path = dir.join("htpasswd");
    let lines: String =
        users.iter().map(|c| format!("{}:{}\n", c.user, bcrypt::hash(&c.password, 4).expect("bcrypt"))).collect();
    std::fs::write(&path, lines).expect("write htpasswd");
    path.display().to_string()
}

async fn get_as(url: &str, who: &Credentials) -> u16 {
    let resp = http::client().get(url).basic_auth(&who.user, Some(&who.password)).send().await.expect("GET");
    resp.status().as_u16()
}

// ---- membership ----------------------------------------------------------------------

/// Issue 32 item 1 as reported: tenant B's private layer is cached; team-a
/// cannot reach it; an operator imports a layout from team-a that holds
/// only a manifest and a config and names B's layer. Before, that import
/// gave team-a/app the layer.
#[tokio::test(flavor = "multi_thread")]
async fn a_layout_that_only_names_another_tenants_cached_blob_gets_nothing_of_it() {
    let origin = Origin::start().await;
    let private = ImageBuilder::oci().layers(&[64 * KIB]).push(&origin, "private/b", "v1").await;
    let layer = private.manifests[0].layers[0].clone();
    let dir = tempfile::tempdir().unwrap();
    let (team_a, team_b) = (Credentials::new("team-a", "a-secret"), Credentials::new("team-b", "b-secret"));
    let htpasswd = htpasswd(dir.path(), &[&team_a, &team_b]);
    let (larder, _admin) = larder_with_admin(&origin, |b| {
        b.append_toml(&format!(
            "[server.auth]\nhtpasswd = {htpasswd:?}\n\
             [[server.auth.grant]]\nwho = [\"team-a\"]\nrepositories = [\"team-a/**\"]\n\
             [[server.auth.grant]]\nwho = [\"team-b\"]\nrepositories = [\"private/**\"]\n"
        ))
        .ready_on_tcp()
    })
    .await;
    Pull::new(&larder.image_ref("private/b:v1")).credentials(&team_b).run().await.expect("team-b pulls its own");
    assert!(larder.blob_file(&layer.digest).exists(), "B's layer is cached");
    let layer_url = format!("{}/v2/team-a/app/blobs/{}", larder.url(), layer.digest);
    assert_eq!(get_as(&format!("{}/v2/private/b/manifests/v1", larder.url()), &team_a).await, 403);
    assert_eq!(get_as(&layer_url, &team_a).await, 404, "team-a/app does not have B's layer");

    // A layout "from team-a": a config and a manifest naming B's layer.
    let mut layout = Layout::create(&dir.path().join("from-team-a"));
    let config = br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
    let config_digest = layout.blob(config);
    let manifest = image_manifest((&config_digest, config.len()), &[(layer.digest.clone(), layer.size as usize)]);
    let manifest_digest = layout.blob(&manifest);
    layout.image(OCI_MANIFEST, &manifest_digest, manifest.len(), json!({REF_NAME: "v1"}));
    let out = larder.cli(&["import", &layout.path(), "--as", &format!("{ORIGIN_NAME}/team-a/app")]);

    assert_eq!(out.status.code(), Some(1), "refused");
    let stderr = text(&out.stderr);
    assert!(stderr.contains(&layer.digest), "the refusal names the blob: {stderr}");
    assert!(stderr.contains("nothing imported"), "{stderr}");
    assert_eq!(get_as(&layer_url, &team_a).await, 404, "team-a still gets nothing of B's layer");
    let pull = Pull::new(&larder.image_ref("team-a/app:v1")).credentials(&team_a).run().await;
    assert!(pull.is_err(), "nothing of the layout was imported: team-a/app:v1 does not pull");
}

/// The other side of the rule: a layout may leave out a blob its image's
/// repository has already, or one upstream confirms that repository has
/// (a base layer the site pulls anyway); it is recorded, not carried.
#[tokio::test(flavor = "multi_thread")]
async fn a_blob_the_layout_lacks_is_imported_when_upstream_or_the_cache_vouches_for_its_repository() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[48 * KIB, 16 * KIB]).push(&origin, "team-a/app", "v1").await;
    let base = image.manifests[0].layers[0].clone();
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let source = origin.image_ref("team-a/app:v1");
    skopeo::run(&["copy".into(), "--src-tls-verify=false".into(), source, format!("oci:{}:v1", layout.display())])
        .await
        .expect("skopeo copy to oci:");
    std::fs::remove_file(layout.join(blob_path(&base.digest))).unwrap();
    let (larder, _admin) = larder_with_admin(&origin, |b| b).await;
    let as_name = format!("{ORIGIN_NAME}/team-a/app");

    let mark = origin.log_mark().await;
    let out = larder.cli(&["import", &layout.display().to_string(), "--as", &as_name]);
    assert!(out.status.success(), "imported: upstream confirms team-a/app has the base layer");
    assert!(text(&out.stdout).contains("(1 blob the layout lacks, which upstream confirmed)"), "{}", text(&out.stdout));
    let asked = origin.requests_since(&mark).await;
    let heads: Vec<_> = asked.entries().iter().filter(|r| r.method == "HEAD").map(|r| r.path().to_owned()).collect();
    assert_eq!(heads, vec![format!("/v2/team-a/app/blobs/{}", base.digest)], "one HEAD, for the missing blob");
    let pulled = skopeo::pull(&larder.image_ref("team-a/app:v1"), false).await.expect("pull");
    assert_eq!(pulled.manifest_digest, image.digest);

    // Now the repository has it: with the origin gone, a layout that
    // still lacks it imports without asking anyone.
    drop(origin);
    let mut index: Value = serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    index["manifests"][0]["annotations"][REF_NAME] = json!("v2");
    std::fs::write(layout.join("index.json"), index.to_string()).unwrap();
    let out = larder.cli(&["import", &layout.display().to_string(), "--as", &as_name]);
    assert!(out.status.success(), "imported with the origin gone: team-a/app holds the base layer already");
    let pulled = skopeo::pull(&larder.image_ref("team-a/app:v2"), false).await.expect("pull v2");
    assert_eq!(pulled.manifest_digest, image.digest);
}

// ---- bounds --------------------------------------------------------------------------

/// Issue 32 item 2 as reported: 30 images of one index manifest that
/// lists one child 40,000 times, a 3.9 MB tar. Before, the walk read the
/// child once per reference per image and kept every copy (1 GB).
#[tokio::test(flavor = "multi_thread")]
async fn a_small_tar_describing_a_huge_graph_is_refused_and_larder_stays_small() {
    let origin = Origin::start().await;
    let (larder, admin) = larder_with_admin(&origin, |b| b).await;
    let config = b"{}".to_vec();
    let config_digest = sha256_digest(&config);
    let child = image_manifest((&config_digest, config.len()), &[]);
    let child_digest = sha256_digest(&child);
    let entry = json!({"digest": child_digest, "size": child.len()});
    let index = json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": vec![entry; 40_000]}).to_string();
    let index_digest = sha256_digest(index.as_bytes());
    let images: Vec<Value> = (0..30)
        .map(|i| json!({"mediaType": OCI_INDEX, "digest": index_digest, "size": index.len(), "annotations": {REF_NAME: format!("t{i}")}}))
        .collect();
    let tar = tar_of(&[
        ("oci-layout".into(), br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()),
        ("index.json".into(), json!({"schemaVersion": 2, "manifests": images}).to_string().into_bytes()),
        (blob_path(&config_digest), config),
        (blob_path(&child_digest), child),
        (blob_path(&index_digest), index.into_bytes()),
    ]);
    assert!(tar.len() < 4_000_000, "a small tar: {} bytes", tar.len());
    let tar_len = tar.len();
    let before = peak_rss(larder.pid());

    let (status, answer) = post_import(&admin, Some(&format!("{ORIGIN_NAME}/team/app")), tar).await;

    assert_eq!(status, 413, "refused past a named limit: {answer}");
    let message = answer["errors"][0]["message"].as_str().unwrap_or_default().to_owned();
    assert!(message.contains("holds 40000 references, over 10000 for one manifest"), "{message}");
    let grown = peak_rss(larder.pid()).saturating_sub(before);
    eprintln!("a {} byte tar: larder's peak RSS {} KiB before, grew by {} KiB", tar_len, before >> 10, grown >> 10);
    assert!(grown < 64 << 20, "larder's peak RSS grew by {} MiB (before: 1 GB)", grown >> 20);
    let base = http::client().get(format!("{}/v2/", larder.url())).send().await.expect("the registry port answers");
    assert_eq!(base.status(), 200);
}

// ---- all or nothing ------------------------------------------------------------------

/// A layout of one image with `layers` layers of 1 KiB each (random): a
/// commit with that many files to put in place. Its manifest digest.
fn many_layers(layout: &mut Layout, layers: usize, tag: &str, seed: u64) -> (String, Vec<String>) {
    let config = format!(r#"{{"architecture":"amd64","os":"linux","seed":{seed}}}"#).into_bytes();
    let config_digest = layout.blob(&config);
    let mut digests = Vec::new();
    for i in 0..layers {
        let mut bytes = common::push::random(KIB);
        bytes[..8].copy_from_slice(&(i as u64 ^ (seed << 32)).to_le_bytes());
        digests.push((layout.blob(&bytes), bytes.len()));
    }
    let manifest = image_manifest((&config_digest, config.len()), &digests);
    let manifest_digest = layout.blob(&manifest);
    layout.image(OCI_MANIFEST, &manifest_digest, manifest.len(), json!({REF_NAME: tag}));
    (manifest_digest, digests.into_iter().map(|(d, _)| d).collect())
}

/// A larder whose only upstream is gone (port 9 on loopback: nothing
/// listens), with its admin listener and [`TOKEN`].
async fn larder_without_origin(edit: impl FnOnce(common::LarderBuilder) -> common::LarderBuilder) -> (Larder, Admin) {
    let gone = common::larder::Upstream::new(ORIGIN_NAME, "http://127.0.0.1:9").default(true);
    let (builder, admin) = Admin::with_token(edit(Larder::builder().upstream(gone)), TOKEN);
    (builder.start().await, admin)
}

/// How many of `team/app:<tag>`'s manifest and `blobs` larder serves.
async fn served(larder: &Larder, tag: &str, blobs: &[String]) -> (bool, usize) {
    let client = http::client();
    let manifest = http::manifest_get(&client, &format!("{}/v2/team/app/manifests/{tag}", larder.url()))
        .send()
        .await
        .expect("GET the manifest")
        .status()
        == 200;
    let mut count = 0;
    for digest in blobs {
        let url = format!("{}/v2/team/app/blobs/{digest}", larder.url());
        if client.head(&url).send().await.expect("HEAD a blob").status() == 200 {
            count += 1;
        }
    }
    (manifest, count)
}

fn files_under(dir: &Path) -> usize {
    let Ok(listing) = std::fs::read_dir(dir) else { return 0 };
    listing.flatten().map(|e| if e.path().is_dir() { files_under(&e.path()) } else { 1 }).sum()
}

/// Issue 32 item 3: larder SIGKILLed while it puts an import's files in
/// place. Before, each blob was committed with its row one at a time, so
/// the restart served part of the image.
#[tokio::test(flavor = "multi_thread")]
async fn larder_killed_while_it_commits_an_import_serves_all_of_it_or_none_after_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut layout = Layout::create(&dir.path().join("layout"));
    let (_, blobs) = many_layers(&mut layout, 1500, "v1", 1);
    let (mut larder, _admin) = larder_without_origin(|b| b).await;
    let committed = larder.cache_dir().join("blobs/sha256");
    let mut import = std::process::Command::new(common::larder::binary())
        .args(["import", &layout.path(), "--as", &format!("{ORIGIN_NAME}/team/app"), "--config"])
        .arg(larder.config_path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("run larder import");

    // The commit is under way once blob files appear in the blob folders:
    // let a hundred of the 1,501 land first.
    let started = std::time::Instant::now();
    while files_under(&committed) < 100 {
        assert!(started.elapsed() < Duration::from_secs(120), "the import never reached its commit");
        std::thread::sleep(Duration::from_millis(1));
    }
    larder.stop();
    let _ = import.wait();
    let files_at_kill = files_under(&committed);
    larder.restart().await;

    let (manifest, blobs_served) = served(&larder, "v1", &blobs).await;
    eprintln!(
        "killed with {files_at_kill} blob files in place; after the restart: manifest {manifest}, {blobs_served} blobs"
    );
    assert!(
        (manifest && blobs_served == blobs.len()) || (!manifest && blobs_served == 0),
        "all or nothing: the manifest served {manifest}, {blobs_served} of {} blobs served",
        blobs.len()
    );
    larder.send_sigterm();
    assert!(larder.wait_exit(Duration::from_secs(40)).await.is_some_and(|s| s.success()), "larder stopped");
    let verify = larder.cli(&["verify"]);
    assert!(verify.status.success(), "larder verify finds nothing wrong: {}", text(&verify.stdout));
}

/// A client that goes away in the middle of its upload leaves nothing:
/// no staged file, no blob, no row; the same layout then imports whole.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_gone_mid_upload_leaves_nothing_and_the_next_import_works() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let mut layout = Layout::create(&dir.path().join("layout"));
    let (_, blobs) = many_layers(&mut layout, 200, "v1", 2);
    let tar = layout_tar(&layout);
    let (larder, admin) = larder_without_origin(|b| b).await;

    let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", admin.port)).await.unwrap();
    let head = format!(
        "POST /import?as={ORIGIN_NAME}/team/app HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\
         Content-Length: {}\r\n\r\n",
        tar.len()
    );
    socket.write_all(head.as_bytes()).await.unwrap();
    socket.write_all(&tar[..tar.len() / 2]).await.unwrap();
    socket.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(socket);

    let tmp = larder.cache_dir().join("tmp");
    wait_until("the staging area is removed", Duration::from_secs(30), || files_under(&tmp) == 0).await;
    assert_eq!(files_under(&larder.cache_dir().join("blobs/sha256")), 0, "no blob committed");
    assert_eq!(served(&larder, "v1", &blobs).await, (false, 0), "nothing served");

    let (status, answer) = post_import(&admin, Some(&format!("{ORIGIN_NAME}/team/app")), tar).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(served(&larder, "v1", &blobs).await, (true, blobs.len()), "the whole image, from the second upload");
}

/// Issue 32 item 3: a connection that ends while its import commits (the
/// client hangs up, or before, the admin listener's idle timeout cut it)
/// does not cancel the commit: the image is served whole. Before, each
/// blob was committed on its own and the rest were dropped with the
/// request.
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_that_ends_while_its_import_commits_still_gets_all_of_it() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let mut layout = Layout::create(&dir.path().join("layout"));
    let (_, blobs) = many_layers(&mut layout, 1500, "v1", 3);
    let tar = layout_tar(&layout);
    let (larder, admin) = larder_without_origin(|b| b).await;

    let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", admin.port)).await.unwrap();
    socket.write_all(import_head(&format!("?as={ORIGIN_NAME}/team/app"), tar.len() as u64).as_bytes()).await.unwrap();
    socket.write_all(&tar).await.unwrap();
    socket.flush().await.unwrap();
    let committed = larder.cache_dir().join("blobs/sha256");
    wait_until("the commit begins", Duration::from_secs(120), || files_under(&committed) > 0).await;
    drop(socket);

    let tmp = larder.cache_dir().join("tmp");
    wait_until("the import ends", Duration::from_secs(120), || files_under(&tmp) == 0).await;
    assert_eq!(served(&larder, "v1", &blobs).await, (true, blobs.len()), "the whole image");
}

// ---- immutable content ---------------------------------------------------------------

/// Issue 32 item 4 as reported: a public manifest without `mediaType` (OCI
/// allows that), cached as the image manifest it was served as, imported
/// again declared as an index. Before, the import rewrote the stored media
/// type, and skopeo then refused every pull of the original ("rejecting
/// ambiguous manifest").
#[tokio::test(flavor = "multi_thread")]
async fn a_manifest_declared_with_another_media_type_is_refused_and_the_cached_one_still_pulls() {
    let origin = Origin::start().await;
    let config = br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#.to_vec();
    let layer = common::push::random(16 * KIB);
    let (config_digest, layer_digest) =
        (origin.push_blob("public/app", &config).await, origin.push_blob("public/app", &layer).await);
    let manifest = json!({
        "schemaVersion": 2,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config.len()},
        "layers": [{"mediaType": OCI_LAYER, "digest": layer_digest, "size": layer.len()}],
    })
    .to_string()
    .into_bytes();
    let digest = origin.push_manifest("public/app", "v1", OCI_MANIFEST, &manifest).await;
    let (larder, _admin) = larder_with_admin(&origin, |b| b).await;
    let pulled = skopeo::pull(&larder.image_ref("public/app:v1"), false).await.expect("the first pull caches it");
    assert_eq!(pulled.manifest_digest, digest);

    let dir = tempfile::tempdir().unwrap();
    let mut layout = Layout::create(&dir.path().join("layout"));
    for bytes in [&config, &layer, &manifest] {
        layout.blob(bytes);
    }
    layout.image(OCI_INDEX, &digest, manifest.len(), json!({REF_NAME: "v1"}));
    let out = larder.cli(&["import", &layout.path(), "--as", &format!("{ORIGIN_NAME}/other/app")]);

    assert_eq!(out.status.code(), Some(1), "refused");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(&format!("manifest {digest} has no mediaType of its own, so it is a {OCI_MANIFEST}"))
            && stderr.contains(&format!("the layout declares it a {OCI_INDEX}")),
        "{stderr}"
    );
    drop(origin);
    for reference in ["public/app:v1".to_owned(), format!("public/app@{digest}")] {
        let pulled = skopeo::pull(&larder.image_ref(&reference), false).await;
        assert_eq!(pulled.expect("the original still pulls").manifest_digest, digest, "{reference}");
    }
}

// ---- destinations --------------------------------------------------------------------

/// Issue 32 item 5 as reported: `--as team-a/app` (the default upstream)
/// and a tag annotation carrying `?ns=other.local`. Before, the image
/// landed in other.local/team-a/app:v1 and the command printed counts.
#[tokio::test(flavor = "multi_thread")]
async fn as_decides_where_every_image_goes_and_the_answer_lists_each_destination() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[16 * KIB]).push(&origin, "team-a/app", "v1").await;
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let source = origin.image_ref("team-a/app:v1");
    skopeo::run(&["copy".into(), "--src-tls-verify=false".into(), source, format!("oci:{}:v1", layout.display())])
        .await
        .expect("skopeo copy to oci:");
    let other = common::larder::Upstream::new("other.local", "http://127.0.0.1:9");
    let (larder, admin) = larder_with_admin(&origin, |b| b.upstream(other)).await;
    let annotate = |annotations: Value| {
        let path = layout.join("index.json");
        let mut index: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        index["manifests"][0]["annotations"] = annotations;
        std::fs::write(&path, index.to_string()).unwrap();
    };
    let layout_path = layout.display().to_string();

    annotate(json!({REF_NAME: "v1?ns=other.local"}));
    let out = larder.cli(&["import", &layout_path, "--as", "team-a/app"]);
    assert_eq!(out.status.code(), Some(1), "a tag that routes is no tag");
    assert!(text(&out.stderr).contains(r#""v1?ns=other.local", which is not a tag"#), "{}", text(&out.stderr));

    annotate(json!({REF_NAME: "v1", "io.containerd.image.name": "other.local/team-a/app:v1"}));
    let out = larder.cli(&["import", &layout_path, "--as", "team-a/app"]);
    assert!(out.status.success(), "imported where --as says");
    let destination = format!("{ORIGIN_NAME}/team-a/app:v1@{}", image.digest);
    assert!(text(&out.stdout).lines().any(|l| l.trim() == destination), "the command lists {destination}");

    drop(origin);
    let pulled = skopeo::pull(&larder.image_ref("team-a/app:v1"), false).await.expect("pull where --as put it");
    assert_eq!(pulled.manifest_digest, image.digest);
    let elsewhere = format!("{}/v2/team-a/app/manifests/v1?ns=other.local", larder.url());
    let status = http::manifest_get(&http::client(), &elsewhere).send().await.unwrap().status();
    assert_ne!(status, 200, "nothing landed in other.local");

    // The admin answer lists the destinations too.
    let mut files = Vec::new();
    for name in ["oci-layout", "index.json"] {
        files.push((name.to_owned(), std::fs::read(layout.join(name)).unwrap()));
    }
    for entry in std::fs::read_dir(layout.join("blobs/sha256")).unwrap() {
        let entry = entry.unwrap();
        files.push((
            format!("blobs/sha256/{}", entry.file_name().to_string_lossy()),
            std::fs::read(entry.path()).unwrap(),
        ));
    }
    let (status, answer) = post_import(&admin, Some("team-a/app"), tar_of(&files)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["destinations"], json!([destination]));
}

// ---- descriptors ---------------------------------------------------------------------

/// Descriptors `pid` has open.
fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).expect("/proc/<pid>/fd").count() as u64
}

/// Sets `pid`'s soft open-files limit (lowering and raising it back needs no privilege).
fn set_open_files_limit(pid: u32, limit: &str) {
    let status = std::process::Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--nofile={limit}:"))
        .status()
        .expect("prlimit");
    assert!(status.success(), "prlimit --nofile={limit}: on {pid}");
}

/// Issue 32 item 6 as reported: under a low open-files limit, an import of
/// many blobs held one descriptor per staged blob until the whole tar was
/// read; the listeners then failed to accept, and pulls timed out.
#[tokio::test(flavor = "multi_thread")]
async fn an_import_of_many_blobs_under_a_low_open_file_limit_leaves_the_listeners_their_descriptors() {
    let origin = Origin::start().await;
    let base = ImageBuilder::oci().layers(&[16 * KIB]).push(&origin, "team/base", "v1").await;
    let (larder, _admin) = larder_with_admin(&origin, |b| b).await;
    skopeo::pull(&larder.image_ref("team/base:v1"), false).await.expect("cache team/base");
    let dir = tempfile::tempdir().unwrap();
    let mut layout = Layout::create(&dir.path().join("layout"));
    many_layers(&mut layout, 1000, "v1", 4);
    let pid = larder.pid();
    let limit = open_fds(pid) + 150;
    set_open_files_limit(pid, &limit.to_string());

    // Pulls on fresh connections all through the import.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let blob_url = format!("{}/v2/team/base/blobs/{}", larder.url(), base.blob_digests()[0]);
    let pulls = tokio::spawn({
        let stop = std::sync::Arc::clone(&stop);
        async move {
            let (mut ok, mut failed) = (0, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match http::client().get(&blob_url).send().await {
                    Ok(resp) if resp.status() == 200 => ok += 1,
                    Ok(resp) => failed.push(resp.status().to_string()),
                    Err(e) => failed.push(e.to_string()),
                }
            }
            (ok, failed)
        }
    });
    let import = {
        let (config, path) = (larder.config_path().to_owned(), layout.path());
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(common::larder::binary())
                .args(["import", &path, "--as", &format!("{ORIGIN_NAME}/team/app"), "--config"])
                .arg(config)
                .output()
                .expect("run larder import")
        })
    };
    let out = import.await.unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = pulls.await.unwrap();
    set_open_files_limit(pid, "20000");

    assert!(out.status.success(), "imported under a limit of {limit} files: {}", text(&out.stderr));
    assert!(failed.is_empty(), "{} pulls failed during the import ({ok} served): {failed:?}", failed.len());
    assert!(ok > 0, "pulls ran during the import");
    assert!(!larder.log().contains("Too many open files"), "no descriptor ran out");
}

// ---- POST /import --------------------------------------------------------------------

/// Sends `head` (and `body`, if any) on a fresh connection to the admin
/// listener, then reads the answer's status line within 10 s, sending
/// nothing more.
async fn answer_without_the_rest(admin: &Admin, head: &str, body: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", admin.port)).await.unwrap();
    socket.write_all(head.as_bytes()).await.unwrap();
    socket.write_all(body).await.unwrap();
    socket.flush().await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match socket.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
            if answer.windows(4).any(|w| w == b"\r\n\r\n") && answer.ends_with(b"}") {
                break;
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no answer while the rest of the body was held back: {}", text(&answer));
    text(&answer)
}

fn import_head(query: &str, length: u64) -> String {
    format!(
        "POST /import{query} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {length}\r\n\r\n"
    )
}

/// Issue 32 item 7: `POST /import` stored the whole body before it
/// checked where the images go. Now a destination policy refuses is a 403
/// as soon as `?as=` or `index.json` names it, the rest of the body unread.
#[tokio::test(flavor = "multi_thread")]
async fn post_import_refuses_a_destination_policy_refuses_before_it_reads_the_blobs() {
    let origin = Origin::start().await;
    let policy = common::Upstream::from(&origin).line("deny = [\"private/**\"]");
    let (builder, admin) = Admin::with_token(Larder::builder().upstream(policy), TOKEN);
    let larder = builder.start().await;

    let answer =
        answer_without_the_rest(&admin, &import_head(&format!("?as={ORIGIN_NAME}/private/x"), 3 << 20), b"").await;
    assert!(answer.starts_with("HTTP/1.1 403"), "refused before a byte of the body: {answer}");
    assert!(answer.contains("deny rule"), "{answer}");

    // index.json first, naming a refused repository; the blobs held back.
    let index = json!({"schemaVersion": 2, "manifests": [{
        "mediaType": OCI_MANIFEST, "digest": format!("sha256:{}", "a".repeat(64)), "size": 10,
        "annotations": {"io.containerd.image.name": format!("{ORIGIN_NAME}/private/x:v1")},
    }]});
    let start = tar_of(&[
        ("oci-layout".into(), br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()),
        ("index.json".into(), index.to_string().into_bytes()),
    ]);
    let start = &start[..start.len() - 1024]; // without the end-of-archive blocks: more would follow
    let answer = answer_without_the_rest(&admin, &import_head("", 3 << 20), start).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "refused once index.json was read: {answer}");
    assert_eq!(files_under(&larder.cache_dir().join("tmp")), 0, "nothing staged");

    // The CLI says what larder said, not that its upload was cut.
    let dir = tempfile::tempdir().unwrap();
    let mut layout = Layout::create(&dir.path().join("layout"));
    let (_, _) = many_layers(&mut layout, 3, "v1", 5);
    let out = larder.cli(&["import", &layout.path(), "--as", &format!("{ORIGIN_NAME}/private/x")]);
    assert_eq!(out.status.code(), Some(1), "refused");
    assert!(
        text(&out.stderr).contains("403 DENIED") && text(&out.stderr).contains("deny rule"),
        "{}",
        text(&out.stderr)
    );
}

/// Issue 32 item 7: a body past `cache.max_import_size` is a 413, before
/// a byte of it is read when `Content-Length` says so, and where the
/// upload is chunked (the CLI's) as soon as it passes the limit.
#[tokio::test(flavor = "multi_thread")]
async fn post_import_answers_a_body_past_max_import_size_with_a_413() {
    let origin = Origin::start().await;
    let (larder, admin) = larder_with_admin(&origin, |b| b.cache_line("max_import_size = \"4MiB\"")).await;

    let answer = answer_without_the_rest(&admin, &import_head("", 5 << 20), b"").await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("over cache.max_import_size (4194304 bytes)"), "{answer}");

    let dir = tempfile::tempdir().unwrap();
    let mut layout = Layout::create(&dir.path().join("layout"));
    let big = common::push::random(5 << 20);
    let big_digest = layout.blob(&big);
    let config = b"{}".to_vec();
    let config_digest = layout.blob(&config);
    let manifest = image_manifest((&config_digest, config.len()), &[(big_digest, big.len())]);
    let manifest_digest = layout.blob(&manifest);
    layout.image(OCI_MANIFEST, &manifest_digest, manifest.len(), json!({REF_NAME: "v1"}));
    let out = larder.cli(&["import", &layout.path(), "--as", &format!("{ORIGIN_NAME}/team/app")]);
    assert_eq!(out.status.code(), Some(1), "refused");
    assert!(text(&out.stderr).contains("413 SIZE_INVALID"), "{}", text(&out.stderr));
    assert_eq!(files_under(&larder.cache_dir().join("blobs/sha256")), 0, "nothing committed");
}

/// An `oci-archive:` from skopeo has `index.json` after its blobs. Posted
/// as it is, only a quarter of `cache.max_import_size` is staged before
/// larder knows where the images go; `larder import` sends `index.json`
/// first, so the same archive imports whole.
#[tokio::test(flavor = "multi_thread")]
async fn blobs_before_index_json_are_staged_within_a_quota_and_the_cli_sends_index_json_first() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[3 << 20]).push(&origin, "team/tool", "2.0").await;
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("tool.tar");
    let source = origin.image_ref("team/tool:2.0");
    skopeo::run(&[
        "copy".into(),
        "--src-tls-verify=false".into(),
        source,
        format!("oci-archive:{}:2.0", archive.display()),
    ])
    .await
    .expect("skopeo copy to oci-archive:");
    let names: Vec<String> = tar::Archive::new(std::fs::File::open(&archive).unwrap())
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().display().to_string())
        .collect();
    let index_at = names.iter().position(|n| n.trim_start_matches("./") == "index.json").expect("an index.json");
    assert!(names[..index_at].iter().any(|n| n.contains("blobs/sha256/")), "skopeo puts blobs first: {names:?}");
    let (larder, admin) = larder_with_admin(&origin, |b| b.cache_line("max_import_size = \"8MiB\"")).await;

    let (status, answer) = post_import(&admin, Some("team/tool"), std::fs::read(&archive).unwrap()).await;
    assert_eq!(status, 413, "{answer}");
    let message = answer["errors"][0]["message"].as_str().unwrap_or_default().to_owned();
    assert!(message.contains("over 2097152 bytes of blobs come before index.json"), "{message}");

    let out = larder.cli(&["import", &archive.display().to_string(), "--as", "team/tool"]);
    assert!(out.status.success(), "the CLI sends index.json first");
    drop(origin);
    let pulled = skopeo::pull(&larder.image_ref("team/tool:2.0"), false).await.expect("pull with the origin gone");
    assert_eq!(pulled.manifest_digest, image.digest);
}

/// Imports at once of layouts that share blobs (two run, the third waits
/// its turn): each commits whole, every image pulls, and the cache is
/// consistent (`larder verify`).
#[tokio::test(flavor = "multi_thread")]
async fn imports_at_once_of_overlapping_layouts_each_commit_whole() {
    let dir = tempfile::tempdir().unwrap();
    let shared: Vec<Vec<u8>> = (0..50).map(|_| common::push::random(KIB)).collect();
    let mut layouts = Vec::new();
    for (i, tag) in ["a", "b", "c"].into_iter().enumerate() {
        let mut layout = Layout::create(&dir.path().join(tag));
        let config = format!(r#"{{"architecture":"amd64","os":"linux","n":{i}}}"#).into_bytes();
        let config_digest = layout.blob(&config);
        let mut layers: Vec<(String, usize)> = shared.iter().map(|b| (layout.blob(b), b.len())).collect();
        let own = common::push::random(64 * KIB);
        layers.push((layout.blob(&own), own.len()));
        let manifest = image_manifest((&config_digest, config.len()), &layers);
        let digest = layout.blob(&manifest);
        layout.image(OCI_MANIFEST, &digest, manifest.len(), json!({REF_NAME: tag}));
        layouts.push((layout, layers.into_iter().map(|(d, _)| d).collect::<Vec<_>>()));
    }
    let (mut larder, _admin) = larder_without_origin(|b| b).await;

    let runs: Vec<_> = layouts
        .iter()
        .map(|(layout, _)| {
            let (config, path) = (larder.config_path().to_owned(), layout.path());
            tokio::task::spawn_blocking(move || {
                std::process::Command::new(common::larder::binary())
                    .args(["import", &path, "--as", &format!("{ORIGIN_NAME}/team/app"), "--config"])
                    .arg(config)
                    .output()
                    .expect("run larder import")
            })
        })
        .collect();
    for run in runs {
        let out = run.await.unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    for ((_, blobs), tag) in layouts.iter().zip(["a", "b", "c"]) {
        assert_eq!(served(&larder, tag, blobs).await, (true, blobs.len()), "team/app:{tag}");
    }
    larder.send_sigterm();
    assert!(larder.wait_exit(Duration::from_secs(40)).await.is_some_and(|s| s.success()), "larder stopped");
    let verify = larder.cli(&["verify"]);
    assert!(verify.status.success(), "larder verify finds nothing wrong: {}", text(&verify.stdout));
}

// ---- review (session 2): what an import must not do either ---------------------------

/// A manifest without `mediaType` of its own (OCI allows that) that the
/// origin has, never pulled through larder yet, imported declared as a
/// Docker manifest (Docker's types carry theirs). Before, the import was
/// the first to store it, under the layout's type, and every repository
/// was then served it so: skopeo refused the origin's own `public/x` by
/// digest ("unsupported docker v2s2 media type").
#[tokio::test(flavor = "multi_thread")]
async fn a_layout_cannot_be_first_to_give_a_manifest_another_media_type_than_its_shape() {
    const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
    let origin = Origin::start().await;
    let config = br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#.to_vec();
    let layer = common::push::random(16 * KIB);
    let (config_digest, layer_digest) =
        (origin.push_blob("public/x", &config).await, origin.push_blob("public/x", &layer).await);
    let manifest = json!({
        "schemaVersion": 2,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config.len()},
        "layers": [{"mediaType": OCI_LAYER, "digest": layer_digest, "size": layer.len()}],
    })
    .to_string()
    .into_bytes();
    let digest = origin.push_manifest("public/x", "v1", OCI_MANIFEST, &manifest).await;
    let (larder, _admin) = larder_with_admin(&origin, |b| b).await;

    let dir = tempfile::tempdir().unwrap();
    let mut layout = Layout::create(&dir.path().join("layout"));
    for bytes in [&config, &layer, &manifest] {
        layout.blob(bytes);
    }
    layout.image(DOCKER_MANIFEST, &digest, manifest.len(), json!({REF_NAME: "v1"}));
    let out = larder.cli(&["import", &layout.path(), "--as", &format!("{ORIGIN_NAME}/team-a/app")]);

    assert_eq!(out.status.code(), Some(1), "refused");
    let stderr = text(&out.stderr);
    assert!(stderr.contains(&format!("manifest {digest} has no mediaType of its own")), "{stderr}");
    assert!(stderr.contains(&format!("the layout declares it a {DOCKER_MANIFEST}")), "{stderr}");
    let pulled = skopeo::pull(&larder.image_ref(&format!("public/x@{digest}")), false).await;
    assert_eq!(pulled.expect("the origin's image pulls through larder").manifest_digest, digest);

    // Declared as what its shape is, the same layout imports.
    layout.images.clear();
    layout.image(OCI_MANIFEST, &digest, manifest.len(), json!({REF_NAME: "v1"}));
    let out = larder.cli(&["import", &layout.path(), "--as", &format!("{ORIGIN_NAME}/team-a/app")]);
    assert!(out.status.success(), "imported");
    let pulled = skopeo::pull(&larder.image_ref("team-a/app:v1"), false).await.expect("pull team-a/app:v1");
    assert_eq!(pulled.manifest_digest, digest);
}

/// A layout folder whose `blobs/sha256` is a link to a folder of larder's
/// own store (`blobs/sha256/<first two hex digits>`), as a tenant's tar of
/// a layout unpacks it: the tenant's manifest, ground to share the first
/// two digits with tenant B's cached layer and pulled through larder as a
/// blob of team-a/app, names that layer. Before, every file of the linked
/// folder counted as carried, so team-a/app got B's layer with no byte
/// of it in the layout.
#[tokio::test(flavor = "multi_thread")]
async fn a_layout_whose_blob_folder_links_into_the_store_carries_nothing_of_it() {
    let origin = Origin::start().await;
    let private = ImageBuilder::oci().layers(&[64 * KIB]).push(&origin, "private/b", "v1").await;
    let layer = private.manifests[0].layers[0].clone();
    let (larder, _admin) = larder_with_admin(&origin, |b| b).await;
    skopeo::pull(&larder.image_ref("private/b:v1"), false).await.expect("B's image is cached");
    let prefix = layer.digest[7..9].to_owned();
    assert!(larder.blob_file(&layer.digest).exists(), "B's layer is cached");

    // team-a's config upstream, and a manifest naming it and B's layer,
    // its annotation chosen so that its digest starts as the layer's does.
    let config = br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#.to_vec();
    let config_digest = origin.push_blob("team-a/app", &config).await;
    let manifest = (0u64..)
        .map(|n| {
            let mut m: Value = serde_json::from_slice(&image_manifest(
                (&config_digest, config.len()),
                &[(layer.digest.clone(), layer.size as usize)],
            ))
            .unwrap();
            m["annotations"] = json!({"n": n.to_string()});
            m.to_string().into_bytes()
        })
        .find(|m| sha256_digest(m)[7..9] == prefix)
        .unwrap();
    let manifest_digest = origin.push_blob("team-a/app", &manifest).await;
    let url = format!("{}/v2/team-a/app/blobs/{manifest_digest}", larder.url());
    assert_eq!(http::client().get(&url).send().await.unwrap().status(), 200, "pulled through as a blob");
    let cached = larder.blob_file(&manifest_digest);
    wait_until("the manifest is cached as a blob", Duration::from_secs(10), || cached.exists()).await;

    let dir = tempfile::tempdir().unwrap();
    let mut layout = Layout::create(&dir.path().join("layout"));
    std::fs::remove_dir(layout.dir.join("blobs/sha256")).unwrap();
    let store_folder = larder.blob_file(&layer.digest).parent().unwrap().to_owned();
    std::os::unix::fs::symlink(&store_folder, layout.dir.join("blobs/sha256")).unwrap();
    layout.image(OCI_MANIFEST, &manifest_digest, manifest.len(), json!({REF_NAME: "v1"}));
    let out = larder.cli(&["import", &layout.path(), "--as", &format!("{ORIGIN_NAME}/team-a/app")]);

    assert!(!out.status.success(), "refused");
    assert!(text(&out.stderr).contains("blobs/sha256 is a link or a file, not a folder"), "{}", text(&out.stderr));
    let layer_url = format!("{}/v2/team-a/app/blobs/{}", larder.url(), layer.digest);
    let status = http::client().get(&layer_url).send().await.unwrap().status();
    assert_eq!(status, 404, "team-a/app does not get B's layer");
}

/// An import into team/app that began before a purge of team/app (its
/// upload held back while the purge ran) is refused whole, as a fill
/// from before a purge commits without its membership. Before, the
/// import committed its rows after the purge and team/app served the
/// image again.
#[tokio::test(flavor = "multi_thread")]
async fn an_import_that_began_before_a_purge_of_its_destination_is_refused_whole() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let mut layout = Layout::create(&dir.path().join("layout"));
    let (_, blobs) = many_layers(&mut layout, 20, "v1", 3);
    let tar = layout_tar(&layout);
    let (larder, admin) = larder_without_origin(|b| b).await;

    let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", admin.port)).await.unwrap();
    socket.write_all(import_head(&format!("?as={ORIGIN_NAME}/team/app"), tar.len() as u64).as_bytes()).await.unwrap();
    socket.write_all(&tar[..tar.len() / 2]).await.unwrap();
    socket.flush().await.unwrap();
    let tmp = larder.cache_dir().join("tmp");
    wait_until("the import stages blobs", Duration::from_secs(30), || files_under(&tmp) > 0).await;
    let purge = http::client()
        .post(format!("{}/purge?upstream={ORIGIN_NAME}&repo=team/app", admin.url()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("POST /purge");
    assert_eq!(purge.status(), 200);
    socket.write_all(&tar[tar.len() / 2..]).await.unwrap();
    socket.flush().await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        while !(answer.windows(4).any(|w| w == b"\r\n\r\n") && answer.ends_with(b"}")) {
            match socket.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let answer = text(&answer);
    assert!(read.is_ok(), "an answer: {answer}");

    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains(&format!("{ORIGIN_NAME}/team/app was purged while the import ran")), "{answer}");
    assert_eq!(served(&larder, "v1", &blobs).await, (false, 0), "nothing of it is served after the purge");

    let (status, answer) = post_import(&admin, Some(&format!("{ORIGIN_NAME}/team/app")), tar).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(served(&larder, "v1", &blobs).await, (true, blobs.len()), "imported again, whole");
}

/// A tmpfs mounted over a folder for a test (needs root); unmounted when
/// dropped (lazily, if something still has files open on it).
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("run mount");
        assert!(out.status.success(), "cannot mount a tmpfs (this test needs root): {}", text(&out.stderr));
        Tmpfs { dir: dir.to_owned() }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let unmounted = std::process::Command::new("umount").arg(&self.dir).status().is_ok_and(|s| s.success());
        if !unmounted {
            let _ = std::process::Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// The staging area's disk fills up (the cache is on an 8 MiB tmpfs, the
/// layout is 12 MiB): a 503 saying the disk is full, the staging area
/// removed, and the next import that fits works. Before, the write's
/// ENOSPC was answered as a broken layout (400, "not an OCI image
/// layout: ... No space left on device").
#[tokio::test(flavor = "multi_thread")]
async fn a_disk_that_fills_while_an_import_stages_is_a_503_not_a_broken_layout() {
    let dir = tempfile::tempdir().unwrap();
    let mut big = Layout::create(&dir.path().join("big"));
    let config = br#"{"architecture":"amd64","os":"linux"}"#.to_vec();
    let config_digest = big.blob(&config);
    let layers: Vec<(String, usize)> =
        (0..12).map(|_| (big.blob(&common::push::random(1024 * KIB)), 1024 * KIB)).collect();
    let manifest = image_manifest((&config_digest, config.len()), &layers);
    let manifest_digest = big.blob(&manifest);
    big.image(OCI_MANIFEST, &manifest_digest, manifest.len(), json!({REF_NAME: "v1"}));
    let mut small = Layout::create(&dir.path().join("small"));
    let (_, blobs) = many_layers(&mut small, 4, "v2", 5);
    let (mut larder, admin) = larder_without_origin(|b| b).await;
    larder.stop();
    let _disk = Tmpfs::mount(&larder.cache_dir(), "8m");
    larder.restart().await;

    let out = larder.cli(&["import", &big.path(), "--as", &format!("{ORIGIN_NAME}/team/app")]);

    assert_eq!(out.status.code(), Some(1), "refused");
    let stderr = text(&out.stderr);
    assert!(stderr.contains("503 UNAVAILABLE: the cache disk is full"), "{stderr}");
    assert!(!stderr.contains("not an OCI image layout"), "the layout is fine: {stderr}");
    let tmp = larder.cache_dir().join("tmp");
    wait_until("the staging area is removed", Duration::from_secs(30), || files_under(&tmp) == 0).await;
    let out = larder.cli(&["import", &small.path(), "--as", &format!("{ORIGIN_NAME}/team/app")]);
    assert!(out.status.success(), "a layout that fits imports");
    assert_eq!(served(&larder, "v2", &blobs).await.1, blobs.len());
    drop(admin);
}
