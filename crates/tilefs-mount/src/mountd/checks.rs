//! Where the service may attach a mount for a caller, and whether a mount
//! it made is in use: every check made on the descriptor the caller sent,
//! never on a path.
//!
//! A mount point must be one the caller could use as if the mount were
//! theirs: a directory the caller owns, can write and reach (every
//! directory above it searchable by the caller), on a filesystem that
//! holds ordinary files (never proc, sysfs, cgroup, devtmpfs or another
//! pseudo filesystem, where a directory the caller owns can still be read
//! by others as the kernel's word), not already a mount point and not
//! covered by one.

use super::policy::Caller;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{Access, AtFlags, Mode, OFlags, StatxAttributes, StatxFlags};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// statx's STATX_MNT_ID_UNIQUE (Linux 6.8): an id never reused.
pub(crate) const STATX_MNT_ID_UNIQUE: u32 = 0x4000;
/// statx's STATX_MNT_ID: the id /proc shows (reused after an unmount).
pub(crate) const STATX_MNT_ID: u32 = 0x1000;

/// Filesystems whose directories a user may have a mount attached to:
/// those that store files (the type mountinfo names). A pseudo filesystem
/// (proc, sysfs, cgroup, devtmpfs, ...) is never one, whoever owns the
/// directory.
const ORDINARY: &[&str] = &[
    "ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "f2fs", "bcachefs", "zfs", "nfs", "nfs4", "cifs", "smb3", "ceph",
    "gfs2", "ocfs2", "jfs", "reiserfs", "nilfs2", "vfat", "msdos", "exfat", "ntfs", "ntfs3", "overlay", "fuse",
    "fuseblk", "9p", "virtiofs", "afs", "lustre",
];

/// Why `caller` may not have a mount attached at `target`, if so.
pub(crate) fn mount_point(caller: &Caller, target: BorrowedFd<'_>) -> Result<(), String> {
    let st = rustix::fs::statx(
        target,
        "",
        AtFlags::EMPTY_PATH,
        StatxFlags::TYPE | StatxFlags::UID | StatxFlags::INO | StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
    )
    .map_err(|e| format!("the mount point: {e}"))?;
    if u32::from(st.stx_mode) & libc::S_IFMT != libc::S_IFDIR {
        return Err("the mount point is not a directory".into());
    }
    if st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT) {
        return Err("the mount point is already a mount point".into());
    }
    covered(target, &st)?;
    if st.stx_uid != caller.uid {
        return Err(format!(
            "the mount point is owned by uid {}, not by the caller (uid {})",
            st.stx_uid, caller.uid
        ));
    }
    let fstype = fstype_of(target)?;
    let ordinary = ORDINARY.contains(&fstype.as_str()) || fstype.starts_with("fuse.");
    if !ordinary {
        return Err(format!(
            "the mount point is on a {fstype} filesystem: the service mounts only on filesystems that store files"
        ));
    }
    reachable_and_writable(caller, target)
}

/// The type of the filesystem `fd` is on, as mountinfo names it.
fn fstype_of(fd: BorrowedFd<'_>) -> Result<String, String> {
    let st = rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::from_bits_retain(STATX_MNT_ID))
        .map_err(|e| format!("the mount point: {e}"))?;
    let mountinfo =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    // "ID PARENT MAJ:MIN ROOT POINT OPTIONS [TAGS...] - FSTYPE SOURCE SUPER"
    mountinfo
        .lines()
        .find(|l| l.split(' ').next().and_then(|i| i.parse::<u64>().ok()) == Some(st.stx_mnt_id))
        .and_then(|l| l.split(" - ").nth(1))
        .and_then(|rest| rest.split(' ').next())
        .map(str::to_string)
        .ok_or_else(|| "the mount point is not in the service's mount namespace".to_string())
}

/// Refuses a directory something is mounted on: the caller's descriptor
/// then names the directory under that mount, where a new mount would
/// stack on top of it. Looked up again by name from its parent, the
/// directory must be the same one, on the same mount.
fn covered(target: BorrowedFd<'_>, st: &rustix::fs::Statx) -> Result<(), String> {
    let path = fd_path(target)?;
    let name = path
        .file_name()
        .filter(|_| !path.as_os_str().as_bytes().ends_with(b" (deleted)"))
        .ok_or("the mount point has been removed")?;
    let parent = rustix::fs::openat(
        target,
        "..",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("the mount point's directory: {e}"))?;
    let there = rustix::fs::statx(
        &parent,
        name,
        AtFlags::SYMLINK_NOFOLLOW | AtFlags::NO_AUTOMOUNT,
        StatxFlags::INO | StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
    )
    .map_err(|e| format!("the mount point, looked up again: {e}"))?;
    let same = there.stx_ino == st.stx_ino
        && (there.stx_dev_major, there.stx_dev_minor) == (st.stx_dev_major, st.stx_dev_minor)
        && there.stx_mnt_id == st.stx_mnt_id;
    if !same {
        return Err("the mount point is covered by another mount (or moved)".into());
    }
    Ok(())
}

/// The caller can write and search the directory and search every
/// directory above it: checked with the caller's own credentials.
fn reachable_and_writable(caller: &Caller, target: BorrowedFd<'_>) -> Result<(), String> {
    let groups = caller.gids.get(1..).unwrap_or_default();
    let _as_caller = tilefs_sys::creds::FsCreds::enter(caller.uid, caller.gids[0], groups)
        .map_err(|e| format!("taking on the caller's credentials: {e}"))?;
    // "." of the directory itself (faccessat2 refuses AT_EMPTY_PATH here).
    let may = |dir: BorrowedFd<'_>, access: Access| rustix::fs::accessat(dir, ".", access, AtFlags::EACCESS).is_ok();
    if !may(target, Access::WRITE_OK | Access::EXEC_OK) {
        return Err("the mount point is not a directory the caller may write to".into());
    }
    let mut cur: OwnedFd = rustix::fs::openat(
        target,
        ".",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("the mount point: {e}"))?;
    // Bounded: a path has at most PATH_MAX / 2 components.
    for _ in 0..2048 {
        let parent = rustix::fs::openat(
            &cur,
            "..",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|_| "a directory above the mount point is not searchable by the caller".to_string())?;
        if same_file(cur.as_fd(), parent.as_fd()) {
            return Ok(());
        }
        if !may(parent.as_fd(), Access::EXEC_OK) {
            let at = fd_path(parent.as_fd())
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            return Err(format!(
                "the directory {at} above the mount point is not searchable by the caller"
            ));
        }
        cur = parent;
    }
    Err("the mount point is nested too deep".into())
}

fn same_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> bool {
    match (rustix::fs::fstat(a), rustix::fs::fstat(b)) {
        (Ok(x), Ok(y)) => (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino),
        _ => false,
    }
}

/// Where `fd` is, as the kernel names it.
pub(crate) fn fd_path(fd: BorrowedFd<'_>) -> Result<PathBuf, String> {
    use std::os::fd::AsRawFd;
    let link = rustix::fs::readlink(format!("/proc/self/fd/{}", fd.as_raw_fd()), Vec::new())
        .map_err(|e| format!("a directory's name: {e}"))?;
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(link.as_bytes())))
}

/// What keeps the mount whose root is `root` in use, if anything: mounts
/// on or inside it, processes with their working or root directory in it,
/// files open or mapped from it. An unmount while any of these holds would
/// fail with EBUSY; the service unmounts by descriptor with MNT_DETACH,
/// which never fails, so it asks first.
pub(crate) fn in_use(root: BorrowedFd<'_>) -> Result<Option<String>, String> {
    let st = rustix::fs::statx(
        root,
        "",
        AtFlags::EMPTY_PATH,
        StatxFlags::from_bits_retain(STATX_MNT_ID),
    )
    .map_err(|e| format!("the mount: {e}"))?;
    let id = st.stx_mnt_id;
    let dev = format!("{:02x}:{:02x}", st.stx_dev_major, st.stx_dev_minor);
    let mountinfo =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    if mountinfo
        .lines()
        .any(|l| l.split(' ').nth(1).and_then(|p| p.parse::<u64>().ok()) == Some(id))
    {
        return Ok(Some("something is mounted inside it".into()));
    }
    let me = std::process::id().to_string();
    let procs = std::fs::read_dir("/proc").map_err(|e| format!("/proc: {e}"))?;
    for p in procs.flatten() {
        let name = p.file_name();
        let Some(pid) = name.to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())) else {
            continue;
        };
        if pid == me {
            continue;
        }
        if let Some(what) = process_uses(&p.path(), id, &dev) {
            let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            return Ok(Some(format!("{what} of process {pid} ({})", comm.trim())));
        }
    }
    Ok(None)
}

/// How the process at `/proc/PID` uses mount `id` (device `dev`), if it does.
fn process_uses(proc: &Path, id: u64, dev: &str) -> Option<&'static str> {
    // The mount a directory is on is the kernel's to say: its filesystem
    // is not asked (any user's process may sit in a FUSE directory that
    // never answers).
    let mnt_of = |link: &str| {
        rustix::fs::statx(
            rustix::fs::CWD,
            proc.join(link),
            AtFlags::STATX_DONT_SYNC,
            StatxFlags::from_bits_retain(STATX_MNT_ID),
        )
        .ok()
        .map(|s| s.stx_mnt_id)
    };
    if mnt_of("cwd") == Some(id) {
        return Some("the working directory");
    }
    if mnt_of("root") == Some(id) {
        return Some("the root directory");
    }
    // O_PATH descriptors read and write nothing: not uses (the client's
    // own, of the mount point it sent, is one).
    const O_PATH: u64 = 0o10000000;
    if let Ok(fds) = std::fs::read_dir(proc.join("fdinfo")) {
        for f in fds.flatten() {
            let info = std::fs::read_to_string(f.path()).unwrap_or_default();
            let field = |name: &str, radix: u32| {
                info.lines()
                    .find_map(|l| l.strip_prefix(name))
                    .and_then(|v| u64::from_str_radix(v.trim(), radix).ok())
            };
            if field("mnt_id:", 10) == Some(id) && field("flags:", 8).is_some_and(|f| f & O_PATH == 0) {
                return Some("an open file");
            }
        }
    }
    let maps = std::fs::read_to_string(proc.join("maps")).unwrap_or_default();
    if maps.lines().any(|l| l.split_whitespace().nth(3) == Some(dev)) {
        return Some("a mapped file");
    }
    None
}

/// The calling thread's view: whether `fd` is the root of a mount.
pub(crate) fn is_mount_root(fd: impl AsFd) -> Result<bool, String> {
    let st = rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::empty())
        .map_err(|e| format!("the mount point: {e}"))?;
    Ok(st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT))
}
