//! tilefs-image: the composefs image format.
//!
//! - [`tree`]: the in-memory tree model every input and output goes through;
//! - [`flat`]: the same in a compact, append-only form, which the dump parser
//!   and directory scanner fill for the writer when building images;
//! - [`dump`]: the composefs-dump(5) text format, parsed and printed;
//! - [`erofs`]: the EROFS metadata image in the composefs layout, written
//!   byte for byte as the reference `mkcomposefs` does, and read back with
//!   every offset checked;
//! - [`verity`]: fs-verity SHA-256 digests, which name objects in the store;
//! - [`source`]: building a tree from a directory on disk;
//! - [`upper`]: what a writable mount's upper directory records beyond
//!   overlayfs's markers (owners and types a server without privilege
//!   could not apply).

pub mod dump;
pub mod erofs;
pub mod flat;
// SHA-NI intrinsics are unsafe to call; the module checks the CPU first.
#[allow(unsafe_code)]
mod sha_x2;
pub mod source;
pub mod summary;
pub mod tree;
pub mod upper;
pub mod verity;

pub use tree::{Entry, FileType, Inode, InodeId, Timespec, Tree, TreeError, Xattr, ROOT};
