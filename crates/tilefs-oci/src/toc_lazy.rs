//! eStargz and zstd:chunked images pulled lazily as they are, from the
//! tables of contents their layers carry ([`tilefs_seekable::toc`]),
//! without a tilefs index.
//!
//! A table of contents gives each file's metadata, where its chunks lie
//! in the layer blob and the SHA-256 of each chunk and of the whole file;
//! the manifest's layer annotations give the table's own digest, checked
//! before anything in it is used. What it does not give is the fs-verity
//! digest composefs names objects by, which is known only once the bytes
//! are. So the pull writes an image whose files not yet in the store are
//! named by their SHA-256 ([`tilefs_store::alias`]: a redirect to
//! `.sha256/XX/…`, no verity digest), and a record ([`TocRecord`]) in
//! `STORE/.remote/<image>` that keeps the verified tables. On a file's
//! first read, [`TocSource`] fetches its chunks' byte ranges from the
//! ordinary layer blob, checks every chunk against its digest before
//! handing a byte on, and the whole file against its SHA-256, stores it
//! as an ordinary object and links the alias to it. A file whose alias
//! is already present (fetched for any eStargz or zstd:chunked image) is
//! not fetched: it is resolved to its object at pull time.
//!
//! Resolving instead of rewriting: the lazy image cannot name the right
//! objects before their bytes are here, and rewriting it under a live
//! mount is not possible; but a pull that finds every alias present
//! resolves each to its object (hashing it) and writes the very image an
//! ordinary `tilefs pull` makes (composefs-rs's rules, small files
//! inline), so `tilefs pull --lazy` again once all is read completes it.
//! The alternative, an index of fs-verity digests per SHA-256, would be a
//! second name for the same fact to keep in step; a hardlink is the fact.

use crate::apply::Applier;
use crate::fetch::LazySource;
use crate::flights::{Flights, Joined};
use crate::layer::{self, Content, Kind, LayerEntry, Meta};
use crate::manifest::BlobRef;
use crate::pull::{PullOptions, PullProgress, PullReport};
use crate::transport::registry::Registry;
use crate::transport::{Resolved, Transport};
use crate::{compat, ImageRef, OciError};
use serde::{Deserialize, Serialize};
use sha2::Digest as _;
use std::collections::{HashMap, HashSet};
use std::io::{self, Read};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tilefs_image::tree::{Timespec, RECOMMENDED_INLINE_MAX, S_IFBLK, S_IFCHR};
use tilefs_seekable::toc::{self, estargz, zstd_chunked, Annotated, Toc};
use tilefs_store::ingest::Ingest;
use tilefs_store::remote::{self, ObjectSource, REMOTE_DIR};
use tilefs_store::{alias, tags, Store};

/// What a record in `STORE/.remote` of an image pulled from tables of
/// contents starts with (the records of [`crate::fetch`] cannot: they
/// start with their version, a small number).
const RECORD_MAGIC: &[u8] = b"tilefs-toc-lazy\n";
const RECORD_VERSION: u32 = 1;
/// The largest chunk decoded (in memory): eStargz cuts files into 4 MiB
/// chunks, zstd:chunked into smaller ones.
const MAX_CHUNK: u64 = 256 << 20;
/// Most compressed bytes a chunk may span: its contents' cap with room for
/// what a compressor adds and the next entry's headers.
const MAX_COMPRESSED_CHUNK: u64 = MAX_CHUNK + (MAX_CHUNK >> 2);

/// Where the files of an image pulled from tables of contents are.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TocRecord {
    version: u32,
    /// The reference pulled (its transport and repository).
    pub source: String,
    pub manifest_digest: Option<String>,
    pub tls_verify: bool,
    pub timeout_secs: u64,
    /// How the pull passed the signature policy (checked again before the
    /// first fetch).
    pub trust: Option<crate::trust::TrustRecord>,
    /// Per layer of the image, in its manifest's order.
    pub layers: Vec<TocLayer>,
}

/// A layer and its table of contents, as the annotation vouched for it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TocLayer {
    pub digest: String,
    pub size: u64,
    pub table: Table,
}

/// A layer's table of contents: the bytes whose digest the layer's
/// annotation gives, and where they were (re-checked and parsed when read
/// back).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Table {
    Estargz {
        /// The JSON, and the digest the annotation gives it.
        json: Vec<u8>,
        digest: String,
        toc_offset: u64,
        /// The tar header of the table's own entry (`stargz.index.json`),
        /// a file of the layer as any other.
        header: Vec<u8>,
    },
    ZstdChunked {
        /// The compressed manifest, and the digest the annotation gives it.
        manifest: Vec<u8>,
        digest: String,
        offset: u64,
        uncompressed_len: u64,
    },
    /// An eStargz table whose JSON is in the store already, as the object
    /// of the layer's `stargz.index.json` (its image holds it): the
    /// record names it rather than keeping a second copy. (Last, so the
    /// records written before it still decode.)
    EstargzStored {
        /// The object (its fs-verity digest).
        object: [u8; 32],
        digest: String,
        toc_offset: u64,
        header: Vec<u8>,
    },
}

impl Table {
    /// Checks the bytes (read from `store` if there) against their digest
    /// again and parses them.
    fn parse(&self, store: Option<&Store>) -> Result<Toc, String> {
        let digest = |d: &str| tilefs_seekable::Digest::parse(d, "digest").map_err(|e| e.to_string());
        let estargz = |json: &[u8], d: &str, toc_offset: u64| {
            digest(d)?
                .verify(json, || "the eStargz table of contents".into())
                .map_err(|e| e.to_string())?;
            estargz::parse_json(json, toc_offset).map_err(|e| e.to_string())
        };
        match self {
            Table::Estargz {
                json,
                digest: d,
                toc_offset,
                ..
            } => estargz(json, d, *toc_offset),
            Table::EstargzStored {
                object,
                digest: d,
                toc_offset,
                ..
            } => {
                let path = Store::object_rel(object);
                let store = store.ok_or("the eStargz table of contents is in a store")?;
                let mut json = Vec::new();
                tilefs_store::open_regular(store.dir_fd(), Path::new(&path), false)
                    .and_then(|f| f.take(toc::MAX_TOC_JSON).read_to_end(&mut json))
                    .map_err(|e| format!("the eStargz table of contents, object {path} of the store: {e}"))?;
                estargz(&json, d, *toc_offset)
            }
            Table::ZstdChunked {
                manifest,
                digest: d,
                offset,
                uncompressed_len,
            } => {
                let position = zstd_chunked::Position {
                    offset: *offset,
                    compressed_len: manifest.len() as u64,
                    uncompressed_len: *uncompressed_len,
                };
                zstd_chunked::parse_manifest(manifest, &position, &digest(d)?).map_err(|e| e.to_string())
            }
        }
    }

    fn format(&self) -> &'static str {
        match self {
            Table::Estargz { .. } | Table::EstargzStored { .. } => "eStargz",
            Table::ZstdChunked { .. } => "zstd:chunked",
        }
    }
}

/// What [`pull_toc`] made of an image.
pub(crate) enum TocPull {
    Pulled(Box<PullReport>),
    /// Its layers carry no table of contents.
    NotToc,
    /// They do, but the tables cannot be used: why.
    Unusable(String),
}

/// A lazy image made from an image's tables of contents.
pub struct TocImage {
    /// The image's bytes and fs-verity digest.
    pub image: Vec<u8>,
    pub digest: [u8; 32],
    /// Its record: None when every file was in the store already (the
    /// image is then the one an ordinary pull makes).
    pub record: Option<TocRecord>,
    /// Files it names by alias (still to fetch).
    pub lazy_files: u64,
    pub entries: usize,
    pub format_version: u32,
    /// "eStargz", "zstd:chunked", or both joined by `+`.
    pub formats: String,
}

/// The image of the tables of contents of the first `layers` of
/// `resolved`'s layers (the image `source` names, as the signature policy
/// accepted it; all of them for `pull --lazy`, a chain's for the
/// snapshotter), in `store`: Ok(None) when its layers have none;
/// Ok(Err(why)) when they cannot be used. The caller holds the store's
/// lock shared from this call until the image is held (the objects it
/// found present are not referenced before), writes the record with
/// [`TocRecord::save`] under [`TocImage::digest`] and serves the image's
/// FUSE mount through [`open_source`].
pub fn toc_image(
    store: &Store,
    source: &ImageRef,
    resolved: &Resolved,
    opts: &PullOptions,
    progress: &PullProgress,
    layers: usize,
) -> Result<Option<Result<TocImage, String>>, OciError> {
    Ok(tables(source, resolved, opts, progress, &|_, _| false)?.map(|t| t?.image(store, layers, opts.keep_all_xattrs)))
}

/// An image's tables of contents, fetched and checked once: the
/// snapshotter makes the image of each chain of its layers from them.
pub struct TocTables {
    /// The tables read, in the image's layers' order.
    record: TocRecord,
    /// Shared with the sources made from them ([`TocTables::diff_source`]).
    tocs: Vec<Arc<Toc>>,
    /// Per layer of the image: where its table is in `record` and `tocs`
    /// (None: not read, the caller knowing it already), and the digest
    /// its annotation gives the table.
    at: Vec<(Option<usize>, String)>,
}

impl TocTables {
    /// The image of the first `layers` layers (1 ..= all), as
    /// [`toc_image`] makes it.
    pub fn image(&self, store: &Store, layers: usize, keep_all_xattrs: bool) -> Result<TocImage, String> {
        let read = self.at.iter().take(layers).all(|a| a.0.is_some());
        if layers == 0 || layers > self.at.len() || !read || self.tocs.len() != self.at.len() {
            return Err(format!("{} has no chain of {layers} layers", self.record.source));
        }
        let record = self.record.with_layers(self.record.layers[..layers].to_vec());
        image_of(store, record, &self.tocs[..layers], keep_all_xattrs, false)
    }

    /// The digest the annotation of layer `n` gives its table.
    pub fn table_digest(&self, n: usize) -> Option<&str> {
        self.at.get(n).map(|a| a.1.as_str())
    }

    /// Whether layer `n`'s table was read.
    pub fn is_read(&self, n: usize) -> bool {
        self.read(n).is_ok()
    }

    /// Where layer `n`'s table is, if it was read.
    fn read(&self, n: usize) -> Result<usize, String> {
        match self.at.get(n) {
            Some((Some(k), _)) => Ok(*k),
            _ => Err(format!("{} has no table read for layer {n}", self.record.source)),
        }
    }

    /// The image of layer `n`'s diff alone (its whiteouts and opaque
    /// directories kept, as [`crate::apply::Applier::apply_diff`] keeps
    /// them), for podman's layer store; its record names that layer only.
    pub fn diff_image(&self, store: &Store, n: usize) -> Result<TocImage, String> {
        let k = self.read(n)?;
        let (Some(layer), Some(toc)) = (self.record.layers.get(k), self.tocs.get(k)) else {
            return Err(format!("{} has no layer {n}", self.record.source));
        };
        let record = self.record.with_layers(vec![layer.clone()]);
        image_of(store, record, std::slice::from_ref(toc), true, true)
    }

    /// The source of the files of layer `n`'s diff image, whose record
    /// [`TocTables::diff_image`] made (`record`), from the tables parsed
    /// here: what [`open_source`] gives once the record is saved, without
    /// reading it back and checking and parsing its table again.
    pub fn diff_source(&self, store: &Store, n: usize, record: TocRecord) -> Result<Arc<dyn ObjectSource>, OciError> {
        let toc = self
            .read(n)
            .ok()
            .and_then(|k| self.tocs.get(k))
            .ok_or_else(|| OciError::Reference(format!("{} has no layer {n}", self.record.source)))?;
        let store = Store::open(store.path())?;
        Ok(Arc::new(TocSource::of(store, record, vec![toc.clone()])))
    }

    /// "eStargz", "zstd:chunked", or both joined by `+`.
    pub fn formats(&self) -> String {
        formats(&self.record.layers)
    }
}

/// The formats of these layers' tables: "eStargz", "zstd:chunked", or
/// both joined by `+`.
fn formats(layers: &[TocLayer]) -> String {
    let mut formats: Vec<&str> = Vec::new();
    for l in layers {
        if !formats.contains(&l.table.format()) {
            formats.push(l.table.format());
        }
    }
    formats.join("+")
}

impl TocRecord {
    /// This record with `layers` in place of its own.
    fn with_layers(&self, layers: Vec<TocLayer>) -> TocRecord {
        TocRecord {
            version: self.version,
            source: self.source.clone(),
            manifest_digest: self.manifest_digest.clone(),
            tls_verify: self.tls_verify,
            timeout_secs: self.timeout_secs,
            trust: self.trust.clone(),
            layers,
        }
    }
}

/// Tables of contents fetched at once.
const TABLE_JOBS: usize = 4;

/// A layer's table of contents, as [`read_table`] reads it.
type TableRead = Result<(TocLayer, Toc), OciError>;

/// The tables of contents of `resolved`'s layers, as [`toc_image`] reads
/// them (several at once), but those of the layers `known` (given their
/// digest and their table's) says the caller has made use of already.
pub fn tables(
    source: &ImageRef,
    resolved: &Resolved,
    opts: &PullOptions,
    progress: &PullProgress,
    known: &dyn Fn(&str, &str) -> bool,
) -> Result<Option<Result<TocTables, String>>, OciError> {
    let ImageRef::Registry { reference } = source else {
        return Ok(None);
    };
    let Some(manifest_digest) = &resolved.manifest_digest else {
        return Ok(None);
    };
    let reg = Registry::open(reference, &opts.registry)?;
    // The reference named the platform's manifest itself, or an index.
    let manifest = match manifest_digest.matches(&resolved.top_manifest) {
        true => resolved.top_manifest.clone(),
        false => reg.manifest_by_digest(manifest_digest)?,
    };
    let annotated = match annotations(&manifest, &resolved.layers) {
        Ok(a) if a.iter().all(Option::is_none) => return Ok(None),
        Ok(a) => a,
        Err(why) => return Ok(Some(Err(why))),
    };
    if let Some(l) = resolved.layers.iter().zip(&annotated).find(|(_, a)| a.is_none()) {
        return Ok(Some(Err(format!(
            "layer {} has no table of contents (neither eStargz nor zstd:chunked)",
            l.0.digest
        ))));
    }
    progress.stage.set("fetching the layers' tables of contents", true);
    let digests: Vec<String> = annotated
        .iter()
        .map(|a| match a {
            Some(Annotated::Estargz { toc_digest }) => format!("sha256:{}", hex::encode(toc_digest.0)),
            Some(Annotated::ZstdChunked { manifest_digest, .. }) => {
                format!("sha256:{}", hex::encode(manifest_digest.0))
            }
            None => String::new(),
        })
        .collect();
    let skip: Vec<bool> = resolved
        .layers
        .iter()
        .zip(&digests)
        .map(|(l, d)| known(&l.digest.to_string(), d))
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let read: Vec<std::sync::Mutex<Option<TableRead>>> = annotated.iter().map(|_| Default::default()).collect();
    std::thread::scope(|s| {
        for _ in 0..TABLE_JOBS.min(annotated.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let (Some(l), Some(Some(a))) = (resolved.layers.get(i), annotated.get(i)) else {
                    break;
                };
                if skip[i] {
                    continue;
                }
                *read[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(read_table(&reg, l, a));
            });
        }
    });
    let (mut layers, mut tocs) = (Vec::with_capacity(annotated.len()), Vec::with_capacity(annotated.len()));
    let mut at = Vec::with_capacity(annotated.len());
    // The first failure in the manifest's order.
    for (((l, r), skip), digest) in resolved.layers.iter().zip(read).zip(skip).zip(digests) {
        if skip {
            at.push((None, digest));
            continue;
        }
        match r.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok((layer, toc))) => {
                at.push((Some(layers.len()), digest));
                layers.push(layer);
                tocs.push(Arc::new(toc));
            }
            Some(Err(OciError::Interrupted)) | None => return Err(OciError::Interrupted),
            Some(Err(e)) => return Ok(Some(Err(format!("layer {}: {e}", l.digest)))),
        }
    }
    let record = TocRecord {
        version: RECORD_VERSION,
        source: source.to_string(),
        manifest_digest: Some(manifest_digest.to_string()),
        tls_verify: opts.registry.tls_verify,
        timeout_secs: opts.registry.timeout.as_secs(),
        trust: resolved.trust.clone(),
        layers,
    };
    progress.stage.set("writing the image of the tables of contents", false);
    Ok(Some(Ok(TocTables { record, tocs, at })))
}

/// Each layer's table of contents as its annotations announce it (None
/// for a layer without), from the image manifest (checked against its
/// digest by the caller), whose layers must be `layers`.
fn annotations(manifest: &[u8], layers: &[BlobRef]) -> Result<Vec<Option<Annotated>>, String> {
    let v: serde_json::Value = serde_json::from_slice(manifest).map_err(|e| format!("the image manifest: {e}"))?;
    let listed = v
        .get("layers")
        .and_then(|l| l.as_array())
        .ok_or("the image manifest lists no layers")?;
    if listed.len() != layers.len() {
        return Err("the image manifest's layers are not those resolved".into());
    }
    listed
        .iter()
        .zip(layers)
        .map(|(d, l)| {
            if d.get("digest").and_then(|d| d.as_str()) != Some(&l.digest.to_string()) {
                return Err("the image manifest's layers are not those resolved".into());
            }
            let size = l.size.ok_or_else(|| format!("layer {} has no size", l.digest))?;
            let ann = d.get("annotations");
            let get = |k: &str| ann.and_then(|a| a.get(k)).and_then(|v| v.as_str());
            toc::from_annotations(get, size).map_err(|e| format!("layer {}: {e}", l.digest))
        })
        .collect()
}

/// Fetches a layer's table of contents, checks it against the digest its
/// annotation gives and parses it.
fn read_table(reg: &Registry, blob: &BlobRef, a: &Annotated) -> Result<(TocLayer, Toc), OciError> {
    let size = blob.size.unwrap_or(0);
    let bad = |e: tilefs_seekable::Error| OciError::blob(&blob.digest.to_string(), e.to_string());
    let get = |r: std::ops::Range<u64>| -> Result<Vec<u8>, OciError> {
        let mut out = Vec::new();
        reg.open_range(blob, r.start, r.end - r.start)?
            .take(r.end - r.start)
            .read_to_end(&mut out)
            .map_err(|e| OciError::blob(&blob.digest.to_string(), e.to_string()))?;
        if out.len() as u64 != r.end - r.start {
            return Err(OciError::blob(&blob.digest.to_string(), "a range answer ended early"));
        }
        Ok(out)
    };
    let table = match a {
        Annotated::Estargz { toc_digest } => {
            let footer = estargz::parse_footer(&get(estargz::footer_range(size).map_err(bad)?)?, size).map_err(bad)?;
            let range = footer.toc_range(size);
            if range.end - range.start > toc::MAX_TOC_JSON {
                return Err(OciError::blob(
                    &blob.digest.to_string(),
                    "the eStargz table of contents is too large",
                ));
            }
            let (json, header) = estargz::toc_entry(&get(range.clone())?, range.start).map_err(bad)?;
            Table::Estargz {
                json,
                digest: format!("sha256:{}", hex::encode(toc_digest.0)),
                toc_offset: footer.toc_offset,
                header,
            }
        }
        Annotated::ZstdChunked {
            manifest,
            manifest_digest,
            ..
        } => Table::ZstdChunked {
            manifest: get(manifest.range())?,
            digest: format!("sha256:{}", hex::encode(manifest_digest.0)),
            offset: manifest.offset,
            uncompressed_len: manifest.uncompressed_len,
        },
    };
    let toc = table
        .parse(None)
        .map_err(|e| OciError::blob(&blob.digest.to_string(), e))?;
    let layer = TocLayer {
        digest: blob.digest.to_string(),
        size,
        table,
    };
    Ok((layer, toc))
}

/// A file's contents as the image gets them.
enum Got {
    Inline(Vec<u8>),
    /// Present: its object.
    Object([u8; 32]),
    /// Absent: its SHA-256, named by alias.
    Alias([u8; 32]),
}

/// The image of `record`'s tables (`tocs`, parsed): files present
/// resolved to their objects, the others named by alias.
/// (`diff`: the one layer's diff, not the layers applied.)
fn image_of(
    store: &Store,
    mut record: TocRecord,
    tocs: &[Arc<Toc>],
    keep_all_xattrs: bool,
    diff: bool,
) -> Result<TocImage, String> {
    let mut applier = Applier::new(keep_all_xattrs);
    let mut resolved: HashMap<[u8; 32], Option<[u8; 32]>> = HashMap::new();
    let mut aliased: HashSet<[u8; 32]> = HashSet::new();
    // Each layer's table's object, where its JSON went to the store.
    let mut stored: Vec<Option<[u8; 32]>> = vec![None; record.layers.len()];
    for ((l, toc), stored) in record.layers.iter().zip(tocs).zip(&mut stored) {
        let mut entries = Vec::with_capacity(toc.entries.len() + 1);
        for e in &toc.entries {
            let got = |f: &toc::File| {
                let got = contents(store, f, &mut resolved)?;
                if let Got::Alias(d) = got {
                    aliased.insert(d);
                }
                Ok(got)
            };
            let fail = |why: String| format!("layer {}: {:?}: {why}", l.digest, e.path);
            entries.extend(entry(e, got).map_err(fail)?);
        }
        if let Table::Estargz { json, header, .. } = &l.table {
            let file = toc_file(store, json, header).map_err(|e| format!("layer {}: {e}", l.digest))?;
            if let Kind::File {
                content: Content::Object(object),
                ..
            } = &file.kind
            {
                *stored = Some(*object);
            }
            entries.push(file);
        }
        if diff {
            applier.apply_diff(&l.digest, entries).map_err(|e| e.to_string())?;
        } else {
            applier.apply_layer(&l.digest, entries).map_err(|e| e.to_string())?;
        }
    }
    if !diff {
        compat::normalize(applier.tree_mut());
    }
    let mut tree = applier.finish();
    // A table whose JSON is an object the image holds (an upper layer's
    // `stargz.index.json` may hide a lower one's) is named in the record,
    // not kept there a second time.
    let held: HashSet<[u8; 32]> = tree.inodes.iter().filter_map(|i| i.digest).collect();
    for (l, object) in record.layers.iter_mut().zip(stored) {
        if let (
            Table::Estargz {
                digest,
                toc_offset,
                header,
                ..
            },
            Some(object),
        ) = (&mut l.table, object.filter(|o| held.contains(o)))
        {
            l.table = Table::EstargzStored {
                object,
                digest: std::mem::take(digest),
                toc_offset: *toc_offset,
                header: std::mem::take(header),
            };
        }
    }
    // Files not here yet: named by alias, with no fs-verity digest to
    // check (their bytes are checked against the table when fetched).
    // Those of lower layers that upper ones removed are not counted.
    let mut lazy_files = HashSet::new();
    for i in tree.inodes.iter_mut() {
        if let Some(d) = i.digest.filter(|d| aliased.contains(d)) {
            i.payload = Some(alias::alias_rel(&d).into_bytes());
            i.digest = None;
            lazy_files.insert(d);
        }
    }
    let image = tilefs_image::erofs::write_image(
        &tree,
        &tilefs_image::erofs::WriteOptions {
            min_version: compat::FORMAT_VERSION,
            max_version: compat::FORMAT_VERSION,
        },
    )
    .map_err(|e| format!("the image of the tables of contents cannot be written: {e}"))?;
    Ok(TocImage {
        digest: image.digest,
        entries: tree.inodes.len(),
        format_version: image.version,
        lazy_files: lazy_files.len() as u64,
        formats: formats(&record.layers),
        record: (!lazy_files.is_empty()).then_some(record),
        image: image.bytes,
    })
}

/// A regular file's contents: empty, or present by its alias (inline if
/// small, else its object, whose fs-verity digest is computed once per
/// pull), or to fetch.
fn contents(store: &Store, f: &toc::File, resolved: &mut HashMap<[u8; 32], Option<[u8; 32]>>) -> Result<Got, String> {
    if f.size == 0 {
        return Ok(Got::Inline(Vec::new()));
    }
    let sha = sha256_of(f)?;
    if alias::size(store, &sha) != Some(f.size) {
        return Ok(Got::Alias(sha));
    }
    let file = alias::open(store, &sha).map_err(|e| format!("{}: {e}", alias::alias_rel(&sha)))?;
    if f.size <= RECOMMENDED_INLINE_MAX {
        let mut data = Vec::new();
        (&file)
            .take(f.size + 1)
            .read_to_end(&mut data)
            .map_err(|e| format!("{}: {e}", alias::alias_rel(&sha)))?;
        return match data.len() as u64 == f.size {
            true => Ok(Got::Inline(data)),
            false => Ok(Got::Alias(sha)),
        };
    }
    if let Some(v) = resolved.get(&sha) {
        return Ok(v.map_or(Got::Alias(sha), Got::Object));
    }
    let verity =
        tilefs_image::verity::digest_file(&file, |_| {}).map_err(|e| format!("{}: {e}", alias::alias_rel(&sha)))?;
    let v = alias::restore_object(store, &sha, &verity).ok().map(|()| verity);
    resolved.insert(sha, v);
    Ok(v.map_or(Got::Alias(sha), Got::Object))
}

/// A table's entries as layer entries, every file named by its SHA-256
/// (as a pull into an empty store names them); what the fuzz target
/// `oci_toc_lazy` applies.
pub fn entries_of(toc: &Toc) -> Result<Vec<LayerEntry>, String> {
    let mut out = Vec::with_capacity(toc.entries.len());
    for e in &toc.entries {
        let got = |f: &toc::File| match f.size {
            0 => Ok(Got::Inline(Vec::new())),
            _ => sha256_of(f).map(Got::Alias),
        };
        out.extend(entry(e, got).map_err(|why| format!("{:?}: {why}", e.path))?);
    }
    Ok(out)
}

/// The SHA-256 of a file's contents, as its table gives it.
fn sha256_of(f: &toc::File) -> Result<[u8; 32], String> {
    match (f.digest, f.chunks.as_slice()) {
        (Some(d), _) => Ok(d.0),
        (None, [one]) => Ok(one.digest.0),
        (None, _) => Err("a file in several chunks without the digest of its whole contents".into()),
    }
}

/// A table's entry as a layer entry (None for bookkeeping a runtime
/// skips).
fn entry(
    e: &toc::Entry,
    mut contents: impl FnMut(&toc::File) -> Result<Got, String>,
) -> Result<Option<LayerEntry>, String> {
    let path = match e.path.is_empty() {
        true => Vec::new(),
        false => layer::split_path(e.path.as_bytes()).map_err(str::to_string)?,
    };
    let meta = Meta {
        perm: e.mode & 0o7777,
        uid: e.uid,
        gid: e.gid,
        mtime: e.mtime.map_or(Timespec { sec: 0, nsec: 0 }, |t| Timespec {
            sec: t.secs,
            nsec: t.nanos,
        }),
        xattrs: e
            .xattrs
            .iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.clone()))
            .collect(),
    };
    match layer::marker(&path)? {
        layer::Marker::No => {}
        layer::Marker::Skip => return Ok(None),
        layer::Marker::Is(kind, path) => return Ok(Some(LayerEntry { path, kind, meta })),
    }
    layer::check_path(&path, matches!(e.kind, toc::Kind::Dir), "its path")?;
    let kind = match &e.kind {
        toc::Kind::Dir => Kind::Dir,
        toc::Kind::File(f) => Kind::File {
            size: f.size,
            content: match contents(f)? {
                Got::Inline(v) => Content::Inline(v),
                // An alias stands as an object until the image is written.
                Got::Object(d) | Got::Alias(d) => Content::Object(d),
            },
        },
        toc::Kind::Symlink { target } => Kind::Symlink(target.as_bytes().to_vec()),
        toc::Kind::Hardlink { target } => Kind::Hardlink(layer::split_path(target.as_bytes()).map_err(str::to_string)?),
        toc::Kind::CharDevice { major, minor } => Kind::Device {
            mode_type: S_IFCHR,
            rdev: rustix::fs::makedev(*major, *minor) as u32,
        },
        toc::Kind::BlockDevice { major, minor } => Kind::Device {
            mode_type: S_IFBLK,
            rdev: rustix::fs::makedev(*major, *minor) as u32,
        },
        toc::Kind::Fifo => Kind::Fifo,
    };
    Ok(Some(LayerEntry { path, kind, meta }))
}

/// eStargz's `stargz.index.json`: the last file of the layer's tar stream,
/// which an ordinary pull keeps; its bytes are the table, here already.
fn toc_file(store: &Store, json: &[u8], header: &[u8]) -> Result<LayerEntry, String> {
    let h = tar::Header::from_byte_slice(header);
    let bad = |e: io::Error| format!("the eStargz table's tar header: {e}");
    let size = json.len() as u64;
    let content = match size <= RECOMMENDED_INLINE_MAX {
        true => Content::Inline(json.to_vec()),
        false => {
            let ingest = Ingest::for_fetched(store).map_err(|e| e.to_string())?;
            let d = ingest.import_bytes(json.to_vec()).map_err(|e| e.to_string())?;
            ingest.finish().map_err(|e| e.to_string())?;
            Content::Object(d)
        }
    };
    Ok(LayerEntry {
        path: vec![estargz::TOC_TAR_NAME.as_bytes().to_vec()],
        kind: Kind::File { size, content },
        meta: Meta {
            perm: h.mode().map_err(bad)? & 0o7777,
            uid: h.uid().map_err(bad)? as u32,
            gid: h.gid().map_err(bad)? as u32,
            mtime: Timespec {
                sec: h.mtime().map_err(bad)? as i64,
                nsec: 0,
            },
            xattrs: Vec::new(),
        },
    })
}

/// `pull --lazy` of an image without a tilefs index: from its layers'
/// tables of contents, if they all have one.
pub(crate) fn pull_toc(
    store: &Store,
    source: &ImageRef,
    resolved: &Resolved,
    tag: &str,
    opts: &PullOptions,
    progress: &PullProgress,
) -> Result<TocPull, OciError> {
    // Held shared (as builds hold it) until the tag is written: a gc
    // meanwhile would take the objects found present for unreferenced.
    let _lock = store.lock(tilefs_store::LockMode::Shared, true)?;
    let made = match toc_image(store, source, resolved, opts, progress, resolved.layers.len()) {
        Ok(Some(Ok(m))) => m,
        Ok(None) => return Ok(TocPull::NotToc),
        Ok(Some(Err(why))) => return Ok(TocPull::Unusable(why)),
        Err(OciError::Interrupted) => return Err(OciError::Interrupted),
        Err(e) => return Ok(TocPull::Unusable(e.to_string())),
    };
    match &made.record {
        Some(r) => r.save(store, &made.digest)?,
        None => remote::forget(store, &made.digest)?,
    }
    crate::trust::save_evidence(store, &made.digest, resolved)?;
    tags::write_tag(store, tag, &made.image)?;
    Ok(TocPull::Pulled(Box::new(PullReport {
        tag: tag.to_string(),
        digest: hex::encode(made.digest),
        image_bytes: made.image.len(),
        format_version: made.format_version,
        manifest_digest: resolved.manifest_digest.as_ref().map(|d| d.to_string()),
        layers: resolved.layers.len(),
        blob_bytes: 0,
        entries: made.entries,
        objects: Default::default(),
        notes: vec![format!(
            "lazily from the layers' {} tables of contents (no tilefs index)",
            made.formats
        )],
        lazy_objects: made.lazy_files,
        lazy_index: None,
        lazy_fallback: None,
    })))
}

impl TocRecord {
    /// Writes the record of `image` (its fs-verity digest) in `store`.
    pub fn save(&self, store: &Store, image: &[u8; 32]) -> Result<(), OciError> {
        let mut bytes = RECORD_MAGIC.to_vec();
        bytes.extend(postcard::to_stdvec(self).map_err(|e| OciError::Reference(format!("cannot encode: {e}")))?);
        crate::layer_cache::write_record_in(store, REMOTE_DIR, &hex::encode(image), &bytes).map_err(|e| {
            OciError::io(
                &remote::record_path(store, image),
                "cannot record where the files are",
                e,
            )
        })
    }

    /// The record of `image` if it is one of these (None for none, or a
    /// record of [`crate::fetch`]), and if it may say where this user's
    /// credentials go.
    pub fn load(store: &Store, image: &[u8; 32]) -> Result<Option<TocRecord>, OciError> {
        if !remote::is_lazy(store, image) {
            return Ok(None);
        }
        let path = remote::record_path(store, image);
        let mut f = crate::layer_cache::open_record_in(store, REMOTE_DIR, &hex::encode(image))
            .map_err(|e| OciError::io(&path, "cannot read", e))?;
        let mut raw = Vec::new();
        f.read_to_end(&mut raw)
            .map_err(|e| OciError::io(&path, "cannot read", e))?;
        let Some(body) = raw.strip_prefix(RECORD_MAGIC) else {
            return Ok(None);
        };
        if let Some(why) = crate::fetch::untrusted(store, &f) {
            return Err(OciError::io(
                &path,
                "refusing this lazy-pull record",
                io::Error::other(format!("{why}: pull the image again into a store of yours")),
            ));
        }
        let r: TocRecord = postcard::from_bytes(body)
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
}

/// The source of a lazily pulled image's objects, whichever way it was
/// pulled (from tables of contents, through a tilefs index, or a tilefs
/// artifact); None when it lacks nothing.
pub fn open_source(store: &Path, image: &[u8; 32]) -> Result<Option<Arc<dyn ObjectSource>>, OciError> {
    if let Some(s) = TocSource::open(store, image)? {
        return Ok(Some(Arc::new(s)));
    }
    Ok(LazySource::open(store, image)?.map(|s| Arc::new(s) as Arc<dyn ObjectSource>))
}

/// [`open_source`], its record read (and its tables parsed) at the first
/// fetch rather than now: podman's layer store serves layers kept or made
/// already at its lookups, most of whose files are never read.
pub fn open_source_later(store: &Path, image: &[u8; 32]) -> Result<Option<Arc<dyn ObjectSource>>, OciError> {
    if !remote::is_lazy(&Store::open(store)?, image) {
        return Ok(None);
    }
    Ok(Some(Arc::new(Later {
        store: store.to_path_buf(),
        image: *image,
        source: OnceLock::new(),
    })))
}

/// A source opened at its first use.
struct Later {
    store: std::path::PathBuf,
    image: [u8; 32],
    source: OnceLock<Result<Option<Arc<dyn ObjectSource>>, String>>,
}

impl ObjectSource for Later {
    fn fetch(&self, digest: &[u8; 32], size: u64) -> Result<(), String> {
        let source = self
            .source
            .get_or_init(|| open_source(&self.store, &self.image).map_err(|e| e.to_string()));
        match source {
            Ok(Some(s)) => s.fetch(digest, size),
            // Completed meanwhile: every file is in the store.
            Ok(None) => Ok(()),
            Err(e) => Err(e.clone()),
        }
    }
}

/// Fetches the files of an image pulled from tables of contents as a FUSE
/// mount first reads them, by the SHA-256 its image names them by.
pub struct TocSource {
    store: Store,
    record: TocRecord,
    tocs: Vec<Arc<Toc>>,
    /// Each SHA-256 the tables list: (layer, entry) of a file with it.
    files: HashMap<[u8; 32], (usize, usize)>,
    transport: OnceLock<Box<dyn Transport>>,
    flights: Flights,
}

impl TocSource {
    /// The source of `image`, if it was pulled from tables of contents and
    /// lacks files still.
    pub fn open(store: &Path, image: &[u8; 32]) -> Result<Option<TocSource>, OciError> {
        let store = Store::open(store)?;
        let Some(record) = TocRecord::load(&store, image)? else {
            return Ok(None);
        };
        let path = remote::record_path(&store, image);
        let mut tocs = Vec::with_capacity(record.layers.len());
        for (i, l) in record.layers.iter().enumerate() {
            let toc = l
                .table
                .parse(Some(&store))
                .map_err(|e| OciError::io(&path, "a lazy-pull record", io::Error::other(format!("layer {i}: {e}"))))?;
            tocs.push(Arc::new(toc));
        }
        Ok(Some(TocSource::of(store, record, tocs)))
    }

    /// The source of `record`'s files, its tables parsed (`tocs`).
    fn of(store: Store, record: TocRecord, tocs: Vec<Arc<Toc>>) -> TocSource {
        let mut files = HashMap::new();
        for (i, toc) in tocs.iter().enumerate() {
            for (k, e) in toc.entries.iter().enumerate() {
                if let toc::Kind::File(f) = &e.kind {
                    if let Ok(d) = sha256_of(f) {
                        files.entry(d).or_insert((i, k));
                    }
                }
            }
        }
        TocSource {
            store,
            record,
            tocs,
            files,
            transport: OnceLock::new(),
            flights: Flights::default(),
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(self.record.timeout_secs.clamp(1, 3600))
    }

    /// The transport, started on the first fetch (after the signature
    /// policy accepts the image again).
    fn transport(&self) -> Result<&dyn Transport, String> {
        if let Some(t) = self.transport.get() {
            return Ok(t.as_ref());
        }
        let t = crate::fetch::open_transport(
            &self.record.source,
            self.record.tls_verify,
            self.timeout(),
            self.record.trust.as_ref(),
            None,
        )?;
        Ok(self.transport.get_or_init(|| t).as_ref())
    }

    /// Fetches the file `sha` (layer `l`, entry `k`), checks it and stores
    /// it, its alias linked.
    fn bring(&self, sha: &[u8; 32], l: usize, k: usize) -> Result<(), String> {
        let toc = &self.tocs[l];
        let layer = &self.record.layers[l];
        let e = &toc.entries[k];
        let toc::Kind::File(f) = &e.kind else {
            unreachable!("only files are listed")
        };
        let blob = BlobRef {
            digest: crate::digest::Digest::parse(&layer.digest).map_err(|e| e.to_string())?,
            size: Some(layer.size),
            media_type: String::new(),
            member: None,
        };
        let fetched: Vec<&toc::Chunk> = f.chunks.iter().filter(|c| !c.zeros).collect();
        let reader: Box<dyn Read + Send + '_> = match (fetched.first(), fetched.last()) {
            (Some(a), Some(z)) => {
                let (start, end) = (a.compressed.start, z.compressed.end);
                self.transport()?
                    .open_range(&blob, start, end - start)
                    .map_err(|e| e.to_string())?
            }
            _ => Box::new(io::empty()),
        };
        let mut chunks = Chunks {
            toc,
            chunks: &f.chunks,
            next: 0,
            reader,
            pos: fetched.first().map_or(0, |c| c.compressed.start),
            buf: Vec::new(),
            at: 0,
            hash: sha2::Sha256::new(),
            want: *sha,
        };
        let what = format!("{} (layer {}, {:?})", alias::alias_rel(sha), layer.digest, e.path);
        // Held until the alias is linked: a gc meanwhile would take the
        // new object for unreferenced.
        let _lock = self
            .store
            .lock(tilefs_store::LockMode::Shared, true)
            .map_err(|e| e.to_string())?;
        let mut ingest = Ingest::for_fetched(&self.store).map_err(|e| e.to_string())?;
        ingest.commit_each();
        let imported = ingest.import_reader(Path::new(&what), f.size, &mut chunks);
        let committed = ingest.finish();
        let verity = imported.map_err(|e| e.to_string())?;
        committed.map_err(|e| e.to_string())?;
        alias::link(&self.store, sha, &verity).map_err(|e| e.to_string())
    }
}

impl ObjectSource for TocSource {
    fn warm(&self) {
        let _ = self.transport();
    }

    fn fetch(&self, sha: &[u8; 32], size: u64) -> Result<(), String> {
        let rel = alias::alias_rel(sha);
        if alias::size(&self.store, sha) == Some(size) {
            return Ok(());
        }
        let &(l, k) = self
            .files
            .get(sha)
            .ok_or_else(|| format!("{rel}: no table of contents of the image lists it"))?;
        let listed = match &self.tocs[l].entries[k].kind {
            toc::Kind::File(f) => f.size,
            _ => 0,
        };
        if listed != size {
            return Err(format!(
                "{rel}: the table of contents says {listed} bytes, the image {size}"
            ));
        }
        match self.flights.join(sha) {
            Joined::Follow(flight) => flight.wait(),
            Joined::Lead(lead) => {
                let r = self.bring(sha, l, k).map_err(|e| {
                    let origin = self
                        .transport
                        .get()
                        .map(|t| t.origin())
                        .unwrap_or_else(|| self.record.source.clone());
                    format!("{rel}: fetch from {origin} failed: {e}")
                });
                lead.answer(r.clone());
                r
            }
        }
    }
}

/// A file's bytes out of its chunks, fetched in one range: each chunk is
/// decoded and checked against its digest before any byte of it is read
/// out, and the last one only once the whole file has its SHA-256.
struct Chunks<'a> {
    toc: &'a Toc,
    chunks: &'a [toc::Chunk],
    next: usize,
    reader: Box<dyn Read + Send + 'a>,
    /// The blob offset `reader` is at.
    pos: u64,
    buf: Vec<u8>,
    at: usize,
    hash: sha2::Sha256,
    want: [u8; 32],
}

impl Chunks<'_> {
    fn load(&mut self) -> io::Result<()> {
        let c = &self.chunks[self.next];
        let bad = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
        if c.size > MAX_CHUNK {
            return Err(bad(format!("a chunk of {} bytes, over {MAX_CHUNK}", c.size)));
        }
        let mut out = vec![0u8; c.size as usize];
        if c.zeros {
            self.toc.read_chunk(c, &[], &mut out).map_err(|e| bad(e.to_string()))?;
        } else {
            if c.compressed.start < self.pos {
                return Err(bad(format!("chunks out of order at blob byte {}", c.compressed.start)));
            }
            io::copy(
                &mut (&mut self.reader).take(c.compressed.start - self.pos),
                &mut io::sink(),
            )?;
            let len = c.compressed.end - c.compressed.start;
            // A chunk's compressed range runs to the next one the table
            // lists: a lying table could make it the whole blob, held here.
            if len > MAX_COMPRESSED_CHUNK {
                return Err(bad(format!(
                    "a chunk of {} compressed bytes at blob byte {}, over {MAX_COMPRESSED_CHUNK}",
                    len, c.compressed.start
                )));
            }
            let mut fetched = Vec::with_capacity(len as usize);
            (&mut self.reader).take(len).read_to_end(&mut fetched)?;
            if fetched.len() as u64 != len {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the range answer ended early",
                ));
            }
            self.pos = c.compressed.end;
            self.toc
                .read_chunk(c, &fetched, &mut out)
                .map_err(|e| bad(e.to_string()))?;
        }
        self.hash.update(&out);
        self.next += 1;
        if self.next == self.chunks.len() {
            let got: [u8; 32] = self.hash.clone().finalize().into();
            if got != self.want {
                return Err(bad(format!(
                    "its chunks make contents of SHA-256 {}, not the {} the table gives the file",
                    hex::encode(got),
                    hex::encode(self.want)
                )));
            }
        }
        self.buf = out;
        self.at = 0;
        Ok(())
    }
}

impl Read for Chunks<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.at == self.buf.len() {
            if self.next == self.chunks.len() {
                return Ok(0);
            }
            self.load()?;
        }
        let n = out.len().min(self.buf.len() - self.at);
        out[..n].copy_from_slice(&self.buf[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}
