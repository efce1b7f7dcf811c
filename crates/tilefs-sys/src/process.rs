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
