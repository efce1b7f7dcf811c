//! `tilefs commit`: a writable mount (kernel overlay, FUSE as root, FUSE
//! without privilege) changed in every way a tree can change must commit
//! to exactly the image `tilefs build --store` makes of the mount point;
//! the store stays clean (`fsck`), the committed image mounted shows the
//! same tree, files of the image are not read again, and an upper
//! directory that is not what it should be (hostile or broken) gives an
//! error naming the path, and no tag.
//!
//! The tests need root (mounts, devices, owners); each fails, saying what
//! is missing, when it cannot run. Every mount is taken down when a test
//! ends, also when it fails.

mod common;

use common::*;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

// ---------------------------------------------------------------------------
// Mounts and views
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Kernel,
    Fuse,
}

impl Kind {
    fn flag(self) -> &'static str {
        match self {
            Kind::Kernel => "--kernel",
            Kind::Fuse => "--fuse",
        }
    }
}

/// Why mounts of `kind` cannot be tested here.
fn cannot(kind: Kind) -> Option<String> {
    if !is_root() {
        return Some("not running as root".into());
    }
    match kind {
        Kind::Kernel => cannot_mount("erofs").or_else(|| cannot_mount("overlay")),
        Kind::Fuse => cannot_fuse(),
    }
}

/// `tilefs mount KIND [--upper U --work W] --store S IMAGE MNT`.
fn mount(kind: Kind, store: &Path, image: &Path, mnt: &Path, layers: Option<(&Path, &Path)>) -> Mounted {
    let mut args: Vec<&OsStr> = vec![os("mount"), os(kind.flag()), os("--store"), store.as_os_str()];
    if let Some((u, w)) = layers {
        args.extend([os("--upper"), u.as_os_str(), os("--work"), w.as_os_str()]);
    }
    args.extend([image.as_os_str(), mnt.as_os_str()]);
    let out = tilefs_any(&args);
    let guard = Mounted(mnt.to_path_buf());
    assert!(out.status.success(), "tilefs mount {kind:?} failed: {}", stderr(&out));
    assert!(is_mounted(mnt), "nothing mounted at {}", mnt.display());
    guard
}

/// What a user sees of `dir`, one line per entry, sorted: metadata but
/// inode numbers and link counts (hardlinks become files of their own in a
/// commit, as in a directory build), the symlink target, xattrs and the
/// SHA-256 of regular files' contents.
fn view(dir: &Path) -> Vec<String> {
    let mut lines = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let ft = m.mode() & S_IFMT;
        if ft == S_IFDIR {
            for e in fs::read_dir(&p).unwrap() {
                stack.push(e.unwrap().path());
            }
        }
        let rel = p.strip_prefix(dir).unwrap().as_os_str().as_bytes();
        let mut line = format!(
            "{} {:o} {}:{} size={} mtime={}.{:09} rdev={}",
            String::from_utf8_lossy(rel).escape_debug(),
            m.mode(),
            m.uid(),
            m.gid(),
            if ft == S_IFDIR { 0 } else { m.size() },
            m.mtime(),
            m.mtime_nsec(),
            m.rdev(),
        );
        if m.file_type().is_symlink() {
            line.push_str(&format!(" -> {:?}", fs::read_link(&p).unwrap()));
        }
        let mut x: Vec<_> = xattrs(&p).into_iter().collect();
        x.sort();
        for (k, v) in x {
            line.push_str(&format!(" {}={}", k.to_string_lossy(), hex::encode(v)));
        }
        if ft == S_IFREG {
            let data = fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            line.push_str(&format!(" sha256={}", sha256_hex(&data)));
        }
        lines.push(line);
    }
    lines.sort();
    lines
}

/// Asserts two views are the same, showing the first lines that differ.
fn assert_same_views(want: &[String], got: &[String], what: &str) {
    if want == got {
        return;
    }
    let w: std::collections::BTreeSet<_> = want.iter().collect();
    let g: std::collections::BTreeSet<_> = got.iter().collect();
    panic!(
        "{what}: views differ:\n only before: {:#?}\n only after: {:#?}",
        w.difference(&g).take(8).collect::<Vec<_>>(),
        g.difference(&w).take(8).collect::<Vec<_>>()
    );
}

/// When run with TILEFS_COMMIT_VIEW=DIR (as an unprivileged user, by the
/// rootless test), prints `view(DIR)`. Otherwise does nothing. Not a test of
/// its own, so ignored.
#[test]
#[ignore = "a helper: rootless_fuse_commit_is_the_build_of_the_mount runs it as the unprivileged user"]
fn view_child() {
    let Some(dir) = std::env::var_os("TILEFS_COMMIT_VIEW") else {
        return;
    };
    for l in view(Path::new(&dir)) {
        println!("VIEW {l}");
    }
}

fn view_as_nobody(dir: &Path) -> Vec<String> {
    let out = as_nobody(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "view_child",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("TILEFS_COMMIT_VIEW", dir)
            .stdin(Stdio::null()),
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "view as nobody failed: {}", stderr(&out));
    let lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("VIEW ").map(str::to_string))
        .collect();
    assert!(!lines.is_empty(), "view as nobody printed nothing: {}", stderr(&out));
    lines
}

fn json_of(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// `tilefs commit --json` (as root, or as nobody): its summary.
fn commit(store: &Path, mnt: &Path, tag: &str, nobody: bool) -> serde_json::Value {
    let mut cmd = Command::new(tilefs_bin());
    cmd.args([
        os("commit"),
        os("--json"),
        os("--store"),
        store.as_os_str(),
        os("--tag"),
        os(tag),
    ])
    .arg(mnt)
    .stdin(Stdio::null());
    if nobody {
        as_nobody(&mut cmd);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "tilefs commit failed: {}", stderr(&out));
    json_of(&out)
}

/// `tilefs build --store STORE MNT OUT` (as root, or as nobody), at the
/// format version of the mount's image (which a commit keeps).
fn build_of(store: &Path, mnt: &Path, out_image: &Path, nobody: bool, version: u32) {
    let mut cmd = Command::new(tilefs_bin());
    cmd.args([os("build"), os("--quiet"), os("--store"), store.as_os_str()])
        .arg(format!("--min-version={version}"))
        .arg(mnt)
        .arg(out_image)
        .stdin(Stdio::null());
    if nobody {
        as_nobody(&mut cmd);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "tilefs build of the mount failed: {}",
        stderr(&out)
    );
}

fn fsck_clean(store: &Path, nobody: bool) {
    let mut cmd = Command::new(tilefs_bin());
    cmd.args([os("fsck"), os("--quiet"), os("--store"), store.as_os_str()])
        .stdin(Stdio::null());
    if nobody {
        as_nobody(&mut cmd);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "fsck after the commit: {}{}",
        String::from_utf8_lossy(&out.stdout),
        stderr(&out)
    );
}

/// The committed image (`STORE/images/TAG`) is the build of the mount.
fn assert_commit_is_build(store: &Path, tag: &str, built: &Path) {
    let committed = fs::read(store.join("images").join(tag)).unwrap();
    let built_bytes = fs::read(built).unwrap();
    if committed != built_bytes {
        let dump = |img: &Path| String::from_utf8(tilefs(&[os("dump"), img.as_os_str()]).stdout).unwrap();
        let (c, b) = (dump(&store.join("images").join(tag)), dump(built));
        let diff: Vec<_> = c
            .lines()
            .zip(b.lines())
            .filter(|(x, y)| x != y)
            .take(6)
            .map(|(x, y)| format!("\n commit {x}\n build  {y}"))
            .collect();
        panic!(
            "the commit ({} bytes) differs from the build of the mount ({} bytes):{}",
            committed.len(),
            built_bytes.len(),
            diff.concat()
        );
    }
}

// ---------------------------------------------------------------------------
// Changes
// ---------------------------------------------------------------------------

fn w(p: &Path, data: &[u8]) {
    fs::write(p, data).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
}

fn sx(p: &Path, k: &str, v: &[u8]) {
    rustix::fs::lsetxattr(p, k, v, rustix::fs::XattrFlags::empty())
        .unwrap_or_else(|e| panic!("setxattr {k} on {}: {e}", p.display()));
}

fn times(p: &Path, sec: i64, nsec: i64) {
    let t = rustix::fs::Timespec {
        tv_sec: sec,
        tv_nsec: nsec as _,
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        p,
        &rustix::fs::Timestamps {
            last_access: t,
            last_modification: t,
        },
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
}

/// Changes the mounted `make_source_tree` in every way (as root).
fn change_everything(m: &Path, kind: Kind) {
    let mut rng = Rng::new(99);
    let f = m.join("files");
    // New files (empty, inline, external), in old and new directories.
    w(&m.join("new-empty"), b"");
    w(&m.join("new-small"), b"small new");
    w(&m.join("new-64"), &rng.bytes(64));
    w(&m.join("new-big"), &rng.bytes(300_000));
    w(&f.join("new-in-image-dir"), &rng.bytes(5000));
    fs::create_dir_all(m.join("newdir/sub/deeper")).unwrap();
    w(&m.join("newdir/sub/deeper/file"), &rng.bytes(70));
    // Appended and overwritten image files; one truncated.
    fs::OpenOptions::new()
        .append(true)
        .open(f.join("f5-4095"))
        .unwrap()
        .write_all_at_end(b"appended");
    w(&f.join("f7-4097"), &rng.bytes(3000));
    fs::OpenOptions::new()
        .write(true)
        .open(f.join("f6-4096"))
        .unwrap()
        .set_len(10)
        .unwrap();
    // Metadata of image files (kernel: metacopy copy-ups).
    fs::set_permissions(f.join("f8-100000"), fs::Permissions::from_mode(0o600)).unwrap();
    rustix::fs::chown(
        f.join("f4-65"),
        Some(rustix::fs::Uid::from_raw(1234)),
        Some(rustix::fs::Gid::from_raw(5678)),
    )
    .unwrap();
    times(&f.join("hardlink-3"), 1_234_567_890, 123_456_789);
    sx(&f.join("f0-0"), "user.added", b"to an image file");
    rustix::fs::lremovexattr(f.join("f1-1"), "user.unique").unwrap();
    sx(&m.join("owned"), "trusted.commit", b"privileged");
    // Deleted files and directories.
    fs::remove_file(f.join("f2-63")).unwrap();
    fs::remove_file(m.join("big-dir/entry-with-a-longish-name-00007")).unwrap();
    fs::remove_dir_all(m.join("deep/level0/level1/level2/level3")).unwrap();
    fs::remove_file(m.join("link-abs")).unwrap();
    // Renamed files (within a directory, across directories, over another).
    fs::rename(f.join("f3-64"), f.join("renamed-f3")).unwrap();
    fs::rename(f.join("f9-1048576"), m.join("moved-f9")).unwrap();
    fs::rename(m.join("new-small"), f.join("f1-1")).unwrap();
    // Renamed directories (redirects: absolute, and within the root).
    fs::rename(m.join("big-dir"), m.join("sticky/big-dir-moved")).unwrap();
    fs::rename(m.join("deep/level0/level1"), m.join("deep-moved")).unwrap();
    w(&m.join("deep-moved/level2/added"), b"into a moved directory");
    // Opaque: an image directory removed and made again.
    fs::remove_dir_all(m.join("deep")).unwrap();
    fs::create_dir(m.join("deep")).unwrap();
    w(&m.join("deep/only-new"), b"only this");
    // Symlinks: new, replaced, dangling.
    symlink("files/f0-0", m.join("new-link")).unwrap();
    fs::remove_file(m.join("link-short")).unwrap();
    symlink("/nowhere/at/all", m.join("link-short")).unwrap();
    // Hardlinks: to an image file, to a new one.
    fs::hard_link(f.join("f5-4095"), m.join("hl-f5")).unwrap();
    fs::hard_link(m.join("new-big"), m.join("newdir/hl-new-big")).unwrap();
    // xattrs of new files, escaped overlay xattrs among them.
    sx(&m.join("new-big"), "user.new", b"value");
    sx(&m.join("new-64"), "trusted.overlay.mine", b"escaped");
    sx(&m.join("new-64"), "user.overlay.mine", b"user ns");
    sx(&m.join("new-empty"), "security.test", b"sec");
    if kind == Kind::Kernel {
        // The tilefs FUSE server refuses xattrs, chmod and chown on
        // directories as root (it calls them on O_PATH descriptors).
        sx(&m.join("newdir"), "user.dir", b"on a directory");
        sx(&m.join("sticky"), "user.dir", b"on an image directory");
        fs::set_permissions(m.join("newdir/sub"), fs::Permissions::from_mode(0o2750)).unwrap();
        rustix::fs::chown(
            m.join("sticky"),
            Some(rustix::fs::Uid::from_raw(4242)),
            Some(rustix::fs::Gid::from_raw(4343)),
        )
        .unwrap();
    }
    // Special files, owners and modes of directories.
    rustix::fs::mknodat(
        rustix::fs::CWD,
        m.join("newdir/fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o640),
        0,
    )
    .unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        m.join("newdir/null"),
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    )
    .unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        m.join("newdir/disk"),
        rustix::fs::FileType::BlockDevice,
        rustix::fs::Mode::from_raw_mode(0o660),
        rustix::fs::makedev(259, 70000),
    )
    .unwrap();
    times(&m.join("newdir/sub/deeper"), 1_000_000_000, 5);
}

trait AppendExt {
    fn write_all_at_end(self, data: &[u8]);
}

impl AppendExt for fs::File {
    fn write_all_at_end(mut self, data: &[u8]) {
        std::io::Write::write_all(&mut self, data).unwrap();
    }
}

/// Regular files of more than 64 bytes in `upper` that hold their data.
fn upper_data_files(upper: &Path) -> u64 {
    let mut n = 0;
    let mut stack = vec![upper.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                stack.push(p);
            } else if m.is_file() && m.len() > 64 && !xattrs(&p).contains_key(OsStr::new("trusted.overlay.metacopy")) {
                n += 1;
            }
        }
    }
    n
}

/// `make_source_tree` without its 5 GiB sparse file (digesting it through
/// a mount for the comparison build is slow) in STORE, as IMAGE.
fn source_image(a: &Area) -> (PathBuf, PathBuf) {
    let src = a.path("src");
    make_source_tree(&src, 7);
    fs::remove_file(src.join("files/sparse-5g")).unwrap();
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    (store, image)
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

fn commit_is_the_build_of_the_mount(kind: Kind) {
    let a = Area::new();
    let (store, image) = source_image(&a);
    let (upper, work, mnt) = (a.dir("upper"), a.dir("work"), a.dir("mnt"));
    let writable = mount(kind, &store, &image, &mnt, Some((&upper, &work)));
    change_everything(&mnt, kind);

    let report = commit(&store, &mnt, "c1", false);
    assert_eq!(report["tag"], "c1");
    assert_eq!(report["kind"], if kind == Kind::Kernel { "kernel" } else { "fuse" });
    // Digested: the upper directory's external files (not the kernel's
    // metacopy files, whose data is the image's), nothing else.
    assert_eq!(report["files_digested"], upper_data_files(&upper), "{report}");
    let built = a.path("built.cfs");
    assert_eq!(
        report["format_version"],
        version_of(&image),
        "the image's format is kept"
    );
    build_of(&store, &mnt, &built, false, version_of(&image));
    assert_commit_is_build(&store, "c1", &built);
    assert_eq!(report["digest"], digest_hex(&built));
    fsck_clean(&store, false);

    // The committed image mounted shows the same tree.
    let before = view(&mnt);
    let ro = a.dir("ro");
    let _ro = mount(kind, &store, &store.join("images/c1"), &ro, None);
    assert_same_views(&before, &view(&ro), "the writable mount against the committed image");

    // A second commit reads no file again (the digest cache), and no file
    // of the image is ever read: an object of an unchanged image file,
    // damaged (same size), changes nothing.
    let victim = store.join(object_rel(&digest_hex(&a.path("src/files/hardlink-9"))));
    let good = fs::read(&victim).unwrap();
    let mut bad = good.clone();
    bad[0] ^= 0xff;
    fs::write(&victim, &bad).unwrap();
    let again = commit(&store, &mnt, "c2", false);
    fs::write(&victim, &good).unwrap();
    assert_eq!(again["digest"], report["digest"], "{again}");
    assert_eq!(again["cache_hits"], again["files_digested"], "{again}");
    assert_eq!(again["new_objects"], 0, "{again}");
    drop(writable);
}

#[test]
fn kernel_commit_is_the_build_of_the_mount() {
    require(cannot(Kind::Kernel));
    commit_is_the_build_of_the_mount(Kind::Kernel);
}

#[test]
fn fuse_commit_is_the_build_of_the_mount() {
    require(cannot(Kind::Fuse));
    commit_is_the_build_of_the_mount(Kind::Fuse);
}

/// A tree an unprivileged user can change through FUSE: directories are
/// theirs; files, a symlink, a FIFO and a device belong to root (copied
/// up, they need override xattrs, and the last three stand-in files).
fn rootless_source(src: &Path) {
    let mut rng = Rng::new(5);
    for d in ["", "a", "a/b", "c", "c/d"] {
        fs::create_dir_all(src.join(d)).unwrap();
    }
    w(&src.join("a/root-small"), b"owned by root");
    w(&src.join("a/root-big"), &rng.bytes(20_000));
    w(&src.join("a/root-writable"), &rng.bytes(9000));
    fs::set_permissions(src.join("a/root-writable"), fs::Permissions::from_mode(0o666)).unwrap();
    w(&src.join("a/b/mine"), &rng.bytes(4000));
    sx(&src.join("a/root-big"), "user.kept", b"xattr of the image");
    // Not settable by the user: kept as user.tilefs.x.security.kept.
    sx(&src.join("a/root-writable"), "security.kept", b"sec");
    w(&src.join("c/d/deep"), &rng.bytes(100));
    w(&src.join("c/gone"), b"to be removed");
    symlink("a/root-small", src.join("link")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        src.join("c/fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        src.join("c/null"),
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    )
    .unwrap();
    for p in ["", "a", "a/b", "c", "c/d", "a/b/mine", "c/d/deep", "c/gone"] {
        rustix::fs::chown(
            src.join(p),
            Some(rustix::fs::Uid::from_raw(NOBODY)),
            Some(rustix::fs::Gid::from_raw(NOBODY)),
        )
        .unwrap();
    }
    for (i, p) in ["a/root-small", "a/root-big", "c/d/deep", "link"].iter().enumerate() {
        times(&src.join(p), 1_500_000_000 + i as i64, 7);
    }
}

/// What the unprivileged user does in the mount.
const ROOTLESS_CHANGES: &str = r#"
set -e
cd "$1"
echo appended >> a/root-writable          # copy-up of root's file: override
head -c 7000 /dev/zero > a/new-big         # new files
echo tiny > a/b/new-small
mkdir -p e/f && echo x > e/f/g
mv link link-moved                         # root's symlink: a stand-in
mv c/fifo c/fifo-moved                     # root's FIFO: a stand-in
mv c/null c/null-moved                     # root's device: a stand-in
rm c/gone                                  # whiteout
rm -rf c/d                                 # whiteout of a directory
mkdir c/d && echo new > c/d/new            # opaque
mv a/b a/b-moved                           # redirect (user.overlay.redirect)
ln a/new-big hl
ln -s a/b-moved/mine new-link
setfattr -n user.mine -v 1 a/new-big
setfattr -n user.overlay.x -v escaped a/b-moved/mine
touch -d @1600000000 c/d/new
"#;

#[test]
fn rootless_fuse_commit_is_the_build_of_the_mount() {
    require(cannot(Kind::Fuse).or_else(|| missing_program("fusermount3", "Debian package fuse3")));
    let a = Area::new();
    let src = a.path("src");
    rootless_source(&src);
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    let (upper, work, mnt, ro) = (a.dir("upper"), a.dir("work"), a.dir("mnt"), a.dir("ro"));
    for p in [&upper, &work, &mnt, &ro] {
        give_to_nobody(p);
    }
    let st = Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(&store)
        .status()
        .unwrap();
    assert!(st.success());
    fs::set_permissions(a.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let _dev = DevFuseMode::set(0o666);
    let as_user = |args: &[&OsStr]| {
        let out = as_nobody(Command::new(tilefs_bin()).args(args).stdin(Stdio::null()))
            .output()
            .unwrap();
        assert!(out.status.success(), "tilefs {args:?} as nobody: {}", stderr(&out));
    };
    as_user(&[
        os("mount"),
        os("--fuse"),
        os("--store"),
        store.as_os_str(),
        os("--upper"),
        upper.as_os_str(),
        os("--work"),
        work.as_os_str(),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    let _writable = Mounted(mnt.clone());
    let out = as_nobody(
        Command::new("sh")
            .args(["-c", ROOTLESS_CHANGES, "sh"])
            .arg(&mnt)
            .stdin(Stdio::null()),
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "changes as nobody: {}", stderr(&out));
    // What only the override and kept xattrs record is in the upper.
    let kept = xattrs(&upper.join("a/root-writable"));
    assert!(kept.contains_key(OsStr::new("user.tilefs.x.security.kept")), "{kept:?}");
    assert!(xattrs(&upper.join("link-moved")).contains_key(OsStr::new("user.containers.override_stat")));

    let report = commit(&store, &mnt, "mine", true);
    let out_dir = a.dir("out");
    give_to_nobody(&out_dir);
    let built = out_dir.join("built.cfs");
    build_of(&store, &mnt, &built, true, version_of(&image));
    assert_commit_is_build(&store, "mine", &built);
    fsck_clean(&store, true);
    // The tree holds root's owners and the stand-ins' types.
    let dump = String::from_utf8(tilefs(&[os("dump"), built.as_os_str()]).stdout).unwrap();
    assert!(
        dump.lines().any(|l| l.starts_with("/link-moved 12 120777 1 0 0 0 ")),
        "{dump}"
    );
    assert!(
        dump.lines().any(|l| l.starts_with("/c/fifo-moved 0 10644 1 0 0 0 ")),
        "{dump}"
    );
    assert!(
        dump.lines().any(|l| l.starts_with("/c/null-moved 0 20644 1 0 0 259 ")),
        "{dump}"
    );
    assert!(dump.contains("security.kept=sec"), "{dump}");
    assert!(report["files_digested"].as_u64().unwrap() >= 2, "{report}");

    let before = view_as_nobody(&mnt);
    as_user(&[
        os("mount"),
        os("--fuse"),
        os("--store"),
        store.as_os_str(),
        store.join("images/mine").as_os_str(),
        ro.as_os_str(),
    ]);
    let _ro = Mounted(ro.clone());
    assert_same_views(&before, &view_as_nobody(&ro), "the rootless mount against its commit");

    // What the user may break in their upper directory is refused, named.
    let as_user_sh = |script: &str| {
        let out = as_nobody(
            Command::new("sh")
                .args(["-c", script, "sh"])
                .arg(&upper)
                .stdin(Stdio::null()),
        )
        .output()
        .unwrap();
        assert!(out.status.success(), "{script}: {}", stderr(&out));
    };
    let refused_as_user = |names: &str, why: &str| {
        let out = as_nobody(
            Command::new(tilefs_bin())
                .args(commit_args(&store, "bad", &mnt))
                .stdin(Stdio::null()),
        )
        .output()
        .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(names) && err.contains(why), "{err}");
        assert!(!tags_in(&store).contains(&"bad".to_string()));
    };
    as_user_sh(r#"chmod 000 "$1/e""#);
    refused_as_user("upper/e", "Permission denied");
    as_user_sh(r#"chmod 755 "$1/e""#);
    as_user_sh(r#"setfattr -n user.containers.override_stat -v 0:0:0755:dir "$1/a/b-moved/new-small""#);
    refused_as_user("upper/a/b-moved/new-small", "says it is a directory");
    as_user_sh(r#"setfattr -x user.containers.override_stat "$1/a/b-moved/new-small""#);
    let again = commit(&store, &mnt, "mine", true);
    assert_eq!(again["digest"], report["digest"]);
}

/// `tilefs commit` that fails: exit status 1, one line naming `names`,
/// no tag `tag` and nothing left in the store's temporary directory.
fn refused(args: &[&OsStr], store: &Path, tag: &str, names: &str, why: &str) -> String {
    let out = tilefs_any(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
    assert!(
        err.starts_with("tilefs: ") && err.contains(names) && err.contains(why),
        "{args:?}: {err}"
    );
    assert!(!tags_in(store).contains(&tag.to_string()), "{args:?} tagged {tag}");
    let leftovers: Vec<_> = fs::read_dir(store.join(".tmp"))
        .map(|rd| rd.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(leftovers.is_empty(), "{args:?} left {leftovers:?}");
    err
}

fn commit_args<'a>(store: &'a Path, tag: &'a str, mnt: &'a Path) -> Vec<&'a OsStr> {
    vec![
        os("commit"),
        os("--store"),
        store.as_os_str(),
        os("--tag"),
        os(tag),
        mnt.as_os_str(),
    ]
}

/// A small image: a few files, one external, in two directories.
fn small_image(a: &Area) -> (PathBuf, PathBuf) {
    let src = a.dir("small");
    fs::create_dir(src.join("a")).unwrap();
    w(&src.join("a/file"), &[7u8; 5000]);
    w(&src.join("top"), b"top");
    let (store, image) = (a.path("store"), a.path("small.cfs"));
    build_with_store(&src, &store, &image, &[]);
    (store, image)
}

#[test]
fn commit_refuses_what_is_not_a_writable_tilefs_mount() {
    require(cannot(Kind::Fuse));
    let a = Area::new();
    let (store, image) = small_image(&a);
    // Usage errors: exit status 2.
    let out = tilefs_any(&[os("commit"), a.path("x").as_os_str()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--tag"), "{}", stderr(&out));

    let plain = a.dir("plain");
    refused(
        &commit_args(&store, "t", &plain),
        &store,
        "t",
        "plain",
        "not a mount point",
    );
    refused(
        &commit_args(&store, "t", Path::new("/proc")),
        &store,
        "t",
        "/proc",
        "not a tilefs mount",
    );
    refused(
        &commit_args(&store, "t", &a.path("absent")),
        &store,
        "t",
        "absent",
        "No such file",
    );
    refused(
        &commit_args(&store, "bad/tag", &plain),
        &store,
        "bad/tag",
        "bad/tag",
        "invalid tag name",
    );

    let ro = a.dir("ro");
    let m = mount(Kind::Fuse, &store, &image, &ro, None);
    refused(
        &commit_args(&store, "t", &ro),
        &store,
        "t",
        "ro",
        "read-only tilefs mount",
    );
    drop(m);
    if cannot(Kind::Kernel).is_none() {
        let m = mount(Kind::Kernel, &store, &image, &ro, None);
        refused(
            &commit_args(&store, "t", &ro),
            &store,
            "t",
            "ro",
            "read-only tilefs mount",
        );
        drop(m);
    }

    // A writable mount of another store.
    let (upper, work, mnt) = (a.dir("upper"), a.dir("work"), a.dir("mnt"));
    let _m = mount(Kind::Fuse, &store, &image, &mnt, Some((&upper, &work)));
    let other = a.dir("other-store");
    tilefs(&[
        os("build"),
        os("--quiet"),
        os("--store"),
        other.as_os_str(),
        plain.as_os_str(),
        a.path("x.cfs").as_os_str(),
    ]);
    refused(
        &commit_args(&other, "t", &mnt),
        &other,
        "t",
        "mnt",
        "no live FUSE mount of the store",
    );
    // A subdirectory of the mount is not its mount point.
    refused(
        &commit_args(&store, "t", &mnt.join("a")),
        &store,
        "t",
        "a",
        "not a mount point",
    );
    // The right store commits.
    tilefs(&commit_args(&store, "t", &mnt));
    assert!(tags_in(&store).contains(&"t".to_string()));
}

#[test]
fn a_broken_or_hostile_upper_directory_is_refused_naming_the_path() {
    require(cannot(Kind::Fuse));
    let a = Area::new();
    let (store, image) = small_image(&a);
    // On tmpfs, which holds large xattrs.
    let t = a.dir("tmpfs");
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64m", "tmpfs"])
        .arg(&t)
        .status()
        .unwrap();
    assert!(st.success());
    let _tmpfs = Mounted(t.clone());
    let (upper, work, mnt) = (t.join("upper"), t.join("work"), a.dir("mnt"));
    fs::create_dir(&upper).unwrap();
    fs::create_dir(&work).unwrap();
    let _m = mount(Kind::Fuse, &store, &image, &mnt, Some((&upper, &work)));
    w(&mnt.join("new"), &[1u8; 1000]);
    let args = commit_args(&store, "bad", &mnt);

    // xattrs beyond what an inode may hold.
    let huge = upper.join("huge");
    w(&huge, b"x");
    for i in 0..3 {
        sx(&huge, &format!("user.big{i}"), &vec![b'v'; 20_000]);
    }
    refused(&args, &store, "bad", "upper/huge", "xattrs need");
    fs::remove_file(&huge).unwrap();

    // A symlink is recorded as one, never followed: a link to / where the
    // image has a directory hides that directory and leads nowhere.
    symlink("/", upper.join("a")).unwrap();
    tilefs(&commit_args(&store, "link", &mnt));
    let dump = String::from_utf8(tilefs(&[os("dump"), store.join("images/link").as_os_str()]).stdout).unwrap();
    assert!(dump.lines().any(|l| l.starts_with("/a 1 120777 ")), "{dump}");
    assert!(!dump.contains("/a/"), "{dump}");
    fs::remove_file(upper.join("a")).unwrap();

    // A FIFO, a socket and a device in the upper directory are entries,
    // never opened (a FIFO opened would hang the reader).
    rustix::fs::mknodat(
        rustix::fs::CWD,
        upper.join("fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    tilefs(&commit_args(&store, "fifo", &mnt));
    fs::remove_file(upper.join("fifo")).unwrap();

    // A mount inside the upper directory is not crossed.
    let inner = upper.join("inner");
    fs::create_dir(&inner).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "tmpfs"])
        .arg(&inner)
        .status()
        .unwrap();
    assert!(st.success());
    let inner_guard = Mounted(inner.clone());
    refused(&args, &store, "bad", "upper/inner", "cannot open directory");
    drop(inner_guard);
    fs::remove_dir(&inner).unwrap();

    // A redirect to an image directory still in place: shown twice (and
    // a thousand such would make the tree explode).
    fs::create_dir(upper.join("dup")).unwrap();
    sx(&upper.join("dup"), "trusted.overlay.redirect", b"/a");
    refused(&args, &store, "bad", "mnt/dup", "shows in another place too");
    fs::remove_dir(upper.join("dup")).unwrap();

    // The upper directory swapped for a symlink (to a copy of it).
    let real = t.join("upper.real");
    fs::rename(&upper, &real).unwrap();
    symlink(&real, &upper).unwrap();
    refused(&args, &store, "bad", "upper", "cannot open the upper directory");
    fs::remove_file(&upper).unwrap();
    fs::rename(&real, &upper).unwrap();

    // Whole again: it commits.
    tilefs(&commit_args(&store, "good", &mnt));
    fsck_clean(&store, false);
}

#[test]
fn kernel_metacopy_file_without_image_data_is_refused() {
    require(cannot(Kind::Kernel));
    let a = Area::new();
    let (store, image) = small_image(&a);
    let (upper, work, mnt) = (a.dir("upper"), a.dir("work"), a.dir("mnt"));
    let _m = mount(Kind::Kernel, &store, &image, &mnt, Some((&upper, &work)));
    // Planted by hand: metadata whose data the image does not hold.
    let p = upper.join("orphan");
    w(&p, b"");
    fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(5000)
        .unwrap();
    sx(&p, "trusted.overlay.metacopy", b"");
    sx(&p, "trusted.overlay.redirect", b"/no/such/file");
    refused(
        &commit_args(&store, "bad", &mnt),
        &store,
        "bad",
        "upper/orphan",
        "metacopy file whose data is not in the image",
    );
    // Over image data of another size.
    sx(&p, "trusted.overlay.redirect", b"/a/file");
    fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(4000)
        .unwrap();
    refused(
        &commit_args(&store, "bad", &mnt),
        &store,
        "bad",
        "upper/orphan",
        "4000 bytes over image data of 5000",
    );
    fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(5000)
        .unwrap();
    tilefs(&commit_args(&store, "good", &mnt));
    let dump = String::from_utf8(tilefs(&[os("dump"), store.join("images/good").as_os_str()]).stdout).unwrap();
    let file = dump.lines().find(|l| l.starts_with("/a/file ")).unwrap();
    let orphan = dump.lines().find(|l| l.starts_with("/orphan ")).unwrap();
    assert_eq!(
        file.split(' ').nth(8),
        orphan.split(' ').nth(8),
        "the image's object:\n{file}\n{orphan}"
    );
}
