//! The writable mount: the image as the read-only lower layer, changes in
//! an upper directory (see [`upper`] for its format), served through FUSE
//! with overlayfs's semantics, so that the same operations give the same
//! tree as the kernel's overlay of the same image.
//!
//! - A file of the image is copied up (data verified, metadata and xattrs
//!   kept, made durable, then linked into place) before it is changed;
//!   opening it read-only serves the image's object as the read-only
//!   mount does.
//! - Directories are merged: upper entries hide image entries of the same
//!   name, whiteouts hide deleted ones, opaque directories hide the whole
//!   image directory, moved directories carry a redirect to their image
//!   path.
//! - Everything changes through the kernel's own FUSE operations, so the
//!   kernel's caches stay true by themselves and are kept forever, with
//!   two exceptions told to it as they happen: a directory copied up as an
//!   ancestor (it now shows overlayfs's link count of a merged directory)
//!   and a file copied up (its inode number or link count may change).

mod files;
mod io_mode;
mod names;
mod nodes;
mod ops_files;
mod ops_names;
mod serve;
mod upper;

use crate::lower::{Lower, Object, FOREVER};
use crate::Tuning;
use nodes::{Node, NodeId, Nodes};
use rustc_hash::FxHashMap;
use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;
use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use tilefs_fuse_proto::abi;
use tilefs_fuse_proto::{Connection, Entry};
use tilefs_image::tree::InodeId;
use upper::{errno, Meta, Override, Target, Upper, XPath, KEPT_PREFIX, OVERRIDE, S_IFDIR, S_IFLNK, S_IFMT, S_IFREG};
pub(crate) use upper::{IdMap, Upper as UpperDir};

/// The namespace this process's server keeps overlay xattrs in (as
/// [`Upper::open`] decides), for the mount's record.
pub(crate) fn xattr_namespace() -> tilefs_store::mounts::OverlayXattrs {
    match upper::Powers::of_this_process().privileged {
        true => tilefs_store::mounts::OverlayXattrs::Trusted,
        false => tilefs_store::mounts::OverlayXattrs::User,
    }
}

/// Inode numbers of upper entries: the upper inode with the top bit set,
/// so that they never meet an image inode's (below 2^32).
const UPPER_INO: u64 = 1 << 63;

type R<T> = Result<T, i32>;

fn e(x: Errno) -> i32 {
    errno(x)
}

/// An open file or directory.
pub(crate) enum Handle {
    /// A file of the image, read from its verified object.
    Lower(Object, InodeId),
    /// A file of the image stored inline (or empty).
    Inline(InodeId),
    /// An upper file (shared with its node once the file is removed: see
    /// `OverlayFs::remove`).
    Upper(Arc<OwnedFd>),
    /// A directory: its merged listing, taken at the first READDIR.
    Dir(Mutex<Option<Arc<Vec<Listed>>>>),
}

/// An entry of a merged listing.
#[derive(Clone)]
pub(crate) struct Listed {
    name: Box<[u8]>,
    ino: u64,
    typ: u32,
}

/// What a name of a directory is, from the upper directory and the image.
struct Found {
    /// The upper entry (not a whiteout), with its metadata.
    upper: Option<Meta>,
    /// The image inode merged or shown.
    lower: Option<InodeId>,
    /// An upper directory that hides the image's.
    opaque: bool,
}

pub struct OverlayFs {
    lower: Lower,
    up: Upper,
    nodes: Mutex<Nodes>,
    /// Held by every change of the tree (creations, removals, renames,
    /// copy-ups): they see and leave the upper directory consistent.
    changing: Mutex<()>,
    handles: Mutex<FxHashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    conn: OnceLock<Arc<Connection>>,
    tune: Tuning,
    /// The kernel caches writes (FUSE_WRITEBACK_CACHE).
    writeback: AtomicBool,
    /// We clear setuid/setgid (FUSE_HANDLE_KILLPRIV_V2).
    killpriv: AtomicBool,
    io: io_mode::IoModes,
    /// OPEN is answered with ENOSYS (see `serve.rs`): the kernel sends
    /// neither OPEN nor RELEASE, and reads and writes name the node alone.
    no_open: AtomicBool,
    /// The handles that I/O naming a node alone uses, by node, at most
    /// `unopened_max` (no release ever says when one is done with).
    unopened: Mutex<FxHashMap<NodeId, Arc<Handle>>>,
    unopened_max: usize,
    /// Removed files' descriptors are kept (until FORGET) only below this
    /// descriptor number: three quarters of the limit on open files.
    orphan_fd_max: u64,
}

/// A location in the upper directory: an entry of a directory, or a file
/// that has no name left.
enum Loc {
    At(Arc<OwnedFd>, Box<[u8]>),
    Orphan(Arc<OwnedFd>),
}

impl Loc {
    fn xpath(&self) -> XPath {
        match self {
            Loc::At(d, n) => XPath::at(d.as_fd(), n),
            Loc::Orphan(f) => XPath::of(f.as_fd()),
        }
    }
}

/// The time of `t` as the kernel takes it.
fn time_of(t: (i64, u32)) -> (u64, u32) {
    (t.0 as u64, t.1.min(999_999_999))
}

impl OverlayFs {
    /// `nofile`: the limit on open files in force.
    pub(crate) fn new(lower: Lower, up: Upper, tune: Tuning, nofile: u64) -> Result<OverlayFs, String> {
        // Exact modes in the upper directory: nothing masked by ours.
        rustix::process::umask(Mode::empty());
        let root_lower = tilefs_image::tree::ROOT;
        let root_fd = rustix::fs::openat(
            &up.root,
            ".",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| format!("upper directory: {e}"))?;
        let opaque = up.is_opaque(&XPath::of(root_fd.as_fd()));
        let root = Node {
            refs: 1,
            kind: S_IFDIR,
            ino: u64::from(root_lower) + 1,
            names: Vec::new(),
            lower: (!opaque).then_some(root_lower),
            upper: true,
            dir_fd: Some(Arc::new(root_fd)),
            opaque,
            upper_ino: None,
            orphan: None,
        };
        Ok(OverlayFs {
            lower,
            up,
            nodes: Mutex::new(Nodes::new(root)),
            changing: Mutex::new(()),
            handles: Mutex::new(FxHashMap::default()),
            next_fh: AtomicU64::new(1),
            conn: OnceLock::new(),
            tune,
            writeback: AtomicBool::new(false),
            killpriv: AtomicBool::new(false),
            io: io_mode::IoModes::new(),
            no_open: AtomicBool::new(false),
            unopened: Mutex::new(FxHashMap::default()),
            // A small share of the descriptors: the rest is for open files,
            // directories and removed files kept until FORGET.
            unopened_max: (nofile / 8).clamp(1, crate::UNOPENED_MAX as u64) as usize,
            orphan_fd_max: nofile / 4 * 3,
        })
    }

    fn nodes(&self) -> MutexGuard<'_, Nodes> {
        self.nodes.lock().unwrap_or_else(|e| e.into_inner())
    }

    // ---- where things are -------------------------------------------------

    /// The upper directory of a directory node, if it has one.
    fn dir_fd(&self, id: NodeId) -> R<Option<Arc<OwnedFd>>> {
        let nodes = self.nodes();
        let n = nodes.get(id).ok_or(libc::ENOENT)?;
        if !n.is_dir() {
            return Err(libc::ENOTDIR);
        }
        Ok(n.dir_fd.clone())
    }

    /// Where a node's upper entry is.
    fn loc(&self, id: NodeId) -> R<Loc> {
        let nodes = self.nodes();
        let n = nodes.get(id).ok_or(libc::ENOENT)?;
        if !n.upper {
            return Err(libc::EIO);
        }
        if let Some(d) = &n.dir_fd {
            return Ok(Loc::Orphan(d.clone()));
        }
        for (p, name) in &n.names {
            if let Some(pfd) = nodes.get(*p).and_then(|p| p.dir_fd.clone()) {
                return Ok(Loc::At(pfd, name.clone()));
            }
        }
        n.orphan.clone().map(Loc::Orphan).ok_or(libc::ESTALE)
    }

    /// The absolute image path of image directory `dir` (for redirects).
    /// The image's side of the mount.
    pub(crate) fn lower(&self) -> &Lower {
        &self.lower
    }

    fn lower_path(&self, dir: InodeId) -> Vec<u8> {
        let mut parts = Vec::new();
        let mut cur = dir;
        while cur != tilefs_image::tree::ROOT {
            let parent = self.lower.parent(cur);
            let name = self
                .lower
                .node(parent)
                .entries()
                .find(|e| e.inode == cur && !e.hardlink)
                .map(|e| e.name.to_vec())
                .unwrap_or_default();
            parts.push(name);
            cur = parent;
        }
        let mut p = Vec::new();
        for n in parts.iter().rev() {
            p.push(b'/');
            p.extend_from_slice(n);
        }
        if p.is_empty() {
            p.push(b'/');
        }
        p
    }

    /// The image directory at absolute path `path`, if it is one.
    fn lower_dir_at(&self, path: &[u8]) -> Option<InodeId> {
        let mut cur = tilefs_image::tree::ROOT;
        for c in path.split(|&b| b == b'/').filter(|c| !c.is_empty()) {
            let e = self.lower.node(cur).entry(c)?;
            cur = e.inode;
            if !self.lower.node(cur).is_dir() {
                return None;
            }
        }
        Some(cur)
    }

    /// The image entry `name` of directory node `dir` (None when the
    /// directory has no image side or hides it).
    fn lower_child(&self, dir: &Node, name: &[u8]) -> Option<InodeId> {
        if dir.opaque {
            return None;
        }
        let l = dir.lower?;
        self.lower.node(l).entry(name).map(|e| e.inode)
    }

    /// What `name` in directory `parent` is.
    fn find(&self, parent: NodeId, name: &[u8]) -> R<Option<Found>> {
        let (dir_fd, lower_child) = {
            let nodes = self.nodes();
            let p = nodes.get(parent).ok_or(libc::ENOENT)?;
            if !p.is_dir() {
                return Err(libc::ENOTDIR);
            }
            (p.dir_fd.clone(), self.lower_child(p, name))
        };
        let mut upper = None;
        let mut opaque = false;
        let mut redirect = None;
        if let Some(d) = &dir_fd {
            match self.up.meta_at(d.as_fd(), name) {
                Ok(m) if m.is_whiteout() => return Ok(None),
                Ok(m) => {
                    if m.is_dir() {
                        let path = XPath::at(d.as_fd(), name);
                        opaque = self.up.is_opaque(&path);
                        if !opaque {
                            redirect = self.up.redirect(&path);
                        }
                    }
                    upper = Some(m);
                }
                Err(Errno::NOENT) => {}
                Err(x) => return Err(e(x)),
            }
        }
        let lower = match &upper {
            None => lower_child,
            Some(m) if m.is_dir() && !opaque => match redirect {
                Some(r) if r.starts_with(b"/") => self.lower_dir_at(&r),
                // A relative redirect names a sibling in the image.
                Some(r) => {
                    let nodes = self.nodes();
                    let p = nodes.get(parent).ok_or(libc::ENOENT)?;
                    self.lower_child(p, &r)
                }
                None => lower_child,
            }
            .filter(|&l| self.lower.node(l).is_dir()),
            Some(_) => None,
        };
        if upper.is_none() && lower.is_none() {
            return Ok(None);
        }
        Ok(Some(Found { upper, lower, opaque }))
    }

    /// The node for `name` in `parent`, found or made, with one more
    /// lookup counted.
    fn node_for(&self, parent: NodeId, name: &[u8], f: &Found) -> R<NodeId> {
        self.node_for_as(parent, name, f, true)
    }

    /// [`Self::node_for`]; `reuse`: an upper directory's descriptor may
    /// be taken from the node already known by that name.
    fn node_for_as(&self, parent: NodeId, name: &[u8], f: &Found, reuse: bool) -> R<NodeId> {
        // An upper directory known by this name already has its
        // descriptor: the common case, no need to open it again.
        let known_dir = reuse && matches!(&f.upper, Some(m) if m.is_dir()) && {
            let nodes = self.nodes();
            nodes
                .by_name
                .get(&(parent, Box::<[u8]>::from(name)))
                .and_then(|id| nodes.get(*id))
                .is_some_and(|n| n.is_dir() && n.upper && n.lower == f.lower && n.dir_fd.is_some())
        };
        let dir_fd = match &f.upper {
            Some(m) if m.is_dir() && !known_dir => {
                let pfd = self.dir_fd(parent)?.ok_or(libc::EIO)?;
                Some(Arc::new(self.up.open_dir_at(pfd.as_fd(), name).map_err(e)?))
            }
            _ => None,
        };
        let mut nodes = self.nodes();
        let existing = match &f.upper {
            Some(m) if !m.is_dir() => nodes.by_upper.get(&m.ino).copied(),
            _ => None,
        }
        .or_else(|| {
            let id = *nodes.by_name.get(&(parent, Box::<[u8]>::from(name)))?;
            let n = nodes.get(id)?;
            let same = match &f.upper {
                None => !n.upper && n.lower == f.lower,
                Some(m) if m.is_dir() => n.is_dir() && n.upper && n.lower == f.lower,
                Some(m) => n.upper_ino == Some(m.ino),
            };
            same.then_some(id)
        })
        .or_else(|| match (&f.upper, f.lower) {
            (Some(m), Some(l)) if m.is_dir() => nodes.by_lower_dir.get(&l).copied(),
            (None, Some(l)) if self.lower.node(l).is_dir() => nodes.by_lower_dir.get(&l).copied(),
            _ => None,
        });
        let upper_dir = matches!(&f.upper, Some(m) if m.is_dir());
        let has_fd = existing
            .and_then(|id| nodes.get(id))
            .is_some_and(|n| n.dir_fd.is_some());
        if upper_dir && dir_fd.is_none() && !has_fd {
            // Forgotten meanwhile: open it after all.
            drop(nodes);
            return self.node_for_as(parent, name, f, false);
        }
        if let Some(id) = existing {
            let n = nodes.get_mut(id).expect("indexed");
            n.refs += 1;
            if n.is_dir() && n.dir_fd.is_none() {
                n.dir_fd = dir_fd;
            }
            if !n.names.iter().any(|(p, m)| *p == parent && **m == *name) {
                nodes.add_name(id, parent, name);
            }
            return Ok(id);
        }
        let (kind, ino, upper_ino) = match (&f.upper, f.lower) {
            (Some(m), Some(l)) if m.is_dir() => (S_IFDIR, u64::from(l) + 1, None),
            (Some(m), _) => (m.mode & S_IFMT, self.upper_ino(m), (!m.is_dir()).then_some(m.ino)),
            (None, Some(l)) => {
                let i = &self.lower.node(l);
                (Lower::shown_mode(i) & S_IFMT, u64::from(l) + 1, None)
            }
            (None, None) => return Err(libc::ENOENT),
        };
        Ok(nodes.insert(Node {
            refs: 1,
            kind,
            ino,
            names: vec![(parent, name.into())],
            lower: f.lower,
            upper: f.upper.is_some(),
            dir_fd,
            opaque: f.opaque,
            upper_ino,
            orphan: None,
        }))
    }

    fn upper_ino(&self, m: &Meta) -> u64 {
        if m.dev == self.up.dev {
            UPPER_INO | m.ino
        } else {
            // Something mounted inside the upper directory: its inode
            // numbers are made unique by mixing in the device.
            UPPER_INO | (1 << 62) | (m.ino ^ m.dev.rotate_left(32)) & ((1 << 62) - 1)
        }
    }

    // ---- attributes -------------------------------------------------------

    fn attr_of_meta(&self, m: &Meta, ino: u64, merged_dir: bool) -> abi::Attr {
        let (at, atn) = time_of(m.atime);
        let (mt, mtn) = time_of(m.mtime);
        let (ct, ctn) = time_of(m.ctime);
        abi::Attr {
            ino,
            size: m.size,
            blocks: m.blocks,
            atime: at,
            mtime: mt,
            ctime: ct,
            atimensec: atn,
            mtimensec: mtn,
            ctimensec: ctn,
            mode: m.mode,
            // overlayfs shows a merged directory with one link: counting
            // its subdirectories is not worth it.
            nlink: if merged_dir { 1 } else { m.nlink },
            uid: self.up.uids.show(m.uid),
            gid: self.up.gids.show(m.gid),
            rdev: m.rdev as u32,
            blksize: 4096,
            flags: 0,
        }
    }

    fn lower_attr(&self, l: InodeId, ino: u64) -> abi::Attr {
        let mut a = self.lower.attr(l);
        a.ino = ino;
        a.uid = self.up.uids.show(a.uid);
        a.gid = self.up.gids.show(a.gid);
        a
    }

    /// The metadata of a node's upper entry.
    fn upper_meta(&self, id: NodeId) -> R<Meta> {
        match self.loc(id)? {
            Loc::At(d, n) => self.up.meta_at(d.as_fd(), &n).map_err(e),
            Loc::Orphan(f) => {
                let st = rustix::fs::fstat(&f).map_err(e)?;
                let m = Meta::from_stat(&st);
                if self.up.powers.privileged || st.st_mode & S_IFMT != S_IFREG && st.st_mode & S_IFMT != S_IFDIR {
                    return Ok(m);
                }
                Ok(match XPath::of(f.as_fd()).get(OVERRIDE).map_err(e)? {
                    Some(v) => Override::parse(&v).map_or(m, |o| m.with(&o)),
                    None => m,
                })
            }
        }
    }

    fn attr(&self, id: NodeId) -> R<abi::Attr> {
        let (upper, lower, ino, dir) = {
            let nodes = self.nodes();
            let n = nodes.get(id).ok_or(libc::ENOENT)?;
            (n.upper, n.lower, n.ino, n.is_dir())
        };
        match (upper, lower) {
            (true, _) => {
                let m = self.upper_meta(id)?;
                Ok(self.attr_of_meta(&m, ino, dir && lower.is_some()))
            }
            (false, Some(l)) => Ok(self.lower_attr(l, ino)),
            (false, None) => Err(libc::ESTALE),
        }
    }

    fn entry(&self, id: NodeId) -> R<Entry> {
        Ok(Entry {
            nodeid: id,
            generation: 0,
            entry_ttl: FOREVER,
            attr_ttl: FOREVER,
            attr: self.attr(id)?,
        })
    }

    /// Tells the kernel a node's attributes changed behind its back.
    fn invalidate(&self, id: NodeId) {
        if let Some(c) = self.conn.get() {
            c.inval_inode(id, -1, 0);
        }
    }

    // ---- copy-up ----------------------------------------------------------

    /// Makes sure directory node `id` has an upper directory (copying its
    /// image directory's metadata up, and its parents' first).
    fn upper_dir(&self, id: NodeId) -> R<Arc<OwnedFd>> {
        let (parent, name, lower) = {
            let nodes = self.nodes();
            let n = nodes.get(id).ok_or(libc::ENOENT)?;
            if !n.is_dir() {
                return Err(libc::ENOTDIR);
            }
            if let Some(d) = &n.dir_fd {
                return Ok(d.clone());
            }
            let (p, name) = n.primary().ok_or(libc::ESTALE)?;
            (p, name.to_vec(), n.lower.ok_or(libc::EIO)?)
        };
        let pfd = self.upper_dir(parent)?;
        let inode = &self.lower.node(lower);
        let tmp = self.up.tmp_name();
        rustix::fs::mkdirat(&self.up.work, tmp.as_c_str(), Mode::from_raw_mode(0o700)).map_err(e)?;
        let done = (|| -> Result<(), Errno> {
            let path = XPath::at(self.up.work.as_fd(), tmp.as_bytes());
            let t = Target::At(self.up.work.as_fd(), tmp.as_bytes());
            // Owner first: chown drops security.capability.
            self.up
                .set_owner_mode(t, inode.uid, inode.gid, inode.mode, None, false)?;
            self.copy_xattrs(&path, lower)?;
            set_times(self.up.work.as_fd(), tmp.as_bytes(), inode.mtime.sec, inode.mtime.nsec)?;
            rustix::fs::renameat_with(
                &self.up.work,
                tmp.as_c_str(),
                pfd.as_fd(),
                name.as_slice(),
                rustix::fs::RenameFlags::NOREPLACE,
            )
        })();
        if let Err(x) = done {
            let _ = rustix::fs::unlinkat(&self.up.work, tmp.as_c_str(), AtFlags::REMOVEDIR);
            tracing::warn!("copy-up of directory {} failed: {x}", upper::shown(&name));
            return Err(e(x));
        }
        let fd = Arc::new(self.up.open_dir_at(pfd.as_fd(), &name).map_err(e)?);
        let mut nodes = self.nodes();
        if let Some(n) = nodes.get_mut(id) {
            n.upper = true;
            n.dir_fd = Some(fd.clone());
        }
        drop(nodes);
        // Now merged: overlayfs shows it with one link.
        self.invalidate(id);
        Ok(fd)
    }

    /// Copies the image's xattrs of `lower` to the upper entry at `path`:
    /// those the server may not set are kept under our own names.
    fn copy_xattrs(&self, path: &XPath, lower: InodeId) -> Result<(), Errno> {
        for (k, v) in self.lower.xattrs(lower) {
            if k.starts_with(b"trusted.overlay.") || k.starts_with(b"user.overlay.") {
                continue;
            }
            self.set_xattr_raw(path, k, v, rustix::fs::XattrFlags::empty())?;
        }
        Ok(())
    }

    /// Sets an xattr as asked, or keeps it under our own name when the
    /// server may not set it.
    fn set_xattr_raw(&self, path: &XPath, k: &[u8], v: &[u8], flags: rustix::fs::XattrFlags) -> Result<(), Errno> {
        match path.set(k, v, flags) {
            Err(Errno::PERM) | Err(Errno::ACCESS) | Err(Errno::OPNOTSUPP)
                if !self.up.powers.privileged && !k.starts_with(b"user.") =>
            {
                let mut kept = KEPT_PREFIX.to_vec();
                kept.extend_from_slice(k);
                path.set(&kept, v, flags)
            }
            r => r,
        }
    }

    /// Copies non-directory node `id` up (with only the first `keep`
    /// bytes of its data: all unless truncated).
    fn copy_up(&self, id: NodeId, keep: Option<u64>) -> R<()> {
        let (parent, name, lower) = {
            let nodes = self.nodes();
            let n = nodes.get(id).ok_or(libc::ENOENT)?;
            if n.upper {
                return Ok(());
            }
            if n.is_dir() {
                drop(nodes);
                return self.upper_dir(id).map(|_| ());
            }
            let (p, name) = n.primary().ok_or(libc::ESTALE)?;
            (p, name.to_vec(), n.lower.ok_or(libc::EIO)?)
        };
        let pfd = self.upper_dir(parent)?;
        let inode = &self.lower.node(lower);
        let mode = Lower::shown_mode(inode);
        let typ = mode & S_IFMT;
        let stand_in = self.up.needs_stand_in(mode, inode.uid, inode.gid);
        let tmp = self.up.tmp_name();
        let work = self.up.work.as_fd();
        let made = (|| -> Result<(), Errno> {
            if typ == S_IFREG || stand_in {
                let f = rustix::fs::openat(
                    work,
                    tmp.as_c_str(),
                    OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC | OFlags::NOFOLLOW,
                    Mode::from_raw_mode(0o600),
                )?;
                // Copying data and syncing it take long.
                tilefs_fuse_proto::may_block();
                if typ == S_IFREG {
                    self.copy_data(lower, &f, keep).inspect_err(|x| {
                        tracing::warn!("copy-up of {}: cannot read its data: {x}", self.lower.path_of(lower));
                    })?;
                } else if typ == S_IFLNK {
                    rustix::io::write(&f, inode.payload.unwrap_or_default())?;
                }
                // Durable before it can be seen, as overlayfs's copy-up.
                rustix::fs::fsync(&f)?;
            } else if typ == S_IFLNK {
                let target = inode.payload.unwrap_or_default();
                let t = CString::new(target).map_err(|_| Errno::INVAL)?;
                rustix::fs::symlinkat(t.as_c_str(), work, tmp.as_c_str())?;
            } else {
                let ft = rustix::fs::FileType::from_raw_mode(typ);
                rustix::fs::mknodat(
                    work,
                    tmp.as_c_str(),
                    ft,
                    Mode::from_raw_mode(0o600),
                    u64::from(inode.rdev),
                )?;
            }
            let path = XPath::at(work, tmp.as_bytes());
            let t = Target::At(work, tmp.as_bytes());
            // Owner first: chown drops security.capability.
            self.up.set_owner_mode(
                t,
                inode.uid,
                inode.gid,
                mode,
                stand_in.then_some(u64::from(inode.rdev)),
                false,
            )?;
            if typ == S_IFREG || typ == S_IFDIR || stand_in || self.up.powers.privileged {
                self.copy_xattrs(&path, lower)?;
            }
            set_times(work, tmp.as_bytes(), inode.mtime.sec, inode.mtime.nsec)?;
            rustix::fs::renameat_with(
                work,
                tmp.as_c_str(),
                pfd.as_fd(),
                name.as_slice(),
                rustix::fs::RenameFlags::NOREPLACE,
            )
        })();
        if let Err(x) = made {
            let _ = rustix::fs::unlinkat(work, tmp.as_c_str(), AtFlags::empty());
            return Err(e(x));
        }
        let st = rustix::fs::statat(pfd.as_fd(), name.as_slice(), AtFlags::SYMLINK_NOFOLLOW).map_err(e)?;
        let m = Meta::from_stat(&st);
        let broke_link = inode.nlink > 1;
        let new_ino = self.upper_ino(&m);
        let mut nodes = self.nodes();
        nodes.update(id, |n| {
            n.upper = true;
            n.upper_ino = Some(m.ino);
            // The inode number stays, unless the image file has other
            // names: they keep it, this copy is another file now.
            if broke_link {
                n.ino = new_ino;
            }
        });
        drop(nodes);
        // I/O from now on goes to the upper file, truncated or not.
        self.unopened_drop(id);
        self.invalidate(id);
        Ok(())
    }

    /// Writes the data of image file `lower` (at most `keep` bytes) to `to`.
    fn copy_data(&self, lower: InodeId, to: &OwnedFd, keep: Option<u64>) -> Result<(), Errno> {
        let inode = &self.lower.node(lower);
        let want = keep.map_or(inode.size, |k| k.min(inode.size));
        if want == 0 {
            return Ok(());
        }
        if !inode.is_external() {
            let data = inode.content.unwrap_or_default();
            let data = &data[..(want as usize).min(data.len())];
            let mut done = 0;
            while done < data.len() {
                done += rustix::io::write(to, &data[done..])?;
            }
            return Ok(());
        }
        let obj = self.lower.object(inode).map_err(|x| {
            self.lower.report(lower, &x.to_string());
            Errno::IO
        })?;
        let mut off_in = 0u64;
        while off_in < want {
            let len = (want - off_in) as usize;
            match rustix::fs::copy_file_range(&obj.file, Some(&mut off_in), to, None, len) {
                Ok(0) => break,
                Ok(_) => {}
                Err(Errno::XDEV) | Err(Errno::INVAL) | Err(Errno::NOSYS) | Err(Errno::OPNOTSUPP) => {
                    return copy_by_read(&obj.file, to, off_in, want);
                }
                Err(x) => return Err(x),
            }
        }
        // The object was verified when opened; it must still be as long.
        if off_in != want {
            return Err(Errno::IO);
        }
        Ok(())
    }
}

fn copy_by_read(from: &std::fs::File, to: &OwnedFd, mut off: u64, end: u64) -> Result<(), Errno> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    while off < end {
        let n = ((end - off) as usize).min(buf.len());
        let got = from
            .read_at(&mut buf[..n], off)
            .map_err(|x| Errno::from_io_error(&x).unwrap_or(Errno::IO))?;
        if got == 0 {
            return Err(Errno::IO);
        }
        let mut done = 0;
        while done < got {
            done += rustix::io::write(to, &buf[done..got])?;
        }
        off += got as u64;
    }
    Ok(())
}

fn set_times(dir: BorrowedFd<'_>, name: &[u8], sec: i64, nsec: u32) -> Result<(), Errno> {
    let t = rustix::fs::Timespec {
        tv_sec: sec,
        tv_nsec: i64::from(nsec.min(999_999_999)),
    };
    rustix::fs::utimensat(
        dir,
        name,
        &rustix::fs::Timestamps {
            last_access: t,
            last_modification: t,
        },
        AtFlags::SYMLINK_NOFOLLOW,
    )
}
