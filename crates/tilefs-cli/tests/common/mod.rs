//! Helpers shared by the CLI's integration tests: the binary, generated
//! source trees on disk, kernel mounts that are always undone, and a
//! comparison of two trees as a user would see them.

#![allow(dead_code)]

pub mod filler;
pub mod oci;
pub mod registry;
pub mod seekable;
pub mod snapshotter;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The tilefs binary under test.
pub fn tilefs_bin() -> PathBuf {
    std::env::var_os("TILEFS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tilefs")))
}

/// `mount.tilefs`: the tilefs binary under that name, as `scripts/install`
/// installs it: a link in cargo's scratch directory for tests, one per
/// binary (so nothing is left in /tmp), made by rename (test processes
/// run at once).
pub fn mount_helper_bin() -> PathBuf {
    static LINK: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    LINK.get_or_init(|| {
        let bin = tilefs_bin();
        let bin = fs::canonicalize(&bin).unwrap_or(bin);
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join("mount-helper")
            .join(&sha256_hex(bin.as_os_str().as_encoded_bytes())[..16]);
        fs::create_dir_all(&dir).unwrap();
        let link = dir.join("mount.tilefs");
        let part = dir.join(format!(".mount.tilefs.{}", std::process::id()));
        let _ = fs::remove_file(&part);
        std::os::unix::fs::symlink(&bin, &part).unwrap();
        fs::rename(&part, &link).unwrap();
        link
    })
    .clone()
}

/// `tilefs snapshotter --root ROOT --store STORE --socket SOCK EXTRA...`,
/// its stderr appended to `log`, once it listens on `sock`. Unless EXTRA
/// says where, it makes no link for CRI's image filesystem (whose default
/// is in the machine's /var/lib/containerd).
pub fn spawn_snapshotter(root: &Path, store: &Path, sock: &Path, extra: &[&str], log: &Path) -> std::process::Child {
    spawn_snapshotter_under(&[], root, store, sock, extra, log)
}

/// [`spawn_snapshotter`] run by the command `under` (a sandbox, say:
/// `scripts/unit-sandbox UNIT --`).
pub fn spawn_snapshotter_under(
    under: &[&OsStr],
    root: &Path,
    store: &Path,
    sock: &Path,
    extra: &[&str],
    log: &Path,
) -> std::process::Child {
    let out = fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    let _ = fs::remove_file(sock);
    let no_link: &[&str] = if extra.iter().any(|a| a.starts_with("--cri-imagefs")) {
        &[]
    } else {
        &["--cri-imagefs="]
    };
    let mut cmd = match under.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(tilefs_bin());
            c
        }
        None => Command::new(tilefs_bin()),
    };
    let child = cmd
        .arg("snapshotter")
        .arg("--root")
        .arg(root)
        .arg("--store")
        .arg(store)
        .arg("--socket")
        .arg(sock)
        .args(no_link)
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(out)
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while !sock.exists() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "the snapshotter did not start: {}",
            fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child
}

/// Sends `signal` ("-TERM", "-KILL") to the process in `child`, if any,
/// and waits for it.
pub fn stop_child(child: &mut Option<std::process::Child>, signal: &str) {
    if let Some(mut c) = child.take() {
        let _ = Command::new("kill").args([signal, &c.id().to_string()]).status();
        let _ = c.wait();
    }
}

/// Removes cgroup `name` at the top of every hierarchy (v1 and v2) with
/// the empty cgroups below it: containerd's cgroup of a namespace
/// (`/NAMESPACE`), which it makes for the first container and never
/// removes. A cgroup still in use stays.
pub fn remove_cgroup(name: &str) {
    fn remove(dir: &Path) {
        if let Ok(rd) = fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    remove(&e.path());
                }
            }
        }
        let _ = fs::remove_dir(dir);
    }
    let top = Path::new("/sys/fs/cgroup");
    let mut roots = vec![top.to_path_buf()];
    if let Ok(rd) = fs::read_dir(top) {
        roots.extend(rd.flatten().map(|e| e.path()));
    }
    for r in roots {
        remove(&r.join(name));
    }
}

/// Runs tilefs with `args`; panics with its stderr when it fails.
pub fn tilefs(args: &[&OsStr]) -> Output {
    let out = Command::new(tilefs_bin()).args(args).output().expect("running tilefs");
    assert!(
        out.status.success(),
        "tilefs {:?} failed: {}",
        args,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs tilefs with `args`, returning its output whatever the status.
pub fn tilefs_any(args: &[&OsStr]) -> Output {
    Command::new(tilefs_bin()).args(args).output().expect("running tilefs")
}

pub fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Why this machine cannot mount `fstype`, if it cannot.
pub fn cannot_mount(fstype: &str) -> Option<String> {
    if !is_root() {
        return Some("not running as root".into());
    }
    let fs = fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fs.lines().any(|l| l.split_whitespace().last() == Some(fstype)) {
        return Some(format!("the kernel has no {fstype} filesystem"));
    }
    None
}

/// Why FUSE mounts cannot be made here, if they cannot.
pub fn cannot_fuse() -> Option<String> {
    if !Path::new("/dev/fuse").exists() {
        return Some("no /dev/fuse".into());
    }
    cannot_mount("fuse")
}

/// Why root-only work cannot be done here (`what` says what needs root).
pub fn not_root(what: &str) -> Option<String> {
    (!is_root()).then(|| format!("not running as root ({what})"))
}

/// Why `program` cannot be run, if it is not in $PATH (`package`: where
/// to find it).
pub fn missing_program(program: &str, package: &str) -> Option<String> {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
        .unwrap_or(false);
    (!found).then(|| format!("{program} not found ({package})"))
}

/// Fails the test when the machine lacks what it needs (`why`, from the
/// `cannot_*` functions above), rather than letting it pass without having
/// run: the tests run as root on machines with EROFS, overlayfs, FUSE and
/// loop devices. What machines truly lack is asked for by tests marked
/// `#[ignore = "needs ..."]` instead.
#[track_caller]
pub fn require(why: Option<String>) {
    if let Some(why) = why {
        panic!("this test cannot run here: {why}");
    }
}

/// The composefs vectors: `$TILEFS_ASSETS`, by default
/// ../shared/composefs-assets beside the checkout. Absent, the test fails.
pub fn assets_dir() -> PathBuf {
    let dir = std::env::var_os("TILEFS_ASSETS").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/composefs-assets"),
        PathBuf::from,
    );
    require((!dir.is_dir()).then(|| format!("no composefs vectors at {} (set TILEFS_ASSETS)", dir.display())));
    dir
}

/// Runs the tests of one binary that take it one at a time: `unshare -m`
/// in one test copies every mount of the others into its new namespace,
/// and a mount that propagates to such a copy while it is being made can
/// be reported busy.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The SHA-256 of `data`, hex.
pub fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(data))
}

/// The unprivileged user tests run things as ("nobody").
pub const NOBODY: u32 = 65534;

/// Runs `cmd` as uid/gid 65534 without supplementary groups.
pub fn as_nobody(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // As root, std also drops the supplementary groups before setuid.
    cmd.uid(NOBODY).gid(NOBODY)
}

/// Gives `path` to the unprivileged user (a mount point of theirs).
pub fn give_to_nobody(path: &Path) {
    rustix::fs::chown(
        path,
        Some(rustix::fs::Uid::from_raw(NOBODY)),
        Some(rustix::fs::Gid::from_raw(NOBODY)),
    )
    .unwrap();
}

/// The lines of this namespace's mount table.
pub fn mountinfo_lines() -> Vec<String> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// `path` as the mount table writes it: absolute, symlinks resolved where
/// it can be (a FUSE mount whose server died cannot), with space, tab,
/// newline and backslash in octal.
fn mountinfo_path(path: &Path) -> String {
    let p = fs::canonicalize(path)
        .or_else(|_| std::path::absolute(path))
        .unwrap_or_else(|_| path.to_path_buf());
    let mut out = String::new();
    for c in p.to_string_lossy().chars() {
        match c {
            ' ' | '\t' | '\n' | '\\' => out.push_str(&format!("\\{:03o}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// The mount table lines of the mounts exactly at `mnt`, the first made
/// first.
pub fn mounts_at(mnt: &Path) -> Vec<String> {
    let m = mountinfo_path(mnt);
    mountinfo_lines()
        .into_iter()
        .filter(|l| l.split(' ').nth(4) == Some(m.as_str()))
        .collect()
}

/// The mount table line of the mount exactly at `mnt` (the first made,
/// if several are stacked there).
pub fn mount_line(mnt: &Path) -> Option<String> {
    mounts_at(mnt).into_iter().next()
}

/// Whether something is mounted exactly at `mnt` (in this namespace).
pub fn is_mounted(mnt: &Path) -> bool {
    mount_line(mnt).is_some()
}

/// Whatever is mounted at the path is taken down when dropped, even when a
/// test panics: `tilefs umount` (which refuses what is not tilefs's), then
/// a lazy detach and fusermount3's as a last resort; mounts stacked there
/// go too.
pub struct Mounted(pub PathBuf);

impl Mounted {
    /// Takes down what is mounted at the path now.
    pub fn unmount(&self) {
        for _ in 0..4 {
            if !is_mounted(&self.0) {
                return;
            }
            let _ = tilefs_any(&[os("umount"), self.0.as_os_str()]);
            if is_mounted(&self.0) {
                let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
                let _ = Command::new("fusermount3")
                    .args(["-u", "-z", "--"])
                    .arg(&self.0)
                    .stderr(std::process::Stdio::null())
                    .status();
            }
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        self.unmount();
    }
}

/// fusermount3 opens /dev/fuse as the calling user: Debian's udev rule
/// makes it 0666, but machines without udev leave it 0600. A test sets the
/// mode it needs for its length, then puts the old one back.
pub struct DevFuseMode(u32);

impl DevFuseMode {
    pub fn set(want: u32) -> DevFuseMode {
        let mode = fs::metadata("/dev/fuse").unwrap().mode() & 0o7777;
        if mode != want {
            eprintln!("note: /dev/fuse is mode {mode:o}: made {want:o} for this test");
            fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(want)).unwrap();
        }
        DevFuseMode(mode)
    }
}

impl Drop for DevFuseMode {
    fn drop(&mut self) {
        let _ = fs::set_permissions("/dev/fuse", fs::Permissions::from_mode(self.0));
    }
}

const URING_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Holders of [`FuseUring`], and the parameter's value before the first.
static URING_HOLDERS: std::sync::Mutex<(usize, String)> = std::sync::Mutex::new((0, String::new()));

/// FUSE over io_uring enabled in the fuse module (its `enable_uring`
/// parameter, root only) while held; put back as it was when the last
/// holder lets go, even when a test panics.
pub struct FuseUring(());

impl FuseUring {
    /// None, with the reason, when this kernel or user cannot have it.
    pub fn on() -> Result<FuseUring, String> {
        if !is_root() {
            return Err("not root: only root may enable FUSE over io_uring".into());
        }
        let mut h = URING_HOLDERS.lock().unwrap_or_else(|e| e.into_inner());
        if h.0 == 0 {
            let was = fs::read_to_string(URING_PARAM)
                .map_err(|e| format!("{URING_PARAM}: {e} (a kernel without FUSE over io_uring)"))?;
            fs::write(URING_PARAM, "Y").map_err(|e| format!("{URING_PARAM}: {e}"))?;
            h.1 = was.trim().to_string();
        }
        h.0 += 1;
        Ok(FuseUring(()))
    }
}

impl Drop for FuseUring {
    fn drop(&mut self) {
        let mut h = URING_HOLDERS.lock().unwrap_or_else(|e| e.into_inner());
        h.0 -= 1;
        if h.0 == 0 {
            let _ = fs::write(URING_PARAM, &h.1);
        }
    }
}

/// Mounts `image` read-only as EROFS at `target` (file-backed).
pub fn mount_erofs(image: &Path, target: &Path) -> Mounted {
    let st = Command::new("mount")
        .args(["-t", "erofs", "-o", "ro"])
        .arg(image)
        .arg(target)
        .status()
        .unwrap();
    assert!(st.success(), "mount -t erofs {} failed", image.display());
    Mounted(target.to_path_buf())
}

/// xorshift64*, seeded.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

fn set_time(path: &Path, sec: i64, nsec: i64) {
    use rustix::fs::{utimensat, AtFlags, Timestamps, CWD};
    let t = rustix::fs::Timespec {
        tv_sec: sec,
        tv_nsec: nsec as _,
    };
    utimensat(
        CWD,
        path,
        &Timestamps {
            last_access: t,
            last_modification: t,
        },
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
}

fn set_owner(path: &Path, uid: u32, gid: u32) {
    use rustix::fs::{chownat, AtFlags, Gid, Uid, CWD};
    // SAFETY-free: rustix validates ids; both are plain numbers here.
    chownat(
        CWD,
        path,
        Some(Uid::from_raw(uid)),
        Some(Gid::from_raw(gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
}

fn set_xattr(path: &Path, key: &str, value: &[u8]) {
    rustix::fs::lsetxattr(path, key, value, rustix::fs::XattrFlags::empty())
        .unwrap_or_else(|e| panic!("setxattr {key} on {}: {e}", path.display()));
}

/// Creates a tree under `root` (which must not exist) with every file type
/// a source can hold, awkward names, xattrs shared and unique, hardlinks,
/// long symlinks, inline and external files, big and nested directories,
/// ids above 65535 and nanosecond mtimes. Needs root (devices, owners,
/// trusted.* xattrs).
pub fn make_source_tree(root: &Path, seed: u64) {
    let mut rng = Rng::new(seed);
    fs::create_dir(root).unwrap();
    let mut dirs = vec![root.to_path_buf()];
    let awkward: [&[u8]; 8] = [
        b"with space",
        b"equals=sign",
        b"new\nline",
        b"tab\there",
        b"\xff\xfehigh bytes \xe9",
        b"-",
        b"back\\slash",
        b"x",
    ];
    for (i, n) in awkward.iter().enumerate() {
        let p = root.join(OsStr::from_bytes(n));
        fs::write(&p, format!("awkward {i}\n")).unwrap();
    }
    let long = root.join(OsStr::from_bytes(&[b'L'; 255]));
    fs::write(&long, b"long name").unwrap();

    // Regular files of every interesting size, and some hardlinks.
    let files = root.join("files");
    fs::create_dir(&files).unwrap();
    dirs.push(files.clone());
    for (i, size) in [0usize, 1, 63, 64, 65, 4095, 4096, 4097, 100_000, 1 << 20]
        .iter()
        .enumerate()
    {
        let p = files.join(format!("f{i}-{size}"));
        fs::write(&p, rng.bytes(*size)).unwrap();
        set_xattr(&p, "user.unique", format!("value {i}").as_bytes());
        set_xattr(&p, "user.shared", b"same for many");
        if i % 3 == 0 {
            fs::hard_link(&p, files.join(format!("hardlink-{i}"))).unwrap();
        }
    }
    // A sparse file bigger than 4 GiB (costs no disk).
    let big = files.join("sparse-5g");
    let f = fs::File::create(&big).unwrap();
    f.set_len(5 << 30).unwrap();
    drop(f);

    // Symlinks, short and long.
    symlink("files/f1-1", root.join("link-short")).unwrap();
    symlink("/absolute/target", root.join("link-abs")).unwrap();
    let long_target: String = std::iter::repeat_n("d/", 2000).collect::<String>() + "end";
    symlink(&long_target, root.join("link-long")).unwrap();

    // Special files.
    let dev = root.join("dev");
    fs::create_dir(&dev).unwrap();
    dirs.push(dev.clone());
    use rustix::fs::{mknodat, FileType, Mode, CWD};
    mknodat(
        CWD,
        dev.join("null"),
        FileType::CharacterDevice,
        Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    )
    .unwrap();
    mknodat(
        CWD,
        dev.join("sda"),
        FileType::BlockDevice,
        Mode::from_raw_mode(0o660),
        rustix::fs::makedev(8, 0),
    )
    .unwrap();
    mknodat(
        CWD,
        dev.join("big-minor"),
        FileType::CharacterDevice,
        Mode::from_raw_mode(0o600),
        rustix::fs::makedev(250, 70000),
    )
    .unwrap();
    mknodat(CWD, dev.join("fifo"), FileType::Fifo, Mode::from_raw_mode(0o644), 0).unwrap();
    mknodat(
        CWD,
        dev.join("whiteout"),
        FileType::CharacterDevice,
        Mode::from_raw_mode(0o000),
        0,
    )
    .unwrap();
    let sock = std::os::unix::net::UnixListener::bind(dev.join("socket")).unwrap();
    drop(sock);

    // A directory that spans several blocks, and deep nesting.
    let big_dir = root.join("big-dir");
    fs::create_dir(&big_dir).unwrap();
    dirs.push(big_dir.clone());
    for i in 0..700 {
        let p = big_dir.join(format!("entry-with-a-longish-name-{i:05}"));
        fs::write(&p, [i as u8; 10]).unwrap();
    }
    let mut deep = root.join("deep");
    for i in 0..40 {
        deep = deep.join(format!("level{i}"));
    }
    fs::create_dir_all(&deep).unwrap();
    fs::write(
        deep.join("bottom"),
        b"deep file contents, more than sixty-four bytes long so it is stored externally",
    )
    .unwrap();
    let mut d = root.join("deep");
    dirs.push(d.clone());
    for i in 0..40 {
        d = d.join(format!("level{i}"));
        dirs.push(d.clone());
    }

    // Owners, modes and xattrs of all kinds.
    let owned = root.join("owned");
    fs::write(&owned, b"owned by a high uid").unwrap();
    set_owner(&owned, 100_000, 200_000);
    fs::set_permissions(&owned, std::os::unix::fs::PermissionsExt::from_mode(0o4751)).unwrap();
    set_xattr(&owned, "trusted.overlay.opaque", b"y");
    set_xattr(&owned, "trusted.other", b"trusted value");
    set_xattr(
        &owned,
        "security.capability",
        b"\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",
    );
    set_xattr(&owned, "user.big", &rng.bytes(3000));
    set_xattr(&owned, "user.empty", b"");
    let sticky = root.join("sticky");
    fs::create_dir(&sticky).unwrap();
    dirs.push(sticky.clone());
    fs::set_permissions(&sticky, std::os::unix::fs::PermissionsExt::from_mode(0o1777)).unwrap();
    set_owner(&sticky, 65536, 0);

    // Times last, deepest first, so creating entries does not change them.
    let mut all: Vec<PathBuf> = Vec::new();
    collect(root, &mut all);
    all.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for (i, p) in all.iter().enumerate() {
        let sec = 1_600_000_000 + (i as i64 % 7) * 1000;
        let nsec = if i % 3 == 0 {
            0
        } else {
            (i as i64 * 7919) % 1_000_000_000
        };
        set_time(p, sec, nsec);
    }
    let _ = dirs;
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            collect(&e.path(), out);
        } else {
            out.push(e.path());
        }
    }
}

/// What a user sees of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: Option<u64>,
    pub mtime: (i64, i64),
    pub rdev: u64,
    pub link: Option<OsString>,
    pub xattrs: BTreeMap<OsString, Vec<u8>>,
    pub nlink: Option<u64>,
    pub ino: u64,
}

pub fn xattrs(path: &Path) -> BTreeMap<OsString, Vec<u8>> {
    let mut names = vec![0u8; 65536];
    let n = rustix::fs::llistxattr(path, &mut names).unwrap_or(0);
    let mut out = BTreeMap::new();
    for name in names[..n].split(|&c| c == 0).filter(|n| !n.is_empty()) {
        let mut value = vec![0u8; 65536];
        let len = rustix::fs::lgetxattr(path, OsStr::from_bytes(name), &mut value).unwrap();
        value.truncate(len);
        out.insert(OsString::from_vec(name.to_vec()), value);
    }
    out
}

/// Every path under `root` (relative, root itself as "") and what it looks like.
pub fn scan(root: &Path) -> BTreeMap<Vec<u8>, Seen> {
    let mut all = Vec::new();
    collect(root, &mut all);
    all.into_iter()
        .map(|p| {
            let m = fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(root).unwrap().as_os_str().as_bytes().to_vec();
            let seen = seen(&p, &m, xattrs(&p));
            (rel, seen)
        })
        .collect()
}

pub const S_IFMT: u32 = 0o170000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFCHR: u32 = 0o020000;
pub const S_IFBLK: u32 = 0o060000;
pub const S_IFDIR: u32 = 0o040000;

/// What a user sees of `p`, given its lstat and xattrs.
pub fn seen(p: &Path, m: &fs::Metadata, xattrs: BTreeMap<OsString, Vec<u8>>) -> Seen {
    let ft = m.mode() & S_IFMT;
    Seen {
        mode: m.mode(),
        uid: m.uid(),
        gid: m.gid(),
        size: (ft != S_IFDIR).then_some(m.size()),
        mtime: (m.mtime(), m.mtime_nsec()),
        rdev: m.rdev(),
        link: m
            .file_type()
            .is_symlink()
            .then(|| fs::read_link(p).unwrap().into_os_string()),
        xattrs,
        nlink: (ft != S_IFDIR).then_some(m.nlink()),
        ino: m.ino(),
    }
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The tags in a store (none when it has no images directory).
pub fn tags_in(store: &Path) -> Vec<String> {
    fs::read_dir(store.join("images"))
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The images tilefs components hold in a store (the snapshotter's, one
/// per committed snapshot): `STORE/.owned/HOLDER/NAME`, sorted.
pub fn held_images(store: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(store.join(".owned"))
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|h| fs::read_dir(h.path()).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect();
    v.sort();
    v
}

/// A scratch directory for one test.
pub struct Area {
    pub tmp: tempfile::TempDir,
}

impl Area {
    pub fn new() -> Area {
        Area {
            tmp: tempfile::tempdir().unwrap(),
        }
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }
    pub fn dir(&self, name: &str) -> PathBuf {
        let p = self.path(name);
        fs::create_dir_all(&p).unwrap();
        p
    }
}

/// A whiteout as the source has it: a character device 0/0.
pub fn is_whiteout(s: &Seen) -> bool {
    s.mode & S_IFMT == S_IFCHR && s.rdev == 0
}

pub fn parent_of(path: &[u8]) -> Vec<u8> {
    match path.iter().rposition(|&c| c == b'/') {
        Some(i) => path[..i].to_vec(),
        None => Vec::new(),
    }
}

pub fn xattr_map(pairs: &[(&str, &[u8])]) -> BTreeMap<OsString, Vec<u8>> {
    pairs.iter().map(|(k, v)| (OsString::from(k), v.to_vec())).collect()
}

/// The xattrs an overlay mount shows on a whiteout of the image (the
/// composefs "xattr whiteout": an empty regular file carrying them).
pub const WHITEOUT_XATTRS: &[(&str, &[u8])] = &[("trusted.overlay.whiteout", b""), ("user.overlay.whiteout", b"")];

/// Compares two files byte for byte, all of them.
pub fn same_contents(a: &Path, b: &Path) -> Result<(), String> {
    let mut fa = fs::File::open(a).map_err(|e| format!("{}: {e}", a.display()))?;
    let mut fb = fs::File::open(b).map_err(|e| format!("{}: {e}", b.display()))?;
    let mut ba = vec![0u8; 1 << 20];
    let mut bb = vec![0u8; 1 << 20];
    let mut off = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba).map_err(|e| format!("{} at {off}: {e}", a.display()))?;
        let nb = read_full(&mut fb, &mut bb).map_err(|e| format!("{} at {off}: {e}", b.display()))?;
        if na != nb || ba[..na] != bb[..nb] {
            return Err(format!("contents differ in the MiB at offset {off}"));
        }
        if na == 0 {
            return Ok(());
        }
        off += na as u64;
    }
}

fn read_full(f: &mut fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::io::Read;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Every regular file of `view` reads the same under `mnt` as under `src`;
/// returns how many were compared.
pub fn assert_same_contents(src: &Path, mnt: &Path, view: &BTreeMap<Vec<u8>, Seen>) -> usize {
    let mut n = 0;
    for (path, s) in view {
        if s.mode & S_IFMT != S_IFREG {
            continue;
        }
        let rel = OsStr::from_bytes(path);
        if let Err(e) = same_contents(&src.join(rel), &mnt.join(rel)) {
            panic!("/{}: {e}", String::from_utf8_lossy(path));
        }
        n += 1;
    }
    n
}

/// `tilefs build --store STORE [extra] SRC IMG`.
pub fn build_with_store(src: &Path, store: &Path, image: &Path, extra: &[&str]) {
    let mut args: Vec<&OsStr> = vec![os("build"), os("--quiet"), os("--store"), store.as_os_str()];
    args.extend(extra.iter().map(|s| os(s)));
    args.push(src.as_os_str());
    args.push(image.as_os_str());
    tilefs(&args);
}

/// What the overlay shows for a whiteout of the image (a char device 0/0
/// in the source): overlayfs keeps the composefs "xattr whiteout" as it
/// is, an empty regular file with the same permissions, owner and mtime
/// carrying `overlay.whiteout` (trusted and user), so the mount can itself
/// serve as a lower layer where it acts as a whiteout; its directory
/// carries `overlay.whiteouts` and, in format version 1, `overlay.opaque=x`.
pub const WHITEOUT_DIR_XATTRS: &[(&str, &[u8])] =
    &[("trusted.overlay.whiteouts", b""), ("user.overlay.whiteouts", b"")];
pub const WHITEOUT_DIR_XATTRS_V1: &[(&str, &[u8])] = &[("trusted.overlay.opaque", b"x"), ("user.overlay.opaque", b"x")];

/// The composefs format version of an image file.
pub fn version_of(image: &Path) -> u32 {
    tilefs_image::erofs::image_version(&fs::read(image).unwrap()).unwrap()
}

/// Checks that `got` (the mount of an image of format `version`) shows
/// exactly `want` (the source, as a user saw it). `privileged`: whether the
/// viewer sees trusted.* xattrs. Contents are checked separately.
pub fn assert_same_view(
    want: &BTreeMap<Vec<u8>, Seen>,
    got: &BTreeMap<Vec<u8>, Seen>,
    version: u32,
    privileged: bool,
    what: &str,
) {
    let wn: Vec<_> = want.keys().map(|k| String::from_utf8_lossy(k).into_owned()).collect();
    let gn: Vec<_> = got.keys().map(|k| String::from_utf8_lossy(k).into_owned()).collect();
    if wn != gn {
        let w: BTreeSet<_> = wn.iter().collect();
        let g: BTreeSet<_> = gn.iter().collect();
        panic!(
            "{what}: names differ: missing {:?}, extra {:?}",
            w.difference(&g).take(10).collect::<Vec<_>>(),
            g.difference(&w).take(10).collect::<Vec<_>>()
        );
    }
    let whiteout_dirs: BTreeSet<Vec<u8>> = want
        .iter()
        .filter(|(_, s)| is_whiteout(s))
        .map(|(p, _)| parent_of(p))
        .collect();
    for (path, w) in want {
        let g = &got[path];
        let shown = format!("{what}: /{}", String::from_utf8_lossy(path));
        let mut want_xattrs = w.xattrs.clone();
        if is_whiteout(w) {
            assert_eq!(g.mode, S_IFREG | (w.mode & 0o7777), "{shown}: whiteout mode");
            assert_eq!(g.size, Some(0), "{shown}: whiteout size");
            want_xattrs.extend(xattr_map(WHITEOUT_XATTRS));
        } else {
            assert_eq!(g.mode, w.mode, "{shown}: mode");
            assert_eq!(g.size, w.size, "{shown}: size");
            assert_eq!(g.link, w.link, "{shown}: symlink target");
            if matches!(w.mode & S_IFMT, S_IFCHR | S_IFBLK) {
                assert_eq!(g.rdev, w.rdev, "{shown}: device number");
            }
        }
        if whiteout_dirs.contains(path) {
            want_xattrs.extend(xattr_map(WHITEOUT_DIR_XATTRS));
            if version >= 1 {
                want_xattrs.extend(xattr_map(WHITEOUT_DIR_XATTRS_V1));
            }
        }
        assert_eq!((g.uid, g.gid), (w.uid, w.gid), "{shown}: owner");
        assert_eq!(g.mtime, w.mtime, "{shown}: mtime");
        want_xattrs.retain(|k, _| privileged || !k.as_bytes().starts_with(b"trusted."));
        assert_eq!(g.xattrs, want_xattrs, "{shown}: xattrs");
    }
}

/// A file's fs-verity digest in hex, as `tilefs digest --compact` prints it.
pub fn digest_hex(file: &Path) -> String {
    let out = String::from_utf8(tilefs(&[os("digest"), os("--compact"), file.as_os_str()]).stdout).unwrap();
    out.split_whitespace().next().unwrap_or_default().to_string()
}

/// The store path of the object with digest `hex`: `XX/YYYY…`.
pub fn object_rel(hex: &str) -> String {
    format!("{}/{}", &hex[..2], &hex[2..])
}

/// The names of a process's threads (a FUSE server's `fuse-q*` are its
/// io_uring queues).
pub fn server_threads(pid: u32) -> Vec<String> {
    let mut names = Vec::new();
    for t in fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        if let Ok(n) = fs::read_to_string(t.unwrap().path().join("comm")) {
            names.push(n.trim().to_string());
        }
    }
    names
}

/// An OCI layout at `dir` holding one image named `name`: one layer with
/// one file whose contents are `seed`'s.
pub fn oci_layout(dir: &Path, name: &str, seed: &str) {
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).unwrap();
    let put = |data: &[u8]| -> (String, usize) {
        let hex = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(data));
        fs::write(blobs.join(&hex), data).unwrap();
        (format!("sha256:{hex}"), data.len())
    };
    let mut tar = tar::Builder::new(Vec::new());
    for (path, data) in [("usr/", &b""[..]), ("usr/seed", seed.as_bytes())] {
        let mut h = tar::Header::new_ustar();
        h.set_path(path).unwrap();
        h.set_size(data.len() as u64);
        h.set_mode(if path.ends_with('/') { 0o755 } else { 0o644 });
        h.set_entry_type(if path.ends_with('/') {
            tar::EntryType::Directory
        } else {
            tar::EntryType::Regular
        });
        h.set_mtime(1);
        h.set_uid(0);
        h.set_gid(0);
        h.set_cksum();
        tar.append(&h, data).unwrap();
    }
    let layer = tar.into_inner().unwrap();
    let diff = format!("sha256:{}", hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&layer)));
    let (ld, ls) = put(&layer);
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [diff]},
    }))
    .unwrap();
    let (cd, cs) = put(&config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": ld, "size": ls}],
    }))
    .unwrap();
    let (md, ms) = put(&manifest);
    fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
                "annotations": {"org.opencontainers.image.ref.name": name}}],
        }))
        .unwrap(),
    )
    .unwrap();
}

/// Runs the shell command `cmd` on a terminal (script(1) gives it one) and
/// returns what the terminal showed, with its exit status.
pub fn on_terminal(cmd: &str) -> Output {
    require(
        Command::new("script")
            .arg("--version")
            .output()
            .is_err()
            .then(|| "script(1) (util-linux) is needed".to_string()),
    );
    Command::new("script")
        .args(["-qec", cmd, "/dev/null"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}
