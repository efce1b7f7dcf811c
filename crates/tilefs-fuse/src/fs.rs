//! The filesystem: answers FUSE requests from the image's tree, reads file
//! contents from verified objects in the store.
//!
//! Nothing changes while mounted, so every answer is given with a long
//! validity and the kernel is asked to cache everything it can (see
//! `Tuning`). Node ids are the tree's inode ids plus one (the tree's root,
//! id 0, is FUSE's root, 1); they are also the inode numbers shown, so
//! hardlinks share one and numbers never collide.

use crate::lower::LowerNode;
use crate::lower::{dirent_type, Lower, Object, FOREVER};
use crate::objects::ObjectError;
use crate::Tuning;
use rustc_hash::FxHashMap;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tilefs_fuse_proto::abi::{self, fopen, init};
use tilefs_fuse_proto::{
    BackingId, Connection, DirBuf, Entry, Filesystem, InitConfig, KernelInit, Op, Open, Reply, Request,
};
use tilefs_image::tree::{InodeId, S_IFMT};

/// Backing files kept registered while no open uses them (fewer if the
/// limit on open files is low): registering one is most of an OPEN's time.
const IDLE_BACKING_MAX: usize = 1024;

/// Backing files registered for passthrough: one per inode while it is
/// open (the kernel refuses a second for the same inode), kept idle after
/// that for the next open.
#[derive(Default)]
struct BackingFiles {
    map: FxHashMap<InodeId, Backed>,
    /// Entries with no open.
    idle: usize,
}

struct Backed {
    id: BackingId,
    /// What it was registered from: an idle one is used again only if the
    /// object has not changed since it was checked.
    object: Object,
    opens: u32,
}

impl BackingFiles {
    /// The backing id for one more open of `id`, if one is registered and
    /// still good: in use, or idle and its object unchanged since checked.
    /// An idle one whose object changed is dropped: the open registers the
    /// object as the store has it now.
    fn reuse(&mut self, id: InodeId) -> (Option<i32>, Option<Backed>) {
        let Some(e) = self.map.get_mut(&id) else {
            return (None, None);
        };
        if e.opens == 0 {
            self.idle -= 1;
            if !e.object.unchanged() {
                return (None, self.map.remove(&id));
            }
        }
        e.opens += 1;
        (Some(e.id.id()), None)
    }

    /// Records an open of `id` with backing file `bid`, registered from
    /// `object`, and returns the id the open must use: if another open
    /// registered one meanwhile, that one (the kernel takes one per inode).
    fn add_open(&mut self, id: InodeId, bid: BackingId, object: Object) -> i32 {
        if let Some(kept) = self.reuse(id).0 {
            return kept;
        }
        self.map.insert(
            id,
            Backed {
                id: bid,
                object,
                opens: 1,
            },
        );
        self.map[&id].id.id()
    }

    /// An open of `id` was released; its backing file stays registered,
    /// idle, unless `max` are idle already. Returns what to drop.
    fn release(&mut self, id: InodeId, max: usize) -> Option<Backed> {
        let e = self.map.get_mut(&id)?;
        e.opens = e.opens.checked_sub(1)?;
        if e.opens > 0 {
            return None;
        }
        self.idle += 1;
        if self.idle <= max {
            return None;
        }
        // Any idle one goes; registering it again costs one OPEN's work.
        let old = *self.map.iter().find(|(_, e)| e.opens == 0)?.0;
        self.idle -= 1;
        self.map.remove(&old)
    }
}

/// An open file.
enum Handle {
    /// Served by us from an object.
    Object(Object),
    /// Served by the kernel from the object (FUSE passthrough).
    Passthrough(InodeId),
}

pub struct TileFs {
    pub(crate) lower: Lower,
    pub(crate) tune: Tuning,
    handles: Mutex<FxHashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    /// Objects of files opened without asking us, by inode.
    unopened: Mutex<FxHashMap<InodeId, Arc<Object>>>,
    unopened_max: usize,
    /// Backing files registered with the kernel for passthrough.
    backing: Mutex<BackingFiles>,
    idle_backing_max: usize,
    /// The connection (for passthrough), once INIT is answered.
    conn: OnceLock<Arc<Connection>>,
    passthrough: AtomicBool,
}

impl TileFs {
    pub(crate) fn new(lower: Lower, tune: Tuning, fd_budget: u64) -> TileFs {
        TileFs {
            lower,
            tune,
            handles: Mutex::new(FxHashMap::default()),
            next_fh: AtomicU64::new(1),
            unopened: Mutex::new(FxHashMap::default()),
            unopened_max: crate::UNOPENED_MAX
                .min(fd_budget.try_into().unwrap_or(usize::MAX))
                .max(1),
            backing: Mutex::new(BackingFiles::default()),
            // Half the budget: the rest is for the unopened objects.
            idle_backing_max: IDLE_BACKING_MAX
                .min((fd_budget / 2).try_into().unwrap_or(usize::MAX))
                .max(1),
            conn: OnceLock::new(),
            passthrough: AtomicBool::new(false),
        }
    }

    fn add_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().unwrap().insert(fh, Arc::new(h));
        fh
    }

    /// The object of a file the kernel opened without asking us: kept open
    /// by inode (no release ever comes), at most `unopened_max` at a time.
    /// A kept object whose file changed since it was checked is opened
    /// again from the store, so a replaced or removed object is seen as an
    /// open would see it.
    fn unopened_object(&self, id: InodeId, inode: &LowerNode) -> Result<Arc<Object>, ObjectError> {
        let kept = self.unopened.lock().unwrap().get(&id).cloned();
        if let Some(o) = kept {
            if o.unchanged() {
                return Ok(o);
            }
        }
        // Replaces a changed object under the same key.
        let h = Arc::new(self.lower.object(inode)?);
        // (Reopening an evicted one costs an open and a stat: the check
        // itself is remembered by the object's state.)
        let evicted = crate::keep_bounded(&mut self.unopened.lock().unwrap(), self.unopened_max, id, h.clone());
        drop(evicted);
        Ok(h)
    }

    fn open_flags(&self) -> u32 {
        let mut f = 0;
        if self.tune.keep_cache {
            f |= fopen::KEEP_CACHE;
        }
        if self.tune.no_flush {
            f |= fopen::NOFLUSH;
        }
        f
    }

    /// Serves `size` bytes at `offset` of an object already known to be
    /// in a verified state (so as long as the file).
    fn read_object(&self, id: InodeId, file: &File, offset: u64, size: u32, reply: Reply<'_>) {
        let file_size = self.lower.node(id).size;
        let len = file_size.saturating_sub(offset).min(u64::from(size)) as usize;
        if let Err(e) = reply.file(file.as_fd(), offset, len) {
            self.lower.report(id, &format!("cannot read the object: {e}"));
        }
    }
}

impl TileFs {
    fn lookup(&self, parent: u64, name: &[u8], reply: Reply<'_>) {
        let dir = match self.lower.dir(parent) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        match dir.entry(name) {
            Some(e) => match self.lower.try_entry(e.inode) {
                Ok(e) => reply.entry(&e),
                Err(e) => reply.error(e),
            },
            None if self.tune.negative_cache => {
                // Node id 0: a negative entry the kernel keeps for the timeout.
                reply.entry(&Entry {
                    nodeid: 0,
                    entry_ttl: FOREVER,
                    ..Entry::default()
                })
            }
            None => reply.error(libc::ENOENT),
        }
    }

    fn open(&self, ino: u64, flags: u32, reply: Reply<'_>) {
        let (id, inode) = match self.lower.inode(ino) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        if flags as i32 & libc::O_ACCMODE != libc::O_RDONLY || flags as i32 & libc::O_TRUNC != 0 {
            return reply.error(libc::EROFS);
        }
        if inode.is_dir() {
            return reply.error(libc::EISDIR);
        }
        let passthrough = self.passthrough.load(Ordering::Relaxed);
        if !passthrough && self.tune.no_open && self.tune.keep_cache {
            // The kernel stops asking (the mount is read-only, so it refuses
            // writes itself); reads then name the inode alone.
            return reply.error(libc::ENOSYS);
        }
        if !inode.is_external() {
            // Inline, empty or special: served from the image.
            return reply.open(Open {
                fh: 0,
                flags: self.open_flags(),
                backing_id: 0,
            });
        }
        // The kernel refuses page-cache flags with passthrough, and wants
        // every open of an inode open in passthrough mode to be one too.
        let noflush = self.open_flags() & fopen::NOFLUSH;
        if passthrough {
            let (kept, stale) = self.backing.lock().unwrap().reuse(id);
            drop(stale);
            if let Some(backing_id) = kept {
                let fh = self.add_handle(Handle::Passthrough(id));
                return reply.open(Open {
                    fh,
                    flags: noflush | fopen::PASSTHROUGH,
                    backing_id,
                });
            }
        }
        let o = match self.lower.object(&inode) {
            Ok(o) => o,
            Err(e) => {
                self.lower.report(id, &e.to_string());
                return reply.error(libc::EIO);
            }
        };
        let served = |o| Open {
            fh: self.add_handle(Handle::Object(o)),
            flags: self.open_flags(),
            backing_id: 0,
        };
        let conn = self.conn.get().filter(|_| passthrough);
        let Some(conn) = conn else {
            return reply.open(served(o));
        };
        match conn.open_backing(o.file.as_fd()) {
            Ok(bid) => {
                let backing_id = self.backing.lock().unwrap().add_open(id, bid, o);
                let fh = self.add_handle(Handle::Passthrough(id));
                reply.open(Open {
                    fh,
                    flags: noflush | fopen::PASSTHROUGH,
                    backing_id,
                })
            }
            Err(e) => {
                // Later opens are answered as without passthrough.
                self.passthrough.store(false, Ordering::Relaxed);
                tracing::warn!("passthrough refused by the kernel ({e}); serving reads instead");
                reply.open(served(o))
            }
        }
    }

    fn read(&self, ino: u64, fh: u64, offset: u64, size: u32, reply: Reply<'_>) {
        let (id, inode) = match self.lower.inode(ino) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        if fh != 0 {
            let h = self.handles.lock().unwrap().get(&fh).cloned();
            return match h.as_deref() {
                // Checked at open; if the object changed since, check it again.
                Some(Handle::Object(o)) => match o.digest.map(|d| self.lower.verified.recheck(&o.file, &d, &o.key)) {
                    Some(Err(e)) => {
                        self.lower.report(id, &e.to_string());
                        reply.error(libc::EIO)
                    }
                    _ => self.read_object(id, &o.file, offset, size, reply),
                },
                // The kernel reads passthrough files itself.
                Some(Handle::Passthrough(_)) => reply.error(libc::EIO),
                None => reply.error(libc::EBADF),
            };
        }
        if inode.is_external() {
            // Opened without asking us (open answered with ENOSYS).
            return match self.unopened_object(id, &inode) {
                Ok(o) => self.read_object(id, &o.file, offset, size, reply),
                Err(e) => {
                    self.lower.report(id, &e.to_string());
                    reply.error(libc::EIO)
                }
            };
        }
        let data: &[u8] = if inode.is_whiteout() {
            &[]
        } else {
            inode.content.unwrap_or_default()
        };
        let start = (offset.min(data.len() as u64)) as usize;
        let end = start.saturating_add(size as usize).min(data.len());
        reply.data(&data[start..end])
    }

    fn release(&self, fh: u64, reply: Reply<'_>) {
        if fh != 0 {
            let h = self.handles.lock().unwrap().remove(&fh);
            if let Some(Handle::Passthrough(id)) = h.as_deref() {
                // Dropped (unregistered, its object closed) after the lock.
                let _evicted = self.backing.lock().unwrap().release(*id, self.idle_backing_max);
            }
        }
        reply.ok()
    }

    fn opendir(&self, ino: u64, reply: Reply<'_>) {
        match self.lower.inode(ino) {
            Ok((_, i)) if i.is_dir() => {}
            Ok(_) => return reply.error(libc::ENOTDIR),
            Err(e) => return reply.error(e),
        }
        if self.tune.no_opendir {
            // The kernel stops asking and keeps directory caches by itself.
            return reply.error(libc::ENOSYS);
        }
        let flags = if self.tune.cache_dir {
            fopen::CACHE_DIR | fopen::KEEP_CACHE
        } else {
            0
        };
        reply.open(Open {
            fh: 0,
            flags,
            backing_id: 0,
        })
    }

    fn readdir(&self, ino: u64, offset: u64, size: u32, plus: bool, reply: Reply<'_>) {
        let dir = match self.lower.inode(ino) {
            Ok((id, i)) if i.is_dir() => id,
            Ok(_) => return reply.error(libc::ENOTDIR),
            Err(e) => return reply.error(e),
        };
        let mut buf = DirBuf::new(size);
        self.lower.list(dir, offset, |off, name, id| {
            let e = self.lower.entry(id);
            if plus {
                buf.add_plus(&e, off, dirent_type(e.attr.mode), name)
            } else {
                buf.add(self.lower.nodeid(id), off, dirent_type(e.attr.mode), name)
            }
        });
        reply.data(buf.as_bytes())
    }

    fn statfs(&self, reply: Reply<'_>) {
        reply.statfs(&abi::Kstatfs {
            blocks: u64::from(self.lower.info.blocks),
            files: self.lower.len() as u64,
            bsize: 4096,
            namelen: 255,
            frsize: 4096,
            ..Default::default()
        })
    }

    fn getxattr(&self, req: &Request, ino: u64, name: &[u8], size: u32, reply: Reply<'_>) {
        let (id, _) = match self.lower.inode(ino) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        if self.lower.unsupported(name) {
            return reply.error(libc::EOPNOTSUPP);
        }
        if !self.lower.visible(req.uid, name) {
            return reply.error(libc::ENODATA);
        }
        let xattrs = match self.lower.try_xattrs(id) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        let Some((_, value)) = xattrs.iter().find(|(k, _)| *k == name) else {
            return reply.error(libc::ENODATA);
        };
        xattr_reply(value, size, reply)
    }

    fn listxattr(&self, req: &Request, ino: u64, size: u32, reply: Reply<'_>) {
        let (id, _) = match self.lower.inode(ino) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        let mut names = Vec::new();
        let xattrs = match self.lower.try_xattrs(id) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        for (k, _) in xattrs {
            if self.lower.visible(req.uid, k) {
                names.extend_from_slice(k);
                names.push(0);
            }
        }
        xattr_reply(&names, size, reply)
    }

    fn access(&self, req: &Request, ino: u64, mask: u32, reply: Reply<'_>) {
        // Only reached without default_permissions (a measurement setting).
        match self.lower.inode(ino) {
            Ok((_, i)) => {
                let mask = mask as i32;
                if mask & libc::W_OK != 0 {
                    reply.error(libc::EROFS)
                } else if Lower::permitted(req.uid, req.gid, &i, mask) {
                    reply.ok()
                } else {
                    reply.error(libc::EACCES)
                }
            }
            Err(e) => reply.error(e),
        }
    }
}

/// Answers a getxattr or listxattr of `value`: its size when asked with
/// size 0, ERANGE when it does not fit.
pub(crate) fn xattr_reply(value: &[u8], size: u32, reply: Reply<'_>) {
    if size == 0 {
        reply.xattr_size(value.len() as u32)
    } else if (size as usize) < value.len() {
        reply.error(libc::ERANGE)
    } else {
        reply.data(value)
    }
}

impl Filesystem for TileFs {
    fn init(&self, kernel: &KernelInit, conn: &Arc<Connection>) -> InitConfig {
        let _ = self.conn.set(conn.clone());
        let mut want = init::ASYNC_READ | init::PARALLEL_DIROPS | init::BIG_WRITES;
        if self.tune.cache_symlinks {
            want |= init::CACHE_SYMLINKS;
        }
        if self.tune.readdirplus {
            want |= init::DO_READDIRPLUS;
            if self.tune.readdirplus_auto {
                want |= init::READDIRPLUS_AUTO;
            }
        }
        if self.tune.posix_acl && self.lower.info.has_acl {
            want |= init::POSIX_ACL;
        }
        if self.tune.max_pages {
            want |= init::MAX_PAGES;
        }
        let passthrough = crate::passthrough_possible(&self.tune, kernel);
        let mut cfg = InitConfig {
            want,
            max_write: if self.tune.max_pages { 1 << 20 } else { 128 * 1024 },
            max_background: 64,
            congestion_threshold: 48,
            ..InitConfig::default()
        };
        if passthrough {
            cfg.want |= init::PASSTHROUGH;
            // 1: the backing files may not be on a stacked filesystem, but
            // this mount may itself be the lower layer of an overlay.
            cfg.max_stack_depth = 1;
        }
        self.passthrough.store(passthrough, Ordering::Relaxed);
        cfg
    }

    fn handle(&self, req: &Request, op: Op<'_>, reply: Reply<'_>) {
        let ino = req.nodeid;
        match op {
            Op::Lookup { name } => self.lookup(ino, name.as_bytes(), reply),
            Op::Getattr { .. } => match self.lower.inode(ino).and_then(|(id, _)| self.lower.try_attr(id)) {
                Ok(a) => reply.attr(FOREVER, &a),
                Err(e) => reply.error(e),
            },
            Op::Readlink => match self.lower.inode(ino) {
                Ok((_, i)) if i.mode & S_IFMT == libc::S_IFLNK => reply.data(i.payload.unwrap_or_default()),
                Ok(_) => reply.error(libc::EINVAL),
                Err(e) => reply.error(e),
            },
            Op::Open { flags, .. } => self.open(ino, flags, reply),
            Op::Read(a) => self.read(ino, a.fh, a.offset, a.size, reply),
            Op::Release(a) => self.release(a.fh, reply),
            Op::Flush { .. } if self.tune.no_flush => {
                // The kernel stops sending flush on close.
                reply.error(libc::ENOSYS)
            }
            Op::Flush { .. } | Op::Releasedir(_) => reply.ok(),
            Op::Opendir { .. } => self.opendir(ino, reply),
            Op::Readdir { arg, plus } => self.readdir(ino, arg.offset, arg.size, plus, reply),
            Op::Statfs => self.statfs(reply),
            Op::Getxattr { name, size } => self.getxattr(req, ino, name.as_bytes(), size, reply),
            Op::Listxattr { size } => self.listxattr(req, ino, size, reply),
            Op::Access { mask } => self.access(req, ino, mask, reply),
            Op::Setattr(_)
            | Op::Symlink { .. }
            | Op::Mknod { .. }
            | Op::Mkdir { .. }
            | Op::Unlink { .. }
            | Op::Rmdir { .. }
            | Op::Rename { .. }
            | Op::Link { .. }
            | Op::Write { .. }
            | Op::Setxattr { .. }
            | Op::Removexattr { .. }
            | Op::Create { .. }
            | Op::Fallocate(_)
            | Op::CopyFileRange(_) => reply.error(libc::EROFS),
            Op::Fsync { .. } | Op::Fsyncdir { .. } | Op::Syncfs => reply.ok(),
            _ => reply.error(libc::ENOSYS),
        }
    }
}
