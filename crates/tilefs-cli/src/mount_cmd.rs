//! `tilefs mount` and `tilefs umount`.

use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct MountArgs {
    /// Object store directory
    #[arg(long)]
    pub store: PathBuf,
    /// Image file, or a tag in the store
    pub image: PathBuf,
    /// Where to mount
    pub mountpoint: PathBuf,
    /// Mount with the kernel (EROFS + overlayfs; needs privilege)
    #[arg(long, conflicts_with = "fuse")]
    pub kernel: bool,
    /// Mount with the tilefs FUSE server (works without privilege)
    #[arg(long)]
    pub fuse: bool,
}

#[derive(Args)]
pub struct UmountArgs {
    /// Mount point
    pub mountpoint: PathBuf,
}

pub fn mount(_a: MountArgs) -> Result<ExitCode> {
    bail!("not implemented yet")
}

pub fn umount(_a: UmountArgs) -> Result<ExitCode> {
    bail!("not implemented yet")
}
