//! Lazily pulled images mounted by the kernel (EROFS + overlayfs over a
//! store with placeholders, filled on first open or read by a filler
//! answering fanotify pre-content events), against a real registry
//! (docker-registry on loopback; what it sent is read from its access
//! log). Root only: fanotify pre-content groups need it.

mod common;

use common::oci::*;
use common::registry::{Pass, Registry, Relay};
use common::*;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The machine lacks what a kernel lazy mount needs: why.
fn cannot_fill() -> Option<String> {
    not_root("fanotify pre-content events")
        .or_else(|| cannot_mount("erofs"))
        .or_else(|| cannot_mount("overlay"))
}

/// A source tree (40 files of 256 KiB, two of 5 MiB, an executable) built,
/// tagged and pushed; a store that pulled it with --lazy.
struct Image {
    area: Area,
    registry: Registry,
    src: PathBuf,
    lazy: PathBuf,
    tag: String,
    remote: String,
}

fn image() -> Image {
    let area = Area::new();
    // Readers run as another user too.
    fs::set_permissions(area.tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    tree(&src, 5, 40, 256 << 10);
    write_files(
        &src,
        6,
        &[("big/five-mib".into(), 5 << 20), ("big/five-mib-2".into(), 5 << 20)],
    );
    fs::create_dir_all(src.join("bin")).unwrap();
    fs::copy("/usr/bin/true", src.join("bin/true")).unwrap();
    let store = area.path("store");
    build_tag(&store, "app", &src);
    let remote = format!("docker://{}/team/app:v1", registry.addr);
    push(&store, "app", &remote);
    let lazy = area.path("lazy");
    pull(&lazy, &remote, &["--lazy"]);
    let tag = format!("{}_team_app:v1", registry.addr);
    Image {
        area,
        registry,
        src,
        lazy,
        tag,
        remote,
    }
}

/// `tilefs mount` of the image's tag from `store` at `mnt` (the filler
/// logging to `log`): the mount and what the command said.
fn mount(store: &Path, tag: &str, mnt: &Path, log: &Path, extra: &[&str]) -> (Mounted, String) {
    fs::create_dir_all(mnt).unwrap();
    let mut args = vec![
        os("mount"),
        os("--store"),
        store.as_os_str(),
        os("--log"),
        log.as_os_str(),
    ];
    args.extend(extra.iter().map(|a| os(a)));
    args.extend([os(tag), mnt.as_os_str()]);
    let out = tilefs_any(&args);
    assert!(out.status.success(), "mount: {}", stderr(&out));
    (Mounted(mnt.to_path_buf()), stderr(&out))
}

fn fstype(mnt: &Path) -> String {
    let line = mount_line(mnt).expect("mounted");
    let after = line.split(" - ").nth(1).unwrap();
    after.split(' ').next().unwrap().to_string()
}

/// GET requests of blobs since `n`.
fn blob_gets_since(r: &Registry, n: usize) -> usize {
    r.requests()[n..]
        .iter()
        .filter(|q| q.method == "GET" && q.path.contains("/blobs/"))
        .count()
}

/// The processes (pid, parent) whose command line names `store`: the
/// mount's holder and filler.
fn servers_of(store: &Path) -> Vec<(u32, u32)> {
    common::filler::processes_naming(&[store.as_os_str().as_encoded_bytes()])
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Entries of the placeholder index.
fn index_entries(store: &Path) -> usize {
    fs::read_dir(store.join(".placeholders"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().len() == 64)
        .count()
}

fn fsck_json(store: &Path) -> serde_json::Value {
    let out = tilefs(&[os("fsck"), os("--json"), os("--store"), store.as_os_str()]);
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_lazy_image_is_a_kernel_mount_whose_objects_arrive_on_first_read() {
    require(cannot_fill());
    let img = image();
    let (area, registry, src, lazy) = (&img.area, &img.registry, &img.src, &img.lazy);
    let mnt = area.path("mnt");
    let log = area.path("filler.log");
    let (m, said) = mount(lazy, &img.tag, &mnt, &log, &[]);
    assert_eq!(fstype(&mnt), "overlay", "a kernel mount ({said})");
    assert!(!said.contains("FUSE"), "{said}");
    // Every object a placeholder of its size, known as such to fsck.
    let f = fsck_json(lazy);
    assert_eq!(f["placeholders"], 43, "{f}");
    assert_eq!(f["clean"], true, "{f}");
    let big = src.join("big/five-mib");
    let want = fs::read(&big).unwrap();

    // Root reading a placeholder in the store itself, through its index
    // link or its object path, gets the object (filled for it), never
    // the placeholder's zeros.
    for (file, through) in [("d0/f000", ".placeholders/{}"), ("d2/f002", "{}")] {
        let hex = digest_hex(&src.join(file));
        let rel = match through {
            "{}" => object_rel(&hex),
            _ => format!(".placeholders/{hex}"),
        };
        let out = Command::new("cat").arg(lazy.join(&rel)).output().unwrap();
        assert!(out.status.success(), "{rel}: {}", stderr(&out));
        assert!(out.stdout == fs::read(src.join(file)).unwrap(), "{rel}: wrong bytes");
    }

    // A reader that only maps the file: filled on open.
    let n = registry.requests().len();
    let t = Instant::now();
    let out = Command::new("/usr/bin/python3")
        .args([
            "-c",
            "import mmap,sys,hashlib\nf=open(sys.argv[1],'rb')\nm=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ)\nprint(hashlib.sha256(m).hexdigest())",
        ])
        .arg(mnt.join("big/five-mib"))
        .output()
        .unwrap();
    eprintln!("first read (mmap) of 5 MiB: {:?}", t.elapsed());
    assert!(
        out.status.success(),
        "{}; filler: {}",
        stderr(&out),
        fs::read_to_string(&log).unwrap_or_default()
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), sha256_hex(&want));
    let sent = blob_bytes_since(registry, n);
    assert!((5 << 20..(5 << 20) + (1 << 20)).contains(&sent), "5 MiB sent {sent}");
    // Filled: an ordinary object, once on disk, read without the filler.
    let obj = fs::read_dir(lazy)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().len() == 2)
        .flat_map(|e| fs::read_dir(e.path()).unwrap().flatten())
        .find(|e| e.metadata().unwrap().len() == 5 << 20)
        .unwrap()
        .path();
    let meta = fs::metadata(&obj).unwrap();
    assert_eq!((meta.mode() & 0o7777, meta.nlink()), (0o644, 1));
    let n = registry.requests().len();
    assert_eq!(fs::read(mnt.join("big/five-mib")).unwrap(), want);
    assert_eq!(blob_gets_since(registry, n), 0);

    // A binary runs.
    let st = Command::new(mnt.join("bin/true")).status().unwrap();
    assert!(st.success());

    // Another user reads.
    let out = as_nobody(Command::new("cat").arg(mnt.join("d1/f001")))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(out.stdout, fs::read(src.join("d1/f001")).unwrap());

    // Eight readers of one object at once: one fetch.
    let n = registry.requests().len();
    let one = mnt.join("d2/f007");
    let got: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8).map(|_| s.spawn(|| fs::read(&one).unwrap())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want7 = fs::read(src.join("d2/f007")).unwrap();
    assert!(got.iter().all(|g| *g == want7));
    assert_eq!(blob_gets_since(registry, n), 1, "eight readers, one fetch");

    // The whole tree, byte for byte.
    assert_same_contents(src, &mnt, &scan(src));
    let f = fsck_json(lazy);
    assert_eq!(
        (f["placeholders"].clone(), f["clean"].clone()),
        (0.into(), true.into()),
        "{f}"
    );

    // umount returns once the holder and the filler are gone.
    wait_until("a holder and a filler run", || servers_of(lazy).len() == 2);
    drop(m);
    assert_eq!(servers_of(lazy), vec![], "left running after umount");
    assert_eq!(index_entries(lazy), 0);
}

#[test]
fn two_lazy_images_mounted_at_once_share_their_placeholders() {
    require(cannot_fill());
    let img = image();
    let (area, registry, src, lazy) = (&img.area, &img.registry, &img.src, &img.lazy);
    // A second image: the first's 40 small files (the same bytes) and one
    // of its own, pulled lazily into the same store.
    let src2 = area.dir("src2");
    tree(&src2, 5, 40, 256 << 10);
    write_files(&src2, 9, &[("own".into(), 300 << 10)]);
    let store = area.path("store");
    build_tag(&store, "app2", &src2);
    push(&store, "app2", &format!("docker://{}/team/app2:v1", registry.addr));
    pull(lazy, &format!("docker://{}/team/app2:v1", registry.addr), &["--lazy"]);
    let (mnt1, mnt2) = (area.path("mnt1"), area.path("mnt2"));
    let (m1, said1) = mount(lazy, &img.tag, &mnt1, &area.path("filler1.log"), &[]);
    let tag2 = format!("{}_team_app2:v1", registry.addr);
    let (m2, said2) = mount(lazy, &tag2, &mnt2, &area.path("filler2.log"), &[]);
    for (mnt, said) in [(&mnt1, &said1), (&mnt2, &said2)] {
        assert_eq!(fstype(mnt), "overlay", "a kernel mount ({said})");
    }
    assert_eq!(fsck_json(lazy)["placeholders"], 44);
    // One shared file read through both mounts at once: one fetch.
    let n = registry.requests().len();
    let want = fs::read(src.join("d1/f001")).unwrap();
    std::thread::scope(|s| {
        let readers: Vec<_> = [&mnt1, &mnt2, &mnt1, &mnt2, &mnt1, &mnt2]
            .into_iter()
            .map(|m| s.spawn(move || fs::read(m.join("d1/f001")).unwrap()))
            .collect();
        for r in readers {
            assert!(r.join().unwrap() == want, "wrong bytes");
        }
    });
    assert_eq!(blob_gets_since(registry, n), 1, "six readers on two mounts, one fetch");
    // Filled through one mount, read through the other without a fetch.
    let n = registry.requests().len();
    assert!(fs::read(mnt2.join("d3/f008")).unwrap() == fs::read(src2.join("d3/f008")).unwrap());
    assert!(fs::read(mnt1.join("d3/f008")).unwrap() == fs::read(src.join("d3/f008")).unwrap());
    assert_eq!(blob_gets_since(registry, n), 1);
    assert_same_contents(src, &mnt1, &scan(src));
    assert_same_contents(&src2, &mnt2, &scan(&src2));
    let f = fsck_json(lazy);
    assert_eq!(
        (f["placeholders"].clone(), f["clean"].clone()),
        (0.into(), true.into()),
        "{f}"
    );
    // Unmounted, nothing of theirs is left: the store can go at once.
    drop((m1, m2));
    assert_eq!(servers_of(lazy), vec![], "left running after umount");
    fs::remove_dir_all(lazy).unwrap();
}

#[test]
fn the_rest_arrives_in_the_background_and_a_pull_fills_placeholders() {
    require(cannot_fill());
    let img = image();
    let (area, registry, src, lazy) = (&img.area, &img.registry, &img.src, &img.lazy);
    let total: u64 = 40 * (256 << 10) + 2 * (5 << 20);
    let mnt = area.path("mnt");
    let log = area.path("filler.log");
    let started = Instant::now();
    let (m, _) = mount(lazy, &img.tag, &mnt, &log, &["--fetch-rest", "8M"]);
    // A reader gets its file without waiting for the rest.
    assert!(fs::read(mnt.join("d2/f012")).unwrap() == fs::read(src.join("d2/f012")).unwrap());
    let left = fsck_json(lazy)["placeholders"].as_u64().unwrap();
    assert!(
        left > 10,
        "the rest still coming after the first read: {left} placeholders"
    );
    wait_until("every placeholder is filled", || fsck_json(lazy)["placeholders"] == 0);
    // At 8 MiB/s, ~20 MiB take a while: the rate is kept (the last object
    // starts once all before it would have taken at that rate).
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1500),
        "{total} bytes in {took:?} at 8 MiB/s"
    );
    let said = fs::read_to_string(&log).unwrap();
    assert!(
        said.contains("the rest of the image fetched in the background"),
        "{said}"
    );
    let n = registry.requests().len();
    assert_same_contents(src, &mnt, &scan(src));
    assert_eq!(blob_gets_since(registry, n), 0, "all there before anyone read it");
    drop(m);

    // `tilefs pull` of the image fills the placeholders of a mount that
    // is being served.
    let lazy2 = area.path("lazy2");
    pull(&lazy2, &img.remote, &["--lazy"]);
    let (m, _) = mount(&lazy2, &img.tag, &mnt, &area.path("filler2.log"), &[]);
    assert!(fs::read(mnt.join("d0/f000")).unwrap() == fs::read(src.join("d0/f000")).unwrap());
    pull(&lazy2, &img.remote, &[]);
    let f = fsck_json(&lazy2);
    assert_eq!(
        (f["placeholders"].clone(), f["objects"].clone(), f["clean"].clone()),
        (0.into(), 43.into(), true.into()),
        "{f}"
    );
    let n = registry.requests().len();
    assert_same_contents(src, &mnt, &scan(src));
    assert_eq!(blob_gets_since(registry, n), 0);
    drop(m);
}

#[test]
fn a_tampered_blob_fails_that_read_with_eio_and_leaves_the_placeholder() {
    require(cannot_fill());
    let img = image();
    let (area, lazy, src) = (&img.area, &img.lazy, &img.src);
    img.registry.tamper_largest_blob();
    let mnt = area.path("mnt");
    let log = area.path("filler.log");
    let (_m, _) = mount(lazy, &img.tag, &mnt, &log, &[]);
    // Every file reads right or fails with EIO: never the placeholder's
    // zeros, never the tampered bytes.
    let mut failed = Vec::new();
    for (rel, seen) in scan(src) {
        if seen.mode & 0o170000 != 0o100000 {
            continue;
        }
        let rel = String::from_utf8(rel).unwrap();
        let rel = rel.trim_start_matches('/');
        match fs::read(mnt.join(rel)) {
            Ok(got) => assert!(got == fs::read(src.join(rel)).unwrap(), "{rel}: wrong bytes"),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "{rel}: {e}");
                failed.push(rel.to_string());
            }
        }
    }
    assert_eq!(failed.len(), 1, "one file lies where the byte was flipped: {failed:?}");
    // Tried again: the same answer.
    let err = fs::read(mnt.join(&failed[0])).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    let said = fs::read_to_string(&log).unwrap();
    assert!(said.contains("answered EIO, the placeholder stays"), "{said}");
    assert!(said.contains("fs-verity digest"), "{said}");
    let f = fsck_json(lazy);
    assert_eq!(f["placeholders"], 1, "{f}");
    assert_eq!(f["clean"], true, "{f}");
}

#[test]
fn fsck_and_gc_know_placeholders() {
    require(cannot_fill());
    let img = image();
    let (area, lazy, src) = (&img.area, &img.lazy, &img.src);
    let mnt = area.path("mnt");
    let (m, _) = mount(lazy, &img.tag, &mnt, &area.path("filler.log"), &[]);
    assert_eq!(
        fs::read(mnt.join("d0/f000")).unwrap(),
        fs::read(src.join("d0/f000")).unwrap()
    );
    drop(m);
    let text = fsck_text(lazy);
    assert!(text.contains("42 placeholders") && text.contains("clean"), "{text}");
    // A placeholder is no object to a full pull: it fetches them all.
    // (Untagged first here: gc takes the placeholders and the one object.)
    tilefs(&[os("untag"), os("--store"), lazy.as_os_str(), os(&img.tag)]);
    let out = tilefs(&[os("gc"), os("--json"), os("--store"), lazy.as_os_str()]);
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (r["placeholders_removed"].clone(), r["objects_removed"].clone()),
        (42.into(), 1.into()),
        "{r}"
    );
    assert_eq!(objects_in(lazy), 0);
    assert_eq!(index_entries(lazy), 0);
    // Pulled whole again into a store with placeholders: they are replaced.
    pull(lazy, &img.remote, &["--lazy"]);
    let (m, _) = mount(lazy, &img.tag, &mnt, &area.path("filler2.log"), &[]);
    drop(m);
    pull(lazy, &img.remote, &[]);
    let f = fsck_json(lazy);
    assert_eq!(
        (f["placeholders"].clone(), f["clean"].clone()),
        (0.into(), true.into()),
        "{f}"
    );
    assert_eq!(f["objects"], 43, "{f}");
}

#[test]
fn a_store_on_tmpfs_falls_back_to_fuse_saying_why() {
    require(cannot_fill());
    let img = image();
    let area = &img.area;
    let on_tmpfs = area.dir("tmpfs");
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "tmpfs"])
        .arg(&on_tmpfs)
        .status()
        .unwrap();
    assert!(st.success());
    let _tmpfs = Mounted(on_tmpfs.clone());
    let store = on_tmpfs.join("store");
    pull(&store, &img.remote, &["--lazy"]);
    let mnt = area.path("mnt");
    let (m, said) = mount(&store, &img.tag, &mnt, &area.path("fuse.log"), &[]);
    assert!(said.contains("FUSE") && said.contains("pre-content"), "{said}");
    assert_eq!(fstype(&mnt), "fuse.tilefs");
    assert_eq!(
        fs::read(mnt.join("d0/f000")).unwrap(),
        fs::read(img.src.join("d0/f000")).unwrap()
    );
    drop(m);
    // --kernel is refused, saying why.
    let out = tilefs_any(&[
        os("mount"),
        os("--kernel"),
        os("--store"),
        store.as_os_str(),
        os(&img.tag),
        mnt.as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("pre-content"), "{}", stderr(&out));
    assert!(!is_mounted(&mnt));
}

#[test]
fn kill_9_of_the_filler_fails_closed_and_another_takes_over() {
    require(cannot_fill());
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    tree(&src, 11, 24, 512 << 10);
    let store = area.path("store");
    build_tag(&store, "app", &src);
    let direct = format!("{}/team/app:v1", registry.addr);
    push(&store, "app", &format!("docker://{direct}"));
    // Fetches go through a relay that drips: each fill takes a while, so
    // the kill lands while readers wait.
    let relay = Relay::start(&registry.addr, |_, _| {
        std::thread::sleep(Duration::from_millis(20));
        Pass::All
    });
    let remote = format!("docker://{}/team/app:v1", relay.addr);
    let lazy = area.path("lazy");
    pull(&lazy, &remote, &["--lazy"]);
    let tag = format!("{}_team_app:v1", relay.addr);
    let mnt = area.path("mnt");
    let log = area.path("filler.log");
    let (_m, _) = mount(&lazy, &tag, &mnt, &log, &[]);
    wait_until("the filler runs", || servers_of(&lazy).len() == 2);
    let (holder, filler) = common::filler::holder_and_filler(&servers_of(&lazy));
    let files: Vec<PathBuf> = (0..24).map(|i| PathBuf::from(format!("d{}/f{i:03}", i % 5))).collect();
    let (right, eio) = common::filler::reads_across_a_kill(&mnt, &src, &files, filler);
    eprintln!("during the kill: {right} files read right, {eio} failed with EIO");
    assert!(eio > 0, "the kill came after every read ({right} read)");
    // Another filler took over: everything reads now.
    wait_until("a new filler runs", || {
        servers_of(&lazy)
            .iter()
            .any(|(p, ppid)| *ppid == holder && *p != filler)
    });
    assert_same_contents(&src, &mnt, &scan(&src));
    let said = fs::read_to_string(&log).unwrap();
    assert!(said.contains("answered EIO; starting another"), "{said}");
    drop(relay);
}
