//! Which writable tilefs mount a mount point is: its image, its upper
//! directory, and how its server keeps overlay's markers there.
//!
//! The mount is identified by the kernel's id of the mount whose root
//! MNT is (statx), never by a path it was given: a kernel mount's record in
//! the store names that id, and mountinfo (the kernel's word) names its
//! upper directory, checked against the overlay's own uuid where it keeps
//! one. A FUSE mount's record names its mount point and layers; it is the
//! one recorded at the mount point mountinfo gives for that id, whose
//! server is alive (it holds the record's lock) and holds the upper
//! directory's lock.

use crate::upper::{Dir, BENEATH};
use crate::CommitError;
use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{AtFlags, FlockOperation, Mode, OFlags, StatxAttributes, StatxFlags};
use rustix::io::Errno;
use std::path::{Path, PathBuf};
use tilefs_mount::mountinfo::{self, MountEntry};
use tilefs_store::mounts::{self, OverlayXattrs};
use tilefs_store::Store;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// overlayfs over the image's EROFS mount (`tilefs mount --kernel`).
    Kernel,
    /// The tilefs FUSE server (`tilefs mount --fuse`).
    Fuse,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Kernel => "kernel",
            Kind::Fuse => "fuse",
        }
    }
}

/// A live writable mount.
pub(crate) struct Writable {
    pub(crate) kind: Kind,
    /// Its root, open (for syncfs).
    pub(crate) root: OwnedFd,
    /// The mounted image's bytes (from its record).
    pub(crate) image: Vec<u8>,
    pub(crate) upper: Dir,
    pub(crate) xattrs: OverlayXattrs,
    /// A FUSE server without privilege (owners in override xattrs).
    pub(crate) rootless: bool,
}

fn err(mnt: &Path, reason: impl Into<String>) -> CommitError {
    CommitError::At {
        path: mnt.to_path_buf(),
        reason: reason.into(),
    }
}

/// Finds the writable tilefs mount whose root `mnt` is, recorded in `store`.
pub(crate) fn find(store: &Store, mnt: &Path) -> Result<Writable, CommitError> {
    let root = rustix::fs::open(mnt, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).map_err(
        |e| match e {
            Errno::NOTCONN => err(mnt, "a FUSE mount whose server is gone"),
            Errno::NOTDIR => err(mnt, "not a directory"),
            e => crate::upper::at(mnt, "cannot open", e),
        },
    )?;
    let st = rustix::fs::statx(&root, "", AtFlags::EMPTY_PATH, StatxFlags::MNT_ID)
        .map_err(|e| crate::upper::at(mnt, "cannot stat", e))?;
    let is_root = st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT)
        && st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT);
    if !is_root {
        return Err(err(mnt, "not a mount point (give the root of a writable tilefs mount)"));
    }
    let id = st.stx_mnt_id;
    let entry = mountinfo::read()
        .map_err(|e| err(Path::new("/proc/self/mountinfo"), e.to_string()))?
        .into_iter()
        .find(|m| m.id == id)
        .ok_or_else(|| err(mnt, format!("mount {id} is not in /proc/self/mountinfo")))?;
    if !entry.is_tilefs() {
        return Err(err(
            mnt,
            format!("not a tilefs mount ({} from {})", entry.fstype, entry.source),
        ));
    }
    let w = if entry.fstype == "overlay" {
        kernel(store, mnt, root, &entry)?
    } else {
        fuse(store, mnt, root, &entry)?
    };
    // Without the capability the markers would be silently missing.
    if w.xattrs == OverlayXattrs::Trusted && !may_read_trusted() {
        return Err(err(
            mnt,
            "its upper directory keeps overlayfs's markers in trusted.* xattrs, which only root \
             (CAP_SYS_ADMIN) can read: commit it as root",
        ));
    }
    Ok(w)
}

fn may_read_trusted() -> bool {
    rustix::thread::capabilities(None).is_ok_and(|c| c.effective.contains(rustix::thread::CapabilitySet::SYS_ADMIN))
}

fn read_only(mnt: &Path) -> CommitError {
    err(
        mnt,
        "a read-only tilefs mount: nothing to commit (a writable mount has --upper and --work)",
    )
}

fn not_recorded(mnt: &Path, store: &Store, what: &str) -> CommitError {
    err(
        mnt,
        format!(
            "no live {what} of the store {} is recorded there (was it mounted with another --store?)",
            store.path().display()
        ),
    )
}

fn kernel(store: &Store, mnt: &Path, root: OwnedFd, entry: &MountEntry) -> Result<Writable, CommitError> {
    let opts: Vec<(&str, Option<&str>)> = entry
        .super_options
        .split(',')
        .map(|o| match o.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (o, None),
        })
        .collect();
    let opt = |k: &str| opts.iter().find(|(key, _)| *key == k).map(|(_, v)| *v);
    let upper = opt("upperdir").flatten().ok_or_else(|| read_only(mnt))?;
    if upper.starts_with("/proc/") {
        return Err(err(
            mnt,
            "a mount made by the mount service: its layers are the service's descriptors, which commit cannot reach",
        ));
    }
    let xattrs = if opt("userxattr").is_some() {
        OverlayXattrs::User
    } else {
        OverlayXattrs::Trusted
    };
    let record = mounts::live_mounts(store, false)?
        .into_iter()
        .find(|r| r.kind == "kernel" && r.mount_id == Some(entry.id))
        .ok_or_else(|| not_recorded(mnt, store, "kernel mount"))?;
    let upper = Dir::open_root(Path::new(upper))?;
    // The overlay's uuid is kept on its upper directory: the directory
    // mountinfo names must be the one the overlay writes to.
    if let (Some(mine), Some(kept)) = (
        tilefs_sys::fs::fs_uuid(root.as_fd()),
        upper.own_xattr(b"trusted.overlay.uuid")?,
    ) {
        if kept != mine {
            return Err(err(
                mnt,
                format!(
                    "{} is not the mount's upper directory (its overlay uuid differs)",
                    upper.path.display()
                ),
            ));
        }
    }
    Ok(Writable {
        kind: Kind::Kernel,
        root,
        image: record.image,
        upper,
        xattrs,
        rootless: false,
    })
}

fn fuse(store: &Store, mnt: &Path, root: OwnedFd, entry: &MountEntry) -> Result<Writable, CommitError> {
    let here: Vec<_> = mounts::live_mounts(store, false)?
        .into_iter()
        .filter(|r| r.kind == "fuse" && r.mountpoint.as_deref() == Some(entry.mountpoint.as_path()))
        .collect();
    if here.is_empty() {
        return Err(not_recorded(mnt, store, "FUSE mount"));
    }
    let mut writable: Vec<_> = here.into_iter().filter(|r| r.upper.is_some()).collect();
    let record = match writable.len() {
        0 => return Err(read_only(mnt)),
        1 => writable.remove(0),
        n => {
            return Err(err(
                mnt,
                format!("{n} live writable FUSE mounts are recorded there (one detached but still served?): cannot tell which this is"),
            ))
        }
    };
    let layer = record.upper.expect("filtered");
    // Its server holds the work directory's lock while it serves.
    if !upper_in_use(&layer.work) {
        return Err(err(
            mnt,
            format!(
                "the upper directory {} its record names is not in use by a server",
                layer.upper.display()
            ),
        ));
    }
    let upper = Dir::open_root(&layer.upper)?;
    Ok(Writable {
        kind: Kind::Fuse,
        root,
        image: record.image,
        upper,
        xattrs: layer.xattrs,
        rootless: layer.xattrs == OverlayXattrs::User,
    })
}

/// Whether a FUSE server holds the lock of the work directory `work`
/// (`work/tilefs/lock`, locked exclusively while it serves).
fn upper_in_use(work: &PathBuf) -> bool {
    let Ok(dir) = rustix::fs::openat2(
        rustix::fs::CWD,
        work,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        rustix::fs::ResolveFlags::NO_SYMLINKS | rustix::fs::ResolveFlags::NO_MAGICLINKS,
    ) else {
        return false;
    };
    let Ok(lock) = rustix::fs::openat2(
        &dir,
        "tilefs/lock",
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
        BENEATH,
    ) else {
        return false;
    };
    // Taken by us, it is not held (and goes with the descriptor).
    rustix::fs::flock(&lock, FlockOperation::NonBlockingLockShared).is_err()
}
