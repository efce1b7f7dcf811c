//! `tilefs mountd`: the mount service (see tilefs_mount::mountd).

use anyhow::{anyhow, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use tilefs_mount::mountd::server;

#[derive(Args)]
pub struct MountdArgs {
    /// Socket to listen on (ignored when systemd passes one: socket activation)
    #[arg(long, value_name = "PATH", default_value = server::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Policy: which users may mount which stores' tagged images (TOML; see the README)
    #[arg(long, value_name = "FILE", default_value = server::DEFAULT_POLICY)]
    pub policy: PathBuf,
}

pub fn run(a: MountdArgs) -> Result<ExitCode> {
    server::run(&a.socket, &a.policy).map_err(|e| anyhow!(e))?;
    Ok(ExitCode::SUCCESS)
}
