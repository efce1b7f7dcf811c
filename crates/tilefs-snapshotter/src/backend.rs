//! What the snapshots' state machine ([`crate::snapshots`]) asks of the
//! store and the kernel: store a committed layer and make its chain's
//! image, make a lazy chain's image, mount and unmount an image, let go of
//! one. [`crate::store_backend`] is the real one; the unit tests run the
//! state machine over one in memory.

use crate::error::Result;
use crate::layer::LayerUsage;
use crate::state::Record;
use std::any::Any;
use std::path::Path;
use tilefs_oci::lazy_index::LazyKind;
use tilefs_oci::pull::PullOptions;
use tilefs_oci::ImageRef;

/// A snapshot's layer, stored.
#[derive(Debug, Clone)]
pub struct Stored {
    /// Its chain's image: fs-verity digest (hex).
    pub image: String,
    pub usage: LayerUsage,
}

/// A hold on an upper directory that no live overlay has: while it lives,
/// none takes it ([`crate::claim`]).
pub type Hold = Box<dyn Any + Send>;

/// The store and the kernel, for the state machine. Every image is held as
/// one snapshot's (by its id) until released.
pub trait Backend: Send + Sync + 'static {
    /// Stores pending snapshot `id`'s layer (its upper directory
    /// `ROOT/snapshots/ID/fs`) over the committed layers `chain` (oldest
    /// first) and makes the image of the chain and it, held as `id`'s.
    fn store_layer(&self, id: u64, chain: &[u64]) -> Result<Stored>;

    /// Undoes what a [`Backend::store_layer`] of `id` that failed (or that
    /// a crash ended) did: its image let go, its upper directory's files
    /// given back as they were. Nothing to undo is no error.
    fn undo_store(&self, id: u64) -> Result<()>;

    /// Makes the image of the first `n` layers of the image planned
    /// `kind` (served lazily), held as `id`'s: its digest (hex) and how
    /// many of its files are still to be fetched.
    fn build_chain(&self, id: u64, kind: &LazyKind, n: usize) -> Result<(String, u64)>;

    /// Pulls the runnable artifact `reference` lazily, its image held as
    /// `id`'s: the image's digest (hex).
    fn pull_lazy(&self, id: u64, reference: &ImageRef, opts: &PullOptions) -> Result<String>;

    /// Mounts committed snapshot `r`'s image, read-only, at the directory
    /// `at`.
    fn mount(&self, r: &Record, at: &Path) -> Result<()>;

    /// Whether an image is mounted at `at`.
    fn is_mounted(&self, at: &Path) -> bool;

    /// Whether the image mounted at `at` has its files' data read from the
    /// store, as the data-only lower of the overlays over it (an EROFS
    /// mount), rather than serving it itself (a lazy image's FUSE server).
    fn needs_data_lower(&self, at: &Path) -> bool;

    /// Unmounts what is mounted at `at` (nothing: nothing to do).
    fn unmount(&self, at: &Path);

    /// Lets go of snapshot `id`'s image, if it has one; with `collect`,
    /// the objects it named are collected later unless another image names
    /// them.
    fn release(&self, id: u64, collect: bool) -> Result<()>;

    /// The ids of the snapshots whose images are held.
    fn held(&self) -> Result<Vec<u64>>;

    /// Holds the upper directory `upper` if no live overlay has it (None:
    /// one has, or it cannot be told, and the directory is left alone).
    /// `scratch` is a directory beside it the hold may use.
    fn hold_upper(&self, upper: &Path, scratch: &Path) -> Option<Hold>;

    /// Syncs the store's filesystem.
    fn sync(&self) -> Result<()>;

    /// Checks the objects of committed snapshot `id`'s layer against their
    /// digests, removing the damaged ones: how many were.
    fn check_layer(&self, id: u64) -> Result<usize>;

    /// The data-only lower directory of the mounts of images that are not
    /// lazy (the store).
    fn data_lower(&self) -> &Path;
}
