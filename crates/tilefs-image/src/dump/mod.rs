//! The composefs-dump(5) text format: one line per file, parsed into a
//! [`Tree`](crate::Tree) and printed from one.

mod parse;
mod print;

pub use parse::{parse, DumpError, ParseOptions};
pub use print::print;
