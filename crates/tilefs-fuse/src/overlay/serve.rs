//! The FUSE side of the writable mount: INIT and each request.

use super::io_mode::IoMode;
use super::names::NewEntry;
use super::upper::{S_IFDIR, S_IFMT, S_IFREG};
use super::{e, Handle, OverlayFs, R};
use crate::lower::{ACL_XATTRS, FOREVER};
use crate::overlay::nodes::ROOT;
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use tilefs_fuse_proto::abi::{self, fattr, fopen, init};
use tilefs_fuse_proto::{Connection, DirBuf, Entry, Filesystem, InitConfig, KernelInit, Op, Open, Reply, Request};

impl OverlayFs {
    fn add_handle(&self, h: Handle) -> (u64, Arc<Handle>) {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let h = Arc::new(h);
        self.handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(fh, h.clone());
        (fh, h)
    }

    fn handle_of(&self, fh: u64) -> Option<Arc<Handle>> {
        self.handles.lock().unwrap_or_else(|e| e.into_inner()).get(&fh).cloned()
    }

    /// Counts one more lookup of `id` and answers with its entry (or
    /// takes the count back if its attributes cannot be had).
    fn reply_entry(&self, id: u64, reply: Reply<'_>) {
        match self.entry(id) {
            Ok(en) => reply.entry(&en),
            Err(x) => {
                self.nodes().forget(id, 1);
                reply.error(x)
            }
        }
    }

    fn lookup(&self, parent: u64, name: &[u8]) -> R<Option<u64>> {
        match self.find(parent, name)? {
            None => Ok(None),
            Some(f) => self.node_for(parent, name, &f).map(Some),
        }
    }

    /// Registers open handle `h` of node `id` and tells how the kernel is
    /// to do its I/O (see [`super::io_mode`]).
    fn opened(&self, id: u64, h: Handle) -> Open {
        let (fh, h) = self.add_handle(h);
        let upper = match &*h {
            Handle::Upper(f) => Some(f.as_fd()),
            _ => None,
        };
        let log = |m: &str| self.log().log(m);
        let (flags, backing_id) = match self.io.open(self.conn.get().map(|c| &**c), id, fh, upper, &log) {
            IoMode::Passthrough(b) => (fopen::PASSTHROUGH, b),
            // Pages of an upper file cached before it was written through
            // passthrough would be stale: only image files keep theirs.
            IoMode::Cached if upper.is_some() && self.io.passthrough() => (0, 0),
            IoMode::Cached => (fopen::KEEP_CACHE, 0),
        };
        Open { fh, flags, backing_id }
    }

    fn readdir(&self, id: u64, fh: u64, offset: u64, size: u32, plus: bool, reply: Reply<'_>) {
        let Some(h) = self.handle_of(fh) else {
            return reply.error(libc::EBADF);
        };
        let Handle::Dir(snap) = &*h else {
            return reply.error(libc::EBADF);
        };
        let list = {
            let mut s = snap.lock().unwrap_or_else(|e| e.into_inner());
            if s.is_none() || offset == 0 {
                match self.listing(id) {
                    Ok(l) => *s = Some(Arc::new(l)),
                    Err(x) => return reply.error(x),
                }
            }
            s.clone().expect("set above")
        };
        let (ino, parent_ino) = {
            let nodes = self.nodes();
            let Some(n) = nodes.get(id) else {
                return reply.error(libc::ENOENT);
            };
            let p = n.primary().and_then(|(p, _)| nodes.get(p)).map_or(n.ino, |p| p.ino);
            (n.ino, p)
        };
        let mut buf = DirBuf::new(size);
        let dir_type = S_IFDIR >> 12;
        for i in offset..(list.len() as u64 + 2) {
            let full = match i {
                0 | 1 => {
                    let (name, ino): (&[u8], u64) = if i == 0 { (b".", ino) } else { (b"..", parent_ino) };
                    if plus {
                        // Not counted as lookups by the kernel.
                        let en = Entry {
                            attr: tilefs_fuse_proto::abi::Attr {
                                ino,
                                mode: S_IFDIR,
                                ..Default::default()
                            },
                            ..Entry::default()
                        };
                        buf.add_plus(&en, i + 1, dir_type, name)
                    } else {
                        buf.add(ino, i + 1, dir_type, name)
                    }
                }
                _ => {
                    let l = &list[(i - 2) as usize];
                    if plus {
                        let Ok(Some(child)) = self.lookup(id, &l.name) else {
                            continue;
                        };
                        match self.entry(child) {
                            Ok(en) => {
                                let full = buf.add_plus(&en, i + 1, (en.attr.mode & S_IFMT) >> 12, &l.name);
                                if full {
                                    self.nodes().forget(child, 1);
                                }
                                full
                            }
                            Err(_) => {
                                self.nodes().forget(child, 1);
                                continue;
                            }
                        }
                    } else {
                        buf.add(l.ino, i + 1, l.typ, &l.name)
                    }
                }
            };
            if full {
                break;
            }
        }
        reply.data(buf.as_bytes())
    }

    fn acl_name(&self, name: &[u8]) -> bool {
        !self.lower.info.has_acl && ACL_XATTRS.contains(&name)
    }
}

fn xattr_answer(r: R<Vec<u8>>, size: u32, reply: Reply<'_>) {
    match r {
        Ok(v) => crate::fs::xattr_reply(&v, size, reply),
        Err(x) => reply.error(x),
    }
}

impl Filesystem for OverlayFs {
    fn init(&self, kernel: &KernelInit, conn: &Arc<Connection>) -> InitConfig {
        let _ = self.conn.set(conn.clone());
        let mut want = init::ASYNC_READ
            | init::PARALLEL_DIROPS
            | init::BIG_WRITES
            | init::ATOMIC_O_TRUNC
            | init::DO_READDIRPLUS
            | init::CACHE_SYMLINKS
            | init::MAX_PAGES
            // We clear setuid/setgid on write, truncate and chown, as the
            // kernel would: it then marks the superblock SB_NOSEC and stops
            // asking for security.capability before every write(2), and
            // chown no longer needs a GETATTR first.
            | init::HANDLE_KILLPRIV_V2;
        // As root, upper files are read and written by the kernel itself
        // (passthrough); it refuses that together with writeback caching,
        // which costs a GETATTR after every close(2) besides (it drops the
        // cached block count).
        let passthrough = crate::passthrough_possible(&self.tune, kernel);
        self.io.set_passthrough(passthrough);
        if passthrough {
            want |= init::PASSTHROUGH;
        } else if self.tune.writeback_cache {
            want |= init::WRITEBACK_CACHE;
        }
        if self.lower.info.has_acl && self.tune.posix_acl {
            want |= init::POSIX_ACL;
        }
        self.killpriv
            .store(kernel.offers(init::HANDLE_KILLPRIV_V2), Ordering::Relaxed);
        self.writeback.store(
            !passthrough && kernel.offers(init::WRITEBACK_CACHE) && self.tune.writeback_cache,
            Ordering::Relaxed,
        );
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
        drop(gone);
    }

    fn handle(&self, req: &Request, op: Op<'_>, reply: Reply<'_>) {
        let id = req.nodeid;
        match op {
            Op::Lookup { name } => match self.lookup(id, name.as_bytes()) {
                Ok(Some(child)) => self.reply_entry(child, reply),
                Ok(None) => reply.entry(&Entry {
                    nodeid: 0,
                    entry_ttl: FOREVER,
                    ..Entry::default()
                }),
                Err(x) => reply.error(x),
            },
            Op::Getattr { fh } => {
                let by_fd = fh.and_then(|fh| self.handle_of(fh)).and_then(|h| match &*h {
                    Handle::Upper(f) => Some(self.attr_by_fd(id, f)),
                    _ => None,
                });
                match by_fd.unwrap_or_else(|| self.attr(id)) {
                    Ok(a) => reply.attr(FOREVER, &a),
                    Err(x) => reply.error(x),
                }
            }
            Op::Setattr(mut a) => {
                // With KILLPRIV_V2 the kernel leaves setuid/setgid to us but
                // flags only chown and truncate: a write through passthrough
                // (file_remove_privs) or chown(f, -1, -1) reaches us as a
                // SETATTR with nothing else to change. Those are exactly
                // the changes that drop the bits on the kernel's overlay.
                let nothing_else = a.valid & !(fattr::FH | fattr::LOCKOWNER | fattr::CTIME) == 0;
                if nothing_else && self.killpriv.load(Ordering::Relaxed) {
                    a.valid |= fattr::KILL_SUIDGID;
                }
                let h = (a.valid & fattr::FH != 0).then(|| self.handle_of(a.fh)).flatten();
                let fd = h.as_deref().and_then(|h| match h {
                    Handle::Upper(f) => Some(&**f),
                    _ => None,
                });
                match self.setattr(id, &a, fd) {
                    Ok(attr) => reply.attr(FOREVER, &attr),
                    Err(x) => reply.error(x),
                }
            }
            Op::Readlink => match self.readlink(id) {
                Ok(t) => reply.data(&t),
                Err(x) => reply.error(x),
            },
            Op::Symlink { name, target } => {
                match self.create(
                    (req.uid, req.gid),
                    id,
                    name.as_bytes(),
                    NewEntry::Symlink(target),
                    0o777,
                    false,
                ) {
                    Ok((child, _)) => self.reply_entry(child, reply),
                    Err(x) => reply.error(x),
                }
            }
            Op::Mknod { name, mode, rdev, .. } => {
                let what = if mode & S_IFMT == S_IFREG || mode & S_IFMT == 0 {
                    NewEntry::File
                } else {
                    NewEntry::Special(u64::from(rdev))
                };
                let mode = if mode & S_IFMT == 0 { mode | S_IFREG } else { mode };
                match self.create((req.uid, req.gid), id, name.as_bytes(), what, mode, false) {
                    Ok((child, _)) => self.reply_entry(child, reply),
                    Err(x) => reply.error(x),
                }
            }
            Op::Mkdir { name, mode, .. } => {
                match self.create(
                    (req.uid, req.gid),
                    id,
                    name.as_bytes(),
                    NewEntry::Dir,
                    S_IFDIR | mode,
                    false,
                ) {
                    Ok((child, _)) => self.reply_entry(child, reply),
                    Err(x) => reply.error(x),
                }
            }
            Op::Unlink { name } => match self.remove(id, name.as_bytes(), false) {
                Ok(()) => reply.ok(),
                Err(x) => reply.error(x),
            },
            Op::Rmdir { name } => match self.remove(id, name.as_bytes(), true) {
                Ok(()) => reply.ok(),
                Err(x) => reply.error(x),
            },
            Op::Rename {
                name,
                newdir,
                newname,
                flags,
            } => match self.rename(id, name.as_bytes(), newdir, newname.as_bytes(), flags) {
                Ok(()) => reply.ok(),
                Err(x) => reply.error(x),
            },
            Op::Link { oldnode, newname } => match self.link(oldnode, id, newname.as_bytes()) {
                Ok(()) => match self.entry(oldnode) {
                    Ok(en) => reply.entry(&en),
                    Err(x) => {
                        self.nodes().forget(oldnode, 1);
                        reply.error(x)
                    }
                },
                Err(x) => reply.error(x),
            },
            Op::Open { flags, open_flags } => match self
                .open_node(id, flags, self.writeback.load(Ordering::Relaxed))
                .and_then(|h| {
                    if open_flags & abi::OPEN_KILL_SUIDGID != 0 {
                        self.kill_suidgid(id)?;
                    }
                    Ok(h)
                }) {
                Ok(h) => reply.open(self.opened(id, h)),
                Err(x) => reply.error(x),
            },
            Op::Create { name, arg, tmpfile } => {
                let made = if tmpfile {
                    self.tmpfile((req.uid, req.gid), id, arg.mode)
                        .map(|(c, f)| (c, Some(f)))
                } else {
                    self.create(
                        (req.uid, req.gid),
                        id,
                        name.as_bytes(),
                        NewEntry::File,
                        S_IFREG | arg.mode,
                        true,
                    )
                };
                match made {
                    Ok((child, Some(f))) => match self.entry(child) {
                        Ok(en) => reply.create(&en, self.opened(child, Handle::Upper(Arc::new(f)))),
                        Err(x) => {
                            self.nodes().forget(child, 1);
                            reply.error(x)
                        }
                    },
                    Ok((child, None)) => {
                        self.nodes().forget(child, 1);
                        reply.error(libc::EIO)
                    }
                    Err(x) => reply.error(x),
                }
            }
            Op::Read(a) => {
                let Some(h) = self.handle_of(a.fh) else {
                    return reply.error(libc::EBADF);
                };
                match &*h {
                    Handle::Upper(f) => {
                        if let Err(x) = reply.file(f.as_fd(), a.offset, a.size as usize) {
                            self.log().log(&format!("reading an upper file failed: {x}"));
                        }
                    }
                    Handle::Lower(o, l) => {
                        if let Some(d) = o.digest {
                            if let Err(x) = self.lower.verified.recheck(&o.file, &d, &o.key) {
                                self.lower.report(*l, &x.to_string());
                                return reply.error(libc::EIO);
                            }
                        }
                        let size = self.lower.node(*l).size;
                        let len = size.saturating_sub(a.offset).min(u64::from(a.size)) as usize;
                        if let Err(x) = reply.file(o.file.as_fd(), a.offset, len) {
                            self.lower.report(*l, &format!("cannot read the object: {x}"));
                        }
                    }
                    Handle::Inline(l) => {
                        let data = self.lower.node(*l).content.unwrap_or_default();
                        let start = (a.offset.min(data.len() as u64)) as usize;
                        let end = start.saturating_add(a.size as usize).min(data.len());
                        reply.data(&data[start..end])
                    }
                    Handle::Dir(_) => reply.error(libc::EISDIR),
                }
            }
            Op::Write { arg, data } => {
                let Some(h) = self.handle_of(arg.fh) else {
                    return reply.error(libc::EBADF);
                };
                let Handle::Upper(f) = &*h else {
                    return reply.error(libc::EBADF);
                };
                let mut done = 0;
                while done < data.len() {
                    match rustix::io::pwrite(f, &data[done..], arg.offset + done as u64) {
                        Ok(0) => break,
                        Ok(n) => done += n,
                        Err(Errno::INTR) => {}
                        Err(x) if done == 0 => return reply.error(e(x)),
                        Err(_) => break,
                    }
                }
                if arg.write_flags & abi::WRITE_KILL_SUIDGID != 0 && done > 0 {
                    if let Err(x) = self.kill_suidgid(id) {
                        return reply.error(x);
                    }
                }
                reply.write(done as u32)
            }
            Op::Release(a) | Op::Releasedir(a) => {
                self.io.release(a.fh);
                self.handles.lock().unwrap_or_else(|e| e.into_inner()).remove(&a.fh);
                reply.ok()
            }
            // close(2) need not wait: written data reaches us by writeback.
            Op::Flush { .. } => reply.error(libc::ENOSYS),
            Op::Fsync { fh, datasync } => match self.handle_of(fh).as_deref() {
                Some(Handle::Upper(f)) => {
                    let r = if datasync {
                        rustix::fs::fdatasync(f)
                    } else {
                        rustix::fs::fsync(f)
                    };
                    match r {
                        Ok(()) => reply.ok(),
                        Err(x) => reply.error(e(x)),
                    }
                }
                _ => reply.ok(),
            },
            Op::Opendir { .. } => {
                let (fh, _) = self.add_handle(Handle::Dir(Mutex::new(None)));
                reply.open(Open {
                    fh,
                    flags: fopen::CACHE_DIR | fopen::KEEP_CACHE,
                    backing_id: 0,
                })
            }
            Op::Readdir { arg, plus } => self.readdir(id, arg.fh, arg.offset, arg.size, plus, reply),
            Op::Fsyncdir { .. } => match self.dir_fd(id) {
                Ok(Some(d)) => match rustix::fs::openat(
                    &*d,
                    ".",
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .and_then(|f| rustix::fs::fsync(&f))
                {
                    Ok(()) => reply.ok(),
                    Err(x) => reply.error(e(x)),
                },
                Ok(None) => reply.ok(),
                Err(x) => reply.error(x),
            },
            Op::Statfs => match self.statfs() {
                Ok(s) => reply.statfs(&s),
                Err(x) => reply.error(x),
            },
            Op::Getxattr { name, size } => {
                let name = name.as_bytes();
                if self.acl_name(name) {
                    return reply.error(libc::EOPNOTSUPP);
                }
                xattr_answer(self.getxattr(id, req.uid, name), size, reply)
            }
            Op::Listxattr { size } => xattr_answer(self.listxattr(id, req.uid), size, reply),
            Op::Setxattr { name, value, flags, .. } => {
                let name = name.as_bytes();
                if self.acl_name(name) {
                    return reply.error(libc::EOPNOTSUPP);
                }
                match self.setxattr(id, name, value, flags) {
                    Ok(()) => reply.ok(),
                    Err(x) => reply.error(x),
                }
            }
            Op::Removexattr { name } => match self.removexattr(id, name.as_bytes()) {
                Ok(()) => reply.ok(),
                Err(x) => reply.error(x),
            },
            Op::Fallocate(a) => match self.handle_of(a.fh).as_deref() {
                Some(Handle::Upper(f)) => {
                    let mode = rustix::fs::FallocateFlags::from_bits_retain(a.mode);
                    match rustix::fs::fallocate(f, mode, a.offset, a.length) {
                        Ok(()) => reply.ok(),
                        Err(x) => reply.error(e(x)),
                    }
                }
                _ => reply.error(libc::EBADF),
            },
            Op::Lseek(a) => {
                let whence = match a.whence as i32 {
                    libc::SEEK_DATA => rustix::fs::SeekFrom::Data(a.offset),
                    libc::SEEK_HOLE => rustix::fs::SeekFrom::Hole(a.offset),
                    _ => return reply.error(libc::EINVAL),
                };
                let r = match self.handle_of(a.fh).as_deref() {
                    Some(Handle::Upper(f)) => rustix::fs::seek(f, whence).map_err(e),
                    Some(Handle::Lower(o, _)) => rustix::fs::seek(&o.file, whence).map_err(e),
                    Some(Handle::Inline(l)) => {
                        let size = self.lower.node(*l).size;
                        match whence {
                            _ if a.offset >= size => Err(libc::ENXIO),
                            rustix::fs::SeekFrom::Data(o) => Ok(o),
                            _ => Ok(size),
                        }
                    }
                    _ => Err(libc::EBADF),
                };
                match r {
                    Ok(o) => reply.lseek(o),
                    Err(x) => reply.error(x),
                }
            }
            Op::Syncfs => {
                match rustix::fs::openat(
                    &self.up.root,
                    ".",
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .and_then(|f| rustix::fs::syncfs(&f))
                {
                    Ok(()) => reply.ok(),
                    Err(x) => reply.error(e(x)),
                }
            }
            _ => reply.error(libc::ENOSYS),
        }
    }
}

#[allow(dead_code)]
const _ROOT: u64 = ROOT;
