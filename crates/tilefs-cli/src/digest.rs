//! `tilefs digest`: fs-verity digests of files.

use crate::store_arg::StoreArg;
use anyhow::{Context, Result};
use clap::Args;
use rayon::prelude::*;
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use tilefs_image::verity;

#[derive(Args)]
pub struct DigestArgs {
    /// Files to digest, or tags in the store (their images' digests)
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    #[command(flatten)]
    pub store: StoreArg,
    /// Print only the hex digest, one a line
    #[arg(long)]
    pub compact: bool,
}

pub fn run(a: DigestArgs) -> Result<ExitCode> {
    let results: Vec<Result<[u8; 32]>> = a
        .files
        .par_iter()
        .map(|p| {
            let p = &a.store.resolve_image(p)?;
            let f = File::open(p).with_context(|| format!("cannot open {}", p.display()))?;
            verity::digest_file(&f, |_| {}).with_context(|| format!("cannot read {}", p.display()))
        })
        .collect();
    let mut out = std::io::stdout().lock();
    let mut failed = false;
    for (path, r) in a.files.iter().zip(results) {
        match r {
            Ok(d) if a.compact => writeln!(out, "{}", hex::encode(d))?,
            Ok(d) => writeln!(out, "sha256:{} {}", hex::encode(d), path.display())?,
            Err(e) => {
                eprintln!("tilefs: {e:#}");
                failed = true;
            }
        }
    }
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
