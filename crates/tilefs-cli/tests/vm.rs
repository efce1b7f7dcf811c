//! Virtual machines on tilefs images: `tilefs serve --vhost-user` serves
//! an image to QEMU (`vhost-user-fs-pci`), which boots Debian's own kernel
//! (linux-image-amd64) with a busybox initramfs built here.
//!
//! - The guest mounts the tag and prints what it sees: a listing and
//!   SHA-256s (compared with the tree the image was built from), the
//!   output of programs of the image, EIO for the one file whose object
//!   was tampered with (while the rest reads), and its writes, which the
//!   host then finds in the upper directory and the guest sees again after
//!   a remount.
//! - A VMM killed (SIGKILL) after its guest wrote and synced loses nothing
//!   of the upper directory, and the server answers the next VMM, whose
//!   guest boots with the image as its root (`root=TAG
//!   rootfstype=virtiofs`, switched to from the initramfs).
//! - A lazily pulled image whose registry stalls: the read waiting for the
//!   fetch holds up only itself, other files read meanwhile.
//!
//! The accelerator: KVM when /dev/kvm opens and a probe guest boots under
//! it within `TILEFS_VM_KVM_WAIT` seconds (default 20), else TCG (on this
//! machine's kind /dev/kvm exists but QEMU aborts, "failed to set MSR
//! 0x10a"); `TILEFS_VM_ACCEL=tcg|kvm` forces one. Each test says which
//! ran. QEMU and the servers are killed however a test ends.
//!
//! Needs qemu-system-x86, linux-image-amd64 and busybox-static
//! (scripts/setup installs them), and docker-registry for the lazy image;
//! the tests fail without them.

mod common;

use common::oci::{build_tag, pull, push, tree};
use common::registry::{Gate, Registry};
use common::*;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

const TAG: &str = "tilefs";

/// A child killed (and reaped) when dropped.
struct Killed(Option<Child>);

impl Killed {
    fn running(&mut self) -> bool {
        self.0.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The guest kernel: Debian's newest in /boot, and its modules.
fn guest_kernel() -> Option<(PathBuf, PathBuf)> {
    let mut kernels: Vec<PathBuf> = fs::read_dir("/boot")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .collect();
    kernels.sort();
    let k = kernels.pop()?;
    let ver = k.file_name()?.to_string_lossy().strip_prefix("vmlinuz-")?.to_string();
    let modules = PathBuf::from("/lib/modules").join(ver);
    modules.join("modules.dep").exists().then_some((k, modules))
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_string_lossy()
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// Why the test cannot run here, if it cannot.
fn cannot_test() -> Option<String> {
    if which("qemu-system-x86_64").is_none() {
        return Some("no qemu-system-x86_64 (qemu-system-x86)".into());
    }
    if guest_kernel().is_none() {
        return Some("no kernel in /boot with modules (linux-image-amd64)".into());
    }
    if busybox().is_none() {
        return Some("no static busybox (busybox-static)".into());
    }
    None
}

fn busybox() -> Option<PathBuf> {
    ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// `modules` and what they need, in the order to load them (modules.dep).
fn modules_in_order(moddir: &Path, wanted: &[&str]) -> Vec<PathBuf> {
    let dep = fs::read_to_string(moddir.join("modules.dep")).unwrap();
    let deps: BTreeMap<String, Vec<String>> = dep
        .lines()
        .filter_map(|l| {
            let (m, d) = l.split_once(':')?;
            Some((m.to_string(), d.split_whitespace().map(str::to_string).collect()))
        })
        .collect();
    let mut order: Vec<String> = Vec::new();
    for w in wanted {
        let m = deps
            .keys()
            .find(|k| {
                let base = Path::new(k).file_name().unwrap().to_string_lossy().to_string();
                base == format!("{w}.ko") || base.starts_with(&format!("{w}.ko."))
            })
            .unwrap_or_else(|| panic!("module {w} not in modules.dep"))
            .clone();
        // modules.dep lists dependencies so that the last loads first.
        for d in deps[&m].iter().rev().chain(std::iter::once(&m)) {
            if !order.contains(d) {
                order.push(d.clone());
            }
        }
    }
    order.into_iter().map(|m| moddir.join(m)).collect()
}

/// A cpio archive (newc) of `entries`: (path, mode, contents or link target).
fn cpio(entries: &[(String, u32, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut put = |name: &str, mode: u32, data: &[u8], ino: usize| {
        let hdr = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        out.extend_from_slice(hdr.as_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        while out.len() % 4 != 0 {
            out.push(0);
        }
        out.extend_from_slice(data);
        while out.len() % 4 != 0 {
            out.push(0);
        }
    };
    for (i, (name, mode, data)) in entries.iter().enumerate() {
        put(name, *mode, data, i + 1);
    }
    put("TRAILER!!!", 0, &[], 0);
    out
}

/// The start of every guest's /init: busybox's applets, /proc, /sys,
/// /dev and the modules virtio-fs needs (Debian builds it as a module).
const INIT_START: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /mnt
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules); do insmod /lib/modules/$m || echo "TILEFS-VM: insmod $m failed"; done
echo "TILEFS-VM: booted"
"#;

/// Mounts the tag on /mnt (the device may show up a moment after the
/// modules load).
const MOUNT: &str = r#"n=0
until mount -t virtiofs TAG /mnt; do
    n=$((n+1)); [ $n -gt 20 ] && break; sleep 1
done
grep virtiofs /proc/mounts | sed 's/^/TILEFS-VM: mounted /'
"#;

/// The first test's guest: prints what it sees between markers, writes,
/// remounts, powers off.
const CHECKS: &str = r#"cd /mnt
echo "TILEFS-VM: begin list"
for t in f d l; do find . -type $t | sed "s/^/$t /"; done | sort
echo "TILEFS-VM: end list"
echo "TILEFS-VM: begin sums"
find . -type f ! -name victim | sort | xargs sha256sum
echo "TILEFS-VM: end sums"
echo "TILEFS-VM: link $(readlink link)"
echo "TILEFS-VM: script $(./bin/hello.sh arg1)"
echo "TILEFS-VM: busybox $(./bin/busybox echo from-the-image)"
cat victim > /dev/null 2>/tmp/err; echo "TILEFS-VM: victim $? $(cat /tmp/err)"
echo "TILEFS-VM: after-victim $(sha256sum data/blob3 | cut -d' ' -f1)"
mkdir newdir && echo "written in the guest" > newdir/newfile
echo "appended" >> hello.txt
rm data/blob0
dd if=/dev/zero of=big bs=65536 count=48 2>/dev/null
sync
cd /
umount /mnt || echo "TILEFS-VM: umount failed"
mount -t virtiofs TAG /mnt || echo "TILEFS-VM: remount failed"
echo "TILEFS-VM: remount $(cat /mnt/newdir/newfile) | $(tail -n1 /mnt/hello.txt) | $(ls /mnt/data/blob0 2>&1 | grep -c 'No such') | $(wc -c < /mnt/big)"
umount /mnt
echo "TILEFS-VM: done"
poweroff -f
"#;

/// An initramfs's /init as a distribution's does it: the root named on
/// the kernel's command line (`root=TAG rootfstype=virtiofs`) mounted and
/// switched to, its /sbin/init run as pid 1.
const SWITCH_ROOT: &str = r#"for a in $(cat /proc/cmdline); do
    case $a in root=*) root=${a#root=};; rootfstype=*) fstype=${a#rootfstype=};; esac
done
mkdir -p /root
n=0
until mount -t "$fstype" "$root" /root; do
    n=$((n+1)); [ $n -gt 20 ] && break; sleep 1
done
umount /proc /sys
mount --move /dev /root/dev 2>/dev/null || umount /dev
exec switch_root /root /sbin/init
"#;

fn make_initramfs(dir: &Path, name: &str, init: &str) -> PathBuf {
    let (_, moddir) = guest_kernel().unwrap();
    let mods = modules_in_order(&moddir, &["virtio_pci", "virtiofs"]);
    let mut entries: Vec<(String, u32, Vec<u8>)> = vec![
        ("bin".into(), 0o040755, vec![]),
        ("lib".into(), 0o040755, vec![]),
        ("lib/modules".into(), 0o040755, vec![]),
        ("tmp".into(), 0o041777, vec![]),
        ("bin/busybox".into(), 0o100755, fs::read(busybox().unwrap()).unwrap()),
        ("init".into(), 0o100755, init.replace("TAG", TAG).into_bytes()),
    ];
    let mut names = Vec::new();
    for m in &mods {
        let name = m.file_name().unwrap().to_string_lossy().to_string();
        assert!(name.ends_with(".ko"), "compressed module {name}: not supported here");
        entries.push((format!("lib/modules/{name}"), 0o100644, fs::read(m).unwrap()));
        names.push(name);
    }
    entries.push(("modules".into(), 0o100644, names.join(" ").into_bytes()));
    let p = dir.join(format!("{name}.cpio"));
    fs::write(&p, cpio(&entries)).unwrap();
    p
}

/// The image's tree: files inline and external (one of them run as a
/// script, a static busybox run as a program), a symlink, directories.
fn make_tree(src: &Path) {
    fs::create_dir_all(src.join("data")).unwrap();
    fs::create_dir_all(src.join("bin")).unwrap();
    fs::create_dir_all(src.join("empty/deeper")).unwrap();
    fs::write(src.join("hello.txt"), b"hello from tilefs\n").unwrap();
    let mut rng = Rng::new(30);
    for i in 0..8 {
        let n = [10usize, 4096, 5000, 65536, 200_000, 1 << 20, 3 << 20, 777][i];
        fs::write(src.join(format!("data/blob{i}")), rng.bytes(n)).unwrap();
    }
    fs::write(src.join("victim"), rng.bytes(50_000)).unwrap();
    fs::write(src.join("bin/hello.sh"), b"#!/bin/sh\necho \"script ran with $1\"\n").unwrap();
    fs::set_permissions(src.join("bin/hello.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::copy(busybox().unwrap(), src.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("hello.txt", src.join("link")).unwrap();
}

/// What the guest should list: `f ./x`, `d ./y`, `l ./z`, sorted.
fn expected_listing(src: &Path) -> Vec<String> {
    fn walk(root: &Path, rel: &str, out: &mut Vec<String>) {
        for e in fs::read_dir(root.join(rel)).unwrap() {
            let e = e.unwrap();
            let name = format!("{rel}/{}", e.file_name().to_string_lossy());
            let t = e.file_type().unwrap();
            let k = if t.is_symlink() {
                "l"
            } else if t.is_dir() {
                "d"
            } else {
                "f"
            };
            out.push(format!("{k} {name}"));
            if t.is_dir() {
                walk(root, &name, out);
            }
        }
    }
    let mut out = vec!["d .".to_string()];
    walk(src, ".", &mut out);
    out.sort();
    out
}

fn sha256_hex(p: &Path) -> String {
    hex(&Sha256::digest(fs::read(p).unwrap()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Lines between `TILEFS-VM: begin WHAT` and `... end WHAT`.
fn section(console: &str, what: &str) -> Vec<String> {
    let (b, e) = (format!("TILEFS-VM: begin {what}"), format!("TILEFS-VM: end {what}"));
    console
        .lines()
        .map(|l| l.trim_end_matches('\r'))
        .skip_while(|l| !l.ends_with(&b))
        .skip(1)
        .take_while(|l| !l.ends_with(&e))
        .map(str::to_string)
        .collect()
}

fn line<'a>(console: &'a str, key: &str) -> Option<&'a str> {
    let k = format!("TILEFS-VM: {key} ");
    console
        .lines()
        .find_map(|l| l.trim_end_matches('\r').split_once(&k).map(|(_, v)| v))
}

fn kvm_usable() -> bool {
    fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_ok()
}

/// The accelerator the guests run under: forced, else KVM if a probe
/// guest (no virtio-fs) boots under it in time, else TCG. Probed once per
/// test process.
fn accel() -> &'static str {
    static ACCEL: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    ACCEL.get_or_init(|| {
        match std::env::var("TILEFS_VM_ACCEL").ok().as_deref() {
            Some("kvm") => return "kvm",
            Some("tcg") => return "tcg",
            Some(other) => panic!("TILEFS_VM_ACCEL={other}: kvm or tcg"),
            None => {}
        }
        if !kvm_usable() {
            eprintln!("accelerator: tcg (/dev/kvm does not open)");
            return "tcg";
        }
        let wait = std::env::var("TILEFS_VM_KVM_WAIT")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(20);
        let dir = tempfile::tempdir().unwrap();
        let init = format!("{INIT_START}echo \"TILEFS-VM: done\"\npoweroff -f\n");
        let initramfs = make_initramfs(dir.path(), "probe", &init);
        let mut vm = Vm::start(dir.path(), "probe", "kvm", None, &initramfs, "");
        match vm.wait_for("TILEFS-VM: done", Duration::from_secs(wait)) {
            Ok(_) => {
                eprintln!("accelerator: kvm");
                "kvm"
            }
            Err(c) => {
                let tail: String = c.lines().rev().take(3).collect::<Vec<_>>().join(" / ");
                eprintln!("accelerator: tcg (a guest did not boot under KVM within {wait}s: {tail})");
                "tcg"
            }
        }
    })
}

/// A QEMU guest, killed when dropped; its console goes to a file.
struct Vm {
    qemu: Killed,
    console: PathBuf,
    start: Instant,
    name: String,
}

impl Vm {
    /// Boots Debian's kernel with `initramfs`, the kernel command line
    /// `append` added, and (with `socket`) a vhost-user-fs device of tag
    /// TAG served on it.
    fn start(dir: &Path, name: &str, accel: &str, socket: Option<&Path>, initramfs: &Path, append: &str) -> Vm {
        let (kernel, _) = guest_kernel().unwrap();
        let console = dir.join(format!("console-{name}.log"));
        let _ = fs::remove_file(&console);
        let mem = "512M";
        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args(["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
            .args(["-machine", &format!("q35,accel={accel}")])
            .args(["-cpu", if accel == "kvm" { "host" } else { "max" }])
            .args(["-smp", "1", "-m", mem])
            .args(["-object", &format!("memory-backend-memfd,id=mem,size={mem},share=on")])
            .args(["-numa", "node,memdev=mem"]);
        if let Some(socket) = socket {
            cmd.arg("-chardev")
                .arg(format!("socket,id=fs0,path={}", socket.display()))
                .args(["-device", &format!("vhost-user-fs-pci,chardev=fs0,tag={TAG}")]);
        }
        cmd.arg("-kernel")
            .arg(&kernel)
            .arg("-initrd")
            .arg(initramfs)
            .args(["-append", &format!("console=ttyS0 panic=-1 quiet loglevel=3 {append}")])
            .arg("-serial")
            .arg(format!("file:{}", console.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        Vm {
            qemu: Killed(Some(cmd.spawn().expect("starting qemu"))),
            console,
            start: Instant::now(),
            name: name.to_string(),
        }
    }

    fn console(&self) -> String {
        fs::read_to_string(&self.console).unwrap_or_default()
    }

    /// Waits until the console shows `marker`: Ok(console), or
    /// Err(console and why) when QEMU exits first or `limit` passes.
    fn wait_for(&mut self, marker: &str, limit: Duration) -> Result<String, String> {
        let end = Instant::now() + limit;
        loop {
            let c = self.console();
            if c.contains(marker) {
                return Ok(c);
            }
            if !self.qemu.running() {
                let mut err = String::new();
                if let Some(e) = self.qemu.0.as_mut().and_then(|c| c.stderr.as_mut()) {
                    let _ = std::io::Read::read_to_string(e, &mut err);
                }
                // The console may have been written just before the exit.
                let c = self.console();
                if c.contains(marker) {
                    return Ok(c);
                }
                return Err(format!("{c}\n[qemu exited; stderr]\n{err}"));
            }
            if Instant::now() > end {
                return Err(format!("{c}\n[no {marker:?} after {:?}]", self.start.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits for the guest to power off after printing `TILEFS-VM: done`.
    fn finish(&mut self, limit: Duration) -> Result<String, String> {
        let c = self.wait_for("TILEFS-VM: done", limit)?;
        let end = Instant::now() + Duration::from_secs(60);
        while self.qemu.running() {
            if Instant::now() > end {
                return Err(format!("{c}\n[qemu did not exit after the guest powered off]"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!(
            "{}: the guest ran {:.1}s",
            self.name,
            self.start.elapsed().as_secs_f64()
        );
        Ok(self.console())
    }

    /// SIGKILL, as a VMM that dies.
    fn kill(&mut self) {
        if let Some(c) = self.qemu.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `tilefs serve --vhost-user SOCKET ARGS...`, killed when dropped, once
/// its socket is there.
/// `image` of `store` served writable over `upper` and `work`.
fn serve_writable(socket: &Path, log: &Path, store: &Path, (upper, work): (&Path, &Path), image: &Path) -> Killed {
    serve(
        socket,
        log,
        &[
            os("--store"),
            store.as_os_str(),
            os("--upper"),
            upper.as_os_str(),
            os("--work"),
            work.as_os_str(),
            image.as_os_str(),
        ],
    )
}

fn serve(socket: &Path, log: &Path, args: &[&std::ffi::OsStr]) -> Killed {
    let mut server = Killed(Some(
        Command::new(tilefs_bin())
            .args(["serve", "--vhost-user"])
            .arg(socket)
            .arg("--log")
            .arg(log)
            .args(args)
            .stdin(Stdio::null())
            .spawn()
            .expect("starting tilefs serve"),
    ));
    let end = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(
            server.running(),
            "the server exited: {}",
            fs::read_to_string(log).unwrap_or_default()
        );
        assert!(Instant::now() < end, "no socket after 20s");
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

/// How long a guest may take under TCG on a loaded machine.
const GUEST_LIMIT: Duration = Duration::from_secs(600);

#[test]
fn guest_boots_reads_verifies_and_writes_over_virtio_fs() {
    require(cannot_test());
    let _one = serial();
    let a = Area::new();
    let src = a.dir("src");
    make_tree(&src);
    let store = a.path("store");
    let image = a.path("image.cfs");
    build_with_store(&src, &store, &image, &[]);
    // The victim's object is tampered with before the guest starts.
    let obj = store.join(object_rel(&digest_hex(&src.join("victim"))));
    let mut bad = fs::read(&obj).unwrap();
    bad[1000] ^= 0x55;
    fs::write(&obj, &bad).unwrap();
    let (upper, work) = (a.dir("upper"), a.dir("work"));
    let socket = a.path("vhost.sock");
    let log = a.path("server.log");
    let initramfs = make_initramfs(a.tmp.path(), "checks", &format!("{INIT_START}{MOUNT}{CHECKS}"));
    let mut server = serve_writable(&socket, &log, &store, (&upper, &work), &image);
    let accel = accel();
    let mut vm = Vm::start(a.tmp.path(), "checks", accel, Some(&socket), &initramfs, "");
    let console = vm.finish(GUEST_LIMIT).unwrap_or_else(|c| {
        panic!(
            "the guest failed under {accel}:\n{c}\n[server log]\n{}",
            fs::read_to_string(&log).unwrap_or_default()
        )
    });
    eprintln!("accelerator: {accel}");
    let _ = fs::write(a.tmp.path().join("console.log"), &console);
    let ctx = || {
        format!(
            "[console]\n{console}\n[server log]\n{}",
            fs::read_to_string(&log).unwrap_or_default()
        )
    };

    // What the guest saw is the tree.
    assert!(line(&console, "mounted").is_some(), "not mounted\n{}", ctx());
    assert_eq!(section(&console, "list"), expected_listing(&src), "{}", ctx());
    let mut want: Vec<String> = expected_listing(&src)
        .iter()
        .filter_map(|l| l.strip_prefix("f "))
        .filter(|p| *p != "./victim")
        .map(|p| format!("{}  {p}", sha256_hex(&src.join(p))))
        .collect();
    want.sort_by(|x, y| x[66..].cmp(&y[66..]));
    assert_eq!(section(&console, "sums"), want, "{}", ctx());
    assert_eq!(line(&console, "link"), Some("hello.txt"), "{}", ctx());
    assert_eq!(line(&console, "script"), Some("script ran with arg1"), "{}", ctx());
    assert_eq!(line(&console, "busybox"), Some("from-the-image"), "{}", ctx());
    // The tampered object: EIO for its file, the rest reads.
    let v = line(&console, "victim").unwrap_or_default();
    assert!(
        v.starts_with('1') && v.contains("Input/output error"),
        "victim: {v}\n{}",
        ctx()
    );
    assert_eq!(
        line(&console, "after-victim"),
        Some(sha256_hex(&src.join("data/blob3")).as_str())
    );
    let slog = fs::read_to_string(&log).unwrap_or_default();
    assert!(
        slog.contains("victim"),
        "the server log names the tampered file: {slog}"
    );

    // The guest's writes are in the upper directory, and a remount shows them.
    assert_eq!(
        fs::read(upper.join("newdir/newfile")).unwrap(),
        b"written in the guest\n"
    );
    let hello = fs::read_to_string(upper.join("hello.txt")).unwrap();
    assert_eq!(hello, "hello from tilefs\nappended\n");
    let wh = fs::symlink_metadata(upper.join("data/blob0")).unwrap();
    assert_eq!(
        (wh.mode() & libc::S_IFMT, wh.rdev()),
        (libc::S_IFCHR, 0),
        "blob0's whiteout"
    );
    assert_eq!(fs::metadata(upper.join("big")).unwrap().len(), 48 * 65536);
    assert_eq!(
        line(&console, "remount"),
        Some("written in the guest | appended | 1 | 3145728"),
        "{}",
        ctx()
    );
    // The server outlived the guest, waiting for the next VMM.
    assert!(server.running(), "the server exited with the guest");
    let _ = std::io::stderr().flush();
}

/// The first guest of the restart test: writes, syncs, says so and waits
/// to be killed.
const WRITE_AND_WAIT: &str = r#"mkdir -p /mnt/kept && echo "synced before the VMM died" > /mnt/kept/file
echo "not synced, maybe lost" > /mnt/kept/unsynced-name-only
sync
echo "TILEFS-VM: synced"
sleep 100000
"#;

/// The image's /sbin/init for the root test: run as pid 1 from the
/// tilefs root.
const ROOT_INIT: &str = r#"#!/bin/sh
export PATH=/bin
busybox mount -t proc proc /proc
echo "TILEFS-VM: init pid $$"
echo "TILEFS-VM: root $(busybox grep ' / ' /proc/mounts | busybox tr '\n' ';')"
echo "TILEFS-VM: motd $(busybox cat /etc/motd)"
echo "TILEFS-VM: kept $(busybox cat /kept/file 2>&1)"
echo "written by the guest whose root is tilefs" > /from-root
busybox sync
echo "TILEFS-VM: done"
busybox poweroff -f
"#;

/// A tree that boots: a static busybox as /bin/sh, /sbin/init, the
/// directories a root needs.
fn make_root_tree(src: &Path) {
    for d in ["bin", "sbin", "etc", "proc", "sys", "dev", "tmp", "mnt"] {
        fs::create_dir_all(src.join(d)).unwrap();
    }
    fs::copy(busybox().unwrap(), src.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", src.join("bin/sh")).unwrap();
    fs::write(src.join("sbin/init"), ROOT_INIT).unwrap();
    fs::set_permissions(src.join("sbin/init"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(src.join("etc/motd"), "this root is a tilefs image\n").unwrap();
}

#[test]
fn a_killed_vmm_loses_no_synced_write_and_the_next_boots_with_the_image_as_root() {
    require(cannot_test());
    let _one = serial();
    let a = Area::new();
    let src = a.dir("src");
    make_root_tree(&src);
    let store = a.path("store");
    let image = a.path("root.cfs");
    build_with_store(&src, &store, &image, &[]);
    let (upper, work) = (a.dir("upper"), a.dir("work"));
    let socket = a.path("vhost.sock");
    let log = a.path("server.log");
    let mut server = serve_writable(&socket, &log, &store, (&upper, &work), &image);
    let accel = accel();
    eprintln!("accelerator: {accel}");
    let slog = || fs::read_to_string(&log).unwrap_or_default();

    // The first VMM: its guest writes and syncs, then QEMU is killed.
    let writer = make_initramfs(a.tmp.path(), "writer", &format!("{INIT_START}{MOUNT}{WRITE_AND_WAIT}"));
    let mut vm = Vm::start(a.tmp.path(), "writer", accel, Some(&socket), &writer, "");
    vm.wait_for("TILEFS-VM: synced", GUEST_LIMIT)
        .unwrap_or_else(|c| panic!("the first guest failed:\n{c}\n[server log]\n{}", slog()));
    vm.kill();
    assert_eq!(
        fs::read_to_string(upper.join("kept/file")).unwrap(),
        "synced before the VMM died\n"
    );
    assert!(upper.join("kept/unsynced-name-only").exists());
    let end = Instant::now() + Duration::from_secs(20);
    while !slog().contains("the VMM disconnected") {
        assert!(Instant::now() < end, "no disconnection logged:\n{}", slog());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(server.running(), "the server exited with the killed VMM:\n{}", slog());
    // While served, the image (built by path: no tag keeps it) is a gc
    // root: gc removes none of the objects the next guest boots from.
    let out = tilefs(&[os("gc"), os("--json"), os("--store"), store.as_os_str()]);
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (r["objects_removed"].as_u64(), r["mounts"].as_u64()),
        (Some(0), Some(1)),
        "{r}"
    );

    // The next VMM on the same socket: its guest's root is the image.
    let boot = make_initramfs(a.tmp.path(), "switch-root", &format!("{INIT_START}{SWITCH_ROOT}"));
    let mut vm = Vm::start(
        a.tmp.path(),
        "root",
        accel,
        Some(&socket),
        &boot,
        &format!("root={TAG} rootfstype=virtiofs"),
    );
    let console = vm
        .finish(GUEST_LIMIT)
        .unwrap_or_else(|c| panic!("the root guest failed:\n{c}\n[server log]\n{}", slog()));
    let ctx = || format!("[console]\n{console}\n[server log]\n{}", slog());
    assert_eq!(line(&console, "init pid"), Some("1"), "{}", ctx());
    let root = line(&console, "root").unwrap_or_default();
    assert!(
        root.starts_with(&format!("{TAG} / virtiofs ")),
        "root: {root}\n{}",
        ctx()
    );
    assert_eq!(line(&console, "motd"), Some("this root is a tilefs image"), "{}", ctx());
    assert_eq!(line(&console, "kept"), Some("synced before the VMM died"), "{}", ctx());
    assert_eq!(
        fs::read_to_string(upper.join("from-root")).unwrap(),
        "written by the guest whose root is tilefs\n"
    );
    assert!(server.running(), "the server exited:\n{}", slog());
}

/// The stall test's guest: a read that waits for a stalled fetch runs in
/// the background while other files are read.
const STALL: &str = r#"cd /mnt
(sha256sum d0/f000 > /tmp/slow; echo > /tmp/slow-done) &
slow=$!
sleep 3
echo "TILEFS-VM: fast $(sha256sum d1/f001 | cut -d' ' -f1) $(cat small) $(ls -lR . > /dev/null; find . | wc -l)"
echo "TILEFS-VM: slow-done-before-fast $([ -e /tmp/slow-done ] && echo yes || echo no)"
echo "TILEFS-VM: open-gate"
wait $slow
echo "TILEFS-VM: slow $(cut -d' ' -f1 /tmp/slow)"
echo "TILEFS-VM: done"
poweroff -f
"#;

#[test]
fn a_stalled_fetch_holds_up_only_its_own_read() {
    require(cannot_test());
    require(missing_program("docker-registry", "docker-registry"));
    let _one = serial();
    let a = Area::new();
    let registry = Registry::start(&a);
    let src = a.dir("src");
    // d0/f000 .. d3/f003, each its own object, and an inline `small`.
    tree(&src, 30, 4, 300 << 10);
    let store = a.path("store");
    build_tag(&store, "app", &src);
    push(&store, "app", &format!("docker://{}/team/app:v1", registry.addr));
    let gate = Gate::start(&registry.addr);
    let lazy = a.path("lazy");
    pull(
        &lazy,
        &format!("docker://{}/team/app:v1", gate.addr),
        &["--lazy", "--timeout", "120"],
    );
    // d1/f001's object is in the store already, as if read before.
    let pre = a.dir("pre");
    fs::copy(src.join("d1/f001"), pre.join("f001")).unwrap();
    build_with_store(&pre, &lazy, &a.path("pre.cfs"), &[]);
    // Every fetch from now on stalls.
    gate.closed.store(true, Relaxed);
    let socket = a.path("vhost.sock");
    let log = a.path("server.log");
    let tag = format!("{}_team_app:v1", gate.addr);
    let _server = serve(&socket, &log, &[os("--store"), lazy.as_os_str(), os(&tag)]);
    let accel = accel();
    eprintln!("accelerator: {accel}");
    let slog = || fs::read_to_string(&log).unwrap_or_default();
    let initramfs = make_initramfs(a.tmp.path(), "stall", &format!("{INIT_START}{MOUNT}{STALL}"));
    let mut vm = Vm::start(a.tmp.path(), "stall", accel, Some(&socket), &initramfs, "");
    let c = vm
        .wait_for("TILEFS-VM: open-gate", GUEST_LIMIT)
        .unwrap_or_else(|c| panic!("the guest failed:\n{c}\n[server log]\n{}", slog()));
    // Opened before any assertion, so that a failing test does not wait
    // out the fetch's timeout.
    gate.closed.store(false, Relaxed);
    let want_fast = format!(
        "{} inline contents {}",
        sha256_hex(&src.join("d1/f001")),
        expected_listing(&src).len()
    );
    assert_eq!(line(&c, "fast"), Some(want_fast.as_str()), "{c}\n{}", slog());
    assert_eq!(
        line(&c, "slow-done-before-fast"),
        Some("no"),
        "the other reads waited for the stalled one\n{c}\n{}",
        slog()
    );
    let c = vm
        .finish(GUEST_LIMIT)
        .unwrap_or_else(|c| panic!("the guest failed:\n{c}\n[server log]\n{}", slog()));
    assert_eq!(
        line(&c, "slow"),
        Some(sha256_hex(&src.join("d0/f000")).as_str()),
        "{c}\n{}",
        slog()
    );
}
