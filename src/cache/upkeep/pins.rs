//! Pinned content: what the pinned warm images need — for each, its
//! current digest and the one before it (so that a rollback is warm too),
//! the manifests of the platforms chosen and every blob they name — is
//! never evicted. Eviction reads the pinned set and passes over it;
//! everything else is evicted as usual.
//!
//! Pinned content is charged to an upstream that pins it (the warm
//! image's own upstream), and another upstream's use of it moves only its
//! access time, not its charge: one upstream's pins never fill another's
//! share, and pinned bytes are reported by the upstream that pins them.
//!
//! When pinned content alone is above the high watermark of `max_size`
//! (or of an upstream's own `max_size`), eviction cannot make room: larder
//! says so in its log (at start, and when it changes), on `/status` and in
//! `larder_cache_pinned_over_limit`, and goes on evicting only what is not
//! pinned.

use std::collections::HashMap;
use std::sync::Arc;

use crate::cache::*;
use crate::oci::inspect_manifest;

/// The content eviction passes over, and the upstreams pinning each item.
#[derive(Debug, Default)]
pub struct Pins {
    items: HashMap<(Kind, Digest), Vec<String>>,
}

impl Pins {
    pub fn contains(&self, kind: Kind, digest: &Digest) -> bool {
        self.items.contains_key(&(kind, *digest))
    }

    /// Whether a use by upstream `by` may take the item's charge: it is
    /// not pinned, or `by` pins it too.
    pub fn charge_follows(&self, kind: Kind, digest: &Digest, by: &str) -> bool {
        self.items.get(&(kind, *digest)).is_none_or(|pinners| pinners.iter().any(|p| p == by))
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// An image whose content is pinned: a manifest (or index) by digest of
/// `upstream` and, for an index, the platforms chosen (empty: all of them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinnedImage {
    pub upstream: String,
    pub digest: Digest,
    pub platforms: Vec<String>,
}

/// How much is pinned, and whether it leaves eviction room.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct PinnedUsage {
    /// Bytes of pinned content in the cache.
    pub bytes: u64,
    /// The same, per upstream that pins it (the one it is charged to, see
    /// [`index::Charged`]).
    pub by_upstream: Vec<(String, u64)>,
    /// One sentence per limit pinned content alone is above; empty when
    /// eviction has room.
    pub over_limit: Vec<String>,
}

/// Whether an index entry's platform is one of `wants` (empty: every
/// platform): `linux/arm64` selects `linux/arm64` and `linux/arm64/v8`,
/// `linux` every Linux platform. An entry without a platform is selected
/// only when every platform is.
pub fn platform_selected(have: Option<&str>, wants: &[String]) -> bool {
    if wants.is_empty() {
        return true;
    }
    let Some(have) = have else { return false };
    wants.iter().any(|want| have == want || have.strip_prefix(want.as_str()).is_some_and(|rest| rest.starts_with('/')))
}

impl Cache {
    /// The pinned set, as last computed.
    pub(super) fn pins(&self) -> Arc<Pins> {
        Arc::clone(&self.pins.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Pins `images` (and only them: what was pinned before and is not
    /// among them may be evicted again), from the manifests the cache
    /// holds; a manifest not cached yet pins only its digest until it is
    /// pinned again after its fetch. Returns how much is pinned, which is
    /// also logged when the verdict on the limits changes.
    pub async fn pin(&self, images: &[PinnedImage]) -> Result<PinnedUsage, Error> {
        let mut items: HashMap<(Kind, Digest), Vec<String>> = HashMap::new();
        let mut add = |item: (Kind, Digest), upstream: &str| {
            let pinners = items.entry(item).or_default();
            if !pinners.iter().any(|p| p == upstream) {
                pinners.push(upstream.to_owned());
            }
        };
        for image in images {
            let upstream = image.upstream.as_str();
            add((Kind::Manifest, image.digest), upstream);
            let Some(top) = self.stored_manifest(&image.digest).await? else { continue };
            let (_, refs) = inspect_manifest(&top.bytes, Some(top.media_type)).map_err(Error::Internal)?;
            refs.blobs.iter().for_each(|d| add((Kind::Blob, *d), upstream));
            for (child, platform) in refs.manifests.iter().zip(&refs.platforms) {
                if !platform_selected(platform.as_deref(), &image.platforms) {
                    continue;
                }
                add((Kind::Manifest, *child), upstream);
                let Some(m) = self.stored_manifest(child).await? else { continue };
                let (_, child_refs) = inspect_manifest(&m.bytes, Some(m.media_type)).map_err(Error::Internal)?;
                child_refs.blobs.iter().for_each(|d| add((Kind::Blob, *d), upstream));
            }
        }
        for pinners in items.values_mut() {
            pinners.sort();
        }
        let by_pinner: Vec<((Kind, Digest), Vec<String>)> = items.iter().map(|(k, v)| (*k, v.clone())).collect();
        *self.pins.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(Pins { items });
        // Charged to an upstream that pins it (a write only when one is
        // not), then counted by that one.
        let index = Arc::clone(&self.index);
        let charges = blocking(move || {
            let pinned: Vec<(Kind, Digest)> = by_pinner.iter().map(|(item, _)| *item).collect();
            let charges = index.charges_of(&pinned)?;
            let elsewhere: Vec<((Kind, Digest), Vec<String>)> = by_pinner
                .into_iter()
                .zip(&charges)
                .filter(|((_, pinners), charge)| {
                    charge.as_ref().is_some_and(|(_, owner)| owner.as_ref().is_none_or(|o| !pinners.contains(o)))
                })
                .map(|(item, _)| item)
                .collect();
            if elsewhere.is_empty() {
                return Ok(charges);
            }
            index.charge_to(&elsewhere)?;
            Ok(index.charges_of(&pinned)?)
        })
        .await?;
        let usage = self.pinned_usage(charges.into_iter().flatten());
        let m = metrics();
        m.cache_pinned_bytes.set(i64::try_from(usage.bytes).unwrap_or(i64::MAX));
        m.cache_pinned_over_limit.set(i64::from(!usage.over_limit.is_empty()));
        let mut last = self.pinned_usage.lock().unwrap_or_else(|p| p.into_inner());
        if last.over_limit != usage.over_limit {
            for sentence in &usage.over_limit {
                tracing::warn!(pinned = usage.bytes, "{sentence}");
            }
            if usage.over_limit.is_empty() && !last.over_limit.is_empty() {
                tracing::info!(pinned = usage.bytes, "pinned content is within the limits again");
            }
        }
        *last = usage.clone();
        Ok(usage)
    }

    /// How much was pinned, as of the last [`Cache::pin`].
    pub fn pinned(&self) -> PinnedUsage {
        self.pinned_usage.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn pinned_usage(&self, charges: impl Iterator<Item = (u64, Option<String>)>) -> PinnedUsage {
        let mut by_upstream: HashMap<String, u64> = HashMap::new();
        let mut bytes = 0;
        for (size, owner) in charges {
            bytes += size;
            if let Some(owner) = owner {
                *by_upstream.entry(owner).or_default() += size;
            }
        }
        let mut usage = PinnedUsage { bytes, ..PinnedUsage::default() };
        let high = self.evictor.limits().high;
        if bytes > high {
            usage.over_limit.push(format!(
                "pinned content ({bytes} bytes) is above the cache's high watermark ({high} bytes of max_size \
                 {}): only unpinned content is evicted, and it cannot make room; raise cache.max_size or pin fewer \
                 images",
                self.config.max_size
            ));
        }
        let mut by_upstream: Vec<(String, u64)> = by_upstream.into_iter().collect();
        by_upstream.sort();
        for (upstream, pinned) in &by_upstream {
            if let Some(limits) = self.evictor.quota(upstream).filter(|l| *pinned > l.high) {
                usage.over_limit.push(format!(
                    "pinned content of upstream {upstream:?} ({pinned} bytes) is above the high watermark of its \
                     max_size ({} bytes): only its unpinned content is evicted",
                    limits.high
                ));
            }
        }
        usage.by_upstream = by_upstream;
        usage
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::test_cache::temporary_with;
    use crate::oci::MediaType;

    /// A blob of `size` bytes of `seed`, committed for `upstream/team/app`
    /// as a fill leaves it, last used at `accessed_ms`.
    fn blob(cache: &Cache, seed: u8, size: usize, accessed_ms: u64) -> Digest {
        let bytes = vec![seed; size];
        let d = Digest::of(&bytes);
        let path = cache.store.blob_path(&d);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        if cache
            .index
            .insert_blob(&d, size as u64, &member_key("hub", &"team/app".parse().unwrap(), &d), accessed_ms)
            .unwrap()
        {
            cache.evictor.added(size as u64);
        }
        d
    }

    fn manifest(cache: &Cache, json: String, media_type: MediaType, accessed_ms: u64) -> Digest {
        let d = Digest::of(json.as_bytes());
        let member = member_key("hub", &"team/app".parse().unwrap(), &d);
        if cache.index.insert_manifest(&d, media_type, json.as_bytes(), None, &[member], accessed_ms).unwrap() {
            cache.evictor.added(json.len() as u64);
        }
        d
    }

    fn image(cache: &Cache, config: Digest, layer: Digest, accessed_ms: u64) -> Digest {
        let json = format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{config}","size":1}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{layer}","size":1}}]}}"#
        );
        manifest(cache, json, MediaType::OciManifest, accessed_ms)
    }

    fn cached(cache: &Cache, d: &Digest) -> bool {
        cache.index.blob_size(d).unwrap().is_some() && cache.store.blob_path(d).is_file()
    }

    #[tokio::test]
    async fn pinned_images_and_their_chosen_platforms_survive_eviction() {
        let (_dir, cache) = temporary_with(|c| c.max_size = 8 << 20).await;
        const KB: usize = 1024;
        let old = blob(&cache, 1, 100 * KB, 1);
        let (amd_config, amd_layer) = (blob(&cache, 2, 10 * KB, 2), blob(&cache, 3, 100 * KB, 3));
        let (arm_config, arm_layer) = (blob(&cache, 4, 10 * KB, 4), blob(&cache, 5, 100 * KB, 5));
        let amd = image(&cache, amd_config, amd_layer, 6);
        let arm = image(&cache, arm_config, arm_layer, 7);
        let index = manifest(
            &cache,
            format!(
                r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{amd}","size":1,"platform":{{"os":"linux","architecture":"amd64"}}}},{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{arm}","size":1,"platform":{{"os":"linux","architecture":"arm64"}}}}]}}"#
            ),
            MediaType::OciIndex,
            8,
        );
        let newest = blob(&cache, 6, 100 * KB, 9);

        let usage = cache
            .pin(&[PinnedImage { upstream: "hub".into(), digest: index, platforms: vec!["linux/amd64".into()] }])
            .await
            .unwrap();
        assert_eq!(cache.pins().len(), 4, "the index, the amd64 manifest, its config and layer");
        assert_eq!(
            usage.bytes,
            cache
                .index
                .charges_of(&[
                    (Kind::Blob, amd_config),
                    (Kind::Blob, amd_layer),
                    (Kind::Manifest, amd),
                    (Kind::Manifest, index)
                ])
                .unwrap()
                .iter()
                .flatten()
                .map(|(s, _)| s)
                .sum::<u64>()
        );
        assert_eq!(usage.by_upstream, vec![("hub".to_owned(), usage.bytes)]);
        assert!(usage.over_limit.is_empty());

        cache.evict(u64::MAX).await.unwrap();
        for (d, what) in [(amd_config, "pinned config"), (amd_layer, "pinned layer")] {
            assert!(cached(&cache, &d), "{what} stays");
        }
        for (d, what) in [(old, "old"), (arm_config, "arm64 config"), (arm_layer, "arm64 layer"), (newest, "newest")] {
            assert!(!cached(&cache, &d), "{what}: not pinned, evicted");
        }
        assert!(cache.index.manifest(&index).unwrap().is_some() && cache.index.manifest(&amd).unwrap().is_some());
        assert!(cache.index.manifest(&arm).unwrap().is_none(), "the arm64 manifest was not chosen");
        assert_eq!(cache.usage(), usage.bytes, "only what is pinned is left");

        // Unpinned, it goes like anything else.
        cache.pin(&[]).await.unwrap();
        cache.evict(u64::MAX).await.unwrap();
        assert!(!cached(&cache, &amd_layer));
        assert_eq!(cache.usage(), 0);
    }

    #[tokio::test]
    async fn pinned_content_above_the_limits_is_reported() {
        let (_dir, cache) = temporary_with(|c| {
            c.max_size = 4 << 20;
            c.upstream_max_size = vec![("hub".to_owned(), 1 << 20)];
        })
        .await;
        let (config, layer) = (blob(&cache, 1, 1024, 1), blob(&cache, 2, 1 << 20, 2));
        let top = image(&cache, config, layer, 3);
        let usage =
            cache.pin(&[PinnedImage { upstream: "hub".into(), digest: top, platforms: Vec::new() }]).await.unwrap();
        assert_eq!(usage.over_limit.len(), 1, "{:?}", usage.over_limit);
        assert!(usage.over_limit[0].contains("upstream \"hub\""), "{:?}", usage.over_limit);
        assert_eq!(cache.pinned(), usage, "kept for /status");
        // Eviction for the upstream's share frees nothing pinned.
        cache.evict_upstream("hub", u64::MAX).await.unwrap();
        assert!(cached(&cache, &layer) && cached(&cache, &config));
        let usage = cache.pin(&[]).await.unwrap();
        assert!(usage.over_limit.is_empty() && usage.bytes == 0);
    }

    #[tokio::test]
    async fn pinned_content_is_charged_to_and_reported_by_the_upstream_that_pins_it() {
        let (_dir, cache) = temporary_with(|c| c.upstream_max_size = vec![("hub".to_owned(), 4 << 20)]).await;
        // Fetched through hub (another team's image of the same layers)...
        let (config, layer) = (blob(&cache, 1, 1024, 1), blob(&cache, 2, 100 * 1024, 2));
        let top = image(&cache, config, layer, 3);
        let all = cache.evictor.charged("hub");
        // ... and kept warm for mirror.
        let usage =
            cache.pin(&[PinnedImage { upstream: "mirror".into(), digest: top, platforms: Vec::new() }]).await.unwrap();
        assert_eq!(usage.by_upstream, vec![("mirror".to_owned(), all)], "reported by the pinning upstream");
        assert_eq!((cache.evictor.charged("hub"), cache.evictor.charged("mirror")), (0, all), "and charged to it");
        // Hub's pulls use the layer every day: its access time moves, its charge stays.
        cache.evictor.record_access(Kind::Blob, layer, &Arc::from("hub"), 50);
        cache.flush_accesses().await.unwrap();
        assert_eq!((cache.evictor.charged("hub"), cache.evictor.charged("mirror")), (0, all));
        let order = cache.index.least_recently_used(u64::MAX, &|_, _| false).unwrap();
        assert_eq!(order.last().map(|e| (e.digest, e.accessed_ms)), Some((layer, 50)), "its use counted");
    }

    #[test]
    fn platforms_match_whole_segments() {
        let wants = ["linux/arm64".to_owned(), "windows".to_owned()];
        assert!(platform_selected(Some("linux/arm64"), &wants));
        assert!(platform_selected(Some("linux/arm64/v8"), &wants));
        assert!(platform_selected(Some("windows/amd64"), &wants));
        assert!(!platform_selected(Some("linux/arm"), &wants));
        assert!(!platform_selected(Some("linux/arm64v8"), &["linux/arm64".to_owned()]));
        assert!(!platform_selected(None, &wants), "no platform: only when all are wanted");
        assert!(platform_selected(None, &[]));
    }
}
