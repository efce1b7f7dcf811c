//! CRI's lazy path. A Prepare that carries CRI's labels for a layer of a
//! runnable tilefs artifact (`tilefs push --runnable-from`) is answered
//! with a committed snapshot made from the artifact's image and object
//! index alone, and AlreadyExists: containerd then downloads none of the
//! layers. A container on it reads through a FUSE server of the image
//! (started by the front end, see [`MountFn`]) that fetches each file on
//! its first read and checks it before serving a byte.
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
use tilefs_oci::digest::Digest;
use tilefs_oci::pull::PullOptions;
use tilefs_oci::ImageRef;

/// The snapshot containerd wants committed (the layer's chain ID).
pub const LABEL_TARGET: &str = "containerd.io/snapshot.ref";
pub const LABEL_IMAGE_REF: &str = "containerd.io/snapshot/cri.image-ref";
pub const LABEL_MANIFEST: &str = "containerd.io/snapshot/cri.manifest-digest";
pub const LABEL_LAYER: &str = "containerd.io/snapshot/cri.layer-digest";

/// Serves the lazily pulled image `image` (a file, or a tag) of store `store` at
/// `mountpoint`, read-only and open to every user (overlayfs reads it
/// for the container), in the background until it is unmounted; returns
/// once it is mounted. The last argument is the image's reference (its
/// credentials are the keychain's for it).
pub type MountFn = dyn Fn(&Path, &str, &Path, Option<&ImageRef>) -> Result<(), String> + Send + Sync;

/// What the lazy path needs from its front end.
#[derive(Clone)]
pub struct Lazy {
    /// How registries are reached (credentials, TLS, mirrors, signature
    /// policy), as `tilefs pull` reaches them.
    pub pull: PullOptions,
    pub mount: Arc<MountFn>,
}

/// What CRI's labels ask for.
#[derive(Debug, Clone)]
pub struct Target {
    /// The snapshot to commit: the layer's chain ID.
    pub name: String,
    /// The image, by its manifest's digest.
    pub reference: ImageRef,
    pub layer: String,
}

impl Target {
    /// None unless every one of CRI's labels is there.
    pub fn of(labels: &HashMap<String, String>) -> Option<Result<Target, String>> {
        let name = labels.get(LABEL_TARGET)?;
        let image = labels.get(LABEL_IMAGE_REF)?;
        let manifest = labels.get(LABEL_MANIFEST)?;
        let layer = labels.get(LABEL_LAYER)?;
        Some((|| {
            Digest::parse(manifest).map_err(|e| format!("label {LABEL_MANIFEST}: {e}"))?;
            let r = format!("docker://{}@{manifest}", repository(image));
            Ok(Target {
                name: name.clone(),
                reference: ImageRef::parse(&r).map_err(|e| format!("label {LABEL_IMAGE_REF}: {e}"))?,
                layer: layer.clone(),
            })
        })())
    }
}

/// The name of the lazy snapshot of chain ID `chain` of image
/// `reference` (repository and manifest digest):
/// `lazy/REFERENCE/CHAIN`.
pub fn snapshot_name(reference: &ImageRef, chain: &str) -> String {
    format!("lazy/{reference}/{chain}")
}

/// The repository of `HOST/PATH[:TAG][@DIGEST]`.
fn repository(image_ref: &str) -> &str {
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

/// The blobs of the runnable artifact `r` names (None: it is none),
/// asked of the registry once per manifest: containerd prepares an image's
/// layers one after another, and a manifest named by its digest never
/// changes.
#[derive(Default)]
pub struct Artifacts {
    known: std::sync::Mutex<HashMap<String, Option<Vec<Digest>>>>,
}

impl Artifacts {
    /// Most manifests remembered.
    const MAX: usize = 1024;

    pub fn layers(&self, r: &ImageRef, lazy: &Lazy) -> Result<Option<Vec<Digest>>, String> {
        let key = r.to_string();
        if let Some(known) = self.known.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(known.clone());
        }
        let layers = tilefs_oci::pull::runnable_layers(r, &lazy.pull).map_err(|e| e.to_string())?;
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if known.len() >= Self::MAX {
            known.clear();
        }
        known.insert(key, layers.clone());
        Ok(layers)
    }
}

/// Checks `t` against the artifact whose blobs (diff IDs) are `layers`:
/// the chain IDs of its layers up to `t`'s, the last being `t.name`.
pub fn check(t: &Target, layers: &[Digest]) -> Result<Vec<String>, String> {
    let chain = chain_ids(layers);
    let i = layers
        .iter()
        .position(|l| l.to_string() == t.layer)
        .ok_or_else(|| format!("label {LABEL_LAYER} names {}, no layer of {}", t.layer, t.reference))?;
    if chain[i] != t.name {
        return Err(format!(
            "label {LABEL_TARGET} names {}, but layer {} of {} has chain ID {}",
            t.name,
            i + 1,
            t.reference,
            chain[i]
        ));
    }
    Ok(chain[..=i].to_vec())
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
