//! The mount service (`tilefs mountd`), run as root by the test on a socket
//! and policy of its own, with unprivileged users (uid/gid 65534 "nobody",
//! and uid 1 "daemon") as its clients: kernel mounts of tagged images by
//! policy, always nosuid and nodev, attached only where the caller may,
//! unmounted only for the user they were made for; and the attacks a
//! hostile local user tried on it, each refused.

mod common;
#[path = "mountd/stalling_fuse.rs"]
mod stalling_fuse;

use common::*;
use rustix::fd::OwnedFd;
use stalling_fuse::StallingFuse;
use std::ffi::OsStr;
use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tilefs_mount::mountd::proto;

const SECRET: &[u8] = b"root's secret, mode 0600, long enough (over 64 bytes) to be an object of the store\n";
const PRIVATE: &[u8] = b"a 0644 file in a 0700 root directory\n";
const DAEMON: u32 = 1;

/// A raw connection to the service at `socket`.
fn connect(socket: &Path) -> OwnedFd {
    let fd = rustix::net::socket(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        None,
    )
    .unwrap();
    rustix::net::connect(&fd, &rustix::net::SocketAddrUnix::new(socket).unwrap()).unwrap();
    fd
}

/// Runs `f` on a thread of its own whose credentials are `uid`/`gid`: the
/// kernel keeps credentials per thread, so a connection it makes carries
/// them (SO_PEERCRED), and its opens are checked against them.
fn on_thread_as<T: Send>(uid: u32, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            let gid = rustix::process::Gid::from_raw(uid);
            rustix::thread::set_thread_groups(&[gid]).unwrap();
            rustix::thread::set_thread_res_gid(gid, gid, gid).unwrap();
            let u = rustix::process::Uid::from_raw(uid);
            rustix::thread::set_thread_res_uid(u, u, u).unwrap();
            f()
        })
        .join()
        .unwrap()
    })
}

/// Asks the service as `uid`, on a thread with that user's credentials:
/// `bytes`, with the directories `dirs` opened as the client opens them;
/// None when no reply came within `wait`.
fn ask_as(uid: u32, socket: &Path, bytes: &[u8], dirs: &[&Path], wait: Duration) -> Option<proto::Reply> {
    on_thread_as(uid, || {
        use rustix::fs::{Mode, OFlags};
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fds: Vec<OwnedFd> = dirs
            .iter()
            .map(|d| rustix::fs::open(*d, flags, Mode::empty()).unwrap())
            .collect();
        let fd = connect(socket);
        rustix::net::sockopt::set_socket_timeout(&fd, rustix::net::sockopt::Timeout::Recv, Some(wait)).unwrap();
        let _ = proto::send(&fd, bytes, &fds);
        let (reply, _) = proto::recv(&fd).ok()?;
        Some(serde_json::from_slice(&reply).unwrap())
    })
}

/// Sends `bytes` with `fds` and reads the reply (the service may answer
/// before it reads, so a failed send is not the end).
fn exchange(socket: &Path, bytes: &[u8], fds: &[OwnedFd]) -> proto::Reply {
    let fd = connect(socket);
    let _ = proto::send(&fd, bytes, fds);
    let (reply, _) = proto::recv(&fd).unwrap();
    serde_json::from_slice(&reply).unwrap()
}

/// The service, killed when dropped; whatever it mounted goes too.
struct Service {
    child: Child,
    socket: PathBuf,
    mounts: Vec<Mounted>,
    /// What it logged so far.
    log: Arc<Mutex<String>>,
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // (Then its mounts go, as the fields are dropped.)
    }
}

impl Service {
    /// Starts `cmd` (the service) and waits for its socket.
    fn start(mut cmd: Command, socket: &Path) -> Service {
        let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (stderr, sink) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let end = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("the service exited ({st}): {}", log.lock().unwrap());
            }
            assert!(Instant::now() < end, "the service did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        Service {
            child,
            socket: socket.to_path_buf(),
            mounts: Vec::new(),
            log,
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits (10 s at most) until `what` is in `n` lines of the log.
    fn wait_for_log(&self, what: &str, n: usize) {
        let end = Instant::now() + Duration::from_secs(10);
        while self.log().lines().filter(|l| l.contains(what)).count() < n {
            assert!(Instant::now() < end, "no {n} lines with {what:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

struct Setup {
    area: Area,
    store: PathBuf,
    policy: PathBuf,
    service: Service,
}

/// A store with a tagged image holding what a hostile user would want:
/// a setuid-root `id`, /dev/zero's device, a root-only file, a 0644 file
/// in a 0700 directory; a file of nobody's own; a policy letting nobody
/// (and daemon) mount it; and the service on it.
fn setup(policy_extra: &str) -> Setup {
    setup_with(policy_extra, &[])
}

/// [`setup`], the service started with `args` besides.
fn setup_with(policy_extra: &str, args: &[&str]) -> Setup {
    require(cannot_mount("erofs").or_else(|| cannot_mount("overlay")));
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
    fs::create_dir_all(src.join("srv/private")).unwrap();
    fs::write(src.join("srv/private/file"), PRIVATE).unwrap();
    fs::set_permissions(src.join("srv/private"), fs::Permissions::from_mode(0o700)).unwrap();
    fs::create_dir(src.join("root")).unwrap();
    fs::write(src.join("root/secret.txt"), SECRET).unwrap();
    fs::set_permissions(src.join("root/secret.txt"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::write(src.join("own"), b"nobody's own file in the image\n").unwrap();
    give_to_nobody(&src.join("own"));
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
            "[[store]]\npath = \"{}\"\nusers = [\"nobody\", \"daemon\"]\n{policy_extra}",
            store.display()
        ),
    )
    .unwrap();
    let socket = area.path("mountd.sock");
    let mut cmd = Command::new(tilefs_bin());
    cmd.args([
        os("mountd"),
        os("--socket"),
        socket.as_os_str(),
        os("--policy"),
        policy.as_os_str(),
    ]);
    cmd.args(args);
    let service = Service::start(cmd, &socket);
    Setup {
        area,
        store,
        policy,
        service,
    }
}

impl Setup {
    /// A mount point owned by `uid`.
    fn mountpoint_of(&mut self, name: &str, uid: u32) -> PathBuf {
        let m = self.area.dir(name);
        rustix::fs::chown(
            &m,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(uid)),
        )
        .unwrap();
        self.service.mounts.push(Mounted(m.clone()));
        m
    }

    /// A mount point owned by nobody.
    fn mountpoint(&mut self, name: &str) -> PathBuf {
        self.mountpoint_of(name, NOBODY)
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

    fn sh_as_nobody(&self, script: &str) -> Output {
        self.as_nobody(Path::new("/bin/sh"), &[os("-c"), os(script)])
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

    fn writable_as_nobody(&self, mnt: &Path, upper: &Path, work: &Path) -> Output {
        self.mount_as_nobody(
            "os:1",
            mnt,
            &["--upper", upper.to_str().unwrap(), "--work", work.to_str().unwrap()],
        )
    }

    fn umount_as_nobody(&self, mnt: &Path) -> Output {
        self.tilefs_as_nobody(&[os("umount"), mnt.as_os_str()])
    }

    /// A mount request of os:1 as raw JSON, with `attach` and `upper` as given.
    fn request(&self, attach: bool, upper: bool) -> String {
        format!(
            r#"{{"op":"mount","store":"{}","image":"os:1","attach":{attach},"upper":{upper}}}"#,
            self.store.display()
        )
    }
}

fn ok(out: &Output) {
    assert!(out.status.success(), "{}", stderr(out));
}

fn refused(out: &Output, why: &str) {
    assert!(!out.status.success(), "not refused (wanted: {why})");
    assert!(stderr(out).contains(why), "wanted {why:?}, got: {}", stderr(out));
}

#[test]
fn a_user_gets_a_kernel_mount_of_a_trusted_image() {
    let _serial = serial();
    let mut s = setup("");
    let mnt = s.mountpoint("mnt");
    let out = s.mount_as_nobody("os:1", &mnt, &[]);
    ok(&out);
    let line = mount_line(&mnt).expect("mounted");
    assert!(line.contains(" - overlay "), "a kernel mount: {line}");
    assert!(line.contains("nosuid") && line.contains("nodev"), "{line}");
    let cat = s.as_nobody(Path::new("/bin/cat"), &[mnt.join("hello").as_os_str()]);
    assert_eq!(cat.stdout, b"hello from a delegated mount");
    let id = s.as_nobody(&mnt.join("id"), &[os("-u")]);
    assert_eq!(String::from_utf8_lossy(&id.stdout).trim(), "65534", "setuid honoured");
    let dev = s.as_nobody(Path::new("/usr/bin/head"), &[os("-c4"), mnt.join("zero").as_os_str()]);
    assert!(!dev.status.success(), "a device opened");
    // The image's permissions hold for its user.
    let secret = s.sh_as_nobody(&format!("cat {}/root/secret.txt", mnt.display()));
    assert!(!secret.status.success() && secret.stdout.is_empty());

    // Only for the user it was made for (daemon is allowed the store too).
    let target = rustix::fs::open(&mnt, rustix::fs::OFlags::PATH, rustix::fs::Mode::empty()).unwrap();
    let r = on_thread_as(DAEMON, || exchange(&s.service.socket, br#"{"op":"umount"}"#, &[target]));
    assert!(
        r.error
            .as_deref()
            .unwrap_or_default()
            .contains("not a mount this service made for you"),
        "{r:?}"
    );
    assert!(is_mounted(&mnt));
    // Busy: refused, saying what holds it; then unmounted by its user.
    let mut busy = Command::new("sleep").arg("60").current_dir(&mnt).spawn().unwrap();
    let out = s.umount_as_nobody(&mnt);
    busy.kill().unwrap();
    busy.wait().unwrap();
    refused(&out, "busy (the working directory of process");
    assert!(is_mounted(&mnt));
    let held = fs::File::open(mnt.join("hello")).unwrap();
    refused(&s.umount_as_nobody(&mnt), "busy (an open file of process");
    drop(held);
    ok(&s.umount_as_nobody(&mnt));
    assert!(!is_mounted(&mnt));
    // --lazy unmounts whatever holds it.
    ok(&s.mount_as_nobody("os:1", &mnt, &[]));
    let held = fs::File::open(mnt.join("hello")).unwrap();
    ok(&s.tilefs_as_nobody(&[os("umount"), os("--lazy"), mnt.as_os_str()]));
    assert!(!is_mounted(&mnt));
    drop(held);

    // Options asked for reach the mount, or are refused.
    let out = s.mount_as_nobody("os:1", &mnt, &["-o", "noexec,nosymfollow"]);
    ok(&out);
    let line = mount_line(&mnt).expect("mounted");
    assert!(line.contains("noexec") && line.contains("nosymfollow"), "{line}");
    let exec = s.as_nobody(Path::new("/bin/sh"), &[os("-c"), mnt.join("id").as_os_str()]);
    assert!(!exec.status.success(), "exec on a noexec mount");
    ok(&s.umount_as_nobody(&mnt));
    let out = s.mount_as_nobody("os:1", &mnt, &["-o", "strictatime"]);
    refused(&out, "access-time options cannot be honoured");

    // Plain `tilefs mount` without privilege uses the service and says so.
    let out = s.tilefs_as_nobody(&[
        os("mount"),
        os("--store"),
        s.store.as_os_str(),
        os("os:1"),
        mnt.as_os_str(),
    ]);
    ok(&out);
    assert!(stderr(&out).contains("mount service"), "{}", stderr(&out));
    // Mounting again on it: it is already a mount point, whoever owns its root.
    refused(&s.mount_as_nobody("os:1", &mnt, &[]), "already a mount point");
    ok(&s.umount_as_nobody(&mnt));
    let log = s.service.log();
    assert!(log.contains("mounted os:1") && log.contains("unmounted mount"), "{log}");
}

#[test]
fn refusals_name_the_rule() {
    let _serial = serial();
    let mut s = setup(&format!(
        "images = [\"os:1\", \"pinned\"]\n[store.pinned]\n\"pinned\" = \"sha256:{}\"\n",
        "ab".repeat(32)
    ));
    let mnt = s.mountpoint("mnt");
    // A tag the policy does not list.
    refused(&s.mount_as_nobody("other", &mnt, &[]), "not among the images");
    // A pinned digest that does not match.
    fs::copy(s.store.join("images/os:1"), s.store.join("images/pinned")).unwrap();
    refused(&s.mount_as_nobody("pinned", &mnt, &[]), "fs-verity digest");
    // An image by path: the service serves tags only.
    let by_path = s.store.join("images/os:1");
    refused(
        &s.mount_as_nobody(by_path.to_str().unwrap(), &mnt, &[]),
        "tagged images only",
    );
    // A mount point the caller does not own, or a symlink to one it does.
    let root_owned = s.area.dir("rootdir");
    s.service.mounts.push(Mounted(root_owned.clone()));
    refused(&s.mount_as_nobody("os:1", &root_owned, &[]), "owned by uid 0");
    let link = s.area.path("link");
    std::os::unix::fs::symlink(&mnt, &link).unwrap();
    refused(&s.mount_as_nobody("os:1", &link, &[]), "symlink is never followed");
    // suid or dev asked: refused, not ignored.
    refused(&s.mount_as_nobody("os:1", &mnt, &["-o", "suid"]), "always nosuid");
    // Writable: not allowed by this policy.
    let up = s.mountpoint("up");
    let wk = s.mountpoint("wk");
    refused(&s.writable_as_nobody(&mnt, &up, &wk), "writable");
    assert!(!is_mounted(&mnt) && !is_mounted(&root_owned));

    // Raw requests: a store not listed; garbage; an oversized request.
    let store = s.store.display().to_string();
    let socket = s.service.socket.clone();
    let r = on_thread_as(NOBODY, || {
        exchange(
            &socket,
            br#"{"op":"mount","store":"/etc","image":"os:1","attach":true}"#,
            &[],
        )
    });
    assert!(r.error.unwrap().contains("not listed in the policy"));
    for garbage in [&b"\x00\x01garbage"[..], b"{}", br#"{"op":"mount","uid":0}"#, b""] {
        let r = on_thread_as(NOBODY, || exchange(&socket, garbage, &[]));
        assert!(!r.ok && r.error.unwrap().contains("malformed"));
    }
    let big = format!(r#"{{"op":"mount","store":"{store}","image":"{}"}}"#, "x".repeat(20_000));
    let r = on_thread_as(NOBODY, || exchange(&socket, big.as_bytes(), &[]));
    assert!(
        r.error.unwrap().contains("larger than"),
        "an oversized request is answered"
    );
    // Root is not in the policy: turned away before anything is read, and
    // told so without the policy's list of users.
    let r = exchange(&socket, s.request(true, false).as_bytes(), &[]);
    let e = r.error.unwrap();
    assert!(
        e.contains("uid 0 may not use this mount service") && !e.contains("nobody"),
        "{e}"
    );
}

/// Item 1a of the hostile probe: a directory the caller made in its upper
/// before mounting must not open the image's 0700 directory under it.
/// Item 1b: a file the caller moved in its upper between mounts must not
/// read the root-only file whose name it took.
#[test]
fn a_writable_mount_keeps_the_images_permissions() {
    let _serial = serial();
    let mut s = setup("writable = true\n");
    let mnt = s.mountpoint("mnt");
    let upper = s.mountpoint("upper");
    let work = s.mountpoint("work");
    let m = mnt.display().to_string();
    let u = upper.display().to_string();
    // (a) The upper's own directory over the image's 0700 one.
    ok(&s.sh_as_nobody(&format!("mkdir -p {u}/srv/private")));
    ok(&s.writable_as_nobody(&mnt, &upper, &work));
    let line = mount_line(&mnt).expect("mounted");
    assert!(
        line.contains("userxattr") && line.contains("nosuid") && line.contains("nodev"),
        "{line}"
    );
    let read = s.sh_as_nobody(&format!("cat {m}/srv/private/file; ls {m}/srv/private"));
    assert!(
        !String::from_utf8_lossy(&read.stdout).contains("0644 file"),
        "read a 0700 directory's file"
    );
    assert!(!read.status.success(), "listed a 0700 directory");
    // (b) chmod of the caller's own file, then its upper copy moved to the
    // name of the root-only file.
    ok(&s.sh_as_nobody(&format!("chmod 600 {m}/own && echo mine >> {m}/own")));
    let secret = s.sh_as_nobody(&format!("cat {m}/root/secret.txt"));
    assert!(!secret.status.success() && secret.stdout.is_empty());
    ok(&s.umount_as_nobody(&mnt));
    ok(&s.sh_as_nobody(&format!("mkdir -p {u}/root && mv {u}/own {u}/root/secret.txt")));
    ok(&s.writable_as_nobody(&mnt, &upper, &work));
    let moved = s.sh_as_nobody(&format!("cat {m}/root/secret.txt"));
    assert!(
        !String::from_utf8_lossy(&moved.stdout).contains("secret"),
        "the root-only file was read: {}",
        String::from_utf8_lossy(&moved.stdout)
    );
    // And through the image's own name, never.
    let direct = s.sh_as_nobody(&format!("cat {m}/srv/private/file"));
    assert!(direct.stdout.is_empty());
    ok(&s.umount_as_nobody(&mnt));
}

#[test]
fn writable_mounts_write_as_the_caller() {
    let _serial = serial();
    let mut s = setup("writable = true\n");
    let mnt = s.mountpoint("mnt");
    let upper = s.mountpoint("upper");
    let work = s.mountpoint("work");
    // Layers the caller does not own are refused.
    let root_work = s.area.dir("rootwork");
    refused(
        &s.writable_as_nobody(&mnt, &upper, &root_work),
        "work directory is owned by uid 0",
    );
    assert!(!is_mounted(&mnt));

    ok(&s.writable_as_nobody(&mnt, &upper, &work));
    let m = mnt.display();
    ok(&s.sh_as_nobody(&format!("echo new > {m}/new && rm {m}/hello && echo more >> {m}/own")));
    // The root-owned setuid binary stays out of the user's reach.
    assert!(!s.sh_as_nobody(&format!("echo x >> {m}/id")).status.success());
    let new = fs::metadata(upper.join("new")).unwrap();
    assert_eq!(
        (new.uid(), new.gid()),
        (NOBODY, NOBODY),
        "written with the caller's ids"
    );
    let wh = fs::symlink_metadata(upper.join("hello")).unwrap();
    assert!(
        std::os::unix::fs::FileTypeExt::is_char_device(&wh.file_type()),
        "a whiteout"
    );
    // Only user.* overlay attributes: nothing the caller could not write.
    let xattrs = xattrs(&upper.join("own"));
    assert!(
        xattrs.keys().all(|k| !k.to_string_lossy().starts_with("trusted.")),
        "{xattrs:?}"
    );
    ok(&s.umount_as_nobody(&mnt));
    // What was written is there on the next mount.
    ok(&s.writable_as_nobody(&mnt, &upper, &work));
    let out = s.sh_as_nobody(&format!("cat {m}/new {m}/own; test -e {m}/hello || echo gone"));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "new\nnobody's own file in the image\nmore\ngone\n"
    );
    ok(&s.umount_as_nobody(&mnt));
}

/// Item 2: mount points on pseudo filesystems, not writable by the caller,
/// or under a directory the caller cannot search.
#[test]
fn mount_points_the_caller_could_not_use_are_refused() {
    let _serial = serial();
    let mut s = setup("writable = true\n");
    // The caller's own /proc/PID directory.
    let mut sleeper = Command::new("sleep");
    sleeper.arg("60");
    let mut sleeper = as_nobody(&mut sleeper).spawn().unwrap();
    let proc_dir = PathBuf::from(format!("/proc/{}", sleeper.id()));
    assert_eq!(fs::metadata(&proc_dir).unwrap().uid(), NOBODY);
    s.service.mounts.push(Mounted(proc_dir.clone()));
    let out = s.mount_as_nobody("os:1", &proc_dir, &[]);
    let upper = s.mountpoint("upper");
    let work = s.mountpoint("work");
    let out_w = s.writable_as_nobody(&proc_dir, &upper, &work);
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    refused(&out, "on a proc filesystem");
    refused(&out_w, "on a proc filesystem");
    // A directory of the caller's on devtmpfs and on a cgroup filesystem.
    for (dir, fstype) in [
        (PathBuf::from("/dev/tilefs-mountd-test"), "devtmpfs"),
        (PathBuf::from("/sys/fs/cgroup/cpu/tilefs-mountd-test"), "cgroup"),
    ] {
        if fs::create_dir(&dir).is_err() {
            eprintln!("note: cannot make {} here; not tried", dir.display());
            continue;
        }
        give_to_nobody(&dir);
        s.service.mounts.push(Mounted(dir.clone()));
        let out = s.mount_as_nobody("os:1", &dir, &[]);
        let _ = fs::remove_dir(&dir);
        refused(&out, &format!("on a {fstype} filesystem"));
    }
    // Owned but not writable by the caller.
    let ro = s.mountpoint("ro");
    fs::set_permissions(&ro, fs::Permissions::from_mode(0o555)).unwrap();
    refused(&s.mount_as_nobody("os:1", &ro, &[]), "may write to");
    // A descriptor opened while the parent was searchable, sent after root
    // made it 0700.
    let parent = s.area.dir("closed");
    fs::set_permissions(&parent, fs::Permissions::from_mode(0o755)).unwrap();
    let inner = parent.join("mnt");
    fs::create_dir(&inner).unwrap();
    give_to_nobody(&inner);
    s.service.mounts.push(Mounted(inner.clone()));
    let socket = s.service.socket.clone();
    let req = s.request(true, false);
    let fd = on_thread_as(NOBODY, || {
        rustix::fs::open(
            &inner,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .unwrap()
    });
    fs::set_permissions(&parent, fs::Permissions::from_mode(0o700)).unwrap();
    let r = on_thread_as(NOBODY, || exchange(&socket, req.as_bytes(), &[fd]));
    assert!(
        r.error
            .as_deref()
            .unwrap_or_default()
            .contains("not searchable by the caller"),
        "{r:?}"
    );
    assert!(!is_mounted(&inner));
}

/// Item 7: a stale descriptor of a directory something was mounted on
/// since; a detached mount asked for from the initial namespace.
#[test]
fn stale_descriptors_and_detached_mounts_in_the_initial_namespace_are_refused() {
    let _serial = serial();
    let mut s = setup("");
    let mnt = s.mountpoint("mnt");
    let socket = s.service.socket.clone();
    let req = s.request(true, false);
    let stale = on_thread_as(NOBODY, || {
        rustix::fs::open(
            &mnt,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .unwrap()
    });
    ok(&s.mount_as_nobody("os:1", &mnt, &[]));
    let r = on_thread_as(NOBODY, || exchange(&socket, req.as_bytes(), &[stale]));
    assert!(
        r.error
            .as_deref()
            .unwrap_or_default()
            .contains("covered by another mount"),
        "{r:?}"
    );
    let stacked = mounts_at(&mnt).len();
    assert_eq!(stacked, 1, "a second mount was stacked");
    ok(&s.umount_as_nobody(&mnt));
    // A detached mount for a caller in the initial user namespace.
    let r = on_thread_as(NOBODY, || exchange(&socket, s.request(false, false).as_bytes(), &[]));
    assert!(
        r.error
            .as_deref()
            .unwrap_or_default()
            .contains("user namespace of its own"),
        "{r:?}"
    );
}

/// Item 3 and the usability items: in the caller's own user and mount
/// namespace (`unshare -Urm`), the mount's flags are locked (no remount
/// with suid or dev, no device opens), and writable mounts work there.
#[test]
fn inside_a_user_namespace_the_mount_is_its_own_and_locked() {
    let _serial = serial();
    let mut s = setup("writable = true\n");
    let mnt = s.mountpoint("mnt");
    let upper = s.mountpoint("upper");
    let work = s.mountpoint("work");
    let script = format!(
        "set -x; {t} mount --delegated --store {st} os:1 {m} && cat {m}/hello && grep -c ' {m} ' /proc/self/mountinfo \
         && if mount -o remount,bind,suid,dev {m}; then echo REMOUNTED; fi \
         && if head -c4 {m}/zero >/dev/null; then echo DEVICE; fi \
         && {t} umount {m} \
         && {t} mount --delegated --store {st} --upper {u} --work {w} os:1 {m} \
         && echo written > {m}/new && cat {m}/new \
         && if mount -o remount,bind,suid,dev {m}; then echo REMOUNTED; fi \
         && if head -c4 {m}/zero >/dev/null; then echo DEVICE; fi \
         && umount {m}",
        t = tilefs_bin().display(),
        st = s.store.display(),
        m = mnt.display(),
        u = upper.display(),
        w = work.display(),
    );
    let out = s.as_nobody(
        Path::new("/usr/bin/unshare"),
        &[os("-Urm"), os("sh"), os("-c"), os(&script)],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    assert!(text.contains("hello from a delegated mount"), "{text}");
    assert!(!text.contains("REMOUNTED"), "the flags are not locked: {text}");
    assert!(!text.contains("DEVICE"), "a device of the image opened: {text}");
    assert!(text.contains("written"), "{text}");
    assert!(!is_mounted(&mnt), "visible outside the user's namespace");
    assert_eq!(fs::read(upper.join("new")).unwrap(), b"written\n");
    let log = s.service.log();
    assert!(log.contains("for its own namespace"), "not logged: {log}");
}

/// Item 6: idle connections of users the policy does not name take no
/// slot; one user cannot take every slot; a user's live mounts are
/// limited; accept errors (out of descriptors) are waited out.
#[test]
fn no_user_can_deny_the_service_to_others() {
    let _serial = serial();
    let mut s = setup("");
    // With a limit of two live mounts a user.
    s.service.child.kill().unwrap();
    s.service.child.wait().unwrap();
    fs::write(
        &s.policy,
        format!(
            "max_mounts_per_user = 2\n[[store]]\npath = \"{}\"\nusers = [\"nobody\", \"daemon\"]\n",
            s.store.display()
        ),
    )
    .unwrap();
    let _ = fs::remove_file(&s.service.socket);
    let mut cmd = Command::new(tilefs_bin());
    cmd.args([
        os("mountd"),
        os("--socket"),
        s.service.socket.as_os_str(),
        os("--policy"),
        s.policy.as_os_str(),
    ]);
    let mounts = std::mem::take(&mut s.service.mounts);
    s.service = Service::start(cmd, &s.service.socket.clone());
    s.service.mounts = mounts;
    let socket = s.service.socket.clone();
    let connect_as =
        |uid: u32, n: usize| -> Vec<OwnedFd> { on_thread_as(uid, || (0..n).map(|_| connect(&socket)).collect()) };

    // An unlisted user (uid 4242) with 100 connections: each is answered at
    // once and holds nothing.
    let unlisted = connect_as(4242, 100);
    for fd in &unlisted {
        let (bytes, _) = proto::recv(fd).unwrap();
        let r: proto::Reply = serde_json::from_slice(&bytes).unwrap();
        assert!(r.error.unwrap().contains("uid 4242 may not use this mount service"));
    }
    drop(unlisted);
    // A listed user holding idle connections gets "busy" past its share,
    // while another user is served.
    let idle = connect_as(DAEMON, 4);
    std::thread::sleep(Duration::from_millis(300));
    let r = on_thread_as(DAEMON, || exchange(&socket, s.request(true, false).as_bytes(), &[]));
    assert!(r.error.as_deref().unwrap_or_default().contains("busy"), "{r:?}");
    drop(idle);
    let mnt = s.mountpoint("mnt");
    ok(&s.mount_as_nobody("os:1", &mnt, &[]));
    // Out of descriptors: the service waits, then serves what queued up.
    // (The idle connections are held for 5 s at most: all this is quick.)
    let more_idle = connect_as(NOBODY, 2);
    std::thread::sleep(Duration::from_millis(300));
    let pid = s.service.child.id();
    let open = fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    // The soft limit only: raising a hard limit again needs more than root
    // may have in a container.
    let limit = format!("--nofile={open}:");
    assert!(Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &limit])
        .status()
        .unwrap()
        .success());
    let mnt2 = s.mountpoint("mnt2");
    let waiting = {
        let (store, mnt2) = (s.store.clone(), mnt2.clone());
        let socket = socket.clone();
        std::thread::spawn(move || {
            let mut cmd = Command::new(tilefs_bin());
            cmd.args([
                os("mount"),
                os("--delegated"),
                os("--store"),
                store.as_os_str(),
                os("os:1"),
                mnt2.as_os_str(),
            ])
            .env("TILEFS_MOUNTD_SOCKET", &socket);
            as_nobody(&mut cmd).output().unwrap()
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    assert!(!is_mounted(&mnt2), "served beyond the descriptor limit");
    assert!(Command::new("prlimit")
        .args(["--pid", &pid.to_string(), "--nofile=1024:"])
        .status()
        .unwrap()
        .success());
    drop(more_idle);
    ok(&waiting.join().unwrap());
    // Turned away at accept, or for the descriptors the request carried.
    let log = s.service.log();
    assert!(
        log.contains("waiting for resources") || log.contains("no descriptors left") || log.contains("busy: "),
        "{log}"
    );
    // Two live mounts at most.
    let mnt3 = s.mountpoint("mnt3");
    refused(&s.mount_as_nobody("os:1", &mnt3, &[]), "the most the policy allows");
    ok(&s.umount_as_nobody(&mnt2));
    ok(&s.mount_as_nobody("os:1", &mnt3, &[]));
    for m in [&mnt, &mnt3] {
        ok(&s.umount_as_nobody(m));
    }
}

/// Item 8: a client's strings cannot forge lines of the service's log.
#[test]
fn the_log_escapes_what_clients_send() {
    let _serial = serial();
    let s = setup("");
    let socket = s.service.socket.clone();
    let req = br#"{"op":"mount","store":"/x\nFORGED: uid 0 mounted everything","image":"a","attach":true}"#;
    let r = on_thread_as(NOBODY, || exchange(&socket, req, &[]));
    assert!(!r.ok);
    std::thread::sleep(Duration::from_millis(200));
    let log = s.service.log();
    assert!(log.contains("\\nFORGED"), "{log}");
    assert!(!log.lines().any(|l| l.starts_with("FORGED")), "{log}");
}

/// SIGTERM: the service says so, removes its socket and exits at once.
#[test]
fn sigterm_ends_the_service_cleanly() {
    let _serial = serial();
    let mut s = setup("");
    let t = Instant::now();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(s.service.child.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let st = s.service.child.wait().unwrap();
    assert!(st.success(), "{st}");
    assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
    assert!(!s.service.socket.exists(), "the socket file was left behind");
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        s.service.log().contains("shutting down (SIGTERM)"),
        "{}",
        s.service.log()
    );
}

/// The service under contrib/systemd's sandbox (capability bounding set,
/// system call filter, namespace restrictions, no new privileges, umask),
/// applied by scripts/unit-sandbox: read-only and writable mounts work.
#[test]
fn the_systemd_units_sandbox_lets_the_service_work() {
    let _serial = serial();
    let mut s = setup("writable = true\n");
    s.service.child.kill().unwrap();
    s.service.child.wait().unwrap();
    let _ = fs::remove_file(&s.service.socket);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut cmd = Command::new(root.join("scripts/unit-sandbox"));
    cmd.arg(root.join("contrib/systemd/tilefs-mountd.service"))
        .arg("--")
        .arg(tilefs_bin())
        .args([
            os("mountd"),
            os("--socket"),
            s.service.socket.as_os_str(),
            os("--policy"),
            s.policy.as_os_str(),
        ]);
    let mounts = std::mem::take(&mut s.service.mounts);
    s.service = Service::start(cmd, &s.service.socket.clone());
    s.service.mounts = mounts;
    let mnt = s.mountpoint("mnt");
    let upper = s.mountpoint("upper");
    let work = s.mountpoint("work");
    ok(&s.mount_as_nobody("os:1", &mnt, &[]));
    ok(&s.umount_as_nobody(&mnt));
    ok(&s.writable_as_nobody(&mnt, &upper, &work));
    ok(&s.sh_as_nobody(&format!("echo x > {}/new", mnt.display())));
    ok(&s.umount_as_nobody(&mnt));
    let log = s.service.log();
    assert!(log.contains("unit-sandbox: applied"), "{log}");
}

/// Item 4: a store root made holds the contents of root-only files: other
/// users cannot read its objects or images, they get the image through the
/// service with its permissions; fsck warns about a store others can read.
#[test]
fn a_roots_store_is_roots_alone() {
    let _serial = serial();
    let mut s = setup("");
    let st = fs::metadata(&s.store).unwrap();
    assert_eq!(st.mode() & 0o777, 0o700, "a new store's mode");
    let secret_object = {
        let dump = tilefs(&[os("dump"), s.store.join("images/os:1").as_os_str()]);
        let line = String::from_utf8_lossy(&dump.stdout)
            .lines()
            .find(|l| l.starts_with("/root/secret.txt "))
            .map(str::to_string)
            .unwrap();
        s.store.join(line.split(' ').nth(8).unwrap())
    };
    assert_eq!(
        fs::read(&secret_object).unwrap(),
        SECRET,
        "the object holds the root-only file"
    );
    let store = s.store.display().to_string();
    for attack in [
        format!("cat {}", secret_object.display()),
        format!("find {store} -type f"),
        format!("{} dump --store {store} os:1", tilefs_bin().display()),
    ] {
        let out = s.sh_as_nobody(&attack);
        assert!(
            !out.status.success(),
            "{attack}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(!String::from_utf8_lossy(&out.stdout).contains("secret"), "{attack}");
    }
    // Through the service, the image with its permissions.
    let mnt = s.mountpoint("mnt");
    ok(&s.mount_as_nobody("os:1", &mnt, &[]));
    let out = s.sh_as_nobody(&format!("cat {0}/hello; cat {0}/root/secret.txt", mnt.display()));
    assert_eq!(out.stdout, b"hello from a delegated mount");
    ok(&s.umount_as_nobody(&mnt));
    // A store opened up: fsck says so (and stays clean: it is not damage).
    let clean = tilefs(&[os("fsck"), os("--store"), s.store.as_os_str()]);
    assert!(!String::from_utf8_lossy(&clean.stdout).contains("warning"));
    fs::set_permissions(&s.store, fs::Permissions::from_mode(0o755)).unwrap();
    let out = tilefs(&[os("fsck"), os("--store"), s.store.as_os_str()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("warning:") && text.contains("every local user can read"),
        "{text}"
    );
}

/// A store whose rule names a signature policy: the service mounts only
/// images that policy accepts, judged by the record the checked pull kept
/// (an image built in place has none), and an edit of the policy applies
/// to the next mount.
#[test]
fn the_signature_policy_decides_what_the_service_mounts() {
    let _serial = serial();
    let keep = Area::new();
    let layout = keep.dir("layout");
    oci_layout(&layout, "a", "a pulled image");
    let sig_policy = keep.path("policy.json");
    let accept_layout = format!(
        r#"{{"default":[{{"type":"reject"}}],"transports":{{"oci":{{"{}":[{{"type":"insecureAcceptAnything"}}]}}}}}}"#,
        layout.display()
    );
    fs::write(&sig_policy, &accept_layout).unwrap();
    let mut s = setup(&format!("signature_policy = \"{}\"\n", sig_policy.display()));
    tilefs(&[
        os("pull"),
        os("-q"),
        os("--store"),
        s.store.as_os_str(),
        os("--signature-policy"),
        sig_policy.as_os_str(),
        os("--tag"),
        os("pulled"),
        os(&format!("oci:{}:a", layout.display())),
    ]);
    let mnt = s.mountpoint("mnt");
    // Built in the store, never checked: refused.
    refused(
        &s.mount_as_nobody("os:1", &mnt, &[]),
        "no record of a signature policy check",
    );
    // Pulled under the policy: mounted.
    ok(&s.mount_as_nobody("pulled", &mnt, &[]));
    let cat = s.as_nobody(Path::new("/bin/cat"), &[mnt.join("usr/seed").as_os_str()]);
    assert_eq!(cat.stdout, b"a pulled image");
    ok(&s.umount_as_nobody(&mnt));
    // The policy now refuses it: so does the service, naming the image,
    // the scope and why.
    fs::write(&sig_policy, r#"{"default":[{"type":"reject"}]}"#).unwrap();
    let out = s.mount_as_nobody("pulled", &mnt, &[]);
    refused(&out, "refused by the signature policy");
    assert!(
        stderr(&out).contains(&layout.display().to_string()) && stderr(&out).contains("global default"),
        "{}",
        stderr(&out)
    );
    // Accepted again as soon as the policy accepts it.
    fs::write(&sig_policy, &accept_layout).unwrap();
    ok(&s.mount_as_nobody("pulled", &mnt, &[]));
    ok(&s.umount_as_nobody(&mnt));
    assert!(!is_mounted(&mnt));

    // A record where others may write (a careless chmod), or written by
    // the user: the pulled image's record under the unchecked image's name
    // must not pass for a check of it.
    let trust = s.store.join(".trust");
    let record = fs::read_dir(&trust).unwrap().flatten().next().unwrap().path();
    let digest = |tag: &str| {
        let out = tilefs(&[os("digest"), os("--store"), s.store.as_os_str(), os(tag)]);
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap()
            .trim_start_matches("sha256:")
            .to_string()
    };
    let forged = trust.join(format!("{}.json", digest("os:1")));
    fs::copy(&record, &forged).unwrap();
    fs::set_permissions(&trust, fs::Permissions::from_mode(0o777)).unwrap();
    refused(&s.mount_as_nobody("os:1", &mnt, &[]), "is not root's alone");
    fs::set_permissions(&trust, fs::Permissions::from_mode(0o755)).unwrap();
    give_to_nobody(&forged);
    refused(&s.mount_as_nobody("os:1", &mnt, &[]), "is not root's alone");
    // Root's own record of the image it checked still serves.
    ok(&s.mount_as_nobody("pulled", &mnt, &[]));
    ok(&s.umount_as_nobody(&mnt));
    assert!(!is_mounted(&mnt));
}

/// A child killed (and reaped) when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Issue 43, item 5: a user's FUSE directory that stops answering once
/// the service's first checks of it have passed, sent as a mount point
/// (and a process of the user's sitting in it). Requests waiting on it
/// hold up no one else's (a mount and an unmount, which looks at every
/// process's directories), each is answered at its deadline, the user has
/// at most 4 of them in flight (the fifth is told the service is busy),
/// and none is carried out when the directory answers again.
#[test]
fn a_mount_point_that_stops_answering_holds_up_no_one_else() {
    let _serial = serial();
    require(cannot_fuse());
    let mut s = setup_with("", &["--request-timeout", "5"]);
    let fuse = StallingFuse::mount(&s.area.dir("fuse"), NOBODY);
    let sub = fuse.sub();
    let _sitting = Killed(
        as_nobody(Command::new("sleep").arg("600").current_dir(&fuse.root))
            .spawn()
            .unwrap(),
    );
    fuse.arm();
    let socket = s.service.socket.clone();
    let request = s.request(true, false);
    let ask = |uid: u32, dir: &Path| ask_as(uid, &socket, request.as_bytes(), &[dir], Duration::from_secs(20));
    let daemons = s.mountpoint_of("daemons", DAEMON);
    std::thread::scope(|sc| {
        let first = sc.spawn(|| s.mount_as_nobody("os:1", &sub, &[]));
        fuse.wait_held(1);
        let more: Vec<_> = (0..3).map(|_| sc.spawn(|| ask(NOBODY, &sub))).collect();
        fuse.wait_held(4);
        // The user's fifth request: busy, not queued.
        let r = ask(NOBODY, &sub).expect("a reply");
        assert!(r.busy, "{r:?}");
        // Another user is served meanwhile: a mount, and an unmount that
        // checks it is not in use.
        let r = ask(DAEMON, &daemons).expect("another user's request was held up");
        assert!(r.ok, "{r:?}");
        assert!(is_mounted(&daemons));
        let r = ask_as(
            DAEMON,
            &socket,
            br#"{"op":"umount"}"#,
            &[&daemons],
            Duration::from_secs(20),
        )
        .expect("another user's unmount was held up");
        assert!(r.ok, "{r:?}");
        assert!(!is_mounted(&daemons));
        // ... before the stalled ones were refused, at their deadline.
        assert!(!first.is_finished() && more.iter().all(|m| !m.is_finished()));
        refused(&first.join().unwrap(), "did not finish within 5s");
        for m in more {
            let r = m.join().unwrap().expect("no reply at the deadline");
            assert!(r.error.unwrap_or_default().contains("did not finish within 5s"));
        }
    });
    // The directory answers again: what waited on it ends, and nothing is
    // attached there for a client long gone.
    fuse.release();
    s.service.wait_for_log("ended after its client was answered", 4);
    assert!(!is_mounted(&sub), "mounted for a request refused at its deadline");
    // Its threads ended, the user is served again (there too).
    ok(&s.mount_as_nobody("os:1", &sub, &[]));
    ok(&s.umount_as_nobody(&sub));
}

/// Issue 43, item 5: a request whose client hangs up before its mount is
/// attached is not carried out, even when what held it up answers again.
#[test]
fn a_request_whose_client_hung_up_is_not_carried_out() {
    let _serial = serial();
    require(cannot_fuse());
    let s = setup("");
    let fuse = StallingFuse::mount(&s.area.dir("fuse"), NOBODY);
    fuse.arm();
    let sub = fuse.sub();
    let socket = s.service.socket.clone();
    let conn = on_thread_as(NOBODY, || {
        let fd = connect(&socket);
        let dir = rustix::fs::open(&sub, rustix::fs::OFlags::PATH, rustix::fs::Mode::empty()).unwrap();
        proto::send(&fd, s.request(true, false).as_bytes(), &[dir]).unwrap();
        fd
    });
    fuse.wait_held(1);
    drop(conn);
    s.service.wait_for_log("the client hung up", 1);
    fuse.release();
    s.service.wait_for_log("ended after its client was answered", 1);
    assert!(!is_mounted(&sub), "mounted for a client that hung up");
}

/// The counts in a line of turned-away connections ("...: 3 of ..., 2 idle ...").
fn counted(line: &str) -> u64 {
    let counts = line.rsplit(": ").next().unwrap_or_default();
    counts
        .split(", ")
        .filter_map(|part| part.split(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Issue 43, item 6: connections turned away before they ask anything
/// (of users the policy does not name, beyond a user's share, idle past
/// 5 s) are counted and logged in one line a minute at most; what was
/// counted since is in the shutdown's line.
#[test]
fn turned_away_connections_are_logged_once_a_minute_in_all() {
    let _serial = serial();
    let mut s = setup("");
    let socket = s.service.socket.clone();
    let connect_as =
        |uid: u32, n: usize| -> Vec<OwnedFd> { on_thread_as(uid, || (0..n).map(|_| connect(&socket)).collect()) };
    let answered = |fds: &[OwnedFd]| {
        for fd in fds {
            proto::recv(fd).unwrap();
        }
    };
    let unlisted = connect_as(4242, 50);
    answered(&unlisted);
    let idle = connect_as(NOBODY, 4);
    std::thread::sleep(Duration::from_millis(300));
    let beyond = connect_as(NOBODY, 6);
    answered(&beyond);
    // The idle ones are dropped after 5 s.
    for fd in &idle {
        let _ = rustix::net::sockopt::set_socket_timeout(
            fd,
            rustix::net::sockopt::Timeout::Recv,
            Some(Duration::from_secs(10)),
        );
        assert_eq!(proto::recv(fd).map(|(b, _)| b.len()), Ok(0), "not dropped");
    }
    std::thread::sleep(Duration::from_millis(200));
    let log = s.service.log();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("connections turned away")).collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(!log.contains("not a user the policy names"), "{log}");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(s.service.child.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    s.service.child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let log = s.service.log();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("connections turned away")).collect();
    assert_eq!(lines.len(), 2, "{log}");
    assert!(lines[1].contains("shutting down (SIGTERM)"), "{log}");
    assert!(
        lines[1].contains("of users the policy does not name (uid 4242)") && lines[1].contains("idle"),
        "{log}"
    );
    assert_eq!(lines.iter().map(|l| counted(l)).sum::<u64>(), 60, "{log}");
}

/// Issue 43, item 5: the service reads a file it trusts (its policy, a
/// store's signature policy) only if root alone could have written it:
/// not through a symlink (here to a file the user may write), not one
/// others may write, named in the error with the reason; and a signature
/// policy replaced by a symlink at run time is refused at the next mount.
#[test]
fn the_service_reads_only_files_root_alone_could_write() {
    let _serial = serial();
    let keep = Area::new();
    fs::set_permissions(keep.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let accept = r#"{"default":[{"type":"insecureAcceptAnything"}]}"#;
    let roots = keep.path("policy.json");
    fs::write(&roots, accept).unwrap();
    let users = keep.path("users.json");
    fs::write(&users, accept).unwrap();
    give_to_nobody(&users);
    let link = keep.path("link.json");
    std::os::unix::fs::symlink(&roots, &link).unwrap();
    let mut s = setup(&format!("signature_policy = \"{}\"\n", roots.display()));
    let start = |policy_extra: &str| {
        let text = format!(
            "[[store]]\npath = \"{}\"\nusers = [\"nobody\"]\n{policy_extra}",
            s.store.display()
        );
        fs::write(&s.policy, text).unwrap();
        // A service that starts is a failure: stopped after 10 s.
        let mut cmd = Command::new(tilefs_bin());
        cmd.args([
            os("mountd"),
            os("--socket"),
            s.area.path("other.sock").as_os_str(),
            os("--policy"),
            s.policy.as_os_str(),
        ]);
        let mut child = Killed(cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap());
        let end = Instant::now() + Duration::from_secs(10);
        while child.0.try_wait().unwrap().is_none() {
            assert!(Instant::now() < end, "the service started on a file it cannot trust");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut err = Vec::new();
        child.0.stderr.take().unwrap().read_to_end(&mut err).unwrap();
        Output {
            status: child.0.wait().unwrap(),
            stdout: Vec::new(),
            stderr: err,
        }
    };
    for (sp, why) in [(&link, "is a symlink"), (&users, "is not root's alone (uid 65534")] {
        let out = start(&format!("signature_policy = \"{}\"\n", sp.display()));
        refused(&out, why);
        assert!(stderr(&out).contains(&sp.display().to_string()), "{}", stderr(&out));
    }
    // The policy itself, where others may write it.
    fs::set_permissions(&s.policy, fs::Permissions::from_mode(0o666)).unwrap();
    let out = start("");
    refused(&out, "is not root's alone");
    assert!(
        stderr(&out).contains(&s.policy.display().to_string()),
        "{}",
        stderr(&out)
    );
    // At run time: the signature policy is read at each request.
    let mnt = s.mountpoint("mnt");
    refused(
        &s.mount_as_nobody("os:1", &mnt, &[]),
        "no record of a signature policy check",
    );
    fs::remove_file(&roots).unwrap();
    std::os::unix::fs::symlink(&users, &roots).unwrap();
    let out = s.mount_as_nobody("os:1", &mnt, &[]);
    refused(&out, "is a symlink");
    assert!(stderr(&out).contains(&roots.display().to_string()), "{}", stderr(&out));
    assert!(!is_mounted(&mnt));
}

/// A delegated mount keeps its image's objects whatever root does to the
/// tags (`tilefs untag` of every tag of them, then `tilefs gc`): one the
/// service attached for its caller, and one it handed over to a caller in
/// a user and mount namespace of its own (`unshare -Urm`), attached there,
/// where gc (here) cannot see it by path. Once that namespace is gone, so
/// is its root; unmounted, so is the other's.
#[test]
fn a_delegated_mount_keeps_its_image_through_untag_and_gc() {
    let _serial = serial();
    let mut s = setup("");
    let gc = |store: &Path| -> serde_json::Value {
        let out = tilefs(&[os("gc"), os("--json"), os("--store"), store.as_os_str()]);
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let counts = |r: &serde_json::Value| (r["objects_removed"].as_u64().unwrap(), r["mounts"].as_u64().unwrap());
    let here = s.mountpoint("here");
    ok(&s.mount_as_nobody("os:1", &here, &[]));
    // In its own namespaces, the caller mounts, says so, and reads the
    // file once it gets a line.
    let there = s.mountpoint("there");
    let script = format!(
        "{t} mount --delegated --store {st} os:1 {m} && echo mounted && read go && cat {m}/hello",
        t = tilefs_bin().display(),
        st = s.store.display(),
        m = there.display(),
    );
    let mut cmd = Command::new("unshare");
    cmd.args(["-Urm", "sh", "-c", &script])
        .env("TILEFS_MOUNTD_SOCKET", &s.service.socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    struct Reap(Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut sh = Reap(as_nobody(&mut cmd).spawn().unwrap());
    let mut lines = BufReader::new(sh.0.stdout.take().unwrap()).lines();
    assert_eq!(
        lines.next().and_then(Result::ok).as_deref(),
        Some("mounted"),
        "{}",
        s.service.log()
    );
    assert!(!is_mounted(&there), "the namespace's mount is visible here");
    for tag in ["os:1", "other"] {
        tilefs(&[os("untag"), os("--store"), s.store.as_os_str(), os(tag)]);
    }
    let r = gc(&s.store);
    assert_eq!(counts(&r), (0, 2), "{r}");
    let _ = fs::write("/proc/sys/vm/drop_caches", "3");
    let cat = s.as_nobody(Path::new("/bin/cat"), &[here.join("hello").as_os_str()]);
    assert_eq!(cat.stdout, b"hello from a delegated mount");
    std::io::Write::write_all(sh.0.stdin.as_mut().unwrap(), b"go\n").unwrap();
    assert_eq!(
        lines.next().and_then(Result::ok).as_deref(),
        Some("hello from a delegated mount")
    );
    assert!(sh.0.wait().unwrap().success());
    // That namespace gone, one mount keeps the objects; unmounted, none.
    assert_eq!(counts(&gc(&s.store)), (0, 1));
    ok(&s.umount_as_nobody(&here));
    let r = gc(&s.store);
    assert!(r["objects_removed"].as_u64().unwrap() > 0 && r["mounts"] == 0, "{r}");
}
