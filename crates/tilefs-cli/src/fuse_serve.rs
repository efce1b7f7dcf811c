//! Serving a FUSE mount from the command line: in the foreground until it
//! is unmounted, or in a forked server, the command returning once the
//! mount answers. SIGTERM, SIGINT, SIGHUP and SIGQUIT unmount it (a second
//! one detaches it even while busy).

use anyhow::{anyhow, bail, Context, Result};
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;
use tilefs_fuse::{Mounted, Running, ServeConfig};

const SIGNALS: [i32; 4] = [
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGHUP,
    signal_hook::consts::SIGQUIT,
];

/// Serves `mounted` with `config`: here until unmounted (`foreground`), or
/// in a server process of its own, returning once the mount answers.
/// `log_file`: where the server's stderr goes in the background.
pub fn serve(mounted: Mounted, config: ServeConfig, foreground: bool, log_file: Option<&Path>) -> Result<()> {
    if foreground {
        return run(mounted, config, None);
    }
    let (rd, wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).context("pipe")?;
    let mut mounted = mounted;
    match tilefs_sys::process::fork() {
        Err(e) => {
            let mnt = mounted.mountpoint().to_path_buf();
            mounted.abandon();
            bail!("{}: cannot start the server: {e}", mnt.display())
        }
        Ok(tilefs_sys::process::Forked::Parent(pid)) => {
            drop(wr);
            // The server's copy of the record's descriptor keeps it; the
            // parent's copy of the connection goes with `mounted`.
            mounted.leave_record();
            let mnt = mounted.mountpoint().to_path_buf();
            drop(mounted);
            wait_ready(rd, pid, &mnt)
        }
        Ok(tilefs_sys::process::Forked::Child) => {
            drop(rd);
            detach_from_terminal(log_file);
            let code = match run(mounted, config, Some(wr)) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("tilefs-fuse: {e:#}");
                    1
                }
            };
            std::process::exit(code)
        }
    }
}

/// A new session, no terminal, stdio on /dev/null (stderr on `log_file`),
/// none of the caller's other descriptors.
pub(crate) fn detach_from_terminal(log_file: Option<&Path>) {
    tilefs_sys::process::close_inherited_fds();
    let _ = rustix::process::setsid();
    let _ = rustix::process::chdir("/");
    if let Ok(null) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null") {
        let _ = rustix::stdio::dup2_stdin(&null);
        let _ = rustix::stdio::dup2_stdout(&null);
        let _ = rustix::stdio::dup2_stderr(&null);
    }
    if let Some(p) = log_file {
        if let Ok(f) = std::fs::OpenOptions::new().append(true).create(true).open(p) {
            let _ = rustix::stdio::dup2_stderr(&f);
        }
    }
}

/// Serves until the mount goes away; `ready` gets "ready" (or why not)
/// once the mount answers a request.
fn run(mounted: Mounted, config: ServeConfig, ready: Option<rustix::fd::OwnedFd>) -> Result<()> {
    let mut signals = signal_hook::iterator::Signals::new(SIGNALS).context("cannot handle signals")?;
    let mut running: Running = mounted.start(config).map_err(|e| anyhow!("{e}"))?;
    let answered = running.ready();
    if let Some(wr) = ready {
        let msg = match &answered {
            Ok(()) => "ready".to_string(),
            Err(e) => e.clone(),
        };
        let _ = std::fs::File::from(wr).write_all(msg.as_bytes());
    }
    while !running.is_finished() {
        for sig in signals.pending() {
            running.unmount(&format!("signal {sig}"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    running.wait().map_err(|e| anyhow!("{e}"))
}

/// Waits for the server's "ready" (or its error) on `rd`.
fn wait_ready(rd: rustix::fd::OwnedFd, pid: rustix::process::Pid, mnt: &Path) -> Result<()> {
    let mut msg = Vec::new();
    let _ = std::fs::File::from(rd).read_to_end(&mut msg);
    if msg == b"ready" {
        return Ok(());
    }
    let status = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty())
        .ok()
        .flatten()
        .map(|(_, s)| format!("{s:?}"))
        .unwrap_or_default();
    let _ = tilefs_fuse::unmount(mnt, true);
    let why = if msg.is_empty() {
        format!("the server exited before the mount was ready ({status})")
    } else {
        String::from_utf8_lossy(&msg).into_owned()
    };
    Err(anyhow!("{}: {why}", mnt.display()))
}
