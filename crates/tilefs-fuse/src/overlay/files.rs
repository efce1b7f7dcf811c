//! Contents and metadata: merged listings, opening, reading and writing,
//! attributes, symlinks and xattrs.

use super::upper::{
    proc_path, Meta, Override, Target, XPath, KEPT_PREFIX, OVERRIDE, S_IFDIR, S_IFLNK, S_IFMT, S_IFREG,
};
use super::{e, Handle, Listed, Loc, NodeId, OverlayFs, R, UPPER_INO};
use crate::lower::{dirent_type, Lower};
use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;
use std::collections::HashSet;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use tilefs_fuse_proto::abi::{self, fattr};
use tilefs_image::tree::InodeId;

impl OverlayFs {
    /// The merged entries of a directory with upper directory `dir` (if
    /// any) and image directory `lower` (if any, and not hidden).
    pub(crate) fn merged_listing(&self, dir: Option<BorrowedFd<'_>>, lower: Option<InodeId>) -> R<Vec<Listed>> {
        let mut out = Vec::new();
        let mut seen: HashSet<Box<[u8]>> = HashSet::new();
        if let Some(d) = dir {
            let fd = rustix::fs::openat(
                d,
                ".",
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(e)?;
            let mut it = rustix::fs::Dir::read_from(&fd).map_err(e)?;
            while let Some(ent) = it.read() {
                let ent = ent.map_err(e)?;
                let name = ent.file_name().to_bytes();
                if name == b"." || name == b".." {
                    continue;
                }
                seen.insert(name.into());
                let m = match self.up.meta_at(d, name) {
                    Ok(m) => m,
                    Err(Errno::NOENT) => continue,
                    Err(x) => return Err(e(x)),
                };
                if m.is_whiteout() {
                    continue;
                }
                let ino = if m.is_dir() {
                    // A merged directory shows its image directory's number.
                    let path = XPath::at(d, name);
                    let below = match (self.up.is_opaque(&path), lower) {
                        (true, _) | (_, None) => None,
                        (false, Some(l)) => match self.up.redirect(&path) {
                            Some(r) if r.starts_with(b"/") => self.lower_dir_at(&r),
                            Some(r) => self.lower.node(l).entry(&r).map(|e| e.inode),
                            None => self.lower.node(l).entry(name).map(|e| e.inode),
                        }
                        .filter(|&c| self.lower.node(c).is_dir()),
                    };
                    below.map_or_else(|| self.upper_ino(&m), |b| u64::from(b) + 1)
                } else {
                    self.upper_ino(&m)
                };
                out.push(Listed {
                    name: name.into(),
                    ino,
                    typ: dirent_type(m.mode),
                });
            }
        }
        if let Some(l) = lower {
            for ent in self.lower.node(l).entries() {
                if seen.contains(ent.name) {
                    continue;
                }
                let i = &self.lower.node(ent.inode);
                out.push(Listed {
                    name: ent.name.into(),
                    ino: u64::from(ent.inode) + 1,
                    typ: dirent_type(Lower::shown_mode(i)),
                });
            }
        }
        Ok(out)
    }

    /// The merged listing of directory node `id`.
    pub(crate) fn listing(&self, id: NodeId) -> R<Vec<Listed>> {
        let (fd, lower) = {
            let nodes = self.nodes();
            let n = nodes.get(id).ok_or(libc::ENOENT)?;
            if !n.is_dir() {
                return Err(libc::ENOTDIR);
            }
            (n.dir_fd.clone(), if n.opaque { None } else { n.lower })
        };
        self.merged_listing(fd.as_ref().map(|f| f.as_fd()), lower)
    }

    /// Opens node `id` with open(2) `flags`; `shared`: the kernel may write
    /// through the handle whatever it was opened for (writeback caching,
    /// or I/O that names the node alone).
    pub(crate) fn open_node(&self, id: NodeId, flags: u32, shared: bool) -> R<Handle> {
        let (dir, upper, lower) = {
            let nodes = self.nodes();
            let n = nodes.get(id).ok_or(libc::ENOENT)?;
            (n.is_dir(), n.upper, n.lower)
        };
        if dir {
            return Err(libc::EISDIR);
        }
        let flags = flags as i32;
        let acc = flags & libc::O_ACCMODE;
        let trunc = flags & libc::O_TRUNC != 0;
        let write = acc != libc::O_RDONLY || trunc;
        if !upper && !write {
            let l = lower.ok_or(libc::ESTALE)?;
            let inode = &self.lower.node(l);
            if !inode.is_external() {
                return Ok(Handle::Inline(l));
            }
            return match self.lower.object(inode) {
                Ok(o) => Ok(Handle::Lower(o, l)),
                Err(x) => {
                    self.lower.report(l, &x.to_string());
                    Err(libc::EIO)
                }
            };
        }
        if write {
            let _changing = self.changing.lock().unwrap_or_else(|e| e.into_inner());
            self.copy_up(id, trunc.then_some(0))?;
        }
        // The kernel writes pages with its own offsets, and may read a
        // page it is filling: read and write, never append.
        let mut of = if write || shared { OFlags::RDWR } else { OFlags::RDONLY };
        if trunc {
            of |= OFlags::TRUNC;
        }
        if flags & libc::O_DIRECT != 0 && !shared {
            of |= OFlags::DIRECT;
        }
        let fd = match self.loc(id)? {
            Loc::At(d, n) => self.up.open_file_at(d.as_fd(), &n, of).map_err(e)?,
            Loc::Orphan(f) => rustix::fs::open(
                proc_path(f.as_fd(), None).as_c_str(),
                of | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(e)?,
        };
        Ok(Handle::Upper(Arc::new(fd)))
    }

    /// Attributes of node `id` through an open upper file `fd`.
    pub(crate) fn attr_by_fd(&self, id: NodeId, fd: &OwnedFd) -> R<abi::Attr> {
        let st = rustix::fs::fstat(fd).map_err(e)?;
        let mut m = Meta::from_stat(&st);
        if !self.up.powers.privileged {
            if let Ok(Some(v)) = XPath::of(fd.as_fd()).get(OVERRIDE) {
                if let Some(o) = Override::parse(&v) {
                    m = m.with(&o);
                }
            }
        }
        let ino = self.nodes().get(id).map_or(UPPER_INO | m.ino, |n| n.ino);
        Ok(self.attr_of_meta(&m, ino, false))
    }

    /// Clears setuid, and setgid where group execute is set, as the kernel
    /// does on write, truncate and chown of a non-directory (we handle
    /// that: FUSE_HANDLE_KILLPRIV_V2).
    pub(crate) fn kill_suidgid(&self, id: NodeId) -> R<()> {
        let a = abi::SetattrIn {
            valid: fattr::KILL_SUIDGID,
            ..abi::SetattrIn::default()
        };
        self.setattr(id, &a, None).map(|_| ())
    }

    /// Changes attributes (SETATTR); `fd`: the open upper file it names.
    pub(crate) fn setattr(&self, id: NodeId, a: &abi::SetattrIn, fd: Option<&OwnedFd>) -> R<abi::Attr> {
        let _changing = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        let v = a.valid;
        let size = (v & fattr::SIZE != 0).then_some(a.size);
        self.copy_up(id, size)?;
        let loc = self.loc(id)?;
        fn target(l: &Loc) -> Target<'_> {
            match l {
                Loc::At(d, n) => Target::At(d.as_fd(), n),
                Loc::Orphan(f) => Target::Fd(f.as_fd()),
            }
        }
        if let Some(size) = size {
            match fd {
                Some(f) => rustix::fs::ftruncate(f, size).map_err(e)?,
                None => {
                    let f = match &loc {
                        Loc::At(d, n) => self.up.open_file_at(d.as_fd(), n, OFlags::WRONLY).map_err(e)?,
                        Loc::Orphan(f) => rustix::fs::open(
                            proc_path(f.as_fd(), None).as_c_str(),
                            OFlags::WRONLY | OFlags::CLOEXEC,
                            Mode::empty(),
                        )
                        .map_err(e)?,
                    };
                    rustix::fs::ftruncate(&f, size).map_err(e)?;
                }
            }
        }
        if v & (fattr::MODE | fattr::UID | fattr::GID | fattr::KILL_SUIDGID) != 0 {
            let m = self.upper_meta(id)?;
            let uid = if v & fattr::UID != 0 {
                self.up.uids.store(a.uid).ok_or(libc::EINVAL)?
            } else {
                m.uid
            };
            let gid = if v & fattr::GID != 0 {
                self.up.gids.store(a.gid).ok_or(libc::EINVAL)?
            } else {
                m.gid
            };
            let mut mode = if v & fattr::MODE != 0 {
                (m.mode & S_IFMT) | (a.mode & 0o7777)
            } else {
                m.mode
            };
            if v & fattr::KILL_SUIDGID != 0 && mode & S_IFMT != S_IFDIR {
                // Setuid always; setgid only with group execute (without
                // it, the bit means mandatory locking, not privilege).
                mode &= !0o4000;
                if mode & 0o2010 == 0o2010 {
                    mode &= !0o2000;
                }
            }
            let stand_in = (m.disk_mode & S_IFMT == S_IFREG && m.mode & S_IFMT != S_IFREG).then_some(m.rdev);
            let chown = v & (fattr::UID | fattr::GID) != 0;
            if self.up.powers.privileged && stand_in.is_none() {
                // Only the calls asked for (each updates ctime): chown, then
                // chmod if the mode changes or chown cleared setuid/setgid.
                let t = target(&loc);
                if chown {
                    t.chown(uid, gid).map_err(e)?;
                }
                let set_mode = v & fattr::MODE != 0 || mode != m.mode || (chown && mode & 0o6000 != 0);
                if set_mode && mode & S_IFMT != S_IFLNK {
                    t.chmod(mode & 0o7777).map_err(e)?;
                }
            } else if chown || v & fattr::MODE != 0 || mode != m.mode {
                // (A kill that finds nothing to clear changes nothing.)
                match self.up.set_owner_mode(target(&loc), uid, gid, mode, stand_in, false) {
                    Err(Errno::PERM) if !self.up.powers.privileged && stand_in.is_none() => {
                        // A symlink or special file given to someone else:
                        // it becomes a stand-in that can record its owner.
                        self.make_stand_in(&loc, &m, uid, gid, mode)?;
                    }
                    r => r.map_err(e)?,
                }
            }
        }
        if v & (fattr::ATIME | fattr::MTIME | fattr::ATIME_NOW | fattr::MTIME_NOW) != 0 {
            let pick = |set: u32, now: u32, sec: u64, nsec: u32| {
                if v & now != 0 {
                    rustix::fs::Timespec {
                        tv_sec: 0,
                        tv_nsec: libc::UTIME_NOW,
                    }
                } else if v & set != 0 {
                    rustix::fs::Timespec {
                        tv_sec: sec as i64,
                        tv_nsec: i64::from(nsec),
                    }
                } else {
                    rustix::fs::Timespec {
                        tv_sec: 0,
                        tv_nsec: libc::UTIME_OMIT,
                    }
                }
            };
            let at = pick(fattr::ATIME, fattr::ATIME_NOW, a.atime, a.atimensec);
            let mt = pick(fattr::MTIME, fattr::MTIME_NOW, a.mtime, a.mtimensec);
            match fd {
                Some(f) => Target::Fd(f.as_fd()).set_times(at, mt),
                None => target(&loc).set_times(at, mt),
            }
            .map_err(e)?;
        }
        match fd {
            Some(f) => self.attr_by_fd(id, f),
            None => self.attr(id),
        }
    }

    /// Replaces the symlink or special file at `loc` with a stand-in
    /// regular file recording `uid:gid:mode` and its type.
    fn make_stand_in(&self, loc: &Loc, m: &Meta, uid: u32, gid: u32, mode: u32) -> R<()> {
        let Loc::At(d, n) = loc else { return Err(libc::EPERM) };
        let target = if m.mode & S_IFMT == S_IFLNK {
            rustix::fs::readlinkat(d.as_fd(), &**n, Vec::new())
                .map_err(e)?
                .into_bytes()
        } else {
            Vec::new()
        };
        let work = self.up.work.as_fd();
        let tmp = self.up.tmp_name();
        let made = (|| -> Result<(), Errno> {
            let f = rustix::fs::openat(
                work,
                tmp.as_c_str(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )?;
            let mut done = 0;
            while done < target.len() {
                done += rustix::io::write(&f, &target[done..])?;
            }
            self.up
                .set_owner_mode(Target::At(work, tmp.as_bytes()), uid, gid, mode, Some(m.rdev), false)?;
            let t = |x: (i64, u32)| rustix::fs::Timespec {
                tv_sec: x.0,
                tv_nsec: i64::from(x.1),
            };
            Target::At(work, tmp.as_bytes()).set_times(t(m.atime), t(m.mtime))?;
            rustix::fs::renameat(work, tmp.as_c_str(), d.as_fd(), &**n)
        })();
        if let Err(x) = made {
            let _ = rustix::fs::unlinkat(work, tmp.as_c_str(), AtFlags::empty());
            return Err(e(x));
        }
        Ok(())
    }

    pub(crate) fn readlink(&self, id: NodeId) -> R<Vec<u8>> {
        let (upper, lower) = {
            let nodes = self.nodes();
            let n = nodes.get(id).ok_or(libc::ENOENT)?;
            if n.kind != S_IFLNK {
                return Err(libc::EINVAL);
            }
            (n.upper, n.lower)
        };
        if !upper {
            let l = lower.ok_or(libc::ESTALE)?;
            return Ok(self.lower.node(l).payload.unwrap_or_default().to_vec());
        }
        let Loc::At(d, n) = self.loc(id)? else {
            return Err(libc::EINVAL);
        };
        match rustix::fs::readlinkat(d.as_fd(), &*n, Vec::new()) {
            Ok(t) => Ok(t.into_bytes()),
            // A stand-in holds its target.
            Err(Errno::INVAL) => self.up.stand_in_target(d.as_fd(), &n).map_err(e),
            Err(x) => Err(e(x)),
        }
    }

    // ---- xattrs -------------------------------------------------------------

    /// The name an xattr is stored under in the upper directory.
    fn stored_xattr(&self, name: &[u8]) -> Vec<u8> {
        let p = self.up.ns.prefix();
        if name.starts_with(p) {
            // overlayfs's escape for its own namespace.
            let mut k = p.to_vec();
            k.extend_from_slice(b"overlay.");
            k.extend_from_slice(&name[p.len()..]);
            return k;
        }
        name.to_vec()
    }

    /// The name an upper xattr shows as, or None if it is ours.
    fn shown_xattr(&self, stored: &[u8]) -> Option<Vec<u8>> {
        let p = self.up.ns.prefix();
        if let Some(rest) = stored.strip_prefix(p) {
            let inner = rest.strip_prefix(b"overlay.")?;
            let mut k = p.to_vec();
            k.extend_from_slice(inner);
            return Some(k);
        }
        if stored == OVERRIDE && !self.up.powers.privileged {
            return None;
        }
        if let Some(kept) = stored.strip_prefix(KEPT_PREFIX) {
            return (!self.up.powers.privileged).then(|| kept.to_vec());
        }
        Some(stored.to_vec())
    }

    fn upper_xattr_path(&self, id: NodeId) -> R<XPath> {
        Ok(self.loc(id)?.xpath())
    }

    pub(crate) fn getxattr(&self, id: NodeId, uid: u32, name: &[u8]) -> R<Vec<u8>> {
        let (upper, lower) = {
            let nodes = self.nodes();
            let n = nodes.get(id).ok_or(libc::ENOENT)?;
            (n.upper, n.lower)
        };
        if !self.lower.visible(uid, name) {
            return Err(libc::ENODATA);
        }
        if !upper {
            let l = lower.ok_or(libc::ESTALE)?;
            if self.lower.unsupported(name) {
                return Err(libc::EOPNOTSUPP);
            }
            return self
                .lower
                .xattrs(l)
                .into_iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_vec())
                .ok_or(libc::ENODATA);
        }
        if name == OVERRIDE && !self.up.powers.privileged {
            return Err(libc::ENODATA);
        }
        let path = self.upper_xattr_path(id)?;
        let stored = self.stored_xattr(name);
        if let Some(v) = path.get(&stored).map_err(e)? {
            return Ok(v);
        }
        if !self.up.powers.privileged && !name.starts_with(b"user.") {
            let mut kept = KEPT_PREFIX.to_vec();
            kept.extend_from_slice(name);
            if let Some(v) = path.get(&kept).map_err(e)? {
                return Ok(v);
            }
        }
        Err(libc::ENODATA)
    }

    pub(crate) fn listxattr(&self, id: NodeId, uid: u32) -> R<Vec<u8>> {
        let (upper, lower) = {
            let nodes = self.nodes();
            let n = nodes.get(id).ok_or(libc::ENOENT)?;
            (n.upper, n.lower)
        };
        let mut names = Vec::new();
        if !upper {
            let l = lower.ok_or(libc::ESTALE)?;
            for (k, _) in self.lower.xattrs(l) {
                if self.lower.visible(uid, k) {
                    names.extend_from_slice(k);
                    names.push(0);
                }
            }
            return Ok(names);
        }
        for k in self.upper_xattr_path(id)?.list().map_err(e)? {
            if let Some(shown) = self.shown_xattr(&k) {
                if self.lower.visible(uid, &shown) {
                    names.extend_from_slice(&shown);
                    names.push(0);
                }
            }
        }
        Ok(names)
    }

    pub(crate) fn setxattr(&self, id: NodeId, name: &[u8], value: &[u8], flags: u32) -> R<()> {
        if name == OVERRIDE && !self.up.powers.privileged {
            return Err(libc::EPERM);
        }
        let _changing = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        self.copy_up(id, None)?;
        let path = self.upper_xattr_path(id)?;
        let flags = rustix::fs::XattrFlags::from_bits_retain(flags);
        self.set_xattr_raw(&path, &self.stored_xattr(name), value, flags)
            .map_err(e)
    }

    pub(crate) fn removexattr(&self, id: NodeId, name: &[u8]) -> R<()> {
        if name == OVERRIDE && !self.up.powers.privileged {
            return Err(libc::ENODATA);
        }
        let _changing = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        self.copy_up(id, None)?;
        let path = self.upper_xattr_path(id)?;
        match path.remove(&self.stored_xattr(name)) {
            Err(Errno::NODATA) if !self.up.powers.privileged && !name.starts_with(b"user.") => {
                let mut kept = KEPT_PREFIX.to_vec();
                kept.extend_from_slice(name);
                path.remove(&kept).map_err(e)
            }
            r => r.map_err(e),
        }
    }

    /// statfs of the upper directory's filesystem.
    pub(crate) fn statfs(&self) -> R<abi::Kstatfs> {
        let s = rustix::fs::fstatfs(&self.up.root).map_err(e)?;
        Ok(abi::Kstatfs {
            blocks: s.f_blocks,
            bfree: s.f_bfree,
            bavail: s.f_bavail,
            files: s.f_files,
            ffree: s.f_ffree,
            bsize: s.f_bsize as u32,
            namelen: s.f_namelen as u32,
            frsize: s.f_frsize as u32,
            ..Default::default()
        })
    }
}
