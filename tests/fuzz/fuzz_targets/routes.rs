//! The request router on arbitrary methods and request targets. Input: the
//! first byte picks the method (`G`ET, `H`EAD, `P`UT, p`O`ST, `D`ELETE,
//! p`A`TCH, op`T`IONS; any other byte picks by its value), the rest is the
//! request target (`/v2/...?ns=...`), skipped unless it parses as a `Uri`.
//!
//! Properties: no panic; only GET/HEAD on `/v2` routes; a route's repository
//! is a valid `RepoName` taken from the path, on a configured upstream, and
//! its endpoint is what the path ends with; every error is a 4xx that
//! renders to a response.
#![no_main]

use std::sync::LazyLock;

use http::{Method, Uri};
use larder::config::Config;
use larder::oci::{Reference, RepoName};
use larder::server::routes::{self, Endpoint, Parsed};
use larder::upstream::Upstreams;
use libfuzzer_sys::fuzz_target;

const CONFIG: &str = r#"
[[upstream]]
name = "docker.io"
url = "http://127.0.0.1:1"
default = true
aliases = ["index.docker.io", "registry-1.docker.io"]
library_namespace = true

[[upstream]]
name = "ghcr.io"
url = "http://127.0.0.1:1"
aliases = ["ghcr.example:5000", "mirror.ghcr.example"]

[[upstream]]
name = "quay.io"
url = "http://127.0.0.1:1"
"#;

const NAMES: [&str; 3] = ["docker.io", "ghcr.io", "quay.io"];

static UPSTREAMS: LazyLock<Upstreams> = LazyLock::new(|| {
    let config = Config::parse(CONFIG, "fuzz.toml", None).expect("fuzz config parses");
    Upstreams::new(&config).expect("fuzz upstreams build")
});

fn method(b: u8) -> Method {
    const OTHERS: [&str; 9] = ["GET", "HEAD", "PUT", "POST", "DELETE", "PATCH", "OPTIONS", "TRACE", "PURGE"];
    match b {
        b'G' => Method::GET,
        b'H' => Method::HEAD,
        b'P' => Method::PUT,
        b'O' => Method::POST,
        b'D' => Method::DELETE,
        b'A' => Method::PATCH,
        b'T' => Method::OPTIONS,
        b => Method::from_bytes(OTHERS[b as usize % OTHERS.len()].as_bytes()).unwrap(),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&m, target)) = data.split_first() else { return };
    let Ok(uri) = Uri::try_from(target) else { return };
    let method = method(m);
    let path = uri.path();
    match routes::parse(&method, &uri, &UPSTREAMS) {
        Ok(Parsed::Base) => {
            assert!(method == Method::GET || method == Method::HEAD, "{method} {uri} parsed as base");
            assert!(path.strip_prefix("/v2").is_some_and(|r| r.bytes().all(|b| b == b'/')), "base from {uri}");
        }
        Ok(Parsed::Repo(route)) => {
            assert!(method == Method::GET || method == Method::HEAD, "{method} {uri} parsed as a route");
            assert!(path.starts_with("/v2/") && path.len() <= routes::MAX_PATH_LEN, "route from {uri}");
            assert!(NAMES.contains(&route.upstream.name()), "upstream {}", route.upstream.name());

            let repo = route.repo.as_str();
            assert_eq!(
                repo.parse::<RepoName>().as_ref(),
                Ok(&route.repo),
                "{method} {uri}: the route's repository is not a valid name ({} bytes)",
                repo.len()
            );
            let unprefixed = repo.strip_prefix("library/").unwrap_or(repo);
            assert!(path.contains(repo) || path.contains(unprefixed), "repository {repo:?} not in {path:?}");

            match &route.endpoint {
                Endpoint::TagsList(query) => {
                    assert!(path.ends_with("/tags/list"), "{path:?}");
                    if let Some(q) = query {
                        for pair in q.split('&') {
                            assert!(pair.starts_with("n=") || pair.starts_with("last="), "query {q:?}");
                        }
                    }
                }
                Endpoint::Manifest(reference) => {
                    assert!(path.ends_with(&format!("/manifests/{reference}")), "{reference} from {path:?}");
                    if let Reference::Tag(t) = reference {
                        assert!(!t.as_str().contains(['/', ':']));
                    }
                }
                Endpoint::Blob(digest) => assert!(path.ends_with(&format!("/blobs/{digest}")), "{path:?}"),
                Endpoint::Referrers(digest, query) => {
                    assert!(path.ends_with(&format!("/referrers/{digest}")), "{path:?}");
                    if let Some(q) = query {
                        for pair in q.split('&') {
                            assert!(
                                ["artifactType=", "n=", "last="].iter().any(|k| pair.starts_with(k)),
                                "query {q:?}"
                            );
                        }
                    }
                }
                // Endpoints added later: covered by the checks above.
                #[allow(unreachable_patterns)]
                _ => {}
            }
        }
        Err(e) => {
            assert!(e.status().is_client_error(), "{method} {uri}: {e} is {}", e.status());
            let head = method == Method::HEAD;
            let resp = e.into_response(head);
            assert!(resp.status().is_client_error());
        }
    }
});
