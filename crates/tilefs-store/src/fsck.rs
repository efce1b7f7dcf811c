//! `fsck`: every object's digest recomputed, the references of every tagged
//! image and every image a tilefs component holds checked; holders gone
//! for good named.
//!
//! fsck holds the store lock shared (as builds do), so a gc cannot remove
//! objects under it while builds may go on: an object appears only whole,
//! under its final name, so a concurrent import cannot look corrupt. Objects
//! are read without following symlinks, on a pool of `jobs` threads, the
//! largest first so that one big object does not finish alone at the end.

use crate::store::{ObjectScan, QUARANTINE_DIR, TMP_DIR};
use crate::tags::{self, TagInfo};
use crate::{parse_object_rel, LockMode, Store, StoreError};
use rayon::prelude::*;
use rustix::fd::OwnedFd;
use rustix::fs::{self as rfs, Mode, OFlags};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use tilefs_image::verity;

#[derive(Debug, Clone, Default)]
pub struct FsckOptions {
    /// Move corrupt objects and strays to `.quarantine/`.
    pub repair: bool,
    /// Threads (0: one per core).
    pub jobs: usize,
}

/// What fsck found.
#[derive(Debug, Default, serde::Serialize)]
pub struct FsckReport {
    pub objects: u64,
    pub bytes: u64,
    /// Aliases checked ([`crate::alias`]); a corrupt one is listed in
    /// `corrupt`, a missing one in `missing` or `not_fetched`.
    pub aliases: u64,
    /// Tagged images checked.
    pub images: u64,
    /// Images held by tilefs components checked.
    pub held: u64,
    /// Images whose holder is gone for good (or cannot be told): kept as
    /// roots until `tilefs untag --orphaned`; a warning, not damage.
    pub orphaned: Vec<Orphaned>,
    /// Objects whose contents do not match their name.
    pub corrupt: Vec<PathBuf>,
    /// The tagged images that use each corrupt object (those used by none
    /// are absent).
    pub corrupt_used_by: BTreeMap<PathBuf, Vec<String>>,
    /// Objects that could not be read (the reason): not repaired, since the
    /// cause may be outside the store (permissions, a failing disk).
    pub unreadable: Vec<(PathBuf, String)>,
    /// Objects referenced by a tagged image but absent: (object path, tags).
    pub missing: Vec<(String, Vec<String>)>,
    /// Absent objects that only lazily pulled images need (fetched when
    /// read, or by pulling again): expected, not damage. By tag: how many.
    pub not_fetched: BTreeMap<String, u64>,
    /// Entries in the store that are not objects.
    pub strays: Vec<PathBuf>,
    /// Tagged images that cannot be read, or that reference something that
    /// cannot be an object: (tag, reason).
    pub bad_images: Vec<(String, String)>,
    /// Placeholders: objects of lazily pulled images not fetched yet, of
    /// their size, that a kernel mount's filler fills on first access
    /// (not damage; their images count them in `not_fetched`).
    pub placeholders: u64,
    /// Temporary files of interrupted imports (not a problem; gc removes them).
    pub leftovers: u64,
    /// Paths moved to `.quarantine/` by --repair.
    pub repaired: Vec<PathBuf>,
    /// Who other than its owner can read the store, if anyone (a warning,
    /// not damage).
    pub exposed: Option<String>,
}

/// A holder's images that nothing will let go.
#[derive(Debug, serde::Serialize)]
pub struct Orphaned {
    /// The holder's id (its directory in `STORE/.owned`).
    pub owner: String,
    /// Who it was, if its record says.
    pub holder: Option<String>,
    /// Why it is taken for gone.
    pub why: String,
    pub images: Vec<String>,
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.corrupt.is_empty()
            && self.unreadable.is_empty()
            && self.missing.is_empty()
            && self.strays.is_empty()
            && self.bad_images.is_empty()
    }
}

/// Bad references reported per image; the rest are counted.
const MAX_BAD_REFS_PER_IMAGE: usize = 20;

/// Checks the store; `progress(bytes_done, bytes_total)` is called as it goes.
pub fn fsck(store: &Store, opts: &FsckOptions, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<FsckReport, StoreError> {
    let _lock = match store.lock(LockMode::Shared, true) {
        Ok(l) => Some(l),
        // A read-only store (or one we may not write) can still be checked;
        // it cannot be repaired.
        Err(StoreError::Io { err, .. })
            if !opts.repair && matches!(err.raw_os_error(), Some(libc::EROFS | libc::EACCES | libc::EPERM)) =>
        {
            None
        }
        Err(e) => return Err(e),
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.jobs)
        .thread_name(|i| format!("fsck-{i}"))
        .build()
        .map_err(|e| StoreError::Invalid(format!("cannot start fsck threads: {e}")))?;

    let ObjectScan {
        objects,
        mut strays,
        mut leftovers,
    } = store.scan_objects()?;
    let mut report = FsckReport {
        exposed: store.exposure(),
        ..FsckReport::default()
    };
    check_own_dirs(store, &mut strays, &mut leftovers);
    report.leftovers = leftovers.len() as u64;
    let sized = sizes(objects, &mut strays, &mut report.unreadable, &mut report.placeholders);
    let mut present = check_objects(&pool, &sized, progress, &mut report, &mut strays);
    let mut aliases = check_aliases(store, &pool, &mut report, &mut strays);

    let images = tags::scan_images(store)?;
    strays.extend(images.others);
    let held = crate::owned::scan(store)?;
    strays.extend(held.others.iter().cloned());
    report.orphaned = orphaned(&held);
    report.corrupt.sort();
    report.unreadable.sort();
    strays.sort();
    report.strays = strays;
    if opts.repair && (!report.corrupt.is_empty() || !report.strays.is_empty()) {
        repair(store, &mut report, &mut present)?;
        aliases.retain(|d| !report.repaired.contains(&store.join(crate::alias::alias_rel(d))));
    }
    // References, after any repair: the report says what is true now.
    let roots: Vec<TagInfo> = images.tags.into_iter().chain(held.roots().cloned()).collect();
    check_references(store, &pool, &roots, &present, &aliases, &mut report);
    Ok(report)
}

/// Checks every alias's SHA-256 against its name on `pool`; returns those
/// present (good or corrupt).
fn check_aliases(
    store: &Store,
    pool: &rayon::ThreadPool,
    report: &mut FsckReport,
    strays: &mut Vec<PathBuf>,
) -> HashSet<[u8; 32]> {
    let (aliases, more) = crate::alias::scan(store);
    strays.extend(more);
    let checked: Vec<io::Result<bool>> =
        pool.install(|| aliases.par_iter().map(|(d, p)| crate::alias::check(p, d)).collect());
    let mut present = HashSet::with_capacity(aliases.len());
    for ((d, path), r) in aliases.into_iter().zip(checked) {
        match r {
            Ok(good) => {
                report.aliases += 1;
                if !good {
                    report.corrupt.push(path);
                }
                present.insert(d);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => report.unreadable.push((path, e.to_string())),
        }
    }
    present
}

/// The holders gone for good, or whose record cannot be read.
fn orphaned(held: &crate::owned::OwnedScan) -> Vec<Orphaned> {
    held.owners
        .iter()
        .filter(|o| !o.roots.is_empty())
        .filter_map(|o| {
            let (holder, why) = match &o.holder {
                Ok(h) => (Some(h.describe()), h.gone()?),
                Err(e) => (None, format!("its record cannot be read: {e}")),
            };
            Some(Orphaned {
                owner: o.id.clone(),
                holder,
                why,
                images: o.roots.iter().map(|r| r.name.clone()).collect(),
            })
        })
        .collect()
}

/// The store's own directories must be directories: a symlink there
/// would lead tilefs out of the store. One that is not is a stray, and
/// what the scan took for leftovers in it are not counted.
fn check_own_dirs(store: &Store, strays: &mut Vec<PathBuf>, leftovers: &mut Vec<PathBuf>) {
    for name in [TMP_DIR, QUARANTINE_DIR] {
        let path = store.join(name);
        if std::fs::symlink_metadata(&path).is_ok_and(|m| !m.file_type().is_dir()) {
            leftovers.retain(|p| !p.starts_with(&path));
            strays.push(path);
        }
    }
}

/// An object to check: its digest, path and size.
type ToCheck = ([u8; 32], PathBuf, u64);

/// The objects' sizes (for progress), the largest first; what is not a
/// regular file is a stray, what cannot be looked at is unreadable.
fn sizes(
    objects: Vec<([u8; 32], PathBuf)>,
    strays: &mut Vec<PathBuf>,
    unreadable: &mut Vec<(PathBuf, String)>,
    placeholders: &mut u64,
) -> Vec<ToCheck> {
    use std::os::unix::fs::MetadataExt;
    let mut sized: Vec<ToCheck> = Vec::with_capacity(objects.len());
    for (d, path) in objects {
        match std::fs::symlink_metadata(&path) {
            // Never opened: a kernel mount's filler would fetch it.
            Ok(m) if m.file_type().is_file() && m.mode() & 0o7777 == crate::placeholder::MODE => *placeholders += 1,
            Ok(m) if m.file_type().is_file() => sized.push((d, path, m.len())),
            Ok(_) => strays.push(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => unreadable.push((path, e.to_string())),
        }
    }
    sized.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
    sized
}

/// Recomputes every object's digest on `pool`, counting the objects
/// and their bytes in `report`; returns the digests of the objects
/// present (good, corrupt or unreadable).
fn check_objects(
    pool: &rayon::ThreadPool,
    sized: &[ToCheck],
    progress: &(dyn Fn(u64, u64) + Sync),
    report: &mut FsckReport,
    strays: &mut Vec<PathBuf>,
) -> HashSet<[u8; 32]> {
    let total: u64 = sized.iter().map(|o| o.2).sum();
    let done = AtomicU64::new(0);
    progress(0, total);
    let results: Vec<(usize, Checked)> = pool.install(|| {
        sized
            .par_iter()
            .enumerate()
            .with_max_len(1)
            .map(|(i, (d, path, _))| {
                let r = check_object(path, d, &|n| {
                    let now = done.fetch_add(n, Ordering::Relaxed) + n;
                    progress(now, total);
                });
                (i, r)
            })
            .collect()
    });
    let mut present: HashSet<[u8; 32]> = HashSet::with_capacity(sized.len());
    for (i, r) in results {
        let (d, path, size) = &sized[i];
        match r {
            Checked::Good => {
                report.objects += 1;
                report.bytes += size;
                present.insert(*d);
            }
            Checked::Corrupt => {
                report.objects += 1;
                report.bytes += size;
                report.corrupt.push(path.clone());
                present.insert(*d);
            }
            Checked::Gone => {}
            Checked::Placeholder => report.placeholders += 1,
            Checked::NotAFile => strays.push(path.clone()),
            Checked::Unreadable(why) => {
                report.unreadable.push((path.clone(), why));
                present.insert(*d);
            }
        }
    }
    progress(done.load(Ordering::Relaxed), total);
    present
}

/// Moves the corrupt objects and the strays to the quarantine; those
/// objects are no longer `present`.
fn repair(store: &Store, report: &mut FsckReport, present: &mut HashSet<[u8; 32]>) -> Result<(), StoreError> {
    // By descriptor, never following a symlink: in a store others can
    // write, a symlink swapped in could otherwise make root move files
    // into, or out of, places outside the store.
    let qdir = store.open_subdir(QUARANTINE_DIR).map_err(|e| match e {
        StoreError::Io { path, err, .. }
            if err.raw_os_error() == Some(libc::ENOTDIR) || err.raw_os_error() == Some(libc::ELOOP) =>
        {
            StoreError::Invalid(format!(
                "{}: not a directory (a symlink or file): cannot repair; remove it and run fsck --repair again",
                path.display()
            ))
        }
        e => e,
    })?;
    for path in report.corrupt.iter().chain(&report.strays) {
        quarantine(store, &qdir, path)?;
        report.repaired.push(path.clone());
        if let Some(d) = path
            .strip_prefix(store.path())
            .ok()
            .and_then(|rel| rel.to_str())
            .and_then(|rel| parse_object_rel(rel.as_bytes()))
        {
            present.remove(&d);
        }
    }
    // The quarantine moves are metadata: make them durable.
    let _ = rfs::fsync(&qdir);
    Ok(())
}

/// Reads the tagged images: objects they reference that are absent
/// (missing, or only not fetched yet for lazily pulled images), which
/// images use the corrupt objects still in place, and bad references.
fn check_references(
    store: &Store,
    pool: &rayon::ThreadPool,
    images: &[TagInfo],
    present: &HashSet<[u8; 32]>,
    present_aliases: &HashSet<[u8; 32]>,
    report: &mut FsckReport,
) {
    report.held = images.iter().filter(|t| t.owner.is_some()).count() as u64;
    report.images = images.len() as u64 - report.held;
    let lazy = crate::remote::records(store);
    let checked: Vec<ImageCheck> = pool.install(|| images.par_iter().map(|t| check_image(store, t, &lazy)).collect());
    // Absent objects, with the tags needing them and whether all of those
    // are lazily pulled images.
    let mut missing: BTreeMap<[u8; 32], (BTreeSet<String>, bool)> = BTreeMap::new();
    let mut missing_aliases: BTreeMap<[u8; 32], (BTreeSet<String>, bool)> = BTreeMap::new();
    // Corrupt objects still in place (not quarantined), by digest.
    let mut corrupt: BTreeMap<[u8; 32], BTreeSet<String>> = report
        .corrupt
        .iter()
        .filter(|p| !report.repaired.contains(p))
        .filter_map(|p| parse_object_rel(p.strip_prefix(store.path()).ok()?.to_str()?.as_bytes()))
        .map(|d| (d, BTreeSet::new()))
        .collect();
    for (tag, c) in images.iter().zip(checked) {
        match c {
            ImageCheck::Gone if tag.owner.is_some() => report.held -= 1,
            ImageCheck::Gone => report.images -= 1,
            ImageCheck::Bad(reason) => report.bad_images.push((tag.name.clone(), reason)),
            ImageCheck::Read {
                objects,
                aliases,
                bad_refs,
                lazy,
            } => {
                for d in aliases.into_iter().filter(|d| !present_aliases.contains(d)) {
                    let (tags, all_lazy) = missing_aliases.entry(d).or_insert_with(|| (BTreeSet::new(), true));
                    tags.insert(tag.name.clone());
                    *all_lazy &= lazy;
                }
                for r in bad_refs {
                    report.bad_images.push((tag.name.clone(), r));
                }
                for d in objects {
                    if !present.contains(&d) && !store.has_object(&d) {
                        let (tags, all_lazy) = missing.entry(d).or_insert_with(|| (BTreeSet::new(), true));
                        tags.insert(tag.name.clone());
                        *all_lazy &= lazy;
                    } else if let Some(users) = corrupt.get_mut(&d) {
                        users.insert(tag.name.clone());
                    }
                }
            }
        }
    }
    let missing = missing.into_iter().map(|(d, m)| (Store::object_rel(&d), m)).chain(
        missing_aliases
            .into_iter()
            .map(|(d, m)| (crate::alias::alias_rel(&d), m)),
    );
    for (rel, (tags, all_lazy)) in missing {
        if all_lazy {
            for t in tags {
                *report.not_fetched.entry(t).or_default() += 1;
            }
        } else {
            report.missing.push((rel, tags.into_iter().collect()));
        }
    }
    report.corrupt_used_by = corrupt
        .into_iter()
        .filter(|(_, tags)| !tags.is_empty())
        .map(|(d, tags)| (store.object_path(&d), tags.into_iter().collect()))
        .collect();
}

enum Checked {
    Good,
    Corrupt,
    /// Removed since the scan.
    Gone,
    /// Not fetched yet ([`crate::placeholder`]): not read.
    Placeholder,
    /// Replaced by something else than a regular file since the scan.
    NotAFile,
    Unreadable(String),
}

/// Recomputes an object's digest, reporting bytes read to `advance`.
fn check_object(path: &Path, want: &[u8; 32], advance: &dyn Fn(u64)) -> Checked {
    let fd = match rfs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Checked::Gone,
        Err(rustix::io::Errno::LOOP) => return Checked::NotAFile,
        Err(e) => return Checked::Unreadable(io::Error::from(e).to_string()),
    };
    match rfs::fstat(&fd) {
        Ok(st) if crate::placeholder::is_placeholder(&st) => return Checked::Placeholder,
        Ok(st) if rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::RegularFile => {}
        Ok(_) => return Checked::NotAFile,
        Err(e) => return Checked::Unreadable(io::Error::from(e).to_string()),
    }
    // Opened without blocking; a regular file, so read it as any other.
    let _ = rfs::fcntl_setfl(&fd, OFlags::empty());
    let _ = rfs::fadvise(&fd, 0, None, rfs::Advice::Sequential);
    let file = std::fs::File::from(fd);
    match verity::digest_file(&file, advance) {
        Ok(d) if d == *want => Checked::Good,
        Ok(_) => Checked::Corrupt,
        Err(e) => Checked::Unreadable(e.to_string()),
    }
}

enum ImageCheck {
    Gone,
    Bad(String),
    Read {
        objects: BTreeSet<[u8; 32]>,
        /// Aliases it names (an image pulled lazily from a table of
        /// contents).
        aliases: BTreeSet<[u8; 32]>,
        bad_refs: Vec<String>,
        /// Pulled lazily: absent objects are expected.
        lazy: bool,
    },
}

/// Reads a tagged image: the objects it references, and its references that
/// cannot be objects.
fn check_image(store: &Store, tag: &TagInfo, lazy_images: &std::collections::HashSet<[u8; 32]>) -> ImageCheck {
    let bytes = match tags::read_listed(store, tag) {
        Ok(Some(b)) => b,
        // Untagged since the listing.
        Ok(None) => return ImageCheck::Gone,
        Err(e) => return ImageCheck::Bad(e.to_string()),
    };
    let (tree, _) = match tilefs_image::erofs::read_image(&bytes) {
        Ok(t) => t,
        Err(e) => return ImageCheck::Bad(e.to_string()),
    };
    // (Hashed only when some image was pulled lazily.)
    let lazy = !lazy_images.is_empty() && lazy_images.contains(&verity::digest_bytes(&bytes));
    drop(bytes);
    let mut objects = BTreeSet::new();
    let mut aliases = BTreeSet::new();
    let mut bad_refs = Vec::new();
    let mut more_bad = 0usize;
    tree.walk(|path, entry, id| {
        if entry.is_some_and(|e| e.hardlink) {
            return;
        }
        let inode = tree.inode(id);
        if !inode.is_external() {
            return;
        }
        // An external file without a redirect reads as zeros: no object.
        let Some(payload) = inode.payload.as_deref().filter(|p| !p.is_empty()) else {
            return;
        };
        let problem = match parse_object_rel(payload) {
            Some(d) => {
                objects.insert(d);
                match inode.digest {
                    Some(digest) if digest != d => Some(format!(
                        "{}: its fs-verity digest is {} but its redirect names object {}",
                        String::from_utf8_lossy(path),
                        hex::encode(digest),
                        Store::object_rel(&d)
                    )),
                    _ => None,
                }
            }
            None => match crate::alias::parse_alias_rel(payload) {
                Some(d) => {
                    aliases.insert(d);
                    None
                }
                None => Some(format!(
                    "{}: redirect {:?} is not an object path (XX/ and 62 lower-case hex digits)",
                    String::from_utf8_lossy(path),
                    String::from_utf8_lossy(payload)
                )),
            },
        };
        if let Some(p) = problem {
            if bad_refs.len() < MAX_BAD_REFS_PER_IMAGE {
                bad_refs.push(p);
            } else {
                more_bad += 1;
            }
        }
    });
    if more_bad > 0 {
        bad_refs.push(format!("and {more_bad} more bad references"));
    }
    ImageCheck::Read {
        objects,
        aliases,
        bad_refs,
        lazy,
    }
}

/// Moves `path` into the quarantine directory `qdir` under a name made from
/// its store-relative path, never replacing anything there. The path is
/// reached from the store's own descriptor without following a symlink.
fn quarantine(store: &Store, qdir: &OwnedFd, path: &Path) -> Result<PathBuf, StoreError> {
    let rel = path.strip_prefix(store.path()).unwrap_or(path);
    let (parent, name) = match (rel.parent(), rel.file_name()) {
        (Some(p), Some(n)) => (p, n),
        _ => return Err(StoreError::Invalid(format!("{}: not in the store", path.display()))),
    };
    let from = if parent.as_os_str().is_empty() {
        rfs::openat(
            store.dir_fd(),
            ".",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
    } else {
        rfs::openat2(
            store.dir_fd(),
            parent,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            rfs::ResolveFlags::BENEATH | rfs::ResolveFlags::NO_SYMLINKS | rfs::ResolveFlags::NO_MAGICLINKS,
        )
    }
    .map_err(|e| StoreError::io(path, "cannot move to quarantine", e.into()))?;
    let base: String = rel.to_string_lossy().replace('/', "_");
    let base = base.trim_start_matches('_').to_string();
    let qpath = store.join(QUARANTINE_DIR);
    for n in 0u32.. {
        let dest = if n == 0 { base.clone() } else { format!("{base}.{n}") };
        // renameat2(RENAME_NOREPLACE) where the filesystem has it; else a
        // check first (the store lock keeps other tilefs processes out of
        // the quarantine, which only fsck --repair writes).
        match rfs::renameat_with(&from, name, qdir, &dest, rfs::RenameFlags::NOREPLACE) {
            Ok(()) => return Ok(qpath.join(dest)),
            Err(rustix::io::Errno::EXIST) => continue,
            Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS) => {
                if rfs::statat(qdir, &dest, rfs::AtFlags::SYMLINK_NOFOLLOW).is_ok() {
                    continue;
                }
                rfs::renameat(&from, name, qdir, &dest)
                    .map_err(|e| StoreError::io(path, "cannot move to quarantine", e.into()))?;
                return Ok(qpath.join(dest));
            }
            Err(e) => return Err(StoreError::io(path, "cannot move to quarantine", e.into())),
        }
    }
    unreachable!()
}
