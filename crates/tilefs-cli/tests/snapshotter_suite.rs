//! The snapshotter contract containerd documents, against the real
//! snapshotter (store, EROFS images, kernel overlays) over its gRPC API,
//! with the mounts it gives made as containerd makes them: layers written
//! through one mount read back through the next, whiteouts, renames,
//! hard links, owners and modes kept, views read-only, parents not removed
//! under children, and everything found again after a restart. The same
//! contract runs without root against a backend in memory in the
//! snapshotter crate's unit tests.

mod common;

use common::snapshotter::{mount_all, Snap};
use common::*;
use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use tonic::Code;

/// Prepares `key` over `parent`, mounts it at `at`, lets `write` change
/// it, unmounts and commits it as `name`.
fn layer(snap: &Snap, name: &str, parent: &str, at: &Path, write: impl FnOnce(&Path)) {
    let key = format!("{name}-active");
    let m = snap
        .prepare_mounts(&key, parent, HashMap::new())
        .unwrap_or_else(|e| panic!("prepare {key}: {e:?}\n{}", snap.log()));
    {
        let _mounted = mount_all(&m, at);
        write(at);
    }
    snap.commit(name, &key)
        .unwrap_or_else(|e| panic!("commit {name}: {e:?}\n{}", snap.log()));
}

fn read(p: &Path) -> String {
    fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn the_snapshotter_keeps_containerds_contract_with_real_mounts() {
    require(not_root("the snapshotter mounts"));
    let area = Area::new();
    let base = area.path("");
    let mut snap = Snap::start(&base);
    let work = base.join("work");

    // A first layer: files, directories with their modes, an owner.
    layer(&snap, "l1", "", &work.join("l1"), |d| {
        fs::write(d.join("foo"), "foo\n").unwrap();
        fs::create_dir_all(d.join("a/b/c")).unwrap();
        fs::create_dir(d.join("private")).unwrap();
        fs::set_permissions(d.join("private"), fs::Permissions::from_mode(0o700)).unwrap();
        fs::write(d.join("private/f"), "secret").unwrap();
        fs::write(d.join("owned"), "x").unwrap();
        std::os::unix::fs::lchown(d.join("owned"), Some(1234), Some(5678)).unwrap();
        fs::write(d.join("moved"), "move me").unwrap();
        fs::write(d.join("gone"), "delete me").unwrap();
        fs::write(d.join("h1"), "linked").unwrap();
        fs::hard_link(d.join("h1"), d.join("h2")).unwrap();
        // The root as a layer without a `./` entry leaves it.
        assert_eq!(fs::metadata(d).unwrap().mode() & 0o7777, 0o755);
    });
    let l1 = snap.info("l1").unwrap();
    assert_eq!((l1.kind, l1.parent.as_str()), (3, ""), "committed, no parent");
    assert_eq!(snap.info("l1-active").unwrap_err().0, Code::NotFound);

    // A second over it: what the first wrote is there; it changes, removes,
    // renames and links.
    layer(&snap, "l2", "l1", &work.join("l2"), |d| {
        assert_eq!(read(&d.join("foo")), "foo\n");
        assert!(d.join("a/b/c").is_dir());
        fs::write(d.join("foo"), "bar\n").unwrap();
        fs::write(d.join("bar"), "bar\n").unwrap();
        fs::remove_dir_all(d.join("a/b")).unwrap();
        fs::remove_file(d.join("gone")).unwrap();
        fs::create_dir(d.join("dir3")).unwrap();
        fs::rename(d.join("moved"), d.join("dir3/moved")).unwrap();
        fs::hard_link(d.join("dir3/moved"), d.join("dir3/link")).unwrap();
    });
    let l2 = snap.info("l2").unwrap();
    assert_eq!((l2.kind, l2.parent.as_str()), (3, "l1"));

    // A third that changes nothing, then a view of the chain.
    layer(&snap, "l3", "l2", &work.join("l3"), |_| {});
    let v = snap.view_mounts("look", "l3").unwrap();
    {
        let at = work.join("look");
        let _m = mount_all(&v, &at);
        assert_eq!(read(&at.join("foo")), "bar\n");
        assert_eq!(read(&at.join("bar")), "bar\n");
        assert!(at.join("a").is_dir() && !at.join("a/b").exists());
        assert!(!at.join("gone").exists() && !at.join("moved").exists());
        assert_eq!(read(&at.join("dir3/moved")), "move me");
        assert_eq!(read(&at.join("dir3/link")), "move me");
        let (h1, h2) = (
            fs::metadata(at.join("h1")).unwrap(),
            fs::metadata(at.join("h2")).unwrap(),
        );
        assert_eq!(h1.ino(), h2.ino(), "a hard link stays one file");
        let owned = fs::metadata(at.join("owned")).unwrap();
        assert_eq!((owned.uid(), owned.gid()), (1234, 5678));
        assert_eq!(fs::metadata(at.join("private")).unwrap().mode() & 0o7777, 0o700);
        assert_eq!(read(&at.join("private/f")), "secret");
        // A view is read-only.
        assert!(fs::write(at.join("new"), "x").is_err(), "wrote into a view");
    }

    // Keys are taken once; parents must exist and be committed.
    assert_eq!(snap.view_mounts("look", "l3").unwrap_err().0, Code::AlreadyExists);
    snap.prepare_mounts("busy", "l3", HashMap::new()).unwrap();
    assert_eq!(snap.view_mounts("busy", "l3").unwrap_err().0, Code::AlreadyExists);
    assert_eq!(snap.view_mounts("x", "busy").unwrap_err().0, Code::InvalidArgument);
    assert_eq!(snap.view_mounts("x", "nowhere").unwrap_err().0, Code::NotFound);
    assert_eq!(snap.commit("l4", "l3").unwrap_err().0, Code::FailedPrecondition);

    // Labels change by field path, and nothing else does.
    let asked = |labels: &[(&str, &str)]| containerd_snapshots::api::snapshots::v1::Info {
        name: "l2".into(),
        parent: "elsewhere".into(),
        labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        ..Default::default()
    };
    let u = snap.update(asked(&[("a", "1"), ("b", "2")]), &[]).unwrap();
    assert_eq!((u.parent.as_str(), u.labels.len()), ("l1", 2));
    let u = snap
        .update(asked(&[("a", "changed")]), &["labels.a", "labels.b"])
        .unwrap();
    assert_eq!(u.labels, HashMap::from([("a".to_string(), "changed".to_string())]));
    assert_eq!(
        snap.update(asked(&[]), &["parent"]).unwrap_err().0,
        Code::InvalidArgument
    );
    assert_eq!(snap.walk_names(&["labels.a==changed"]), ["l2"]);
    assert_eq!(snap.walk_names(&["parent==l3"]), ["busy", "look"]);
    assert_eq!(snap.walk_names(&["kind==committed"]), ["l1", "l2", "l3"]);

    // A restart finds it all, and mounts the chain again.
    snap.stop();
    snap.run();
    assert_eq!(
        snap.info("l2").unwrap().labels.get("a").map(String::as_str),
        Some("changed")
    );
    assert_eq!(snap.walk_names(&[]), ["busy", "l1", "l2", "l3", "look"]);
    let v = snap.view_mounts("again", "l2").unwrap();
    {
        let at = work.join("again");
        let _m = mount_all(&v, &at);
        assert_eq!(read(&at.join("dir3/link")), "move me");
    }

    // A parent is not removed under its children; the chain goes top down.
    for k in ["l1", "l2", "l3"] {
        let e = snap.try_remove(k).unwrap_err();
        assert_eq!(e.0, Code::FailedPrecondition, "{k}: {e:?}");
    }
    for k in ["again", "look", "busy", "l3", "l2", "l1"] {
        snap.try_remove(k)
            .unwrap_or_else(|e| panic!("remove {k}: {e:?}\n{}", snap.log()));
    }
    assert!(snap.walk_names(&[]).is_empty());
    assert_eq!(snap.try_remove("l1").unwrap_err().0, Code::NotFound);
}
