//! `tilefs dump`, `info` and `objects`: reading images back.

use crate::store_arg::StoreArg;
use anyhow::{Context, Result};
use clap::Args;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tilefs_image::erofs::{self, ImageInfo};
use tilefs_image::{dump, summary, verity, Tree};

#[derive(Args)]
pub struct DumpArgs {
    /// Image files or tags in the store (`-` reads stdin); several are printed one after another,
    /// each starting with its root line `/`
    #[arg(required = true)]
    pub images: Vec<PathBuf>,
    #[command(flatten)]
    pub store: StoreArg,
}

#[derive(Args)]
pub struct InfoArgs {
    /// Image file or tag in the store (`-` reads stdin)
    pub image: PathBuf,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub store: StoreArg,
}

#[derive(Args)]
pub struct ObjectsArgs {
    /// Image files or tags in the store (`-` reads stdin); the objects any of them references are
    /// listed once each, sorted
    #[arg(required = true)]
    pub images: Vec<PathBuf>,
    #[command(flatten)]
    pub store: StoreArg,
}

/// An image read from disk.
pub struct Loaded {
    pub bytes: Vec<u8>,
    pub tree: Tree,
    pub info: ImageInfo,
}

/// Reads an image file (`-`: stdin) and parses it.
pub fn load(path: &Path) -> Result<Loaded> {
    let bytes = if path.as_os_str() == "-" {
        let mut b = Vec::new();
        std::io::stdin()
            .lock()
            .read_to_end(&mut b)
            .context("cannot read stdin")?;
        b
    } else {
        std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?
    };
    let (tree, info) = erofs::read_image(&bytes).with_context(|| format!("{}", path.display()))?;
    Ok(Loaded { bytes, tree, info })
}

/// Loads each IMAGE argument (file, tag or `-`), in order.
fn load_all<'a>(store: &'a StoreArg, images: &'a [PathBuf]) -> impl Iterator<Item = Result<Loaded>> + 'a {
    images.iter().map(|i| load(&store.resolve_image(i)?))
}

pub fn dump(a: DumpArgs) -> Result<ExitCode> {
    let mut out = BufWriter::with_capacity(256 * 1024, std::io::stdout().lock());
    for img in load_all(&a.store, &a.images) {
        dump::print(&img?.tree, &mut out)?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

pub fn objects(a: ObjectsArgs) -> Result<ExitCode> {
    let mut all = std::collections::BTreeSet::new();
    for img in load_all(&a.store, &a.images) {
        all.extend(summary::objects(&img?.tree).into_iter().map(<[u8]>::to_vec));
    }
    let mut out = BufWriter::new(std::io::stdout().lock());
    for o in all {
        out.write_all(&o)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

#[derive(serde::Serialize)]
struct InfoReport<'a> {
    image: String,
    image_bytes: u64,
    digest: String,
    format_version: u32,
    has_acl: bool,
    #[serde(flatten)]
    summary: &'a summary::Summary,
}

pub fn info(a: InfoArgs) -> Result<ExitCode> {
    let img = load(&a.store.resolve_image(&a.image)?)?;
    let s = summary::summarize(&img.tree);
    let report = InfoReport {
        image: a.image.display().to_string(),
        image_bytes: img.bytes.len() as u64,
        digest: hex::encode(verity::digest_bytes(&img.bytes)),
        format_version: img.info.version,
        has_acl: img.info.has_acl,
        summary: &s,
    };
    let mut out = std::io::stdout().lock();
    if a.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
        return Ok(ExitCode::SUCCESS);
    }
    writeln!(out, "image:            {}", report.image)?;
    writeln!(out, "image size:       {} bytes", report.image_bytes)?;
    writeln!(out, "fs-verity digest: {}", report.digest)?;
    writeln!(out, "format version:   {}", report.format_version)?;
    writeln!(out, "POSIX ACLs:       {}", if report.has_acl { "yes" } else { "no" })?;
    writeln!(out, "inodes:           {}", s.inodes)?;
    writeln!(out, "  directories:    {}", s.directories)?;
    writeln!(
        out,
        "  regular files:  {} ({} inline, {} external, {} empty)",
        s.regular_files,
        s.inline_files,
        s.external_files,
        s.regular_files - s.inline_files - s.external_files
    )?;
    writeln!(out, "  symlinks:       {}", s.symlinks)?;
    writeln!(out, "  block devices:  {}", s.block_devices)?;
    writeln!(out, "  char devices:   {}", s.char_devices)?;
    writeln!(out, "  fifos:          {}", s.fifos)?;
    writeln!(out, "  sockets:        {}", s.sockets)?;
    writeln!(out, "  whiteouts:      {}", s.whiteouts)?;
    writeln!(out, "extra hardlinks:  {}", s.hardlinks)?;
    writeln!(out, "inline bytes:     {}", s.inline_bytes)?;
    writeln!(out, "external bytes:   {}", s.external_bytes)?;
    writeln!(out, "objects:          {}", s.objects)?;
    if s.unverified_files > 0 {
        writeln!(out, "without digest:   {} files", s.unverified_files)?;
    }
    Ok(ExitCode::SUCCESS)
}
