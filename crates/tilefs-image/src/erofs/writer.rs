//! Writes a tree as a composefs EROFS image.
use crate::tree::Tree;
use std::io::{self, Write};

#[derive(Debug, Clone, Copy)]
pub struct WriteOptions {
    pub min_version: u32,
    pub max_version: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error(transparent)]
    Io(#[from] io::Error),
}

pub fn write_image(_tree: &Tree, _opts: &WriteOptions, _out: &mut impl Write) -> Result<[u8; 32], WriteError> {
    todo!()
}
