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
//! - a kernel mount has no process, so its record names the mount point
//!   and the mount's id: it is alive while that path is the root of the
//!   mount with that id (in gc's mount namespace).
//!
//! A record is one file: a header line
//! `tilefs-mount-record 1 fuse|kernel MOUNT_ID HEX(MOUNTPOINT)\n`, then
//! the image's bytes. Records are written into `.tmp/` and renamed into
//! place under the store's shared lock, so gc (exclusive) sees either none
//! or a whole one. They are not synced: no mount outlives a crash.

use crate::store::TMP_DIR;
use crate::tags::{open_existing_subdir, open_subdir, temp_name};
use crate::{LockMode, Store, StoreError};
use rustix::fd::OwnedFd;
use rustix::fs::{self as rfs, AtFlags, FlockOperation, Mode, OFlags};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

pub const MOUNTS_DIR: &str = ".mounts";
const MAGIC: &str = "tilefs-mount-record 1";

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

/// Records a FUSE mount of `image` (its bytes); the record stays a gc root
/// while the returned value, or a forked copy of its descriptor, lives.
pub fn register_fuse(store: &Store, image: &[u8]) -> Result<MountRecord, StoreError> {
    let name = temp_name("fuse-");
    let (dir, fd) = write_record(store, &name, &format!("{MAGIC} fuse 0 -\n"), image, true)?;
    Ok(MountRecord {
        dir,
        name,
        fd: Some(fd),
    })
}

/// Records a kernel mount of `image` at `mountpoint` (canonical), the mount
/// with id `mount_id` (statx's `stx_mnt_id`); gc removes the record once
/// that mount is gone.
pub fn register_kernel(store: &Store, image: &[u8], mountpoint: &Path, mount_id: u64) -> Result<(), StoreError> {
    let name = format!("kernel-{mount_id}-{}", temp_name(""));
    let header = format!(
        "{MAGIC} kernel {mount_id} {}\n",
        hex::encode(mountpoint.as_os_str().as_bytes())
    );
    write_record(store, &name, &header, image, false).map(drop)
}

fn write_record(
    store: &Store,
    name: &str,
    header: &str,
    image: &[u8],
    lock: bool,
) -> Result<(OwnedFd, OwnedFd), StoreError> {
    // Not while gc decides what is referenced.
    let _lock = store.lock(LockMode::Shared, true)?;
    let dir = open_subdir(store, MOUNTS_DIR)?;
    let tmp = open_subdir(store, TMP_DIR)?;
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
    /// The kernel mount's mount point.
    pub mountpoint: Option<PathBuf>,
    /// The mounted image's bytes.
    pub image: Vec<u8>,
}

/// The records of live mounts. With `remove_stale`, records whose mount
/// is gone are removed (call under the store's exclusive lock). A record
/// that cannot be read is an error: what it protects is unknown.
pub fn live_mounts(store: &Store, remove_stale: bool) -> Result<Vec<LiveMount>, StoreError> {
    let dir = match open_existing_subdir(store, MOUNTS_DIR) {
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
        let header = std::str::from_utf8(&bytes[..nl]).map_err(|_| bad("bad header".into()))?;
        let fields: Vec<&str> = header.strip_prefix(MAGIC).unwrap_or("").split_whitespace().collect();
        let (kind, alive, mountpoint) = match fields.as_slice() {
            ["fuse", _, _] => {
                // Locked by a living server: our shared try fails.
                let alive = rfs::flock(&fd, FlockOperation::NonBlockingLockShared).is_err();
                ("fuse", alive, None)
            }
            ["kernel", id, mnt] => {
                let id: u64 = id.parse().map_err(|_| bad("bad mount id".into()))?;
                let mnt = PathBuf::from(std::ffi::OsStr::from_bytes(
                    &hex::decode(mnt).map_err(|_| bad("bad mount point".into()))?,
                ));
                ("kernel", mount_id_of(&mnt) == Some(id), Some(mnt))
            }
            _ => return Err(bad("unknown header".into())),
        };
        if alive {
            live.push(LiveMount {
                path,
                kind,
                mountpoint,
                image: bytes.split_off(nl + 1),
            });
        } else if remove_stale {
            let _ = rfs::unlinkat(&dir, name.as_str(), AtFlags::empty());
        }
    }
    Ok(live)
}

/// The id of the mount whose root `path` is, if it is one.
pub fn mount_id_of(path: &Path) -> Option<u64> {
    use rustix::fs::{StatxAttributes, StatxFlags};
    let st = rfs::statx(
        rfs::CWD,
        path,
        AtFlags::SYMLINK_NOFOLLOW | AtFlags::NO_AUTOMOUNT,
        StatxFlags::MNT_ID,
    )
    .ok()?;
    let root = st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT)
        && st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT);
    root.then_some(st.stx_mnt_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuse_records_live_while_locked() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(dir.path()).unwrap();
        let r = register_fuse(&s, b"image bytes").unwrap();
        let live = live_mounts(&s, true).unwrap();
        assert_eq!(live.len(), 1);
        assert_eq!((live[0].kind, &live[0].image[..]), ("fuse", &b"image bytes"[..]));
        drop(r);
        assert!(live_mounts(&s, true).unwrap().is_empty());
        assert_eq!(std::fs::read_dir(dir.path().join(MOUNTS_DIR)).unwrap().count(), 0);

        // A server that died leaves an unlocked record: stale, removed
        // only when asked.
        register_fuse(&s, b"x").unwrap().leave();
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
    fn garbage_records_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(dir.path()).unwrap();
        std::fs::create_dir(dir.path().join(MOUNTS_DIR)).unwrap();
        std::fs::write(dir.path().join(MOUNTS_DIR).join("x"), b"junk\n").unwrap();
        let e = live_mounts(&s, true).unwrap_err().to_string();
        assert!(e.contains("mount record") && e.contains("unknown header"), "{e}");
    }
}
