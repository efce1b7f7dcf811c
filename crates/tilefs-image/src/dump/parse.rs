//! composefs-dump(5) parser.

use crate::tree::Tree;
use std::io::BufRead;

/// How strictly to parse.
#[derive(Debug, Clone, Copy, Default)]
pub struct ParseOptions {
    /// Refuse what the reference accepts only in its lenient mode.
    pub strict: bool,
}

/// A dump that cannot be parsed: the line (1-based, 0 when not tied to a
/// line) and the reason.
#[derive(Debug, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct DumpError {
    pub line: usize,
    pub reason: String,
}

/// Parses a whole dump into a tree.
pub fn parse(_input: impl BufRead, _opts: ParseOptions) -> Result<Tree, DumpError> {
    todo!("dump parser")
}
