//! The image commands as a user runs them: refusals leave nothing behind,
//! `dump` is the inverse of `build`, `--print-digest` is the image's
//! fs-verity digest.

mod common;

use common::*;
use std::fs;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

#[test]
fn should_fail_dumps_are_refused_naming_the_line() {
    let tmp = tempfile::tempdir().unwrap();
    let mut n = 0;
    for e in fs::read_dir(assets_dir()).unwrap().flatten() {
        let name = e.file_name().into_string().unwrap();
        if !name.starts_with("should-fail-") {
            continue;
        }
        let img = tmp.path().join("out.img");
        let out = tilefs_any(&[os("build"), os("--from-dump"), e.path().as_os_str(), img.as_os_str()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(
            err.contains(&name) && err.contains("line "),
            "{name}: message does not name file and line: {err}"
        );
        assert!(!img.exists(), "{name}: an image was left behind");
        assert_eq!(
            fs::read_dir(tmp.path()).unwrap().count(),
            0,
            "{name}: temporary files left behind"
        );
        n += 1;
    }
    assert!(n >= 14);
}

#[test]
fn dump_then_build_reproduces_every_vector_image() {
    let tmp = tempfile::tempdir().unwrap();
    for name in [
        "special.dump",
        "longlink.dump",
        "bigfile-xattr.dump",
        "config-with-hard-link.dump.gz",
        "cs9-x86_64-minimal.dump.gz",
    ] {
        let img = tmp.path().join("a.img");
        let again = tmp.path().join("b.img");
        tilefs(&[
            os("build"),
            os("--from-dump"),
            assets_dir().join(name).as_os_str(),
            img.as_os_str(),
        ]);
        let dump = tilefs(&[os("dump"), img.as_os_str()]).stdout;
        let mut child = Command::new(tilefs_bin())
            .args([os("build"), os("--from-dump"), os("-"), again.as_os_str()])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(&dump).unwrap();
        assert!(child.wait().unwrap().success(), "{name}");
        assert!(
            fs::read(&img).unwrap() == fs::read(&again).unwrap(),
            "{name}: build(dump(image)) differs"
        );
    }
}

#[test]
fn print_digest_is_the_image_fs_verity_digest() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("a.img");
    let src = assets_dir().join("special.dump");
    let out = tilefs(&[
        os("build"),
        os("--print-digest"),
        os("--from-dump"),
        src.as_os_str(),
        img.as_os_str(),
    ]);
    let printed = String::from_utf8(out.stdout).unwrap();
    let digest = String::from_utf8(tilefs(&[os("digest"), os("--compact"), img.as_os_str()]).stdout).unwrap();
    assert_eq!(printed, digest);
    let only = tilefs(&[
        os("build"),
        os("--print-digest-only"),
        os("--from-dump"),
        src.as_os_str(),
    ]);
    assert_eq!(String::from_utf8(only.stdout).unwrap(), digest);
}

#[test]
fn info_and_objects_describe_the_image() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("a.img");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/hello.dump");
    tilefs(&[os("build"), os("--from-dump"), src.as_os_str(), img.as_os_str()]);
    let info: serde_json::Value =
        serde_json::from_slice(&tilefs(&[os("info"), os("--json"), img.as_os_str()]).stdout).unwrap();
    assert_eq!(info["format_version"], 1, "the example has a whiteout");
    assert_eq!(info["directories"], 8);
    assert_eq!(info["whiteouts"], 1);
    assert_eq!(info["hardlinks"], 1);
    assert_eq!(info["external_files"], 1);
    assert_eq!(info["objects"], 1);
    let objects = String::from_utf8(tilefs(&[os("objects"), img.as_os_str()]).stdout).unwrap();
    assert_eq!(
        objects,
        "3a/1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9\n"
    );
    // Not an image: refused, naming the file.
    let bogus = tmp.path().join("bogus");
    fs::write(&bogus, vec![0u8; 8192]).unwrap();
    let out = tilefs_any(&[os("info"), bogus.as_os_str()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bogus"));
}
