//! The mount service (`tilefs mountd`), run as root by the test on a socket
//! and policy of its own, with an unprivileged user (uid/gid 65534,
//! "nobody") as the client: kernel mounts of tagged images by policy,
//! always nosuid and nodev, attached only where the caller may, unmounted
//! only for the user they were made for; refusals say which rule refused;
//! garbage, stalled and many clients do not stop the service.

mod common;

use common::*;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use tilefs_mount::mountd::{client, proto};

/// The tests here run one at a time: `unshare -m` in one test copies every
/// mount of the others into its new namespace, and a mount that propagates
/// to such a copy while it is being made can be reported busy.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The mountinfo line of the mount at `mnt`.
fn mount_line(mnt: &Path) -> String {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(mnt.to_str().unwrap()))
        .expect("mounted")
        .to_string()
}

/// A raw connection to the service at `socket`.
fn connect(socket: &Path) -> rustix::fd::OwnedFd {
    let fd = rustix::net::socket(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        None,
    )
    .unwrap();
    rustix::net::connect(&fd, &rustix::net::SocketAddrUnix::new(socket).unwrap()).unwrap();
    fd
}

/// The service, killed when dropped; whatever it mounted goes too.
struct Service {
    child: Child,
    socket: PathBuf,
    mounts: Vec<PathBuf>,
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for m in &self.mounts {
            while is_mounted(m) {
                if rustix::mount::unmount(m, rustix::mount::UnmountFlags::DETACH).is_err() {
                    break;
                }
            }
        }
    }
}

struct Setup {
    area: Area,
    store: PathBuf,
    service: Service,
}

/// A store with a tagged image holding a setuid-root `id` and /dev/zero's
/// device, a policy letting nobody mount it, and the service on it.
fn setup(policy_extra: &str) -> Option<Setup> {
    if let Some(why) = cannot_mount("erofs").or_else(|| cannot_mount("overlay")) {
        eprintln!("skipping: {why}");
        return None;
    }
    let area = Area::new();
    fs::set_permissions(area.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let src = area.dir("src");
    fs::copy("/usr/bin/id", src.join("id")).unwrap();
    fs::set_permissions(src.join("id"), fs::Permissions::from_mode(0o4755)).unwrap();
    assert!(Command::new("mknod")
        .arg(src.join("zero"))
        .args(["c", "1", "5"])
        .status()
        .unwrap()
        .success());
    fs::set_permissions(src.join("zero"), fs::Permissions::from_mode(0o666)).unwrap();
    fs::write(src.join("hello"), b"hello from a delegated mount").unwrap();
    let store = area.path("store");
    for tag in ["os:1", "other"] {
        tilefs(&[
            os("build"),
            os("-q"),
            os("--store"),
            store.as_os_str(),
            os("--tag"),
            os(tag),
            src.as_os_str(),
        ]);
    }
    let policy = area.path("policy.toml");
    fs::write(
        &policy,
        format!(
            "[[store]]\npath = \"{}\"\nusers = [\"nobody\"]\n{policy_extra}",
            store.display()
        ),
    )
    .unwrap();
    let socket = area.path("mountd.sock");
    let child = Command::new(tilefs_bin())
        .args([
            os("mountd"),
            os("--socket"),
            socket.as_os_str(),
            os("--policy"),
            policy.as_os_str(),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let service = Service {
        child,
        socket: socket.clone(),
        mounts: Vec::new(),
    };
    let end = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(Instant::now() < end, "the service did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    Some(Setup { area, store, service })
}

impl Setup {
    /// A mount point owned by nobody.
    fn mountpoint(&mut self, name: &str) -> PathBuf {
        let m = self.area.dir(name);
        give_to_nobody(&m);
        self.service.mounts.push(m.clone());
        m
    }

    /// `prog args` as nobody, with the service's socket; killed after 30 s.
    fn as_nobody(&self, prog: &Path, args: &[&OsStr]) -> Output {
        let mut cmd = Command::new(prog);
        cmd.args(args)
            .env("TILEFS_MOUNTD_SOCKET", &self.service.socket)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = as_nobody(&mut cmd).spawn().unwrap();
        let end = Instant::now() + Duration::from_secs(30);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > end {
                let _ = child.kill();
                panic!("{} {args:?} hangs", prog.display());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        child.wait_with_output().unwrap()
    }

    fn tilefs_as_nobody(&self, args: &[&OsStr]) -> Output {
        self.as_nobody(&tilefs_bin(), args)
    }

    fn mount_as_nobody(&self, image: &str, mnt: &Path, extra: &[&str]) -> Output {
        let mut args = vec![os("mount"), os("--delegated"), os("--store"), self.store.as_os_str()];
        args.extend(extra.iter().map(|s| os(s)));
        args.extend([os(image), mnt.as_os_str()]);
        self.tilefs_as_nobody(&args)
    }

    /// A raw request as root (uid 0, whom the policy does not name).
    fn raw(&self, bytes: &[u8]) -> proto::Reply {
        let fd = connect(&self.service.socket);
        proto::send(&fd, bytes, &[]).unwrap();
        let (reply, _) = proto::recv(&fd).unwrap();
        serde_json::from_slice(&reply).unwrap()
    }
}

#[test]
fn a_user_gets_a_kernel_mount_of_a_trusted_image() {
    let _serial = serial();
    let Some(mut s) = setup("") else { return };
    let mnt = s.mountpoint("mnt");
    let out = s.mount_as_nobody("os:1", &mnt, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let line = mount_line(&mnt);
    assert!(line.contains(" - overlay "), "a kernel mount: {line}");
    assert!(line.contains("nosuid") && line.contains("nodev"), "{line}");
    let cat = s.as_nobody(Path::new("/bin/cat"), &[mnt.join("hello").as_os_str()]);
    assert_eq!(cat.stdout, b"hello from a delegated mount");
    let id = s.as_nobody(&mnt.join("id"), &[os("-u")]);
    assert_eq!(String::from_utf8_lossy(&id.stdout).trim(), "65534", "setuid honoured");
    let dev = s.as_nobody(Path::new("/usr/bin/head"), &[os("-c4"), mnt.join("zero").as_os_str()]);
    assert!(!dev.status.success(), "a device opened");

    // Only for the user it was made for.
    let e = client::umount(&s.service.socket, &mnt, false).unwrap_err().to_string();
    assert!(e.contains("not a mount this service made for you"), "{e}");
    assert!(is_mounted(&mnt));
    // Busy: refused; then unmounted by its user.
    let mut busy = Command::new("sleep").arg("60").current_dir(&mnt).spawn().unwrap();
    let out = s.tilefs_as_nobody(&[os("umount"), mnt.as_os_str()]);
    busy.kill().unwrap();
    busy.wait().unwrap();
    assert!(
        !out.status.success() && stderr(&out).contains("busy"),
        "{}",
        stderr(&out)
    );
    let out = s.tilefs_as_nobody(&[os("umount"), mnt.as_os_str()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!is_mounted(&mnt));

    // Options asked for reach the mount, or are refused.
    let out = s.mount_as_nobody("os:1", &mnt, &["-o", "noexec,nosymfollow"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let line = mount_line(&mnt);
    assert!(line.contains("noexec") && line.contains("nosymfollow"), "{line}");
    let exec = s.as_nobody(Path::new("/bin/sh"), &[os("-c"), mnt.join("id").as_os_str()]);
    assert!(!exec.status.success(), "exec on a noexec mount");
    assert!(s.tilefs_as_nobody(&[os("umount"), mnt.as_os_str()]).status.success());
    let out = s.mount_as_nobody("os:1", &mnt, &["-o", "strictatime"]);
    assert!(
        stderr(&out).contains("access-time options cannot be honoured"),
        "{}",
        stderr(&out)
    );

    // Plain `tilefs mount` without privilege uses the service and says so.
    let out = s.tilefs_as_nobody(&[
        os("mount"),
        os("--store"),
        s.store.as_os_str(),
        os("os:1"),
        mnt.as_os_str(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("mount service"), "{}", stderr(&out));
    let out = s.tilefs_as_nobody(&[os("umount"), mnt.as_os_str()]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn refusals_name_the_rule() {
    let _serial = serial();
    let Some(mut s) = setup(&format!(
        "images = [\"os:1\", \"pinned\"]\n[store.pinned]\n\"pinned\" = \"sha256:{}\"\n",
        "ab".repeat(32)
    )) else {
        return;
    };
    let mnt = s.mountpoint("mnt");
    // A tag the policy does not list.
    let out = s.mount_as_nobody("other", &mnt, &[]);
    assert!(stderr(&out).contains("not among the images"), "{}", stderr(&out));
    // A pinned digest that does not match (the tag does not even exist:
    // a tag is needed first).
    fs::copy(s.store.join("images/os:1"), s.store.join("images/pinned")).unwrap();
    let out = s.mount_as_nobody("pinned", &mnt, &[]);
    assert!(stderr(&out).contains("fs-verity digest"), "{}", stderr(&out));
    // An image by path: the service serves tags only.
    let out = s.mount_as_nobody(s.store.join("images/os:1").to_str().unwrap(), &mnt, &[]);
    assert!(stderr(&out).contains("tagged images only"), "{}", stderr(&out));
    // A mount point the caller does not own, or a symlink to one it does.
    let root_owned = s.area.dir("rootdir");
    s.service.mounts.push(root_owned.clone());
    let out = s.mount_as_nobody("os:1", &root_owned, &[]);
    assert!(stderr(&out).contains("owned by uid 0"), "{}", stderr(&out));
    let link = s.area.path("link");
    std::os::unix::fs::symlink(&mnt, &link).unwrap();
    let out = s.mount_as_nobody("os:1", &link, &[]);
    assert!(stderr(&out).contains("symlink is never followed"), "{}", stderr(&out));
    // suid or dev asked: refused, not ignored.
    let out = s.mount_as_nobody("os:1", &mnt, &["-o", "suid"]);
    assert!(stderr(&out).contains("always nosuid"), "{}", stderr(&out));
    // Writable: not allowed by this policy.
    let up = s.mountpoint("up");
    let wk = s.mountpoint("wk");
    let out = s.mount_as_nobody(
        "os:1",
        &mnt,
        &["--upper", up.to_str().unwrap(), "--work", wk.to_str().unwrap()],
    );
    assert!(stderr(&out).contains("writable"), "{}", stderr(&out));
    assert!(!out.status.success(), "a writable mount was made");
    assert!(!is_mounted(&mnt) && !is_mounted(&root_owned));

    // Raw requests, as root, whom the policy does not name; a store not
    // listed; a tag that escapes; garbage.
    let store = s.store.display().to_string();
    let r = s.raw(format!(r#"{{"op":"mount","store":"{store}","image":"os:1","attach":false}}"#).as_bytes());
    assert!(r.error.unwrap().contains("not among the users"));
    let r = s.raw(br#"{"op":"mount","store":"/etc","image":"os:1","attach":false}"#);
    assert!(r.error.unwrap().contains("not listed in the policy"));
    for garbage in [&b"\x00\x01garbage"[..], b"{}", br#"{"op":"mount","uid":0}"#, b""] {
        let r = s.raw(garbage);
        assert!(!r.ok && r.error.unwrap().contains("malformed"));
    }
}

#[test]
fn stalled_garbage_and_many_clients_do_not_stop_the_service() {
    let _serial = serial();
    let Some(mut s) = setup("") else { return };
    // A client that connects and says nothing; another that leaves.
    let stalled = connect(&s.service.socket);
    drop(connect(&s.service.socket));
    // 50 at once, all answered (refused: root is not in the policy).
    let socket = s.service.socket.clone();
    let store = s.store.display().to_string();
    let threads: Vec<_> = (0..50)
        .map(|_| {
            let socket = socket.clone();
            let store = store.clone();
            std::thread::spawn(move || {
                let fd = connect(&socket);
                let req = format!(r#"{{"op":"mount","store":"{store}","image":"os:1","attach":false}}"#);
                proto::send(&fd, req.as_bytes(), &[]).unwrap();
                let (reply, _) = proto::recv(&fd).unwrap();
                serde_json::from_slice::<proto::Reply>(&reply).unwrap()
            })
        })
        .collect();
    for t in threads {
        let r = t.join().unwrap();
        assert!(!r.ok && r.error.is_some());
    }
    // And the stalled client holds nobody up.
    let mnt = s.mountpoint("mnt");
    let out = s.mount_as_nobody("os:1", &mnt, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = s.tilefs_as_nobody(&[os("umount"), mnt.as_os_str()]);
    assert!(out.status.success(), "{}", stderr(&out));
    drop(stalled);
}

#[test]
fn inside_a_user_namespace_the_mount_is_its_own() {
    let _serial = serial();
    let Some(mut s) = setup("") else { return };
    let mnt = s.mountpoint("mnt");
    let script = format!(
        "{t} mount --delegated --store {st} os:1 {m} && cat {m}/hello && grep -c ' {m} ' /proc/self/mountinfo",
        t = tilefs_bin().display(),
        st = s.store.display(),
        m = mnt.display()
    );
    let out = s.as_nobody(
        Path::new("/usr/bin/unshare"),
        &[os("-Urm"), os("sh"), os("-c"), os(&script)],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("hello from a delegated mount"), "{text}");
    assert!(!is_mounted(&mnt), "visible outside the user's namespace");
}

#[test]
fn writable_mounts_write_as_the_caller() {
    let _serial = serial();
    let Some(mut s) = setup("writable = true\n") else {
        return;
    };
    let mnt = s.mountpoint("mnt");
    let upper = s.mountpoint("upper");
    let work = s.mountpoint("work");
    // Layers the caller does not own are refused.
    let root_work = s.area.dir("rootwork");
    let out = s.mount_as_nobody(
        "os:1",
        &mnt,
        &[
            "--upper",
            upper.to_str().unwrap(),
            "--work",
            root_work.to_str().unwrap(),
        ],
    );
    assert!(
        stderr(&out).contains("work directory is owned by uid 0"),
        "{}",
        stderr(&out)
    );
    assert!(!is_mounted(&mnt));

    let out = s.mount_as_nobody(
        "os:1",
        &mnt,
        &["--upper", upper.to_str().unwrap(), "--work", work.to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let sh = |script: &str| s.as_nobody(Path::new("/bin/sh"), &[os("-c"), os(script)]);
    let m = mnt.display();
    assert!(sh(&format!("echo new > {m}/new && rm {m}/hello")).status.success());
    // The root-owned setuid binary stays out of the user's reach.
    assert!(!sh(&format!("echo x >> {m}/id")).status.success());
    let new = fs::metadata(upper.join("new")).unwrap();
    assert_eq!(
        (
            std::os::unix::fs::MetadataExt::uid(&new),
            std::os::unix::fs::MetadataExt::gid(&new)
        ),
        (NOBODY, NOBODY),
        "written with the caller's ids"
    );
    let wh = fs::symlink_metadata(upper.join("hello")).unwrap();
    assert!(
        std::os::unix::fs::FileTypeExt::is_char_device(&wh.file_type()),
        "a whiteout"
    );
    let out = s.tilefs_as_nobody(&[os("umount"), mnt.as_os_str()]);
    assert!(out.status.success(), "{}", stderr(&out));
}
