//! The new tree: the image's tree with the upper directory applied, as the
//! mount shows it, so that writing it gives the bytes `tilefs build` of
//! the mount point gives.
//!
//! - Where the upper directory has no directory, the image's tree is taken
//!   as it is (no file of it read); where it has one, its entries hide the
//!   image's entries of the same names, whiteouts (character devices 0/0)
//!   remove them, and the directory's own metadata is the upper one's.
//! - An opaque directory (`overlay.opaque` = `y`) hides the image's; a
//!   moved one (`overlay.redirect`) merges the image directory it names
//!   (absolute, or a sibling when relative) instead of the one at its path.
//! - A kernel metacopy file (`overlay.metacopy`) is the upper file's
//!   metadata over the image file's data: the image's digest, unread.
//! - Without privilege (FUSE), `user.containers.override_stat` gives owners,
//!   mode and, for stand-in regular files, the type (a symlink's target is
//!   the stand-in's contents); `user.tilefs.x.NAME` is the xattr NAME.
//! - Overlay xattrs of the mount's namespace are its own and dropped,
//!   escaped ones (`overlay.overlay.X`) unescaped.
//! - As a directory build, every name is a file of its own (nlink 1):
//!   hardlinks of the image or the upper directory are split.
//!
//! The walk is depth first with an explicit stack: a deep upper directory
//! costs memory, not stack, and at most its depth in open descriptors.

use crate::find::Kind;
use crate::upper::{Dir, Xattrs};
use crate::CommitError;
use rustix::fd::BorrowedFd;
use rustix::fs::{AtFlags, Stat};
use std::ffi::{CStr, CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tilefs_image::erofs::ImageInfo;
use tilefs_image::tree::{
    self, digest_object_path, Entry, Inode, InodeId, Timespec, Tree, Xattr, EXTERNAL_XATTR_BUDGET, MAX_PAYLOAD_LEN,
    RECOMMENDED_INLINE_MAX, S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK, S_IFMT, S_IFREG, S_IFSOCK,
};
use tilefs_image::verity;
use tilefs_store::mounts::OverlayXattrs;

pub(crate) use tilefs_image::upper::{Override, KEPT_PREFIX, OVERRIDE};
const ACL_XATTRS: [&[u8]; 2] = [b"system.posix_acl_access", b"system.posix_acl_default"];
// What the mount shows on the image's whiteouts (stored as marked empty
// regular files) and on their directories.
const WHITEOUT_XATTRS: [&[u8]; 2] = [b"trusted.overlay.whiteout", b"user.overlay.whiteout"];
const WHITEOUTS_XATTRS: [&[u8]; 2] = [b"trusted.overlay.whiteouts", b"user.overlay.whiteouts"];
const OPAQUE_XATTRS: [&[u8]; 2] = [b"trusted.overlay.opaque", b"user.overlay.opaque"];

/// What the mount is made of.
pub(crate) struct Layers<'a> {
    /// The mount point, for messages about the tree.
    pub(crate) mount: &'a Path,
    pub(crate) lower: &'a Tree,
    pub(crate) info: &'a ImageInfo,
    pub(crate) kind: Kind,
    pub(crate) xattrs: OverlayXattrs,
    /// A FUSE server without privilege: owners in override xattrs.
    pub(crate) rootless: bool,
    /// A FUSE mount's root: under its writeback cache the kernel, not the
    /// server, keeps a written file's mtime (see [`Merger::shown_mtime`]).
    pub(crate) fuse_root: Option<BorrowedFd<'a>>,
}

/// An upper regular file whose data goes into the store.
pub(crate) struct Import {
    pub(crate) inode: InodeId,
    /// Its directory, relative to the upper directory.
    pub(crate) dir: PathBuf,
    pub(crate) name: CString,
    pub(crate) stat: Stat,
    /// For messages.
    pub(crate) path: PathBuf,
}

/// Image data the new tree needs in another form than the image holds it
/// (images not built from a directory: a dump's inline files of more than
/// 64 bytes, small external ones, objects named without a digest).
pub(crate) enum LowerData {
    /// Inline contents that become an object.
    Store(InodeId),
    /// An object to read: to inline it, or to learn its digest.
    Read(InodeId),
}

pub(crate) struct Merged {
    pub(crate) tree: Tree,
    pub(crate) imports: Vec<Import>,
    pub(crate) lower_data: Vec<LowerData>,
    /// Entries read from the upper directory (whiteouts included).
    pub(crate) upper_entries: u64,
}

/// A directory to fill: the new inode, its upper side and its image side.
struct Job {
    out: InodeId,
    /// Its path in the tree, relative to the root (and so to the upper
    /// directory, whose directories sit where the mount shows them).
    rel: PathBuf,
    upper: Option<UpperSide>,
    lower: Option<InodeId>,
}

enum UpperSide {
    /// Open already (the root).
    Open(Arc<Dir>),
    /// To be opened when filled: descriptors stay open for the depth of
    /// the walk only.
    Child { parent: Arc<Dir>, name: CString },
}

struct Merger<'a> {
    l: &'a Layers<'a>,
    out: Tree,
    imports: Vec<Import>,
    lower_data: Vec<LowerData>,
    upper_entries: u64,
    /// Directories of the image that hold a whiteout (as a primary entry).
    marked: Vec<bool>,
    /// Directories of the image placed in the new tree: overlayfs's own
    /// changes place each at most once (a rename leaves a whiteout), and a
    /// hand-made upper directory whose redirects place one again and again
    /// must not make the tree explode.
    placed: Vec<bool>,
    key_opaque: Vec<u8>,
    key_redirect: Vec<u8>,
    key_metacopy: Vec<u8>,
}

/// Merges `upper` (the open upper directory) over the image.
pub(crate) fn merge(l: &Layers<'_>, upper: Dir) -> Result<Merged, CommitError> {
    let key = |w: &str| [l.xattrs.prefix(), w.as_bytes()].concat();
    let mut marked = vec![false; l.lower.inodes.len()];
    for (id, inode) in l.lower.inodes.iter().enumerate() {
        if inode
            .entries
            .iter()
            .any(|e| !e.hardlink && l.lower.inodes.get(e.inode as usize).is_some_and(Inode::is_whiteout))
        {
            marked[id] = true;
        }
    }
    let mut m = Merger {
        l,
        out: Tree::new(Inode::new(S_IFDIR | 0o755)),
        imports: Vec::new(),
        lower_data: Vec::new(),
        upper_entries: 0,
        marked,
        placed: vec![false; l.lower.inodes.len()],
        key_opaque: key("opaque"),
        key_redirect: key("redirect"),
        key_metacopy: key("metacopy"),
    };
    // The root: always the upper directory's, merged with the image's root
    // unless opaque.
    let st = rustix::fs::fstat(&upper.fd).map_err(|e| crate::upper::at(&upper.path, "cannot stat", e))?;
    let raw = upper.xattrs(None)?;
    let over = if l.rootless { upper.own_xattr(OVERRIDE)? } else { None };
    let opaque = upper.own_xattr(&m.key_opaque)?.is_some_and(|v| v == b"y");
    let root = m.upper_inode(&upper.path, &st, over.as_deref(), raw)?;
    if root.mode & S_IFMT != S_IFDIR {
        return Err(CommitError::At {
            path: upper.path.clone(),
            reason: "the upper directory's override makes it no directory".into(),
        });
    }
    m.out.inodes[tree::ROOT as usize] = root;
    let root_job = Job {
        out: tree::ROOT,
        rel: PathBuf::new(),
        upper: Some(UpperSide::Open(Arc::new(upper))),
        lower: (!opaque).then_some(tree::ROOT),
    };
    if !opaque {
        m.placed[tree::ROOT as usize] = true;
    }
    m.fill(root_job)?;
    Ok(Merged {
        tree: m.out,
        imports: m.imports,
        lower_data: m.lower_data,
        upper_entries: m.upper_entries,
    })
}

impl Merger<'_> {
    /// Fills the job's directory and, depth first, everything below it.
    fn fill(&mut self, first: Job) -> Result<(), CommitError> {
        let mut stack = vec![first];
        while let Some(job) = stack.pop() {
            let dir = match job.upper {
                Some(UpperSide::Open(d)) => Some(d),
                Some(UpperSide::Child { parent, name }) => Some(Arc::new(parent.open_dir(&name)?)),
                None => None,
            };
            let entries = self.entries_of(dir.as_ref(), &job.rel, job.lower, &mut stack)?;
            self.out.inodes[job.out as usize].entries = entries;
        }
        Ok(())
    }

    /// The merged entries of one directory, sorted; subdirectories are
    /// pushed on `stack` to be filled.
    fn entries_of(
        &mut self,
        dir: Option<&Arc<Dir>>,
        rel: &Path,
        lower: Option<InodeId>,
        stack: &mut Vec<Job>,
    ) -> Result<Vec<Entry>, CommitError> {
        let names = match dir {
            Some(d) => d.names()?,
            None => Vec::new(),
        };
        let lower_entries: &[Entry] = match lower {
            Some(l) => &self.l.lower.inodes[l as usize].entries,
            None => &[],
        };
        let mut entries = Vec::with_capacity(names.len() + lower_entries.len());
        let (mut i, mut j) = (0, 0);
        // Both lists are sorted by name: merged in one pass.
        while i < names.len() || j < lower_entries.len() {
            let take_upper = match (names.get(i), lower_entries.get(j)) {
                (Some(u), Some(le)) => match u.to_bytes().cmp(&le.name) {
                    std::cmp::Ordering::Less => true,
                    std::cmp::Ordering::Equal => {
                        j += 1;
                        true
                    }
                    std::cmp::Ordering::Greater => false,
                },
                (Some(_), None) => true,
                _ => false,
            };
            if take_upper {
                let name = &names[i];
                i += 1;
                let d = dir.expect("names come from the upper directory");
                self.upper_entries += 1;
                if let Some(id) = self.upper_child(d, rel, name, lower, stack)? {
                    entries.push(Entry {
                        name: name.to_bytes().to_vec(),
                        inode: id,
                        hardlink: false,
                    });
                }
            } else {
                let e = &lower_entries[j];
                j += 1;
                let id = self.lower_child(e.inode, rel.join(OsStr::from_bytes(&e.name)), stack)?;
                entries.push(Entry {
                    name: e.name.clone(),
                    inode: id,
                    hardlink: false,
                });
            }
        }
        Ok(entries)
    }

    /// An image entry not hidden by the upper directory, as the mount shows
    /// it; a directory is queued to be filled from the image alone.
    fn lower_child(&mut self, lower: InodeId, rel: PathBuf, stack: &mut Vec<Job>) -> Result<InodeId, CommitError> {
        let inode = self.shown_lower(lower);
        let dir = inode.is_dir();
        if dir {
            self.place(lower, &rel)?;
        }
        let id = self.out.add_inode(inode);
        self.note_lower_data(id);
        if dir {
            stack.push(Job {
                out: id,
                rel,
                upper: None,
                lower: Some(lower),
            });
        }
        Ok(id)
    }

    /// Notes that image directory `lower` is shown at `rel`; an error if it
    /// is shown elsewhere already.
    fn place(&mut self, lower: InodeId, rel: &Path) -> Result<(), CommitError> {
        if std::mem::replace(&mut self.placed[lower as usize], true) {
            return Err(CommitError::At {
                path: self.l.mount.join(rel),
                reason: "an image directory the tree shows in another place too (the upper directory's \
                         redirects name a directory that was not moved away)"
                    .into(),
            });
        }
        Ok(())
    }

    /// An image inode as the mount shows it, without entries.
    fn shown_lower(&self, id: InodeId) -> Inode {
        let i = &self.l.lower.inodes[id as usize];
        let mut n = Inode {
            mode: i.mode,
            nlink: 1,
            uid: i.uid,
            gid: i.gid,
            rdev: i.rdev,
            size: i.size,
            mtime: i.mtime,
            payload: i.payload.clone(),
            content: i.content.clone(),
            digest: i.digest,
            xattrs: i.xattrs.clone(),
            entries: Vec::new(),
        };
        let mut extra: Vec<(&[u8], &[u8])> = Vec::new();
        if i.is_whiteout() {
            // The composefs "xattr whiteout": an empty marked regular file.
            n.mode = S_IFREG | (i.mode & !S_IFMT);
            n.size = 0;
            n.rdev = 0;
            n.payload = None;
            extra.extend(WHITEOUT_XATTRS.map(|k| (k, &b""[..])));
        }
        if i.is_dir() && self.marked[id as usize] {
            extra.extend(WHITEOUTS_XATTRS.map(|k| (k, &b""[..])));
            if self.l.info.version >= 1 {
                extra.extend(OPAQUE_XATTRS.map(|k| (k, &b"x"[..])));
            }
        }
        for (k, v) in extra {
            n.xattrs.retain(|x| x.key != k);
            n.xattrs.push(Xattr {
                key: k.to_vec(),
                value: v.to_vec(),
            });
        }
        if self.l.kind == Kind::Fuse && !self.l.info.has_acl {
            n.xattrs.retain(|x| !ACL_XATTRS.contains(&x.key.as_slice()));
        }
        n.xattrs.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        n
    }

    /// Notes what a regular file taken from the image needs beyond the
    /// image, as a directory build would store it: more than 64 bytes
    /// external with a digest, fewer inline.
    fn note_lower_data(&mut self, id: InodeId) {
        let n = &mut self.out.inodes[id as usize];
        if !n.is_reg() || n.size == 0 {
            return;
        }
        match (&n.content, n.size > RECOMMENDED_INLINE_MAX) {
            (Some(c), true) => {
                let d = verity::digest_bytes(c);
                n.digest = Some(d);
                n.payload = Some(digest_object_path(&d).into_bytes());
                self.lower_data.push(LowerData::Store(id));
            }
            (None, false) => self.lower_data.push(LowerData::Read(id)),
            (None, true) if n.digest.is_none() => self.lower_data.push(LowerData::Read(id)),
            _ => {}
        }
    }

    /// The image entry below `parent` that an upper entry named `name`
    /// with redirect `redirect` stands over.
    fn below(&self, parent: Option<InodeId>, name: &[u8], redirect: Option<&[u8]>) -> Option<InodeId> {
        let t = self.l.lower;
        match redirect {
            Some(r) if r.starts_with(b"/") => {
                let comps: Vec<&[u8]> = r.split(|&b| b == b'/').filter(|c| !c.is_empty()).collect();
                let mut cur = tree::ROOT;
                for (k, c) in comps.iter().enumerate() {
                    let i = &t.inodes[cur as usize];
                    if !i.is_dir() {
                        return None;
                    }
                    cur = i.entry(c)?.inode;
                    if k + 1 < comps.len() && !t.inodes[cur as usize].is_dir() {
                        return None;
                    }
                }
                Some(cur)
            }
            // A relative redirect names a sibling.
            Some(r) => t.inodes[parent? as usize].entry(r).map(|e| e.inode),
            None => t.inodes[parent? as usize].entry(name).map(|e| e.inode),
        }
    }

    /// One entry of an upper directory: None for a whiteout (or an entry
    /// gone since the listing).
    fn upper_child(
        &mut self,
        dir: &Arc<Dir>,
        rel: &Path,
        name: &CStr,
        parent_lower: Option<InodeId>,
        stack: &mut Vec<Job>,
    ) -> Result<Option<InodeId>, CommitError> {
        let path = dir.join(name.to_bytes());
        tree::validate_name(name.to_bytes()).map_err(|e| CommitError::At {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let Some(st) = dir.stat(name)? else {
            return Ok(None);
        };
        let disk = st.st_mode & S_IFMT;
        if disk == S_IFCHR && st.st_rdev == 0 {
            return Ok(None);
        }
        let over = if self.l.rootless && (disk == S_IFREG || disk == S_IFDIR) {
            dir.xattr(name, OVERRIDE)?
        } else {
            None
        };
        let raw = dir.xattrs(Some(name))?;
        let marker = |k: &[u8]| raw.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_slice());
        let opaque = disk == S_IFDIR && marker(&self.key_opaque) == Some(b"y");
        let redirect = marker(&self.key_redirect).map(<[u8]>::to_vec);
        let metacopy = self.l.kind == Kind::Kernel && disk == S_IFREG && marker(&self.key_metacopy).is_some();
        let mut inode = self.upper_inode(&path, &st, over.as_deref(), raw)?;
        let typ = inode.mode & S_IFMT;
        let stand_in = disk == S_IFREG && typ != S_IFREG;
        match typ {
            S_IFDIR if disk != S_IFDIR => {
                return Err(CommitError::At {
                    path,
                    reason: "a regular file whose override xattr says it is a directory".into(),
                })
            }
            S_IFDIR => {
                let below = if opaque {
                    None
                } else {
                    self.below(parent_lower, name.to_bytes(), redirect.as_deref())
                        .filter(|&b| self.l.lower.inodes[b as usize].is_dir())
                };
                let rel = rel.join(OsStr::from_bytes(name.to_bytes()));
                if let Some(b) = below {
                    self.place(b, &rel)?;
                }
                let id = self.out.add_inode(inode);
                stack.push(Job {
                    out: id,
                    rel,
                    upper: Some(UpperSide::Child {
                        parent: dir.clone(),
                        name: name.to_owned(),
                    }),
                    lower: below,
                });
                return Ok(Some(id));
            }
            S_IFREG if metacopy => {
                // The data is the image file's: its digest, not read.
                let below = self
                    .below(parent_lower, name.to_bytes(), redirect.as_deref())
                    .filter(|&b| self.l.lower.inodes[b as usize].is_reg())
                    .ok_or_else(|| CommitError::At {
                        path: path.clone(),
                        reason: "a metacopy file whose data is not in the image".into(),
                    })?;
                let data = self.shown_lower(below);
                if data.size != inode.size {
                    return Err(CommitError::At {
                        path,
                        reason: format!(
                            "a metacopy file of {} bytes over image data of {} bytes",
                            inode.size, data.size
                        ),
                    });
                }
                inode.content = data.content;
                inode.digest = data.digest;
                inode.payload = data.payload;
                let id = self.out.add_inode(inode);
                self.note_lower_data(id);
                return Ok(Some(id));
            }
            S_IFREG if !stand_in => self.shown_mtime(&mut inode, rel, name),
            _ => {}
        }
        match typ {
            S_IFREG if inode.size > RECOMMENDED_INLINE_MAX => {
                let id = self.out.add_inode(inode);
                self.imports.push(Import {
                    inode: id,
                    dir: rel.to_path_buf(),
                    name: name.to_owned(),
                    stat: st,
                    path,
                });
                return Ok(Some(id));
            }
            S_IFREG if inode.size > 0 => {
                let data = dir.read_file(name, RECOMMENDED_INLINE_MAX as usize + 1)?;
                if data.len() as u64 != inode.size {
                    return Err(CommitError::At {
                        path,
                        reason: format!(
                            "changed size while being read ({} bytes when examined, {} read)",
                            inode.size,
                            data.len()
                        ),
                    });
                }
                let d = verity::digest_bytes(&data);
                inode.digest = Some(d);
                inode.payload = Some(digest_object_path(&d).into_bytes());
                inode.content = Some(data);
            }
            S_IFLNK => {
                let target = if stand_in {
                    // The stand-in holds the target, as the server reads it.
                    dir.read_file(name, libc::PATH_MAX as usize)?
                } else {
                    dir.readlink(name)?
                };
                if target.is_empty() || target.len() > MAX_PAYLOAD_LEN {
                    return Err(CommitError::At {
                        path,
                        reason: format!("a symlink target of {} bytes", target.len()),
                    });
                }
                inode.size = target.len() as u64;
                inode.payload = Some(target);
            }
            S_IFREG | S_IFCHR | S_IFBLK | S_IFIFO | S_IFSOCK => {}
            _ => {
                return Err(CommitError::At {
                    path,
                    reason: format!("unknown file type (mode {:o})", inode.mode),
                })
            }
        }
        Ok(Some(self.out.add_inode(inode)))
    }

    /// A FUSE mount's writeback cache keeps a written file's mtime in the
    /// kernel, which tells the server with a SETATTR that the tilefs FUSE
    /// server may apply before the WRITEs it follows (the write then moves
    /// the upper file's mtime on): the mount shows the kernel's, and so
    /// does the commit. Nothing else is taken from the mount.
    fn shown_mtime(&self, inode: &mut Inode, rel: &Path, name: &CStr) {
        let Some(root) = self.l.fuse_root else { return };
        let at = if rel.as_os_str().is_empty() {
            PathBuf::from(OsStr::from_bytes(name.to_bytes()))
        } else {
            rel.join(OsStr::from_bytes(name.to_bytes()))
        };
        if let Ok(st) = rustix::fs::statat(root, &at, AtFlags::SYMLINK_NOFOLLOW) {
            if st.st_mode & S_IFMT == S_IFREG && st.st_size as u64 == inode.size {
                inode.mtime = Timespec {
                    sec: st.st_mtime,
                    nsec: st.st_mtime_nsec as u32,
                };
            }
        }
    }

    /// An upper entry's inode from its stat, override and xattrs.
    fn upper_inode(&self, path: &Path, st: &Stat, over: Option<&[u8]>, raw: Xattrs) -> Result<Inode, CommitError> {
        let disk = st.st_mode & S_IFMT;
        let mut n = Inode::new(st.st_mode);
        n.uid = st.st_uid;
        n.gid = st.st_gid;
        // The kernel's 32-bit encoding is the low half of the 64-bit one.
        n.rdev = st.st_rdev as u32;
        n.size = st.st_size as u64;
        n.mtime = Timespec {
            sec: st.st_mtime,
            nsec: st.st_mtime_nsec as u32,
        };
        // An override that does not parse is ignored, as the server does.
        if let Some(o) = over.and_then(Override::parse) {
            n.uid = o.uid;
            n.gid = o.gid;
            let typ = match o.typ {
                Some((t, rdev)) if disk == S_IFREG => {
                    n.rdev = rdev as u32;
                    if t != S_IFLNK {
                        n.size = 0;
                    }
                    t
                }
                _ => disk,
            };
            n.mode = typ | o.perm;
        }
        if n.mode & S_IFMT == S_IFDIR {
            n.size = 0;
        }
        let xattrs = self.shown_xattrs(raw);
        n.set_xattrs(xattrs.iter().map(|(k, v)| (k, v)), EXTERNAL_XATTR_BUDGET)
            .map_err(|e| CommitError::At {
                path: path.to_path_buf(),
                reason: format!("its xattrs: {e}"),
            })?;
        n.xattrs.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        Ok(n)
    }

    /// An upper entry's xattrs as the mount shows them.
    fn shown_xattrs(&self, raw: Xattrs) -> Xattrs {
        let prefix = self.l.xattrs.prefix();
        let fuse = self.l.kind == Kind::Fuse;
        let mut out: Vec<(Vec<u8>, Vec<u8>, bool)> = Vec::with_capacity(raw.len());
        for (k, v) in raw {
            let (key, kept) = if let Some(rest) = k.strip_prefix(prefix) {
                // The mount's own markers are hidden; escaped ones shown.
                match rest.strip_prefix(b"overlay.") {
                    Some(inner) => ([prefix, inner].concat(), false),
                    None => continue,
                }
            } else if fuse && k.starts_with(KEPT_PREFIX) {
                // Shown under their own name by a server without
                // privilege; hidden by one with it (it never writes them).
                if !self.l.rootless || k.len() == KEPT_PREFIX.len() {
                    continue;
                }
                (k[KEPT_PREFIX.len()..].to_vec(), true)
            } else if self.l.rootless && k == OVERRIDE {
                continue;
            } else {
                (k, false)
            };
            if fuse && !self.l.info.has_acl && ACL_XATTRS.contains(&key.as_slice()) {
                continue;
            }
            out.push((key, v, kept));
        }
        // A name both set and kept: the server reads the one set.
        out.sort_by(|a, b| a.0.cmp(&b.0).then(a.2.cmp(&b.2)));
        out.dedup_by(|later, first| later.0 == first.0);
        out.into_iter().map(|(k, v, _)| (k, v)).collect()
    }
}
