//! Loop device ioctls (linux/loop.h).

use rustix::fd::{AsRawFd, BorrowedFd};
use rustix::io::Errno;

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
pub const LO_FLAGS_READ_ONLY: u32 = 1;
pub const LO_FLAGS_AUTOCLEAR: u32 = 4;
pub const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;

/// `struct loop_info64`.
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

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

fn last_errno() -> Errno {
    Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO)
}

/// The number of a free loop device (LOOP_CTL_GET_FREE on
/// /dev/loop-control), allocating one if needed.
pub fn get_free(control: BorrowedFd<'_>) -> Result<u32, Errno> {
    // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a number.
    let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
    if n < 0 {
        Err(last_errno())
    } else {
        Ok(n as u32)
    }
}

/// Attaches `backing` to the loop device `dev` in one step
/// (LOOP_CONFIGURE) with its logical `block_size` (0: 512), `flags`
/// (`LO_FLAGS_*`) and `name` (shown in
/// /sys/block/loopN/loop/backing_file; cut to 63 bytes).
pub fn configure(
    dev: BorrowedFd<'_>,
    backing: BorrowedFd<'_>,
    block_size: u32,
    flags: u32,
    name: &[u8],
) -> Result<(), Errno> {
    let mut cfg = LoopConfig {
        fd: backing.as_raw_fd() as u32,
        block_size,
        info: LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: flags,
            lo_file_name: [0; LO_NAME_SIZE],
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        },
        reserved: [0; 8],
    };
    let n = name.len().min(LO_NAME_SIZE - 1);
    cfg.info.lo_file_name[..n].copy_from_slice(&name[..n]);
    // SAFETY: LOOP_CONFIGURE reads a `struct loop_config`, which
    // `LoopConfig` lays out exactly; `cfg` outlives the call.
    let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &cfg as *const LoopConfig) };
    if r == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}
