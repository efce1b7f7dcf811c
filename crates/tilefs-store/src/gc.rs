//! `gc`: removes objects no tagged image references, and leftovers of
//! interrupted imports.

use crate::{Store, StoreError};

#[derive(Debug, Clone, Default)]
pub struct GcOptions {
    /// Report only; remove nothing.
    pub dry_run: bool,
}

#[derive(Debug, Default, serde::Serialize)]
pub struct GcReport {
    pub objects_kept: u64,
    pub objects_removed: u64,
    pub bytes_removed: u64,
    pub leftovers_removed: u64,
}

/// Runs gc under the store's exclusive lock.
pub fn gc(_store: &Store, _opts: &GcOptions) -> Result<GcReport, StoreError> {
    todo!()
}
