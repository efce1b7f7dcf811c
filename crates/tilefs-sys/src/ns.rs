//! Namespaces.

use rustix::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use rustix::io::Errno;
use rustix::thread::UnshareFlags;
use std::io;

/// Whether this process is in the initial user namespace: only there does
/// its uid map map every id to itself. Where the map cannot be read (no
/// /proc), the answer is yes, as it was before user namespaces. Read
/// each time: a thread that unshares its user namespace changes it.
pub fn in_initial_userns() -> bool {
    std::fs::read_to_string("/proc/self/uid_map").map_or(true, |m| {
        m.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"]
    })
}

/// Moves the calling thread into new namespaces of the kinds in `flags`:
/// user, mount, network, IPC, UTS, PID, cgroup, time. Unsharing the file
/// table or the file-system context is refused here: those would make
/// this thread disagree with the others about what a descriptor or a path
/// means, which is what makes rustix's `unshare` unsafe.
pub fn unshare(flags: UnshareFlags) -> io::Result<()> {
    let namespaces = UnshareFlags::NEWUSER
        | UnshareFlags::NEWNS
        | UnshareFlags::NEWNET
        | UnshareFlags::NEWIPC
        | UnshareFlags::NEWUTS
        | UnshareFlags::NEWPID
        | UnshareFlags::NEWCGROUP
        | UnshareFlags::NEWTIME;
    if !namespaces.contains(flags) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: only namespace flags reach the kernel (checked above): the
    // file table and the fs context stay shared, so every descriptor and
    // path means what it meant before in every thread.
    unsafe { rustix::thread::unshare_unsafe(flags) }.map_err(io::Error::from)
}

/// The 64-bit id of the mount namespace `ns` is (an open
/// `/proc/PID/ns/mnt`, or what a pidfd gave): `NS_GET_MNTNS_ID`, Linux
/// 6.11. Ids are never reused while the system runs.
pub fn mnt_ns_id(ns: BorrowedFd<'_>) -> io::Result<u64> {
    let mut id: u64 = 0;
    // SAFETY: NS_GET_MNTNS_ID writes one u64, into `id`.
    let r = unsafe { libc::ioctl(ns.as_raw_fd(), libc::NS_GET_MNTNS_ID as _, &mut id as *mut u64) };
    if r == 0 {
        Ok(id)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The mount namespace of the process `pidfd` names, opened
/// (`PIDFD_GET_MNT_NAMESPACE`, Linux 6.11): unlike `/proc/PID/ns/mnt`, it
/// cannot be another process's after a pid is reused.
pub fn pidfd_mnt_ns(pidfd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // _IO(PIDFS_IOCTL_MAGIC 0xFF, 3)
    const PIDFD_GET_MNT_NAMESPACE: libc::c_ulong = 0xFF03;
    // SAFETY: the ioctl takes no argument and returns a new descriptor
    // (or -1), which nothing else owns.
    let r = unsafe { libc::ioctl(pidfd.as_raw_fd(), PIDFD_GET_MNT_NAMESPACE as _, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `r` is a descriptor the kernel just opened for us.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

/// struct mnt_id_req, MNT_ID_REQ_SIZE_VER1: what statmount and listmount
/// are asked.
#[repr(C)]
struct MntIdReq {
    size: u32,
    spare: u32,
    mnt_id: u64,
    param: u64,
    mnt_ns_id: u64,
}

impl MntIdReq {
    fn new(mnt_id: u64, param: u64, mnt_ns_id: u64) -> MntIdReq {
        MntIdReq {
            size: std::mem::size_of::<MntIdReq>() as u32,
            spare: 0,
            mnt_id,
            param,
            mnt_ns_id,
        }
    }
}

// New system calls have one number on every architecture (but alpha).
const SYS_STATMOUNT: libc::c_long = 457;
const SYS_LISTMOUNT: libc::c_long = 458;

fn errno_of(r: libc::c_long) -> Result<(), Errno> {
    if r >= 0 {
        return Ok(());
    }
    Err(Errno::from_io_error(&io::Error::last_os_error()).unwrap_or(Errno::IO))
}

/// Whether the mount whose unique id (statx's `STATX_MNT_ID_UNIQUE`) is
/// `mnt_id` is mounted in the mount namespace of id `ns_id`: `statmount`
/// (Linux 6.8; a namespace other than the caller's from 6.11). Ok(false)
/// when the kernel says there is no such mount there (or no such
/// namespace any more); an error when it cannot tell (EPERM: the
/// namespace is not ours to look into; ENOSYS, EINVAL: an older kernel).
pub fn mount_in_namespace(mnt_id: u64, ns_id: u64) -> Result<bool, Errno> {
    const STATMOUNT_SB_BASIC: u64 = 0x1;
    let req = MntIdReq::new(mnt_id, STATMOUNT_SB_BASIC, ns_id);
    // struct statmount is 512 bytes in Linux 6.18; room for a later,
    // larger one (the kernel writes at most what it is given).
    let mut buf = [0u64; 256];
    // SAFETY: statmount reads `req` (of the size it says) and writes at
    // most `size_of_val(&buf)` bytes into `buf`; both outlive the call.
    let r = unsafe {
        libc::syscall(
            SYS_STATMOUNT,
            &req as *const MntIdReq,
            buf.as_mut_ptr(),
            std::mem::size_of_val(&buf),
            0u32,
        )
    };
    match errno_of(r) {
        Ok(()) => Ok(true),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether the mount namespace of id `ns_id` still exists: `listmount`
/// of its root (Linux 6.11), errors as [`mount_in_namespace`]'s.
pub fn mount_namespace_exists(ns_id: u64) -> Result<bool, Errno> {
    const LSMT_ROOT: u64 = u64::MAX;
    let req = MntIdReq::new(LSMT_ROOT, 0, ns_id);
    let mut ids = [0u64; 1];
    // SAFETY: listmount reads `req` and writes at most `ids.len()` ids
    // into `ids`; both outlive the call.
    let r = unsafe {
        libc::syscall(
            SYS_LISTMOUNT,
            &req as *const MntIdReq,
            ids.as_mut_ptr(),
            ids.len(),
            0u32,
        )
    };
    match errno_of(r) {
        Ok(()) => Ok(true),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(e),
    }
}
