//! The composefs-dump(5) text format: one line per file, parsed into a
//! [`Tree`](crate::Tree) and printed from one.

mod parse;
mod print;

pub use parse::{parse, parse_flat, DumpError, ParseOptions};
pub use print::print;
