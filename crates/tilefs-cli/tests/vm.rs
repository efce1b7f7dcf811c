//! A virtual machine on a tilefs image: `tilefs serve --vhost-user` serves
//! a writable image to QEMU (`vhost-user-fs-pci`), which boots Debian's
//! own kernel (linux-image-amd64) with a busybox initramfs built here. The
//! guest mounts the tag and prints what it sees: a listing and SHA-256s
//! (compared with the tree the image was built from), the output of
//! programs of the image, EIO for the one file whose object was tampered
//! with (while the rest reads), and its writes, which the host then finds
//! in the upper directory and the guest sees again after a remount.
//!
//! KVM is tried first when /dev/kvm opens (for `TILEFS_VM_KVM_WAIT`
//! seconds, default 20, until the guest says it booted), else, or when
//! the guest does not boot under it, TCG runs; `TILEFS_VM_ACCEL=tcg|kvm`
//! forces one. QEMU and the server are killed however the test ends.
//!
//! Needs qemu-system-x86, linux-image-amd64 and busybox-static
//! (scripts/setup installs them); the test fails without them.

mod common;

use common::*;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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

/// The guest's /init: loads the modules, mounts the tag, prints what it
/// sees between markers, writes, remounts, powers off.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /mnt
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules); do insmod /lib/modules/$m || echo "TILEFS-VM: insmod $m failed"; done
echo "TILEFS-VM: booted"
n=0
until mount -t virtiofs TAG /mnt; do
    n=$((n+1)); [ $n -gt 20 ] && break; sleep 1
done
grep virtiofs /proc/mounts | sed 's/^/TILEFS-VM: mounted /'
cd /mnt
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

fn make_initramfs(dir: &Path) -> PathBuf {
    let (_, moddir) = guest_kernel().unwrap();
    let mods = modules_in_order(&moddir, &["virtio_pci", "virtiofs"]);
    let mut entries: Vec<(String, u32, Vec<u8>)> = vec![
        ("bin".into(), 0o040755, vec![]),
        ("lib".into(), 0o040755, vec![]),
        ("lib/modules".into(), 0o040755, vec![]),
        ("tmp".into(), 0o041777, vec![]),
        ("bin/busybox".into(), 0o100755, fs::read(busybox().unwrap()).unwrap()),
        ("init".into(), 0o100755, INIT.replace("TAG", TAG).into_bytes()),
    ];
    let mut names = Vec::new();
    for m in &mods {
        let name = m.file_name().unwrap().to_string_lossy().to_string();
        assert!(name.ends_with(".ko"), "compressed module {name}: not supported here");
        entries.push((format!("lib/modules/{name}"), 0o100644, fs::read(m).unwrap()));
        names.push(name);
    }
    entries.push(("modules".into(), 0o100644, names.join(" ").into_bytes()));
    let p = dir.join("initramfs.cpio");
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

/// Runs QEMU with `accel` until the guest powers off (Ok: the console),
/// or Err(console) when it has not said it booted within `boot_wait` or
/// has not finished within `total`.
fn run_vm(
    dir: &Path,
    accel: &str,
    socket: &Path,
    initramfs: &Path,
    boot_wait: Duration,
    total: Duration,
) -> Result<String, String> {
    let (kernel, _) = guest_kernel().unwrap();
    let console = dir.join(format!("console-{accel}.log"));
    let _ = fs::remove_file(&console);
    let mem = "512M";
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
        .args(["-machine", &format!("q35,accel={accel}")])
        .args(["-cpu", if accel == "kvm" { "host" } else { "max" }])
        .args(["-smp", "1", "-m", mem])
        .args(["-object", &format!("memory-backend-memfd,id=mem,size={mem},share=on")])
        .args(["-numa", "node,memdev=mem"])
        .arg("-chardev")
        .arg(format!("socket,id=fs0,path={}", socket.display()))
        .args(["-device", &format!("vhost-user-fs-pci,chardev=fs0,tag={TAG}")])
        .arg("-kernel")
        .arg(&kernel)
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", "console=ttyS0 panic=-1 quiet loglevel=3"])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut q = Killed(Some(cmd.spawn().expect("starting qemu")));
    let read = || fs::read_to_string(&console).unwrap_or_default();
    let mut booted = false;
    loop {
        let c = read();
        if !booted && c.contains("TILEFS-VM: booted") {
            booted = true;
            eprintln!("{accel}: booted in {:.1}s", start.elapsed().as_secs_f64());
        }
        if !q.running() {
            let mut err = String::new();
            if let Some(e) = q.0.as_mut().and_then(|c| c.stderr.as_mut()) {
                let _ = std::io::Read::read_to_string(e, &mut err);
            }
            eprintln!("{accel}: the guest ran {:.1}s", start.elapsed().as_secs_f64());
            return if c.contains("TILEFS-VM: done") {
                Ok(c)
            } else {
                Err(format!("{c}\n[qemu stderr]\n{err}"))
            };
        }
        if (!booted && start.elapsed() > boot_wait) || start.elapsed() > total {
            return Err(format!("{c}\n[timed out after {:?}]", start.elapsed()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn guest_boots_reads_verifies_and_writes_over_virtio_fs() {
    require(cannot_test());
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
    let initramfs = make_initramfs(a.tmp.path());

    let mut server = Killed(Some(
        Command::new(tilefs_bin())
            .args(["serve", "--vhost-user"])
            .arg(&socket)
            .arg("--store")
            .arg(&store)
            .arg("--upper")
            .arg(&upper)
            .arg("--work")
            .arg(&work)
            .arg("--log")
            .arg(&log)
            .arg(&image)
            .stdin(Stdio::null())
            .spawn()
            .expect("starting tilefs serve"),
    ));
    let end = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(
            server.running(),
            "the server exited: {}",
            fs::read_to_string(&log).unwrap_or_default()
        );
        assert!(Instant::now() < end, "no socket after 20s");
        std::thread::sleep(Duration::from_millis(50));
    }

    let forced = std::env::var("TILEFS_VM_ACCEL").ok();
    let kvm_wait = std::env::var("TILEFS_VM_KVM_WAIT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let total = Duration::from_secs(600);
    let mut console = None;
    if forced.as_deref() == Some("kvm") || (forced.is_none() && kvm_usable()) {
        match run_vm(
            a.tmp.path(),
            "kvm",
            &socket,
            &initramfs,
            Duration::from_secs(kvm_wait),
            total,
        ) {
            Ok(c) => console = Some(("kvm", c)),
            Err(c) if forced.is_some() => panic!("the guest failed under KVM:\n{c}"),
            Err(c) => {
                let tail: String = c.lines().rev().take(5).collect::<Vec<_>>().join(" / ");
                eprintln!("KVM: the guest did not boot within {kvm_wait}s ({tail}); falling back to TCG");
            }
        }
        assert!(server.running(), "the server exited after the KVM attempt");
    }
    let (accel, console) = match console {
        Some(c) => c,
        None => (
            "tcg",
            run_vm(a.tmp.path(), "tcg", &socket, &initramfs, total, total).unwrap_or_else(|c| {
                panic!(
                    "the guest failed under TCG:\n{c}\n[server log]\n{}",
                    fs::read_to_string(&log).unwrap_or_default()
                )
            }),
        ),
    };
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
