//! `tilefs push`: a tagged image and its objects to a registry, as the
//! artifact [`crate::artifact`] describes.
//!
//! Every blob is first asked for (HEAD): one the repository has is not
//! sent again; one another repository of the same registry has (a
//! repository this store pushed to or pulled from before) is mounted
//! across; the rest are uploaded, several at once, each streamed from the
//! store as it is sent. The manifest goes last, so a pushed tag always
//! names complete blobs.

use crate::artifact::{self, ObjectRef};
use crate::digest::Digest;
use crate::transport::registry::Registry;
use crate::transport::RegistryOptions;
use crate::{ImageRef, OciError};
use sha2::{Digest as _, Sha256};
use std::io::{self, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use tilefs_store::store::LAYER_CACHE;
use tilefs_store::{tags, Store};

/// How to push.
#[derive(Debug, Clone, Default)]
pub struct PushOptions {
    pub registry: RegistryOptions,
    /// Blobs uploaded at once (0: 4).
    pub jobs: usize,
    pub cancel: Option<Arc<AtomicBool>>,
    pub progress: Option<Arc<PushProgress>>,
    /// registries.conf (`insecure`) and whether `--tls-verify` was given.
    pub trust: crate::trust::TrustOptions,
    /// Signatures to make of the pushed manifest.
    pub sign: crate::trust::SignOptions,
    /// Push a runnable artifact ([`crate::artifact`]): the image
    /// configuration (bytes) of the image it stands for, whose command,
    /// environment and platform it keeps.
    pub runnable_from: Option<Vec<u8>>,
}

/// Counters of a push, readable while it runs.
#[derive(Debug, Default)]
pub struct PushProgress {
    /// Bytes to hash (stage "hashing"), then bytes to upload: blobs the
    /// registry has already or mounts from another repository leave the
    /// total, and a byte counts as done once the HTTP client has taken it.
    pub bytes_total: Arc<AtomicU64>,
    pub bytes_done: Arc<AtomicU64>,
    pub blobs_done: AtomicU64,
    /// What the push is doing now.
    pub stage: crate::Stage,
}

/// What a push did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PushReport {
    pub reference: String,
    pub manifest_digest: String,
    /// The image's fs-verity digest, hex.
    pub digest: String,
    pub objects: u64,
    pub object_bytes: u64,
    pub blobs: u64,
    /// Blobs the repository had already.
    pub blobs_present: u64,
    /// Blobs linked from another repository of the registry.
    pub blobs_mounted: u64,
    pub blobs_uploaded: u64,
    pub bytes_uploaded: u64,
    /// The signatures written, if asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signed: Option<crate::trust::Signed>,
}

/// One blob of the artifact and how to read it.
struct Blob {
    digest: Digest,
    size: u64,
    source: Source,
}

enum Source {
    Bytes(Arc<Vec<u8>>),
    /// Objects `range` of the image's object list, concatenated.
    Pack(std::ops::Range<usize>),
}

/// Pushes the image tagged `tag` in `store` to `dest`.
pub fn push(store: &Store, tag: &str, dest: &ImageRef, opts: &PushOptions) -> Result<PushReport, OciError> {
    let reference = match dest {
        ImageRef::Registry { reference } => reference,
        // A name with its registry, as podman takes it.
        ImageRef::Name { name } if !tilefs_trust::DockerRef::is_short_name(name) => name,
        ImageRef::Name { name } => {
            return Err(OciError::Reference(format!(
                "{name:?} names no registry: push to docker://HOST[:PORT]/{name}"
            )))
        }
        _ => {
            return Err(OciError::Reference(format!(
                "{dest}: tilefs pushes to registries only (docker://HOST[:PORT]/REPO[:TAG])"
            )))
        }
    };
    // Signing must be able to work before anything is sent.
    let signer = crate::trust::prepare_signing(reference, &opts.sign)?;
    let image = tags::read_tag(store, tag)?;
    let (tree, _) = tilefs_image::erofs::read_image(&image)
        .map_err(|e| OciError::manifest(format!("image {tag:?}"), format!("cannot be read: {e}")))?;
    let image_digest = tilefs_image::verity::digest_bytes(&image);
    let fsverity = hex::encode(image_digest);
    let objects = artifact::objects_of(&tree);
    drop(tree);
    // Every object must be here, whole, before anything is sent.
    check_objects(store, tag, &objects, &image_digest)?;
    let (locs, packs) = artifact::plan_packs(&objects);
    let progress = opts.progress.clone().unwrap_or_default();
    let object_bytes: u64 = objects.iter().map(|o| o.size).sum();
    progress.bytes_total.store(object_bytes, Relaxed);
    progress.stage.set(format!("hashing {} objects", objects.len()), false);
    let pack_digests = pack_digests(store, &objects, &packs, &fsverity, opts, &progress)?;
    let (blobs, manifest) = artifact_blobs(
        image,
        &objects,
        &locs,
        packs,
        pack_digests,
        &fsverity,
        object_bytes,
        opts.runnable_from.as_deref(),
    )?;

    let mut reach = crate::trust::push_options(reference, &opts.registry, &opts.trust)?;
    reach.cancel = reach.cancel.or_else(|| opts.cancel.clone());
    let registry = Registry::open(reference, &reach)?;
    let sources = crate::layer_cache::origins(store, registry.registry(), registry.repository());
    // From here the counters are of bytes sent.
    progress.stage.set(
        format!("sending {} blobs to {}", blobs.len(), registry.registry()),
        true,
    );
    progress.bytes_done.store(0, Relaxed);
    progress
        .bytes_total
        .store(blobs.iter().map(|b| b.size).sum::<u64>(), Relaxed);
    let sent = send_blobs(store, &registry, &objects, &blobs, &sources, opts, &progress)?;
    progress
        .stage
        .set(format!("writing the manifest to {}", registry.registry()), true);
    registry.put_manifest(manifest.clone())?;
    crate::layer_cache::add_origin(store, registry.registry(), registry.repository());
    let manifest_digest = Digest::sha256_of(&manifest).to_string();
    let signed = match &signer {
        Some(s) => {
            progress.stage.set("signing", true);
            Some(s.sign(&registry, &manifest_digest)?)
        }
        None => None,
    };
    Ok(PushReport {
        reference: dest.to_string(),
        manifest_digest,
        signed,
        digest: fsverity,
        objects: objects.len() as u64,
        object_bytes,
        blobs: blobs.len() as u64,
        blobs_present: sent.present,
        blobs_mounted: sent.mounted,
        blobs_uploaded: sent.uploaded,
        bytes_uploaded: sent.bytes_uploaded,
    })
}

/// Fails unless every object of the image is in the store, whole.
fn check_objects(store: &Store, tag: &str, objects: &[ObjectRef], image_digest: &[u8; 32]) -> Result<(), OciError> {
    for o in objects {
        match store.object_size(&o.digest) {
            Some(s) if s == o.size => {}
            Some(s) => {
                return Err(OciError::manifest(
                    format!("image {tag:?}"),
                    format!(
                        "object {} is {s} bytes in the store but {} in the image (run `tilefs fsck`)",
                        Store::object_rel(&o.digest),
                        o.size
                    ),
                ))
            }
            None => {
                return Err(OciError::manifest(
                    format!("image {tag:?}"),
                    format!(
                        "object {} is not in the store{}",
                        Store::object_rel(&o.digest),
                        if tilefs_store::remote::is_lazy(store, image_digest) {
                            " (the image was pulled with --lazy: `tilefs pull` it again to complete it)"
                        } else {
                            ""
                        }
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// The SHA-256 of each pack: hashed once per image, then kept in the
/// layer cache (a pack whose objects changed since would be refused by
/// the registry's own check).
fn pack_digests(
    store: &Store,
    objects: &[ObjectRef],
    packs: &[artifact::Pack],
    fsverity: &str,
    opts: &PushOptions,
    progress: &PushProgress,
) -> Result<Vec<Digest>, OciError> {
    let object_bytes: u64 = objects.iter().map(|o| o.size).sum();
    let cache_name = format!("packs-{}-{fsverity}", artifact::PACK_TARGET);
    if let Some(known) = crate::layer_cache::read_record_in(store, LAYER_CACHE, &cache_name)
        .and_then(|raw| serde_json::from_slice::<Vec<String>>(&raw).ok())
        .filter(|v| v.len() == packs.len())
        .and_then(|v| v.iter().map(|d| Digest::parse(d).ok()).collect::<Option<Vec<_>>>())
    {
        progress.bytes_done.fetch_add(object_bytes, Relaxed);
        return Ok(known);
    }
    let hashed = hash_packs(store, objects, packs, opts, progress)?;
    let list: Vec<String> = hashed.iter().map(|d| d.to_string()).collect();
    if let Ok(bytes) = serde_json::to_vec(&list) {
        let _ = crate::layer_cache::write_record_in(store, LAYER_CACHE, &cache_name, &bytes);
    }
    Ok(hashed)
}

/// The artifact's blobs (config, image, index, then the packs) and its
/// manifest; runnable (see [`crate::artifact`]) with a base configuration.
#[allow(clippy::too_many_arguments)]
fn artifact_blobs(
    image: Vec<u8>,
    objects: &[ObjectRef],
    locs: &[artifact::Location],
    packs: Vec<artifact::Pack>,
    pack_digests: Vec<Digest>,
    fsverity: &str,
    object_bytes: u64,
    runnable_from: Option<&[u8]>,
) -> Result<(Vec<Blob>, Vec<u8>), OciError> {
    let index = Arc::new(artifact::encode_index(objects, locs));
    let facts = artifact::Config {
        fsverity: fsverity.to_string(),
        objects: objects.len() as u64,
        object_bytes,
    };
    let image = Arc::new(image);
    let mem = |b: &Arc<Vec<u8>>| Blob {
        digest: Digest::sha256_of(b),
        size: b.len() as u64,
        source: Source::Bytes(b.clone()),
    };
    let mut blobs = vec![mem(&image), mem(&index)];
    for (d, pack) in pack_digests.into_iter().zip(packs) {
        blobs.push(Blob {
            digest: d,
            size: pack.size,
            source: Source::Pack(pack.objects),
        });
    }
    let config = match runnable_from {
        Some(base) => {
            let ids: Vec<Digest> = blobs.iter().map(|b| b.digest.clone()).collect();
            artifact::runnable_config(base, &facts, &ids)
                .map_err(|e| OciError::manifest("the configuration of --runnable-from", e))?
        }
        None => serde_json::to_vec(&facts).expect("a config serializes"),
    };
    blobs.insert(0, mem(&Arc::new(config)));
    let manifest = artifact::manifest(
        (&blobs[0].digest, blobs[0].size),
        (&blobs[1].digest, blobs[1].size),
        (&blobs[2].digest, blobs[2].size),
        &blobs[3..]
            .iter()
            .map(|b| (b.digest.clone(), b.size))
            .collect::<Vec<_>>(),
        fsverity,
        runnable_from.is_some(),
    );
    Ok((blobs, manifest))
}

/// How the blobs got to the repository.
#[derive(Debug, Default)]
struct SentCounts {
    present: u64,
    mounted: u64,
    uploaded: u64,
    bytes_uploaded: u64,
}

/// Sends the blobs the repository lacks, `opts.jobs` at once; the first
/// failure stops them all.
fn send_blobs(
    store: &Store,
    registry: &Registry,
    objects: &[ObjectRef],
    blobs: &[Blob],
    sources: &[String],
    opts: &PushOptions,
    progress: &PushProgress,
) -> Result<SentCounts, OciError> {
    let counts = [
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
    ];
    let next = AtomicUsize::new(0);
    let first_err: Mutex<Option<OciError>> = Mutex::new(None);
    let stop = || first_err.lock().unwrap().is_some() || opts.cancel.as_ref().is_some_and(|c| c.load(Relaxed));
    let jobs = if opts.jobs == 0 { 4 } else { opts.jobs }.min(blobs.len());
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| {
                while let Some(b) = blobs.get(next.fetch_add(1, Relaxed)) {
                    if stop() {
                        break;
                    }
                    match send_blob(store, registry, objects, b, sources, &progress.bytes_done) {
                        Ok(how) => {
                            counts[how as usize].fetch_add(1, Relaxed);
                            if how == Sent::Uploaded {
                                counts[3].fetch_add(b.size, Relaxed);
                            } else {
                                // Not to send after all.
                                progress.bytes_total.fetch_sub(b.size, Relaxed);
                            }
                        }
                        Err(e) => {
                            first_err.lock().unwrap().get_or_insert(e);
                        }
                    }
                    progress.blobs_done.fetch_add(1, Relaxed);
                }
            });
        }
    });
    if let Some(e) = first_err.into_inner().unwrap() {
        return Err(e);
    }
    if opts.cancel.as_ref().is_some_and(|c| c.load(Relaxed)) {
        return Err(OciError::Interrupted);
    }
    let [present, mounted, uploaded, bytes_uploaded] = counts.map(AtomicU64::into_inner);
    Ok(SentCounts {
        present,
        mounted,
        uploaded,
        bytes_uploaded,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    Present = 0,
    Mounted = 1,
    Uploaded = 2,
}

fn send_blob(
    store: &Store,
    registry: &Registry,
    objects: &[ObjectRef],
    b: &Blob,
    sources: &[String],
    sent: &Arc<AtomicU64>,
) -> Result<Sent, OciError> {
    if registry.has_blob(&b.digest)? {
        return Ok(Sent::Present);
    }
    if sources.iter().any(|from| registry.mount_from(&b.digest, from)) {
        return Ok(Sent::Mounted);
    }
    match &b.source {
        Source::Bytes(bytes) => registry.upload(&b.digest, b.size, &mut io::Cursor::new(bytes.as_slice()), sent)?,
        Source::Pack(range) => registry.upload(
            &b.digest,
            b.size,
            &mut PackReader::new(store, objects[range.clone()].to_vec()),
            sent,
        )?,
    }
    Ok(Sent::Uploaded)
}

/// SHA-256 of each pack, several packs at once.
fn hash_packs(
    store: &Store,
    objects: &[ObjectRef],
    packs: &[artifact::Pack],
    opts: &PushOptions,
    progress: &PushProgress,
) -> Result<Vec<Digest>, OciError> {
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(packs.len().max(1));
    let next = AtomicUsize::new(0);
    let out: Vec<Mutex<Option<Result<Digest, OciError>>>> = packs.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Relaxed);
                let Some(range) = packs.get(i).map(|p| &p.objects) else {
                    break;
                };
                if opts.cancel.as_ref().is_some_and(|c| c.load(Relaxed)) {
                    break;
                }
                let mut r = PackReader::new(store, objects[range.clone()].to_vec());
                let mut h = Sha256::new();
                let mut buf = vec![0u8; 1 << 20];
                let result = loop {
                    match r.read(&mut buf) {
                        Ok(0) => break Ok(Digest::from_sha256(h.finalize().into())),
                        Ok(n) => {
                            h.update(&buf[..n]);
                            progress.bytes_done.fetch_add(n as u64, Relaxed);
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => break Err(OciError::io(store.path(), "cannot read an object", e)),
                    }
                };
                *out[i].lock().unwrap() = Some(result);
            });
        }
    });
    if opts.cancel.as_ref().is_some_and(|c| c.load(Relaxed)) {
        return Err(OciError::Interrupted);
    }
    out.into_iter()
        .map(|m| m.into_inner().unwrap().unwrap_or(Err(OciError::Interrupted)))
        .collect()
}

/// Reads objects from the store one after the other, each exactly its
/// size (an object that changed size since the check is an error, not a
/// shifted pack).
struct PackReader<'s> {
    store: &'s Store,
    objects: std::vec::IntoIter<ObjectRef>,
    current: Option<(io::Take<std::fs::File>, ObjectRef)>,
}

impl<'s> PackReader<'s> {
    fn new(store: &'s Store, objects: Vec<ObjectRef>) -> PackReader<'s> {
        PackReader {
            store,
            objects: objects.into_iter(),
            current: None,
        }
    }
}

impl Read for PackReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if let Some((f, o)) = &mut self.current {
                let n = f.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
                if f.limit() > 0 {
                    return Err(io::Error::other(format!(
                        "object {} is shorter than the image says ({} bytes)",
                        Store::object_rel(&o.digest),
                        o.size
                    )));
                }
                self.current = None;
            }
            let Some(o) = self.objects.next() else { return Ok(0) };
            let rel = Store::object_rel(&o.digest);
            let f = tilefs_store::open_regular(self.store.dir_fd(), std::path::Path::new(&rel), false)
                .map_err(|e| io::Error::new(e.kind(), format!("object {rel}: {e}")))?;
            self.current = Some((f.take(o.size), o));
        }
    }
}
