//! The service's mounts as gc roots of their store (see
//! `tilefs_store::mounts`): a user's mount keeps its objects while it
//! lives, whatever is done to its tag meanwhile. The record names the
//! mount by its unique id and the mount namespace it is in (the service's,
//! where it attaches mounts; for a mount handed over detached to a client
//! in a user namespace of its own, the client's, where it attaches it), so
//! `tilefs gc` finds it from any namespace. (No system call here is
//! outside the unit's filter.)

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{AtFlags, StatxFlags};
use std::io::Read;
use std::path::Path;
use tilefs_store::mounts::KernelMount;
use tilefs_store::{LockMode, Store, StoreLock};

/// Taken before a mount is built: the store (its lock held shared, so
/// that no gc runs between the mount and its record) and the image's bytes
/// (read from the descriptor the mount is built from).
pub(crate) struct Pending {
    store: Store,
    image: Vec<u8>,
    _lock: StoreLock,
}

/// Prepares the record of a mount of `image` (an open tag) of `store`.
pub(crate) fn before(store: &Path, image: &std::fs::File) -> Result<Pending, String> {
    let s = Store::open(store).map_err(|e| e.to_string())?;
    let lock = s.lock(LockMode::Shared, true).map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    // A clone of the descriptor shares its offset: read from the start,
    // then leave it there for the mount's own read.
    let mut f = image.try_clone().map_err(|e| format!("the image: {e}"))?;
    rustix::fs::seek(&f, rustix::fs::SeekFrom::Start(0)).map_err(|e| format!("the image: {e}"))?;
    f.read_to_end(&mut bytes).map_err(|e| format!("the image: {e}"))?;
    rustix::fs::seek(&f, rustix::fs::SeekFrom::Start(0)).map_err(|e| format!("the image: {e}"))?;
    Ok(Pending {
        store: s,
        image: bytes,
        _lock: lock,
    })
}

/// Records `mount`, attached by the service at `target` (in its own mount
/// namespace: it attaches nowhere else) or (None) handed over detached to
/// the caller whose pidfd is `caller`, who attaches it in its own.
pub(crate) fn record(
    p: Pending,
    mount: BorrowedFd<'_>,
    target: Option<BorrowedFd<'_>>,
    caller: &OwnedFd,
) -> Result<(), String> {
    let id = |which: u32| {
        rustix::fs::statx(mount, "", AtFlags::EMPTY_PATH, StatxFlags::from_bits_retain(which))
            .map(|st| st.stx_mnt_id)
            .map_err(|e| format!("the mount's id: {e}"))
    };
    let ns = match target {
        Some(_) => std::fs::File::open("/proc/self/ns/mnt").map(OwnedFd::from),
        None => tilefs_sys::ns::pidfd_mnt_ns(caller.as_fd()),
    }
    .and_then(|ns| tilefs_sys::ns::mnt_ns_id(ns.as_fd()))
    .map_err(|e| format!("the mount namespace: {e}"))?;
    // Where it is, as the service sees it: named for people reading the
    // record; the ids are what count.
    let mountpoint =
        target.and_then(|t| std::fs::read_link(format!("/proc/self/fd/{}", rustix::fd::AsRawFd::as_raw_fd(&t))).ok());
    let m = KernelMount {
        mount_id: id(super::checks::STATX_MNT_ID)?,
        mountpoint,
        unique: Some((id(super::checks::STATX_MNT_ID_UNIQUE)?, ns)),
    };
    tilefs_store::mounts::register_kernel_mount(&p.store, &p.image, &m).map_err(|e| e.to_string())
}
