//! Helpers shared by the image crate's tests: the composefs vectors and
//! the reference tools.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// Fails the test when the machine lacks what it needs (`why`), rather
/// than letting it pass without having run. What machines truly lack (the
/// reference tools) is asked for by tests marked `#[ignore = "needs ..."]`.
#[track_caller]
pub fn require(why: Option<String>) {
    if let Some(why) = why {
        panic!("this test cannot run here: {why}");
    }
}

/// The composefs vectors: `$TILEFS_ASSETS`, by default
/// ../shared/composefs-assets beside the checkout.
pub fn assets_dir() -> PathBuf {
    let dir = std::env::var_os("TILEFS_ASSETS").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/composefs-assets"),
        PathBuf::from,
    );
    require((!dir.is_dir()).then(|| format!("no composefs vectors at {} (set TILEFS_ASSETS)", dir.display())));
    dir
}

/// A reference composefs tool in `$TILEFS_REF_BIN` (default /work/ref/bin):
/// the tests that use one are ignored, so one asked for (`--ignored`)
/// must be there.
pub fn ref_bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("TILEFS_REF_BIN").map_or_else(|| PathBuf::from("/work/ref/bin"), PathBuf::from);
    let bin = dir.join(name);
    require((!bin.is_file()).then(|| format!("reference {} not found (set TILEFS_REF_BIN)", bin.display())));
    bin
}
