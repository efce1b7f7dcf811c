//! The requests on a file's attributes, contents and xattrs, and on the
//! whole filesystem (STATFS, SYNCFS).

use super::serve::{answer, reopen_dir, xattr_answer};
use super::{e, Handle, OverlayFs};
use crate::lower::FOREVER;
use rustix::fs::SeekFrom;
use rustix::io::Errno;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use tilefs_fuse_proto::abi::{self, fattr};
use tilefs_fuse_proto::Reply;

impl OverlayFs {
    /// Attributes through the open upper file `fh`, if the kernel names
    /// one, else from the node.
    pub(super) fn op_getattr(&self, id: u64, fh: Option<u64>, reply: Reply<'_>) {
        let by_fd = fh.and_then(|fh| self.handle_of(fh)).and_then(|h| match &*h {
            Handle::Upper(f) => Some(self.attr_by_fd(id, f)),
            _ => None,
        });
        match by_fd.unwrap_or_else(|| self.attr(id)) {
            Ok(a) => reply.attr(FOREVER, &a),
            Err(x) => reply.error(x),
        }
    }

    pub(super) fn op_setattr(&self, id: u64, mut a: abi::SetattrIn, reply: Reply<'_>) {
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

    pub(super) fn op_readlink(&self, id: u64, reply: Reply<'_>) {
        match self.readlink(id) {
            Ok(t) => reply.data(&t),
            Err(x) => reply.error(x),
        }
    }

    pub(super) fn op_open(&self, id: u64, flags: u32, open_flags: u32, reply: Reply<'_>) {
        if self.no_open.load(Ordering::Relaxed) {
            // The kernel stops asking (see `init`).
            return reply.error(libc::ENOSYS);
        }
        let opened = self
            .open_node(id, flags, self.writeback.load(Ordering::Relaxed))
            .and_then(|h| {
                if open_flags & abi::OPEN_KILL_SUIDGID != 0 {
                    self.kill_suidgid(id)?;
                }
                Ok(h)
            });
        match opened {
            Ok(h) => reply.open(self.opened(id, h)),
            Err(x) => reply.error(x),
        }
    }

    /// Reads from the upper file, the image's object (checked again if it
    /// is verified) or the image's inline data.
    pub(super) fn op_read(&self, id: u64, a: abi::ReadIn, reply: Reply<'_>) {
        let h = match self.io_handle(id, a.fh, false) {
            Ok(h) => h,
            Err(x) => return reply.error(x),
        };
        match &*h {
            Handle::Upper(f) => {
                if let Err(x) = reply.file(f.as_fd(), a.offset, a.size as usize) {
                    tracing::warn!("reading an upper file failed: {x}");
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

    /// Writes what it can: a failure after some bytes are written answers
    /// with those (as write(2) does).
    pub(super) fn op_write(&self, id: u64, arg: abi::WriteIn, data: &[u8], reply: Reply<'_>) {
        let h = match self.io_handle(id, arg.fh, true) {
            Ok(h) => h,
            Err(x) => return reply.error(x),
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

    /// RELEASE and RELEASEDIR.
    pub(super) fn op_release(&self, fh: u64, reply: Reply<'_>) {
        self.io.release(fh);
        self.handles.lock().unwrap_or_else(|e| e.into_inner()).remove(&fh);
        reply.ok()
    }

    /// Only upper files have anything to sync.
    pub(super) fn op_fsync(&self, id: u64, fh: u64, datasync: bool, reply: Reply<'_>) {
        match self.io_handle(id, fh, false).as_deref() {
            Ok(Handle::Upper(f)) => {
                tilefs_fuse_proto::may_block();
                let r = if datasync {
                    rustix::fs::fdatasync(f)
                } else {
                    rustix::fs::fsync(f)
                };
                answer(r.map_err(e), reply)
            }
            Ok(_) => reply.ok(),
            Err(x) => reply.error(*x),
        }
    }

    pub(super) fn op_fallocate(&self, id: u64, a: abi::FallocateIn, reply: Reply<'_>) {
        match self.io_handle(id, a.fh, true).as_deref() {
            Ok(Handle::Upper(f)) => {
                tilefs_fuse_proto::may_block();
                let mode = rustix::fs::FallocateFlags::from_bits_retain(a.mode);
                answer(rustix::fs::fallocate(f, mode, a.offset, a.length).map_err(e), reply)
            }
            Ok(_) => reply.error(libc::EBADF),
            Err(x) => reply.error(*x),
        }
    }

    /// SEEK_DATA and SEEK_HOLE (the kernel does the others itself); inline
    /// data is one extent of data.
    pub(super) fn op_lseek(&self, id: u64, a: abi::LseekIn, reply: Reply<'_>) {
        let whence = match a.whence as i32 {
            libc::SEEK_DATA => SeekFrom::Data(a.offset),
            libc::SEEK_HOLE => SeekFrom::Hole(a.offset),
            _ => return reply.error(libc::EINVAL),
        };
        let r = match self.io_handle(id, a.fh, false).as_deref() {
            Ok(Handle::Upper(f)) => rustix::fs::seek(f, whence).map_err(e),
            Ok(Handle::Lower(o, _)) => rustix::fs::seek(&o.file, whence).map_err(e),
            Ok(Handle::Inline(l)) => {
                let size = self.lower.node(*l).size;
                match whence {
                    _ if a.offset >= size => Err(libc::ENXIO),
                    SeekFrom::Data(o) => Ok(o),
                    _ => Ok(size),
                }
            }
            Ok(Handle::Dir(_)) => Err(libc::EBADF),
            Err(x) => Err(*x),
        };
        match r {
            Ok(o) => reply.lseek(o),
            Err(x) => reply.error(x),
        }
    }

    /// POSIX ACL names are refused when the image has no ACLs (see
    /// [`Self::acl_name`]).
    pub(super) fn op_getxattr(&self, id: u64, uid: u32, name: &[u8], size: u32, reply: Reply<'_>) {
        if self.acl_name(name) {
            return reply.error(libc::EOPNOTSUPP);
        }
        xattr_answer(self.getxattr(id, uid, name), size, reply)
    }

    pub(super) fn op_setxattr(&self, id: u64, name: &[u8], value: &[u8], flags: u32, reply: Reply<'_>) {
        if self.acl_name(name) {
            return reply.error(libc::EOPNOTSUPP);
        }
        answer(self.setxattr(id, name, value, flags), reply)
    }

    pub(super) fn op_statfs(&self, reply: Reply<'_>) {
        match self.statfs() {
            Ok(s) => reply.statfs(&s),
            Err(x) => reply.error(x),
        }
    }

    /// Syncs the filesystem of the upper directory.
    pub(super) fn op_syncfs(&self, reply: Reply<'_>) {
        tilefs_fuse_proto::may_block();
        answer(
            reopen_dir(&self.up.root)
                .and_then(|f| rustix::fs::syncfs(&f))
                .map_err(e),
            reply,
        )
    }
}
