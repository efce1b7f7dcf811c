//! FUSE mounts (`tilefs mount --fuse`): the tree shown must equal the
//! source and the kernel mount of the same image, for root and for an
//! unprivileged user (through fusermount3); objects are verified (a
//! tampered or missing one gives EIO for its file only); the server ends
//! cleanly on SIGTERM, `tilefs umount` clears a mount whose server died,
//! a corrupt image is refused, and parallel readers see no error.
//!
//! Most tests need root (the source trees hold devices, owners and
//! trusted.* xattrs); the unprivileged test drops to uid/gid 65534 from
//! root. Each fails, saying what is missing, when it cannot run.
//! `TILEFS_FUSE_STRESS_SECS` sets the stress test's length (default 20).

mod common;

use common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// Why these tests cannot run here (they need root to make the source tree).
fn cannot_test() -> Option<String> {
    if !is_root() {
        return Some("not running as root (the source trees need it)".into());
    }
    cannot_fuse()
}

fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A FUSE mount, always taken down when dropped (even when a test panics),
/// then its server (when run in the foreground) killed.
struct FuseMounted {
    mount: Mounted,
    child: Option<Child>,
}

impl Drop for FuseMounted {
    fn drop(&mut self) {
        self.mount.unmount();
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Mounts in the background (the command returns once the mount is ready).
fn fmount(store: &Path, image: &Path, mnt: &Path, extra: &[&str]) -> FuseMounted {
    let mut args: Vec<&OsStr> = vec![os("mount"), os("--fuse"), os("--store"), store.as_os_str()];
    args.extend(extra.iter().map(|s| os(s)));
    args.push(image.as_os_str());
    args.push(mnt.as_os_str());
    let out = tilefs_any(&args);
    let guard = FuseMounted {
        mount: Mounted(mnt.to_path_buf()),
        child: None,
    };
    assert!(out.status.success(), "tilefs mount --fuse failed: {}", stderr(&out));
    assert!(
        is_mounted(mnt),
        "mount returned but nothing is mounted at {}",
        mnt.display()
    );
    guard
}

/// Mounts in the foreground: the server is the child, its stderr piped.
fn fmount_foreground(store: &Path, image: &Path, mnt: &Path, env: &[(&str, &str)]) -> FuseMounted {
    fmount_foreground_with(store, image, mnt, env, &[])
}

fn fmount_foreground_with(store: &Path, image: &Path, mnt: &Path, env: &[(&str, &str)], args: &[&str]) -> FuseMounted {
    let mut cmd = Command::new(tilefs_bin());
    cmd.args([
        os("mount"),
        os("--fuse"),
        os("--foreground"),
        os("--store"),
        store.as_os_str(),
    ])
    .args(args)
    .arg(image)
    .arg(mnt)
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().unwrap();
    let mut guard = FuseMounted {
        mount: Mounted(mnt.to_path_buf()),
        child: Some(child),
    };
    wait_until("the foreground mount", 30, || {
        if let Some(st) = guard.child.as_mut().unwrap().try_wait().unwrap() {
            panic!("tilefs mount --fuse --foreground exited early: {st}");
        }
        is_mounted(mnt)
    });
    guard
}

/// Exactly equal views (FUSE against the kernel mount): everything but
/// inode numbers, which must group entries the same way.
fn assert_identical_views(kernel: &BTreeMap<Vec<u8>, Seen>, fuse: &BTreeMap<Vec<u8>, Seen>) {
    assert_eq!(
        kernel.keys().collect::<Vec<_>>(),
        fuse.keys().collect::<Vec<_>>(),
        "names differ between the kernel and the FUSE mount"
    );
    let mut k_groups: BTreeMap<u64, BTreeSet<&Vec<u8>>> = BTreeMap::new();
    let mut f_groups: BTreeMap<u64, BTreeSet<&Vec<u8>>> = BTreeMap::new();
    for (path, k) in kernel {
        let f = &fuse[path];
        let shown = format!("/{}", String::from_utf8_lossy(path));
        let dir = k.mode & S_IFMT == S_IFDIR;
        assert_eq!(f.mode, k.mode, "{shown}: mode");
        assert_eq!((f.uid, f.gid), (k.uid, k.gid), "{shown}: owner");
        assert_eq!(f.size, k.size, "{shown}: size");
        assert_eq!(f.mtime, k.mtime, "{shown}: mtime");
        assert_eq!(f.rdev, k.rdev, "{shown}: rdev");
        assert_eq!(f.link, k.link, "{shown}: symlink target");
        assert_eq!(f.xattrs, k.xattrs, "{shown}: xattrs");
        assert_eq!(f.nlink, k.nlink, "{shown}: nlink");
        if !dir && !path.is_empty() {
            k_groups.entry(k.ino).or_default().insert(path);
            f_groups.entry(f.ino).or_default().insert(path);
        }
    }
    let k: BTreeSet<_> = k_groups.into_values().collect();
    let f: BTreeSet<_> = f_groups.into_values().collect();
    assert_eq!(k, f, "entries sharing an inode differ");
}

fn statvfs(p: &Path) -> rustix::fs::StatVfs {
    rustix::fs::statvfs(p).unwrap()
}

/// The object in `store` holding the contents of `file`.
fn object_of(store: &Path, file: &Path) -> PathBuf {
    store.join(object_rel(&digest_hex(file)))
}

/// Drops the kernel's cached pages of a file in the mount (an open that
/// fails has nothing cached to drop).
fn drop_cached_pages(file: &Path) {
    if let Ok(f) = fs::File::open(file) {
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
    }
}

fn eio(r: std::io::Result<Vec<u8>>) -> bool {
    matches!(r, Err(ref e) if e.raw_os_error() == Some(libc::EIO))
}

// ---------------------------------------------------------------------------
// The view: root, and the kernel's for comparison
// ---------------------------------------------------------------------------

#[test]
fn fuse_mount_shows_the_source_and_what_the_kernel_shows() {
    require(cannot_test());
    let a = Area::new();
    let src = a.path("src");
    make_source_tree(&src, 11);
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    let mnt = a.dir("mnt");
    let m = fmount(&store, &image, &mnt, &[]);

    let want = scan(&src);
    let got = scan(&mnt);
    assert_same_view(&want, &got, version_of(&image), true, "FUSE (root)");
    let n = assert_same_contents(&src, &mnt, &want);
    assert!(n > 20, "only {n} regular files compared");

    // Inode numbers are unique and stable: a second look gives the same.
    let again = scan(&mnt);
    for (p, s) in &got {
        assert_eq!(
            again[p].ino,
            s.ino,
            "/{}: inode number changed",
            String::from_utf8_lossy(p)
        );
    }
    let mut inos: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    for (p, s) in &got {
        if let Some(other) = inos.insert(s.ino, p.clone()) {
            panic!(
                "/{} and /{} share inode {} (directory builds make no hardlinks)",
                String::from_utf8_lossy(&other),
                String::from_utf8_lossy(p),
                s.ino
            );
        }
    }
    assert!(!inos.contains_key(&0));

    // statfs: the image's size, nothing free, full-length names.
    let st = statvfs(&mnt);
    let image_blocks = fs::metadata(&image).unwrap().len().div_ceil(4096);
    assert_eq!(st.f_bsize, 4096);
    assert_eq!(st.f_blocks, image_blocks, "statfs blocks");
    assert_eq!(st.f_bfree, 0);
    assert_eq!(st.f_namemax, 255);
    assert!(st.f_files >= got.len() as u64 - 1);
    assert!(
        st.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY),
        "mounted read-only"
    );

    // Read-only; missing names are ENOENT (and stay so: negative entries).
    let err = fs::write(mnt.join("new-file"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    for _ in 0..2 {
        let err = fs::symlink_metadata(mnt.join("files/no-such-file")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    }
    let err = fs::read_dir(mnt.join("files/f1-1")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOTDIR));

    // The kernel mount of the same image shows the same, inode groups too.
    match cannot_mount("erofs").or_else(|| cannot_mount("overlay")) {
        Some(why) => eprintln!("not compared with a kernel mount: {why}"),
        None => {
            let kmnt = a.dir("kmnt");
            let out = tilefs_any(&[
                os("mount"),
                os("--kernel"),
                os("--verity"),
                os("off"),
                os("--store"),
                store.as_os_str(),
                image.as_os_str(),
                kmnt.as_os_str(),
            ]);
            if out.status.success() {
                let kview = scan(&kmnt);
                let _ = tilefs_any(&[os("umount"), kmnt.as_os_str()]);
                assert_identical_views(&kview, &got);
            } else {
                eprintln!("not compared with a kernel mount: {}", stderr(&out));
            }
        }
    }

    drop(m);
    assert!(!is_mounted(&mnt), "still mounted after tilefs umount");
}

/// Hardlinks kept by a dump build share one inode number and the image's
/// nlink; a file without a digest is served with --verity auto and refused
/// with --verity require.
#[test]
fn hardlinks_share_an_inode_and_require_refuses_files_without_digest() {
    require(cannot_test());
    let a = Area::new();
    let store = a.dir("store");
    let data = a.path("data");
    let contents: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    fs::write(&data, &contents).unwrap();
    let obj = object_of(&store, &data);
    fs::create_dir_all(obj.parent().unwrap()).unwrap();
    fs::copy(&data, &obj).unwrap();
    let rel = obj.strip_prefix(&store).unwrap().to_str().unwrap().to_string();
    let hex = rel.replace('/', "");
    let dump = format!(
        "/ 4096 40755 2 0 0 0 1600000000.0 - - -\n\
         /a 10000 100644 3 0 0 0 1600000000.123456789 {rel} - {hex}\n\
         /b 10000 @100644 3 0 0 0 1600000000.123456789 /a - -\n\
         /c 10000 @100644 3 0 0 0 1600000000.123456789 /a - -\n\
         /nodigest 10000 100600 1 0 0 0 1600000000.0 {rel} - -\n"
    );
    let dumpfile = a.path("tree.dump");
    fs::write(&dumpfile, dump).unwrap();
    let image = a.path("image.cfs");
    tilefs(&[os("build"), os("--from-dump"), dumpfile.as_os_str(), image.as_os_str()]);

    let mnt = a.dir("mnt");
    {
        let _m = fmount(&store, &image, &mnt, &[]);
        let ma = fs::symlink_metadata(mnt.join("a")).unwrap();
        for n in ["b", "c"] {
            let m = fs::symlink_metadata(mnt.join(n)).unwrap();
            assert_eq!(m.ino(), ma.ino(), "{n} is a hardlink of a");
        }
        assert_eq!(ma.nlink(), 3);
        assert_eq!(ma.mtime_nsec(), 123_456_789);
        for n in ["a", "b", "c", "nodigest"] {
            assert_eq!(fs::read(mnt.join(n)).unwrap(), contents, "{n}");
        }
    }
    assert!(!is_mounted(&mnt));
    let _m = fmount(&store, &image, &mnt, &["--verity", "require"]);
    assert_eq!(fs::read(mnt.join("a")).unwrap(), contents);
    assert!(
        eio(fs::read(mnt.join("nodigest"))),
        "require: a file without digest is refused"
    );
}

// ---------------------------------------------------------------------------
// Rootless
// ---------------------------------------------------------------------------

/// When run with TILEFS_FUSE_SCAN=DIR (by `mounted_without_root`, as an
/// unprivileged user), prints what that user sees of DIR: one line per
/// file with its metadata, xattrs and the SHA-256 of its contents when
/// readable. Otherwise does nothing. Not a test of its own, so ignored.
#[test]
#[ignore = "a helper: mounted_without_root runs it as the unprivileged user"]
fn scan_child() {
    let Some(dir) = std::env::var_os("TILEFS_FUSE_SCAN") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let mut paths = Vec::new();
    let mut stack = vec![dir.clone()];
    while let Some(d) = stack.pop() {
        paths.push(d.clone());
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if fs::symlink_metadata(&p).unwrap().is_dir() {
                stack.push(p);
            } else {
                paths.push(p);
            }
        }
    }
    let mut lines = Vec::new();
    for p in paths {
        let m = fs::symlink_metadata(&p).unwrap();
        let rel = p.strip_prefix(&dir).unwrap().as_os_str().as_bytes();
        let ft = m.mode() & S_IFMT;
        let mut line = format!(
            "SCAN {} {:o} {} {} {} {} {} {} {}",
            hex::encode(rel),
            m.mode(),
            m.uid(),
            m.gid(),
            if ft == S_IFDIR { 0 } else { m.size() },
            m.mtime(),
            m.mtime_nsec(),
            m.rdev(),
            if ft == S_IFDIR { 0 } else { m.nlink() },
        );
        if m.file_type().is_symlink() {
            line.push_str(&format!(
                " link={}",
                hex::encode(fs::read_link(&p).unwrap().as_os_str().as_bytes())
            ));
        }
        // Values of user.* xattrs need read permission: a refusal is shown
        // as such (and must be the same on both sides).
        let mut names = vec![0u8; 65536];
        let n = rustix::fs::llistxattr(&p, &mut names).unwrap_or(0);
        let mut names: Vec<&[u8]> = names[..n].split(|&c| c == 0).filter(|n| !n.is_empty()).collect();
        names.sort();
        for name in names {
            let mut value = vec![0u8; 65536];
            let shown = match rustix::fs::lgetxattr(&p, OsStr::from_bytes(name), &mut value) {
                Ok(len) => hex::encode(&value[..len]),
                Err(e) => format!("error{}", e.raw_os_error()),
            };
            line.push_str(&format!(" x:{}={shown}", hex::encode(name)));
        }
        if ft == S_IFREG && m.size() <= 64 << 20 {
            match fs::read(&p) {
                Ok(data) => line.push_str(&format!(" sha256={}", sha256_hex(&data))),
                Err(e) => line.push_str(&format!(" error={}", e.raw_os_error().unwrap_or(0))),
            }
        }
        lines.push(line);
    }
    lines.sort();
    for l in lines {
        println!("{l}");
    }
}

/// What the unprivileged user sees of `dir` (via `scan_child`).
fn scan_as_nobody(dir: &Path) -> Vec<String> {
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
            .env("TILEFS_FUSE_SCAN", dir)
            .stdin(Stdio::null()),
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "scan as nobody failed: {}", stderr(&out));
    let lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("SCAN ").map(str::to_string))
        .collect();
    assert!(!lines.is_empty(), "scan as nobody printed nothing: {}", stderr(&out));
    lines
}

#[test]
fn mounted_without_root() {
    require(cannot_test().or_else(|| missing_program("fusermount3", "Debian package fuse3")));
    let a = Area::new();
    let src = a.path("src");
    make_source_tree(&src, 23);
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    // A store root made is root's alone (0700): this one is shared on purpose.
    fs::set_permissions(&store, fs::Permissions::from_mode(0o755)).unwrap();
    let mnt = a.dir("mnt");
    give_to_nobody(&mnt);

    let mount_as_nobody = || {
        as_nobody(
            Command::new(tilefs_bin())
                .args([os("mount"), os("--fuse"), os("--store"), store.as_os_str()])
                .arg(&image)
                .arg(&mnt)
                .stdin(Stdio::null()),
        )
        .output()
        .unwrap()
    };
    // Without access to /dev/fuse the user is told what to ask for.
    {
        let _dev = DevFuseMode::set(0o600);
        let out = mount_as_nobody();
        assert!(!out.status.success(), "mounted without access to /dev/fuse");
        let err = stderr(&out);
        assert!(err.contains("/dev/fuse") && err.contains("mode 0666"), "{err}");
        assert!(!is_mounted(&mnt), "a refused mount left {} mounted", mnt.display());
    }

    // Mount as nobody: through fusermount3, no privilege at all.
    let _dev = DevFuseMode::set(0o666);
    let out = mount_as_nobody();
    let guard = FuseMounted {
        mount: Mounted(mnt.clone()),
        child: None,
    };
    assert!(
        out.status.success(),
        "rootless tilefs mount --fuse failed: {}",
        stderr(&out)
    );
    let line = mount_line(&mnt).expect("mounted");
    assert!(line.contains("fuse.tilefs"), "{line}");
    assert!(line.contains(&format!("user_id={NOBODY}")), "mounted by nobody: {line}");

    // The unprivileged user sees the same as it sees of the source
    // (whiteouts and their directories aside, as the kernel shows them).
    let want = scan_as_nobody(&src);
    let got = scan_as_nobody(&mnt);
    assert_eq!(want.len(), got.len(), "number of entries");
    let mut compared_contents = 0;
    for (w, g) in want.iter().zip(&got) {
        let wf: Vec<&str> = w.split(' ').collect();
        let gf: Vec<&str> = g.split(' ').collect();
        assert_eq!(wf[0], gf[0], "names");
        let path = String::from_utf8_lossy(&hex::decode(wf[0]).unwrap()).into_owned();
        if path.starts_with("dev") && (path == "dev" || path == "dev/whiteout") {
            continue; // checked as root in the other test
        }
        // A regular file's nlink is the source's (its hardlinks there, which
        // the image built without --hardlinks does not keep); the image's is
        // checked against the kernel's.
        let nlink_differs = wf[1].starts_with("100");
        for (i, (x, y)) in wf.iter().zip(&gf).enumerate() {
            // Field 8 is nlink.
            if i == 8 && nlink_differs {
                continue;
            }
            assert_eq!(x, y, "/{path}: field {i} differs:\n source {w}\n mount  {g}");
        }
        assert_eq!(wf.len(), gf.len(), "/{path}:\n source {w}\n mount  {g}");
        if w.contains("sha256=") {
            compared_contents += 1;
        }
    }
    assert!(compared_contents > 20, "only {compared_contents} files read");
    // trusted.* stays hidden from the unprivileged user.
    assert!(!got
        .iter()
        .any(|l| l.contains(&format!("x:{}", hex::encode("trusted.")))));

    // Unmount as that user.
    let out = as_nobody(Command::new(tilefs_bin()).arg("umount").arg(&mnt).stdin(Stdio::null()))
        .output()
        .unwrap();
    assert!(out.status.success(), "rootless tilefs umount failed: {}", stderr(&out));
    assert!(!is_mounted(&mnt));
    drop(guard);
}

// ---------------------------------------------------------------------------
// Verification
// ---------------------------------------------------------------------------

/// A tree with a few external files, built into a store.
fn small_store(a: &Area) -> (PathBuf, PathBuf, PathBuf) {
    let src = a.dir("src");
    for i in 0..6u32 {
        let data: Vec<u8> = (0..(5000 + i * 1000)).map(|j| (j * 7 + i) as u8).collect();
        fs::write(src.join(format!("file{i}")), data).unwrap();
    }
    fs::write(src.join("small"), b"inline").unwrap();
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    (src, store, image)
}

fn check_tampering(tuning: &str) {
    let a = Area::new();
    let (src, store, image) = small_store(&a);
    let mnt = a.dir("mnt");
    let mut m = fmount_foreground(&store, &image, &mnt, &[("TILEFS_FUSE_TUNING", tuning)]);

    // Every file reads back (and so is verified once).
    for i in 0..6 {
        let f = format!("file{i}");
        assert_eq!(fs::read(mnt.join(&f)).unwrap(), fs::read(src.join(&f)).unwrap(), "{f}");
    }
    // file1's object changes after it was verified; file2's disappears.
    let obj1 = object_of(&store, &src.join("file1"));
    let mut bad = fs::read(&obj1).unwrap();
    bad[100] ^= 0xff;
    fs::write(&obj1, &bad).unwrap();
    let obj2 = object_of(&store, &src.join("file2"));
    fs::remove_file(&obj2).unwrap();
    // Pages the kernel already holds were verified and may still be read;
    // once dropped, reads reach the server, which sees the change.
    for f in ["file1", "file2"] {
        drop_cached_pages(&mnt.join(f));
    }
    for _ in 0..2 {
        assert!(
            eio(fs::read(mnt.join("file1"))),
            "{tuning}: tampered object must give EIO"
        );
        assert!(
            eio(fs::read(mnt.join("file2"))),
            "{tuning}: missing object must give EIO"
        );
    }
    // Nothing else breaks.
    for f in ["file0", "file3", "file4", "file5", "small"] {
        assert_eq!(
            fs::read(mnt.join(f)).unwrap(),
            fs::read(src.join(f)).unwrap(),
            "{tuning}: {f}"
        );
    }
    assert!(fs::read_dir(&mnt).unwrap().count() == 7);
    // Put file1 right again: served again.
    fs::write(&obj1, fs::read(src.join("file1")).unwrap()).unwrap();
    drop_cached_pages(&mnt.join("file1"));
    assert_eq!(
        fs::read(mnt.join("file1")).unwrap(),
        fs::read(src.join("file1")).unwrap()
    );

    // SIGTERM: a clean unmount and exit; the log names both files.
    let mut child = m.child.take().unwrap();
    rustix::process::kill_process(rustix::process::Pid::from_child(&child), rustix::process::Signal::TERM).unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < end, "server did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut log = String::new();
    child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    assert!(status.success(), "server exit after SIGTERM: {status}; stderr: {log}");
    assert!(!is_mounted(&mnt), "still mounted after SIGTERM");
    assert!(log.contains("/file1") && log.contains("mismatch"), "log: {log}");
    assert!(log.contains("/file2"), "log: {log}");
    drop(m);
}

#[test]
fn tampered_or_missing_objects_give_eio_for_their_files_only() {
    require(cannot_test());
    // Passthrough (root's default), reads served by the server (opens kept
    // in the kernel), and served with every open asking the server.
    check_tampering("");
    check_tampering("no-passthrough");
    check_tampering("no-passthrough,open");
}

#[test]
fn no_passthrough_keeps_opens_in_the_kernel_and_still_verifies() {
    require(cannot_test());
    let a = Area::new();
    let (src, store, image) = small_store(&a);
    let mnt = a.dir("mnt");
    let _m = fmount(&store, &image, &mnt, &["--no-passthrough"]);
    for f in ["file0", "file1", "small"] {
        assert_eq!(fs::read(mnt.join(f)).unwrap(), fs::read(src.join(f)).unwrap(), "{f}");
    }
    let obj = object_of(&store, &src.join("file1"));
    let mut bad = fs::read(&obj).unwrap();
    bad[7] ^= 0x40;
    fs::write(&obj, &bad).unwrap();
    // The open never reaches the server, so it succeeds; the data does not.
    let f = fs::File::open(mnt.join("file1")).unwrap();
    rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
    let mut buf = Vec::new();
    let err = std::io::Read::read_to_end(&mut &f, &mut buf).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // A kernel mount has no such choice.
    let out = tilefs_any(&[
        os("mount"),
        os("--kernel"),
        os("--no-passthrough"),
        os("--store"),
        store.as_os_str(),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    assert!(
        !out.status.success() && stderr(&out).contains("--no-passthrough"),
        "{}",
        stderr(&out)
    );
}

/// Fills `buf` from `f` at `off` as far as the file goes; returns the bytes read.
fn pread_full(f: &fs::File, buf: &mut [u8], off: u64) -> usize {
    use std::os::unix::fs::FileExt;
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off + done as u64).unwrap() {
            0 => break,
            n => done += n,
        }
    }
    done
}

/// Reads served by the server give the source's bytes at any offset and
/// size, whether spliced from the object (the default over /dev/fuse) or
/// copied through the server's buffer (asked for, or through FUSE over
/// io_uring, whose replies are written into the ring's buffers): through
/// the page cache (dropped before each read), across the end, and with
/// O_DIRECT in 1 MiB requests (more than the splice pipe holds, so those
/// are copied). The server's read(2) count shows which way a whole-file
/// read went.
#[test]
fn served_reads_give_the_source_bytes_spliced_or_copied() {
    require(cannot_test());
    let uring = FuseUring::on();
    require(uring.as_ref().err().cloned());
    let a = Area::new();
    let src = a.dir("src");
    let data = Rng::new(5).bytes((3 << 20) + 12_345);
    fs::write(src.join("big"), &data).unwrap();
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    let len = data.len() as u64;
    let ways = [
        ("no-passthrough", "--no-uring"),
        ("no-passthrough,no-splice", "--no-uring"),
        ("no-passthrough,uring", "--threads=2"),
    ];
    for (tuning, transport) in ways {
        let mnt = a.dir(&format!("mnt-{tuning}"));
        let env = tuning.trim_end_matches(",uring");
        let m = fmount_foreground_with(&store, &image, &mnt, &[("TILEFS_FUSE_TUNING", env)], &[transport]);
        if tuning.ends_with("uring") {
            let pid = m.child.as_ref().unwrap().id();
            wait_until("an io_uring queue thread", 10, || {
                server_threads(pid).iter().any(|t| t.starts_with("fuse-q"))
            });
        }
        let f = fs::File::open(mnt.join("big")).unwrap();
        let mut rng = Rng::new(9);
        for _ in 0..300 {
            rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
            let off = rng.below(len + 100);
            let mut buf = vec![0u8; 1 + rng.below(300_000) as usize];
            let got = pread_full(&f, &mut buf, off);
            let want = &data[off.min(len) as usize..(off + buf.len() as u64).min(len) as usize];
            assert!(&buf[..got] == want, "{tuning}: {} bytes at {off} differ", buf.len());
        }
        // Which way the bytes went, from what the server read(2)s: spliced,
        // the object's bytes never pass through it (only the requests do).
        let pid = m.child.as_ref().unwrap().id();
        let read_by_server = || -> u64 {
            let io = fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
            io.lines()
                .find_map(|l| l.strip_prefix("rchar: "))
                .unwrap()
                .parse()
                .unwrap()
        };
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        let before = read_by_server();
        let mut all = Vec::new();
        (&f).read_to_end(&mut all).unwrap();
        assert!(all == data, "{tuning}: the whole file differs");
        let read = read_by_server() - before;
        if tuning.contains("no-splice") || tuning.ends_with("uring") {
            assert!(read >= len, "{tuning}: the server read only {read} bytes to copy {len}");
        } else {
            assert!(
                read < len / 8,
                "{tuning}: the server read {read} bytes of {len} spliced"
            );
        }
        let direct = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(mnt.join("big"))
            .unwrap();
        let mut got = Vec::new();
        let mut chunk = vec![0u8; 1 << 20];
        loop {
            let n = pread_full(&direct, &mut chunk, got.len() as u64);
            got.extend_from_slice(&chunk[..n]);
            if n < chunk.len() {
                break;
            }
        }
        assert!(got == data, "{tuning}: O_DIRECT read differs");
    }
}

/// The kernel's FUSE request tracepoint, under a tracefs mount.
const FUSE_TRACE: &str = "events/fuse/fuse_request_send";

/// Counts the requests of each opcode name that the FUSE connection of
/// `mnt` is sent while `f` runs, from the tracepoint of the tracefs
/// mounted at `tracing`.
fn fuse_requests(tracing: &Path, mnt: &Path, f: impl FnOnce()) -> BTreeMap<String, usize> {
    let dev = fs::metadata(mnt).unwrap().dev();
    // The tracepoint prints the kernel's dev_t: major << 20 | minor.
    let conn = format!(
        "connection {} ",
        (rustix::fs::major(dev) << 20) | rustix::fs::minor(dev)
    );
    let enable = tracing.join(FUSE_TRACE).join("enable");
    fs::write(tracing.join("trace"), "").unwrap();
    fs::write(&enable, "1").unwrap();
    f();
    fs::write(&enable, "0").unwrap();
    let mut counts = BTreeMap::new();
    for line in fs::read_to_string(tracing.join("trace")).unwrap().lines() {
        if let (true, Some(i)) = (line.contains(&conn), line.find("(FUSE_")) {
            let name = line[i + 1..].split(')').next().unwrap().to_string();
            *counts.entry(name).or_insert(0) += 1;
        }
    }
    counts
}

#[test]
fn opens_and_closes_ask_the_server_only_when_they_must() {
    require(cannot_test());
    let a = Area::new();
    // A tracefs of our own (the kernel shares one instance), undone after.
    let tracing = a.dir("tracing");
    let mounted = rustix::mount::mount("tracefs", &tracing, "tracefs", rustix::mount::MountFlags::empty(), None);
    require(mounted.err().map(|e| format!("cannot mount tracefs: {e}")));
    let _t = Mounted(tracing.clone());
    require((!tracing.join(FUSE_TRACE).exists()).then(|| format!("this kernel has no {FUSE_TRACE} tracepoint")));
    let (src, store, image) = small_store(&a);
    let open_close = |mnt: &Path| {
        for _ in 0..20 {
            for f in ["file0", "file1", "small"] {
                drop(fs::File::open(mnt.join(f)).unwrap());
            }
        }
    };
    // Served reads: after the first open is refused (ENOSYS) and the first
    // close's flush too, neither reaches the server again.
    let mnt = a.dir("served");
    let _m = fmount(&store, &image, &mnt, &["--no-passthrough"]);
    open_close(&mnt);
    let n = fuse_requests(&tracing, &mnt, || open_close(&mnt));
    for op in ["FUSE_OPEN", "FUSE_FLUSH", "FUSE_RELEASE"] {
        assert_eq!(n.get(op), None, "served: {op} sent: {n:?}");
    }
    assert_eq!(
        fs::read(mnt.join("file1")).unwrap(),
        fs::read(src.join("file1")).unwrap()
    );
    // Passthrough: every open asks (the kernel needs the backing file), no
    // close waits for a flush.
    let mnt = a.dir("passthrough");
    let _m = fmount(&store, &image, &mnt, &[]);
    open_close(&mnt);
    let n = fuse_requests(&tracing, &mnt, || open_close(&mnt));
    assert_eq!(n.get("FUSE_OPEN"), Some(&60), "passthrough: {n:?}");
    assert_eq!(n.get("FUSE_FLUSH"), None, "passthrough: {n:?}");
}

#[test]
fn verity_off_serves_changed_objects() {
    require(cannot_test());
    let a = Area::new();
    let (src, store, image) = small_store(&a);
    let obj = object_of(&store, &src.join("file3"));
    let mut bad = fs::read(&obj).unwrap();
    bad[0] ^= 1;
    fs::write(&obj, &bad).unwrap();
    let mnt = a.dir("mnt");
    {
        let _m = fmount(&store, &image, &mnt, &[]);
        assert!(eio(fs::read(mnt.join("file3"))));
    }
    let _m = fmount(&store, &image, &mnt, &["--verity", "off"]);
    assert_eq!(fs::read(mnt.join("file3")).unwrap(), bad);
}

// ---------------------------------------------------------------------------
// Lifecycle
// ---------------------------------------------------------------------------

#[test]
fn corrupt_image_is_refused_with_a_clear_message() {
    require(cannot_test());
    let a = Area::new();
    let (_src, store, image) = small_store(&a);
    let mnt = a.dir("mnt");
    let good = fs::read(&image).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", good[..good.len() / 2].to_vec()),
        ("not an image", b"hello, this is not an image at all".repeat(200)),
        ("bad superblock", {
            let mut b = good.clone();
            b[1024..1028].copy_from_slice(&[0, 0, 0, 0]);
            b
        }),
    ];
    for (what, bytes) in cases {
        let bad = a.path("bad.cfs");
        fs::write(&bad, &bytes).unwrap();
        let out = tilefs_any(&[
            os("mount"),
            os("--fuse"),
            os("--store"),
            store.as_os_str(),
            bad.as_os_str(),
            mnt.as_os_str(),
        ]);
        let _guard = FuseMounted {
            mount: Mounted(mnt.clone()),
            child: None,
        };
        assert!(!out.status.success(), "{what}: mounted a corrupt image");
        let err = stderr(&out);
        assert!(err.contains("bad.cfs"), "{what}: message names the image: {err}");
        assert!(
            err.contains("corrupt") || err.contains("not a composefs image") || err.contains("truncated"),
            "{what}: message says what is wrong: {err}"
        );
        assert!(!is_mounted(&mnt), "{what}: left a mount behind");
    }
}

/// The background server's pid, found by its command line.
fn server_pid(mnt: &Path) -> Option<i32> {
    let want = mnt.as_os_str().as_bytes();
    for e in fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmd.split(|&c| c == 0).collect();
        if args.iter().any(|a| a.ends_with(b"mount")) && args.iter().any(|a| a.ends_with(want)) {
            return Some(pid);
        }
    }
    None
}

#[test]
fn sigterm_unmounts_and_umount_clears_a_dead_server() {
    require(cannot_test());
    let a = Area::new();
    let (src, store, image) = small_store(&a);
    let mnt = a.dir("mnt");

    // Background server: SIGTERM unmounts and the server exits.
    let m = fmount(&store, &image, &mnt, &[]);
    let pid = server_pid(&mnt).expect("background server process");
    assert_eq!(
        fs::read(mnt.join("file0")).unwrap(),
        fs::read(src.join("file0")).unwrap()
    );
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    wait_until("unmount after SIGTERM", 20, || !is_mounted(&mnt));
    wait_until("the server's exit", 20, || {
        fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| s.contains(") Z "))
    });
    drop(m);

    // A crashed server (SIGKILL) leaves a dead mount; tilefs umount clears it.
    let m = fmount(&store, &image, &mnt, &[]);
    let pid = server_pid(&mnt).expect("background server process");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    wait_until("the server's death", 20, || {
        fs::symlink_metadata(mnt.join("file0")).is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN))
    });
    let out = tilefs_any(&[os("umount"), mnt.as_os_str()]);
    assert!(out.status.success(), "tilefs umount of a dead mount: {}", stderr(&out));
    assert!(!is_mounted(&mnt));
    assert!(
        fs::read_dir(&mnt).unwrap().next().is_none(),
        "the mountpoint is a plain empty directory again"
    );
    drop(m);

    // And the same place mounts again.
    let _m = fmount(&store, &image, &mnt, &[]);
    assert_eq!(
        fs::read(mnt.join("file5")).unwrap(),
        fs::read(src.join("file5")).unwrap()
    );
}

#[test]
fn the_background_server_keeps_none_of_the_callers_descriptors() {
    require(cannot_test());
    let a = Area::new();
    let (src, store, image) = small_store(&a);
    let mnt = a.dir("mnt");
    // As in `out=$(tilefs mount ... 3>&1)` or a pipeline: the shell hands
    // tilefs a pipe as descriptor 3. The server outliving the command must
    // not hold it, or whoever reads the pipe waits for the server's end.
    let mut sh = Command::new("sh")
        .arg("-c")
        .arg(r#"exec 3>&1; exec "$1" mount --fuse --store "$2" "$3" "$4" >/dev/null"#)
        .args([
            "sh".as_ref(),
            tilefs_bin().as_os_str(),
            store.as_os_str(),
            image.as_os_str(),
        ])
        .arg(&mnt)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Not read to its end: that would hang on the bug this test is about.
    let status = sh.wait().unwrap();
    let _m = FuseMounted {
        mount: Mounted(mnt.clone()),
        child: None,
    };
    assert!(status.success(), "tilefs mount --fuse failed");
    let pid = server_pid(&mnt).expect("background server process");
    let fds: Vec<String> = fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| fs::read_link(e.path()).ok())
        .map(|l| l.display().to_string())
        .collect();
    assert!(
        !fds.iter().any(|l| l.starts_with("pipe:")),
        "the server holds a pipe: {fds:?}"
    );
    // And it closed nothing of its own.
    assert_eq!(
        fs::read(mnt.join("file3")).unwrap(),
        fs::read(src.join("file3")).unwrap()
    );
}

// ---------------------------------------------------------------------------
// Robustness
// ---------------------------------------------------------------------------

/// Walks and reads everything under `dir` once; returns (entries, bytes) or
/// the first error.
fn walk_and_read(dir: &Path, buf: &mut [u8]) -> Result<(u64, u64), String> {
    let mut entries = 0;
    let mut bytes = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))? {
            let e = e.map_err(|e| format!("{}: {e}", d.display()))?;
            let p = e.path();
            let m = fs::symlink_metadata(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            entries += 1;
            xattrs(&p);
            let ft = m.file_type();
            if ft.is_dir() {
                stack.push(p);
            } else if ft.is_symlink() {
                fs::read_link(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            } else if ft.is_file() {
                let mut f = fs::File::open(&p).map_err(|e| format!("{}: {e}", p.display()))?;
                // Big (sparse) files: the first 4 MiB.
                let mut left = m.len().min(4 << 20);
                let cap = buf.len() as u64;
                while left > 0 {
                    let n = f
                        .read(&mut buf[..left.min(cap) as usize])
                        .map_err(|e| format!("{}: {e}", p.display()))?;
                    if n == 0 {
                        return Err(format!("{}: short read", p.display()));
                    }
                    left -= n as u64;
                    bytes += n as u64;
                }
            }
        }
    }
    Ok((entries, bytes))
}

#[test]
fn parallel_readers_see_no_error() {
    require(cannot_test());
    let secs: u64 = std::env::var("TILEFS_FUSE_STRESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let a = Area::new();
    let src = a.path("src");
    make_source_tree(&src, 31);
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    for tuning in ["", "no-passthrough"] {
        let mnt = a.dir("mnt");
        let m = fmount_foreground(&store, &image, &mnt, &[("TILEFS_FUSE_TUNING", tuning)]);
        let end = Instant::now() + Duration::from_secs(secs / 2);
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let mnt = mnt.clone();
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 256 << 10];
                    let mut rounds = 0u64;
                    while Instant::now() < end || rounds == 0 {
                        walk_and_read(&mnt, &mut buf)?;
                        rounds += 1;
                    }
                    Ok::<u64, String>(rounds)
                })
            })
            .collect();
        // A hang shows as a reader that never comes back.
        let deadline = end + Duration::from_secs(120);
        for t in threads {
            while !t.is_finished() {
                assert!(Instant::now() < deadline, "{tuning}: a reader hangs");
                std::thread::sleep(Duration::from_millis(50));
            }
            let rounds = t
                .join()
                .unwrap()
                .unwrap_or_else(|e| panic!("{tuning}: reader failed: {e}"));
            assert!(rounds > 0);
        }
        // Still serving, and still right.
        assert_eq!(
            fs::read(mnt.join("files/f7-4097")).unwrap(),
            fs::read(src.join("files/f7-4097")).unwrap()
        );
        drop(m);
    }
}
