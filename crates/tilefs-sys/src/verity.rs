//! fs-verity ioctls (linux/fsverity.h).

use rustix::fd::{AsRawFd, BorrowedFd};
use rustix::io::Errno;

/// `FS_IOC_ENABLE_VERITY`: `_IOW('f', 133, struct fsverity_enable_arg)`.
const FS_IOC_ENABLE_VERITY: libc::c_ulong = 0x4080_6685;
/// `FS_IOC_MEASURE_VERITY`: `_IOWR('f', 134, struct fsverity_digest)`.
const FS_IOC_MEASURE_VERITY: libc::c_ulong = 0xC004_6686;
const FS_VERITY_HASH_ALG_SHA256: u16 = 1;

/// `struct fsverity_enable_arg`.
#[repr(C)]
struct EnableArg {
    version: u32,
    hash_algorithm: u32,
    block_size: u32,
    salt_size: u32,
    salt_ptr: u64,
    sig_size: u32,
    reserved1: u32,
    sig_ptr: u64,
    reserved2: [u64; 11],
}

/// `struct fsverity_digest` with room for the longest digest.
#[repr(C)]
struct MeasureBuf {
    digest_algorithm: u16,
    digest_size: u16,
    digest: [u8; 64],
}

/// Enables fs-verity on a file opened read-only: SHA-256, 4 KiB blocks,
/// no salt (the parameters composefs digests assume).
pub fn enable(fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let arg = EnableArg {
        version: 1,
        hash_algorithm: u32::from(FS_VERITY_HASH_ALG_SHA256),
        block_size: 4096,
        salt_size: 0,
        salt_ptr: 0,
        sig_size: 0,
        reserved1: 0,
        sig_ptr: 0,
        reserved2: [0; 11],
    };
    // SAFETY: the ioctl reads a fully initialised fsverity_enable_arg,
    // laid out as the kernel declares it, from `arg`, which outlives the
    // call; the salt and signature pointers are null with zero sizes.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), FS_IOC_ENABLE_VERITY as _, &arg as *const EnableArg) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The fs-verity digest of an open file: `Ok(Some)` when verity is enabled
/// with SHA-256, `Ok(None)` when the file has no verity (or another hash),
/// `Err` when the filesystem or kernel cannot tell (no fs-verity support).
pub fn measure(fd: BorrowedFd<'_>) -> Result<Option<[u8; 32]>, Errno> {
    let mut buf = MeasureBuf {
        digest_algorithm: 0,
        digest_size: 64,
        digest: [0; 64],
    };
    // SAFETY: FS_IOC_MEASURE_VERITY reads digest_size and writes at most
    // that many bytes after the 4-byte header, all inside `buf`.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), FS_IOC_MEASURE_VERITY as _, &mut buf as *mut MeasureBuf) };
    if r < 0 {
        return match Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO) {
            Errno::NODATA => Ok(None),
            e => Err(e),
        };
    }
    if buf.digest_algorithm != FS_VERITY_HASH_ALG_SHA256 || buf.digest_size != 32 {
        return Ok(None);
    }
    let mut d = [0u8; 32];
    d.copy_from_slice(&buf.digest[..32]);
    Ok(Some(d))
}
