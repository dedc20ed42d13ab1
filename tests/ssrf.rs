//! Server-side request forgery through an upstream (docs/security.md,
//! "What larder never sends where"): a registry, its CDN or a front can
//! name any host in a `Location` or a token realm, and on a cloud node
//! `http://169.254.169.254/latest/meta-data/iam/security-credentials/…`
//! hands out the node's credentials to whoever asks. larder must not ask
//! for them, must not hand a client anything that is not a listing, and
//! must never follow https down to http.
//!
//! The address tests run in network namespaces of their own
//! (`common::isolation`): their loopback carries the metadata addresses, a
//! private one and public-looking documentation addresses (203.0.113.0/24),
//! made-up names resolve through an /etc/hosts of their own, and nothing
//! can leave. Each ends by counting what the hosts larder must not talk to
//! saw (a [`Recorder`] on each).

mod common;
mod fake;

use std::net::SocketAddr;

use common::metrics::{ADMIN_LISTEN, metric};
use common::{Larder, TestCa, TlsFront, Upstream, http, isolation};
use fake::recorder::{Recorder, http_response, redirect_to};
use fake::{digest, random_bytes};

/// What a metadata service hands whoever asks.
const STOLEN: &str = "s3cret-from-the-metadata-service";
/// The upstream registry's address and name (public-looking).
const REGISTRY_IP: &str = "203.0.113.7";
const REGISTRY_NAME: &str = "registry.example.com";
/// A CDN on another public-looking address.
const CDN_IP: &str = "203.0.113.8";
const CDN_NAME: &str = "cdn.example.com";
/// An address on a private network.
const PRIVATE_IP: &str = "10.1.2.3";

fn metadata_answer() -> Vec<u8> {
    let body = format!(
        r#"{{"Code":"Success","Type":"AWS-HMAC","AccessKeyId":"ASIAEXAMPLE","SecretAccessKey":"{STOLEN}","Token":"t"}}"#
    );
    http_response("200 OK", "text/plain", body.as_bytes())
}

/// The path of a request line (`GET /path HTTP/1.1`).
fn path_of(request_line: &str) -> String {
    request_line.split_whitespace().nth(1).unwrap_or_default().to_owned()
}

async fn get(larder: &Larder, path: &str) -> (u16, String) {
    let resp = http::manifest_get(&http::client(), &format!("{}{path}", larder.url()))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap_or_default())
}

async fn refused(larder: &Larder, reason: &str) -> f64 {
    metric(larder, &format!("larder_upstream_redirects_refused_total{{reason=\"{reason}\"}}")).await
}

#[tokio::test]
async fn redirects_and_realms_to_metadata_loopback_or_private_addresses_are_never_dialled() {
    let Some(_ns) = isolation::isolated(
        "redirects_and_realms_to_metadata_loopback_or_private_addresses_are_never_dialled",
        &["169.254.169.254/32", "fd00:ec2::254/128", "203.0.113.7/32", "203.0.113.8/32", "10.1.2.3/32"],
        &[
            (REGISTRY_NAME, REGISTRY_IP),
            (CDN_NAME, CDN_IP),
            ("metadata.test", "169.254.169.254"),
            ("auth.example.com", "169.254.169.254"),
            ("mapped.test", "::ffff:169.254.169.254"),
        ],
    ) else {
        return;
    };
    // Everywhere larder must not go, each answering what it would hand out.
    let metadata = Recorder::routed("169.254.169.254:80".parse().unwrap(), |_| metadata_answer()).await;
    let metadata6 = Recorder::routed("[fd00:ec2::254]:80".parse().unwrap(), |_| metadata_answer()).await;
    let loopback = Recorder::routed("127.0.0.1:0".parse().unwrap(), |_| metadata_answer()).await;
    let private = Recorder::routed(SocketAddr::new(PRIVATE_IP.parse().unwrap(), 0), |_| metadata_answer()).await;
    // A CDN on a public address: where a redirect may go.
    let cdn = Recorder::routed(SocketAddr::new(CDN_IP.parse().unwrap(), 0), |_| {
        http_response("200 OK", "application/json", br#"{"name":"test/app","tags":["v1"]}"#)
    })
    .await;

    let blob = random_bytes(1024, 7);
    let blob_digest = digest(&blob);
    let (loopback_port, private_port, cdn_port) = (loopback.addr().port(), private.addr().port(), cdn.addr().port());
    let imds = "latest/meta-data/iam/security-credentials/node-role";
    let registry = Recorder::routed(SocketAddr::new(REGISTRY_IP.parse().unwrap(), 0), move |line| {
        let path = path_of(line);
        let to = match path.as_str() {
            "/v2/test/app/tags/list" => format!("http://{CDN_NAME}:{cdn_port}/lists/test-app"),
            "/v2/ssrf/ipv4/tags/list" => format!("http://169.254.169.254/{imds}"),
            "/v2/ssrf/ipv6/tags/list" => format!("http://[fd00:ec2::254]/{imds}"),
            "/v2/ssrf/name/tags/list" => format!("http://metadata.test/{imds}"),
            "/v2/ssrf/mapped/tags/list" => format!("http://[::ffff:169.254.169.254]/{imds}"),
            "/v2/ssrf/mapped-name/tags/list" => format!("http://mapped.test/{imds}"),
            "/v2/ssrf/loopback/tags/list" => format!("http://127.0.0.1:{loopback_port}/purge"),
            "/v2/ssrf/private/tags/list" => format!("http://{PRIVATE_IP}:{private_port}/"),
            "/v2/ssrf/ipv4/manifests/v1" => format!("http://169.254.169.254/{imds}"),
            p if p.starts_with("/v2/ssrf/ipv4/blobs/") => format!("http://169.254.169.254/{imds}"),
            // The registry's own challenge names a realm on its own site
            // whose name resolves to the metadata address.
            "/v2/realm/app/manifests/v1" => {
                let challenge = r#"Bearer realm="http://auth.example.com/token",service="registry.example.com""#;
                return format!(
                    "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: {challenge}\r\nContent-Length: 0\r\n\
                     Connection: close\r\n\r\n"
                )
                .into_bytes();
            }
            _ => return http_response("404 Not Found", "application/json", br#"{"errors":[]}"#),
        };
        redirect_to(&to)
    })
    .await;
    let url = format!("http://{REGISTRY_NAME}:{}", registry.addr().port());
    let larder = Larder::builder()
        .upstream(Upstream::new("fake.test", &url).default(true))
        .server_line(ADMIN_LISTEN)
        .start()
        .await;

    // A redirect to a public address is followed: the path works.
    let (status, body) = get(&larder, "/v2/test/app/tags/list").await;
    assert_eq!((status, body.as_str()), (200, r#"{"name":"test/app","tags":["v1"]}"#));
    assert_eq!(cdn.connections(), 1);

    for (path, what) in [
        ("/v2/ssrf/ipv4/tags/list", "the IPv4 metadata address"),
        ("/v2/ssrf/ipv6/tags/list", "the IPv6 metadata address"),
        ("/v2/ssrf/name/tags/list", "a name that resolves to the metadata address"),
        ("/v2/ssrf/mapped/tags/list", "the metadata address mapped into IPv6"),
        ("/v2/ssrf/mapped-name/tags/list", "a name that resolves to the mapped metadata address"),
        ("/v2/ssrf/ipv4/manifests/v1", "the metadata address, for a manifest"),
        (&format!("/v2/ssrf/ipv4/blobs/{blob_digest}"), "the metadata address, for a blob"),
        ("/v2/realm/app/manifests/v1", "a token realm whose name resolves to the metadata address"),
        ("/v2/ssrf/loopback/tags/list", "a service on larder's own loopback"),
        ("/v2/ssrf/private/tags/list", "a private network"),
    ] {
        let (status, body) = get(&larder, path).await;
        assert_eq!(status, 502, "{what}: {body}");
        assert!(body.contains("UNAVAILABLE") && !body.contains(STOLEN), "{what}: {body}");
    }

    assert_eq!(metadata.connections(), 0, "the metadata service was dialled: {:?}", metadata.heads());
    assert_eq!(metadata6.connections(), 0, "the IPv6 metadata service was dialled");
    assert_eq!(loopback.connections(), 0, "a loopback service was dialled");
    assert_eq!(private.connections(), 0, "a private address was dialled");
    assert_eq!(refused(&larder, "metadata").await, 8.0);
    assert_eq!(refused(&larder, "loopback").await, 1.0);
    assert_eq!(refused(&larder, "private").await, 1.0);
    assert!(!larder.log().contains(STOLEN));
}

/// IPv6 addresses that carry 169.254.169.254 (docs/security.md; issue 32
/// item 8), each on the namespace's loopback with a metadata service
/// listening on it, and the name that resolves to it where there is one.
const CARRIERS: [(&str, &str, Option<&str>); 9] = [
    ("6to4", "2002:a9fe:a9fe::1", Some("sixto4.test")),
    ("NAT64 local-use, /96 layout", "64:ff9b:1::a9fe:a9fe", Some("nat64-local.test")),
    ("NAT64 local-use, /48 layout", "64:ff9b:1:a9fe:a9:fe00::", None),
    ("NAT64 well-known", "64:ff9b::a9fe:a9fe", Some("nat64.test")),
    ("IPv4-translated", "::ffff:0:a9fe:a9fe", Some("translated.test")),
    ("IPv4-compatible", "::a9fe:a9fe", Some("compatible.test")),
    ("Teredo, as the client", "2001:0:cb00:7107::5601:5601", Some("teredo.test")),
    ("Teredo, as the server", "2001:0:a9fe:a9fe:8000:ffff:34ff:8ef8", None),
    ("ISATAP", "2001:db8::5efe:a9fe:a9fe", Some("isatap.test")),
];
/// 6to4 of 203.0.113.8 (public-looking): where a redirect may go.
const PUBLIC_6TO4: &str = "2002:cb00:7108::1";

#[tokio::test]
async fn ipv6_forms_that_carry_the_metadata_address_are_never_dialled() {
    let mut addresses: Vec<String> = CARRIERS.iter().map(|(_, a, _)| format!("{a}/128")).collect();
    addresses.extend([format!("{REGISTRY_IP}/32"), format!("{PUBLIC_6TO4}/128")]);
    let mut hosts: Vec<(&str, &str)> = CARRIERS.iter().filter_map(|(_, a, name)| name.map(|n| (n, *a))).collect();
    hosts.extend([
        (REGISTRY_NAME, REGISTRY_IP),
        ("cdn6.example.com", PUBLIC_6TO4),
        // One public address and one carrier: refused whole.
        ("mixed.test", PUBLIC_6TO4),
        ("mixed.test", CARRIERS[0].1),
    ]);
    let Some(_ns) = isolation::isolated(
        "ipv6_forms_that_carry_the_metadata_address_are_never_dialled",
        &addresses.iter().map(String::as_str).collect::<Vec<_>>(),
        &hosts,
    ) else {
        return;
    };
    // A metadata service on every carrier, where a dial would land.
    let mut services = Vec::new();
    for (form, address, _) in CARRIERS {
        let at = SocketAddr::new(address.parse().unwrap(), 80);
        services.push((form, Recorder::routed(at, |_| metadata_answer()).await));
    }
    let cdn = Recorder::routed(SocketAddr::new(PUBLIC_6TO4.parse().unwrap(), 0), |_| {
        http_response("200 OK", "application/json", br#"{"name":"test/app","tags":["v1"]}"#)
    })
    .await;

    // Every way to write each carrier in a Location: the address as it is,
    // in capitals, written out in full, with its last 32 bits dotted, by
    // name. Then ways the URL parser refuses before anything is dialled:
    // a zone id (encoded or not) and IPv4 tails in hex, octal, with
    // leading zeros or as one number.
    let imds = "latest/meta-data/iam/security-credentials/node-role";
    let mut targets: Vec<(String, String)> = Vec::new();
    for (form, address, name) in CARRIERS {
        let ip: std::net::Ipv6Addr = address.parse().unwrap();
        let o = ip.octets();
        let (a, b, c, d) = (o[12], o[13], o[14], o[15]);
        let s = ip.segments();
        let full = s.iter().map(|x| format!("{x:04x}")).collect::<Vec<_>>().join(":");
        let dotted =
            format!("{}:{a}.{b}.{c}.{d}", s[..6].iter().map(|x| format!("{x:x}")).collect::<Vec<_>>().join(":"));
        for written in [
            format!("[{address}]"),
            format!("[{}]", address.to_uppercase()),
            format!("[{full}]"),
            format!("[{dotted}]"),
        ] {
            targets.push((format!("{form}, written {written}"), format!("http://{written}/{imds}")));
        }
        if let Some(name) = name {
            targets.push((format!("{form}, by the name {name}"), format!("http://{name}/{imds}")));
        }
    }
    targets.push((
        "a name with a public address and a 6to4 carrier".to_owned(),
        format!("http://mixed.test:{}/{imds}", cdn.addr().port()),
    ));
    let unparsable: Vec<String> = [
        "[2002:a9fe:a9fe::1%25lo]",
        "[2002:a9fe:a9fe::1%lo]",
        "[64:ff9b:1::0xa9.0xfe.0xa9.0xfe]",
        "[64:ff9b:1::0251.0376.0251.0376]",
        "[::ffff:0:169.254.169.0254]",
        "[::ffff:0:2852039166]",
    ]
    .iter()
    .map(|written| format!("http://{written}/{imds}"))
    .collect();
    let cdn_port = cdn.addr().port();
    let routes: Vec<(String, String)> = targets
        .iter()
        .map(|(_, to)| to)
        .chain(&unparsable)
        .enumerate()
        .map(|(i, to)| (format!("/v2/ssrf/carrier{i}/tags/list"), to.clone()))
        .chain([("/v2/test/app/tags/list".to_owned(), format!("http://cdn6.example.com:{cdn_port}/lists/test-app"))])
        .collect();
    let registry = Recorder::routed(SocketAddr::new(REGISTRY_IP.parse().unwrap(), 0), move |line| {
        let path = path_of(line);
        match routes.iter().find(|(p, _)| *p == path) {
            Some((_, to)) => redirect_to(to),
            None => http_response("404 Not Found", "application/json", br#"{"errors":[]}"#),
        }
    })
    .await;
    let url = format!("http://{REGISTRY_NAME}:{}", registry.addr().port());
    let larder = Larder::builder()
        .upstream(Upstream::new("fake.test", &url).default(true))
        .server_line(ADMIN_LISTEN)
        .start()
        .await;

    // A 6to4 address of a public address is followed: the guard judges
    // what a form carries, not the form.
    let (status, body) = get(&larder, "/v2/test/app/tags/list").await;
    assert_eq!((status, body.as_str()), (200, r#"{"name":"test/app","tags":["v1"]}"#));
    assert_eq!(cdn.connections(), 1);

    let whats = targets.iter().map(|(what, _)| what.as_str()).chain(unparsable.iter().map(String::as_str));
    for (i, what) in whats.enumerate() {
        let (status, body) = get(&larder, &format!("/v2/ssrf/carrier{i}/tags/list")).await;
        assert_eq!(status, 502, "{what}: {body}");
        assert!(body.contains("UNAVAILABLE") && !body.contains(STOLEN), "{what}: {body}");
    }

    let dialled: Vec<String> = services
        .iter()
        .filter(|(_, service)| service.connections() > 0)
        .map(|(form, service)| format!("{form}: {} connections", service.connections()))
        .collect();
    assert!(dialled.is_empty(), "metadata services dialled through the carriers: {dialled:#?}");
    assert_eq!(refused(&larder, "metadata").await, targets.len() as f64, "each carrier refused by the guard");
    assert_eq!(cdn.connections(), 1, "nor was the public address of the mixed name dialled");
    assert!(larder.log().contains("(6to4, carrying 169.254.169.254)"), "the log names what the address carries");
    assert!(!larder.log().contains(STOLEN));
}

#[tokio::test]
async fn a_private_registry_may_redirect_within_its_network_or_to_trusted_networks_but_never_to_metadata() {
    let Some(_ns) = isolation::isolated(
        "a_private_registry_may_redirect_within_its_network_or_to_trusted_networks_but_never_to_metadata",
        &["169.254.169.254/32", "10.1.2.3/32", "10.1.2.4/32", "192.0.2.10/32"],
        &[],
    ) else {
        return;
    };
    let list = |name: &str| {
        http_response("200 OK", "application/json", format!(r#"{{"name":"{name}","tags":["v1"]}}"#).as_bytes())
    };
    let metadata = Recorder::routed("169.254.169.254:80".parse().unwrap(), |_| metadata_answer()).await;
    let storage = Recorder::routed("10.1.2.4:0".parse().unwrap(), move |_| list("team/app")).await;
    let (storage_port, imds) = (storage.addr().port(), "latest/meta-data/");
    let registry = Recorder::routed("10.1.2.3:0".parse().unwrap(), move |line| match path_of(line).as_str() {
        "/v2/team/app/tags/list" => redirect_to(&format!("http://10.1.2.4:{storage_port}/list")),
        "/v2/team/metadata/tags/list" => redirect_to(&format!("http://169.254.169.254/{imds}")),
        _ => http_response("404 Not Found", "application/json", b"{}"),
    })
    .await;
    let url = format!("http://{}", registry.addr());
    let larder = Larder::builder()
        .upstream(Upstream::new("private.test", &url).default(true))
        .server_line(ADMIN_LISTEN)
        .start()
        .await;

    let (status, body) = get(&larder, "/v2/team/app/tags/list").await;
    assert_eq!(status, 200, "its own storage on its own private network: {body}");
    assert_eq!(storage.connections(), 1);
    let (status, _) = get(&larder, "/v2/team/metadata/tags/list").await;
    assert_eq!(status, 502, "a metadata address is never allowed by the registry's own class");
    assert_eq!(metadata.connections(), 0);
    assert_eq!(refused(&larder, "metadata").await, 1.0);

    // A public registry whose CDN lives in a network the operator named.
    let cdn = Recorder::routed("10.1.2.4:0".parse().unwrap(), move |_| list("team/app")).await;
    let cdn_port = cdn.addr().port();
    let public = Recorder::routed("192.0.2.10:0".parse().unwrap(), move |_| {
        redirect_to(&format!("http://10.1.2.4:{cdn_port}/list"))
    })
    .await;
    let url = format!("http://{}", public.addr());
    let untrusted = Larder::builder().upstream(Upstream::new("public.test", &url).default(true)).start().await;
    assert_eq!(get(&untrusted, "/v2/team/app/tags/list").await.0, 502, "refused without trusted_networks");
    assert_eq!(cdn.connections(), 0);
    let trusted = Larder::builder()
        .upstream(Upstream::new("public.test", &url).default(true).line(r#"trusted_networks = ["10.1.2.0/24"]"#))
        .start()
        .await;
    assert_eq!(get(&trusted, "/v2/team/app/tags/list").await.0, 200, "allowed by trusted_networks");
    assert_eq!(cdn.connections(), 1);
}

#[tokio::test]
async fn an_https_upstream_is_never_followed_down_to_http() {
    // The address rules allow the target (loopback, as the upstream's
    // own): only the downgrade refuses it.
    let plain = Recorder::routed("127.0.0.1:0".parse().unwrap(), |_| {
        http_response("200 OK", "application/json", br#"{"name":"team/app","tags":["v1"]}"#)
    })
    .await;
    let plain_port = plain.addr().port();
    let backend = Recorder::routed("127.0.0.1:0".parse().unwrap(), move |line| match path_of(line).as_str() {
        "/v2/team/app/tags/list" => redirect_to(&format!("http://127.0.0.1:{plain_port}/list")),
        "/v2/team/secure/tags/list" => redirect_to("/v2/team/secure/list"),
        "/v2/team/secure/list" => {
            http_response("200 OK", "application/json", br#"{"name":"team/secure","tags":["v2"]}"#)
        }
        _ => http_response("404 Not Found", "application/json", b"{}"),
    })
    .await;
    let ca = TestCa::new();
    let front = TlsFront::start(&ca, backend.addr().port()).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = ca.write_ca(dir.path());
    let larder = Larder::builder()
        .upstream(
            Upstream::new("secure.test", &front.url())
                .default(true)
                .line(&format!("ca_file = {:?}", ca_file.display().to_string())),
        )
        .server_line(ADMIN_LISTEN)
        .start()
        .await;

    let (status, body) = get(&larder, "/v2/team/secure/tags/list").await;
    assert_eq!((status, body.as_str()), (200, r#"{"name":"team/secure","tags":["v2"]}"#), "https to https is followed");
    let (status, body) = get(&larder, "/v2/team/app/tags/list").await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(plain.connections(), 0, "the cleartext target was dialled");
    assert_eq!(refused(&larder, "downgrade").await, 1.0);
}

#[tokio::test]
async fn a_listing_that_is_not_a_listing_is_never_relayed() {
    let secret = format!(r#"{{"Code":"Success","AccessKeyId":"ASIAEXAMPLE","SecretAccessKey":"{STOLEN}"}}"#);
    let manifest = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
    let registry = Recorder::routed("127.0.0.1:0".parse().unwrap(), move |line| {
        let path = path_of(line);
        if path.starts_with("/v2/team/app/tags/list") || path.starts_with("/v2/team/app/referrers/") {
            return http_response("200 OK", "application/json", secret.as_bytes());
        }
        if path.starts_with("/v2/team/fine/tags/list") {
            let body = br#"{"name":"team/fine","tags":["b","a"],"extra":{"SecretAccessKey":"x"}}"#;
            return http_response("200 OK", "text/html", body);
        }
        http_response("404 Not Found", "application/json", b"{}")
    })
    .await;
    let url = format!("http://{}", registry.addr());
    let larder = Larder::builder()
        .upstream(Upstream::new("plain.test", &url).default(true))
        .server_line(ADMIN_LISTEN)
        .start()
        .await;

    for (path, listing) in
        [("/v2/team/app/tags/list".to_owned(), "tags"), (format!("/v2/team/app/referrers/{manifest}"), "referrers")]
    {
        let (status, body) = get(&larder, &path).await;
        assert_eq!(status, 502, "{path}: {body}");
        assert!(!body.contains(STOLEN) && !body.contains("AccessKeyId"), "{path}: {body}");
        let series = format!("larder_upstream_listings_refused_total{{listing=\"{listing}\",upstream=\"plain.test\"}}");
        assert_eq!(metric(&larder, &series).await, 1.0, "{series}");
    }
    // A real tag list is written anew: only `name` and `tags`, as JSON.
    let resp = http::client().get(format!("{}/v2/team/fine/tags/list", larder.url())).send().await.unwrap();
    assert_eq!(resp.headers()["content-type"], "application/json");
    assert_eq!(resp.text().await.unwrap(), r#"{"name":"team/fine","tags":["a","b"]}"#);
    assert!(!larder.log().contains(STOLEN), "the refused body is not logged either");
}
