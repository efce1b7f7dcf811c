//! The read-only filesystem driven in-process, as the kernel drives it but
//! without a mount or privilege: FUSE messages, laid out as the kernel
//! lays them out, go through the `Handler` every transport uses, and the
//! replies land in a recording sink. The image is built from a directory
//! into a real store, as `tilefs build` builds it.

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::Arc;
use tilefs_fuse::{ServeSpec, TileFs, Verity};
use tilefs_fuse_proto::abi::opcode;
use tilefs_fuse_proto::{Agreed, Handler, Layout, Sink};

/// The replies sent, by request.
#[derive(Default)]
struct Recorded(Vec<(u64, i32, Vec<u8>)>);

impl Sink for Recorded {
    fn send(&mut self, unique: u64, error: i32, parts: &[&[u8]]) -> std::io::Result<()> {
        self.0.push((unique, error, parts.concat()));
        Ok(())
    }

    fn send_file(&mut self, unique: u64, file: BorrowedFd<'_>, offset: u64, len: usize) -> std::io::Result<()> {
        let mut buf = vec![0; len];
        let n = rustix::io::pread(file, &mut buf, offset)?;
        buf.truncate(n);
        self.0.push((unique, 0, buf));
        Ok(())
    }
}

/// A filesystem and its handler, asked as the kernel asks.
struct Fs {
    handler: Handler<TileFs>,
    unique: u64,
    _dir: tempfile::TempDir,
}

impl Fs {
    /// Serves the tree `make` writes (in a temporary directory), built
    /// into a store; `spoil` may then change the store's objects.
    fn new(make: impl FnOnce(&Path), spoil: impl FnOnce(&Path)) -> Fs {
        let dir = tempfile::tempdir().unwrap();
        let (src, store_dir) = (dir.path().join("src"), dir.path().join("store"));
        std::fs::create_dir(&src).unwrap();
        make(&src);
        let store = tilefs_store::Store::create(&store_dir).unwrap();
        let ingest = tilefs_store::ingest::Ingest::new(&store, Default::default()).unwrap();
        let tree = tilefs_image::source::scan_flat(&src, &Default::default(), Some(&ingest)).unwrap();
        ingest.finish().unwrap();
        let (bytes, _) = tilefs_image::erofs::writer::write_flat(&tree, &Default::default()).unwrap();
        let image = dir.path().join("image");
        std::fs::write(&image, bytes).unwrap();
        spoil(&store_dir);
        let mut spec = ServeSpec::new(&image, &store_dir);
        spec.verity = Verity::Auto;
        let fs = TileFs::from_spec(&spec).unwrap();
        let agreed = Agreed {
            layout: Layout::default(),
            uring: false,
            max_write: 128 << 10,
        };
        Fs {
            handler: Handler::new(Arc::new(fs), &agreed),
            unique: 0,
            _dir: dir,
        }
    }

    /// Sends request `op` about `node` with `body`: its error (0 or a
    /// negative errno) and reply.
    fn ask(&mut self, op: u32, node: u64, body: &[u8]) -> (i32, Vec<u8>) {
        self.unique += 2;
        let mut msg = Vec::new();
        msg.extend_from_slice(&(40 + body.len() as u32).to_ne_bytes());
        msg.extend_from_slice(&op.to_ne_bytes());
        msg.extend_from_slice(&self.unique.to_ne_bytes());
        msg.extend_from_slice(&node.to_ne_bytes());
        // uid, gid, pid; no extensions.
        for v in [0u32, 0, 1] {
            msg.extend_from_slice(&v.to_ne_bytes());
        }
        msg.extend_from_slice(&[0; 4]);
        msg.extend_from_slice(body);
        let mut sink = Recorded::default();
        assert!(self.handler.handle(&msg, &mut sink), "no reply to opcode {op}");
        let (unique, error, reply) = sink.0.pop().expect("a reply");
        assert_eq!(unique, self.unique);
        (error, reply)
    }

    /// LOOKUP: the node id and the entry's mode and size, or the errno.
    fn lookup(&mut self, parent: u64, name: &str) -> Result<(u64, u32, u64), i32> {
        let (e, r) = self.ask(opcode::LOOKUP, parent, &[name.as_bytes(), b"\0"].concat());
        if e != 0 {
            return Err(-e);
        }
        // EntryOut: nodeid, generation, two validities (u64, u64, u32, u32),
        // then the attributes (ino, size, ..., mode at 60).
        Ok((u64_at(&r, 0), u32_at(&r, 40 + 60), u64_at(&r, 40 + 8)))
    }

    /// GETATTR: mode and size.
    fn getattr(&mut self, node: u64) -> (u32, u64) {
        let (e, r) = self.ask(opcode::GETATTR, node, &[0; 16]);
        assert_eq!(e, 0);
        // AttrOut: validity (u64, u32, u32), then the attributes.
        (u32_at(&r, 16 + 60), u64_at(&r, 16 + 8))
    }

    /// OPEN for reading, as the kernel does it: the handle, or 0 when the
    /// filesystem answered ENOSYS (then the kernel opens without asking,
    /// and reads name the inode alone).
    fn open_ro(&mut self, node: u64) -> Result<u64, i32> {
        match self.open(node, libc::O_RDONLY) {
            Err(libc::ENOSYS) => Ok(0),
            r => r,
        }
    }

    /// OPEN with `flags`: the handle, or the errno.
    fn open(&mut self, node: u64, flags: i32) -> Result<u64, i32> {
        let (e, r) = self.ask(opcode::OPEN, node, &[(flags as u32).to_ne_bytes(), [0; 4]].concat());
        if e != 0 {
            return Err(-e);
        }
        Ok(u64_at(&r, 0))
    }

    /// READ of `size` bytes at `offset` through handle `fh`.
    fn read(&mut self, node: u64, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>, i32> {
        let mut body = Vec::new();
        body.extend_from_slice(&fh.to_ne_bytes());
        body.extend_from_slice(&offset.to_ne_bytes());
        body.extend_from_slice(&size.to_ne_bytes());
        body.extend_from_slice(&[0; 20]);
        match self.ask(opcode::READ, node, &body) {
            (0, r) => Ok(r),
            (e, _) => Err(-e),
        }
    }

    /// OPENDIR (ENOSYS: the kernel then lists without a handle) and
    /// READDIR to the end: the names and their types.
    fn readdir(&mut self, node: u64) -> Vec<(String, u32)> {
        let fh = match self.ask(opcode::OPENDIR, node, &[0; 8]) {
            (0, r) => u64_at(&r, 0),
            (e, _) => {
                assert_eq!(e, -libc::ENOSYS);
                0
            }
        };
        let mut out = Vec::new();
        let mut offset = 0u64;
        loop {
            let mut body = Vec::new();
            body.extend_from_slice(&fh.to_ne_bytes());
            body.extend_from_slice(&offset.to_ne_bytes());
            body.extend_from_slice(&4096u32.to_ne_bytes());
            body.extend_from_slice(&[0; 20]);
            let (e, r) = self.ask(opcode::READDIR, node, &body);
            assert_eq!(e, 0);
            if r.is_empty() {
                return out;
            }
            // Dirent: ino, off, namelen, type, name padded to 8 bytes.
            let mut at = 0;
            while at < r.len() {
                let len = u32_at(&r, at + 16) as usize;
                let name = String::from_utf8(r[at + 24..at + 24 + len].to_vec()).unwrap();
                out.push((name, u32_at(&r, at + 20)));
                offset = u64_at(&r, at + 8);
                at += (24 + len).div_ceil(8) * 8;
            }
        }
    }

    /// GETXATTR of `name` (size 0: its length; else its value).
    fn getxattr(&mut self, node: u64, name: &str, size: u32) -> Result<Vec<u8>, i32> {
        let body = [&size.to_ne_bytes()[..], &[0; 4], name.as_bytes(), b"\0"].concat();
        match self.ask(opcode::GETXATTR, node, &body) {
            (0, r) => Ok(r),
            (e, _) => Err(-e),
        }
    }

    /// LISTXATTR: the names.
    fn listxattr(&mut self, node: u64) -> Vec<String> {
        let (e, r) = self.ask(opcode::LISTXATTR, node, &[&4096u32.to_ne_bytes()[..], &[0; 4]].concat());
        assert_eq!(e, 0);
        r.split(|&b| b == 0)
            .filter(|n| !n.is_empty())
            .map(|n| String::from_utf8(n.to_vec()).unwrap())
            .collect()
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(b[at..at + 8].try_into().unwrap())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(b[at..at + 4].try_into().unwrap())
}

const ROOT: u64 = 1;

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
    let mut fs = Fs::new(tree, |_| {});
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
    let mut fs = Fs::new(tree, spoil);
    let (big, _, _) = fs.lookup(ROOT, "big").unwrap();
    let read = fs.open_ro(big).and_then(|fh| fs.read(big, fh, 0, 4096));
    assert_eq!(read, Err(libc::EIO));
    let (dir, _, _) = fs.lookup(ROOT, "dir").unwrap();
    let (hello, _, _) = fs.lookup(dir, "hello").unwrap();
    let fh = fs.open_ro(hello).unwrap();
    assert_eq!(fs.read(hello, fh, 0, 4096).unwrap(), b"hello, world\n");
}
