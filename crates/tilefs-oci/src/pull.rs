//! A pull: from an image reference to a tagged image in a store.
//!
//! The manifest is resolved first (nothing is written before the image is
//! known to be one). Layers are then read in parallel, largest first, each
//! on one thread that streams its blob through the digest check and the
//! decompressor into the tar reader, writing file contents into the store
//! as it goes. Applying them is ordered and cheap (metadata only). The
//! image is written, its objects made durable, and only then the tag.
//!
//! On any failure nothing is tagged; objects already written are complete
//! and named by their own digest (so never corrupt); `gc` removes them.

use crate::apply::Applier;
use crate::bounded::MAX_CONFIG;
use crate::digest::Verified;
use crate::layer::{self, Compression, Content, Job, Kind, LayerEntry, ReadOptions};
use crate::manifest::{BlobRef, Platform};
use crate::transport::{self, RegistryOptions, Transport};
use crate::{compat, ImageRef, OciError};
use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use tilefs_store::ingest::{Ingest, Method, StatsSnapshot};
use tilefs_store::{tags, Store};

/// How to pull.
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    /// The platform to pick from an index (default: this machine's).
    pub platform: Option<Platform>,
    pub registry: RegistryOptions,
    /// Keep every xattr the layers carry, not only `security.capability`
    /// (the image then differs from composefs-rs's where layers have
    /// others).
    pub keep_all_xattrs: bool,
    /// Layers read at once (0: one per core, at least two).
    pub jobs: usize,
    /// Once set, the pull stops with [`OciError::Interrupted`].
    pub cancel: Option<Arc<AtomicBool>>,
    /// Counters for a progress display.
    pub progress: Option<Arc<PullProgress>>,
    /// For an image pushed by tilefs: fetch the image and its object index
    /// only; objects come when a FUSE mount reads them.
    pub lazy: bool,
    /// The signature policy, registries.d and registries.conf to use
    /// (default: podman's files).
    pub trust: crate::trust::TrustOptions,
}

/// Counters of a pull, readable while it runs.
#[derive(Debug, Default)]
pub struct PullProgress {
    pub layers_total: AtomicU64,
    pub layers_done: AtomicU64,
    /// Sum of the layers' blob sizes, once known.
    pub blob_total: Arc<AtomicU64>,
    /// Blob bytes read so far.
    pub blob_bytes: Arc<AtomicU64>,
    pub entries: AtomicU64,
    /// What the pull is doing now.
    pub stage: crate::Stage,
}

/// What a pull did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PullReport {
    pub tag: String,
    /// The image's fs-verity digest, hex.
    pub digest: String,
    pub image_bytes: usize,
    pub format_version: u32,
    pub manifest_digest: Option<String>,
    pub layers: usize,
    /// Blob bytes read (compressed, as transferred).
    pub blob_bytes: u64,
    pub entries: usize,
    #[serde(flatten)]
    pub objects: StatsSnapshot,
    /// Notes for the user (the store's filesystem lacks fs-verity, say).
    #[serde(skip)]
    pub notes: Vec<String>,
    /// Objects left to fetch on demand (`--lazy`).
    pub lazy_objects: u64,
    /// The tilefs index an ordinary image was pulled lazily by.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lazy_index: Option<String>,
    /// Why `--lazy` pulled an ordinary image whole.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lazy_fallback: Option<String>,
}

/// Pulls the image `r` into `store` and tags it `tag`.
pub fn pull(store: &Store, r: &ImageRef, tag: &str, opts: &PullOptions) -> Result<PullReport, OciError> {
    tags::validate_tag(tag)?;
    let platform = opts.platform.clone().unwrap_or_else(Platform::host);
    let progress = opts.progress.clone().unwrap_or_default();
    let remote = matches!(r, ImageRef::Registry { .. } | ImageRef::Name { .. });
    progress.stage.set(
        if remote {
            format!("fetching the manifest of {r}")
        } else {
            format!("reading the manifest of {r}")
        },
        remote,
    );
    // Nothing is written before the policy has accepted the image.
    let opened = crate::trust::open_checked(r, &registry_options(opts), &opts.trust, &platform)?;
    let (t, resolved, r) = (opened.transport, opened.resolved, &opened.source);
    let opts = &PullOptions {
        registry: opened.registry,
        ..opts.clone()
    };
    if resolved.artifact {
        return crate::fetch::pull_artifact(store, r, t.as_ref(), resolved, tag, opts, &progress);
    }
    let mut lazy_fallback = None;
    if opts.lazy {
        match crate::lazy_index::pull_indexed(store, r, &resolved, tag, opts, &progress)? {
            Ok(report) => return Ok(report),
            // Without an index, an eStargz or zstd:chunked image starts
            // lazily from its tables of contents.
            Err(why) => match crate::toc_lazy::pull_toc(store, r, &resolved, tag, opts, &progress)? {
                crate::toc_lazy::TocPull::Pulled(report) => return Ok(*report),
                crate::toc_lazy::TocPull::NotToc => lazy_fallback = Some(why),
                crate::toc_lazy::TocPull::Unusable(toc_why) => {
                    lazy_fallback = Some(format!("{why}, and its tables of contents cannot be used: {toc_why}"))
                }
            },
        }
    }
    if let Some(config) = &resolved.config {
        progress.stage.set("fetching the image configuration", remote);
        check_config(t.as_ref(), config, resolved.layers.len())?;
    }
    // A blob the manifest lists more than once is read once.
    let distinct = distinct_blobs(&resolved.layers);
    progress.stage.set(
        match (resolved.layers.len(), distinct.len()) {
            (1, _) => "reading its layer".to_string(),
            (n, d) if d == n => format!("reading its {n} layers"),
            (n, d) => format!("reading its {n} layers ({d} distinct)"),
        },
        remote,
    );
    progress.layers_total.store(distinct.len() as u64, Relaxed);
    progress
        .blob_total
        .store(distinct.iter().filter_map(|l| l.size).sum(), Relaxed);

    let mut ingest = Ingest::new(store, Method::Copy)?;
    // Measured on a 1.1 GB, 51k-file pull: 128 MiB batches beat 1 GiB by a
    // tenth, 32 and 64 MiB no further.
    ingest.set_batch_bytes(128 << 20);
    if let Some(c) = &opts.cancel {
        ingest.set_cancel(c.clone());
    }
    let presence = tilefs_store::presence::Presence::default();
    let digests: Vec<&crate::digest::Digest> = resolved.layers.iter().map(|l| &l.digest).collect();
    let key = crate::layer_cache::image_key(&digests, opts.keep_all_xattrs);
    if let Some(known) = crate::layer_cache::load_image(store, &key, &presence) {
        // Made before from these very layers, its objects all present.
        progress.layers_done.store(resolved.layers.len() as u64, Relaxed);
        crate::trust::save_evidence(store, &tilefs_image::verity::digest_bytes(&known.image), &resolved)?;
        tags::write_tag(store, tag, &known.image)?;
        return Ok(PullReport {
            tag: tag.to_string(),
            digest: hex::encode(tilefs_image::verity::digest_bytes(&known.image)),
            image_bytes: known.image.len(),
            format_version: compat::FORMAT_VERSION,
            manifest_digest: resolved.manifest_digest.map(|d| d.to_string()),
            layers: resolved.layers.len(),
            blob_bytes: 0,
            entries: known.entries,
            objects: StatsSnapshot::default(),
            notes: lazy_fallback.iter().map(|w| lazy_note(w)).collect(),
            lazy_objects: 0,
            lazy_index: None,
            lazy_fallback,
        });
    }
    let read = read_layers(store, t.as_ref(), &distinct, &ingest, &progress, &presence, opts, false)?;
    let read = read.into_iter().map(|l| l.entries).collect();
    progress.stage.set("writing the image", false);
    let mut applier = Applier::new(opts.keep_all_xattrs);
    let mut entries = 0;
    for (blob, l) in resolved
        .layers
        .iter()
        .zip(in_manifest_order(&resolved.layers, &distinct, read))
    {
        if opts.cancel.as_ref().is_some_and(|c| c.load(Relaxed)) {
            return Err(OciError::Interrupted);
        }
        entries += l.len();
        applier.apply_layer(&blob.digest.to_string(), l)?;
    }
    let (tree, image) = compat::write_image(applier)
        .map_err(|e| OciError::manifest(r.to_string(), format!("cannot write the image: {e}")))?;
    let objects = ingest.finish()?;
    crate::trust::save_evidence(store, &image.digest, &resolved)?;
    tags::write_tag(store, tag, &image.bytes)?;
    let mut needed: Vec<[u8; 32]> = tree.inodes.iter().filter_map(|i| i.digest).collect();
    needed.sort_unstable();
    needed.dedup();
    crate::layer_cache::save_image(store, &key, &image.bytes, entries, needed);
    let mut notes: Vec<String> = ingest.verity_warning().into_iter().collect();
    notes.extend(lazy_fallback.iter().map(|w| lazy_note(w)));
    drop(ingest);
    Ok(PullReport {
        tag: tag.to_string(),
        digest: hex::encode(image.digest),
        image_bytes: image.bytes.len(),
        format_version: image.version,
        manifest_digest: resolved.manifest_digest.map(|d| d.to_string()),
        layers: resolved.layers.len(),
        blob_bytes: progress.blob_bytes.load(Relaxed),
        entries,
        objects,
        notes,
        lazy_objects: 0,
        lazy_index: None,
        lazy_fallback,
    })
}

/// How to reach registries: the pull's cancellation stops their
/// transfers too.
fn registry_options(opts: &PullOptions) -> RegistryOptions {
    RegistryOptions {
        cancel: opts.registry.cancel.clone().or_else(|| opts.cancel.clone()),
        ..opts.registry.clone()
    }
}

/// `--lazy` asked of an image of layers that could not be pulled lazily:
/// it was pulled whole, and why.
fn lazy_note(why: &str) -> String {
    format!("pulled whole, not lazily: {why}")
}

/// The image configuration (bytes, checked against its digest) of the OCI
/// image `r` names, for `opts.platform` (the host's by default), read as a
/// pull reads it: after the signature policy has accepted the image.
pub fn image_config(r: &ImageRef, opts: &PullOptions) -> Result<Vec<u8>, OciError> {
    let (opened, raw) = open_with_config(r, opts)?;
    if opened.resolved.artifact {
        return Err(OciError::manifest(
            opened.source.to_string(),
            "is a tilefs artifact, not an OCI image",
        ));
    }
    Ok(raw)
}

/// Opens `r` (checked against the signature policy) and reads its
/// configuration.
pub fn open_with_config(r: &ImageRef, opts: &PullOptions) -> Result<(crate::trust::Opened, Vec<u8>), OciError> {
    let platform = opts.platform.clone().unwrap_or_else(Platform::host);
    let opened = crate::trust::open_checked(r, &registry_options(opts), &opts.trust, &platform)?;
    let what = opened.source.to_string();
    let config = opened
        .resolved
        .config
        .as_ref()
        .ok_or_else(|| OciError::manifest(&what, "has no image configuration of its own"))?;
    let raw = read_config(opened.transport.as_ref(), config)?;
    Ok((opened, raw))
}

/// An image configuration's bytes: at most its descriptor's size, and
/// [`MAX_CONFIG`], checked against its digest.
fn read_config(t: &dyn Transport, config: &BlobRef) -> Result<Vec<u8>, OciError> {
    if let Some(size) = config.size.filter(|&s| s > MAX_CONFIG) {
        return Err(OciError::manifest(
            format!("configuration {}", config.digest),
            format!(
                "its descriptor states {size} bytes, more than {} (the limit)",
                crate::bounded::size(MAX_CONFIG)
            ),
        ));
    }
    transport::read_checked(
        t.open_blob(config)?,
        &config.digest,
        config.size.unwrap_or(MAX_CONFIG),
        "configuration",
    )
}

/// The configuration must be an image configuration listing as many
/// layers as the manifest (composefs-rs walks the configuration's list).
fn check_config(t: &dyn Transport, config: &BlobRef, layers: usize) -> Result<(), OciError> {
    let what = format!("configuration {}", config.digest);
    let raw = read_config(t, config)?;
    let v: serde_json::Value =
        serde_json::from_slice(&raw).map_err(|e| OciError::manifest(&what, format!("not JSON: {e}")))?;
    let diff_ids = v
        .pointer("/rootfs/diff_ids")
        .and_then(|d| d.as_array())
        .ok_or_else(|| OciError::manifest(&what, "not an image configuration (no rootfs.diff_ids)"))?;
    if diff_ids.len() != layers {
        return Err(OciError::manifest(
            &what,
            format!("lists {} layers where the manifest has {layers}", diff_ids.len()),
        ));
    }
    Ok(())
}

/// The blobs of `layers`, each once, in the order they first come.
fn distinct_blobs(layers: &[BlobRef]) -> Vec<BlobRef> {
    let mut seen = std::collections::HashSet::new();
    layers.iter().filter(|l| seen.insert(&l.digest)).cloned().collect()
}

/// The entries of each of `layers`, from those read of each of `distinct`
/// (a blob listed twice gives its entries twice).
fn in_manifest_order(layers: &[BlobRef], distinct: &[BlobRef], read: Vec<Vec<LayerEntry>>) -> Vec<Vec<LayerEntry>> {
    let at: HashMap<&crate::digest::Digest, usize> = distinct.iter().enumerate().map(|(i, b)| (&b.digest, i)).collect();
    let mut uses = vec![0usize; distinct.len()];
    for l in layers {
        uses[at[&l.digest]] += 1;
    }
    let mut read: Vec<Option<Vec<LayerEntry>>> = read.into_iter().map(Some).collect();
    layers
        .iter()
        .map(|l| {
            let i = at[&l.digest];
            uses[i] -= 1;
            match uses[i] {
                0 => read[i].take().unwrap_or_default(),
                _ => read[i].clone().unwrap_or_default(),
            }
        })
        .collect()
}

/// One layer as read: its entries, and with `locate` where each file lies
/// in its tar stream and the stream's seek index (None for a layer that
/// is not compressed: its offsets are the blob's).
pub(crate) struct LayerRead {
    pub entries: Vec<LayerEntry>,
    pub placements: Vec<layer::Placement>,
    pub seek: Option<tilefs_seekable::SeekIndex>,
}

/// Reads every layer, several at once, largest first; returns them in the
/// order of `layers`, or the first error in that order. With `locate`,
/// every layer is read (none taken from the layer cache) and located.
#[allow(clippy::too_many_arguments)]
pub(crate) fn read_layers(
    store: &Store,
    t: &dyn Transport,
    layers: &[BlobRef],
    ingest: &Ingest,
    progress: &PullProgress,
    presence: &tilefs_store::presence::Presence,
    opts: &PullOptions,
    locate: bool,
) -> Result<Vec<LayerRead>, OciError> {
    let mut order: Vec<usize> = (0..layers.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(layers[i].size.unwrap_or(0)));
    let threads = match opts.jobs {
        0 => std::thread::available_parallelism().map_or(2, |n| n.get()).max(2),
        n => n,
    }
    .min(layers.len().max(1));
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    type Slot = Mutex<Option<Result<LayerRead, OciError>>>;
    let results: Vec<Slot> = layers.iter().map(|_| Mutex::new(None)).collect();
    let stop = || failed.load(Relaxed) || opts.cancel.as_ref().is_some_and(|c| c.load(Relaxed));
    // Files read by the layer threads are digested and stored by workers,
    // one per core: decompression is the long pole of a big layer.
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let (tx, rx) = mpsc::sync_channel::<(usize, Job)>(64);
    let rx = Mutex::new(rx);
    let pending: Vec<Pending> = layers.iter().map(|_| Pending::default()).collect();
    // The holes sparse files may declare, over all the layers.
    let sparse_budget = AtomicU64::new(layer::MAX_SPARSE_HOLES);
    std::thread::scope(|outer| {
        for _ in 0..workers {
            outer.spawn(|| loop {
                let msg = rx.lock().unwrap().recv();
                let Ok((i, job)) = msg else { break };
                let r = ingest.import_bytes(job.data);
                pending[i].finish(job.id, r);
            });
        }
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let k = next.fetch_add(1, Relaxed);
                    let Some(&i) = order.get(k) else { break };
                    if stop() {
                        break;
                    }
                    let cached = match locate {
                        false => crate::layer_cache::load(store, &layers[i].digest, presence),
                        true => None,
                    };
                    let r = match cached {
                        Some(entries) => {
                            progress.entries.fetch_add(entries.len() as u64, Relaxed);
                            Ok(LayerRead {
                                entries,
                                placements: Vec::new(),
                                seek: None,
                            })
                        }
                        None => {
                            let offload = |job: Job| {
                                pending[i].add();
                                // The workers outlive every sender.
                                let _ = tx.send((i, job));
                            };
                            let how = Reading {
                                progress,
                                stop: &stop,
                                offload: &offload,
                                sparse_budget: &sparse_budget,
                                locate,
                            };
                            let r = read_layer(t, &layers[i], ingest, &how).and_then(|mut l| {
                                l.entries = pending[i].resolve(&layers[i].digest.to_string(), l.entries)?;
                                Ok(l)
                            });
                            if let Ok(l) = &r {
                                crate::layer_cache::save(store, &layers[i].digest, &l.entries);
                            }
                            r
                        }
                    };
                    if r.is_err() {
                        failed.store(true, Relaxed);
                    }
                    progress.layers_done.fetch_add(1, Relaxed);
                    *results[i].lock().unwrap() = Some(r);
                });
            }
        });
        drop(tx);
    });
    if opts.cancel.as_ref().is_some_and(|c| c.load(Relaxed)) {
        return Err(OciError::Interrupted);
    }
    let mut out = Vec::with_capacity(layers.len());
    let mut first_err = None;
    for r in results {
        match r.into_inner().unwrap() {
            Some(Ok(e)) => out.push(e),
            // An interruption caused by another layer's failure is not the
            // error to report.
            Some(Err(OciError::Interrupted)) | None => {}
            Some(Err(e)) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None if out.len() == layers.len() => Ok(out),
        None => Err(OciError::Interrupted),
    }
}

/// How a layer is read: what its reading shares with the others.
struct Reading<'a> {
    progress: &'a PullProgress,
    stop: &'a (dyn Fn() -> bool + Sync),
    offload: &'a (dyn Fn(Job) + Sync),
    sparse_budget: &'a AtomicU64,
    /// Record where files lie and the seek index.
    locate: bool,
}

/// The decompressed stream of a layer: the plain decoders, or with
/// `locate` the indexing ones, which record checkpoints as they go.
enum Decoded<'a, R: BufRead> {
    Plain(Box<dyn Read + 'a>),
    Gzip(tilefs_seekable::gzip::GzipIndexer<R>),
    Zstd(tilefs_seekable::zstd::ZstdIndexer<R>),
}

impl<R: BufRead> Read for Decoded<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Decoded::Plain(r) => r.read(buf),
            Decoded::Gzip(r) => r.read(buf),
            Decoded::Zstd(r) => r.read(buf),
        }
    }
}

/// Reads one layer: blob -> digest check -> decompressor -> tar entries.
fn read_layer(t: &dyn Transport, blob: &BlobRef, ingest: &Ingest, how: &Reading) -> Result<LayerRead, OciError> {
    let name = blob.digest.to_string();
    let raw = t.open_blob(blob)?;
    let verified = Verified::new(raw, blob.digest.clone(), blob.size).counting(how.progress.blob_bytes.clone());
    let check = verified.check();
    let stop = how.stop;
    let mut buf = BufReader::with_capacity(1 << 20, verified);
    let result = (|| -> Result<LayerRead, OciError> {
        let head = buf
            .fill_buf()
            .map_err(|e| OciError::layer(&name, None, format!("cannot read: {e}")))?;
        let compression = Compression::sniff(head);
        let seek_error = |e: tilefs_seekable::Error| OciError::layer(&name, None, format!("{compression:?}: {e}"));
        let mut stream: Decoded<'_, &mut BufReader<_>> = match (compression, how.locate) {
            (Compression::None, _) => Decoded::Plain(Box::new(&mut buf)),
            (Compression::Gzip, false) => Decoded::Plain(Box::new(flate2::bufread::MultiGzDecoder::new(&mut buf))),
            (Compression::Zstd, false) => Decoded::Plain(Box::new(
                zstd::Decoder::with_buffer(&mut buf).map_err(|e| OciError::layer(&name, None, format!("zstd: {e}")))?,
            )),
            (Compression::Gzip, true) => Decoded::Gzip(tilefs_seekable::gzip::GzipIndexer::new(&mut buf)),
            (Compression::Zstd, true) => {
                Decoded::Zstd(tilefs_seekable::zstd::ZstdIndexer::new(&mut buf).map_err(seek_error)?)
            }
        };
        let opts = ReadOptions {
            stop: Some(stop),
            entries: Some(&how.progress.entries),
            offload: Some(how.offload),
            sparse_budget: Some(how.sparse_budget),
        };
        let (entries, placements) = layer::read_entries_placed(&mut stream, &name, ingest, opts)
            .map_err(|e| with_compression(e, compression))?;
        // The rest of the stream (tar padding, the compressor's trailer)
        // must be read too: that is where a truncated or corrupt stream and
        // a wrong digest show.
        io::copy(&mut layer::Guarded::stoppable(&mut stream, stop), &mut io::sink()).map_err(|e| {
            OciError::layer(
                &name,
                None,
                format!("{} stream after the tar archive: {e}", compression.name()),
            )
        })?;
        let seek = match stream {
            Decoded::Plain(_) => None,
            Decoded::Gzip(g) => Some(g.finish().map_err(seek_error)?),
            Decoded::Zstd(z) => Some(z.finish().map_err(seek_error)?),
        };
        Ok(LayerRead {
            entries,
            placements: if how.locate { placements } else { Vec::new() },
            seek,
        })
    })();
    // A blob that is not what its descriptor says is the error, whatever
    // it made the decompressor or tar reader say: on an error, the rest of
    // the blob is read to learn whether it is.
    if result.is_err() && check.failure().is_none() && !stop() {
        let _ = io::copy(&mut buf, &mut io::sink());
    }
    if let Some(f) = check.failure() {
        return Err(OciError::blob(&name, f));
    }
    let read = match result {
        // Stopped (interrupted, or another layer failed): not this layer's
        // error.
        Err(_) if stop() => return Err(OciError::Interrupted),
        r => r?,
    };
    check.result().map_err(|f| OciError::blob(&name, f))?;
    Ok(read)
}

/// Adds the compression to a layer error that the decompressor caused.
fn with_compression(e: OciError, c: Compression) -> OciError {
    match e {
        OciError::Layer { blob, entry, reason }
            if c != Compression::None && (reason.contains("unreadable") || reason.starts_with("cannot read")) =>
        {
            OciError::Layer {
                blob,
                entry,
                reason: format!("{reason} (in the {} stream)", c.name()),
            }
        }
        e => e,
    }
}

/// The offloaded files of one layer: how many are still being stored, and
/// the digests (or errors) of those done.
#[derive(Default)]
struct Pending {
    state: Mutex<PendingState>,
    done: Condvar,
}

/// Jobs still running, and the outcome of those done, by job id.
type PendingState = (u32, HashMap<u32, Result<[u8; 32], tilefs_store::StoreError>>);

impl Pending {
    fn add(&self) {
        self.state.lock().unwrap().0 += 1;
    }

    fn finish(&self, id: u32, r: Result<[u8; 32], tilefs_store::StoreError>) {
        let mut st = self.state.lock().unwrap();
        st.0 -= 1;
        st.1.insert(id, r);
        if st.0 == 0 {
            self.done.notify_all();
        }
    }

    /// Waits for the layer's files to be stored and puts their digests in
    /// place.
    fn resolve(&self, blob: &str, mut entries: Vec<LayerEntry>) -> Result<Vec<LayerEntry>, OciError> {
        let mut st = self.state.lock().unwrap();
        while st.0 > 0 {
            st = self.done.wait(st).unwrap();
        }
        let mut digests = std::mem::take(&mut st.1);
        drop(st);
        for e in &mut entries {
            if let Kind::File { content, .. } = &mut e.kind {
                if let Content::Pending(id) = *content {
                    match digests.remove(&id) {
                        Some(Ok(d)) => *content = Content::Object(d),
                        Some(Err(tilefs_store::StoreError::Interrupted)) => return Err(OciError::Interrupted),
                        Some(Err(err)) => return Err(OciError::layer(blob, Some(&e.display_path()), err.to_string())),
                        None => {
                            return Err(OciError::layer(
                                blob,
                                Some(&e.display_path()),
                                "contents lost (an internal error)",
                            ))
                        }
                    }
                }
            }
        }
        Ok(entries)
    }
}
