//! `tilefs build`: a directory or a dump in, an image out.

use crate::output;
use crate::progress::{self, Progress};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tilefs_image::erofs::{self, WriteOptions};
use tilefs_image::flat::FlatTree;
use tilefs_image::{dump, source, verity};
use tilefs_store::ingest::{Ingest, Method};
use tilefs_store::{tags, Store};

#[derive(Args)]
pub struct BuildArgs {
    /// Source directory, or with --from-dump a composefs-dump(5) file (`-` for stdin; gzip is detected)
    pub source: PathBuf,
    /// Image file to write (`-` for stdout); written atomically
    #[arg(required_unless_present_any = ["print_digest_only", "tag"])]
    pub image: Option<PathBuf>,
    /// Object store: put every file's contents there (as STORE/XX/YYYY..., by fs-verity digest)
    #[arg(long, value_name = "STORE")]
    pub store: Option<PathBuf>,
    /// Record the image in the store (--store, or the default store) under this name; tagged
    /// images are gc roots
    #[arg(long, value_name = "NAME")]
    pub tag: Option<String>,
    /// Hardlink source files into the store instead of copying (same filesystem only; a later
    /// change to a source file then changes the object too, which fsck reports)
    #[arg(long)]
    pub hardlink: bool,
    /// No progress display
    #[arg(short, long)]
    pub quiet: bool,
    /// Print a JSON summary (files, bytes, new objects, deduplicated bytes, seconds)
    #[arg(long)]
    pub json: bool,
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
    /// Threads reading and digesting files (the default is 8 per core: reads of a cold tree wait on
    /// the disk)
    #[arg(short, long, default_value_t = source::worker_threads(0), value_name = "N")]
    pub jobs: usize,
    /// Keep hardlinks of a source directory: names of one file share one inode (and st_nlink) in the
    /// image. Off by default, as mkcomposefs, whose images this then matches byte for byte
    #[arg(long)]
    pub hardlinks: bool,
}

/// A build stopped by SIGINT or SIGTERM (exit status 130).
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// Removes a store directory this build created, unless the build
/// succeeded: a failed build leaves no store behind.
pub(crate) struct NewStore(pub(crate) Option<PathBuf>);

impl Drop for NewStore {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

pub fn run(a: BuildArgs) -> Result<ExitCode> {
    let started = Instant::now();
    // glibc raises its mmap threshold to the size of each large block
    // freed, after which a scan's freed listings and grown tables stayed
    // resident in the thread arenas: /usr/share into a store peaked at
    // 74 MB with 30 MB of it free, 62 MB with the threshold kept.
    tilefs_sys::mem::fix_mmap_threshold(128 << 10);
    if a.source.as_os_str().is_empty() {
        bail!("empty source path");
    }
    if let Some(tag) = &a.tag {
        tags::validate_tag(tag)?;
    }
    // Everything that can be checked is, before any work: the output and
    // the store.
    if let Some(path) = a.image.as_deref().filter(|_| !a.print_digest_only) {
        output::check_writable(path)?;
    }
    // A tag needs a store: the default one unless --store names another.
    let store_path = match (&a.store, &a.tag) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(_)) => Some(tilefs_store::default_store_path()?),
        (None, None) if a.hardlink => bail!("--hardlink needs --store or --tag"),
        (None, None) => None,
    };
    let mut new_store = NewStore(None);
    let store = match &store_path {
        Some(p) => {
            let existed = std::fs::symlink_metadata(p).is_ok();
            let s = Store::create(p)?;
            if !existed {
                new_store.0 = Some(p.clone());
            }
            Some(s)
        }
        None => None,
    };
    // SIGINT and SIGTERM stop the import at the next file; the error path
    // then removes temporary files and keeps the digests learnt.
    let cancel = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, cancel.clone()).context("cannot handle signals")?;
    }
    let interrupted = |e: anyhow::Error| {
        if cancel.load(Relaxed) {
            anyhow::Error::new(Interrupted)
        } else {
            e
        }
    };
    // Held until the image is tagged, so a gc cannot remove new objects.
    let ingest = match &store {
        Some(s) => {
            let method = if a.hardlink { Method::Hardlink } else { Method::Copy };
            let mut i = Ingest::new(s, method)?;
            i.set_cancel(cancel.clone());
            Some(i)
        }
        None => None,
    };
    let progress_counters = Arc::new(source::ScanProgress::default());
    let (tree, entries) = if a.from_dump {
        let tree = read_dump(&a.source, a.strict)?;
        let n = tree.len() as u64;
        (tree, n)
    } else {
        let opts = source::ScanOptions {
            use_epoch: a.use_epoch,
            skip_devices: a.skip_devices,
            skip_xattrs: a.skip_xattrs,
            user_xattrs: a.user_xattrs,
            jobs: a.jobs,
            progress: Some(progress_counters.clone()),
            hardlinks: a.hardlinks,
            cancel: Some(cancel.clone()),
        };
        let _display = progress::enabled(a.quiet || a.json).then(|| {
            let c = progress_counters.clone();
            let total = progress::measure_in_background(a.source.clone(), 0);
            Progress::bytes(
                "importing",
                "files",
                move || (c.files.load(Relaxed), c.bytes.load(Relaxed)),
                total,
            )
        });
        let sink = ingest.as_ref().map(|i| i as &dyn source::ContentSink);
        let tree = match source::scan_flat(&a.source, &opts, sink) {
            Ok(tree) => tree,
            Err(e) => {
                if let (Some(i), true) = (&ingest, cancel.load(Relaxed)) {
                    // What was imported is kept (committed objects, the
                    // digests learnt) for the next try; temporary files go.
                    let _ = i.save_cache();
                    new_store.0 = None;
                }
                return Err(interrupted(e.into()));
            }
        };
        // The scan's worker threads freed their buffers and listings into
        // their own malloc arenas, where the image written next cannot use
        // them: give those pages back.
        tilefs_sys::mem::trim_heap();
        (tree, progress_counters.entries.load(Relaxed) + 1)
    };
    let stats = match &ingest {
        Some(i) => {
            let s = i.finish()?;
            if s.replaced > 0 && !a.quiet {
                eprintln!(
                    "tilefs: note: replaced {} damaged object{} (wrong size) in {}",
                    s.replaced,
                    if s.replaced == 1 { "" } else { "s" },
                    store_path.as_deref().unwrap_or(Path::new("the store")).display()
                );
            }
            if let Some(w) = i.verity_warning() {
                if !a.quiet {
                    eprintln!("tilefs: note: {w}");
                }
            }
            Some(s)
        }
        None => None,
    };
    let opts = WriteOptions {
        min_version: a.min_version,
        max_version: a.max_version,
    };
    // The image's fs-verity digest, only computed when it is shown.
    let want_digest = a.print_digest || a.print_digest_only || a.json || (a.tag.is_some() && a.image.is_none());
    let cannot_build = || format!("cannot build from {}", a.source.display());
    let file_out = a
        .image
        .as_deref()
        .filter(|p| !a.print_digest_only && p.as_os_str() != "-");
    let (image_bytes, version, digest, bytes) = match file_out {
        Some(path) => {
            // Streamed into the file: the image is never whole in memory.
            let mut written = None;
            output::write_atomic_with(path, |f| {
                let (len, version) = erofs::write_flat_to(&tree, &opts, f).with_context(cannot_build)?;
                let digest = match want_digest {
                    true => {
                        Some(verity::digest_file(f, |_| {}).with_context(|| format!("reading {}", path.display()))?)
                    }
                    false => None,
                };
                written = Some((len, version, digest));
                Ok(())
            })?;
            let (len, version, digest) = written.context("internal error: image not written")?;
            (len, version, digest, None)
        }
        None => {
            let (bytes, version) = erofs::write_flat(&tree, &opts).with_context(cannot_build)?;
            let digest = want_digest.then(|| verity::digest_bytes(&bytes));
            if let Some(path) = a.image.as_deref().filter(|_| !a.print_digest_only) {
                output::write_atomic(path, &bytes)?;
            }
            (bytes.len() as u64, version, digest, Some(bytes))
        }
    };
    let digest_hex = || digest.map(hex::encode).unwrap_or_default();
    if let (Some(store), Some(tag)) = (&store, &a.tag) {
        if !a.print_digest_only {
            let bytes = match (&bytes, file_out) {
                (Some(b), _) => std::borrow::Cow::Borrowed(&b[..]),
                (None, Some(path)) => {
                    std::borrow::Cow::Owned(std::fs::read(path).with_context(|| format!("reading {}", path.display()))?)
                }
                (None, None) => bail!("internal error: no image to tag"),
            };
            tags::write_tag(store, tag, &bytes)?;
            if a.image.is_none() && !a.quiet && !a.json {
                eprintln!(
                    "tilefs: tagged {tag:?} in {} (digest {})",
                    store.path().display(),
                    digest_hex()
                );
            }
        }
    }
    if let Some(store) = store.as_ref().filter(|_| a.from_dump) {
        let missing = tree
            .objects()
            .into_iter()
            .filter(|o| tilefs_store::parse_object_rel(o).is_none_or(|d| !store.has_object(&d)))
            .count();
        if missing > 0 && !a.quiet {
            eprintln!(
                "tilefs: note: {missing} objects the image references are not in {}",
                store.path().display()
            );
        }
    }
    drop(ingest);
    new_store.0 = None;
    if a.print_digest || a.print_digest_only {
        println!("{}", digest_hex());
    }
    if a.json {
        let s = stats.unwrap_or_default();
        let report = serde_json::json!({
            "image": a.image.as_ref().map(|p| p.display().to_string()),
            "tag": a.tag,
            "digest": digest_hex(),
            "image_bytes": image_bytes,
            "format_version": version,
            "entries": entries,
            "files": progress_counters.files.load(Relaxed),
            "bytes": progress_counters.bytes.load(Relaxed),
            "new_objects": s.new_objects,
            "new_bytes": s.new_bytes,
            "deduplicated_bytes": s.dedup_bytes,
            "cache_hits": s.cache_hits,
            "replaced_objects": s.replaced,
            "seconds": started.elapsed().as_secs_f64(),
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// Parses a dump file (or stdin), transparently gunzipping it.
pub fn read_dump(path: &Path, strict: bool) -> Result<FlatTree> {
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
    dump::parse_flat(input, dump::ParseOptions { strict }).with_context(|| format!("{}", path.display()))
}
