//! The `--store` option every store command shares, with its default.

use anyhow::Result;
use clap::Args;
use std::path::{Path, PathBuf};
use tilefs_store::{tags, Store};

#[derive(Args, Clone, Debug, Default)]
pub struct StoreArg {
    /// Object store directory [default: $TILEFS_STORE, else /var/lib/tilefs/store for root and
    /// $XDG_DATA_HOME/tilefs/store for other users]
    #[arg(long = "store", value_name = "STORE")]
    pub store: Option<PathBuf>,
}

impl StoreArg {
    /// An IMAGE argument: `-` (stdin, returned as is), an existing file, or
    /// else a tag in the store (the one given, or the default).
    pub fn resolve_image(&self, arg: &Path) -> Result<PathBuf> {
        if arg.as_os_str() == "-" || std::fs::metadata(arg).is_ok_and(|m| !m.is_dir()) {
            return Ok(arg.to_path_buf());
        }
        let store = self.path()?;
        match Store::open(&store) {
            Ok(s) => Ok(tags::resolve_image(Some(&s), arg)?),
            // No default store yet: the image is simply not there.
            Err(_) if self.store.is_none() => anyhow::bail!(
                "{}: no such image file, and no tag of that name (the default store {} does not exist)",
                arg.display(),
                store.display()
            ),
            Err(e) => Err(e.into()),
        }
    }

    /// The store directory: the one given, or the default.
    pub fn path(&self) -> Result<PathBuf> {
        match &self.store {
            Some(p) => Ok(p.clone()),
            None => Ok(tilefs_store::default_store_path()?),
        }
    }
}
