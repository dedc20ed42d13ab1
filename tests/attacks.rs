//! Attacks on what the security guide (docs/security.md) claims, each a script that
//! ends by counting what the hosts larder must not talk to saw:
//!
//! 1. a token realm on another host asks for larder's credentials (or
//!    answers with more than 1 MiB);
//! 2. a redirect tries to carry them to a "CDN" on another host, loops, or
//!    points at a `file:` URL;
//! 3. a client names the host to dial (`?ns=`, a path prefix, a proxy-style
//!    request): larder is no open proxy;
//! 4. a blob cached (or still downloading) for a private repository is asked
//!    for through another repository, or through another upstream;
//! 5. an upstream serves a manifest whose media types disagree, or one
//!    larger than 4 MiB, or names a layer by a foreign `urls` entry;
//! 6. a client sends hostile bytes at the edge.
//!
//! "Another host" is 127.0.0.2 (all of 127.0.0.0/8 is loopback): a
//! [`Recorder`] there counts every connection it is offered.
//!
//! Covered elsewhere, not repeated: a blob whose bytes do not match its
//! digest is aborted and not cached (tests/coalesce.rs,
//! `a_failed_fill_aborts_every_reader_and_the_next_request_fills_afresh`);
//! manifests whose bytes or `Docker-Content-Digest` lie (tests/faults.rs);
//! silent and trickling clients (tests/slow_clients.rs); a purge or
//! prefetch on the admin listener without the token, with a wrong one, or
//! with none configured on a listener others can reach: refused, counted,
//! nothing purged (tests/admin_auth.rs,
//! `an_unauthenticated_purge_is_refused_and_changes_nothing` and
//! `without_a_token_file_a_listener_others_can_reach_refuses_purge_and_prefetch`);
//! idle and partial-header floods of the admin port (tests/admin_limits.rs).

mod common;
mod fake;

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use common::{Credentials, ImageBuilder, KIB, Origin, Upstream, skopeo};
use fake::client::{self, End};
use fake::recorder::Recorder;
use fake::{FakeUpstream, Larder, MIB, OCI_MANIFEST, REPO, blob_path, digest, image_manifest, manifest_path};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The second "host": larder must never dial it unless configured to.
const OTHER_HOST: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
/// larder's upstream credentials in these tests.
const USER: &str = "larder-attack-test";
const PASSWORD: &str = "hunter2-must-never-leave";
/// Longest wait for one answer: a guard against hangs, not a timing check.
const NO_HANG: Duration = Duration::from_secs(30);

const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";

// ---- helpers ----------------------------------------------------------------

/// Runs `f`, failing the test if it takes longer than [`NO_HANG`].
async fn no_hang<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(NO_HANG, f).await.unwrap_or_else(|_| panic!("{what}: no answer within {NO_HANG:?}"))
}

/// A larder in front of `up` with `username` + `password_file`; the temp
/// dir holding the password file lives as long as the returned guard.
async fn larder_with_credentials(up: &FakeUpstream) -> (Larder, tempfile::TempDir) {
    let secrets = tempfile::tempdir().expect("a temp dir for the password file");
    let password_file = secrets.path().join("password");
    std::fs::write(&password_file, PASSWORD).expect("write the password file");
    let larder = Larder::builder(up)
        .upstream_setting("username", &format!("{USER:?}"))
        .upstream_setting("password_file", &format!("{:?}", password_file.display().to_string()))
        .start()
        .await;
    (larder, secrets)
}

/// `Basic base64(USER:PASSWORD)`: what larder sends when challenged for Basic.
fn basic_authorization() -> String {
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}")))
}

fn bearer_challenge(realm: &str) -> String {
    format!(r#"Bearer realm="{realm}",service="x",scope="repository:{REPO}:pull""#)
}

/// A small image manifest and its digest.
fn manifest() -> (Bytes, String) {
    let config = fake::random_bytes(256, 100);
    let layer = fake::random_bytes(4 * KIB, 101);
    let m = image_manifest((&digest(&config), config.len()), &[(&digest(&layer), layer.len())]);
    let d = digest(&m);
    (m, d)
}

/// Waits until larder has logged refusing a token realm on `host` (its
/// log is collected from stderr as it arrives).
async fn wait_for_refused_realm(larder: &Larder, host: &str) {
    let quoted = format!("\\\"{host}\\\"");
    let refused = |l: &str| l.contains("token realm host") && l.contains(&quoted);
    fake::wait_until(&format!("larder logs refusing a realm on {host}"), || larder.logs().lines().any(refused)).await;
}

/// The `[cache] dir` of a fake-harness larder.
fn cache_dir(larder: &Larder) -> PathBuf {
    let any = digest(b"");
    larder.blob_file(&any).ancestors().nth(4).expect("<cache>/blobs/sha256/<xx>/<hex>").to_path_buf()
}

/// Every file under `dir`, at any depth.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries.flatten().flat_map(|e| if e.path().is_dir() { files_under(&e.path()) } else { vec![e.path()] }).collect()
}

/// Peak resident memory (`VmHWM`) of process `pid`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/<pid>/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    kib * 1024
}

/// A response read off a raw connection.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    /// The `code` of the OCI error envelope, or `None` without one.
    fn error_code(&self) -> Option<String> {
        let json: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        let first = &json["errors"][0];
        if ["code", "message", "detail"].iter().any(|k| first.get(k).is_none()) {
            return None;
        }
        first["code"].as_str().map(str::to_owned)
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// Sends `request` exactly as given and reads the answer until the
/// connection closes. Panics if larder closes without a status line.
async fn exchange(addr: SocketAddr, request: &[u8]) -> Answer {
    let what = String::from_utf8_lossy(&request[..request.len().min(80)]).into_owned();
    no_hang(&what, async {
        let mut sock = TcpStream::connect(addr).await.expect("connect to larder");
        let (mut rd, mut wr) = sock.split();
        // Written while reading: larder may answer (and close) before it has
        // read all of an oversized request.
        let write = async {
            let _ = wr.write_all(request).await;
        };
        let read = async {
            let mut out = Vec::new();
            let mut buf = vec![0u8; 64 * KIB];
            loop {
                match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => break out,
                    Ok(n) => out.extend_from_slice(&buf[..n]),
                }
            }
        };
        let ((), raw) = tokio::join!(write, read);
        let end = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("{what:?}: no response head in {:?}", String::from_utf8_lossy(&raw)));
        let head = String::from_utf8_lossy(&raw[..end]).into_owned();
        let mut lines = head.split("\r\n");
        let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).expect("a status");
        let headers =
            lines.filter_map(|l| l.split_once(':')).map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned())).collect();
        Answer { status, headers, body: raw[end + 4..].to_vec() }
    })
    .await
}

/// `METHOD path` with `Connection: close` and `extra` header lines.
fn request(method: &str, path: &str, extra: &str) -> Vec<u8> {
    format!("{method} {path} HTTP/1.1\r\nHost: larder.test\r\nConnection: close\r\n{extra}\r\n").into_bytes()
}

// ---- 1. hostile token realms ------------------------------------------------

#[tokio::test]
async fn a_token_realm_on_another_host_is_refused_before_anything_is_sent_there() {
    // A "token service" on 127.0.0.2 that would give a token to anyone, and
    // one on 127.0.0.1 (the upstream's IP) for the `localhost` spelling.
    let trap = Recorder::token_service(OTHER_HOST).await;
    let local_trap = Recorder::token_service(Ipv4Addr::LOCALHOST).await;
    let (m, _) = manifest();
    let up = FakeUpstream::builder()
        .manifest(REPO, "v1", OCI_MANIFEST, m)
        .challenge(&bearer_challenge(&format!("http://{}/token", trap.addr())))
        .start()
        .await;
    let (larder, _secrets) = larder_with_credentials(&up).await;
    let path = manifest_path("v1");

    let r = no_hang("GET manifest", client::get(larder.addr(), &path)).await;
    assert_eq!(r.status(), 502, "a refused realm is an upstream failure, not 404 or 200");
    assert_eq!(r.error_code(), "UNAVAILABLE");
    assert_eq!(up.total_requests(), 1, "one GET, answered 401; nothing retried");
    assert_eq!(trap.connections(), 0, "nothing dialed the realm on 127.0.0.2: {:?}", trap.heads());
    wait_for_refused_realm(&larder, "127.0.0.2").await;

    // Other ways of naming a host that is not the upstream. None is dialed,
    // so no name needs resolving: each is refused on its spelling alone.
    let (p, lp, fake_port) = (trap.addr().port(), local_trap.addr().port(), up.addr().port());
    let realms = [
        ("http://evil.example/token".to_owned(), "evil.example"),
        ("https://registry.evil.example/token".to_owned(), "registry.evil.example"),
        // Userinfo that spells the upstream, host that is not.
        (format!("http://127.0.0.1:{fake_port}@127.0.0.2:{p}/token"), "127.0.0.2"),
        // 127.0.0.2 as one number, as inet_aton would read it.
        (format!("http://2130706434:{p}/token"), "2130706434"),
        // The upstream's own address, but spelled as a name.
        (format!("http://localhost:{lp}/token"), "localhost"),
    ];
    for (n, (realm, host)) in realms.iter().enumerate() {
        up.set_challenge(Some(&bearer_challenge(realm)));
        let r = no_hang(realm, client::get(larder.addr(), &path)).await;
        assert_eq!(r.status(), 502, "realm {realm}");
        assert_eq!(r.error_code(), "UNAVAILABLE", "realm {realm}");
        assert_eq!(up.total_requests(), n + 2, "realm {realm}: only the one GET reached the upstream");
        wait_for_refused_realm(&larder, host).await;
    }
    assert_eq!(trap.connections(), 0, "127.0.0.2 was never dialed: {:?}", trap.heads());
    assert_eq!(local_trap.connections(), 0, "localhost was never dialed: {:?}", local_trap.heads());
    assert!(up.log().iter().all(|r| r.authorization.is_none()), "nothing was sent with credentials: {:?}", up.log());
    assert!(!larder.logs().contains(PASSWORD), "the password is never logged");

    // Control: a realm on the upstream's own host is trusted, and the trap
    // does see that (so the zero counts above mean something).
    up.set_challenge(Some(&bearer_challenge(&format!("http://127.0.0.1:{lp}/token"))));
    let r = no_hang("GET with a trusted realm", client::get(larder.addr(), &path)).await;
    assert_eq!(r.status(), 403, "the fake refuses the trap's token");
    assert_eq!(local_trap.connections(), 1, "the trusted realm was asked for a token");
    assert_eq!(local_trap.header_values("authorization"), [basic_authorization()], "with the credentials");
}

#[tokio::test]
async fn a_token_response_over_1_mib_is_refused() {
    let (m, _) = manifest();
    let huge = format!(r#"{{"token":"{}","expires_in":300}}"#, "t".repeat(2 * MIB));
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, m).token_response(huge).start().await;
    up.set_challenge(Some(&bearer_challenge(&format!("{}/token", up.url()))));
    let (larder, _secrets) = larder_with_credentials(&up).await;

    let r = no_hang("GET manifest", client::get(larder.addr(), &manifest_path("v1"))).await;
    assert_eq!(r.status(), 502, "{:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.error_code(), "UNAVAILABLE");
    assert_eq!(up.requests("GET", "/token"), 1, "the realm was asked once");
    assert_eq!(up.manifest_gets("v1"), 1, "no retry with a token: {:?}", up.log());
}

// ---- 2. redirects -------------------------------------------------------------

#[tokio::test]
async fn credentials_never_follow_a_redirect_to_another_host() {
    // Three blobs, each redirected by the upstream to a "CDN" that is not
    // the upstream: 127.0.0.2 (absolute), 127.0.0.2 (scheme-relative), and
    // the upstream's own IP on another port.
    let blobs: Vec<Bytes> = (0..3).map(|i| fake::random_bytes(256 * KIB + i, 200 + i as u64)).collect();
    let cdns = [
        Recorder::cdn(OTHER_HOST, &blobs[0]).await,
        Recorder::cdn(OTHER_HOST, &blobs[1]).await,
        Recorder::cdn(Ipv4Addr::LOCALHOST, &blobs[2]).await,
    ];
    let digests: Vec<String> = blobs.iter().map(|b| digest(b)).collect();
    let locations = [
        format!("http://{}/cdn/{}?sig=abc", cdns[0].addr(), digests[0]),
        format!("//{}/cdn/{}?sig=abc", cdns[1].addr(), digests[1]),
        format!("http://{}/cdn/{}?sig=abc", cdns[2].addr(), digests[2]),
    ];
    let up = FakeUpstream::builder()
        .challenge(r#"Basic realm="fake""#)
        .accept_authorization(&basic_authorization())
        .blob(blobs[0].clone())
        .redirect(&locations[0])
        .blob(blobs[1].clone())
        .redirect(&locations[1])
        .blob(blobs[2].clone())
        .redirect(&locations[2])
        .start()
        .await;
    let (larder, _secrets) = larder_with_credentials(&up).await;

    for ((blob, d), (cdn, location)) in blobs.iter().zip(&digests).zip(cdns.iter().zip(&locations)) {
        let r = no_hang(location, client::get(larder.addr(), &blob_path(d))).await;
        assert_eq!((r.status(), &r.end), (200, &End::Complete), "blob redirected to {location}");
        assert!(r.body == *blob, "exact bytes from {location}");
        larder.wait_committed(d).await;

        // The upstream got the credentials, and answered with the redirect.
        let authorized_gets = up
            .log()
            .iter()
            .filter(|l| l.method == "GET" && l.path == blob_path(d) && l.authorization == Some(basic_authorization()))
            .count();
        assert_eq!(authorized_gets, 1, "{location}: one authorized upstream GET: {:?}", up.log());
        // The CDN got one request, without them.
        let heads = cdn.heads();
        assert_eq!(heads.len(), 1, "{location}: {heads:?}");
        assert_eq!(cdn.header_values("host"), [cdn.addr().to_string()], "the recorder reads headers: {heads:?}");
        assert!(heads[0].starts_with(&format!("GET /cdn/{d}?sig=abc ")), "{location}: {heads:?}");
        for header in ["authorization", "proxy-authorization", "cookie"] {
            assert!(cdn.header_values(header).is_empty(), "{location}: the CDN was sent {header}: {heads:?}");
        }
    }
    assert!(!larder.logs().contains(PASSWORD), "the password is never logged");
}

#[tokio::test]
async fn a_relative_redirect_stays_on_the_upstream() {
    let blob = fake::random_bytes(128 * KIB, 300);
    let d = digest(&blob);
    let cdn_path = format!("/cdn/{d}");
    let up = FakeUpstream::builder()
        .challenge(r#"Basic realm="fake""#)
        .accept_authorization(&basic_authorization())
        .blob(blob.clone())
        .redirect(&format!("{cdn_path}?sig=abc"))
        .start()
        .await;
    let (larder, _secrets) = larder_with_credentials(&up).await;

    let r = no_hang("GET blob", client::get(larder.addr(), &blob_path(&d))).await;
    assert_eq!((r.status(), &r.end), (200, &End::Complete));
    assert!(r.body == blob, "exact bytes");
    assert_eq!(up.requests("GET", &cdn_path), 1, "the relative Location was resolved on the upstream: {:?}", up.log());
    larder.wait_committed(&d).await;
}

#[tokio::test]
async fn a_redirect_target_that_challenges_gets_no_credentials() {
    // The "CDN" asks for credentials itself.
    let cdn = Recorder::start(
        OTHER_HOST,
        b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"cdn\"\r\n\
          Content-Length: 0\r\nConnection: close\r\n\r\n"
            .to_vec(),
    )
    .await;
    let blob = fake::random_bytes(64 * KIB, 301);
    let d = digest(&blob);
    let up = FakeUpstream::builder()
        .challenge(r#"Basic realm="fake""#)
        .accept_authorization(&basic_authorization())
        .blob(blob)
        .redirect(&format!("http://{}/cdn/{d}", cdn.addr()))
        .start()
        .await;
    let (larder, _secrets) = larder_with_credentials(&up).await;

    let r = no_hang("GET blob", client::get(larder.addr(), &blob_path(&d))).await;
    assert!(r.status() >= 400 && r.status() != 404, "an upstream failure, not {}", r.status());
    r.error_code();
    assert_eq!(cdn.heads().len(), 1, "the CDN was not retried with credentials: {:?}", cdn.heads());
    assert!(cdn.header_values("authorization").is_empty(), "{:?}", cdn.heads());
    assert!(!larder.blob_file(&d).exists());
}

#[tokio::test]
async fn redirect_loops_and_non_http_locations_are_502() {
    let trap = Recorder::cdn(OTHER_HOST, b"not the blob").await;
    let looping = fake::random_bytes(KIB, 400);
    let to_file = fake::random_bytes(KIB, 401);
    let to_ftp = fake::random_bytes(KIB, 402);
    let (dl, df, dt) = (digest(&looping), digest(&to_file), digest(&to_ftp));
    let up = FakeUpstream::builder()
        .blob(looping)
        .redirect(&blob_path(&dl))
        .blob(to_file)
        .redirect("file:///etc/passwd")
        .blob(to_ftp)
        .redirect(&format!("ftp://{}/cdn/{dt}", trap.addr()))
        .start()
        .await;
    let larder = Larder::start(&up).await;

    for round in 1..=2 {
        let r = no_hang("a redirect loop", client::get(larder.addr(), &blob_path(&dl))).await;
        assert_eq!(r.status(), 502, "redirect loop, round {round}");
        assert_eq!(r.error_code(), "UNAVAILABLE");
        // The first GET and 5 redirects followed; the 6th redirect is refused.
        assert_eq!(up.blob_gets(&dl), 6 * round, "at most 5 hops, nothing cached");
    }
    for (d, location) in [(&df, "file:///etc/passwd"), (&dt, "ftp://127.0.0.2")] {
        let r = no_hang(location, client::get(larder.addr(), &blob_path(d))).await;
        assert_eq!(r.status(), 502, "redirect to {location}");
        assert_eq!(r.error_code(), "UNAVAILABLE");
        assert_eq!(up.blob_gets(d), 1, "{location}");
    }
    assert_eq!(trap.connections(), 0, "the ftp:// target was never dialed");
    for d in [&dl, &df, &dt] {
        assert!(!larder.blob_file(d).exists());
    }
}

// ---- 3. no open proxy -----------------------------------------------------------

#[tokio::test]
async fn hosts_named_by_a_client_are_404_and_never_dialed() {
    let trap = Recorder::cdn(OTHER_HOST, b"{}").await;
    let (m, md) = manifest();
    let blob = fake::random_bytes(KIB, 500);
    let bd = digest(&blob);
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, m.clone()).blob(blob).start().await;
    let larder = Larder::start(&up).await;
    let t = trap.addr();

    let paths = [
        format!("/v2/{REPO}/manifests/v1?ns=evil.example"),
        format!("/v2/{REPO}/manifests/v1?ns={t}"),
        format!("/v2/{REPO}/manifests/v1?ns=127.0.0.2"),
        format!("/v2/{REPO}/blobs/{bd}?ns=http://{t}/"),
        format!("/v2/{REPO}/tags/list?ns={t}"),
        format!("/v2/{REPO}/manifests/v1?ns={}.evil.example", fake::UPSTREAM_NAME),
        "/v2/evil.example/app/manifests/1".to_owned(),
        format!("/v2/{t}/app/manifests/1"),
        "/v2/127.0.0.2/app/manifests/1".to_owned(),
        format!("/v2/{t}/app/blobs/{bd}"),
        format!("/v2/{t}/app/tags/list"),
        "/v2/localhost/app/manifests/1".to_owned(),
        format!("/v2/localhost:{}/app/manifests/1", t.port()),
    ];
    for path in &paths {
        let r = no_hang(path, client::get(larder.addr(), path)).await;
        assert_eq!(r.status(), 404, "{path}");
        assert_eq!(r.error_code(), "NAME_UNKNOWN", "{path}");
    }
    assert_eq!(up.total_requests(), 0, "the configured upstream saw nothing: {:?}", up.log());
    assert_eq!(trap.connections(), 0, "127.0.0.2 saw nothing: {:?}", trap.heads());

    // The configured name is the only way out, and it leads to the upstream.
    let r = client::get(larder.addr(), &format!("/v2/{}/{REPO}/manifests/v1", fake::UPSTREAM_NAME)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.header("docker-content-digest"), Some(md.as_str()));
    assert_eq!(up.total_requests(), 1);
}

#[tokio::test]
async fn proxy_style_requests_never_reach_the_host_they_name() {
    let trap = Recorder::cdn(OTHER_HOST, b"{}").await;
    let (m, md) = manifest();
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, m).start().await;
    let larder = Larder::start(&up).await;
    let t = trap.addr();

    // An absolute-form target and Host/forwarding headers naming 127.0.0.2:
    // larder reads only the path, so these go to the configured upstream.
    let absolute = format!("GET http://{t}{} HTTP/1.1\r\nHost: {t}\r\nConnection: close\r\n\r\n", manifest_path("v1"));
    let forwarded = format!(
        "GET {} HTTP/1.1\r\nHost: {t}\r\nX-Forwarded-Host: {t}\r\nForwarded: host={t}\r\nConnection: close\r\n\r\n",
        manifest_path("v1")
    );
    for raw in [&absolute, &forwarded] {
        let a = exchange(larder.addr(), raw.as_bytes()).await;
        assert_eq!(a.status, 200, "{raw:?}");
        assert_eq!(a.header("docker-content-digest"), Some(md.as_str()), "served from the configured upstream");
    }
    // CONNECT is no tunnel.
    let connect = format!("CONNECT {t} HTTP/1.1\r\nHost: {t}\r\nConnection: close\r\n\r\n");
    let a = exchange(larder.addr(), connect.as_bytes()).await;
    assert!((400..500).contains(&a.status), "CONNECT answered {}", a.status);

    assert_eq!(trap.connections(), 0, "127.0.0.2 saw nothing: {:?}", trap.heads());
}

// ---- 4. repositories do not leak into each other ----------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_blob_cached_for_a_private_repository_is_not_served_for_another() {
    let credentials = Credentials::new("larder", "s3cret");
    let origin = Origin::with_token_auth(credentials.clone()).await;
    let secret = ImageBuilder::oci().layers(&[64 * KIB]).push(&origin, "private/secret", "v1").await;
    ImageBuilder::oci().layers(&[16 * KIB]).push(&origin, "public/app", "v1").await;
    let larder = common::Larder::builder().upstream(Upstream::from(&origin).credentials(&credentials)).start().await;
    let addr: SocketAddr = larder.host_port().parse().expect("larder's address");

    // larder, with its credentials, pulls the private image: all cached.
    skopeo::pull(&larder.image_ref(&secret.reference()), false)
        .await
        .unwrap_or_else(|e| panic!("pulling private/secret through larder: {e}"));
    let layer = secret.manifests[0].layers[0].digest.clone();
    let config = secret.manifests[0].config.digest.clone();

    // Asked for through public/app, which does not hold them.
    let mark = origin.log_mark().await;
    for d in [&layer, &config] {
        for path in [format!("/v2/public/app/blobs/{d}"), format!("/v2/{}/public/app/blobs/{d}", common::ORIGIN_NAME)] {
            let r = client::get(addr, &path).await;
            assert_eq!(r.status(), 404, "GET {path}: {:?}", String::from_utf8_lossy(&r.body));
            assert_eq!(r.error_code(), "BLOB_UNKNOWN", "GET {path}");
            let a = exchange(addr, &request("HEAD", &path, "")).await;
            assert_eq!(a.status, 404, "HEAD {path}");
        }
    }
    let path = format!("/v2/public/app/manifests/{}", secret.digest);
    let r = client::get_with(addr, &path, &[("Accept", OCI_MANIFEST)]).await;
    assert_eq!(r.status(), 404, "GET {path}: {:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.error_code(), "MANIFEST_UNKNOWN", "GET {path}");
    assert_eq!(exchange(addr, &request("HEAD", &path, "")).await.status, 404, "HEAD {path}");

    // Each refusal followed an upstream HEAD that said "not here"; nothing
    // was downloaded for public/app.
    let log = origin.requests_since(&mark).await;
    eprintln!("origin requests while asking through public/app:\n{log}");
    let head_404 = |p: &str| log.entries().iter().any(|e| e.method == "HEAD" && e.path() == p && e.status == 404);
    assert!(head_404(&format!("/v2/public/app/blobs/{layer}")), "a HEAD checked the layer:\n{log}");
    assert!(head_404(&format!("/v2/public/app/manifests/{}", secret.digest)), "a HEAD checked the manifest:\n{log}");
    assert_eq!(log.blob_gets(), 0, "no blob GET:\n{log}");

    // Control: a repository that does hold the layer gets it, after one HEAD
    // and without a download.
    let creds = credentials.colon_joined();
    skopeo::run(&[
        "copy".to_owned(),
        "--src-tls-verify=false".to_owned(),
        "--dest-tls-verify=false".to_owned(),
        format!("--src-creds={creds}"),
        format!("--dest-creds={creds}"),
        origin.image_ref("private/secret:v1"),
        origin.image_ref("public/shared:v1"),
    ])
    .await
    .unwrap_or_else(|e| panic!("copying the image to public/shared at the origin: {e}"));
    let mark = origin.log_mark().await;
    let r = client::get(addr, &format!("/v2/public/shared/blobs/{layer}")).await;
    assert_eq!((r.status(), &r.end), (200, &End::Complete));
    assert_eq!(digest(&r.body), layer);
    let log = origin.requests_since(&mark).await;
    let head_200 = log
        .entries()
        .iter()
        .any(|e| e.method == "HEAD" && e.path() == format!("/v2/public/shared/blobs/{layer}") && e.status == 200);
    assert!(head_200, "membership confirmed by HEAD:\n{log}");
    assert_eq!(log.blob_gets(), 0, "served from the cache:\n{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_blob_still_downloading_for_one_repository_is_not_served_for_another() {
    let blob = fake::random_bytes(2 * MIB, 700);
    let d = digest(&blob);
    let (private, public) = (format!("/v2/private/secret/blobs/{d}"), format!("/v2/public/app/blobs/{d}"));
    // Only private/secret has it; its download stalls halfway.
    let up = FakeUpstream::builder().blob(blob.clone()).only_in("private/secret").stall_after(MIB).start().await;
    let larder = Larder::start(&up).await;

    let downloading = client::open(larder.addr(), &private).await;
    assert_eq!(downloading.status(), 200);
    fake::wait_until("the download is halfway", || up.bytes_sent(&d) >= MIB as u64).await;

    // public/app asks for the same digest while it is being filled.
    let r = client::get(larder.addr(), &public).await;
    assert_eq!(r.status(), 404, "GET mid-download: {:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.error_code(), "BLOB_UNKNOWN");
    assert_eq!(exchange(larder.addr(), &request("HEAD", &public, "")).await.status, 404, "HEAD mid-download");

    // The download completes for private/secret, and is committed.
    up.release(&d);
    let (len, got, end) = downloading.hash_to_end().await;
    assert_eq!((len, got.as_str(), end), (blob.len() as u64, d.as_str(), End::Complete));
    larder.wait_committed(&d).await;

    // Committed, and still not public/app's.
    let r = client::get(larder.addr(), &public).await;
    assert_eq!(r.status(), 404, "GET after commit");
    assert_eq!(r.error_code(), "BLOB_UNKNOWN");
    assert_eq!(up.requests("HEAD", &public), 3, "each answer followed an upstream HEAD: {:?}", up.log());
    assert_eq!(up.requests("GET", &public), 0, "nothing was downloaded for public/app");
    assert_eq!(up.blob_gets(&d), 1, "one download, for private/secret");
}

#[tokio::test]
async fn a_blob_cached_from_one_upstream_is_not_served_through_another() {
    let blob = fake::random_bytes(64 * KIB, 800);
    let d = digest(&blob);
    // Two upstreams, the same repository name on both; only "a" has the blob.
    let a = FakeUpstream::builder().blob(blob.clone()).only_in(REPO).start().await;
    let b = FakeUpstream::builder().start().await;
    let larder = common::Larder::builder()
        .upstream(Upstream::new("a.test", &a.url()).default(true))
        .upstream(Upstream::new("b.test", &b.url()))
        .start()
        .await;
    let addr: SocketAddr = larder.host_port().parse().expect("larder's address");

    let r = client::get(addr, &format!("/v2/a.test/{REPO}/blobs/{d}")).await;
    assert_eq!((r.status(), &r.end), (200, &End::Complete));
    assert!(r.body == blob);

    for path in [format!("/v2/b.test/{REPO}/blobs/{d}"), format!("/v2/{REPO}/blobs/{d}?ns=b.test")] {
        let r = client::get(addr, &path).await;
        assert_eq!(r.status(), 404, "GET {path}: {:?}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.error_code(), "BLOB_UNKNOWN", "GET {path}");
    }
    assert_eq!(b.requests("HEAD", &blob_path(&d)), 2, "upstream b was asked each time: {:?}", b.log());
    assert_eq!(b.blob_gets(&d), 0);
    assert_eq!(a.blob_gets(&d), 1, "one download, through a");
}

// ---- 5. poisoned content ---------------------------------------------------------

#[tokio::test]
async fn a_manifest_whose_media_type_disagrees_with_its_content_type_is_502_and_not_cached() {
    // The JSON says OCI manifest; Content-Type says Docker v2.
    let (m, md) = manifest();
    let up = FakeUpstream::builder().manifest(REPO, "v1", DOCKER_MANIFEST, m).start().await;
    let larder = Larder::start(&up).await;

    for (n, reference) in ["v1", md.as_str(), "v1"].iter().enumerate() {
        let r = no_hang(reference, client::get(larder.addr(), &manifest_path(reference))).await;
        assert_eq!(r.status(), 502, "GET {reference}");
        assert_eq!(r.error_code(), "UNAVAILABLE");
        assert_eq!(up.manifest_gets("v1") + up.manifest_gets(&md), n + 1, "nothing was cached");
    }
    assert!(larder.logs().contains("disagrees with mediaType"), "larder logs why:\n{}", larder.logs());
}

#[tokio::test]
async fn a_manifest_over_4_mib_is_502_not_cached_and_not_read_into_memory() {
    let padded = |len: usize| {
        let json = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(b"c"), "size": 1 },
            "layers": [],
            "annotations": { "padding": "x".repeat(len) },
        });
        Bytes::from(serde_json::to_vec(&json).expect("JSON"))
    };
    // 5 MiB with Content-Length; 48 MiB chunked, so that only a limit on
    // the bytes read can stop it.
    let up = FakeUpstream::builder()
        .manifest(REPO, "big", OCI_MANIFEST, padded(5 * MIB))
        .manifest(REPO, "huge", OCI_MANIFEST, padded(48 * MIB))
        .chunked()
        .start()
        .await;
    let larder = Larder::start(&up).await;

    let before = peak_rss(larder.pid());
    for tag in ["big", "huge"] {
        for n in 1..=2 {
            let r = no_hang(tag, client::get(larder.addr(), &manifest_path(tag))).await;
            assert_eq!(r.status(), 502, "GET {tag} #{n}");
            assert_eq!(r.error_code(), "UNAVAILABLE");
            assert_eq!(up.manifest_gets(tag), n, "{tag}: nothing was cached");
        }
    }
    let grown = peak_rss(larder.pid()).saturating_sub(before);
    eprintln!("peak RSS grew by {grown} bytes");
    assert!(
        grown < 24 * MIB as u64,
        "larder's peak RSS grew by {} MiB for a refused 48 MiB manifest",
        grown / MIB as u64
    );
}

#[tokio::test]
async fn descriptor_urls_are_never_fetched() {
    let trap = Recorder::cdn(OTHER_HOST, b"foreign layer").await;
    // A "foreign layer" that only its `urls` entry, on 127.0.0.2, serves.
    let foreign = digest(b"foreign layer");
    let config = fake::random_bytes(256, 600);
    let m = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(&config), "size": 256 },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
            "digest": foreign,
            "size": 13,
            "urls": [format!("http://{}/layer", trap.addr())],
        }],
    });
    let m = Bytes::from(serde_json::to_vec(&m).expect("JSON"));
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, m).blob(config).start().await;
    let larder = Larder::start(&up).await;

    assert_eq!(client::get(larder.addr(), &manifest_path("v1")).await.status(), 200);
    let r = client::get(larder.addr(), &blob_path(&foreign)).await;
    assert_eq!(r.status(), 404, "upstream does not have it");
    assert_eq!(r.error_code(), "BLOB_UNKNOWN");
    assert_eq!(trap.connections(), 0, "the descriptor's urls were never fetched");
}

// ---- 6. hostile input at the edge --------------------------------------------

/// What is sent, the request bytes, the statuses allowed, and the OCI error
/// code when larder itself answers (hyper's own refusals have no body).
type Case<'a> = (&'a str, Vec<u8>, &'a [u16], Option<&'a str>);

#[tokio::test]
async fn hostile_requests_get_a_clean_4xx_and_touch_nothing() {
    let (m, _) = manifest();
    let up = FakeUpstream::builder().manifest(REPO, "v1", OCI_MANIFEST, m).start().await;
    let larder = Larder::start(&up).await;
    let sha512 = format!("sha512:{}", "ab".repeat(64));
    let valid = digest(b"x");

    let get = |path: &str| request("GET", path, "");
    let mut raw_nul = b"GET /v2/test/a".to_vec();
    raw_nul.extend_from_slice(b"\0pp/manifests/v1 HTTP/1.1\r\nHost: larder.test\r\nConnection: close\r\n\r\n");
    let many_headers: String = (0..200).map(|i| format!("X-Header-{i}: {i}\r\n")).collect();
    let cases: Vec<Case> = vec![
        ("`..` in the name", get("/v2/test/../app/manifests/v1"), &[400], Some("NAME_INVALID")),
        ("`..` past /v2", get("/v2/../../etc/passwd"), &[404], Some("NOT_FOUND")),
        ("`%2e%2e` in the name", get("/v2/%2e%2e/app/manifests/v1"), &[400], Some("NAME_INVALID")),
        ("`%2e%2e%2f` as a digest", get("/v2/test/app/blobs/%2e%2e%2f%2e%2e%2fetc"), &[400], Some("DIGEST_INVALID")),
        ("`%2f` in the name", get("/v2/test%2fapp/manifests/v1"), &[400], Some("NAME_INVALID")),
        ("`%00` in the name", get("/v2/test%00/app/manifests/v1"), &[400], Some("NAME_INVALID")),
        ("`%00` in the tag", get("/v2/test/app/manifests/v1%00"), &[404], Some("MANIFEST_UNKNOWN")),
        ("a NUL byte in the request line", raw_nul, &[400], None),
        ("a NUL byte in a header", request("GET", "/v2/", "X-Evil: a\0b\r\n"), &[400], None),
        ("an empty name component", get("/v2/test//app/manifests/v1"), &[400], Some("NAME_INVALID")),
        ("a 10 KB path", get(&format!("/v2/{}manifests/v1", "a/".repeat(5 * KIB))), &[400], Some("NAME_INVALID")),
        ("a 70 KB path", get(&format!("/v2/{}/manifests/v1", "a".repeat(70 * KIB))), &[400, 414], None),
        (
            "a 100 KB header on an unknown ns",
            request(
                "GET",
                &format!("{}?ns=evil.example", manifest_path("v1")),
                &format!("X-Big: {}\r\n", "b".repeat(100 * KIB)),
            ),
            &[404],
            Some("NAME_UNKNOWN"),
        ),
        (
            "a 1 MiB header",
            request("GET", &manifest_path("v1"), &format!("X-Big: {}\r\n", "b".repeat(MIB))),
            &[431],
            None,
        ),
        ("200 headers", request("GET", &manifest_path("v1"), &many_headers), &[431], None),
        ("an uppercase name", get("/v2/Test/App/manifests/v1"), &[400], Some("NAME_INVALID")),
        ("a non-ASCII name", get("/v2/tést/app/manifests/v1"), &[400], Some("NAME_INVALID")),
        (
            "a 10 KB ns",
            get(&format!("{}?ns={}", manifest_path("v1"), "n".repeat(10 * KIB))),
            &[404],
            Some("NAME_UNKNOWN"),
        ),
        ("sha256:totallywrong (manifest)", get(&manifest_path("sha256:totallywrong")), &[400], Some("DIGEST_INVALID")),
        ("sha256:totallywrong (blob)", get(&blob_path("sha256:totallywrong")), &[400], Some("DIGEST_INVALID")),
        (
            "an uppercase sha256",
            get(&blob_path(&valid.to_uppercase().replace("SHA256", "sha256"))),
            &[400],
            Some("DIGEST_INVALID"),
        ),
        ("sha512 (blob)", get(&blob_path(&sha512)), &[400], Some("DIGEST_INVALID")),
        ("sha512 (manifest)", get(&manifest_path(&sha512)), &[400], Some("DIGEST_INVALID")),
        ("tag .INVALID_MANIFEST_NAME", get(&manifest_path(".INVALID_MANIFEST_NAME")), &[404], Some("MANIFEST_UNKNOWN")),
        ("a 200-character tag", get(&manifest_path(&"t".repeat(200))), &[404], Some("MANIFEST_UNKNOWN")),
        ("PUT a manifest", request("PUT", &manifest_path("v1"), "Content-Length: 2\r\n"), &[405], Some("UNSUPPORTED")),
        ("DELETE a blob", request("DELETE", &blob_path(&valid), ""), &[405], Some("UNSUPPORTED")),
        ("PATCH", request("PATCH", &blob_path(&valid), ""), &[405], Some("UNSUPPORTED")),
        ("POST an upload", request("POST", &format!("/v2/{REPO}/blobs/uploads/"), ""), &[405], Some("UNSUPPORTED")),
        ("GET an upload", get(&format!("/v2/{REPO}/blobs/uploads/abc")), &[405], Some("UNSUPPORTED")),
        ("an unknown endpoint", get(&format!("/v2/{REPO}/unknown")), &[404], Some("NOT_FOUND")),
        ("outside /v2", get("/etc/passwd"), &[404], Some("NOT_FOUND")),
        (
            "TLS on the plain port",
            b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03garbage\r\n\r\n".to_vec(),
            &[400],
            None,
        ),
    ];

    for (what, raw, allowed, code) in &cases {
        let a = exchange(larder.addr(), raw).await;
        eprintln!("{what}: {} {:?}", a.status, a.error_code());
        assert!(
            allowed.contains(&a.status),
            "{what}: status {} (allowed {allowed:?}), body {:?}",
            a.status,
            String::from_utf8_lossy(&a.body)
        );
        if let Some(code) = code {
            assert_eq!(a.error_code().as_deref(), Some(*code), "{what}: body {:?}", String::from_utf8_lossy(&a.body));
        }
    }

    // Still serving; upstream and the cache untouched.
    let r = client::get(larder.addr(), "/v2/").await;
    assert_eq!(r.status(), 200, "larder still answers");
    assert_eq!(up.total_requests(), 0, "no request reached the upstream: {:?}", up.log());
    let cache = cache_dir(&larder);
    for sub in ["blobs", "tmp"] {
        let files = files_under(&cache.join(sub));
        assert!(files.is_empty(), "files appeared under {sub}/: {files:?}");
    }
}
