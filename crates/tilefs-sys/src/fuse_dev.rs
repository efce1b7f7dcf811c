//! /dev/fuse ioctls (linux/fuse.h).

use rustix::fd::{AsRawFd, BorrowedFd};

const MAGIC: u32 = 229;
const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | (MAGIC << 8) | nr
}
const WRITE: u32 = 1;
const READ: u32 = 2;
const DEV_IOC_CLONE: u32 = ioc(READ, 0, 4);
const DEV_IOC_BACKING_OPEN: u32 = ioc(WRITE, 1, std::mem::size_of::<BackingMap>());
const DEV_IOC_BACKING_CLOSE: u32 = ioc(WRITE, 2, 4);

/// `struct fuse_backing_map`.
#[repr(C)]
struct BackingMap {
    fd: i32,
    flags: u32,
    padding: u64,
}

/// Attaches `new` (a fresh open of /dev/fuse) to the connection of
/// `session` (FUSE_DEV_IOC_CLONE), so a worker thread reads requests from
/// a descriptor of its own.
pub fn clone_device(new: BorrowedFd<'_>, session: BorrowedFd<'_>) -> std::io::Result<()> {
    let master = session.as_raw_fd() as u32;
    // SAFETY: FUSE_DEV_IOC_CLONE reads one u32 (the descriptor to clone)
    // from the pointer, which is valid for the call.
    let r = unsafe { libc::ioctl(new.as_raw_fd(), DEV_IOC_CLONE as _, &master) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Registers `file` as a backing file of the connection (passthrough):
/// returns the id the kernel gave it.
pub fn backing_open(dev: BorrowedFd<'_>, file: BorrowedFd<'_>) -> std::io::Result<i32> {
    let map = BackingMap {
        fd: file.as_raw_fd(),
        flags: 0,
        padding: 0,
    };
    // SAFETY: FUSE_DEV_IOC_BACKING_OPEN reads a fuse_backing_map from the
    // pointer, valid for the call.
    let r = unsafe { libc::ioctl(dev.as_raw_fd(), DEV_IOC_BACKING_OPEN as _, &map) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Lets go of a backing file registered by [`backing_open`].
pub fn backing_close(dev: BorrowedFd<'_>, id: i32) {
    let id = id as u32;
    // SAFETY: FUSE_DEV_IOC_BACKING_CLOSE reads one u32 from the pointer.
    unsafe { libc::ioctl(dev.as_raw_fd(), DEV_IOC_BACKING_CLOSE as _, &id) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ioctl numbers libfuse and the kernel use.
    #[test]
    fn ioctl_numbers() {
        assert_eq!(std::mem::size_of::<BackingMap>(), 16);
        assert_eq!(DEV_IOC_CLONE, 0x8004_e500);
        assert_eq!(DEV_IOC_BACKING_OPEN, 0x4010_e501);
        assert_eq!(DEV_IOC_BACKING_CLOSE, 0x4004_e502);
    }
}
