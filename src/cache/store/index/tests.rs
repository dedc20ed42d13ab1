//! The index's tests: rows, the access order, purges, migrations from
//! older schemas, the running byte totals and the first open after a crash.

use super::*;

fn index() -> (tempfile::TempDir, Index) {
    let dir = tempfile::tempdir().unwrap();
    let index = Index::open(&dir.path().join("index.redb")).unwrap();
    (dir, index)
}

#[test]
fn rows_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("index.redb");
    let d = Digest::of(b"blob");
    let m = Digest::of(b"{}");
    {
        let index = Index::open(&path).unwrap();
        assert_eq!(index.blob_size(&d).unwrap(), None);
        index.insert_blob(&d, 4, &format!("u\0r\0{}", d.hex().as_str()), 1).unwrap();
        index.insert_manifest(&m, MediaType::OciManifest, b"{}", Some("u\0r\0t"), &["u\0r\0m".into()], 42).unwrap();
    }
    let index = Index::open(&path).unwrap();
    assert_eq!(index.blob_size(&d).unwrap(), Some(4));
    assert_eq!(index.blob_sizes(&[m, d]).unwrap(), [None, Some(4)], "a manifest has no blob row");
    assert_eq!(index.manifest(&m).unwrap(), Some((MediaType::OciManifest, b"{}".to_vec())));
    assert!(index.is_member(&format!("u\0r\0{}", d.hex().as_str())).unwrap());
    assert!(index.is_member("u\0r\0m").unwrap());
    assert!(!index.is_member("u\0other\0m").unwrap());
    let tag = index.tag("u\0r\0t").unwrap().unwrap();
    assert_eq!((tag.digest, tag.confirmed_ms), (m, 42));
    let removed = index.remove_content(&[(Kind::Blob, d)]).unwrap();
    assert_eq!(removed.iter().map(|e| e.size).collect::<Vec<_>>(), [4]);
    assert!(index.is_member(&format!("u\0r\0{}", d.hex().as_str())).unwrap(), "membership outlives the bytes");
    assert!(index.remove_content(&[(Kind::Blob, d)]).unwrap().is_empty(), "a second removal counts nothing");
    index.remove_tag("u\0r\0t").unwrap();
    assert_eq!(index.blob_size(&d).unwrap(), None);
    assert!(index.tag("u\0r\0t").unwrap().is_none());
}

/// Whether opening the index at `path` repairs it.
fn repairs_on_open(path: &Path) -> bool {
    let repaired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = std::sync::Arc::clone(&repaired);
    Database::builder()
        .set_repair_callback(move |_| flag.store(true, std::sync::atomic::Ordering::Relaxed))
        .create(path)
        .unwrap();
    repaired.load(std::sync::atomic::Ordering::Relaxed)
}

#[test]
fn the_first_open_after_a_crash_needs_no_repair() {
    let dir = tempfile::tempdir().unwrap();
    let (path, crashed) = (dir.path().join("index.redb"), dir.path().join("crashed.redb"));
    let d = Digest::of(b"blob");
    let index = Index::open(&path).unwrap();
    index.insert_blob(&d, 4, &format!("u\0r\0{}", d.hex().as_str()), 1).unwrap();
    index.touch(&[Use { kind: Kind::Blob, digest: d, at_ms: 2, by: None }]).unwrap();
    // The file as a crash right now leaves it: open, never closed.
    std::fs::copy(&path, &crashed).unwrap();
    drop(index);
    assert!(!repairs_on_open(&crashed), "the allocator state was in the last commit");
    let index = Index::open(&crashed).unwrap();
    assert_eq!(index.blob_size(&d).unwrap(), Some(4), "and so was the row");
    assert_eq!(index.least_recently_used(1, &|_, _| false).unwrap()[0].accessed_ms, 2);

    // The same crash after a commit without quick repair, as larder
    // made them before: its next open walks the whole file.
    let (plain, plain_crashed) = (dir.path().join("plain.redb"), dir.path().join("plain-crashed.redb"));
    let db = Database::create(&plain).unwrap();
    let txn = db.begin_write().unwrap();
    txn.open_table(BLOBS).unwrap().insert(d.hex().as_str(), (4, 1)).unwrap();
    txn.commit().unwrap();
    std::fs::copy(&plain, &plain_crashed).unwrap();
    drop(db);
    assert!(repairs_on_open(&plain_crashed), "a plain commit leaves the allocator state to rebuild");
}

#[test]
fn eviction_reads_the_access_order_not_every_row() {
    let (_dir, index) = index();
    let d = |n: u8| Digest::of(&[n]);
    for n in 0..10u8 {
        index.insert_blob(&d(n), 10, &format!("u\0r\0{}", d(n).hex().as_str()), 100 + u64::from(n)).unwrap();
    }
    // Touching the oldest makes it the newest.
    index
        .touch(&[
            Use { kind: Kind::Blob, digest: d(0), at_ms: 500, by: None },
            Use { kind: Kind::Blob, digest: d(1), at_ms: 50, by: None },
        ])
        .unwrap();
    let lru: Vec<u64> = index.least_recently_used(25, &|_, _| false).unwrap().iter().map(|e| e.accessed_ms).collect();
    assert_eq!(lru, [101, 102, 103], "an older access time never moves a row back");
    assert!(index.least_recently_used(0, &|_, _| false).unwrap().is_empty());
    let all = index.least_recently_used(u64::MAX, &|_, _| false).unwrap();
    assert_eq!(all.len(), 10);
    assert_eq!(all.last().map(|e| e.digest), Some(d(0)));
}

#[test]
fn purge_removes_only_content_no_other_repository_references() {
    let (_dir, index) = index();
    let (shared, own) = (Digest::of(b"shared"), Digest::of(b"own"));
    let key = |repo: &str, d: &Digest| format!("u\0{repo}\0{}", d.hex().as_str());
    index.insert_blob(&shared, 6, &key("a", &shared), 1).unwrap();
    index.add_members(&[key("b", &shared)], 1).unwrap();
    index.insert_blob(&own, 3, &key("a", &own), 1).unwrap();
    index.set_tag("u\0a\0v1", &own, 1).unwrap();
    let purged = index.purge("u\0a\0").unwrap();
    assert_eq!((purged.tags, purged.members), (1, 2));
    assert_eq!(purged.content.iter().map(|e| e.digest).collect::<Vec<_>>(), [own]);
    assert_eq!(index.blob_size(&shared).unwrap(), Some(6), "b still references it");
    assert!(index.is_member(&key("b", &shared)).unwrap());
    assert_eq!(index.least_recently_used(u64::MAX, &|_, _| false).unwrap().len(), 1, "the access order follows");
}

#[test]
fn an_older_index_gets_its_secondary_tables_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("index.redb");
    let d = Digest::of(b"old");
    let member = format!("u\0r\0{}", d.hex().as_str());
    {
        // Rows as a version-1 larder wrote them: no access order, no
        // reverse membership, no schema row.
        let db = Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(BLOBS).unwrap().insert(d.hex().as_str(), (3, 7)).unwrap();
        txn.open_table(MEMBERS).unwrap().insert(member.as_str(), 7).unwrap();
        txn.commit().unwrap();
    }
    let index = Index::open(&path).unwrap();
    assert_eq!(index.usage().unwrap(), 3, "the byte total was summed from the old rows");
    assert_eq!(index.least_recently_used(1, &|_, _| false).unwrap().first().map(|e| e.digest), Some(d));
    let purged = index.purge("u\0r\0").unwrap();
    assert_eq!(purged.content.len(), 1, "the reverse membership was built from the old rows");
    assert_eq!(index.usage().unwrap(), 0);
}

#[test]
fn the_byte_total_follows_every_change_and_survives_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("index.redb");
    let (a, b, m) = (Digest::of(b"a"), Digest::of(b"b"), Digest::of(b"{}"));
    let member = |d: &Digest| format!("u\0r\0{}", d.hex().as_str());
    {
        let index = Index::open(&path).unwrap();
        index.insert_blob(&a, 100, &member(&a), 1).unwrap();
        index.insert_blob(&b, 20, &member(&b), 1).unwrap();
        index.insert_manifest(&m, MediaType::OciManifest, b"{}", None, &[member(&m)], 1).unwrap();
        assert_eq!(index.usage().unwrap(), 122);

        // Committed again, touched, adopted again: counted once.
        index.insert_blob(&a, 100, &member(&a), 2).unwrap();
        index
            .touch(&[
                Use { kind: Kind::Blob, digest: b, at_ms: 9, by: None },
                Use { kind: Kind::Manifest, digest: m, at_ms: 9, by: None },
            ])
            .unwrap();
        assert_eq!(index.adopt_blobs(&[(b, 20)], 10).unwrap(), 0, "b was indexed already");
        assert_eq!(index.usage().unwrap(), 122);

        // Removed twice: subtracted once.
        index.remove_content(&[(Kind::Blob, a)]).unwrap();
        index.remove_content(&[(Kind::Blob, a)]).unwrap();
        assert_eq!(index.usage().unwrap(), 22);
    }
    let index = Index::open(&path).unwrap();
    assert_eq!(index.usage().unwrap(), 22, "read back without visiting rows");
    index.purge("u\0").unwrap();
    assert_eq!(index.usage().unwrap(), 0);
}

#[test]
fn blobs_under_a_prefix_are_exactly_that_shard() {
    let (_dir, index) = index();
    let digests: Vec<Digest> = (0..200u32).map(|i| Digest::of(&i.to_le_bytes())).collect();
    for d in &digests {
        index.insert_blob(d, 1, &format!("u\0r\0{}", d.hex().as_str()), 1).unwrap();
    }
    let shard = &digests[0].hex()[..2];
    let mut expected: Vec<Digest> = digests.iter().filter(|d| d.hex().starts_with(shard)).copied().collect();
    expected.sort();
    let found: Vec<Digest> = index.blobs_under(shard).unwrap().into_iter().map(|(d, _)| d).collect();
    assert_eq!(found, expected);
}

// ---- per-upstream charges --------------------------------------------------

fn member(upstream: &str, repo: &str, d: &Digest) -> String {
    format!("{upstream}\0{repo}\0{}", d.hex().as_str())
}

fn keep_none(_: Kind, _: &Digest) -> bool {
    false
}

fn used(kind: Kind, digest: Digest, at_ms: u64, by: &str) -> Use {
    Use { kind, digest, at_ms, by: Some(std::sync::Arc::from(by)) }
}

#[test]
fn content_is_charged_to_the_upstream_whose_use_is_the_most_recent_and_totals_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("index.redb");
    let (a, b, m) = (Digest::of(b"a"), Digest::of(b"b"), Digest::of(b"{}"));
    {
        let index = Index::open(&path).unwrap();
        index.insert_blob(&a, 100, &member("hub", "r", &a), 1).unwrap();
        index.insert_blob(&b, 20, &member("ghcr", "r", &b), 2).unwrap();
        index.insert_manifest(&m, MediaType::OciManifest, b"{}", None, &[member("ghcr", "r", &m)], 3).unwrap();
        // Fetched again for another upstream: charged to it now.
        index.insert_blob(&a, 100, &member("ghcr", "other", &a), 4).unwrap();
        assert_eq!((index.charged().get("hub"), index.charged().get("ghcr")), (0, 122));
        // Used by hub since: back to hub. A use older than the last moves nothing.
        index.touch(&[used(Kind::Blob, a, 9, "hub"), used(Kind::Manifest, m, 2, "hub")]).unwrap();
        assert_eq!((index.charged().get("hub"), index.charged().get("ghcr")), (100, 22));
        assert_eq!(index.usage().unwrap(), 122, "the upstreams add up to the whole");
        // An adopted file belongs to no upstream until one serves it.
        let adopted = Digest::of(b"adopted");
        index.adopt_blobs(&[(adopted, 5)], 5).unwrap();
        assert_eq!(index.usage().unwrap(), 127);
        assert_eq!(index.charged().get("hub") + index.charged().get("ghcr"), 122);
        index.touch(&[used(Kind::Blob, adopted, 6, "ghcr")]).unwrap();
        assert_eq!((index.charged().get("hub"), index.charged().get("ghcr")), (100, 27));
        // A use without an upstream (pinned elsewhere) moves only the time.
        index.touch(&[Use { kind: Kind::Blob, digest: adopted, at_ms: 7, by: None }]).unwrap();
        assert_eq!(index.charged().get("ghcr"), 27);
        index.remove_content(&[(Kind::Blob, adopted)]).unwrap();
    }
    let index = Index::open(&path).unwrap();
    assert_eq!((index.charged().get("hub"), index.charged().get("ghcr")), (100, 22), "read back at open");
    let hub: Vec<Digest> =
        index.least_recently_used_of("hub", u64::MAX, &keep_none).unwrap().iter().map(|e| e.digest).collect();
    assert_eq!(hub, [a], "each upstream has its own access order");
    let ghcr: Vec<u64> =
        index.least_recently_used_of("ghcr", u64::MAX, &keep_none).unwrap().iter().map(|e| e.accessed_ms).collect();
    assert_eq!(ghcr, [2, 3]);
    let hub: Vec<u64> =
        index.least_recently_used_of("hub", u64::MAX, &keep_none).unwrap().iter().map(|e| e.accessed_ms).collect();
    assert_eq!(hub, [9], "in hub's order at the time of its use");
    index.remove_content(&[(Kind::Blob, a)]).unwrap();
    assert_eq!(index.charged().get("hub"), 0, "removal gives it back");
    assert!(index.least_recently_used_of("hub", u64::MAX, &keep_none).unwrap().is_empty());
}

#[test]
fn eviction_passes_over_kept_content() {
    let (_dir, index) = index();
    let d = |n: u8| Digest::of(&[n]);
    for n in 0..4u8 {
        index.insert_blob(&d(n), 10, &member("hub", "r", &d(n)), 100 + u64::from(n)).unwrap();
    }
    let pinned = |_: Kind, x: &Digest| *x == d(0) || *x == d(2);
    let lru: Vec<Digest> = index.least_recently_used(15, &pinned).unwrap().iter().map(|e| e.digest).collect();
    assert_eq!(lru, [d(1), d(3)]);
    let all: Vec<Digest> =
        index.least_recently_used_of("hub", u64::MAX, &pinned).unwrap().iter().map(|e| e.digest).collect();
    assert_eq!(all, [d(1), d(3)], "however much is asked, pinned content is never offered");
}

#[test]
fn a_quota_hands_shared_content_to_an_upstream_with_room_and_removes_the_rest() {
    let (_dir, index) = index();
    let (own, shared, crowded) = (Digest::of(b"own"), Digest::of(b"shared"), Digest::of(b"crowded"));
    index.insert_blob(&own, 10, &member("hub", "r", &own), 1).unwrap();
    index.insert_blob(&shared, 20, &member("hub", "r", &shared), 2).unwrap();
    index.add_members(&[member("mirror", "r", &shared)], 2).unwrap();
    index.insert_blob(&crowded, 30, &member("hub", "r", &crowded), 3).unwrap();
    index.add_members(&[member("full", "r", &crowded)], 3).unwrap();
    let victims = [(Kind::Blob, own), (Kind::Blob, shared), (Kind::Blob, crowded)];
    let mut asked = Vec::new();
    let mut takes = |upstream: &str, size: u64| {
        asked.push((upstream.to_owned(), size));
        upstream == "mirror"
    };
    let done = index.evict_for_upstream("hub", &victims, &mut takes).unwrap();
    assert_eq!(asked, [("mirror".to_owned(), 20), ("full".to_owned(), 30)]);
    let removed: Vec<Digest> = done.removed.iter().map(|e| e.digest).collect();
    assert_eq!(
        removed,
        [own, crowded],
        "no one else uses `own`; `full` has no room for `crowded`, and nothing older to give up for it"
    );
    assert_eq!((done.handed_over, done.handed_over_bytes), (1, 20));
    assert_eq!(index.blob_size(&shared).unwrap(), Some(20), "the shared blob stays");
    assert_eq!((index.charged().get("hub"), index.charged().get("mirror")), (0, 20));
    let mirror = index.least_recently_used_of("mirror", u64::MAX, &keep_none).unwrap();
    assert_eq!((mirror[0].digest, mirror[0].accessed_ms), (shared, 2), "charged with its access time");
    // Evicting again for `hub` finds nothing it is charged for.
    let again = index.evict_for_upstream("hub", &[(Kind::Blob, shared)], &mut |_: &str, _: u64| true).unwrap();
    assert!(again.removed.is_empty() && again.handed_over == 0);
}

#[test]
fn a_quota_hands_shared_content_without_room_to_an_upstream_that_holds_older_content() {
    let (_dir, index) = index();
    let (older, shared) = (Digest::of(b"older"), Digest::of(b"shared"));
    index.insert_blob(&older, 10, &member("full", "r", &older), 1).unwrap();
    index.insert_blob(&shared, 20, &member("hub", "r", &shared), 5).unwrap();
    index.add_members(&[member("full", "r", &shared)], 5).unwrap();
    let done = index.evict_for_upstream("hub", &[(Kind::Blob, shared)], &mut |_: &str, _: u64| false).unwrap();
    assert!(done.removed.is_empty(), "`full` still uses it and has older content to evict first");
    assert_eq!((index.charged().get("hub"), index.charged().get("full")), (0, 30));
    let order: Vec<Digest> =
        index.least_recently_used_of("full", u64::MAX, &keep_none).unwrap().iter().map(|e| e.digest).collect();
    assert_eq!(order, [older, shared], "its own eviction takes the older first");
}

#[test]
fn a_purge_hands_what_another_upstream_still_references_over_to_it() {
    let (_dir, index) = index();
    let shared = Digest::of(b"shared");
    index.insert_blob(&shared, 8, &member("hub", "r", &shared), 1).unwrap();
    index.add_members(&[member("mirror", "r", &shared)], 1).unwrap();
    let purged = index.purge("hub\0").unwrap();
    assert!(purged.content.is_empty(), "mirror still references it");
    assert_eq!((index.charged().get("hub"), index.charged().get("mirror")), (0, 8));
    assert_eq!(index.purge("mirror\0").unwrap().content.len(), 1);
    assert_eq!(index.charged().get("mirror"), 0);
    assert_eq!(index.usage().unwrap(), 0);
}

#[test]
fn an_index_from_before_quotas_charges_each_row_to_an_upstream_that_references_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("index.redb");
    let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
    {
        let index = Index::open(&path).unwrap();
        index.insert_blob(&a, 3, &member("hub", "r", &a), 1).unwrap();
        index.insert_blob(&b, 4, &member("quay", "r", &b), 2).unwrap();
        // As a version-3 larder left it: no charges, schema 3.
        let txn = index.db.begin_write().unwrap();
        txn.delete_table(CHARGED).unwrap();
        txn.delete_table(UPSTREAM_ACCESS).unwrap();
        {
            let mut meta = txn.open_table(META).unwrap();
            meta.remove(quota::bytes_key("hub").as_str()).unwrap();
            meta.remove(quota::bytes_key("quay").as_str()).unwrap();
            meta.insert(SCHEMA_KEY, 3).unwrap();
        }
        txn.commit().unwrap();
    }
    let index = Index::open(&path).unwrap();
    assert_eq!((index.charged().get("hub"), index.charged().get("quay")), (3, 4));
    assert_eq!(index.least_recently_used_of("quay", 1, &keep_none).unwrap()[0].digest, b);
}

#[test]
fn warm_rows_are_kept_until_their_image_is_no_longer_listed() {
    let (_dir, index) = index();
    let (d1, d2) = (Digest::of(b"1"), Digest::of(b"2"));
    index.set_warm_row("hub\0r\0v1", &WarmRow { digest: d2, previous: Some(d1), seen_ms: 5 }).unwrap();
    index.set_warm_row("hub\0r\0v2", &WarmRow { digest: d1, previous: None, seen_ms: 6 }).unwrap();
    let rows = index.warm_rows().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0], ("hub\0r\0v1".to_owned(), WarmRow { digest: d2, previous: Some(d1), seen_ms: 5 }));
    assert_eq!(rows[1].1.previous, None);
    assert_eq!(index.retain_warm_rows(&["hub\0r\0v2".to_owned()]).unwrap(), 1);
    assert_eq!(index.warm_rows().unwrap().len(), 1);
}

#[test]
fn a_manifests_warnings_are_kept_per_repository_replaced_and_removed_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("index.redb");
    let (m, other) = (Digest::of(b"{\"a\":1}"), Digest::of(b"{\"b\":2}"));
    let (hub, quay) = (member("hub", "r", &m), member("quay", "q", &m));
    let w = b"299 - \"deprecated\"\n299 - \"moved\"".as_slice();
    {
        // As schema 4 left it, before warnings: no manifest_warnings table.
        let index = Index::open(&path).unwrap();
        index.insert_manifest(&m, MediaType::OciManifest, b"{\"a\":1}", None, std::slice::from_ref(&hub), 1).unwrap();
        let txn = index.db.begin_write().unwrap();
        txn.delete_table(MANIFEST_WARNINGS).unwrap();
        txn.commit().unwrap();
    }
    let index = Index::open(&path).unwrap();
    assert_eq!(index.manifest(&m).unwrap().map(|(t, _)| t), Some(MediaType::OciManifest), "an older index opens");
    assert!(index.manifest_warnings(&hub).unwrap().is_empty(), "and its manifests have no warnings");

    let row = |warnings| (MediaType::OciManifest, b"{\"a\":1}".as_slice(), warnings);
    index.insert_manifest_warned(&m, row(Some(w)), None, std::slice::from_ref(&hub), 2).unwrap();
    drop(index);
    let index = Index::open(&path).unwrap();
    assert_eq!(index.manifest_warnings(&hub).unwrap(), w, "kept across reopening");
    // Another repository of another upstream has the same bytes, not hub's warnings.
    index.insert_manifest_warned(&m, row(Some(b"")), None, std::slice::from_ref(&quay), 3).unwrap();
    assert!(index.manifest_warnings(&quay).unwrap().is_empty());
    assert_eq!(index.manifest_warnings(&hub).unwrap(), w, "another repository's fill leaves them");
    // A source without warnings (an import) leaves them; upstream's answer replaces them.
    index.insert_manifest_warned(&m, row(None), None, std::slice::from_ref(&hub), 3).unwrap();
    assert_eq!(index.manifest_warnings(&hub).unwrap(), w);
    index.set_manifest_warnings(&hub, b"299 - \"new\"").unwrap();
    assert_eq!(index.manifest_warnings(&hub).unwrap(), b"299 - \"new\"");
    assert!(index.manifest_warnings(&quay).unwrap().is_empty(), "one repository's answer is not another's");
    let not_stored = member("hub", "r", &other);
    index.set_manifest_warnings(&not_stored, w).unwrap();
    assert!(index.manifest_warnings(&not_stored).unwrap().is_empty(), "no row for a manifest not stored");
    index.set_manifest_warnings(&hub, b"").unwrap();
    assert!(index.manifest_warnings(&hub).unwrap().is_empty(), "none now");

    // A purge of one repository takes its warnings, not another's.
    index.set_manifest_warnings(&hub, w).unwrap();
    index.set_manifest_warnings(&quay, w).unwrap();
    assert!(index.purge("hub\0").unwrap().content.is_empty(), "quay still has the manifest");
    assert!(index.manifest_warnings(&hub).unwrap().is_empty(), "purged with its repository");
    assert_eq!(index.manifest_warnings(&quay).unwrap(), w);
    // Eviction takes every repository's.
    index.add_members(std::slice::from_ref(&hub), 4).unwrap();
    index.set_manifest_warnings(&hub, w).unwrap();
    index.remove_content(&[(Kind::Manifest, m)]).unwrap();
    assert!(index.manifest_warnings(&hub).unwrap().is_empty(), "evicted with the manifest");
    assert!(index.manifest_warnings(&quay).unwrap().is_empty(), "evicted with the manifest");
    let txn = index.db.begin_read().unwrap();
    assert_eq!(txn.open_table(MANIFEST_WARNINGS).unwrap().iter().unwrap().count(), 0, "no row left behind");
}

/// An image manifest naming `layer` with `size`.
fn manifest_declaring(layer: &Digest, size: u64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": Digest::of(b"{}").to_string(), "size": 2},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer.to_string(), "size": size}],
    }))
    .unwrap()
}

#[test]
fn declared_sizes_are_kept_per_repository_with_the_manifest_and_purged_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("index.redb");
    let layer = Digest::of(b"layer");
    let bytes = manifest_declaring(&layer, 1234);
    let m = Digest::of(&bytes);
    {
        let index = Index::open(&path).unwrap();
        index.insert_manifest(&m, MediaType::OciManifest, &bytes, None, &[member("hub", "a", &m)], 1).unwrap();
        // Confirmed in another repository later (a HEAD upstream).
        index.add_members(&[member("hub", "b", &m)], 2).unwrap();
    }
    let index = Index::open(&path).unwrap();
    assert_eq!(index.declared_size(&member("hub", "a", &layer)).unwrap(), Some(1234), "after a reopen");
    assert_eq!(index.declared_size(&member("hub", "b", &layer)).unwrap(), Some(1234));
    assert_eq!(index.declared_size(&member("hub", "c", &layer)).unwrap(), None, "not another repository's");
    index.purge("hub\0a\0").unwrap();
    assert_eq!(index.declared_size(&member("hub", "a", &layer)).unwrap(), None, "purged with the repository");
    assert_eq!(index.declared_size(&member("hub", "b", &layer)).unwrap(), Some(1234));
}

#[test]
fn an_index_from_before_declared_sizes_gets_them_from_its_manifests() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("index.redb");
    let layer = Digest::of(b"layer");
    let bytes = manifest_declaring(&layer, 99);
    let m = Digest::of(&bytes);
    {
        let index = Index::open(&path).unwrap();
        index.insert_manifest(&m, MediaType::OciManifest, &bytes, None, &[member("hub", "r", &m)], 1).unwrap();
        // As a version-4 larder left it: no declared sizes, schema 4.
        let txn = index.db.begin_write().unwrap();
        txn.delete_table(DECLARED).unwrap();
        txn.open_table(META).unwrap().insert(SCHEMA_KEY, 4).unwrap();
        txn.commit().unwrap();
    }
    let index = Index::open(&path).unwrap();
    assert_eq!(index.declared_size(&member("hub", "r", &layer)).unwrap(), Some(99));
}

#[test]
fn an_imported_manifest_declares_its_sizes_for_its_repository_and_a_refused_import_writes_nothing() {
    let (_dir, index) = index();
    let layer = Digest::of(b"layer");
    let bytes = manifest_declaring(&layer, 4321);
    let m = Digest::of(&bytes);
    let members = [member("hub", "team/app", &m), member("hub", "team/app", &layer)];
    let rows = import::ImportRows {
        blobs: &[(layer, 4321, "hub")],
        manifests: &[(m, MediaType::OciManifest, "hub")],
        members: &members,
        tags: &[],
        now_ms: 1,
    };
    index.commit_import(&rows, &mut |_| Ok(bytes.clone()), &|_| false).unwrap();
    assert_eq!(index.declared_size(&member("hub", "team/app", &layer)).unwrap(), Some(4321));
    assert_eq!(index.declared_size(&member("hub", "other", &layer)).unwrap(), None, "not another repository's");
    // The same manifest declared as an index is refused whole: no membership, no declared size.
    let elsewhere = [member("hub", "team/b", &m)];
    let refused = import::ImportRows {
        blobs: &[],
        manifests: &[(m, MediaType::OciIndex, "hub")],
        members: &elsewhere,
        tags: &[],
        now_ms: 2,
    };
    assert!(index.commit_import(&refused, &mut |_| Ok(bytes.clone()), &|_| false).is_err());
    assert!(!index.is_member(&elsewhere[0]).unwrap());
    assert_eq!(index.declared_size(&member("hub", "team/b", &layer)).unwrap(), None);

    index.purge("hub\0team/app\0").unwrap();
    assert_eq!(index.declared_size(&member("hub", "team/app", &layer)).unwrap(), None, "purged with it");
}
