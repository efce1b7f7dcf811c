//! Asking the mount service: a mount of a tagged image, or the unmount of
//! one it made for us.

use super::proto::{self, Reply, Request};
use rustix::fd::OwnedFd;
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::mount::MoveMountFlags;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use std::path::Path;
use std::time::Duration;

/// Why the service did not do it.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No service there (no socket, nobody listening).
    #[error("the mount service at {socket} is not reachable: {why}")]
    Unreachable { socket: String, why: String },
    /// The service refused, saying why.
    #[error("the mount service refused: {0}")]
    Refused(String),
    #[error("{0}")]
    Failed(String),
}

/// What a delegated mount asks for.
#[derive(Debug, Clone)]
pub struct DelegatedMount<'a> {
    pub store: &'a Path,
    pub image: &'a str,
    pub mountpoint: &'a Path,
    pub noexec: bool,
    pub nosymfollow: bool,
    pub verity: Option<&'a str>,
    /// Writable: the upper and work directories.
    pub upper: Option<(&'a Path, &'a Path)>,
}

fn connect(socket: &Path) -> Result<OwnedFd, ClientError> {
    let unreachable = |why: String| ClientError::Unreachable {
        socket: socket.display().to_string(),
        why,
    };
    let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .map_err(|e| unreachable(e.to_string()))?;
    let addr = SocketAddrUnix::new(socket).map_err(|e| unreachable(e.to_string()))?;
    rustix::net::connect(&fd, &addr).map_err(|e| unreachable(std::io::Error::from(e).to_string()))?;
    // Mounting reads the image: allow for a slow disk, never hang.
    let t = Some(Duration::from_secs(60));
    let _ = rustix::net::sockopt::set_socket_timeout(&fd, rustix::net::sockopt::Timeout::Recv, t);
    let _ = rustix::net::sockopt::set_socket_timeout(&fd, rustix::net::sockopt::Timeout::Send, t);
    Ok(fd)
}

/// How long a busy service is asked again before its "busy" is the answer.
const BUSY_PATIENCE: Duration = Duration::from_secs(10);

/// Sends `req` with the descriptors `fds` opens (closed once sent: the
/// service holds the only copies then, so that none of ours keeps a mount
/// busy) and returns the reply. A busy service is asked again, with the
/// descriptors opened anew, for up to [`BUSY_PATIENCE`].
fn ask(
    socket: &Path,
    req: &Request,
    fds: impl Fn() -> Result<Vec<OwnedFd>, ClientError>,
) -> Result<(Reply, Option<OwnedFd>), ClientError> {
    let bytes = serde_json::to_vec(req).map_err(|e| ClientError::Failed(e.to_string()))?;
    let give_up = std::time::Instant::now() + BUSY_PATIENCE;
    let mut pause = Duration::from_millis(50);
    loop {
        let conn = connect(socket)?;
        let fds = fds()?;
        // A service that refuses a caller at once answers before reading
        // the request: its reply is then waiting even though the send failed.
        let sent = proto::send(&conn, &bytes, &fds);
        drop(fds);
        if let Err(e) = sent {
            if !matches!(e, Errno::PIPE | Errno::CONNRESET) {
                return Err(ClientError::Failed(format!("sending the request: {e}")));
            }
        }
        let (bytes, back) = proto::recv(&conn).map_err(|e| ClientError::Failed(format!("reading the reply: {e}")))?;
        let reply: Reply =
            serde_json::from_slice(&bytes).map_err(|e| ClientError::Failed(format!("bad reply: {e}")))?;
        if reply.ok {
            return Ok((reply, back.into_iter().next()));
        }
        if !reply.busy || std::time::Instant::now() + pause > give_up {
            return Err(ClientError::Refused(
                reply.error.unwrap_or_else(|| "no reason given".into()),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// Opens a directory (mount point, upper or work) as the service will use
/// it: reached without following a symlink at its last component, held by
/// descriptor.
fn open_mountpoint(p: &Path) -> Result<OwnedFd, ClientError> {
    rustix::fs::open(
        p,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| {
        let why = match e {
            Errno::NOTDIR | Errno::LOOP => "not a directory (a symlink is never followed here)".to_string(),
            e => std::io::Error::from(e).to_string(),
        };
        ClientError::Failed(format!("{}: {why}", p.display()))
    })
}

/// Has the service mount `m`. In the initial user namespace the service
/// attaches it; inside a user namespace of our own (a rootless container)
/// the detached mount comes back and is attached here, visible only in our
/// mount namespace. Returns the service's notices.
pub fn mount(socket: &Path, m: &DelegatedMount) -> Result<Vec<String>, ClientError> {
    let attach = tilefs_sys::ns::in_initial_userns();
    // Where a mount that comes back is attached: opened before asking.
    let target = if attach {
        None
    } else {
        Some(open_mountpoint(m.mountpoint)?)
    };
    let req = Request::Mount {
        store: m.store.to_path_buf(),
        image: m.image.to_string(),
        attach,
        noexec: m.noexec,
        nosymfollow: m.nosymfollow,
        verity: m.verity.map(str::to_string),
        upper: m.upper.is_some(),
    };
    let dirs = || {
        let mut dirs = Vec::new();
        if attach {
            dirs.push(open_mountpoint(m.mountpoint)?);
        }
        if let Some((upper, work)) = m.upper {
            dirs.push(open_mountpoint(upper)?);
            dirs.push(open_mountpoint(work)?);
        }
        Ok(dirs)
    };
    let (reply, back) = ask(socket, &req, dirs)?;
    if let Some(target) = target {
        attach_here(back, &target, m.mountpoint)?;
    }
    Ok(reply.notices)
}

/// Attaches a mount the service sent back at `target`, in our own mount
/// namespace.
fn attach_here(back: Option<OwnedFd>, target: &OwnedFd, mountpoint: &Path) -> Result<(), ClientError> {
    {
        let mnt = back.ok_or_else(|| ClientError::Failed("the service sent no mount".into()))?;
        rustix::mount::move_mount(
            &mnt,
            "",
            target,
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(|e: Errno| ClientError::Failed(format!("attaching the mount at {}: {e}", mountpoint.display())))?;
    }
    Ok(())
}

/// Has the service unmount the mount at `mountpoint` (one it made for us).
pub fn umount(socket: &Path, mountpoint: &Path, lazy: bool) -> Result<(), ClientError> {
    ask(socket, &Request::Umount { lazy }, || {
        Ok(vec![open_mountpoint(mountpoint)?])
    })
    .map(drop)
}
