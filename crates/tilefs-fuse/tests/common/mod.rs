//! The kernel's side of a FUSE connection, in-process: requests laid out
//! as the kernel lays them out (its ABI structures, then names and data)
//! go through the `Handler` every transport uses, and the replies land in
//! a recording sink. No mount, no privilege. Shared by the tests of the
//! read-only and the writable filesystems.

// Each test file uses its own share of the requests.
#![allow(dead_code)]

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::Arc;
use tilefs_fuse_proto::abi::{self, opcode};
use tilefs_fuse_proto::{Agreed, Filesystem, Handler, Layout, Sink};
use zerocopy::{FromBytes, IntoBytes};

pub const ROOT: u64 = abi::ROOT_ID;

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

/// Builds an image of the tree `make` writes into `dir/src`, its data
/// ingested into a new store `dir/store`, as `tilefs build` does; returns
/// the image's path.
pub fn build_image(dir: &Path, make: impl FnOnce(&Path)) -> std::path::PathBuf {
    let (src, store_dir) = (dir.join("src"), dir.join("store"));
    std::fs::create_dir(&src).unwrap();
    make(&src);
    let store = tilefs_store::Store::create(&store_dir).unwrap();
    let ingest = tilefs_store::ingest::Ingest::new(&store, Default::default()).unwrap();
    let tree = tilefs_image::source::scan_flat(&src, &Default::default(), Some(&ingest)).unwrap();
    ingest.finish().unwrap();
    let (bytes, _) = tilefs_image::erofs::writer::write_flat(&tree, &Default::default()).unwrap();
    let image = dir.join("image");
    std::fs::write(&image, bytes).unwrap();
    image
}

/// A filesystem's handler, asked as the kernel asks (as root, pid 1).
pub struct Kernel<F: Filesystem> {
    handler: Handler<F>,
    unique: u64,
}

/// Parses a reply's structure.
fn parse<T: FromBytes>(r: &[u8]) -> T {
    T::read_from_prefix(r).expect("a reply of the structure's size").0
}

fn result(reply: (i32, Vec<u8>)) -> Result<Vec<u8>, i32> {
    match reply {
        (0, r) => Ok(r),
        (e, _) => Err(-e),
    }
}

fn cname(name: &str) -> Vec<u8> {
    [name.as_bytes(), b"\0"].concat()
}

impl<F: Filesystem> Kernel<F> {
    pub fn new(fs: F) -> Kernel<F> {
        let agreed = Agreed {
            layout: Layout::default(),
            uring: false,
            max_write: 128 << 10,
        };
        Kernel {
            handler: Handler::new(Arc::new(fs), &agreed),
            unique: 0,
        }
    }

    /// Sends request `op` about `node` with `body`: its error (0 or a
    /// negative errno) and reply.
    pub fn ask(&mut self, op: u32, node: u64, body: &[u8]) -> (i32, Vec<u8>) {
        self.unique += 2;
        let head = abi::InHeader {
            len: (size_of::<abi::InHeader>() + body.len()) as u32,
            opcode: op,
            unique: self.unique,
            nodeid: node,
            pid: 1,
            ..Default::default()
        };
        let msg = [head.as_bytes(), body].concat();
        let mut sink = Recorded::default();
        assert!(self.handler.handle(&msg, &mut sink), "no reply to opcode {op}");
        let (unique, error, reply) = sink.0.pop().expect("a reply");
        assert_eq!(unique, self.unique);
        (error, reply)
    }

    /// LOOKUP, MKDIR, MKNOD, SYMLINK, CREATE: the entry, or the errno.
    fn entry(&mut self, op: u32, parent: u64, body: &[u8]) -> Result<abi::EntryOut, i32> {
        result(self.ask(op, parent, body)).map(|r| parse(&r))
    }

    /// LOOKUP: the node id and the entry's mode and size, or the errno.
    pub fn lookup(&mut self, parent: u64, name: &str) -> Result<(u64, u32, u64), i32> {
        let e = self.entry(opcode::LOOKUP, parent, &cname(name))?;
        Ok((e.nodeid, e.attr.mode, e.attr.size))
    }

    /// GETATTR: the attributes, or the errno.
    pub fn attr(&mut self, node: u64) -> Result<abi::Attr, i32> {
        let r = result(self.ask(opcode::GETATTR, node, abi::GetattrIn::default().as_bytes()))?;
        Ok(parse::<abi::AttrOut>(&r).attr)
    }

    /// GETATTR: mode and size.
    pub fn getattr(&mut self, node: u64) -> (u32, u64) {
        let a = self.attr(node).expect("GETATTR");
        (a.mode, a.size)
    }

    /// OPEN for reading, as the kernel does it: the handle, or 0 when the
    /// filesystem answered ENOSYS (then the kernel opens without asking,
    /// and reads name the inode alone).
    pub fn open_ro(&mut self, node: u64) -> Result<u64, i32> {
        match self.open(node, libc::O_RDONLY) {
            Err(libc::ENOSYS) => Ok(0),
            r => r,
        }
    }

    /// OPEN with `flags`: the handle, or the errno.
    pub fn open(&mut self, node: u64, flags: i32) -> Result<u64, i32> {
        let arg = abi::OpenIn {
            flags: flags as u32,
            open_flags: 0,
        };
        let r = result(self.ask(opcode::OPEN, node, arg.as_bytes()))?;
        Ok(parse::<abi::OpenOut>(&r).fh)
    }

    /// RELEASE of handle `fh`.
    pub fn release(&mut self, node: u64, fh: u64) {
        let arg = abi::ReleaseIn {
            fh,
            ..Default::default()
        };
        assert_eq!(self.ask(opcode::RELEASE, node, arg.as_bytes()).0, 0);
    }

    /// READ of `size` bytes at `offset` through handle `fh`.
    pub fn read(&mut self, node: u64, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>, i32> {
        let arg = abi::ReadIn {
            fh,
            offset,
            size,
            ..Default::default()
        };
        result(self.ask(opcode::READ, node, arg.as_bytes()))
    }

    /// WRITE of `data` at `offset` through handle `fh`: the count written.
    pub fn write(&mut self, node: u64, fh: u64, offset: u64, data: &[u8]) -> Result<u32, i32> {
        let arg = abi::WriteIn {
            fh,
            offset,
            size: data.len() as u32,
            ..Default::default()
        };
        let r = result(self.ask(opcode::WRITE, node, &[arg.as_bytes(), data].concat()))?;
        Ok(parse::<abi::WriteOut>(&r).size)
    }

    /// CREATE of file `name` (opened with `flags`): its node and handle.
    pub fn create(&mut self, parent: u64, name: &str, mode: u32, flags: i32) -> Result<(u64, u64), i32> {
        let arg = abi::CreateIn {
            flags: flags as u32,
            mode: libc::S_IFREG | mode,
            ..Default::default()
        };
        let r = result(self.ask(opcode::CREATE, parent, &[arg.as_bytes(), &cname(name)].concat()))?;
        let e: abi::EntryOut = parse(&r);
        let open: abi::OpenOut = parse(&r[size_of::<abi::EntryOut>()..]);
        Ok((e.nodeid, open.fh))
    }

    /// MKDIR: the new directory's node.
    pub fn mkdir(&mut self, parent: u64, name: &str, mode: u32) -> Result<u64, i32> {
        let arg = abi::MkdirIn { mode, umask: 0 };
        Ok(self
            .entry(opcode::MKDIR, parent, &[arg.as_bytes(), &cname(name)].concat())?
            .nodeid)
    }

    /// UNLINK.
    pub fn unlink(&mut self, parent: u64, name: &str) -> Result<(), i32> {
        result(self.ask(opcode::UNLINK, parent, &cname(name))).map(drop)
    }

    /// RMDIR.
    pub fn rmdir(&mut self, parent: u64, name: &str) -> Result<(), i32> {
        result(self.ask(opcode::RMDIR, parent, &cname(name))).map(drop)
    }

    /// RENAME2 (`flags` 0: a plain rename(2)).
    pub fn rename(&mut self, parent: u64, name: &str, newdir: u64, newname: &str, flags: u32) -> Result<(), i32> {
        let arg = abi::Rename2In {
            newdir,
            flags,
            padding: 0,
        };
        let body = [arg.as_bytes(), &cname(name), &cname(newname)].concat();
        result(self.ask(opcode::RENAME2, parent, &body)).map(drop)
    }

    /// SETATTR: the attributes after it.
    pub fn setattr(&mut self, node: u64, arg: abi::SetattrIn) -> Result<abi::Attr, i32> {
        let r = result(self.ask(opcode::SETATTR, node, arg.as_bytes()))?;
        Ok(parse::<abi::AttrOut>(&r).attr)
    }

    /// SETXATTR (the layout without FUSE_SETXATTR_EXT).
    pub fn setxattr(&mut self, node: u64, name: &str, value: &[u8], flags: u32) -> Result<(), i32> {
        let body = [
            &(value.len() as u32).to_ne_bytes()[..],
            &flags.to_ne_bytes(),
            &cname(name),
            value,
        ]
        .concat();
        result(self.ask(opcode::SETXATTR, node, &body)).map(drop)
    }

    /// REMOVEXATTR.
    pub fn removexattr(&mut self, node: u64, name: &str) -> Result<(), i32> {
        result(self.ask(opcode::REMOVEXATTR, node, &cname(name))).map(drop)
    }

    /// OPENDIR (ENOSYS: the kernel then lists without a handle) and
    /// READDIR to the end: the names and their types.
    pub fn readdir(&mut self, node: u64) -> Vec<(String, u32)> {
        let fh = match self.ask(opcode::OPENDIR, node, abi::OpenIn::default().as_bytes()) {
            (0, r) => parse::<abi::OpenOut>(&r).fh,
            (e, _) => {
                assert_eq!(e, -libc::ENOSYS);
                0
            }
        };
        let mut out = Vec::new();
        let mut offset = 0u64;
        loop {
            let arg = abi::ReadIn {
                fh,
                offset,
                size: 4096,
                ..Default::default()
            };
            let (e, r) = self.ask(opcode::READDIR, node, arg.as_bytes());
            assert_eq!(e, 0);
            if r.is_empty() {
                return out;
            }
            // Each entry: its Dirent, then the name padded to 8 bytes.
            let mut at = 0;
            while at < r.len() {
                let d: abi::Dirent = parse(&r[at..]);
                let start = at + size_of::<abi::Dirent>();
                let name = String::from_utf8(r[start..start + d.namelen as usize].to_vec()).unwrap();
                out.push((name, d.typ));
                offset = d.off;
                at = (start + d.namelen as usize).next_multiple_of(8);
            }
        }
    }

    /// The sorted names `node` lists, without `.` and `..`.
    pub fn names(&mut self, node: u64) -> Vec<String> {
        let mut v: Vec<String> = self
            .readdir(node)
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| n != "." && n != "..")
            .collect();
        v.sort();
        v
    }

    /// GETXATTR of `name` (size 0: its length; else its value).
    pub fn getxattr(&mut self, node: u64, name: &str, size: u32) -> Result<Vec<u8>, i32> {
        let arg = abi::GetxattrIn { size, padding: 0 };
        result(self.ask(opcode::GETXATTR, node, &[arg.as_bytes(), &cname(name)].concat()))
    }

    /// LISTXATTR: the names.
    pub fn listxattr(&mut self, node: u64) -> Vec<String> {
        let arg = abi::GetxattrIn { size: 4096, padding: 0 };
        let (e, r) = self.ask(opcode::LISTXATTR, node, arg.as_bytes());
        assert_eq!(e, 0);
        r.split(|&b| b == 0)
            .filter(|n| !n.is_empty())
            .map(|n| String::from_utf8(n.to_vec()).unwrap())
            .collect()
    }
}
