//! `tilefs push`: a tagged image and its objects to a registry, as the
//! artifact [`crate::artifact`] describes.
//!
//! The artifact the destination's tag names (or `--base`) is read first:
//! its packs the image still uses are kept ([`base`]). The other objects
//! are packed, compressed, into unnamed temporary files in the store
//! (several packs at once); what each pack holds is kept in the layer
//! cache by the list of its objects, so a pack another push made already
//! (this image's, or an earlier version's) is not compressed again unless
//! the registry lacks it.
//!
//! Every blob is then asked for (HEAD): one the repository has is not
//! sent again; one another repository of the same registry has (a
//! repository this store pushed to or pulled from before) is mounted
//! across; the rest are uploaded, several at once. The manifest goes
//! last, so a pushed tag always names complete blobs.

mod base;

use crate::artifact::{self, ObjectRef};
use crate::digest::Digest;
use crate::transport::registry::Registry;
use crate::transport::RegistryOptions;
use crate::{ImageRef, OciError};
use sha2::{Digest as _, Sha256};
use std::io::{self, Read, Seek};
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
    /// The tag (in the destination's repository) of an artifact whose
    /// packs to keep ([`base`]); default: the destination's tag.
    pub base: Option<String>,
    /// Push a runnable artifact ([`crate::artifact`]): the image
    /// configuration (bytes) of the image it stands for, whose command,
    /// environment and platform it keeps.
    pub runnable_from: Option<Vec<u8>>,
    /// Write format 2 (the image whole, which tilefs before format 3
    /// reads) rather than format 3 (the image's tree in chunks): see
    /// [`crate::artifact`].
    pub format_2: bool,
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
    /// The tag of the artifact whose packs were kept, if one was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    /// Its packs this artifact keeps.
    pub packs_kept: u64,
    /// The artifact's format ([`crate::artifact`]): 3, the image's tree in
    /// chunks, or 2, the image whole (an image its tree does not rebuild).
    pub format: u32,
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
    /// A pack of the base artifact, in the repository already.
    Kept,
    /// A pack of objects `objects` of the image's list: written already
    /// (its temporary file), or to write again if the registry lacks it.
    Pack {
        objects: std::ops::Range<usize>,
        file: Mutex<Option<std::fs::File>>,
    },
}

/// A pack made (or known from the cache): its blob, and how each of its
/// objects is stored, in order.
#[derive(serde::Serialize, serde::Deserialize)]
struct Packed {
    digest: String,
    size: u64,
    stored: Vec<artifact::Stored>,
}

/// Pushes the image tagged `tag` in `store` to `dest`.
pub fn push(store: &Store, tag: &str, dest: &ImageRef, opts: &PushOptions) -> Result<PushReport, OciError> {
    let reference = destination(dest)?;
    // Signing must be able to work before anything is sent.
    let signer = crate::trust::prepare_signing(reference, &opts.sign)?;
    let image = tags::read_tag(store, tag)?;
    let (tree, _) = tilefs_image::erofs::read_image(&image)
        .map_err(|e| OciError::manifest(format!("image {tag:?}"), format!("cannot be read: {e}")))?;
    let image_digest = tilefs_image::verity::digest_bytes(&image);
    let fsverity = hex::encode(image_digest);
    let objects = artifact::objects_of(&tree);
    // Every object must be here, whole, before anything is sent.
    check_objects(store, tag, &objects, &image_digest)?;
    let progress = opts.progress.clone().unwrap_or_default();
    let mut reach = crate::trust::push_options(reference, &opts.registry, &opts.trust)?;
    reach.cancel = reach.cancel.or_else(|| opts.cancel.clone());
    let registry = Registry::open(reference, &reach)?;
    let base_tag = match &opts.base {
        Some(t) => Some(t.clone()),
        None => reference
            .parse::<oci_client::Reference>()
            .ok()
            .and_then(|r| r.tag().map(str::to_string)),
    };
    let base = match &base_tag {
        Some(t) => {
            progress.stage.set(
                format!(
                    "reading {}/{}:{t}, to keep its packs",
                    registry.registry(),
                    registry.repository()
                ),
                true,
            );
            base::read(&registry, t, opts.base.is_some())?
        }
        None => None,
    };
    let plan = base::plan(&objects, base.as_ref());
    let object_bytes: u64 = objects.iter().map(|o| o.size).sum();
    progress
        .bytes_total
        .store(plan.fresh.iter().map(|o| o.size).sum(), Relaxed);
    progress.stage.set(
        format!(
            "packing {} objects into {} packs",
            plan.fresh.len(),
            plan.fresh_packs.len()
        ),
        false,
    );
    let made = make_packs(store, &plan.fresh, &plan.fresh_packs, opts, &progress)?;
    let (blobs, manifest, format) = artifact_blobs((&image, &tree), &plan, made, &fsverity, object_bytes, opts)?;
    drop((tree, image));

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
    let sent = send_blobs(store, &registry, &plan.fresh, &blobs, &sources, opts, &progress)?;
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
        base: base.as_ref().and(base_tag),
        packs_kept: plan.kept.len() as u64,
        format: match format {
            artifact::Format::V1 => 1,
            artifact::Format::V2 => 2,
            artifact::Format::V3 => 3,
        },
    })
}

/// The registry reference `dest` names, or why it names none.
fn destination(dest: &ImageRef) -> Result<&str, OciError> {
    match dest {
        ImageRef::Registry { reference } => Ok(reference),
        // A name with its registry, as podman takes it.
        ImageRef::Name { name } if !tilefs_trust::DockerRef::is_short_name(name) => Ok(name),
        ImageRef::Name { name } => Err(OciError::Reference(format!(
            "{name:?} names no registry: push to docker://HOST[:PORT]/{name}"
        ))),
        _ => Err(OciError::Reference(format!(
            "{dest}: tilefs pushes to registries only (docker://HOST[:PORT]/REPO[:TAG])"
        ))),
    }
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

/// The name of the layer cache's record of the pack holding `objects`:
/// what it holds and how it is written.
fn pack_key(objects: &[ObjectRef]) -> String {
    let mut h = Sha256::new();
    // Another zstd may write other bytes for the same objects.
    h.update(format!(
        "tilefs pack v2 zstd {} level {} window {}\n",
        zstd::zstd_safe::version_number(),
        artifact::LEVEL,
        artifact::WINDOW_LOG
    ));
    for o in objects {
        h.update(o.digest);
        h.update(o.size.to_le_bytes());
    }
    format!("pack-{}", hex::encode(h.finalize()))
}

/// Each of `packs` (ranges of `objects`): known from the layer cache, or
/// written now into a temporary file, several at once.
fn make_packs(
    store: &Store,
    objects: &[ObjectRef],
    packs: &[std::ops::Range<usize>],
    opts: &PushOptions,
    progress: &PushProgress,
) -> Result<Vec<(Packed, Option<std::fs::File>)>, OciError> {
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(packs.len().max(1));
    let next = AtomicUsize::new(0);
    let out: Vec<Mutex<Option<Result<_, OciError>>>> = packs.iter().map(|_| Mutex::new(None)).collect();
    let cancelled = || opts.cancel.as_ref().is_some_and(|c| c.load(Relaxed));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Relaxed);
                let Some(range) = packs.get(i) else { break };
                if cancelled() {
                    break;
                }
                let these = &objects[range.clone()];
                let key = pack_key(these);
                let known = crate::layer_cache::read_record_in(store, LAYER_CACHE, &key)
                    .and_then(|raw| postcard::from_bytes::<Packed>(&raw).ok())
                    .filter(|p| p.stored.len() == these.len() && Digest::parse(&p.digest).is_ok());
                let result = match known {
                    Some(p) => {
                        progress
                            .bytes_done
                            .fetch_add(these.iter().map(|o| o.size).sum(), Relaxed);
                        Ok((p, None))
                    }
                    None => write_pack(store, these, &progress.bytes_done).map(|(p, f)| {
                        if let Ok(bytes) = postcard::to_stdvec(&p) {
                            let _ = crate::layer_cache::write_record_in(store, LAYER_CACHE, &key, &bytes);
                        }
                        (p, Some(f))
                    }),
                };
                *out[i].lock().unwrap() = Some(result);
            });
        }
    });
    if cancelled() {
        return Err(OciError::Interrupted);
    }
    out.into_iter()
        .map(|m| m.into_inner().unwrap().unwrap_or(Err(OciError::Interrupted)))
        .collect()
}

/// Writes the pack of `objects` (each read from the store, exactly its
/// size) into an unnamed temporary file in the store; counts the objects'
/// bytes in `done`.
fn write_pack(store: &Store, objects: &[ObjectRef], done: &AtomicU64) -> Result<(Packed, std::fs::File), OciError> {
    let mut file = tempfile::tempfile_in(store.path())
        .map_err(|e| OciError::io(store.path(), "cannot make a temporary file for a pack", e))?;
    let mut stored = Vec::with_capacity(objects.len());
    let mut at = 0;
    for o in objects {
        let rel = Store::object_rel(&o.digest);
        let open = || tilefs_store::open_regular(store.dir_fd(), std::path::Path::new(&rel), false);
        let how = artifact::pack_object(open, o.size, &mut file, at)
            .map_err(|e| OciError::io(&store.object_path(&o.digest), "cannot pack the object", e))?;
        at += how.bytes(o.size);
        stored.push(how);
        done.fetch_add(o.size, Relaxed);
    }
    file.seek(io::SeekFrom::Start(0))
        .map_err(|e| OciError::io(store.path(), "cannot read a pack back", e))?;
    let mut h = Sha256::new();
    io::copy(&mut (&file).take(at), &mut h).map_err(|e| OciError::io(store.path(), "cannot read a pack back", e))?;
    let digest = Digest::from_sha256(h.finalize().into());
    Ok((
        Packed {
            digest: digest.to_string(),
            size: at,
            stored,
        },
        file,
    ))
}

/// The image as the artifact carries it: its tree in chunks (format 3),
/// or its bytes and the object index (format 2).
struct Metadata {
    blobs: Vec<Arc<Vec<u8>>>,
    types: Vec<&'static str>,
    format: artifact::Format,
}

/// The image's metadata blobs: format 3's chunks of `tree` (whose image
/// is `image`) where they rebuild the image, byte for byte (and format 2
/// is not asked for); else format 2's image and index. `packs`: the artifact's packs, which `objects`
/// lie in at `locs`.
fn metadata(
    image: &[u8],
    tree: &tilefs_image::Tree,
    fsverity: &str,
    packs: &[Digest],
    (objects, locs): (&[ObjectRef], &[artifact::Location]),
    runnable: bool,
    format_2: bool,
) -> Metadata {
    let version = tilefs_image::erofs::image_version(image).unwrap_or(0);
    let at: std::collections::HashMap<&[u8; 32], &artifact::Location> =
        objects.iter().map(|o| &o.digest).zip(locs).collect();
    let chunks = match format_2 {
        true => None,
        false => crate::artifact_tree::encode(tree, version, packs, |d| at.get(d).copied().copied()),
    };
    let rebuilds = chunks
        .as_ref()
        .is_some_and(|c| crate::artifact_tree::rebuilds(c, packs, image, fsverity));
    match chunks {
        Some(chunks) if rebuilds => Metadata {
            types: vec![artifact::tree_types(runnable).0; chunks.len()],
            blobs: chunks.into_iter().map(Arc::new).collect(),
            format: artifact::Format::V3,
        },
        _ => {
            let [erofs_type, index_type, _] = artifact::blob_types(runnable, artifact::Format::V2);
            Metadata {
                blobs: vec![
                    Arc::new(artifact::pack_image(image)),
                    Arc::new(artifact::encode_index(objects, locs)),
                ],
                types: vec![erofs_type, index_type],
                format: artifact::Format::V2,
            }
        }
    }
}

/// The artifact's blobs (config, the image's metadata, then the packs:
/// those kept, then those made), its manifest and its format; runnable
/// (see [`crate::artifact`]) with a base configuration.
fn artifact_blobs(
    (image, tree): (&[u8], &tilefs_image::Tree),
    plan: &base::Plan,
    made: Vec<(Packed, Option<std::fs::File>)>,
    fsverity: &str,
    object_bytes: u64,
    opts: &PushOptions,
) -> Result<(Vec<Blob>, Vec<u8>, artifact::Format), OciError> {
    let runnable_from = opts.runnable_from.as_deref();
    let (mut objects, mut locs): (Vec<ObjectRef>, Vec<artifact::Location>) = plan.kept_objects.iter().copied().unzip();
    for (i, (range, (p, _))) in plan.fresh_packs.iter().zip(&made).enumerate() {
        let mut at = 0;
        for (o, how) in plan.fresh[range.clone()].iter().zip(&p.stored) {
            objects.push(*o);
            locs.push(artifact::Location {
                pack: (plan.kept.len() + i) as u32,
                offset: at,
                size: o.size,
                stored: *how,
            });
            at += how.bytes(o.size);
        }
    }
    let facts = artifact::Config {
        fsverity: fsverity.to_string(),
        objects: objects.len() as u64,
        object_bytes,
    };
    let runnable = runnable_from.is_some();
    let pack_type = artifact::blob_types(runnable, artifact::Format::V2)[2];
    let mut packs = Vec::new();
    for (digest, size) in &plan.kept {
        packs.push(Blob {
            digest: digest.clone(),
            size: *size,
            source: Source::Kept,
        });
    }
    for (range, (p, file)) in plan.fresh_packs.iter().cloned().zip(made) {
        packs.push(Blob {
            digest: Digest::parse(&p.digest).expect("checked when made or read"),
            size: p.size,
            source: Source::Pack {
                objects: range,
                file: Mutex::new(file),
            },
        });
    }
    let pack_digests: Vec<Digest> = packs.iter().map(|b| b.digest.clone()).collect();
    let meta = metadata(
        image,
        tree,
        fsverity,
        &pack_digests,
        (&objects, &locs),
        runnable,
        opts.format_2,
    );
    let mem = |b: &Arc<Vec<u8>>| Blob {
        digest: Digest::sha256_of(b),
        size: b.len() as u64,
        source: Source::Bytes(b.clone()),
    };
    let mut blobs: Vec<Blob> = meta.blobs.iter().map(mem).collect();
    let mut types = meta.types;
    types.extend(std::iter::repeat_n(pack_type, packs.len()));
    blobs.extend(packs);
    let config = match runnable_from {
        Some(base) => {
            let ids: Vec<Digest> = blobs.iter().map(|b| b.digest.clone()).collect();
            artifact::runnable_config(base, &facts, &ids)
                .map_err(|e| OciError::manifest("the configuration of --runnable-from", e))?
        }
        None => serde_json::to_vec(&facts).expect("a config serializes"),
    };
    let config = mem(&Arc::new(config));
    let layers: Vec<(&str, &Digest, u64)> = types.iter().zip(&blobs).map(|(t, b)| (*t, &b.digest, b.size)).collect();
    let manifest = artifact::manifest((&config.digest, config.size), &layers, fsverity, runnable);
    blobs.insert(0, config);
    Ok((blobs, manifest, meta.format))
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
        Source::Kept => {
            return Err(OciError::blob(
                &b.digest.to_string(),
                format!(
                    "a pack of the artifact this push keeps packs of, gone from {}",
                    registry.repository()
                ),
            ))
        }
        Source::Bytes(bytes) => registry.upload(&b.digest, b.size, &mut io::Cursor::new(bytes.as_slice()), sent)?,
        Source::Pack { objects: range, file } => {
            // Known from the cache, not written this time: written again
            // (the same bytes: the registry checks the digest).
            let mut f = match file.lock().unwrap().take() {
                Some(f) => f,
                None => write_pack(store, &objects[range.clone()], &AtomicU64::new(0))?.1,
            };
            f.seek(io::SeekFrom::Start(0))
                .map_err(|e| OciError::io(store.path(), "cannot read a pack back", e))?;
            registry.upload(&b.digest, b.size, &mut f, sent)?
        }
    }
    Ok(Sent::Uploaded)
}

/// How to convert.
#[derive(Debug, Clone, Default)]
pub struct ConvertOptions {
    /// How to read the source (registry options, policy, platform, cancel,
    /// progress of the reading).
    pub pull: crate::pull::PullOptions,
    /// How to push the artifact (its `runnable_from` is the source's).
    pub push: PushOptions,
    /// Where the scratch store goes (default: the system's temporary
    /// directory).
    pub tmpdir: Option<std::path::PathBuf>,
}

/// What a conversion did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ConvertReport {
    pub source: String,
    /// The source's manifest digest.
    pub source_manifest_digest: Option<String>,
    /// Blob bytes read from the source (its layers, compressed).
    pub source_bytes: u64,
    pub entries: usize,
    #[serde(flatten)]
    pub push: PushReport,
}

/// Converts the OCI image `src` into a runnable artifact at `dest` (what
/// `tilefs pull SRC` then `tilefs push --runnable-from SRC` make, the same
/// image): the layers are read once, streaming, into a scratch store in a
/// temporary directory, removed at the end whatever happens.
pub fn convert(src: &ImageRef, dest: &ImageRef, opts: &ConvertOptions) -> Result<ConvertReport, OciError> {
    destination(dest)?;
    let tmpdir = opts.tmpdir.clone().unwrap_or_else(std::env::temp_dir);
    // The source's configuration first: an artifact (or an image the
    // policy refuses) fails before a layer is read.
    let config = crate::pull::image_config(src, &opts.pull)?;
    let scratch = tempfile::Builder::new()
        .prefix("tilefs-convert-")
        .tempdir_in(&tmpdir)
        .map_err(|e| OciError::io(&tmpdir, "cannot make a scratch directory", e))?;
    let store = Store::create(&scratch.path().join("store"))?;
    let pulled = crate::pull::pull(&store, src, "source", &opts.pull)?;
    let push_opts = PushOptions {
        runnable_from: Some(config),
        ..opts.push.clone()
    };
    let pushed = push(&store, "source", dest, &push_opts)?;
    Ok(ConvertReport {
        source: src.to_string(),
        source_manifest_digest: pulled.manifest_digest,
        source_bytes: pulled.blob_bytes,
        entries: pulled.entries,
        push: pushed,
    })
}
