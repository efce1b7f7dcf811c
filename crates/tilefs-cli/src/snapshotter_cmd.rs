//! `tilefs snapshotter`: tilefs as a containerd snapshotter (proxy plugin),
//! see tilefs_snapshotter.

use crate::store_arg::StoreArg;
use anyhow::{anyhow, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use tilefs_snapshotter::{Config, DEFAULT_ROOT, DEFAULT_SOCKET};

#[derive(Args)]
pub struct SnapshotterArgs {
    /// Unix socket containerd connects to (its config's proxy_plugins address)
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// State directory: snapshot records, upper directories, image mounts
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArg,
    /// TOML file with `root`, `store` and `socket` (options given on the command line win)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    root: Option<PathBuf>,
    store: Option<PathBuf>,
    socket: Option<PathBuf>,
}

pub fn run(a: SnapshotterArgs) -> Result<ExitCode> {
    let file: FileConfig = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?;
            toml::from_str(&text).map_err(|e| anyhow!("{}: {}", p.display(), e.message()))?
        }
        None => FileConfig::default(),
    };
    let store = match (a.store.store.clone(), file.store) {
        (Some(s), _) | (None, Some(s)) => s,
        (None, None) => a.store.path()?,
    };
    let cfg = Config {
        root: a.root.or(file.root).unwrap_or_else(|| DEFAULT_ROOT.into()),
        store,
        socket: a.socket.or(file.socket).unwrap_or_else(|| DEFAULT_SOCKET.into()),
    };
    tilefs_snapshotter::serve(&cfg, |sock| {
        eprintln!("tilefs snapshotter: serving on {}", sock.display())
    })
    .map_err(|e| anyhow!(e))?;
    Ok(ExitCode::SUCCESS)
}
