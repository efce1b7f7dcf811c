//! The writable filesystem driven in-process (see `common`): the image of
//! a small tree as the lower layer, changes in an upper directory checked
//! on disk as a user (or the kernel's overlayfs) reads it. Needs no root:
//! without it the server keeps overlayfs's markers under `user.overlay.*`
//! and whiteouts are character devices 0/0, which Linux lets any user make.

mod common;

use common::{Kernel, ROOT};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use tilefs_fuse::{OverlayFs, ServeSpec, Verity};
use tilefs_fuse_proto::abi::{self, fattr};

/// The image's tree.
fn tree(src: &Path) {
    std::fs::create_dir(src.join("dir")).unwrap();
    std::fs::write(src.join("dir/hello"), b"hello, world\n").unwrap();
    std::fs::create_dir(src.join("dir/sub")).unwrap();
    std::fs::write(src.join("dir/sub/deep"), b"deep\n").unwrap();
    // Larger than an inline tail: its data is the store's object.
    std::fs::write(src.join("big"), vec![7u8; 100_000]).unwrap();
    rustix::fs::setxattr(
        src.join("dir/hello"),
        "user.note",
        b"kept",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
}

/// A writable filesystem over the image of `tree`, and where its parts are.
struct Mount {
    fs: Kernel<OverlayFs>,
    dir: tempfile::TempDir,
}

impl Mount {
    fn new() -> Mount {
        let dir = tempfile::tempdir().unwrap();
        let image = common::build_image(dir.path(), tree);
        for d in ["upper", "work", "outside"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        let mut spec = ServeSpec::new(&image, dir.path().join("store"));
        spec.verity = Verity::Auto;
        spec.upper = Some((dir.path().join("upper"), dir.path().join("work")));
        let fs = Kernel::new(OverlayFs::from_spec(&spec).unwrap());
        Mount { fs, dir }
    }

    /// A path in the upper directory.
    fn upper(&self, rel: &str) -> PathBuf {
        self.dir.path().join("upper").join(rel)
    }

    /// The node of `path` (from the root), looked up name by name.
    fn node(&mut self, path: &str) -> u64 {
        path.split('/').fold(ROOT, |dir, name| {
            let (id, _, _) = self.fs.lookup(dir, name).unwrap();
            assert_ne!(id, 0, "{path}: no such entry");
            id
        })
    }

    /// The whole content of file `path`, read through the filesystem.
    fn content(&mut self, path: &str) -> Vec<u8> {
        let node = self.node(path);
        let fh = self.fs.open_ro(node).unwrap();
        let data = self.fs.read(node, fh, 0, 1 << 20).unwrap();
        self.fs.release(node, fh);
        data
    }
}

/// The namespace the server keeps overlayfs's markers in.
fn overlay_xattr(what: &str) -> String {
    let ns = if rustix::process::geteuid().is_root() {
        "trusted"
    } else {
        "user"
    };
    format!("{ns}.overlay.{what}")
}

fn is_whiteout(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_char_device() && m.rdev() == 0)
}

fn xattr(p: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0; 4096];
    let n = rustix::fs::lgetxattr(p, name, &mut buf).ok()?;
    buf.truncate(n);
    Some(buf)
}

#[test]
fn a_created_file_reads_back_and_is_in_the_upper_directory() {
    let mut m = Mount::new();
    let (node, fh) = m.fs.create(ROOT, "new", 0o644, libc::O_RDWR).unwrap();
    assert_eq!(m.fs.write(node, fh, 0, b"written ").unwrap(), 8);
    assert_eq!(m.fs.write(node, fh, 8, b"here\n").unwrap(), 5);
    assert_eq!(m.fs.read(node, fh, 0, 4096).unwrap(), b"written here\n");
    m.fs.release(node, fh);
    assert_eq!(m.fs.getattr(node), (libc::S_IFREG | 0o644, 13));
    assert_eq!(std::fs::read(m.upper("new")).unwrap(), b"written here\n");
    assert_eq!(m.fs.names(ROOT), ["big", "dir", "new"]);
    // Creating it again: the name is taken.
    assert_eq!(
        m.fs.create(ROOT, "new", 0o644, libc::O_RDWR | libc::O_EXCL).map(drop),
        Err(libc::EEXIST)
    );
}

#[test]
fn writing_an_image_file_copies_it_up_and_leaves_the_image_alone() {
    let mut m = Mount::new();
    let object = m
        .dir
        .path()
        .join("store")
        .join(tilefs_store::Store::object_rel(&tilefs_image::verity::digest_bytes(
            &vec![7u8; 100_000],
        )));
    let before = std::fs::read(&object).unwrap();

    // Read-only opens serve the image: nothing is copied.
    assert_eq!(m.content("big"), vec![7u8; 100_000]);
    assert!(!m.upper("big").exists());

    let big = m.node("big");
    let fh = m.fs.open(big, libc::O_WRONLY).unwrap();
    assert_eq!(m.fs.write(big, fh, 10, b"xyz").unwrap(), 3);
    m.fs.release(big, fh);
    let mut want = vec![7u8; 100_000];
    want[10..13].copy_from_slice(b"xyz");
    assert_eq!(m.content("big"), want);
    assert_eq!(std::fs::read(m.upper("big")).unwrap(), want);
    assert_eq!(std::fs::read(&object).unwrap(), before);

    // A file in an image directory: the directory is copied up first, the
    // file with its xattrs, the directory's other entries stay below.
    let hello = m.node("dir/hello");
    let fh = m.fs.open(hello, libc::O_RDWR).unwrap();
    m.fs.write(hello, fh, 0, b"HELLO").unwrap();
    m.fs.release(hello, fh);
    assert_eq!(m.content("dir/hello"), b"HELLO, world\n");
    assert_eq!(std::fs::read(m.upper("dir/hello")).unwrap(), b"HELLO, world\n");
    assert_eq!(xattr(&m.upper("dir/hello"), "user.note").as_deref(), Some(&b"kept"[..]));
    assert_eq!(m.fs.getxattr(hello, "user.note", 64).unwrap(), b"kept");
    assert!(!m.upper("dir/sub").exists());
    let dir = m.node("dir");
    assert_eq!(m.fs.names(dir), ["hello", "sub"]);
    assert_eq!(m.content("dir/sub/deep"), b"deep\n");
}

#[test]
fn removing_image_entries_leaves_whiteouts() {
    let mut m = Mount::new();
    m.fs.unlink(ROOT, "big").unwrap();
    assert!(is_whiteout(&m.upper("big")), "upper/big is not a whiteout");
    assert_eq!(m.fs.lookup(ROOT, "big").map(|e| e.0), Ok(0));
    assert_eq!(m.fs.names(ROOT), ["dir"]);

    // A directory with entries cannot go; emptied, it leaves a whiteout.
    assert_eq!(m.fs.rmdir(ROOT, "dir"), Err(libc::ENOTEMPTY));
    let dir = m.node("dir");
    let sub = m.node("dir/sub");
    m.fs.unlink(sub, "deep").unwrap();
    m.fs.rmdir(dir, "sub").unwrap();
    m.fs.unlink(dir, "hello").unwrap();
    m.fs.rmdir(ROOT, "dir").unwrap();
    assert!(is_whiteout(&m.upper("dir")), "upper/dir is not a whiteout");
    assert!(m.fs.names(ROOT).is_empty());

    // Made again, it is opaque: the image's directory stays hidden.
    let dir = m.fs.mkdir(ROOT, "dir", 0o755).unwrap();
    assert!(m.upper("dir").is_dir());
    assert_eq!(
        xattr(&m.upper("dir"), &overlay_xattr("opaque")).as_deref(),
        Some(&b"y"[..])
    );
    assert!(m.fs.names(dir).is_empty());
    assert_eq!(m.fs.lookup(dir, "hello").map(|e| e.0), Ok(0));
}

#[test]
fn new_directories_come_and_go_without_a_trace() {
    let mut m = Mount::new();
    let d = m.fs.mkdir(ROOT, "d", 0o750).unwrap();
    assert_eq!(m.fs.getattr(d).0, libc::S_IFDIR | 0o750);
    assert!(m.upper("d").is_dir());
    let (f, fh) = m.fs.create(d, "f", 0o600, libc::O_WRONLY).unwrap();
    m.fs.release(f, fh);
    assert_eq!(m.fs.rmdir(ROOT, "d"), Err(libc::ENOTEMPTY));
    assert_eq!(m.fs.rmdir(d, "f"), Err(libc::ENOTDIR));
    m.fs.unlink(d, "f").unwrap();
    m.fs.rmdir(ROOT, "d").unwrap();
    // Nothing below to hide: no whiteout.
    assert!(std::fs::symlink_metadata(m.upper("d")).is_err());
    assert_eq!(m.fs.names(ROOT), ["big", "dir"]);
}

#[test]
fn renames_move_files_and_image_directories() {
    let mut m = Mount::new();
    let dir = m.node("dir");
    m.fs.rename(dir, "hello", ROOT, "moved", 0).unwrap();
    assert_eq!(m.content("moved"), b"hello, world\n");
    assert_eq!(m.fs.lookup(dir, "hello").map(|e| e.0), Ok(0));
    assert!(is_whiteout(&m.upper("dir/hello")));
    assert_eq!(std::fs::read(m.upper("moved")).unwrap(), b"hello, world\n");

    // RENAME_NOREPLACE onto an existing name is refused, nothing moves.
    assert_eq!(
        m.fs.rename(ROOT, "moved", ROOT, "big", libc::RENAME_NOREPLACE),
        Err(libc::EEXIST)
    );
    assert_eq!(m.content("moved"), b"hello, world\n");
    // A plain rename replaces it.
    m.fs.rename(ROOT, "moved", ROOT, "big", 0).unwrap();
    assert_eq!(m.content("big"), b"hello, world\n");
    assert_eq!(m.fs.names(ROOT), ["big", "dir"]);

    // An image directory moved: its new name redirects to its image path,
    // its old name is a whiteout, its image entries follow it.
    m.fs.rename(ROOT, "dir", ROOT, "dir2", 0).unwrap();
    assert!(is_whiteout(&m.upper("dir")));
    assert_eq!(
        xattr(&m.upper("dir2"), &overlay_xattr("redirect")).as_deref(),
        Some(&b"/dir"[..])
    );
    let dir2 = m.node("dir2");
    assert_eq!(m.fs.names(dir2), ["sub"]);
    assert_eq!(m.content("dir2/sub/deep"), b"deep\n");
}

#[test]
fn chmod_and_truncate_copy_up_and_apply() {
    let mut m = Mount::new();
    let big = m.node("big");
    let chmod = abi::SetattrIn {
        valid: fattr::MODE,
        mode: 0o600,
        ..Default::default()
    };
    assert_eq!(m.fs.setattr(big, chmod).unwrap().mode, libc::S_IFREG | 0o600);
    assert_eq!(m.fs.getattr(big), (libc::S_IFREG | 0o600, 100_000));
    assert_eq!(std::fs::read(m.upper("big")).unwrap(), vec![7u8; 100_000]);

    let hello = m.node("dir/hello");
    let truncate = abi::SetattrIn {
        valid: fattr::SIZE,
        size: 5,
        ..Default::default()
    };
    assert_eq!(m.fs.setattr(hello, truncate).unwrap().size, 5);
    assert_eq!(m.content("dir/hello"), b"hello");
    assert_eq!(std::fs::read(m.upper("dir/hello")).unwrap(), b"hello");
    // Growing fills with zeros.
    let grow = abi::SetattrIn {
        valid: fattr::SIZE,
        size: 8,
        ..Default::default()
    };
    m.fs.setattr(hello, grow).unwrap();
    assert_eq!(m.content("dir/hello"), b"hello\0\0\0");
}

#[test]
fn xattrs_set_read_list_and_remove() {
    let mut m = Mount::new();
    let big = m.node("big");
    m.fs.setxattr(big, "user.color", b"blue", 0).unwrap();
    assert_eq!(m.fs.getxattr(big, "user.color", 64).unwrap(), b"blue");
    assert!(m.fs.listxattr(big).contains(&"user.color".to_string()));
    assert_eq!(xattr(&m.upper("big"), "user.color").as_deref(), Some(&b"blue"[..]));
    assert_eq!(
        m.fs.setxattr(big, "user.color", b"red", libc::XATTR_CREATE as u32),
        Err(libc::EEXIST)
    );
    assert_eq!(m.fs.removexattr(big, "user.color"), Ok(()));
    assert_eq!(m.fs.getxattr(big, "user.color", 64), Err(libc::ENODATA));
    assert_eq!(m.fs.removexattr(big, "user.color"), Err(libc::ENODATA));
    assert_eq!(xattr(&m.upper("big"), "user.color"), None);
    // The image's xattrs of a file not copied up are read from the image.
    let hello = m.node("dir/hello");
    assert_eq!(m.fs.getxattr(hello, "user.note", 64).unwrap(), b"kept");
}

/// What a hostile client or a planted upper directory tries is refused,
/// and nothing outside the upper directory changes.
#[test]
fn hostile_names_and_planted_links_go_nowhere() {
    let mut m = Mount::new();
    let outside = m.dir.path().join("outside");
    // Names the kernel never sends: refused before the filesystem sees them.
    for bad in ["a/b", "../outside/x", ""] {
        assert_eq!(m.fs.mkdir(ROOT, bad, 0o755), Err(libc::EINVAL), "{bad:?}");
        assert_eq!(
            m.fs.create(ROOT, bad, 0o644, libc::O_RDWR).map(drop),
            Err(libc::EINVAL),
            "{bad:?}"
        );
    }
    // `.` and `..` name no new entry.
    for bad in [".", ".."] {
        assert!(m.fs.mkdir(ROOT, bad, 0o755).is_err(), "{bad:?}");
        assert!(m.fs.create(ROOT, bad, 0o644, libc::O_RDWR).is_err(), "{bad:?}");
        assert!(m.fs.unlink(ROOT, bad).is_err(), "{bad:?}");
    }

    // A symlink planted in the upper directory, to a directory outside:
    // a symlink in the tree, never followed.
    std::os::unix::fs::symlink(&outside, m.upper("escape")).unwrap();
    let (escape, mode, _) = m.fs.lookup(ROOT, "escape").unwrap();
    assert_eq!(mode & libc::S_IFMT, libc::S_IFLNK);
    assert_eq!(m.fs.mkdir(escape, "x", 0o755), Err(libc::ENOTDIR));
    assert_eq!(
        m.fs.create(escape, "x", 0o644, libc::O_RDWR).map(drop),
        Err(libc::ENOTDIR)
    );
    assert_eq!(m.fs.setxattr(escape, "user.x", b"v", 0), Err(libc::EPERM));

    // An xattr in the overlay namespace set by a client is escaped, as
    // overlayfs does: it marks nothing.
    let dir = m.fs.mkdir(ROOT, "plain", 0o755).unwrap();
    let opaque = overlay_xattr("opaque");
    m.fs.setxattr(dir, &opaque, b"y", 0).unwrap();
    assert_eq!(m.fs.getxattr(dir, &opaque, 64).unwrap(), b"y");
    assert_eq!(xattr(&m.upper("plain"), &opaque), None);
    assert_eq!(
        xattr(&m.upper("plain"), &overlay_xattr("overlay.opaque")).as_deref(),
        Some(&b"y"[..])
    );

    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
}
