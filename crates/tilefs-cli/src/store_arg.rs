//! The `--store` option every store command shares, with its default.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Clone, Debug, Default)]
pub struct StoreArg {
    /// Object store directory [default: $TILEFS_STORE, else /var/lib/tilefs/store for root and
    /// $XDG_DATA_HOME/tilefs/store for other users]
    #[arg(long = "store", value_name = "STORE")]
    pub store: Option<PathBuf>,
}

impl StoreArg {
    /// The store directory: the one given, or the default.
    pub fn path(&self) -> Result<PathBuf> {
        match &self.store {
            Some(p) => Ok(p.clone()),
            None => Ok(tilefs_store::default_store_path()?),
        }
    }
}
