//! The image side of a mount: the image (served from its bytes, see
//! `ImageView`, with the ids, entries and xattrs of the tree read from it), how its
//! inodes look through FUSE (as the kernel's composefs mount shows them),
//! and their contents, opened from the store and verified against the
//! image's digests. The read-only server serves it as it is; the writable
//! one uses it as its lower layer.

use crate::objects::{open_object, FileState, ObjectError, VerifiedObjects};
use crate::Verity;
use rustc_hash::FxHashMap;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use tilefs_fuse_proto::abi;
use tilefs_fuse_proto::{Entry, Ttl};
use tilefs_image::erofs::view::{Dir, DirEntry, DirPos, Entries};
use tilefs_image::erofs::{ImageError, ImageInfo, ImageView};
use tilefs_image::tree::{InodeId, Timespec, S_IFCHR, S_IFDIR, S_IFMT, S_IFREG};

/// Validity of every entry and attribute: ten years, far beyond any mount,
/// small enough for the kernel's conversion to jiffies.
pub(crate) const FOREVER: Ttl = Ttl::from_secs(10 * 365 * 24 * 3600);

// Markers the kernel's overlay mount shows on whiteouts from the source
// (stored as marked empty regular files) and on their directories.
const WHITEOUT_XATTRS: [&[u8]; 2] = [b"trusted.overlay.whiteout", b"user.overlay.whiteout"];
const WHITEOUTS_XATTRS: [&[u8]; 2] = [b"trusted.overlay.whiteouts", b"user.overlay.whiteouts"];
const OPAQUE_XATTRS: [&[u8]; 2] = [b"trusted.overlay.opaque", b"user.overlay.opaque"];
const SELINUX: &[u8] = b"security.selinux";
pub(crate) const ACL_XATTRS: [&[u8]; 2] = [b"system.posix_acl_access", b"system.posix_acl_default"];

/// [`tilefs_sys::ns::in_initial_userns`], read once: asked on every
/// `trusted.` xattr, and a server never changes its user namespace.
fn initial_userns() -> bool {
    static INITIAL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INITIAL.get_or_init(tilefs_sys::ns::in_initial_userns)
}

/// The `d_type` of a mode, as READDIR gives it.
pub(crate) fn dirent_type(mode: u32) -> u32 {
    (mode & S_IFMT) >> 12
}

/// Xattrs shown, (name, value) sorted by name.
pub(crate) type XattrList<'a> = Vec<(&'a [u8], &'a [u8])>;

/// Directories whose listing position is remembered, at most.
const MAX_CURSORS: usize = 4096;

/// An object file opened (and checked, unless verity is off) for serving.
pub(crate) struct Object {
    pub(crate) file: File,
    /// What its data is checked against; None when nothing is checked.
    pub(crate) digest: Option<[u8; 32]>,
    /// The file's state when it was checked.
    pub(crate) key: FileState,
}

impl Object {
    /// Whether the file is as it was when checked (true when nothing is
    /// checked), so what it holds may be used again without a new check.
    pub(crate) fn unchanged(&self) -> bool {
        self.digest.is_none() || FileState::of_fd(&self.file).is_ok_and(|s| s == self.key)
    }
}

pub(crate) struct Lower {
    /// The image, served from its bytes.
    pub(crate) view: ImageView,
    pub(crate) info: ImageInfo,
    /// The image, for messages.
    name: String,
    /// Answer getxattr of security.selinux with EOPNOTSUPP when no file
    /// has a label (see `Tuning::selinux_enotsup`).
    pub(crate) selinux_enotsup: bool,
    pub(crate) store: OwnedFd,
    pub(crate) verity: Verity,
    pub(crate) verified: VerifiedObjects,
    /// Objects already reported broken (by inode), so a file opened over
    /// and over logs once per state of its object.
    reported: Mutex<FxHashMap<InodeId, String>>,
    /// Where absent objects come from (a lazily pulled image).
    pub(crate) fetcher: Option<crate::Fetcher>,
    /// Where listings of directories stopped (see `LowerNode::entries_from`).
    cursors: Mutex<FxHashMap<InodeId, DirPos>>,
    /// Added to every node id and inode number shown: one filesystem that
    /// serves many images (the layer store) gives each a range of its own.
    pub(crate) base: u64,
}

/// An image inode as the tree holds it (its attributes, payload, inline
/// contents and digest), with its directory entries read on demand.
#[derive(Clone, Copy)]
pub(crate) struct LowerNode<'a> {
    lower: &'a Lower,
    pub(crate) id: InodeId,
    pub(crate) mode: u32,
    pub(crate) nlink: u32,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) rdev: u32,
    pub(crate) size: u64,
    pub(crate) mtime: Timespec,
    /// Symlink target, or the path of a regular file's object.
    pub(crate) payload: Option<&'a [u8]>,
    /// Inline contents of a small regular file.
    pub(crate) content: Option<&'a [u8]>,
    /// fs-verity digest of a regular file's contents.
    pub(crate) digest: Option<[u8; 32]>,
}

impl<'a> LowerNode<'a> {
    pub(crate) fn is_dir(&self) -> bool {
        self.mode & S_IFMT == S_IFDIR
    }

    pub(crate) fn is_reg(&self) -> bool {
        self.mode & S_IFMT == S_IFREG
    }

    /// An overlayfs whiteout: a character device with device number 0/0.
    pub(crate) fn is_whiteout(&self) -> bool {
        self.mode & S_IFMT == S_IFCHR && self.rdev == 0
    }

    /// A regular file whose data lives outside the image (in the store).
    pub(crate) fn is_external(&self) -> bool {
        self.is_reg() && self.size > 0 && self.content.is_none()
    }

    fn dir(&self) -> Option<Dir<'a>> {
        if !self.is_dir() {
            return None;
        }
        self.lower.view.dir(self.id).map_err(|e| self.lower.corrupt(e)).ok()
    }

    /// The entry `name` of a directory.
    pub(crate) fn entry(&self, name: &[u8]) -> Option<DirEntry<'a>> {
        self.dir()?.entry(name)
    }

    /// The entries of a directory in name order (none for others).
    pub(crate) fn entries(&self) -> impl Iterator<Item = DirEntry<'a>> + 'a {
        self.dir().into_iter().flat_map(|d| d.entries())
    }

    /// The entries of a directory from index `start` on, resumed where an
    /// earlier listing stopped when it stopped there (so that a listing in
    /// many replies costs time linear in its length).
    fn entries_from(&self, start: u64) -> Option<Entries<'a>> {
        let d = self.dir()?;
        let pos = self.lower.cursors.lock().unwrap().get(&self.id).copied();
        let mut it = match pos {
            Some(p) if p.index == start => d.entries_at(p),
            _ => d.entries(),
        };
        while it.pos().index < start {
            it.next()?;
        }
        Some(it)
    }
}

impl Lower {
    pub(crate) fn new(view: ImageView, name: String, store: OwnedFd, verity: Verity) -> Lower {
        Lower {
            info: view.info().clone(),
            view,
            name,
            selinux_enotsup: true,
            store,
            verity,
            verified: VerifiedObjects::default(),
            reported: Mutex::new(FxHashMap::default()),
            fetcher: None,
            cursors: Mutex::new(FxHashMap::default()),
            base: 0,
        }
    }

    /// The node id (and inode number) image inode `id` is shown with.
    pub(crate) fn nodeid(&self, id: InodeId) -> u64 {
        u64::from(id) + 1 + self.base
    }

    /// Logs an image that contradicts the walk that checked it (never
    /// expected: the walk reads everything these reads read).
    fn corrupt(&self, e: ImageError) -> i32 {
        tracing::warn!("{}: {e}", self.name);
        libc::EIO
    }

    fn id(&self, ino: u64) -> Option<InodeId> {
        let id = ino.checked_sub(1 + self.base)?;
        (id < self.view.len() as u64).then_some(id as InodeId)
    }

    /// Number of image inodes (ids are 0..len).
    pub(crate) fn len(&self) -> usize {
        self.view.len()
    }

    /// Parent of image directory `id` (the root is its own).
    pub(crate) fn parent(&self, id: InodeId) -> InodeId {
        self.view.parent(id)
    }

    /// Image inode `id` (a node with no type should the image be broken;
    /// [`try_node`](Self::try_node) says so).
    pub(crate) fn node(&self, id: InodeId) -> LowerNode<'_> {
        self.try_node(id).unwrap_or(LowerNode {
            lower: self,
            id,
            mode: 0,
            nlink: 0,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: 0,
            mtime: Timespec::default(),
            payload: None,
            content: None,
            digest: None,
        })
    }

    pub(crate) fn try_node(&self, id: InodeId) -> Result<LowerNode<'_>, i32> {
        let n = self.view.node(id).map_err(|e| self.corrupt(e))?;
        let a = n.attr;
        Ok(LowerNode {
            lower: self,
            id,
            mode: a.mode,
            nlink: a.nlink,
            uid: a.uid,
            gid: a.gid,
            rdev: a.rdev,
            size: a.size,
            mtime: a.mtime,
            payload: n.payload,
            content: n.content,
            digest: n.digest,
        })
    }

    /// The entries of directory `ino` (ENOTDIR if it is none), reading
    /// only its fixed fields: a lookup needs neither its attributes nor
    /// its xattrs.
    pub(crate) fn dir(&self, ino: u64) -> Result<Dir<'_>, i32> {
        let id = self.id(ino).ok_or(libc::ENOENT)?;
        self.view.try_dir(id).map_err(|e| self.corrupt(e))?.ok_or(libc::ENOTDIR)
    }

    pub(crate) fn inode(&self, ino: u64) -> Result<(InodeId, LowerNode<'_>), i32> {
        let id = self.id(ino).ok_or(libc::ENOENT)?;
        Ok((id, self.try_node(id)?))
    }

    /// The mode shown: a whiteout from the source shows as the marked empty
    /// regular file the image holds, as the kernel's overlay mount shows it.
    pub(crate) fn shown_mode(inode: &LowerNode) -> u32 {
        Self::shown(inode.mode, inode.rdev)
    }

    fn shown(mode: u32, rdev: u32) -> u32 {
        if mode & S_IFMT == S_IFCHR && rdev == 0 {
            S_IFREG | (mode & !S_IFMT)
        } else {
            mode
        }
    }

    /// The attributes of image inode `id`, as FUSE shows them.
    pub(crate) fn try_attr(&self, id: InodeId) -> Result<abi::Attr, i32> {
        let i = self.view.attr(id).map_err(|e| self.corrupt(e))?;
        let mode = Self::shown(i.mode, i.rdev);
        let size = if i.is_whiteout() { 0 } else { i.size };
        // Negative times travel as two's complement, as the kernel reads them.
        let (sec, nsec) = (i.mtime.sec as u64, i.mtime.nsec.min(999_999_999));
        Ok(abi::Attr {
            ino: self.nodeid(id),
            size,
            blocks: size.div_ceil(4096) * 8,
            atime: sec,
            mtime: sec,
            ctime: sec,
            atimensec: nsec,
            mtimensec: nsec,
            ctimensec: nsec,
            mode,
            nlink: i.nlink,
            uid: i.uid,
            gid: i.gid,
            rdev: if i.is_whiteout() { 0 } else { i.rdev },
            blksize: 4096,
            flags: 0,
        })
    }

    pub(crate) fn attr(&self, id: InodeId) -> abi::Attr {
        self.try_attr(id).unwrap_or(abi::Attr {
            ino: self.nodeid(id),
            blksize: 4096,
            ..abi::Attr::default()
        })
    }

    pub(crate) fn try_entry(&self, id: InodeId) -> Result<Entry, i32> {
        Ok(Entry {
            nodeid: self.nodeid(id),
            generation: 0,
            entry_ttl: FOREVER,
            attr_ttl: FOREVER,
            attr: self.try_attr(id)?,
        })
    }

    pub(crate) fn entry(&self, id: InodeId) -> Entry {
        Entry {
            nodeid: self.nodeid(id),
            generation: 0,
            entry_ttl: FOREVER,
            attr_ttl: FOREVER,
            attr: self.attr(id),
        }
    }

    /// The xattrs shown for an inode, sorted by name: the image's, plus the
    /// overlay markers of whiteouts and of the directories holding them.
    pub(crate) fn try_xattrs(&self, id: InodeId) -> Result<XattrList<'_>, i32> {
        let mut v = self.view.xattrs(id).map_err(|e| self.corrupt(e))?;
        let a = self.view.attr(id).map_err(|e| self.corrupt(e))?;
        let mut extra: Vec<(&[u8], &[u8])> = Vec::new();
        if a.is_whiteout() {
            extra.extend(WHITEOUT_XATTRS.iter().map(|k| (*k, &b""[..])));
        }
        if self.view.is_marked(id) {
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
        Ok(v)
    }

    pub(crate) fn xattrs(&self, id: InodeId) -> XattrList<'_> {
        self.try_xattrs(id).unwrap_or_default()
    }

    /// trusted.* xattrs are for privileged callers only, as the kernel
    /// checks CAP_SYS_ADMIN; uid 0 stands in for that capability here, in
    /// the initial user namespace only: a server mounted by the root of
    /// another (`podman unshare`) sees its root as uid 0, to whom the
    /// kernel then refuses the trusted.* names listed (ENODATA), which
    /// fails an overlay's copy-up of the file.
    /// POSIX ACLs exist only in images flagged as having them: the kernel
    /// mounts the others with `noacl`.
    pub(crate) fn visible(&self, uid: u32, key: &[u8]) -> bool {
        (!key.starts_with(b"trusted.") || (uid == 0 && initial_userns()))
            && (self.info.has_acl || !ACL_XATTRS.contains(&key))
    }

    /// Names answered with EOPNOTSUPP rather than ENODATA: ACLs when the
    /// image has none (as the kernel's `noacl` mount answers), and SELinux
    /// labels when no file has one (so `ls -l` stops asking, as it does on
    /// filesystems without labels, instead of making a round trip per file).
    pub(crate) fn unsupported(&self, key: &[u8]) -> bool {
        (!self.info.has_acl && ACL_XATTRS.contains(&key))
            || (self.selinux_enotsup && !self.view.has_selinux() && key == SELINUX)
    }

    /// Logs a broken object once for each way it is broken.
    pub(crate) fn report(&self, id: InodeId, what: &str) {
        let mut r = self.reported.lock().unwrap();
        if r.get(&id).map(String::as_str) != Some(what) {
            r.insert(id, what.to_string());
            drop(r);
            tracing::warn!("{}: {what}", self.path_of(id));
        }
    }

    /// A path of `id` for messages (its primary entry).
    pub(crate) fn path_of(&self, id: InodeId) -> String {
        let dir_path = |mut d: InodeId| {
            let mut parts = Vec::new();
            while d != tilefs_image::tree::ROOT {
                let p = self.parent(d);
                let name = self.node(p).entries().find(|e| e.inode == d && !e.hardlink);
                parts.push(name.map(|e| e.name).unwrap_or_default());
                d = p;
            }
            let mut path = Vec::new();
            for n in parts.iter().rev() {
                path.push(b'/');
                path.extend_from_slice(n);
            }
            path
        };
        let found = if self.view.attr(id).is_ok_and(|a| a.is_dir()) {
            Some(dir_path(id))
        } else {
            (0..self.len() as InodeId)
                .filter(|&d| self.view.attr(d).is_ok_and(|a| a.is_dir()))
                .find_map(|d| {
                    let e = self.node(d).entries().find(|e| e.inode == id && !e.hardlink)?;
                    let mut p = dir_path(d);
                    p.push(b'/');
                    p.extend_from_slice(e.name);
                    Some(p)
                })
        };
        match found {
            Some(p) if p.is_empty() => "/".to_string(),
            Some(p) => String::from_utf8_lossy(&p).into_owned(),
            None => format!("inode {}", self.nodeid(id)),
        }
    }

    /// Opens and checks the object of a regular file.
    pub(crate) fn open_checked(&self, inode: &LowerNode) -> Result<(File, Option<FileState>), ObjectError> {
        let payload = inode.payload.ok_or(ObjectError::BadPath)?;
        if self.verity == Verity::Require && inode.digest.is_none() {
            return Err(ObjectError::NoDigest);
        }
        let file = match open_object(&self.store, payload) {
            // Not fetched yet (a lazily pulled image): fetched, checked
            // against its name and stored whole, then opened as any other.
            Err(ObjectError::Open(e)) if e.kind() == std::io::ErrorKind::NotFound && self.fetcher.is_some() => {
                // (An image pulled from a table of contents names a file
                // not fetched yet by the SHA-256 of its contents: its
                // source knows it by that.)
                let digest = inode
                    .digest
                    .or_else(|| tilefs_store::parse_object_rel(payload))
                    .or_else(|| tilefs_store::alias::parse_alias_rel(payload))
                    .ok_or(ObjectError::Open(e))?;
                let fetcher = self.fetcher.as_ref().expect("checked above");
                tilefs_fuse_proto::may_block();
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

    /// The object of a regular file, opened and checked.
    pub(crate) fn object(&self, inode: &LowerNode) -> Result<Object, ObjectError> {
        let (file, key) = self.open_checked(inode)?;
        let digest = if self.verity == Verity::Off { None } else { inode.digest };
        Ok(Object {
            file,
            digest,
            key: key.unwrap_or_default(),
        })
    }

    /// Calls `add(offset, name, id)` for the directory's entries from
    /// `offset` on (`.` is 1, `..` 2, entry i is i + 3) until it returns true.
    pub(crate) fn list(&self, dir: InodeId, offset: u64, mut add: impl FnMut(u64, &[u8], InodeId) -> bool) {
        let mut off = offset;
        if off == 0 {
            if add(1, b".", dir) {
                return;
            }
            off = 1;
        }
        if off == 1 {
            if add(2, b"..", self.parent(dir)) {
                return;
            }
            off = 2;
        }
        let Some(mut it) = self.node(dir).entries_from(off - 2) else {
            return;
        };
        loop {
            let at = it.pos();
            let Some(e) = it.next() else {
                break;
            };
            if add(at.index + 3, e.name, e.inode) {
                // The next reply starts with this entry.
                let mut c = self.cursors.lock().unwrap();
                if c.len() >= MAX_CURSORS {
                    c.clear();
                }
                c.insert(dir, at);
                return;
            }
        }
    }

    pub(crate) fn permitted(uid: u32, gid: u32, inode: &LowerNode, mask: i32) -> bool {
        if uid == 0 {
            // Root may do anything but execute files no one may execute.
            return mask & libc::X_OK == 0 || inode.is_dir() || inode.mode & 0o111 != 0;
        }
        let bits = if uid == inode.uid {
            (inode.mode >> 6) & 7
        } else if gid == inode.gid {
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
