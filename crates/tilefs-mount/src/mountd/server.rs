//! The service: checks each caller against the policy and builds the
//! kernel mount of a trusted image for it, detached, always nosuid and
//! nodev; attaches it at a directory the caller owns (held by descriptor
//! from the client's open to the attach, so nothing can be swapped in
//! between), or hands the detached mount back to a client in its own
//! mount namespace. Every refusal is logged with the caller and the reason.

use super::policy::{Caller, Policy};
use super::proto::{self, Reply, Request};
use crate::{build_detached, MountAttrs, MountOptions, Verity};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags, StatxAttributes, StatxFlags};
use rustix::io::Errno;
use rustix::mount::MoveMountFlags;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub const DEFAULT_SOCKET: &str = "/run/tilefs/mountd.sock";
pub const DEFAULT_POLICY: &str = "/etc/tilefs/mountd.toml";
/// Mounts made for users, by unique mount id: a file holding the uid.
const RECORDS: &str = "/run/tilefs/mountd";
/// Requests served at once; more are refused (busy), not queued.
const MAX_CLIENTS: usize = 64;
/// A client has this long to send its request and take its reply.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);
/// statx's STATX_MNT_ID_UNIQUE (Linux 6.8): an id never reused.
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

fn log(msg: &str) {
    eprintln!("tilefs-mountd: {msg}");
}

/// Runs the service until killed: on the socket systemd passed
/// (`LISTEN_FDS`), else on `socket` (created, mode 0666: the policy, not
/// the socket's mode, decides who gets what).
pub fn run(socket: &Path, policy_path: &Path) -> Result<(), String> {
    if !rustix::process::geteuid().is_root() {
        return Err("the mount service must run as root".into());
    }
    let policy = Arc::new(Policy::load(policy_path)?);
    let listener = match activated_socket() {
        Some(fd) => fd,
        None => bind(socket)?,
    };
    std::fs::create_dir_all(RECORDS).map_err(|e| format!("{RECORDS}: {e}"))?;
    log(&format!(
        "serving {} with policy {} ({} stores)",
        socket.display(),
        policy_path.display(),
        policy.stores.len()
    ));
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let conn = match rustix::net::accept_with(&listener, SocketFlags::CLOEXEC) {
            Ok(c) => c,
            Err(Errno::INTR) | Err(Errno::CONNABORTED) => continue,
            Err(e) => return Err(format!("accept: {e}")),
        };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
            active.fetch_sub(1, Ordering::SeqCst);
            let _ = reply(&conn, Err("the mount service is busy; try again".into()), None);
            log("refused a client: too many at once");
            continue;
        }
        let (policy, active) = (policy.clone(), active.clone());
        let spawned = std::thread::Builder::new().name("mountd-client".into()).spawn(move || {
            serve_client(conn, &policy);
            active.fetch_sub(1, Ordering::SeqCst);
        });
        if let Err(e) = spawned {
            log(&format!("cannot start a thread: {e}"));
        }
    }
}

/// The listening socket systemd passed, if it did (socket activation).
fn activated_socket() -> Option<OwnedFd> {
    let pid: i32 = std::env::var("LISTEN_PID").ok()?.parse().ok()?;
    let n: i32 = std::env::var("LISTEN_FDS").ok()?.parse().ok()?;
    if pid != rustix::process::getpid().as_raw_nonzero().get() || n < 1 {
        return None;
    }
    // SAFETY: systemd passed fd 3 to this process for us to own.
    let fd = unsafe { OwnedFd::from_raw_fd(3) };
    let _ = rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC);
    Some(fd)
}

fn bind(path: &Path) -> Result<OwnedFd, String> {
    let err = |what: &str, e: Errno| format!("{}: {what}: {e}", path.display());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    // A socket left by an earlier run (never anything else).
    if std::fs::symlink_metadata(path).is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type())) {
        let _ = std::fs::remove_file(path);
    }
    let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .map_err(|e| err("socket", e))?;
    let addr = SocketAddrUnix::new(path).map_err(|e| err("socket address", e))?;
    rustix::net::bind(&fd, &addr).map_err(|e| err("bind", e))?;
    rustix::fs::chmod(path, Mode::from_raw_mode(0o666)).map_err(|e| err("chmod", e))?;
    rustix::net::listen(&fd, 128).map_err(|e| err("listen", e))?;
    Ok(fd)
}

fn serve_client(conn: OwnedFd, policy: &Policy) {
    use rustix::net::sockopt;
    let _ = sockopt::set_socket_timeout(&conn, sockopt::Timeout::Recv, Some(CLIENT_TIMEOUT));
    let _ = sockopt::set_socket_timeout(&conn, sockopt::Timeout::Send, Some(CLIENT_TIMEOUT));
    let caller = match peer(&conn) {
        Ok(c) => c,
        Err(e) => return log(&format!("a client without credentials: {e}")),
    };
    let who = format!("uid {} (pid {})", caller.uid, caller.pid);
    let (bytes, fds) = match proto::recv(&conn) {
        Ok(m) => m,
        Err(Errno::AGAIN) => return log(&format!("{who}: no request within {CLIENT_TIMEOUT:?}")),
        Err(e) => return log(&format!("{who}: cannot read the request: {e}")),
    };
    let result = Request::parse(&bytes).and_then(|req| handle(policy, &caller, req, fds));
    let (result, back) = match result {
        Ok((notices, back)) => (Ok(notices), back),
        Err(e) => {
            log(&format!("{who}: refused: {e}"));
            (Err(e), None)
        }
    };
    if let Err(e) = reply(&conn, result, back.as_ref()) {
        log(&format!("{who}: cannot send the reply: {e}"));
    }
}

fn reply(conn: impl AsFd, result: Result<Vec<String>, String>, fd: Option<&OwnedFd>) -> Result<(), Errno> {
    let r = match result {
        Ok(notices) => Reply {
            ok: true,
            error: None,
            notices,
        },
        Err(e) => Reply {
            ok: false,
            error: Some(e),
            notices: Vec::new(),
        },
    };
    let bytes = serde_json::to_vec(&r).unwrap_or_default();
    proto::send(conn, &bytes, fd.map(std::slice::from_ref).unwrap_or_default())
}

/// The caller, from the kernel: SO_PEERCRED and SO_PEERGROUPS.
fn peer(conn: &OwnedFd) -> Result<Caller, Errno> {
    let cred = rustix::net::sockopt::socket_peercred(conn)?;
    let mut gids = vec![cred.gid.as_raw()];
    let mut buf = [0u32; 1024];
    let mut len = std::mem::size_of_val(&buf) as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `buf` and the
    // length it wrote into `len`.
    let r = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERGROUPS,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r == 0 {
        gids.extend_from_slice(&buf[..len as usize / 4]);
    }
    Ok(Caller {
        uid: cred.uid.as_raw(),
        gids,
        pid: cred.pid.as_raw_nonzero().get(),
    })
}

type Handled = (Vec<String>, Option<OwnedFd>);

fn handle(policy: &Policy, caller: &Caller, req: Request, fds: Vec<OwnedFd>) -> Result<Handled, String> {
    let mut fds = fds.into_iter();
    match req {
        Request::Mount {
            store,
            image,
            attach,
            noexec,
            nosymfollow,
            verity,
            upper,
        } => {
            let rule = policy.allow(caller, &store, &image)?;
            if upper && !rule.writable {
                return Err(format!(
                    "the policy does not allow writable mounts of store {}",
                    store.display()
                ));
            }
            let target = if attach {
                Some(fds.next().ok_or("no mount point came with the request")?)
            } else {
                None
            };
            let layers = if upper {
                let (u, w) = fds
                    .next()
                    .zip(fds.next())
                    .ok_or("no upper and work directories came with the request")?;
                check_layers(caller, u.as_fd(), w.as_fd())?;
                Some((u, w))
            } else {
                None
            };
            tilefs_store::tags::validate_tag(&image).map_err(|e| e.to_string())?;
            let image_path = rule.path.join(tilefs_store::store::IMAGES_DIR).join(&image);
            let file = open_tag(&rule.path, &image).map_err(|e| format!("{}: {e}", image_path.display()))?;
            // The policy's verity wins over the request's, where it says one.
            let verity: Verity = match (&rule.verity, &verity) {
                (Some(v), _) | (None, Some(v)) => v.parse()?,
                (None, None) => Verity::Auto,
            };
            let digest = match rule.pinned.get(&image) {
                Some(d) => Some(crate::options::parse_digest(d)?),
                None => None,
            };
            let fd_path = |f: &OwnedFd| PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
            let o = MountOptions {
                image: image_path,
                stores: vec![rule.path.clone()],
                // The directories checked, by descriptor; written with the
                // caller's file-system credentials, never root's.
                upper: layers.as_ref().map(|(u, _)| fd_path(u)),
                work: layers.as_ref().map(|(_, w)| fd_path(w)),
                upper_creds: layers.as_ref().map(|_| crate::FsCreds {
                    uid: caller.uid,
                    gid: caller.gids[0],
                    groups: caller.gids[1..].to_vec(),
                }),
                verity,
                digest,
                read_only: !upper,
                attrs: MountAttrs {
                    nosuid: true,
                    nodev: true,
                    noexec,
                    nosymfollow,
                    ..MountAttrs::default()
                },
                ..MountOptions::default()
            };
            let built = build_detached(&o, file).map_err(|e| e.to_string())?;
            if !attach {
                return Ok((built.notices, Some(built.mount)));
            }
            let target = target.ok_or("no mount point came with the request")?;
            attach_for(caller, &built.mount, target.as_fd())?;
            let id = unique_mount_id(built.mount.as_fd()).map_err(|e| format!("the new mount's id: {e}"))?;
            std::fs::write(Path::new(RECORDS).join(id.to_string()), caller.uid.to_string())
                .map_err(|e| format!("cannot record the mount: {e}"))?;
            log(&format!(
                "uid {} (pid {}): mounted {image} of {} (mount {id})",
                caller.uid,
                caller.pid,
                store.display()
            ));
            Ok((built.notices, None))
        }
        Request::Umount { lazy } => {
            let target = fds.next().ok_or("no mount point came with the request")?;
            let st = rustix::fs::statx(&target, "", AtFlags::EMPTY_PATH, StatxFlags::empty())
                .map_err(|e| format!("the mount point: {e}"))?;
            if !st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT) {
                return Err("not a mount point".into());
            }
            let id = unique_mount_id(target.as_fd()).map_err(|e| format!("the mount's id: {e}"))?;
            let record = Path::new(RECORDS).join(id.to_string());
            let owner = std::fs::read_to_string(&record)
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok());
            if owner != Some(caller.uid) {
                return Err("not a mount this service made for you".into());
            }
            unmount_by_fd(target, id, lazy)?;
            let _ = std::fs::remove_file(&record);
            log(&format!(
                "uid {} (pid {}): unmounted mount {id}",
                caller.uid, caller.pid
            ));
            Ok((Vec::new(), None))
        }
    }
}

/// Unmounts the mount whose root `target` is (unique id `id`), without a
/// path anyone else could change: from the mount point's parent directory,
/// held by descriptor as this thread's own working directory, by its last
/// name alone (a mount point can be neither renamed nor removed while
/// mounted). `target` is closed first: it would keep the mount busy.
fn unmount_by_fd(target: OwnedFd, id: u64, lazy: bool) -> Result<(), String> {
    let name = rustix::fs::readlinkat(
        rustix::fs::CWD,
        format!("/proc/self/fd/{}", target.as_raw_fd()),
        Vec::new(),
    )
    .map_err(|e| format!("the mount point's name: {e}"))?;
    let name = Path::new(std::ffi::OsStr::from_bytes(name.as_bytes()))
        .file_name()
        .map(|n| n.to_os_string())
        .ok_or("the mount point has no name")?;
    let parent = rustix::fs::openat(
        &target,
        "..",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("the mount point's directory: {e}"))?;
    let there = rustix::fs::statx(
        &parent,
        name.as_os_str(),
        AtFlags::SYMLINK_NOFOLLOW | AtFlags::NO_AUTOMOUNT,
        StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
    )
    .map_err(|e| format!("the mount point: {e}"))?;
    if there.stx_mnt_id != id || !there.stx_attributes.contains(StatxAttributes::MOUNT_ROOT) {
        return Err("the mount point moved while it was being unmounted".into());
    }
    drop(target);
    // This thread's working directory only (its own fs context).
    // SAFETY: CLONE_FS gives this thread its own root, cwd and umask; its
    // file table, memory and everything Rust relies on stay shared.
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::FS) }.map_err(|e| format!("unshare: {e}"))?;
    rustix::process::fchdir(&parent).map_err(|e| format!("fchdir: {e}"))?;
    let flags = rustix::mount::UnmountFlags::NOFOLLOW
        | if lazy {
            rustix::mount::UnmountFlags::DETACH
        } else {
            rustix::mount::UnmountFlags::empty()
        };
    let r = rustix::mount::unmount(name.as_os_str(), flags);
    let _ = rustix::process::chdir("/");
    match r {
        Ok(()) => Ok(()),
        Err(Errno::BUSY) => Err(
            "the mount is busy (a process has a file open or its working directory in it); close them and retry, or unmount with --lazy"
                .into(),
        ),
        Err(e) => Err(format!("unmount: {e}")),
    }
}

/// Opens `STORE/images/TAG` beneath the store, following no symlink,
/// without blocking, and only if it is a regular file.
fn open_tag(store: &Path, tag: &str) -> Result<std::fs::File, String> {
    let dir = rustix::fs::open(
        store,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("the store: {e}"))?;
    let fd = rustix::fs::openat2(
        &dir,
        format!("{}/{tag}", tilefs_store::store::IMAGES_DIR),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| match e {
        Errno::NOENT => "no such tag in the store (only tagged images are served)".to_string(),
        e => e.to_string(),
    })?;
    let st = rustix::fs::fstat(&fd).map_err(|e| e.to_string())?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err("not a regular file".into());
    }
    rustix::fs::fcntl_setfl(&fd, OFlags::empty()).map_err(|e| e.to_string())?;
    Ok(std::fs::File::from(fd))
}

/// A writable mount's upper and work directories: directories the caller
/// owns, two of them, on one filesystem.
fn check_layers(caller: &Caller, upper: BorrowedFd<'_>, work: BorrowedFd<'_>) -> Result<(), String> {
    let mut seen = Vec::new();
    for (fd, what) in [(upper, "upper"), (work, "work")] {
        let st = rustix::fs::fstat(fd).map_err(|e| format!("the {what} directory: {e}"))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return Err(format!("the {what} directory is not a directory"));
        }
        if st.st_uid != caller.uid {
            return Err(format!(
                "the {what} directory is owned by uid {}, not by the caller (uid {})",
                st.st_uid, caller.uid
            ));
        }
        seen.push((st.st_dev, st.st_ino));
    }
    if seen[0] == seen[1] {
        return Err("the upper and work directories are the same".into());
    }
    if seen[0].0 != seen[1].0 {
        return Err("the upper and work directories must be on the same filesystem".into());
    }
    Ok(())
}

/// Attaches `mount` at `target` if the caller may have it there: a
/// directory the caller owns that is not itself a mount point, checked and
/// used through the same descriptor.
fn attach_for(caller: &Caller, mount: &OwnedFd, target: BorrowedFd<'_>) -> Result<(), String> {
    let st = rustix::fs::statx(target, "", AtFlags::EMPTY_PATH, StatxFlags::TYPE | StatxFlags::UID)
        .map_err(|e| format!("the mount point: {e}"))?;
    if u32::from(st.stx_mode) & libc::S_IFMT != libc::S_IFDIR {
        return Err("the mount point is not a directory".into());
    }
    if st.stx_uid != caller.uid {
        return Err(format!(
            "the mount point is owned by uid {}, not by the caller (uid {})",
            st.stx_uid, caller.uid
        ));
    }
    if st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT) {
        return Err("the mount point is already a mount point".into());
    }
    rustix::mount::move_mount(
        mount,
        "",
        target,
        "",
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
    )
    .map_err(|e| format!("attaching the mount: {e}"))
}

/// The never-reused id of the mount `fd` is in (or the mount `fd` is).
fn unique_mount_id(fd: BorrowedFd<'_>) -> Result<u64, Errno> {
    let st = rustix::fs::statx(
        fd,
        "",
        AtFlags::EMPTY_PATH,
        StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
    )?;
    if st.stx_mask & STATX_MNT_ID_UNIQUE == 0 {
        return Err(Errno::NOSYS);
    }
    Ok(st.stx_mnt_id)
}

/// The socket clients use: `$TILEFS_MOUNTD_SOCKET`, else the default.
pub fn socket_path() -> PathBuf {
    std::env::var_os("TILEFS_MOUNTD_SOCKET")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET))
}
