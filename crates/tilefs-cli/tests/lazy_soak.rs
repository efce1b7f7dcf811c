//! Lazy mounts under load (issue 34): many readers through FUSE mounts of
//! a lazily pulled image, racing each other, `tilefs pull`, a second mount,
//! a registry that goes away and one that stalls. Every byte read must be
//! the source's, no read may fail but one in flight while the registry is
//! away, and the registry's access log must show each object sent once.

mod common;

use common::oci::*;
use common::registry::{Gate, Registry};
use common::*;
use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// The soak's tree: several hundred files of 100 B to 300 KiB, a few of
/// 3 MiB and one of 20 MiB (fetched in parallel 4 MiB pieces), a sixth of
/// them copies of another file elsewhere (one object, several files).
/// Returns every file with its contents.
fn soak_tree(root: &Path) -> Vec<(String, Vec<u8>)> {
    let mut rng = Rng::new(34);
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    for i in 0..384usize {
        let name = format!("d{}/s{}/f{i:03}", i % 8, i % 3);
        let data = if i % 6 == 5 {
            files[i - 5].1.clone()
        } else {
            let size = match i % 16 {
                0 => 100_000 + rng.below(200_000),
                1..=3 => 16_000 + rng.below(48_000),
                _ => 100 + rng.below(16_000),
            };
            rng.bytes(size as usize)
        };
        files.push((name, data));
    }
    for i in 0..4 {
        files.push((format!("big/three-mib-{i}"), rng.bytes(3 << 20)));
    }
    files.push(("big/copy-of-three-mib-0".into(), files[384].1.clone()));
    files.push(("big/twenty-mib".into(), rng.bytes(20 << 20)));
    for (name, data) in &files {
        let p = root.join(name);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, data).unwrap();
    }
    files
}

/// Bytes of the distinct objects the files make.
fn object_bytes(files: &[(String, Vec<u8>)]) -> u64 {
    let distinct: HashSet<&[u8]> = files.iter().map(|(_, d)| d.as_slice()).collect();
    distinct.iter().map(|d| d.len() as u64).sum()
}

/// A read that failed: which file, why, and when it ran.
#[derive(Debug)]
struct Failure {
    file: String,
    error: String,
    started: Instant,
}

/// `readers` threads read every file, each in its own random order, reader
/// `r` through `mounts[r % mounts.len()]`; `done` counts reads finished.
/// Wrong bytes fail the test at once; errors are returned.
fn read_everything(
    mounts: &[PathBuf],
    files: &[(String, Vec<u8>)],
    readers: usize,
    seed: u64,
    done: &AtomicUsize,
) -> Vec<Failure> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..readers)
            .map(|r| {
                let mnt = &mounts[r % mounts.len()];
                s.spawn(move || {
                    let mut order: Vec<usize> = (0..files.len()).collect();
                    let mut rng = Rng::new(seed + r as u64);
                    for i in (1..order.len()).rev() {
                        order.swap(i, rng.below(i as u64 + 1) as usize);
                    }
                    let mut failed = Vec::new();
                    for i in order {
                        let (name, want) = &files[i];
                        let started = Instant::now();
                        match fs::read(mnt.join(name)) {
                            Ok(got) => assert!(got == *want, "reader {r}: {name}: wrong contents"),
                            Err(e) => failed.push(Failure {
                                file: name.clone(),
                                error: e.to_string(),
                                started,
                            }),
                        }
                        done.fetch_add(1, Relaxed);
                    }
                    failed
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    })
}

/// A `tilefs pull` of `remote` into `store`, running.
fn spawn_pull(store: &Path, remote: &str) -> std::process::Child {
    Command::new(tilefs_bin())
        .args(["pull", "-q", "--tls-verify=false", "--store"])
        .arg(store)
        .arg(remote)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Nothing half-written is left in the store's temporary directory.
fn assert_no_temporary_files(store: &Path) {
    let left: Vec<_> = fs::read_dir(store.join(".tmp"))
        .map(|rd| rd.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{}: left in .tmp: {left:?}", store.display());
}

#[test]
fn parallel_readers_of_a_lazy_mount_share_each_fetch() {
    require(cannot_fuse());
    let t0 = Instant::now();
    let area = Area::new();
    let mut registry = Registry::start(&area);
    let src = area.dir("src");
    let files = soak_tree(&src);
    let objects = object_bytes(&files);
    let store = area.path("store");
    let digest = build_tag(&store, "app", &src);
    let remote = format!("docker://{}/team/soak:v1", registry.addr);
    push(&store, "app", &remote);
    let tag = format!("{}_team_soak:v1", registry.addr);
    let within = |sent: u64, extra: u64, what: &str| {
        eprintln!(
            "{what}: the registry sent {sent} bytes for {objects} bytes of objects (+{extra} of image and index)"
        );
        assert!(
            sent >= objects && sent <= objects + objects / 10 + extra,
            "{what}: {sent} bytes sent for {objects} bytes of objects (+{extra} of image and index)"
        );
    };

    // 8 readers through one mount; a few readers killed in the middle of
    // the largest file first.
    let lazy = area.path("lazy-1");
    pull(&lazy, &remote, &["--lazy"]);
    let mnt = area.path("mnt-1");
    let (m, _) = mount_tag(&lazy, &tag, &mnt, &area.path("fuse-1.log"));
    let n = registry.requests().len();
    let killed: Vec<_> = (0..3)
        .map(|_| {
            Command::new("cat")
                .arg(mnt.join("big/twenty-mib"))
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(30));
    for mut c in killed {
        let _ = c.kill();
        let _ = c.wait();
    }
    let t = Instant::now();
    let failed = read_everything(std::slice::from_ref(&mnt), &files, 8, 1, &AtomicUsize::new(0));
    eprintln!("8 readers x {} files: {:?}", files.len(), t.elapsed());
    assert!(failed.is_empty(), "reads failed: {failed:#?}");
    within(blob_bytes_since(&registry, n), 0, "one mount");
    drop(m);
    assert_no_temporary_files(&lazy);

    // Two mounts of one image, 4 readers each, and two `tilefs pull`s of
    // it into the same store, all at once.
    let lazy = area.path("lazy-2");
    let n = registry.requests().len();
    pull(&lazy, &remote, &["--lazy"]);
    let meta = blob_bytes_since(&registry, n);
    let mnts = [area.path("mnt-2a"), area.path("mnt-2b")];
    let (m2a, _) = mount_tag(&lazy, &tag, &mnts[0], &area.path("fuse-2a.log"));
    let (m2b, _) = mount_tag(&lazy, &tag, &mnts[1], &area.path("fuse-2b.log"));
    let n = registry.requests().len();
    let t = Instant::now();
    let (failed, pulls) = std::thread::scope(|s| {
        let readers = s.spawn(|| read_everything(&mnts, &files, 8, 11, &AtomicUsize::new(0)));
        std::thread::sleep(Duration::from_millis(50));
        let pulls: Vec<_> = (0..2).map(|_| spawn_pull(&lazy, &remote)).collect();
        let pulls: Vec<_> = pulls.into_iter().map(|p| p.wait_with_output().unwrap()).collect();
        (readers.join().unwrap(), pulls)
    });
    eprintln!("2 mounts x 4 readers and 2 pulls: {:?}", t.elapsed());
    for p in &pulls {
        assert!(p.status.success(), "pull: {}", stderr(p));
        assert_eq!(String::from_utf8_lossy(&p.stdout).trim(), digest);
    }
    assert!(failed.is_empty(), "reads failed: {failed:#?}");
    within(blob_bytes_since(&registry, n), 2 * meta, "two mounts and two pulls");
    let text = fsck_text(&lazy);
    assert!(text.contains("clean") && !text.contains("not fetched"), "{text}");
    drop((m2a, m2b));
    assert_no_temporary_files(&lazy);

    // The registry goes away for 5 s while 8 readers read, longer than a
    // fetch retries (3.5 s): reads under way then fail, only those, and
    // they read again once it is back.
    let lazy = area.path("lazy-3");
    pull(&lazy, &remote, &["--lazy"]);
    let mnt = area.path("mnt-3");
    let log = area.path("fuse-3.log");
    let (m, _) = mount_tag(&lazy, &tag, &mnt, &log);
    let done = AtomicUsize::new(0);
    let (failed, back) = std::thread::scope(|s| {
        let readers = s.spawn(|| read_everything(std::slice::from_ref(&mnt), &files, 8, 21, &done));
        while done.load(Relaxed) < files.len() * 8 / 4 && !readers.is_finished() {
            std::thread::sleep(Duration::from_millis(5));
        }
        registry.stop();
        eprintln!("registry stopped after {} reads", done.load(Relaxed));
        std::thread::sleep(Duration::from_secs(5));
        registry.restart();
        let back = Instant::now();
        eprintln!("registry back after {} reads", done.load(Relaxed));
        (readers.join().unwrap(), back)
    });
    eprintln!("{} reads failed while the registry was away", failed.len());
    assert!(!failed.is_empty(), "no read was under way while the registry was away");
    for f in &failed {
        assert!(
            f.started < back,
            "a read begun after the registry was back failed: {f:?}"
        );
        assert!(f.error.contains("os error 5"), "{f:?}");
        let (_, want) = files.iter().find(|(n, _)| *n == f.file).unwrap();
        assert!(fs::read(mnt.join(&f.file)).unwrap() == *want, "{}", f.file);
    }
    let logged = fs::read_to_string(&log).unwrap();
    assert!(logged.contains(&failed[0].file), "{logged}");
    drop(m);
    assert_no_temporary_files(&lazy);
    assert!(fsck_text(&lazy).contains("clean"));
    eprintln!("soak: {:?}", t0.elapsed());
}

#[test]
fn readers_waiting_on_a_stalled_fetch_get_its_answer_and_the_next_read_succeeds() {
    require(cannot_fuse());
    let area = Area::new();
    let registry = Registry::start(&area);
    let src = area.dir("src");
    let files = tree(&src, 34, 4, 300 << 10);
    let store = area.path("store");
    build_tag(&store, "app", &src);
    push(&store, "app", &format!("docker://{}/team/app:v1", registry.addr));
    let gate = Gate::start(&registry.addr);
    let lazy = area.path("lazy");
    pull(
        &lazy,
        &format!("docker://{}/team/app:v1", gate.addr),
        &["--lazy", "--timeout", "2"],
    );
    let mnt = area.path("mnt");
    let (_m, _) = mount_tag(
        &lazy,
        &format!("{}_team_app:v1", gate.addr),
        &mnt,
        &area.path("fuse.log"),
    );
    let file = mnt.join(&files[0].0);
    // Another file (random contents of its own), fetched while the link is up.
    let other = mnt.join(&files[1].0);
    let other_bytes = fs::read(src.join(&files[1].0)).unwrap();
    assert_eq!(read(&other).unwrap(), other_bytes);

    // The link dies: 6 readers of one file (two of them killed while they
    // wait) all have their answer within one transfer's timeout, not one
    // timeout each.
    gate.closed.store(true, Relaxed);
    let t = Instant::now();
    let answered = AtomicUsize::new(0);
    let errors = std::thread::scope(|s| {
        let readers: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let r = read(&file);
                    answered.fetch_add(1, Relaxed);
                    r
                })
            })
            .collect();
        let mut killed: Vec<_> = (0..2)
            .map(|_| Command::new("cat").arg(&file).stdout(Stdio::null()).spawn().unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        // Meanwhile the rest of the mount answers: the stalled fetch holds
        // its own readers only (the server's other workers read on).
        assert_eq!(read(&other).unwrap(), other_bytes);
        assert!(fs::read_dir(&mnt).unwrap().count() > 0);
        assert_eq!(
            answered.load(Relaxed),
            0,
            "the stalled readers were answered before the others: the test proves nothing"
        );
        for c in &mut killed {
            let _ = c.kill();
            let _ = c.wait();
        }
        readers.into_iter().map(|r| r.join().unwrap()).collect::<Vec<_>>()
    });
    eprintln!("4 readers of a stalled fetch answered in {:?}", t.elapsed());
    for e in &errors {
        assert_eq!(e.as_ref().unwrap_err().raw_os_error(), Some(libc::EIO), "{e:?}");
    }
    assert!(
        t.elapsed() < Duration::from_secs(6),
        "readers of one stalled fetch took {:?}",
        t.elapsed()
    );
    assert_eq!(objects_in(&lazy), 1, "only the other file's object");
    assert_no_temporary_files(&lazy);

    // The link is back: the failure was not remembered.
    gate.closed.store(false, Relaxed);
    assert_eq!(read(&file).unwrap(), fs::read(src.join(&files[0].0)).unwrap());
    assert_eq!(objects_in(&lazy), 2);
}
