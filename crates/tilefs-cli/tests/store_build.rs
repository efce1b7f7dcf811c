//! `tilefs build --store`: objects land where composefs expects them, with
//! the right contents, once; an interrupted or starved build leaves nothing
//! wrong behind.

mod common;

use common::*;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// `tilefs build --json --store STORE SRC IMG`, which must succeed.
fn build_json(store: &Path, src: &Path, img: &Path) -> std::process::Output {
    tilefs(&[
        os("build"),
        os("--json"),
        os("--store"),
        store.as_os_str(),
        src.as_os_str(),
        img.as_os_str(),
    ])
}

fn json(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// A plain tree any user can make: files of many sizes, two identical.
fn plain_tree(root: &Path, files: usize, size: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    fs::create_dir_all(root.join("sub/deeper")).unwrap();
    for i in 0..files {
        let dir = match i % 3 {
            0 => root.to_path_buf(),
            1 => root.join("sub"),
            _ => root.join("sub/deeper"),
        };
        let len = 65 + (rng.below(size as u64) as usize);
        fs::write(dir.join(format!("file{i}")), rng.bytes(len)).unwrap();
    }
    fs::write(
        root.join("same-a"),
        b"identical contents, longer than sixty-four bytes, stored once in the store",
    )
    .unwrap();
    fs::write(
        root.join("same-b"),
        b"identical contents, longer than sixty-four bytes, stored once in the store",
    )
    .unwrap();
    fs::write(root.join("small"), b"inline").unwrap();
}

/// Every object file in a store (relative paths), leaving out bookkeeping.
fn objects_in(store: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(store).unwrap().flatten() {
        let name = e.file_name().into_string().unwrap();
        if name.len() == 2 && e.file_type().unwrap().is_dir() {
            for o in fs::read_dir(e.path()).unwrap().flatten() {
                out.push(PathBuf::from(&name).join(o.file_name()));
            }
        }
    }
    out.sort();
    out
}

fn tmp_leftovers(store: &Path) -> usize {
    fs::read_dir(store.join(".tmp")).map(|d| d.count()).unwrap_or(0)
}

#[test]
fn objects_are_named_by_digest_and_stored_once() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    plain_tree(&src, 40, 20_000, 1);
    let store = tmp.path().join("store");
    let img = tmp.path().join("img");
    let out = build_json(&store, &src, &img);
    let report = json(&out);
    assert_eq!(report["new_objects"], 41, "{report}");

    // Every object referenced by the image is there, named by its digest,
    // readable by all, and holds the file's bytes.
    let listed = String::from_utf8(tilefs(&[os("objects"), img.as_os_str()]).stdout).unwrap();
    let listed: Vec<PathBuf> = listed.lines().map(PathBuf::from).collect();
    assert_eq!(listed, objects_in(&store));
    for rel in &listed {
        let path = store.join(rel);
        let d = digest_hex(&path);
        let name = rel.to_str().unwrap().replace('/', "");
        assert_eq!(d, name, "{} holds other contents than its name says", rel.display());
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644);
    }
    assert_eq!(tmp_leftovers(&store), 0);

    // Again: nothing new, and no file is even read (the digest cache knows).
    let report = json(&build_json(&store, &src, &img));
    assert_eq!(report["new_objects"], 0);
    assert_eq!(report["cache_hits"], 42, "{report}");

    // A changed file misses the cache and becomes a new object.
    fs::write(
        src.join("file0"),
        b"new contents of file zero, long enough to live in the store as an object",
    )
    .unwrap();
    let img2 = tmp.path().join("img2");
    let report = json(&build_json(&store, &src, &img2));
    assert_eq!(report["new_objects"], 1, "{report}");
    let listed2 = String::from_utf8(tilefs(&[os("objects"), img2.as_os_str()]).stdout).unwrap();
    for rel in listed2.lines() {
        assert!(store.join(rel).is_file(), "{rel} missing after rebuild");
    }
}

/// Issue 43: `--hardlink` made an object of the source file's inode, which
/// changed whenever the file did. It is refused, saying why and what to do
/// instead; a build shares no inode with its sources.
#[test]
fn hardlink_is_retired_and_objects_share_no_inode_with_sources() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    plain_tree(&src, 6, 5000, 2);
    let store = tmp.path().join("store");
    let img = tmp.path().join("img");
    let refused = tilefs_any(&[
        os("build"),
        os("--hardlink"),
        os("--store"),
        store.as_os_str(),
        src.as_os_str(),
        img.as_os_str(),
    ]);
    let err = stderr(&refused);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--hardlink is retired") && err.contains("drop the option"),
        "{err}"
    );
    assert!(!img.exists() && !store.exists(), "a refused build wrote something");
    tilefs(&[
        os("build"),
        os("--store"),
        store.as_os_str(),
        src.as_os_str(),
        img.as_os_str(),
    ]);
    let obj = store.join(object_rel(&digest_hex(&src.join("file0"))));
    assert_ne!(
        fs::metadata(&obj).unwrap().ino(),
        fs::metadata(src.join("file0")).unwrap().ino()
    );
    // A change to the source leaves the object as it was.
    let before = fs::read(&obj).unwrap();
    fs::OpenOptions::new()
        .append(true)
        .open(src.join("file0"))
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"more"))
        .unwrap();
    assert_eq!(fs::read(&obj).unwrap(), before);
}

#[test]
fn bad_store_and_tag_are_refused_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    plain_tree(&src, 3, 100, 3);
    let img = tmp.path().join("img");
    // A store path that is a file.
    let file = tmp.path().join("not-a-dir");
    fs::write(&file, b"x").unwrap();
    let out = tilefs_any(&[
        os("build"),
        os("--store"),
        file.as_os_str(),
        src.as_os_str(),
        img.as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not-a-dir") && err.contains("not a directory"), "{err}");
    assert_eq!(
        err.matches("not a directory").count(),
        1,
        "the cause is said once: {err}"
    );
    assert!(!img.exists());
    // A tag that could escape the store.
    let store = tmp.path().join("store");
    let out = tilefs_any(&[
        os("build"),
        os("--store"),
        store.as_os_str(),
        os("--tag"),
        os("../evil"),
        src.as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!tmp.path().join("evil").exists());
}

#[test]
fn a_rebuild_replaces_objects_of_the_wrong_size() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    let mut rng = Rng::new(7);
    // One object hashed in memory, one streamed through a temporary file,
    // one whose damage keeps its size.
    fs::write(src.join("small"), rng.bytes(10_000)).unwrap();
    fs::write(src.join("large"), rng.bytes(5 << 20)).unwrap();
    fs::write(src.join("other"), rng.bytes(3_000)).unwrap();
    let store = tmp.path().join("store");
    let img = tmp.path().join("img");
    let build = || build_json(&store, &src, &img);
    assert_eq!(json(&build())["new_objects"], 3);
    let object_of = |name: &str| store.join(object_rel(&digest_hex(&src.join(name))));

    let large = fs::OpenOptions::new().write(true).open(object_of("large")).unwrap();
    large.set_len(1 << 20).unwrap();
    let mut small = fs::read(object_of("small")).unwrap();
    small.extend_from_slice(b"trailing garbage");
    fs::write(object_of("small"), small).unwrap();
    let mut other = fs::read(object_of("other")).unwrap();
    other[100] ^= 0xff;
    fs::write(object_of("other"), other).unwrap();
    assert!(!fsck_clean(&store).0, "fsck missed the damage");

    // The sources are unchanged, so the digest cache answers for them; the
    // objects' sizes still give the first two away.
    let out = build();
    let report = json(&out);
    assert_eq!(report["replaced_objects"], 2, "{report}");
    assert_eq!(report["new_objects"], 2, "{report}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("replaced 2 damaged objects (wrong size)"), "{err}");
    for name in ["small", "large"] {
        assert_eq!(
            fs::read(object_of(name)).unwrap(),
            fs::read(src.join(name)).unwrap(),
            "{name}"
        );
    }
    assert_eq!(tmp_leftovers(&store), 0);

    // Damage of the same size is fsck's to find.
    let (clean, report) = fsck_clean(&store);
    assert!(!clean, "fsck passed a corrupt object");
    let other = object_of("other");
    assert!(report.contains(other.to_str().unwrap()), "{report}");
    assert_eq!(report.matches("corrupt object: ").count(), 1, "{report}");
}

/// Runs `tilefs fsck` and says whether the store is clean.
fn fsck_clean(store: &Path) -> (bool, String) {
    let out = tilefs_any(&[os("fsck"), os("--quiet"), os("--store"), store.as_os_str()]);
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn killed_builds_leave_a_consistent_store() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let img = tmp.path().join("img");
    let build = |src: &Path| {
        Command::new(tilefs_bin())
            .args([
                os("build"),
                os("--quiet"),
                os("--store"),
                store.as_os_str(),
                os("--tag"),
                os("t"),
            ])
            .arg(src)
            .arg(&img)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    // How long one import of a fresh ~30 MB tree takes here: kills land
    // anywhere from its start to its end.
    let first = tmp.path().join("src0");
    plain_tree(&first, 120, 500_000, 100);
    let started = std::time::Instant::now();
    assert!(build(&first).wait().unwrap().success());
    let span = started.elapsed().as_millis().max(20) as u64;

    let mut rng = Rng::new(99);
    let mut killed = 0;
    for round in 1..=12u64 {
        // New contents every round, so every build has real work to do.
        let src = tmp.path().join(format!("src{round}"));
        plain_tree(&src, 120, 500_000, 100 + round);
        let mut child = build(&src);
        std::thread::sleep(Duration::from_millis(rng.below(span)));
        let _ = child.kill();
        killed += (!child.wait().unwrap().success()) as u32;
        // Whatever moment it died at: every object is whole, the tag (if
        // any) refers only to present objects, and the image is whole.
        let (clean, report) = fsck_clean(&store);
        assert!(clean, "round {round}: fsck after SIGKILL: {report}");
        if img.exists() {
            tilefs(&[os("info"), img.as_os_str()]);
        }
        fs::remove_dir_all(&src).unwrap();
    }
    assert!(killed > 0, "no build was interrupted: the test proves nothing");
    tilefs(&[
        os("build"),
        os("--quiet"),
        os("--store"),
        store.as_os_str(),
        os("--tag"),
        os("t"),
        first.as_os_str(),
        img.as_os_str(),
    ]);
    let (clean, report) = fsck_clean(&store);
    assert!(clean, "after the final build: {report}");
    tilefs(&[os("gc"), os("--store"), store.as_os_str()]);
    assert_eq!(tmp_leftovers(&store), 0, "gc leaves no leftovers");
    let (clean, report) = fsck_clean(&store);
    assert!(clean, "after gc: {report}");
}

#[test]
fn full_disk_fails_clearly_and_leaves_nothing_partial() {
    require(
        not_root("it loop-mounts a small filesystem")
            .or_else(|| missing_program("mkfs.ext4", "Debian package e2fsprogs")),
    );
    let tmp = tempfile::tempdir().unwrap();
    let disk = tmp.path().join("disk.img");
    fs::File::create(&disk).unwrap().set_len(24 << 20).unwrap();
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&disk)
        .status()
        .unwrap();
    assert!(st.success());
    let small = tmp.path().join("small");
    fs::create_dir(&small).unwrap();
    let st = Command::new("mount")
        .args(["-o", "loop"])
        .arg(&disk)
        .arg(&small)
        .status()
        .unwrap();
    assert!(st.success(), "loop mount failed");
    let _guard = Mounted(small.clone());

    let src = tmp.path().join("src");
    plain_tree(&src, 60, 1_000_000, 5); // ~30 MB: more than fits
    let store = small.join("store");
    // An existing store: it stays, whole (a store the build would create
    // is removed when the build fails).
    fs::create_dir(&store).unwrap();
    let img = small.join("img");
    let out = tilefs_any(&[
        os("build"),
        os("--quiet"),
        os("--store"),
        store.as_os_str(),
        os("--tag"),
        os("t"),
        src.as_os_str(),
        img.as_os_str(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(
        stderr.contains("No space left") || stderr.contains("no space"),
        "unclear message: {stderr}"
    );
    assert!(!img.exists(), "an image was written");
    assert!(!store.join("images/t").exists(), "a tag was written");
    assert_eq!(tmp_leftovers(&store), 0, "temporary files left behind");
    let (clean, report) = fsck_clean(&store);
    assert!(clean, "{report}");
}
