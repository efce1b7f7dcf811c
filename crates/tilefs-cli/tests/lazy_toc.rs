//! eStargz and zstd:chunked images, their layers written by the stargz
//! project's estargz package and containers/storage's chunked compressor
//! (seekable-gen, crates/tilefs-seekable/testdata-gen), started lazily
//! with no tilefs index: `pull --lazy` reads only the tables of contents,
//! a FUSE mount fetches byte ranges of the layers as files are read (out
//! of order) and shows the tree an ordinary pull makes, a file already
//! fetched for another image is not fetched again, and once all is read a
//! lazy pull again gives the ordinary pull's very image. A proxy that
//! flips a byte of range answers fails only the file read through it; a
//! table whose digest is not the annotation's falls back to a whole pull,
//! saying why.

mod common;

use common::oci::*;
use common::registry::{Pass, Registry, Relay};
use common::seekable::{generator, push_seekable};
use common::*;
use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// The base layer: files of every size (inline, one and several chunks, a
/// pair with the same contents), a symlink, a hardlink, an empty file.
fn base(root: &Path, seed: u64) {
    write_files(
        root,
        seed,
        &[
            ("etc/hostname".into(), 20),
            ("etc/config".into(), 3000),
            ("d/a".into(), 100 << 10),
            ("d/b".into(), 100 << 10),
            ("d/c".into(), 300 << 10),
            ("big/lone".into(), 6 << 20),
        ],
    );
    fs::write(root.join("empty"), b"").unwrap();
    fs::copy(root.join("d/a"), root.join("d/same-as-a")).unwrap();
    std::os::unix::fs::symlink("config", root.join("etc/link")).unwrap();
    fs::hard_link(root.join("etc/config"), root.join("etc/hard")).unwrap();
}

/// The top layer: removes `d/b` (a whiteout), replaces `etc/hostname`,
/// adds a file.
fn top(root: &Path, seed: u64) {
    fs::create_dir_all(root.join("d")).unwrap();
    fs::write(root.join("d/.wh.b"), b"").unwrap();
    write_files(root, seed, &[("etc/hostname".into(), 30), ("top/new".into(), 50 << 10)]);
}

/// `tilefs pull --json --lazy` into `store`: its report and stderr.
fn pull_lazy(store: &Path, remote: &str) -> (serde_json::Value, String) {
    let out = tilefs_any(&[
        os("pull"),
        os("--json"),
        os("--lazy"),
        os("--tls-verify=false"),
        os("--store"),
        store.as_os_str(),
        os(&format!("docker://{remote}")),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    (serde_json::from_slice(&out.stdout).unwrap(), stderr(&out))
}

/// The ranges of layer blobs the registry answered since request `n`:
/// (status, bytes) of each blob GET.
fn blob_gets_since(r: &Registry, n: usize) -> Vec<(u16, u64)> {
    r.requests()[n..]
        .iter()
        .filter(|q| q.method == "GET" && q.path.contains("/blobs/sha256:"))
        .map(|q| (q.status, q.bytes))
        .collect()
}

/// What a user sees of every path under `root`, but inode numbers.
fn view(root: &Path) -> Vec<(Vec<u8>, Seen)> {
    scan(root)
        .into_iter()
        .map(|(p, mut s)| {
            s.ino = 0;
            (p, s)
        })
        .collect()
}

#[test]
fn estargz_and_zstd_chunked_images_start_lazily_from_their_tables_of_contents() {
    require(cannot_fuse());
    let Some(generator) = generator() else { return };
    let area = Area::new();
    let registry = Registry::start(&area);
    let lazy = area.path("lazy");
    // The zstd:chunked image shares big/lone with the eStargz one: read
    // through the first, it is not fetched for the second.
    let mut shared = None;
    for (format, seed) in [("estargz", 1), ("zstd-chunked", 2)] {
        let name = format!("{}app", format.replace('-', ""));
        let remote = push_seekable(
            &generator,
            &area,
            &registry,
            &name,
            format,
            &[
                &|r: &Path| {
                    base(r, seed);
                    if seed == 2 {
                        fs::copy(area.path("estargzapp-tree0/big/lone"), r.join("big/lone")).unwrap();
                    }
                },
                &|r: &Path| top(r, seed + 10),
            ],
            false,
        );
        let layer_bytes: u64 = (0..2)
            .map(|i| fs::metadata(area.path(&format!("{name}-{i}.blob"))).unwrap().len())
            .sum();

        // An ordinary pull: the image to match.
        let full = area.path(&format!("full-{format}"));
        let digest = pull(&full, &format!("docker://{remote}"), &[]);

        // Lazily: the tables of contents, not the layers.
        let n = registry.requests().len();
        let (report, said) = pull_lazy(&lazy, &remote);
        eprintln!("{format}: {report}");
        assert!(report["lazy_fallback"].is_null(), "{report}");
        assert!(
            said.contains("tables of contents") && said.contains(if seed == 1 { "eStargz" } else { "zstd:chunked" }),
            "{said}"
        );
        let lazy_files = report["lazy_objects"].as_u64().unwrap();
        assert_ne!(report["digest"], digest.as_str(), "named by alias until fetched");
        let sent: u64 = blob_gets_since(&registry, n).iter().map(|g| g.1).sum();
        assert!(sent * 4 < layer_bytes, "the lazy pull fetched {sent} of {layer_bytes}");

        let img = format!("{}_tilefs_{name}:v1", registry.addr);
        let (mnt_full, mnt_lazy) = (
            area.dir(&format!("mnt-full-{format}")),
            area.dir(&format!("mnt-{format}")),
        );
        let (_full, _) = mount_tag(&full, &img, &mnt_full, &area.path(&format!("full-{format}.log")));
        // eStargz's table is kept once, as its file's object: the lazy
        // record names it, it holds no second copy.
        if seed == 1 {
            let record = fs::read(lazy.join(".remote").join(report["digest"].as_str().unwrap())).unwrap();
            let table = read(&mnt_full.join("stargz.index.json")).unwrap();
            assert!(
                !record.windows(table.len()).any(|w| w == table),
                "the record ({} bytes) copies the table ({} bytes)",
                record.len(),
                table.len()
            );
        }
        let log = area.path(&format!("lazy-{format}.log"));
        let (lazy_mount, _) = mount_tag(&lazy, &img, &mnt_lazy, &log);

        // Files out of order: each costs a range of its layer, no more.
        for f in ["d/c", "etc/config", "d/a", "top/new"] {
            let n = registry.requests().len();
            assert!(
                read(&mnt_lazy.join(f)).unwrap() == read(&mnt_full.join(f)).unwrap(),
                "{f}"
            );
            let gets = blob_gets_since(&registry, n);
            let size = fs::metadata(mnt_full.join(f)).unwrap().len();
            assert!(gets.iter().all(|g| g.0 == 206), "{f}: {gets:?}");
            let sent: u64 = gets.iter().map(|g| g.1).sum();
            assert!(sent <= size + (64 << 10), "{f} ({size} bytes) fetched {sent}");
            eprintln!(
                "{format}: reading {f} ({size} bytes) fetched {sent} in {} ranges",
                gets.len()
            );
        }
        // Same contents, one fetch; and the shared file, for the second
        // image, none.
        let n = registry.requests().len();
        assert!(read(&mnt_lazy.join("d/same-as-a")).unwrap() == read(&mnt_full.join("d/a")).unwrap());
        if let Some(lone) = &shared {
            assert!(&read(&mnt_lazy.join("big/lone")).unwrap() == lone);
        }
        assert_eq!(blob_gets_since(&registry, n), [], "fetched again");
        // gc keeps what the lazy image names and what was fetched.
        let out = tilefs(&[os("gc"), os("--store"), lazy.as_os_str()]);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = fsck_text(&lazy);
        assert!(text.contains("not fetched"), "{text}");

        // The whole tree reads as the ordinary pull's mount shows it.
        assert_eq!(view(&mnt_lazy), view(&mnt_full));
        assert!(assert_same_contents(&mnt_full, &mnt_lazy, &scan(&mnt_full)) > 8);
        shared = Some(read(&mnt_full.join("big/lone")).unwrap());
        drop(lazy_mount);
        let log = fs::read_to_string(&log).unwrap_or_default();
        assert!(!log.contains("failed"), "{log}");

        // All read: a lazy pull again is the ordinary pull's image.
        let (again, _) = pull_lazy(&lazy, &remote);
        assert_eq!(again["digest"], digest.as_str(), "{again}");
        assert_eq!(again["lazy_objects"], 0);
        assert_clean_or_gone(&lazy);
        // etc/hostname, etc/config, d/a (and its copy), d/c, top/new; and
        // for eStargz its landmark file and big/lone, which the
        // zstd:chunked image finds in the store.
        assert_eq!(lazy_files, if seed == 1 { 7 } else { 5 });
    }
}

#[test]
fn a_flipped_byte_fails_its_file_only_and_a_bad_table_digest_falls_back() {
    require(cannot_fuse());
    let Some(generator) = generator() else { return };
    let area = Area::new();
    let registry = Registry::start(&area);
    let fill = |r: &Path| base(r, 5);
    let remote = push_seekable(&generator, &area, &registry, "flip", "estargz", &[&fill], false);
    let full = area.path("full");
    pull(&full, &format!("docker://{remote}"), &[]);

    // A proxy that flips the byte 64 KiB into each range answer's body
    // while armed: the file read through it fails with EIO, nothing wrong
    // is kept (read again unarmed, it is right), other files read right.
    let armed = Arc::new(AtomicBool::new(false));
    let flipping = armed.clone();
    let until_flip = Mutex::new(None::<usize>);
    let relay = Relay::start(&registry.addr, move |chunk, _| {
        let mut left = until_flip.lock().unwrap();
        let mut body = 0;
        if chunk.starts_with(b"HTTP/1.1 ") {
            *left = None;
            let head = chunk.windows(4).position(|w| w == b"\r\n\r\n");
            if let Some(h) = head.filter(|_| chunk.starts_with(b"HTTP/1.1 206") && flipping.load(Relaxed)) {
                (*left, body) = (Some(64 << 10), h + 4);
            }
        }
        if let Some(n) = *left {
            match body + n < chunk.len() {
                true => (chunk[body + n], *left) = (chunk[body + n] ^ 0x55, None),
                false => *left = Some(n - (chunk.len() - body)),
            }
        }
        Pass::All
    });
    let lazy = area.path("lazy");
    let via = remote.replace(&registry.addr, &relay.addr);
    pull_lazy(&lazy, &via);
    let img = format!("{}_tilefs_flip:v1", relay.addr);
    let mnt_full = area.dir("mnt-full");
    let (_full, _) = mount_tag(
        &full,
        &format!("{}_tilefs_flip:v1", registry.addr),
        &mnt_full,
        &area.path("full.log"),
    );
    let mnt = area.dir("mnt");
    let log = area.path("lazy.log");
    let (_m, _) = mount_tag(&lazy, &img, &mnt, &log);
    armed.store(true, Relaxed);
    let err = read(&mnt.join("big/lone")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(5), "EIO expected: {err}");
    let text = fs::read_to_string(&log).unwrap_or_default();
    assert!(text.contains("fetch from") && text.contains("big/lone"), "{text}");
    armed.store(false, Relaxed);
    for f in ["d/c", "etc/config", "big/lone"] {
        assert!(read(&mnt.join(f)).unwrap() == read(&mnt_full.join(f)).unwrap(), "{f}");
    }

    // An alias whose contents are not its SHA-256 is corrupt to fsck; gc
    // removes it (no image names it, it is no object gc keeps), and keeps
    // those of the files read.
    let bogus = lazy.join(".sha256/ab").join("c".repeat(62));
    fs::create_dir_all(bogus.parent().unwrap()).unwrap();
    fs::write(&bogus, b"not these bytes").unwrap();
    let out = tilefs_any(&[os("fsck"), os("--store"), lazy.as_os_str()]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains(&bogus.display().to_string()), "{text}");
    let out = tilefs(&[os("gc"), os("--json"), os("--store"), lazy.as_os_str()]);
    let gc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(gc["aliases_removed"], 1, "{gc}");
    assert!(!bogus.exists());
    let text = fsck_text(&lazy);
    assert!(text.contains("not fetched"), "{text}");
    let n = registry.requests().len();
    assert!(read(&mnt.join("d/c")).unwrap() == read(&mnt_full.join("d/c")).unwrap());
    assert_eq!(registry.requests()[n..].len(), 0, "fetched again after gc");

    // A table of contents whose digest is not the annotation's: pulled
    // whole, the reason said on stderr and in --json.
    let bad = push_seekable(&generator, &area, &registry, "badtoc", "estargz", &[&fill], true);
    let whole = area.path("whole");
    let digest = pull(&whole, &format!("docker://{bad}"), &[]);
    let (report, said) = pull_lazy(&area.path("fallback"), &bad);
    let why = report["lazy_fallback"].as_str().unwrap_or_default();
    assert!(
        why.contains("tables of contents cannot be used") && why.contains("eStargz table of contents"),
        "{report}"
    );
    assert!(said.contains("pulled whole, not lazily"), "{said}");
    assert_eq!(report["digest"], digest.as_str());
    assert_eq!(report["lazy_objects"], 0);
}
