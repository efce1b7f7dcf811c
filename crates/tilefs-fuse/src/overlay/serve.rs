//! The FUSE side of the writable mount: INIT, and each request handed to
//! the method that answers it ([`super::ops_names`], [`super::ops_files`]).

use super::io_mode::IoMode;
use super::names::NewEntry;
use super::upper::S_IFDIR;
use super::{Handle, OverlayFs, R};
use crate::lower::ACL_XATTRS;
use rustix::fs::{Mode, OFlags};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tilefs_fuse_proto::abi::{fopen, init};
use tilefs_fuse_proto::{Connection, Filesystem, InitConfig, KernelInit, Op, Open, Reply, Request};

impl OverlayFs {
    pub(super) fn add_handle(&self, h: Handle) -> (u64, Arc<Handle>) {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let h = Arc::new(h);
        self.handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(fh, h.clone());
        (fh, h)
    }

    pub(super) fn handle_of(&self, fh: u64) -> Option<Arc<Handle>> {
        self.handles.lock().unwrap_or_else(|e| e.into_inner()).get(&fh).cloned()
    }

    /// The handle that I/O on node `id` uses: open file `fh`, or, for a
    /// file the kernel opened without asking us (`fh` 0), one kept for the
    /// node. `write`: the I/O changes the file, which is copied up first.
    pub(super) fn io_handle(&self, id: u64, fh: u64, write: bool) -> R<Arc<Handle>> {
        if fh != 0 || !self.no_open.load(Ordering::Relaxed) {
            return self.handle_of(fh).ok_or(libc::EBADF);
        }
        let kept = self.unopened().get(&id).cloned();
        if let Some(h) = kept {
            if !write || matches!(*h, Handle::Upper(_)) {
                return Ok(h);
            }
        }
        let flags = if write { libc::O_RDWR } else { libc::O_RDONLY };
        // Upper files are opened for reading and writing either way: the
        // writes of every open of the file come through this handle.
        let h = self.open_node(id, flags as u32, true)?;
        Ok(self.unopened_keep(id, h))
    }

    /// Keeps `h` for I/O on node `id` that names no open file.
    pub(super) fn unopened_keep(&self, id: u64, h: Handle) -> Arc<Handle> {
        let h = Arc::new(h);
        let mut kept = self.unopened();
        if !matches!(*h, Handle::Upper(_)) && self.nodes().get(id).is_none_or(|n| n.upper) {
            // Copied up since it was opened: good for this read only (a
            // copy-up after this check drops what is kept).
            return h;
        }
        let evicted = crate::keep_bounded(&mut kept, self.unopened_max, id, h.clone());
        drop(kept);
        // Closed after the lock (the last close of a removed file frees it).
        drop(evicted);
        h
    }

    fn unopened(&self) -> std::sync::MutexGuard<'_, rustc_hash::FxHashMap<u64, Arc<Handle>>> {
        self.unopened.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The handle kept for I/O on node `id`, if any.
    pub(super) fn unopened_of(&self, id: u64) -> Option<Arc<Handle>> {
        self.unopened().get(&id).cloned()
    }

    /// Forgets the handle kept for node `id` (closed after the lock).
    pub(super) fn unopened_drop(&self, id: u64) {
        let h = self.unopened().remove(&id);
        drop(h);
    }

    /// Counts one more lookup of `id` and answers with its entry (or
    /// takes the count back if its attributes cannot be had).
    pub(super) fn reply_entry(&self, id: u64, reply: Reply<'_>) {
        match self.entry(id) {
            Ok(en) => reply.entry(&en),
            Err(x) => {
                self.nodes().forget(id, 1);
                reply.error(x)
            }
        }
    }

    /// Registers open handle `h` of node `id` and tells how the kernel is
    /// to do its I/O (see [`super::io_mode`]).
    pub(super) fn opened(&self, id: u64, h: Handle) -> Open {
        let (fh, h) = self.add_handle(h);
        let upper = match &*h {
            Handle::Upper(f) => Some(f.as_fd()),
            _ => None,
        };
        let (flags, backing_id) = match self.io.open(self.conn.get().map(|c| &**c), id, fh, upper) {
            IoMode::Passthrough(b) => (fopen::PASSTHROUGH, b),
            // Pages of an upper file cached before it was written through
            // passthrough would be stale: only image files keep theirs.
            IoMode::Cached if upper.is_some() && self.io.passthrough() => (0, 0),
            IoMode::Cached => (fopen::KEEP_CACHE, 0),
        };
        Open { fh, flags, backing_id }
    }

    pub(super) fn acl_name(&self, name: &[u8]) -> bool {
        !self.lower.info.has_acl && ACL_XATTRS.contains(&name)
    }
}

/// Answers a request whose reply is only whether it worked.
pub(super) fn answer(r: R<()>, reply: Reply<'_>) {
    match r {
        Ok(()) => reply.ok(),
        Err(x) => reply.error(x),
    }
}

pub(super) fn xattr_answer(r: R<Vec<u8>>, size: u32, reply: Reply<'_>) {
    match r {
        Ok(v) => crate::fs::xattr_reply(&v, size, reply),
        Err(x) => reply.error(x),
    }
}

/// A descriptor of the directory `dir` that can be synced: upper
/// directories are held with O_PATH, which fsync(2) and syncfs(2) refuse.
pub(super) fn reopen_dir(dir: impl AsFd) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

impl Filesystem for OverlayFs {
    fn init(&self, kernel: &KernelInit, conn: &Arc<Connection>) -> InitConfig {
        let _ = self.conn.set(conn.clone());
        let mut want = init::ASYNC_READ
            | init::PARALLEL_DIROPS
            | init::BIG_WRITES
            | init::DO_READDIRPLUS
            | init::CACHE_SYMLINKS
            | init::MAX_PAGES
            // We clear setuid/setgid on write, truncate and chown, as the
            // kernel would: it then marks the superblock SB_NOSEC and stops
            // asking for security.capability before every write(2), and
            // chown no longer needs a GETATTR first.
            | init::HANDLE_KILLPRIV_V2;
        // With passthrough (asked for, root only) the kernel reads and
        // writes upper files itself, which needs an OPEN of every open.
        // Without it, nothing needs OPEN: answered "not implemented", the
        // kernel stops sending it and RELEASE (two round trips per open,
        // which a build pays for every #include), and I/O names the node.
        // That I/O goes through the node's page cache, which stays true
        // because every change passes through it. Writes are then written
        // through, not cached: a copy-up (now at the first write) or a full
        // disk fails the write(2) itself, and the kernel caches no size or
        // data the upper file never got. A truncating open truncates by
        // SETATTR (ATOMIC_O_TRUNC relies on the OPEN).
        let passthrough = crate::passthrough_possible(&self.tune, kernel);
        self.io.set_passthrough(passthrough);
        let no_open = !passthrough && self.tune.no_open;
        self.no_open.store(no_open, Ordering::Relaxed);
        // Writeback caching (where OPEN is answered) costs a GETATTR after
        // every close(2) besides: it drops the cached block count. The
        // kernel refuses it together with passthrough.
        let writeback = !passthrough && !no_open && kernel.offers(init::WRITEBACK_CACHE) && self.tune.writeback_cache;
        self.writeback.store(writeback, Ordering::Relaxed);
        if passthrough {
            want |= init::PASSTHROUGH;
        } else if writeback {
            want |= init::WRITEBACK_CACHE;
        }
        if !no_open {
            want |= init::ATOMIC_O_TRUNC;
        }
        if self.lower.info.has_acl && self.tune.posix_acl {
            want |= init::POSIX_ACL;
        }
        self.killpriv
            .store(kernel.offers(init::HANDLE_KILLPRIV_V2), Ordering::Relaxed);
        InitConfig {
            want,
            max_write: 1 << 20,
            max_background: 64,
            congestion_threshold: 48,
            // The upper directory may not be on a stacked filesystem; this
            // mount may itself be a lower layer.
            max_stack_depth: if passthrough { 1 } else { 0 },
            ..InitConfig::default()
        }
    }

    fn forget(&self, nodeid: u64, nlookup: u64) {
        // Dropped after the lock: the last close of a removed file's
        // descriptor frees its blocks (deferred there from UNLINK), which
        // the queue threads must not wait behind.
        let gone = self.nodes().forget(nodeid, nlookup);
        if gone.is_some() {
            self.unopened_drop(nodeid);
        }
        drop(gone);
    }

    fn handle(&self, req: &Request, op: Op<'_>, reply: Reply<'_>) {
        let id = req.nodeid;
        let who = (req.uid, req.gid);
        match op {
            Op::Lookup { name } => self.op_lookup(id, name.as_bytes(), reply),
            Op::Getattr { fh } => self.op_getattr(id, fh, reply),
            Op::Setattr(a) => self.op_setattr(id, a, reply),
            Op::Readlink => self.op_readlink(id, reply),
            Op::Symlink { name, target } => {
                self.op_make(who, id, name.as_bytes(), NewEntry::Symlink(target), 0o777, reply)
            }
            Op::Mknod { name, mode, rdev, .. } => self.op_mknod(who, id, name.as_bytes(), mode, rdev, reply),
            Op::Mkdir { name, mode, .. } => {
                self.op_make(who, id, name.as_bytes(), NewEntry::Dir, S_IFDIR | mode, reply)
            }
            Op::Unlink { name } => answer(self.remove(id, name.as_bytes(), false), reply),
            Op::Rmdir { name } => answer(self.remove(id, name.as_bytes(), true), reply),
            Op::Rename {
                name,
                newdir,
                newname,
                flags,
            } => {
                let r = self.rename(id, name.as_bytes(), newdir, newname.as_bytes(), flags);
                answer(r, reply)
            }
            Op::Link { oldnode, newname } => self.op_link(oldnode, id, newname.as_bytes(), reply),
            Op::Open { flags, open_flags } => self.op_open(id, flags, open_flags, reply),
            Op::Create { name, arg, tmpfile } => self.op_create(who, id, name.as_bytes(), arg.mode, tmpfile, reply),
            Op::Read(a) => self.op_read(id, a, reply),
            Op::Write { arg, data } => self.op_write(id, arg, data, reply),
            Op::Release(a) | Op::Releasedir(a) => self.op_release(a.fh, reply),
            // close(2) need not wait: written data reaches us by writeback.
            Op::Flush { .. } => reply.error(libc::ENOSYS),
            Op::Fsync { fh, datasync } => self.op_fsync(id, fh, datasync, reply),
            Op::Opendir { .. } => self.op_opendir(reply),
            Op::Readdir { arg, plus } => self.op_readdir(id, arg.fh, arg.offset, arg.size, plus, reply),
            Op::Fsyncdir { .. } => self.op_fsyncdir(id, reply),
            Op::Statfs => self.op_statfs(reply),
            Op::Getxattr { name, size } => self.op_getxattr(id, req.uid, name.as_bytes(), size, reply),
            Op::Listxattr { size } => xattr_answer(self.listxattr(id, req.uid), size, reply),
            Op::Setxattr { name, value, flags, .. } => self.op_setxattr(id, name.as_bytes(), value, flags, reply),
            Op::Removexattr { name } => answer(self.removexattr(id, name.as_bytes()), reply),
            Op::Fallocate(a) => self.op_fallocate(id, a, reply),
            Op::Lseek(a) => self.op_lseek(id, a, reply),
            Op::Syncfs => self.op_syncfs(reply),
            _ => reply.error(libc::ENOSYS),
        }
    }
}
