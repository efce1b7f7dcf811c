//! Putting source files into the store.
//!
//! Each file is cloned (`FICLONE`) into a temporary file in `STORE/.tmp`
//! and the clone is hashed, or, where the filesystem cannot clone, read
//! once: every buffer is hashed and written to the temporary file. Either
//! way the digest is of exactly the bytes the object holds, even if the
//! source changes meanwhile. Objects already present are not written again.
//!
//! New objects become visible in batches: the temporary files are made
//! durable with one `syncfs` (far cheaper than an fsync per object), then
//! renamed to their final names, then the store is synced again. A crash
//! at any point leaves only complete objects under object names, and
//! temporary files that `gc` removes.
//!
//! A digest cache maps a source file's identity (device, inode, size,
//! mtime, ctime) to its digest, so importing an unchanged tree again reads
//! no file contents at all. ctime cannot be set by users, so a changed
//! file always misses the cache.

use crate::layout::{temp_name, DIGEST_CACHE, NO_VERITY_NOTED, TMP_DIR};
use crate::{FileState, LockMode, Store, StoreError, StoreLock};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{self as rfs, AtFlags, Mode, OFlags};
use std::collections::{HashMap, HashSet};
use std::ffi::CStr;
use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::Mutex;
use tilefs_image::verity;

/// How objects are made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Method {
    /// Clone where the filesystem can, copy otherwise.
    #[default]
    Copy,
    /// Move the source file into the store where no writer can reach it:
    /// its inode becomes the object (hardlinked in, no data written), and
    /// the caller removes the source names once the image that needs the
    /// objects is recorded, so until then a crash leaves the source whole.
    /// A file is linked only if it has no link but the names the caller's
    /// tree holds ([`Ingest::import_named`]) and the kernel grants a read
    /// lease on it (no descriptor has it open for writing, and none can
    /// open it so while it is hashed and linked); any other is copied, as
    /// across filesystems. The caller answers for the rest: no mount may
    /// write the source's directory (the snapshotter claims a layer's
    /// upper directory from overlayfs first), and nobody else may reach
    /// its names. A file whose object is present already is not linked at
    /// all (dropped with its source). A new object is made owned by the
    /// store's user with mode 0644 (no setuid bit or file capability
    /// reaches the store) and gets fs-verity where the filesystem has it.
    Move,
}

/// Counters of an import, readable while it runs.
#[derive(Debug, Default)]
pub struct Stats {
    pub files: AtomicU64,
    pub bytes: AtomicU64,
    pub new_objects: AtomicU64,
    pub new_bytes: AtomicU64,
    pub dedup_bytes: AtomicU64,
    pub cache_hits: AtomicU64,
    pub replaced: AtomicU64,
    /// Files a [`Method::Move`] copied: a writer could reach them.
    pub copied: AtomicU64,
}

/// A snapshot of [`Stats`].
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct StatsSnapshot {
    pub files: u64,
    pub bytes: u64,
    pub new_objects: u64,
    pub new_bytes: u64,
    pub dedup_bytes: u64,
    pub cache_hits: u64,
    /// Objects present with the wrong size (so damaged) and written anew.
    pub replaced: u64,
    /// Files a [`Method::Move`] copied: a writer could reach them.
    pub copied: u64,
}

impl Stats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            files: self.files.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            new_objects: self.new_objects.load(Relaxed),
            new_bytes: self.new_bytes.load(Relaxed),
            dedup_bytes: self.dedup_bytes.load(Relaxed),
            cache_hits: self.cache_hits.load(Relaxed),
            replaced: self.replaced.load(Relaxed),
            copied: self.copied.load(Relaxed),
        }
    }
}

/// A source file to import: open directory, name in it, its stat, and a
/// path for messages.
pub struct SourceFile<'a> {
    pub dir: BorrowedFd<'a>,
    pub name: &'a CStr,
    pub path: &'a Path,
    pub stat: &'a rfs::Stat,
}

/// fs-verity support of the store's filesystem, learnt from the first try.
const VERITY_UNKNOWN: u8 = 0;
const VERITY_YES: u8 = 1;
const VERITY_NO: u8 = 2;

/// Files up to this size are read into memory, hashed, and written only
/// when their object is new; larger ones go straight into a temporary file.
/// Each worker thread keeps one buffer of this size, so the import's memory
/// does not grow with the files (16 threads reading 4 MiB files each once
/// took a build 24 MB above the reference's peak RSS).
const SMALL_FILE: u64 = 256 << 10;

/// The same for a stream (a layer's file): kept in memory up to 4 MiB, so
/// an object already present is not written out first; streams are read a
/// few at a time, not by a scan's many threads.
const SMALL_STREAM: u64 = 4 << 20;

/// Start a commit once this much new data waits in temporary files.
const BATCH_BYTES: u64 = 1 << 30;

/// An import into a store. Holds the store's shared lock (so gc waits)
/// until dropped; temporary files not committed are removed on drop.
pub struct Ingest<'s> {
    store: &'s Store,
    tmp: OwnedFd,
    method: Method,
    pub stats: Stats,
    cache: DigestCache,
    /// New objects waiting for commit: (temporary name, digest, size).
    pending: Mutex<Vec<(String, [u8; 32], u64)>>,
    pending_bytes: AtomicU64,
    /// Digests imported in this run (a second copy is not written).
    seen: Mutex<HashSet<[u8; 32]>>,
    verity: AtomicU8,
    verity_warning: Mutex<Option<String>>,
    cloning: AtomicBool,
    /// [`Method::Move`] links (false once the store proved to be on another
    /// filesystem).
    linking: AtomicBool,
    /// Commit once this much new data waits.
    batch_bytes: u64,
    /// Set (by a signal handler, say) to stop the import at the next file.
    cancel: Option<std::sync::Arc<AtomicBool>>,
    /// Commit by syncing each object, not the filesystem (see
    /// [`Ingest::commit_each`]).
    commit_each: bool,
    /// Sync the filesystem at each commit (see [`Ingest::defer_sync`]).
    sync: bool,
    _lock: StoreLock,
}

/// Most fsyncs [`sync_each`] has under way at once.
const SYNC_THREADS: usize = 8;

/// fsyncs the temporary files of `batch`, several at once: each fsync of a
/// new file waits for a commit of the filesystem's journal, and fsyncs
/// issued together share commits (ext4's, XFS's), where one after another
/// each pays its own (a range of a layer read on demand stores dozens of
/// files, and its reader waits for all of them).
fn sync_each(tmp: &OwnedFd, batch: &[(String, [u8; 32], u64)]) -> io::Result<()> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || -> io::Result<()> {
        while let Some((name, ..)) = batch.get(next.fetch_add(1, Relaxed)) {
            let fd = rfs::openat(
                tmp,
                name.as_str(),
                OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            rfs::fsync(&fd)?;
        }
        Ok(())
    };
    if batch.len() == 1 {
        return work();
    }
    std::thread::scope(|s| {
        let helpers: Vec<_> = (1..SYNC_THREADS.min(batch.len())).map(|_| s.spawn(work)).collect();
        let mine = work();
        helpers
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(io::Error::other("a sync thread panicked")))
            })
            .fold(mine, |a, b| a.and(b))
    })
}

impl<'s> Ingest<'s> {
    /// Starts an import: takes the shared lock (waiting for a running gc).
    pub fn new(store: &'s Store, method: Method) -> Result<Ingest<'s>, StoreError> {
        Ingest::start(store, method, true)
    }

    /// Starts an import of fetched objects (by copy): as [`Ingest::new`]
    /// without the digest cache, which only source files use.
    pub fn for_fetched(store: &'s Store) -> Result<Ingest<'s>, StoreError> {
        Ingest::start(store, Method::Copy, false)
    }

    fn start(store: &'s Store, method: Method, use_cache: bool) -> Result<Ingest<'s>, StoreError> {
        let lock = store.lock(LockMode::Shared, true)?;
        let tmp = store.open_subdir(TMP_DIR)?;
        Ok(Ingest {
            store,
            tmp,
            method,
            stats: Stats::default(),
            cache: if use_cache {
                DigestCache::load(&store.join(DIGEST_CACHE))
            } else {
                DigestCache::default()
            },
            pending: Mutex::new(Vec::new()),
            pending_bytes: AtomicU64::new(0),
            seen: Mutex::new(HashSet::new()),
            verity: AtomicU8::new(VERITY_UNKNOWN),
            verity_warning: Mutex::new(None),
            cloning: AtomicBool::new(true),
            linking: AtomicBool::new(true),
            batch_bytes: BATCH_BYTES,
            cancel: None,
            commit_each: false,
            sync: true,
            _lock: lock,
        })
    }

    /// Makes every later [`Ingest::import`] fail with
    /// [`StoreError::Interrupted`] once `flag` is set.
    pub fn set_cancel(&mut self, flag: std::sync::Arc<AtomicBool>) {
        self.cancel = Some(flag);
    }

    /// Commits new objects once `bytes` of them wait (default 1 GiB). A
    /// stream (a layer) whose files arrive one by one gains from smaller
    /// batches: the renames and syncs of a batch then overlap the reading
    /// of the next instead of all waiting for the end.
    pub fn set_batch_bytes(&mut self, bytes: u64) {
        self.batch_bytes = bytes.max(1);
    }

    /// Commits by syncing each new object rather than the whole
    /// filesystem, and leaves the renames to the filesystem's own pace: for
    /// a few objects fetched on demand, which no tag waits for (an object
    /// whose rename a crash undoes is only fetched again).
    pub fn commit_each(&mut self) {
        self.commit_each = true;
    }

    /// Leaves the durability of new objects to the caller, who syncs the
    /// filesystem before anything relies on them surviving a power loss:
    /// commits still rename them into place (so a process that dies
    /// leaves only complete objects), but no longer wait for the disk.
    /// For [`Method::Move`] of files another program just wrote (a layer
    /// containerd unpacked), where the sync is the writeback of all of
    /// them.
    pub fn defer_sync(&mut self) {
        self.sync = false;
    }

    /// Saves the digests learnt so far (an interrupted build keeps them:
    /// the next one does not read those files again).
    pub fn save_cache(&self) -> Result<(), StoreError> {
        self.cache.save(self.store, &self.tmp)
    }

    /// The objects this import stored or found stored: what a caller that
    /// fails before tagging them may hand to a collection (any that no
    /// root references is garbage).
    pub fn imported(&self) -> Vec<[u8; 32]> {
        self.seen.lock().unwrap().iter().copied().collect()
    }

    /// How this import makes objects.
    pub fn method(&self) -> Method {
        self.method
    }

    /// Why objects are not fs-verity protected, if they are not.
    pub fn verity_warning(&self) -> Option<String> {
        self.verity_warning.lock().unwrap().clone()
    }

    /// Imports one file and returns its digest.
    pub fn import(&self, f: &SourceFile) -> Result<[u8; 32], StoreError> {
        self.import_named(f, 1)
    }

    /// [`Ingest::import`] of a file that the caller's tree names `names`
    /// times (its hardlinks): a [`Method::Move`] links in only a file with
    /// no other link.
    pub fn import_named(&self, f: &SourceFile, names: u64) -> Result<[u8; 32], StoreError> {
        if self.cancel.as_ref().is_some_and(|c| c.load(Relaxed)) {
            return Err(StoreError::Interrupted);
        }
        let st = f.stat;
        let size = st.st_size as u64;
        self.stats.files.fetch_add(1, Relaxed);
        self.stats.bytes.fetch_add(size, Relaxed);
        let key = FileState::of(st);
        if let Some(d) = self.cache.get(&key) {
            if self.seen.lock().unwrap().contains(&d) || self.store.object_size(&d) == Some(size) {
                self.stats.cache_hits.fetch_add(1, Relaxed);
                self.stats.dedup_bytes.fetch_add(size, Relaxed);
                return Ok(d);
            }
        }
        let src = rfs::openat(
            f.dir,
            f.name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
            Mode::empty(),
        )
        .map_err(|e| StoreError::source_io(f.path, "cannot open", e.into()))?;
        let now = rfs::fstat(&src).map_err(|e| StoreError::source_io(f.path, "cannot stat", e.into()))?;
        if now.st_ino != st.st_ino || now.st_dev != st.st_dev {
            return Err(StoreError::source(f.path, "file was replaced during the build"));
        }
        // Opened without blocking (a FIFO swapped in must not hang us); the
        // file scanned, so a regular one: read it as any other.
        let _ = rfs::fcntl_setfl(&src, OFlags::empty());
        let _ = rfs::fadvise(&src, 0, None, rfs::Advice::Sequential);

        let tmp_name = self.temp_name();
        let result = match self.method {
            Method::Copy => self.copy_in(f, &src, &tmp_name, size),
            Method::Move => self.move_in(f, &src, &now, names, &tmp_name),
        };
        let Hashed(written, digest, buffered) = match result {
            Ok(r) => r,
            Err(e) => {
                let _ = rfs::unlinkat(&self.tmp, &tmp_name, AtFlags::empty());
                return Err(e);
            }
        };
        // The digest is of exactly the bytes the object gets; they must still
        // be what was stat'ed when the tree was made.
        if written != size {
            let _ = rfs::unlinkat(&self.tmp, &tmp_name, AtFlags::empty());
            return Err(StoreError::source(f.path, "file changed size during the build"));
        }
        // A moved file's identity says nothing once its source is gone.
        if self.method != Method::Move {
            self.cache.insert(key, digest);
        }
        self.place(tmp_name, size, Hashed(written, digest, buffered))
    }

    /// Imports `size` bytes read from `src` (a stream: a layer being
    /// unpacked, say) and returns their digest. `what` names the source in
    /// messages. Fails if `src` ends early or holds more than `size` bytes.
    pub fn import_reader(&self, what: &Path, size: u64, src: &mut dyn Read) -> Result<[u8; 32], StoreError> {
        let (tmp_name, hashed) = self.read_stream(what, size, src)?;
        self.place(tmp_name, size, hashed)
    }

    /// Imports `size` bytes from `src` that must have the fs-verity digest
    /// `expected` (an object fetched from elsewhere). Bytes that do not
    /// are refused with [`StoreError::Mismatch`] and nothing is stored.
    pub fn import_expected(
        &self,
        what: &Path,
        size: u64,
        src: &mut dyn Read,
        expected: &[u8; 32],
    ) -> Result<(), StoreError> {
        if let Some(fill) = crate::placeholder::fill_in_place(self.store, expected, size, false) {
            return self.fill_placeholder(fill, what, size, src, expected);
        }
        let (tmp_name, hashed) = self.read_stream(what, size, src)?;
        if hashed.1 != *expected {
            if hashed.2.is_none() {
                let _ = rfs::unlinkat(&self.tmp, &tmp_name, AtFlags::empty());
            }
            return Err(StoreError::Mismatch(what.to_path_buf()));
        }
        self.place(tmp_name, size, hashed).map(drop)
    }

    /// [`Ingest::import_expected`] straight into the object's placeholder
    /// (a lazy kernel mount's reader waits for it): the bytes written are
    /// hashed as they go, and only once they are the object and durable
    /// is the placeholder one no longer. Bytes that are not leave it a
    /// placeholder, emptied.
    fn fill_placeholder(
        &self,
        mut fill: crate::placeholder::InPlace,
        what: &Path,
        size: u64,
        src: &mut dyn Read,
        expected: &[u8; 32],
    ) -> Result<(), StoreError> {
        if self.cancel.as_ref().is_some_and(|c| c.load(Relaxed)) {
            fill.abandon();
            return Err(StoreError::Interrupted);
        }
        self.stats.files.fetch_add(1, Relaxed);
        self.stats.bytes.fetch_add(size, Relaxed);
        let wrong = match hash_copy(&mut src.take(size + 1), Some(&mut fill.file)) {
            Ok((n, _)) if n < size => Some(StoreError::source(what, "contents end early")),
            Ok((n, _)) if n > size => Some(StoreError::source(what, "contents longer than stated")),
            Ok((_, d)) if d != *expected => Some(StoreError::Mismatch(what.to_path_buf())),
            Ok(_) => None,
            Err(e) => Some(self.copy_error(what, e)),
        };
        if let Some(e) = wrong {
            fill.abandon();
            return Err(e);
        }
        fill.finish(self.store, expected, |fd| self.enable_verity(fd))
            .map_err(|e| StoreError::io(&self.store.object_path(expected), "cannot fill its placeholder", e))?;
        self.seen.lock().unwrap().insert(*expected);
        self.stats.new_objects.fetch_add(1, Relaxed);
        self.stats.new_bytes.fetch_add(size, Relaxed);
        Ok(())
    }

    /// Reads and hashes exactly `size` bytes of `src`: small ones into
    /// memory, others into a new temporary file (named by the result).
    fn read_stream(&self, what: &Path, size: u64, src: &mut dyn Read) -> Result<(String, Hashed), StoreError> {
        if self.cancel.as_ref().is_some_and(|c| c.load(Relaxed)) {
            return Err(StoreError::Interrupted);
        }
        self.stats.files.fetch_add(1, Relaxed);
        self.stats.bytes.fetch_add(size, Relaxed);
        let tmp_name = self.temp_name();
        let hashed = if size <= SMALL_STREAM {
            read_small(src, size, what)?
        } else {
            let mut dst = self.create_temp(&tmp_name)?;
            match hash_copy(&mut src.take(size + 1), Some(&mut dst)) {
                Ok((n, d)) => Hashed(n, d, None),
                Err(e) => {
                    let _ = rfs::unlinkat(&self.tmp, &tmp_name, AtFlags::empty());
                    return Err(self.copy_error(what, e));
                }
            }
        };
        if hashed.0 != size {
            let _ = rfs::unlinkat(&self.tmp, &tmp_name, AtFlags::empty());
            return Err(StoreError::source(
                what,
                if hashed.0 < size {
                    "contents end early"
                } else {
                    "contents longer than stated"
                },
            ));
        }
        Ok((tmp_name, hashed))
    }

    /// Imports a sparse file of `size` bytes (a layer's) and returns its
    /// digest: its data `extents` ((offset, length), in order, within
    /// `size`) are read one after the other from `src`, its holes hashed
    /// as zeros and left as holes in the object, never read or written: the
    /// cost is that of the data, however large `size` is.
    pub fn import_sparse(
        &self,
        what: &Path,
        size: u64,
        extents: &[(u64, u64)],
        src: &mut dyn Read,
    ) -> Result<[u8; 32], StoreError> {
        if self.cancel.as_ref().is_some_and(|c| c.load(Relaxed)) {
            return Err(StoreError::Interrupted);
        }
        self.stats.files.fetch_add(1, Relaxed);
        self.stats.bytes.fetch_add(size, Relaxed);
        let tmp_name = self.temp_name();
        let mut dst = self.create_temp(&tmp_name)?;
        let copied = (|| {
            let mut sink = HashSink::new(Some(&mut dst));
            for &(off, len) in extents {
                if off < sink.total || off.checked_add(len).is_none_or(|end| end > size) {
                    let why = "sparse map: pieces overlap, are out of order or pass the file's end";
                    return Err(StoreError::source(what, why));
                }
                sink.hole(off - sink.total);
                let n = sink.copy(&mut src.take(len)).map_err(|e| self.copy_error(what, e))?;
                if n < len {
                    return Err(StoreError::source(what, "contents end early"));
                }
            }
            sink.hole(size - sink.total);
            sink.finish().map_err(|e| self.copy_error(what, e))
        })();
        match copied {
            Ok((n, d)) => self.place(tmp_name, size, Hashed(n, d, None)),
            Err(e) => {
                let _ = rfs::unlinkat(&self.tmp, &tmp_name, AtFlags::empty());
                Err(e)
            }
        }
    }

    /// Imports bytes held in memory and returns their digest.
    pub fn import_bytes(&self, data: Vec<u8>) -> Result<[u8; 32], StoreError> {
        let size = data.len() as u64;
        self.stats.files.fetch_add(1, Relaxed);
        self.stats.bytes.fetch_add(size, Relaxed);
        let d = verity::digest_bytes(&data);
        self.place(self.temp_name(), size, Hashed(size, d, Some(data)))
    }

    /// A name for a new temporary file, unique in the store: imports
    /// running at once in one process (a lazy mount's fetches) must not
    /// pick the same one.
    fn temp_name(&self) -> String {
        temp_name("obj-")
    }

    fn copy_error(&self, source: &Path, e: CopyError) -> StoreError {
        match e {
            CopyError::Read(e) => StoreError::source_io(source, "cannot read", e),
            CopyError::Write(e) => self.write_error(e),
        }
    }

    /// Makes a hashed object pending (or drops it, if present already).
    fn place(&self, tmp_name: String, size: u64, Hashed(_, digest, buffered): Hashed) -> Result<[u8; 32], StoreError> {
        let fresh = self.seen.lock().unwrap().insert(digest);
        let present = self.store.object_size(&digest);
        if !fresh || present == Some(size) {
            match buffered {
                Some(data) => recycle(data),
                None => {
                    let _ = rfs::unlinkat(&self.tmp, &tmp_name, AtFlags::empty());
                }
            }
            self.stats.dedup_bytes.fetch_add(size, Relaxed);
            return Ok(digest);
        }
        if let Some(data) = buffered {
            if data.len() as u64 != size {
                // A moved file found present (see `move_in`) is gone again:
                // it is never written from a buffer it never filled.
                return Err(StoreError::Invalid(format!(
                    "object {} vanished from the store during an import",
                    hex::encode(digest)
                )));
            }
            let written = self.write_temp(&tmp_name, &data);
            recycle(data);
            written?;
        }
        if self.method == Method::Move {
            self.adopt(&tmp_name)?;
        }
        if matches!(self.method, Method::Copy | Method::Move) {
            self.try_enable_verity(&tmp_name);
        }
        if present.is_some() {
            self.stats.replaced.fetch_add(1, Relaxed);
        }
        self.stats.new_objects.fetch_add(1, Relaxed);
        self.stats.new_bytes.fetch_add(size, Relaxed);
        self.pending.lock().unwrap().push((tmp_name, digest, size));
        if self.pending_bytes.fetch_add(size, Relaxed) + size >= self.batch_bytes {
            self.pending_bytes.store(0, Relaxed);
            self.commit_batch()?;
        }
        Ok(digest)
    }

    fn create_temp(&self, tmp_name: &str) -> Result<std::fs::File, StoreError> {
        // Messages name the store, not the temporary file (which is gone).
        let store = self.store.path();
        let fd = rfs::openat(
            &self.tmp,
            tmp_name,
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )
        .map_err(|e| StoreError::io(store, "cannot create a new object", e.into()))?;
        // Explicitly, whatever the umask: objects are readable by all.
        rfs::fchmod(&fd, Mode::from_raw_mode(0o644))
            .map_err(|e| StoreError::io(store, "cannot set the mode of a new object", e.into()))?;
        Ok(std::fs::File::from(fd))
    }

    fn write_temp(&self, tmp_name: &str, data: &[u8]) -> Result<(), StoreError> {
        let mut f = self.create_temp(tmp_name)?;
        f.write_all(data).map_err(|e| {
            let _ = rfs::unlinkat(&self.tmp, tmp_name, AtFlags::empty());
            self.write_error(e)
        })
    }

    fn write_error(&self, e: io::Error) -> StoreError {
        let store = self.store.path();
        if e.raw_os_error() == Some(libc::ENOSPC) || e.raw_os_error() == Some(libc::EDQUOT) {
            StoreError::io(store, "no space left on the store's device", e)
        } else {
            StoreError::io(store, "cannot write into the store", e)
        }
    }

    /// Reads the source once and hashes it: small files into memory (written
    /// out only if the object is new), large ones straight into a temporary
    /// file; or clones it and hashes the clone. Returns (bytes, digest, the
    /// contents when they are still only in memory).
    fn copy_in(&self, f: &SourceFile, src: &OwnedFd, tmp_name: &str, size: u64) -> Result<Hashed, StoreError> {
        let mut srcf = std::fs::File::from(
            src.try_clone()
                .map_err(|e| StoreError::source_io(f.path, "cannot dup", e))?,
        );
        if self.cloning.load(Relaxed) {
            let dst = self.create_temp(tmp_name)?;
            if rfs::ioctl_ficlone(&dst, src).is_ok() {
                // Hash the clone: our own copy, which nobody else changes.
                let mut clone = rfs::openat(
                    &self.tmp,
                    tmp_name,
                    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map(std::fs::File::from)
                .map_err(|e| StoreError::source_io(f.path, "cannot reopen clone", e.into()))?;
                let (n, d) = hash_file(&mut clone, None).map_err(|e| self.copy_error(f.path, e))?;
                return Ok(Hashed(n, d, None));
            }
            self.cloning.store(false, Relaxed);
            let _ = rfs::unlinkat(&self.tmp, tmp_name, AtFlags::empty());
        }
        if size <= SMALL_FILE {
            return read_small(&mut srcf, size, f.path);
        }
        let mut dst = self.create_temp(tmp_name)?;
        let (n, d) = hash_file(&mut srcf, Some(&mut dst)).map_err(|e| self.copy_error(f.path, e))?;
        Ok(Hashed(n, d, None))
    }

    /// [`Method::Move`]: the source's inode when no writer can reach it
    /// (see there) and both are on one filesystem (hashed in place, under
    /// the read lease), else a copy. Only the hash is taken here; whether
    /// the object is new is decided by [`Ingest::place`].
    fn move_in(
        &self,
        f: &SourceFile,
        src: &OwnedFd,
        st: &rfs::Stat,
        names: u64,
        tmp_name: &str,
    ) -> Result<Hashed, StoreError> {
        // A link elsewhere, or a writer (EAGAIN; a filesystem without
        // leases cannot tell): copied.
        let unreached = st.st_nlink <= names && tilefs_sys::fs::lease_read(src.as_fd()).is_ok();
        if unreached && self.linking.load(Relaxed) {
            let mut s = std::fs::File::from(src.try_clone().map_err(|e| StoreError::io(f.path, "cannot dup", e))?);
            let (n, d) = hash_file(&mut s, None).map_err(|e| self.copy_error(f.path, e))?;
            // Present already (or met before in this import): nothing to
            // link, the source is simply dropped by the caller.
            if self.seen.lock().unwrap().contains(&d) || self.store.object_size(&d) == Some(n) {
                return Ok(Hashed(n, d, Some(Vec::new())));
            }
            match rfs::linkat(f.dir, f.name, &self.tmp, tmp_name, AtFlags::empty()) {
                Ok(()) => {
                    let linked = rfs::statat(&self.tmp, tmp_name, AtFlags::SYMLINK_NOFOLLOW)
                        .map_err(|e| StoreError::io(f.path, "cannot stat", e.into()))?;
                    if linked.st_ino != st.st_ino || linked.st_dev != st.st_dev {
                        return Err(StoreError::source(f.path, "file was replaced while being moved"));
                    }
                    // Linked elsewhere meanwhile (link(2) waits for no lease).
                    if linked.st_nlink != st.st_nlink + 1 {
                        return Err(StoreError::source(
                            f.path,
                            "file was linked elsewhere while being moved",
                        ));
                    }
                    let _ = tilefs_sys::fs::lease_release(src.as_fd());
                    return Ok(Hashed(n, d, None));
                }
                Err(rustix::io::Errno::XDEV) | Err(rustix::io::Errno::PERM) => self.linking.store(false, Relaxed),
                Err(e) => return Err(StoreError::io(f.path, "cannot link into the store", e.into())),
            }
        }
        if unreached {
            let _ = tilefs_sys::fs::lease_release(src.as_fd());
        } else {
            self.stats.copied.fetch_add(1, Relaxed);
        }
        self.copy_in(f, src, tmp_name, st.st_size as u64)
    }

    /// A moved-in object made the store's: owned by this process's user
    /// (which, as root, also drops setuid bits and file capabilities),
    /// mode 0644.
    fn adopt(&self, tmp_name: &str) -> Result<(), StoreError> {
        let store = self.store.path();
        let fd = rfs::openat(
            &self.tmp,
            tmp_name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| StoreError::io(store, "cannot open a new object", e.into()))?;
        let st = rfs::fstat(&fd).map_err(|e| StoreError::io(store, "cannot stat a new object", e.into()))?;
        let (uid, gid) = (rustix::process::geteuid(), rustix::process::getegid());
        if st.st_uid != uid.as_raw() || st.st_gid != gid.as_raw() || st.st_mode & 0o7000 != 0 {
            rfs::fchown(&fd, Some(uid), Some(gid))
                .map_err(|e| StoreError::io(store, "cannot set the owner of a new object", e.into()))?;
        }
        rfs::fchmod(&fd, Mode::from_raw_mode(0o644))
            .map_err(|e| StoreError::io(store, "cannot set the mode of a new object", e.into()))
    }

    fn try_enable_verity(&self, tmp_name: &str) {
        if self.verity.load(Relaxed) == VERITY_NO {
            return;
        }
        if let Ok(fd) = rfs::openat(&self.tmp, tmp_name, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()) {
            self.enable_verity(fd.as_fd());
        }
    }

    /// Enables fs-verity on a new object open read-only (no writer left),
    /// learning whether the store's filesystem can.
    fn enable_verity(&self, fd: BorrowedFd<'_>) {
        if self.verity.load(Relaxed) == VERITY_NO {
            return;
        }
        match tilefs_sys::verity::enable(fd) {
            Ok(()) => self.verity.store(VERITY_YES, Relaxed),
            Err(e) => {
                // Said once per store: a marker file remembers it was.
                if self.verity.swap(VERITY_NO, Relaxed) != VERITY_NO
                    && rfs::openat(
                        self.store.dir_fd(),
                        NO_VERITY_NOTED,
                        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
                        Mode::from_raw_mode(0o644),
                    )
                    .is_ok()
                {
                    *self.verity_warning.lock().unwrap() = Some(format!(
                        "{}: the filesystem does not support fs-verity ({e}); objects are verified by digest only \
                         (said once for this store)",
                        self.store.path().display()
                    ));
                }
            }
        }
    }

    /// Makes every pending object durable and visible.
    fn commit_batch(&self) -> Result<(), StoreError> {
        let mut batch = std::mem::take(&mut *self.pending.lock().unwrap());
        if batch.is_empty() {
            return Ok(());
        }
        let store_path = self.store.path();
        if self.commit_each {
            sync_each(&self.tmp, &batch).map_err(|e| StoreError::io(store_path, "cannot sync", e))?;
        } else if self.sync {
            rfs::syncfs(&self.tmp).map_err(|e| StoreError::io(store_path, "cannot sync", e.into()))?;
        }
        // Each object renamed into its fan-out directory, opened without
        // following a symlink: a store others may write must not lead our
        // objects anywhere else. In digest order, each directory once.
        batch.sort_unstable_by_key(|b| b.1);
        let mut fanout: Option<(u8, OwnedFd)> = None;
        for (tmp_name, digest, size) in &batch {
            if fanout.as_ref().is_none_or(|(f, _)| *f != digest[0]) {
                fanout = Some((digest[0], self.store.open_fanout(digest)?));
            }
            let (_, fan) = fanout.as_ref().expect("opened above");
            let rel = Store::object_rel(digest);
            self.rename_into(tmp_name, fan, &rel[3..], *size)
                .map_err(|e| StoreError::io(&self.store.join(&rel), "cannot rename into place", e))?;
        }
        if !self.commit_each && self.sync {
            rfs::syncfs(self.store.dir_fd()).map_err(|e| StoreError::io(store_path, "cannot sync", e.into()))?;
        }
        Ok(())
    }

    /// Gives a temporary file its object name. An object stored meanwhile
    /// by another import (a fetch of the same object) is kept and ours
    /// dropped: it was checked as ours was, and readers may have it open.
    /// Only one of another size (damaged) is replaced.
    fn rename_into(&self, tmp_name: &str, fan: &OwnedFd, name: &str, size: u64) -> io::Result<()> {
        match rfs::renameat_with(&self.tmp, tmp_name, fan, name, rfs::RenameFlags::NOREPLACE) {
            Err(rustix::io::Errno::EXIST) => {
                let st = rfs::statat(fan, name, AtFlags::SYMLINK_NOFOLLOW)?;
                // (A placeholder, not fetched yet, is replaced.)
                if rfs::FileType::from_raw_mode(st.st_mode).is_file()
                    && st.st_size as u64 == size
                    && !crate::placeholder::is_placeholder(&st)
                {
                    let _ = rfs::unlinkat(&self.tmp, tmp_name, AtFlags::empty());
                    return Ok(());
                }
            }
            // A filesystem without RENAME_NOREPLACE.
            Err(rustix::io::Errno::INVAL) => {}
            r => return Ok(r?),
        }
        Ok(rfs::renameat(&self.tmp, tmp_name, fan, name)?)
    }

    /// Makes the objects imported so far durable and visible now (a fetch
    /// does before it lets others that wait for them look).
    pub fn commit(&self) -> Result<(), StoreError> {
        self.commit_batch()
    }

    /// Commits what remains and saves the digest cache. Call before writing
    /// an image that references the imported objects; keep the import (and
    /// so the store lock) until that image is tagged.
    pub fn finish(&self) -> Result<StatsSnapshot, StoreError> {
        self.commit_batch()?;
        self.save_cache()?;
        // Saved: its memory is better used by the image written next (an
        // import after this one is correct, only without the cache).
        self.cache.close();
        Ok(self.stats.snapshot())
    }
}

impl tilefs_image::source::ContentSink for Ingest<'_> {
    fn store(&self, dir: BorrowedFd<'_>, name: &CStr, path: &Path, stat: &rfs::Stat) -> Result<[u8; 32], String> {
        self.import(&SourceFile { dir, name, path, stat }).map_err(|e| match e {
            // The caller names the source file already.
            StoreError::SourceIo { what, err, .. } => format!("{what}: {err}"),
            e => e.to_string(),
        })
    }
}

impl Drop for Ingest<'_> {
    fn drop(&mut self) {
        // A failed or abandoned import leaves no temporary files behind.
        for (tmp_name, ..) in self.pending.get_mut().unwrap().drain(..) {
            let _ = rfs::unlinkat(&self.tmp, tmp_name.as_str(), AtFlags::empty());
        }
    }
}

/// What reading a source gave: its length, its digest, and its contents
/// when they are held in memory rather than in a temporary file.
struct Hashed(u64, [u8; 32], Option<Vec<u8>>);

thread_local! {
    /// This thread's buffer for small files (see [`SMALL_FILE`]).
    static SMALL_BUF: std::cell::Cell<Option<Vec<u8>>> = const { std::cell::Cell::new(None) };
    /// This thread's buffer for copies.
    static COPY_BUF: std::cell::Cell<Option<Vec<u8>>> = const { std::cell::Cell::new(None) };
}

/// Gives a buffer back to this thread's pool once its contents are used.
fn recycle(mut data: Vec<u8>) {
    if data.capacity() <= SMALL_FILE as usize + 1 {
        data.clear();
        SMALL_BUF.set(Some(data));
    }
}

/// Reads a small source whole (at most `size` + 1 bytes, so a longer one
/// shows) and hashes it; its contents stay in memory, up to [`SMALL_FILE`]
/// in this thread's buffer (give it back with [`recycle`]).
fn read_small(src: &mut dyn Read, size: u64, path: &Path) -> Result<Hashed, StoreError> {
    let mut data = match size <= SMALL_FILE {
        true => SMALL_BUF
            .take()
            .unwrap_or_else(|| Vec::with_capacity(SMALL_FILE as usize + 1)),
        false => Vec::new(),
    };
    data.clear();
    data.reserve_exact(size as usize + 1);
    if let Err(e) = src.take(size + 1).read_to_end(&mut data) {
        recycle(data);
        return Err(StoreError::source_io(path, "cannot read", e));
    }
    let d = verity::digest_bytes(&data);
    Ok(Hashed(data.len() as u64, d, Some(data)))
}

/// Which side of a copy failed.
enum CopyError {
    Read(io::Error),
    Write(io::Error),
}

/// Reads `src` to its end, hashing it and, if given, writing it to `dst`
/// (runs of zero blocks hashed as zeros and left as holes).
fn hash_copy(src: &mut dyn Read, dst: Option<&mut std::fs::File>) -> Result<(u64, [u8; 32]), CopyError> {
    let mut sink = HashSink::new(dst);
    sink.copy(src)?;
    sink.finish()
}

/// A file's bytes as they come, hashed and, given a destination, written:
/// holes (declared by the source, or runs of zero blocks in its data) are
/// hashed as zeros, a few hashes per tree level however long, and left as
/// holes in the destination, so they cost neither hashing nor disk.
struct HashSink<'a> {
    h: verity::Hasher,
    dst: Option<&'a mut std::fs::File>,
    /// Bytes of the file so far.
    total: u64,
    /// Where the destination's offset is (behind `total` after a hole).
    written: u64,
}

impl<'a> HashSink<'a> {
    fn new(dst: Option<&'a mut std::fs::File>) -> HashSink<'a> {
        HashSink {
            h: verity::Hasher::new(),
            dst,
            total: 0,
            written: 0,
        }
    }

    /// `len` zero bytes, neither read nor written.
    fn hole(&mut self, len: u64) {
        self.h.update_zeros(len);
        self.total += len;
    }

    /// Bytes of data: runs of zero 4 KiB blocks among them are holes.
    fn data(&mut self, data: &[u8]) -> io::Result<()> {
        const BLOCK: usize = 4096;
        // Compared with memcmp, many times faster than a loop over bytes.
        static ZEROS: [u8; BLOCK] = [0; BLOCK];
        let zero = |c: &[u8]| c == &ZEROS[..c.len()];
        let mut rest = data;
        while !rest.is_empty() {
            let is_zero = zero(&rest[..BLOCK.min(rest.len())]);
            let run: usize = rest
                .chunks(BLOCK)
                .take_while(|c| zero(c) == is_zero)
                .map(<[u8]>::len)
                .sum();
            let (piece, after) = rest.split_at(run);
            rest = after;
            if is_zero {
                self.hole(run as u64);
                continue;
            }
            self.h.update(piece);
            if let Some(d) = self.dst.as_deref_mut() {
                if self.written != self.total {
                    use std::io::{Seek, SeekFrom};
                    d.seek(SeekFrom::Start(self.total))?;
                }
                d.write_all(piece)?;
                self.written = self.total + run as u64;
            }
            self.total += run as u64;
        }
        Ok(())
    }

    /// Reads `src` to its end (whole buffers filled: a decompressor hands
    /// out small pieces); the bytes read.
    fn copy(&mut self, src: &mut dyn Read) -> Result<u64, CopyError> {
        let mut buf = COPY_BUF.take().unwrap_or_else(|| vec![0u8; 256 << 10]);
        let r = self.copy_with(src, &mut buf);
        COPY_BUF.set(Some(buf));
        r
    }

    fn copy_with(&mut self, src: &mut dyn Read, buf: &mut [u8]) -> Result<u64, CopyError> {
        let start = self.total;
        loop {
            let mut n = 0;
            while n < buf.len() {
                match src.read(&mut buf[n..]) {
                    Ok(0) => break,
                    Ok(k) => n += k,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(CopyError::Read(e)),
                }
            }
            self.data(&buf[..n]).map_err(CopyError::Write)?;
            if n < buf.len() {
                return Ok(self.total - start);
            }
        }
    }

    /// The file's length and digest, the destination given its full length
    /// (trailing holes).
    fn finish(self) -> Result<(u64, [u8; 32]), CopyError> {
        if let Some(d) = self.dst {
            d.set_len(self.total).map_err(CopyError::Write)?;
        }
        Ok((self.total, self.h.finalize()))
    }
}

/// [`hash_copy`] of a source file, its holes never read ([`copy_file`]).
fn hash_file(src: &mut std::fs::File, dst: Option<&mut std::fs::File>) -> Result<(u64, [u8; 32]), CopyError> {
    let mut sink = HashSink::new(dst);
    copy_file(src, &mut sink)?;
    sink.finish()
}

/// Copies a source file through `sink`, asking the filesystem where its
/// data is (SEEK_DATA, SEEK_HOLE): its holes are never read. A file that
/// changes meanwhile gives the bytes the copy holds, which its size check
/// then refuses.
fn copy_file(src: &mut std::fs::File, sink: &mut HashSink) -> Result<(), CopyError> {
    use rustix::fs::SeekFrom;
    use std::io::Seek;
    let mut pos = 0u64;
    loop {
        // ENXIO: no data past `pos`, the rest is a hole; a filesystem that
        // cannot tell has data everywhere.
        let data = match rfs::seek(&*src, SeekFrom::Data(pos)) {
            Ok(d) => d.max(pos),
            Err(rustix::io::Errno::NXIO) => {
                let size = src.metadata().map_err(CopyError::Read)?.len();
                sink.hole(size.saturating_sub(pos));
                pos = pos.max(size);
                break;
            }
            Err(_) => pos,
        };
        let end = rfs::seek(&*src, SeekFrom::Hole(data)).map_or(u64::MAX, |h| h.max(data));
        sink.hole(data - pos);
        src.seek(io::SeekFrom::Start(data)).map_err(CopyError::Read)?;
        let n = sink.copy(&mut (&mut *src).take(end - data))?;
        pos = data + n;
        if n < end - data {
            return Ok(());
        }
    }
    // Written past its end meanwhile: read to the real end.
    src.seek(io::SeekFrom::Start(pos)).map_err(CopyError::Read)?;
    sink.copy(src).map(drop)
}

/// The digest cache's on-disk form of a [`FileState`].
impl FileState {
    const SIZE: usize = 8 * 3 + 12 * 2;

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.dev.to_le_bytes());
        out.extend_from_slice(&self.ino.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        for (s, ns) in [self.mtime, self.ctime] {
            out.extend_from_slice(&s.to_le_bytes());
            out.extend_from_slice(&ns.to_le_bytes());
        }
    }

    fn decode(b: &[u8]) -> FileState {
        let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let t = |i: usize| (u(i) as i64, u32::from_le_bytes(b[i + 8..i + 12].try_into().unwrap()));
        FileState {
            dev: u(0),
            ino: u(8),
            size: u(16),
            mtime: t(24),
            ctime: t(36),
        }
    }
}

/// The digest cache file: a magic line, records of (key, digest), and a
/// SHA-256 of everything before it, so a torn or tampered file is ignored
/// rather than trusted.
#[derive(Default)]
struct DigestCache {
    map: Mutex<HashMap<FileState, [u8; 32]>>,
    dirty: AtomicBool,
    /// Saved for good and emptied (see [`DigestCache::close`]).
    closed: AtomicBool,
}

const CACHE_MAGIC: &[u8; 16] = b"tilefs-dcache-1\n";
const CACHE_MAX_ENTRIES: usize = 16 << 20;

impl DigestCache {
    fn load(path: &Path) -> DigestCache {
        let map = std::fs::read(path)
            .ok()
            .and_then(|b| DigestCache::decode(&b))
            .unwrap_or_default();
        DigestCache {
            map: Mutex::new(map),
            dirty: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        }
    }

    fn decode(b: &[u8]) -> Option<HashMap<FileState, [u8; 32]>> {
        use sha2::Digest;
        let body = b.strip_prefix(CACHE_MAGIC)?;
        let (records, sum) = body.split_at_checked(body.len().checked_sub(32)?)?;
        let mut h = sha2::Sha256::new();
        h.update(CACHE_MAGIC);
        h.update(records);
        if h.finalize().as_slice() != sum {
            return None;
        }
        let rec = FileState::SIZE + 32;
        if records.len() % rec != 0 {
            return None;
        }
        Some(
            records
                .chunks_exact(rec)
                .map(|r| {
                    (
                        FileState::decode(&r[..FileState::SIZE]),
                        r[FileState::SIZE..].try_into().unwrap(),
                    )
                })
                .collect(),
        )
    }

    /// Frees the map once it is saved: later lookups miss, nothing more is
    /// recorded or saved (a save would lose what the file holds).
    fn close(&self) {
        self.closed.store(true, Relaxed);
        *self.map.lock().unwrap() = HashMap::new();
    }

    fn get(&self, k: &FileState) -> Option<[u8; 32]> {
        self.map.lock().unwrap().get(k).copied()
    }

    fn insert(&self, k: FileState, d: [u8; 32]) {
        if self.closed.load(Relaxed) {
            return;
        }
        let mut m = self.map.lock().unwrap();
        if m.len() < CACHE_MAX_ENTRIES && m.insert(k, d) != Some(d) {
            self.dirty.store(true, Relaxed);
        }
    }

    /// Saves the cache as the store's `.digest-cache`: written anew under
    /// `.tmp` (never through whatever a store others may write has there)
    /// and renamed into place.
    fn save(&self, store: &Store, tmp_dir: &OwnedFd) -> Result<(), StoreError> {
        use sha2::Digest;
        if !self.dirty.load(Relaxed) || self.closed.load(Relaxed) {
            return Ok(());
        }
        let m = self.map.lock().unwrap();
        let mut out = Vec::with_capacity(16 + m.len() * (FileState::SIZE + 32) + 32);
        out.extend_from_slice(CACHE_MAGIC);
        for (k, d) in m.iter() {
            k.encode(&mut out);
            out.extend_from_slice(d);
        }
        let sum = sha2::Sha256::digest(&out);
        out.extend_from_slice(&sum);
        let tmp_name = temp_name("cache-");
        let write = || -> io::Result<()> {
            let fd = rfs::openat(
                tmp_dir,
                tmp_name.as_str(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
            )?;
            let mut f = std::fs::File::from(fd);
            f.write_all(&out)?;
            f.sync_all()?;
            rfs::renameat(tmp_dir, tmp_name.as_str(), store.dir_fd(), DIGEST_CACHE)?;
            Ok(())
        };
        write().map_err(|e| {
            let _ = rfs::unlinkat(tmp_dir, tmp_name.as_str(), AtFlags::empty());
            StoreError::io(&store.join(DIGEST_CACHE), "cannot save the digest cache", e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Moves `name` of `dir` into `store`, as the snapshotter does, the
    /// caller's tree naming it `names` times; the object's path.
    fn moved(store: &Store, dir: &Path, name: &str, names: u64) -> std::path::PathBuf {
        let d = rfs::open(dir, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).unwrap();
        let c = std::ffi::CString::new(name).unwrap();
        let st = rfs::statat(&d, c.as_c_str(), AtFlags::SYMLINK_NOFOLLOW).unwrap();
        let ingest = Ingest::new(store, Method::Move).unwrap();
        let digest = ingest
            .import_named(
                &SourceFile {
                    dir: d.as_fd(),
                    name: &c,
                    path: &dir.join(name),
                    stat: &st,
                },
                names,
            )
            .unwrap();
        ingest.finish().unwrap();
        store.object_path(&digest)
    }

    /// Fetched objects committed each with its own fsync (several at
    /// once) all reach their names, whole.
    #[test]
    fn objects_committed_each_all_arrive() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::create(&dir.path().join("store")).unwrap();
        let mut ingest = Ingest::for_fetched(&store).unwrap();
        ingest.commit_each();
        let objects: Vec<_> = (0..20u8)
            .map(|i| {
                let data = vec![i; 100 + usize::from(i) * 1000];
                (ingest.import_bytes(data.clone()).unwrap(), data)
            })
            .collect();
        ingest.finish().unwrap();
        for (digest, data) in objects {
            assert_eq!(std::fs::read(store.object_path(&digest)).unwrap(), data);
        }
    }

    /// Issue 43: a moved file's inode becomes the object only where no
    /// writer can reach it; one linked elsewhere or open for writing is
    /// copied, and writes to it leave the object as it was.
    #[test]
    fn a_move_links_only_what_no_writer_can_reach() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::create(&dir.path().join("store")).unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();

        std::fs::write(src.join("alone"), vec![1u8; 5000]).unwrap();
        let obj = moved(&store, &src, "alone", 1);
        assert_eq!(
            ino(&obj),
            ino(&src.join("alone")),
            "a file no one else reaches is linked"
        );

        // Two names in the caller's tree: linked; a third elsewhere: copied.
        std::fs::write(src.join("pair"), vec![2u8; 5000]).unwrap();
        std::fs::hard_link(src.join("pair"), src.join("pair2")).unwrap();
        assert_eq!(ino(&moved(&store, &src, "pair", 2)), ino(&src.join("pair")));
        std::fs::write(src.join("linked"), vec![3u8; 5000]).unwrap();
        std::fs::hard_link(src.join("linked"), dir.path().join("outside")).unwrap();
        let obj = moved(&store, &src, "linked", 1);
        assert_ne!(
            ino(&obj),
            ino(&src.join("linked")),
            "a file linked elsewhere was linked in"
        );

        // Open for writing: copied, and a write after leaves the object.
        std::fs::write(src.join("open"), vec![4u8; 5000]).unwrap();
        let mut w = std::fs::OpenOptions::new().append(true).open(src.join("open")).unwrap();
        let obj = moved(&store, &src, "open", 1);
        assert_ne!(
            ino(&obj),
            ino(&src.join("open")),
            "a file open for writing was linked in"
        );
        std::io::Write::write_all(&mut w, b"more").unwrap();
        assert_eq!(std::fs::read(&obj).unwrap(), vec![4u8; 5000]);
    }

    /// Issue 43: sparse contents cost their data: a layer's sparse file
    /// (its extents) and a source file with holes are hashed as the file
    /// they stand for, their holes left holes in the object.
    #[test]
    fn holes_are_hashed_as_zeros_and_left_as_holes() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let size = 8u64 << 30;
        let pieces: Vec<(u64, Vec<u8>)> = vec![
            (0, vec![1u8; 5000]),
            ((3 << 30) + 7, (0..10_000).map(|i| i as u8 | 1).collect()),
            (size - 100, vec![3u8; 100]),
        ];
        let by_hand = dir.path().join("by-hand");
        let f = std::fs::File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&by_hand)
            .unwrap();
        f.set_len(size).unwrap();
        for (off, d) in &pieces {
            f.write_all_at(d, *off).unwrap();
        }
        let want = verity::digest_file(&f, |_| {}).unwrap();
        let small = |p: &Path| {
            let m = std::fs::metadata(p).unwrap();
            assert_eq!(m.len(), size);
            assert!(m.blocks() * 512 < 1 << 20, "{} bytes on disk", m.blocks() * 512);
        };

        let store = Store::create(&dir.path().join("a")).unwrap();
        let ingest = Ingest::new(&store, Method::Copy).unwrap();
        let extents: Vec<(u64, u64)> = pieces.iter().map(|(o, d)| (*o, d.len() as u64)).collect();
        let data = pieces.iter().flat_map(|p| p.1.clone()).collect::<Vec<u8>>();
        let what = Path::new("disk");
        assert_eq!(
            ingest.import_sparse(what, size, &extents, &mut &data[..]).unwrap(),
            want
        );
        ingest.finish().unwrap();
        small(&store.object_path(&want));
        // Pieces out of order, or data that ends early: refused.
        let ingest = Ingest::new(&store, Method::Copy).unwrap();
        let bad = [(10, 5), (0, 5)];
        let e = ingest.import_sparse(what, size, &bad, &mut &data[..10]).unwrap_err();
        assert!(e.to_string().contains("pieces overlap, are out of order"), "{e}");
        let e = ingest
            .import_sparse(what, size, &extents, &mut &data[..100])
            .unwrap_err();
        assert!(e.to_string().contains("contents end early"), "{e}");
        drop(ingest);

        let store = Store::create(&dir.path().join("b")).unwrap();
        let ingest = Ingest::new(&store, Method::Copy).unwrap();
        let d = rfs::open(
            dir.path(),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap();
        let st = rfs::stat(&by_hand).unwrap();
        let source = SourceFile {
            dir: d.as_fd(),
            name: c"by-hand",
            path: &by_hand,
            stat: &st,
        };
        assert_eq!(ingest.import(&source).unwrap(), want);
        ingest.finish().unwrap();
        small(&store.object_path(&want));
    }

    /// Imports running at once in one process (a lazy mount's fetches):
    /// none takes another's temporary name, and an object another stored
    /// first is kept and counts as stored.
    #[test]
    fn imports_at_once_share_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::create(dir.path()).unwrap();
        let (a, b) = (
            Ingest::for_fetched(&store).unwrap(),
            Ingest::for_fetched(&store).unwrap(),
        );
        let (x, y) = (vec![1u8; 5000], vec![2u8; 300_000]);
        let (dx, dy) = (verity::digest_bytes(&x), verity::digest_bytes(&y));
        let what = Path::new("object");
        a.import_expected(what, 5000, &mut &x[..], &dx).unwrap();
        b.import_expected(what, 300_000, &mut &y[..], &dy).unwrap();
        b.import_expected(what, 5000, &mut &x[..], &dx).unwrap();
        a.commit().unwrap();
        let first = std::fs::metadata(store.object_path(&dx)).unwrap().ino();
        b.finish().unwrap();
        assert_eq!(std::fs::metadata(store.object_path(&dx)).unwrap().ino(), first);
        assert_eq!(store.object_size(&dy), Some(300_000));
        assert!(matches!(
            a.import_expected(what, 5000, &mut &y[..5000], &dx),
            Err(StoreError::Mismatch(_))
        ));
        assert_eq!(std::fs::read_dir(dir.path().join(TMP_DIR)).unwrap().count(), 0);
    }
}
