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
use tilefs_store::ingest::{Ingest, Method, StatsSnapshot};
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
    /// Retired: an object hardlinked to a source file changed whenever the file did. Builds
    /// clone (FICLONE) where the filesystem can and copy otherwise; drop the option
    #[arg(long, hide = true)]
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
    check_args(&a)?;
    let store_path = store_path(&a)?;
    let mut new_store = NewStore(None);
    let store = match &store_path {
        Some(p) => Some(open_store(p, &mut new_store)?),
        None => None,
    };
    // SIGINT and SIGTERM stop the import at the next file; the error path
    // then removes temporary files and keeps the digests learnt.
    let cancel = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, cancel.clone()).context("cannot handle signals")?;
    }
    // Held until the image is tagged, so a gc cannot remove new objects.
    let ingest = match &store {
        Some(s) => {
            let mut i = Ingest::new(s, Method::Copy)?;
            i.set_cancel(cancel.clone());
            Some(i)
        }
        None => None,
    };
    let counters = Arc::new(source::ScanProgress::default());
    let (tree, entries) = if a.from_dump {
        let tree = read_dump(&a.source, a.strict)?;
        let n = tree.len() as u64;
        (tree, n)
    } else {
        let tree = scan(&a, ingest.as_ref(), &cancel, &counters, &mut new_store)?;
        (tree, counters.entries.load(Relaxed) + 1)
    };
    let stats = match &ingest {
        Some(i) => Some(finish_ingest(i, a.quiet, store_path.as_deref())?),
        None => None,
    };
    let image = write_image(&a, &tree)?;
    if let (Some(store), Some(tag)) = (&store, &a.tag) {
        if !a.print_digest_only {
            tag_image(store, tag, &a, &image)?;
        }
    }
    if let Some(store) = store.as_ref().filter(|_| a.from_dump && !a.quiet) {
        note_missing_objects(store, &tree);
    }
    drop(ingest);
    new_store.0 = None;
    if a.print_digest || a.print_digest_only {
        println!("{}", image.digest_hex());
    }
    if a.json {
        let report = json_report(&a, &image, entries, &counters, stats.unwrap_or_default(), started);
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// Everything that can be checked is, before any work: the source, the
/// tag and the output (and then the store).
fn check_args(a: &BuildArgs) -> Result<()> {
    if a.hardlink {
        bail!(
            "--hardlink is retired: an object hardlinked to a source file changes whenever the file does, \
             under every image that shares it; drop the option (builds clone with FICLONE where the \
             filesystem can, copy otherwise)"
        );
    }
    if a.source.as_os_str().is_empty() {
        bail!("empty source path");
    }
    if let Some(tag) = &a.tag {
        tags::validate_tag(tag)?;
    }
    if let Some(path) = a.image.as_deref().filter(|_| !a.print_digest_only) {
        output::check_writable(path)?;
    }
    Ok(())
}

/// The store to import into, if any: a tag needs one, the default one
/// unless --store names another.
fn store_path(a: &BuildArgs) -> Result<Option<PathBuf>> {
    Ok(match (&a.store, &a.tag) {
        (Some(p), _) => Some(p.clone()),
        (None, Some(_)) => Some(tilefs_store::default_store_path()?),
        (None, None) => None,
    })
}

/// Opens the store at `path`, creating it if there is none: then it is
/// `new`'s to remove if the build fails.
fn open_store(path: &Path, new: &mut NewStore) -> Result<Store> {
    let existed = std::fs::symlink_metadata(path).is_ok();
    let s = Store::create(path)?;
    if !existed {
        new.0 = Some(path.to_path_buf());
    }
    Ok(s)
}

/// Reads the source directory into a tree, its files' contents into the
/// store through `ingest`, showing progress unless told not to.
fn scan(
    a: &BuildArgs,
    ingest: Option<&Ingest>,
    cancel: &Arc<AtomicBool>,
    counters: &Arc<source::ScanProgress>,
    new_store: &mut NewStore,
) -> Result<FlatTree> {
    let opts = source::ScanOptions {
        use_epoch: a.use_epoch,
        skip_devices: a.skip_devices,
        skip_xattrs: a.skip_xattrs,
        user_xattrs: a.user_xattrs,
        jobs: a.jobs,
        progress: Some(counters.clone()),
        hardlinks: a.hardlinks,
        cancel: Some(cancel.clone()),
    };
    let _display = progress::enabled(a.quiet || a.json).then(|| {
        let c = counters.clone();
        let total = progress::measure_in_background(a.source.clone(), 0);
        Progress::bytes(
            "importing",
            "files",
            move || (c.files.load(Relaxed), c.bytes.load(Relaxed)),
            total,
        )
    });
    let sink = ingest.map(|i| i as &dyn source::ContentSink);
    let tree = match source::scan_flat(&a.source, &opts, sink) {
        Ok(tree) => tree,
        Err(_) if cancel.load(Relaxed) => {
            if let Some(i) = ingest {
                // What was imported is kept (committed objects, the
                // digests learnt) for the next try; temporary files go.
                let _ = i.save_cache();
                new_store.0 = None;
            }
            return Err(anyhow::Error::new(Interrupted));
        }
        Err(e) => return Err(e.into()),
    };
    // The scan's worker threads freed their buffers and listings into
    // their own malloc arenas, where the image written next cannot use
    // them: give those pages back.
    tilefs_sys::mem::trim_heap();
    Ok(tree)
}

/// Makes the imported objects durable, and says what the import noted.
fn finish_ingest(i: &Ingest, quiet: bool, store_path: Option<&Path>) -> Result<StatsSnapshot> {
    let s = i.finish()?;
    if s.replaced > 0 && !quiet {
        eprintln!(
            "tilefs: note: replaced {} damaged object{} (wrong size) in {}",
            s.replaced,
            if s.replaced == 1 { "" } else { "s" },
            store_path.unwrap_or(Path::new("the store")).display()
        );
    }
    if let Some(w) = i.verity_warning() {
        if !quiet {
            eprintln!("tilefs: note: {w}");
        }
    }
    Ok(s)
}

/// An image written: its length, format version and fs-verity digest (if
/// it was wanted), and its bytes if it was built in memory.
struct Image {
    len: u64,
    version: u32,
    digest: Option<[u8; 32]>,
    bytes: Option<Vec<u8>>,
}

impl Image {
    fn digest_hex(&self) -> String {
        self.digest.map(hex::encode).unwrap_or_default()
    }
}

/// Writes the image where `a` says: streamed into a file (never whole in
/// memory), or built in memory for stdout, for a digest only, or for a tag.
fn write_image(a: &BuildArgs, tree: &FlatTree) -> Result<Image> {
    let opts = WriteOptions {
        min_version: a.min_version,
        max_version: a.max_version,
    };
    // The image's fs-verity digest, only computed when it is shown.
    let want_digest = a.print_digest || a.print_digest_only || a.json || (a.tag.is_some() && a.image.is_none());
    let cannot_build = || format!("cannot build from {}", a.source.display());
    match file_out(a) {
        Some(path) => {
            let mut written = None;
            output::write_atomic_with(path, |f| {
                let (len, version) = erofs::write_flat_to(tree, &opts, f).with_context(cannot_build)?;
                let digest = match want_digest {
                    true => {
                        Some(verity::digest_file(f, |_| {}).with_context(|| format!("reading {}", path.display()))?)
                    }
                    false => None,
                };
                written = Some(Image {
                    len,
                    version,
                    digest,
                    bytes: None,
                });
                Ok(())
            })?;
            written.context("internal error: image not written")
        }
        None => {
            let (bytes, version) = erofs::write_flat(tree, &opts).with_context(cannot_build)?;
            let digest = want_digest.then(|| verity::digest_bytes(&bytes));
            if let Some(path) = a.image.as_deref().filter(|_| !a.print_digest_only) {
                output::write_atomic(path, &bytes)?;
            }
            Ok(Image {
                len: bytes.len() as u64,
                version,
                digest,
                bytes: Some(bytes),
            })
        }
    }
}

/// The image file to write, if the image goes to one (not to stdout).
fn file_out(a: &BuildArgs) -> Option<&Path> {
    a.image
        .as_deref()
        .filter(|p| !a.print_digest_only && p.as_os_str() != "-")
}

/// Records the image in the store under `tag` (read back from its file
/// if it was streamed there).
fn tag_image(store: &Store, tag: &str, a: &BuildArgs, image: &Image) -> Result<()> {
    let bytes = match (&image.bytes, file_out(a)) {
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
            image.digest_hex()
        );
    }
    Ok(())
}

/// Says how many objects a tree read from a dump references that the
/// store lacks (a dump names objects; it does not bring them).
fn note_missing_objects(store: &Store, tree: &FlatTree) {
    let missing = tree
        .objects()
        .into_iter()
        .filter(|o| tilefs_store::parse_object_rel(o).is_none_or(|d| !store.has_object(&d)))
        .count();
    if missing > 0 {
        eprintln!(
            "tilefs: note: {missing} objects the image references are not in {}",
            store.path().display()
        );
    }
}

/// The summary --json prints.
fn json_report(
    a: &BuildArgs,
    image: &Image,
    entries: u64,
    counters: &source::ScanProgress,
    s: StatsSnapshot,
    started: Instant,
) -> serde_json::Value {
    serde_json::json!({
        "image": a.image.as_ref().map(|p| p.display().to_string()),
        "tag": a.tag,
        "digest": image.digest_hex(),
        "image_bytes": image.len,
        "format_version": image.version,
        "entries": entries,
        "files": counters.files.load(Relaxed),
        "bytes": counters.bytes.load(Relaxed),
        "new_objects": s.new_objects,
        "new_bytes": s.new_bytes,
        "deduplicated_bytes": s.dedup_bytes,
        "cache_hits": s.cache_hits,
        "replaced_objects": s.replaced,
        "seconds": started.elapsed().as_secs_f64(),
    })
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
