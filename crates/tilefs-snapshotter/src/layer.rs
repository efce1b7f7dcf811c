//! A committed snapshot's upper directory read as a layer: the entries an
//! OCI layer of the same changes would hold, in the form `tilefs pull`
//! reads layers into ([`LayerEntry`]), so that the chain's image is made
//! by the very code, and rules, that make a pulled image.
//!
//! The upper directory is in overlayfs's form, as containerd's differ
//! writes it (and as a container's writes leave it): a whiteout is a
//! character device 0/0, an opaque directory has `trusted.overlay.opaque`
//! = `y`, a file whose metadata only changed (metacopy) keeps its data in
//! the layers below, a directory renamed through the overlay has
//! `trusted.overlay.redirect` naming where its contents were below (a layer
//! cannot say "renamed", so it is written out whole: opaque, with the
//! entries it shows). Regular files of more than 64 bytes go into the
//! store: by [`Method::Move`] (linked in where no writer can reach them,
//! dropped where the store has their object already) when the caller
//! holds the upper directory from overlayfs (see [`crate::claim`]), else
//! copied.
//!
//! Moving a file in changes its inode (owner root, mode 0644, now shared
//! with the store): what it was is journaled first ([`Undo`]) so that a
//! Commit that fails, or a crash, gives the active snapshot back exactly
//! ([`restore`]). A copy changes nothing in the upper directory.
//!
//! The directory is untrusted: it is read through
//! [`tilefs_commit::upper::Dir`], which never follows a symlink or leaves
//! the directory.

use rayon::prelude::*;
use rustix::fd::OwnedFd;
use rustix::fs::{Mode, OFlags, ResolveFlags};
use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use tilefs_commit::upper::{Dir, BENEATH};
use tilefs_image::tree::{
    InodeId, Timespec, Tree, RECOMMENDED_INLINE_MAX, S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK, S_IFMT, S_IFREG,
};
use tilefs_oci::layer::{Content, Kind, LayerEntry, Meta};
use tilefs_store::ingest::{Ingest, Method, SourceFile};

/// Overlayfs's own markers in the upper directory (never file xattrs).
const OVERLAY_PREFIX: &[u8] = b"trusted.overlay.";

/// Why an upper directory could not be read as a layer.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// Reading the directory failed (its path and the system's error).
    #[error(transparent)]
    Read(#[from] tilefs_commit::CommitError),
    /// A metacopy file whose data the layers below do not hold.
    #[error("{}: a metacopy file whose data is not below it", path.display())]
    MetacopyWithoutData { path: PathBuf },
    #[error("{}: a metacopy file of {size} bytes over data of {below} bytes", path.display())]
    MetacopySize { path: PathBuf, size: u64, below: u64 },
    /// A file written to while it was read (the snapshot is in use).
    #[error("{}: changed size while being read", path.display())]
    ChangedSize { path: PathBuf },
    /// A file could not be put into the store.
    #[error("{}: cannot store it: {err}", path.display())]
    Import {
        path: PathBuf,
        err: tilefs_store::StoreError,
    },
    #[error("cannot start worker threads: {0}")]
    Threads(#[from] rayon::ThreadPoolBuildError),
}

/// What a layer holds, for `Usage`.
#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct LayerUsage {
    pub size: i64,
    pub inodes: i64,
}

/// What a regular file moved into the store was, to give it back: its
/// names in the upper directory (components), inode, owner, mode, times
/// and file capability (which a change of owner drops).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Undo {
    pub names: Vec<Vec<Vec<u8>>>,
    pub ino: u64,
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
    pub atime: (i64, i64),
    pub mtime: (i64, i64),
    pub capability: Option<Vec<u8>>,
}

const CAPABILITY: &[u8] = b"security.capability";

/// A directory being walked: where its contents were in the layers below
/// (`/`-joined, "" for the root; None if nowhere), and whether the layer
/// must state it whole (it or a parent was renamed: the layers below do
/// not have it at this path).
struct Walk {
    dir: Dir,
    rel: Vec<Vec<u8>>,
    below: Option<Vec<u8>>,
    whole: bool,
}

fn below_join(at: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = at.to_vec();
    p.push(b'/');
    p.extend_from_slice(name);
    p
}

/// Where a redirect (absolute, or relative to the parent's place below)
/// points in the layers below.
fn resolve_redirect(parent_below: Option<&[u8]>, r: &[u8]) -> Option<Vec<u8>> {
    if r.starts_with(b"/") {
        Some(r.to_vec())
    } else {
        parent_below.map(|p| below_join(p, r))
    }
}

/// Reads the upper directory `upper` as a layer over `below` (the chain's
/// tree so far, where a metacopy file finds its data and a renamed
/// directory its contents). `journal` gets what the files to move were,
/// before any of them changes (nothing, if `ingest` copies).
pub fn read_upper(
    upper: &Path,
    ingest: &Ingest<'_>,
    below: &Tree,
    journal: impl FnOnce(&[Undo]) -> crate::Result<()>,
) -> crate::Result<(Vec<LayerEntry>, LayerUsage)> {
    let root = Dir::open_root(upper).map_err(read_err)?;
    let mut out = Vec::new();
    let mut usage = LayerUsage::default();
    let mut links: HashMap<(u64, u64), Vec<Vec<u8>>> = HashMap::new();
    // Each inode's names in the layer: a file with others is copied.
    let mut names_of: HashMap<(u64, u64), u64> = HashMap::new();
    let mut pending: Vec<Pending> = Vec::new();
    // Depth first, by name: a hardlinked file's first name is the one a
    // walk in dump order meets first.
    // The root's own metadata, as a layer's `./` entry gives it (the
    // directory is made 0755, root's, time zero, as a layer without one
    // implies it). Its overlayfs markers are not the layer's: an opaque
    // root (containerd's differ marks it for a layer's root `.wh..wh..opq`)
    // hides nothing, as the kernel ignores it (see `tilefs_oci::apply`).
    let st = rustix::fs::fstat(&root.fd).map_err(|e| crate::Error::io(upper, "cannot stat", e.into()))?;
    out.push(LayerEntry {
        path: Vec::new(),
        kind: Kind::Dir,
        meta: Meta {
            perm: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            mtime: Timespec {
                sec: st.st_mtime,
                nsec: st.st_mtime_nsec as u32,
            },
            xattrs: root
                .xattrs(None)
                .map_err(read_err)?
                .into_iter()
                .filter(|(k, _)| !k.starts_with(OVERLAY_PREFIX))
                .collect(),
        },
    });
    let mut stack = vec![Walk {
        dir: root,
        rel: Vec::new(),
        below: Some(Vec::new()),
        whole: false,
    }];
    let mut copied: HashMap<InodeId, Vec<Vec<u8>>> = HashMap::new();
    while let Some(Walk {
        dir,
        rel,
        below: at_below,
        whole,
    }) = stack.pop()
    {
        let mut subdirs = Vec::new();
        let names = dir.names().map_err(read_err)?;
        for name in &names {
            let name = name.clone();
            let mut path = rel.clone();
            path.push(name.to_bytes().to_vec());
            let Some(st) = dir.stat(&name).map_err(read_err)? else {
                continue;
            };
            let shown = dir.join(name.to_bytes());
            let raw = dir.xattrs(Some(&name)).map_err(read_err)?;
            let marker = |k: &str| {
                raw.iter()
                    .find(|(key, _)| key.strip_prefix(OVERLAY_PREFIX) == Some(k.as_bytes()))
                    .map(|(_, v)| v.clone())
            };
            let meta = Meta {
                perm: st.st_mode & 0o7777,
                uid: st.st_uid,
                gid: st.st_gid,
                mtime: Timespec {
                    sec: st.st_mtime,
                    nsec: st.st_mtime_nsec as u32,
                },
                xattrs: raw
                    .iter()
                    .filter(|(k, _)| !k.starts_with(OVERLAY_PREFIX))
                    .cloned()
                    .collect(),
            };
            let typ = st.st_mode & S_IFMT;
            usage.inodes += 1;
            let kind = match typ {
                // In a directory stated whole, a whiteout only keeps a name
                // of the renamed directory from being copied.
                S_IFCHR if st.st_rdev == 0 && whole => continue,
                S_IFCHR if st.st_rdev == 0 => {
                    out.push(LayerEntry {
                        path,
                        kind: Kind::Whiteout,
                        meta: Meta::default(),
                    });
                    continue;
                }
                S_IFDIR => {
                    let redirect = marker("redirect");
                    let opaque = marker("opaque").as_deref() == Some(b"y");
                    // Whether this layer hides the layers' below at this
                    // path (a parent stated whole hid them already).
                    if (redirect.is_some() || opaque) && !whole {
                        out.push(LayerEntry {
                            path: path.clone(),
                            kind: Kind::Opaque,
                            meta: Meta::default(),
                        });
                    }
                    let child_below = if let Some(r) = &redirect {
                        resolve_redirect(at_below.as_deref(), r)
                    } else if opaque {
                        None
                    } else {
                        at_below.as_deref().map(|b| below_join(b, name.to_bytes()))
                    };
                    subdirs.push((name.clone(), path.clone(), child_below, whole || redirect.is_some()));
                    Kind::Dir
                }
                S_IFREG if marker("metacopy").is_some() => {
                    // Metadata only: the data is a file of the layers below.
                    let (size, content) = metacopy_data(
                        below,
                        at_below.as_deref(),
                        name.to_bytes(),
                        marker("redirect").as_deref(),
                    )
                    .ok_or_else(|| LayerError::MetacopyWithoutData { path: shown.clone() })?;
                    let size = size.unwrap_or(st.st_size as u64);
                    if size != st.st_size as u64 {
                        return Err(LayerError::MetacopySize {
                            path: shown,
                            size: st.st_size as u64,
                            below: size,
                        }
                        .into());
                    }
                    Kind::File { size, content }
                }
                S_IFREG => {
                    let size = st.st_size as u64;
                    if st.st_nlink > 1 {
                        let id = (st.st_dev, st.st_ino);
                        *names_of.entry(id).or_default() += 1;
                        if let Some(first) = links.get(&id) {
                            out.push(LayerEntry {
                                path,
                                kind: Kind::Hardlink(first.clone()),
                                meta,
                            });
                            continue;
                        }
                        links.insert(id, path.clone());
                    }
                    usage.size += size as i64;
                    let content = if size > RECOMMENDED_INLINE_MAX {
                        // Moved in parallel once the walk is done.
                        pending.push(Pending {
                            entry: out.len(),
                            dir: rel.iter().map(|c| OsStr::from_bytes(c)).collect(),
                            name: name.clone(),
                            stat: st,
                            path: shown,
                            names: 1,
                        });
                        Content::Pending(0)
                    } else {
                        let data = dir
                            .read_file(&name, RECOMMENDED_INLINE_MAX as usize + 1)
                            .map_err(read_err)?;
                        if data.len() as u64 != size {
                            return Err(LayerError::ChangedSize { path: shown }.into());
                        }
                        Content::Inline(data)
                    };
                    Kind::File { size, content }
                }
                S_IFLNK => Kind::Symlink(dir.readlink(&name).map_err(read_err)?),
                S_IFCHR | S_IFBLK => Kind::Device {
                    mode_type: typ,
                    // The kernel's 32-bit encoding is the low half of the 64-bit one.
                    rdev: st.st_rdev as u32,
                },
                S_IFIFO => Kind::Fifo,
                // Sockets are no layer content (tar has none).
                _ => continue,
            };
            out.push(LayerEntry { path, kind, meta });
        }
        // A directory stated whole shows, besides its own entries, those
        // of its place below that it neither replaced nor removed.
        if whole {
            if let Some(id) = at_below.as_deref().and_then(|b| below.lookup_path(b)) {
                let n = below.inode(id);
                if n.is_dir() {
                    for e in &n.entries {
                        if names.binary_search_by(|x| x.to_bytes().cmp(&e.name)).is_err() {
                            let mut path = rel.clone();
                            path.push(e.name.clone());
                            copy_below(below, e.inode, path, &mut out, &mut copied, &mut usage);
                        }
                    }
                }
            }
        }
        // Pushed in reverse: popped, and so walked, in name order.
        for (name, path, child_below, child_whole) in subdirs.into_iter().rev() {
            stack.push(Walk {
                dir: open_sub(&dir, &name)?,
                rel: path,
                below: child_below,
                whole: child_whole,
            });
        }
    }
    let moving = ingest.method() == Method::Move;
    journal(&if moving { undo_of(&pending, &out) } else { Vec::new() })?;
    for p in &mut pending {
        p.names = names_of.get(&(p.stat.st_dev, p.stat.st_ino)).copied().unwrap_or(1);
    }
    import_all(upper, ingest, &pending, &mut out)?;
    Ok((out, usage))
}

/// The journal of the files about to be moved: each with all its names
/// (a hardlinked file's others are the layer's hardlinks to it).
fn undo_of(pending: &[Pending], out: &[LayerEntry]) -> Vec<Undo> {
    let mut others: HashMap<&[Vec<u8>], Vec<Vec<Vec<u8>>>> = HashMap::new();
    for e in out {
        if let Kind::Hardlink(target) = &e.kind {
            others.entry(target.as_slice()).or_default().push(e.path.clone());
        }
    }
    pending
        .iter()
        .map(|p| {
            let e = &out[p.entry];
            let mut names = vec![e.path.clone()];
            names.extend(others.get(e.path.as_slice()).cloned().unwrap_or_default());
            Undo {
                names,
                ino: p.stat.st_ino,
                uid: p.stat.st_uid,
                gid: p.stat.st_gid,
                mode: p.stat.st_mode & 0o7777,
                atime: (p.stat.st_atime, p.stat.st_atime_nsec as i64),
                mtime: (p.stat.st_mtime, p.stat.st_mtime_nsec as i64),
                capability: e
                    .meta
                    .xattrs
                    .iter()
                    .find(|(k, _)| k == CAPABILITY)
                    .map(|(_, v)| v.clone()),
            }
        })
        .collect()
}

/// The entries of inode `id` of the layers below (and, a directory, all
/// below it), restated at `path`. A file met twice is a hardlink to its
/// first path.
fn copy_below(
    below: &Tree,
    id: InodeId,
    path: Vec<Vec<u8>>,
    out: &mut Vec<LayerEntry>,
    copied: &mut HashMap<InodeId, Vec<Vec<u8>>>,
    usage: &mut LayerUsage,
) {
    let n = below.inode(id);
    let meta = Meta {
        perm: n.mode & 0o7777,
        uid: n.uid,
        gid: n.gid,
        mtime: n.mtime,
        xattrs: n
            .xattrs
            .iter()
            .filter(|x| !x.key.starts_with(OVERLAY_PREFIX))
            .map(|x| (x.key.clone(), x.value.clone()))
            .collect(),
    };
    usage.inodes += 1;
    let typ = n.mode & S_IFMT;
    let kind = match typ {
        S_IFDIR => {
            out.push(LayerEntry {
                path: path.clone(),
                kind: Kind::Dir,
                meta,
            });
            for e in &n.entries {
                let mut p = path.clone();
                p.push(e.name.clone());
                copy_below(below, e.inode, p, out, copied, usage);
            }
            return;
        }
        S_IFREG => {
            if let Some(first) = copied.get(&id) {
                Kind::Hardlink(first.clone())
            } else {
                copied.insert(id, path.clone());
                usage.size += n.size as i64;
                let content = match n.digest {
                    Some(d) => Content::Object(d),
                    None => Content::Inline(n.content.clone().unwrap_or_default()),
                };
                Kind::File { size: n.size, content }
            }
        }
        S_IFLNK => Kind::Symlink(n.payload.clone().unwrap_or_default()),
        S_IFCHR | S_IFBLK => Kind::Device {
            mode_type: typ,
            rdev: n.rdev,
        },
        S_IFIFO => Kind::Fifo,
        _ => return,
    };
    out.push(LayerEntry { path, kind, meta });
}

/// Opens the directory of `name` (components) below `root`, never through
/// a link; with the last component.
fn parent_of<'a>(root: &OwnedFd, name: &'a [Vec<u8>]) -> Result<(OwnedFd, &'a [u8]), rustix::io::Errno> {
    let (last, dirs) = name.split_last().ok_or(rustix::io::Errno::INVAL)?;
    let rel: PathBuf = dirs.iter().map(|c| OsStr::from_bytes(c)).collect();
    let fd = if rel.as_os_str().is_empty() {
        rustix::fs::openat(
            root,
            c".",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?
    } else {
        rustix::fs::openat2(
            root,
            &rel,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            BENEATH,
        )?
    };
    Ok((fd, last))
}

/// Gives the upper directory `upper` back the files a failed (or crashed)
/// Commit moved into the store: each file whose inode the store shares is
/// replaced by a copy (so the store's object stays as it is and the
/// snapshot's file is its own again), each gets its owner, mode, times
/// and file capability back. Idempotent: a name that no longer holds the
/// journaled inode is left alone.
pub fn restore(upper: &Path, undo: &[Undo]) -> crate::Result<()> {
    use rustix::fs::{AtFlags, Timestamps};
    let root = open_upper(upper)?;
    for u in undo {
        let shown = |n: &[Vec<u8>]| upper.join(n.iter().map(|c| OsStr::from_bytes(c)).collect::<PathBuf>());
        // The names that still hold the journaled inode.
        let mut olds = Vec::new();
        for n in &u.names {
            let Ok((dir, last)) = parent_of(&root, n) else { continue };
            match rustix::fs::statat(&dir, last, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) if st.st_ino == u.ino && st.st_mode & S_IFMT == S_IFREG => olds.push((dir, last, n)),
                _ => {}
            }
        }
        let Some((first_dir, first, first_name)) = olds.first() else {
            continue;
        };
        let path = shown(first_name);
        let fail = |what: &'static str, e: rustix::io::Errno| crate::Error::io(&path, what, e.into());
        let old = rustix::fs::openat(
            first_dir,
            *first,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| fail("cannot open", e))?;
        let st = rustix::fs::fstat(&old).map_err(|e| fail("cannot stat", e))?;
        let shared = st.st_nlink as usize > olds.len();
        let fd = if shared {
            // A copy beside it, then renamed over each of its names.
            let tmp = CString::new(format!(".tilefs-restore-{}", u.ino)).expect("no NUL");
            let _ = rustix::fs::unlinkat(first_dir, &tmp, AtFlags::empty());
            let new = rustix::fs::openat(
                first_dir,
                &tmp,
                OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )
            .map_err(|e| fail("cannot create its copy", e))?;
            let mut from = std::fs::File::from(old);
            let mut to = std::fs::File::from(new);
            std::io::copy(&mut from, &mut to).map_err(|e| crate::Error::io(&path, "cannot copy", e))?;
            for (k, v) in xattrs_of(&from) {
                if k.as_slice() != CAPABILITY {
                    let k = CString::new(k).expect("xattr names have no NUL");
                    let _ = rustix::fs::fsetxattr(&to, &k, &v, rustix::fs::XattrFlags::empty());
                }
            }
            to.sync_all()
                .map_err(|e| crate::Error::io(&path, "cannot sync its copy", e))?;
            for (i, (dir, last, _)) in olds.iter().enumerate() {
                if i == 0 {
                    rustix::fs::renameat(first_dir, &tmp, dir, *last)
                } else {
                    // Another name of the same file: linked, then renamed over.
                    let tmp2 = CString::new(format!(".tilefs-restore-{}-{i}", u.ino)).expect("no NUL");
                    let _ = rustix::fs::unlinkat(dir, &tmp2, AtFlags::empty());
                    rustix::fs::linkat(first_dir, *first, dir, &tmp2, AtFlags::empty())
                        .and_then(|()| rustix::fs::renameat(dir, &tmp2, dir, *last))
                }
                .map_err(|e| fail("cannot put its copy in place", e))?;
            }
            rustix::fd::OwnedFd::from(to)
        } else {
            old
        };
        rustix::fs::fchown(
            &fd,
            Some(rustix::process::Uid::from_raw(u.uid)),
            Some(rustix::process::Gid::from_raw(u.gid)),
        )
        .map_err(|e| fail("cannot set its owner back", e))?;
        // After the owner: a change of owner clears setuid bits and the
        // capability.
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(u.mode)).map_err(|e| fail("cannot set its mode back", e))?;
        if let Some(cap) = &u.capability {
            rustix::fs::fsetxattr(&fd, c"security.capability", cap, rustix::fs::XattrFlags::empty())
                .map_err(|e| fail("cannot set its capability back", e))?;
        }
        let ts = |(sec, nsec): (i64, i64)| rustix::fs::Timespec {
            tv_sec: sec,
            tv_nsec: nsec as _,
        };
        rustix::fs::futimens(
            &fd,
            &Timestamps {
                last_access: ts(u.atime),
                last_modification: ts(u.mtime),
            },
        )
        .map_err(|e| fail("cannot set its times back", e))?;
    }
    Ok(())
}

/// A file's xattrs (those it lets us read).
fn xattrs_of(f: &std::fs::File) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut list = vec![0u8; 64 << 10];
    let Ok(n) = rustix::fs::flistxattr(f, &mut list) else {
        return Vec::new();
    };
    list[..n]
        .split(|&c| c == 0)
        .filter(|k| !k.is_empty())
        .filter_map(|k| {
            let name = CString::new(k).ok()?;
            let mut v = vec![0u8; 64 << 10];
            let m = rustix::fs::fgetxattr(f, &name, &mut v).ok()?;
            v.truncate(m);
            Some((k.to_vec(), v))
        })
        .collect()
}

/// A regular file to move into the store: entry `entry` of the layer.
struct Pending {
    entry: usize,
    /// Its directory, relative to the upper directory.
    dir: PathBuf,
    name: CString,
    stat: rustix::fs::Stat,
    path: PathBuf,
    /// Its names in the layer (its hardlinks there).
    names: u64,
}

/// The upper directory, opened without following a link on its way.
fn open_upper(upper: &Path) -> crate::Result<OwnedFd> {
    rustix::fs::openat2(
        rustix::fs::CWD,
        upper,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| crate::Error::io(upper, "cannot open", e.into()))
}

/// Moves the pending files into the store, on several threads (hashing a
/// cold file waits on the disk), and puts their digests in their entries.
fn import_all(upper: &Path, ingest: &Ingest<'_>, pending: &[Pending], out: &mut [LayerEntry]) -> crate::Result<()> {
    if pending.is_empty() {
        return Ok(());
    }
    let root = open_upper(upper)?;
    let one = |p: &Pending| -> crate::Result<[u8; 32]> {
        // Its directory again from the upper root, never through a link.
        let dir = if p.dir.as_os_str().is_empty() {
            rustix::fs::openat(
                &root,
                c".",
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
        } else {
            rustix::fs::openat2(
                &root,
                &p.dir,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
                BENEATH,
            )
        }
        .map_err(|e| crate::Error::io(&p.path, "cannot open its directory", e.into()))?;
        ingest
            .import_named(
                &SourceFile {
                    dir: rustix::fd::AsFd::as_fd(&dir),
                    name: &p.name,
                    path: &p.path,
                    stat: &p.stat,
                },
                p.names,
            )
            .map_err(|err| LayerError::Import {
                path: p.path.clone(),
                err,
            })
            .map_err(crate::Error::from)
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(tilefs_image::source::worker_threads(0).min(pending.len()))
        .thread_name(|i| format!("tilefs-layer-{i}"))
        .build()
        .map_err(LayerError::from)?;
    let digests: Vec<crate::Result<[u8; 32]>> = pool.install(|| pending.par_iter().map(one).collect());
    for (p, d) in pending.iter().zip(digests) {
        if let Kind::File { content, .. } = &mut out[p.entry].kind {
            *content = Content::Object(d?);
        }
    }
    Ok(())
}

/// A failure to read the upper directory.
fn read_err(e: tilefs_commit::CommitError) -> crate::Error {
    LayerError::Read(e).into()
}

fn open_sub(dir: &Dir, name: &CStr) -> crate::Result<Dir> {
    dir.open_dir(name).map_err(read_err)
}

/// The data a metacopy file `name` shows, in a directory whose place below
/// is `dir_below`: the regular file below at its redirect (absolute, or
/// relative to that place), or at its own name there, or, for a redirect
/// naming a store object (a copy-up over a data-only layer), that object.
fn metacopy_data(
    below: &Tree,
    dir_below: Option<&[u8]>,
    name: &[u8],
    redirect: Option<&[u8]>,
) -> Option<(Option<u64>, Content)> {
    let at = match redirect {
        Some(r) if r.starts_with(b"/") => {
            if let Some(d) = tilefs_store::parse_object_rel(&r[1..]) {
                // The object names its bytes; their count is the file's.
                return Some((None, Content::Object(d)));
            }
            r.to_vec()
        }
        Some(r) => resolve_redirect(dir_below, r)?,
        None => below_join(dir_below?, name),
    };
    let id = below.lookup_path(&at)?;
    let n = below.inode(id);
    if !n.is_reg() {
        return None;
    }
    let content = match (&n.content, n.digest) {
        (Some(c), _) if n.size <= RECOMMENDED_INLINE_MAX => Content::Inline(c.clone()),
        (_, Some(d)) => Content::Object(d),
        _ if n.size == 0 => Content::Inline(Vec::new()),
        _ => return None,
    };
    Some((Some(n.size), content))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::code;
    use tilefs_commit::CommitError;
    use tonic::Code;

    /// An upper directory read as a layer over an empty tree, its files
    /// copied into a new store: the entries, or the error.
    fn read(upper: &Path, store: &Path) -> crate::Result<Vec<LayerEntry>> {
        let store = tilefs_store::Store::create(store).unwrap();
        let ingest = Ingest::new(&store, Default::default()).unwrap();
        let below = Tree::new(tilefs_image::tree::Inode::new(S_IFDIR | 0o755));
        read_upper(upper, &ingest, &below, |_| Ok(())).map(|(entries, _)| entries)
    }

    #[test]
    fn a_missing_upper_directory_is_named_with_the_system_error() {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("gone");
        let e = read(&upper, &dir.path().join("store")).unwrap_err();
        match &e {
            crate::Error::Layer(LayerError::Read(CommitError::Io { path, err, .. })) => {
                assert_eq!(
                    (path.as_path(), err.kind()),
                    (upper.as_path(), std::io::ErrorKind::NotFound)
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().starts_with(&upper.display().to_string()), "{e}");
        assert_eq!(code(&e), Code::Internal);
    }

    /// A metacopy file over nothing: the upper directory is not one
    /// overlayfs made over its parents (the marker is `trusted.`: root).
    #[test]
    fn a_metacopy_file_without_data_below_is_a_failed_precondition() {
        if !rustix::process::geteuid().is_root() {
            println!("skipped: setting trusted.overlay.metacopy needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        std::fs::create_dir(&upper).unwrap();
        std::fs::write(upper.join("f"), b"").unwrap();
        rustix::fs::setxattr(
            upper.join("f"),
            "trusted.overlay.metacopy",
            b"",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        let e = read(&upper, &dir.path().join("store")).unwrap_err();
        match &e {
            crate::Error::Layer(LayerError::MetacopyWithoutData { path }) => assert_eq!(path, &upper.join("f")),
            other => panic!("{other:?}"),
        }
        assert_eq!(code(&e), Code::FailedPrecondition);
    }
}
