//! Indexes of ordinary OCI images (`tilefs index`): what a lazy mount of
//! an image of gzip, zstd or uncompressed layers needs, pushed beside the
//! image as an artifact that refers to it ([`crate::referrers`]), so that
//! the image itself starts lazily, unconverted.
//!
//! # The artifact
//!
//! An OCI image manifest of `artifactType` [`ARTIFACT_TYPE`] whose
//! `subject` is the image's (platform) manifest:
//!
//! - config ([`CONFIG_TYPE`]): [`IndexConfig`], JSON: format version, the
//!   fs-verity digest of the flattened image, and per layer of the image
//!   (in its manifest's order) the layer's digest, media type and size and
//!   the digest of its layer map;
//! - first the flattened composefs image, exactly the bytes `tilefs pull`
//!   makes of the image (composefs-rs's xattr rules): in format 2, as its
//!   tree in chunks ([`TREE_TYPE`], [`crate::artifact_tree`]'s chunks with
//!   no objects placed: the maps place them), cut where the paths say, so
//!   that the index of a new version of the image shares all chunks but
//!   those around its changes and a re-index uploads only those; the
//!   image rebuilt from them must have the digest the configuration
//!   records. In format 1 (still read), one blob ([`IMAGE_TYPE`]), zstd;
//! - then one layer map per distinct layer ([`MAP_TYPE`]): zstd of a
//!   postcard record ([`LayerMap`]): the layer's entries in the form and
//!   order [`crate::apply`] takes them (so the image of any prefix of the
//!   layers can be made locally, as the snapshotter needs for each chain),
//!   each regular file's [`Placement`] in the layer's uncompressed tar
//!   stream, and the layer's seek index ([`tilefs_seekable::format`]; none
//!   for an uncompressed layer, whose offsets are the blob's).
//!
//! Nothing in an index is trusted for contents: every object read through
//! it is checked against the fs-verity digest the image names before a
//! byte is served (an index that lies makes reads fail, never wrong). The
//! signature policy judges the index's manifest as it judges the image's
//! (same scope): a policy that wants the image signed wants its index
//! signed too, since the image blob in it is what gets mounted.

use crate::apply::Applier;
use crate::artifact::{self, Location, ObjectIndex, ObjectRef};
use crate::digest::Digest;
use crate::layer::{self, Content, Kind, LayerEntry, Placement};
use crate::manifest::{BlobRef, OCI_MANIFEST};
use crate::pull::{PullOptions, PullProgress};
use crate::referrers::{self, Listed};
use crate::transport::registry::Registry;
use crate::transport::Resolved;
use crate::{compat, ImageRef, OciError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::Read;
use tilefs_image::tree::{MAX_PAYLOAD_LEN, RECOMMENDED_INLINE_MAX, S_IFBLK, S_IFCHR};
use tilefs_seekable::SeekIndex;
use tilefs_store::ingest::{Ingest, Method};
use tilefs_store::Store;

pub const ARTIFACT_TYPE: &str = "application/vnd.tilefs.index.v1";
pub const CONFIG_TYPE: &str = "application/vnd.tilefs.index.config.v1+json";
pub const IMAGE_TYPE: &str = "application/vnd.tilefs.index.erofs.v1+zstd";
/// A chunk of the image's tree (format 2).
pub const TREE_TYPE: &str = "application/vnd.tilefs.index.tree.v1+zstd";
pub const MAP_TYPE: &str = "application/vnd.tilefs.index.layer-map.v1+zstd";
/// The format version of the configuration and the layer maps.
/// The format written: 2, the image in tree chunks; 1, the image whole.
pub const VERSION: u32 = 2;
/// Largest configuration, and layer map (uncompressed), accepted.
pub const MAX_CONFIG: u64 = 4 << 20;
pub const MAX_MAP: u64 = 1 << 30;
/// The offset of an object a lazy record places in a layer that must be
/// read whole to get it (a sparse file).
pub const WHOLE_LAYER: u64 = u64::MAX;
/// zstd level of the image and the maps: measured on a tar of /usr, 19
/// gives a few percent less than 9 at several times the time.
const LEVEL: i32 = 12;

/// The index's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexConfig {
    pub version: u32,
    /// The flattened image's fs-verity digest, hex.
    pub fsverity: String,
    pub layers: Vec<IndexedLayer>,
}

/// One layer of the image, and its map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct IndexedLayer {
    pub digest: String,
    pub media_type: String,
    pub size: u64,
    /// The digest of its layer map blob.
    pub map: String,
}

/// One layer's map: its entries, where each file lies in its tar stream,
/// and its seek index.
#[derive(Debug, Clone)]
pub struct LayerMap {
    pub entries: Vec<LayerEntry>,
    /// As long as `entries`: [`Placement::At`] or [`Placement::WholeLayer`]
    /// for each file whose contents are an object, [`Placement::None`] for
    /// every other entry.
    pub placements: Vec<Placement>,
    /// None: the layer is not compressed.
    pub seek: Option<SeekIndex>,
}

/// The serialized map (postcard).
#[derive(Serialize, Deserialize)]
struct MapFile {
    version: u32,
    entries: Vec<LayerEntry>,
    placements: Vec<Placement>,
    seek: Option<Vec<u8>>,
}

fn zstd_bounded(bytes: &[u8], limit: u64, what: &str) -> Result<Vec<u8>, String> {
    let d = zstd::stream::Decoder::new(bytes).map_err(|e| format!("{what}: zstd: {e}"))?;
    let mut out = Vec::new();
    d.take(limit + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("{what}: zstd: {e}"))?;
    if out.len() as u64 > limit {
        return Err(format!(
            "{what}: more than {} uncompressed",
            crate::bounded::size(limit)
        ));
    }
    Ok(out)
}

impl LayerMap {
    /// The blob: zstd of the postcard record.
    pub fn encode(&self) -> Vec<u8> {
        let file = MapFile {
            version: VERSION,
            entries: self.entries.clone(),
            placements: self.placements.clone(),
            seek: self.seek.as_ref().map(SeekIndex::encode),
        };
        let raw = postcard::to_stdvec(&file).expect("a map serializes");
        zstd::bulk::compress(&raw, LEVEL).expect("zstd compresses in memory")
    }

    /// Decodes and checks the map blob of a layer of `layer_size` bytes:
    /// every entry one a layer could give ([`crate::layer`]'s rules for
    /// names and links; contents inline up to the inline limit, objects
    /// past it), placements only for objects and within the stream, a seek
    /// index of that very blob.
    pub fn decode(blob: &[u8], layer_size: u64) -> Result<LayerMap, String> {
        let raw = zstd_bounded(blob, MAX_MAP, "layer map")?;
        let file: MapFile = postcard::from_bytes(&raw).map_err(|e| format!("not a tilefs layer map: {e}"))?;
        if file.version != VERSION {
            return Err(format!(
                "layer map version {} (this tilefs reads {VERSION})",
                file.version
            ));
        }
        if file.placements.len() != file.entries.len() {
            return Err(format!(
                "{} placements for {} entries",
                file.placements.len(),
                file.entries.len()
            ));
        }
        let seek = match &file.seek {
            Some(b) => {
                let s = SeekIndex::decode(b).map_err(|e| format!("its seek index: {e}"))?;
                if s.compressed_size() != layer_size {
                    return Err(format!(
                        "its seek index is of a blob of {} bytes, the layer has {layer_size}",
                        s.compressed_size()
                    ));
                }
                Some(s)
            }
            None => None,
        };
        let stream = seek.as_ref().map_or(layer_size, SeekIndex::uncompressed_size);
        for (e, p) in file.entries.iter().zip(&file.placements) {
            check_entry(e, *p, stream).map_err(|r| format!("entry {}: {r}", e.display_path()))?;
        }
        Ok(LayerMap {
            entries: file.entries,
            placements: file.placements,
            seek,
        })
    }
}

/// An entry of a map, held to what [`layer::read_entries`] gives.
fn check_entry(e: &LayerEntry, p: Placement, stream: u64) -> Result<(), String> {
    for c in &e.path {
        if c.is_empty() || c == b"." || c == b".." || c.contains(&b'/') || c.contains(&0) {
            return Err("a path component that no layer can give".into());
        }
    }
    layer::check_path(&e.path, matches!(e.kind, Kind::Dir | Kind::Opaque), "its path")?;
    if e.meta.perm & !0o7777 != 0 {
        return Err(format!("mode {:o} has more than permission bits", e.meta.perm));
    }
    let object = match &e.kind {
        Kind::Dir | Kind::Opaque => false,
        _ if e.path.is_empty() => return Err("the root is not a directory".into()),
        Kind::File { size, content } => match content {
            Content::Inline(v) if v.len() as u64 == *size && *size <= RECOMMENDED_INLINE_MAX => false,
            Content::Object(_) if *size > RECOMMENDED_INLINE_MAX => {
                if let Placement::At(off) = p {
                    if off.checked_add(*size).is_none_or(|end| end > stream) {
                        return Err(format!("its {size} bytes at {off} pass the stream's end ({stream})"));
                    }
                }
                true
            }
            _ => return Err("contents that do not match its size".into()),
        },
        Kind::Symlink(t) => {
            if t.is_empty() || t.contains(&0) || t.len() > MAX_PAYLOAD_LEN {
                return Err("a symlink target no layer can give".into());
            }
            false
        }
        Kind::Hardlink(t) => {
            if t.is_empty()
                || t.iter()
                    .any(|c| c.is_empty() || c == b"." || c == b".." || c.contains(&b'/'))
            {
                return Err("a hardlink target no layer can give".into());
            }
            false
        }
        Kind::Device { mode_type, .. } if *mode_type == S_IFCHR || *mode_type == S_IFBLK => false,
        Kind::Device { .. } => return Err("a device of another type".into()),
        Kind::Fifo | Kind::Whiteout => false,
    };
    match (object, p) {
        (true, Placement::At(_) | Placement::WholeLayer) | (false, Placement::None) => Ok(()),
        _ => Err("a placement for an entry without contents, or none for a file".into()),
    }
}

/// The image of `maps` applied in order (a prefix of an image's layers
/// makes the image of that chain): the bytes and its fs-verity digest.
pub fn flatten(
    maps: &[&LayerMap],
    digests: &[&Digest],
    keep_all_xattrs: bool,
) -> Result<(Vec<u8>, [u8; 32]), OciError> {
    let mut applier = Applier::new(keep_all_xattrs);
    for (m, d) in maps.iter().zip(digests) {
        applier.apply_layer(&d.to_string(), m.entries.clone())?;
    }
    let (_, image) = compat::write_image(applier)
        .map_err(|e| OciError::manifest("the image of the layer maps", format!("cannot be written: {e}")))?;
    Ok((image.bytes, image.digest))
}

/// Where each of `objects` lies in `maps` (map i is the layer the lazy
/// record calls pack i): offset in the layer's uncompressed stream, or
/// [`WHOLE_LAYER`]. An object that several files hold is placed where it
/// can be read alone, if anywhere.
pub fn locate(maps: &[&LayerMap], objects: &[ObjectRef]) -> Result<ObjectIndex, String> {
    let mut at: HashMap<[u8; 32], Location> = HashMap::new();
    for (i, m) in maps.iter().enumerate() {
        for (e, p) in m.entries.iter().zip(&m.placements) {
            let Kind::File {
                size,
                content: Content::Object(d),
            } = &e.kind
            else {
                continue;
            };
            let offset = match p {
                Placement::At(o) => *o,
                Placement::WholeLayer => WHOLE_LAYER,
                Placement::None => continue,
            };
            let loc = Location::raw(i as u32, offset, *size);
            at.entry(*d)
                .and_modify(|l| {
                    if l.offset == WHOLE_LAYER {
                        *l = loc
                    }
                })
                .or_insert(loc);
        }
    }
    let mut out = Vec::with_capacity(objects.len());
    for o in objects {
        let loc = at
            .get(&o.digest)
            .filter(|l| l.size == o.size)
            .ok_or_else(|| format!("no layer map holds object {} ({} bytes)", hex::encode(o.digest), o.size))?;
        out.push((o.digest, *loc));
    }
    out.sort_unstable_by_key(|a| a.0);
    Ok(ObjectIndex { objects: out })
}

// ---- making and pushing an index -------------------------------------------

/// How to index.
#[derive(Debug, Clone, Default)]
pub struct IndexOptions {
    /// The registry, trust, platform, jobs, cancellation and progress of
    /// reading the image (as a pull's).
    pub pull: PullOptions,
    /// Signatures to make of the index's manifest.
    pub sign: crate::trust::SignOptions,
    /// Write format 1 (the image whole), which tilefs before format 2
    /// reads.
    pub format_1: bool,
}

/// What `tilefs index` did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct IndexReport {
    pub reference: String,
    /// The index artifact's manifest digest.
    pub manifest_digest: String,
    /// The image manifest it refers to.
    pub subject: String,
    /// The flattened image's fs-verity digest, hex (what `tilefs pull`
    /// prints).
    pub digest: String,
    pub layers: usize,
    /// The image's layer blobs, as the registry holds them.
    pub layer_bytes: u64,
    /// The index: manifest, configuration and blobs.
    pub index_bytes: u64,
    /// The index's format: 2, the image in tree chunks; 1, whole.
    pub format: u32,
    /// The image's blobs (its tree chunks, or the image).
    pub image_blob_bytes: u64,
    pub image_blobs: usize,
    pub map_bytes: u64,
    /// The seek indexes (inside the maps, compressed with them).
    pub seek_bytes: u64,
    /// index_bytes / layer_bytes, in percent.
    pub percent: f64,
    pub blobs_uploaded: u64,
    #[serde(flatten)]
    pub listed: Listed,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signed: Option<crate::trust::Signed>,
}

/// Reads the image `r` once (its files go through `store`, as a pull's: a
/// file's fs-verity digest is what the store names it by; untagged, gc
/// removes them), makes its index and pushes it to `r`'s repository.
pub fn index(store: &Store, r: &ImageRef, opts: &IndexOptions) -> Result<IndexReport, OciError> {
    let reference = match r {
        ImageRef::Registry { reference } => reference.clone(),
        ImageRef::Name { name } if !tilefs_trust::DockerRef::is_short_name(name) => name.clone(),
        _ => {
            return Err(OciError::Reference(format!(
                "{r}: tilefs indexes images in registries (docker://HOST[:PORT]/REPO[:TAG])"
            )))
        }
    };
    let signer = crate::trust::prepare_signing(&reference, &opts.sign)?;
    let popts = &opts.pull;
    let progress = popts.progress.clone().unwrap_or_default();
    let platform = popts.platform.clone().unwrap_or_else(crate::manifest::Platform::host);
    progress.stage.set(format!("fetching the manifest of {r}"), true);
    let opened = crate::trust::open_checked(r, &popts.registry, &popts.trust, &platform)?;
    let resolved = &opened.resolved;
    if resolved.artifact {
        return Err(OciError::manifest(
            r.to_string(),
            "is a tilefs artifact: it is pulled lazily as it is, without an index",
        ));
    }
    let subject = resolved
        .manifest_digest
        .clone()
        .ok_or_else(|| OciError::manifest(r.to_string(), "has no manifest digest"))?;
    let layers = &resolved.layers;
    let sizes: Option<Vec<u64>> = layers.iter().map(|l| l.size).collect();
    let sizes = sizes.ok_or_else(|| OciError::manifest(r.to_string(), "a layer without its size"))?;

    // Read each distinct layer once, locating its files.
    let mut distinct: Vec<BlobRef> = Vec::new();
    for l in layers {
        if !distinct.iter().any(|d| d.digest == l.digest) {
            distinct.push(l.clone());
        }
    }
    progress
        .layers_total
        .store(distinct.len() as u64, std::sync::atomic::Ordering::Relaxed);
    progress
        .blob_total
        .store(sizes.iter().sum(), std::sync::atomic::Ordering::Relaxed);
    progress.stage.set(format!("reading {} layers", distinct.len()), true);
    let ingest = Ingest::new(store, Method::Copy)?;
    let presence = tilefs_store::presence::Presence::default();
    let read = crate::pull::read_layers(
        store,
        opened.transport.as_ref(),
        &distinct,
        &ingest,
        &progress,
        &presence,
        popts,
        true,
    )?;
    ingest.finish()?;
    drop(ingest);
    let maps: Vec<LayerMap> = read
        .into_iter()
        .map(|l| LayerMap {
            entries: l.entries,
            placements: l.placements,
            seek: l.seek,
        })
        .collect();
    let of_layer: Vec<&LayerMap> = layers
        .iter()
        .map(|l| &maps[distinct.iter().position(|d| d.digest == l.digest).unwrap()])
        .collect();
    progress.stage.set("writing the image and the layer maps", false);
    let digests: Vec<&Digest> = layers.iter().map(|l| &l.digest).collect();
    let (image, fsverity) = flatten(&of_layer, &digests, false)?;

    // The blobs: configuration, image (its tree's chunks, where they
    // rebuild it, else whole), maps.
    let chunks = match opts.format_1 {
        true => None,
        false => tilefs_image::erofs::read_image(&image).ok().and_then(|(tree, info)| {
            crate::artifact_tree::encode_lines(&tree, info.version)
                .filter(|c| crate::artifact_tree::rebuilds(c, &[], &image, &hex::encode(fsverity)))
        }),
    };
    let (format, image_type, image_blobs) = match chunks {
        Some(c) => (2, TREE_TYPE, c),
        None => (
            1,
            IMAGE_TYPE,
            vec![zstd::bulk::compress(&image, LEVEL).expect("zstd compresses in memory")],
        ),
    };
    let map_blobs: Vec<Vec<u8>> = maps.iter().map(LayerMap::encode).collect();
    let seek_bytes: u64 = maps
        .iter()
        .filter_map(|m| m.seek.as_ref())
        .map(|s| s.encode().len() as u64)
        .sum();
    let map_digest = |i: usize| Digest::sha256_of(&map_blobs[i]);
    let config = IndexConfig {
        version: format,
        fsverity: hex::encode(fsverity),
        layers: layers
            .iter()
            .map(|l| IndexedLayer {
                digest: l.digest.to_string(),
                media_type: l.media_type.clone(),
                size: l.size.unwrap_or(0),
                map: map_digest(distinct.iter().position(|d| d.digest == l.digest).unwrap()).to_string(),
            })
            .collect(),
    };
    let config = serde_json::to_vec(&config).expect("a config serializes");
    let mut blobs: Vec<(&str, &[u8])> = vec![(CONFIG_TYPE, &config)];
    blobs.extend(image_blobs.iter().map(|b| (image_type, b.as_slice())));
    blobs.extend(map_blobs.iter().map(|b| (MAP_TYPE, b.as_slice())));

    let mut reach = crate::trust::push_options(&reference, &popts.registry, &popts.trust)?;
    reach.cancel = reach.cancel.or_else(|| popts.cancel.clone());
    let reg = Registry::open(&reference, &reach)?;
    let subject_manifest = reg.manifest_by_digest(&subject)?;
    let subject_type = serde_json::from_slice::<Value>(&subject_manifest)
        .ok()
        .and_then(|v| v.get("mediaType").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| OCI_MANIFEST.to_string());
    progress
        .stage
        .set(format!("sending the index to {}", reg.registry()), true);
    let mut uploaded = 0;
    for (_, b) in &blobs {
        let d = Digest::sha256_of(b);
        if !reg.has_blob(&d)? {
            let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            reg.upload(&d, b.len() as u64, &mut std::io::Cursor::new(*b), &sent)?;
            uploaded += 1;
        }
    }
    let desc = |t: &str, b: &[u8]| json!({"mediaType": t, "digest": Digest::sha256_of(b).to_string(), "size": b.len()});
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": desc(CONFIG_TYPE, &config),
        "layers": blobs[1..].iter().map(|(t, b)| desc(t, b)).collect::<Vec<_>>(),
        "subject": {"mediaType": subject_type, "digest": subject.to_string(), "size": subject_manifest.len()},
        "annotations": {"org.tilefs.fsverity": hex::encode(fsverity)},
    });
    let manifest = serde_json::to_vec(&manifest).expect("a manifest serializes");
    let manifest_digest = Digest::sha256_of(&manifest);
    let index_bytes = manifest.len() as u64 + blobs.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
    progress.stage.set("listing the index as a referrer of the image", true);
    let listed = referrers::push(
        &reg,
        &subject,
        manifest,
        &[ARTIFACT_TYPE, CONFIG_TYPE],
        json!({"org.tilefs.fsverity": hex::encode(fsverity)}),
    )?;
    let signed = match &signer {
        Some(s) => {
            progress.stage.set("signing", true);
            Some(s.sign(&reg, &manifest_digest.to_string())?)
        }
        None => None,
    };
    let layer_bytes: u64 = sizes.iter().sum();
    Ok(IndexReport {
        reference: r.to_string(),
        manifest_digest: manifest_digest.to_string(),
        subject: subject.to_string(),
        digest: hex::encode(fsverity),
        layers: layers.len(),
        layer_bytes,
        index_bytes,
        format,
        image_blob_bytes: image_blobs.iter().map(|b| b.len() as u64).sum(),
        image_blobs: image_blobs.len(),
        map_bytes: map_blobs.iter().map(|b| b.len() as u64).sum(),
        seek_bytes,
        percent: index_bytes as f64 * 100.0 / layer_bytes.max(1) as f64,
        blobs_uploaded: uploaded,
        listed,
        signed,
    })
}

// ---- finding and reading an index ------------------------------------------

/// An image's index, found and checked: what a lazy pull (or the
/// snapshotter, for each chain of the image's layers) needs.
///
/// The contract, for callers other than `tilefs pull --lazy`:
/// - [`find`] is given the image as the policy accepted it (its
///   [`Resolved`], with its trust record for a registry image); it judges
///   the index by the same policy, so an index is used only where the
///   image could be;
/// - `maps[i]` describes the image's layer `i` (manifest order);
///   [`flatten`] of `maps[..=i]` is the image of the chain of layers
///   `0..=i`, and [`locate`] of those maps and that image's objects gives
///   the object index of a lazy record whose packs are those layers
///   ([`crate::fetch::LazyRecord::for_layers`]), which
///   [`crate::fetch::LazySource`] then serves from the layer blobs.
pub struct Indexed {
    /// The index artifact's manifest digest.
    pub manifest_digest: Digest,
    pub config: IndexConfig,
    /// The flattened image of all the layers, and its fs-verity digest;
    /// None when it was not wanted ([`Needs::maps_only`]).
    pub image: Option<(Vec<u8>, [u8; 32])>,
    /// Per layer of the image, in its manifest's order.
    pub maps: Vec<std::sync::Arc<LayerMap>>,
    /// How the index passed the signature policy (a registry image's).
    pub trust: Option<crate::trust::TrustRecord>,
}

/// What of an image's index, or of its tables of contents, a plan needs.
#[derive(Clone, Copy)]
pub struct Needs<'a> {
    /// The index's maps alone, not its flattened image: what podman's
    /// layer store goes by (each layer's image is made from its map),
    /// which spares it fetching and rebuilding the image's tree.
    pub maps_only: bool,
    /// The layers (given their digest and their table of contents') whose
    /// table the caller has made use of already: not fetched.
    pub known_table: &'a dyn Fn(&str, &str) -> bool,
}

impl Needs<'_> {
    /// All of it.
    pub const ALL: Needs<'static> = Needs {
        maps_only: false,
        known_table: &|_, _| false,
    };
}

/// The newest index of the image `resolved` in `reg` (the repository the
/// image came from), checked; None when there is none.
pub fn find(reg: &Registry, resolved: &Resolved, needs: Needs<'_>) -> Result<Option<Indexed>, OciError> {
    let Some(subject) = &resolved.manifest_digest else {
        return Ok(None);
    };
    let found = referrers::find(reg, subject, &[ARTIFACT_TYPE, CONFIG_TYPE])?;
    let Some(newest) = found.last() else {
        return Ok(None);
    };
    let what = format!("the index {}", newest.digest);
    if newest.size > crate::bounded::MAX_MANIFEST {
        return Err(OciError::manifest(
            &what,
            format!("its manifest is {} bytes", newest.size),
        ));
    }
    let manifest = reg.manifest_by_digest(&newest.digest)?;
    let trust = match &resolved.trust {
        Some(t) => Some(crate::trust::check_referrer(t, reg, &manifest, &newest.digest)?),
        None => None,
    };
    let bad = |r: String| OciError::manifest(&what, r);
    let v: Value = serde_json::from_slice(&manifest).map_err(|e| bad(format!("not JSON: {e}")))?;
    if v.get("artifactType").and_then(Value::as_str) != Some(ARTIFACT_TYPE) {
        return Err(bad("not a tilefs index".into()));
    }
    if v.pointer("/subject/digest").and_then(Value::as_str) != Some(&subject.to_string()) {
        return Err(bad(format!("its subject is not the image's manifest {subject}")));
    }
    let blob = |d: &Value, want: &str| -> Result<BlobRef, OciError> {
        if d.get("mediaType").and_then(Value::as_str) != Some(want) {
            return Err(bad(format!("a blob that is not of type {want}")));
        }
        let digest = d
            .get("digest")
            .and_then(Value::as_str)
            .and_then(|s| Digest::parse(s).ok())
            .ok_or_else(|| bad("a blob without a valid digest".into()))?;
        Ok(BlobRef {
            digest,
            size: d.get("size").and_then(Value::as_u64),
            media_type: want.to_string(),
            member: None,
        })
    };
    let config_ref = blob(v.get("config").unwrap_or(&Value::Null), CONFIG_TYPE)?;
    let listed = v
        .get("layers")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no layers".into()))?;
    let config_raw = reg.blob_bytes(&config_ref, MAX_CONFIG)?;
    let config: IndexConfig =
        serde_json::from_slice(&config_raw).map_err(|e| bad(format!("its configuration: {e}")))?;
    // Format 1: the image whole, then the maps; 2: its tree's chunks.
    let image_type = match config.version {
        1 => IMAGE_TYPE,
        2 => TREE_TYPE,
        v => return Err(bad(format!("format version {v} (this tilefs reads 1 and {VERSION})"))),
    };
    let n = match config.version {
        1 => 1,
        _ => listed
            .iter()
            .take_while(|d| d.get("mediaType").and_then(Value::as_str) == Some(TREE_TYPE))
            .count(),
    };
    if n == 0 || listed.len() < n {
        return Err(bad("no image blob".into()));
    }
    let image_refs = listed[..n]
        .iter()
        .map(|d| blob(d, image_type))
        .collect::<Result<Vec<_>, _>>()?;
    let map_refs = listed[n..]
        .iter()
        .map(|d| blob(d, MAP_TYPE))
        .collect::<Result<Vec<_>, _>>()?;
    if config.layers.len() != resolved.layers.len()
        || config
            .layers
            .iter()
            .zip(&resolved.layers)
            .any(|(c, l)| c.digest != l.digest.to_string() || Some(c.size) != l.size)
    {
        return Err(bad("its layers are not the image's".into()));
    }
    let image = match (needs.maps_only, config.version) {
        (true, _) => None,
        (false, 1) => {
            let image_z = reg.blob_bytes(&image_refs[0], artifact::MAX_IMAGE)?;
            Some(zstd_bounded(&image_z, artifact::MAX_IMAGE, "image").map_err(bad)?)
        }
        // Its objects are the maps' to place: a chunk placing any in a
        // pack is refused (the index has no packs).
        (false, _) => {
            let chunks = crate::artifact_tree::fetch(reg, &image_refs)?;
            let names: Vec<String> = image_refs.iter().map(|r| r.digest.to_string()).collect();
            let rebuilt = crate::artifact_tree::rebuild(&chunks, &names, &[], &what, Some(config.fsverity.as_str()))?;
            Some(rebuilt.image)
        }
    };
    let image = match image {
        None => None,
        Some(image) => {
            let fsverity = tilefs_image::verity::digest_bytes(&image);
            if hex::encode(fsverity) != config.fsverity {
                return Err(bad(format!(
                    "its image's fs-verity digest is {}, its configuration says {}",
                    hex::encode(fsverity),
                    config.fsverity
                )));
            }
            Some((image, fsverity))
        }
    };
    let mut decoded: HashMap<String, std::sync::Arc<LayerMap>> = HashMap::new();
    let mut maps = Vec::with_capacity(config.layers.len());
    for l in &config.layers {
        if let Some(m) = decoded.get(&l.map) {
            maps.push(m.clone());
            continue;
        }
        let r = map_refs.iter().find(|m| m.digest.to_string() == l.map).ok_or_else(|| {
            bad(format!(
                "the map {} of layer {} is not among its blobs",
                l.map, l.digest
            ))
        })?;
        let raw = reg.blob_bytes(r, MAX_MAP)?;
        let m = std::sync::Arc::new(
            LayerMap::decode(&raw, l.size).map_err(|e| bad(format!("the map of layer {}: {e}", l.digest)))?,
        );
        decoded.insert(l.map.clone(), m.clone());
        maps.push(m);
    }
    Ok(Some(Indexed {
        manifest_digest: newest.digest.clone(),
        config,
        image,
        maps,
        trust,
    }))
}

/// The index of the image `resolved`, found in the registry of
/// `reference` (`source`'s); Ok(Err(why)) when there is none to use.
fn usable(
    source: &ImageRef,
    reference: &str,
    resolved: &Resolved,
    registry: &crate::transport::RegistryOptions,
    needs: Needs<'_>,
) -> Result<Result<Indexed, String>, OciError> {
    match Registry::open(reference, registry).and_then(|reg| find(&reg, resolved, needs)) {
        Ok(Some(i)) => Ok(Ok(i)),
        Ok(None) => Ok(Err(format!("{source} has no tilefs index (`tilefs index` makes one)"))),
        Err(OciError::Interrupted) => Err(OciError::Interrupted),
        Err(e) => Ok(Err(format!("its tilefs index cannot be used: {e}"))),
    }
}

/// `pull --lazy` of an ordinary image: its index found, the image tagged
/// and a lazy record written. Ok(Err(why)) where there is no index to use
/// (the caller pulls the image whole, saying why).
pub(crate) fn pull_indexed(
    store: &Store,
    source: &ImageRef,
    resolved: &Resolved,
    tag: &str,
    opts: &PullOptions,
    progress: &PullProgress,
) -> Result<Result<crate::PullReport, String>, OciError> {
    let ImageRef::Registry { reference } = source else {
        return Ok(Err("only an image in a registry has an index".into()));
    };
    progress.stage.set("looking for a tilefs index of the image", true);
    let indexed = match usable(source, reference, resolved, &opts.registry, Needs::ALL)? {
        Ok(i) => i,
        Err(why) => return Ok(Err(why)),
    };
    let maps: Vec<&LayerMap> = indexed.maps.iter().map(|m| m.as_ref()).collect();
    let (image, digest) = match (&indexed.image, opts.keep_all_xattrs) {
        (Some(image), false) => image.clone(),
        _ => {
            let digests: Vec<&Digest> = resolved.layers.iter().map(|l| &l.digest).collect();
            flatten(&maps, &digests, opts.keep_all_xattrs)?
        }
    };
    let (tree, info) = tilefs_image::erofs::read_image(&image)
        .map_err(|e| OciError::manifest(format!("the index {}", indexed.manifest_digest), e.to_string()))?;
    let objects = artifact::objects_of(&tree);
    let entries = tree.inodes.len();
    drop(tree);
    let index =
        locate(&maps, &objects).map_err(|e| OciError::manifest(format!("the index {}", indexed.manifest_digest), e))?;
    let absent = tilefs_store::presence::absent(store, objects.iter().map(|o| o.digest));
    let record = crate::fetch::LazyRecord::for_layers(source, resolved, opts, &maps, index, indexed.trust.clone());
    if !absent.is_empty() {
        record.save(store, &digest)?;
    }
    crate::trust::save_evidence(store, &digest, resolved)?;
    tilefs_store::tags::write_tag(store, tag, &image)?;
    if absent.is_empty() {
        tilefs_store::remote::forget(store, &digest)?;
    }
    Ok(Ok(crate::PullReport {
        tag: tag.to_string(),
        digest: hex::encode(digest),
        image_bytes: image.len(),
        format_version: info.version,
        manifest_digest: resolved.manifest_digest.as_ref().map(|d| d.to_string()),
        layers: resolved.layers.len(),
        blob_bytes: 0,
        entries,
        objects: Default::default(),
        notes: Vec::new(),
        lazy_objects: absent.len() as u64,
        lazy_index: Some(indexed.manifest_digest.to_string()),
        lazy_fallback: None,
    }))
}

// ---- lazy starts elsewhere (the snapshotter) -------------------------------

/// What a lazy start of an image (the snapshotter's, for each layer
/// containerd prepares) can go by, found as `pull --lazy` finds it.
pub struct LazyPlan {
    /// The image's (platform) manifest digest, and the digest of the
    /// manifest or index its reference names (what CRI lists as the
    /// image's repo digest).
    pub manifest_digest: Option<Digest>,
    pub top_digest: Option<String>,
    pub kind: LazyKind,
}

pub enum LazyKind {
    /// A runnable tilefs artifact: its blobs' digests (each its own diff
    /// ID, as its configuration was checked to say).
    Artifact(Vec<Digest>),
    /// An ordinary image with an index to use.
    Indexed(Box<IndexedImage>),
    /// An eStargz or zstd:chunked image without one: its tables of
    /// contents.
    Toc(Box<TocImages>),
    /// Anything else: pulled whole, and why.
    Whole(String),
}

/// An ordinary image and its index, as a lazy start needs them.
pub struct IndexedImage {
    /// Where it was found (a mirror's reference, or the registry's), and
    /// how it was reached there: its lazy records fetch from there.
    pub source: ImageRef,
    pub opts: PullOptions,
    /// As the policy accepted it.
    pub resolved: Resolved,
    /// Its layers' diff IDs (its configuration's `rootfs.diff_ids`), in
    /// the manifest's order: the chain IDs containerd names snapshots by.
    pub diff_ids: Vec<Digest>,
    pub index: Indexed,
}

/// An eStargz or zstd:chunked image and its tables of contents, as a
/// lazy start needs them (found as [`IndexedImage`]'s index is).
pub struct TocImages {
    pub source: ImageRef,
    pub opts: PullOptions,
    pub resolved: Resolved,
    pub diff_ids: Vec<Digest>,
    pub tables: crate::toc_lazy::TocTables,
}

/// The image of the chain of an image's first layers, and the lazy
/// record that places its files in them.
pub struct Chain {
    pub image: Vec<u8>,
    pub digest: [u8; 32],
    pub objects: Vec<ObjectRef>,
    pub record: crate::fetch::LazyRecord,
}

/// Opens `r` (judged by the signature policy: a refusal is the error),
/// reads its configuration and, for an ordinary image, looks for its index,
/// then for its layers' tables of contents (eStargz, zstd:chunked).
pub fn plan(r: &ImageRef, opts: &PullOptions) -> Result<LazyPlan, OciError> {
    plan_for(r, opts, Needs::ALL)
}

/// [`plan`], an index's image fetched only if `needs` says so.
pub fn plan_for(r: &ImageRef, opts: &PullOptions, needs: Needs<'_>) -> Result<LazyPlan, OciError> {
    let (opened, raw) = crate::pull::open_with_config(r, opts)?;
    plan_opened_for(&opened, &raw, opts, needs)
}

/// The diff IDs an image configuration `raw` (`what`, for errors) gives
/// its layers (`rootfs.diff_ids`), which must be `layers`, the manifest's
/// count.
pub fn diff_ids(raw: &[u8], layers: usize, what: &str) -> Result<Vec<Digest>, OciError> {
    let v: Value = serde_json::from_slice(raw).map_err(|e| OciError::manifest(what, format!("not JSON: {e}")))?;
    let diff_ids = v
        .pointer("/rootfs/diff_ids")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|d| d.as_str().and_then(|s| Digest::parse(s).ok()))
                .collect::<Option<Vec<Digest>>>()
        })
        .ok_or_else(|| OciError::manifest(what, "not an image configuration (no rootfs.diff_ids)"))?
        .ok_or_else(|| OciError::manifest(what, "a diff ID that is no digest"))?;
    if diff_ids.len() != layers {
        return Err(OciError::manifest(
            what,
            format!("lists {} layers where the manifest has {layers}", diff_ids.len()),
        ));
    }
    Ok(diff_ids)
}

/// [`plan`] of an image opened already ([`crate::pull::open_with_config`]:
/// accepted by the policy), `raw` its configuration.
pub fn plan_opened(opened: &crate::trust::Opened, raw: &[u8], opts: &PullOptions) -> Result<LazyPlan, OciError> {
    plan_opened_for(opened, raw, opts, Needs::ALL)
}

fn plan_opened_for(
    opened: &crate::trust::Opened,
    raw: &[u8],
    opts: &PullOptions,
    needs: Needs<'_>,
) -> Result<LazyPlan, OciError> {
    let crate::trust::Opened {
        source,
        resolved,
        registry,
        ..
    } = opened;
    let config = resolved.config.as_ref().expect("checked by open_with_config");
    let what = format!("configuration {}", config.digest);
    let blobs: Vec<Digest> = resolved.layers.iter().map(|l| l.digest.clone()).collect();
    let kind = if resolved.artifact {
        if config.media_type == artifact::CONFIG_TYPE {
            LazyKind::Whole(format!(
                "{source} is a tilefs image that is not runnable (`tilefs push --runnable-from` makes one)"
            ))
        } else {
            artifact::parse_runnable_config(raw, &blobs).map_err(|e| OciError::manifest(&what, e))?;
            LazyKind::Artifact(blobs)
        }
    } else {
        let diff_ids = diff_ids(raw, blobs.len(), &what)?;
        let opts = PullOptions {
            registry: registry.clone(),
            ..opts.clone()
        };
        match &source {
            ImageRef::Registry { reference } => match usable(source, reference, resolved, registry, needs)? {
                Ok(index) => LazyKind::Indexed(Box::new(IndexedImage {
                    opts,
                    source: source.clone(),
                    resolved: resolved.clone(),
                    diff_ids,
                    index,
                })),
                // Without an index, an eStargz or zstd:chunked image goes
                // by its tables of contents (as `pull --lazy` does).
                Err(why) => {
                    match crate::toc_lazy::tables(source, resolved, &opts, &Default::default(), needs.known_table) {
                        Ok(Some(Ok(tables))) => LazyKind::Toc(Box::new(TocImages {
                            opts,
                            source: source.clone(),
                            resolved: resolved.clone(),
                            diff_ids,
                            tables,
                        })),
                        Ok(None) => LazyKind::Whole(why),
                        Ok(Some(Err(toc_why))) => {
                            LazyKind::Whole(format!("{why}, and its tables of contents cannot be used: {toc_why}"))
                        }
                        Err(OciError::Interrupted) => return Err(OciError::Interrupted),
                        Err(e) => LazyKind::Whole(format!("{why}, and its tables of contents cannot be used: {e}")),
                    }
                }
            },
            _ => LazyKind::Whole("only an image in a registry has an index".into()),
        }
    };
    Ok(LazyPlan {
        manifest_digest: resolved.manifest_digest.clone(),
        top_digest: resolved.trust.as_ref().map(|t| t.manifest_digest.clone()),
        kind,
    })
}

impl IndexedImage {
    /// The chain of the first `n` layers (1 ..= all): its image (the
    /// index's own for all of them, else made from their maps, as the
    /// image of that chain's layers pulled whole) and its lazy record.
    pub fn chain(&self, n: usize) -> Result<Chain, OciError> {
        let what = || format!("the index {}", self.index.manifest_digest);
        let maps: Vec<&LayerMap> = self.index.maps.iter().take(n).map(|m| m.as_ref()).collect();
        if n == 0 || maps.len() != n {
            return Err(OciError::manifest(what(), format!("has no chain of {n} layers")));
        }
        let (image, digest) = if let (true, Some(image)) = (n == self.index.maps.len(), &self.index.image) {
            image.clone()
        } else {
            let digests: Vec<&Digest> = self.resolved.layers.iter().take(n).map(|l| &l.digest).collect();
            flatten(&maps, &digests, false)?
        };
        let (tree, _) =
            tilefs_image::erofs::read_image(&image).map_err(|e| OciError::manifest(what(), e.to_string()))?;
        let objects = artifact::objects_of(&tree);
        drop(tree);
        let index = locate(&maps, &objects).map_err(|e| OciError::manifest(what(), e))?;
        let record = crate::fetch::LazyRecord::for_layers(
            &self.source,
            &self.resolved,
            &self.opts,
            &maps,
            index,
            self.index.trust.clone(),
        );
        Ok(Chain {
            image,
            digest,
            objects,
            record,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A gzip layer of a directory, files of several sizes (one of 6 MiB,
    /// past a checkpoint's span), a symlink, a hardlink and a whiteout.
    fn layer() -> (Vec<u8>, Vec<(&'static str, Vec<u8>)>) {
        let files: Vec<(&str, Vec<u8>)> = vec![
            ("etc/small", b"inline".to_vec()),
            ("etc/config", (0..5000u32).flat_map(|i| i.to_le_bytes()).collect()),
            (
                "big",
                (0..(6u32 << 20))
                    .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
                    .collect(),
            ),
            ("after", vec![7u8; 300]),
        ];
        let mut b = tar::Builder::new(Vec::new());
        let header = |path: &str, size: usize, t: tar::EntryType| {
            let mut h = tar::Header::new_ustar();
            h.set_path(path).unwrap();
            h.set_size(size as u64);
            h.set_mode(0o644);
            h.set_entry_type(t);
            h.set_mtime(1);
            h.set_uid(0);
            h.set_gid(0);
            h.set_cksum();
            h
        };
        b.append(&header("etc/", 0, tar::EntryType::Directory), std::io::empty())
            .unwrap();
        for (p, data) in &files {
            b.append(&header(p, data.len(), tar::EntryType::Regular), &data[..])
                .unwrap();
        }
        let mut h = header("etc/link", 0, tar::EntryType::Symlink);
        h.set_link_name("config").unwrap();
        h.set_cksum();
        b.append(&h, std::io::empty()).unwrap();
        let mut h = header("etc/hard", 0, tar::EntryType::Link);
        h.set_link_name("etc/config").unwrap();
        h.set_cksum();
        b.append(&h, std::io::empty()).unwrap();
        b.append(&header("etc/.wh.small", 0, tar::EntryType::Regular), std::io::empty())
            .unwrap();
        let tar = b.into_inner().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&tar).unwrap();
        (gz.finish().unwrap(), files)
    }

    /// The map of `blob` as `tilefs index` makes it.
    fn map_of(blob: &[u8]) -> LayerMap {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::create(&dir.path().join("store")).unwrap();
        let ingest = Ingest::new(&store, Method::Copy).unwrap();
        let mut ix = tilefs_seekable::gzip::GzipIndexer::with_span(blob, 1 << 20);
        let (entries, placements) =
            layer::read_entries_placed(&mut ix, "l", &ingest, layer::ReadOptions::default()).unwrap();
        std::io::copy(&mut ix, &mut std::io::sink()).unwrap();
        LayerMap {
            entries,
            placements,
            seek: Some(ix.finish().unwrap()),
        }
    }

    #[test]
    fn a_map_places_every_file_where_a_range_read_finds_it() {
        let (blob, files) = layer();
        let map = map_of(&blob);
        let seek = map.seek.as_ref().unwrap();
        assert!(seek.is_enterable());
        let again = LayerMap::decode(&map.encode(), blob.len() as u64).unwrap();
        assert_eq!((&again.entries, &again.placements), (&map.entries, &map.placements));
        assert_eq!(again.seek.as_ref(), Some(seek));
        let mut found = 0;
        for (e, p) in map.entries.iter().zip(&map.placements) {
            let Kind::File { size, content } = &e.kind else {
                assert_eq!(*p, Placement::None);
                continue;
            };
            let want = &files.iter().find(|f| f.0.as_bytes() == e.path.join(&b'/')).unwrap().1;
            match (content, p) {
                (Content::Inline(v), Placement::None) => assert_eq!(v, want),
                (Content::Object(d), Placement::At(off)) => {
                    let range = seek.fetch_range(*off..off + size).unwrap();
                    let mut out = vec![0u8; *size as usize];
                    seek.read_at(
                        *off..off + size,
                        &blob[range.start as usize..range.end as usize],
                        &mut out,
                    )
                    .unwrap();
                    assert_eq!(&out, want);
                    assert_eq!(*d, tilefs_image::verity::digest_bytes(want));
                    found += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(found, 3);
        // The objects are placed; the image of the map is the layer's.
        let objects: Vec<ObjectRef> = map
            .entries
            .iter()
            .filter_map(|e| match &e.kind {
                Kind::File {
                    size,
                    content: Content::Object(d),
                } => Some(ObjectRef {
                    digest: *d,
                    size: *size,
                }),
                _ => None,
            })
            .collect();
        let index = locate(&[&map], &objects).unwrap();
        assert_eq!(index.objects.len(), 3);
        // Over a layer of its other entries: its whiteout removes from it.
        let mut below = map.clone();
        below.entries.retain(|e| e.kind != Kind::Whiteout);
        let d = Digest::sha256_of(&blob);
        flatten(&[&below, &map], &[&d, &d], false).unwrap();
    }

    #[test]
    fn maps_that_no_layer_could_give_are_refused() {
        let (blob, _) = layer();
        let map = map_of(&blob);
        let size = blob.len() as u64;
        let refused = |m: &LayerMap| LayerMap::decode(&m.encode(), size).unwrap_err();
        let file = map
            .placements
            .iter()
            .position(|p| matches!(p, Placement::At(_)))
            .unwrap();
        let mut m = map.clone();
        m.placements[file] = Placement::At(u64::MAX - 3);
        assert!(refused(&m).contains("pass the stream's end"), "{}", refused(&m));
        let mut m = map.clone();
        m.placements[0] = Placement::At(0);
        assert!(refused(&m).contains("placement"), "{}", refused(&m));
        let mut m = map.clone();
        m.entries[1].path.push(b"..".to_vec());
        assert!(refused(&m).contains("path component"), "{}", refused(&m));
        let mut m = map.clone();
        m.placements.pop();
        assert!(refused(&m).contains("placements for"), "{}", refused(&m));
        assert!(LayerMap::decode(&map.encode(), size + 1)
            .unwrap_err()
            .contains("seek index"));
        assert!(LayerMap::decode(b"junk", size).is_err());
        // Seeds for the fuzz target: a real map, with its layer size.
        if let Some(dir) = std::env::var_os("TILEFS_WRITE_LAZY_INDEX_SEEDS") {
            let dir = std::path::Path::new(&dir);
            std::fs::create_dir_all(dir).unwrap();
            let mut seed = size.to_le_bytes().to_vec();
            seed.push(0);
            seed.extend(map.encode());
            std::fs::write(dir.join("layer-map"), seed).unwrap();
        }
    }
}
