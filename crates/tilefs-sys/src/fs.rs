//! File system calls rustix does not wrap, and the atomic replacement of
//! a file every writer of tilefs uses.

use rustix::fd::{AsRawFd, BorrowedFd};
use rustix::io::Errno;
use std::ffi::CString;

fn last_errno() -> Errno {
    Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO)
}

/// The uuid of the filesystem holding `fd` (FS_IOC_GETFSUUID), if it has
/// one that is not all zeros.
pub fn fs_uuid(fd: BorrowedFd<'_>) -> Option<Vec<u8>> {
    // struct fsuuid2 { __u8 len; __u8 uuid[16]; }
    const FS_IOC_GETFSUUID: libc::c_ulong = 0x8011_1500;
    let mut buf = [0u8; 17];
    // SAFETY: the ioctl writes at most the 17 bytes of `buf`.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), FS_IOC_GETFSUUID as _, buf.as_mut_ptr()) };
    let len = usize::from(buf[0]);
    (r == 0 && (1..=16).contains(&len) && buf[1..=len].iter().any(|&b| b != 0)).then(|| buf[1..=len].to_vec())
}

/// `fchmodat2(dir, name, mode, AT_SYMLINK_NOFOLLOW)`: a chmod that never
/// follows a symlink (Linux 6.6; a symlink itself fails with EOPNOTSUPP,
/// having no mode of its own).
pub fn chmod_nofollow(dir: BorrowedFd<'_>, name: &[u8], mode: u32) -> Result<(), Errno> {
    let c = CString::new(name).map_err(|_| Errno::INVAL)?;
    // SAFETY: fchmodat2 reads the NUL-terminated name, which outlives the
    // call; the descriptor is borrowed for it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_fchmodat2,
            dir.as_raw_fd(),
            c.as_ptr(),
            mode as libc::c_uint,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// What an open file description lock does to its byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RangeLock {
    Shared,
    Exclusive,
    Unlock,
}

/// Sets an open file description lock (`F_OFD_SETLK`, never waiting) on
/// `len` bytes from `start`: unlike POSIX record locks, it belongs to the
/// descriptor, so threads of one process exclude each other too.
pub fn ofd_lock(fd: BorrowedFd<'_>, kind: RangeLock, start: u64, len: u64) -> Result<(), Errno> {
    // SAFETY: flock is plain data; all-zero is a valid value of it.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = match kind {
        RangeLock::Shared => libc::F_RDLCK,
        RangeLock::Exclusive => libc::F_WRLCK,
        RangeLock::Unlock => libc::F_UNLCK,
    } as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = start.min(i64::MAX as u64 / 2) as libc::off_t;
    fl.l_len = len.clamp(1, i64::MAX as u64 / 2) as libc::off_t;
    // SAFETY: F_OFD_SETLK reads the flock, which outlives the call, on a
    // borrowed descriptor.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &fl) } == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// Takes a read lease on `fd` (`F_SETLEASE`, `F_RDLCK`; the descriptor must
/// be open read-only): the kernel refuses it with EAGAIN while any
/// descriptor anywhere has the file open for writing, and while it is held
/// an open for writing (or a truncate) waits until it is let go with
/// [`lease_release`] or the descriptor is closed (at most
/// `/proc/sys/fs/lease-break-time` seconds). The kernel tells the holder of
/// such a wait by a signal: SIGURG here, which a process ignores unless it
/// asks for it (the default, SIGIO, would end the process).
pub fn lease_read(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    // <asm-generic/fcntl.h>'s F_SETSIG (10 on every architecture Linux
    // runs tilefs on), which the libc crate leaves out.
    const F_SETSIG: libc::c_int = 10;
    // SAFETY: F_SETSIG and F_SETLEASE take an int argument and touch no
    // memory of ours; the descriptor is borrowed for the calls.
    unsafe {
        if libc::fcntl(fd.as_raw_fd(), F_SETSIG, libc::SIGURG) != 0 {
            return Err(last_errno());
        }
        if libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK) != 0 {
            return Err(last_errno());
        }
    }
    Ok(())
}

/// Lets go of a lease taken with [`lease_read`].
pub fn lease_release(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    // SAFETY: as in `lease_read`.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK) } == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// Replaces `path` whole, atomically: `write` fills a new file beside it
/// (created with exactly `mode`, never following a symlink, readable back
/// through the descriptor), which is synced, renamed over `path`, and the
/// directory synced, so that after a crash `path` is either the old file or
/// the new one, complete. Nothing is left behind when a step fails; the
/// error names `path` and the step.
pub fn replace<E: From<std::io::Error>>(
    path: &std::path::Path,
    mode: u32,
    write: impl FnOnce(&std::fs::File) -> Result<(), E>,
) -> Result<(), E> {
    use rustix::fs::{Mode, OFlags};
    use std::sync::atomic::{AtomicU64, Ordering};
    // Unique within the process, and the pid across processes: writers of
    // the same file (threads, two commands) never share a temporary file.
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let fail =
        |what: &str, e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {what}: {e}", path.display()));
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    let tmp = dir.join(format!(
        ".tmp-{name}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let fd = rustix::fs::open(
        &tmp,
        OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(mode),
    )
    .map_err(|e| fail("cannot create a temporary file beside it", e.into()))?;
    let file = std::fs::File::from(fd);
    let done = (|| {
        write(&file)?;
        // The umask does not narrow what the caller asked for.
        rustix::fs::fchmod(&file, Mode::from_raw_mode(mode)).map_err(|e| fail("cannot set its mode", e.into()))?;
        file.sync_all().map_err(|e| fail("cannot sync", e))?;
        std::fs::rename(&tmp, path).map_err(|e| fail("cannot rename into place", e))?;
        Ok::<(), E>(())
    })();
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(dir).map_err(|e| fail("cannot sync its directory", e))?;
    Ok(())
}

/// Syncs directory `dir`: the names made or removed in it are on disk.
pub fn sync_dir(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    fn listing(dir: &std::path::Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn replace_swaps_the_whole_file_or_leaves_the_old_one() {
        let dir = std::env::temp_dir().join(format!("tilefs-sys-replace-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let p = dir.join("record");
        std::fs::write(&p, b"old").unwrap();
        replace(&p, 0o640, |mut f| f.write_all(b"new")).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o640);
        // A writer that fails leaves the old file and no temporary one.
        let r = replace(&p, 0o644, |mut f| {
            f.write_all(b"half")?;
            Err(std::io::Error::other("stopped"))
        });
        assert_eq!(r.unwrap_err().to_string(), "stopped");
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(listing(&dir), ["record"]);
        // A directory in the way: the error names the file and the step.
        let d = dir.join("sub");
        std::fs::create_dir(&d).unwrap();
        let e = replace(&d, 0o644, |mut f| f.write_all(b"x")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("{}: cannot rename into place", d.display())),
            "{e}"
        );
        assert_eq!(listing(&dir), ["record", "sub"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
