//! A read-only loop device over the image, for kernels whose EROFS cannot
//! mount a regular file (built without `CONFIG_EROFS_FS_BACKED_BY_FILE`).
//! The device is set to clear itself when its last user goes away: once
//! EROFS holds it, closing our descriptor leaves it to the mount, and if
//! the mount fails, closing it frees the device.

use crate::MountError;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::io::Errno;
use std::path::Path;
use tilefs_sys::loopdev::{self as ioctl, LO_FLAGS_AUTOCLEAR, LO_FLAGS_DIRECT_IO, LO_FLAGS_READ_ONLY};

/// An attached loop device.
pub(crate) struct LoopDevice {
    pub(crate) name: String,
    _fd: OwnedFd,
}

/// Attaches `image` (open read-only) to a free loop device.
pub(crate) fn attach(image: BorrowedFd<'_>, image_path: &Path) -> Result<LoopDevice, MountError> {
    let ctl = rustix::fs::open(
        "/dev/loop-control",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| MountError::Unsupported(format!("no loop devices (/dev/loop-control: {e})")))?;
    let label = image_path.as_os_str().as_encoded_bytes();
    // A free device can be taken by someone else between GET_FREE and
    // CONFIGURE (EBUSY): try a few times.
    let mut last = Errno::BUSY;
    for _ in 0..16 {
        let n =
            ioctl::get_free(ctl.as_fd()).map_err(|e| MountError::Unsupported(format!("no free loop device: {e}")))?;
        let name = format!("/dev/loop{n}");
        let dev = match rustix::fs::open(
            name.as_str(),
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(e) => {
                last = e;
                continue;
            }
        };
        let flags = LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR;
        let mut r = ioctl::configure(dev.as_fd(), image, 4096, flags | LO_FLAGS_DIRECT_IO, label);
        if r == Err(Errno::INVAL) {
            // Direct I/O refused (image on a filesystem without O_DIRECT):
            // buffered then.
            r = ioctl::configure(dev.as_fd(), image, 4096, flags, label);
        }
        match r {
            Ok(()) => return Ok(LoopDevice { name, _fd: dev }),
            Err(e) => last = e,
        }
        if last != Errno::BUSY {
            break;
        }
    }
    Err(MountError::Unsupported(format!(
        "cannot attach {} to a loop device: {last}",
        image_path.display()
    )))
}
