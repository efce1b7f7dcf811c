//! Writable mounts (`tilefs mount --fuse --upper DIR --work DIR`): the same
//! random sequences of operations applied to the FUSE mount, to the
//! kernel's overlayfs over the same image and to a plain copy of the tree
//! give the same results (each operation's outcome, then names, types,
//! modes, owners, sizes, contents, xattrs and link counts), as root and as
//! an unprivileged user writing, and with the FUSE server itself running
//! without privilege. The upper directory persists (a remount shows the
//! same tree) and is overlayfs's format (the kernel's overlay mounts it
//! and shows the same tree).
//!
//! `TILEFS_WRITABLE_OPS` sets the number of operations per sequence
//! (default 400); `TILEFS_WRITABLE_SEEDS` (`A-B` or `A,B,...`) replaces
//! each test's fixed seeds, for soaking with many more sequences.

// The operations are applied with raw system calls (each one's errno is
// compared across the three trees) and files are changed through shared
// mappings, as a program in the mount would.
#![allow(unsafe_code)]

mod common;

use common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

// ---------------------------------------------------------------------------
// The image
// ---------------------------------------------------------------------------

fn set_owner(p: &Path, uid: u32, gid: u32) {
    rustix::fs::chownat(
        rustix::fs::CWD,
        p,
        Some(rustix::process::Uid::from_raw(uid)),
        Some(rustix::process::Gid::from_raw(gid)),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
}

fn set_mode(p: &Path, mode: u32) {
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

fn xattr(p: &Path, k: &str, v: &[u8]) {
    rustix::fs::lsetxattr(p, k, v, rustix::fs::XattrFlags::empty()).unwrap();
}

/// The lower tree: directories an unprivileged user may write in (and
/// ones it may not), files of inline and external sizes, owners, modes,
/// xattrs, symlinks, a FIFO, a device, and with `hardlinks` files of
/// several names.
fn make_lower(root: &Path, hardlinks: bool) {
    let mut rng = Rng::new(77);
    fs::create_dir(root).unwrap();
    let mk = |p: &Path, mode: u32, uid: u32| {
        fs::create_dir_all(p).unwrap();
        set_mode(p, mode);
        set_owner(p, uid, uid);
    };
    let file = |p: &Path, size: usize, mode: u32, uid: u32, rng: &mut Rng| {
        fs::write(p, rng.bytes(size)).unwrap();
        set_mode(p, mode);
        set_owner(p, uid, uid);
    };
    mk(&root.join("pub"), 0o777, 0);
    mk(&root.join("pub/sticky"), 0o1777, 0);
    mk(&root.join("pub/own"), 0o755, NOBODY);
    mk(&root.join("pub/own/sub/deeper"), 0o755, NOBODY);
    mk(&root.join("pub/own/empty"), 0o755, NOBODY);
    mk(&root.join("pub/own/setgid"), 0o2775, NOBODY);
    for (i, size) in [0usize, 10, 64, 65, 5000, 70_000, 300_000].into_iter().enumerate() {
        file(&root.join(format!("pub/own/f{i}")), size, 0o644, NOBODY, &mut rng);
        file(
            &root.join(format!("pub/own/sub/s{i}")),
            size / 2,
            0o640,
            NOBODY,
            &mut rng,
        );
    }
    file(&root.join("pub/own/sub/deeper/bottom"), 1000, 0o600, NOBODY, &mut rng);
    file(&root.join("pub/own/exec"), 200, 0o755, NOBODY, &mut rng);
    file(&root.join("pub/rootfile"), 300, 0o644, 0, &mut rng);
    file(&root.join("pub/sticky/theirs"), 100, 0o666, 0, &mut rng);
    file(&root.join("pub/sticky/mine"), 100, 0o644, NOBODY, &mut rng);
    xattr(&root.join("pub/own/f1"), "user.note", b"lower note");
    xattr(&root.join("pub/own/f4"), "user.big", &[7u8; 300]);
    xattr(&root.join("pub/own/sub"), "user.dir", b"on a dir");
    xattr(&root.join("pub/rootfile"), "trusted.secret", b"root only");
    std::os::unix::fs::symlink("f1", root.join("pub/own/link")).unwrap();
    std::os::unix::fs::symlink("sub/deeper", root.join("pub/own/dirlink")).unwrap();
    set_owner(&root.join("pub/own/link"), NOBODY, NOBODY);
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join("pub/own/fifo").as_path(),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    set_owner(&root.join("pub/own/fifo"), NOBODY, NOBODY);
    mk(&root.join("etc/conf.d"), 0o755, 0);
    file(&root.join("etc/passwd"), 1500, 0o644, 0, &mut rng);
    file(&root.join("etc/conf.d/a.conf"), 40, 0o644, 0, &mut rng);
    file(&root.join("etc/conf.d/b.conf"), 4000, 0o600, 0, &mut rng);
    file(&root.join("etc/suid"), 4000, 0o4755, 0, &mut rng);
    mk(&root.join("dev"), 0o755, 0);
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join("dev/null").as_path(),
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    )
    .unwrap();
    mk(&root.join("big"), 0o755, 0);
    for i in 0..150 {
        file(
            &root.join(format!("big/entry-{i:03}")),
            (i * 37) % 200,
            0o644,
            0,
            &mut rng,
        );
    }
    if hardlinks {
        file(&root.join("pub/own/hl-a"), 3000, 0o644, NOBODY, &mut rng);
        fs::hard_link(root.join("pub/own/hl-a"), root.join("pub/own/hl-b")).unwrap();
        fs::hard_link(root.join("pub/own/hl-a"), root.join("pub/own/sub/hl-c")).unwrap();
        file(&root.join("etc/hl-small"), 20, 0o644, 0, &mut rng);
        fs::hard_link(root.join("etc/hl-small"), root.join("etc/hl-small2")).unwrap();
    }
}

// ---------------------------------------------------------------------------
// Mounts
// ---------------------------------------------------------------------------

/// Mounts `image` writable at `mnt` with `upper`/`work`: `how` is
/// "kernel" or "fuse" (root, allow_other), or "fuse-nobody" (the server
/// run by the unprivileged user). `extra`: more arguments.
fn mount_rw(how: &str, store: &Path, image: &Path, dirs: (&Path, &Path, &Path), extra: &[&str]) -> Mounted {
    mount_rw_under(&[], how, store, image, dirs, extra)
}

/// [`mount_rw`], with the mount command run under `wrapper` (a command
/// and its arguments, as `prlimit --nofile=N`).
fn mount_rw_under(
    wrapper: &[&str],
    how: &str,
    store: &Path,
    image: &Path,
    dirs: (&Path, &Path, &Path),
    extra: &[&str],
) -> Mounted {
    let (mnt, upper, work) = dirs;
    let mut cmd = match wrapper {
        [] => Command::new(tilefs_bin()),
        [w, args @ ..] => {
            let mut c = Command::new(w);
            c.args(args).arg(tilefs_bin());
            c
        }
    };
    cmd.arg("mount")
        .args(if how == "kernel" { ["--kernel"] } else { ["--fuse"] })
        .arg("--store")
        .arg(store)
        .arg("--upper")
        .arg(upper)
        .arg("--work")
        .arg(work)
        .args(extra);
    // Ids as stored, as the kernel overlay shows them, unless the test
    // maps them (a user's mount of root's image otherwise shows root's
    // files as the user's).
    if how != "kernel" && !extra.iter().any(|e| e.contains("uidmapping")) {
        cmd.args(["-o", "uidmapping=none,gidmapping=none"]);
    }
    if how == "fuse" {
        cmd.args(["-o", "allow_other"]);
    }
    cmd.arg(image).arg(mnt);
    if how == "fuse-nobody" {
        as_nobody(&mut cmd);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "mount {how} failed: {}", stderr(&out));
    Mounted(mnt.to_path_buf())
}

fn umount(m: Mounted) {
    let out = tilefs_any(&[os("umount"), m.0.as_os_str()]);
    assert!(out.status.success(), "umount {}: {}", m.0.display(), stderr(&out));
    std::mem::forget(m);
}

// ---------------------------------------------------------------------------
// The operations
// ---------------------------------------------------------------------------

/// One operation, on paths relative to each root.
#[derive(Debug, Clone)]
enum Opn {
    Create(PathBuf, usize, u32),
    Write(PathBuf, u64, usize),
    Append(PathBuf, usize),
    Truncate(PathBuf, u64),
    OpenTrunc(PathBuf, usize),
    Mkdir(PathBuf, u32),
    Rmdir(PathBuf),
    Unlink(PathBuf),
    Rename(PathBuf, PathBuf, u32),
    Link(PathBuf, PathBuf),
    Symlink(Vec<u8>, PathBuf),
    Chmod(PathBuf, u32),
    Chown(PathBuf, u32, u32),
    Utimes(PathBuf, i64, i64),
    SetXattr(PathBuf, String, Vec<u8>),
    RemoveXattr(PathBuf, String),
    Mkfifo(PathBuf),
    Mknod(PathBuf, u64),
    Fallocate(PathBuf, i32, u64, u64),
    TmpfileLink(PathBuf, PathBuf, usize),
}

fn cpath(root: &Path, rel: &Path) -> CString {
    CString::new(root.join(rel).as_os_str().as_bytes()).unwrap()
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Applies `op` under `root`; the outcome is 0 or an errno. Data written
/// is derived from the op, so every root gets the same bytes.
fn apply(root: &Path, op: &Opn, seed: u64) -> i32 {
    let data = |n: usize| Rng::new(seed).bytes(n);
    // SAFETY: plain syscalls on NUL-terminated paths and valid buffers.
    unsafe {
        let r = match op {
            Opn::Create(p, n, mode) => {
                let fd = libc::open(
                    cpath(root, p).as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC,
                    *mode,
                );
                if fd < 0 {
                    return last_errno();
                }
                let d = data(*n);
                let w = libc::write(fd, d.as_ptr().cast(), d.len());
                libc::close(fd);
                if w < 0 {
                    -1
                } else {
                    0
                }
            }
            Opn::Write(p, off, n) => return write_at(root, p, Some(*off), &data(*n)),
            Opn::Append(p, n) => return write_at(root, p, None, &data(*n)),
            Opn::Truncate(p, size) => libc::truncate(cpath(root, p).as_ptr(), *size as i64),
            Opn::OpenTrunc(p, n) => {
                let fd = libc::open(
                    cpath(root, p).as_ptr(),
                    libc::O_WRONLY | libc::O_TRUNC | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC,
                );
                if fd < 0 {
                    return last_errno();
                }
                let d = data(*n);
                let w = libc::write(fd, d.as_ptr().cast(), d.len());
                let e = last_errno();
                libc::close(fd);
                return if w < 0 { e } else { 0 };
            }
            Opn::Mkdir(p, mode) => libc::mkdir(cpath(root, p).as_ptr(), *mode),
            Opn::Rmdir(p) => libc::rmdir(cpath(root, p).as_ptr()),
            Opn::Unlink(p) => libc::unlink(cpath(root, p).as_ptr()),
            Opn::Rename(a, b, flags) => libc::renameat2(
                libc::AT_FDCWD,
                cpath(root, a).as_ptr(),
                libc::AT_FDCWD,
                cpath(root, b).as_ptr(),
                *flags,
            ),
            Opn::Link(a, b) => libc::link(cpath(root, a).as_ptr(), cpath(root, b).as_ptr()),
            Opn::Symlink(t, p) => libc::symlink(CString::new(t.clone()).unwrap().as_ptr(), cpath(root, p).as_ptr()),
            Opn::Chmod(p, mode) => libc::fchmodat(libc::AT_FDCWD, cpath(root, p).as_ptr(), *mode, 0),
            Opn::Chown(p, u, g) => libc::lchown(cpath(root, p).as_ptr(), *u, *g),
            Opn::Utimes(p, a, m) => {
                let ts = [
                    libc::timespec {
                        tv_sec: *a,
                        tv_nsec: 123,
                    },
                    libc::timespec {
                        tv_sec: *m,
                        tv_nsec: 456_789,
                    },
                ];
                libc::utimensat(
                    libc::AT_FDCWD,
                    cpath(root, p).as_ptr(),
                    ts.as_ptr(),
                    libc::AT_SYMLINK_NOFOLLOW,
                )
            }
            Opn::SetXattr(p, k, v) => {
                let k = CString::new(k.as_str()).unwrap();
                libc::lsetxattr(cpath(root, p).as_ptr(), k.as_ptr(), v.as_ptr().cast(), v.len(), 0)
            }
            Opn::RemoveXattr(p, k) => {
                let k = CString::new(k.as_str()).unwrap();
                libc::lremovexattr(cpath(root, p).as_ptr(), k.as_ptr())
            }
            Opn::Mkfifo(p) => libc::mkfifo(cpath(root, p).as_ptr(), 0o640),
            Opn::Mknod(p, dev) => libc::mknod(cpath(root, p).as_ptr(), libc::S_IFCHR | 0o600, *dev),
            Opn::Fallocate(p, mode, off, len) => {
                let fd = libc::open(
                    cpath(root, p).as_ptr(),
                    libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC,
                );
                if fd < 0 {
                    return last_errno();
                }
                let r = libc::fallocate(fd, *mode, *off as i64, *len as i64);
                let e = last_errno();
                libc::close(fd);
                return if r < 0 { e } else { 0 };
            }
            Opn::TmpfileLink(dir, p, n) => {
                let fd = libc::open(
                    cpath(root, dir).as_ptr(),
                    libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC,
                    0o640,
                );
                if fd < 0 {
                    return last_errno();
                }
                let d = data(*n);
                libc::write(fd, d.as_ptr().cast(), d.len());
                let proc = CString::new(format!("/proc/self/fd/{fd}")).unwrap();
                let r = libc::linkat(
                    libc::AT_FDCWD,
                    proc.as_ptr(),
                    libc::AT_FDCWD,
                    cpath(root, p).as_ptr(),
                    libc::AT_SYMLINK_FOLLOW,
                );
                let e = last_errno();
                libc::close(fd);
                return if r < 0 { e } else { 0 };
            }
        };
        if r < 0 {
            last_errno()
        } else {
            0
        }
    }
}

/// Writes `d` to the file `p` under `root` at `off` (None: appending).
fn write_at(root: &Path, p: &Path, off: Option<u64>, d: &[u8]) -> i32 {
    // O_CLOEXEC: a server another test starts meanwhile must not inherit
    // the descriptor and keep this mount busy.
    let flags = libc::O_WRONLY
        | libc::O_NOFOLLOW
        | libc::O_NONBLOCK
        | libc::O_CLOEXEC
        | if off.is_none() { libc::O_APPEND } else { 0 };
    // SAFETY: plain syscalls on a NUL-terminated path and a valid buffer.
    unsafe {
        let fd = libc::open(cpath(root, p).as_ptr(), flags);
        if fd < 0 {
            return last_errno();
        }
        let w = match off {
            Some(o) => libc::pwrite(fd, d.as_ptr().cast(), d.len(), o as i64),
            None => libc::write(fd, d.as_ptr().cast(), d.len()),
        };
        let e = last_errno();
        libc::close(fd);
        if w < 0 {
            e
        } else {
            0
        }
    }
}

/// What a root holds, for choosing operands: directories and non-dirs.
fn entries(root: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut dirs = vec![PathBuf::new()];
    let mut files = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(root.join(&d)) else { continue };
        let mut names: Vec<_> = rd.filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
        names.sort();
        for n in names {
            let rel = d.join(&n);
            match fs::symlink_metadata(root.join(&rel)) {
                Ok(m) if m.is_dir() => {
                    dirs.push(rel.clone());
                    stack.push(rel);
                }
                Ok(_) => files.push(rel),
                Err(_) => {}
            }
        }
    }
    (dirs, files)
}

/// The next random operation on the tree under `root` (the first root:
/// all hold the same tree).
fn next_op(rng: &mut Rng, root: &Path, as_root: bool, n: usize) -> Opn {
    let (dirs, files) = entries(root);
    // Mostly where the writer may write.
    let pick_dir = |rng: &mut Rng| -> PathBuf {
        let writable: Vec<&PathBuf> = dirs.iter().filter(|d| as_root || d.starts_with("pub")).collect();
        let v = if writable.is_empty() || rng.below(10) == 0 {
            dirs.iter().collect()
        } else {
            writable
        };
        v[rng.below(v.len() as u64) as usize].clone()
    };
    let pick_any = |rng: &mut Rng| -> PathBuf {
        let all: Vec<&PathBuf> = dirs.iter().skip(1).chain(files.iter()).collect();
        let pubs: Vec<&PathBuf> = all
            .iter()
            .copied()
            .filter(|p| as_root || p.starts_with("pub"))
            .collect();
        let v = if pubs.is_empty() || rng.below(8) == 0 {
            all
        } else {
            pubs
        };
        if v.is_empty() {
            return PathBuf::from("pub");
        }
        v[rng.below(v.len() as u64) as usize].clone()
    };
    let pick_file = |rng: &mut Rng| -> PathBuf {
        let pubs: Vec<&PathBuf> = files.iter().filter(|p| as_root || p.starts_with("pub")).collect();
        let v: Vec<&PathBuf> = if pubs.is_empty() || rng.below(8) == 0 {
            files.iter().collect()
        } else {
            pubs
        };
        if v.is_empty() {
            return PathBuf::from("pub/none");
        }
        v[rng.below(v.len() as u64) as usize].clone()
    };
    let fresh = |rng: &mut Rng, dir: PathBuf| -> PathBuf {
        // Sometimes an existing name, to hit EEXIST and replacements.
        if rng.below(5) == 0 {
            return pick_any(rng);
        }
        dir.join(format!("n{n}-{}", rng.below(1000)))
    };
    match rng.below(22) {
        0 | 1 => {
            let d = pick_dir(rng);
            Opn::Create(
                fresh(rng, d),
                rng.below(100_000) as usize,
                [0o644, 0o600, 0o755, 0o4755][rng.below(4) as usize],
            )
        }
        2 => Opn::Write(pick_file(rng), rng.below(80_000), 1 + rng.below(20_000) as usize),
        3 => Opn::Append(pick_file(rng), 1 + rng.below(5000) as usize),
        4 => Opn::Truncate(pick_file(rng), rng.below(100_000)),
        5 => Opn::OpenTrunc(pick_file(rng), rng.below(3000) as usize),
        6 => {
            let d = pick_dir(rng);
            Opn::Mkdir(fresh(rng, d), [0o755, 0o700, 0o2775, 0o1777][rng.below(4) as usize])
        }
        7 => Opn::Rmdir(pick_any(rng)),
        8 | 9 => Opn::Unlink(pick_file(rng)),
        10 | 11 => {
            let src = pick_any(rng);
            let d = pick_dir(rng);
            let flags = match rng.below(8) {
                0 => libc::RENAME_EXCHANGE,
                1 => libc::RENAME_NOREPLACE,
                _ => 0,
            };
            Opn::Rename(src, fresh(rng, d), flags)
        }
        12 => {
            let d = pick_dir(rng);
            Opn::Link(pick_file(rng), fresh(rng, d))
        }
        13 => {
            let d = pick_dir(rng);
            let t: &[u8] = [&b"f1"[..], b"../etc/passwd", b"/nowhere", b"sub"][rng.below(4) as usize];
            Opn::Symlink(t.to_vec(), fresh(rng, d))
        }
        14 => Opn::Chmod(
            pick_any(rng),
            [0o644, 0o600, 0o755, 0o4711, 0o2755, 0o1777, 0o000][rng.below(7) as usize],
        ),
        15 => {
            let ids = if as_root {
                [0, NOBODY, 1234, 70_000]
            } else {
                [NOBODY, NOBODY, 0, 1234]
            };
            Opn::Chown(pick_any(rng), ids[rng.below(4) as usize], ids[rng.below(4) as usize])
        }
        16 => Opn::Utimes(
            pick_any(rng),
            1_000_000 + rng.below(1000) as i64,
            2_000_000 + rng.below(1000) as i64,
        ),
        17 => {
            let k = ["user.a", "user.b", "user.note", "trusted.t"][rng.below(4) as usize];
            if rng.below(3) == 0 {
                Opn::RemoveXattr(pick_any(rng), k.into())
            } else {
                let n = 1 + rng.below(100) as usize;
                Opn::SetXattr(pick_any(rng), k.into(), rng.bytes(n))
            }
        }
        18 => {
            let d = pick_dir(rng);
            if as_root && rng.below(2) == 0 {
                Opn::Mknod(fresh(rng, d), rustix::fs::makedev(1, 5))
            } else {
                Opn::Mkfifo(fresh(rng, d))
            }
        }
        19 => {
            let modes = [
                0,
                libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                libc::FALLOC_FL_ZERO_RANGE,
            ];
            Opn::Fallocate(
                pick_file(rng),
                modes[rng.below(4) as usize],
                rng.below(60_000),
                1 + rng.below(30_000),
            )
        }
        _ => {
            let d = pick_dir(rng);
            let p = fresh(rng, d.clone());
            Opn::TmpfileLink(d, p, rng.below(5000) as usize)
        }
    }
}

/// Runs `count` random operations (seed `seed`) on every root in
/// lockstep; returns the operations whose outcomes differed.
fn run_ops(roots: &[PathBuf], seed: u64, count: usize, as_root: bool) -> Vec<String> {
    let mut rng = Rng::new(seed);
    let mut diffs = Vec::new();
    for i in 0..count {
        let op = next_op(&mut rng, &roots[0], as_root, i);
        let data_seed = seed * 1_000_003 + i as u64;
        let results: Vec<i32> = roots.iter().map(|r| apply(r, &op, data_seed)).collect();
        let traced = std::env::var("TILEFS_WRITABLE_TRACE").is_ok_and(|t| format!("{op:?}").contains(&t));
        if traced || results.iter().any(|&r| r != results[0]) {
            diffs.push(format!("op {i} {op:?}: outcomes {results:?}"));
        }
    }
    diffs
}

/// When run with TILEFS_WRITABLE_OPS_ROOTS (as the unprivileged user, by
/// the tests below): runs the random operations on those roots and prints
/// the differing outcomes. Otherwise does nothing. Not a test of its own,
/// so ignored.
#[test]
#[ignore = "a helper: the unprivileged tests run it as the unprivileged user"]
fn ops_child() {
    let Some(roots) = std::env::var_os("TILEFS_WRITABLE_OPS_ROOTS") else {
        return;
    };
    let roots: Vec<PathBuf> = std::env::split_paths(&roots).collect();
    let seed: u64 = std::env::var("TILEFS_WRITABLE_SEED").unwrap().parse().unwrap();
    let count: usize = std::env::var("TILEFS_WRITABLE_COUNT").unwrap().parse().unwrap();
    for d in run_ops(&roots, seed, count, false) {
        println!("DIFF {d}");
    }
}

fn run_ops_as_nobody(roots: &[PathBuf], seed: u64, count: usize) -> Vec<String> {
    let out = as_nobody(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "ops_child",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("TILEFS_WRITABLE_OPS_ROOTS", std::env::join_paths(roots).unwrap())
            .env("TILEFS_WRITABLE_SEED", seed.to_string())
            .env("TILEFS_WRITABLE_COUNT", count.to_string())
            .stdin(Stdio::null()),
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "operations as nobody failed: {}", stderr(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("DIFF ").map(str::to_string))
        .collect()
}

/// The seeds of a test's sequences: `fixed`, unless TILEFS_WRITABLE_SEEDS
/// names others.
fn seeds(fixed: &[u64]) -> Vec<u64> {
    let Ok(v) = std::env::var("TILEFS_WRITABLE_SEEDS") else {
        return fixed.to_vec();
    };
    let bad = || panic!("TILEFS_WRITABLE_SEEDS={v:?}: want A-B or A,B,...");
    match v.split_once('-') {
        Some((a, b)) => {
            (a.trim().parse().unwrap_or_else(|_| bad())..=b.trim().parse().unwrap_or_else(|_| bad())).collect()
        }
        None => v
            .split(',')
            .map(|x| x.trim().parse().unwrap_or_else(|_| bad()))
            .collect(),
    }
}

fn op_count() -> usize {
    std::env::var("TILEFS_WRITABLE_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400)
}

// ---------------------------------------------------------------------------
// Trees
// ---------------------------------------------------------------------------

/// What a user sees of one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Shown {
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
    nlink: u64,
    rdev: u64,
    link: Option<Vec<u8>>,
    digest: Option<String>,
    xattrs: BTreeMap<String, Vec<u8>>,
    /// Set by utimes only (the others move with the clock).
    mtime: Option<(i64, i64)>,
    ino: u64,
}

fn listxattrs(p: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut names = vec![0u8; 65536];
    let Ok(n) = rustix::fs::llistxattr(p, &mut names) else {
        return out;
    };
    for k in names[..n].split(|&c| c == 0).filter(|k| !k.is_empty()) {
        let mut v = vec![0u8; 65536];
        if let Ok(m) = rustix::fs::lgetxattr(p, k, &mut v) {
            out.insert(String::from_utf8_lossy(k).into_owned(), v[..m].to_vec());
        }
    }
    out
}

fn scan_tree(root: &Path) -> BTreeMap<Vec<u8>, Shown> {
    let mut out = BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(root.join(&d)) else { continue };
        for e in rd {
            let rel = d.join(e.unwrap().file_name());
            let p = root.join(&rel);
            let m = match fs::symlink_metadata(&p) {
                Ok(m) => m,
                // A directory that may be listed but not searched.
                Err(e) => {
                    let err = format!("stat: {}", e.raw_os_error().unwrap_or(0));
                    let placeholder = Shown {
                        mode: 0,
                        uid: 0,
                        gid: 0,
                        size: 0,
                        nlink: 0,
                        rdev: 0,
                        link: None,
                        digest: Some(err),
                        xattrs: BTreeMap::new(),
                        mtime: None,
                        ino: 0,
                    };
                    out.insert(rel.as_os_str().as_bytes().to_vec(), placeholder);
                    continue;
                }
            };
            let ft = m.mode() & libc::S_IFMT;
            if ft == libc::S_IFDIR {
                stack.push(rel.clone());
            }
            let digest = (ft == libc::S_IFREG).then(|| match fs::read(&p) {
                Ok(b) => sha256_hex(&b),
                Err(e) => format!("unreadable: {}", e.raw_os_error().unwrap_or(0)),
            });
            out.insert(
                rel.as_os_str().as_bytes().to_vec(),
                Shown {
                    mode: m.mode(),
                    uid: m.uid(),
                    gid: m.gid(),
                    size: if ft == libc::S_IFDIR { 0 } else { m.size() },
                    nlink: m.nlink(),
                    rdev: m.rdev(),
                    link: (ft == libc::S_IFLNK).then(|| fs::read_link(&p).unwrap().as_os_str().as_bytes().to_vec()),
                    digest,
                    xattrs: listxattrs(&p),
                    mtime: (m.mtime() < 3_000_000).then(|| (m.mtime(), m.mtime_nsec())),
                    ino: m.ino(),
                },
            );
        }
    }
    out
}

/// One scanned entry as a line (for a scan made by another process).
fn scan_line(rel: &[u8], s: &Shown) -> String {
    let x: Vec<String> = s
        .xattrs
        .iter()
        .map(|(k, v)| format!("{}={}", hex::encode(k), hex::encode(v)))
        .collect();
    format!(
        "{} {} {} {} {} {} {} {} {} {} {} {}",
        hex::encode(rel),
        s.mode,
        s.uid,
        s.gid,
        s.size,
        s.nlink,
        s.rdev,
        s.link.as_ref().map_or("-".into(), hex::encode),
        s.digest.as_ref().map_or("-".into(), |d| d.replace(' ', "_")),
        s.mtime.map_or("-".into(), |(a, b)| format!("{a}.{b}")),
        s.ino,
        if x.is_empty() { "-".into() } else { x.join(",") },
    )
}

fn parse_scan_line(l: &str) -> (Vec<u8>, Shown) {
    let f: Vec<&str> = l.split(' ').collect();
    let num = |i: usize| f[i].parse::<u64>().unwrap();
    let opt = |i: usize| (f[i] != "-").then(|| f[i].to_string());
    let xattrs = if f[11] == "-" {
        BTreeMap::new()
    } else {
        f[11]
            .split(',')
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (
                    String::from_utf8(hex::decode(k).unwrap()).unwrap(),
                    hex::decode(v).unwrap(),
                )
            })
            .collect()
    };
    (
        hex::decode(f[0]).unwrap(),
        Shown {
            mode: num(1) as u32,
            uid: num(2) as u32,
            gid: num(3) as u32,
            size: num(4),
            nlink: num(5),
            rdev: num(6),
            link: opt(7).map(|h| hex::decode(h).unwrap()),
            digest: opt(8).map(|d| d.replace('_', " ")),
            mtime: opt(9).map(|t| {
                let (a, b) = t.split_once('.').unwrap();
                (a.parse().unwrap(), b.parse().unwrap())
            }),
            ino: num(10),
            xattrs,
        },
    )
}

/// When run with TILEFS_WRITABLE_SCAN=DIR (as the unprivileged user, by
/// the tests below): prints what that user sees of DIR. Otherwise does
/// nothing. Not a test of its own, so ignored.
#[test]
#[ignore = "a helper: the unprivileged tests run it as the unprivileged user"]
fn scan_child() {
    let Some(dir) = std::env::var_os("TILEFS_WRITABLE_SCAN") else {
        return;
    };
    for (k, s) in scan_tree(Path::new(&dir)) {
        println!("SCAN {}", scan_line(&k, &s));
    }
}

/// What the unprivileged user sees of `dir`.
fn scan_as_nobody(dir: &Path) -> BTreeMap<Vec<u8>, Shown> {
    let out = as_nobody(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "scan_child",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("TILEFS_WRITABLE_SCAN", dir)
            .stdin(Stdio::null()),
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "scan as nobody failed: {}", stderr(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("SCAN "))
        .map(parse_scan_line)
        .collect()
}

/// Compares two scans: every field, directory link counts only when
/// `dir_nlink` (overlays show a merged directory with one link), and the
/// way inode numbers group names.
fn compare(what: &str, a: &BTreeMap<Vec<u8>, Shown>, b: &BTreeMap<Vec<u8>, Shown>, dir_nlink: bool) -> Vec<String> {
    let mut d = Vec::new();
    let ka: BTreeSet<_> = a.keys().collect();
    let kb: BTreeSet<_> = b.keys().collect();
    for k in ka.symmetric_difference(&kb) {
        d.push(format!(
            "{what}: {} only in {}",
            String::from_utf8_lossy(k),
            if a.contains_key(*k) { "the first" } else { "the second" }
        ));
    }
    let norm = |s: &Shown| {
        let mut s = s.clone();
        s.ino = 0;
        if !dir_nlink && s.mode & libc::S_IFMT == libc::S_IFDIR {
            s.nlink = 0;
        }
        s
    };
    for k in ka.intersection(&kb) {
        let (x, y) = (norm(&a[*k]), norm(&b[*k]));
        if x != y {
            d.push(format!(
                "{what}: {} differs:\n  {x:?}\n  {y:?}",
                String::from_utf8_lossy(k)
            ));
        }
    }
    let groups = |t: &BTreeMap<Vec<u8>, Shown>| -> BTreeSet<Vec<Vec<u8>>> {
        let mut g: BTreeMap<u64, Vec<Vec<u8>>> = BTreeMap::new();
        for (k, s) in t {
            if s.mode & libc::S_IFMT != libc::S_IFDIR {
                g.entry(s.ino).or_default().push(k.clone());
            }
        }
        g.into_values().filter(|v| v.len() > 1).collect()
    };
    if groups(a) != groups(b) {
        d.push(format!(
            "{what}: names sharing an inode differ: {:?} vs {:?}",
            groups(a),
            groups(b)
        ));
    }
    d
}

fn assert_no_diffs(diffs: Vec<String>) {
    // The first ones matter: a difference makes the trees drift apart.
    let first: Vec<&String> = diffs.iter().take(12).collect();
    assert!(
        diffs.is_empty(),
        "{} differences, the first:\n{}",
        diffs.len(),
        first.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n")
    );
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

fn cannot_test() -> Option<String> {
    if !is_root() {
        return Some("not running as root (the lower tree and the kernel overlay need it)".into());
    }
    cannot_mount("overlay")
        .or_else(|| cannot_mount("erofs"))
        .or_else(|| cannot_mount("fuse"))
}

struct Setup {
    a: Area,
    store: PathBuf,
    image: PathBuf,
    src: PathBuf,
}

fn setup(hardlinks: bool) -> Setup {
    let a = Area::new();
    let src = a.path("src");
    make_lower(&src, hardlinks);
    let store = a.path("store");
    let image = a.path("image.cfs");
    let extra: &[&str] = if hardlinks { &["--hardlinks"] } else { &[] };
    build_with_store(&src, &store, &image, extra);
    Setup { a, store, image, src }
}

/// The three directories of a writable mount named `name`.
fn dirs(s: &Setup, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let m = s.a.dir(&format!("{name}-mnt"));
    let u = s.a.dir(&format!("{name}-upper"));
    let w = s.a.dir(&format!("{name}-work"));
    (m, u, w)
}

/// Root writes: FUSE, the kernel overlay and a plain copy of the tree
/// agree on every outcome and on the trees; the FUSE upper remounts to the
/// same tree, through FUSE and through the kernel's overlay.
#[test]
fn root_writes_match_the_kernel_overlay_and_a_plain_copy() {
    require(cannot_test());
    let s = setup(false);
    let (km, ku, kw) = dirs(&s, "k");
    let (fm, fu, fw) = dirs(&s, "f");
    let plain = s.a.path("plain");
    assert!(Command::new("cp")
        .arg("-a")
        .arg(&s.src)
        .arg(&plain)
        .status()
        .unwrap()
        .success());
    let kernel = mount_rw("kernel", &s.store, &s.image, (&km, &ku, &kw), &[]);
    let fuse = mount_rw("fuse", &s.store, &s.image, (&fm, &fu, &fw), &[]);
    let roots = vec![km.clone(), fm.clone(), plain.clone()];
    let mut diffs = Vec::new();
    for seed in seeds(&[1, 2]) {
        diffs.extend(run_ops(&roots, seed, op_count(), true));
    }
    let (k, f, p) = (scan_tree(&km), scan_tree(&fm), scan_tree(&plain));
    diffs.extend(compare("fuse vs kernel", &k, &f, true));
    diffs.extend(compare("fuse vs plain", &f, &p, false));
    assert_no_diffs(diffs);
    umount(fuse);
    umount(kernel);
    // The upper persists, and is overlayfs's own format.
    let again = mount_rw("fuse", &s.store, &s.image, (&fm, &fu, &fw), &[]);
    assert_no_diffs(compare("fuse remounted", &f, &scan_tree(&fm), true));
    umount(again);
    let (km2, _, kw2) = dirs(&s, "k2");
    let by_kernel = mount_rw("kernel", &s.store, &s.image, (&km2, &fu, &kw2), &[]);
    assert_no_diffs(compare("the fuse upper under the kernel", &f, &scan_tree(&km2), true));
    umount(by_kernel);
}

/// An unprivileged user writing: the FUSE mount (server root) and the
/// kernel overlay agree, with hardlinks in the image.
#[test]
fn unprivileged_writes_match_the_kernel_overlay() {
    require(cannot_test());
    let s = setup(true);
    let (km, ku, kw) = dirs(&s, "k");
    let (fm, fu, fw) = dirs(&s, "f");
    let kernel = mount_rw("kernel", &s.store, &s.image, (&km, &ku, &kw), &[]);
    let fuse = mount_rw("fuse", &s.store, &s.image, (&fm, &fu, &fw), &[]);
    let roots = vec![km.clone(), fm.clone()];
    let mut diffs = Vec::new();
    for seed in seeds(&[3, 4]) {
        diffs.extend(run_ops_as_nobody(&roots, seed, op_count()));
    }
    diffs.extend(compare("fuse vs kernel", &scan_tree(&km), &scan_tree(&fm), true));
    assert_no_diffs(diffs);
    umount(fuse);
    umount(kernel);
}

/// The FUSE server itself without privilege (through fusermount3), an
/// unprivileged user writing: the same as the kernel overlay, owners of
/// the image kept (recorded in the upper directory's xattrs), and a
/// remount shows the same tree.
#[test]
fn a_server_without_privilege_matches_the_kernel_overlay() {
    require(cannot_test());
    require(missing_program("fusermount3", "Debian package fuse3"));
    let _dev = DevFuseMode::set(0o666);
    let s = setup(true);
    let (km, ku, kw) = dirs(&s, "k");
    let (fm, fu, fw) = dirs(&s, "f");
    // The merged root is the upper directory: the same owner for both.
    for p in [&fm, &fu, &fw, &ku] {
        give_to_nobody(p);
    }
    give_to_nobody(&s.a.path(""));
    // The store root made is root's alone (0700): shared with nobody here.
    fs::set_permissions(&s.store, fs::Permissions::from_mode(0o755)).unwrap();
    let kernel = mount_rw("kernel", &s.store, &s.image, (&km, &ku, &kw), &[]);
    let fuse = mount_rw("fuse-nobody", &s.store, &s.image, (&fm, &fu, &fw), &[]);
    let roots = vec![km.clone(), fm.clone()];
    let mut diffs = Vec::new();
    for seed in seeds(&[5]) {
        diffs.extend(run_ops_as_nobody(&roots, seed, op_count()));
    }
    // Only its user may enter a FUSE mount made without privilege: both
    // are seen as that user, owners of the image (root...) as they are.
    let f = scan_as_nobody(&fm);
    diffs.extend(compare(
        "fuse (unprivileged server) vs kernel",
        &scan_as_nobody(&km),
        &f,
        true,
    ));
    assert_no_diffs(diffs);
    umount(fuse);
    let again = mount_rw("fuse-nobody", &s.store, &s.image, (&fm, &fu, &fw), &[]);
    assert_no_diffs(compare("remounted", &f, &scan_as_nobody(&fm), true));
    umount(again);
    umount(kernel);
}

/// Copy-up keeps what the image says of a file (mode, owner, mtime,
/// xattrs, contents) and its inode number; a file of several names in the
/// image is split from its other names, as overlayfs does.
#[test]
fn copy_up_keeps_metadata_and_inode_numbers() {
    require(cannot_test());
    let s = setup(true);
    let (fm, fu, fw) = dirs(&s, "f");
    let fuse = mount_rw("fuse", &s.store, &s.image, (&fm, &fu, &fw), &[]);
    let p = fm.join("pub/own/f1");
    let before = fs::symlink_metadata(&p).unwrap();
    let xattrs = listxattrs(&p);
    // chmod copies up; the data, times, owner and xattrs stay.
    set_mode(&p, 0o600);
    let after = fs::symlink_metadata(&p).unwrap();
    assert_eq!(before.ino(), after.ino(), "copy-up changed the inode number");
    assert_eq!(
        (before.mtime(), before.mtime_nsec(), before.uid()),
        (after.mtime(), after.mtime_nsec(), after.uid())
    );
    assert_eq!(after.mode() & 0o7777, 0o600);
    assert_eq!(listxattrs(&p), xattrs);
    assert_eq!(fs::read(&p).unwrap(), fs::read(s.src.join("pub/own/f1")).unwrap());
    assert!(fu.join("pub/own/f1").exists(), "not copied up");
    // One name of a hardlinked image file written: the others keep the
    // image's data and inode number; the written one gets its own.
    let (a, b) = (fm.join("pub/own/hl-a"), fm.join("pub/own/hl-b"));
    let ino = fs::metadata(&a).unwrap().ino();
    assert_eq!(fs::metadata(&b).unwrap().ino(), ino);
    fs::write(&a, b"new contents").unwrap();
    assert_eq!(fs::read(&b).unwrap(), fs::read(s.src.join("pub/own/hl-b")).unwrap());
    assert_eq!(fs::metadata(&b).unwrap().ino(), ino);
    assert_ne!(fs::metadata(&a).unwrap().ino(), ino);
    assert_eq!(fs::read(&a).unwrap(), b"new contents");
    umount(fuse);
}

/// Files kept open across a copy-up, with passthrough of upper files (as
/// root, --passthrough) and without (the default: no OPEN is asked for, so
/// the copy-up comes with the first write): a reader opened before the copy-up keeps working, a
/// writer opened while it is open writes the upper file, and later opens,
/// mmap writes, appends and truncation see the upper data. The kernel
/// wants every open of a file in one I/O mode; a wrong choice would fail
/// the open with EIO.
#[test]
fn files_open_across_a_copy_up_keep_working() {
    require(cannot_test());
    let s = setup(false);
    for (name, extra) in [("pt", &["--passthrough"][..]), ("noopen", &[][..])] {
        let (fm, fu, fw) = dirs(&s, name);
        let m = mount_rw("fuse", &s.store, &s.image, (&fm, &fu, &fw), extra);
        let p = fm.join("pub/own/f1");
        let lower = fs::read(s.src.join("pub/own/f1")).unwrap();
        let reader = fs::File::open(&p).unwrap();
        let mut head = vec![0u8; 4];
        rustix::io::pread(&reader, &mut head, 0).unwrap();
        assert_eq!(head, lower[..4], "{name}");
        {
            let w = fs::OpenOptions::new().write(true).open(&p).unwrap();
            rustix::io::pwrite(&w, b"WXYZ", 0).unwrap();
        }
        assert!(fu.join("pub/own/f1").exists(), "{name}: not copied up");
        drop(reader);
        let mut want = lower.clone();
        want[..4].copy_from_slice(b"WXYZ");
        assert_eq!(fs::read(&p).unwrap(), want, "{name}");
        // Written through a shared mapping while a reader is open.
        let f = fs::OpenOptions::new().read(true).write(true).open(&p).unwrap();
        rustix::io::pwrite(&f, b"EFGH", 4).unwrap();
        // Passthrough: the kernel wrote the upper file itself; without it,
        // the write went through the server. Either way before any close.
        let upper = fs::read(fu.join("pub/own/f1")).unwrap();
        assert_eq!(&upper[4..8], b"EFGH", "{name}: the write did not reach the upper file");
        let reader = fs::File::open(&p).unwrap();
        let len = f.metadata().unwrap().len() as usize;
        // SAFETY: the mapping is ours alone while it lives (nothing else
        // truncates the file meanwhile).
        let mut map = unsafe { memmap2::MmapMut::map_mut(&f) }.unwrap();
        map[..4].copy_from_slice(b"mmap");
        map.flush().unwrap();
        drop(map);
        rustix::io::pread(&reader, &mut head, 0).unwrap();
        assert_eq!(&head, b"mmap", "{name}: a reader open during the mmap write");
        drop((f, reader));
        // Append and truncate, then the sizes the kernel reports.
        let mut a = fs::OpenOptions::new().append(true).open(&p).unwrap();
        std::io::Write::write_all(&mut a, b"tail").unwrap();
        drop(a);
        assert_eq!(fs::metadata(&p).unwrap().len() as usize, len + 4, "{name}");
        let t = fs::OpenOptions::new().write(true).open(&p).unwrap();
        t.set_len(3).unwrap();
        drop(t);
        assert_eq!(fs::metadata(&p).unwrap().len(), 3, "{name}");
        assert_eq!(fs::read(&p).unwrap(), b"mma", "{name}");
        assert_eq!(
            fs::read(fu.join("pub/own/f1")).unwrap(),
            b"mma",
            "{name}: the upper file"
        );
        // chown(f, -1, -1) drops setuid on ext4 and on the kernel's overlay.
        set_mode(&p, 0o4755);
        rustix::fs::chown(&p, None, None).unwrap();
        assert_eq!(
            fs::metadata(&p).unwrap().mode() & 0o7777,
            0o755,
            "{name}: setuid kept by chown(f, -1, -1)"
        );
        umount(m);
    }
}

/// Opening a file asks the server nothing by default: the first OPEN is
/// answered "not implemented", after which the kernel sends neither OPEN
/// nor RELEASE (a build opens every header it includes). Files of the
/// image and upper files, each read five times, and files created after
/// that first open, all read back right, and a file of the image read,
/// truncated and extended shows zeros; with --passthrough every open is an
/// OPEN and a RELEASE, as the server's own request counts show.
#[test]
fn opening_a_file_asks_the_server_nothing() {
    require(cannot_test());
    let s = setup(false);
    for (name, extra) in [("noopen", &[][..]), ("pt", &["--passthrough"][..])] {
        let (m, u, w) = dirs(&s, name);
        let log = s.a.path(&format!("{name}.log"));
        let mut args = vec!["--log", log.to_str().unwrap()];
        args.extend_from_slice(extra);
        let env = ["env", "TILEFS_FUSE_STATS=1"];
        let mounted = mount_rw_under(&env, "fuse", &s.store, &s.image, (&m, &u, &w), &args);
        let image: Vec<(PathBuf, Vec<u8>)> = (1..=6)
            .flat_map(|i| [format!("pub/own/f{i}"), format!("pub/own/sub/s{i}")])
            .map(|rel| (m.join(&rel), fs::read(s.src.join(&rel)).unwrap()))
            .collect();
        assert_eq!(fs::read(&image[0].0).unwrap(), image[0].1, "{name}");
        let upper: Vec<(PathBuf, Vec<u8>)> = (0..20)
            .map(|i| (m.join(format!("pub/up{i}")), format!("upper file {i}").into_bytes()))
            .collect();
        for (p, data) in &upper {
            fs::write(p, data).unwrap();
        }
        for round in 0..5 {
            for (p, data) in image.iter().chain(&upper) {
                assert_eq!(&fs::read(p).unwrap(), data, "{name}, round {round}: {}", p.display());
            }
        }
        // A file of the image read, then truncated (copied up with nothing
        // kept) and extended: the image's data is gone.
        let (p, data) = &image[5];
        let f = fs::File::open(p).unwrap();
        let mut head = vec![0u8; 16];
        rustix::io::pread(&f, &mut head, 0).unwrap();
        let t = fs::OpenOptions::new().write(true).open(p).unwrap();
        t.set_len(0).unwrap();
        t.set_len(data.len() as u64).unwrap();
        drop(t);
        assert!(
            fs::read(p).unwrap().iter().all(|&b| b == 0),
            "{name}: the image's data shows through a truncated copy-up"
        );
        rustix::io::pread(&f, &mut head, 0).unwrap();
        assert_eq!(head, [0u8; 16], "{name}: through a descriptor opened before");
        drop(f);
        umount(mounted);
        let text = fs::read_to_string(&log).unwrap();
        let line = text
            .lines()
            .rev()
            .find(|l| l.contains("requests (opcode: count, ms):"))
            .unwrap_or_else(|| panic!("{name}: no request counts in the server's log:\n{text}"));
        let count = |op: u32| -> u64 {
            line.split(';')
                .find_map(|f| f.trim().strip_prefix(&format!("{op}: ")))
                .and_then(|r| r.split_whitespace().next())
                .map_or(0, |c| c.parse().unwrap())
        };
        let (opens, releases) = (count(14), count(18));
        let reads = 5 * (image.len() + upper.len()) as u64;
        if name == "noopen" {
            assert_eq!((opens, releases), (1, 0), "{name}: OPEN and RELEASE counts: {line}");
        } else {
            assert!(
                opens > reads && releases > reads,
                "{name}: OPEN and RELEASE counts: {line}"
            );
        }
    }
}

/// A tmpfs of `size` at `path`, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn new(path: &Path, size: &str) -> Tmpfs {
        fs::create_dir_all(path).unwrap();
        rustix::mount::mount(
            "tmpfs",
            path,
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            Some(&*CString::new(format!("size={size}")).unwrap()),
        )
        .unwrap();
        Tmpfs(path.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
    }
}

/// Refused with a clear reason: upper and work on different filesystems,
/// an upper the server may not write, a work directory in use by another
/// mount, a work directory planted with a symlink.
#[test]
fn bad_upper_and_work_directories_are_refused() {
    require(cannot_test());
    let s = setup(false);
    let (m, u, w) = dirs(&s, "f");
    let other = Tmpfs::new(&s.a.path("tmpfs"), "4m");
    let fail = |upper: &Path, work: &Path, nobody: bool| -> String {
        let mut cmd = Command::new(tilefs_bin());
        cmd.args(["mount", "--fuse", "--store"])
            .arg(&s.store)
            .arg("--upper")
            .arg(upper)
            .arg("--work")
            .arg(work)
            .arg(&s.image)
            .arg(&m);
        if nobody {
            as_nobody(&mut cmd);
        }
        let out = cmd.output().unwrap();
        assert!(
            !out.status.success(),
            "mounted with upper {} work {}",
            upper.display(),
            work.display()
        );
        assert!(!is_mounted(&m));
        stderr(&out)
    };
    let err = fail(&u, &other.0, false);
    assert!(err.contains("different filesystems"), "{err}");
    let _dev = DevFuseMode::set(0o666);
    give_to_nobody(&m);
    let err = fail(&u, &w, true);
    assert!(
        err.contains("not writable") || err.contains("Permission denied"),
        "{err}"
    );
    // One mount per upper directory.
    let first = mount_rw("fuse", &s.store, &s.image, (&m, &u, &w), &[]);
    let (m2, _, _) = dirs(&s, "second");
    let out = Command::new(tilefs_bin())
        .args(["mount", "--fuse", "--store"])
        .arg(&s.store)
        .arg("--upper")
        .arg(&u)
        .arg("--work")
        .arg(&w)
        .arg(&s.image)
        .arg(&m2)
        .output()
        .unwrap();
    assert!(
        !out.status.success() && stderr(&out).contains("in use"),
        "{}",
        stderr(&out)
    );
    umount(first);
    // A symlink planted where our work directory goes is not followed.
    let outside = s.a.dir("outside");
    let w2 = s.a.dir("w2");
    std::os::unix::fs::symlink(&outside, w2.join("tilefs")).unwrap();
    let err = fail(&u, &w2, false);
    assert!(err.contains("tilefs"), "{err}");
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 0);
}

/// A full disk during copy-up: ENOSPC, the image's file intact through
/// the mount, nothing half-copied in the upper or work directory.
#[test]
fn a_full_disk_during_copy_up_leaves_nothing_behind() {
    require(cannot_test());
    let s = setup(false);
    let small = Tmpfs::new(&s.a.path("small"), "200k");
    let (m, _, _) = dirs(&s, "f");
    let (u, w) = (small.0.join("upper"), small.0.join("work"));
    fs::create_dir(&u).unwrap();
    fs::create_dir(&w).unwrap();
    let mounted = mount_rw("fuse", &s.store, &s.image, (&m, &u, &w), &[]);
    let p = m.join("pub/own/f6"); // 300,000 bytes: more than the disk holds

    // No OPEN is asked for (see `opening_a_file_asks_the_server_nothing`):
    // the copy-up comes with the first write, which fails.
    let mut f = fs::OpenOptions::new().append(true).open(&p).unwrap();
    let err = std::io::Write::write_all(&mut f, b"more").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    drop(f);
    assert_eq!(fs::read(&p).unwrap(), fs::read(s.src.join("pub/own/f6")).unwrap());
    assert!(!u.join("pub/own/f6").exists(), "a half copy is visible");
    let left: Vec<_> = fs::read_dir(w.join("tilefs"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "lock")
        .collect();
    assert!(left.is_empty(), "left in the work directory: {left:?}");
    // Small changes still fit.
    fs::write(m.join("pub/own/small"), b"fits").unwrap();
    umount(mounted);
}

/// A server killed while a file is being written: `tilefs umount` clears
/// the dead mount, a remount shows the file holding only bytes that were
/// written (a prefix of them), and the upper directory stays usable.
#[test]
fn a_killed_server_leaves_the_upper_directory_usable() {
    require(cannot_test());
    let s = setup(false);
    let (m, u, w) = dirs(&s, "f");
    let mounted = mount_rw("fuse", &s.store, &s.image, (&m, &u, &w), &[]);
    let pattern: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
    let target = m.join("pub/own/f5");
    let writer = {
        let target = target.clone();
        let pattern = pattern.clone();
        std::thread::spawn(move || {
            use std::io::Write;
            if let Ok(mut f) = fs::OpenOptions::new().write(true).truncate(true).open(&target) {
                for c in pattern.chunks(64 << 10) {
                    if f.write_all(c).is_err() {
                        break;
                    }
                }
            }
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(100));
    let pid = server_pid(&u).to_string();
    assert!(Command::new("kill").args(["-KILL", &pid]).status().unwrap().success());
    let _ = writer.join();
    std::mem::forget(mounted);
    let out = tilefs_any(&[os("umount"), m.as_os_str()]);
    assert!(out.status.success(), "umount of a dead mount: {}", stderr(&out));
    let again = mount_rw("fuse", &s.store, &s.image, (&m, &u, &w), &[]);
    let got = fs::read(&target).unwrap();
    assert!(
        got.len() <= pattern.len() && got == pattern[..got.len()],
        "the file holds bytes that were never written"
    );
    fs::write(m.join("pub/own/after"), b"still works").unwrap();
    umount(again);
}

/// Symlinks planted in the upper directory, pointing outside it, are
/// never followed by the server: changes made to them through the mount
/// (without following them, as lchown, lsetxattr, utimensat, rename and
/// unlink do) leave what they point at untouched, and a merged directory
/// replaced by a planted symlink shows as that symlink.
#[test]
fn a_hostile_upper_directory_is_never_followed() {
    require(cannot_test());
    let s = setup(false);
    let (m, u, w) = dirs(&s, "f");
    let outside = s.a.dir("outside");
    fs::write(outside.join("target"), b"outside").unwrap();
    set_mode(&outside.join("target"), 0o644);
    let before = scan_tree(&outside);
    fs::create_dir_all(u.join("etc")).unwrap();
    std::os::unix::fs::symlink(outside.join("target"), u.join("etc/passwd")).unwrap();
    fs::create_dir_all(u.join("pub")).unwrap();
    std::os::unix::fs::symlink(&outside, u.join("pub/own")).unwrap();
    let mounted = mount_rw("fuse", &s.store, &s.image, (&m, &u, &w), &[]);
    assert!(fs::symlink_metadata(m.join("pub/own"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(fs::symlink_metadata(m.join("etc/passwd"))
        .unwrap()
        .file_type()
        .is_symlink());
    let p = m.join("etc/passwd");
    rustix::fs::chownat(
        rustix::fs::CWD,
        p.as_path(),
        Some(rustix::process::Uid::from_raw(1234)),
        None,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
    let _ = rustix::fs::lsetxattr(p.as_path(), "trusted.x", b"1", rustix::fs::XattrFlags::empty());
    let t = rustix::fs::Timespec { tv_sec: 5, tv_nsec: 0 };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        p.as_path(),
        &rustix::fs::Timestamps {
            last_access: t,
            last_modification: t,
        },
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
    fs::rename(&p, m.join("etc/moved")).unwrap();
    fs::remove_file(m.join("etc/moved")).unwrap();
    fs::rename(m.join("pub/own"), m.join("pub/gone")).unwrap();
    umount(mounted);
    assert_no_diffs(compare("outside", &before, &scan_tree(&outside), true));
    assert_eq!(fs::read(outside.join("target")).unwrap(), b"outside");
}

/// `-o uidmapping=`/`gidmapping=`: ids as stored shown as other ids, and
/// ids the kernel gives stored back.
#[test]
fn id_mappings_translate_both_ways() {
    require(cannot_test());
    let s = setup(false);
    let (m, u, w) = dirs(&s, "f");
    let mounted = mount_rw(
        "fuse",
        &s.store,
        &s.image,
        (&m, &u, &w),
        &["-o", "uidmapping=0:100000:65536,gidmapping=0:200000:65536"],
    );
    let md = fs::symlink_metadata(m.join("etc/passwd")).unwrap();
    assert_eq!((md.uid(), md.gid()), (100_000, 200_000));
    // 65534 as stored is shown as 100000 + 65534.
    assert_eq!(fs::symlink_metadata(m.join("pub/own/f1")).unwrap().uid(), 165_534);
    rustix::fs::chownat(
        rustix::fs::CWD,
        m.join("etc/passwd").as_path(),
        Some(rustix::process::Uid::from_raw(100_005)),
        Some(rustix::process::Gid::from_raw(200_007)),
        rustix::fs::AtFlags::empty(),
    )
    .unwrap();
    let up = fs::symlink_metadata(u.join("etc/passwd")).unwrap();
    assert_eq!((up.uid(), up.gid()), (5, 7));
    // An id no range covers cannot be stored.
    let err = rustix::fs::chownat(
        rustix::fs::CWD,
        m.join("etc/passwd").as_path(),
        Some(rustix::process::Uid::from_raw(5)),
        None,
        rustix::fs::AtFlags::empty(),
    )
    .unwrap_err();
    assert_eq!(err, rustix::io::Errno::INVAL);
    umount(mounted);
}

/// What the kernel does for a filesystem works through the mount: file
/// locks (flock and fcntl, between processes), writes through a shared
/// mapping, statfs of the upper directory's filesystem, O_TMPFILE.
#[test]
fn locks_mmap_statfs_and_tmpfile_work() {
    require(cannot_test());
    let s = setup(false);
    let (m, u, w) = dirs(&s, "f");
    let mounted = mount_rw("fuse", &s.store, &s.image, (&m, &u, &w), &[]);
    let p = m.join("pub/own/f5");
    // A shared mapping of an image file, written: copied up, persisted.
    let f = fs::OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a shared mapping of a file we hold open, unmapped below.
    unsafe {
        let a = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        );
        assert_ne!(a, libc::MAP_FAILED);
        std::ptr::write_bytes(a.cast::<u8>().add(100), 0xab, 1000);
        assert_eq!(libc::msync(a, len, libc::MS_SYNC), 0);
        libc::munmap(a, len);
    }
    drop(f);
    let mut want = fs::read(s.src.join("pub/own/f5")).unwrap();
    want[100..1100].fill(0xab);
    assert!(fs::read(&p).unwrap() == want, "the mapped write is not in the file");
    // flock: a second process cannot take the lock.
    let f = fs::File::open(&p).unwrap();
    rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive).unwrap();
    let other = Command::new("flock")
        .args(["-n", "-x"])
        .arg(&p)
        .arg("true")
        .status()
        .unwrap();
    assert!(!other.success(), "two exclusive flocks");
    drop(f);
    assert!(Command::new("flock")
        .args(["-n", "-x"])
        .arg(&p)
        .arg("true")
        .status()
        .unwrap()
        .success());
    // statfs is the upper filesystem's.
    let (a, b) = (
        rustix::fs::statfs(m.as_path()).unwrap(),
        rustix::fs::statfs(u.as_path()).unwrap(),
    );
    assert_eq!((a.f_blocks, a.f_bsize), (b.f_blocks, b.f_bsize));
    // O_TMPFILE, then linked.
    let t = rustix::fs::open(
        m.join("pub").as_path(),
        rustix::fs::OFlags::TMPFILE | rustix::fs::OFlags::RDWR,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
    rustix::io::write(&t, b"tmp").unwrap();
    rustix::fs::linkat(
        rustix::fs::CWD,
        format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&t)).as_str(),
        rustix::fs::CWD,
        m.join("pub/linked").as_path(),
        rustix::fs::AtFlags::SYMLINK_FOLLOW,
    )
    .unwrap();
    assert_eq!(fs::read(m.join("pub/linked")).unwrap(), b"tmp");
    drop(t);
    umount(mounted);
}

/// Free bytes of the filesystem holding `p`.
fn free_bytes(p: &Path) -> u64 {
    let st = rustix::fs::statvfs(p).unwrap();
    st.f_bavail * st.f_frsize
}

/// The server that mounted with upper directory `upper`.
fn server_pid(upper: &Path) -> u32 {
    let out = Command::new("pgrep")
        .args(["-f", "--", &format!("--upper {}", upper.display())])
        .output()
        .unwrap();
    let pid = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .map(str::parse);
    match pid {
        Some(Ok(pid)) => pid,
        _ => panic!("no server with upper directory {}", upper.display()),
    }
}

/// Removing a file through the mount gives its space back on the upper
/// filesystem (the server lets go of the file when the kernel forgets it,
/// over /dev/fuse and over io_uring, where forgets are batched), and an
/// open file keeps its data until it is closed, as POSIX has it: four 20
/// MB files written one after the other into a 48 MB upper, each removed
/// before the next.
#[test]
fn removed_files_give_their_space_back() {
    require(cannot_test());
    let s = setup(false);
    let uring = FuseUring::on();
    require(uring.as_ref().err().cloned());
    let ways = [("dev", vec!["--no-uring"]), ("uring", vec![])];
    let chunk: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 253) as u8).collect();
    for (name, extra) in ways {
        let base = s.a.path(&format!("space-{name}"));
        let _fs = Tmpfs::new(&base, "48m");
        let (u, w) = (base.join("upper"), base.join("work"));
        fs::create_dir_all(&u).unwrap();
        fs::create_dir_all(&w).unwrap();
        let m = s.a.dir(&format!("mnt-space-{name}"));
        let mounted = mount_rw("fuse", &s.store, &s.image, (&m, &u, &w), &extra);
        if name == "uring" {
            let threads = server_threads(server_pid(&u));
            assert!(
                threads.iter().any(|t| t.starts_with("fuse-q")),
                "the server did not start its io_uring queues: {threads:?}"
            );
        }
        let empty = free_bytes(&u);
        for round in 0..4 {
            let p = m.join(format!("big{round}"));
            let write = || -> std::io::Result<()> {
                use std::io::Write;
                let mut f = fs::File::create(&p)?;
                for _ in 0..20 {
                    f.write_all(&chunk)?;
                }
                f.sync_all()
            };
            write().unwrap_or_else(|e| panic!("{name}: writing 20 MB, round {round}: {e}"));
            let held = fs::File::open(&p).unwrap();
            fs::remove_file(&p).unwrap();
            // Open: the data stays readable, and its space is not free.
            let mut head = vec![0u8; 4096];
            assert_eq!(rustix::io::pread(&held, &mut head, 19 << 20).unwrap(), 4096);
            assert!(head == chunk[..4096], "{name}: an open, removed file lost its data");
            assert!(
                free_bytes(&u) < empty - (15 << 20),
                "{name}: the space of an open file was freed"
            );
            drop(held);
            let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while free_bytes(&u) < empty - (2 << 20) {
                assert!(
                    std::time::Instant::now() < end,
                    "{name}: the space of a removed file did not come back ({} of {} bytes free)",
                    free_bytes(&u),
                    empty
                );
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        umount(mounted);
    }
}

/// Files removed while open neither run the server out of descriptors nor
/// go stale: with a server limited to 256 open files, 120 files created,
/// kept open and removed leave room to create, write and read others, and
/// each removed file stays readable, writable and fstat-able through its
/// descriptor. (A removed file is kept for the kernel until FORGET; an
/// open one through the descriptor of its open, not a second one: two per
/// file would take 240 of the 256, with the ~18 the server starts with.)
#[test]
fn removed_open_files_leave_descriptors_for_the_rest() {
    require(cannot_test());
    require(missing_program("prlimit", "Debian package util-linux"));
    let s = setup(false);
    let (m, u, w) = dirs(&s, "f");
    let mounted = mount_rw_under(
        &["prlimit", "--nofile=256:256"],
        "fuse",
        &s.store,
        &s.image,
        (&m, &u, &w),
        &[],
    );
    let limits = fs::read_to_string(format!("/proc/{}/limits", server_pid(&u))).unwrap();
    let soft: Option<u64> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse().ok());
    if soft != Some(256) {
        // As root with CAP_SYS_RESOURCE the server raises its limit itself.
        eprintln!("note: the server runs with {soft:?} open files, not 256: nothing fills its table");
    }
    let dir = m.join("held");
    fs::create_dir(&dir).unwrap();
    let mut held = Vec::new();
    for i in 0..120u32 {
        let p = dir.join(format!("f{i}"));
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&p)
            .unwrap_or_else(|e| panic!("creating {}: {e}", p.display()));
        rustix::io::pwrite(&f, &i.to_le_bytes(), 0).unwrap();
        fs::remove_file(&p).unwrap_or_else(|e| panic!("removing {}: {e}", p.display()));
        held.push(f);
    }
    for i in 0..10u32 {
        let p = m.join(format!("after{i}"));
        fs::write(&p, i.to_le_bytes())
            .unwrap_or_else(|e| panic!("creating {} with 120 removed files open: {e}", p.display()));
        assert_eq!(fs::read(&p).unwrap(), i.to_le_bytes(), "{}", p.display());
        fs::create_dir(m.join(format!("dir{i}"))).unwrap();
    }
    for (i, f) in held.iter().enumerate() {
        let mut b = [0u8; 4];
        assert_eq!(rustix::io::pread(f, &mut b, 0).unwrap(), 4);
        assert_eq!(u32::from_le_bytes(b), i as u32, "removed file {i} lost its data");
        rustix::io::pwrite(f, b"more", 4).unwrap();
        // The kernel asks the server for the attributes of a removed file
        // it wrote through (passthrough drops the cached size and times).
        assert_eq!(f.metadata().unwrap().len(), 8, "removed file {i}");
    }
    drop(held);
    umount(mounted);
}
