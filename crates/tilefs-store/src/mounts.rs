//! Live mounts as gc roots: `STORE/.mounts/`.
//!
//! An image mounted by file path (not by tag) references objects that no
//! tag protects; gc would remove them under a running mount. So every
//! mount records a copy of its image here while it lives, and gc keeps the
//! objects of the records whose mount is still alive and removes the rest:
//!
//! - a FUSE mount's record is locked (`flock`, exclusive) by its server
//!   for as long as the server lives; the kernel drops the lock when the
//!   server ends, however it ends;
//! - a kernel mount has no process, so its record names the mount: its
//!   unique id (statx's `STATX_MNT_ID_UNIQUE`, never reused) and the id of
//!   the mount namespace it is in. It is alive while `statmount` finds
//!   that mount in that namespace, whichever namespace gc runs in:
//!   `tilefs mount` may run in a namespace of its own, the mount service
//!   (sandboxed, say) in its own, and a client in a user namespace attaches
//!   the mount the service hands it in its own. A namespace gc may
//!   not look into (a non-root gc, another user's namespace) keeps the
//!   record: what cannot be told dead is alive. A mount the service
//!   hands over detached (to a client in a user namespace, which attaches
//!   it itself) is alive for [`HANDOVER_GRACE`] before it is found, while
//!   the namespace it is for lives. On a
//!   kernel without these ids, as before them: the mount point is the root
//!   of the mount with the recorded `/proc` id, in gc's namespace.
//!
//! A record is one file: a header line
//! `tilefs-mount-record 1 fuse|kernel MOUNT_ID WHERE[ UNIQUE_ID MNTNS_ID]\n`,
//! then the image's bytes. For a kernel mount WHERE is `HEX(MOUNTPOINT)`,
//! or `-` for one handed over detached, and MOUNT_ID the id `/proc` shows
//! (tilefs commit finds a mount by it); for a FUSE mount
//! (whose id is unknown when it is recorded, so 0) it is `-` or
//! `HEX(MOUNTPOINT)`, followed for a writable mount by
//! `:HEX(UPPER):HEX(WORK):trusted|user` (its layers and the namespace of
//! its overlay xattrs, for `tilefs commit`): one field, so that readers
//! of the first form read it too. Records are written into `.tmp/` and renamed into
//! place under the store's shared lock, so gc (exclusive) sees either none
//! or a whole one. They are not synced: no mount outlives a crash.

use crate::layout::{temp_name, TMP_DIR};
use crate::{LockMode, Store, StoreError};
use rustix::fd::OwnedFd;
use rustix::fs::{self as rfs, AtFlags, FlockOperation, Mode, OFlags};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

pub use crate::layout::MOUNTS_DIR;
const MAGIC: &str = "tilefs-mount-record 1";
/// How long a kernel mount handed over detached counts as alive before it
/// is found attached (a client attaches it as soon as it has it; its
/// request waits 60 s at most).
pub const HANDOVER_GRACE: std::time::Duration = std::time::Duration::from_secs(120);

/// A FUSE mount's record, locked while this value (or a copy of its
/// descriptor in a forked server) lives.
pub struct MountRecord {
    dir: OwnedFd,
    name: String,
    fd: Option<OwnedFd>,
}

impl MountRecord {
    /// Closes this process's descriptor without removing the record (the
    /// parent of a forked server: the server's copy keeps it locked).
    pub fn leave(mut self) {
        self.fd = None;
    }
}

impl Drop for MountRecord {
    fn drop(&mut self) {
        if self.fd.take().is_some() {
            let _ = rfs::unlinkat(&self.dir, self.name.as_str(), AtFlags::empty());
        }
    }
}

/// The namespace of a writable mount's overlay xattrs (`overlay.opaque`,
/// `overlay.redirect`, ...): `trusted.` for the kernel and a privileged
/// FUSE server, `user.` for one without privilege.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverlayXattrs {
    Trusted,
    User,
}

impl OverlayXattrs {
    /// The prefix of its xattrs: `trusted.overlay.` or `user.overlay.`.
    pub fn prefix(self) -> &'static [u8] {
        match self {
            OverlayXattrs::Trusted => b"trusted.overlay.",
            OverlayXattrs::User => b"user.overlay.",
        }
    }

    fn word(self) -> &'static str {
        match self {
            OverlayXattrs::Trusted => "trusted",
            OverlayXattrs::User => "user",
        }
    }
}

/// A writable mount's layers, as its FUSE record names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpperLayer {
    pub upper: PathBuf,
    pub work: PathBuf,
    /// The namespace its server keeps overlay xattrs in (`trusted` when it
    /// runs with privilege, and then also applies owners itself).
    pub xattrs: OverlayXattrs,
}

/// Where a FUSE mount is, for its record: what `tilefs commit` needs to
/// find a writable mount's layers from its mount point.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FuseWhere {
    /// The mount point (canonical).
    pub mountpoint: Option<PathBuf>,
    pub upper: Option<UpperLayer>,
}

impl FuseWhere {
    fn field(&self) -> String {
        let Some(m) = &self.mountpoint else {
            return "-".into();
        };
        let mut f = hex::encode(m.as_os_str().as_bytes());
        if let Some(u) = &self.upper {
            f.push_str(&format!(
                ":{}:{}:{}",
                hex::encode(u.upper.as_os_str().as_bytes()),
                hex::encode(u.work.as_os_str().as_bytes()),
                u.xattrs.word()
            ));
        }
        f
    }

    fn parse(f: &str) -> Option<FuseWhere> {
        if f == "-" {
            return Some(FuseWhere::default());
        }
        let path = |h: &str| Some(PathBuf::from(std::ffi::OsStr::from_bytes(&hex::decode(h).ok()?)));
        let parts: Vec<&str> = f.split(':').collect();
        let upper = match parts.as_slice() {
            [_] => None,
            [_, u, w, ns] => Some(UpperLayer {
                upper: path(u)?,
                work: path(w)?,
                xattrs: match *ns {
                    "trusted" => OverlayXattrs::Trusted,
                    "user" => OverlayXattrs::User,
                    _ => return None,
                },
            }),
            _ => return None,
        };
        Some(FuseWhere {
            mountpoint: Some(path(parts[0])?),
            upper,
        })
    }
}

/// Records a FUSE mount of `image` (its bytes), at `at`; the record stays a
/// gc root while the returned value, or a forked copy of its descriptor,
/// lives.
pub fn register_fuse(store: &Store, image: &[u8], at: &FuseWhere) -> Result<MountRecord, StoreError> {
    let name = temp_name("fuse-");
    let header = header_line(&RecordHeader::Fuse(at.clone()));
    let (dir, fd) = write_record(store, &name, &header, image, true)?;
    Ok(MountRecord {
        dir,
        name,
        fd: Some(fd),
    })
}

/// A kernel mount, as its record names it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelMount {
    /// The id `/proc` shows (statx's `STATX_MNT_ID`).
    pub mount_id: u64,
    /// Where it is (canonical); None for a mount handed over detached.
    pub mountpoint: Option<PathBuf>,
    /// Its unique id and its mount namespace's id, where the kernel has
    /// them (Linux 6.8 and 6.11).
    pub unique: Option<(u64, u64)>,
}

/// Records a kernel mount of `image` at `mountpoint` (canonical), the mount
/// with id `mount_id` (statx's `stx_mnt_id`) in this process's mount
/// namespace; gc removes the record once that mount is gone.
pub fn register_kernel(store: &Store, image: &[u8], mountpoint: &Path, mount_id: u64) -> Result<(), StoreError> {
    let unique = unique_mount_id(mountpoint).zip(own_mnt_ns_id());
    register_kernel_mount(
        store,
        image,
        &KernelMount {
            mount_id,
            mountpoint: Some(mountpoint.to_path_buf()),
            unique,
        },
    )
}

/// Records kernel mount `m` of `image`.
pub fn register_kernel_mount(store: &Store, image: &[u8], m: &KernelMount) -> Result<(), StoreError> {
    let name = format!("kernel-{}-{}", m.mount_id, temp_name(""));
    write_record(
        store,
        &name,
        &header_line(&RecordHeader::Kernel(m.clone())),
        image,
        false,
    )
    .map(drop)
}

/// What a record's header says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordHeader {
    Fuse(FuseWhere),
    Kernel(KernelMount),
}

/// A record's header line (with its newline).
pub fn header_line(h: &RecordHeader) -> String {
    match h {
        RecordHeader::Fuse(at) => format!("{MAGIC} fuse 0 {}\n", at.field()),
        RecordHeader::Kernel(m) => {
            let at = match &m.mountpoint {
                Some(p) => hex::encode(p.as_os_str().as_bytes()),
                None => "-".into(),
            };
            let unique = m.unique.map(|(u, ns)| format!(" {u} {ns}")).unwrap_or_default();
            format!("{MAGIC} kernel {} {at}{unique}\n", m.mount_id)
        }
    }
}

/// Reads a record's header line (without its newline), as found in a
/// store (untrusted).
pub fn parse_header(line: &[u8]) -> Result<RecordHeader, String> {
    let line = std::str::from_utf8(line).map_err(|_| "bad header".to_string())?;
    let fields: Vec<&str> = match line.strip_prefix(MAGIC) {
        Some(rest) if rest.starts_with(' ') => rest.split(' ').skip(1).collect(),
        _ => return Err("unknown header".into()),
    };
    match fields.as_slice() {
        ["fuse", "0", at] => Ok(RecordHeader::Fuse(
            FuseWhere::parse(at).ok_or("bad mount point or layers")?,
        )),
        ["kernel", id, mnt, unique @ ..] if unique.is_empty() || unique.len() == 2 => {
            let number = |s: &str| match s.parse::<u64>() {
                Ok(n) if n.to_string() == s => Ok(n),
                _ => Err("bad mount id".to_string()),
            };
            let mountpoint = match *mnt {
                "-" => None,
                h => {
                    let bytes = hex::decode(h).map_err(|_| "bad mount point")?;
                    if bytes.is_empty() || hex::encode(&bytes) != h {
                        return Err("bad mount point".into());
                    }
                    Some(PathBuf::from(std::ffi::OsStr::from_bytes(&bytes)))
                }
            };
            Ok(RecordHeader::Kernel(KernelMount {
                mount_id: number(id)?,
                mountpoint,
                unique: match unique {
                    [u, ns] => Some((number(u)?, number(ns)?)),
                    _ => None,
                },
            }))
        }
        _ => Err("unknown header".into()),
    }
}

/// The id of this process's mount namespace, where the kernel gives one.
pub fn own_mnt_ns_id() -> Option<u64> {
    let ns = std::fs::File::open("/proc/self/ns/mnt").ok()?;
    tilefs_sys::ns::mnt_ns_id(rustix::fd::AsFd::as_fd(&ns)).ok()
}

/// The unique id (never reused) of the mount whose root `path` is.
pub fn unique_mount_id(path: &Path) -> Option<u64> {
    mount_ids(rfs::CWD, path, rfs::StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE))
}

/// statx's STATX_MNT_ID_UNIQUE (Linux 6.8).
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

fn write_record(
    store: &Store,
    name: &str,
    header: &str,
    image: &[u8],
    lock: bool,
) -> Result<(OwnedFd, OwnedFd), StoreError> {
    // Not while gc decides what is referenced.
    let _lock = store.lock(LockMode::Shared, true)?;
    let dir = store.open_subdir(MOUNTS_DIR)?;
    let tmp = store.open_subdir(TMP_DIR)?;
    let at = store.join(MOUNTS_DIR);
    let fd = rfs::openat(
        &tmp,
        name,
        OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o644),
    )
    .map_err(|e| StoreError::io(&at, "cannot record the mount", e.into()))?;
    let mut f = std::fs::File::from(fd);
    // Not synced: a record matters only while its mount lives, and no
    // mount outlives a crash.
    let written = f.write_all(header.as_bytes()).and_then(|_| f.write_all(image));
    let fd = OwnedFd::from(f);
    let done = written
        .map_err(|e| StoreError::io(&at, "cannot record the mount", e))
        .and_then(|()| {
            if lock {
                rfs::flock(&fd, FlockOperation::NonBlockingLockExclusive)
                    .map_err(|e| StoreError::io(&at, "cannot lock the mount record", e.into()))?;
            }
            rfs::renameat(&tmp, name, &dir, name).map_err(|e| StoreError::io(&at, "cannot record the mount", e.into()))
        });
    if let Err(e) = done {
        let _ = rfs::unlinkat(&tmp, name, AtFlags::empty());
        return Err(e);
    }
    Ok((dir, fd))
}

/// A record found in the store.
#[derive(Debug)]
pub struct LiveMount {
    /// The record's path.
    pub path: PathBuf,
    /// `fuse` or `kernel`.
    pub kind: &'static str,
    /// The mount point (a FUSE mount's only when recorded with it).
    pub mountpoint: Option<PathBuf>,
    /// A kernel mount's id.
    pub mount_id: Option<u64>,
    /// A writable FUSE mount's layers.
    pub upper: Option<UpperLayer>,
    /// The mounted image's bytes.
    pub image: Vec<u8>,
}

/// The records of live mounts. With `remove_stale`, records whose mount
/// is gone are removed (call under the store's exclusive lock). A record
/// that cannot be read is an error: what it protects is unknown.
pub fn live_mounts(store: &Store, remove_stale: bool) -> Result<Vec<LiveMount>, StoreError> {
    let dir = match store.open_existing_subdir(MOUNTS_DIR) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(StoreError::io(&store.join(MOUNTS_DIR), "cannot open directory", e)),
    };
    let mut names: Vec<String> = std::fs::read_dir(store.join(MOUNTS_DIR))
        .map_err(|e| StoreError::io(&store.join(MOUNTS_DIR), "cannot read directory", e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    let mut live = Vec::new();
    for name in names {
        let path = store.join(MOUNTS_DIR).join(&name);
        let bad = |why: String| StoreError::Invalid(format!("{}: mount record: {why}", path.display()));
        let fd = match rfs::openat(
            &dir,
            name.as_str(),
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => continue,
            Err(e) => return Err(bad(io::Error::from(e).to_string())),
        };
        let st = rfs::fstat(&fd).map_err(|e| bad(io::Error::from(e).to_string()))?;
        if rfs::FileType::from_raw_mode(st.st_mode) != rfs::FileType::RegularFile {
            return Err(bad("not a regular file".into()));
        }
        let mut bytes = Vec::new();
        std::fs::File::from(fd.try_clone().map_err(|e| bad(e.to_string()))?)
            .read_to_end(&mut bytes)
            .map_err(|e| bad(e.to_string()))?;
        let nl = bytes
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| bad("no header".into()))?;
        let (kind, alive, mountpoint, mount_id, upper) = match parse_header(&bytes[..nl]).map_err(bad)? {
            RecordHeader::Fuse(at) => {
                // Locked by a living server: our shared try fails.
                let alive = rfs::flock(&fd, FlockOperation::NonBlockingLockShared).is_err();
                ("fuse", alive, at.mountpoint, None, at.upper)
            }
            RecordHeader::Kernel(m) => {
                let age = st.st_mtime.try_into().ok().and_then(|t: u64| {
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t))
                        .ok()
                });
                let alive = kernel_mount_alive(m.mount_id, m.mountpoint.as_deref(), m.unique, age);
                ("kernel", alive, m.mountpoint, Some(m.mount_id), None)
            }
        };
        if alive {
            live.push(LiveMount {
                path,
                kind,
                mountpoint,
                mount_id,
                upper,
                image: bytes.split_off(nl + 1),
            });
        } else if remove_stale {
            let _ = rfs::unlinkat(&dir, name.as_str(), AtFlags::empty());
        }
    }
    Ok(live)
}

/// Whether a kernel mount's record is of a live mount; `age`: how long
/// ago it was written.
fn kernel_mount_alive(
    mount_id: u64,
    mountpoint: Option<&Path>,
    unique: Option<(u64, u64)>,
    age: Option<std::time::Duration>,
) -> bool {
    if let Some((unique, ns)) = unique {
        match tilefs_sys::ns::mount_in_namespace(unique, ns) {
            Ok(true) => return true,
            // Handed over detached: perhaps not attached yet (while the
            // namespace it is for lives).
            Ok(false) => {
                return mountpoint.is_none()
                    && age.is_none_or(|a| a < HANDOVER_GRACE)
                    && tilefs_sys::ns::mount_namespace_exists(ns).unwrap_or(true)
            }
            // Not ours to look into: it may well be alive.
            Err(rustix::io::Errno::PERM | rustix::io::Errno::ACCESS) => return true,
            // A kernel without statmount: as before it.
            Err(_) => {}
        }
    }
    mountpoint.is_some_and(|m| mount_id_of(m) == Some(mount_id))
}

/// The id of the mount whose root `path` is, if it is one.
pub fn mount_id_of(path: &Path) -> Option<u64> {
    mount_ids(rfs::CWD, path, rfs::StatxFlags::MNT_ID)
}

/// The mount id statx gives with `which` (`MNT_ID` or the unique one) of
/// the mount whose root `path` is, if it is one.
fn mount_ids(dir: impl rustix::fd::AsFd, path: &Path, which: rfs::StatxFlags) -> Option<u64> {
    use rustix::fs::StatxAttributes;
    let st = rfs::statx(dir, path, AtFlags::SYMLINK_NOFOLLOW | AtFlags::NO_AUTOMOUNT, which).ok()?;
    let root = st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT)
        && st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT);
    (root && st.stx_mask & which.bits() == which.bits()).then_some(st.stx_mnt_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuse_records_live_while_locked() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(dir.path()).unwrap();
        let r = register_fuse(&s, b"image bytes", &FuseWhere::default()).unwrap();
        let live = live_mounts(&s, true).unwrap();
        assert_eq!(live.len(), 1);
        assert_eq!((live[0].kind, &live[0].image[..]), ("fuse", &b"image bytes"[..]));
        drop(r);
        assert!(live_mounts(&s, true).unwrap().is_empty());
        assert_eq!(std::fs::read_dir(dir.path().join(MOUNTS_DIR)).unwrap().count(), 0);

        // A server that died leaves an unlocked record: stale, removed
        // only when asked.
        register_fuse(&s, b"x", &FuseWhere::default()).unwrap().leave();
        let count = || std::fs::read_dir(dir.path().join(MOUNTS_DIR)).unwrap().count();
        assert!(live_mounts(&s, false).unwrap().is_empty());
        assert_eq!(count(), 1);
        assert!(live_mounts(&s, true).unwrap().is_empty());
        assert_eq!(count(), 0);
    }

    #[test]
    fn kernel_records_live_while_the_mount_does() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(&dir.path().join("s")).unwrap();
        // "/" is the root of a mount: its id makes the record live.
        let id = mount_id_of(Path::new("/")).unwrap();
        register_kernel(&s, b"img", Path::new("/"), id).unwrap();
        // A directory that is no mount root: stale.
        register_kernel(&s, b"img2", dir.path(), id).unwrap();
        let live = live_mounts(&s, true).unwrap();
        assert_eq!(live.len(), 1);
        assert_eq!(live[0].mountpoint.as_deref(), Some(Path::new("/")));
        assert_eq!(
            std::fs::read_dir(dir.path().join("s").join(MOUNTS_DIR))
                .unwrap()
                .count(),
            1
        );
    }

    #[test]
    fn kernel_records_by_unique_id_and_namespace() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(&dir.path().join("s")).unwrap();
        let (Some(unique), Some(ns)) = (unique_mount_id(Path::new("/")), own_mnt_ns_id()) else {
            eprintln!("this kernel gives no unique mount or namespace ids: nothing to check");
            return;
        };
        let root = KernelMount {
            mount_id: 0,
            mountpoint: Some("/nowhere".into()),
            unique: Some((unique, ns)),
        };
        // Found in its namespace: alive, wherever its recorded path leads.
        register_kernel_mount(&s, b"a", &root).unwrap();
        // No such mount there: gone; unless handed over just now.
        let gone = KernelMount {
            unique: Some((unique + (1 << 40), ns)),
            ..root.clone()
        };
        register_kernel_mount(&s, b"b", &gone).unwrap();
        let handed = KernelMount {
            mountpoint: None,
            ..gone.clone()
        };
        register_kernel_mount(&s, b"c", &handed).unwrap();
        // ... for a namespace that is no more: gone.
        let nowhere = KernelMount {
            unique: Some((unique + (1 << 40), u64::MAX - 1)),
            ..handed.clone()
        };
        register_kernel_mount(&s, b"d", &nowhere).unwrap();
        let mut live: Vec<Vec<u8>> = live_mounts(&s, true).unwrap().into_iter().map(|m| m.image).collect();
        live.sort();
        assert_eq!(live, [b"a".to_vec(), b"c".to_vec()]);
    }

    #[test]
    fn fuse_records_name_their_mount_point_and_layers() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(dir.path()).unwrap();
        let upper = UpperLayer {
            upper: PathBuf::from("/u p/\n:x"),
            work: PathBuf::from("/w"),
            xattrs: OverlayXattrs::User,
        };
        let at = FuseWhere {
            mountpoint: Some(PathBuf::from("/mnt/a b")),
            upper: Some(upper.clone()),
        };
        let _w = register_fuse(&s, b"img", &at).unwrap();
        let ro = FuseWhere {
            mountpoint: Some(PathBuf::from("/ro")),
            upper: None,
        };
        let _r = register_fuse(&s, b"img", &ro).unwrap();
        let mut live = live_mounts(&s, false).unwrap();
        live.sort_by(|a, b| a.mountpoint.cmp(&b.mountpoint));
        assert_eq!(live[0].mountpoint.as_deref(), Some(Path::new("/mnt/a b")));
        assert_eq!(live[0].upper.as_ref(), Some(&upper));
        assert_eq!(live[1].mountpoint.as_deref(), Some(Path::new("/ro")));
        assert_eq!(live[1].upper, None);
        // Still three fields after the magic: older readers parse it too.
        for l in &live {
            let bytes = std::fs::read(&l.path).unwrap();
            let header = &bytes[..bytes.iter().position(|&b| b == b'\n').unwrap()];
            assert_eq!(
                header.split(|&b| b == b' ').count(),
                5,
                "{}",
                String::from_utf8_lossy(header)
            );
        }
    }

    #[test]
    fn garbage_records_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(dir.path()).unwrap();
        std::fs::create_dir(dir.path().join(MOUNTS_DIR)).unwrap();
        std::fs::write(dir.path().join(MOUNTS_DIR).join("x"), b"junk\n").unwrap();
        let e = live_mounts(&s, true).unwrap_err().to_string();
        assert!(e.contains("mount record") && e.contains("unknown header"), "{e}");
    }
}
