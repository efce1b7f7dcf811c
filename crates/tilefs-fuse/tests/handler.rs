//! The read-only filesystem driven in-process, as the kernel drives it but
//! without a mount or privilege (see `common`). The image is built from a
//! directory into a real store, as `tilefs build` builds it.

mod common;

use common::{Kernel, ROOT};
use std::path::Path;
use tilefs_fuse::{ServeSpec, TileFs, Verity};

/// Serves the tree `make` writes (in a temporary directory, kept while
/// served), built into a store; `spoil` may then change the store's
/// objects.
fn serve(make: impl FnOnce(&Path), spoil: impl FnOnce(&Path)) -> (Kernel<TileFs>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let image = common::build_image(dir.path(), make);
    let store_dir = dir.path().join("store");
    spoil(&store_dir);
    let mut spec = ServeSpec::new(&image, &store_dir);
    spec.verity = Verity::Auto;
    (Kernel::new(TileFs::from_spec(&spec).unwrap()), dir)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(b[at..at + 4].try_into().unwrap())
}

fn tree(src: &Path) {
    std::fs::create_dir(src.join("dir")).unwrap();
    std::fs::write(src.join("dir/hello"), b"hello, world\n").unwrap();
    // Larger than an inline tail: served from the store's object.
    std::fs::write(src.join("big"), vec![7u8; 100_000]).unwrap();
    std::os::unix::fs::symlink("dir/hello", src.join("link")).unwrap();
    rustix::fs::setxattr(
        src.join("dir/hello"),
        "user.note",
        b"kept",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
}

#[test]
fn lookups_attributes_listings_and_reads_answer_as_the_tree_is() {
    let (mut fs, _dir) = serve(tree, |_| {});
    let (dir, mode, _) = fs.lookup(ROOT, "dir").unwrap();
    assert_eq!(mode & libc::S_IFMT, libc::S_IFDIR);
    let (hello, mode, size) = fs.lookup(dir, "hello").unwrap();
    assert_eq!((mode & libc::S_IFMT, size), (libc::S_IFREG, 13));
    assert_eq!(fs.getattr(hello), (mode, 13));
    let (_, mode, _) = fs.lookup(ROOT, "link").unwrap();
    assert_eq!(mode & libc::S_IFMT, libc::S_IFLNK);
    // A name that is not there: a negative entry (node 0), which the
    // kernel caches.
    assert_eq!(fs.lookup(ROOT, "absent").map(|e| e.0), Ok(0));

    let mut names = fs.readdir(ROOT);
    names.sort();
    let (d, r, l) = (
        u32::from(libc::DT_DIR),
        u32::from(libc::DT_REG),
        u32::from(libc::DT_LNK),
    );
    let want: Vec<(String, u32)> = [(".", d), ("..", d), ("big", r), ("dir", d), ("link", l)]
        .into_iter()
        .map(|(n, t)| (n.to_string(), t))
        .collect();
    assert_eq!(names, want);

    let fh = fs.open_ro(hello).unwrap();
    assert_eq!(fs.read(hello, fh, 0, 4096).unwrap(), b"hello, world\n");
    assert_eq!(fs.read(hello, fh, 7, 5).unwrap(), b"world");
    let (big, _, size) = fs.lookup(ROOT, "big").unwrap();
    assert_eq!(size, 100_000);
    let fh = fs.open_ro(big).unwrap();
    assert_eq!(fs.read(big, fh, 99_990, 4096).unwrap(), vec![7u8; 10]);
    // A read-only filesystem refuses to open for writing.
    assert_eq!(fs.open(big, libc::O_WRONLY), Err(libc::EROFS));
    assert_eq!(fs.open(big, libc::O_RDWR | libc::O_TRUNC), Err(libc::EROFS));

    assert!(fs.listxattr(hello).contains(&"user.note".to_string()));
    // Size 0 asks for the value's length (GetxattrOut: size, padding).
    assert_eq!(u32_at(&fs.getxattr(hello, "user.note", 0).unwrap(), 0), 4);
    assert_eq!(fs.getxattr(hello, "user.note", 64).unwrap(), b"kept");
    assert_eq!(fs.getxattr(hello, "user.note", 2), Err(libc::ERANGE));
    assert_eq!(fs.getxattr(hello, "user.absent", 64), Err(libc::ENODATA));
}

/// An object whose bytes are not those the image names gives EIO to its
/// file's reader, and only to it.
#[test]
fn a_corrupt_object_fails_its_file_alone() {
    let spoil = |store: &Path| {
        let digest = tilefs_image::verity::digest_bytes(&vec![7u8; 100_000]);
        let object = store.join(tilefs_store::Store::object_rel(&digest));
        let mut bytes = std::fs::read(&object).unwrap();
        bytes[50_000] ^= 1;
        std::fs::remove_file(&object).unwrap();
        std::fs::write(&object, bytes).unwrap();
    };
    let (mut fs, _dir) = serve(tree, spoil);
    let (big, _, _) = fs.lookup(ROOT, "big").unwrap();
    let read = fs.open_ro(big).and_then(|fh| fs.read(big, fh, 0, 4096));
    assert_eq!(read, Err(libc::EIO));
    let (dir, _, _) = fs.lookup(ROOT, "dir").unwrap();
    let (hello, _, _) = fs.lookup(dir, "hello").unwrap();
    let fh = fs.open_ro(hello).unwrap();
    assert_eq!(fs.read(hello, fh, 0, 4096).unwrap(), b"hello, world\n");
}
