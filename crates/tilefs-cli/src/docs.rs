//! `tilefs completions` and `tilefs man`: shell completions and man pages,
//! generated from the same definitions as `--help`.

use anyhow::{Context, Result};
use clap::{Args, CommandFactory};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct CompletionsArgs {
    /// The shell
    pub shell: clap_complete::Shell,
}

#[derive(Args)]
pub struct ManArgs {
    /// Directory to write tilefs.1 and tilefs-COMMAND.1 into (created if needed)
    pub dir: PathBuf,
}

pub fn completions<C: CommandFactory>(a: CompletionsArgs) -> Result<ExitCode> {
    let mut cmd = C::command();
    let name = cmd.get_name().to_string();
    clap_complete::generate(a.shell, &mut cmd, name, &mut std::io::stdout());
    Ok(ExitCode::SUCCESS)
}

pub fn man<C: CommandFactory>(a: ManArgs) -> Result<ExitCode> {
    std::fs::create_dir_all(&a.dir).with_context(|| format!("cannot create {}", a.dir.display()))?;
    let cmd = C::command();
    clap_mangen::generate_to(cmd, &a.dir)
        .with_context(|| format!("cannot write man pages into {}", a.dir.display()))?;
    Ok(ExitCode::SUCCESS)
}
