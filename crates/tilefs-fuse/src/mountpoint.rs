//! Mounting and unmounting: mount(2) on /dev/fuse as root, the setuid
//! `fusermount3` helper otherwise (it opens /dev/fuse, mounts, and passes
//! the fd back over a socket named by `_FUSE_COMMFD`).

use crate::{fail, FuseError, MountFlags as Flags};
use rustix::io::Errno;
use rustix::mount::{MountFlags, UnmountFlags};
use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::{Command, Stdio};

/// The setuid helper that mounts and unmounts for unprivileged users.
pub(crate) fn fusermount() -> String {
    std::env::var("FUSERMOUNT_PATH").unwrap_or_else(|_| "fusermount3".into())
}

/// The source shown in /proc/mounts: `tilefs:` and the image's file name,
/// without the characters mount options cannot hold.
fn fsname(image: &Path) -> String {
    let name = image.file_name().map(|n| n.as_bytes()).unwrap_or(b"image");
    let clean: String = String::from_utf8_lossy(name)
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() && c != ',' && c != '\\' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("tilefs:{clean}")
}

/// Mounts a FUSE filesystem at `mnt` (read-only unless `writable`) and
/// returns the connection's /dev/fuse fd.
pub(crate) fn mount_fuse(
    mnt: &Path,
    image: &Path,
    allow_other: bool,
    default_permissions: bool,
    flags: Flags,
    writable: bool,
) -> Result<OwnedFd, FuseError> {
    let name = fsname(image);
    if rustix::process::geteuid().is_root() {
        match mount_sys(mnt, &name, allow_other, default_permissions, flags, writable) {
            Ok(fd) => return Ok(fd),
            // Root without the capability (a user namespace): the helper
            // may still work.
            Err(Errno::PERM) | Err(Errno::ACCESS) => {}
            Err(e) => return Err(fail(format!("{}: mount: {e}", mnt.display()))),
        }
    }
    mount_helper(mnt, &name, allow_other, default_permissions, flags, writable)
}

fn mount_sys(
    mnt: &Path,
    name: &str,
    allow_other: bool,
    default_permissions: bool,
    flags: Flags,
    writable: bool,
) -> Result<OwnedFd, Errno> {
    let fd = rustix::fs::open(
        "/dev/fuse",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    let st = rustix::fs::stat(mnt)?;
    let mut data = format!(
        "fd={},rootmode={:o},user_id={},group_id={}",
        fd.as_raw_fd(),
        st.st_mode & libc::S_IFMT,
        rustix::process::geteuid().as_raw(),
        rustix::process::getegid().as_raw()
    );
    if default_permissions {
        data.push_str(",default_permissions");
    }
    if allow_other {
        data.push_str(",allow_other");
    }
    let mut mflags = MountFlags::NOATIME;
    if !writable {
        mflags |= MountFlags::RDONLY;
    }
    for (on, f) in [
        (flags.nosuid == Some(true), MountFlags::NOSUID),
        (flags.nodev == Some(true), MountFlags::NODEV),
        (flags.noexec, MountFlags::NOEXEC),
        (flags.nosymfollow, MountFlags::NOSYMFOLLOW),
    ] {
        if on {
            mflags |= f;
        }
    }
    rustix::mount::mount(
        name,
        mnt,
        "fuse.tilefs",
        mflags,
        std::ffi::CString::new(data).map_err(|_| Errno::INVAL)?.as_c_str(),
    )?;
    Ok(fd)
}

fn mount_helper(
    mnt: &Path,
    name: &str,
    allow_other: bool,
    default_permissions: bool,
    flags: Flags,
    writable: bool,
) -> Result<OwnedFd, FuseError> {
    for (asked_off, what) in [(flags.nosuid, "suid"), (flags.nodev, "dev")] {
        if asked_off == Some(false) {
            return Err(fail(format!(
                "{}: option {what} cannot be honoured: a FUSE mount made without privilege (through {}) is always nosuid and nodev",
                mnt.display(),
                fusermount()
            )));
        }
    }
    use rustix::net::{
        recvmsg, socketpair, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SocketFlags,
        SocketType,
    };
    let (ours, theirs) = socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None)
        .map_err(|e| fail(format!("socketpair: {e}")))?;
    // fusermount3 makes every mount of a user nosuid and nodev; saying so
    // keeps that true even where it runs for root.
    let mut opts = format!(
        "{},noatime,nosuid,nodev,fsname={name},subtype=tilefs",
        if writable { "rw" } else { "ro" }
    );
    if flags.noexec {
        opts.push_str(",noexec");
    }
    if flags.nosymfollow {
        opts.push_str(",nosymfollow");
    }
    if default_permissions {
        opts.push_str(",default_permissions");
    }
    if allow_other {
        opts.push_str(",allow_other");
    }
    let helper = fusermount();
    let mut cmd = Command::new(&helper);
    // The helper's end of the socket is its standard input: the one
    // descriptor a child inherits without code between fork and exec.
    cmd.arg("-o")
        .arg(&opts)
        .arg("--")
        .arg(mnt)
        .env("_FUSE_COMMFD", "0")
        .stdin(Stdio::from(theirs))
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let child = cmd.spawn().map_err(|e| {
        fail(format!(
            "cannot run {helper} (Debian package fuse3), needed to mount without root: {e}"
        ))
    })?;
    // Our copy of the helper's end goes with the command, so that the
    // socket reads end of file when the helper exits.
    drop(cmd);
    let mut byte = [0u8; 1];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut fd = None;
    loop {
        match recvmsg(
            &ours,
            &mut [IoSliceMut::new(&mut byte)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(_) => {}
            Err(Errno::INTR) => continue,
            Err(_) => break,
        }
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = msg {
                for f in fds {
                    fd.get_or_insert(f);
                }
            }
        }
        break;
    }
    drop(ours);
    let out = child
        .wait_with_output()
        .map_err(|e| fail(format!("waiting for {helper}: {e}")))?;
    match fd {
        Some(fd) if out.status.success() => Ok(fd),
        _ => {
            let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
            Err(fail(format!(
                "{}: {helper} failed ({}): {err}{}",
                mnt.display(),
                out.status,
                helper_hint(&err)
            )))
        }
    }
}

/// What to do about the usual reasons fusermount3 refuses a user.
fn helper_hint(err: &str) -> &'static str {
    if err.contains("/dev/fuse") && err.contains("Permission denied") {
        " (/dev/fuse must be readable and writable by the user: mode 0666, as udev sets it on most systems)"
    } else if err.contains("user_allow_other") {
        " (add user_allow_other to /etc/fuse.conf, or mount without allow_other)"
    } else {
        ""
    }
}

fn run_helper(args: &[&str], mnt: &Path) -> Result<(), String> {
    let helper = fusermount();
    let out = Command::new(&helper)
        .args(args)
        .arg("--")
        .arg(mnt)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {helper}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// Unmounts the FUSE mount at `mountpoint`, also one whose server died. A
/// busy mount is refused, unless `lazy`: then it is detached (it goes away
/// when its last user leaves).
pub fn unmount(mountpoint: &Path, lazy: bool) -> Result<(), FuseError> {
    if lazy {
        return detach(mountpoint);
    }
    let busy = || FuseError::Busy(mountpoint.to_path_buf());
    if rustix::process::geteuid().is_root() {
        match rustix::mount::unmount(mountpoint, UnmountFlags::empty()) {
            Ok(()) => return Ok(()),
            Err(Errno::BUSY) => return Err(busy()),
            Err(Errno::PERM) => {}
            Err(e) => return Err(fail(format!("{}: unmount: {e}", mountpoint.display()))),
        }
    }
    match run_helper(&["-u"], mountpoint) {
        Ok(()) => Ok(()),
        Err(e) if e.contains("busy") => Err(busy()),
        Err(e) => Err(fail(format!("{}: {e}", mountpoint.display()))),
    }
}

/// Takes a mount of ours down after a failure: unmounted, or detached if
/// something already holds it.
pub(crate) fn take_down(mountpoint: &Path) {
    if unmount(mountpoint, false).is_err() {
        let _ = detach(mountpoint);
    }
}

/// Detaches the mount at `mountpoint` lazily.
pub(crate) fn detach(mountpoint: &Path) -> Result<(), FuseError> {
    if rustix::process::geteuid().is_root() {
        match rustix::mount::unmount(mountpoint, UnmountFlags::DETACH) {
            Ok(()) => return Ok(()),
            Err(Errno::PERM) => {}
            Err(e) => return Err(fail(format!("{}: unmount: {e}", mountpoint.display()))),
        }
    }
    run_helper(&["-u", "-z"], mountpoint).map_err(|e| fail(format!("{}: {e}", mountpoint.display())))
}
