//! Pulling a tilefs artifact ([`crate::artifact`]): the image and its
//! object index first, then only the objects the store lacks, by HTTP
//! range from the packs; or, with `--lazy`, none of them yet: a record in
//! the store says where they are, and [`LazySource`] fetches each one when
//! a FUSE mount first needs it.
//!
//! Every object is checked against its fs-verity digest (its name) before
//! it is stored, and stored only under that name, whole: a registry that
//! sends wrong bytes, an index that lies about where an object lies, or a
//! transfer cut short leave nothing behind but the error.

use crate::artifact::{self, Config, Location, ObjectIndex, ObjectRef};
use crate::flights::{Flights, Joined, Lead};
use crate::manifest::BlobRef;
use crate::pull::{PullOptions, PullProgress, PullReport};
use crate::transport::{self, read_checked, RegistryOptions, Resolved, Transport};
use crate::{ImageRef, OciError};
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use tilefs_store::fetch_lock::{FetchLocks, Span};
use tilefs_store::ingest::{Ingest, StatsSnapshot};
use tilefs_store::remote::{self, ObjectSource, REMOTE_DIR};
use tilefs_store::{tags, Store, StoreError};

/// Objects closer than this in a pack are fetched in one request (the gap
/// costs less than another round trip).
const GAP: u64 = 64 << 10;
/// Longest single range request.
const MAX_RANGE: u64 = 32 << 20;
/// Attempts at a range that fails in transit (not one whose bytes are
/// wrong: that is not retried).
const ATTEMPTS: u32 = 4;

/// An artifact's image and object index, fetched and checked.
pub struct RemoteImage {
    pub image: Vec<u8>,
    pub digest: [u8; 32],
    /// Every object the image needs, in tree order.
    pub objects: Vec<ObjectRef>,
    pub index: ObjectIndex,
    pub packs: Vec<BlobRef>,
    /// The image's inodes and format version.
    pub entries: usize,
    pub version: u32,
}

/// Fetches and checks the artifact's configuration, image and index.
pub fn open(t: &dyn Transport, resolved: &Resolved, what: &str) -> Result<RemoteImage, OciError> {
    let config_ref = resolved.config.as_ref().expect("an artifact has a configuration");
    let raw = read_checked(
        t.open_blob(config_ref)?,
        &config_ref.digest,
        config_ref
            .size
            .unwrap_or(artifact::MAX_CONFIG)
            .min(artifact::MAX_CONFIG),
        "configuration",
    )?;
    let config_what = format!("configuration {}", config_ref.digest);
    let runnable = config_ref.media_type != artifact::CONFIG_TYPE;
    let config: Config = if runnable {
        let blobs: Vec<_> = resolved.layers.iter().map(|l| l.digest.clone()).collect();
        artifact::parse_runnable_config(&raw, &blobs)
            .map_err(|e| OciError::manifest(&config_what, format!("not a runnable tilefs image configuration: {e}")))?
    } else {
        serde_json::from_slice(&raw)
            .map_err(|e| OciError::manifest(&config_what, format!("not a tilefs image configuration: {e}")))?
    };
    let [image_ref, index_ref, packs @ ..] = resolved.layers.as_slice() else {
        return Err(OciError::manifest(
            what,
            "a tilefs artifact has an image and an object index",
        ));
    };
    let format = artifact::format_of(&image_ref.media_type)
        .filter(|&(_, r)| r == runnable)
        .map_or(artifact::Format::V1, |(f, _)| f);
    if format == artifact::Format::V3 {
        return crate::artifact_tree::open(t, &resolved.layers, runnable, Some(&config), what);
    }
    let [erofs_type, index_type, pack_type] = artifact::blob_types(runnable, format);
    for (b, t_) in [(image_ref, erofs_type), (index_ref, index_type)]
        .into_iter()
        .chain(packs.iter().map(|p| (p, pack_type)))
    {
        if b.media_type != t_ {
            return Err(OciError::manifest(
                what,
                format!(
                    "blob {} has media type {} where {t_} was expected",
                    b.digest, b.media_type
                ),
            ));
        }
    }
    let image = read_checked(
        t.open_blob(image_ref)?,
        &image_ref.digest,
        image_ref.size.unwrap_or(artifact::MAX_IMAGE).min(artifact::MAX_IMAGE),
        "image",
    )?;
    let image = match format {
        artifact::Format::V1 => image,
        artifact::Format::V2 | artifact::Format::V3 => artifact::unzstd(&image, artifact::MAX_IMAGE)
            .map_err(|e| OciError::blob(&image_ref.digest.to_string(), format!("the image: {e}")))?,
    };
    let digest = tilefs_image::verity::digest_bytes(&image);
    if hex::encode(digest) != config.fsverity {
        return Err(OciError::blob(
            &image_ref.digest.to_string(),
            format!(
                "the image's fs-verity digest is {} but the configuration says {}",
                hex::encode(digest),
                config.fsverity
            ),
        ));
    }
    let (tree, info) = tilefs_image::erofs::read_image(&image)
        .map_err(|e| OciError::blob(&image_ref.digest.to_string(), format!("not a composefs image: {e}")))?;
    let objects = artifact::objects_of(&tree);
    let entries = tree.inodes.len();
    drop(tree);
    let index_what = format!("object index {}", index_ref.digest);
    let raw = read_checked(
        t.open_blob(index_ref)?,
        &index_ref.digest,
        index_ref.size.unwrap_or(artifact::MAX_INDEX).min(artifact::MAX_INDEX),
        "object index",
    )?;
    let sizes: Vec<u64> = packs.iter().map(|p| p.size.unwrap_or(0)).collect();
    let index = match format {
        artifact::Format::V1 => ObjectIndex::parse_v1(&raw, &sizes, &index_what)?.restrict_to(&objects, &index_what)?,
        artifact::Format::V2 | artifact::Format::V3 => ObjectIndex::parse_v2(&raw, &objects, &sizes, &index_what)?,
    };
    Ok(RemoteImage {
        image,
        digest,
        objects,
        index,
        packs: packs.to_vec(),
        entries,
        version: info.version,
    })
}

/// Pulls an artifact: its objects the store lacks (none with `lazy`, which
/// records where they are instead), then the tag.
pub(crate) fn pull_artifact(
    store: &Store,
    r: &ImageRef,
    t: &dyn Transport,
    resolved: Resolved,
    tag: &str,
    opts: &PullOptions,
    progress: &PullProgress,
) -> Result<PullReport, OciError> {
    let lazy = opts.lazy;
    let remote = matches!(r, ImageRef::Registry { .. } | ImageRef::Name { .. });
    progress.stage.set("fetching the image and its object index", remote);
    let remote_image = open(t, &resolved, &r.to_string())?;
    let absent = tilefs_store::presence::absent(store, remote_image.objects.iter().map(|o| o.digest));
    let mut objects = StatsSnapshot::default();
    if lazy && !absent.is_empty() {
        let record = LazyRecord {
            version: RECORD_VERSION,
            source: r.to_string(),
            manifest_digest: resolved.manifest_digest.as_ref().map(|d| d.to_string()),
            tls_verify: opts.registry.tls_verify,
            timeout_secs: opts.registry.timeout.as_secs(),
            packs: remote_image
                .packs
                .iter()
                .map(|p| (p.digest.to_string(), p.size.unwrap_or(0)))
                .collect(),
            index: remote_image.index.clone(),
            trust: resolved.trust.clone(),
            layers: Vec::new(),
            index_trust: None,
        };
        record.save(store, &remote_image.digest)?;
    } else if !absent.is_empty() {
        let mut ingest = Ingest::for_fetched(store)?;
        ingest.set_batch_bytes(128 << 20);
        if let Some(c) = &opts.cancel {
            ingest.set_cancel(c.clone());
        }
        let wanted: Vec<Placed> = absent
            .iter()
            .map(|d| (*d, remote_image.index.get(d).expect("the index places every object")))
            .collect();
        progress
            .blob_total
            .store(wanted.iter().map(|w| w.1.stored_len()).sum(), Relaxed);
        progress.stage.set(format!("fetching {} objects", wanted.len()), remote);
        let jobs = if opts.jobs == 0 { 4 } else { opts.jobs };
        let fetched = fetch_objects(
            &Fetching {
                store,
                t,
                packs: &remote_image.packs,
                ingest: &ingest,
                cancel: opts.cancel.as_deref(),
                progress,
            },
            &wanted,
            jobs,
            opts.registry.timeout,
        );
        // Objects that came whole and checked are kept even when others
        // failed: a later pull does not fetch them again (gc removes them
        // if none ever does).
        let finished = ingest.finish();
        fetched?;
        objects = finished?;
    }
    crate::trust::save_evidence(store, &remote_image.digest, &resolved)?;
    tags::write_tag(store, tag, &remote_image.image)?;
    if !lazy || absent.is_empty() {
        remote::forget(store, &remote_image.digest)?;
    }
    if let ImageRef::Registry { reference } = r {
        if let Ok(parsed) = reference.parse::<oci_client::Reference>() {
            crate::layer_cache::add_origin(store, parsed.resolve_registry(), parsed.repository());
        }
    }
    Ok(PullReport {
        tag: tag.to_string(),
        digest: hex::encode(remote_image.digest),
        image_bytes: remote_image.image.len(),
        format_version: remote_image.version,
        manifest_digest: resolved.manifest_digest.map(|d| d.to_string()),
        layers: 0,
        blob_bytes: progress.blob_bytes.load(Relaxed),
        entries: remote_image.entries,
        objects,
        notes: Vec::new(),
        lazy_objects: if lazy { absent.len() as u64 } else { 0 },
        lazy_index: None,
        lazy_fallback: None,
    })
}

/// An object (its digest) and where it lies.
type Placed = ([u8; 32], Location);

/// A run of objects of one pack, fetched by one request.
struct Range {
    pack: usize,
    start: u64,
    end: u64,
    objects: Vec<Placed>,
}

/// Groups `wanted` into ranges: by pack, in offset order, neighbours
/// merged across small gaps.
fn plan_ranges(wanted: &[Placed]) -> Vec<Range> {
    let mut sorted = wanted.to_vec();
    sorted.sort_by_key(|(_, l)| (l.pack, l.offset));
    let mut out: Vec<Range> = Vec::new();
    for (d, l) in sorted {
        let end = l.end();
        match out.last_mut() {
            Some(r)
                if r.pack == l.pack as usize
                    && l.offset >= r.end
                    && l.offset - r.end <= GAP
                    && end - r.start <= MAX_RANGE =>
            {
                r.end = end;
                r.objects.push((d, l));
            }
            _ => out.push(Range {
                pack: l.pack as usize,
                start: l.offset,
                end,
                objects: vec![(d, l)],
            }),
        }
    }
    out
}

/// What a pull's fetches share.
struct Fetching<'a> {
    store: &'a Store,
    t: &'a dyn Transport,
    packs: &'a [BlobRef],
    ingest: &'a Ingest<'a>,
    cancel: Option<&'a AtomicBool>,
    progress: &'a PullProgress,
}

/// The span of the store's fetch lock ([`tilefs_store::fetch_lock`]) that
/// stands for the object at `loc` in the pack `pack`: the same in every
/// process, and neighbours in a pack next to each other, so that the locks
/// of a run of objects merge into one. The pack's digest picks one of 2^22
/// slots of 2^40 bytes (two packs sharing a slot only wait for each other
/// now and then).
fn span(pack: &crate::digest::Digest, loc: Location) -> Span {
    let slot = pack
        .hex()
        .get(..16)
        .and_then(|h| u64::from_str_radix(h, 16).ok())
        .unwrap_or(0)
        >> 42;
    Span {
        start: slot << 40 | (loc.offset & ((1 << 40) - 1)),
        len: loc.stored_len().max(1),
    }
}

/// Fetches `wanted` into the store, `jobs` ranges at once; the first error
/// stops the others. Objects another fetch (a lazy mount, another pull) is
/// bringing are left to it and waited for, up to `wait`; those it did not
/// bring are fetched then.
fn fetch_objects(f: &Fetching, wanted: &[Placed], jobs: usize, wait: Duration) -> Result<(), OciError> {
    let deferred = Mutex::new(Vec::new());
    fetch_ranges(f, wanted, jobs, Some(&deferred))?;
    let deferred = deferred.into_inner().unwrap();
    if deferred.is_empty() {
        return Ok(());
    }
    let deadline = Instant::now() + wait;
    let left: Vec<Placed> = deferred
        .into_iter()
        .filter(|(d, l)| {
            if let Some(locks) = FetchLocks::open(f.store) {
                let s = span(&f.packs[l.pack as usize].digest, *l);
                if locks.lock(s, deadline) {
                    locks.unlock(s);
                }
            }
            !f.store.has_object(d)
        })
        .collect();
    fetch_ranges(f, &left, jobs, None)
}

/// Fetches `wanted` by ranges, `jobs` at once, each object under its fetch
/// lock. An object whose lock another fetch holds is put in `defer`, or
/// with no `defer`, fetched all the same.
fn fetch_ranges(
    f: &Fetching,
    wanted: &[Placed],
    jobs: usize,
    defer: Option<&Mutex<Vec<Placed>>>,
) -> Result<(), OciError> {
    let ranges = plan_ranges(wanted);
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<OciError>> = Mutex::new(None);
    let stop = || failed.lock().unwrap().is_some() || f.cancel.is_some_and(|c| c.load(Relaxed));
    std::thread::scope(|s| {
        for _ in 0..jobs.min(ranges.len()).max(1) {
            s.spawn(|| {
                while let Some(range) = ranges.get(next.fetch_add(1, Relaxed)) {
                    if stop() {
                        break;
                    }
                    if let Err(e) = fetch_claimed(f, range, defer) {
                        failed.lock().unwrap().get_or_insert(e);
                    }
                }
            });
        }
    });
    match failed.into_inner().unwrap() {
        // Which registry (or layout) sent it, too.
        Some(OciError::Blob { blob, reason }) => Err(OciError::Blob {
            blob,
            reason: format!("{reason} (from {})", f.t.origin()),
        }),
        Some(e) => Err(e),
        None if f.cancel.is_some_and(|c| c.load(Relaxed)) => Err(OciError::Interrupted),
        None => Ok(()),
    }
}

/// Fetches the objects of `range` this pull may bring: those whose fetch
/// lock it takes and that are still absent then, in runs cut where an
/// object is left out (its bytes are not fetched twice). They are stored
/// for good before the locks go, so a fetch waiting for one finds it.
fn fetch_claimed(f: &Fetching, range: &Range, defer: Option<&Mutex<Vec<Placed>>>) -> Result<(), OciError> {
    let pack = &f.packs[range.pack];
    let locks = FetchLocks::open(f.store);
    let mut runs: Vec<Range> = Vec::new();
    let mut cut = true;
    for &(d, l) in &range.objects {
        let s = span(&pack.digest, l);
        if let (false, Some(defer)) = (locks.as_ref().is_none_or(|k| k.try_lock(s)), defer) {
            defer.lock().unwrap().push((d, l));
            cut = true;
            continue;
        }
        if f.store.has_object(&d) {
            cut = true;
            continue;
        }
        match runs.last_mut() {
            Some(r) if !cut => {
                r.end = l.end();
                r.objects.push((d, l));
            }
            _ => runs.push(Range {
                pack: range.pack,
                start: l.offset,
                end: l.end(),
                objects: vec![(d, l)],
            }),
        }
        cut = false;
    }
    for run in &runs {
        fetch_range(f.t, pack, None, run, f.ingest, f.progress, None, f.cancel)?;
    }
    f.ingest.commit()?;
    drop(locks);
    Ok(())
}

/// Fetches one range, retrying (with back-off, at most [`ATTEMPTS`] times,
/// never past `deadline`, and not once `cancel` is set) from the first
/// object not yet stored when the transfer fails. With `coding`, `pack` is
/// an ordinary layer and the range one of its tar stream.
#[allow(clippy::too_many_arguments)]
fn fetch_range(
    t: &dyn Transport,
    pack: &BlobRef,
    coding: Option<&crate::layer_fetch::Coding>,
    range: &Range,
    ingest: &Ingest,
    progress: &PullProgress,
    deadline: Option<Instant>,
    cancel: Option<&AtomicBool>,
) -> Result<(), OciError> {
    let cancelled = || cancel.is_some_and(|c| c.load(Relaxed));
    let mut done = 0;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let start = range.objects[done].1.offset;
        // One large object alone is fetched in parallel pieces; runs of
        // objects are already fetched several at once.
        let split = range.objects.len() - done == 1;
        let corrupt = AtomicBool::new(false);
        let read = |reader: &mut dyn Read| {
            let mut reader = Counting(reader, &progress.blob_bytes);
            read_objects(&mut reader, pack, start, &range.objects[done..], ingest, &mut done)
        };
        let fetched = match coding {
            None => with_range(t, pack, start, range.end - start, split, read),
            Some(c) => crate::layer_fetch::with_stream_range(t, pack, c, start, range.end - start, &corrupt, read),
        };
        let err = match fetched {
            Ok(Ok(())) => return Ok(()),
            // A compressed range that does not decode: as wrong bytes.
            Ok(Err(Fetch::Transfer(e))) if corrupt.load(Relaxed) => Fetch::Wrong(e),
            Ok(Err(e)) => e,
            Err(e) => Fetch::Transfer(e),
        };
        let e = match err {
            _ if cancelled() => return Err(OciError::Interrupted),
            Fetch::Wrong(e) => return Err(e),
            Fetch::Transfer(e) => e,
        };
        let backoff = Instant::now() + Duration::from_millis(250 << attempt.min(5));
        if attempt >= ATTEMPTS || deadline.is_some_and(|d| backoff >= d) {
            return Err(e);
        }
        while Instant::now() < backoff {
            if cancelled() {
                return Err(OciError::Interrupted);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Ranges longer than this are fetched as [`CHUNK`]-sized requests,
/// [`PARALLEL`] at a time: one stream alone rarely fills a long link.
const PARALLEL_FROM: u64 = 16 << 20;
const CHUNK: u64 = 4 << 20;
const PARALLEL: u64 = 4;

/// Runs `f` on a reader of `len` bytes of `blob` from `offset`: one range
/// request, or for a long range when `split`, several at once, read back
/// in order (at most two chunks per request in memory).
fn with_range<R>(
    t: &dyn Transport,
    blob: &BlobRef,
    offset: u64,
    len: u64,
    split: bool,
    f: impl FnOnce(&mut dyn Read) -> R,
) -> Result<R, OciError> {
    if !split || len <= PARALLEL_FROM {
        let mut r = t.open_range(blob, offset, len)?;
        return Ok(f(&mut r));
    }
    let chunks = len.div_ceil(CHUNK);
    let lanes = PARALLEL.min(chunks);
    Ok(std::thread::scope(|s| {
        let mut receivers = Vec::new();
        for lane in 0..lanes {
            let (tx, rx) = std::sync::mpsc::sync_channel::<io::Result<Vec<u8>>>(1);
            receivers.push(rx);
            s.spawn(move || {
                for c in (lane..chunks).step_by(lanes as usize) {
                    let from = offset + c * CHUNK;
                    let n = CHUNK.min(offset + len - from);
                    let mut buf = Vec::with_capacity(n as usize);
                    let r = t
                        .open_range(blob, from, n)
                        .map_err(io::Error::other)
                        .and_then(|mut r| r.read_to_end(&mut buf));
                    let failed = r.is_err();
                    // The reader went away (done or failed): stop.
                    if tx.send(r.map(|_| buf)).is_err() || failed {
                        return;
                    }
                }
            });
        }
        let mut reader = InOrder {
            receivers,
            next: 0,
            chunks,
            current: io::Cursor::new(Vec::new()),
        };
        f(&mut reader)
    }))
}

/// The chunks of [`with_range`]'s lanes, in order.
struct InOrder {
    receivers: Vec<std::sync::mpsc::Receiver<io::Result<Vec<u8>>>>,
    next: u64,
    chunks: u64,
    current: io::Cursor<Vec<u8>>,
}

impl Read for InOrder {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let n = self.current.read(buf)?;
            if n > 0 || buf.is_empty() || self.next == self.chunks {
                return Ok(n);
            }
            let lane = (self.next % self.receivers.len() as u64) as usize;
            let chunk = self.receivers[lane]
                .recv()
                .map_err(|_| io::Error::other("a range request ended without an answer"))??;
            self.current = io::Cursor::new(chunk);
            self.next += 1;
        }
    }
}

enum Fetch {
    /// Bytes that are not the object: not worth asking again.
    Wrong(OciError),
    /// The transfer failed: another attempt may succeed.
    Transfer(OciError),
}

/// Reads `objects` (in offset order) from `reader`, which starts at
/// `start` in `pack`, into the store; counts those stored in `done`.
fn read_objects(
    reader: &mut dyn Read,
    pack: &BlobRef,
    start: u64,
    objects: &[Placed],
    ingest: &Ingest,
    done: &mut usize,
) -> Result<(), Fetch> {
    let blob = pack.digest.to_string();
    let mut pos = start;
    for (d, l) in objects {
        let rel = Store::object_rel(d);
        let skip = l.offset - pos;
        let skipped = io::copy(&mut reader.take(skip), &mut io::sink())
            .map_err(|e| Fetch::Transfer(OciError::blob(&blob, format!("object {rel}: {e}"))))?;
        if skipped < skip {
            return Err(Fetch::Transfer(OciError::blob(
                &blob,
                format!("object {rel}: the range ended early"),
            )));
        }
        let what = PathBuf::from(format!("object {rel} (bytes {}..{})", l.offset, l.end()));
        let mut stored = Watched {
            inner: reader.take(l.stored_len()),
            failed: false,
        };
        let imported = artifact::unpack(&mut stored, l)
            .map_err(|e| StoreError::source_io(&what, "cannot decode", e))
            .and_then(|mut object| ingest.import_expected(&what, l.size, &mut object, d));
        match imported {
            Ok(()) => {}
            Err(e @ StoreError::Mismatch(_)) => return Err(Fetch::Wrong(OciError::blob(&blob, e.to_string()))),
            // The range ended early or could not be read: the transfer.
            Err(e @ (StoreError::Source { .. } | StoreError::SourceIo { .. }))
                if stored.failed || l.stored == artifact::Stored::Raw =>
            {
                return Err(Fetch::Transfer(OciError::blob(&blob, e.to_string())));
            }
            // All of it came, and does not decode to the object.
            Err(e @ (StoreError::Source { .. } | StoreError::SourceIo { .. })) => {
                return Err(Fetch::Wrong(OciError::blob(
                    &blob,
                    format!("{e} (its zstd frame in the pack is not the object's)"),
                )));
            }
            Err(StoreError::Interrupted) => return Err(Fetch::Wrong(OciError::Interrupted)),
            Err(e) => return Err(Fetch::Wrong(e.into())),
        }
        // What the decoder left of the frame (nothing, from tilefs).
        io::copy(&mut stored, &mut io::sink())
            .map_err(|e| Fetch::Transfer(OciError::blob(&blob, format!("object {rel}: {e}"))))?;
        pos = l.end();
        *done += 1;
    }
    Ok(())
}

/// A reader of an object's stored bytes that notes whether they failed
/// to come (an error, or their end before all came): then a frame that
/// does not decode is the transfer's fault, not the pack's.
struct Watched<R> {
    inner: io::Take<R>,
    failed: bool,
}

impl<R: Read> Read for Watched<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.inner.read(buf) {
            Err(e) if e.kind() != io::ErrorKind::Interrupted => {
                self.failed = true;
                Err(e)
            }
            Ok(0) if !buf.is_empty() && self.inner.limit() > 0 => {
                self.failed = true;
                Ok(0)
            }
            r => r,
        }
    }
}

/// Counts bytes as they are read.
struct Counting<'a, R>(R, &'a std::sync::atomic::AtomicU64);

impl<R: Read> Read for Counting<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.0.read(buf)?;
        self.1.fetch_add(n as u64, Relaxed);
        Ok(n)
    }
}

/// 3: layers of ordinary images ([`LazyRecord::layers`]); 4: objects
/// stored compressed ([`artifact::Stored`]). Records of 2 and 3 are still
/// read.
const RECORD_VERSION: u32 = 4;

/// Why a lazy-pull record may not decide where this user's credentials go,
/// if it may not: its registry and `tls_verify` do, so a user who can write
/// it could send them to another host, or over plain HTTP. It must be the
/// user's (or root's) and writable by no one else, in a store that is the
/// user's (or root's).
pub(crate) fn untrusted(store: &Store, record: &std::fs::File) -> Option<String> {
    let me = rustix::process::geteuid().as_raw();
    let stat = |fd| rustix::fs::fstat(fd).map_err(|e| format!("cannot stat: {e}"));
    let (dir, file) = match (stat(store.dir_fd()), stat(record.as_fd())) {
        (Ok(d), Ok(f)) => (d, f),
        (Err(e), _) | (_, Err(e)) => return Some(e),
    };
    let theirs = |uid: u32| uid != me && uid != 0;
    if theirs(dir.st_uid) {
        return Some(format!(
            "the store {} belongs to uid {}, not to you (uid {me}) or root",
            store.path().display(),
            dir.st_uid
        ));
    }
    if theirs(file.st_uid) {
        return Some(format!(
            "it belongs to uid {}, not to you (uid {me}) or root",
            file.st_uid
        ));
    }
    if file.st_mode & 0o022 != 0 {
        return Some(format!("others may write it (mode {:04o})", file.st_mode & 0o7777));
    }
    None
}

/// Where the objects of a lazily pulled image are: `STORE/.remote/HEX`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LazyRecord {
    version: u32,
    /// The reference pulled (its transport and repository).
    pub source: String,
    pub manifest_digest: Option<String>,
    pub tls_verify: bool,
    pub timeout_secs: u64,
    /// Each pack's digest and size.
    pub packs: Vec<(String, u64)>,
    pub index: ObjectIndex,
    /// How the pull passed the signature policy (a registry image's fetches
    /// check it again before the first one).
    pub trust: Option<crate::trust::TrustRecord>,
    /// For an ordinary image pulled through its index
    /// ([`crate::lazy_index`]), one per pack, which are then its layers:
    /// how each is compressed (the index's locations are offsets in the
    /// uncompressed stream, or [`crate::lazy_index::WHOLE_LAYER`]). Empty
    /// for a tilefs artifact.
    pub layers: Vec<LayerCoding>,
    /// How the index passed the signature policy: checked again too.
    pub index_trust: Option<crate::trust::TrustRecord>,
}

/// A record's bytes: of this version, or of version 2 (artifacts only:
/// this one without its last fields) or 3 (objects as they are in the
/// packs), read as they were written.
fn decode_record(raw: &[u8]) -> Result<LazyRecord, postcard::Error> {
    let (version, _) = postcard::take_from_bytes::<u32>(raw)?;
    let (head, layers, index_trust) = match version {
        2 => (postcard::from_bytes::<RecordV2>(raw)?, Vec::new(), None),
        3 => {
            let r: RecordV3 = postcard::from_bytes(raw)?;
            let head = RecordV2 {
                version: r.version,
                source: r.source,
                manifest_digest: r.manifest_digest,
                tls_verify: r.tls_verify,
                timeout_secs: r.timeout_secs,
                packs: r.packs,
                index: r.index,
                trust: r.trust,
            };
            (head, r.layers, r.index_trust)
        }
        _ => return postcard::from_bytes(raw),
    };
    Ok(LazyRecord {
        version: RECORD_VERSION,
        source: head.source,
        manifest_digest: head.manifest_digest,
        tls_verify: head.tls_verify,
        timeout_secs: head.timeout_secs,
        packs: head.packs,
        index: ObjectIndex {
            objects: head
                .index
                .objects
                .into_iter()
                .map(|(d, (pack, offset, size))| (d, Location::raw(pack, offset, size)))
                .collect(),
        },
        trust: head.trust,
        layers,
        index_trust,
    })
}

/// An object index of a record of version 2 or 3: (pack, offset, size).
#[derive(serde::Serialize, serde::Deserialize)]
struct OldIndex {
    objects: Vec<([u8; 32], (u32, u64, u64))>,
}

/// The fields of a version 2 record (all a version 3 record begins with).
#[derive(serde::Serialize, serde::Deserialize)]
struct RecordV2 {
    version: u32,
    source: String,
    manifest_digest: Option<String>,
    tls_verify: bool,
    timeout_secs: u64,
    packs: Vec<(String, u64)>,
    index: OldIndex,
    trust: Option<crate::trust::TrustRecord>,
}

/// A version 3 record.
#[derive(serde::Serialize, serde::Deserialize)]
struct RecordV3 {
    version: u32,
    source: String,
    manifest_digest: Option<String>,
    tls_verify: bool,
    timeout_secs: u64,
    packs: Vec<(String, u64)>,
    index: OldIndex,
    trust: Option<crate::trust::TrustRecord>,
    layers: Vec<LayerCoding>,
    index_trust: Option<crate::trust::TrustRecord>,
}

/// How an ordinary layer's stream is reached.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum LayerCoding {
    /// Not compressed: stream offsets are blob offsets.
    Plain,
    /// Compressed, with this seek index ([`tilefs_seekable::format`]).
    Seek(Vec<u8>),
}

impl LazyRecord {
    /// The record of an ordinary image whose layers `maps` describe (a
    /// prefix of them makes the image of a chain) and whose objects lie as
    /// `index` says ([`crate::lazy_index::locate`]), pulled from `source`
    /// as `resolved` (its layers, its trust record) with `opts`.
    pub fn for_layers(
        source: &ImageRef,
        resolved: &Resolved,
        opts: &PullOptions,
        maps: &[&crate::lazy_index::LayerMap],
        index: ObjectIndex,
        index_trust: Option<crate::trust::TrustRecord>,
    ) -> LazyRecord {
        LazyRecord {
            version: RECORD_VERSION,
            source: source.to_string(),
            manifest_digest: resolved.manifest_digest.as_ref().map(|d| d.to_string()),
            tls_verify: opts.registry.tls_verify,
            timeout_secs: opts.registry.timeout.as_secs(),
            packs: resolved
                .layers
                .iter()
                .take(maps.len())
                .map(|l| (l.digest.to_string(), l.size.unwrap_or(0)))
                .collect(),
            index,
            trust: resolved.trust.clone(),
            layers: maps
                .iter()
                .map(|m| match &m.seek {
                    Some(s) => LayerCoding::Seek(s.encode()),
                    None => LayerCoding::Plain,
                })
                .collect(),
            index_trust,
        }
    }

    /// Writes the record of `image` (its fs-verity digest) in `store`.
    pub fn save(&self, store: &Store, image: &[u8; 32]) -> Result<(), OciError> {
        let bytes = postcard::to_stdvec(self).map_err(|e| OciError::Reference(format!("cannot encode: {e}")))?;
        crate::layer_cache::write_record_in(store, REMOTE_DIR, &hex::encode(image), &bytes).map_err(|e| {
            OciError::io(
                &remote::record_path(store, image),
                "cannot record where the objects are",
                e,
            )
        })
    }

    /// The record of `image`, if it was pulled lazily, and if it may say
    /// where this user's credentials go (see [`untrusted`]).
    pub fn load(store: &Store, image: &[u8; 32]) -> Result<Option<LazyRecord>, OciError> {
        if !remote::is_lazy(store, image) {
            return Ok(None);
        }
        let path = remote::record_path(store, image);
        let mut f = crate::layer_cache::open_record_in(store, REMOTE_DIR, &hex::encode(image))
            .map_err(|e| OciError::io(&path, "cannot read", e))?;
        if let Some(why) = untrusted(store, &f) {
            return Err(OciError::io(
                &path,
                "refusing this lazy-pull record",
                io::Error::other(format!(
                    "{why}; it says which registry gets your credentials, so only a record of yours (or root's), \
                     in a store of yours (or root's), is used: pull the image again into a store of yours"
                )),
            ));
        }
        let mut raw = Vec::new();
        f.read_to_end(&mut raw)
            .map_err(|e| OciError::io(&path, "cannot read", e))?;
        let r = decode_record(&raw)
            .map_err(|e| OciError::io(&path, "not a tilefs lazy-pull record", io::Error::other(e)))?;
        if r.version != RECORD_VERSION {
            return Err(OciError::io(
                &path,
                "a record of another tilefs version",
                io::Error::other("pull the image again"),
            ));
        }
        Ok(Some(r))
    }

    fn pack(&self, i: u32) -> Option<BlobRef> {
        let (d, size) = self.packs.get(i as usize)?;
        Some(BlobRef {
            digest: crate::digest::Digest::parse(d).ok()?,
            size: Some(*size),
            media_type: artifact::PACK_TYPE.into(),
            member: None,
        })
    }
}

/// The transport of a lazy record's fetches from `source`, once the
/// signature policy accepts the image (and its index) again: only an image
/// it accepts is fetched. The record keeps the timeout only: the default
/// --min-rate.
pub(crate) fn open_transport(
    source: &str,
    tls_verify: bool,
    timeout: Duration,
    trust: Option<&crate::trust::TrustRecord>,
    index_trust: Option<&crate::trust::TrustRecord>,
) -> Result<Box<dyn Transport>, String> {
    let r = ImageRef::parse(source).map_err(|e| e.to_string())?;
    let opts = RegistryOptions {
        tls_verify,
        timeout,
        ..RegistryOptions::default()
    };
    let ImageRef::Registry { reference } = &r else {
        return transport::open(&r, &opts).map_err(|e| e.to_string());
    };
    let trust = trust.ok_or_else(|| {
        "the record does not say how the image passed the signature policy: pull it again".to_string()
    })?;
    // One client for the checks and the fetches: each costs a TLS setup
    // and threads, and the first fetch of a mount waits for all of them.
    let reg = transport::registry::Registry::open(reference, &opts).map_err(|e| e.to_string())?;
    crate::trust::recheck(trust, &reg).map_err(|e| format!("the signature policy refuses the image now: {e}"))?;
    if let Some(index) = index_trust {
        crate::trust::recheck(index, &reg)
            .map_err(|e| format!("the signature policy refuses the image's index now: {e}"))?;
    }
    Ok(Box::new(reg))
}

/// Fetches the objects of a lazily pulled image as a FUSE mount needs
/// them. The transport (a registry client and its threads) starts on the
/// first fetch, so a server that forks into the background starts it in
/// the process that serves.
///
/// Each object is fetched once however many readers want it: readers in
/// this process wait for the fetch under way ([`Flights`]), other
/// processes for its lock in the store ([`FetchLocks`]), and all then find
/// it stored. A failed fetch is answered to those waiting for it and
/// forgotten: the next reader tries again.
pub struct LazySource {
    store: Store,
    record: LazyRecord,
    /// The index's objects in pack order: (pack, offset, position in the
    /// index), for read-ahead.
    by_offset: Vec<(u32, u64, usize)>,
    transport: OnceLock<Box<dyn Transport>>,
    flights: Flights,
    /// Where the last fetch ended (pack, offset): a fetch starting there
    /// is part of a sequential read, and reads ahead.
    last_end: Mutex<Option<(u32, u64)>>,
    /// An ordinary image's layers ([`LazyRecord::layers`]), decoded, each
    /// with the lock of reading it whole (once, not by every reader).
    layers: Vec<(crate::layer_fetch::Coding, Mutex<()>)>,
}

/// How far a sequential read fetches ahead of the object asked for.
const READ_AHEAD: u64 = 1 << 20;
const READ_AHEAD_OBJECTS: usize = 64;

impl LazySource {
    /// The source of the image `image` in the store at `store`, if it was
    /// pulled lazily and lacks objects still.
    pub fn open(store: &Path, image: &[u8; 32]) -> Result<Option<LazySource>, OciError> {
        let store = Store::open(store)?;
        let Some(record) = LazyRecord::load(&store, image)? else {
            return Ok(None);
        };
        let mut by_offset: Vec<(u32, u64, usize)> = record
            .index
            .objects
            .iter()
            .enumerate()
            .map(|(i, (_, l))| (l.pack, l.offset, i))
            .collect();
        by_offset.sort_unstable();
        let path = remote::record_path(&store, image);
        let mut layers = Vec::with_capacity(record.layers.len());
        for (i, c) in record.layers.iter().enumerate() {
            let coding = match c {
                LayerCoding::Plain => crate::layer_fetch::Coding::Plain,
                LayerCoding::Seek(b) => {
                    crate::layer_fetch::Coding::Seek(tilefs_seekable::SeekIndex::decode(b).map_err(|e| {
                        OciError::io(&path, "a lazy-pull record", io::Error::other(format!("layer {i}: {e}")))
                    })?)
                }
            };
            layers.push((coding, Mutex::new(())));
        }
        if !layers.is_empty() && layers.len() != record.packs.len() {
            return Err(OciError::io(
                &path,
                "a lazy-pull record",
                io::Error::other("its layers and packs differ in number"),
            ));
        }
        Ok(Some(LazySource {
            store,
            record,
            by_offset,
            transport: OnceLock::new(),
            flights: Flights::default(),
            last_end: Mutex::new(None),
            layers,
        }))
    }

    /// The transport, started now if it is not yet (a failure to start it
    /// is not kept: the next fetch tries again).
    fn transport(&self) -> Result<&dyn Transport, String> {
        if let Some(t) = self.transport.get() {
            return Ok(t.as_ref());
        }
        let r = &self.record;
        let t = open_transport(
            &r.source,
            r.tls_verify,
            self.timeout(),
            r.trust.as_ref(),
            r.index_trust.as_ref(),
        )?;
        Ok(self.transport.get_or_init(|| t).as_ref())
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(self.record.timeout_secs.clamp(1, 3600))
    }

    /// Why the fetch of `digest` failed, for its readers' log.
    fn failed(&self, digest: &[u8; 32], e: impl std::fmt::Display) -> String {
        let origin = self
            .transport
            .get()
            .map(|t| t.origin())
            .unwrap_or_else(|| self.record.source.clone());
        format!("object {}: fetch from {origin} failed: {e}", Store::object_rel(digest))
    }

    /// The range to fetch for `digest` at `loc`: the object alone, or when
    /// the last fetch ended where it starts (a sequential read: `cat` of a
    /// directory, an archiver), also the absent objects after it in the
    /// pack, up to [`READ_AHEAD`] bytes more, each claimed for this fetch
    /// (led here, locked in the store): the read-ahead stops at the first
    /// one another fetch is bringing. Returns the range and the claims.
    fn range_for(
        &self,
        digest: &[u8; 32],
        loc: Location,
        pack: &crate::digest::Digest,
        locks: Option<&FetchLocks>,
    ) -> (Range, Vec<Lead<'_>>) {
        let mut range = Range {
            pack: loc.pack as usize,
            start: loc.offset,
            end: loc.end(),
            objects: vec![(*digest, loc)],
        };
        let mut ahead = Vec::new();
        // In a layer, the files after this one come with its checkpoint's
        // bytes anyway: they are decoded and stored in the same pass.
        let sequential = !self.layers.is_empty()
            || self
                .last_end
                .lock()
                .unwrap()
                .is_some_and(|(p, end)| p == loc.pack && loc.offset >= end && loc.offset - end <= GAP);
        if !sequential {
            return (range, ahead);
        }
        // In a compressed layer, neighbours up to the next checkpoint only:
        // past it they would cost another span of the blob.
        let limit = match self.layers.get(loc.pack as usize) {
            Some((c, _)) => c.free_until(loc.end()).unwrap_or(u64::MAX),
            None => u64::MAX,
        };
        let at = self
            .by_offset
            .partition_point(|&(p, o, _)| (p, o) <= (loc.pack, loc.offset));
        for &(p, o, i) in &self.by_offset[at..] {
            let (d, l) = self.record.index.objects[i];
            if p != loc.pack
                || o == crate::lazy_index::WHOLE_LAYER
                || o < range.end
                || o - range.end > GAP
                || l.end() - range.start > loc.stored_len() + READ_AHEAD
                || l.end() > limit
                || range.objects.len() > READ_AHEAD_OBJECTS
            {
                break;
            }
            if self.store.has_object(&d) {
                continue;
            }
            let s = span(pack, l);
            if locks.is_some_and(|k| !k.try_lock(s)) {
                break;
            }
            let Some(lead) = self.flights.try_lead(&d) else {
                locks.inspect(|k| k.unlock(s));
                break;
            };
            ahead.push(lead);
            range.end = l.end();
            range.objects.push((d, l));
        }
        (range, ahead)
    }

    /// Brings `digest`, at `loc`, whose fetch this reader leads: waits
    /// for another process fetching it, if one is, then fetches it unless
    /// that one brought it.
    fn lead(&self, digest: &[u8; 32], loc: Location) -> Result<(), String> {
        if self.store.has_object(digest) {
            return Ok(());
        }
        let pack = self
            .record
            .pack(loc.pack)
            .ok_or_else(|| format!("the record names pack {} that it does not list", loc.pack))?;
        let coding = match self.layers.get(loc.pack as usize) {
            None if self.layers.is_empty() => None,
            None => return Err(format!("the record names layer {} that it does not list", loc.pack)),
            Some((c, whole))
                if loc.offset == crate::lazy_index::WHOLE_LAYER || !c.enterable_at(loc.offset, loc.size) =>
            {
                return self.whole_layer(digest, &pack, whole);
            }
            Some((c, _)) => Some(c),
        };
        let locks = FetchLocks::open(&self.store);
        if let Some(k) = &locks {
            // Past the deadline (a fetch elsewhere that hangs), fetched
            // here all the same.
            k.lock(span(&pack.digest, loc), Instant::now() + self.timeout());
            if self.store.has_object(digest) {
                return Ok(());
            }
        }
        let t = self.transport()?;
        let mut ingest = Ingest::for_fetched(&self.store).map_err(|e| e.to_string())?;
        ingest.commit_each();
        let (range, ahead) = self.range_for(digest, loc, &pack.digest, locks.as_ref());
        let deadline = Instant::now() + self.timeout();
        let fetched = fetch_range(
            t,
            &pack,
            coding,
            &range,
            &ingest,
            &PullProgress::default(),
            Some(deadline),
            None,
        );
        // Stored for good before the locks go and those waiting look.
        let committed = ingest.finish();
        drop(locks);
        *self.last_end.lock().unwrap() = Some((loc.pack, range.end));
        // Each object of the range is answered by whether it came (the
        // read-ahead is a bonus: only the one asked for must).
        let error = fetched
            .err()
            .map(|e| e.to_string())
            .or_else(|| committed.err().map(|e| e.to_string()));
        let came = |d: &[u8; 32]| match self.store.has_object(d) {
            true => Ok(()),
            false => Err(error.clone().unwrap_or_else(|| "the fetch ended before it".into())),
        };
        for a in ahead {
            let r = came(a.digest()).map_err(|e| self.failed(a.digest(), e));
            a.answer(r);
        }
        came(digest)
    }

    /// Brings `digest` by reading its layer `blob` whole (under `whole`, so
    /// the readers of its other files wait for that one read), storing
    /// every file of it.
    fn whole_layer(&self, digest: &[u8; 32], blob: &BlobRef, whole: &Mutex<()>) -> Result<(), String> {
        let _once = whole.lock().unwrap_or_else(|e| e.into_inner());
        if self.store.has_object(digest) {
            return Ok(());
        }
        let t = self.transport()?;
        let mut ingest = Ingest::for_fetched(&self.store).map_err(|e| e.to_string())?;
        ingest.commit_each();
        let read = crate::layer_fetch::fetch_whole(t, blob, &ingest);
        let committed = ingest.finish();
        read.map_err(|e| e.to_string())?;
        committed.map_err(|e| e.to_string())?;
        match self.store.has_object(digest) {
            true => Ok(()),
            false => Err(format!("layer {} holds no such file", blob.digest)),
        }
    }
}

impl ObjectSource for LazySource {
    fn warm(&self) {
        let _ = self.transport();
    }

    fn fetch(&self, digest: &[u8; 32], size: u64) -> Result<(), String> {
        let rel = Store::object_rel(digest);
        let loc = self
            .record
            .index
            .get(digest)
            .ok_or_else(|| format!("object {rel} is not in the image's object index"))?;
        // The record is the store's, and the store is not trusted.
        if loc.size != size {
            return Err(format!(
                "object {rel}: the record of where it lies says {} bytes, the image {size}",
                loc.size
            ));
        }
        match self.flights.join(digest) {
            Joined::Follow(flight) => flight.wait(),
            Joined::Lead(lead) => {
                let r = self.lead(digest, loc).map_err(|e| self.failed(digest, e));
                lead.answer(r.clone());
                r
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_of_versions_2_and_3_are_still_read() {
        let old_index = || OldIndex {
            objects: vec![([7; 32], (1, 10, 20))],
        };
        let old = RecordV2 {
            version: 2,
            source: "docker://r.example/a:v1".into(),
            manifest_digest: None,
            tls_verify: true,
            timeout_secs: 60,
            packs: vec![("sha256:00".into(), 5)],
            index: old_index(),
            trust: None,
        };
        let r = decode_record(&postcard::to_stdvec(&old).unwrap()).unwrap();
        assert_eq!((r.version, &r.packs, r.layers.len()), (RECORD_VERSION, &old.packs, 0));
        assert_eq!(r.index.get(&[7; 32]), Some(Location::raw(1, 10, 20)));
        let v3 = RecordV3 {
            version: 3,
            source: old.source.clone(),
            manifest_digest: None,
            tls_verify: true,
            timeout_secs: 60,
            packs: old.packs.clone(),
            index: old_index(),
            trust: None,
            layers: vec![LayerCoding::Plain],
            index_trust: None,
        };
        let r3 = decode_record(&postcard::to_stdvec(&v3).unwrap()).unwrap();
        assert_eq!(
            (r3.layers.len(), r3.index.get(&[7; 32])),
            (1, Some(Location::raw(1, 10, 20)))
        );
        let mut now = r.clone();
        now.packs = vec![("sha256:11".into(), 7)];
        now.layers = vec![LayerCoding::Plain];
        now.index.objects[0].1.stored = artifact::Stored::Zstd(3);
        let again = decode_record(&postcard::to_stdvec(&now).unwrap()).unwrap();
        assert_eq!((again.packs, again.layers.len()), (now.packs, 1));
        assert_eq!(again.index, now.index);
    }
}
