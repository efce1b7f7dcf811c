//! The filesystem: answers FUSE requests from the image's tree, reads file
//! contents from verified objects in the store.
//!
//! Nothing changes while mounted, so every answer is given with a long
//! validity and the kernel is asked to cache everything it can (see
//! `Tuning`). Node ids are the tree's inode ids plus one (the tree's root,
//! id 0, is FUSE's root, 1); they are also the inode numbers shown, so
//! hardlinks share one and numbers never collide.

use crate::log::Logger;
use crate::objects::{open_object, FileState, ObjectError, VerifiedObjects};
use crate::splice::{Spliced, Splicer};
use crate::{Tuning, Verity};
use fuser::{
    AccessFlags, BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyXattr, Request,
};
use rustc_hash::{FxHashMap, FxHashSet};
use std::cell::RefCell;
use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tilefs_image::erofs::ImageInfo;
use tilefs_image::tree::{Inode, InodeId, Tree, S_IFCHR, S_IFDIR, S_IFMT, S_IFREG};

/// Validity of every entry and attribute: ten years, far beyond any mount,
/// small enough for the kernel's conversion to jiffies.
const FOREVER: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Object files kept open for reads that name only the inode (fewer if
/// the limit on open files is low).
const UNOPENED_MAX: usize = 1024;

// Markers the kernel's overlay mount shows on whiteouts from the source
// (stored as marked empty regular files) and on their directories.
const WHITEOUT_XATTRS: [&[u8]; 2] = [b"trusted.overlay.whiteout", b"user.overlay.whiteout"];
const WHITEOUTS_XATTRS: [&[u8]; 2] = [b"trusted.overlay.whiteouts", b"user.overlay.whiteouts"];
const OPAQUE_XATTRS: [&[u8]; 2] = [b"trusted.overlay.opaque", b"user.overlay.opaque"];
const SELINUX: &[u8] = b"security.selinux";
const ACL_XATTRS: [&[u8]; 2] = [b"system.posix_acl_access", b"system.posix_acl_default"];

/// An open file.
enum Handle {
    /// Served by us from an object.
    Object(Object),
    /// Served by the kernel from the object (FUSE passthrough).
    Passthrough(InodeId),
}

/// An object file opened (and checked, unless verity is off) for serving.
struct Object {
    file: File,
    /// What its data is checked against; None when nothing is checked.
    digest: Option<[u8; 32]>,
    /// The file's state when it was checked.
    key: FileState,
}

pub(crate) struct TileFs {
    tree: Tree,
    info: ImageInfo,
    /// Parent of each directory (the root is its own).
    parent: Vec<InodeId>,
    /// Directories holding a whiteout (as a primary entry).
    marked: FxHashSet<InodeId>,
    /// Some inode has a security.selinux label.
    has_selinux: bool,
    store: OwnedFd,
    verity: Verity,
    tune: Tuning,
    verified: VerifiedObjects,
    handles: Mutex<FxHashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    /// Objects of files opened without asking us, by inode.
    unopened: Mutex<FxHashMap<InodeId, Arc<Object>>>,
    unopened_max: usize,
    /// Backing files registered with the kernel for passthrough: one per
    /// inode while it is open, with the number of opens.
    backing: Mutex<FxHashMap<InodeId, (BackingId, u32)>>,
    passthrough: AtomicBool,
    /// Objects already reported broken (by inode), so a file opened over
    /// and over logs once per state of its object.
    reported: Mutex<FxHashMap<InodeId, String>>,
    log: Arc<Logger>,
    /// Read replies spliced from the objects: set by the serving process
    /// when splicing is on (`Tuning::splice`), left empty otherwise.
    pub(crate) splicer: Arc<OnceLock<Splicer>>,
    /// The kernel refused a spliced reply: copy them from then on.
    splice_failed: AtomicBool,
    /// Where absent objects come from (a lazily pulled image).
    pub(crate) fetcher: Option<crate::Fetcher>,
}

thread_local! {
    static READ_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

fn system_time(sec: i64, nsec: u32) -> SystemTime {
    let nsec = nsec.min(999_999_999);
    if sec >= 0 {
        UNIX_EPOCH + Duration::new(sec as u64, nsec)
    } else {
        UNIX_EPOCH - Duration::from_secs(sec.unsigned_abs()) + Duration::from_nanos(u64::from(nsec))
    }
}

fn file_type(mode: u32) -> FileType {
    match mode & S_IFMT {
        S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFBLK => FileType::BlockDevice,
        S_IFCHR => FileType::CharDevice,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        _ => FileType::RegularFile,
    }
}

impl TileFs {
    pub(crate) fn new(
        tree: Tree,
        info: ImageInfo,
        store: OwnedFd,
        verity: Verity,
        tune: Tuning,
        log: Arc<Logger>,
        fd_budget: u64,
    ) -> TileFs {
        let mut parent = vec![0 as InodeId; tree.inodes.len()];
        let mut marked = FxHashSet::default();
        for (id, inode) in tree.inodes.iter().enumerate() {
            for e in inode.entries.iter().filter(|e| !e.hardlink) {
                let child = &tree.inodes[e.inode as usize];
                if child.is_dir() {
                    parent[e.inode as usize] = id as InodeId;
                } else if child.is_whiteout() {
                    marked.insert(id as InodeId);
                }
            }
        }
        let has_selinux = tree.inodes.iter().any(|i| i.xattr(SELINUX).is_some());
        TileFs {
            tree,
            info,
            parent,
            marked,
            has_selinux,
            store,
            verity,
            tune,
            verified: VerifiedObjects::default(),
            handles: Mutex::new(FxHashMap::default()),
            next_fh: AtomicU64::new(1),
            unopened: Mutex::new(FxHashMap::default()),
            unopened_max: UNOPENED_MAX.min(fd_budget.try_into().unwrap_or(usize::MAX)).max(1),
            backing: Mutex::new(FxHashMap::default()),
            passthrough: AtomicBool::new(false),
            reported: Mutex::new(FxHashMap::default()),
            log,
            splicer: Arc::default(),
            splice_failed: AtomicBool::new(false),
            fetcher: None,
        }
    }

    fn id(&self, ino: INodeNo) -> Option<InodeId> {
        let id = ino.0.checked_sub(1)?;
        (id < self.tree.inodes.len() as u64).then_some(id as InodeId)
    }

    fn inode(&self, ino: INodeNo) -> Result<(InodeId, &Inode), Errno> {
        let id = self.id(ino).ok_or(Errno::ENOENT)?;
        Ok((id, &self.tree.inodes[id as usize]))
    }

    /// The mode shown: a whiteout from the source shows as the marked empty
    /// regular file the image holds, as the kernel's overlay mount shows it.
    fn shown_mode(inode: &Inode) -> u32 {
        if inode.is_whiteout() {
            S_IFREG | (inode.mode & !S_IFMT)
        } else {
            inode.mode
        }
    }

    fn attr(&self, id: InodeId) -> FileAttr {
        let i = &self.tree.inodes[id as usize];
        let mode = Self::shown_mode(i);
        let size = if i.is_whiteout() { 0 } else { i.size };
        let t = system_time(i.mtime.sec, i.mtime.nsec);
        FileAttr {
            ino: INodeNo(u64::from(id) + 1),
            size,
            blocks: size.div_ceil(4096) * 8,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            kind: file_type(mode),
            perm: (mode & 0o7777) as u16,
            nlink: i.nlink,
            uid: i.uid,
            gid: i.gid,
            rdev: if i.is_whiteout() { 0 } else { i.rdev },
            blksize: 4096,
            flags: 0,
        }
    }

    /// The xattrs shown for an inode, sorted by name: the image's, plus the
    /// overlay markers of whiteouts and of the directories holding them.
    fn xattrs(&self, id: InodeId) -> Vec<(&[u8], &[u8])> {
        let inode = &self.tree.inodes[id as usize];
        let mut v: Vec<(&[u8], &[u8])> = inode.xattrs.iter().map(|x| (&x.key[..], &x.value[..])).collect();
        let mut extra: Vec<(&[u8], &[u8])> = Vec::new();
        if inode.is_whiteout() {
            extra.extend(WHITEOUT_XATTRS.iter().map(|k| (*k, &b""[..])));
        }
        if self.marked.contains(&id) {
            extra.extend(WHITEOUTS_XATTRS.iter().map(|k| (*k, &b""[..])));
            if self.info.version >= 1 {
                extra.extend(OPAQUE_XATTRS.iter().map(|k| (*k, &b"x"[..])));
            }
        }
        if !extra.is_empty() {
            v.retain(|(k, _)| !extra.iter().any(|(e, _)| e == k));
            v.extend(extra);
            v.sort_unstable_by(|a, b| a.0.cmp(b.0));
        }
        v
    }

    /// trusted.* xattrs are for privileged callers only, as the kernel
    /// checks CAP_SYS_ADMIN; uid 0 stands in for that capability here.
    /// POSIX ACLs exist only in images flagged as having them: the kernel
    /// mounts the others with `noacl`.
    fn visible(&self, req: &Request, key: &[u8]) -> bool {
        (!key.starts_with(b"trusted.") || req.uid() == 0) && (self.info.has_acl || !ACL_XATTRS.contains(&key))
    }

    /// Names answered with EOPNOTSUPP rather than ENODATA: ACLs when the
    /// image has none (as the kernel's `noacl` mount answers), and SELinux
    /// labels when no file has one (so `ls -l` stops asking, as it does on
    /// filesystems without labels, instead of making a round trip per file).
    fn unsupported(&self, key: &[u8]) -> bool {
        (!self.info.has_acl && ACL_XATTRS.contains(&key))
            || (self.tune.selinux_enotsup && !self.has_selinux && key == SELINUX)
    }

    /// Logs a broken object once for each way it is broken.
    fn report(&self, id: InodeId, what: &str) {
        let mut r = self.reported.lock().unwrap();
        if r.get(&id).map(String::as_str) != Some(what) {
            r.insert(id, what.to_string());
            drop(r);
            self.log.log(&format!("{}: {what}", self.path_of(id)));
        }
    }

    /// A path of `id` for messages (its primary entry).
    fn path_of(&self, id: InodeId) -> String {
        let mut found = None;
        self.tree.walk(|path, e, ino| {
            if found.is_none() && ino == id && !e.is_some_and(|e| e.hardlink) {
                found = Some(String::from_utf8_lossy(path).into_owned());
            }
        });
        found.unwrap_or_else(|| format!("inode {}", u64::from(id) + 1))
    }

    /// Opens and checks the object of a regular file.
    fn open_checked(&self, inode: &Inode) -> Result<(File, Option<FileState>), ObjectError> {
        let payload = inode.payload.as_deref().ok_or(ObjectError::BadPath)?;
        if self.verity == Verity::Require && inode.digest.is_none() {
            return Err(ObjectError::NoDigest);
        }
        let file = match open_object(&self.store, payload) {
            // Not fetched yet (a lazily pulled image): fetched, checked
            // against its name and stored whole, then opened as any other.
            Err(ObjectError::Open(e)) if e.kind() == std::io::ErrorKind::NotFound && self.fetcher.is_some() => {
                let digest = inode
                    .digest
                    .or_else(|| tilefs_store::parse_object_rel(payload))
                    .ok_or(ObjectError::Open(e))?;
                let fetcher = self.fetcher.as_ref().expect("checked above");
                fetcher.0.fetch(&digest, inode.size).map_err(ObjectError::Fetch)?;
                open_object(&self.store, payload)?
            }
            r => r?,
        };
        match (self.verity, &inode.digest) {
            (Verity::Off, _) | (_, None) => Ok((file, None)),
            (_, Some(d)) => {
                let key = self.verified.check(&file, d)?;
                Ok((file, Some(key)))
            }
        }
    }

    fn add_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().unwrap().insert(fh, Arc::new(h));
        fh
    }

    /// The object of a regular file, opened and checked.
    fn object(&self, inode: &Inode) -> Result<Object, ObjectError> {
        let (file, key) = self.open_checked(inode)?;
        let digest = if self.verity == Verity::Off { None } else { inode.digest };
        Ok(Object {
            file,
            digest,
            key: key.unwrap_or_default(),
        })
    }

    /// The object of a file the kernel opened without asking us: kept open
    /// by inode (no release ever comes), at most `unopened_max` at a time.
    /// A kept object whose file changed since it was checked is opened
    /// again from the store, so a replaced or removed object is seen as an
    /// open would see it.
    fn unopened_object(&self, id: InodeId, inode: &Inode) -> Result<Arc<Object>, ObjectError> {
        let kept = self.unopened.lock().unwrap().get(&id).cloned();
        if let Some(o) = kept {
            if o.digest.is_none() || FileState::of_fd(&o.file).is_ok_and(|s| s == o.key) {
                return Ok(o);
            }
        }
        // Replaces a changed object under the same key.
        let h = Arc::new(self.object(inode)?);
        let mut map = self.unopened.lock().unwrap();
        if map.len() >= self.unopened_max && !map.contains_key(&id) {
            // Any one goes: reopening costs an open and a stat (the check
            // itself is remembered by the object's state).
            if let Some(&old) = map.keys().next() {
                map.remove(&old);
            }
        }
        map.insert(id, h.clone());
        Ok(h)
    }

    fn open_flags(&self) -> FopenFlags {
        let mut f = FopenFlags::empty();
        if self.tune.keep_cache {
            f |= FopenFlags::FOPEN_KEEP_CACHE;
        }
        if self.tune.no_flush {
            f |= FopenFlags::FOPEN_NOFLUSH;
        }
        f
    }

    /// Serves `size` bytes at `offset` of an object already known to be
    /// in a verified state (so as long as the file), as the reply to
    /// request `unique`.
    fn read_object(&self, id: InodeId, file: &File, offset: u64, size: u32, unique: u64, reply: ReplyData) {
        let file_size = self.tree.inodes[id as usize].size;
        let len = file_size.saturating_sub(offset).min(u64::from(size)) as usize;
        if len > 0 && !self.splice_failed.load(Ordering::Relaxed) {
            if let Some(splicer) = self.splicer.get() {
                match splicer.reply(unique, file, offset, len) {
                    Spliced::Sent | Spliced::Gone => {
                        // Answered (or no longer askable) outside fuser:
                        // dropping `reply` would send a second answer, an
                        // EIO. Forgetting it leaks only a reference count
                        // on the session's device.
                        std::mem::forget(reply);
                        return;
                    }
                    Spliced::NotSent => {}
                    Spliced::Failed(e) => {
                        if !self.splice_failed.swap(true, Ordering::Relaxed) {
                            self.log.log(&format!(
                                "splicing read replies failed ({e}); they are copied from now on"
                            ));
                        }
                    }
                }
            }
        }
        READ_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < size as usize {
                buf.resize(size as usize, 0);
            }
            let mut done = 0usize;
            while done < size as usize {
                match file.read_at(&mut buf[done..size as usize], offset + done as u64) {
                    Ok(0) => break,
                    Ok(n) => done += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        self.report(id, &format!("cannot read the object: {e}"));
                        return reply.error(Errno::EIO);
                    }
                }
            }
            reply.data(&buf[..done]);
        })
    }

    /// Calls `add(offset, name, id)` for the directory's entries from
    /// `offset` on (`.` is 1, `..` 2, entry i is i + 3) until it returns true.
    fn list(&self, dir: InodeId, offset: u64, mut add: impl FnMut(u64, &[u8], InodeId) -> bool) {
        let inode = &self.tree.inodes[dir as usize];
        let mut off = offset;
        if off == 0 {
            if add(1, b".", dir) {
                return;
            }
            off = 1;
        }
        if off == 1 {
            if add(2, b"..", self.parent[dir as usize]) {
                return;
            }
            off = 2;
        }
        let start = (off - 2) as usize;
        for (i, e) in inode.entries.iter().enumerate().skip(start) {
            if add(i as u64 + 3, &e.name, e.inode) {
                return;
            }
        }
    }

    fn permitted(&self, req: &Request, inode: &Inode, mask: i32) -> bool {
        let uid = req.uid();
        if uid == 0 {
            // Root may do anything but execute files no one may execute.
            return mask & libc::X_OK == 0 || inode.is_dir() || inode.mode & 0o111 != 0;
        }
        let bits = if uid == inode.uid {
            (inode.mode >> 6) & 7
        } else if req.gid() == inode.gid {
            (inode.mode >> 3) & 7
        } else {
            inode.mode & 7
        };
        let want = ((mask & libc::R_OK != 0) as u32) << 2
            | ((mask & libc::W_OK != 0) as u32) << 1
            | (mask & libc::X_OK != 0) as u32;
        bits & want == want
    }
}

impl Filesystem for TileFs {
    fn init(&mut self, req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = req;
        let caps = config.capabilities();
        let mut want = InitFlags::FUSE_ASYNC_READ | InitFlags::FUSE_PARALLEL_DIROPS;
        if self.tune.cache_symlinks {
            want |= InitFlags::FUSE_CACHE_SYMLINKS;
        }
        if self.tune.readdirplus {
            want |= InitFlags::FUSE_DO_READDIRPLUS;
            if self.tune.readdirplus_auto {
                want |= InitFlags::FUSE_READDIRPLUS_AUTO;
            }
        }
        if self.tune.posix_acl && self.info.has_acl {
            want |= InitFlags::FUSE_POSIX_ACL;
        }
        if self.tune.max_pages {
            want |= InitFlags::FUSE_MAX_PAGES;
        }
        // The kernel lets only CAP_SYS_ADMIN register backing files; without
        // it, do not ask (inside a user namespace the first open still finds
        // out and falls back).
        let may = rustix::thread::capabilities(None)
            .is_ok_and(|c| c.effective.contains(rustix::thread::CapabilitySet::SYS_ADMIN));
        let passthrough = self.tune.passthrough && may && caps.contains(InitFlags::FUSE_PASSTHROUGH);
        if passthrough {
            want |= InitFlags::FUSE_PASSTHROUGH;
            // 1: the backing files may not be on a stacked filesystem, but
            // this mount may itself be the lower layer of an overlay.
            let _ = config.set_max_stack_depth(1);
        }
        let _ = config.add_capabilities(want & caps);
        self.passthrough.store(passthrough, Ordering::Relaxed);
        if self.tune.max_pages {
            let _ = config.set_max_write(1 << 20);
        }
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let (_, dir) = match self.inode(parent) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        if !dir.is_dir() {
            return reply.error(Errno::ENOTDIR);
        }
        match dir.entry(name.as_bytes()) {
            Some(e) => reply.entry(&FOREVER, &self.attr(e.inode), Generation(0)),
            None if self.tune.negative_cache => {
                // Node id 0: a negative entry the kernel keeps for the timeout.
                let mut attr = self.attr(0);
                attr.ino = INodeNo(0);
                reply.entry(&FOREVER, &attr, Generation(0))
            }
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.inode(ino) {
            Ok((id, _)) => reply.attr(&FOREVER, &self.attr(id)),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.inode(ino) {
            Ok((_, i)) if i.mode & S_IFMT == libc::S_IFLNK => reply.data(i.payload.as_deref().unwrap_or_default()),
            Ok(_) => reply.error(Errno::EINVAL),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let (id, inode) = match self.inode(ino) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        if flags.acc_mode() != OpenAccMode::O_RDONLY || flags.0 & libc::O_TRUNC != 0 {
            return reply.error(Errno::EROFS);
        }
        if inode.is_dir() {
            return reply.error(Errno::EISDIR);
        }
        let passthrough = self.passthrough.load(Ordering::Relaxed);
        if !passthrough && self.tune.no_open && self.tune.keep_cache {
            // The kernel stops asking (the mount is read-only, so it refuses
            // writes itself); reads then name the inode alone.
            return reply.error(Errno::ENOSYS);
        }
        if !inode.is_external() {
            // Inline, empty or special: served from the image.
            return reply.opened(FileHandle(0), self.open_flags());
        }
        // The kernel refuses page-cache flags with passthrough, and wants
        // every open of an inode open in passthrough mode to be one too.
        let noflush = self.open_flags() & FopenFlags::FOPEN_NOFLUSH;
        if passthrough {
            if let Some((bid, n)) = self.backing.lock().unwrap().get_mut(&id) {
                *n += 1;
                let fh = self.add_handle(Handle::Passthrough(id));
                return reply.opened_passthrough(FileHandle(fh), noflush, bid);
            }
        }
        let o = match self.object(inode) {
            Ok(o) => o,
            Err(e) => {
                self.report(id, &e.to_string());
                return reply.error(Errno::EIO);
            }
        };
        if !passthrough {
            return reply.opened(FileHandle(self.add_handle(Handle::Object(o))), self.open_flags());
        }
        match reply.open_backing(&o.file) {
            Ok(bid) => {
                let mut backing = self.backing.lock().unwrap();
                let entry = backing.entry(id).or_insert((bid, 0));
                entry.1 += 1;
                let fh = self.add_handle(Handle::Passthrough(id));
                reply.opened_passthrough(FileHandle(fh), noflush, &entry.0)
            }
            Err(e) => {
                // Later opens are answered as without passthrough.
                self.passthrough.store(false, Ordering::Relaxed);
                self.log.log(&format!(
                    "passthrough refused by the kernel ({e}); serving reads instead"
                ));
                reply.opened(FileHandle(self.add_handle(Handle::Object(o))), self.open_flags())
            }
        }
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let (id, inode) = match self.inode(ino) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        if fh.0 != 0 {
            let h = self.handles.lock().unwrap().get(&fh.0).cloned();
            return match h.as_deref() {
                // Checked at open; if the object changed since, check it again.
                Some(Handle::Object(o)) => match o.digest.map(|d| self.verified.recheck(&o.file, &d, &o.key)) {
                    Some(Err(e)) => {
                        self.report(id, &e.to_string());
                        reply.error(Errno::EIO)
                    }
                    _ => self.read_object(id, &o.file, offset, size, req.unique().0, reply),
                },
                // The kernel reads passthrough files itself.
                Some(Handle::Passthrough(_)) => reply.error(Errno::EIO),
                None => reply.error(Errno::EBADF),
            };
        }
        if inode.is_external() {
            // Opened without asking us (open answered with ENOSYS).
            return match self.unopened_object(id, inode) {
                Ok(o) => self.read_object(id, &o.file, offset, size, req.unique().0, reply),
                Err(e) => {
                    self.report(id, &e.to_string());
                    reply.error(Errno::EIO)
                }
            };
        }
        let data: &[u8] = if inode.is_whiteout() {
            &[]
        } else {
            inode.content.as_deref().unwrap_or_default()
        };
        let start = (offset.min(data.len() as u64)) as usize;
        let end = start.saturating_add(size as usize).min(data.len());
        reply.data(&data[start..end])
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if fh.0 != 0 {
            let h = self.handles.lock().unwrap().remove(&fh.0);
            if let Some(h) = h {
                if let Handle::Passthrough(id) = *h {
                    let mut backing = self.backing.lock().unwrap();
                    if let Some((_, n)) = backing.get_mut(&id) {
                        *n -= 1;
                        if *n == 0 {
                            backing.remove(&id);
                        }
                    }
                }
            }
        }
        reply.ok()
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        if self.tune.no_flush {
            // The kernel stops sending flush on close.
            reply.error(Errno::ENOSYS)
        } else {
            reply.ok()
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.inode(ino) {
            Ok((_, i)) if i.is_dir() => {}
            Ok(_) => return reply.error(Errno::ENOTDIR),
            Err(e) => return reply.error(e),
        }
        if self.tune.no_opendir {
            // The kernel stops asking and keeps directory caches by itself.
            return reply.error(Errno::ENOSYS);
        }
        let mut flags = FopenFlags::empty();
        if self.tune.cache_dir {
            flags |= FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE;
        }
        reply.opened(FileHandle(0), flags)
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let dir = match self.inode(ino) {
            Ok((id, i)) if i.is_dir() => id,
            Ok(_) => return reply.error(Errno::ENOTDIR),
            Err(e) => return reply.error(e),
        };
        self.list(dir, offset, |off, name, id| {
            let mode = Self::shown_mode(&self.tree.inodes[id as usize]);
            reply.add(
                INodeNo(u64::from(id) + 1),
                off,
                file_type(mode),
                OsStr::from_bytes(name),
            )
        });
        reply.ok()
    }

    fn readdirplus(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectoryPlus) {
        let dir = match self.inode(ino) {
            Ok((id, i)) if i.is_dir() => id,
            Ok(_) => return reply.error(Errno::ENOTDIR),
            Err(e) => return reply.error(e),
        };
        self.list(dir, offset, |off, name, id| {
            let attr = self.attr(id);
            reply.add(attr.ino, off, OsStr::from_bytes(name), &FOREVER, &attr, Generation(0))
        });
        reply.ok()
    }

    fn releasedir(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _flags: OpenFlags, reply: ReplyEmpty) {
        reply.ok()
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        reply.statfs(
            u64::from(self.info.blocks),
            0,
            0,
            self.tree.inodes.len() as u64,
            0,
            4096,
            255,
            4096,
        )
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let (id, _) = match self.inode(ino) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        let name = name.as_bytes();
        if self.unsupported(name) {
            return reply.error(Errno::EOPNOTSUPP);
        }
        if !self.visible(req, name) {
            return reply.error(Errno::ENODATA);
        }
        let xattrs = self.xattrs(id);
        let Some((_, value)) = xattrs.iter().find(|(k, _)| *k == name) else {
            return reply.error(Errno::ENODATA);
        };
        if size == 0 {
            reply.size(value.len() as u32)
        } else if (size as usize) < value.len() {
            reply.error(Errno::ERANGE)
        } else {
            reply.data(value)
        }
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let (id, _) = match self.inode(ino) {
            Ok(x) => x,
            Err(e) => return reply.error(e),
        };
        let mut names = Vec::new();
        for (k, _) in self.xattrs(id) {
            if self.visible(req, k) {
                names.extend_from_slice(k);
                names.push(0);
            }
        }
        if size == 0 {
            reply.size(names.len() as u32)
        } else if (size as usize) < names.len() {
            reply.error(Errno::ERANGE)
        } else {
            reply.data(&names)
        }
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        // Only reached without default_permissions (a measurement setting).
        match self.inode(ino) {
            Ok((_, i)) => {
                let mask = mask.bits();
                if mask & libc::W_OK != 0 {
                    reply.error(Errno::EROFS)
                } else if self.permitted(req, i, mask) {
                    reply.ok()
                } else {
                    reply.error(Errno::EACCES)
                }
            }
            Err(e) => reply.error(e),
        }
    }
}
