//! A new user's first day (issue 33): relative stores, lazy mounts whose
//! server runs detached, `umount` that returns once the server is gone,
//! writable mounts of root's images without privilege, notices that can be
//! silenced, gc and fsck saying what they did, man pages.

mod common;

use common::oci::*;
use common::registry::Registry;
use common::*;
use std::fs;
use std::path::Path;
use std::process::{Command, Output};

/// tilefs run in `dir` with `env`.
fn tilefs_in(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(tilefs_bin());
    cmd.current_dir(dir).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}", stderr(o));
    stderr(o)
}

/// The live processes whose command line has every one of `words`.
fn processes_with(words: &[&str]) -> Vec<u32> {
    let mut found = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let zombie = fs::read_to_string(e.path().join("stat"))
            .map(|s| s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
            .unwrap_or(true);
        if !zombie && words.iter().all(|w| args.iter().any(|a| a == w)) {
            found.push(pid);
        }
    }
    found
}

#[test]
fn relative_stores_serve_lazy_mounts_and_umount_waits_for_the_server() {
    require(cannot_fuse());
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    let files = tree(&src, 33, 12, 64 << 10);
    let store = area.path("store");
    build_tag(&store, "app", &src);
    let remote = format!("docker://{}/team/app:v1", registry.addr);
    push(&store, "app", &remote);
    let tag = format!("{}_team_app:v1", registry.addr);
    let top = area.tmp.path();

    // A relative --store, lazily: the detached server finds it.
    ok(&tilefs_in(
        top,
        &[],
        &["pull", "-q", "--tls-verify=false", "--lazy", "--store", "s2", &remote],
    ));
    fs::create_dir(top.join("lz")).unwrap();
    let log = area.path("lz.log");
    let _m = Mounted(top.join("lz"));
    ok(&tilefs_in(
        top,
        &[],
        // The FUSE server (the kernel path's filler has its own tests).
        &[
            "mount",
            "--fuse",
            "--store",
            "s2",
            "--log",
            log.to_str().unwrap(),
            &tag,
            "lz",
        ],
    ));
    for (name, _) in &files {
        let want = fs::read(src.join(name)).unwrap();
        let got = fs::read(top.join("lz").join(name)).unwrap_or_else(|e| {
            panic!(
                "{name:?} through the lazy mount of a relative store: {e}\n{}",
                fs::read_to_string(&log).unwrap_or_default()
            )
        });
        assert!(got == want, "{name:?} differs");
    }
    let servers = processes_with(&["mount", "s2", "lz"]);
    assert_eq!(servers.len(), 1, "one server for the mount");
    ok(&tilefs_in(top, &[], &["umount", "lz"]));
    assert!(!is_mounted(&top.join("lz")));
    assert!(
        processes_with(&["mount", "s2", "lz"]).is_empty(),
        "`tilefs umount` returned while the server ({servers:?}) still ran"
    );

    // A relative $TILEFS_STORE is the store, resolved where it is given.
    ok(&tilefs_in(
        top,
        &[("TILEFS_STORE", "s3")],
        &["pull", "-q", "--tls-verify=false", &remote],
    ));
    assert_eq!(tags_in(&top.join("s3")), vec![tag.clone()]);
}

#[test]
fn a_user_changes_a_root_image_mounted_writable_without_options() {
    require(not_root("the test makes an unprivileged user's mount"));
    let _fuse = DevFuseMode::set(0o666);
    let area = Area::new();
    fs::set_permissions(area.tmp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let src = area.dir("src");
    fs::create_dir(src.join("etc")).unwrap();
    fs::write(src.join("etc/motd"), "hello\n").unwrap();
    fs::write(src.join("gone"), "bye\n").unwrap();
    let store = area.path("store");
    build_tag(&store, "os", &src);
    fs::set_permissions(&store, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let (mnt, upper, work) = (area.dir("mnt"), area.dir("upper"), area.dir("work"));
    for d in [&mnt, &upper, &work] {
        give_to_nobody(d);
    }
    let _m = Mounted(mnt.clone());
    let out = as_nobody(Command::new(tilefs_bin()).args([
        os("mount"),
        os("--fuse"),
        os("--store"),
        store.as_os_str(),
        os("--upper"),
        upper.as_os_str(),
        os("--work"),
        work.as_os_str(),
        os("os"),
        mnt.as_os_str(),
    ]))
    .output()
    .unwrap();
    let said = ok(&out);
    assert!(
        said.contains("belongs to root") && said.contains("uidmapping=0:65534:1"),
        "{said}"
    );
    // Root's files are the user's to change (the mount is the user's: only
    // they may enter it).
    let sh = |script: &str| {
        let o = as_nobody(Command::new("/bin/sh").args(["-c", script]).current_dir(&mnt))
            .output()
            .unwrap();
        ok(&o);
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    assert_eq!(sh("stat -c %u etc/motd"), format!("{NOBODY}\n"));
    sh("echo changed > etc/motd && rm gone && mkdir etc/new && echo x > etc/new/f");
    assert_eq!(sh("cat etc/motd; ls"), "changed\netc\n");
    // The upper directory records them as root's, as the image has them.
    ok(
        &as_nobody(Command::new(tilefs_bin()).args([os("umount"), mnt.as_os_str()]))
            .output()
            .unwrap(),
    );
    let x = xattrs(&upper.join("etc/new/f"));
    let owner = x.get(std::ffi::OsStr::new("user.containers.override_stat")).cloned();
    assert!(
        owner.as_deref().is_some_and(|o| o.starts_with(b"0:0:")),
        "the new file's recorded owner: {owner:?}"
    );
}

#[test]
fn notices_say_what_they_should_once_and_quiet_silences_them() {
    require(cannot_mount("erofs"));
    let area = Area::new();
    let src = area.dir("src");
    fs::write(src.join("f"), "x").unwrap();
    let store = area.path("store");
    build_tag(&store, "t", &src);
    let mnt = area.dir("mnt");
    fs::write(mnt.join("hidden"), "under the mount").unwrap();
    let s = store.to_str().unwrap();
    let m = mnt.to_str().unwrap();
    let top = area.tmp.path();
    let _m = Mounted(mnt.clone());
    let said = ok(&tilefs_in(top, &[], &["mount", "--kernel", "--store", s, "t", m]));
    assert!(said.contains("is not empty: its files are hidden"), "{said}");
    // gc says what kept the objects of an image mounted by its path.
    let image = area.path("t.img");
    fs::copy(store.join("images/t"), &image).unwrap();
    ok(&tilefs_in(top, &[], &["untag", "--store", s, "t"]));
    let mnt2 = area.dir("mnt2");
    let _m2 = Mounted(mnt2.clone());
    ok(&tilefs_in(
        top,
        &[],
        &[
            "mount",
            "--kernel",
            "-q",
            "--store",
            s,
            image.to_str().unwrap(),
            mnt2.to_str().unwrap(),
        ],
    ));
    let gc = tilefs_in(top, &[], &["gc", "--store", s]);
    let text = String::from_utf8_lossy(&gc.stdout).into_owned();
    assert!(text.contains("0 tagged images and 2 live mounts"), "{text}");
    ok(&tilefs_in(top, &[], &["umount", m]));
    let quiet = ok(&tilefs_in(
        top,
        &[],
        &["mount", "-q", "--kernel", "--store", s, image.to_str().unwrap(), m],
    ));
    assert_eq!(quiet, "", "-q prints no notice");
    assert!(tilefs_in(top, &[], &["gc", "-q", "--store", s]).stdout.is_empty());
}

#[test]
fn man_writes_and_lists_the_pages() {
    let area = Area::new();
    let dir = area.path("man");
    let out = tilefs_in(area.tmp.path(), &[], &["man", dir.to_str().unwrap()]);
    let listed = String::from_utf8_lossy(&out.stdout).into_owned();
    for page in ["tilefs.1", "tilefs-mount.1", "tilefs-mountd.1", "mount.tilefs.8"] {
        assert!(listed.contains(page), "{page} not listed: {listed}");
        assert!(dir.join(page).exists(), "{page} not written");
    }
    let mountd = fs::read_to_string(dir.join("tilefs-mountd.1")).unwrap();
    assert!(
        mountd.contains("max_mounts_per_user"),
        "the policy's format is in tilefs-mountd(1)"
    );
    // Internal entry points are offered to no one: mount.tilefs's
    // erofs-backing and the mount service's helper process.
    for shell in ["bash", "zsh", "fish"] {
        let out = tilefs_in(area.tmp.path(), &[], &["completions", shell]);
        let script = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(script.contains("policy"), "{shell}: no mountd options in {script}");
        for internal in ["erofs-backing", "helper"] {
            assert!(!script.contains(internal), "{shell} completion offers {internal}");
        }
    }
    assert!(
        !mountd.contains("helper"),
        "tilefs-mountd(1) shows the helper's entry point"
    );
}
