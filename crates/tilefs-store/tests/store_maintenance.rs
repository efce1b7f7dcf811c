//! fsck, gc and tags on stores built by hand: objects written at their
//! digest paths, images made from dumps and tagged.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;
use tilefs_image::{dump, erofs, verity};
use tilefs_store::fsck::{fsck, FsckOptions, FsckReport};
use tilefs_store::gc::{gc, GcOptions};
use tilefs_store::store::{QUARANTINE_DIR, TMP_DIR};
use tilefs_store::{tags, LockMode, Store};

/// Deterministic contents of `len` bytes.
fn data(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(seed as u32 * 7919) as u8 ^ seed)
        .collect()
}

/// Writes an object at its digest path, as an import would leave it.
fn put_object(store: &Store, contents: &[u8]) -> [u8; 32] {
    let d = verity::digest_bytes(contents);
    let path = store.object_path(&d);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, contents).unwrap();
    d
}

/// An image whose files `/NAME` reference the given objects (and a
/// hardlink to the first and an inline file, which reference nothing new).
fn image(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut text = String::from("/ 4096 40755 2 0 0 0 0.0 - - -\n");
    text.push_str("/inline 5 100644 1 0 0 0 0.0 - hello -\n");
    for (i, (name, contents)) in files.iter().enumerate() {
        let d = verity::digest_bytes(contents);
        let nlink = if i == 0 { 2 } else { 1 };
        text.push_str(&format!(
            "/{name} {} 100644 {nlink} 0 0 0 0.0 {} - {}\n",
            contents.len(),
            Store::object_rel(&d),
            hex::encode(d)
        ));
        if i == 0 {
            text.push_str(&format!("/{name}.link 0 @100644 0 0 0 0 0.0 /{name} - -\n"));
        }
    }
    image_from_dump(&text)
}

fn image_from_dump(text: &str) -> Vec<u8> {
    let tree = dump::parse(text.as_bytes(), dump::ParseOptions::default()).unwrap();
    erofs::write_image(&tree, &erofs::WriteOptions::default())
        .unwrap()
        .bytes
}

/// A store with objects a, b, c tagged as `img` and d unreferenced.
struct Fixture {
    _dir: tempfile::TempDir,
    store: Store,
    a: [u8; 32],
    b: [u8; 32],
    c: [u8; 32],
    d: [u8; 32],
    sizes: [u64; 4],
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::create(&dir.path().join("store")).unwrap();
        let (da, db, dc, dd) = (data(1, 5000), data(2, 3 << 20), data(3, 4096), data(4, 70_000));
        let (a, b, c, d) = (
            put_object(&store, &da),
            put_object(&store, &db),
            put_object(&store, &dc),
            put_object(&store, &dd),
        );
        tags::write_tag(&store, "img", &image(&[("a", &da), ("b", &db), ("c", &dc)])).unwrap();
        Fixture {
            _dir: dir,
            store,
            a,
            b,
            c,
            d,
            sizes: [da.len() as u64, db.len() as u64, dc.len() as u64, dd.len() as u64],
        }
    }

    fn root(&self) -> &Path {
        self.store.path()
    }

    fn check(&self, repair: bool) -> FsckReport {
        fsck(&self.store, &FsckOptions { repair, jobs: 2 }, &|_, _| {}).unwrap()
    }
}

fn quarantined(store: &Store) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(store.join(QUARANTINE_DIR))
        .map(|rd| rd.map(|e| e.unwrap().file_name().into_string().unwrap()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn clean_store() {
    let f = Fixture::new();
    let done = AtomicU64::new(0);
    let total = AtomicU64::new(0);
    let calls = AtomicU64::new(0);
    let r = fsck(&f.store, &FsckOptions { repair: false, jobs: 0 }, &|d, t| {
        done.fetch_max(d, Ordering::Relaxed);
        total.store(t, Ordering::Relaxed);
        calls.fetch_add(1, Ordering::Relaxed);
    })
    .unwrap();
    assert!(r.is_clean(), "{r:?}");
    assert_eq!(r.objects, 4);
    assert_eq!(r.images, 1);
    assert_eq!(r.bytes, f.sizes.iter().sum::<u64>());
    assert_eq!(total.load(Ordering::Relaxed), r.bytes);
    assert_eq!(done.load(Ordering::Relaxed), r.bytes);
    // The 3 MiB object alone is read in several pieces.
    assert!(calls.load(Ordering::Relaxed) >= 5);
    assert_eq!(r.leftovers, 0);
    // One thread gives the same answer.
    let r1 = fsck(&f.store, &FsckOptions { repair: false, jobs: 1 }, &|_, _| {}).unwrap();
    assert!(r1.is_clean() && r1.objects == 4);
}

#[test]
fn corrupt_object_repaired_then_missing() {
    let f = Fixture::new();
    let path = f.store.object_path(&f.b);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[1 << 20] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();

    let r = f.check(false);
    assert!(!r.is_clean());
    assert_eq!(r.corrupt, vec![path.clone()]);
    assert!(r.missing.is_empty() && r.strays.is_empty() && r.repaired.is_empty());
    assert!(path.exists(), "fsck without --repair moves nothing");

    let r = f.check(true);
    assert_eq!(r.corrupt, vec![path.clone()]);
    assert_eq!(r.repaired, vec![path.clone()]);
    assert!(!path.exists());
    let rel = Store::object_rel(&f.b);
    assert_eq!(quarantined(&f.store), vec![rel.replace('/', "_")]);
    // The report describes the store after the repair.
    assert_eq!(r.missing, vec![(rel.clone(), vec!["img".to_string()])]);

    let r = f.check(false);
    assert!(r.corrupt.is_empty());
    assert_eq!(r.missing, vec![(rel, vec!["img".to_string()])]);
    assert_eq!(r.objects, 3);
}

#[test]
fn quarantine_names_do_not_collide() {
    let f = Fixture::new();
    for round in 0..2 {
        let path = f.store.object_path(&f.c);
        std::fs::write(&path, format!("bad {round}")).unwrap();
        let r = f.check(true);
        assert_eq!(r.repaired, vec![path]);
    }
    let base = Store::object_rel(&f.c).replace('/', "_");
    assert_eq!(quarantined(&f.store), vec![base.clone(), format!("{base}.1")]);
}

#[test]
fn missing_object_names_its_tags() {
    let f = Fixture::new();
    let (dc, da) = (data(3, 4096), data(1, 5000));
    tags::write_tag(&f.store, "other", &image(&[("x", &dc), ("y", &da)])).unwrap();
    std::fs::remove_file(f.store.object_path(&f.c)).unwrap();
    let r = f.check(false);
    assert!(!r.is_clean());
    assert_eq!(r.images, 2);
    assert_eq!(
        r.missing,
        vec![(Store::object_rel(&f.c), vec!["img".to_string(), "other".to_string()])]
    );
    assert!(r.corrupt.is_empty() && r.strays.is_empty());
    // --repair cannot bring it back.
    let r = f.check(true);
    assert_eq!(r.missing.len(), 1);
    assert!(r.repaired.is_empty());
}

#[test]
fn strays_and_symlinks() {
    let f = Fixture::new();
    let outside = f._dir.path().join("outside");
    std::fs::write(&outside, data(9, 100)).unwrap();
    let sym_digest = verity::digest_bytes(&data(9, 100));
    let sym_obj = f.store.object_path(&sym_digest);
    std::fs::create_dir_all(sym_obj.parent().unwrap()).unwrap();
    symlink(&outside, &sym_obj).unwrap();
    let fan = Store::object_rel(&f.a)[..2].to_string();
    let badname = f.root().join(&fan).join("not-an-object");
    std::fs::write(&badname, b"x").unwrap();
    let upper = f.root().join("AB");
    std::fs::create_dir(&upper).unwrap();
    let junk = f.root().join("junk");
    std::fs::write(&junk, b"junk").unwrap();
    let fan_link = f.root().join("fe");
    symlink(f._dir.path(), &fan_link).unwrap();
    let tag_link = f.root().join("images").join("linked");
    symlink(&outside, &tag_link).unwrap();

    let r = f.check(false);
    let mut want = vec![
        sym_obj.clone(),
        badname.clone(),
        upper.clone(),
        junk.clone(),
        fan_link.clone(),
        tag_link,
    ];
    want.sort();
    assert_eq!(r.strays, want);
    assert!(r.corrupt.is_empty() && r.missing.is_empty() && r.bad_images.is_empty());
    assert_eq!(r.objects, 4);
    // The symlinked tag is not a tag.
    assert_eq!(tags::list_tags(&f.store).unwrap().len(), 1);

    let r = f.check(true);
    assert_eq!(r.repaired, want);
    assert_eq!(quarantined(&f.store).len(), want.len());
    assert!(outside.exists(), "a symlink's target is never touched");
    let r = f.check(false);
    assert!(r.is_clean(), "{r:?}");
    assert_eq!(r.objects, 4);
}

#[test]
fn leftovers_are_not_problems() {
    let f = Fixture::new();
    let tmp = f.store.subdir(TMP_DIR).unwrap();
    std::fs::write(tmp.join("obj-123"), data(5, 3000)).unwrap();
    std::fs::write(f.root().join(".tmpAbC123"), b"partial").unwrap();
    let r = f.check(false);
    assert!(r.is_clean(), "{r:?}");
    assert_eq!(r.leftovers, 2);
    assert!(r.repaired.is_empty());
}

#[test]
fn bad_references_and_unreadable_images() {
    let f = Fixture::new();
    let evil = "/ 4096 40755 2 0 0 0 0.0 - - -\n/evil 100 100644 1 0 0 0 0.0 ../../etc/passwd - -\n";
    tags::write_tag(&f.store, "evil", &image_from_dump(evil)).unwrap();
    tags::write_tag(&f.store, "garbage", b"not an image at all").unwrap();
    let r = f.check(false);
    assert!(!r.is_clean());
    assert_eq!(r.bad_images.len(), 2, "{:?}", r.bad_images);
    assert_eq!(r.bad_images[0].0, "evil");
    assert!(r.bad_images[0].1.contains("/evil") && r.bad_images[0].1.contains("not an object path"));
    assert_eq!(r.bad_images[1].0, "garbage");
    assert!(r.missing.is_empty());
}

#[test]
fn gc_removes_exactly_the_unreferenced() {
    let f = Fixture::new();
    let tmp = f.store.subdir(TMP_DIR).unwrap();
    std::fs::write(tmp.join("obj-123"), data(5, 3000)).unwrap();
    std::fs::create_dir(tmp.join("dir-leftover")).unwrap();
    std::fs::write(tmp.join("dir-leftover/f"), b"12345").unwrap();
    std::fs::write(f.root().join(".tmpAbC123"), b"partial").unwrap();
    let stray = f.root().join("junk");
    std::fs::write(&stray, b"junk").unwrap();

    let dry = gc(
        &f.store,
        &GcOptions {
            dry_run: true,
            ..GcOptions::default()
        },
    )
    .unwrap();
    assert!(dry.dry_run);
    assert_eq!((dry.objects_removed, dry.bytes_removed), (1, f.sizes[3]));
    assert_eq!((dry.leftovers_removed, dry.leftover_bytes_removed), (3, 3000 + 5 + 7));
    assert_eq!((dry.objects_kept, dry.images), (3, 1));
    assert!(f.store.has_object(&f.d), "dry run removes nothing");
    assert!(tmp.join("obj-123").exists() && f.root().join(".tmpAbC123").exists());

    let r = gc(&f.store, &GcOptions::default()).unwrap();
    assert!(!r.dry_run);
    assert_eq!(
        (r.objects_removed, r.bytes_removed, r.leftovers_removed, r.objects_kept),
        (
            dry.objects_removed,
            dry.bytes_removed,
            dry.leftovers_removed,
            dry.objects_kept
        )
    );
    assert_eq!(r.bytes_kept, f.sizes[..3].iter().sum::<u64>());
    assert!(!f.store.has_object(&f.d));
    for d in [f.a, f.b, f.c] {
        assert!(f.store.has_object(&d));
    }
    assert_eq!(std::fs::read_dir(&tmp).unwrap().count(), 0);
    assert!(!f.root().join(".tmpAbC123").exists());
    assert!(stray.exists(), "gc leaves strays to fsck");
    let r = f.check(false);
    assert_eq!((r.objects, r.leftovers), (3, 0));

    // Untagging frees the rest.
    tags::remove_tag(&f.store, "img").unwrap();
    let r = gc(&f.store, &GcOptions::default()).unwrap();
    assert_eq!((r.objects_removed, r.objects_kept, r.images), (3, 0, 0));
    assert!(f.store.scan_objects().unwrap().objects.is_empty());
}

#[test]
fn gc_does_not_follow_a_symlinked_tmp() {
    let f = Fixture::new();
    let elsewhere = f._dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::write(elsewhere.join("precious"), b"keep me").unwrap();
    std::fs::remove_dir_all(f.root().join(TMP_DIR)).unwrap();
    symlink(&elsewhere, f.root().join(TMP_DIR)).unwrap();
    let e = gc(&f.store, &GcOptions::default()).unwrap_err().to_string();
    assert!(e.contains("refusing to gc") && e.contains(TMP_DIR), "{e}");
    assert!(elsewhere.join("precious").exists());
    assert!(f.store.has_object(&f.d), "nothing removed");
    // fsck names it, and --repair moves the symlink (not its target) aside.
    let r = f.check(false);
    assert_eq!((r.strays.clone(), r.leftovers), (vec![f.root().join(TMP_DIR)], 0));
    f.check(true);
    assert!(elsewhere.join("precious").exists());
    assert!(gc(&f.store, &GcOptions::default()).is_ok());
    assert!(elsewhere.join("precious").exists());
}

#[test]
fn gc_refuses_when_a_tagged_image_is_unreadable() {
    let f = Fixture::new();
    tags::write_tag(&f.store, "broken", b"garbage").unwrap();
    let e = gc(&f.store, &GcOptions::default()).unwrap_err().to_string();
    assert!(e.contains("refusing to gc") && e.contains("broken"), "{e}");
    for d in [f.a, f.b, f.c, f.d] {
        assert!(f.store.has_object(&d), "nothing removed");
    }
    // Nor when images/ holds something that is not a tag.
    tags::remove_tag(&f.store, "broken").unwrap();
    std::fs::create_dir(f.root().join("images/subdir")).unwrap();
    let e = gc(&f.store, &GcOptions::default()).unwrap_err().to_string();
    assert!(e.contains("refusing to gc") && e.contains("subdir"), "{e}");
    assert!(f.store.has_object(&f.d));
}

#[test]
fn gc_waits_for_builds() {
    let f = Fixture::new();
    let build = f.store.lock(LockMode::Shared, true).unwrap();
    let root: PathBuf = f.root().to_path_buf();
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || {
        let store = Store::open(&root).unwrap();
        tx.send(gc(&store, &GcOptions::default()).map(|r| r.objects_removed))
            .unwrap();
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "gc must wait while a build holds the lock"
    );
    assert!(f.store.has_object(&f.d));
    drop(build);
    let removed = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("gc finishes once the lock is free");
    assert_eq!(removed.unwrap(), 1);
    t.join().unwrap();
}

#[test]
fn a_symlinked_images_dir_is_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::create(&dir.path().join("store")).unwrap();
    let outside = dir.path().join("imgs");
    std::fs::create_dir(&outside).unwrap();
    symlink(&outside, store.join("images")).unwrap();
    assert!(tags::list_tags(&store).is_err());
    assert!(tags::write_tag(&store, "t", b"x").is_err());
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    let r = fsck(&store, &FsckOptions::default(), &|_, _| {}).unwrap();
    assert_eq!(r.strays, vec![store.join("images")]);
    assert!(gc(&store, &GcOptions::default()).is_err());
}

#[test]
fn gc_drops_the_trust_records_of_images_no_tag_keeps() {
    let f = Fixture::new();
    let trust = f.root().join(tilefs_store::store::TRUST_DIR);
    std::fs::create_dir(&trust).unwrap();
    let tagged = verity::digest_bytes(&tags::read_tag(&f.store, "img").unwrap());
    let kept = trust.join(format!("{}.json", hex::encode(tagged)));
    let gone = trust.join(format!("{}.json", hex::encode([7u8; 32])));
    let other = trust.join("notes.txt");
    for p in [&kept, &gone, &other] {
        std::fs::write(p, "{}").unwrap();
    }
    let dry = gc(
        &f.store,
        &GcOptions {
            dry_run: true,
            ..GcOptions::default()
        },
    )
    .unwrap();
    assert!(dry.dry_run && gone.exists(), "a dry run removes no record");
    gc(&f.store, &GcOptions::default()).unwrap();
    assert!(kept.exists(), "the record of a tagged image stays");
    assert!(!gone.exists(), "the record of an image no tag or mount keeps goes");
    assert!(other.exists(), "what is not a record is left alone");
}

#[test]
fn held_images_are_roots_and_orphans_are_reported_not_collected() {
    let f = Fixture::new();
    let snap = tempfile::tempdir().unwrap();
    std::fs::create_dir(snap.path().join("metadata")).unwrap();
    let holder = tilefs_store::owned::Holder::ContainerdSnapshotter {
        root: snap.path().to_path_buf(),
    };
    // d held (not tagged), then the user's tag of a, b and c removed.
    let dd = std::fs::read(f.store.object_path(&f.d)).unwrap();
    tilefs_store::owned::write_root(&f.store, &holder, "held-1", &image(&[("d", &dd)])).unwrap();
    tags::remove_tag(&f.store, "img").unwrap();
    let r = gc(&f.store, &GcOptions::default()).unwrap();
    assert_eq!((r.images, r.held, r.objects_removed, r.objects_kept), (0, 1, 3, 1));
    assert!(f.store.has_object(&f.d));
    let report = f.check(false);
    assert!(report.is_clean() && report.orphaned.is_empty(), "{report:?}");
    assert_eq!((report.images, report.held), (0, 1));
    // Its holder gone for good: still a root, and fsck says so.
    drop(snap);
    let report = f.check(false);
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.orphaned.len(), 1, "{report:?}");
    assert!(report.orphaned[0].why.contains("does not exist"), "{report:?}");
    assert_eq!(report.orphaned[0].images, ["held-1"]);
    gc(&f.store, &GcOptions::default()).unwrap();
    assert!(f.store.has_object(&f.d), "gc collected what an orphaned image holds");
    assert_eq!(tilefs_store::owned::release_orphaned(&f.store).unwrap().len(), 1);
    gc(&f.store, &GcOptions::default()).unwrap();
    assert!(!f.store.has_object(&f.d));
}

#[test]
fn a_limited_gc_removes_only_unreferenced_candidates_and_no_leftovers() {
    let f = Fixture::new();
    let leftover = f.store.join(TMP_DIR).join("half-written");
    std::fs::create_dir_all(leftover.parent().unwrap()).unwrap();
    std::fs::write(&leftover, b"x").unwrap();
    let extra = put_object(&f.store, &data(9, 9000));
    // a is tagged: kept; d is a candidate no root has; `extra` is none.
    let only = [f.a, f.d, [0x42; 32]].into_iter().collect();
    let r = gc(
        &f.store,
        &GcOptions {
            only: Some(only),
            ..GcOptions::default()
        },
    )
    .unwrap();
    assert_eq!((r.objects_removed, r.objects_kept, r.leftovers_removed), (1, 1, 0));
    assert_eq!(r.bytes_removed, f.sizes[3]);
    assert!(!f.store.has_object(&f.d) && f.store.has_object(&f.a) && f.store.has_object(&extra));
    assert!(leftover.exists());
    // Not waiting: a build holding the lock makes it busy at once.
    let _build = f.store.lock(LockMode::Shared, true).unwrap();
    let busy = gc(
        &f.store,
        &GcOptions {
            no_wait: true,
            ..GcOptions::default()
        },
    );
    assert!(matches!(busy, Err(tilefs_store::StoreError::Busy(_))), "{busy:?}");
}
