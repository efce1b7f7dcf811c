//! Regressions of the hardening issue: every mount honours the options
//! asked for (setuid binaries, devices and exec tried on every path), no
//! object can wedge the FUSE server, ostree-style redirects are served,
//! `umount` means umount, fallbacks say so, builds check before working
//! and clean up when interrupted, tags and stdin work wherever an IMAGE
//! does, gc keeps what is mounted, and hardlinks can be kept.
//!
//! Mount tests need root (the trees hold setuid-root files and devices) and
//! run what an unprivileged user would as uid/gid 65534.

mod common;

use common::*;
use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs `prog args` as nobody, killed after 20 s; None if it cannot even
/// start (exec refused).
fn try_as_nobody(prog: &Path, args: &[&OsStr]) -> Option<Output> {
    let child = as_nobody(Command::new(prog).args(args).stdin(Stdio::null()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    Some(wait_output(child, Duration::from_secs(20)))
}

/// Runs `prog args` as nobody, killed after 20 s.
fn nobody_runs(prog: &Path, args: &[&OsStr]) -> Output {
    try_as_nobody(prog, args).expect("starting a program as nobody")
}

/// The output of `child`, killing it if it runs past `limit` (a hang is a
/// failure, never a hung test).
fn wait_output(mut child: std::process::Child, limit: Duration) -> Output {
    let end = Instant::now() + limit;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > end {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}: stderr {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Why most tests here cannot run, if they cannot.
fn cannot_test() -> Option<String> {
    cannot_mount("fuse").or_else(|| cannot_mount("erofs"))
}

/// A scratch area others may enter (the tests run things as nobody).
fn open_area() -> Area {
    let a = Area::new();
    fs::set_permissions(a.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    a
}

/// A tree with a setuid-root copy of `id`, the null-like device `c 1 5`
/// (/dev/zero) and an executable; built into an image and a store.
fn privileged_tree(a: &Area) -> (PathBuf, PathBuf) {
    let src = a.dir("src");
    fs::copy("/usr/bin/id", src.join("id")).unwrap();
    fs::set_permissions(src.join("id"), fs::Permissions::from_mode(0o4755)).unwrap();
    let st = Command::new("mknod")
        .arg(src.join("zero"))
        .args(["c", "1", "5"])
        .status()
        .unwrap();
    assert!(st.success());
    fs::set_permissions(src.join("zero"), fs::Permissions::from_mode(0o666)).unwrap();
    fs::copy("/usr/bin/true", src.join("true")).unwrap();
    let store = a.path("store");
    let image = a.path("img");
    tilefs(&[
        os("build"),
        os("-q"),
        os("--store"),
        store.as_os_str(),
        src.as_os_str(),
        image.as_os_str(),
    ]);
    // Shared with the unprivileged user on purpose (a store root makes is
    // root's alone).
    fs::set_permissions(&store, fs::Permissions::from_mode(0o755)).unwrap();
    (store, image)
}

/// What nobody can do in the mount: (setuid gives root, the device reads,
/// a binary executes).
fn what_nobody_can_do(mnt: &Path) -> (bool, bool, bool) {
    let ran = |o: Option<Output>| o.filter(|o| o.status.success());
    let euid_root = ran(try_as_nobody(&mnt.join("id"), &[os("-u")]))
        .is_some_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let dev = nobody_runs(Path::new("/usr/bin/head"), &[os("-c4"), mnt.join("zero").as_os_str()]);
    let exec = ran(try_as_nobody(&mnt.join("true"), &[])).is_some();
    (euid_root, dev.status.success() && dev.stdout == [0; 4], exec)
}

#[test]
fn mount_options_hold_on_every_path() {
    let _serial = serial();
    require(cannot_test());
    let a = open_area();
    let (store, image) = privileged_tree(&a);
    let mnt = a.dir("mnt");
    let _u = Mounted(mnt.clone());
    let mount = |extra: &[&str]| {
        let mut args: Vec<&OsStr> = vec![os("mount"), os("--store"), store.as_os_str()];
        args.extend(extra.iter().map(|s| os(s)));
        args.extend([image.as_os_str(), mnt.as_os_str()]);
        let out = tilefs_any(&args);
        assert!(out.status.success(), "tilefs mount {extra:?}: {}", stderr(&out));
        out
    };
    let umount = || {
        let out = tilefs_any(&[os("umount"), mnt.as_os_str()]);
        assert!(out.status.success(), "umount: {}", stderr(&out));
        assert!(!is_mounted(&mnt));
    };

    // Without options root's mounts honour setuid, devices and exec, as a
    // kernel mount does; each option then takes its power away.
    for backend in ["--kernel", "--fuse"] {
        let allow: &[&str] = if backend == "--fuse" {
            &["-o", "allow_other"]
        } else {
            &[]
        };
        mount(&[&[backend], allow].concat());
        assert_eq!(
            what_nobody_can_do(&mnt),
            (true, true, true),
            "{backend} without options"
        );
        umount();
        mount(&[&[backend, "-o", "nosuid,nodev,noexec"], allow].concat());
        assert_eq!(
            what_nobody_can_do(&mnt),
            (false, false, false),
            "{backend} -o nosuid,nodev,noexec"
        );
        umount();
        mount(&[&[backend, "-o", "nosuid"], allow].concat());
        assert_eq!(what_nobody_can_do(&mnt), (false, true, true), "{backend} -o nosuid");
        umount();
    }

    // A root FUSE mount is for root alone unless allow_other is asked.
    mount(&["--fuse"]);
    let ls = nobody_runs(Path::new("/bin/ls"), &[mnt.as_os_str()]);
    assert!(
        !ls.status.success(),
        "another user entered a mount made without allow_other"
    );
    umount();

    // mount.tilefs: `verity` (required) cannot be had from this kernel's
    // mount, so it falls back to FUSE, says so, and keeps every option.
    let out = Command::new(mount_helper_bin())
        .arg(&image)
        .arg(&mnt)
        .arg("-o")
        .arg(format!("store={},verity,nosuid,nodev,noexec", store.display()))
        .output()
        .unwrap();
    assert!(out.status.success(), "mount.tilefs: {}", stderr(&out));
    let fstype = mount_line(&mnt)
        .map(|l| l.split(" - ").nth(1).unwrap().split(' ').next().unwrap().to_string())
        .unwrap();
    if fstype.starts_with("fuse") {
        assert!(stderr(&out).contains("FUSE"), "the fallback is said: {}", stderr(&out));
    }
    // A system mount is for every user, but with nothing of the power.
    assert_eq!(
        what_nobody_can_do(&mnt),
        (false, false, false),
        "mount.tilefs ({fstype})"
    );
    umount();

    // Refused, not ignored.
    for (opts, why) in [
        (&["-o", "rw"][..], "read-only"),
        (&["--fuse", "-o", "mode=1"], "overlayfs option"),
    ] {
        let mut args: Vec<&OsStr> = vec![os("mount"), os("--store"), store.as_os_str()];
        args.extend(opts.iter().map(|s| os(s)));
        args.extend([image.as_os_str(), mnt.as_os_str()]);
        let out = tilefs_any(&args);
        assert_eq!(out.status.code(), Some(1), "{opts:?} was accepted");
        assert!(stderr(&out).contains(why), "{opts:?}: {}", stderr(&out));
        assert!(!is_mounted(&mnt));
    }
}

#[test]
fn rootless_mounts_are_nosuid_nodev_and_refuse_suid_dev() {
    let _serial = serial();
    require(cannot_test().or_else(|| missing_program("fusermount3", "Debian package fuse3")));
    let a = open_area();
    let (store, image) = privileged_tree(&a);
    let mnt = a.dir("mnt");
    give_to_nobody(&mnt);
    let _u = Mounted(mnt.clone());
    // fusermount3 opens /dev/fuse as the user: make it usable meanwhile.
    let _dev = DevFuseMode::set(0o666);

    let tilefs_as_nobody = |args: &[&OsStr]| nobody_runs(&tilefs_bin(), args);
    for asked in ["suid", "dev"] {
        let out = tilefs_as_nobody(&[
            os("mount"),
            os("--store"),
            store.as_os_str(),
            os("-o"),
            os(asked),
            image.as_os_str(),
            mnt.as_os_str(),
        ]);
        assert_eq!(out.status.code(), Some(1), "-o {asked} accepted without privilege");
        assert!(
            stderr(&out).contains(&format!("option {asked} cannot be honoured")),
            "{}",
            stderr(&out)
        );
        assert!(!is_mounted(&mnt));
    }
    let out = tilefs_as_nobody(&[
        os("mount"),
        os("--store"),
        store.as_os_str(),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    assert!(out.status.success(), "rootless mount: {}", stderr(&out));
    assert!(
        stderr(&out).contains("using the FUSE mount"),
        "the choice is said: {}",
        stderr(&out)
    );
    let (suid, dev, exec) = what_nobody_can_do(&mnt);
    assert!(
        !suid && !dev && exec,
        "rootless: setuid {suid}, device {dev}, exec {exec}"
    );
    let out = tilefs_as_nobody(&[os("umount"), mnt.as_os_str()]);
    assert!(out.status.success(), "rootless umount: {}", stderr(&out));
    assert!(!is_mounted(&mnt));
}

#[test]
fn a_user_namespace_falls_back_to_fuse() {
    let _serial = serial();
    require(cannot_test());
    let a = open_area();
    let (store, image) = privileged_tree(&a);
    let mnt = a.dir("mnt");
    let script = format!(
        "{t} mount --store {s} {i} {m} && ls {m} && {t} umount {m}",
        t = tilefs_bin().display(),
        s = store.display(),
        i = image.display(),
        m = mnt.display()
    );
    let child = Command::new("unshare")
        .args(["-Urm", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_output(child, Duration::from_secs(30));
    assert!(out.status.success(), "in a user namespace: {}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("zero"));
    assert!(stderr(&out).contains("using the FUSE mount"), "{}", stderr(&out));
}

/// A dump whose files' objects are whatever the test puts at their paths.
fn dump_with_objects(a: &Area, lines: &[(&str, &str)]) -> PathBuf {
    let mut dump = String::from("/ 4096 40755 2 0 0 0 0.0 - - -\n");
    for (name, rel) in lines {
        dump.push_str(&format!("/{name} 100 100644 1 0 0 0 0.0 {rel} - -\n"));
    }
    let dump_path = a.path("dump");
    fs::write(&dump_path, dump).unwrap();
    let image = a.path("img");
    tilefs(&[os("build"), os("--from-dump"), dump_path.as_os_str(), image.as_os_str()]);
    image
}

#[test]
fn objects_that_are_not_files_do_not_wedge_the_server() {
    let _serial = serial();
    require(cannot_test());
    let a = Area::new();
    let store = a.dir("store");
    let fifo = format!("aa/{}", "a".repeat(62));
    let dir = format!("bb/{}", "b".repeat(62));
    let dev = format!("cc/{}", "c".repeat(62));
    let sock = format!("dd/{}", "d".repeat(62));
    for rel in [&fifo, &dir, &dev, &sock] {
        fs::create_dir_all(store.join(&rel[..2])).unwrap();
    }
    assert!(Command::new("mkfifo")
        .arg(store.join(&fifo))
        .status()
        .unwrap()
        .success());
    fs::create_dir(store.join(&dir)).unwrap();
    assert!(Command::new("mknod")
        .arg(store.join(&dev))
        .args(["c", "1", "3"])
        .status()
        .unwrap()
        .success());
    let _listener = std::os::unix::net::UnixListener::bind(store.join(&sock)).unwrap();
    let image = dump_with_objects(&a, &[("fifo", &fifo), ("dir", &dir), ("dev", &dev), ("sock", &sock)]);
    let mnt = a.dir("mnt");
    let log = a.path("log");
    let _u = Mounted(mnt.clone());
    let out = tilefs_any(&[
        os("mount"),
        os("--fuse"),
        os("--log"),
        log.as_os_str(),
        os("--store"),
        store.as_os_str(),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    // More readers than workers, each several times: every read fails at
    // once with EIO, and the mount still answers.
    let readers: Vec<_> = (0..8)
        .map(|i| {
            let f = mnt.join(["fifo", "dir", "dev", "sock"][i % 4]);
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                fs::File::open(&f)
                    .and_then(|mut h| h.read_to_end(&mut buf))
                    .map_err(|e| e.raw_os_error())
            })
        })
        .collect();
    let end = Instant::now() + Duration::from_secs(20);
    for r in readers {
        while !r.is_finished() {
            assert!(Instant::now() < end, "a read of a non-file object hangs");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(r.join().unwrap(), Err(Some(libc::EIO)));
    }
    assert_eq!(fs::read_dir(&mnt).unwrap().count(), 4, "the mount still answers");
    let log = fs::read_to_string(&log).unwrap();
    assert!(log.contains("not a regular file"), "the log names why: {log}");
}

#[test]
fn ostree_style_redirects_are_served_like_the_kernel_does() {
    let _serial = serial();
    require(cannot_test());
    let a = Area::new();
    let store = a.dir("store");
    let data = vec![7u8; 10_000];
    let d = tilefs_image::verity::digest_bytes(&data);
    let hexd = hex::encode(d);
    let rel = format!("{}/{}.file", &hexd[..2], &hexd[2..]);
    fs::create_dir_all(store.join(&hexd[..2])).unwrap();
    fs::write(store.join(&rel), &data).unwrap();
    let dump = format!(
        "/ 4096 40755 2 0 0 0 0.0 - - -\n/f 10000 100644 1 0 0 0 0.0 {rel} - {hexd}\n/escape 10000 100644 1 0 0 0 0.0 ../../etc/passwd - -\n"
    );
    let dump_path = a.path("dump");
    fs::write(&dump_path, dump).unwrap();
    let image = a.path("img");
    tilefs(&[os("build"), os("--from-dump"), dump_path.as_os_str(), image.as_os_str()]);
    for backend in ["--kernel", "--fuse"] {
        let mnt = a.dir(&format!("mnt{backend}"));
        let _u = Mounted(mnt.clone());
        tilefs(&[
            os("mount"),
            os(backend),
            os("--store"),
            store.as_os_str(),
            image.as_os_str(),
            mnt.as_os_str(),
        ]);
        assert_eq!(fs::read(mnt.join("f")).unwrap(), data, "{backend} serves XX/<hex>.file");
        assert!(
            fs::read(mnt.join("escape")).is_err(),
            "{backend} followed a redirect out of the store"
        );
        tilefs(&[os("umount"), mnt.as_os_str()]);
    }

    // The reference dump's own redirects: FUSE looks them up in the store
    // (they are absent here) instead of refusing them as not objects.
    let cs9 = assets_dir().join("cs9-x86_64-developer.dump.gz");
    require((!cs9.exists()).then(|| format!("{} not found: its redirects cannot be tried", cs9.display())));
    let image = a.path("cs9");
    tilefs(&[os("build"), os("--from-dump"), cs9.as_os_str(), image.as_os_str()]);
    let mnt = a.dir("cs9mnt");
    let log = a.path("cs9log");
    let _u = Mounted(mnt.clone());
    tilefs(&[
        os("mount"),
        os("--fuse"),
        os("--log"),
        log.as_os_str(),
        os("--store"),
        store.as_os_str(),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    let dump = tilefs(&[os("dump"), image.as_os_str()]).stdout;
    let file = String::from_utf8_lossy(&dump)
        .lines()
        .find(|l| l.split(' ').nth(8).is_some_and(|p| p.ends_with(".file")))
        .map(|l| l.split(' ').next().unwrap().to_string())
        .expect("an ostree-style redirect in the dump");
    assert!(fs::read(mnt.join(file.trim_start_matches('/'))).is_err());
    let log = fs::read_to_string(&log).unwrap();
    assert!(
        log.contains("cannot open the object") && !log.contains("not a path inside the store"),
        "{log}"
    );
}

#[test]
fn umount_means_umount() {
    let _serial = serial();
    require(cannot_test());
    let a = open_area();
    let (store, image) = privileged_tree(&a);
    let mnt = a.dir("mnt");
    let _u = Mounted(mnt.clone());
    tilefs(&[
        os("mount"),
        os("--fuse"),
        os("--store"),
        store.as_os_str(),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    // A second mount on it is refused, as on the kernel path.
    let out = tilefs_any(&[
        os("mount"),
        os("--fuse"),
        os("--store"),
        store.as_os_str(),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("already a mount point"), "{}", stderr(&out));

    // Busy: refused, still mounted.
    let mut busy = Command::new("sleep").arg("60").current_dir(&mnt).spawn().unwrap();
    let out = tilefs_any(&[os("umount"), mnt.as_os_str()]);
    assert_eq!(out.status.code(), Some(1), "a busy mount was unmounted");
    assert!(
        stderr(&out).contains("busy") && stderr(&out).contains("--lazy"),
        "{}",
        stderr(&out)
    );
    assert!(is_mounted(&mnt));
    busy.kill().unwrap();
    busy.wait().unwrap();

    // Done only when the server is gone.
    let server = server_of(&mnt).expect("the FUSE server");
    let out = tilefs_any(&[os("umount"), mnt.as_os_str()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!is_mounted(&mnt));
    let stat = fs::read_to_string(format!("/proc/{server}/stat")).unwrap_or_default();
    assert!(
        stat.is_empty() || stat.contains(") Z "),
        "the server still runs after umount: {stat}"
    );

    // --lazy detaches a busy mount.
    tilefs(&[
        os("mount"),
        os("--fuse"),
        os("--store"),
        store.as_os_str(),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    let mut busy = Command::new("sleep").arg("60").current_dir(&mnt).spawn().unwrap();
    let out = tilefs_any(&[os("umount"), os("--lazy"), mnt.as_os_str()]);
    busy.kill().unwrap();
    busy.wait().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!is_mounted(&mnt));
}

/// The pid of the FUSE server of the mount at `mnt` (the process holding
/// its lock file, found by the mount's device).
fn server_of(mnt: &Path) -> Option<i32> {
    let want = mnt.as_os_str().to_string_lossy().into_owned();
    for e in fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmd = fs::read(e.path().join("cmdline")).unwrap_or_default();
        let args: Vec<String> = cmd
            .split(|&c| c == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.iter().any(|a| a == "mount") && args.contains(&want) {
            return Some(pid);
        }
    }
    None
}

#[test]
fn builds_check_first_and_clean_up_when_interrupted() {
    let _serial = serial();
    let a = Area::new();
    let src = a.dir("src");
    fs::write(src.join("f"), vec![1u8; 100_000]).unwrap();
    let store = a.path("store");

    // The output's directory is checked before anything is imported: no
    // store is created.
    let out = tilefs_any(&[
        os("build"),
        os("--store"),
        store.as_os_str(),
        src.as_os_str(),
        a.path("no/such/dir/img").as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("no/such/dir"), "{}", stderr(&out));
    assert!(!store.exists(), "a failed build created a store");

    // A store path that is a file says so, in every command.
    let file = a.path("file");
    fs::write(&file, b"x").unwrap();
    for cmd in [
        &["build", "--store", "F", "SRC", "IMG"][..],
        &["fsck", "--store", "F"],
        &["gc", "--store", "F"],
    ] {
        let args: Vec<&OsStr> = cmd
            .iter()
            .map(|&w| match w {
                "F" => file.as_os_str(),
                "SRC" => src.as_os_str(),
                "IMG" => os("/dev/null/img"),
                w => os(w),
            })
            .collect();
        let out = tilefs_any(&args);
        assert_eq!(out.status.code(), Some(1), "{cmd:?}");
        assert!(stderr(&out).contains("not a directory"), "{cmd:?}: {}", stderr(&out));
    }

    // A newline in a name cannot split a message.
    let out = tilefs_any(&[os("build"), a.path("a\nb").as_os_str(), a.path("img").as_os_str()]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stderr(&out).trim_end().lines().count(), 1, "{}", stderr(&out));

    // Usage errors exit 2.
    assert_eq!(tilefs_any(&[os("build"), os("--no-such-flag")]).status.code(), Some(2));

    // SIGINT: temporary files removed, digests kept, exit 130.
    let big = Path::new("/usr");
    let mut child = Command::new(tilefs_bin())
        .args([
            os("build"),
            os("-q"),
            os("--store"),
            store.as_os_str(),
            big.as_os_str(),
            a.path("usr.img").as_os_str(),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Until the import has started writing objects.
    let end = Instant::now() + Duration::from_secs(30);
    while !fs::read_dir(store.join(".tmp")).is_ok_and(|mut d| d.next().is_some()) {
        if child.try_wait().unwrap().is_some() || Instant::now() > end {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    rustix::process::kill_process(rustix::process::Pid::from_child(&child), rustix::process::Signal::INT).unwrap();
    let out = wait_output(child, Duration::from_secs(60));
    // A build that ended before the signal interrupted nothing: the test
    // did not run (its tree is too small to be caught in the middle).
    assert_ne!(
        out.status.code(),
        Some(0),
        "the build of {} ended before SIGINT: nothing was interrupted",
        big.display()
    );
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    assert!(stderr(&out).contains("interrupted"), "{}", stderr(&out));
    assert_eq!(
        fs::read_dir(store.join(".tmp")).unwrap().count(),
        0,
        "temporary files left"
    );
    assert!(store.join(".digest-cache").exists(), "the digest cache was not saved");
    assert!(!a.path("usr.img").exists());
}

#[test]
fn tags_and_stdin_wherever_an_image_goes() {
    let _serial = serial();
    let a = Area::new();
    let src = a.dir("src");
    fs::write(src.join("big"), vec![3u8; 5000]).unwrap();
    fs::write(src.join("other"), vec![4u8; 6000]).unwrap();
    let store = a.path("store");
    let out = tilefs(&[
        os("build"),
        os("--store"),
        store.as_os_str(),
        os("--tag"),
        os("t"),
        src.as_os_str(),
    ]);
    assert!(
        stderr(&out).contains("tagged \"t\""),
        "build --tag says what it did: {}",
        stderr(&out)
    );
    let image = store.join("images/t");
    let with_store = |args: &[&str]| {
        let mut v: Vec<&OsStr> = args.iter().map(|s| os(s)).collect();
        v.insert(1, os("--store"));
        v.insert(2, store.as_os_str());
        tilefs(&v).stdout
    };
    let by_file = |args: &[&OsStr]| tilefs(args).stdout;
    assert_eq!(with_store(&["dump", "t"]), by_file(&[os("dump"), image.as_os_str()]));
    assert_eq!(
        with_store(&["objects", "t"]),
        by_file(&[os("objects"), image.as_os_str()])
    );
    assert!(String::from_utf8_lossy(&with_store(&["info", "t"])).contains("fs-verity digest"));
    let digest = String::from_utf8_lossy(&with_store(&["digest", "t"])).into_owned();
    assert!(
        digest.starts_with("sha256:") && digest.trim_end().ends_with(" t"),
        "{digest}"
    );
    // The default store: $TILEFS_STORE.
    let out = Command::new(tilefs_bin())
        .args(["info", "t"])
        .env("TILEFS_STORE", &store)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    // stdin.
    for cmd in ["dump", "info"] {
        let out = Command::new(tilefs_bin())
            .args([cmd, "-"])
            .stdin(fs::File::open(&image).unwrap())
            .output()
            .unwrap();
        assert!(out.status.success(), "{cmd} -: {}", stderr(&out));
    }
    // Several images.
    let dump2 = with_store(&["dump", "t", "t"]);
    assert_eq!(dump2.len(), 2 * by_file(&[os("dump"), image.as_os_str()]).len());
    assert_eq!(with_store(&["objects", "t", "t"]), with_store(&["objects", "t"]));
}

#[test]
fn gc_keeps_what_is_mounted() {
    let _serial = serial();
    require(cannot_test());
    let a = Area::new();
    let src = a.dir("src");
    fs::write(src.join("f"), vec![9u8; 70_000]).unwrap();
    let store = a.path("store");
    let image = a.path("img");
    // Built by path, tagged nowhere: only the mount protects its objects.
    tilefs(&[
        os("build"),
        os("-q"),
        os("--store"),
        store.as_os_str(),
        src.as_os_str(),
        image.as_os_str(),
    ]);
    for backend in ["--kernel", "--fuse"] {
        let mnt = a.dir(&format!("mnt{backend}"));
        let _u = Mounted(mnt.clone());
        tilefs(&[
            os("mount"),
            os(backend),
            os("--store"),
            store.as_os_str(),
            image.as_os_str(),
            mnt.as_os_str(),
        ]);
        let out = tilefs(&[os("gc"), os("--json"), os("--store"), store.as_os_str()]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            (v["objects_removed"].as_u64(), v["mounts"].as_u64()),
            (Some(0), Some(1)),
            "{backend}: {v}"
        );
        drop_caches();
        assert_eq!(fs::read(mnt.join("f")).unwrap(), vec![9u8; 70_000], "{backend}");
        tilefs(&[os("umount"), mnt.as_os_str()]);
    }
    let out = tilefs(&[os("gc"), os("--json"), os("--store"), store.as_os_str()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["objects_removed"].as_u64(), v["mounts"].as_u64()),
        (Some(1), Some(0)),
        "{v}"
    );
}

fn drop_caches() {
    let _ = fs::write("/proc/sys/vm/drop_caches", "3");
}

#[test]
fn hardlinks_can_be_kept() {
    let _serial = serial();
    let a = Area::new();
    let src = a.dir("src");
    fs::write(src.join("a"), vec![5u8; 1000]).unwrap();
    fs::create_dir(src.join("d")).unwrap();
    fs::hard_link(src.join("a"), src.join("d/b")).unwrap();
    fs::write(src.join("small"), b"tiny").unwrap();
    fs::hard_link(src.join("small"), src.join("small2")).unwrap();
    let plain = a.path("plain");
    let kept = a.path("kept");
    tilefs(&[os("build"), src.as_os_str(), plain.as_os_str()]);
    tilefs(&[os("build"), os("--hardlinks"), src.as_os_str(), kept.as_os_str()]);
    let dump = |img: &Path| String::from_utf8(tilefs(&[os("dump"), img.as_os_str()]).stdout).unwrap();
    let plain_dump = dump(&plain);
    assert!(
        !plain_dump.contains(" @"),
        "hardlinks dropped by default (as mkcomposefs): {plain_dump}"
    );
    let kept_dump = dump(&kept);
    let line = |name: &str| kept_dump.lines().find(|l| l.starts_with(name)).unwrap().to_string();
    assert!(line("/a ").split(' ').nth(3) == Some("2"), "nlink 2: {kept_dump}");
    assert!(line("/d/b ").contains(" @100644 "), "a hardlink line: {kept_dump}");
    assert!(line("/small2 ").contains(" @100644 "), "{kept_dump}");
    let info = String::from_utf8(tilefs(&[os("info"), os("--json"), kept.as_os_str()]).stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(v["hardlinks"], 2, "{info}");
}

#[test]
fn version_completions_and_man_pages() {
    let _serial = serial();
    let v = String::from_utf8(tilefs(&[os("--version")]).stdout).unwrap();
    assert!(v.starts_with("tilefs ") && v.contains('('), "{v}");
    let bash = tilefs(&[os("completions"), os("bash")]).stdout;
    assert!(String::from_utf8_lossy(&bash).contains("tilefs"));
    let a = Area::new();
    let dir = a.path("man");
    tilefs(&[os("man"), dir.as_os_str()]);
    for page in ["tilefs.1", "tilefs-build.1", "tilefs-mount.1"] {
        assert!(fs::metadata(dir.join(page)).is_ok_and(|m| m.len() > 100), "{page}");
    }
}

#[test]
fn kernel_refusals_carry_the_kernels_reason() {
    let _serial = serial();
    require(cannot_test());
    let a = Area::new();
    let src = a.dir("src");
    fs::write(src.join("f"), b"x").unwrap();
    let store = a.path("store");
    let image = a.path("img");
    tilefs(&[
        os("build"),
        os("-q"),
        os("--store"),
        store.as_os_str(),
        src.as_os_str(),
        image.as_os_str(),
    ]);
    // Work on another filesystem than upper: overlayfs refuses, and says
    // why only in the kernel log.
    let other = a.dir("other");
    assert!(Command::new("mount")
        .args(["-t", "tmpfs", "tmpfs"])
        .arg(&other)
        .status()
        .unwrap()
        .success());
    let _t = Mounted(other.clone());
    let work = other.join("work");
    fs::create_dir(&work).unwrap();
    let upper = a.dir("upper");
    let mnt = a.dir("mnt");
    let _u = Mounted(mnt.clone());
    let out = tilefs_any(&[
        os("mount"),
        os("--kernel"),
        os("--upper"),
        upper.as_os_str(),
        os("--work"),
        work.as_os_str(),
        os("--store"),
        store.as_os_str(),
        image.as_os_str(),
        mnt.as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("must reside under the same mount"),
        "{}",
        stderr(&out)
    );
    assert!(!is_mounted(&mnt));
}

#[test]
fn an_image_that_is_a_fifo_does_not_hang_a_mount() {
    let a = Area::new();
    let fifo = a.path("image.cfs");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let store = a.dir("store");
    let mnt = a.dir("mnt");
    for backend in ["--kernel", "--fuse"] {
        let child = Command::new(tilefs_bin())
            .args(["mount", backend, "--store"])
            .arg(&store)
            .arg(&fifo)
            .arg(&mnt)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_output(child, Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(1), "{backend}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("not a regular file"),
            "{backend}: {}",
            stderr(&out)
        );
        assert!(!is_mounted(&mnt));
    }
}
