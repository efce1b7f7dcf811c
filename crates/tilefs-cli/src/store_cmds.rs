//! `tilefs images`, `untag`, `fsck`, `gc`: looking after a store.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct ImagesArgs {
    /// Object store directory
    #[arg(long)]
    pub store: PathBuf,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct UntagArgs {
    /// Object store directory
    #[arg(long)]
    pub store: PathBuf,
    /// Tag to remove (its objects stay until gc)
    pub name: String,
}

#[derive(Args)]
pub struct FsckArgs {
    /// Object store directory
    #[arg(long)]
    pub store: PathBuf,
    /// Move corrupt objects and strays aside, to STORE/.quarantine
    #[arg(long)]
    pub repair: bool,
    /// Threads (default: one per core)
    #[arg(short, long, default_value_t = 0, value_name = "N")]
    pub jobs: usize,
    /// No progress display
    #[arg(short, long)]
    pub quiet: bool,
    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct GcArgs {
    /// Object store directory
    #[arg(long)]
    pub store: PathBuf,
    /// Show what would be removed, remove nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,
}

pub fn images(_a: ImagesArgs) -> Result<ExitCode> {
    todo!()
}

pub fn untag(_a: UntagArgs) -> Result<ExitCode> {
    todo!()
}

pub fn fsck(_a: FsckArgs) -> Result<ExitCode> {
    todo!()
}

pub fn gc(_a: GcArgs) -> Result<ExitCode> {
    todo!()
}
