//! Descriptors another library gave up without closing.

use rustix::fd::{AsRawFd, RawFd};

/// kcmp(2)'s KCMP_FILE: whether two descriptors name one open file.
const KCMP_FILE: libc::c_int = 0;

/// Closes descriptor number `abandoned`, which code that no longer runs
/// took ownership of and never closed, if it still names the open file
/// `same_as` names: a number that was closed meanwhile, and perhaps reused
/// for another file, is left alone. `same_as` must be a duplicate kept for
/// this, of a file every other descriptor of which is closed by now.
/// Returns whether it closed it.
pub fn close_if_same_file(abandoned: RawFd, same_as: &impl AsRawFd) -> bool {
    if abandoned == same_as.as_raw_fd() {
        return false;
    }
    let pid = std::process::id() as libc::pid_t;
    // SAFETY: kcmp only compares the files the two numbers name in this
    // process; it reads and writes no memory of ours.
    let same = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid,
            pid,
            KCMP_FILE,
            abandoned as libc::c_ulong,
            same_as.as_raw_fd() as libc::c_ulong,
        )
    } == 0;
    if !same {
        return false;
    }
    // SAFETY: the number names the file `same_as` names, of which no
    // descriptor but `same_as` and the abandoned one is left (the caller's
    // contract), so it is the abandoned descriptor itself, which no code
    // owns: closing it pulls a descriptor from under no one.
    unsafe { libc::close(abandoned) == 0 }
}
