//! `tilefs build`: a directory or a dump in, an image out.

use crate::output;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tilefs_image::erofs::{self, WriteOptions};
use tilefs_image::{dump, source, Tree};

#[derive(Args)]
pub struct BuildArgs {
    /// Source directory, or with --from-dump a composefs-dump(5) file (`-` for stdin; gzip is detected)
    pub source: PathBuf,
    /// Image file to write (`-` for stdout); written atomically
    #[arg(required_unless_present = "print_digest_only")]
    pub image: Option<PathBuf>,
    /// SOURCE is a composefs-dump(5) file, not a directory
    #[arg(long, visible_alias = "from-file")]
    pub from_dump: bool,
    /// Refuse dumps that the reference accepts only leniently (missing final newline, rdev on non-devices, symlink size mismatch)
    #[arg(long)]
    pub strict: bool,
    /// Lowest image format version to write
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub min_version: u32,
    /// Highest image format version to write (1 when the tree has whiteouts and this allows it)
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub max_version: u32,
    /// Set every mtime to zero (directory sources)
    #[arg(long)]
    pub use_epoch: bool,
    /// Leave out block and character devices (directory sources)
    #[arg(long)]
    pub skip_devices: bool,
    /// Store no xattrs (directory sources)
    #[arg(long, conflicts_with = "user_xattrs")]
    pub skip_xattrs: bool,
    /// Store only user.* xattrs (directory sources)
    #[arg(long)]
    pub user_xattrs: bool,
    /// Print the image's fs-verity digest
    #[arg(long)]
    pub print_digest: bool,
    /// Print the image's fs-verity digest and write no image
    #[arg(long, conflicts_with = "image")]
    pub print_digest_only: bool,
    /// Threads for digesting files (default: one per core)
    #[arg(short, long, default_value_t = 0, value_name = "N")]
    pub jobs: usize,
}

pub fn run(a: BuildArgs) -> Result<ExitCode> {
    if a.source.as_os_str().is_empty() {
        bail!("empty source path");
    }
    let tree = if a.from_dump {
        read_dump(&a.source, a.strict)?
    } else {
        let opts = source::ScanOptions {
            use_epoch: a.use_epoch,
            skip_devices: a.skip_devices,
            skip_xattrs: a.skip_xattrs,
            user_xattrs: a.user_xattrs,
            jobs: a.jobs,
        };
        source::scan(&a.source, &opts)?.tree
    };
    let opts = WriteOptions {
        min_version: a.min_version,
        max_version: a.max_version,
    };
    let image =
        erofs::write_image(&tree, &opts).with_context(|| format!("cannot build from {}", a.source.display()))?;
    if let Some(path) = a.image.as_deref().filter(|_| !a.print_digest_only) {
        output::write_atomic(path, &image.bytes)?;
    }
    if a.print_digest || a.print_digest_only {
        println!("{}", hex::encode(image.digest));
    }
    Ok(ExitCode::SUCCESS)
}

/// Parses a dump file (or stdin), transparently gunzipping it.
pub fn read_dump(path: &Path, strict: bool) -> Result<Tree> {
    let input: Box<dyn Read> = if path.as_os_str() == "-" {
        Box::new(io::stdin().lock())
    } else {
        Box::new(File::open(path).with_context(|| format!("cannot open {}", path.display()))?)
    };
    let mut input = BufReader::with_capacity(256 * 1024, input);
    let gz = input.fill_buf().map(|b| b.starts_with(&[0x1f, 0x8b])).unwrap_or(false);
    let input: Box<dyn BufRead> = if gz {
        Box::new(BufReader::with_capacity(
            256 * 1024,
            flate2::bufread::MultiGzDecoder::new(input),
        ))
    } else {
        Box::new(input)
    };
    dump::parse(input, dump::ParseOptions { strict }).with_context(|| format!("{}", path.display()))
}
