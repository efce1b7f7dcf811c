//! The snapshots' records: one small file per snapshot,
//! `ROOT/metadata/ID`, written whole by rename (temporary file, fsync,
//! rename, directory fsync), so that after a crash each record is the old
//! one or the new one. A snapshot's directory is `ROOT/snapshots/ID`
//! (`fs`: its upper directory, `work`: overlayfs's; a committed one keeps
//! only `layer`, its entries, but for one kept over a lazy image, which
//! keeps `fs`); containerd's keys, which hold `/` and anything else, only
//! ever appear inside records.

use crate::error::{Error, Result};
use crate::layer::LayerUsage;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum SnapKind {
    View,
    Active,
    Committed,
}

/// One snapshot's record.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Record {
    pub id: u64,
    pub key: String,
    pub kind: SnapKind,
    /// The parent's key ("" for none).
    pub parent: String,
    pub labels: HashMap<String, String>,
    pub created: SystemTime,
    pub updated: SystemTime,
    /// A committed snapshot: what its layer holds.
    #[serde(default)]
    pub usage: Option<LayerUsage>,
    /// A committed snapshot: the fs-verity digest (hex) of its chain's
    /// flattened image, tagged in the store.
    #[serde(default)]
    pub image: Option<String>,
    /// A committed snapshot whose files may not have reached the disk yet
    /// (Commit does not wait for the writeback of the layer containerd
    /// unpacked; a background sync clears this).
    #[serde(default)]
    pub unsynced: bool,
    /// A committed snapshot whose layer is not stored yet: its upper
    /// directory is whole, and the worker makes its layer and image.
    #[serde(default)]
    pub pending: bool,
    /// A committed snapshot made from a runnable tilefs artifact on CRI's
    /// labels (see [`crate::lazy`]): its image's files are fetched on
    /// first read, through a FUSE mount; it has no layer of its own.
    #[serde(default)]
    pub lazy: bool,
    /// A committed snapshot over an image served lazily: its layer is its
    /// upper directory, kept as it is and given as a lower directory to
    /// the mounts above it (its chain cannot be flattened into an image
    /// without fetching every file of the lazy image).
    #[serde(default)]
    pub kept: bool,
    /// A snapshot made lazily from an ordinary image's tilefs index: its
    /// image is its own chain's (an artifact's layers above the first show
    /// the first's).
    #[serde(default)]
    pub indexed: bool,
    /// An indexed snapshot below its image's top layer whose chain's image
    /// is not made yet (it has no tag): made at its first mount, from the
    /// image's plan ([`crate::lazy::Plans`]). containerd mounts an image's
    /// top layer; the chains below are rarely mounted, and making each
    /// is most of a lazy pull.
    #[serde(default)]
    pub deferred: bool,
}

pub const METADATA: &str = "metadata";
pub const SNAPSHOTS: &str = "snapshots";
pub const MOUNTS: &str = "mnt";
/// In a snapshot's directory while it is committed: what its files were
/// ([`crate::layer::Undo`]).
pub const UNDO: &str = "undo";
/// A snapshot's scratch directory of a claim on its upper directory (see
/// [`crate::claim`]).
pub const CLAIM: &str = "claim";
/// An empty directory: the lower directory of an active snapshot without
/// a parent (an overlay, so that its upper directory is marked in use).
pub const EMPTY: &str = "empty";

/// Loads every record; a record that does not parse is an error (it names
/// the file), never silently dropped.
pub fn load(root: &Path) -> Result<Vec<Record>> {
    let dir = root.join(METADATA);
    let mut out = Vec::new();
    let rd = std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, "cannot list", e))?;
    for ent in rd {
        let ent = ent.map_err(|e| Error::io(&dir, "cannot list", e))?;
        let name = ent.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.starts_with('.') || name.parse::<u64>().is_err() {
            continue;
        }
        let p = ent.path();
        let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, "cannot read", e))?;
        let r: Record = serde_json::from_slice(&bytes)
            .map_err(|e| Error::Broken(format!("{}: not a snapshot record: {e}", p.display())))?;
        if r.id.to_string() != name {
            return Err(Error::Broken(format!(
                "{}: holds the record of snapshot {}",
                p.display(),
                r.id
            )));
        }
        out.push(r);
    }
    Ok(out)
}

pub fn record_path(root: &Path, id: u64) -> PathBuf {
    root.join(METADATA).join(id.to_string())
}

pub fn snapshot_dir(root: &Path, id: u64) -> PathBuf {
    root.join(SNAPSHOTS).join(id.to_string())
}

pub fn mount_dir(root: &Path, id: u64) -> PathBuf {
    root.join(MOUNTS).join(id.to_string())
}

/// Writes `r` atomically and durably.
pub fn save(root: &Path, r: &Record) -> Result<()> {
    let bytes =
        serde_json::to_vec(r).map_err(|e| Error::Broken(format!("cannot encode the record of {}: {e}", r.key)))?;
    write_atomic(&record_path(root, r.id), &bytes)
}

/// Removes `id`'s record durably.
pub fn delete(root: &Path, id: u64) -> Result<()> {
    let p = record_path(root, id);
    match std::fs::remove_file(&p) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(&p, "cannot remove", e)),
    }
    sync_dir(p.parent().expect("a record has a directory"))
}

/// Writes `path` whole: a temporary file beside it, synced, renamed over
/// it, the directory synced.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    // The error names the path and the step that failed.
    tilefs_sys::fs::replace(path, 0o600, |mut f| f.write_all(bytes)).map_err(|e| Error::Broken(e.to_string()))
}

pub fn sync_dir(dir: &Path) -> Result<()> {
    let d = std::fs::File::open(dir).map_err(|e| Error::io(dir, "cannot open", e))?;
    d.sync_all().map_err(|e| Error::io(dir, "cannot sync", e))
}

/// A committed layer's entries, kept for the chains built on it.
pub fn save_layer(root: &Path, id: u64, entries: &[tilefs_oci::layer::LayerEntry]) -> Result<()> {
    let bytes = postcard::to_stdvec(entries).map_err(|e| Error::Broken(format!("cannot encode layer {id}: {e}")))?;
    write_atomic(&snapshot_dir(root, id).join("layer"), &bytes)
}

pub fn load_layer(root: &Path, id: u64) -> Result<Vec<tilefs_oci::layer::LayerEntry>> {
    let p = snapshot_dir(root, id).join("layer");
    let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, "cannot read", e))?;
    postcard::from_bytes(&bytes).map_err(|e| Error::Broken(format!("{}: not a layer record: {e}", p.display())))
}
