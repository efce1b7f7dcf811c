//! composefs-dump(5) printer.

use crate::tree::Tree;
use std::io::{self, Write};

/// Prints `tree` as dump text, one line per entry, depth-first in name order.
pub fn print(_tree: &Tree, _out: &mut impl Write) -> io::Result<()> {
    todo!("dump printer")
}
