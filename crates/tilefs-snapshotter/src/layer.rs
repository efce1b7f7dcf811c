//! A committed snapshot's upper directory read as a layer: the entries an
//! OCI layer of the same changes would hold, in the form `tilefs pull`
//! reads layers into ([`LayerEntry`]), so that the chain's image is made
//! by the very code, and rules, that make a pulled image.
//!
//! The upper directory is in overlayfs's form, as containerd's differ
//! writes it (and as a container's writes leave it): a whiteout is a
//! character device 0/0, an opaque directory has `trusted.overlay.opaque`
//! = `y`, a file whose metadata only changed (metacopy) keeps its data in
//! the layers below. Regular files of more than 64 bytes go into the
//! store by [`Method::Move`]: linked in, never copied, dropped where the
//! store has their object already.
//!
//! The directory is untrusted: it is read through
//! [`tilefs_commit::upper::Dir`], which never follows a symlink or leaves
//! the directory.

use rayon::prelude::*;
use rustix::fs::{Mode, OFlags, ResolveFlags};
use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use tilefs_commit::upper::{Dir, BENEATH};
use tilefs_image::tree::{
    Timespec, Tree, RECOMMENDED_INLINE_MAX, S_IFBLK, S_IFCHR, S_IFDIR, S_IFIFO, S_IFLNK, S_IFMT, S_IFREG,
};
use tilefs_oci::layer::{Content, Kind, LayerEntry, Meta};
use tilefs_store::ingest::{Ingest, SourceFile};

/// Overlayfs's own markers in the upper directory (never file xattrs).
const OVERLAY_PREFIX: &[u8] = b"trusted.overlay.";

/// What a layer holds, for `Usage`.
#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct LayerUsage {
    pub size: i64,
    pub inodes: i64,
}

/// Reads the upper directory `upper` as a layer over `below` (the chain's
/// tree so far, where a metacopy file finds its data).
pub fn read_upper(upper: &Path, ingest: &Ingest<'_>, below: &Tree) -> Result<(Vec<LayerEntry>, LayerUsage), String> {
    let root = Dir::open_root(upper).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let mut usage = LayerUsage::default();
    let mut links: HashMap<(u64, u64), Vec<Vec<u8>>> = HashMap::new();
    let mut pending: Vec<Pending> = Vec::new();
    // Depth first, by name: a hardlinked file's first name is the one a
    // walk in dump order meets first.
    // The root's own metadata, as a layer's `./` entry gives it (the
    // directory is made 0755, root's, time zero, as a layer without one
    // implies it).
    let st = rustix::fs::fstat(&root.fd).map_err(|e| format!("{}: cannot stat: {e}", upper.display()))?;
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
                .map_err(|e| e.to_string())?
                .into_iter()
                .filter(|(k, _)| !k.starts_with(OVERLAY_PREFIX))
                .collect(),
        },
    });
    let mut stack: Vec<(Dir, Vec<Vec<u8>>)> = vec![(root, Vec::new())];
    while let Some((dir, rel)) = stack.pop() {
        let mut subdirs = Vec::new();
        for name in dir.names().map_err(|e| e.to_string())? {
            let mut path = rel.clone();
            path.push(name.to_bytes().to_vec());
            let Some(st) = dir.stat(&name).map_err(|e| e.to_string())? else {
                continue;
            };
            let shown = dir.join(name.to_bytes());
            let raw = dir.xattrs(Some(&name)).map_err(|e| e.to_string())?;
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
                S_IFCHR if st.st_rdev == 0 => {
                    out.push(LayerEntry {
                        path,
                        kind: Kind::Whiteout,
                        meta: Meta::default(),
                    });
                    continue;
                }
                S_IFDIR => {
                    if marker("redirect").is_some() {
                        return Err(format!(
                            "{}: a directory renamed through the overlay (redirect) is not supported",
                            shown.display()
                        ));
                    }
                    if marker("opaque").as_deref() == Some(b"y") {
                        out.push(LayerEntry {
                            path: path.clone(),
                            kind: Kind::Opaque,
                            meta: Meta::default(),
                        });
                    }
                    subdirs.push((name.clone(), path.clone()));
                    Kind::Dir
                }
                S_IFREG if marker("metacopy").is_some() => {
                    // Metadata only: the data is a file of the layers below.
                    let (size, content) = metacopy_data(below, &path, marker("redirect").as_deref())
                        .ok_or_else(|| format!("{}: a metacopy file whose data is not below it", shown.display()))?;
                    let size = size.unwrap_or(st.st_size as u64);
                    if size != st.st_size as u64 {
                        return Err(format!(
                            "{}: a metacopy file of {} bytes over data of {size} bytes",
                            shown.display(),
                            st.st_size
                        ));
                    }
                    Kind::File { size, content }
                }
                S_IFREG => {
                    let size = st.st_size as u64;
                    if st.st_nlink > 1 {
                        let id = (st.st_dev, st.st_ino);
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
                        });
                        Content::Pending(0)
                    } else {
                        let data = dir
                            .read_file(&name, RECOMMENDED_INLINE_MAX as usize + 1)
                            .map_err(|e| e.to_string())?;
                        if data.len() as u64 != size {
                            return Err(format!("{}: changed size while being read", shown.display()));
                        }
                        Content::Inline(data)
                    };
                    Kind::File { size, content }
                }
                S_IFLNK => Kind::Symlink(dir.readlink(&name).map_err(|e| e.to_string())?),
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
        // Pushed in reverse: popped, and so walked, in name order.
        for (name, path) in subdirs.into_iter().rev() {
            stack.push((open_sub(&dir, &name)?, path));
        }
    }
    import_all(upper, ingest, &pending, &mut out)?;
    Ok((out, usage))
}

/// A regular file to move into the store: entry `entry` of the layer.
struct Pending {
    entry: usize,
    /// Its directory, relative to the upper directory.
    dir: PathBuf,
    name: CString,
    stat: rustix::fs::Stat,
    path: PathBuf,
}

/// Moves the pending files into the store, on several threads (hashing a
/// cold file waits on the disk), and puts their digests in their entries.
fn import_all(upper: &Path, ingest: &Ingest<'_>, pending: &[Pending], out: &mut [LayerEntry]) -> Result<(), String> {
    if pending.is_empty() {
        return Ok(());
    }
    let root = rustix::fs::openat2(
        rustix::fs::CWD,
        upper,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| format!("{}: cannot open: {e}", upper.display()))?;
    let one = |p: &Pending| -> Result<[u8; 32], String> {
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
        .map_err(|e| format!("{}: cannot open its directory: {e}", p.path.display()))?;
        ingest
            .import(&SourceFile {
                dir: rustix::fd::AsFd::as_fd(&dir),
                name: &p.name,
                path: &p.path,
                stat: &p.stat,
            })
            .map_err(|e| e.to_string())
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(tilefs_image::source::worker_threads(0).min(pending.len()))
        .thread_name(|i| format!("tilefs-layer-{i}"))
        .build()
        .map_err(|e| format!("cannot start worker threads: {e}"))?;
    let digests: Vec<Result<[u8; 32], String>> = pool.install(|| pending.par_iter().map(one).collect());
    for (p, d) in pending.iter().zip(digests) {
        if let Kind::File { content, .. } = &mut out[p.entry].kind {
            *content = Content::Object(d?);
        }
    }
    Ok(())
}

fn open_sub(dir: &Dir, name: &CStr) -> Result<Dir, String> {
    dir.open_dir(name).map_err(|e| e.to_string())
}

/// The data a metacopy file at `path` shows: the regular file below at
/// its redirect (absolute, or a sibling), or at its own path, or, for a
/// redirect naming a store object (a copy-up over a data-only layer), that
/// object.
fn metacopy_data(below: &Tree, path: &[Vec<u8>], redirect: Option<&[u8]>) -> Option<(Option<u64>, Content)> {
    let mut at: Vec<u8> = Vec::new();
    match redirect {
        Some(r) if r.starts_with(b"/") => {
            if let Some(d) = tilefs_store::parse_object_rel(&r[1..]) {
                // The object names its bytes; their count is the file's.
                return Some((None, Content::Object(d)));
            }
            at.extend_from_slice(r);
        }
        Some(r) => {
            for c in &path[..path.len() - 1] {
                at.push(b'/');
                at.extend_from_slice(c);
            }
            at.push(b'/');
            at.extend_from_slice(r);
        }
        None => {
            for c in path {
                at.push(b'/');
                at.extend_from_slice(c);
            }
        }
    }
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
