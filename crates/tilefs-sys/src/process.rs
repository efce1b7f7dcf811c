//! Processes.

use rustix::process::Pid;
use std::io;

/// Which side of a fork this is.
pub enum Forked {
    /// The parent, with the child's pid.
    Parent(Pid),
    Child,
}

/// Forks this process, which must have one thread only: then the child is
/// a whole copy (no lock held by a thread that is not there), free to run
/// any code. A process with more threads gets EINVAL, nothing forked.
pub fn fork() -> io::Result<Forked> {
    let threads = std::fs::read_dir("/proc/self/task").map(|d| d.count())?;
    if threads != 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("fork: this process has {threads} threads, and may fork only with one"),
        ));
    }
    // SAFETY: the process has one thread (checked above; none can start
    // meanwhile, as this is it), so the child inherits a consistent state.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(Forked::Child),
        pid => Ok(Forked::Parent(
            Pid::from_raw(pid).expect("fork returned a positive pid"),
        )),
    }
}

/// The descriptors above stderr that this process was started with, noted
/// by [`note_inherited_fds`].
static INHERITED: std::sync::OnceLock<Vec<i32>> = std::sync::OnceLock::new();

/// Notes the descriptors above stderr open now: call it before the
/// process opens anything, when every one of them was inherited.
pub fn note_inherited_fds() {
    let listed: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                .filter(|&fd| fd > 2)
                .collect()
        })
        .unwrap_or_default();
    // The listing's own descriptor is among them, closed by now: keep
    // only those still open.
    let fds = listed
        .into_iter()
        .filter(|fd| std::fs::symlink_metadata(format!("/proc/self/fd/{fd}")).is_ok())
        .collect();
    let _ = INHERITED.set(fds);
}

/// Closes the descriptors [`note_inherited_fds`] found: in a server that
/// outlives the command that started it, they would keep the caller's
/// pipes and files open (a shell waiting for a pipe's end would wait for
/// the server's).
pub fn close_inherited_fds() {
    for &fd in INHERITED.get().map(Vec::as_slice).unwrap_or_default() {
        // SAFETY: these descriptors were open before main ran and no part
        // of tilefs owns them (nothing of ours was opened yet when they
        // were noted, and tilefs never closes what it did not open, so the
        // numbers were not reused by an owned descriptor); closing them
        // invalidates no OwnedFd or File of ours.
        unsafe {
            libc::close(fd);
        }
    }
}
