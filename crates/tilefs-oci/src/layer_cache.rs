//! What a pull learnt of each layer: its entries, file contents by digest.
//! A layer read once is not read again while every object it needs is in
//! the store (`STORE/.layers/ALG-HEX.json`, keyed by the blob's digest,
//! which names its bytes). A record that is missing, unreadable, of
//! another version or naming an absent object is simply not used.

use crate::digest::Digest;
use crate::layer::{Content, Kind, LayerEntry};
use std::path::PathBuf;
use tilefs_store::store::LAYER_CACHE;
use tilefs_store::Store;

const VERSION: u32 = 1;

#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    version: u32,
    entries: Vec<LayerEntry>,
}

fn path(store: &Store, d: &Digest) -> PathBuf {
    store
        .join(LAYER_CACHE)
        .join(format!("{}-{}.json", d.algorithm(), d.hex()))
}

/// The layer's entries, if known and every object they need is present.
pub fn load(store: &Store, d: &Digest) -> Option<Vec<LayerEntry>> {
    let raw = std::fs::read(path(store, d)).ok()?;
    let r: Record = serde_json::from_slice(&raw).ok()?;
    if r.version != VERSION {
        return None;
    }
    let complete = r.entries.iter().all(|e| match &e.kind {
        Kind::File {
            size,
            content: Content::Object(o),
        } => store.object_size(o) == Some(*size),
        _ => true,
    });
    complete.then_some(r.entries)
}

/// Records a layer's entries (best effort: a pull does not fail for it).
pub fn save(store: &Store, d: &Digest, entries: &[LayerEntry]) {
    let Ok(dir) = store.subdir(LAYER_CACHE) else { return };
    let Ok(bytes) = serde_json::to_vec(&RecordRef {
        version: VERSION,
        entries,
    }) else {
        return;
    };
    let final_path = path(store, d);
    let tmp = dir.join(format!(".{}-{}.tmp", d.hex(), std::process::id()));
    if std::fs::write(&tmp, bytes).is_err() || std::fs::rename(&tmp, &final_path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[derive(serde::Serialize)]
struct RecordRef<'a> {
    version: u32,
    entries: &'a [LayerEntry],
}
