//! Replies. A [`Reply`] answers one request exactly once: each method
//! consumes it, and one dropped unanswered answers EIO (so a request is
//! never left hanging in the kernel). How the bytes travel is the
//! transport's business ([`Sink`]): written to /dev/fuse, spliced from a
//! file, or placed in an io_uring entry's buffers.

use crate::abi;
use std::io;
use std::os::fd::BorrowedFd;
use zerocopy::IntoBytes;

/// Where replies go.
pub trait Sink {
    /// Sends the reply to `unique`: `error` (0 or a negative errno) and,
    /// on success, the concatenation of `parts`.
    fn send(&mut self, unique: u64, error: i32, parts: &[&[u8]]) -> io::Result<()>;

    /// Sends a READ reply holding up to `len` bytes of `file` at `offset`
    /// (fewer if the file ends first). An error reading the file is
    /// returned before anything is sent, so the caller can answer it.
    fn send_file(&mut self, unique: u64, file: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<()>;
}

/// Reads up to `buf.len()` bytes of `file` at `offset`, fewer only at its end.
pub(crate) fn read_full(file: BorrowedFd<'_>, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pread(file, &mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(done)
}

/// The answer to one request.
pub struct Reply<'a> {
    unique: u64,
    sink: Option<&'a mut dyn Sink>,
}

/// Timeouts of entries and attributes, as the kernel takes them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ttl {
    pub secs: u64,
    pub nsecs: u32,
}

impl Ttl {
    pub const fn from_secs(secs: u64) -> Ttl {
        Ttl { secs, nsecs: 0 }
    }
}

/// What LOOKUP, MKNOD, MKDIR, SYMLINK, LINK and CREATE answer.
#[derive(Debug, Clone, Copy, Default)]
pub struct Entry {
    /// 0 for a negative entry (cached for `entry_ttl`).
    pub nodeid: u64,
    pub generation: u64,
    pub entry_ttl: Ttl,
    pub attr_ttl: Ttl,
    pub attr: abi::Attr,
}

impl Entry {
    pub fn to_abi(&self) -> abi::EntryOut {
        abi::EntryOut {
            nodeid: self.nodeid,
            generation: self.generation,
            entry_valid: self.entry_ttl.secs,
            attr_valid: self.attr_ttl.secs,
            entry_valid_nsec: self.entry_ttl.nsecs,
            attr_valid_nsec: self.attr_ttl.nsecs,
            attr: self.attr,
        }
    }
}

/// What OPEN, OPENDIR and CREATE answer.
#[derive(Debug, Clone, Copy, Default)]
pub struct Open {
    pub fh: u64,
    /// FOPEN_* flags.
    pub flags: u32,
    /// A registered backing file (with FOPEN_PASSTHROUGH), else 0.
    pub backing_id: i32,
}

impl Open {
    fn to_abi(self) -> abi::OpenOut {
        abi::OpenOut {
            fh: self.fh,
            open_flags: self.flags,
            backing_id: self.backing_id,
        }
    }
}

impl<'a> Reply<'a> {
    pub(crate) fn new(unique: u64, sink: &'a mut dyn Sink) -> Reply<'a> {
        Reply {
            unique,
            sink: Some(sink),
        }
    }

    /// The request this answers.
    pub fn unique(&self) -> u64 {
        self.unique
    }

    fn send(mut self, error: i32, parts: &[&[u8]]) {
        if let Some(sink) = self.sink.take() {
            // ENOENT: the request was interrupted and is gone; anything
            // else means the connection is going away. Nobody to tell.
            let _ = sink.send(self.unique, error, parts);
        }
    }

    /// Fails the request with `errno` (a positive errno value).
    pub fn error(self, errno: i32) {
        self.send(-errno.abs(), &[])
    }

    /// Succeeds with no data.
    pub fn ok(self) {
        self.send(0, &[])
    }

    pub fn entry(self, e: &Entry) {
        self.send(0, &[e.to_abi().as_bytes()])
    }

    pub fn attr(self, ttl: Ttl, attr: &abi::Attr) {
        let out = abi::AttrOut {
            attr_valid: ttl.secs,
            attr_valid_nsec: ttl.nsecs,
            dummy: 0,
            attr: *attr,
        };
        self.send(0, &[out.as_bytes()])
    }

    pub fn open(self, o: Open) {
        self.send(0, &[o.to_abi().as_bytes()])
    }

    pub fn create(self, e: &Entry, o: Open) {
        self.send(0, &[e.to_abi().as_bytes(), o.to_abi().as_bytes()])
    }

    /// Raw data: a READ, READLINK, READDIR or xattr value or list.
    pub fn data(self, data: &[u8]) {
        self.send(0, &[data])
    }

    /// A READ reply of up to `len` bytes of `file` at `offset`. If the
    /// file cannot be read, the request fails with EIO and the error is
    /// returned (for the log).
    pub fn file(mut self, file: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<()> {
        crate::readers::may_block_reading(file, offset, len);
        let sink = self.sink.take().expect("a reply is sent once");
        match sink.send_file(self.unique, file, offset, len) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => {
                let _ = sink.send(self.unique, -libc::EIO, &[]);
                Err(e)
            }
        }
    }

    pub fn write(self, size: u32) {
        self.send(0, &[abi::WriteOut { size, padding: 0 }.as_bytes()])
    }

    pub fn statfs(self, st: &abi::Kstatfs) {
        self.send(0, &[st.as_bytes()])
    }

    /// The size an xattr value or list would need (a query with size 0).
    pub fn xattr_size(self, size: u32) {
        self.send(0, &[abi::GetxattrOut { size, padding: 0 }.as_bytes()])
    }

    pub fn lock(self, lk: abi::FileLock) {
        self.send(0, &[abi::LkOut { lk }.as_bytes()])
    }

    pub fn lseek(self, offset: u64) {
        self.send(0, &[abi::LseekOut { offset }.as_bytes()])
    }
}

impl Drop for Reply<'_> {
    fn drop(&mut self) {
        if let Some(sink) = self.sink.take() {
            let _ = sink.send(self.unique, -libc::EIO, &[]);
        }
    }
}

/// A READDIR or READDIRPLUS reply being filled, up to the size the kernel
/// asked for.
pub struct DirBuf {
    buf: Vec<u8>,
    max: usize,
}

const fn align8(n: usize) -> usize {
    (n + 7) & !7
}

impl DirBuf {
    pub fn new(max: u32) -> DirBuf {
        DirBuf {
            buf: Vec::with_capacity((max as usize).min(1 << 20)),
            max: max as usize,
        }
    }

    fn push(&mut self, entry: Option<&abi::EntryOut>, ino: u64, off: u64, typ: u32, name: &[u8]) -> bool {
        let head = entry.map_or(0, |_| abi::DIRENTPLUS_ENTRY_SIZE) + core::mem::size_of::<abi::Dirent>();
        let len = align8(head + name.len());
        if self.buf.len() + len > self.max {
            return true;
        }
        let start = self.buf.len();
        if let Some(e) = entry {
            self.buf.extend_from_slice(e.as_bytes());
        }
        let d = abi::Dirent {
            ino,
            off,
            namelen: name.len() as u32,
            typ,
        };
        self.buf.extend_from_slice(d.as_bytes());
        self.buf.extend_from_slice(name);
        self.buf.resize(start + len, 0);
        false
    }

    /// Adds an entry (`typ` is the file type bits of its mode shifted down
    /// by 12, as in `d_type`); `off` is where a later READDIR resumes.
    /// True if it did not fit (the reply is full).
    pub fn add(&mut self, ino: u64, off: u64, typ: u32, name: &[u8]) -> bool {
        self.push(None, ino, off, typ, name)
    }

    /// Adds an entry with its lookup (READDIRPLUS): the kernel counts it as
    /// a lookup unless `entry.nodeid` is 0. True if it did not fit.
    pub fn add_plus(&mut self, entry: &Entry, off: u64, typ: u32, name: &[u8]) -> bool {
        self.push(Some(&entry.to_abi()), entry.attr.ino, off, typ, name)
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Capture(Vec<(u64, i32, Vec<u8>)>);

    impl Sink for Capture {
        fn send(&mut self, unique: u64, error: i32, parts: &[&[u8]]) -> io::Result<()> {
            self.0.push((unique, error, parts.concat()));
            Ok(())
        }
        fn send_file(&mut self, unique: u64, _file: BorrowedFd<'_>, _offset: u64, _len: usize) -> io::Result<()> {
            self.send(unique, 0, &[])
        }
    }

    #[test]
    fn an_unanswered_request_fails_with_eio() {
        let mut c = Capture::default();
        drop(Reply::new(9, &mut c));
        Reply::new(10, &mut c).error(libc::ENOENT);
        Reply::new(11, &mut c).write(5);
        assert_eq!(c.0[0], (9, -libc::EIO, vec![]));
        assert_eq!(c.0[1], (10, -libc::ENOENT, vec![]));
        assert_eq!(c.0[2].2, [5, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn dirents_are_padded_and_bounded() {
        let mut d = DirBuf::new(128);
        assert!(!d.add(5, 1, 4, b"abc"));
        assert_eq!(d.as_bytes().len(), 32);
        assert!(!d.add(6, 2, 8, b"0123456789"));
        assert_eq!(d.as_bytes().len(), 32 + 40);
        let mut d = DirBuf::new(64);
        assert!(!d.add(5, 1, 4, b"abc"));
        assert!(d.add(6, 2, 8, b"0123456789"), "must not exceed the size asked for");
        let mut p = DirBuf::new(4096);
        assert!(!p.add_plus(&Entry::default(), 1, 4, b"x"));
        assert_eq!(p.as_bytes().len(), 128 + 24 + 8);
    }
}
