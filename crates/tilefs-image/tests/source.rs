//! Building a tree from a directory: every field the scan fills in, the
//! options, and the errors.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, Timestamps, XattrFlags};
use tilefs_image::source::{scan, Scan, ScanOptions};
use tilefs_image::tree::{self, digest_object_path, FileType, Inode, Tree};
use tilefs_image::verity;

const AWKWARD: &[u8] = b"sp ace=eq\nnl\xff\xfe\x80";
const MTIME_SEC: i64 = 1_234_567_890;
const MTIME_NSEC: u32 = 123_456_789;

/// Deterministic file contents.
fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect()
}

fn set_mtime(path: &Path, sec: i64, nsec: u32) {
    let ts = rustix::fs::Timespec {
        tv_sec: sec,
        tv_nsec: nsec as _,
    };
    let times = Timestamps {
        last_access: ts,
        last_modification: ts,
    };
    rustix::fs::utimensat(rustix::fs::CWD, path, &times, rustix::fs::AtFlags::SYMLINK_NOFOLLOW).unwrap();
}

fn set_xattr(path: &Path, key: &str, value: &[u8]) {
    rustix::fs::lsetxattr(path, key, value, XattrFlags::empty()).unwrap();
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// The regular files of the fixture: name and size.
const FILES: &[(&str, usize)] = &[
    ("empty", 0),
    ("one", 1),
    ("sixty-four", 64),
    ("sixty-five", 65),
    ("block", 4096),
    ("big", 100_000),
];

/// Builds the fixture tree in `root`.
fn make_fixture(root: &Path) {
    for (k, &(name, size)) in FILES.iter().enumerate() {
        std::fs::write(root.join(name), bytes(size, k as u8)).unwrap();
    }
    std::os::unix::fs::symlink("sixty-five", root.join("link")).unwrap();
    std::os::unix::fs::symlink("/no/such/target", root.join("dangling")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join("fifo"),
        rustix::fs::FileType::Fifo,
        Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    std::fs::create_dir_all(root.join("a/b/c")).unwrap();
    std::fs::create_dir(root.join("a/d")).unwrap();
    std::fs::write(
        root.join("a/b/c/deep"),
        b"deep file contents, more than sixty-four bytes long, in a nested dir",
    )
    .unwrap();
    std::fs::write(root.join("a/inline"), b"small").unwrap();
    std::fs::write(
        root.join(OsStr::from_bytes(AWKWARD)),
        b"awkward name: contents long enough to be stored outside the image, in the store",
    )
    .unwrap();
    std::fs::hard_link(root.join("big"), root.join("a/big-link")).unwrap();

    set_xattr(&root.join("one"), "user.comment", b"hello\0world");
    set_xattr(&root.join("a"), "user.dir", b"d");
    set_xattr(&root.join("big"), "user.big", &bytes(3000, 9));
    // A symlink cannot carry user.* xattrs; trusted.* needs root.
    if is_root() {
        set_xattr(&root.join("sixty-four"), "trusted.secret", b"t");
        set_xattr(&root.join("link"), "trusted.onlink", b"l");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            root.join("null"),
            rustix::fs::FileType::CharacterDevice,
            Mode::from_raw_mode(0o640),
            rustix::fs::makedev(1, 3),
        )
        .unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            root.join("blk"),
            rustix::fs::FileType::BlockDevice,
            Mode::from_raw_mode(0o660),
            rustix::fs::makedev(259, 300),
        )
        .unwrap();
        rustix::fs::chownat(
            rustix::fs::CWD,
            root.join("block"),
            Some(rustix::fs::Uid::from_raw(1234)),
            Some(rustix::fs::Gid::from_raw(5678)),
            rustix::fs::AtFlags::empty(),
        )
        .unwrap();
    }
    rustix::fs::chmod(root.join("sixty-five"), Mode::from_raw_mode(0o640)).unwrap();
    rustix::fs::chmod(root.join("a/d"), Mode::from_raw_mode(0o1777)).unwrap();
    set_mtime(&root.join("one"), MTIME_SEC, MTIME_NSEC);
    set_mtime(&root.join("link"), MTIME_SEC + 1, 7);
}

fn fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    make_fixture(dir.path());
    dir
}

fn node<'t>(tree: &'t Tree, path: &[u8]) -> &'t Inode {
    let id = tree
        .lookup_path(path)
        .unwrap_or_else(|| panic!("{} not in the tree", String::from_utf8_lossy(path)));
    tree.inode(id)
}

fn scan_with(root: &Path, opts: ScanOptions) -> Scan {
    scan(root, &opts).unwrap_or_else(|e| panic!("scan failed: {e}"))
}

#[test]
fn regular_files() {
    let dir = fixture();
    let s = scan_with(dir.path(), ScanOptions::default());
    for (k, &(name, size)) in FILES.iter().enumerate() {
        let data = bytes(size, k as u8);
        let inode = node(&s.tree, name.as_bytes());
        assert_eq!(inode.file_type(), Some(FileType::Regular), "{name}");
        assert_eq!(inode.size, size as u64, "{name}");
        assert_eq!(inode.nlink, 1, "{name}");
        if size == 0 {
            assert_eq!(inode.digest, None, "{name}");
            assert_eq!(inode.payload, None, "{name}");
            assert_eq!(inode.content, None, "{name}");
            continue;
        }
        let digest = verity::digest_bytes(&data);
        assert_eq!(inode.digest, Some(digest), "{name}");
        assert_eq!(
            inode.payload.as_deref(),
            Some(digest_object_path(&digest).as_bytes()),
            "{name}"
        );
        if size as u64 <= tree::RECOMMENDED_INLINE_MAX {
            assert_eq!(inode.content.as_deref(), Some(&data[..]), "{name}");
            assert!(!inode.is_external());
        } else {
            assert_eq!(inode.content, None, "{name}");
            assert!(inode.is_external());
        }
    }
    let p = node(&s.tree, b"sixty-five").payload.clone().unwrap();
    assert_eq!(p.len(), 2 + 1 + 62);
    assert_eq!(p[2], b'/');
}

#[test]
fn metadata_fields() {
    let dir = fixture();
    let s = scan_with(dir.path(), ScanOptions::default());
    let t = &s.tree;

    let one = node(t, b"one");
    assert_eq!(one.mtime.sec, MTIME_SEC);
    assert_eq!(one.mtime.nsec, MTIME_NSEC);
    assert_eq!(node(t, b"sixty-five").mode, tree::S_IFREG | 0o640);
    assert_eq!(node(t, b"a/d").mode, tree::S_IFDIR | 0o1777);

    let link = node(t, b"link");
    assert_eq!(link.file_type(), Some(FileType::Symlink));
    assert_eq!(link.payload.as_deref(), Some(&b"sixty-five"[..]));
    assert_eq!(link.size, 10);
    assert_eq!(link.mtime.sec, MTIME_SEC + 1);
    assert_eq!(link.mtime.nsec, 7);
    assert_eq!(link.digest, None);
    let dangling = node(t, b"dangling");
    assert_eq!(dangling.payload.as_deref(), Some(&b"/no/such/target"[..]));
    assert_eq!(dangling.size, 15);

    let fifo = node(t, b"fifo");
    assert_eq!(fifo.file_type(), Some(FileType::Fifo));
    assert_eq!(fifo.mode & 0o7777, 0o600);
    assert_eq!(fifo.size, 0);
    assert_eq!(fifo.payload, None);

    // The root has the directory's own metadata.
    let st = rustix::fs::lstat(dir.path()).unwrap();
    let root = s.tree.root();
    assert!(root.is_dir());
    assert_eq!(root.mode, st.st_mode);
    assert_eq!(root.mtime.sec, st.st_mtime as i64);

    // (The fixture has them only when made by root: the tests run as root.)
    assert!(
        is_root(),
        "this test cannot run here: not running as root (uid/gid and device checks)"
    );
    let block = node(t, b"block");
    assert_eq!((block.uid, block.gid), (1234, 5678));
    let null = node(t, b"null");
    assert_eq!(null.file_type(), Some(FileType::CharDevice));
    assert_eq!(null.rdev, (1 << 8) | 3);
    assert_eq!(null.mode & 0o7777, 0o640);
    // Kernel encoding: minor low 8 bits, major, then the minor's rest.
    let blk = node(t, b"blk");
    assert_eq!(blk.file_type(), Some(FileType::BlockDevice));
    assert_eq!(blk.rdev, (300 & 0xff) | (259 << 8) | ((300 & !0xff) << 12));
}

#[test]
fn directories_and_names() {
    let dir = fixture();
    let s = scan_with(dir.path(), ScanOptions::default());
    let t = &s.tree;

    // Entries sorted by name, as bytes.
    for inode in &t.inodes {
        let names: Vec<&[u8]> = inode.entries.iter().map(|e| e.name.as_slice()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        assert!(inode.entries.iter().all(|e| !e.hardlink));
    }

    let root_names: Vec<&[u8]> = t.root().entries.iter().map(|e| e.name.as_slice()).collect();
    assert!(root_names.contains(&AWKWARD));
    let awkward = node(t, AWKWARD);
    assert!(awkward.is_external());

    // Directory link counts: 2 + subdirectories.
    assert_eq!(node(t, b"a").nlink, 4);
    assert_eq!(node(t, b"a/b").nlink, 3);
    assert_eq!(node(t, b"a/b/c").nlink, 2);
    assert_eq!(t.root().nlink, 3);
    let deep = node(t, b"a/b/c/deep");
    assert!(deep.is_external());
    assert_eq!(node(t, b"a/inline").content.as_deref(), Some(&b"small"[..]));

    // Hardlinks are not detected: each name is its own inode.
    let big = t.lookup_path(b"big").unwrap();
    let big_link = t.lookup_path(b"a/big-link").unwrap();
    assert_ne!(big, big_link);
    assert_eq!(t.inode(big_link).nlink, 1);
    assert_eq!(t.inode(big_link).digest, t.inode(big).digest);

    // Every inode is reachable exactly once.
    let mut seen = 0;
    t.walk(|_, _, _| seen += 1);
    assert_eq!(seen, t.len());
}

#[test]
fn sources_list_external_files() {
    let dir = fixture();
    let s = scan_with(dir.path(), ScanOptions::default());
    let mut want: Vec<PathBuf> = ["sixty-five", "block", "big", "a/b/c/deep", "a/big-link"]
        .iter()
        .map(|p| dir.path().join(p))
        .collect();
    want.push(dir.path().join(OsStr::from_bytes(AWKWARD)));
    want.sort();
    let mut got: Vec<PathBuf> = s.sources.iter().map(|(_, p)| p.clone()).collect();
    got.sort();
    assert_eq!(got, want);
    for (id, path) in &s.sources {
        let inode = s.tree.inode(*id);
        assert!(inode.is_external());
        let data = std::fs::read(path).unwrap();
        assert_eq!(inode.digest, Some(verity::digest_bytes(&data)));
    }
}

#[test]
fn xattrs_and_their_options() {
    let dir = fixture();
    let all = scan_with(dir.path(), ScanOptions::default());
    let t = &all.tree;
    assert_eq!(node(t, b"one").xattr(b"user.comment"), Some(&b"hello\0world"[..]));
    assert_eq!(node(t, b"a").xattr(b"user.dir"), Some(&b"d"[..]));
    assert_eq!(node(t, b"big").xattr(b"user.big"), Some(&bytes(3000, 9)[..]));
    assert!(node(t, b"empty").xattrs.is_empty());
    if is_root() {
        assert_eq!(node(t, b"sixty-four").xattr(b"trusted.secret"), Some(&b"t"[..]));
        assert_eq!(node(t, b"link").xattr(b"trusted.onlink"), Some(&b"l"[..]));
    }

    let user = scan_with(
        dir.path(),
        ScanOptions {
            user_xattrs: true,
            ..Default::default()
        },
    );
    let t = &user.tree;
    assert_eq!(node(t, b"one").xattr(b"user.comment"), Some(&b"hello\0world"[..]));
    assert_eq!(node(t, b"a").xattr(b"user.dir"), Some(&b"d"[..]));
    assert!(node(t, b"sixty-four").xattrs.is_empty());
    assert!(node(t, b"link").xattrs.is_empty());
    for inode in &t.inodes {
        assert!(inode.xattrs.iter().all(|x| x.key.starts_with(b"user.")));
    }

    let none = scan_with(
        dir.path(),
        ScanOptions {
            skip_xattrs: true,
            ..Default::default()
        },
    );
    assert!(none.tree.inodes.iter().all(|i| i.xattrs.is_empty()));
}

#[test]
fn epoch_and_skip_devices() {
    let dir = fixture();
    let s = scan_with(
        dir.path(),
        ScanOptions {
            use_epoch: true,
            skip_devices: true,
            ..Default::default()
        },
    );
    let t = &s.tree;
    assert!(t.inodes.iter().all(|i| i.mtime == tree::Timespec::default()));
    assert!(t.lookup_path(b"null").is_none());
    assert!(t.lookup_path(b"blk").is_none());
    assert!(t.lookup_path(b"fifo").is_some());
    if is_root() {
        let full = scan_with(dir.path(), ScanOptions::default());
        assert!(full.tree.lookup_path(b"null").is_some());
        assert_eq!(full.tree.len(), t.len() + 2);
    }
}

#[test]
fn same_tree_whatever_the_thread_count() {
    let dir = fixture();
    // More directories, so the parallel walk has something to reorder.
    for i in 0..40 {
        let d = dir.path().join(format!("many/d{i:02}"));
        std::fs::create_dir_all(&d).unwrap();
        for j in 0..(i % 7) {
            std::fs::write(d.join(format!("f{j}")), bytes(100 * j + i, j as u8)).unwrap();
        }
    }
    let one = scan_with(
        dir.path(),
        ScanOptions {
            jobs: 1,
            ..Default::default()
        },
    );
    for jobs in [0, 2, 8] {
        let other = scan_with(
            dir.path(),
            ScanOptions {
                jobs,
                ..Default::default()
            },
        );
        assert!(one.tree == other.tree, "tree differs with {jobs} jobs");
        assert_eq!(one.sources, other.sources);
    }
}

#[test]
fn root_must_be_a_directory() {
    let dir = fixture();
    let err = scan(&dir.path().join("one"), &ScanOptions::default()).err().unwrap();
    assert_eq!(err.path, dir.path().join("one"));
    assert!(err.reason.contains("not a directory"), "{err}");

    // A symlink to a directory is not followed.
    std::os::unix::fs::symlink(dir.path().join("a"), dir.path().join("dirlink")).unwrap();
    let err = scan(&dir.path().join("dirlink"), &ScanOptions::default())
        .err()
        .unwrap();
    assert!(err.reason.contains("not a directory"), "{err}");

    let missing = dir.path().join("missing");
    let err = scan(&missing, &ScanOptions::default()).err().unwrap();
    assert_eq!(err.path, missing);
    assert!(err.to_string().contains("No such file"), "{err}");
}

/// Runs `f` on a thread without the capabilities that let root ignore
/// permission bits (threads the scan starts inherit that).
fn without_dac_override<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
            let mut caps = capabilities(None).unwrap();
            caps.effective
                .remove(CapabilitySet::DAC_OVERRIDE | CapabilitySet::DAC_READ_SEARCH);
            set_capabilities(None, caps).unwrap();
            f()
        })
        .join()
        .unwrap()
    })
}

#[test]
fn unreadable_entries_are_named() {
    // Through a path component that is not a directory.
    let dir = fixture();
    let err = scan(&dir.path().join("one/x"), &ScanOptions::default()).err().unwrap();
    assert_eq!(err.path, dir.path().join("one/x"));
    assert!(err.to_string().contains("Not a directory"), "{err}");

    // A file that cannot be read.
    let dir = fixture();
    let secret = dir.path().join("a/b/secret");
    std::fs::write(&secret, b"x").unwrap();
    rustix::fs::chmod(&secret, Mode::empty()).unwrap();
    let err = without_dac_override(|| scan(dir.path(), &ScanOptions::default()).err().unwrap());
    assert_eq!(err.path, secret);
    assert!(err.to_string().contains("Permission denied"), "{err}");

    // An empty file is never opened: its mode does not matter.
    let dir = fixture();
    let empty = dir.path().join("a/empty-secret");
    std::fs::write(&empty, b"").unwrap();
    rustix::fs::chmod(&empty, Mode::empty()).unwrap();
    without_dac_override(|| scan(dir.path(), &ScanOptions::default())).unwrap();

    // A directory that cannot be listed.
    let dir = fixture();
    let locked = dir.path().join("a/d");
    rustix::fs::chmod(&locked, Mode::empty()).unwrap();
    let err = without_dac_override(|| scan(dir.path(), &ScanOptions::default()).err().unwrap());
    assert_eq!(err.path, locked);
    assert!(err.to_string().contains("Permission denied"), "{err}");
}

#[test]
fn paths_longer_than_path_max() {
    // Everything is opened relative to its directory, so depth is no limit;
    // xattrs of entries that are not opened are read through the
    // directory's descriptor when the full path is too long.
    let dir = fixture();
    let comp = "d".repeat(200);
    let mut fd = rustix::fs::open(dir.path(), rustix::fs::OFlags::DIRECTORY, Mode::empty()).unwrap();
    for _ in 0..25 {
        rustix::fs::mkdirat(&fd, comp.as_str(), Mode::from_raw_mode(0o755)).unwrap();
        fd = rustix::fs::openat(&fd, comp.as_str(), rustix::fs::OFlags::DIRECTORY, Mode::empty()).unwrap();
    }
    let data = bytes(5000, 3);
    let f = rustix::fs::openat(
        &fd,
        "leaf",
        rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CREATE,
        Mode::from_raw_mode(0o644),
    )
    .unwrap();
    rustix::io::write(&f, &data).unwrap();
    let e = rustix::fs::openat(
        &fd,
        "empty",
        rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CREATE,
        Mode::from_raw_mode(0o644),
    )
    .unwrap();
    rustix::fs::fsetxattr(&e, "user.deep", b"yes", XattrFlags::empty()).unwrap();

    let s = scan_with(dir.path(), ScanOptions::default());
    let rel = vec![comp.as_str(); 25].join("/");
    let leaf = node(&s.tree, format!("{rel}/leaf").as_bytes());
    assert_eq!(leaf.digest, Some(verity::digest_bytes(&data)));
    let empty = node(&s.tree, format!("{rel}/empty").as_bytes());
    assert_eq!(empty.xattr(b"user.deep"), Some(&b"yes"[..]));
}

#[test]
fn large_files_hashed_in_parallel_segments() {
    let dir = tempfile::tempdir().unwrap();
    let sizes = [(16 << 20) + 5000, 24 << 20];
    let mut want = Vec::new();
    for (k, size) in sizes.iter().enumerate() {
        let data = bytes(*size, k as u8);
        std::fs::write(dir.path().join(format!("large{k}")), &data).unwrap();
        want.push(verity::digest_bytes(&data));
    }
    for jobs in [1, 2, 3] {
        let s = scan_with(
            dir.path(),
            ScanOptions {
                jobs,
                ..Default::default()
            },
        );
        for (k, size) in sizes.iter().enumerate() {
            let inode = node(&s.tree, format!("large{k}").as_bytes());
            assert_eq!(inode.size, *size as u64);
            assert_eq!(inode.digest, Some(want[k]), "jobs {jobs}");
        }
    }
}
