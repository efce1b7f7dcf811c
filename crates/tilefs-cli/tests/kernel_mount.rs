//! Kernel mounts (`tilefs mount --kernel`, `mount.tilefs`): EROFS +
//! overlayfs with the store as a data-only layer. The mounted tree must
//! equal its source in names, types, modes, owners, sizes, ns mtimes,
//! device numbers, symlink targets, xattrs and contents; images and stores
//! must be interchangeable with the reference composefs tools; refusals
//! must be clear and leave nothing mounted.
//!
//! Needs root and a kernel with EROFS and overlayfs; fails (saying what
//! is missing) otherwise. The vectors are in `$TILEFS_ASSETS` (default
//! ../shared/composefs-assets beside the checkout). The interoperability
//! tests use the reference binaries in `$TILEFS_REF_BIN` (default
//! /work/ref/bin): they are ignored, run with `--ignored` where those are.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// Why kernel mounts cannot be tested here, if they cannot.
fn no_kernel_mounts() -> Option<String> {
    cannot_mount("erofs").or_else(|| cannot_mount("overlay"))
}

/// A reference composefs tool: the tests that use one are ignored, so one
/// that is asked for (`--ignored`) must be there.
fn ref_bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("TILEFS_REF_BIN").map_or_else(|| PathBuf::from("/work/ref/bin"), PathBuf::from);
    let bin = dir.join(name);
    require((!bin.is_file()).then(|| format!("reference {} not found (set TILEFS_REF_BIN)", bin.display())));
    bin
}

/// `tilefs mount --kernel --store STORE [extra] IMAGE MNT`, which must succeed.
fn kmount(store: &Path, image: &Path, mnt: &Path, extra: &[&str]) -> Mounted {
    let mut args: Vec<&OsStr> = vec![os("mount"), os("--kernel"), os("--store"), store.as_os_str()];
    args.extend(extra.iter().map(|s| os(s)));
    args.push(image.as_os_str());
    args.push(mnt.as_os_str());
    let out = tilefs_any(&args);
    assert!(out.status.success(), "tilefs {args:?} failed: {}", stderr(&out));
    assert!(is_mounted(mnt), "{} not mounted after tilefs mount", mnt.display());
    Mounted(mnt.to_path_buf())
}

/// `tilefs mount --kernel ...`, which must fail: its stderr.
fn kmount_fails(args: &[&OsStr]) -> String {
    let mut all: Vec<&OsStr> = vec![os("mount"), os("--kernel")];
    all.extend_from_slice(args);
    let out = tilefs_any(&all);
    assert!(!out.status.success(), "tilefs {all:?} succeeded but should have failed");
    assert_eq!(out.status.code(), Some(1), "exit status");
    let err = stderr(&out);
    assert!(!err.trim().is_empty(), "no message");
    err
}

/// Mount table lines that involve `dir` (mounted under it, or from it).
fn mounts_involving(dir: &Path) -> Vec<String> {
    let d = dir.to_string_lossy().replace(' ', "\\040");
    mountinfo_lines().into_iter().filter(|l| l.contains(&d)).collect()
}

/// Loop devices backed by `file`.
fn loops_backed_by(file: &Path) -> Vec<String> {
    let file = fs::canonicalize(file).unwrap();
    let mut out = Vec::new();
    for e in fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(b) = fs::read_to_string(e.path().join("loop/backing_file")) {
            if Path::new(b.trim()) == file {
                out.push(name);
            }
        }
    }
    out
}

/// The whole check: metadata and contents.
fn assert_mounted_like(src: &Path, image: &Path, mnt: &Path, what: &str) {
    let want = scan(src);
    let got = scan(mnt);
    assert_same_view(&want, &got, version_of(image), true, what);
    let n = assert_same_contents(src, mnt, &want);
    assert!(n > 0, "{what}: no regular files compared");
}

// ---------------------------------------------------------------------------
// Correctness
// ---------------------------------------------------------------------------

#[test]
fn generated_tree_mounts_like_its_source() {
    require(no_kernel_mounts());
    let a = Area::new();
    let src = a.path("src");
    make_source_tree(&src, 4);
    let store = a.path("store");
    let image = a.path("image.cfs");
    // The 5 GiB sparse file stays sparse in the store (its holes are not
    // written).
    build_with_store(&src, &store, &image, &[]);
    let mnt = a.dir("mnt");
    let m = kmount(&store, &image, &mnt, &["--verity", "off"]);
    assert_mounted_like(&src, &image, &mnt, "generated tree");
    // Read-only, and attached once: one overlay, no EROFS mount anywhere.
    let err = fs::write(mnt.join("new-file"), b"x").unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(libc::EROFS),
        "writing to a read-only mount: {err}"
    );
    let lines = mounts_involving(a.tmp.path());
    assert_eq!(lines.len(), 1, "expected exactly the overlay: {lines:#?}");
    assert!(lines[0].contains(" - overlay tilefs:"), "{}", lines[0]);
    assert!(!mountinfo_lines()
        .iter()
        .any(|l| l.contains(" - erofs ") && l.contains(image.to_str().unwrap())));
    drop(m);
    assert!(mounts_involving(a.tmp.path()).is_empty(), "left mounted after umount");
}

#[test]
fn copied_objects_and_loop_backing_mount_alike() {
    require(no_kernel_mounts());
    let a = Area::new();
    let src = a.path("src");
    make_source_tree(&src, 21);
    fs::remove_file(src.join("files/sparse-5g")).unwrap();
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    for backing in ["file", "loop"] {
        let mnt = a.dir(&format!("mnt-{backing}"));
        let out = Command::new(tilefs_bin())
            .env("TILEFS_EROFS_BACKING", backing)
            .args([os("mount"), os("--kernel"), os("--verity"), os("off"), os("--store")])
            .args([store.as_os_str(), image.as_os_str(), mnt.as_os_str()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{backing}: {}", stderr(&out));
        let m = Mounted(mnt.clone());
        if backing == "loop" {
            assert_eq!(loops_backed_by(&image).len(), 1, "one loop device while mounted");
        } else {
            assert!(
                loops_backed_by(&image).is_empty(),
                "no loop device for a file-backed mount"
            );
        }
        assert_mounted_like(&src, &image, &mnt, backing);
        drop(m);
    }
    // The loop device cleared itself with the mount.
    for _ in 0..50 {
        if loops_backed_by(&image).is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(loops_backed_by(&image).is_empty(), "loop device left behind");
    assert!(mounts_involving(a.tmp.path()).is_empty());
}

#[test]
fn real_tree_mounts_like_its_source() {
    require(no_kernel_mounts());
    let tree = std::env::var_os("TILEFS_REAL_TREE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/include"));
    require((!tree.is_dir()).then(|| format!("{} is not a directory (set TILEFS_REAL_TREE)", tree.display())));
    let a = Area::new();
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&tree, &store, &image, &[]);
    let mnt = a.dir("mnt");
    let _m = kmount(&store, &image, &mnt, &[]);
    assert_mounted_like(&tree, &image, &mnt, &tree.display().to_string());
}

#[test]
fn image_given_by_tag_and_correct_digest_mount() {
    require(no_kernel_mounts());
    let a = Area::new();
    let src = a.dir("src");
    fs::write(
        src.join("hello"),
        b"hello, a file large enough to live in the store as an object\n",
    )
    .unwrap();
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &["--tag", "demo:1"]);
    let digest = digest_hex(&image);
    let mnt = a.dir("mnt");
    let m = kmount(&store, Path::new("demo:1"), &mnt, &["--digest", &digest]);
    assert_eq!(
        fs::read(mnt.join("hello")).unwrap(),
        fs::read(src.join("hello")).unwrap()
    );
    drop(m);
}

// ---------------------------------------------------------------------------
// Writable mounts
// ---------------------------------------------------------------------------

#[test]
fn upper_and_work_make_it_writable() {
    require(no_kernel_mounts());
    let a = Area::new();
    let src = a.dir("src");
    let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    fs::write(src.join("big"), &big).unwrap();
    fs::write(src.join("small"), b"tiny").unwrap();
    fs::create_dir(src.join("dir")).unwrap();
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    // The objects, not the store's bookkeeping (a mount records itself in
    // STORE/.mounts while it lives).
    let objects = |s: &Path| {
        scan(s)
            .into_iter()
            .filter(|(k, _)| !k.is_empty() && !k.starts_with(b"."))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let objects_before = objects(&store);
    let upper = a.dir("upper");
    let work = a.dir("work");
    let mnt = a.dir("mnt");
    let m = kmount(
        &store,
        &image,
        &mnt,
        &["--upper", upper.to_str().unwrap(), "--work", work.to_str().unwrap()],
    );
    fs::write(mnt.join("dir/new"), b"written through the mount").unwrap();
    let mut f = fs::OpenOptions::new().append(true).open(mnt.join("big")).unwrap();
    std::io::Write::write_all(&mut f, b"appended").unwrap();
    drop(f);
    fs::remove_file(mnt.join("small")).unwrap();
    // Changes land in the upper directory ...
    assert_eq!(fs::read(upper.join("dir/new")).unwrap(), b"written through the mount");
    let mut want = big.clone();
    want.extend_from_slice(b"appended");
    assert_eq!(fs::read(upper.join("big")).unwrap(), want);
    assert_eq!(fs::read(mnt.join("big")).unwrap(), want);
    let wh = fs::symlink_metadata(upper.join("small")).unwrap();
    assert!(
        std::os::unix::fs::FileTypeExt::is_char_device(&wh.file_type()),
        "a deletion is a whiteout in upper"
    );
    assert!(!mnt.join("small").exists());
    drop(m);
    // ... never in the store or the image.
    assert_eq!(objects(&store), objects_before, "the store's objects changed");
    let m = kmount(&store, &image, &a.dir("mnt2"), &[]);
    assert_eq!(fs::read(a.path("mnt2/big")).unwrap(), big);
    assert_eq!(fs::read(a.path("mnt2/small")).unwrap(), b"tiny");
    drop(m);
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

#[test]
fn missing_object_fails_that_file_only_and_fsck_names_it() {
    require(no_kernel_mounts());
    let a = Area::new();
    let src = a.dir("src");
    fs::write(src.join("victim"), vec![7u8; 10_000]).unwrap();
    fs::write(src.join("survivor"), vec![9u8; 20_000]).unwrap();
    fs::write(src.join("inline"), b"small").unwrap();
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &["--tag", "victim-image"]);
    let object = object_rel(&digest_hex(&src.join("victim")));
    fs::remove_file(store.join(&object)).unwrap();

    let mnt = a.dir("mnt");
    let m = kmount(&store, &image, &mnt, &[]);
    // The file is listed and stats as before ...
    let st = fs::symlink_metadata(mnt.join("victim")).unwrap();
    assert_eq!(st.len(), 10_000);
    // ... but cannot be read. overlayfs fails the open of a file whose
    // data-only object is missing ("lazy lowerdata lookup failed"): this
    // kernel says ENOENT (EIO on others); either way only that file.
    let err = fs::read(mnt.join("victim")).unwrap_err();
    let errno = err.raw_os_error();
    assert!(
        errno == Some(libc::EIO) || errno == Some(libc::ENOENT),
        "reading a file whose object is missing: {err}"
    );
    eprintln!("missing object: reading the file fails with {err}");
    assert_eq!(fs::read(mnt.join("survivor")).unwrap(), vec![9u8; 20_000]);
    assert_eq!(fs::read(mnt.join("inline")).unwrap(), b"small");
    drop(m);

    // fsck names the missing object.
    let out = tilefs_any(&[os("fsck"), os("--quiet"), os("--store"), store.as_os_str()]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert!(
        !out.status.success(),
        "fsck passed a store with a missing object:\n{text}"
    );
    assert!(text.contains(&object), "fsck does not name {object}:\n{text}");
}

#[test]
fn refusals_are_clear_and_leave_nothing_mounted() {
    require(no_kernel_mounts());
    let a = Area::new();
    let src = a.dir("src");
    fs::write(src.join("file"), vec![1u8; 5000]).unwrap();
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    let mnt = a.dir("mnt");
    let before = mounts_involving(a.tmp.path());
    assert!(before.is_empty());
    let s = store.as_os_str();
    let check_clean = |what: &str| {
        assert_eq!(
            mounts_involving(a.tmp.path()),
            before,
            "{what}: something was left mounted"
        );
        assert!(loops_backed_by(&image).is_empty(), "{what}: loop device left");
    };

    // A wrong digest.
    let err = kmount_fails(&[
        os("--store"),
        s,
        os("--digest"),
        os(&"ab".repeat(32)),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    assert!(err.contains("digest") && err.contains(&"ab".repeat(32)), "{err}");
    check_clean("wrong digest");
    let err = kmount_fails(&[
        os("--store"),
        s,
        os("--digest"),
        os("12345"),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    assert!(err.contains("64 hex digits"), "{err}");

    // A missing kernel feature: verification required where the kernel
    // (or the store's filesystem) cannot do it.
    let out = tilefs_any(&[
        os("mount"),
        os("--kernel"),
        os("--store"),
        s,
        os("--verity"),
        os("require"),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    if out.status.success() {
        // A kernel and store that can verify everything: fine.
        let _m = Mounted(mnt.clone());
    } else {
        let err = stderr(&out);
        assert!(err.contains("--verity require") && err.contains("verity"), "{err}");
        let kernel_lacks = fs::read_to_string("/sys/fs/ext4/features/verity").is_err();
        if kernel_lacks {
            eprintln!("verity=require refused: {err}");
        }
        check_clean("verity require");
    }

    // Not an image: refused before any mount call.
    let bogus = a.path("not-an-image");
    fs::write(&bogus, vec![0x42u8; 8192]).unwrap();
    let err = kmount_fails(&[os("--store"), s, bogus.as_os_str(), mnt.as_os_str()]);
    assert!(
        err.contains("not a composefs image") || err.contains("corrupt"),
        "{err}"
    );
    assert!(err.contains("not-an-image"), "names the file: {err}");
    let truncated = a.path("truncated");
    fs::write(&truncated, &fs::read(&image).unwrap()[..1500]).unwrap();
    let err = kmount_fails(&[os("--store"), s, truncated.as_os_str(), mnt.as_os_str()]);
    assert!(err.contains("truncated"), "{err}");
    let err = kmount_fails(&[os("--store"), s, src.as_os_str(), mnt.as_os_str()]);
    assert!(!err.is_empty());
    let err = kmount_fails(&[os("--store"), s, a.path("no-such-image").as_os_str(), mnt.as_os_str()]);
    assert!(err.contains("no-such-image"), "{err}");
    check_clean("not an image");

    // A missing mount point, a file as mount point, a missing store.
    let err = kmount_fails(&[os("--store"), s, image.as_os_str(), a.path("nowhere").as_os_str()]);
    assert!(err.contains("nowhere") && err.contains("does not exist"), "{err}");
    let err = kmount_fails(&[os("--store"), s, image.as_os_str(), bogus.as_os_str()]);
    assert!(err.contains("not a directory"), "{err}");
    let err = kmount_fails(&[
        os("--store"),
        a.path("no-store").as_os_str(),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    assert!(err.contains("no-store"), "{err}");
    // Upper without a usable work directory: the kernel's own reason.
    let upper = a.dir("upper");
    let err = kmount_fails(&[
        os("--store"),
        s,
        os("--upper"),
        upper.as_os_str(),
        os("--work"),
        a.path("no-work").as_os_str(),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    assert!(err.contains("no-work") && err.contains("does not exist"), "{err}");
    check_clean("bad paths");

    // A busy mount point: refused, the first mount untouched.
    let m = kmount(&store, &image, &mnt, &[]);
    let err = kmount_fails(&[os("--store"), s, image.as_os_str(), mnt.as_os_str()]);
    assert!(err.contains("already a mount point"), "{err}");
    assert_eq!(mounts_involving(a.tmp.path()).len(), 1, "exactly one mount");
    assert_eq!(fs::read(mnt.join("file")).unwrap(), vec![1u8; 5000]);
    drop(m);
    check_clean("busy");

    // umount of what is not a tilefs mount.
    let out = tilefs_any(&[os("umount"), mnt.as_os_str()]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("not a mount point"), "{}", stderr(&out));
    let out = tilefs_any(&[os("umount"), os("/")]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("not a tilefs mount"), "{}", stderr(&out));
}

#[test]
fn busy_mount_needs_lazy_umount() {
    require(no_kernel_mounts());
    let a = Area::new();
    let src = a.dir("src");
    fs::write(src.join("file"), vec![3u8; 5000]).unwrap();
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    let mnt = a.dir("mnt");
    let m = kmount(&store, &image, &mnt, &[]);
    let open = fs::File::open(mnt.join("file")).unwrap();
    let out = tilefs_any(&[os("umount"), mnt.as_os_str()]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("busy"), "{}", stderr(&out));
    tilefs(&[os("umount"), os("--lazy"), mnt.as_os_str()]);
    assert!(!is_mounted(&mnt));
    drop(open);
    std::mem::forget(m);
}

// ---------------------------------------------------------------------------
// mount(8): mount -t tilefs and fstab
// ---------------------------------------------------------------------------

/// /sbin/mount.tilefs for the duration of a test; a file already there is
/// put back afterwards.
struct InstalledHelper {
    path: PathBuf,
    saved: Option<PathBuf>,
}

impl InstalledHelper {
    fn install() -> Result<InstalledHelper, String> {
        let path = PathBuf::from("/sbin/mount.tilefs");
        let saved = if path.exists() {
            let s = PathBuf::from(format!("/sbin/.mount.tilefs.saved-{}", std::process::id()));
            fs::rename(&path, &s).map_err(|e| format!("cannot move the existing {}: {e}", path.display()))?;
            Some(s)
        } else {
            None
        };
        let guard = InstalledHelper { path, saved };
        // The tilefs binary itself: called by that name, it is the helper.
        fs::copy(tilefs_bin(), &guard.path).map_err(|e| format!("/sbin is not writable: {e}"))?;
        Ok(guard)
    }
}

impl Drop for InstalledHelper {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
        if let Some(s) = &self.saved {
            let _ = fs::rename(s, &self.path);
        }
    }
}

#[test]
fn mount_t_tilefs_and_fstab_work() {
    require(no_kernel_mounts().or_else(|| missing_program("mount", "Debian package mount")));
    let a = Area::new();
    let src = a.path("src");
    make_source_tree(&src, 9);
    fs::remove_file(src.join("files/sparse-5g")).unwrap();
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &["--tag", "fstab-test"]);
    let helper = InstalledHelper::install();
    require(helper.as_ref().err().cloned());
    let mnt = a.dir("mnt");
    let umount8 = |mnt: &Path| {
        let st = Command::new("umount").arg(mnt).status().unwrap();
        assert!(st.success(), "umount(8) {}", mnt.display());
    };

    // mount -t tilefs -o store=STORE IMAGE MNT, then umount(8).
    let out = Command::new("mount")
        .args(["-t", "tilefs", "-o"])
        .arg(format!("store={},nosuid,nodev", store.display()))
        .arg(&image)
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(out.status.success(), "mount -t tilefs: {}", stderr(&out));
    let guard = Mounted(mnt.clone());
    let line = mounts_involving(&mnt).pop().unwrap();
    assert!(
        line.contains("nosuid") && line.contains("nodev") && line.contains(" - overlay tilefs:"),
        "{line}"
    );
    assert_mounted_like(&src, &image, &mnt, "mount -t tilefs");
    umount8(&mnt);
    std::mem::forget(guard);
    assert!(mounts_involving(a.tmp.path()).is_empty());

    // An fstab line (mount -T reads another fstab file), the image by tag.
    let fstab = a.path("fstab");
    fs::write(
        &fstab,
        format!(
            "# tilefs test\nfstab-test {} tilefs store={},ro,noauto,nofail,x-test.option=1 0 0\n",
            mnt.display(),
            store.display()
        ),
    )
    .unwrap();
    let out = Command::new("mount").arg("-T").arg(&fstab).arg(&mnt).output().unwrap();
    assert!(out.status.success(), "mount from fstab: {}", stderr(&out));
    let guard = Mounted(mnt.clone());
    assert_mounted_like(&src, &image, &mnt, "fstab");
    umount8(&mnt);
    std::mem::forget(guard);

    // A refusal through mount(8): its status and our message.
    let out = Command::new("mount")
        .args(["-t", "tilefs", "-o"])
        .arg(format!("store={},digest={}", store.display(), "0".repeat(64)))
        .arg(&image)
        .arg(&mnt)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(32), "mount(8) status for a failed mount");
    assert!(stderr(&out).contains("digest"), "{}", stderr(&out));
    let out = Command::new("mount")
        .args(["-t", "tilefs"])
        .arg(&image)
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("store="), "{}", stderr(&out));
    assert!(mounts_involving(a.tmp.path()).is_empty());
    drop(helper);
}

// ---------------------------------------------------------------------------
// Interoperability with the reference composefs
// ---------------------------------------------------------------------------

#[test]
#[ignore = "needs the reference composefs tools in $TILEFS_REF_BIN (default /work/ref/bin)"]
fn reference_image_and_store_mount_with_tilefs() {
    require(no_kernel_mounts());
    let mkcomposefs = ref_bin("mkcomposefs");
    let a = Area::new();
    let src = a.path("src");
    make_source_tree(&src, 13);
    fs::remove_file(src.join("files/sparse-5g")).unwrap();
    let store = a.path("store");
    let image = a.path("ref.cfs");
    let st = Command::new(&mkcomposefs)
        .arg(format!("--digest-store={}", store.display()))
        .arg(&src)
        .arg(&image)
        .status()
        .unwrap();
    assert!(st.success(), "mkcomposefs failed");
    let mnt = a.dir("mnt");
    let _m = kmount(&store, &image, &mnt, &[]);
    assert_mounted_like(&src, &image, &mnt, "mkcomposefs image, tilefs mount");
}

#[test]
#[ignore = "needs the reference composefs tools in $TILEFS_REF_BIN (default /work/ref/bin)"]
fn mount_composefs_mounts_tilefs_image_and_store() {
    require(no_kernel_mounts());
    let mount_composefs = ref_bin("mount.composefs");
    let a = Area::new();
    let src = a.path("src");
    make_source_tree(&src, 17);
    fs::remove_file(src.join("files/sparse-5g")).unwrap();
    let store = a.path("store");
    let image = a.path("tilefs.cfs");
    build_with_store(&src, &store, &image, &[]);
    let mnt = a.dir("mnt");
    let st = Command::new(&mount_composefs)
        .arg("-o")
        .arg(format!("basedir={}", store.display()))
        .arg(&image)
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(st.success(), "mount.composefs failed");
    let _m = Mounted(mnt.clone());
    assert_mounted_like(&src, &image, &mnt, "tilefs image, mount.composefs");
}

/// The kernel lists `user.*` xattrs of symlinks and special files but
/// will not read them (ENODATA): their value is shown as this.
const UNREADABLE: &[u8] = b"<unreadable: ENODATA>";

/// [`scan`] for trees where some xattrs cannot be read.
fn scan_lenient(root: &Path) -> BTreeMap<Vec<u8>, Seen> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        if m.is_dir() {
            for e in fs::read_dir(&p).unwrap() {
                stack.push(e.unwrap().path());
            }
        }
        let mut xattrs = BTreeMap::new();
        let mut names = vec![0u8; 65536];
        let n = rustix::fs::llistxattr(&p, &mut names).unwrap_or(0);
        for name in names[..n].split(|&c| c == 0).filter(|n| !n.is_empty()) {
            let mut value = vec![0u8; 65536];
            let v = match rustix::fs::lgetxattr(&p, OsStr::from_bytes(name), &mut value) {
                Ok(len) => value[..len].to_vec(),
                Err(rustix::io::Errno::NODATA) => UNREADABLE.to_vec(),
                Err(e) => panic!("{}: xattr {}: {e}", p.display(), String::from_utf8_lossy(name)),
            };
            xattrs.insert(OsStr::from_bytes(name).to_os_string(), v);
        }
        let seen = seen(&p, &m, xattrs);
        out.insert(p.strip_prefix(root).unwrap().as_os_str().as_bytes().to_vec(), seen);
    }
    out
}

/// A dump's tree as the mount should show it: (relative path, Seen).
fn expected_from_dump(tree: &tilefs_image::Tree) -> BTreeMap<Vec<u8>, Seen> {
    let mut out = BTreeMap::new();
    tree.walk(|path, _entry, id| {
        let ino = tree.inode(id);
        let rel = path.strip_prefix(b"/").unwrap_or(path).to_vec();
        // An image inode holds 16 bits of mode (a lenient dump may give more).
        let mode = ino.mode & 0o177777;
        let ft = mode & S_IFMT;
        let rdev = if matches!(ft, S_IFCHR | S_IFBLK) {
            let major = (ino.rdev >> 8) & 0xfff;
            let minor = (ino.rdev & 0xff) | ((ino.rdev >> 12) & 0xfff00);
            rustix::fs::makedev(major, minor)
        } else {
            0
        };
        let seen = Seen {
            mode,
            uid: ino.uid,
            gid: ino.gid,
            size: (ft != 0o040000).then_some(ino.size),
            mtime: (ino.mtime.sec, i64::from(ino.mtime.nsec)),
            rdev,
            link: (ft == 0o120000)
                .then(|| OsStr::from_bytes(ino.payload.as_deref().unwrap_or_default()).to_os_string()),
            xattrs: ino
                .xattrs
                .iter()
                .map(|x| {
                    let readable = matches!(ft, S_IFREG | 0o040000) || !x.key.starts_with(b"user.");
                    let v = if readable { x.value.clone() } else { UNREADABLE.to_vec() };
                    (OsStr::from_bytes(&x.key).to_os_string(), v)
                })
                .collect(),
            nlink: None,
            ino: 0,
        };
        out.insert(rel, seen);
    });
    out
}

/// Regular files with data but no object path in the image.
fn files_without_object(tree: &tilefs_image::Tree) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    tree.walk(|path, _, id| {
        let ino = tree.inode(id);
        if ino.is_external() && ino.payload.is_none() {
            out.push(path.strip_prefix(b"/").unwrap_or(path).to_vec());
        }
    });
    out
}

fn assert_unreachable(mnt: &Path, paths: &[Vec<u8>], what: &str) {
    for p in paths {
        let err = fs::symlink_metadata(mnt.join(OsStr::from_bytes(p))).unwrap_err();
        assert_eq!(
            err.raw_os_error(),
            Some(libc::EIO),
            "{what}: /{}",
            String::from_utf8_lossy(p)
        );
    }
}

/// Inode numbers belong to the mount; everything else must agree.
fn without_inos(m: &BTreeMap<Vec<u8>, Seen>) -> BTreeMap<Vec<u8>, Seen> {
    m.iter()
        .map(|(k, v)| (k.clone(), Seen { ino: 0, ..v.clone() }))
        .collect()
}

fn read_vector(path: &Path) -> Vec<u8> {
    let mut raw = fs::read(path).unwrap();
    // A git symlink checked out as a file holds the name of its target.
    let target = path.with_file_name(OsStr::from_bytes(raw.trim_ascii()));
    if raw.len() < 256 && !raw.contains(&b' ') && !raw.starts_with(b"/") && target.is_file() {
        raw = fs::read(target).unwrap();
    }
    if path.extension() == Some(OsStr::new("gz")) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..]).read_to_end(&mut out).unwrap();
        out
    } else {
        raw
    }
}

/// Each composefs vector, built by tilefs, mounts showing exactly the dump
/// (metadata: the vectors have no object contents).
#[test]
fn vectors_mount_as_their_dumps_say() {
    require(no_kernel_mounts());
    vectors_mount(None, None);
}

/// Each composefs vector as above; tilefs mounts the reference's image and
/// mount.composefs mounts tilefs's, and all show the same.
#[test]
#[ignore = "needs the reference composefs tools in $TILEFS_REF_BIN (default /work/ref/bin)"]
fn vectors_mount_the_same_with_the_reference_tools() {
    require(no_kernel_mounts());
    vectors_mount(Some(ref_bin("mkcomposefs")), Some(ref_bin("mount.composefs")));
}

/// Mounts each vector built by tilefs, and with `mkcomposefs`, the
/// reference's build of it; with `mount_composefs`, tilefs's build mounted
/// by the reference.
fn vectors_mount(mkcomposefs: Option<PathBuf>, mount_composefs: Option<PathBuf>) {
    let assets = assets_dir();
    let a = Area::new();
    let store = a.dir("empty-store");
    let mut names: Vec<PathBuf> = fs::read_dir(&assets)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            (n.ends_with(".dump") || n.ends_with(".dump.gz")) && !n.starts_with("should-fail-")
        })
        .collect();
    names.sort();
    assert!(!names.is_empty());
    for (i, vector) in names.iter().enumerate() {
        let name = vector.file_name().unwrap().to_string_lossy().into_owned();
        let text = read_vector(vector);
        let tree = tilefs_image::dump::parse(&text[..], tilefs_image::dump::ParseOptions { strict: false })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let dump = a.path(&format!("{i}.dump"));
        fs::write(&dump, &text).unwrap();
        let image = a.path(&format!("{i}.tilefs.cfs"));
        let version = fs::read_to_string(vector.with_file_name(format!("{name}.version")));
        let (min, max) = match &version {
            Ok(v) => (v.trim().to_string(), v.trim().to_string()),
            Err(_) => ("0".to_string(), "1".to_string()),
        };
        let (min, max) = (format!("--min-version={min}"), format!("--max-version={max}"));
        tilefs(&[
            os("build"),
            os("--from-dump"),
            os(&min),
            os(&max),
            dump.as_os_str(),
            image.as_os_str(),
        ]);
        let mnt = a.dir(&format!("{i}.mnt"));
        let m = kmount(&store, &image, &mnt, &["--verity", "off"]);
        // A regular file with a size but no object (no redirect: the dump
        // gives no digest) cannot even be looked up through overlayfs
        // ("metacopy with no lower data found"): EIO, with either tool.
        let unreachable = files_without_object(&tree);
        if !unreachable.is_empty() {
            assert_unreachable(&mnt, &unreachable, &name);
            drop(m);
            if let Some(mc) = &mount_composefs {
                let st = Command::new(mc)
                    .arg("-o")
                    .arg(format!("basedir={}", store.display()))
                    .arg(&image)
                    .arg(&mnt)
                    .status()
                    .unwrap();
                assert!(st.success(), "{name}: mount.composefs failed");
                let _g = Mounted(mnt.clone());
                assert_unreachable(&mnt, &unreachable, &format!("{name} (mount.composefs)"));
            }
            eprintln!(
                "{name}: {} files without object fail lookup with EIO",
                unreachable.len()
            );
            continue;
        }
        let seen = scan_lenient(&mnt);
        assert_same_view(
            &expected_from_dump(&tree),
            &seen,
            version_of(&image),
            true,
            &format!("{name} (tilefs)"),
        );
        drop(m);

        if let Some(mk) = &mkcomposefs {
            let ref_image = a.path(&format!("{i}.ref.cfs"));
            let st = Command::new(mk)
                .arg("--from-file")
                .arg(&min)
                .arg(&max)
                .arg(&dump)
                .arg(&ref_image)
                .status()
                .unwrap();
            assert!(st.success(), "{name}: mkcomposefs failed");
            let m = kmount(&store, &ref_image, &mnt, &["--verity", "off"]);
            assert_eq!(
                without_inos(&scan_lenient(&mnt)),
                without_inos(&seen),
                "{name}: the reference's image mounts differently"
            );
            drop(m);
        }
        if let Some(mc) = &mount_composefs {
            let st = Command::new(mc)
                .arg("-o")
                .arg(format!("basedir={}", store.display()))
                .arg(&image)
                .arg(&mnt)
                .status()
                .unwrap();
            assert!(st.success(), "{name}: mount.composefs failed");
            let g = Mounted(mnt.clone());
            let theirs = scan_lenient(&mnt);
            drop(g);
            assert_eq!(
                without_inos(&theirs),
                without_inos(&seen),
                "{name}: mount.composefs shows tilefs's image differently"
            );
        }
        eprintln!("{name}: {} entries as the dump says", seen.len());
    }
    assert!(mounts_involving(a.tmp.path()).is_empty());
}
