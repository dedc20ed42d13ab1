//! What an import will write, worked out from the staged layout before
//! anything is committed: each image's manifests walked from its top
//! manifest, every distinct manifest read and parsed once however many
//! images share it, and every count held within [`ImportLimits`].
//!
//! The walk reads manifests through a function (the staging area's files,
//! or a fuzz target's memory), and decides nothing about the cache: which
//! blobs the layout lacks is an answer ([`Plan::absent`]), for the
//! membership rule to settle.

use std::collections::{HashMap, HashSet};

use super::ImportError;
use super::limits::ImportLimits;
use crate::cache::membership::member_key;
use crate::cache::tag_key;
use crate::oci::layout::LayoutImage;
use crate::oci::{Digest, MAX_MANIFEST_SIZE, MediaType, RepoName, Tag, inspect_manifest};

/// An image of the layout and where it goes, as the walk sees it.
#[derive(Debug, Clone, Copy)]
pub struct PlanTarget<'a> {
    /// The upstream's configured name.
    pub upstream: &'a str,
    pub repo: &'a RepoName,
    pub tag: Option<&'a Tag>,
    pub image: &'a LayoutImage,
}

impl PlanTarget<'_> {
    /// `upstream/repository:tag@digest`, or `upstream/repository@digest`.
    pub fn destination(&self) -> String {
        match self.tag {
            Some(tag) => format!("{}/{}:{}@{}", self.upstream, self.repo, tag, self.image.digest),
            None => format!("{}/{}@{}", self.upstream, self.repo, self.image.digest),
        }
    }
}

/// A manifest to store, and the upstream its bytes are charged to (the
/// first image's that names it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedManifest {
    pub digest: Digest,
    pub media_type: MediaType,
    pub size: u64,
    pub upstream: String,
}

/// A blob the layout carries, and the upstream its bytes are charged to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedBlob {
    pub digest: Digest,
    pub size: u64,
    pub upstream: String,
}

/// A blob an image names that the layout does not carry: imported only
/// if it is a member of the image's repository already, or upstream
/// confirms the repository has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbsentBlob {
    /// Which target (its index in the targets walked) names it.
    pub target: usize,
    pub digest: Digest,
    /// The size its manifest declares, if it does.
    pub declared: Option<u64>,
}

/// What an import writes.
#[derive(Debug, Default)]
pub struct Plan {
    /// Every manifest of every image, once.
    pub manifests: Vec<PlannedManifest>,
    /// Every blob the layout carries that an image names, once.
    pub blobs: Vec<PlannedBlob>,
    /// Blobs the layout lacks, once per repository.
    pub absent: Vec<AbsentBlob>,
    /// Membership rows: each image's manifests and blobs in its repository.
    pub members: Vec<String>,
    /// Tag rows (their keys) and the digests they map to.
    pub tags: Vec<(String, Digest)>,
    /// Each image's destination (see [`PlanTarget::destination`]).
    pub destinations: Vec<String>,
    /// Children of an index that the layout does not carry (a
    /// one-platform copy of a multi-platform image): left to upstream.
    pub missing_platforms: usize,
}

/// A manifest of the layout, read once.
struct Node {
    media_type: MediaType,
    size: u64,
    /// Config and layers, with the sizes the manifest declares.
    blobs: Vec<(Digest, Option<u64>)>,
    /// Child manifests, each once, in order.
    children: Vec<Digest>,
}

impl Node {
    /// An index (or anything naming manifests): never a child of one.
    fn is_index(&self) -> bool {
        matches!(self.media_type, MediaType::OciIndex | MediaType::DockerManifestList) || !self.children.is_empty()
    }
}

/// Walks `targets` over a layout whose carried files `carried` sizes (a
/// digest it does not carry: `None`) and whose manifests `read` returns.
pub fn plan(
    targets: &[PlanTarget<'_>],
    carried: &dyn Fn(&Digest) -> Option<u64>,
    read: &mut dyn FnMut(&Digest) -> Result<Vec<u8>, ImportError>,
    limits: &ImportLimits,
) -> Result<Plan, ImportError> {
    let mut walk = Walk { carried, read, limits, nodes: HashMap::new(), references: 0 };
    let mut plan = Plan::default();
    let mut rows = Rows::default();
    let mut tags: HashMap<String, Digest> = HashMap::new();
    for (i, target) in targets.iter().enumerate() {
        let (upstream, repo, image) = (target.upstream, target.repo, target.image);
        plan.destinations.push(target.destination());
        if let Some(tag) = target.tag {
            let key = tag_key(upstream, repo, tag);
            match tags.get(&key) {
                Some(other) if *other != image.digest => {
                    return Err(ImportError::NotALayout(format!(
                        "two images of the layout go to {upstream}/{repo}:{tag} ({other} and {})",
                        image.digest
                    )));
                }
                Some(_) => {}
                None => {
                    tags.insert(key.clone(), image.digest);
                    plan.tags.push((key, image.digest));
                }
            }
        }
        walk.node(&image.digest, Some(image.media_type), Some(image.size))?;
        if !rows.expanded.insert((upstream.to_owned(), repo.clone(), image.digest)) {
            continue; // this image is in this repository already
        }
        let children = walk.nodes[&image.digest].children.clone();
        let mut present = 0;
        for child in &children {
            if (walk.carried)(child).is_none() {
                plan.missing_platforms += 1;
                continue;
            }
            present += 1;
            if walk.node(child, None, None)?.is_index() {
                return Err(ImportError::NotALayout(format!("{child}: an index inside the index {}", image.digest)));
            }
            rows.expand(&mut walk, &mut plan, i, target, child, limits)?;
        }
        if !children.is_empty() && present == 0 {
            return Err(ImportError::Incomplete(format!("{}: none of its platforms is in the layout", image.digest)));
        }
        rows.expand(&mut walk, &mut plan, i, target, &image.digest, limits)?;
    }
    Ok(plan)
}

/// The manifests read so far, and the references they hold.
struct Walk<'a> {
    carried: &'a dyn Fn(&Digest) -> Option<u64>,
    read: &'a mut dyn FnMut(&Digest) -> Result<Vec<u8>, ImportError>,
    limits: &'a ImportLimits,
    nodes: HashMap<Digest, Node>,
    references: usize,
}

impl Walk<'_> {
    /// The manifest `digest`, read and parsed the first time it is met.
    /// `declared`: the media type and size `index.json` gives it.
    fn node(
        &mut self,
        digest: &Digest,
        declared: Option<MediaType>,
        declared_size: Option<u64>,
    ) -> Result<&Node, ImportError> {
        if !self.nodes.contains_key(digest) {
            let node = self.read_node(digest, declared)?;
            self.nodes.insert(*digest, node);
        }
        let node = &self.nodes[digest];
        if let Some(declared) = declared.filter(|d| *d != node.media_type) {
            return Err(ImportError::NotALayout(format!(
                "index.json declares {digest} a {}, but it is read as a {}",
                declared.as_str(),
                node.media_type.as_str()
            )));
        }
        if let Some(size) = declared_size.filter(|s| *s != node.size) {
            return Err(ImportError::NotALayout(format!(
                "index.json declares {digest} as {size} bytes; the layout's file is {} bytes",
                node.size
            )));
        }
        Ok(node)
    }

    fn read_node(&mut self, digest: &Digest, declared: Option<MediaType>) -> Result<Node, ImportError> {
        if self.nodes.len() >= self.limits.max_manifests {
            return Err(ImportError::TooLarge(format!(
                "the layout's images have over {} manifests",
                self.limits.max_manifests
            )));
        }
        let Some(size) = (self.carried)(digest) else {
            return Err(ImportError::Incomplete(format!("the layout lacks manifest {digest}; nothing imported")));
        };
        if size > MAX_MANIFEST_SIZE as u64 {
            return Err(ImportError::NotALayout(format!(
                "manifest {digest} is {size} bytes, over {MAX_MANIFEST_SIZE}"
            )));
        }
        let bytes = (self.read)(digest)?;
        let (media_type, refs) = inspect_manifest(&bytes, declared)
            .map_err(|e| ImportError::NotALayout(format!("manifest {digest}: {e}")))?;
        if let Some(implied) = implied_type(&bytes).filter(|t| *t != media_type) {
            return Err(ImportError::NotALayout(format!(
                "manifest {digest} has no mediaType of its own, so it is a {} by its shape (Docker's types carry \
                 theirs), and the layout declares it a {}: stored so, every repository would be served it so",
                implied.as_str(),
                media_type.as_str()
            )));
        }
        let held = refs.blobs.len() + refs.manifests.len();
        if held > self.limits.max_manifest_references {
            return Err(ImportError::TooLarge(format!(
                "manifest {digest} holds {held} references, over {} for one manifest",
                self.limits.max_manifest_references
            )));
        }
        self.references += held;
        if self.references > self.limits.max_references {
            return Err(ImportError::TooLarge(format!(
                "the layout's manifests hold over {} references",
                self.limits.max_references
            )));
        }
        let mut seen = HashSet::new();
        let children = refs.manifests.into_iter().filter(|d| seen.insert(*d)).collect();
        let blobs = refs.blobs.into_iter().zip(refs.blob_sizes).collect();
        Ok(Node { media_type, size: bytes.len() as u64, blobs, children })
    }
}

/// The type a manifest without a `mediaType` of its own is by its shape:
/// an OCI index if it lists manifests, else an OCI image manifest (Docker's
/// manifest and manifest list must carry theirs). `None` when it carries
/// one (then [`inspect_manifest`] held the declared type to it).
fn implied_type(bytes: &[u8]) -> Option<MediaType> {
    #[derive(serde::Deserialize)]
    struct Shape {
        #[serde(rename = "mediaType")]
        media_type: Option<serde::de::IgnoredAny>,
        manifests: Option<serde::de::IgnoredAny>,
    }
    let shape: Shape = serde_json::from_slice(bytes).ok()?;
    match (shape.media_type, shape.manifests) {
        (Some(_), _) => None,
        (None, Some(_)) => Some(MediaType::OciIndex),
        (None, None) => Some(MediaType::OciManifest),
    }
}

/// Membership rows, each once; which (repository, manifest) pairs have
/// been expanded already; and the blobs and manifests already planned.
#[derive(Default)]
struct Rows {
    members: HashSet<String>,
    /// Membership rows considered, duplicates included: the walk's work.
    considered: usize,
    expanded: HashSet<(String, RepoName, Digest)>,
    blobs: HashSet<Digest>,
    manifests: HashSet<Digest>,
}

impl Rows {
    /// Adds manifest `digest` and the blobs it names to `target`'s
    /// repository: rows, and the content to write.
    fn expand(
        &mut self,
        walk: &mut Walk<'_>,
        plan: &mut Plan,
        i: usize,
        target: &PlanTarget<'_>,
        digest: &Digest,
        limits: &ImportLimits,
    ) -> Result<(), ImportError> {
        let (upstream, repo) = (target.upstream, target.repo);
        if digest != &target.image.digest && !self.expanded.insert((upstream.to_owned(), repo.clone(), *digest)) {
            return Ok(());
        }
        let node = &walk.nodes[digest];
        if self.manifests.insert(*digest) {
            plan.manifests.push(PlannedManifest {
                digest: *digest,
                media_type: node.media_type,
                size: node.size,
                upstream: upstream.to_owned(),
            });
        }
        self.member(plan, upstream, repo, digest, limits)?;
        for (blob, declared) in &node.blobs {
            let fresh = self.member(plan, upstream, repo, blob, limits)?;
            match (walk.carried)(blob) {
                Some(size) => {
                    if let Some(declared) = declared.filter(|d| *d != size) {
                        return Err(ImportError::NotALayout(format!(
                            "manifest {digest} declares blob {blob} as {declared} bytes; the layout's file is {size} bytes"
                        )));
                    }
                    if self.blobs.insert(*blob) {
                        plan.blobs.push(PlannedBlob { digest: *blob, size, upstream: upstream.to_owned() });
                    }
                }
                None if fresh => {
                    if plan.absent.len() >= limits.max_absent_blobs {
                        return Err(ImportError::TooLarge(format!(
                            "the layout lacks over {} blobs its images name (each would be asked upstream)",
                            limits.max_absent_blobs
                        )));
                    }
                    plan.absent.push(AbsentBlob { target: i, digest: *blob, declared: *declared });
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Records `digest` in the repository; whether the row is new.
    fn member(
        &mut self,
        plan: &mut Plan,
        upstream: &str,
        repo: &RepoName,
        digest: &Digest,
        limits: &ImportLimits,
    ) -> Result<bool, ImportError> {
        self.considered += 1;
        if self.considered > limits.max_memberships {
            return Err(ImportError::TooLarge(format!(
                "the layout's images make over {} membership rows",
                limits.max_memberships
            )));
        }
        let key = member_key(upstream, repo, digest);
        if !self.members.insert(key.clone()) {
            return Ok(false);
        }
        plan.members.push(key);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(bytes: &[u8], media_type: MediaType) -> LayoutImage {
        LayoutImage { digest: Digest::of(bytes), media_type, size: bytes.len() as u64, name: None }
    }

    fn manifest(blobs: &[&[u8]]) -> Vec<u8> {
        let layers: Vec<String> = blobs
            .iter()
            .map(|b| {
                format!(r#"{{"mediaType":"application/octet-stream","digest":"{}","size":{}}}"#, Digest::of(b), b.len())
            })
            .collect();
        format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{}","size":2}},"layers":[{}]}}"#,
            Digest::of(b"{}"),
            layers.join(",")
        )
        .into_bytes()
    }

    fn index_of(children: &[&[u8]]) -> Vec<u8> {
        let manifests: Vec<String> = children
            .iter()
            .map(|c| {
                format!(
                    r#"{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{}","size":{}}}"#,
                    Digest::of(c),
                    c.len()
                )
            })
            .collect();
        format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{}]}}"#,
            manifests.join(",")
        )
        .into_bytes()
    }

    /// A layout in memory: its files by digest, and how often each was read.
    struct Files {
        files: HashMap<Digest, Vec<u8>>,
        reads: HashMap<Digest, usize>,
    }

    impl Files {
        fn new(files: &[&[u8]]) -> Files {
            Files { files: files.iter().map(|f| (Digest::of(f), f.to_vec())).collect(), reads: HashMap::new() }
        }

        fn plan(&mut self, targets: &[PlanTarget<'_>], limits: &ImportLimits) -> Result<Plan, ImportError> {
            let sizes: HashMap<Digest, u64> = self.files.iter().map(|(d, f)| (*d, f.len() as u64)).collect();
            let carried = move |d: &Digest| sizes.get(d).copied();
            let (files, reads) = (&self.files, &mut self.reads);
            let mut read = |d: &Digest| {
                *reads.entry(*d).or_default() += 1;
                Ok(files[d].clone())
            };
            plan(targets, &carried, &mut read, limits)
        }
    }

    #[test]
    fn a_manifest_shared_by_many_images_is_read_once_and_planned_once() {
        let (layer, config) = (b"layer".as_slice(), b"{}".as_slice());
        let child = manifest(&[layer]);
        let index = index_of(&[&child]);
        let mut files = Files::new(&[layer, config, &child, &index]);
        let repo: RepoName = "team/app".parse().unwrap();
        let tags: Vec<Tag> = (0..50).map(|i| format!("v{i}").parse().unwrap()).collect();
        let top = image(&index, MediaType::OciIndex);
        let targets: Vec<PlanTarget> =
            tags.iter().map(|t| PlanTarget { upstream: "u", repo: &repo, tag: Some(t), image: &top }).collect();
        let plan = files.plan(&targets, &ImportLimits::with_max_bytes(u64::MAX)).unwrap();
        assert!(files.reads.values().all(|n| *n == 1), "each manifest read once: {:?}", files.reads);
        assert_eq!(plan.manifests.len(), 2);
        assert_eq!(plan.blobs.len(), 2, "config and layer");
        assert_eq!(plan.members.len(), 4, "two manifests and two blobs in one repository");
        assert_eq!(plan.tags.len(), 50);
        assert!(plan.absent.is_empty());
    }

    #[test]
    fn references_past_the_limit_are_refused_before_they_are_all_read() {
        let child = manifest(&[b"x"]);
        let index = index_of(&vec![child.as_slice(); 1000]);
        let mut files = Files::new(&[b"x", b"{}", &child, &index]);
        let repo: RepoName = "team/app".parse().unwrap();
        let top = image(&index, MediaType::OciIndex);
        let target = PlanTarget { upstream: "u", repo: &repo, tag: None, image: &top };
        let limits = ImportLimits { max_references: 999, ..ImportLimits::with_max_bytes(u64::MAX) };
        match files.plan(&[target], &limits) {
            Err(ImportError::TooLarge(m)) => assert!(m.contains("999 references"), "{m}"),
            other => panic!("{other:?}"),
        }
        let limits = ImportLimits { max_manifest_references: 500, ..ImportLimits::with_max_bytes(u64::MAX) };
        match files.plan(&[target], &limits) {
            Err(ImportError::TooLarge(m)) => assert!(m.contains("holds 1000 references, over 500"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_blob_the_layout_lacks_is_absent_once_per_repository_and_an_index_may_not_nest() {
        let child = manifest(&[b"not carried"]);
        let mut files = Files::new(&[b"{}", &child]);
        let (a, b): (RepoName, RepoName) = ("team/a".parse().unwrap(), "team/b".parse().unwrap());
        let top = image(&child, MediaType::OciManifest);
        let targets = [
            PlanTarget { upstream: "u", repo: &a, tag: None, image: &top },
            PlanTarget { upstream: "u", repo: &a, tag: None, image: &top },
            PlanTarget { upstream: "u", repo: &b, tag: None, image: &top },
        ];
        let plan = files.plan(&targets, &ImportLimits::with_max_bytes(u64::MAX)).unwrap();
        let absent: Vec<_> = plan.absent.iter().map(|a| (a.target, a.digest)).collect();
        assert_eq!(absent, vec![(0, Digest::of(b"not carried")), (2, Digest::of(b"not carried"))]);
        let one = ImportLimits { max_absent_blobs: 1, ..ImportLimits::with_max_bytes(u64::MAX) };
        assert!(
            matches!(files.plan(&targets, &one), Err(ImportError::TooLarge(m)) if m.contains("lacks over 1 blobs"))
        );

        let inner = index_of(&[&child]);
        let outer = index_of(&[&inner]);
        let mut files = Files::new(&[b"{}", &child, &inner, &outer]);
        let top = image(&outer, MediaType::OciIndex);
        let target = PlanTarget { upstream: "u", repo: &a, tag: None, image: &top };
        assert!(matches!(
            files.plan(&[target], &ImportLimits::with_max_bytes(u64::MAX)),
            Err(ImportError::NotALayout(_))
        ));
    }
}
