//! Reads a composefs EROFS image back into a tree, checking every offset.

use crate::tree::Tree;

/// What the image says about itself beyond the tree.
#[derive(Debug, Clone, Default)]
pub struct ImageInfo {
    /// composefs format version from the header (0 or 1).
    pub version: u32,
    /// Header flag: the image has POSIX ACLs.
    pub has_acl: bool,
}

/// An image that cannot be read, and why.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("not a composefs image: {0}")]
    NotComposefs(String),
    #[error("corrupt image: {0}")]
    Corrupt(String),
}

/// Reads a whole image into a tree.
pub fn read_image(_image: &[u8]) -> Result<(Tree, ImageInfo), ImageError> {
    todo!("image reader")
}
