//! Where an image comes from. Each transport finds the image's manifest
//! and opens its blobs; the blobs it opens are raw bytes, which
//! [`crate::pull`] checks against their digests as they stream.

pub mod archive;
pub mod auth;
pub mod hosts;
pub mod keychain;
pub mod layout;
pub mod registry;

use crate::digest::Digest;
use crate::manifest::{self, BlobRef, Document, Platform};
use crate::{ImageRef, OciError};
use std::io::Read;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// An image as its transport describes it.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The manifest's digest (where the image has a manifest of its own).
    pub manifest_digest: Option<Digest>,
    pub config: Option<BlobRef>,
    pub layers: Vec<BlobRef>,
    /// A tilefs image pushed as an artifact ([`crate::artifact`]): the
    /// layers are its blobs.
    pub artifact: bool,
    /// The manifest or index the reference names, as its bytes came (what
    /// signatures sign; empty for a Docker archive, which has none).
    pub top_manifest: Vec<u8>,
    /// The image manifest's bytes, checked against its digest (the top
    /// manifest's, unless that is an index; empty for a Docker archive).
    pub manifest: Vec<u8>,
    /// How the image passed the signature policy ([`crate::trust`]), once
    /// it has.
    pub trust: Option<tilefs_trust::TrustRecord>,
    /// What the check read, kept in the store with the image.
    pub evidence: Option<tilefs_trust::evidence::Evidence>,
}

/// A source of manifests and blobs.
pub trait Transport: Send + Sync {
    /// The image's manifest, resolved for `platform`, and its layers.
    fn resolve(&self, platform: &Platform) -> Result<Resolved, OciError>;
    /// Opens a blob's raw bytes (unverified: the caller checks them).
    fn open_blob(&self, blob: &BlobRef) -> Result<Box<dyn Read + Send + '_>, OciError>;
    /// Opens `len` bytes of a blob from `offset` (unverified).
    fn open_range(&self, blob: &BlobRef, offset: u64, len: u64) -> Result<Box<dyn Read + Send + '_>, OciError> {
        let _ = (offset, len);
        Err(OciError::blob(
            &blob.digest.to_string(),
            "this transport cannot read part of a blob (pull from a registry or an OCI layout)",
        ))
    }
    /// Where blobs come from, for messages (the registry, the layout).
    fn origin(&self) -> String;
}

/// How to reach registries.
#[derive(Debug, Clone)]
pub struct RegistryOptions {
    /// Check TLS certificates and require HTTPS (`--tls-verify=false`
    /// allows plain HTTP and unchecked certificates, as skopeo's does).
    pub tls_verify: bool,
    /// How long a connection, an answer or the next bytes of a transfer
    /// may take before it fails; a small document (a manifest, a
    /// configuration, a signature) must come whole within it.
    pub timeout: Duration,
    /// Least average rate, in bytes per second, of a transfer over each
    /// `timeout` it waits for data (0: none): a server that drips fails.
    pub min_rate: u64,
    /// Once set, transfers under way fail ("interrupted") within a tenth of
    /// a second.
    pub cancel: Option<Arc<AtomicBool>>,
}

/// The default of [`RegistryOptions::min_rate`] (`--min-rate`).
pub const DEFAULT_MIN_RATE: u64 = 1024;

impl Default for RegistryOptions {
    fn default() -> Self {
        RegistryOptions {
            tls_verify: true,
            timeout: Duration::from_secs(60),
            min_rate: DEFAULT_MIN_RATE,
            cancel: None,
        }
    }
}

/// Opens the transport of `r`.
pub fn open(r: &ImageRef, opts: &RegistryOptions) -> Result<Box<dyn Transport>, OciError> {
    Ok(match r {
        ImageRef::OciDir { dir, tag } => Box::new(layout::Layout::open_dir(dir, tag.clone())?),
        ImageRef::OciArchive { file, tag } => Box::new(layout::Layout::open_archive(file, tag.clone())?),
        ImageRef::DockerArchive { file, image } => Box::new(archive::DockerArchive::open(file, image.clone())?),
        ImageRef::Registry { reference } => Box::new(registry::Registry::open(reference, opts)?),
        ImageRef::Name { name } => {
            return Err(OciError::Reference(format!(
                "{name}: an image name is resolved through registries.conf first (pull resolves it)"
            )))
        }
    })
}

/// Fetches a manifest by digest (and size), checked against the digest.
pub(crate) type FetchManifest<'a> = &'a dyn Fn(&Digest, u64) -> Result<Vec<u8>, OciError>;

/// Follows an index (or nested indexes) down to the image manifest for
/// `platform`. `fetch` returns a manifest's bytes, already checked against
/// its digest.
pub(crate) fn resolve_manifest(
    top: Vec<u8>,
    top_digest: Option<Digest>,
    what: &str,
    platform: &Platform,
    fetch: FetchManifest,
) -> Result<Resolved, OciError> {
    let top_manifest = top.clone();
    let mut bytes = top;
    let mut digest = top_digest;
    let mut what = what.to_string();
    // Indexes may nest; a loop of them must not hang us.
    for _ in 0..8 {
        match manifest::parse(&bytes, &what)? {
            Document::Index(index) => {
                let (d, size) = manifest::pick(&index, platform, &what)?;
                if size > manifest::MAX_MANIFEST {
                    return Err(OciError::manifest(
                        &what,
                        format!("manifest {d} is too large ({size} bytes)"),
                    ));
                }
                bytes = fetch(&d, size)?;
                what = format!("manifest {d}");
                digest = Some(d);
            }
            Document::Manifest(m) => {
                let config = manifest::config(&m, &what)?;
                let first = m.layers().first().map(|l| l.media_type().to_string());
                let artifact = crate::artifact::is_artifact(&config.media_type, first.as_deref());
                return Ok(Resolved {
                    manifest_digest: digest,
                    config: Some(config),
                    layers: manifest::layers(&m, &what, artifact)?,
                    artifact,
                    top_manifest,
                    manifest: bytes,
                    trust: None,
                    evidence: None,
                });
            }
        }
    }
    Err(OciError::manifest(what, "indexes nested more than 8 deep"))
}

/// The image of `items` named `wanted` (by the names `names_of` gives
/// each), or when none is wanted the only one there is; `container` ("the
/// layout") and `syntax` ("DIR:NAME") phrase the errors.
pub(crate) fn choose<'a, T>(
    items: &'a [T],
    wanted: Option<&str>,
    names_of: impl Fn(&T) -> Vec<String>,
    what: &str,
    container: &str,
    syntax: &str,
) -> Result<&'a T, OciError> {
    let all = || items.iter().flat_map(&names_of).collect::<Vec<_>>().join(", ");
    match (wanted, items) {
        (Some(name), _) => items
            .iter()
            .find(|i| names_of(i).iter().any(|n| n == name))
            .ok_or_else(|| {
                let names = all();
                let names = if names.is_empty() { "none".to_string() } else { names };
                OciError::manifest(what, format!("no image named {name:?} (it names {names})"))
            }),
        (None, [only]) => Ok(only),
        (None, []) => Err(OciError::manifest(what, format!("{container} holds no image"))),
        (None, many) => Err(OciError::manifest(
            what,
            format!(
                "{container} holds {} images; name one ({syntax}) of: {}",
                many.len(),
                all()
            ),
        )),
    }
}

/// Reads a whole small blob (a manifest, a configuration) with its size
/// cap ([`crate::bounded`]) and checks it.
pub(crate) fn read_checked(mut r: impl Read, d: &Digest, limit: u64, what: &str) -> Result<Vec<u8>, OciError> {
    let bytes = crate::bounded::read_at_most(&mut r, limit)
        .map_err(|e| OciError::blob(&d.to_string(), format!("{what}: {e}")))?;
    if !d.matches(&bytes) {
        return Err(OciError::blob(
            &d.to_string(),
            format!("{what} does not match its digest"),
        ));
    }
    Ok(bytes)
}
