//! `tilefs images`, `untag`, `fsck` and `gc` through the binary: exit codes,
//! text and JSON output. Stores are built by hand (objects at their digest
//! paths, tagged images written from dumps), not by `tilefs build`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tilefs_image::{dump, erofs, verity};
use tilefs_store::{tags, Store};

fn tilefs(args: &[&str], store: &Path) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tilefs"));
    cmd.args(&args[..1]).arg("--store").arg(store).args(&args[1..]);
    cmd.output().expect("running tilefs")
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", stdout(o)))
}

fn data(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(seed as u32) as u8 ^ seed)
        .collect()
}

fn put_object(store: &Store, contents: &[u8]) -> [u8; 32] {
    let d = verity::digest_bytes(contents);
    let path = store.object_path(&d);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, contents).unwrap();
    d
}

fn image(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut text = String::from("/ 4096 40755 2 0 0 0 0.0 - - -\n");
    for (name, contents) in files {
        let d = verity::digest_bytes(contents);
        text.push_str(&format!(
            "/{name} {} 100644 1 0 0 0 0.0 {} - {}\n",
            contents.len(),
            Store::object_rel(&d),
            hex::encode(d)
        ));
    }
    let tree = dump::parse(text.as_bytes(), dump::ParseOptions::default()).unwrap();
    erofs::write_image(&tree, &erofs::WriteOptions::default())
        .unwrap()
        .bytes
}

/// Objects a (2000 bytes), b (100000), shared (5000) and unused (3000);
/// tag `one` uses a and shared, tag `two` b and shared.
struct Fixture {
    _dir: tempfile::TempDir,
    store: Store,
    path: PathBuf,
    a: [u8; 32],
    b: [u8; 32],
    unused: [u8; 32],
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let store = Store::create(&path).unwrap();
        let (da, db, ds, du) = (data(1, 2000), data(2, 100_000), data(3, 5000), data(4, 3000));
        let a = put_object(&store, &da);
        let b = put_object(&store, &db);
        put_object(&store, &ds);
        let unused = put_object(&store, &du);
        tags::write_tag(&store, "one", &image(&[("a", &da), ("s", &ds)])).unwrap();
        tags::write_tag(&store, "two", &image(&[("b", &db), ("s", &ds), ("s2", &ds)])).unwrap();
        Fixture {
            _dir: dir,
            store,
            path,
            a,
            b,
            unused,
        }
    }

    fn run(&self, args: &[&str]) -> Output {
        tilefs(args, &self.path)
    }
}

#[test]
fn images_lists_tags() {
    let f = Fixture::new();
    let o = f.run(&["images", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["tag"], "one");
    assert_eq!(rows[0]["objects"], 2);
    assert_eq!(rows[0]["external_bytes"], 7000);
    assert_eq!(rows[0]["missing"], 0);
    assert_eq!(rows[1]["tag"], "two");
    assert_eq!(rows[1]["objects"], 2);
    assert_eq!(rows[1]["external_bytes"], 110_000);
    let size = std::fs::metadata(f.path.join("images/two")).unwrap().len();
    assert_eq!(rows[1]["image_bytes"], size);

    std::fs::remove_file(f.store.object_path(&f.b)).unwrap();
    let o = f.run(&["images"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = stdout(&o);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    for col in ["TAG", "IMAGE SIZE", "OBJECTS", "EXTERNAL BYTES", "MISSING"] {
        assert!(lines[0].contains(col), "{text}");
    }
    let two: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(two[0], "two");
    assert_eq!(two.last(), Some(&"1"), "one missing object: {text}");
}

#[test]
fn untag() {
    let f = Fixture::new();
    let o = f.run(&["untag", "one"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(!f.path.join("images/one").exists());
    let o = f.run(&["untag", "one"]);
    assert_eq!(code(&o), 1);
    assert!(stderr(&o).contains("no tag \"one\""), "{}", stderr(&o));
    let o = f.run(&["untag", "../two"]);
    assert_eq!(code(&o), 1);
    assert!(stderr(&o).contains("invalid tag name"), "{}", stderr(&o));
    let o = f.run(&["images", "--json"]);
    assert_eq!(json(&o).as_array().unwrap().len(), 1);
}

#[test]
fn fsck_exit_codes_and_reports() {
    let f = Fixture::new();
    let o = f.run(&["fsck", "-q"]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    assert_eq!(stdout(&o), "", "fsck -q says nothing of a clean store");
    let o = f.run(&["fsck"]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("clean"));
    let o = f.run(&["fsck", "--json", "-j", "2"]);
    assert_eq!(code(&o), 0);
    let v = json(&o);
    assert_eq!(v["clean"], true);
    assert_eq!(v["objects"], 4);
    assert_eq!(v["images"], 2);
    assert_eq!(v["bytes"], 110_000);

    // A leftover is not a problem.
    std::fs::write(f.path.join(".tmp/partial"), b"xx").unwrap();
    let o = f.run(&["fsck", "--json"]);
    assert_eq!(code(&o), 0);
    assert_eq!(json(&o)["leftovers"], 1);

    // Corrupt.
    let a_path = f.store.object_path(&f.a);
    let mut bytes = std::fs::read(&a_path).unwrap();
    bytes[7] ^= 1;
    std::fs::write(&a_path, &bytes).unwrap();
    let o = f.run(&["fsck", "-q"]);
    assert_eq!(code(&o), 1);
    let text = stdout(&o);
    assert!(
        text.contains(&format!("corrupt object: {} (used by one)", a_path.display())),
        "{text}"
    );
    assert!(text.contains("--repair"), "{text}");
    let o = f.run(&["fsck", "--json"]);
    assert_eq!(code(&o), 1);
    let v = json(&o);
    assert_eq!(v["clean"], false);
    assert_eq!(v["corrupt"], serde_json::json!([a_path]));
    assert_eq!(
        v["corrupt_used_by"],
        serde_json::json!([{"object": a_path, "tags": ["one"]}]),
        "fsck names the images that use a corrupt object"
    );

    // Repaired, but still a problem: the object is now missing.
    let o = f.run(&["fsck", "-q", "--repair"]);
    assert_eq!(code(&o), 1);
    let text = stdout(&o);
    assert!(
        text.contains("moved to quarantine") && text.contains(".quarantine"),
        "{text}"
    );
    assert!(text.contains("`tilefs pull` again"), "{text}");
    assert!(!a_path.exists());
    let o = f.run(&["fsck", "--json"]);
    assert_eq!(code(&o), 1);
    let v = json(&o);
    assert_eq!(v["corrupt"], serde_json::json!([]));
    assert_eq!(v["missing"][0]["object"], Store::object_rel(&f.a));
    assert_eq!(v["missing"][0]["tags"], serde_json::json!(["one"]));
    let o = f.run(&["fsck", "-q"]);
    let text = stdout(&o);
    assert!(
        text.contains("missing object:") && text.contains("(needed by one)"),
        "{text}"
    );
    assert!(text.contains("`tilefs pull` again"), "{text}");
}

#[test]
fn fsck_strays() {
    let f = Fixture::new();
    let fan = &Store::object_rel(&f.unused)[..2];
    let stray = f.path.join(fan).join("stray");
    std::fs::write(&stray, b"?").unwrap();
    let link = f.store.object_path(&verity::digest_bytes(b"elsewhere"));
    std::fs::create_dir_all(link.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", &link).unwrap();
    let o = f.run(&["fsck", "--json"]);
    assert_eq!(code(&o), 1);
    let v = json(&o);
    let mut want = vec![stray.clone(), link.clone()];
    want.sort();
    assert_eq!(v["strays"], serde_json::json!(want));
    // Every stray moved aside: the store is sound again, and fsck says so.
    let o = f.run(&["fsck", "--json", "--repair"]);
    assert_eq!(code(&o), 0);
    assert_eq!(json(&o)["repaired"], serde_json::json!(want));
    let o = f.run(&["fsck", "-q"]);
    assert_eq!(code(&o), 0, "{}", stdout(&o));
}

#[test]
fn gc_dry_run_then_real() {
    let f = Fixture::new();
    std::fs::write(f.path.join(".tmp/partial"), b"12345").unwrap();
    std::fs::write(f.path.join(".tmpXYZ123"), b"123").unwrap();
    let o = f.run(&["gc", "--dry-run", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["dry_run"], true);
    assert_eq!(v["objects_removed"], 1);
    assert_eq!(v["bytes_removed"], 3000);
    assert_eq!(v["leftovers_removed"], 2);
    assert_eq!(v["leftover_bytes_removed"], 8);
    assert_eq!(v["objects_kept"], 3);
    assert!(f.store.has_object(&f.unused));

    let o = f.run(&["gc", "--dry-run"]);
    assert!(stdout(&o).contains("would remove 1 object"), "{}", stdout(&o));
    assert!(f.store.has_object(&f.unused));

    let o = f.run(&["gc"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("removed 1 object (2.93 KiB)"), "{text}");
    assert!(text.contains("kept 3 objects"), "{text}");
    assert!(!f.store.has_object(&f.unused));
    assert!(!f.path.join(".tmp/partial").exists() && !f.path.join(".tmpXYZ123").exists());
    let o = f.run(&["fsck", "--json"]);
    assert_eq!(code(&o), 0);
    assert_eq!(json(&o)["objects"], 3);

    let o = f.run(&["untag", "two"]);
    assert_eq!(code(&o), 0);
    let o = f.run(&["gc", "--json"]);
    assert_eq!(json(&o)["objects_removed"], 1);
    assert!(!f.store.has_object(&f.b));
}

#[test]
fn gc_refuses_an_unreadable_tag() {
    let f = Fixture::new();
    tags::write_tag(&f.store, "broken", b"nonsense").unwrap();
    let o = f.run(&["gc"]);
    assert_eq!(code(&o), 1);
    let e = stderr(&o);
    assert!(e.contains("refusing to gc") && e.contains("broken"), "{e}");
    assert!(f.store.has_object(&f.unused));
    // fsck names it, and `images` flags it.
    let o = f.run(&["fsck", "--json"]);
    assert_eq!(code(&o), 1);
    assert_eq!(json(&o)["bad_images"][0]["tag"], "broken");
    let o = f.run(&["images", "--json"]);
    assert_eq!(code(&o), 1);
    assert!(json(&o)[0]["error"].is_string());
}

#[test]
fn no_such_store() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    for cmd in ["images", "fsck", "gc"] {
        let o = tilefs(&[cmd], &missing);
        assert_eq!(code(&o), 1);
        assert!(stderr(&o).contains(&missing.display().to_string()), "{}", stderr(&o));
        assert!(!missing.exists());
    }
}
