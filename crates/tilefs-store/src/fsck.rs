//! `fsck`: every object's digest recomputed, every tagged image's references
//! checked.

use crate::{Store, StoreError};
use std::path::PathBuf;

#[derive(Debug, Clone, Default)]
pub struct FsckOptions {
    /// Move corrupt objects and strays to `.quarantine/`.
    pub repair: bool,
    /// Threads (0: one per core).
    pub jobs: usize,
}

/// What fsck found.
#[derive(Debug, Default, serde::Serialize)]
pub struct FsckReport {
    pub objects: u64,
    pub bytes: u64,
    /// Objects whose contents do not match their name.
    pub corrupt: Vec<PathBuf>,
    /// Objects referenced by a tagged image but absent: (object path, tags).
    pub missing: Vec<(String, Vec<String>)>,
    /// Entries in the store that are not objects.
    pub strays: Vec<PathBuf>,
    /// Tagged images that cannot be read.
    pub bad_images: Vec<(String, String)>,
    /// Temporary files of interrupted imports (not a problem; gc removes them).
    pub leftovers: u64,
    /// Paths moved to `.quarantine/` by --repair.
    pub repaired: Vec<PathBuf>,
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.corrupt.is_empty() && self.missing.is_empty() && self.strays.is_empty() && self.bad_images.is_empty()
    }
}

/// Checks the store; `progress(bytes_done, bytes_total)` is called as it goes.
pub fn fsck(
    _store: &Store,
    _opts: &FsckOptions,
    _progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<FsckReport, StoreError> {
    todo!()
}
