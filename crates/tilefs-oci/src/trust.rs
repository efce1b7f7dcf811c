//! The signature policy and registries.conf on every path that brings an
//! image in ([`tilefs_trust`] holds the rules; this module fetches what
//! they need).
//!
//! A registry image is resolved from its name (short names through
//! aliases and search registries), routed (a blocked registry refused;
//! mirrors in order, then the registry; `insecure`), its top-level manifest
//! fetched, and only then judged: policy scope, signatures from the
//! lookaside store registries.d names for the image (`file://`, `http://`,
//! `https://`) and from sigstore attachments of the registry that served
//! the manifest. Nothing is written before the image is accepted.

use crate::bounded::MAX_SIGNATURE;
use crate::digest::Digest;
use crate::manifest::{BlobRef, Platform};
use crate::transport::registry::Registry;
use crate::transport::{self, RegistryOptions, Resolved, Transport};
use crate::{ImageRef, OciError};
use tilefs_trust::evidence::Evidence;
use tilefs_trust::policy::{NoSignatures, SignatureSource, SourceError, Subject};
use tilefs_trust::registries_d::{self, Storage};
use tilefs_trust::sigstore::{self, SigstoreSignature};
use tilefs_trust::{DockerRef, Paths, Policy, RegistriesConf};

/// Where the trust configuration comes from, and whether the command line
/// chose TLS (then registries.conf's `insecure` does not apply).
#[derive(Debug, Clone, Default)]
pub struct TrustOptions {
    pub paths: Paths,
    /// `--tls-verify` was given: [`RegistryOptions::tls_verify`] wins over
    /// registries.conf.
    pub tls_verify_explicit: bool,
}

pub use tilefs_trust::TrustRecord;

/// Most signatures read for one image, from the lookaside and from the
/// attachments each (each at most [`MAX_SIGNATURE`] bytes).
const MAX_LOOKASIDE: usize = 128;

/// An image opened and accepted by the policy.
pub struct Opened {
    pub transport: Box<dyn Transport>,
    pub resolved: Resolved,
    /// Where it was found (a mirror's reference, or the registry's).
    pub source: ImageRef,
    /// How it was reached there (registries.conf's `insecure`).
    pub registry: RegistryOptions,
}

/// Opens `r`, resolves its manifest for `platform` and checks it against
/// the signature policy.
pub fn open_checked(
    r: &ImageRef,
    registry: &RegistryOptions,
    trust: &TrustOptions,
    platform: &Platform,
) -> Result<Opened, OciError> {
    let policy = trust.paths.load_policy()?;
    match r {
        ImageRef::Registry { reference } => {
            let logical = DockerRef::parse_normalized(reference)
                .map_err(tilefs_trust::Error::from)?
                .with_default_tag();
            let conf = trust.paths.load_registries_conf()?;
            open_registry(&[logical], "", &policy, &conf, registry, trust, platform)
        }
        ImageRef::Name { name } => {
            let conf = trust.paths.load_registries_conf()?;
            let res = conf.resolve(name)?;
            open_registry(&res.candidates, &res.how, &policy, &conf, registry, trust, platform)
        }
        local => {
            let t = transport::open(local, registry)?;
            let resolved = t.resolve(platform)?;
            let subject = match local {
                ImageRef::OciDir { dir, tag } => Subject::path("oci", dir, tag.as_deref(), local.to_string()),
                ImageRef::OciArchive { file, tag } => {
                    Subject::path("oci-archive", file, tag.as_deref(), local.to_string())
                }
                ImageRef::DockerArchive { file, image } => {
                    Subject::path("docker-archive", file, image.as_deref(), local.to_string())
                }
                _ => unreachable!(),
            };
            let none = NoSignatures("a local layout or archive, which holds no signatures");
            let accepted = policy
                .evaluate(&subject, &resolved.top_manifest, &none)
                .map_err(tilefs_trust::Refused::from)?;
            let mut resolved = resolved;
            resolved.evidence = Some(Evidence::new(
                &subject,
                &resolved.top_manifest,
                &[],
                &[],
                none.0.to_string(),
                &accepted,
            ));
            Ok(Opened {
                transport: t,
                resolved,
                source: local.clone(),
                registry: registry.clone(),
            })
        }
    }
}

/// Tries each candidate name, and for each its endpoints in order; the
/// first that has the image is judged.
fn open_registry(
    candidates: &[DockerRef],
    how: &str,
    policy: &Policy,
    conf: &RegistriesConf,
    registry: &RegistryOptions,
    trust: &TrustOptions,
    platform: &Platform,
) -> Result<Opened, OciError> {
    let mut tried = Vec::new();
    for logical in candidates {
        let route = conf.route(logical)?;
        for ep in &route.endpoints {
            let opts = RegistryOptions {
                tls_verify: if trust.tls_verify_explicit {
                    registry.tls_verify
                } else {
                    !ep.insecure
                },
                ..registry.clone()
            };
            let physical = ep.reference.to_string();
            let attempt = Registry::open(&physical, &opts).and_then(|reg| {
                let resolved = reg.resolve(platform)?;
                Ok((reg, resolved))
            });
            let (reg, mut resolved) = match attempt {
                Ok(x) => x,
                // Unreachable, or without the image: the next one. Bytes
                // that are not what their digest says are an error.
                Err(e @ OciError::Registry { .. }) if route.endpoints.len() > 1 || candidates.len() > 1 => {
                    tried.push(format!("{}{}: {e}", physical, if ep.mirror { " (mirror)" } else { "" }));
                    continue;
                }
                Err(e) => return Err(e),
            };
            let digest = Digest::sha256_of(&resolved.top_manifest).to_string();
            let checked = check_registry_image(policy, &trust.paths, logical, &reg, &resolved.top_manifest, &digest)?;
            resolved.evidence = Some(checked.evidence);
            resolved.trust = Some(TrustRecord {
                logical: format!("docker://{logical}"),
                manifest_digest: digest,
                paths: trust.paths.resolved(),
            });
            return Ok(Opened {
                transport: Box::new(reg),
                resolved,
                source: ImageRef::Registry { reference: physical },
                registry: opts,
            });
        }
    }
    Err(OciError::Registry {
        registry: candidates.first().map(|c| c.domain.clone()).unwrap_or_default(),
        reason: format!(
            "no registry had the image{}: {}",
            if how.is_empty() {
                String::new()
            } else {
                format!(" (names from {how})")
            },
            tried.join("; ")
        ),
    })
}

/// An image the policy accepted: how, and the record of it that a later
/// check (the mount service, a snapshotter) can judge again offline.
pub struct Checked {
    pub accepted: tilefs_trust::Accepted,
    pub evidence: Evidence,
}

/// Judges the registry image `logical` whose top-level manifest `manifest`
/// (digest `digest`) came from `reg`: the library call every path that
/// brings a registry image in makes (pull, a lazy mount's first fetch, a
/// snapshotter resolving an image reference CRI gives it: open the
/// [`Registry`], resolve, then call this before anything is stored).
pub fn check_registry_image(
    policy: &Policy,
    paths: &Paths,
    logical: &DockerRef,
    reg: &Registry,
    manifest: &[u8],
    digest: &str,
) -> Result<Checked, OciError> {
    let subject = Subject::docker(logical);
    if !policy.needs_signatures(&subject) {
        let none = NoSignatures("no requirement needed signatures");
        let accepted = policy
            .evaluate(&subject, manifest, &none)
            .map_err(tilefs_trust::Refused::from)?;
        let evidence = Evidence::new(&subject, manifest, &[], &[], none.0.into(), &accepted);
        return Ok(Checked { accepted, evidence });
    }
    let rd = paths.load_registries_d()?;
    let source = RegistrySignatures {
        reg,
        logical,
        digest,
        storage: rd.storage_for(logical),
        simple_read: Default::default(),
        sigstore_read: Default::default(),
    };
    let accepted = policy
        .evaluate(&subject, manifest, &source)
        .map_err(tilefs_trust::Refused::from)?;
    let origin = format!("{}; {}", source.simple_origin(), source.sigstore_origin());
    let simple = source.simple_read.into_inner().unwrap_or_default();
    let sigstore = source.sigstore_read.into_inner().unwrap_or_default();
    let evidence = Evidence::new(&subject, manifest, &simple, &sigstore, origin, &accepted);
    Ok(Checked { accepted, evidence })
}

/// Keeps the record of how the image `image` (fs-verity digest) passed
/// the policy in `store`, before it is tagged.
pub fn save_evidence(store: &tilefs_store::Store, image: &[u8; 32], resolved: &Resolved) -> Result<(), OciError> {
    let Some(e) = &resolved.evidence else {
        return Ok(());
    };
    tilefs_trust::evidence::save(store.path(), image, e).map_err(|err| {
        OciError::Store(tilefs_store::StoreError::io(
            &tilefs_trust::evidence::path(store.path(), image),
            "cannot write the trust record",
            err,
        ))
    })
}

/// Judges again, under `policy`, an image already in `store` (fs-verity
/// digest `image`) by the record its pull kept: what the mount service
/// does before it mounts a tag of a store whose rule names a signature
/// policy, and what a snapshotter does for an image it finds present.
pub fn check_stored(
    store: &tilefs_store::Store,
    image: &[u8; 32],
    policy: &Policy,
) -> Result<tilefs_trust::Accepted, OciError> {
    Ok(tilefs_trust::evidence::check_stored(store.path(), image, policy)?)
}

/// Signatures of one image in a registry (those read are kept for the
/// record).
struct RegistrySignatures<'a> {
    reg: &'a Registry,
    logical: &'a DockerRef,
    digest: &'a str,
    storage: Storage,
    simple_read: std::cell::OnceCell<Vec<Vec<u8>>>,
    sigstore_read: std::cell::OnceCell<Vec<SigstoreSignature>>,
}

impl SignatureSource for RegistrySignatures<'_> {
    fn simple(&self) -> Result<Vec<Vec<u8>>, SourceError> {
        let got = self.read_simple()?;
        let _ = self.simple_read.set(got.clone());
        Ok(got)
    }

    fn sigstore(&self) -> Result<Vec<SigstoreSignature>, SourceError> {
        let got = self.read_sigstore()?;
        let _ = self.sigstore_read.set(got.clone());
        Ok(got)
    }

    fn simple_origin(&self) -> String {
        match &self.storage.lookaside {
            Some(b) => format!("the lookaside {b} ({})", self.storage.from),
            None => format!("no lookaside: {} defines none", self.storage.from),
        }
    }

    fn sigstore_origin(&self) -> String {
        if self.storage.use_sigstore_attachments {
            format!(
                "the attachments {} of {}",
                sigstore::signature_tag(self.digest),
                self.reg.origin()
            )
        } else {
            format!(
                "no sigstore attachments: use-sigstore-attachments is not enabled for {} ({})",
                self.logical.name(),
                self.storage.from
            )
        }
    }
}

impl RegistrySignatures<'_> {
    fn read_simple(&self) -> Result<Vec<Vec<u8>>, String> {
        let Some(base) = &self.storage.lookaside else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for n in 1..=MAX_LOOKASIDE {
            let url =
                registries_d::lookaside_url(base, &self.logical.path, self.digest, n).map_err(|e| e.to_string())?;
            let got = if let Some(path) = registries_d::file_path(&url) {
                match tilefs_trust::read_config(&path) {
                    Ok(b) => Some(b),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                    Err(e) => return Err(format!("{}: {e}", path.display())),
                }
            } else if url.starts_with("http://") || url.starts_with("https://") {
                self.reg.http_get(&url, MAX_SIGNATURE)?
            } else {
                return Err(format!(
                    "lookaside {base}: only file://, http:// and https:// are supported"
                ));
            };
            match got {
                Some(b) => out.push(b),
                None => break,
            }
        }
        Ok(out)
    }

    fn read_sigstore(&self) -> Result<Vec<SigstoreSignature>, String> {
        if !self.storage.use_sigstore_attachments {
            return Ok(Vec::new());
        }
        let tag = sigstore::signature_tag(self.digest);
        let Some(raw) = self.reg.manifest_at(&tag).map_err(|e| e.to_string())? else {
            return Ok(Vec::new());
        };
        let m: sigstore::AttachmentManifest =
            serde_json::from_slice(&raw).map_err(|e| format!("attachments {tag}: not a manifest: {e}"))?;
        let layers = sigstore::signature_layers(&m);
        if layers.len() > MAX_LOOKASIDE {
            return Err(format!(
                "attachments {tag}: {} signatures, more than the {MAX_LOOKASIDE} read for an image",
                layers.len()
            ));
        }
        let mut out = Vec::new();
        // Each payload fetched once, however many signatures share it.
        let mut fetched: std::collections::HashMap<String, Vec<u8>> = Default::default();
        for (layer, signature) in layers {
            let d = Digest::parse(&layer.digest).map_err(|e| format!("attachments {tag}: {e}"))?;
            if layer.size > MAX_SIGNATURE {
                return Err(format!(
                    "attachments {tag}: a signature payload of {} bytes",
                    layer.size
                ));
            }
            let payload = match fetched.get(&layer.digest) {
                Some(p) => p.clone(),
                None => {
                    let blob = BlobRef {
                        digest: d,
                        size: Some(layer.size),
                        media_type: layer.media_type.clone(),
                        member: None,
                    };
                    let p = self.reg.blob_bytes(&blob, layer.size).map_err(|e| e.to_string())?;
                    fetched.insert(layer.digest.clone(), p.clone());
                    p
                }
            };
            out.push(SigstoreSignature { payload, signature });
        }
        Ok(out)
    }
}

/// Checks a lazily pulled image again before its mount fetches anything:
/// the policy its pull used (as it reads now) must accept the image the
/// record names, by the manifest digest the pull saw, fetched through
/// `reg` (the registry the mount fetches from).
pub fn recheck(record: &TrustRecord, reg: &Registry) -> Result<(), OciError> {
    let logical = record
        .logical
        .strip_prefix("docker://")
        .ok_or_else(|| OciError::Reference(format!("the record names {:?}, not a registry image", record.logical)))?;
    let logical = DockerRef::parse_normalized(logical).map_err(tilefs_trust::Error::from)?;
    let policy = record.paths.load_policy()?;
    let d = Digest::parse(&record.manifest_digest)
        .map_err(|e| OciError::Reference(format!("the record's manifest digest: {e}")))?;
    let manifest = reg.manifest_by_digest(&d)?;
    check_registry_image(
        &policy,
        &record.paths,
        &logical,
        reg,
        &manifest,
        &record.manifest_digest,
    )
    .map(drop)
}

/// How to reach a push's destination: `--tls-verify` when given, else
/// registries.conf's `insecure` for it.
pub fn push_options(dest: &str, registry: &RegistryOptions, trust: &TrustOptions) -> Result<RegistryOptions, OciError> {
    if trust.tls_verify_explicit {
        return Ok(registry.clone());
    }
    let conf = trust.paths.load_registries_conf()?;
    let r = DockerRef::parse_normalized(dest).map_err(tilefs_trust::Error::from)?;
    Ok(RegistryOptions {
        tls_verify: !conf.registry_for(&r).is_some_and(|x| x.insecure),
        ..registry.clone()
    })
}

/// Judges a manifest that refers to the image `image` accepted (an index
/// of it, [`crate::lazy_index`]) as that image: same policy scope, its own
/// signatures (so a policy that wants the image signed wants the index
/// signed). Returns the record of its acceptance, for later rechecks.
pub fn check_referrer(
    image: &TrustRecord,
    reg: &Registry,
    manifest: &[u8],
    digest: &Digest,
) -> Result<TrustRecord, OciError> {
    let logical = image
        .logical
        .strip_prefix("docker://")
        .ok_or_else(|| OciError::Reference(format!("{:?} is not a registry image", image.logical)))?;
    let logical = DockerRef::parse_normalized(logical).map_err(tilefs_trust::Error::from)?;
    let policy = image.paths.load_policy()?;
    check_registry_image(&policy, &image.paths, &logical, reg, manifest, &digest.to_string()).map_err(|e| match e {
        OciError::Refused(r) => OciError::Refused(tilefs_trust::Refused::Index {
            digest: digest.to_string(),
            refused: Box::new(r),
        }),
        e => e,
    })?;
    Ok(TrustRecord {
        logical: image.logical.clone(),
        manifest_digest: digest.to_string(),
        paths: image.paths.clone(),
    })
}

/// How `tilefs push` signs what it pushes.
#[derive(Debug, Clone, Default)]
pub struct SignOptions {
    /// A GnuPG key fingerprint (`--sign-by`): a simple signature written
    /// to the lookaside store registries.d names for the destination.
    pub gpg: Option<String>,
    /// A sigstore private key file (`--sign-by-sigstore-private-key`): an
    /// attachment in the destination repository.
    pub sigstore_key: Option<std::path::PathBuf>,
    pub passphrase_file: Option<std::path::PathBuf>,
    /// The identity to claim (`--sign-identity`): by default the
    /// destination reference.
    pub identity: Option<String>,
    pub paths: Paths,
}

impl SignOptions {
    pub fn any(&self) -> bool {
        self.gpg.is_some() || self.sigstore_key.is_some()
    }
}

/// What was signed and where the signatures went.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Signed {
    pub identity: String,
    pub signatures: Vec<String>,
}

/// Reads a passphrase file (its first line).
fn passphrase(p: Option<&std::path::Path>) -> Result<Vec<u8>, String> {
    match p {
        None => Ok(Vec::new()),
        Some(p) => {
            let raw = tilefs_trust::read_config(p).map_err(|e| format!("{}: {e}", p.display()))?;
            let line = raw.split(|&b| b == b'\n').next().unwrap_or(&[]);
            Ok(line.strip_suffix(b"\r").unwrap_or(line).to_vec())
        }
    }
}

/// Checks before anything is pushed that signing can work: the keys, and
/// where the signatures will go.
pub fn prepare_signing(dest: &str, s: &SignOptions) -> Result<Option<Signer>, OciError> {
    if !s.any() {
        return Ok(None);
    }
    let fail = |e: String| OciError::Reference(format!("cannot sign: {e}"));
    let dest_ref = DockerRef::parse_normalized(dest).map_err(|e| fail(e.to_string()))?;
    let identity = match &s.identity {
        Some(i) => DockerRef::parse_normalized(i).map_err(|e| fail(e.to_string()))?,
        None => dest_ref.clone(),
    };
    if identity.digest.is_some() || identity.tag.is_none() {
        return Err(fail(format!(
            "the identity {identity} must name a tag (push to REPO:TAG or give --sign-identity)"
        )));
    }
    let rd = s.paths.load_registries_d().map_err(|e| fail(e.to_string()))?;
    let storage = rd.storage_for(&dest_ref);
    let sigstore_key = match &s.sigstore_key {
        Some(k) => {
            let raw = tilefs_trust::read_config(k).map_err(|e| fail(format!("{}: {e}", k.display())))?;
            let pass = passphrase(s.passphrase_file.as_deref()).map_err(fail)?;
            let key = sigstore::parse_private_key(&raw, &pass).map_err(|e| fail(format!("{}: {e}", k.display())))?;
            if !storage.use_sigstore_attachments {
                return Err(fail(format!(
                    "sigstore signatures are stored as attachments, and use-sigstore-attachments is not enabled \
                     for {} ({}): add `use-sigstore-attachments: true` for it in a registries.d file",
                    dest_ref.name(),
                    storage.from
                )));
            }
            Some(key)
        }
        None => None,
    };
    let staging = match &s.gpg {
        Some(_) => {
            let base = storage.staging.clone().ok_or_else(|| {
                fail(format!(
                    "no lookaside-staging (or lookaside) for {} in {}: simple signatures have nowhere to go",
                    dest_ref.name(),
                    storage.from
                ))
            })?;
            if registries_d::file_path(&base).is_none() {
                return Err(fail(format!(
                    "the lookaside {base} for {} is not a file:// URL: signatures can only be written to local storage",
                    dest_ref.name()
                )));
            }
            Some(base)
        }
        None => None,
    };
    Ok(Some(Signer {
        identity,
        repo: dest_ref.name(),
        path: dest_ref.path.clone(),
        gpg: s.gpg.clone(),
        passphrase_file: s.passphrase_file.clone(),
        staging,
        sigstore_key,
    }))
}

/// Signing, ready to run once the manifest is pushed.
pub struct Signer {
    identity: DockerRef,
    repo: String,
    /// The repository's path in its registry (lookaside directories are
    /// named by it).
    path: String,
    gpg: Option<String>,
    passphrase_file: Option<std::path::PathBuf>,
    staging: Option<String>,
    sigstore_key: Option<sigstore::SigningKey>,
}

impl Signer {
    /// Signs the manifest `digest` pushed to `reg`.
    pub fn sign(&self, reg: &Registry, digest: &str) -> Result<Signed, OciError> {
        let fail = |e: String| OciError::Reference(format!("cannot sign {digest}: {e}"));
        let mut out = Signed {
            identity: self.identity.to_string(),
            signatures: Vec::new(),
        };
        if let (Some(fpr), Some(base)) = (&self.gpg, &self.staging) {
            let payload = tilefs_trust::payload::build(
                tilefs_trust::payload::SIMPLE_SIGNING_TYPE,
                digest,
                &self.identity.to_string(),
            );
            let sig = tilefs_trust::gpg::sign(&payload, fpr, self.passphrase_file.as_deref())
                .map_err(|e| fail(e.to_string()))?;
            let mut n = 1;
            let path = loop {
                let url = registries_d::lookaside_url(base, &self.path, digest, n).map_err(|e| fail(e.to_string()))?;
                let p = registries_d::file_path(&url).expect("a file:// URL");
                if !p.exists() {
                    break p;
                }
                n += 1;
            };
            let dir = path.parent().expect("a signature has a directory");
            std::fs::create_dir_all(dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
            tilefs_sys::fs::replace(&path, 0o644, |mut f| std::io::Write::write_all(&mut f, &sig))
                .map_err(|e| fail(e.to_string()))?;
            out.signatures.push(path.display().to_string());
        }
        if let Some(key) = &self.sigstore_key {
            let payload =
                tilefs_trust::payload::build(tilefs_trust::payload::SIGSTORE_TYPE, digest, &self.identity.to_string());
            let signature = sigstore::sign(key, &payload);
            let tag = sigstore::signature_tag(digest);
            let existing = reg.manifest_at(&tag)?;
            let mut layers = match existing {
                Some(raw) => {
                    serde_json::from_slice::<sigstore::AttachmentManifest>(&raw)
                        .map_err(|e| fail(format!("the existing attachments {tag} are not a manifest: {e}")))?
                        .layers
                }
                None => Vec::new(),
            };
            let pd = Digest::sha256_of(&payload);
            reg.upload(&pd, payload.len() as u64, &mut payload.as_slice(), &Default::default())?;
            layers.push(sigstore::Descriptor {
                media_type: sigstore::SIGNATURE_LAYER_TYPE.into(),
                size: payload.len() as u64,
                digest: pd.to_string(),
                annotations: Some([(sigstore::SIGNATURE_ANNOTATION.to_string(), signature)].into()),
            });
            let config = sigstore::attachment_config(&layers.iter().map(|l| l.digest.clone()).collect::<Vec<_>>());
            let cd = Digest::sha256_of(&config);
            reg.upload(&cd, config.len() as u64, &mut config.as_slice(), &Default::default())?;
            let m = sigstore::AttachmentManifest {
                schema_version: 2,
                media_type: Some(crate::manifest::OCI_MANIFEST.into()),
                config: sigstore::Descriptor {
                    media_type: "application/vnd.oci.image.config.v1+json".into(),
                    size: config.len() as u64,
                    digest: cd.to_string(),
                    annotations: None,
                },
                layers,
            };
            let bytes = serde_json::to_vec(&m).expect("JSON");
            reg.put_manifest_at(&tag, bytes, crate::manifest::OCI_MANIFEST)?;
            out.signatures.push(format!("{}:{tag}", self.repo));
        }
        Ok(out)
    }
}
