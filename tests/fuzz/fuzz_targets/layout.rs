//! The layout reader `larder import` uses, on arbitrary bytes as a
//! layout's tar: the tar walk (headers, long names, PAX records, entry
//! kinds, an end cut off), `index.json`, then each image's manifests
//! planned as an import would, within small limits. Properties: no panic;
//! `index.json` is handed on at most once, before the blobs that follow
//! it; a blob handed on hashes to its name and the bytes read stay within
//! the limit; a reader that succeeds had `oci-layout` and `index.json`;
//! a plan stays within its limits, plans each manifest and blob once,
//! plans only blobs the layout carries (at their size) and calls absent
//! only those it does not.
#![no_main]

use std::collections::{HashMap, HashSet};
use std::io::Read;

use larder::cache::import::plan::{PlanTarget, plan};
use larder::cache::import::reader::{self, Visitor};
use larder::cache::import::{ImportError, ImportLimits};
use larder::oci::layout::{ImageName, LayoutIndex};
use larder::oci::{Digest, RepoName, Tag};
use libfuzzer_sys::fuzz_target;

const LIMITS: ImportLimits = ImportLimits {
    max_bytes: 1 << 20,
    max_unindexed_bytes: 1 << 18,
    max_blobs: 64,
    max_images: 16,
    max_manifests: 32,
    max_references: 512,
    max_manifest_references: 128,
    max_memberships: 1024,
    max_absent_blobs: 64,
    max_entries: 256,
    max_header_bytes: 4096,
};

#[derive(Default)]
struct Memory {
    index: Option<LayoutIndex>,
    blobs: HashMap<Digest, Vec<u8>>,
    bytes: u64,
}

impl Visitor for Memory {
    fn index(&mut self, index: LayoutIndex, bytes: &[u8]) -> Result<(), ImportError> {
        assert!(self.index.is_none(), "index.json handed on twice");
        assert_eq!(LayoutIndex::parse(bytes).as_ref(), Ok(&index), "the bytes are the index's");
        self.index = Some(index);
        Ok(())
    }

    fn blob(&mut self, named: Digest, path: &str, _size: u64, data: &mut dyn Read) -> Result<(), ImportError> {
        assert!(path.ends_with(named.hex().as_str()), "{path} names {named}");
        let mut bytes = Vec::new();
        data.read_to_end(&mut bytes)?;
        self.bytes += bytes.len() as u64;
        assert!(self.bytes <= LIMITS.max_bytes, "{} bytes read past the limit", self.bytes);
        let actual = Digest::of(&bytes);
        if actual != named {
            return Err(ImportError::Tampered { path: path.to_owned(), actual });
        }
        self.blobs.insert(named, bytes);
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let mut memory = Memory::default();
    let read = reader::read_tar(data, &LIMITS, &mut memory);
    if read.is_ok() {
        assert!(memory.index.is_some(), "a layout read whole has an index.json");
    }
    let Some(index) = memory.index.take() else { return };
    let Ok(images) = index.images() else { return };
    let images: Vec<_> = images.into_iter().take(LIMITS.max_images).collect();
    let repo: RepoName = "fuzz/app".parse().unwrap();
    let tags: Vec<Option<Tag>> = images
        .iter()
        .map(|i| match i.name.as_deref().map(ImageName::parse) {
            Some(ImageName::TagOnly(t)) | Some(ImageName::Whole { tag: Some(t), .. }) => t.parse().ok(),
            _ => None,
        })
        .collect();
    let targets: Vec<PlanTarget> = images
        .iter()
        .zip(&tags)
        .map(|(image, tag)| PlanTarget { upstream: "fuzz.test", repo: &repo, tag: tag.as_ref(), image })
        .collect();
    let blobs = &memory.blobs;
    let carried = |d: &Digest| blobs.get(d).map(|b| b.len() as u64);
    let mut reads: HashMap<Digest, usize> = HashMap::new();
    let mut read_manifest = |d: &Digest| {
        *reads.entry(*d).or_default() += 1;
        Ok(blobs.get(d).cloned().unwrap_or_default())
    };
    let Ok(plan) = plan(&targets, &carried, &mut read_manifest, &LIMITS) else { return };
    assert!(reads.values().all(|n| *n == 1), "a manifest read twice: {reads:?}");
    assert!(plan.manifests.len() <= LIMITS.max_manifests);
    assert!(plan.members.len() <= LIMITS.max_memberships);
    assert_eq!(plan.destinations.len(), targets.len());
    let mut seen = HashSet::new();
    for m in &plan.manifests {
        assert!(seen.insert(m.digest), "manifest {} planned twice", m.digest);
        assert_eq!(carried(&m.digest), Some(m.size), "a planned manifest is carried, at its size");
    }
    let mut seen = HashSet::new();
    for b in &plan.blobs {
        assert!(seen.insert(b.digest), "blob {} planned twice", b.digest);
        assert_eq!(carried(&b.digest), Some(b.size), "a planned blob is carried, at its size");
    }
    assert!(plan.absent.len() <= LIMITS.max_absent_blobs);
    for a in &plan.absent {
        assert_eq!(carried(&a.digest), None, "{} is carried, yet absent", a.digest);
        assert!(a.target < targets.len());
    }
    let members: HashSet<&String> = plan.members.iter().collect();
    assert_eq!(members.len(), plan.members.len(), "a membership row twice");
});
