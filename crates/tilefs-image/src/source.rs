//! Builds a tree from a directory on disk, as the reference `mkcomposefs`
//! does from a directory.

use crate::tree::{InodeId, Tree};
use std::path::{Path, PathBuf};

/// What to read from the directory.
#[derive(Debug, Clone, Default)]
pub struct ScanOptions {
    /// All mtimes zero.
    pub use_epoch: bool,
    /// Leave out block and character devices.
    pub skip_devices: bool,
    /// Store no xattrs.
    pub skip_xattrs: bool,
    /// Store only user.* xattrs.
    pub user_xattrs: bool,
    /// Worker threads for digests (0: one per core).
    pub jobs: usize,
}

/// A scanned tree and where each external regular file came from.
pub struct Scan {
    pub tree: Tree,
    /// Source path of every regular file stored outside the image.
    pub sources: Vec<(InodeId, PathBuf)>,
}

/// A directory that cannot be scanned: the path and the reason.
#[derive(Debug, thiserror::Error)]
#[error("{}: {reason}", path.display())]
pub struct SourceError {
    pub path: PathBuf,
    pub reason: String,
}

/// Scans `root` (a directory) into a tree, with fs-verity digests and
/// object paths for external files and contents for small ones.
pub fn scan(_root: &Path, _opts: &ScanOptions) -> Result<Scan, SourceError> {
    todo!("directory scan")
}
