//! Namespaces.

use rustix::thread::UnshareFlags;
use std::io;

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
