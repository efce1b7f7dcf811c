//! tilefs-commit: a live writable mount turned into a new image in its
//! store, in time proportional to what changed.
//!
//! - [`find`]: which writable mount (kernel overlay or FUSE) a mount point
//!   is, and its image, upper directory and conventions;
//! - [`upper`]: the upper directory, read without leaving it;
//! - [`merge`]: the image's tree with the upper directory applied, as the
//!   mount shows it.
//!
//! [`commit`] syncs the mount (so that what the kernel caches reaches the
//! upper directory), merges, digests and imports the upper directory's
//! files into the store (the store's digest cache spares unchanged ones),
//! writes the image and tags it. Files of the image keep their digests
//! and objects and are never read. The result is byte for byte the image
//! `tilefs build --store STORE MNT` makes of the mounted tree.
//!
//! Changes made while a commit runs: what was written (and, with FUSE's
//! writeback cache, flushed by the sync) before the commit started is in
//! it; a change made meanwhile may or may not be, entry by entry. A file
//! whose data changes while it is digested makes the commit fail, naming
//! it, rather than record bytes it never held: an object always holds
//! exactly the bytes its digest names.

mod find;
mod merge;
pub mod upper;

pub use find::Kind;

use rayon::prelude::*;
use rustix::fs::{Mode, OFlags};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use tilefs_image::erofs::{self, WriteOptions};
use tilefs_image::tree::{digest_object_path, RECOMMENDED_INLINE_MAX};
use tilefs_image::verity;
use tilefs_store::ingest::{Ingest, Method, SourceFile};
use tilefs_store::{tags, Store, StoreError};

/// Why a commit failed.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("{}: {reason}", path.display())]
    At { path: PathBuf, reason: String },
    /// A system call on `path` (in the upper directory, the mount, the
    /// store) failed at `what`.
    #[error("{}: {what}: {err}", path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        err: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What to commit as.
#[derive(Debug, Clone, Default)]
pub struct CommitOptions {
    /// The tag the new image gets in the store.
    pub tag: String,
    /// Threads digesting upper files (0: as a build, 8 per core).
    pub jobs: usize,
    /// Once set, the commit stops at the next file, tagging nothing.
    pub cancel: Option<Arc<AtomicBool>>,
}

/// What a running commit has done, for progress displays.
#[derive(Debug, Default)]
pub struct Progress {
    /// Upper files digested, and their bytes.
    pub files: AtomicU64,
    pub bytes: AtomicU64,
    /// Bytes of upper files to digest, once known.
    pub total_bytes: Arc<AtomicU64>,
}

/// What a commit made.
#[derive(Debug, Clone)]
pub struct Committed {
    pub tag: String,
    pub digest: [u8; 32],
    pub image_bytes: u64,
    pub format_version: u32,
    pub kind: Kind,
    /// Entries of the new tree (the root included).
    pub entries: u64,
    /// Entries found in the upper directory (whiteouts included).
    pub upper_entries: u64,
    /// Upper files digested (found in the digest cache or read).
    pub files: u64,
    pub bytes: u64,
    pub new_objects: u64,
    pub new_bytes: u64,
    pub cache_hits: u64,
}

/// Commits the writable mount whose root is `mnt`, recorded in `store`, as
/// a new image tagged `opts.tag`. On error nothing is tagged; objects
/// already imported stay (complete, named by digest) for gc or the next try.
pub fn commit(store: &Store, mnt: &Path, opts: &CommitOptions, progress: &Progress) -> Result<Committed, CommitError> {
    tags::validate_tag(&opts.tag)?;
    let w = find::find(store, mnt)?;
    // Held until the tag is written: no gc removes what it references.
    let mut ingest = Ingest::new(store, Method::Copy)?;
    if let Some(c) = &opts.cancel {
        ingest.set_cancel(c.clone());
    }
    // What the kernel still caches (FUSE's writeback cache) reaches the
    // upper directory first.
    sync(&w.root).map_err(|e| upper::at(mnt, "cannot sync", e))?;
    let (lower, info) = erofs::read_image(&w.image).map_err(|e| CommitError::At {
        path: mnt.to_path_buf(),
        reason: format!("its image: {e}"),
    })?;
    if let Some(missing) = tilefs_store::remote::incomplete(store, &w.image) {
        return Err(CommitError::At {
            path: mnt.to_path_buf(),
            reason: format!(
                "its image was pulled lazily and {} of its {} objects are not in the store yet: `tilefs pull` it again first",
                missing.absent, missing.total
            ),
        });
    }
    let layers = merge::Layers {
        mount: mnt,
        lower: &lower,
        info: &info,
        kind: w.kind,
        xattrs: w.xattrs,
        rootless: w.rootless,
        fuse_root: (w.kind == Kind::Fuse).then(|| rustix::fd::AsFd::as_fd(&w.root)),
    };
    let upper_path = w.upper.path.clone();
    let upper_fd = rustix::fs::openat(
        &w.upper.fd,
        c".",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| upper::at(&upper_path, "cannot open", e))?;
    let mut m = merge::merge(&layers, w.upper)?;
    drop(lower);

    store_lower_data(store, &ingest, &mut m)?;
    progress.total_bytes.store(
        m.imports.iter().map(|i| i.stat.st_size as u64).sum::<u64>().max(1),
        Relaxed,
    );
    let digests = import_all(&ingest, &upper_fd, &m.imports, opts, progress)?;
    for (imp, d) in m.imports.iter().zip(digests) {
        let n = m.tree.inode_mut(imp.inode);
        n.digest = Some(d);
        n.payload = Some(digest_object_path(&d).into_bytes());
    }
    let stats = ingest.finish()?;
    // The committed image keeps the format of the one it was made on (a
    // pulled image is version 1, as composefs-rs writes OCI images).
    let write = WriteOptions {
        min_version: info.version,
        ..WriteOptions::default()
    };
    let image = erofs::write_image(&m.tree, &write).map_err(|e| CommitError::At {
        path: mnt.to_path_buf(),
        reason: format!("cannot write its image: {e}"),
    })?;
    tags::write_tag(store, &opts.tag, &image.bytes)?;
    drop(ingest);
    Ok(Committed {
        tag: opts.tag.clone(),
        digest: image.digest,
        image_bytes: image.bytes.len() as u64,
        format_version: image.version,
        kind: w.kind,
        entries: m.tree.inodes.len() as u64,
        upper_entries: m.upper_entries,
        files: m.imports.len() as u64,
        bytes: m.imports.iter().map(|i| i.stat.st_size as u64).sum(),
        new_objects: stats.new_objects,
        new_bytes: stats.new_bytes,
        cache_hits: stats.cache_hits,
    })
}

/// syncfs: the kernel writes back what it caches. The tilefs FUSE server
/// answers the write-back of a removed directory's times with ESTALE
/// (once: the inode is clean then), which says nothing about the files
/// that remain: asked again.
fn sync(root: &rustix::fd::OwnedFd) -> Result<(), rustix::io::Errno> {
    let mut tries = 0;
    loop {
        match rustix::fs::syncfs(root) {
            Err(rustix::io::Errno::STALE) if tries < 3 => tries += 1,
            r => return r,
        }
    }
}

/// Digests and imports the upper files, in parallel; their digests in order.
fn import_all(
    ingest: &Ingest<'_>,
    upper: &rustix::fd::OwnedFd,
    imports: &[merge::Import],
    opts: &CommitOptions,
    progress: &Progress,
) -> Result<Vec<[u8; 32]>, CommitError> {
    let one = |imp: &merge::Import| -> Result<[u8; 32], CommitError> {
        // Its directory again, from the upper root and never through a
        // link: the walk kept no descriptor open for it.
        let dir = if imp.dir.as_os_str().is_empty() {
            rustix::fs::openat(
                upper,
                c".",
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
        } else {
            rustix::fs::openat2(
                upper,
                &imp.dir,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
                upper::BENEATH,
            )
        }
        .map_err(|e| upper::at(imp.path.parent().unwrap_or(&imp.path), "cannot open directory", e))?;
        let d = ingest
            .import(&SourceFile {
                dir: rustix::fd::AsFd::as_fd(&dir),
                name: &imp.name,
                path: &imp.path,
                stat: &imp.stat,
            })
            .map_err(|e| match e {
                StoreError::Interrupted => CommitError::At {
                    path: imp.path.clone(),
                    reason: "interrupted".into(),
                },
                e => e.into(),
            })?;
        progress.files.fetch_add(1, Relaxed);
        progress.bytes.fetch_add(imp.stat.st_size as u64, Relaxed);
        Ok(d)
    };
    if imports.len() <= 1 {
        return imports.iter().map(one).collect();
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(tilefs_image::source::worker_threads(opts.jobs).min(imports.len()))
        .thread_name(|i| format!("tilefs-commit-{i}"))
        .build()
        .map_err(|e| CommitError::At {
            path: PathBuf::from("tilefs"),
            reason: format!("cannot start worker threads: {e}"),
        })?;
    pool.install(|| imports.par_iter().map(one).collect())
}

/// Puts in the store what image files need beyond the image (see
/// [`merge::LowerData`]); rare: only images not built from a directory.
fn store_lower_data(store: &Store, ingest: &Ingest<'_>, m: &mut merge::Merged) -> Result<(), CommitError> {
    for what in &m.lower_data {
        match *what {
            merge::LowerData::Store(id) => {
                let data = m.tree.inodes[id as usize].content.take().unwrap_or_default();
                ingest.import_bytes(data)?;
            }
            merge::LowerData::Read(id) => {
                let n = m.tree.inode_mut(id);
                let object = n
                    .payload
                    .as_deref()
                    .and_then(tilefs_store::parse_object_rel)
                    .ok_or_else(|| CommitError::At {
                        path: store.path().to_path_buf(),
                        reason: format!(
                            "the image names an object as {:?}, which is no object name",
                            String::from_utf8_lossy(n.payload.as_deref().unwrap_or_default())
                        ),
                    })?;
                let path = store.object_path(&object);
                let mut f = tilefs_store::open_regular(store.dir_fd(), Path::new(&Store::object_rel(&object)), false)
                    .map_err(|e| CommitError::At {
                    path: path.clone(),
                    reason: format!("cannot open: {e}"),
                })?;
                let fail = |e: std::io::Error| CommitError::At {
                    path: path.clone(),
                    reason: format!("cannot read: {e}"),
                };
                let len = f.metadata().map_err(fail)?.len();
                if len != n.size {
                    return Err(CommitError::At {
                        path,
                        reason: format!("holds {len} bytes where the image says {}", n.size),
                    });
                }
                if n.size <= RECOMMENDED_INLINE_MAX {
                    let mut data = Vec::new();
                    f.read_to_end(&mut data).map_err(fail)?;
                    n.digest = Some(verity::digest_bytes(&data));
                    n.content = Some(data);
                } else {
                    n.digest = Some(verity::digest_file(&f, |_| {}).map_err(fail)?);
                }
                n.payload = n.digest.map(|d| digest_object_path(&d).into_bytes());
            }
        }
    }
    Ok(())
}
