//! Acting with another user's file-system credentials, on this thread only.

use std::io;

/// While alive, this thread's file-system uid, gid and supplementary
/// groups are another user's, and (the kernel's rule for a non-zero
/// fsuid) the capabilities that override file permissions are off: access
/// checks answer as they would for that user. Dropping it puts the
/// thread's own back.
///
/// setfsuid, setfsgid and setgroups (the raw system call, unlike glibc's
/// wrapper) change the calling thread only, so other threads of a
/// multi-threaded server keep their credentials.
pub struct FsCreds {
    uid: u32,
    gid: u32,
    groups: Vec<rustix::process::Gid>,
}

impl FsCreds {
    /// Takes on `uid`, `gid` and `groups` for file-system access.
    pub fn enter(uid: u32, gid: u32, groups: &[u32]) -> io::Result<FsCreds> {
        let old_groups = rustix::process::getgroups()?;
        let new: Vec<_> = groups.iter().map(|&g| rustix::process::Gid::from_raw(g)).collect();
        rustix::thread::set_thread_groups(&new)?;
        // SAFETY: setfsgid and setfsuid only change this thread's
        // file-system ids; they return the previous ones.
        let (old_gid, old_uid) = unsafe { (libc::setfsgid(gid), libc::setfsuid(uid)) };
        let guard = FsCreds {
            uid: old_uid as u32,
            gid: old_gid as u32,
            groups: old_groups,
        };
        // Both calls report the old value whether or not they succeeded:
        // asking again with an invalid id (-1) reads the current one.
        // SAFETY: as above; -1 changes nothing.
        let (now_gid, now_uid) = unsafe { (libc::setfsgid(u32::MAX), libc::setfsuid(u32::MAX)) };
        if now_uid as u32 != uid || now_gid as u32 != gid {
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
        Ok(guard)
    }
}

impl Drop for FsCreds {
    fn drop(&mut self) {
        // SAFETY: as in `enter`, back to the ids this thread had.
        unsafe {
            libc::setfsuid(self.uid);
            libc::setfsgid(self.gid);
        }
        let _ = rustix::thread::set_thread_groups(&self.groups);
    }
}
