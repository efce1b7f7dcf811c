//! A read-only loop device over the image, for kernels whose EROFS cannot
//! mount a regular file (built without `CONFIG_EROFS_FS_BACKED_BY_FILE`).
//! The device is set to clear itself when its last user goes away: once
//! EROFS holds it, closing our descriptor leaves it to the mount, and if
//! the mount fails, closing it frees the device.

use crate::MountError;
use rustix::fd::{AsRawFd, BorrowedFd, OwnedFd};
use rustix::io::Errno;
use std::path::Path;

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;

/// `struct loop_info64` from linux/loop.h.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config` from linux/loop.h.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

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
    // A free device can be taken by someone else between GET_FREE and
    // CONFIGURE (EBUSY): try a few times.
    let mut last = Errno::BUSY;
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a number.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
        if n < 0 {
            return Err(MountError::Unsupported(format!(
                "no free loop device: {}",
                last_errno()
            )));
        }
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
        let mut cfg = LoopConfig {
            fd: image.as_raw_fd() as u32,
            block_size: 4096,
            info: LoopInfo64 {
                lo_device: 0,
                lo_inode: 0,
                lo_rdevice: 0,
                lo_offset: 0,
                lo_sizelimit: 0,
                lo_number: 0,
                lo_encrypt_type: 0,
                lo_encrypt_key_size: 0,
                lo_flags: LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO,
                lo_file_name: [0; LO_NAME_SIZE],
                lo_crypt_name: [0; LO_NAME_SIZE],
                lo_encrypt_key: [0; 32],
                lo_init: [0; 2],
            },
            reserved: [0; 8],
        };
        let p = image_path.as_os_str().as_encoded_bytes();
        let n = p.len().min(LO_NAME_SIZE - 1);
        cfg.info.lo_file_name[..n].copy_from_slice(&p[..n]);
        // SAFETY: LOOP_CONFIGURE reads a `struct loop_config`, which
        // `LoopConfig` lays out exactly; `cfg` outlives the call.
        let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &cfg as *const LoopConfig) };
        if r == 0 {
            return Ok(LoopDevice { name, _fd: dev });
        }
        last = last_errno();
        if last == Errno::INVAL && cfg.info.lo_flags & LO_FLAGS_DIRECT_IO != 0 {
            // Direct I/O refused (image on a filesystem without O_DIRECT):
            // buffered then.
            cfg.info.lo_flags &= !LO_FLAGS_DIRECT_IO;
            // SAFETY: as above.
            if unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &cfg as *const LoopConfig) } == 0 {
                return Ok(LoopDevice { name, _fd: dev });
            }
            last = last_errno();
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

fn last_errno() -> Errno {
    Errno::from_raw_os_error(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
}
