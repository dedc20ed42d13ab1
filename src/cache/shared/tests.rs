//! Unit tests of the shared-tier client: key layout, ranges, lookups that time out, a dead endpoint.

use std::sync::atomic::Ordering;

use super::*;
use crate::config::Secret;

fn config(prefix: &str, endpoint: Option<&str>) -> SharedConfig {
    SharedConfig {
        bucket: "larder-cache".into(),
        prefix: prefix.into(),
        endpoint: endpoint.map(str::to_owned),
        region: "garage".into(),
        credentials: SharedCredentials::Static {
            access_key_id: Secret::new("GK0000"),
            secret_access_key: Secret::new("s3cret"),
            session_token: None,
        },
        max_age: None,
    }
}

#[test]
fn keys_follow_the_documented_layout() {
    let d = Digest::of(b"x");
    let hex = d.hex();
    let with_prefix = SharedStore::new(&config("mirror/v1", Some("http://127.0.0.1:3900"))).unwrap();
    assert_eq!(with_prefix.key(ObjectKind::Blob, &d), format!("mirror/v1/blobs/sha256/{}", hex.as_str()));
    assert_eq!(with_prefix.key(ObjectKind::Manifest, &d), format!("mirror/v1/manifests/sha256/{}", hex.as_str()));
    let at_root = SharedStore::new(&config("", None)).unwrap();
    assert_eq!(at_root.key(ObjectKind::Blob, &d), format!("blobs/sha256/{}", hex.as_str()));
    assert!(!format!("{at_root:?}").contains("s3cret"));
}

#[test]
fn ranges_map_to_object_store_ranges() {
    assert_eq!(get_range(..).unwrap(), None);
    assert_eq!(get_range(0..).unwrap(), None);
    assert_eq!(get_range(10..).unwrap(), Some(GetRange::Offset(10)));
    assert_eq!(get_range(10..20).unwrap(), Some(GetRange::Bounded(10..20)));
    assert_eq!(get_range(10..=19).unwrap(), Some(GetRange::Bounded(10..20)));
    assert_eq!(get_range(..5).unwrap(), Some(GetRange::Bounded(0..5)));
    assert!(get_range(5..5).is_err());
}

#[tokio::test]
async fn a_store_that_does_not_answer_costs_one_lookup_until_the_pause_ends() {
    // Accepts connections, never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    let hole = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            held.push(stream);
        }
    });
    let store = SharedStore::new(&config("", Some(&format!("http://127.0.0.1:{port}"))))
        .unwrap()
        .with_lookup_timeout(Duration::from_millis(200))
        .with_breaker(Duration::from_secs(600), Duration::from_secs(600));
    for _ in 0..5 {
        assert!(store.head(ObjectKind::Blob, &Digest::of(b"x")).await.is_err());
        assert!(store.get_blob(&Digest::of(b"y"), ..).await.is_err());
    }
    assert!(store.is_down());
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "one request reached the store; the other nine were skipped");
    hole.abort();
}

#[tokio::test]
async fn a_dead_endpoint_is_an_error() {
    // A port nothing listens on: connection refused, retried briefly.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let store = SharedStore::new(&config("", Some(&format!("http://127.0.0.1:{port}")))).unwrap();
    let started = std::time::Instant::now();
    let e = store.head(ObjectKind::Blob, &Digest::of(b"x")).await.unwrap_err();
    assert!(matches!(e, SharedError::Store(_)), "{e}");
    // Measured, not asserted (timings belong in benches).
    eprintln!("dead endpoint: HEAD failed after {:?}: {e}", started.elapsed());
}
