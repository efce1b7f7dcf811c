//! CRI's lazy path. A Prepare that carries CRI's labels for a layer of a
//! runnable tilefs artifact (`tilefs push --runnable-from`) is answered
//! with a committed snapshot made from the artifact's image and object
//! index alone, and AlreadyExists: containerd then downloads none of the
//! layers. Where the store's filesystem takes fanotify pre-content marks,
//! a container on it is a kernel overlay over the image's EROFS mount and
//! the store, whose objects not fetched yet are placeholders that a filler
//! fetches, checks and writes on their first open or read, before the
//! reader gets a byte ([`How::Kernel`]); elsewhere it reads through a FUSE
//! server of the image that fetches each file on its first read and checks
//! it before serving a byte. Both run in processes of their own (started
//! by the front end, see [`MountFn`]), which outlive the snapshotter.
//!
//! An ordinary image with a tilefs index ([`tilefs_oci::lazy_index`]) is
//! served the same way, but each layer's snapshot has an image of its own:
//! that of its chain (the layers up to it), made from the index's layer
//! maps, its files fetched by range from the ordinary layer blobs. The
//! chain IDs are the image's own (its configuration's diff IDs), which
//! other images share: the snapshot may be made over any committed
//! snapshot of the chain below (one containerd unpacked, say), whose
//! files it does not use. An eStargz or zstd:chunked image without an
//! index is served so too, each chain's image made from its layers'
//! tables of contents ([`tilefs_oci::toc_lazy`]). Any other image (or one
//! whose index or tables cannot be used) is left to containerd's unpack,
//! and why is logged and kept for CRI's ImageStatus ([`Said`]).
//!
//! The labels are not trusted: the snapshot is made only if the chain ID
//! the artifact's own configuration (fetched by the manifest's digest, under
//! the signature policy) gives the layer is the one the labels name. Every
//! layer of an artifact shows the whole image: the chain IDs are those of
//! the artifact's blobs (its EROFS image first), which no other image
//! shares, so no other chain is built on them by mistake.
//!
//! A lazy snapshot belongs to its image reference (issue 43): two
//! repositories may hold the same artifact, one of them hostile, and a
//! Prepare for one must neither be answered with the other's snapshot
//! (whose files are fetched from the other registry, which would see what
//! is read and could withhold it) nor skip its own registry and signature
//! policy. So each is named by reference and chain ID
//! ([`snapshot_name`]). containerd, told AlreadyExists, looks for the
//! snapshot by the chain ID label and the parent (a walk, which names
//! neither the reference nor containerd's namespace: containerd 1.6 sends
//! the namespace header to no proxy plugin); the walk is shown only the
//! snapshot the Prepare before it was answered with, and a Prepare of
//! another reference for the same chain ID and parent waits until that
//! walk came. Within one containerd namespace containerd itself asks the
//! snapshotter nothing for a chain ID it has already (its metadata is
//! keyed by chain ID, whatever the snapshotter): a second reference with
//! the same artifact there uses the first's snapshots.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tilefs_oci::digest::Digest;
use tilefs_oci::lazy_index::{LazyKind, LazyPlan};
use tilefs_oci::pull::PullOptions;
use tilefs_oci::ImageRef;

/// The snapshot containerd wants committed (the layer's chain ID).
pub const LABEL_TARGET: &str = "containerd.io/snapshot.ref";
pub const LABEL_IMAGE_REF: &str = "containerd.io/snapshot/cri.image-ref";
pub const LABEL_MANIFEST: &str = "containerd.io/snapshot/cri.manifest-digest";
pub const LABEL_LAYER: &str = "containerd.io/snapshot/cri.layer-digest";

/// Serves the lazily pulled image `image` (a file, or a tag) of store `store` at
/// `mountpoint`, read-only and open to every user (overlayfs reads it
/// for the container), as `how` says, in the background until it is
/// unmounted; returns once it is mounted. The fourth argument is the
/// image's reference (its credentials are the keychain's for it).
pub type MountFn = dyn Fn(&Path, &str, &Path, Option<&ImageRef>, How) -> Result<(), Refused> + Send + Sync;

/// How a lazily pulled image is served to the containers on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum How {
    /// Mounted by the kernel as EROFS alone, the store the data-only lower
    /// of the containers' overlays (as images that are not lazy are), the
    /// objects not fetched yet placeholders that a filler (a process of
    /// its own, which outlives the snapshotter) fills on first open or
    /// read; with `fetch_rest`, the others too in the background, at that
    /// many bytes a second.
    Kernel { fetch_rest: Option<u64> },
    /// By a FUSE server that fetches files on first read.
    Fuse,
}

/// Why a [`MountFn`] mounted nothing.
#[derive(Debug)]
pub enum Refused {
    /// The kernel cannot serve lazy images from this store (said once; the
    /// same for every image).
    KernelUnable(String),
    Failed(crate::Error),
}

impl From<crate::Error> for Refused {
    fn from(e: crate::Error) -> Refused {
        Refused::Failed(e)
    }
}

/// Why a layer is not served lazily: its labels, its image or its plan.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotServed(pub String);

/// What the lazy path needs from its front end.
#[derive(Clone)]
pub struct Lazy {
    /// How registries are reached (credentials, TLS, mirrors, signature
    /// policy), as `tilefs pull` reaches them.
    pub pull: PullOptions,
    pub mount: Arc<MountFn>,
    /// Serve lazy images by the kernel where it can fill their objects on
    /// first access (else, and when false, by FUSE).
    pub kernel: bool,
    /// With the kernel: fetch the rest of each image in the background at
    /// this many bytes a second ([`How::Kernel`]).
    pub fetch_rest: Option<u64>,
}

/// What CRI's labels ask for.
#[derive(Debug, Clone)]
pub struct Target {
    /// The snapshot to commit: the layer's chain ID.
    pub name: String,
    /// The image, by its manifest's digest.
    pub reference: ImageRef,
    pub layer: String,
    /// The image as CRI lists it among its repo digests (`REPO@DIGEST`):
    /// what is said of it is said under this ([`Said`]).
    pub repo_digest: String,
}

impl Target {
    /// None unless every one of CRI's labels is there.
    pub fn of(labels: &HashMap<String, String>) -> Option<Result<Target, NotServed>> {
        let name = labels.get(LABEL_TARGET)?;
        let image = labels.get(LABEL_IMAGE_REF)?;
        let manifest = labels.get(LABEL_MANIFEST)?;
        let layer = labels.get(LABEL_LAYER)?;
        Some((|| {
            Ok(Target {
                name: name.clone(),
                reference: by_digest(image, manifest)?,
                layer: layer.clone(),
                repo_digest: format!("{}@{manifest}", repository(image)),
            })
        })())
    }
}

/// `docker://REPO@MANIFEST` of the image CRI names `image` (`REPO[:TAG]`).
pub fn by_digest(image: &str, manifest: &str) -> Result<ImageRef, NotServed> {
    Digest::parse(manifest).map_err(|e| NotServed(format!("label {LABEL_MANIFEST}: {e}")))?;
    let r = format!("docker://{}@{manifest}", repository(image));
    ImageRef::parse(&r).map_err(|e| NotServed(format!("label {LABEL_IMAGE_REF}: {e}")))
}

/// The name of the lazy snapshot of chain ID `chain` of image
/// `reference` (repository and manifest digest):
/// `lazy/REFERENCE/CHAIN`.
pub fn snapshot_name(reference: &ImageRef, chain: &str) -> String {
    format!("lazy/{reference}/{chain}")
}

/// The name of the lazy snapshot of chain ID `chain` of an ordinary image
/// `reference` over `parent`: [`snapshot_name`] over the image's own lazy
/// snapshot of the chain below (`below`) or over none,
/// `lazy/REFERENCE/CHAIN/on/PARENT` over another (a snapshot containerd
/// unpacked, another image's): containerd's walk looks for it by parent.
pub fn snapshot_name_on(reference: &ImageRef, chain: &str, parent: &str, below: &str) -> String {
    match parent.is_empty() || parent == snapshot_name(reference, below) {
        true => snapshot_name(reference, chain),
        false => format!("{}/on/{parent}", snapshot_name(reference, chain)),
    }
}

/// `image` as CRI names images (and so labels and lists them): a name
/// without a registry host is Docker Hub's (`docker.io/`, and
/// `library/` for a name of one component).
pub fn normalized(image: &str) -> String {
    let (first, rest) = image.split_once('/').unwrap_or(("", image));
    let host = first.contains(['.', ':']) || first == "localhost";
    match (host, first.is_empty()) {
        (true, _) => image.to_string(),
        (false, true) => format!("docker.io/library/{rest}"),
        (false, false) => format!("docker.io/{image}"),
    }
}

/// The repository of `HOST/PATH[:TAG][@DIGEST]`.
pub fn repository(image_ref: &str) -> &str {
    let name = image_ref.split('@').next().unwrap_or(image_ref);
    match name.rfind(':') {
        Some(i) if !name[i..].contains('/') => &name[..i],
        _ => name,
    }
}

/// The chain IDs of layers with these diff IDs (the OCI image spec's
/// ChainID: the first is its diff ID, each next the SHA-256 of the one
/// before, a space and its diff ID).
pub fn chain_ids(diff_ids: &[Digest]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(diff_ids.len());
    for d in diff_ids {
        let next = match out.last() {
            None => d.to_string(),
            Some(prev) => Digest::sha256_of(format!("{prev} {d}").as_bytes()).to_string(),
        };
        out.push(next);
    }
    out
}

/// What a lazy start of each image can go by ([`tilefs_oci::lazy_index::plan`]),
/// asked of the registry once per manifest: containerd prepares an image's
/// layers one after another, and a manifest named by its digest never
/// changes. That an image is to be pulled whole is remembered a short while
/// only (an index may be pushed for it since); errors are not remembered.
#[derive(Default)]
pub struct Plans {
    known: std::sync::Mutex<HashMap<String, (Instant, Arc<LazyPlan>)>>,
}

impl Plans {
    /// Most manifests remembered (an index's image and layer maps, or
    /// the layers' tables of contents, are held: a few MB each for an
    /// image of a GB).
    const MAX: usize = 16;
    /// How long an image found to be pulled whole is taken to be.
    const WHOLE_FOR: Duration = Duration::from_secs(30);

    pub fn plan(&self, r: &ImageRef, lazy: &Lazy) -> Result<Arc<LazyPlan>, NotServed> {
        let key = r.to_string();
        if let Some((at, plan)) = self.known.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            if !matches!(plan.kind, LazyKind::Whole(_)) || at.elapsed() < Self::WHOLE_FOR {
                return Ok(plan.clone());
            }
        }
        let plan = Arc::new(tilefs_oci::lazy_index::plan(r, &lazy.pull).map_err(|e| NotServed(e.to_string()))?);
        self.remember(key, plan.clone());
        Ok(plan)
    }

    /// Keeps `plan` for the image `key` names (its repository and manifest
    /// digest, as [`Target::reference`] names it).
    pub fn remember(&self, key: String, plan: Arc<LazyPlan>) {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if known.len() >= Self::MAX {
            known.clear();
        }
        known.insert(key, (Instant::now(), plan));
    }
}

/// Checks `t` against the image whose layer blobs are `blobs` and diff
/// IDs `diff_ids` (an artifact's are its blobs): the chain IDs of its
/// layers up to `t`'s, the last being `t.name`.
pub fn check(t: &Target, blobs: &[Digest], diff_ids: &[Digest]) -> Result<Vec<String>, NotServed> {
    let chain = chain_ids(diff_ids);
    let mut at = blobs
        .iter()
        .enumerate()
        .filter(|(_, l)| l.to_string() == t.layer)
        .map(|(i, _)| i);
    let first = at.next().ok_or_else(|| {
        NotServed(format!(
            "label {LABEL_LAYER} names {}, no layer of {}",
            t.layer, t.reference
        ))
    })?;
    // A blob listed twice is two layers of two chains.
    let i = std::iter::once(first)
        .chain(at)
        .find(|&i| chain[i] == t.name)
        .ok_or_else(|| {
            NotServed(format!(
                "label {LABEL_TARGET} names {}, but layer {} of {} has chain ID {}",
                t.name,
                first + 1,
                t.reference,
                chain[first]
            ))
        })?;
    Ok(chain[..=i].to_vec())
}

/// What became of the images CRI pulled through the snapshotter, by repo
/// digest (`REPO@DIGEST`): served lazily (how), or pulled whole (why).
/// CRI's image service proxy ([`crate::cri`]) shows it in ImageStatus, so
/// that `crictl inspecti` says it; in memory, the latest images only.
#[derive(Default)]
pub struct Said {
    inner: std::sync::Mutex<SaidInner>,
}

#[derive(Default)]
struct SaidInner {
    of: HashMap<String, Outcome>,
    /// The repo digest of an image by its index's (a multi-platform
    /// image's tag names an index; its layers' labels its platform's
    /// manifest).
    alias: HashMap<String, String>,
}

#[derive(Default)]
struct Outcome {
    lazy: Option<String>,
    /// Why layers were unpacked whole, each reason once.
    whole: Vec<String>,
}

impl Said {
    const MAX: usize = 1024;

    fn with(&self, f: impl FnOnce(&mut SaidInner)) {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if s.of.len() >= Self::MAX || s.alias.len() >= Self::MAX {
            *s = SaidInner::default();
        }
        f(&mut s)
    }

    /// A pull of the image `repo_digest` (and `top`, its index's) begins:
    /// what an earlier one said goes.
    pub fn begin(&self, repo_digest: &str, top: Option<&str>) {
        self.with(|s| {
            s.of.remove(repo_digest);
            if let Some(top) = top.filter(|t| *t != repo_digest) {
                s.alias.insert(top.to_string(), repo_digest.to_string());
            }
        })
    }

    pub fn lazy(&self, repo_digest: &str, how: String) {
        self.with(|s| s.of.entry(repo_digest.to_string()).or_default().lazy = Some(how))
    }

    pub fn whole(&self, repo_digest: &str, why: String) {
        self.with(|s| {
            let o = s.of.entry(repo_digest.to_string()).or_default();
            if !o.whole.contains(&why) {
                o.whole.push(why);
            }
        })
    }

    /// What is said of the image with these repo digests, if anything:
    /// whether every layer it had prepared was served lazily, and how (or
    /// why not).
    pub fn of(&self, repo_digests: &[String]) -> Option<(bool, String)> {
        let s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let o = repo_digests
            .iter()
            .find_map(|d| s.of.get(d).or_else(|| s.of.get(s.alias.get(d)?)))?;
        Some(match (&o.lazy, o.whole.as_slice()) {
            (Some(l), []) => (true, l.clone()),
            (None, w) => (false, format!("pulled whole: {}", w.join("; "))),
            (Some(l), w) => (false, format!("{l}; but layers unpacked whole: {}", w.join("; "))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_ids_follow_the_image_spec() {
        let a = Digest::sha256_of(b"a");
        let b = Digest::sha256_of(b"b");
        let ids = chain_ids(&[a.clone(), b.clone()]);
        assert_eq!(ids[0], a.to_string());
        assert_eq!(ids[1], Digest::sha256_of(format!("{a} {b}").as_bytes()).to_string());
    }

    #[test]
    fn the_repository_drops_tag_and_digest_but_not_the_port() {
        assert_eq!(repository("127.0.0.1:5000/app:v1"), "127.0.0.1:5000/app");
        assert_eq!(repository("127.0.0.1:5000/app"), "127.0.0.1:5000/app");
        assert_eq!(repository("docker.io/library/x:1@sha256:ab"), "docker.io/library/x");
    }

    #[test]
    fn names_are_normalized_as_cri_lists_them() {
        assert_eq!(normalized("busybox:1"), "docker.io/library/busybox:1");
        assert_eq!(normalized("team/app"), "docker.io/team/app");
        assert_eq!(normalized("127.0.0.1:5000/app:v1"), "127.0.0.1:5000/app:v1");
        assert_eq!(normalized("localhost/app"), "localhost/app");
        assert_eq!(normalized("reg.example/a/b@sha256:ab"), "reg.example/a/b@sha256:ab");
    }

    #[test]
    fn what_is_said_of_an_image_gathers_its_layers() {
        let said = Said::default();
        let (img, top) = ("r/app@sha256:aa", "r/app@sha256:bb");
        said.begin(img, Some(top));
        assert_eq!(said.of(&[top.to_string()]), None);
        said.whole(img, "no index".into());
        said.whole(img, "no index".into());
        let of = |d: &str| said.of(&["other".into(), d.to_string()]);
        assert_eq!(of(top), Some((false, "pulled whole: no index".into())));
        said.lazy(img, "lazy: x".into());
        assert_eq!(
            of(img),
            Some((false, "lazy: x; but layers unpacked whole: no index".into()))
        );
        said.begin(img, None);
        said.lazy(img, "lazy: x".into());
        assert_eq!(of(img), Some((true, "lazy: x".into())));
    }

    #[test]
    fn targets_need_every_label() {
        let mut l = HashMap::new();
        l.insert(LABEL_TARGET.to_string(), "sha256:aa".to_string());
        l.insert(LABEL_IMAGE_REF.to_string(), "127.0.0.1:5000/app:v1".to_string());
        l.insert(LABEL_LAYER.to_string(), "sha256:bb".to_string());
        assert!(Target::of(&l).is_none());
        l.insert(LABEL_MANIFEST.to_string(), format!("sha256:{}", "c".repeat(64)));
        let t = Target::of(&l).unwrap().unwrap();
        assert_eq!(
            t.reference.to_string(),
            format!("docker://127.0.0.1:5000/app@sha256:{}", "c".repeat(64))
        );
        l.insert(LABEL_MANIFEST.to_string(), "nonsense".to_string());
        assert!(Target::of(&l).unwrap().is_err());
    }
}
