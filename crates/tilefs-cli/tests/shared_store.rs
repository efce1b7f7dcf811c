//! Stores that other users may write (issue 27, items 5 and 9): what an
//! unprivileged user (uid 65534) plants in one must not make root write
//! outside the store, nor send root's registry credentials anywhere root
//! did not pull from.

mod common;

use common::oci::*;
use common::registry::Registry;
use common::*;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn need_root() -> bool {
    if !is_root() {
        eprintln!("skipped: needs root (the victim) and uid 65534 (the other user)");
        return false;
    }
    true
}

/// An area nobody can reach, with a store root made and left writable by
/// all, and a directory of nobody's that must stay untouched.
fn shared_area() -> (Area, PathBuf, PathBuf) {
    let area = Area::new();
    fs::set_permissions(area.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let store = area.path("store");
    build_tag(&store, "base", &area.dir("empty"));
    fs::set_permissions(&store, fs::Permissions::from_mode(0o777)).unwrap();
    let outside = area.dir("outside");
    give_to_nobody(&outside);
    (area, store, outside)
}

/// Runs `sh -c script` as nobody; it must succeed.
fn nobody_sh(script: &str) {
    let out = as_nobody(Command::new("sh").args(["-c", script])).output().unwrap();
    assert!(out.status.success(), "as nobody: {script}: {}", stderr(&out));
}

/// What shows that nothing was written in a directory: its entries and
/// times (creating or removing an entry changes its mtime, even if the
/// entry is moved away again).
fn untouched(dir: &Path) -> (Vec<PathBuf>, i64, i64, i64, i64) {
    let m = fs::metadata(dir).unwrap();
    let entries = fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    (entries, m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec())
}

/// A failed command (exit 1) whose message names `path`.
fn refused_naming(out: &Output, path: &Path, what: &str) {
    assert_eq!(out.status.code(), Some(1), "{what} should fail: {}", stderr(out));
    assert!(
        stderr(out).contains(&path.display().to_string()),
        "{what}: the message names {}: {}",
        path.display(),
        stderr(out)
    );
    eprintln!("{what}: {}", stderr(out).trim());
}

#[test]
fn symlinks_planted_in_a_shared_store_are_refused_not_written_through() {
    if !need_root() {
        return;
    }
    let (area, store, outside) = shared_area();
    let src = area.dir("src");
    let files = tree(&src, 27, 3, 5000);
    let target = &files[0].0;
    let fan = object_rel(&digest_hex(&src.join(target)))[..2].to_string();
    let planted = store.join(&fan);
    let build = || {
        tilefs_any(&[
            os("build"),
            os("-q"),
            os("--store"),
            store.as_os_str(),
            src.as_os_str(),
            area.path("img").as_os_str(),
        ])
    };

    // The object's fan-out directory is a symlink to nobody's directory:
    // refused (a symlink in a store is damage or an attack, never ours to
    // follow or to remove), naming it.
    nobody_sh(&format!("ln -s {} {}", outside.display(), planted.display()));
    let before = untouched(&outside);
    refused_naming(&build(), &planted, "build through a symlinked fan-out directory");
    assert_eq!(untouched(&outside), before, "nothing written outside the store");
    assert!(fs::symlink_metadata(&planted).unwrap().file_type().is_symlink());
    let text = tilefs_any(&[os("fsck"), os("--store"), store.as_os_str()]);
    assert!(
        String::from_utf8_lossy(&text.stdout).contains(&planted.display().to_string()),
        "fsck reports it: {}",
        String::from_utf8_lossy(&text.stdout)
    );

    // The store's temporary directory, and its lock (dangling: opening it
    // with O_CREAT would create a file of root's outside).
    fs::remove_file(&planted).unwrap();
    for (name, plant) in [
        (
            ".tmp",
            format!(
                "mv {s}/.tmp {s}/.tmp-was && ln -s {o} {s}/.tmp",
                s = store.display(),
                o = outside.display()
            ),
        ),
        (
            ".lock",
            format!(
                "mv {s}/.lock {s}/.lock-was && ln -s {o}/made-by-root {s}/.lock",
                s = store.display(),
                o = outside.display()
            ),
        ),
    ] {
        nobody_sh(&plant);
        let before = untouched(&outside);
        refused_naming(&build(), &store.join(name), &format!("build with a symlinked {name}"));
        assert_eq!(untouched(&outside), before, "{name}: nothing written outside the store");
        fs::remove_file(store.join(name)).unwrap();
        fs::rename(store.join(format!("{name}-was")), store.join(name)).unwrap();
    }
    assert!(build().status.success(), "{}", stderr(&build()));

    // Pulls: the full pull and a lazy fetch write objects the same way.
    let registry = Registry::start(&area);
    let pushed = area.path("pushed");
    build_tag(&pushed, "app", &src);
    let remote = format!("docker://{}/team/app:v1", registry.addr);
    push(&pushed, "app", &remote);
    let other = area.path("other-store");
    build_tag(&other, "base", &area.dir("empty-2"));
    fs::set_permissions(&other, fs::Permissions::from_mode(0o777)).unwrap();
    let planted = other.join(&fan);
    nobody_sh(&format!("ln -s {} {}", outside.display(), planted.display()));
    let before = untouched(&outside);
    refused_naming(
        &run_pull(&other, &remote, &[]),
        &planted,
        "pull through a symlinked fan-out directory",
    );
    assert_eq!(untouched(&outside), before, "nothing written outside the store");
    if let Some(why) = fuse_unavailable() {
        eprintln!("skipped the lazy fetch: {why}");
        return;
    }
    pull(&other, &remote, &["--lazy"]);
    let mnt = area.path("mnt");
    let log = area.path("fuse.log");
    let (_m, _) = Mounted::new(&other, &format!("{}_team_app:v1", registry.addr), &mnt, &log);
    // (The server refuses the symlink on the way to the object before it
    // would fetch; a symlink planted during the fetch is refused as above.)
    let e = read(&mnt.join(target)).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let logged = fs::read_to_string(&log).unwrap();
    eprintln!("lazy fetch: {logged}");
    assert!(
        logged.contains(target.as_str()) && logged.contains("symbolic links"),
        "{logged}"
    );
    assert_eq!(untouched(&outside), before, "nothing written outside the store");
}
