//! Serving a kernel mount of a lazily pulled image from the command line:
//! a holder process keeps the mount's fanotify group and runs a filler
//! (forked, so it shares nothing with the holder but the group); when the
//! filler dies, the holder answers EIO to the reads it left waiting and
//! starts another, which takes the reads queued meanwhile. Both end once
//! the mount is gone (`tilefs umount`).

use anyhow::{bail, Result};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tilefs_present::kernel_lazy::{self, Armed};
use tilefs_sys::process::{fork, Forked};

/// Starts the holder (in the background, or here in the foreground) for
/// the mount `mount_id` at `mountpoint`.
/// `rest`: the bytes a second at which the filler fetches the objects no
/// reader asked for (None: only those asked for).
pub fn serve(
    armed: Armed,
    mountpoint: &Path,
    mount_id: u64,
    rest: Option<u64>,
    foreground: bool,
    log_file: Option<&Path>,
) -> Result<()> {
    // Taken before the fork, so `tilefs umount` run right after this
    // command finds it, and kept by the holder and every filler it forks:
    // the unmount returns once they are all gone.
    if let Ok(st) = rustix::fs::stat(mountpoint) {
        let dev = format!("{}:{}", rustix::fs::major(st.st_dev), rustix::fs::minor(st.st_dev));
        tilefs_fuse::hold_server_lock(&dev);
    }
    if foreground {
        hold(&armed, mountpoint, mount_id, rest, log(None));
        return Ok(());
    }
    match fork() {
        Ok(Forked::Parent(_)) => Ok(()),
        Ok(Forked::Child) => {
            crate::fuse_serve::detach_from_terminal(log_file);
            hold(&armed, mountpoint, mount_id, rest, log(log_file));
            std::process::exit(0)
        }
        Err(e) => {
            // Nothing may read the mount unserved: it goes.
            let _ = tilefs_mount::umount(mountpoint, true);
            bail!(
                "{}: cannot start the filler of the lazy mount: {e}",
                mountpoint.display()
            )
        }
    }
}

type Log = Arc<dyn Fn(&str) + Send + Sync>;

/// Where the holder's and filler's lines go: the log file (stderr), else
/// the system log.
fn log(log_file: Option<&Path>) -> Log {
    if log_file.is_some() {
        return Arc::new(|m: &str| eprintln!("tilefs-filler: {m}"));
    }
    tilefs_sys::syslog::open(c"tilefs-filler");
    Arc::new(|m: &str| tilefs_sys::syslog::warning(m))
}

/// Runs fillers one after another while the mount lives.
fn hold(armed: &Armed, mountpoint: &Path, mount_id: u64, rest: Option<u64>, log: Log) {
    let mounted = || kernel_lazy::still_mounted(mountpoint, mount_id);
    let mut restarts = 0;
    while mounted() {
        let pid = match fork() {
            Ok(Forked::Child) => {
                let code = match kernel_lazy::limit_fds()
                    .map_err(|e| e.to_string())
                    .and_then(|()| armed.fill(&mounted, rest, log.clone()))
                {
                    Ok(()) => 0,
                    Err(e) => {
                        log(&format!("{}: the filler stopped: {e}", mountpoint.display()));
                        1
                    }
                };
                std::process::exit(code)
            }
            Ok(Forked::Parent(pid)) => pid,
            Err(e) => {
                log(&format!("{}: cannot start a filler: {e}", mountpoint.display()));
                std::thread::sleep(kernel_lazy::backoff(restarts));
                restarts += 1;
                continue;
            }
        };
        let status = loop {
            match rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG) {
                Ok(Some((_, status))) => break Some(status),
                Ok(None) => {}
                Err(_) => break None,
            }
            if !mounted() {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty());
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        // Whatever the filler had read and not answered is refused, never
        // let through: the readers get EIO, not the placeholder's zeros.
        let denied = kernel_lazy::deny_orphans(armed.group());
        if let Some(status) = status.filter(|_| mounted()) {
            log(&format!(
                "{}: the filler ended ({status:?}); {denied} read(s) it left waiting answered EIO; starting another",
                mountpoint.display()
            ));
            std::thread::sleep(kernel_lazy::backoff(restarts));
            restarts += 1;
        }
    }
    armed.finish();
}
