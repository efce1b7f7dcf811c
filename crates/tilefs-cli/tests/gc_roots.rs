//! What is mounted is never collected, whatever is done to its tag: a
//! tagged image mounted (the kernel's, FUSE's, a lazily pulled one's
//! FUSE mount, a kernel mount made in a mount namespace of its own) is
//! untagged and `tilefs gc` runs; the mount reads on, from the disk. Once
//! it is unmounted, the next gc frees its objects. (The mount service's
//! mounts are tried in `mountd.rs`, a VM's virtio-fs device in `vm.rs`,
//! the snapshotter's images in `containerd.rs` and `cri.rs`.)

mod common;

use common::oci::{build_tag, mount_tag, objects_in, pull, push, tree};
use common::registry::Registry;
use common::*;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};

fn drop_caches() {
    let _ = fs::write("/proc/sys/vm/drop_caches", "3");
}

/// `tilefs untag TAG`, then `tilefs gc --json`: its report.
fn untag_and_gc(store: &Path, tag: &str) -> serde_json::Value {
    tilefs(&[os("untag"), os("--store"), store.as_os_str(), os(tag)]);
    gc(store)
}

fn gc(store: &Path) -> serde_json::Value {
    let out = tilefs(&[os("gc"), os("--json"), os("--store"), store.as_os_str()]);
    serde_json::from_slice(&out.stdout).unwrap()
}

fn removed_and_mounts(r: &serde_json::Value) -> (u64, u64) {
    (r["objects_removed"].as_u64().unwrap(), r["mounts"].as_u64().unwrap())
}

#[test]
fn kernel_and_fuse_mounts_keep_an_untagged_image() {
    let _serial = serial();
    require(
        cannot_fuse()
            .or_else(|| cannot_mount("erofs"))
            .or_else(|| cannot_mount("overlay")),
    );
    let a = Area::new();
    let src = a.dir("src");
    let files = tree(&src, 11, 6, 70_000);
    let store = a.path("store");
    for backend in ["--kernel", "--fuse"] {
        build_tag(&store, "os", &src);
        let mnt = a.dir(&format!("mnt{backend}"));
        let m = Mounted(mnt.clone());
        tilefs(&[
            os("mount"),
            os(backend),
            os("--store"),
            store.as_os_str(),
            os("os"),
            mnt.as_os_str(),
        ]);
        let r = untag_and_gc(&store, "os");
        assert_eq!(removed_and_mounts(&r), (0, 1), "{backend}: {r}");
        drop_caches();
        assert_same_contents(&src, &mnt, &scan(&src));
        m.unmount();
        let r = gc(&store);
        assert_eq!(removed_and_mounts(&r), (files.len() as u64, 0), "{backend}: {r}");
    }
}

/// A child killed (with its mount namespace) when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_kernel_mount_in_another_mount_namespace_keeps_its_image() {
    let _serial = serial();
    require(cannot_mount("erofs").or_else(|| cannot_mount("overlay")));
    let a = Area::new();
    let src = a.dir("src");
    let files = tree(&src, 12, 4, 70_000);
    let store = a.path("store");
    build_tag(&store, "os", &src);
    let mnt = a.dir("mnt");
    // The mount exists only in the namespace of `unshare -m`, where a
    // shell waits for a line before it reads a file through it.
    let script = format!(
        "{t} mount --kernel --store {s} os {m} && echo mounted && read go && cat {m}/d1/f001 | sha256sum",
        t = tilefs_bin().display(),
        s = store.display(),
        m = mnt.display(),
    );
    let mut sh = Killed(
        Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("unshare (util-linux)"),
    );
    let mut lines = BufReader::new(sh.0.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().and_then(Result::ok).as_deref(), Some("mounted"));
    assert!(!is_mounted(&mnt), "the mount is visible outside its namespace");
    let r = untag_and_gc(&store, "os");
    assert_eq!(removed_and_mounts(&r), (0, 1), "{r}");
    drop_caches();
    writeln!(sh.0.stdin.as_mut().unwrap(), "go").unwrap();
    let sum = lines.next().and_then(Result::ok).unwrap_or_default();
    let want = sha256_hex(&fs::read(src.join("d1/f001")).unwrap());
    assert!(sum.starts_with(&want), "read through the mount: {sum:?}, wanted {want}");
    assert!(sh.0.wait().unwrap().success());
    // The namespace is gone, and its mount with it.
    let r = gc(&store);
    assert_eq!(removed_and_mounts(&r), (files.len() as u64, 0), "{r}");
}

#[test]
fn a_lazy_mount_keeps_what_it_fetched_and_what_it_fetches_after_an_untag() {
    let _serial = serial();
    require(cannot_fuse());
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    tree(&src, 13, 8, 200 << 10);
    let origin = area.path("origin");
    build_tag(&origin, "app", &src);
    let remote = format!("docker://{}/team/app:v1", registry.addr);
    push(&origin, "app", &remote);
    let lazy = area.path("lazy");
    pull(&lazy, &remote, &["--lazy", "--tag", "app"]);
    assert_eq!(objects_in(&lazy), 0);
    let mnt = area.path("mnt");
    let (m, _) = mount_tag(&lazy, "app", &mnt, &area.path("fuse.log"));
    let (first, later) = (Path::new("d0/f000"), Path::new("d3/f003"));
    assert_eq!(fs::read(mnt.join(first)).unwrap(), fs::read(src.join(first)).unwrap());
    let fetched = objects_in(&lazy);
    assert!(fetched >= 1);
    let r = untag_and_gc(&lazy, "app");
    assert_eq!(removed_and_mounts(&r), (0, 1), "{r}");
    // A file fetched after the untag: kept by the next gc too.
    assert_eq!(fs::read(mnt.join(later)).unwrap(), fs::read(src.join(later)).unwrap());
    assert!(objects_in(&lazy) > fetched);
    let r = gc(&lazy);
    assert_eq!(removed_and_mounts(&r), (0, 1), "{r}");
    drop_caches();
    for f in [first, later] {
        assert_eq!(
            fs::read(mnt.join(f)).unwrap(),
            fs::read(src.join(f)).unwrap(),
            "{}",
            f.display()
        );
    }
    let n = objects_in(&lazy) as u64;
    m.unmount();
    let r = gc(&lazy);
    assert_eq!(removed_and_mounts(&r), (n, 0), "{r}");
    assert_eq!(
        fs::read_dir(lazy.join(".remote")).unwrap().count(),
        0,
        "the lazy record stayed"
    );
}
