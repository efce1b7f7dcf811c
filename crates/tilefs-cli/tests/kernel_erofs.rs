//! Images built by tilefs mount with the kernel's EROFS and show the
//! source's names, types, modes, owners, times, symlink targets and xattrs.

mod common;

use common::*;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::OsStrExt;

#[test]
fn kernel_mounts_a_directory_build() {
    require(cannot_mount("erofs"));
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    make_source_tree(&src, 7);
    let image = tmp.path().join("image.cfs");
    tilefs(&[os("build"), src.as_os_str(), image.as_os_str()]);

    let mnt = tmp.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    let guard = mount_erofs(&image, &mnt);
    let source = scan(&src);
    let mut mounted = scan(&mnt);

    // The builder gives the root 256 whiteouts (00..ff) that hide the
    // store's fan-out directories in an overlay; nothing else is added.
    for b in 0..=255u8 {
        let name = format!("{b:02x}").into_bytes();
        let seen = mounted.remove(&name).expect("root whiteout");
        assert_eq!(seen.mode & 0o170000, 0o020000);
        assert_eq!(seen.rdev, 0);
    }
    assert_eq!(
        source.keys().collect::<Vec<_>>(),
        mounted.keys().collect::<Vec<_>>(),
        "names differ"
    );

    let mut external = Vec::new();
    for (path, want) in &source {
        let got = &mounted[path];
        let shown = String::from_utf8_lossy(path);
        let whiteout = want.mode & 0o170000 == 0o020000 && want.rdev == 0;
        if whiteout {
            // In the raw image a whiteout is an escaped regular file; the
            // overlay mount turns it back (tested with overlayfs).
            assert_eq!(got.mode & 0o170000, 0o100000, "{shown}");
            assert!(got
                .xattrs
                .contains_key(&OsString::from("trusted.overlay.overlay.whiteout")));
            continue;
        }
        assert_eq!(got.mode, want.mode, "{shown}: mode");
        assert_eq!((got.uid, got.gid), (want.uid, want.gid), "{shown}: owner");
        assert_eq!(got.mtime, want.mtime, "{shown}: mtime");
        assert_eq!(got.size, want.size, "{shown}: size");
        assert_eq!(got.link, want.link, "{shown}: symlink target");
        if want.mode & 0o170000 == 0o020000 || want.mode & 0o170000 == 0o060000 {
            assert_eq!(got.rdev, want.rdev, "{shown}: device number");
        }
        // Every source xattr is there, trusted.overlay.* escaped.
        for (k, v) in &want.xattrs {
            let key = match k.to_str().and_then(|k| k.strip_prefix("trusted.overlay.")) {
                Some(rest) => OsString::from(format!("trusted.overlay.overlay.{rest}")),
                None => k.clone(),
            };
            assert_eq!(got.xattrs.get(&key), Some(v), "{shown}: xattr {k:?}");
        }
        // And the only additions are the overlay xattrs composefs defines.
        for k in got.xattrs.keys() {
            let k = k.to_str().unwrap_or("");
            let ours = k.starts_with("trusted.overlay.overlay.")
                || matches!(
                    k,
                    "trusted.overlay.metacopy" | "trusted.overlay.redirect" | "trusted.overlay.opaque"
                )
                || k.starts_with("user.overlay.");
            assert!(
                ours || want.xattrs.contains_key(&OsString::from(k)),
                "{shown}: unexpected xattr {k}"
            );
        }
        // Small files live in the image: their contents read back.
        if want.mode & 0o170000 == 0o100000 && want.size.is_some_and(|s| s > 0 && s <= 64) {
            let rel = OsStr::from_bytes(path);
            assert_eq!(
                fs::read(mnt.join(rel)).unwrap(),
                fs::read(src.join(rel)).unwrap(),
                "{shown}: contents"
            );
        }
        // Larger ones carry a redirect to their object.
        if want.mode & 0o170000 == 0o100000 && want.size.is_some_and(|s| s > 64) {
            let redirect = got
                .xattrs
                .get(&OsString::from("trusted.overlay.redirect"))
                .expect("redirect");
            external.push((src.join(OsStr::from_bytes(path)), redirect.clone()));
        }
    }
    let mut args = vec![os("digest"), os("--compact")];
    args.extend(external.iter().map(|(p, _)| p.as_os_str()));
    let digests = String::from_utf8(tilefs(&args).stdout).unwrap();
    assert_eq!(digests.lines().count(), external.len());
    for ((path, redirect), hex) in external.iter().zip(digests.lines()) {
        assert_eq!(
            String::from_utf8_lossy(redirect),
            format!("/{}/{}", &hex[..2], &hex[2..]),
            "{}: redirect",
            path.display()
        );
    }
    drop(guard);
}
