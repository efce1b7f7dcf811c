//! tilefs images as OCI artifacts: the layout `tilefs push` writes to a
//! registry and `tilefs pull` recognizes (documented in the README).
//!
//! A standard OCI image manifest whose `artifactType` is [`ARTIFACT_TYPE`]:
//! - config ([`CONFIG_TYPE`]): JSON naming the image's fs-verity digest and
//!   counting its objects;
//! - layer 0 ([`EROFS_TYPE_V2`]): the composefs EROFS image, zstd;
//! - layer 1 ([`INDEX_TYPE_V2`]): the object index: where each object lies
//!   in the packs, and whether it is stored compressed;
//! - layers 2.. ([`PACK_TYPE_V2`]): packs, the objects one after the
//!   other, each its own zstd frame (or its bytes as they are, where zstd
//!   would not make them smaller), so that one object (or a run of them)
//!   is one HTTP range request and one frame to decode.
//!
//! Format 3 ([`Format::V3`], what `tilefs push` writes unless the image
//! cannot be rebuilt from its tree) has, in place of the image and the
//! index, the image's tree in chunks ([`TREE_TYPE_V3`], see
//! [`crate::artifact_tree`]), which also place the objects in the packs;
//! then the packs, as format 2's. A pull rebuilds the image from the
//! chunks and refuses it unless its fs-verity digest is the
//! configuration's. A new version of an image shares most chunks with the
//! last one, where a new image blob shares nothing.
//!
//! Format 1 ([`Format::V1`], tilefs before packs were compressed) had the
//! image and the packs uncompressed and a JSON index: still read, as
//! format 2 is.
//!
//! A *runnable* artifact (`tilefs push --runnable-from`) holds the same
//! blobs under layer media types ([`RUNNABLE_EROFS_TYPE_V2`] and its
//! siblings: containerd treats a type under `application/vnd.oci.image.layer.`
//! as a layer and asks its snapshotter for it) and, for configuration, an
//! OCI image configuration (the command, environment, … of the image it
//! was made from) whose `rootfs.diff_ids` are the blobs' digests and whose
//! labels ([`LABEL_FSVERITY`], …) carry what [`Config`] holds. containerd's
//! CRI pull of it through the tilefs snapshotter downloads none of its
//! layers: the snapshotter serves the image lazily.
//!
//! Packs are cut from the objects in the image's tree order (a directory's
//! files together, so reading a directory reads neighbouring ranges) where
//! the objects themselves say ([`plan_packs`]: content-defined cuts), so
//! that a new version of an image, with some files added or changed, has
//! the same packs as the last one but those holding its new objects:
//! pushing it uploads those only. The same image always gives the same
//! blobs, so pushing it again uploads nothing.

use crate::digest::Digest;
use crate::OciError;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Seek, Write as _};
use tilefs_image::Tree;
use tilefs_store::parse_object_rel;

pub const ARTIFACT_TYPE: &str = "application/vnd.tilefs.image.v1";
pub const CONFIG_TYPE: &str = "application/vnd.tilefs.image.config.v1+json";
pub const EROFS_TYPE_V2: &str = "application/vnd.tilefs.image.erofs.v2";
pub const INDEX_TYPE_V2: &str = "application/vnd.tilefs.image.objects.v2";
pub const PACK_TYPE_V2: &str = "application/vnd.tilefs.image.pack.v2";
pub const RUNNABLE_EROFS_TYPE_V2: &str = "application/vnd.oci.image.layer.tilefs.erofs.v2";
pub const RUNNABLE_INDEX_TYPE_V2: &str = "application/vnd.oci.image.layer.tilefs.objects.v2";
pub const RUNNABLE_PACK_TYPE_V2: &str = "application/vnd.oci.image.layer.tilefs.pack.v2";
/// Format 3's chunks of the image's tree (its packs are format 2's).
pub const TREE_TYPE_V3: &str = "application/vnd.tilefs.image.tree.v3";
pub const RUNNABLE_TREE_TYPE_V3: &str = "application/vnd.oci.image.layer.tilefs.tree.v3";
/// Format 1's types: uncompressed image and packs, JSON index.
pub const EROFS_TYPE: &str = "application/vnd.tilefs.image.erofs.v1";
pub const INDEX_TYPE: &str = "application/vnd.tilefs.image.objects.v1+json";
pub const PACK_TYPE: &str = "application/vnd.tilefs.image.pack.v1";
pub const RUNNABLE_EROFS_TYPE: &str = "application/vnd.oci.image.layer.tilefs.erofs.v1";
pub const RUNNABLE_INDEX_TYPE: &str = "application/vnd.oci.image.layer.tilefs.objects.v1+json";
pub const RUNNABLE_PACK_TYPE: &str = "application/vnd.oci.image.layer.tilefs.pack.v1";
pub const OCI_CONFIG_TYPE: &str = "application/vnd.oci.image.config.v1+json";
/// A runnable artifact's configuration labels.
pub const LABEL_FSVERITY: &str = "org.tilefs.fsverity";
pub const LABEL_OBJECTS: &str = "org.tilefs.objects";
pub const LABEL_OBJECT_BYTES: &str = "org.tilefs.object-bytes";

/// The artifact formats: which its blobs' media types say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Uncompressed image and packs, JSON index (tilefs until issue 44).
    V1,
    /// zstd image, packs of zstd frames (or raw objects), binary index.
    V2,
    /// The image's tree in chunks that place the objects, format 2's packs.
    V3,
}

/// The media types of an artifact's image, index and packs (formats 1
/// and 2; format 3 has no image nor index: [`tree_types`]).
pub fn blob_types(runnable: bool, format: Format) -> [&'static str; 3] {
    match (runnable, format) {
        (true, Format::V2 | Format::V3) => [RUNNABLE_EROFS_TYPE_V2, RUNNABLE_INDEX_TYPE_V2, RUNNABLE_PACK_TYPE_V2],
        (false, Format::V2 | Format::V3) => [EROFS_TYPE_V2, INDEX_TYPE_V2, PACK_TYPE_V2],
        (true, Format::V1) => [RUNNABLE_EROFS_TYPE, RUNNABLE_INDEX_TYPE, RUNNABLE_PACK_TYPE],
        (false, Format::V1) => [EROFS_TYPE, INDEX_TYPE, PACK_TYPE],
    }
}

/// The media types of a format 3 artifact's tree chunks and packs.
pub fn tree_types(runnable: bool) -> (&'static str, &'static str) {
    match runnable {
        true => (RUNNABLE_TREE_TYPE_V3, RUNNABLE_PACK_TYPE_V2),
        false => (TREE_TYPE_V3, PACK_TYPE_V2),
    }
}

/// The format (and whether runnable) an artifact whose first layer has
/// this media type is of.
pub fn format_of(first_layer_type: &str) -> Option<(Format, bool)> {
    match first_layer_type {
        TREE_TYPE_V3 => Some((Format::V3, false)),
        RUNNABLE_TREE_TYPE_V3 => Some((Format::V3, true)),
        EROFS_TYPE_V2 => Some((Format::V2, false)),
        RUNNABLE_EROFS_TYPE_V2 => Some((Format::V2, true)),
        EROFS_TYPE => Some((Format::V1, false)),
        RUNNABLE_EROFS_TYPE => Some((Format::V1, true)),
        _ => None,
    }
}

/// Whether a manifest whose configuration and first layer have these media
/// types is a tilefs artifact.
pub fn is_artifact(config_type: &str, first_layer_type: Option<&str>) -> bool {
    config_type == CONFIG_TYPE || first_layer_type.and_then(format_of).is_some()
}

/// Packs are cut where an object's digest says ([`plan_packs`]), once they
/// hold at least [`PACK_MIN`] bytes (uncompressed), on average
/// [`PACK_SPREAD`] bytes later, at the latest at [`PACK_MAX`]: few packs
/// (each a layer containerd walks, for a runnable artifact), as a new
/// version keeps the last one's packs ([`crate::push`]) rather than
/// relying on small ones.
pub const PACK_MIN: u64 = 16 << 20;
pub const PACK_SPREAD: u64 = 8 << 20;
pub const PACK_MAX: u64 = 64 << 20;
/// zstd level of the objects and the image: on python3's library (98 MB of
/// files, each compressed alone), 6 makes them 1.5% larger than 9 in half
/// the time, and 6% smaller than 3.
pub const LEVEL: i32 = 6;
/// Frames are written with at most this window (2^N bytes) and a reader
/// takes no larger one: what decoding one costs in memory.
pub const WINDOW_LOG: u32 = 22;

/// Largest EROFS image and object index accepted from a registry.
pub const MAX_IMAGE: u64 = 4 << 30;
pub const MAX_INDEX: u64 = 1 << 30;
/// Largest configuration accepted.
pub const MAX_CONFIG: u64 = 64 << 10;

/// The artifact's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The EROFS image's fs-verity digest (SHA-256, 4 KiB blocks), hex.
    pub fsverity: String,
    /// Distinct objects the image references, and their total size.
    pub objects: u64,
    pub object_bytes: u64,
}

/// Where an object lies: pack number (0 is the manifest's third layer),
/// offset in that pack, the object's size, and how it is stored there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Location {
    pub pack: u32,
    pub offset: u64,
    pub size: u64,
    pub stored: Stored,
}

/// How an object's bytes are in its pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stored {
    /// As they are: `size` bytes.
    Raw,
    /// One zstd frame (or several) of this many bytes, which decode to the
    /// object's `size` bytes.
    Zstd(u64),
}

impl Stored {
    /// The bytes an object of `size` bytes takes stored so.
    pub fn bytes(self, size: u64) -> u64 {
        match self {
            Stored::Raw => size,
            Stored::Zstd(n) => n,
        }
    }
}

impl Location {
    /// An object stored as it is.
    pub fn raw(pack: u32, offset: u64, size: u64) -> Location {
        Location {
            pack,
            offset,
            size,
            stored: Stored::Raw,
        }
    }

    /// The bytes it takes in its pack.
    pub fn stored_len(&self) -> u64 {
        self.stored.bytes(self.size)
    }

    /// Where its bytes end in its pack.
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.stored_len())
    }
}

/// Format 1's object index blob: `{"version":1,"objects":[[hex, pack,
/// offset, size], ...]}`, in pack order.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct IndexFile {
    version: u32,
    objects: Vec<(String, u32, u64, u64)>,
}

/// Format 2's object index blob: zstd of this, postcard-encoded. One
/// entry per distinct object of the image, in the order of their digests
/// (which the image gives): (pack, offset, stored bytes or 0 for an object
/// stored as it is).
#[derive(Debug, Serialize, Deserialize)]
struct IndexV2 {
    version: u32,
    objects: Vec<(u32, u64, u64)>,
}

/// An object of the image: its digest (also its store name) and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectRef {
    pub digest: [u8; 32],
    pub size: u64,
}

/// The distinct objects `tree` references, in tree order (first use).
pub fn objects_of(tree: &Tree) -> Vec<ObjectRef> {
    let mut seen = rustc_hash::FxHashSet::default();
    let mut out = Vec::new();
    tree.walk(|_, entry, id| {
        if entry.is_some_and(|e| e.hardlink) {
            return;
        }
        let inode = tree.inode(id);
        if !inode.is_external() {
            return;
        }
        if let Some(d) = inode.payload.as_deref().and_then(parse_object_rel) {
            if seen.insert(d) {
                out.push(ObjectRef {
                    digest: d,
                    size: inode.size,
                });
            }
        }
    });
    out
}

/// Cuts `objects` (in tree order) into packs, each a run of them: after
/// an object whose digest (read as a number) falls under a threshold
/// proportional to its size, once the pack holds [`PACK_MIN`] bytes; or
/// once it holds [`PACK_MAX`]. The cuts depend on the objects around them
/// only: a new object changes its own pack (and, now and then, the next
/// one), not the others.
pub fn plan_packs(objects: &[ObjectRef]) -> Vec<std::ops::Range<usize>> {
    let mut packs = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, o) in objects.iter().enumerate() {
        bytes += o.size;
        let h = u64::from_le_bytes(o.digest[..8].try_into().expect("8 bytes"));
        // P(cut) = size / PACK_SPREAD: on average PACK_SPREAD bytes past
        // the minimum, whatever the objects' sizes.
        let hit = (h as u128) * (PACK_SPREAD as u128) < (o.size as u128 + 1) << 64;
        if (bytes >= PACK_MIN && hit) || bytes >= PACK_MAX {
            packs.push(start..i + 1);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < objects.len() {
        packs.push(start..objects.len());
    }
    packs
}

/// The index blob (format 2) placing each of `objects` at `locs`.
pub fn encode_index(objects: &[ObjectRef], locs: &[Location]) -> Vec<u8> {
    let mut placed: Vec<(&[u8; 32], &Location)> = objects.iter().map(|o| &o.digest).zip(locs).collect();
    placed.sort_unstable_by_key(|p| p.0);
    let file = IndexV2 {
        version: 2,
        objects: placed
            .iter()
            .map(|(_, l)| {
                let stored = match l.stored {
                    Stored::Raw => 0,
                    Stored::Zstd(n) => n,
                };
                (l.pack, l.offset, stored)
            })
            .collect(),
    };
    let raw = postcard::to_stdvec(&file).expect("an index serializes");
    zstd::bulk::compress(&raw, LEVEL).expect("zstd compresses in memory")
}

/// A parsed, checked object index, sorted by digest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectIndex {
    pub objects: Vec<([u8; 32], Location)>,
}

impl ObjectIndex {
    /// Parses a format 2 index blob for an artifact whose packs have
    /// `pack_sizes` and whose image needs `objects`: one location per
    /// object, each inside its pack, a compressed one smaller than the
    /// object (what one object may cost to fetch is bounded by its size).
    /// `what` names the blob in errors.
    pub fn parse_v2(
        bytes: &[u8],
        objects: &[ObjectRef],
        pack_sizes: &[u64],
        what: &str,
    ) -> Result<ObjectIndex, OciError> {
        let bad = |r: String| OciError::manifest(what, r);
        let raw = unzstd(bytes, MAX_INDEX).map_err(bad)?;
        let file: IndexV2 = postcard::from_bytes(&raw).map_err(|e| bad(format!("not a tilefs object index: {e}")))?;
        if file.version != 2 {
            return Err(bad(format!(
                "object index version {} where its media type says 2",
                file.version
            )));
        }
        if file.objects.len() != objects.len() {
            return Err(bad(format!(
                "it places {} objects, the image has {}",
                file.objects.len(),
                objects.len()
            )));
        }
        let mut sorted: Vec<&ObjectRef> = objects.iter().collect();
        sorted.sort_unstable_by_key(|o| o.digest);
        let mut out = Vec::with_capacity(objects.len());
        for (o, &(pack, offset, stored)) in sorted.into_iter().zip(&file.objects) {
            let name = hex::encode(o.digest);
            let loc = Location {
                pack,
                offset,
                size: o.size,
                stored: match stored {
                    0 => Stored::Raw,
                    n if n < o.size => Stored::Zstd(n),
                    n => {
                        return Err(bad(format!(
                            "object {name} of {} bytes is stored compressed in {n} bytes (no fewer)",
                            o.size
                        )))
                    }
                },
            };
            let Some(&pack_size) = pack_sizes.get(pack as usize) else {
                return Err(bad(format!(
                    "object {name} lies in pack {pack}, but the artifact has {} packs",
                    pack_sizes.len()
                )));
            };
            if offset.checked_add(loc.stored_len()).is_none_or(|end| end > pack_size) {
                return Err(bad(format!(
                    "object {name} at offset {offset}, {} bytes, lies outside pack {pack} ({pack_size} bytes)",
                    loc.stored_len()
                )));
            }
            out.push((o.digest, loc));
        }
        Ok(ObjectIndex { objects: out })
    }

    /// Parses a format 1 index blob for an artifact whose packs have
    /// `pack_sizes`: every location must lie inside its pack, every digest
    /// be 64 hex digits, no digest appear twice. `what` names the blob in
    /// errors.
    pub fn parse_v1(bytes: &[u8], pack_sizes: &[u64], what: &str) -> Result<ObjectIndex, OciError> {
        let bad = |r: String| OciError::manifest(what, r);
        let file: IndexFile =
            serde_json::from_slice(bytes).map_err(|e| bad(format!("not a tilefs object index: {e}")))?;
        if file.version != 1 {
            return Err(bad(format!(
                "object index version {} (this tilefs reads 1)",
                file.version
            )));
        }
        let mut objects = Vec::with_capacity(file.objects.len());
        for (hex_digest, pack, offset, size) in file.objects {
            let digest: [u8; 32] = hex::decode(&hex_digest)
                .ok()
                .and_then(|b| b.try_into().ok())
                .filter(|_| hex_digest.bytes().all(|c| !c.is_ascii_uppercase()))
                .ok_or_else(|| bad(format!("{hex_digest:?} is not an object digest")))?;
            let Some(&pack_size) = pack_sizes.get(pack as usize) else {
                return Err(bad(format!(
                    "object {hex_digest} lies in pack {pack}, but the artifact has {} packs",
                    pack_sizes.len()
                )));
            };
            if offset.checked_add(size).is_none_or(|end| end > pack_size) {
                return Err(bad(format!(
                    "object {hex_digest} at offset {offset}, {size} bytes, lies outside pack {pack} ({pack_size} bytes)"
                )));
            }
            objects.push((digest, Location::raw(pack, offset, size)));
        }
        objects.sort_unstable_by_key(|a| a.0);
        if let Some(w) = objects.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(bad(format!("object {} is listed twice", hex::encode(w[0].0))));
        }
        Ok(ObjectIndex { objects })
    }

    pub fn get(&self, digest: &[u8; 32]) -> Option<Location> {
        self.objects
            .binary_search_by(|(d, _)| d.cmp(digest))
            .ok()
            .map(|i| self.objects[i].1)
    }

    /// Checks that the index places every object of `needed` with the size
    /// the image gives it, and keeps only those.
    pub fn restrict_to(self, needed: &[ObjectRef], what: &str) -> Result<ObjectIndex, OciError> {
        let mut objects = Vec::with_capacity(needed.len());
        for o in needed {
            let loc = self.get(&o.digest).ok_or_else(|| {
                OciError::manifest(
                    what,
                    format!(
                        "the image needs object {}, which the index does not list",
                        hex::encode(o.digest)
                    ),
                )
            })?;
            if loc.size != o.size {
                return Err(OciError::manifest(
                    what,
                    format!(
                        "object {} is {} bytes in the image but {} in the index",
                        hex::encode(o.digest),
                        o.size,
                        loc.size
                    ),
                ));
            }
            objects.push((o.digest, loc));
        }
        objects.sort_unstable_by_key(|a| a.0);
        Ok(ObjectIndex { objects })
    }
}

/// The bytes of a zstd blob (the image, the index), at most `limit`.
pub fn unzstd(bytes: &[u8], limit: u64) -> Result<Vec<u8>, String> {
    let mut d = zstd::stream::read::Decoder::new(bytes).map_err(|e| format!("zstd: {e}"))?;
    // No larger window than tilefs writes with: what decoding costs.
    d.window_log_max(WINDOW_LOG).map_err(|e| format!("zstd: {e}"))?;
    crate::bounded::read_at_most(&mut d, limit).map_err(|e| format!("zstd: {e}"))
}

/// The image blob of format 2: the image, zstd.
pub fn pack_image(image: &[u8]) -> Vec<u8> {
    zstd::bulk::compress(image, LEVEL).expect("zstd compresses in memory")
}

/// A reader of an object's bytes from a reader of what its pack stores
/// of it (`loc.stored_len()` bytes): those bytes, or their decoding, which takes
/// no window larger than the writer's. Whether what comes is the object
/// (its size, its digest) is the caller's to check.
pub fn unpack<'a>(stored: impl Read + 'a, loc: &Location) -> io::Result<Box<dyn Read + 'a>> {
    Ok(match loc.stored {
        Stored::Raw => Box::new(stored),
        Stored::Zstd(_) => {
            let mut d = zstd::stream::read::Decoder::new(stored)?;
            d.window_log_max(WINDOW_LOG)?;
            Box::new(d)
        }
    })
}

/// Appends the object `open` reads (`size` bytes) to `out`, whose length
/// is `at`: one zstd frame, or its bytes as they are where that frame
/// would not be smaller (then read again). Returns how it is stored.
pub fn pack_object<R: Read>(
    open: impl Fn() -> io::Result<R>,
    size: u64,
    out: &mut std::fs::File,
    at: u64,
) -> io::Result<Stored> {
    let short = |n: u64| io::Error::other(format!("{n} bytes where the image says {size}"));
    {
        let w = io::BufWriter::with_capacity(1 << 20, &mut *out);
        let mut z = zstd::stream::write::Encoder::new(w, LEVEL)?;
        z.include_checksum(false)?;
        z.include_contentsize(true)?;
        z.set_pledged_src_size(Some(size))?;
        z.window_log(WINDOW_LOG)?;
        let copied = io::copy(&mut open()?.take(size), &mut z)?;
        if copied != size {
            return Err(short(copied));
        }
        z.finish()?.flush()?;
    }
    let frame = out.stream_position()? - at;
    if frame < size {
        return Ok(Stored::Zstd(frame));
    }
    out.set_len(at)?;
    out.seek(io::SeekFrom::Start(at))?;
    let copied = io::copy(&mut open()?.take(size), out)?;
    if copied != size {
        return Err(short(copied));
    }
    Ok(Stored::Raw)
}

/// The manifest of an artifact, as bytes (what is pushed and hashed):
/// its configuration, then its `layers` (media type, digest, size): the
/// image and index (format 2) or the tree chunks (format 3), then the
/// packs. The first layer carries the image's fs-verity digest. `runnable`:
/// the configuration is an OCI image configuration (and the layers' types
/// are layer media types).
pub fn manifest(config: (&Digest, u64), layers: &[(&str, &Digest, u64)], fsverity: &str, runnable: bool) -> Vec<u8> {
    let desc =
        |t: &str, d: &Digest, size: u64| serde_json::json!({"mediaType": t, "digest": d.to_string(), "size": size});
    let mut layers: Vec<serde_json::Value> = layers.iter().map(|(t, d, s)| desc(t, d, *s)).collect();
    if let Some(first) = layers.first_mut() {
        first["annotations"] = serde_json::json!({"org.tilefs.fsverity": fsverity});
    }
    let config_type = if runnable { OCI_CONFIG_TYPE } else { CONFIG_TYPE };
    let m = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": crate::manifest::OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": desc(config_type, config.0, config.1),
        "layers": layers,
    });
    serde_json::to_vec(&m).expect("a manifest serializes")
}

/// A runnable artifact's configuration: `base` (the image configuration
/// of the image it stands for) with `rootfs` listing `blobs` (the
/// artifact's uncompressed blobs: each its own diff ID), no history (which
/// would count other layers), and `config`'s facts among its labels.
pub fn runnable_config(base: &[u8], config: &Config, blobs: &[Digest]) -> Result<Vec<u8>, String> {
    let mut v: serde_json::Value =
        serde_json::from_slice(base).map_err(|e| format!("not an image configuration: {e}"))?;
    let obj = v
        .as_object_mut()
        .filter(|o| o.contains_key("rootfs"))
        .ok_or("not an image configuration (no rootfs)")?;
    obj.remove("history");
    obj.insert(
        "rootfs".into(),
        serde_json::json!({"type": "layers", "diff_ids": blobs.iter().map(|d| d.to_string()).collect::<Vec<_>>()}),
    );
    let run = obj.entry("config").or_insert_with(|| serde_json::json!({}));
    if run.is_null() {
        *run = serde_json::json!({});
    }
    let run = run.as_object_mut().ok_or("its \"config\" is not an object")?;
    let labels = run.entry("Labels").or_insert_with(|| serde_json::json!({}));
    if labels.is_null() {
        *labels = serde_json::json!({});
    }
    let labels = labels.as_object_mut().ok_or("its config.Labels is not an object")?;
    labels.insert(LABEL_FSVERITY.into(), config.fsverity.clone().into());
    labels.insert(LABEL_OBJECTS.into(), config.objects.to_string().into());
    labels.insert(LABEL_OBJECT_BYTES.into(), config.object_bytes.to_string().into());
    Ok(serde_json::to_vec(&v).expect("JSON serializes"))
}

/// What a runnable artifact's configuration says of the image, checked
/// against its `blobs` (each must be its own diff ID).
pub fn parse_runnable_config(raw: &[u8], blobs: &[Digest]) -> Result<Config, String> {
    let v: serde_json::Value = serde_json::from_slice(raw).map_err(|e| format!("not JSON: {e}"))?;
    let diff_ids: Vec<&str> = v
        .pointer("/rootfs/diff_ids")
        .and_then(|d| d.as_array())
        .ok_or("not an image configuration (no rootfs.diff_ids)")?
        .iter()
        .map(|d| d.as_str().unwrap_or(""))
        .collect();
    let want: Vec<String> = blobs.iter().map(|d| d.to_string()).collect();
    if diff_ids != want {
        return Err(format!(
            "its rootfs.diff_ids ({}) are not the artifact's blobs ({})",
            diff_ids.join(", "),
            want.join(", ")
        ));
    }
    let label = |k: &str| {
        v.pointer("/config/Labels")
            .and_then(|l| l.get(k))
            .and_then(|x| x.as_str())
            .ok_or_else(|| format!("label {k} is missing"))
    };
    let number = |k: &str| {
        label(k)?
            .parse::<u64>()
            .map_err(|_| format!("label {k} is not a number"))
    };
    Ok(Config {
        fsverity: label(LABEL_FSVERITY)?.to_string(),
        objects: number(LABEL_OBJECTS)?,
        object_bytes: number(LABEL_OBJECT_BYTES)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(n: u8, size: u64) -> ObjectRef {
        ObjectRef { digest: [n; 32], size }
    }

    #[test]
    fn packs_are_cut_where_the_objects_say_and_stay_cut_there() {
        // Objects of 64 KiB with digests of a counter's hash.
        let objs: Vec<ObjectRef> = (0u32..4000)
            .map(|i| ObjectRef {
                digest: <sha2::Sha256 as sha2::Digest>::digest(i.to_le_bytes()).into(),
                size: 64 << 10,
            })
            .collect();
        let packs = plan_packs(&objs);
        let size = |r: &std::ops::Range<usize>| objs[r.clone()].iter().map(|o| o.size).sum::<u64>();
        assert!(packs.len() > 4, "{packs:?}");
        assert!(packs
            .iter()
            .rev()
            .skip(1)
            .all(|p| size(p) >= PACK_MIN && size(p) <= PACK_MAX));
        assert_eq!(packs.iter().map(|p| p.len()).sum::<usize>(), objs.len());
        // One object more in the middle: the packs before it are the same,
        // and all but one or two after it.
        let mut more = objs.clone();
        more.insert(2000, obj(9, 31 << 10));
        let contents = |o: &[ObjectRef], p: &[std::ops::Range<usize>]| -> Vec<Vec<[u8; 32]>> {
            p.iter()
                .map(|r| o[r.clone()].iter().map(|x| x.digest).collect())
                .collect()
        };
        let before = contents(&objs, &packs);
        let after = contents(&more, &plan_packs(&more));
        let new = after.iter().filter(|p| !before.contains(p)).count();
        assert!((1..=2).contains(&new), "{new} new packs");
    }

    #[test]
    fn a_format_2_index_round_trips_and_bounds_what_it_places() {
        let objs = [obj(3, 100), obj(1, 1000), obj(2, 70)];
        let locs = [
            Location::raw(0, 0, 100),
            Location {
                pack: 0,
                offset: 100,
                size: 1000,
                stored: Stored::Zstd(40),
            },
            Location::raw(1, 0, 70),
        ];
        let bytes = encode_index(&objs, &locs);
        let idx = ObjectIndex::parse_v2(&bytes, &objs, &[140, 70], "index").unwrap();
        for (o, l) in objs.iter().zip(&locs) {
            assert_eq!(idx.get(&o.digest), Some(*l));
        }
        let why = |objs: &[ObjectRef], locs: &[Location], packs: &[u64]| {
            ObjectIndex::parse_v2(&encode_index(objs, locs), objs, packs, "idx")
                .unwrap_err()
                .to_string()
        };
        assert!(why(&objs, &locs, &[139, 70]).contains("outside pack 0"));
        assert!(why(&objs, &locs, &[140]).contains("has 1 packs"));
        let mut fat = locs;
        fat[1].stored = Stored::Zstd(1000);
        assert!(why(&objs, &fat, &[2000, 70]).contains("no fewer"));
        let e = ObjectIndex::parse_v2(&bytes, &objs[..2], &[140, 70], "idx").unwrap_err();
        assert!(e.to_string().contains("places 3 objects, the image has 2"), "{e}");
        assert!(ObjectIndex::parse_v2(b"not zstd", &objs, &[140, 70], "idx").is_err());
    }

    #[test]
    fn objects_are_packed_compressed_or_as_they_are() {
        let mut pack = tempfile::tempfile().unwrap();
        let text = b"tilefs ".repeat(1000);
        let noise: Vec<u8> = (0..5000u32)
            .flat_map(|i| <sha2::Sha256 as sha2::Digest>::digest(i.to_le_bytes())[..1].to_vec())
            .collect();
        let a = pack_object(|| Ok(&text[..]), text.len() as u64, &mut pack, 0).unwrap();
        let Stored::Zstd(n) = a else { panic!("{a:?}") };
        let b = pack_object(|| Ok(&noise[..]), noise.len() as u64, &mut pack, n).unwrap();
        assert_eq!(b, Stored::Raw);
        let mut bytes = Vec::new();
        pack.seek(io::SeekFrom::Start(0)).unwrap();
        pack.read_to_end(&mut bytes).unwrap();
        assert_eq!(bytes.len() as u64, n + noise.len() as u64);
        let la = Location {
            pack: 0,
            offset: 0,
            size: text.len() as u64,
            stored: a,
        };
        let mut out = Vec::new();
        unpack(&bytes[..n as usize], &la)
            .unwrap()
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out, text);
        assert_eq!(&bytes[n as usize..], &noise[..]);
        // Short of what the image says: an error, not a shorter object.
        assert!(pack_object(|| Ok(&text[..10]), 20, &mut pack, 0).is_err());
    }

    #[test]
    fn a_runnable_configuration_keeps_the_image_and_states_the_blobs() {
        let base = br#"{"architecture":"amd64","os":"linux","config":{"Cmd":["/bin/sh"],"Labels":null},
            "rootfs":{"type":"layers","diff_ids":["sha256:aa"]},"history":[{"created_by":"x"}]}"#;
        let cfg = Config {
            fsverity: "ab".repeat(32),
            objects: 3,
            object_bytes: 99,
        };
        let blobs: Vec<Digest> = [b"a".as_slice(), b"b", b"c"]
            .iter()
            .map(|b| Digest::sha256_of(b))
            .collect();
        let raw = runnable_config(base, &cfg, &blobs).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&raw).unwrap();
        assert_eq!(v["config"]["Cmd"][0], "/bin/sh");
        assert!(v.get("history").is_none());
        assert_eq!(parse_runnable_config(&raw, &blobs).unwrap(), cfg);
        let e = parse_runnable_config(&raw, &blobs[..2]).unwrap_err();
        assert!(e.contains("not the artifact's blobs"), "{e}");
        assert!(runnable_config(b"{}", &cfg, &blobs).unwrap_err().contains("no rootfs"));
        let bare = runnable_config(br#"{"config":null,"rootfs":{}}"#, &cfg, &blobs).unwrap();
        assert_eq!(parse_runnable_config(&bare, &blobs).unwrap(), cfg);
    }

    #[test]
    fn lying_indexes_are_refused() {
        let d = hex::encode([7u8; 32]);
        for (json, why) in [
            (format!(r#"{{"version":1,"objects":[["{d}",0,10,5]]}}"#), "outside pack"),
            (format!(r#"{{"version":1,"objects":[["{d}",1,0,1]]}}"#), "1 packs"),
            (
                format!(r#"{{"version":1,"objects":[["{d}",0,18446744073709551615,2]]}}"#),
                "outside pack",
            ),
            (
                format!(r#"{{"version":1,"objects":[["{d}",0,0,1],["{d}",0,1,1]]}}"#),
                "twice",
            ),
            (
                r#"{"version":1,"objects":[["zz",0,0,1]]}"#.to_string(),
                "not an object digest",
            ),
            (r#"{"version":2,"objects":[]}"#.to_string(), "version 2"),
            (r#"{"objects":[]}"#.to_string(), "not a tilefs object index"),
        ] {
            let e = ObjectIndex::parse_v1(json.as_bytes(), &[12], "idx")
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{json}: {e}");
        }
    }
}
