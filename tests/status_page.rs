//! The admin listener's status page, seen as a person sees it: headless
//! Chromium (Debian's `chromium`) loads `GET /` of a larder that has served
//! real pulls (cold, then one warm), one upstream announcing Docker
//! Hub-style rate-limit headers, one that is down, and one whose blob is
//! stalled mid-download (a fill in flight); the test checks the rendered
//! text, that the page loads no script and no asset from elsewhere, that
//! `larder status` reports the same facts, and keeps a screenshot as a
//! test artifact (`target/tmp/status-page.png`). With
//! `LARDER_UPDATE_SCREENSHOT=1` it also refreshes the operating guide's
//! `docs/status-page.png`.

mod common;
mod fake;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::admin::{stderr, stdout};
use common::{Admin, ImageBuilder, KIB, Larder, MIB, Origin, Upstream, http, skopeo, which};
use fake::{FakeUpstream, REPO, blob_path, client, random_bytes};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// How long Chromium may take to load and render the page.
const BROWSER_TIMEOUT: Duration = Duration::from_secs(60);

/// Headless Chromium as root, with a fresh profile and nothing phoning home.
fn chromium(profile: &Path, args: &[&str]) -> std::process::Output {
    let mut command = Command::new(which("chromium"));
    command.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
    ]);
    command.arg(format!("--user-data-dir={}", profile.display())).args(args);
    let child = command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start chromium (tests/run.sh installs Debian's chromium)");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(BROWSER_TIMEOUT) {
        Ok(output) => output.expect("wait for chromium"),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("chromium did not finish within {BROWSER_TIMEOUT:?}");
        }
    }
}

/// The page's text as rendered: the DOM after load, tags stripped,
/// entities decoded, whitespace collapsed.
fn rendered_text(dom: &str) -> String {
    let body = dom.split("<body>").nth(1).unwrap_or(dom);
    let mut text = String::new();
    let mut in_tag = false;
    for c in body.chars() {
        match c {
            '<' => in_tag = true,
            '>' => {
                in_tag = false;
                text.push(' ');
            }
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    let text = text.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&#39;", "'");
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A registry front that answers everything 404 with Docker Hub's
/// rate-limit headers.
async fn rate_limited_registry() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf).await;
                let answer = "HTTP/1.1 404 Not Found\r\nratelimit-limit: 100;w=21600\r\n\
                              ratelimit-remaining: 76;w=21600\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
                let _ = conn.write_all(answer.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}")
}

/// References in `html` to anything on another host: `src=`, `href=`,
/// `action=`, CSS `url(` and `@import` naming `http:`, `https:` or `//`.
fn external_references(html: &str) -> Vec<String> {
    let lower = html.to_ascii_lowercase();
    let mut found = Vec::new();
    for attribute in ["src=", "href=", "action=", "url(", "@import"] {
        for (at, _) in lower.match_indices(attribute) {
            let value = lower[at + attribute.len()..].trim_start_matches(['"', '\'', ' ']);
            if ["http:", "https:", "//"].iter().any(|scheme| value.starts_with(scheme)) {
                found.push(html[at..(at + 80).min(html.len())].to_owned());
            }
        }
    }
    found
}

fn artifact(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_status_page_shows_the_cache_upstreams_and_repositories_in_a_browser() {
    let origin = Origin::start().await;
    ImageBuilder::oci().layers(&[2 * MIB, MIB, 512 * KIB]).push(&origin, "team/app", "v1").await;
    ImageBuilder::oci().layers(&[256 * KIB]).push(&origin, "team/tools", "v2").await;
    ImageBuilder::oci().layers(&[96 * KIB]).push(&origin, "library/base", "1.0").await;
    let hub = rate_limited_registry().await;
    let stalled_blob = random_bytes(MIB, 7);
    let stalling = FakeUpstream::builder().blob(stalled_blob.clone()).stall_after(64 * KIB).start().await;
    let (builder, admin) = Admin::open(
        Larder::builder()
            .upstream(&origin)
            .upstream(Upstream::new("hub.test", &hub).line(r#"max_bandwidth = "50MiB""#))
            .upstream(Upstream::new("down.test", "http://127.0.0.1:9"))
            .upstream(Upstream::new("stall.test", &stalling.url()))
            // A warm image the registry does not have: listed as missing upstream.
            .append_toml("[[warm]]\nimage = \"hub.test/team/db:15\""),
    );
    let larder = builder.start().await;
    for image in ["library/base:1.0", "team/tools:v2", "team/app:v1"] {
        skopeo::pull(&larder.image_ref(image), false).await.expect("pull");
    }
    // A warm pull: team/app's config and 3 layers are hits this time.
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("warm pull");
    for (prefix, want) in [("hub.test", 404), ("down.test", 503)] {
        let url = format!("{}/v2/{prefix}/team/app/manifests/v1", larder.url());
        assert_eq!(http::manifest_get(&http::client(), &url).send().await.expect("answer").status(), want);
    }
    // A client reading a blob that upstream stalls on after 64 KiB: a fill
    // in flight while the page and `larder status` are looked at.
    let larder_addr = ([127, 0, 0, 1], larder.port()).into();
    let stalled_path = blob_path(&fake::digest(&stalled_blob)).replacen("/v2/", "/v2/stall.test/", 1);
    assert!(stalled_path.starts_with(&format!("/v2/stall.test/{REPO}/blobs/")), "{stalled_path}");
    let mut stalled = client::open(larder_addr, &stalled_path).await;
    assert_eq!(stalled.status(), 200);
    assert_eq!(stalled.read_exact(64 * KIB).await.len(), 64 * KIB, "the fill is under way");

    // The warm loop checked hub.test/team/db:15 at start: hub.test never
    // had it (a typo, as far as larder can tell).
    let checked = tokio::time::Instant::now();
    while common::metrics::metric(&larder, r#"larder_warm_images{state="not_found"}"#).await != 1.0 {
        assert!(checked.elapsed() < BROWSER_TIMEOUT, "the warm image was never checked");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let profile = tempfile::tempdir().expect("profile dir");
    let page = format!("{}/", admin.url());
    // What the server sends: no script, nothing fetched from elsewhere.
    let html = http::client().get(&page).send().await.expect("GET /").text().await.expect("the page");
    assert!(!html.to_ascii_lowercase().contains("<script"), "the page carries no script:\n{html}");
    let bad = "<link href='https://cdn.example/x.css'><img src=//cdn.example/a.png><i style=\"background:url( 'http://x/y')\">";
    assert_eq!(external_references(bad).len(), 3, "the check finds what it looks for");
    assert_eq!(external_references(&html), Vec::<String>::new(), "no external assets:\n{html}");

    let dom = chromium(profile.path(), &["--dump-dom", &page]);
    assert!(dom.status.success(), "chromium --dump-dom failed: {}", String::from_utf8_lossy(&dom.stderr));
    let text = rendered_text(&String::from_utf8_lossy(&dom.stdout));

    assert!(text.starts_with("larder version 0.1.0"), "{text}");
    assert!(text.contains("of 10.0 GiB"), "cache size against the limit: {text}");
    assert!(text.contains("eviction starts at 9.5 GiB"), "{text}");
    assert!(text.contains("8 blobs"), "3 configs and 5 layers: {text}");
    assert!(text.contains("3 manifests"), "{text}");
    assert!(text.contains("1 fills in flight"), "the stalled download: {text}");
    assert!(text.contains("30.8% blobs (13 requests)"), "4 warm hits of 13 blob requests: {text}");
    assert!(text.contains("origin.test (default)"), "{text}");
    assert!(text.contains("hub.test") && text.contains("76 of 100 left"), "rate-limit headroom: {text}");
    assert!(text.contains("50.0 MiB/s"), "hub.test's max_bandwidth: {text}");
    assert!(text.contains("unlimited"), "the others have none: {text}");
    assert!(text.contains("down.test") && text.contains("cannot connect to upstream"), "last error: {text}");
    let largest = text.split("Largest repositories (3 in all)").nth(1).expect("largest section");
    let order: Vec<usize> =
        ["team/app", "team/tools", "library/base"].iter().map(|r| largest.find(r).expect(r)).collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "largest first: {largest}");
    let warm = text.split("Kept warm (1 image)").nth(1).expect("the warm section");
    assert!(
        warm.contains("hub.test/team/db:15 not found upstream (404), and never was since it was listed")
            && warm.contains("not found"),
        "{warm}"
    );
    let recent = text.split("Most recently used").nth(1).expect("recent section");
    assert!(recent.contains("team/app") && recent.contains("s ago"), "{recent}");

    // `larder status` tells the same story as text.
    let out = admin.cli(&["status"]);
    let status = stdout(&out);
    assert!(out.status.success(), "{status}{}", stderr(&out));
    assert!(status.contains("hit ratio    blobs 30.8% of 13 requests,"), "{status}");
    assert!(status.contains("fills        1 in flight"), "{status}");
    let upstream = |name: &str| {
        let line = status.lines().find(|l| l.trim_start().starts_with(&format!("{name} ")));
        line.unwrap_or_else(|| panic!("no line for {name}:\n{status}")).to_owned()
    };
    assert!(upstream("hub.test").ends_with("; rate limit 76 of 100 left"), "{status}");
    assert!(upstream("hub.test").contains(", at most 50.0 MiB/s,"), "{status}");
    let max_bandwidth = r#"larder_upstream_max_bandwidth_bytes{upstream="hub.test"}"#;
    assert_eq!(common::metrics::metric(&larder, max_bandwidth).await, (50 << 20) as f64);
    let down = upstream("down.test");
    assert!(down.contains("1 errors, last error ") && down.contains("(cannot connect to upstream"), "{down}");
    assert!(upstream("origin.test").contains("0 errors, no errors; rate limit not announced"), "{status}");

    // The screenshot, kept for whoever looks at the test run.
    let shot = artifact("status-page.png");
    let _ = std::fs::remove_file(&shot);
    let out = chromium(profile.path(), &["--window-size=1280,860", &format!("--screenshot={}", shot.display()), &page]);
    assert!(out.status.success(), "chromium --screenshot failed: {}", String::from_utf8_lossy(&out.stderr));
    let png = std::fs::read(&shot).expect("the screenshot was written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 20_000, "a real PNG, {} bytes", png.len());
    eprintln!("status page screenshot: {}", shot.display());
    stalling.release(&fake::digest(&stalled_blob));
    let (received, end, difference) = stalled.compare_to_end(&stalled_blob[64 * KIB..]).await;
    assert!(matches!(end, client::End::Complete) && difference.is_none(), "{end:?} {difference:?}");
    assert_eq!(received, (MIB - 64 * KIB) as u64, "the stalled fill completes once released");
    if std::env::var_os("LARDER_UPDATE_SCREENSHOT").is_some() {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/status-page.png");
        std::fs::create_dir_all(docs.parent().expect("docs dir")).expect("create docs/");
        std::fs::copy(&shot, &docs).expect("copy the screenshot to docs/");
    }
}
