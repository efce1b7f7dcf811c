//! `gc`: removes objects no tagged image, no image a tilefs component
//! holds ([`crate::owned`]) and no live mount ([`crate::mounts`])
//! references, and leftovers of interrupted imports.
//!
//! gc holds the store lock exclusively: builds hold it shared from their
//! first import to their tag, so no object gc sees unreferenced can be
//! about to be tagged, and no temporary file can be in use. Every root
//! must be read: if one cannot be, gc stops before removing anything,
//! since the objects it references are unknown.
//!
//! A collection may be limited to some objects ([`GcOptions::only`]): those
//! of images just let go (the snapshotter's, after containerd removed
//! snapshots). Every root is read all the same, but the store is not
//! scanned and leftovers are left to a full gc.

use crate::store::{ObjectScan, TMP_DIR};
use crate::tags;
use crate::{parse_object_rel, LockMode, Store, StoreError};
use rustix::fd::OwnedFd;
use rustix::fs::{self as rfs, AtFlags, Mode, OFlags};
use std::collections::HashSet;
use std::io;
use std::path::Path;

#[derive(Debug, Clone, Default)]
pub struct GcOptions {
    /// Report only; remove nothing.
    pub dry_run: bool,
    /// Consider only these objects (leftovers are not removed either).
    pub only: Option<HashSet<[u8; 32]>>,
    /// Fail with [`StoreError::Busy`] rather than wait for the lock.
    pub no_wait: bool,
}

#[derive(Debug, Default, serde::Serialize)]
pub struct GcReport {
    /// Tagged images whose references were kept.
    pub images: u64,
    /// Images held by tilefs components whose references were kept.
    pub held: u64,
    /// Live mounts whose references were kept.
    pub mounts: u64,
    pub objects_kept: u64,
    pub bytes_kept: u64,
    pub objects_removed: u64,
    pub bytes_removed: u64,
    pub leftovers_removed: u64,
    pub leftover_bytes_removed: u64,
    /// Aliases ([`crate::alias`]) no root names, of objects gone.
    pub aliases_removed: u64,
    /// Placeholders (objects never fetched) no root names.
    pub placeholders_removed: u64,
    /// Nothing was removed: the counts say what would have been.
    pub dry_run: bool,
}

/// Runs gc under the store's exclusive lock.
pub fn gc(store: &Store, opts: &GcOptions) -> Result<GcReport, StoreError> {
    let _lock = store.lock(LockMode::Exclusive, !opts.no_wait)?;
    let mut report = GcReport {
        dry_run: opts.dry_run,
        ..GcReport::default()
    };

    let images = tags::scan_images(store)?;
    let held = crate::owned::scan(store)?;
    if let Some(other) = images.others.first().or(held.others.first()) {
        return Err(StoreError::Invalid(format!(
            "refusing to gc: {} is not a tagged image (a symlink, directory or file with an invalid tag name), so \
             what it references is unknown; move it out of the store or run `tilefs fsck --repair`; nothing was removed",
            other.display()
        )));
    }
    let roots: Vec<&tags::TagInfo> = images.tags.iter().chain(held.roots()).collect();
    // Records of images (where a lazy one's objects are, how a pulled one
    // passed the signature policy) whose image is no longer tagged or
    // mounted go too (images are hashed only when there are records).
    let lazy_records = crate::remote::records(store);
    let trust_records = trust_records(store);
    let mut lazy: HashSet<[u8; 32]> = lazy_records.union(&trust_records).copied().collect();
    let mut aliases = HashSet::new();
    let mut referenced = referenced_objects(store, &roots, &mut lazy, &mut aliases)?;
    report.images = images.tags.len() as u64;
    report.held = roots.len() as u64 - report.images;
    // Live mounts keep what they use; records of gone ones are cleared.
    for m in crate::mounts::live_mounts(store, !opts.dry_run)? {
        let (tree, _) = tilefs_image::erofs::read_image(&m.image).map_err(|e| {
            StoreError::Invalid(format!(
                "refusing to gc: the image of a live mount ({}) cannot be read, so the objects it needs are unknown: {e}; nothing was removed",
                m.path.display()
            ))
        })?;
        add_references(&tree, &mut referenced);
        crate::alias::add_references(&tree, &mut aliases);
        if !lazy.is_empty() {
            lazy.remove(&tilefs_image::verity::digest_bytes(&m.image));
        }
        report.mounts += 1;
    }

    // Only a real .tmp directory is emptied (never one a symlink points
    // to); checked before anything is removed.
    let tmp_path = store.join(TMP_DIR);
    let tmp_dir = match store.open_existing_subdir(TMP_DIR) {
        Ok(fd) => Some(fd),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(StoreError::Invalid(format!(
                "refusing to gc: {}: {e}; nothing was removed",
                tmp_path.display()
            )))
        }
    };

    let ObjectScan { objects, leftovers, .. } = match &opts.only {
        None => store.scan_objects()?,
        Some(only) => {
            // Only objects that are there, under real fan-out directories.
            let mut objects: Vec<([u8; 32], std::path::PathBuf)> = only
                .iter()
                .filter(|d| store.has_object(d))
                .map(|d| (*d, store.object_path(d)))
                .collect();
            objects.sort();
            ObjectScan {
                objects,
                ..ObjectScan::default()
            }
        }
    };
    // Objects come sorted by digest, so by fan-out directory.
    let mut fanout: Option<(String, OwnedFd)> = None;
    // The files of the objects kept: their aliases stay too.
    let mut kept = HashSet::new();
    for (d, path) in objects {
        let placeholder;
        let size = match std::fs::symlink_metadata(&path) {
            Ok(m) => {
                use std::os::unix::fs::MetadataExt;
                placeholder = m.is_file() && m.mode() & 0o7777 == crate::placeholder::MODE;
                if referenced.contains(&d) {
                    kept.insert((m.dev(), m.ino()));
                }
                m.len()
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(StoreError::io(&path, "cannot stat", e)),
        };
        if referenced.contains(&d) {
            report.objects_kept += 1;
            report.bytes_kept += size;
            continue;
        }
        if !opts.dry_run {
            let rel = Store::object_rel(&d);
            let (dir, name) = rel.split_at(2);
            let name = &name[1..];
            if !matches!(&fanout, Some((n, _)) if n == dir) {
                let fd = rfs::openat(
                    store.dir_fd(),
                    dir,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| StoreError::io(&store.join(dir), "cannot open directory", e.into()))?;
                fanout = Some((dir.to_string(), fd));
            }
            let (_, fd) = fanout.as_ref().expect("fan-out directory just opened");
            match rfs::unlinkat(fd, name, AtFlags::empty()) {
                Ok(()) => {}
                Err(rustix::io::Errno::NOENT) => continue,
                Err(e) => return Err(StoreError::io(&path, "cannot remove object", e.into())),
            }
        }
        if placeholder {
            report.placeholders_removed += 1;
        } else {
            report.objects_removed += 1;
            report.bytes_removed += size;
        }
    }
    drop(fanout);
    crate::placeholder::sweep(store, opts.dry_run);

    remove_leftovers(store, tmp_dir.as_ref(), &leftovers, opts.dry_run, &mut report)?;
    // A limited collection has not seen every kept object.
    if opts.only.is_none() {
        report.aliases_removed = crate::alias::sweep(store, &aliases, &kept, opts.dry_run)?;
    }
    if !opts.dry_run {
        crate::remote::prune(store, lazy.intersection(&lazy_records).copied());
        prune_trust(store, lazy.intersection(&trust_records));
    }
    // Pulls' records of layers and images (caches) may name what went:
    // they are dropped with it. Records whose files are not there are only
    // ignored by a pull, but they would take room for nothing.
    if report.objects_removed > 0 && !opts.dry_run {
        if let Ok(rd) = std::fs::read_dir(store.join(crate::store::LAYER_CACHE)) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_file()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
    Ok(report)
}

/// Every object any of `roots` references (by redirect, or by digest for a
/// file whose redirect is not an object path), and into `aliases` the
/// aliases they name; removes the rooted images from `lazy` (records of
/// lazily pulled images). Fails if one cannot be read.
fn referenced_objects(
    store: &Store,
    roots: &[&tags::TagInfo],
    lazy: &mut HashSet<[u8; 32]>,
    aliases: &mut HashSet<[u8; 32]>,
) -> Result<HashSet<[u8; 32]>, StoreError> {
    let mut referenced = HashSet::new();
    for tag in roots {
        let refuse = |why: String| {
            StoreError::Invalid(format!(
                "refusing to gc: tagged image {:?} ({}) cannot be read, so the objects it needs are unknown: {why}; \
                 nothing was removed (fix or untag it first)",
                tag.name,
                tag.path.display()
            ))
        };
        // A tag removed by hand since the listing is no root any more.
        let Some(bytes) = tags::read_listed(store, tag).map_err(|e| refuse(e.to_string()))? else {
            continue;
        };
        let (tree, _) = tilefs_image::erofs::read_image(&bytes).map_err(|e| refuse(e.to_string()))?;
        add_references(&tree, &mut referenced);
        crate::alias::add_references(&tree, aliases);
        if !lazy.is_empty() {
            lazy.remove(&tilefs_image::verity::digest_bytes(&bytes));
        }
    }
    Ok(referenced)
}

/// The images that have a record in `STORE/.trust` (`HEX.json`).
fn trust_records(store: &Store) -> HashSet<[u8; 32]> {
    let Ok(dir) = store.open_existing_subdir(crate::store::TRUST_DIR) else {
        return HashSet::new();
    };
    let Ok(rd) = rustix::fs::Dir::read_from(&dir) else {
        return HashSet::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str().ok()?.strip_suffix(".json")?;
            let mut d = [0u8; 32];
            hex::decode_to_slice(name, &mut d).ok()?;
            Some(d)
        })
        .collect()
}

/// Removes the `.trust` records of `images`, through the real directory.
fn prune_trust<'a>(store: &Store, images: impl Iterator<Item = &'a [u8; 32]>) {
    let Ok(dir) = store.open_existing_subdir(crate::store::TRUST_DIR) else {
        return;
    };
    for d in images {
        let _ = rfs::unlinkat(&dir, format!("{}.json", hex::encode(d)), AtFlags::empty());
    }
}

/// The objects `image` references, as gc counts them: what letting go of
/// it may free.
pub fn objects_of(image: &[u8]) -> Result<HashSet<[u8; 32]>, StoreError> {
    let (tree, _) = tilefs_image::erofs::read_image(image).map_err(|e| StoreError::Invalid(e.to_string()))?;
    let mut objects = HashSet::new();
    add_references(&tree, &mut objects);
    Ok(objects)
}

fn add_references(tree: &tilefs_image::Tree, referenced: &mut HashSet<[u8; 32]>) {
    for inode in tree.inodes.iter().filter(|i| i.is_external()) {
        if let Some(d) = inode.payload.as_deref().and_then(parse_object_rel) {
            referenced.insert(d);
        }
        if let Some(d) = inode.digest {
            referenced.insert(d);
        }
    }
}

/// Removes temporary files: `STORE/.tmp/*` and the reference's
/// `STORE/.tmpXXXXXX`, without following symlinks.
fn remove_leftovers(
    store: &Store,
    tmp_dir: Option<&OwnedFd>,
    leftovers: &[std::path::PathBuf],
    dry_run: bool,
    report: &mut GcReport,
) -> Result<(), StoreError> {
    let tmp_path = store.join(TMP_DIR);
    for path in leftovers {
        let Some(name) = path.file_name() else { continue };
        let dir = if path.parent() == Some(tmp_path.as_path()) {
            match tmp_dir {
                Some(fd) => rustix::fd::AsFd::as_fd(fd),
                None => continue,
            }
        } else if path.parent() == Some(store.path()) {
            store.dir_fd()
        } else {
            continue;
        };
        let st = match rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(rustix::io::Errno::NOENT) => continue,
            Err(e) => return Err(StoreError::io(path, "cannot stat", e.into())),
        };
        let is_dir = rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::Directory;
        let bytes = if is_dir { tree_bytes(path) } else { st.st_size as u64 };
        if !dry_run {
            let r = if is_dir {
                // std's remove_dir_all does not follow symlinks inside.
                std::fs::remove_dir_all(path)
            } else {
                rfs::unlinkat(dir, name, AtFlags::empty()).map_err(io::Error::from)
            };
            match r {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(StoreError::io(path, "cannot remove leftover", e)),
            }
        }
        report.leftovers_removed += 1;
        report.leftover_bytes_removed += bytes;
    }
    Ok(())
}

/// Bytes of the regular files under a directory (not following symlinks).
fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => total += e.metadata().map(|m| m.len()).unwrap_or(0),
                _ => {}
            }
        }
    }
    total
}
