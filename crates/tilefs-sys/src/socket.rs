//! Peer credentials of a unix socket that rustix lacks.

use rustix::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::io;

/// SO_PEERGROUPS (Linux 4.13): the peer's supplementary groups.
const SO_PEERGROUPS: libc::c_int = 59;
/// SO_PEERPIDFD (Linux 6.5): a pidfd of the process that connected.
const SO_PEERPIDFD: libc::c_int = 77;

/// The supplementary groups of the process that connected (or created the
/// pair), as the kernel recorded them then.
pub fn peer_groups(sock: impl AsFd) -> io::Result<Vec<u32>> {
    let mut buf = vec![0u32; 256];
    loop {
        let mut len = std::mem::size_of_val(buf.as_slice()) as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `buf`, which
        // has that many, and the length it wrote (or needs) into `len`.
        let r = unsafe {
            libc::getsockopt(
                sock.as_fd().as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERGROUPS,
                buf.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if r == 0 {
            buf.truncate(len as usize / 4);
            return Ok(buf);
        }
        let e = io::Error::last_os_error();
        // ERANGE: `len` says how much room the list needs.
        if e.raw_os_error() == Some(libc::ERANGE) && (len as usize / 4) > buf.len() {
            buf.resize(len as usize / 4, 0);
            continue;
        }
        return Err(e);
    }
}

/// A pidfd of the process that connected: it names that process even if
/// it exits and its pid is reused.
pub fn peer_pidfd(sock: impl AsFd) -> io::Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes one int (the new descriptor) into `fd`.
    let r = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    // SAFETY: the kernel just opened `fd` for us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The listening socket systemd passed to this process (socket
/// activation: `LISTEN_PID` is ours and `LISTEN_FDS` at least 1), taken
/// once: later calls return None.
pub fn systemd_listen_fd() -> Option<OwnedFd> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static TAKEN: AtomicBool = AtomicBool::new(false);
    let pid: i32 = std::env::var("LISTEN_PID").ok()?.parse().ok()?;
    let n: i32 = std::env::var("LISTEN_FDS").ok()?.parse().ok()?;
    if pid != rustix::process::getpid().as_raw_nonzero().get() || n < 1 {
        return None;
    }
    // fd 3 must be open (systemd's) and a socket before we own it.
    // SAFETY: only borrowed for this fstat; if fd 3 is not open, fstat
    // fails with EBADF.
    let st = rustix::fs::fstat(unsafe { rustix::fd::BorrowedFd::borrow_raw(3) }).ok()?;
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK || TAKEN.swap(true, Ordering::SeqCst) {
        return None;
    }
    // SAFETY: systemd passed fd 3 to this process for it to own; the flag
    // above makes this the only owner.
    Some(unsafe { OwnedFd::from_raw_fd(3) })
}

/// A unix socket of type `kind` bound at `path`, not listening yet (its
/// mode is the caller's to set first). A socket there that a server
/// answers on is refused; one no server answers on (left by a server that
/// died) is replaced; any other file is refused.
pub fn bind_fresh(path: &std::path::Path, kind: rustix::net::SocketType) -> io::Result<OwnedFd> {
    use rustix::io::Errno;
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags};
    let fail = |what: &str, e: io::Error| io::Error::new(e.kind(), format!("{}: {what}: {e}", path.display()));
    let addr = SocketAddrUnix::new(path).map_err(|e| fail("socket address", e.into()))?;
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail("cannot look", e)),
        Ok(m) if !std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{}: exists and is no socket", path.display()),
            ))
        }
        Ok(_) => {
            // Without blocking: a server whose backlog is full is live too.
            let probe = rustix::net::socket_with(
                AddressFamily::UNIX,
                kind,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
                None,
            )
            .map_err(|e| fail("socket", e.into()))?;
            match rustix::net::connect(&probe, &addr) {
                Err(Errno::CONNREFUSED) => {
                    std::fs::remove_file(path).map_err(|e| fail("cannot remove the stale socket", e))?
                }
                // Answered, busy, or bound by a server of another socket type.
                Ok(()) | Err(Errno::AGAIN | Errno::INPROGRESS | Errno::PROTOTYPE) => {
                    return Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        format!("{}: another server listens there", path.display()),
                    ))
                }
                Err(e) => return Err(fail("cannot tell whether a server listens there", e.into())),
            }
        }
    }
    let fd = rustix::net::socket_with(AddressFamily::UNIX, kind, SocketFlags::CLOEXEC, None)
        .map_err(|e| fail("socket", e.into()))?;
    rustix::net::bind(&fd, &addr).map_err(|e| fail("cannot bind", e.into()))?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::SocketType;

    #[test]
    fn bind_fresh_replaces_a_dead_socket_and_refuses_a_live_one() {
        let dir = std::env::temp_dir().join(format!("tilefs-sys-bind-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let p = dir.join("s.sock");
        for kind in [SocketType::STREAM, SocketType::SEQPACKET] {
            let live = bind_fresh(&p, kind).unwrap();
            rustix::net::listen(&live, 1).unwrap();
            let e = bind_fresh(&p, kind).unwrap_err();
            assert_eq!(e.to_string(), format!("{}: another server listens there", p.display()));
            // Its server gone, the socket file stays: it is replaced.
            drop(live);
            assert!(p.exists());
            let again = bind_fresh(&p, kind).unwrap();
            drop(again);
            std::fs::remove_file(&p).unwrap();
        }
        std::fs::write(&p, b"not a socket").unwrap();
        let e = bind_fresh(&p, SocketType::STREAM).unwrap_err();
        assert_eq!(e.to_string(), format!("{}: exists and is no socket", p.display()));
        assert_eq!(std::fs::read(&p).unwrap(), b"not a socket");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
