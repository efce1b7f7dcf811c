//! The image side of a mount: the tree read from the image, how its
//! inodes look through FUSE (as the kernel's composefs mount shows them),
//! and their contents, opened from the store and verified against the
//! image's digests. The read-only server serves it as it is; the writable
//! one uses it as its lower layer.

use crate::log::Logger;
use crate::objects::{open_object, FileState, ObjectError, VerifiedObjects};
use crate::Verity;
use rustc_hash::{FxHashMap, FxHashSet};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use tilefs_fuse_proto::abi;
use tilefs_fuse_proto::{Entry, Ttl};
use tilefs_image::erofs::ImageInfo;
use tilefs_image::tree::{Inode, InodeId, Tree, S_IFMT, S_IFREG};

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

/// The `d_type` of a mode, as READDIR gives it.
pub(crate) fn dirent_type(mode: u32) -> u32 {
    (mode & S_IFMT) >> 12
}

/// An object file opened (and checked, unless verity is off) for serving.
pub(crate) struct Object {
    pub(crate) file: File,
    /// What its data is checked against; None when nothing is checked.
    pub(crate) digest: Option<[u8; 32]>,
    /// The file's state when it was checked.
    pub(crate) key: FileState,
}

pub(crate) struct Lower {
    pub(crate) tree: Tree,
    pub(crate) info: ImageInfo,
    /// Parent of each directory (the root is its own).
    pub(crate) parent: Vec<InodeId>,
    /// Directories holding a whiteout (as a primary entry).
    pub(crate) marked: FxHashSet<InodeId>,
    /// Some inode has a security.selinux label.
    has_selinux: bool,
    /// Answer getxattr of security.selinux with EOPNOTSUPP when no file
    /// has a label (see `Tuning::selinux_enotsup`).
    pub(crate) selinux_enotsup: bool,
    pub(crate) store: OwnedFd,
    pub(crate) verity: Verity,
    pub(crate) verified: VerifiedObjects,
    /// Objects already reported broken (by inode), so a file opened over
    /// and over logs once per state of its object.
    reported: Mutex<FxHashMap<InodeId, String>>,
    pub(crate) log: Arc<Logger>,
    /// Where absent objects come from (a lazily pulled image).
    pub(crate) fetcher: Option<crate::Fetcher>,
}

impl Lower {
    pub(crate) fn new(tree: Tree, info: ImageInfo, store: OwnedFd, verity: Verity, log: Arc<Logger>) -> Lower {
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
        Lower {
            tree,
            info,
            parent,
            marked,
            has_selinux,
            selinux_enotsup: true,
            store,
            verity,
            verified: VerifiedObjects::default(),
            reported: Mutex::new(FxHashMap::default()),
            log,
            fetcher: None,
        }
    }

    fn id(&self, ino: u64) -> Option<InodeId> {
        let id = ino.checked_sub(1)?;
        (id < self.tree.inodes.len() as u64).then_some(id as InodeId)
    }

    pub(crate) fn inode(&self, ino: u64) -> Result<(InodeId, &Inode), i32> {
        let id = self.id(ino).ok_or(libc::ENOENT)?;
        Ok((id, &self.tree.inodes[id as usize]))
    }

    /// The mode shown: a whiteout from the source shows as the marked empty
    /// regular file the image holds, as the kernel's overlay mount shows it.
    pub(crate) fn shown_mode(inode: &Inode) -> u32 {
        if inode.is_whiteout() {
            S_IFREG | (inode.mode & !S_IFMT)
        } else {
            inode.mode
        }
    }

    pub(crate) fn attr(&self, id: InodeId) -> abi::Attr {
        let i = &self.tree.inodes[id as usize];
        let mode = Self::shown_mode(i);
        let size = if i.is_whiteout() { 0 } else { i.size };
        // Negative times travel as two's complement, as the kernel reads them.
        let (sec, nsec) = (i.mtime.sec as u64, i.mtime.nsec.min(999_999_999));
        abi::Attr {
            ino: u64::from(id) + 1,
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
        }
    }

    pub(crate) fn entry(&self, id: InodeId) -> Entry {
        Entry {
            nodeid: u64::from(id) + 1,
            generation: 0,
            entry_ttl: FOREVER,
            attr_ttl: FOREVER,
            attr: self.attr(id),
        }
    }

    /// The xattrs shown for an inode, sorted by name: the image's, plus the
    /// overlay markers of whiteouts and of the directories holding them.
    pub(crate) fn xattrs(&self, id: InodeId) -> Vec<(&[u8], &[u8])> {
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
    pub(crate) fn visible(&self, uid: u32, key: &[u8]) -> bool {
        (!key.starts_with(b"trusted.") || uid == 0) && (self.info.has_acl || !ACL_XATTRS.contains(&key))
    }

    /// Names answered with EOPNOTSUPP rather than ENODATA: ACLs when the
    /// image has none (as the kernel's `noacl` mount answers), and SELinux
    /// labels when no file has one (so `ls -l` stops asking, as it does on
    /// filesystems without labels, instead of making a round trip per file).
    pub(crate) fn unsupported(&self, key: &[u8]) -> bool {
        (!self.info.has_acl && ACL_XATTRS.contains(&key))
            || (self.selinux_enotsup && !self.has_selinux && key == SELINUX)
    }

    /// Logs a broken object once for each way it is broken.
    pub(crate) fn report(&self, id: InodeId, what: &str) {
        let mut r = self.reported.lock().unwrap();
        if r.get(&id).map(String::as_str) != Some(what) {
            r.insert(id, what.to_string());
            drop(r);
            self.log.log(&format!("{}: {what}", self.path_of(id)));
        }
    }

    /// A path of `id` for messages (its primary entry).
    pub(crate) fn path_of(&self, id: InodeId) -> String {
        let mut found = None;
        self.tree.walk(|path, e, ino| {
            if found.is_none() && ino == id && !e.is_some_and(|e| e.hardlink) {
                found = Some(String::from_utf8_lossy(path).into_owned());
            }
        });
        found.unwrap_or_else(|| format!("inode {}", u64::from(id) + 1))
    }

    /// Opens and checks the object of a regular file.
    pub(crate) fn open_checked(&self, inode: &Inode) -> Result<(File, Option<FileState>), ObjectError> {
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

    /// The object of a regular file, opened and checked.
    pub(crate) fn object(&self, inode: &Inode) -> Result<Object, ObjectError> {
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

    pub(crate) fn permitted(uid: u32, gid: u32, inode: &Inode, mask: i32) -> bool {
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
