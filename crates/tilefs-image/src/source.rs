//! Builds a tree from a directory on disk, as the reference `mkcomposefs`
//! does from a directory.
//!
//! Every entry is read with `lstat` semantics (symlinks are never
//! followed). By default each becomes its own inode: like the reference, a
//! directory build does not look for hardlinks, so every non-directory has
//! nlink 1 (and images stay byte-identical to the reference's). With
//! [`ScanOptions::hardlinks`], names of one inode (same device and inode
//! number) share one inode in the tree, whose nlink counts its names there.
//! Regular files get their fs-verity digest and object path; files of at
//! most [`RECOMMENDED_INLINE_MAX`] bytes also keep their contents inline.
//!
//! The walk is parallel: each directory is one task on a rayon pool, its
//! entries are examined (stat, xattrs, symlink target, contents and
//! digest) in parallel, and each subdirectory becomes a new task. Tasks
//! open everything relative to their directory's descriptor, so no path is
//! walked twice and no depth limit applies. The tree is assembled at the
//! end on one thread, in name order, so the result does not depend on the
//! order the work happened in.

use crate::flat::{FlatTree, Meta, NewInode};
use crate::tree::{
    digest_object_path, validate_name, FileType, Inode, InodeId, Timespec, Tree, Xattr, EXTERNAL_XATTR_BUDGET,
    MAX_NAME_LEN, RECOMMENDED_INLINE_MAX, ROOT, S_IFDIR, S_IFMT, S_IFREG,
};
use crate::verity;
use rayon::prelude::*;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{AtFlags, Mode, OFlags, RawDir, Stat};
use rustix::io::Errno;
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, CString, OsStr};
use std::mem::MaybeUninit;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// What to read from the directory.
#[derive(Debug, Clone, Default)]
pub struct ScanOptions {
    /// All mtimes zero.
    pub use_epoch: bool,
    /// Leave out block and character devices.
    pub skip_devices: bool,
    /// Store no xattrs.
    pub skip_xattrs: bool,
    /// Store only user.* xattrs (`skip_xattrs` wins if both are set).
    pub user_xattrs: bool,
    /// Worker threads for the walk and the digests (0: 8 per core, see
    /// [`worker_threads`]).
    pub jobs: usize,
    /// Counters updated as the scan goes, for progress displays.
    pub progress: Option<Arc<ScanProgress>>,
    /// Keep hardlinks: names of one source inode share one inode.
    pub hardlinks: bool,
    /// Once set, the scan stops at the next entry with an error saying
    /// "interrupted".
    pub cancel: Option<Arc<AtomicBool>>,
}

/// What a running scan has done so far.
#[derive(Debug, Default)]
pub struct ScanProgress {
    /// Entries examined.
    pub entries: AtomicU64,
    /// Regular files whose contents were read (or found in the store).
    pub files: AtomicU64,
    /// Their bytes.
    pub bytes: AtomicU64,
}

/// Where the contents of external files (more than 64 bytes) go while the
/// tree is scanned: an object store imports them and names them by digest.
pub trait ContentSink: Sync {
    /// Takes the regular file `name` in `dir` (as `stat` describes it) and
    /// returns the fs-verity digest of exactly the contents it kept.
    fn store(&self, dir: BorrowedFd<'_>, name: &CStr, path: &Path, stat: &Stat) -> Result<[u8; 32], String>;
}

/// A scanned tree and where each external regular file came from.
pub struct Scan {
    pub tree: Tree,
    /// Source path of every regular file stored outside the image.
    pub sources: Vec<(InodeId, PathBuf)>,
}

/// A directory that cannot be scanned: the path and the reason.
#[derive(Debug, thiserror::Error)]
#[error("{}: {reason}", path.display())]
pub struct SourceError {
    pub path: PathBuf,
    pub reason: String,
}

impl SourceError {
    fn new(path: impl Into<PathBuf>, reason: impl Into<String>) -> SourceError {
        SourceError {
            path: path.into(),
            reason: reason.into(),
        }
    }

    fn os(path: impl Into<PathBuf>, what: &str, err: Errno) -> SourceError {
        let err = std::io::Error::from(err);
        SourceError::new(path, format!("{what}: {err}"))
    }
}

/// How regular files are opened. NOFOLLOW and NONBLOCK: if the entry was
/// swapped for a symlink or a fifo since it was listed, fail (or see it is
/// no regular file) rather than follow or hang.
const REGULAR_OPEN: OFlags = OFlags::RDONLY
    .union(OFlags::NOFOLLOW)
    .union(OFlags::NONBLOCK)
    .union(OFlags::NOCTTY)
    .union(OFlags::CLOEXEC);

/// Read buffer for file contents, one per thread.
const READ_BUF_SIZE: usize = 256 * 1024;
/// Files at least this large are announced to the kernel as read
/// sequentially (more readahead when the cache is cold).
const FADVISE_MIN: u64 = 1 << 20;
/// Files at least this large are read and hashed in segments, in parallel.
const PARALLEL_MIN: u64 = 16 << 20;
/// Segment size for that (a whole number of blocks and of read buffers).
const SEGMENT: u64 = 4 << 20;
/// Longest path the path-based xattr calls accept (PATH_MAX with its NUL).
const PATH_MAX: usize = 4096;

thread_local! {
    static READ_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Threads for a scan: as asked, or by default 8 per core, because a scan
/// of a cold tree spends most of its time waiting for the disk, and more
/// requests in flight is what makes it faster (about 3x on a virtio disk).
pub fn worker_threads(jobs: usize) -> usize {
    if jobs > 0 {
        return jobs;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores * 8).min(64)
}

/// Scans `root` (a directory) into a tree, with fs-verity digests and
/// object paths for external files and contents for small ones.
pub fn scan(root: &Path, opts: &ScanOptions) -> Result<Scan, SourceError> {
    scan_into(root, opts, None)
}

/// Like [`scan`], giving the contents of external files to `sink`.
pub fn scan_into(root: &Path, opts: &ScanOptions, sink: Option<&dyn ContentSink>) -> Result<Scan, SourceError> {
    let mut sources = Vec::new();
    let flat = walk(root, opts, sink, Some(&mut sources))?;
    Ok(Scan {
        tree: flat.to_tree(),
        sources,
    })
}

/// Like [`scan_into`], into a [`FlatTree`] (what image builds use), its
/// inodes numbered the same way.
pub fn scan_flat(root: &Path, opts: &ScanOptions, sink: Option<&dyn ContentSink>) -> Result<FlatTree, SourceError> {
    walk(root, opts, sink, None)
}

/// Scans every directory under `root`, in parallel, and builds the tree
/// from them meanwhile (see [`assemble`]).
fn walk(
    root: &Path,
    opts: &ScanOptions,
    sink: Option<&dyn ContentSink>,
    sources: Option<&mut Vec<(InodeId, PathBuf)>>,
) -> Result<FlatTree, SourceError> {
    let st = rustix::fs::lstat(root).map_err(|e| SourceError::os(root, "cannot stat", e))?;
    if FileType::from_mode(st.st_mode as u32) != Some(FileType::Directory) {
        return Err(SourceError::new(root, "not a directory"));
    }
    let root_meta = meta_from_stat(&st, opts);

    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(worker_threads(opts.jobs))
        .thread_name(|i| format!("tilefs-scan-{i}"))
        // A thread waiting inside one directory's parallel loop may run
        // other directories' tasks meanwhile: leave room for that nesting.
        .stack_size(8 << 20)
        .build()
        .map_err(|e| SourceError::new(root, format!("cannot start worker threads: {e}")))?;

    let walk = Walk {
        opts,
        sink,
        next_dir: AtomicUsize::new(1),
        dirs: Mutex::new(Vec::new()),
        ready: Condvar::new(),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
    };
    let tree = pool.install(|| {
        rayon::scope(|s| {
            walk.dir_task(s, DirRef::Root, root.to_path_buf(), 0);
            let tree = assemble(root_meta, &walk, sources);
            if tree.is_err() {
                // The other tasks stop at their next entry.
                walk.failed.store(true, Ordering::Relaxed);
            }
            tree
        })
    });
    // A scan error comes first: the assembly may have stopped because of it.
    if let Some(err) = walk.error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(err);
    }
    tree
}

/// A scanned directory: its own xattrs and its entries, sorted by name.
struct DirScan {
    path: PathBuf,
    xattrs: Vec<Xattr>,
    entries: Vec<Scanned>,
}

/// What the scan learns of one file, before it goes into the tree.
#[derive(Default)]
struct FileInfo {
    meta: Meta,
    /// Symlink target.
    target: Option<Vec<u8>>,
    /// Inline contents of a small regular file.
    content: Option<Vec<u8>>,
    /// fs-verity digest of a regular file (its object path follows).
    digest: Option<[u8; 32]>,
    xattrs: Vec<Xattr>,
}

impl FileInfo {
    fn is_dir(&self) -> bool {
        self.meta.mode & S_IFMT == S_IFDIR
    }

    fn is_external(&self) -> bool {
        self.meta.mode & S_IFMT == S_IFREG && self.meta.size > 0 && self.content.is_none()
    }
}

/// One entry of a scanned directory.
struct Scanned {
    name: CString,
    info: FileInfo,
    /// For a directory: the index of its own [`DirScan`].
    subdir: Option<usize>,
    /// With [`ScanOptions::hardlinks`], for a non-directory with more than
    /// one link: its (device, inode number).
    link_key: Option<(u64, u64)>,
}

/// How a directory task finds its directory.
enum DirRef {
    Root,
    /// A name in a parent directory, kept open until its children have
    /// opened theirs.
    Child(Arc<OwnedFd>, CString),
}

/// State shared by all the tasks of one scan.
struct Walk<'a> {
    opts: &'a ScanOptions,
    sink: Option<&'a dyn ContentSink>,
    /// Index of the next directory found (the root is 0).
    next_dir: AtomicUsize,
    /// Scanned directories by index, until the tree takes them.
    dirs: Mutex<Vec<Option<DirScan>>>,
    /// Signalled when a directory is scanned or the scan fails.
    ready: Condvar,
    /// Set on the first error: remaining tasks stop early.
    failed: AtomicBool,
    error: Mutex<Option<SourceError>>,
}

impl<'a> Walk<'a> {
    fn fail(&self, err: SourceError) {
        let mut slot = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(err);
        }
        self.failed.store(true, Ordering::Relaxed);
        drop(slot);
        let _dirs = self.dirs.lock().unwrap_or_else(|e| e.into_inner());
        self.ready.notify_all();
    }

    /// Directory `i` once it is scanned, running scan tasks meanwhile;
    /// None if the scan failed.
    fn wait_for(&self, i: usize) -> Option<DirScan> {
        loop {
            if let Some(d) = self
                .dirs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_mut(i)
                .and_then(Option::take)
            {
                return Some(d);
            }
            if self.failed.load(Ordering::Relaxed) {
                return None;
            }
            // Help while it is not there; sleep when there is nothing to do
            // (the other workers are scanning).
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
                let dirs = self.dirs.lock().unwrap_or_else(|e| e.into_inner());
                if dirs.get(i).is_none_or(Option::is_none) && !self.failed.load(Ordering::Relaxed) {
                    let _ = self.ready.wait_timeout(dirs, std::time::Duration::from_millis(10));
                }
            }
        }
    }

    /// Scans one directory and spawns a task for each subdirectory.
    fn dir_task<'s>(&'s self, scope: &rayon::Scope<'s>, dir: DirRef, path: PathBuf, index: usize)
    where
        'a: 's,
    {
        if self.failed.load(Ordering::Relaxed) {
            return;
        }
        match self.scan_dir(dir, &path) {
            Ok((fd, mut scan)) => {
                let fd = Arc::new(fd);
                for entry in scan.entries.iter_mut() {
                    if !entry.info.is_dir() {
                        continue;
                    }
                    let sub = self.next_dir.fetch_add(1, Ordering::Relaxed);
                    entry.subdir = Some(sub);
                    let child_path = path.join(OsStr::from_bytes(entry.name.to_bytes()));
                    let child = DirRef::Child(fd.clone(), entry.name.clone());
                    scope.spawn(move |s| self.dir_task(s, child, child_path, sub));
                }
                scan.path = path;
                let mut dirs = self.dirs.lock().unwrap_or_else(|e| e.into_inner());
                if dirs.len() <= index {
                    dirs.resize_with(index + 1, || None);
                }
                dirs[index] = Some(scan);
                self.ready.notify_all();
            }
            Err(e) => self.fail(e),
        }
    }

    /// Opens and reads one directory: its xattrs, its entries (each
    /// examined in parallel), sorted by name.
    fn scan_dir(&self, dir: DirRef, path: &Path) -> Result<(OwnedFd, DirScan), SourceError> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = match dir {
            DirRef::Root => rustix::fs::open(path, flags, Mode::empty()),
            DirRef::Child(parent, name) => rustix::fs::openat(&*parent, name.as_c_str(), flags, Mode::empty()),
        }
        .map_err(|e| SourceError::os(path, "cannot open directory", e))?;

        let xattrs = if self.opts.skip_xattrs {
            Vec::new()
        } else {
            read_xattrs(XattrSource::Fd(fd.as_fd()), self.opts.user_xattrs).map_err(|e| e.at(path))?
        };

        let names = list_dir(fd.as_fd()).map_err(|e| SourceError::os(path, "cannot read directory", e))?;
        let dirfd = fd.as_fd();
        let scanned: Vec<Option<Scanned>> = names
            .into_par_iter()
            .map(|(name, is_reg)| {
                if self.failed.load(Ordering::Relaxed) {
                    return Ok(None);
                }
                scan_entry(dirfd, path, name, is_reg, self.opts, self.sink)
            })
            .collect::<Result<_, SourceError>>()?;
        let mut entries: Vec<Scanned> = scanned.into_iter().flatten().collect();
        entries.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        Ok((
            fd,
            DirScan {
                path: PathBuf::new(),
                xattrs,
                entries,
            },
        ))
    }
}

/// The names in a directory, without `.` and `..`, and whether the
/// directory says each is a regular file.
fn list_dir(fd: BorrowedFd<'_>) -> Result<Vec<(CString, bool)>, Errno> {
    thread_local! {
        // One getdents64 buffer per thread, not one per directory.
        static DIR_BUF: RefCell<Vec<MaybeUninit<u8>>> = const { RefCell::new(Vec::new()) };
    }
    DIR_BUF.with_borrow_mut(|buf| {
        if buf.is_empty() {
            buf.resize(32 * 1024, MaybeUninit::uninit());
        }
        let mut dir = RawDir::new(fd, &mut buf[..]);
        let mut names = Vec::new();
        while let Some(entry) = dir.next() {
            let entry = entry?;
            let name = entry.file_name();
            let bytes = name.to_bytes();
            if bytes == b"." || bytes == b".." {
                continue;
            }
            names.push((name.to_owned(), entry.file_type() == rustix::fs::FileType::RegularFile));
        }
        Ok(names)
    })
}

/// The inode fields that come from `lstat` (nlink 1, as the reference
/// gives every file of a directory source).
#[allow(clippy::unnecessary_cast)]
fn meta_from_stat(st: &Stat, opts: &ScanOptions) -> Meta {
    Meta {
        mode: st.st_mode as u32,
        nlink: 1,
        uid: st.st_uid as u32,
        gid: st.st_gid as u32,
        // The 32-bit kernel encoding is the low half of the 64-bit one.
        rdev: st.st_rdev as u64 as u32,
        size: st.st_size as u64,
        mtime: if opts.use_epoch {
            Timespec::default()
        } else {
            Timespec {
                sec: st.st_mtime as i64,
                nsec: st.st_mtime_nsec as u32,
            }
        },
    }
}

/// Examines one entry of a directory; `None` if it is left out.
#[allow(clippy::unnecessary_cast)] // st_mode is not u32 everywhere
fn scan_entry(
    dirfd: BorrowedFd<'_>,
    dir: &Path,
    owned_name: CString,
    is_reg: bool,
    opts: &ScanOptions,
    sink: Option<&dyn ContentSink>,
) -> Result<Option<Scanned>, SourceError> {
    let name = owned_name.as_c_str();
    let name_bytes = name.to_bytes();
    let path = || dir.join(OsStr::from_bytes(name_bytes));
    if opts.cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed)) {
        return Err(SourceError::new(path(), "interrupted"));
    }
    if name_bytes.len() > MAX_NAME_LEN {
        return Err(SourceError::new(
            path(),
            format!(
                "file name is {} bytes, longer than the {MAX_NAME_LEN} the format holds",
                name_bytes.len()
            ),
        ));
    }
    // A regular file (as the directory listing says) of a build without a
    // store is opened first and the descriptor stat'ed: one path lookup, not
    // two. Anything else (or a file that changed meanwhile) is stat'ed by
    // name, as it always is with a store, whose import opens the file
    // itself only when its digest is not known already.
    let opened = (is_reg && sink.is_none())
        .then(|| rustix::fs::openat(dirfd, name, REGULAR_OPEN, Mode::empty()).ok())
        .flatten()
        .and_then(|fd| {
            let st = rustix::fs::fstat(&fd).ok()?;
            (FileType::from_mode(st.st_mode as u32) == Some(FileType::Regular)).then_some((fd, st))
        });
    let (opened, st) = match opened {
        Some((fd, st)) => (Some(fd), st),
        None => (
            None,
            rustix::fs::statat(dirfd, name, AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| SourceError::os(path(), "cannot stat", e))?,
        ),
    };
    let Some(ftype) = FileType::from_mode(st.st_mode as u32) else {
        return Err(SourceError::new(
            path(),
            format!("unknown file type (mode {:o})", st.st_mode),
        ));
    };
    if opts.skip_devices && matches!(ftype, FileType::BlockDevice | FileType::CharDevice) {
        return Ok(None);
    }
    let mut inode = FileInfo {
        meta: meta_from_stat(&st, opts),
        ..FileInfo::default()
    };
    #[allow(clippy::unnecessary_cast)]
    let link_key = (opts.hardlinks && ftype != FileType::Directory && st.st_nlink > 1)
        .then_some((st.st_dev as u64, st.st_ino as u64));
    let mut xattrs_from_path = !opts.skip_xattrs;
    if let Some(p) = &opts.progress {
        p.entries.fetch_add(1, Ordering::Relaxed);
        if ftype == FileType::Regular && inode.meta.size > 0 {
            p.files.fetch_add(1, Ordering::Relaxed);
            p.bytes.fetch_add(inode.meta.size, Ordering::Relaxed);
        }
    }
    match ftype {
        // Its own task reads its xattrs, through its descriptor.
        FileType::Directory => xattrs_from_path = false,
        FileType::Regular if inode.meta.size > RECOMMENDED_INLINE_MAX && sink.is_some() => {
            let digest = sink
                .unwrap()
                .store(dirfd, name, &path(), &st)
                .map_err(|e| SourceError::new(path(), e))?;
            inode.digest = Some(digest);
        }
        FileType::Regular if inode.meta.size > 0 => {
            read_regular(dirfd, name, opened, &mut inode, opts).map_err(|e| e.at(&path()))?;
            xattrs_from_path = false;
        }
        FileType::Regular if !opts.skip_xattrs => {
            if let Some(fd) = &opened {
                inode.xattrs = read_xattrs(XattrSource::Fd(fd.as_fd()), opts.user_xattrs).map_err(|e| e.at(&path()))?;
                xattrs_from_path = false;
            }
        }
        FileType::Symlink => {
            let target = rustix::fs::readlinkat(dirfd, name, Vec::new())
                .map_err(|e| SourceError::os(path(), "cannot read symlink", e))?
                .into_bytes();
            inode.meta.size = target.len() as u64;
            inode.target = Some(target);
        }
        _ => {}
    }
    if xattrs_from_path {
        let xattrs = read_xattrs_at(dirfd, dir, name, opts.user_xattrs).map_err(|e| e.at(&path()))?;
        inode.xattrs = xattrs;
    }
    Ok(Some(Scanned {
        name: owned_name,
        info: inode,
        subdir: None,
        link_key,
    }))
}

/// An error tied to the entry being examined, before its path is known.
enum EntryError {
    Os(&'static str, Errno),
    Other(String),
}

impl EntryError {
    fn at(self, path: &Path) -> SourceError {
        match self {
            EntryError::Os(what, e) => SourceError::os(path, what, e),
            EntryError::Other(reason) => SourceError::new(path, reason),
        }
    }
}

/// Reads a non-empty regular file: digest, object path, inline contents
/// for small files, and xattrs through the open descriptor.
fn read_regular(
    dirfd: BorrowedFd<'_>,
    name: &CStr,
    opened: Option<OwnedFd>,
    inode: &mut FileInfo,
    opts: &ScanOptions,
) -> Result<(), EntryError> {
    let fd = match opened {
        Some(fd) => fd,
        None => rustix::fs::openat(dirfd, name, REGULAR_OPEN, Mode::empty())
            .map_err(|e| EntryError::Os("cannot open", e))?,
    };
    let size = inode.meta.size;
    if size >= FADVISE_MIN {
        // Only a hint: failure changes nothing.
        let _ = rustix::fs::fadvise(&fd, 0, None, rustix::fs::Advice::Sequential);
    }
    let digest = if size >= PARALLEL_MIN && rayon::current_num_threads() > 1 {
        digest_in_segments(fd.as_fd(), size)?
    } else {
        let (digest, content) = digest_sequentially(fd.as_fd(), size)?;
        inode.content = content;
        digest
    };
    inode.digest = Some(digest);
    if !opts.skip_xattrs {
        inode.xattrs = read_xattrs(XattrSource::Fd(fd.as_fd()), opts.user_xattrs)?;
    }
    Ok(())
}

fn size_changed(size: u64, read: &str) -> EntryError {
    EntryError::Other(format!(
        "file changed size while being read ({size} bytes when examined, {read} read)"
    ))
}

/// Runs `f` with this thread's read buffer.
fn with_read_buf<T>(f: impl FnOnce(&mut [u8]) -> T) -> T {
    READ_BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        if buf.len() < READ_BUF_SIZE {
            buf.resize(READ_BUF_SIZE, 0);
        }
        f(&mut buf[..])
    })
}

/// Reads a file from its current offset to the end, hashing as it goes;
/// also returns the contents of a file small enough to be inline.
fn digest_sequentially(fd: BorrowedFd<'_>, size: u64) -> Result<([u8; 32], Option<Vec<u8>>), EntryError> {
    let inline = size <= RECOMMENDED_INLINE_MAX;
    let mut content = Vec::new();
    let mut hasher = verity::Hasher::new();
    let mut total: u64 = 0;
    with_read_buf(|buf| -> Result<(), EntryError> {
        loop {
            let n = match rustix::io::read(fd, &mut *buf) {
                Ok(n) => n,
                Err(Errno::INTR) => continue,
                Err(e) => return Err(EntryError::Os("cannot read", e)),
            };
            if n == 0 {
                return Ok(());
            }
            let data = &buf[..n];
            hasher.update(data);
            if inline && content.len() <= RECOMMENDED_INLINE_MAX as usize {
                let room = RECOMMENDED_INLINE_MAX as usize + 1 - content.len();
                content.extend_from_slice(&data[..n.min(room)]);
            }
            total += n as u64;
            if total > size {
                return Err(size_changed(size, &format!("at least {total}")));
            }
            // A read cut short exactly at the size stat gave is the end
            // of the file: spare the read that would return 0.
            if total == size && n < buf.len() {
                return Ok(());
            }
        }
    })?;
    if total != size {
        return Err(size_changed(size, &total.to_string()));
    }
    Ok((hasher.finalize(), inline.then_some(content)))
}

/// Digest of a large file, its segments read and hashed in parallel.
fn digest_in_segments(fd: BorrowedFd<'_>, size: u64) -> Result<[u8; 32], EntryError> {
    let segments = size.div_ceil(SEGMENT);
    // A few segments per thread at a time: keeps every thread busy while
    // holding the hashes of only a bounded part of the file.
    let batch = rayon::current_num_threads() as u64 * 4;
    let mut hasher = verity::Hasher::new();
    let mut first = 0;
    while first < segments {
        let end = (first + batch).min(segments);
        let hashes: Vec<Result<Vec<[u8; 32]>, EntryError>> = (first..end)
            .into_par_iter()
            .map(|i| {
                let offset = i * SEGMENT;
                hash_segment(fd, offset, SEGMENT.min(size - offset), size)
            })
            .collect();
        for (i, h) in (first..end).zip(hashes) {
            let offset = i * SEGMENT;
            hasher.update_block_hashes(SEGMENT.min(size - offset), &h?);
        }
        first = end;
    }
    // The file must end where stat said.
    let mut probe = [0u8; 1];
    loop {
        match rustix::io::pread(fd, &mut probe, size) {
            Ok(0) => break,
            Ok(_) => return Err(size_changed(size, &format!("at least {}", size + 1))),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(EntryError::Os("cannot read", e)),
        }
    }
    Ok(hasher.finalize())
}

/// Hashes of the blocks of `len` bytes at `offset` (a block boundary).
fn hash_segment(fd: BorrowedFd<'_>, offset: u64, len: u64, size: u64) -> Result<Vec<[u8; 32]>, EntryError> {
    with_read_buf(|buf| {
        let mut hashes = Vec::with_capacity(len.div_ceil(verity::BLOCK_SIZE as u64) as usize);
        let mut done = 0u64;
        while done < len {
            // Fill the buffer (a whole number of blocks) before hashing.
            let want = (len - done).min(buf.len() as u64) as usize;
            let mut filled = 0;
            while filled < want {
                let at = offset + done + filled as u64;
                match rustix::io::pread(fd, &mut buf[filled..want], at) {
                    Ok(0) => return Err(size_changed(size, &format!("only {at}"))),
                    Ok(n) => filled += n,
                    Err(Errno::INTR) => continue,
                    Err(e) => return Err(EntryError::Os("cannot read", e)),
                }
            }
            verity::block_hashes(&buf[..want], &mut hashes);
            done += want as u64;
        }
        Ok(hashes)
    })
}

/// Where to read xattrs from.
#[derive(Clone, Copy)]
enum XattrSource<'a> {
    /// An open file or directory.
    Fd(BorrowedFd<'a>),
    /// A path, not followed if it is a symlink.
    Path(&'a CStr),
}

impl XattrSource<'_> {
    fn list(self, buf: &mut [u8]) -> Result<usize, Errno> {
        match self {
            XattrSource::Fd(fd) => rustix::fs::flistxattr(fd, buf),
            XattrSource::Path(p) => rustix::fs::llistxattr(p, buf),
        }
    }

    fn get(self, name: &CStr, buf: &mut [u8]) -> Result<usize, Errno> {
        match self {
            XattrSource::Fd(fd) => rustix::fs::fgetxattr(fd, name, buf),
            XattrSource::Path(p) => rustix::fs::lgetxattr(p, name, buf),
        }
    }
}

/// Calls `f` with ever larger buffers until the answer fits (xattrs can
/// grow between a size query and the read).
fn with_growing_buf(mut f: impl FnMut(&mut [u8]) -> Result<usize, Errno>) -> Result<Vec<u8>, Errno> {
    let mut buf = vec![0u8; 1024];
    loop {
        match f(&mut buf) {
            Ok(n) => {
                buf.truncate(n);
                return Ok(buf);
            }
            Err(Errno::RANGE) => {
                let need = f(&mut [])?;
                buf.resize(need.max(buf.len() * 2), 0);
            }
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Reads the xattrs of an entry of a directory, without following it.
fn read_xattrs_at(dirfd: BorrowedFd<'_>, dir: &Path, name: &CStr, user_only: bool) -> Result<Vec<Xattr>, EntryError> {
    let dir_bytes = dir.as_os_str().as_bytes();
    let name_bytes = name.to_bytes();
    let mut path = Vec::with_capacity(dir_bytes.len() + name_bytes.len() + 2);
    if dir_bytes.len() + name_bytes.len() + 2 <= PATH_MAX {
        path.extend_from_slice(dir_bytes);
    } else {
        // Too long for the path-based calls: reach the directory through
        // its descriptor instead.
        let fd_num = {
            use std::os::fd::AsRawFd;
            dirfd.as_raw_fd()
        };
        path.extend_from_slice(format!("/proc/self/fd/{fd_num}").as_bytes());
    }
    path.push(b'/');
    path.extend_from_slice(name_bytes);
    let path = CString::new(path).map_err(|_| EntryError::Other("path contains a NUL byte".into()))?;
    read_xattrs(XattrSource::Path(&path), user_only)
}

/// Reads all xattrs (or only `user.*` ones), checked against the budget of
/// an inode, sorted by name.
fn read_xattrs(src: XattrSource<'_>, user_only: bool) -> Result<Vec<Xattr>, EntryError> {
    // Most files have none: one call with a small buffer says so.
    let mut small = [0u8; 256];
    let list = match src.list(&mut small) {
        Ok(0) => return Ok(Vec::new()),
        Ok(n) => small[..n].to_vec(),
        Err(Errno::RANGE) => with_growing_buf(|b| src.list(b)).map_err(|e| EntryError::Os("cannot list xattrs", e))?,
        // A filesystem without xattrs has none to give.
        Err(Errno::OPNOTSUPP) => return Ok(Vec::new()),
        Err(e) => return Err(EntryError::Os("cannot list xattrs", e)),
    };
    let mut holder = Inode::default();
    for key in list.split_inclusive(|&b| b == 0) {
        let Ok(key) = CStr::from_bytes_with_nul(key) else {
            continue;
        };
        let key_bytes = key.to_bytes();
        if key_bytes.is_empty() || (user_only && !key_bytes.starts_with(b"user.")) {
            continue;
        }
        let value = match with_growing_buf(|b| src.get(key, b)) {
            Ok(v) => v,
            // Removed since it was listed.
            Err(Errno::NODATA) => continue,
            Err(e) => {
                return Err(EntryError::Other(format!(
                    "cannot read xattr {}: {}",
                    key.to_string_lossy(),
                    std::io::Error::from(e)
                )))
            }
        };
        holder
            .set_xattr(key_bytes, &value, EXTERNAL_XATTR_BUDGET)
            .map_err(|e| EntryError::Other(format!("cannot store xattr {}: {e}", key.to_string_lossy())))?;
    }
    holder.xattrs.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    Ok(holder.xattrs)
}

/// Builds the tree from the scanned directories, breadth first in name
/// order, on one thread (so inode numbers do not depend on which directory
/// was scanned first), taking each directory as soon as it is scanned: the
/// scans of all directories are never in memory at once, and the tree is
/// ready soon after the last one. With `sources`, also lists the source
/// path of each external file.
fn assemble(
    root: Meta,
    walk: &Walk,
    mut sources: Option<&mut Vec<(InodeId, PathBuf)>>,
) -> Result<FlatTree, SourceError> {
    let take = |i: usize| -> Result<DirScan, SourceError> {
        // (A failed scan's own error is what the caller reports.)
        walk.wait_for(i).ok_or_else(|| SourceError::new("", "scan failed"))
    };
    let mut tree = FlatTree::new(root);
    let mut queue = VecDeque::new();
    // Kept hardlinks: the first name met (in this fixed order) is the
    // inode's primary entry, later ones link to it.
    let mut linked: HashMap<(u64, u64), InodeId> = HashMap::new();
    let too_large = |e: crate::flat::TooLarge| SourceError::new("", e.to_string());
    queue.push_back((0, ROOT));
    while let Some((index, id)) = queue.pop_front() {
        let dir = take(index)?;
        let subdirs = dir.entries.iter().filter(|e| e.info.is_dir()).count();
        tree.set_xattrs(id, dir.xattrs.iter().map(|x| (&x.key[..], &x.value[..])))
            .map_err(too_large)?;
        tree.meta_mut(id).nlink = u32::try_from(subdirs + 2).unwrap_or(u32::MAX);
        for entry in dir.entries {
            let name = entry.name.to_bytes();
            let at = || dir.path.join(OsStr::from_bytes(name));
            validate_name(name).map_err(|e| SourceError::new(at(), e.to_string()))?;
            if let Some(&target) = entry.link_key.as_ref().and_then(|k| linked.get(k)) {
                tree.push_entry(id, name, target, true).map_err(too_large)?;
                let t = tree.meta_mut(target);
                t.nlink = t.nlink.saturating_add(1);
                continue;
            }
            let info = &entry.info;
            let object = info.digest.map(|d| digest_object_path(&d));
            let new = NewInode {
                payload: info.target.as_deref().or(object.as_deref().map(str::as_bytes)),
                content: info.content.as_deref(),
                digest: info.digest,
            };
            let child = tree
                .add_inode(info.meta, new, info.xattrs.iter().map(|x| (&x.key[..], &x.value[..])))
                .map_err(too_large)?;
            tree.push_entry(id, name, child, false).map_err(too_large)?;
            if let Some(key) = entry.link_key {
                linked.insert(key, child);
            }
            if let Some(sub) = entry.subdir {
                queue.push_back((sub, child));
            } else if let Some(sources) = sources.as_deref_mut().filter(|_| info.is_external()) {
                sources.push((child, at()));
            }
        }
    }
    Ok(tree)
}
