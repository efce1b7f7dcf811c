//! tilefs-store: the content-addressed object store.
//!
//! - [`layout`]: everything under a store's directory, named and
//!   documented in one place (a format description);
//! - [`store`]: the store directory, its lock and object names;
//! - [`ingest`]: putting source files into the store (clone or copy,
//!   digest while writing, durable before visible), with a digest cache;
//! - [`tags`]: named images kept in the store (gc roots);
//! - [`owned`]: images tilefs components hold (gc roots not the user's);
//! - [`fsck`]: proving a store is whole;
//! - [`mounts`]: live mounts, gc roots while they live;
//! - [`presence`]: which of many objects a store holds;
//! - [`placeholder`]: objects not fetched yet, of their size, that a
//!   kernel mount's filler fills on first access;
//! - [`remote`]: images pulled lazily, whose objects come on demand;
//! - [`alias`]: objects by the SHA-256 of their contents, for images
//!   pulled lazily from eStargz and zstd:chunked tables of contents;
//! - [`fetch_lock`]: objects being fetched, one fetch each across processes;
//! - [`gc`]: removing what no tagged or held image or live mount needs;
//! - [`verity`]: how mounts check objects against their image's digests.

pub mod alias;
pub mod fetch_lock;
pub mod file_state;
pub mod fsck;
pub mod gc;
pub mod ingest;
pub mod layout;
pub mod mounts;
pub mod owned;
pub mod placeholder;
pub mod presence;
pub mod remote;
pub mod store;
pub mod tags;
pub mod verity;

pub use file_state::FileState;
pub use store::{default_store_path, open_regular, parse_object_rel, LockMode, Store, StoreLock};
pub use verity::Verity;

use std::io;
use std::path::{Path, PathBuf};

/// A store operation that failed: what, where, and the OS's reason.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    // The cause is part of the message, so it is not also a `source()`:
    // printing the chain would say it twice.
    #[error("{}: {what}: {err}", path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        err: io::Error,
    },
    #[error("{}: the store is busy (a gc or build holds its lock)", .0.display())]
    Busy(PathBuf),
    #[error("{0}")]
    Invalid(String),
    /// Bytes fetched for an object that are not it (they do not have its
    /// fs-verity digest): nothing was stored, and asking again for the
    /// same bytes is no use.
    #[error("{}: does not match its fs-verity digest", .0.display())]
    Mismatch(PathBuf),
    /// A source file that is not what it was when the tree was read.
    #[error("{}: {msg}", path.display())]
    Source { path: PathBuf, msg: &'static str },
    /// The source being imported failed at `what`: reading it (a stream
    /// cut short, a file that cannot be read), or for a file, opening,
    /// linking or cloning it. Told apart from the store's own failures
    /// ([`StoreError::Io`]) by kind, as a fetch decides whether to try
    /// again by it; `path` names the source.
    #[error("{}: {what}: {err}", path.display())]
    SourceIo {
        path: PathBuf,
        what: &'static str,
        err: io::Error,
    },
    #[error("interrupted")]
    Interrupted,
}

impl StoreError {
    pub fn io(path: &Path, what: &'static str, source: io::Error) -> StoreError {
        StoreError::Io {
            path: path.to_path_buf(),
            what,
            err: source,
        }
    }

    pub fn source(path: &Path, msg: &'static str) -> StoreError {
        StoreError::Source {
            path: path.to_path_buf(),
            msg,
        }
    }

    pub fn source_io(path: &Path, what: &'static str, err: io::Error) -> StoreError {
        StoreError::SourceIo {
            path: path.to_path_buf(),
            what,
            err,
        }
    }

    /// True when the error is the disk being full.
    pub fn is_no_space(&self) -> bool {
        matches!(self, StoreError::Io { err, .. } if err.raw_os_error() == Some(libc::ENOSPC) || err.raw_os_error() == Some(libc::EDQUOT))
    }
}
