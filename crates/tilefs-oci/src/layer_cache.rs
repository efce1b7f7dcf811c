//! What a pull learnt of each layer: its entries, file contents by digest.
//! A layer read once is not read again while every object it needs is in
//! the store (`STORE/.layers/ALG-HEX`, keyed by the blob's digest, which
//! names its bytes; a compact serde encoding, postcard). A record that is
//! missing, unreadable, of another version or naming an absent object is
//! simply not used.
//!
//! The image a list of layers makes is kept the same way
//! (`STORE/.layers/image-KEY`, KEY a SHA-256 of the layer digests and the
//! options that shape the image), with the objects it needs: pulling an
//! image again costs its manifest and a check that those objects are still
//! there.

use crate::digest::Digest;
use crate::layer::{Content, Kind, LayerEntry};
use rustix::fs::{Mode, OFlags};
use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::Path;
use tilefs_store::presence::Presence;
use tilefs_store::store::LAYER_CACHE;
use tilefs_store::Store;

/// Bumped whenever what a record holds changes meaning, or the image a
/// list of layers makes changes (a new rule in `compat`, say).
const VERSION: u32 = 2;

#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    version: u32,
    entries: Vec<LayerEntry>,
}

fn record_name(d: &Digest) -> String {
    format!("{}-{}", d.algorithm(), d.hex())
}

/// A record's bytes. The store is not trusted: a record is read only if it
/// is a regular file (never through a symlink, never blocking on a FIFO).
fn read_record(store: &Store, name: &str) -> Option<Vec<u8>> {
    read_record_in(store, LAYER_CACHE, name)
}

/// A record's bytes from the store's directory `dir`.
pub(crate) fn read_record_in(store: &Store, dir: &str, name: &str) -> Option<Vec<u8>> {
    let mut raw = Vec::new();
    open_record_in(store, dir, name).ok()?.read_to_end(&mut raw).ok()?;
    Some(raw)
}

/// Opens a record of the store's directory `dir`: a regular file in a
/// real directory, no symlink followed on the way.
pub(crate) fn open_record_in(store: &Store, dir: &str, name: &str) -> std::io::Result<std::fs::File> {
    let dir = store.open_existing_subdir(dir)?;
    tilefs_store::open_regular(&dir, Path::new(name), false)
}

/// Writes a record atomically (best effort: a pull does not fail for it).
/// The temporary file is created anew, never opened through whatever an
/// untrusted store left under its name.
fn write_record(store: &Store, name: &str, bytes: &[u8]) {
    let _ = write_record_in(store, LAYER_CACHE, name, bytes);
}

/// Writes a record into the store's directory `dir`, through descriptors
/// of real directories only: in a store others may write, a symlink there
/// must not take the record anywhere else.
pub(crate) fn write_record_in(store: &Store, dir: &str, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let dir = store.open_subdir(dir).map_err(std::io::Error::other)?;
    let tmp = tilefs_store::store::temp_name(&format!(".{name}."));
    let written = rustix::fs::openat(
        &dir,
        tmp.as_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o644),
    )
    .map_err(std::io::Error::from)
    .map(std::fs::File::from)
    .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
    .and_then(|()| Ok(rustix::fs::renameat(&dir, tmp.as_str(), &dir, name)?));
    if written.is_err() {
        let _ = rustix::fs::unlinkat(&dir, tmp.as_str(), rustix::fs::AtFlags::empty());
    }
    written
}

const ORIGINS: &str = "origins";

/// Other repositories of `registry` this store pushed to or pulled from
/// (where a push may find blobs to mount), most recent first.
pub fn origins(store: &Store, registry: &str, except: &str) -> Vec<String> {
    let list: Vec<(String, String)> = read_record(store, ORIGINS)
        .and_then(|raw| serde_json::from_slice(&raw).ok())
        .unwrap_or_default();
    list.into_iter()
        .filter(|(r, repo)| r == registry && repo != except)
        .map(|(_, repo)| repo)
        .take(4)
        .collect()
}

/// Remembers a repository pushed to or pulled from (best effort).
pub fn add_origin(store: &Store, registry: &str, repository: &str) {
    let mut list: Vec<(String, String)> = read_record(store, ORIGINS)
        .and_then(|raw| serde_json::from_slice(&raw).ok())
        .unwrap_or_default();
    list.retain(|(r, repo)| !(r == registry && repo == repository));
    list.insert(0, (registry.to_string(), repository.to_string()));
    list.truncate(64);
    if let Ok(bytes) = serde_json::to_vec(&list) {
        write_record(store, ORIGINS, &bytes);
    }
}

/// The layer's entries, if known and every object they need is present.
pub fn load(store: &Store, d: &Digest, presence: &Presence) -> Option<Vec<LayerEntry>> {
    let raw = read_record(store, &record_name(d))?;
    let r: Record = postcard::from_bytes(&raw).ok()?;
    if r.version != VERSION {
        return None;
    }
    let mut needed: Vec<&[u8; 32]> = Vec::new();
    for e in &r.entries {
        match &e.kind {
            Kind::File {
                content: Content::Object(o),
                ..
            } => needed.push(o),
            Kind::File {
                content: Content::Pending(_),
                ..
            } => return None,
            _ => {}
        }
    }
    needed.sort_unstable_by_key(|o| o[0]);
    presence.all_present(store, &needed).then_some(r.entries)
}

/// Records a layer's entries (best effort: a pull does not fail for it).
pub fn save(store: &Store, d: &Digest, entries: &[LayerEntry]) {
    if let Ok(bytes) = postcard::to_stdvec(&RecordRef {
        version: VERSION,
        entries,
    }) {
        write_record(store, &record_name(d), &bytes);
    }
}

#[derive(serde::Serialize)]
struct RecordRef<'a> {
    version: u32,
    entries: &'a [LayerEntry],
}

/// An image made from a list of layers.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct ImageRecord {
    version: u32,
    /// The fan-out directories holding the objects, with their mtimes when
    /// the objects were known present: a directory whose mtime is unchanged
    /// lost no entry since (a removal changes it), so only the others are
    /// listed.
    fanouts: Vec<(u8, i64, i64)>,
    pub image: Vec<u8>,
    pub entries: usize,
    pub objects: Vec<[u8; 32]>,
}

/// The key of the image `layers` make with these options.
pub fn image_key(layers: &[&Digest], keep_all_xattrs: bool) -> String {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    h.update(format!("tilefs-oci-image v{VERSION} all-xattrs={keep_all_xattrs}\n"));
    for l in layers {
        h.update(l.to_string());
        h.update(b"\n");
    }
    hex::encode(h.finalize())
}

/// The image recorded under `key`, if every object it needs is present.
pub fn load_image(store: &Store, key: &str, presence: &Presence) -> Option<ImageRecord> {
    let raw = read_record(store, &format!("image-{key}"))?;
    let r: ImageRecord = postcard::from_bytes(&raw).ok()?;
    if r.version != VERSION {
        return None;
    }
    let changed: HashSet<u8> = r
        .fanouts
        .iter()
        .filter(|&&(fan, sec, nsec)| fanout_mtime(store, fan) != Some((sec, nsec)))
        .map(|&(fan, ..)| fan)
        .collect();
    if changed.is_empty() {
        return Some(r);
    }
    let needed: Vec<&[u8; 32]> = r.objects.iter().filter(|o| changed.contains(&o[0])).collect();
    if !presence.all_present(store, &needed) {
        return None;
    }
    // Checked now: the next pull need not list these again.
    save_image(store, key, &r.image, r.entries, r.objects.clone());
    Some(r)
}

fn fanout_mtime(store: &Store, fan: u8) -> Option<(i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(store.join(format!("{fan:02x}"))).ok()?;
    Some((m.mtime(), m.mtime_nsec()))
}

/// Records the image `key` makes (best effort). Call once its objects are
/// durable in the store.
pub fn save_image(store: &Store, key: &str, image: &[u8], entries: usize, mut objects: Vec<[u8; 32]>) {
    objects.sort_unstable();
    let mut fanouts: Vec<(u8, i64, i64)> = Vec::new();
    for fan in objects.iter().map(|o| o[0]) {
        if fanouts.last().is_some_and(|&(f, ..)| f == fan) {
            continue;
        }
        let Some((sec, nsec)) = fanout_mtime(store, fan) else {
            return;
        };
        fanouts.push((fan, sec, nsec));
    }
    let record = ImageRecord {
        version: VERSION,
        fanouts,
        image: image.to_vec(),
        entries,
        objects,
    };
    if let Ok(bytes) = postcard::to_stdvec(&record) {
        write_record(store, &format!("image-{key}"), &bytes);
    }
}
