//! The tilefs FUSE server: serves an image and its store without privilege,
//! verifying each object against the image's digest before serving it.

use std::path::PathBuf;

/// How objects are checked before their data is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verity {
    /// Every object must match the digest in the image; files without a
    /// digest in the image are refused (EIO).
    Require,
    /// Objects with a digest in the image are checked; others are served.
    #[default]
    Auto,
    /// No checks.
    Off,
}

/// A FUSE mount request.
#[derive(Debug, Clone)]
pub struct FuseMount {
    pub image: PathBuf,
    pub store: PathBuf,
    pub mountpoint: PathBuf,
    pub verity: Verity,
    /// Stay in the foreground until unmounted (otherwise return once the
    /// mount is ready, leaving the server running in the background).
    pub foreground: bool,
    /// Worker threads (0: default).
    pub threads: usize,
}

/// Why a FUSE mount failed.
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    #[error("{0}")]
    Failed(String),
}

/// Mounts and serves `m`. Returns when the mount is ready (or, with
/// `foreground`, when it has been unmounted).
pub fn mount(_m: &FuseMount) -> Result<(), FuseError> {
    Err(FuseError::Failed("FUSE mounts are not implemented yet".into()))
}
