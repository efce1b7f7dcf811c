//! How `tilefs umount` knows that a FUSE server (or a kernel lazy
//! mount's filler, see `hold_server_lock`) has exited: the server
//! holds an exclusive lock on `<runtime dir>/fuse/<major>:<minor>.lock`
//! (the mount's device) until its process ends; the kernel drops the lock
//! then, however it ends. The files stay (one per device number, empty,
//! in a tmpfs): removing one could pull it from under the next server of
//! the same device number. The runtime dir is
//! `/run/tilefs` for root and `/run/user/<uid>/tilefs` for other users
//! (where it exists), so that whoever unmounts finds the lock of the
//! mount's owner from the mount table alone.

use rustix::fd::OwnedFd;
use rustix::fs::{flock, FlockOperation, Mode, OFlags};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn lock_dir(uid: u32) -> Option<PathBuf> {
    if uid == 0 {
        return Some(PathBuf::from("/run/tilefs/fuse"));
    }
    // Only a runtime dir the user really owns (logind makes it, 0700).
    let base = PathBuf::from(format!("/run/user/{uid}"));
    let m = std::fs::symlink_metadata(&base).ok()?;
    (m.is_dir() && m.uid() == uid).then(|| base.join("tilefs/fuse"))
}

fn lock_path(uid: u32, dev: &str) -> Option<PathBuf> {
    Some(lock_dir(uid)?.join(format!("{dev}.lock")))
}

/// The server's lock.
pub(crate) struct ServerLock {
    fd: OwnedFd,
}

impl ServerLock {
    /// Takes the lock for the mount of device `dev` (`major:minor`). None
    /// where there is no runtime dir to put it in; `umount` then does not
    /// wait.
    pub(crate) fn take(dev: &str) -> Option<ServerLock> {
        let uid = rustix::process::geteuid().as_raw();
        let path = lock_path(uid, dev)?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(path.parent()?)
            .ok()?;
        let fd = rustix::fs::open(
            &path,
            OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
            Mode::from_raw_mode(0o644),
        )
        .ok()?;
        // The server of an earlier mount that had this device number may
        // still be on its way out (its mount is gone, so it will be soon).
        let end = Instant::now() + Duration::from_secs(10);
        while flock(&fd, FlockOperation::NonBlockingLockExclusive).is_err() {
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Some(ServerLock { fd })
    }

    /// Keeps the lock until the process exits (its descriptor is never
    /// closed before), so a waiter wakes only when the server is gone.
    pub(crate) fn keep_until_exit(self) {
        std::mem::forget(self.fd);
    }
}

/// Waits up to `timeout` for the server of the mount of device `dev`, owned
/// by `uid`, to exit. Returns false if it is still running then.
pub(crate) fn wait_for_exit(uid: u32, dev: &str, timeout: Duration) -> bool {
    let Some(path) = lock_path(uid, dev) else {
        return true;
    };
    let Ok(fd) = rustix::fs::open(
        &path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    ) else {
        return true;
    };
    let end = Instant::now() + timeout;
    loop {
        if flock(&fd, FlockOperation::NonBlockingLockShared).is_ok() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
