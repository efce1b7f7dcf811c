//! Reading an upper directory, which is untrusted input: every entry is
//! reached from the upper root's descriptor with `openat2`
//! (`RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
//! RESOLVE_NO_XDEV`), files are opened `O_NOFOLLOW | O_NONBLOCK` and read
//! only if regular, and xattrs are read with the `l` calls through
//! `/proc/self/fd/DIR/NAME`, which follow no link of the upper directory.
//! So no symlink, FIFO, device or mount planted there leads the reader
//! anywhere else or makes it wait.

use crate::CommitError;
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use rustix::fs::{AtFlags, Mode, OFlags, RawDir, ResolveFlags, Stat};
use rustix::io::Errno;
use std::ffi::{CStr, CString, OsStr};
use std::mem::MaybeUninit;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// How entries below a directory descriptor are resolved.
pub const BENEATH: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS)
    .union(ResolveFlags::NO_XDEV);

/// Xattrs as read: (name, value).
pub type Xattrs = Vec<(Vec<u8>, Vec<u8>)>;

/// A directory of the upper directory, open, with its path for messages.
pub struct Dir {
    pub fd: OwnedFd,
    pub path: PathBuf,
}

/// An error about `path`.
pub fn at(path: &Path, what: &'static str, e: Errno) -> CommitError {
    CommitError::Io {
        path: path.to_path_buf(),
        what,
        err: e.into(),
    }
}

impl Dir {
    /// Opens the upper directory itself (a canonical path): no component
    /// may be a symlink.
    pub fn open_root(path: &Path) -> Result<Dir, CommitError> {
        let fd = rustix::fs::openat2(
            rustix::fs::CWD,
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
        )
        .map_err(|e| at(path, "cannot open the upper directory", e))?;
        Ok(Dir {
            fd,
            path: path.to_path_buf(),
        })
    }

    pub fn join(&self, name: &[u8]) -> PathBuf {
        self.path.join(OsStr::from_bytes(name))
    }

    /// The subdirectory `name`.
    pub fn open_dir(&self, name: &CStr) -> Result<Dir, CommitError> {
        let path = self.join(name.to_bytes());
        let fd = rustix::fs::openat2(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
            BENEATH,
        )
        .map_err(|e| at(&path, "cannot open directory", e))?;
        Ok(Dir { fd, path })
    }

    /// The directory's entries, without `.` and `..`, sorted by name.
    pub fn names(&self) -> Result<Vec<CString>, CommitError> {
        // A descriptor of its own: reading moves the offset.
        let fd = rustix::fs::openat(
            &self.fd,
            c".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| at(&self.path, "cannot open directory", e))?;
        let mut buf: Vec<MaybeUninit<u8>> = vec![MaybeUninit::uninit(); 32 * 1024];
        let mut dir = RawDir::new(&fd, &mut buf);
        let mut names = Vec::new();
        while let Some(e) = dir.next() {
            let e = e.map_err(|e| at(&self.path, "cannot read directory", e))?;
            let n = e.file_name();
            if n.to_bytes() != b"." && n.to_bytes() != b".." {
                names.push(n.to_owned());
            }
        }
        names.sort_unstable();
        Ok(names)
    }

    /// lstat of `name`; None if it has gone since it was listed.
    pub fn stat(&self, name: &CStr) -> Result<Option<Stat>, CommitError> {
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(st)),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(at(&self.join(name.to_bytes()), "cannot stat", e)),
        }
    }

    pub fn readlink(&self, name: &CStr) -> Result<Vec<u8>, CommitError> {
        rustix::fs::readlinkat(&self.fd, name, Vec::new())
            .map(CString::into_bytes)
            .map_err(|e| at(&self.join(name.to_bytes()), "cannot read symlink", e))
    }

    /// Reads the regular file `name`: at most `max` bytes. Anything but a
    /// regular file is refused, unread.
    pub fn read_file(&self, name: &CStr, max: usize) -> Result<Vec<u8>, CommitError> {
        let path = self.join(name.to_bytes());
        let fd = open_file(self.fd.as_fd(), name).map_err(|e| at(&path, "cannot open", e))?;
        let mut data = vec![0u8; max];
        let mut n = 0;
        while n < max {
            match rustix::io::read(&fd, &mut data[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(Errno::INTR) => continue,
                Err(e) => return Err(at(&path, "cannot read", e)),
            }
        }
        data.truncate(n);
        Ok(data)
    }

    /// The xattrs of entry `name`, or of the directory itself (None).
    pub fn xattrs(&self, name: Option<&CStr>) -> Result<Xattrs, CommitError> {
        let path = || name.map_or_else(|| self.path.clone(), |n| self.join(n.to_bytes()));
        let src = Source::new(self.fd.as_fd(), name);
        let list = match grow(|b| src.list(b)) {
            Ok(l) => l,
            Err(Errno::OPNOTSUPP) => return Ok(Vec::new()),
            Err(e) => return Err(at(&path(), "cannot list xattrs", e)),
        };
        let mut out = Vec::new();
        for key in list.split(|&b| b == 0).filter(|k| !k.is_empty()) {
            let k = CString::new(key).expect("split at NUL");
            match grow(|b| src.get(&k, b)) {
                Ok(v) => out.push((key.to_vec(), v)),
                // Removed since it was listed.
                Err(Errno::NODATA) => {}
                Err(e) => {
                    return Err(CommitError::At {
                        path: path(),
                        reason: format!("cannot read xattr {}: {}", key.escape_ascii(), std::io::Error::from(e)),
                    })
                }
            }
        }
        Ok(out)
    }

    /// One xattr of the directory itself.
    pub fn own_xattr(&self, key: &[u8]) -> Result<Option<Vec<u8>>, CommitError> {
        let k = CString::new(key).map_err(|_| at(&self.path, "xattr name", Errno::INVAL))?;
        match grow(|b| rustix::fs::fgetxattr(&self.fd, k.as_c_str(), b)) {
            Ok(v) => Ok(Some(v)),
            Err(Errno::NODATA) | Err(Errno::OPNOTSUPP) => Ok(None),
            Err(e) => Err(at(&self.path, "cannot read xattrs", e)),
        }
    }

    /// One xattr of entry `name` (not followed if it is a symlink).
    pub fn xattr(&self, name: &CStr, key: &[u8]) -> Result<Option<Vec<u8>>, CommitError> {
        let k = CString::new(key).map_err(|_| at(&self.path, "xattr name", Errno::INVAL))?;
        let src = Source::new(self.fd.as_fd(), Some(name));
        match grow(|b| src.get(&k, b)) {
            Ok(v) => Ok(Some(v)),
            Err(Errno::NODATA) | Err(Errno::OPNOTSUPP) => Ok(None),
            Err(e) => Err(at(&self.join(name.to_bytes()), "cannot read xattrs", e)),
        }
    }
}

/// Opens regular file `name` of `dir` for reading, never through a
/// symlink, never blocking (a FIFO), never below a mount.
pub fn open_file(dir: BorrowedFd<'_>, name: &CStr) -> Result<OwnedFd, Errno> {
    let fd = rustix::fs::openat2(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
        BENEATH,
    )?;
    if rustix::fs::FileType::from_raw_mode(rustix::fs::fstat(&fd)?.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(Errno::INVAL);
    }
    Ok(fd)
}

/// Where xattrs are read: a directory by its descriptor, an entry by
/// `/proc/self/fd/DIR/NAME` with the calls that do not follow its last
/// component.
enum Source<'a> {
    Fd(BorrowedFd<'a>),
    Path(CString),
}

impl<'a> Source<'a> {
    fn new(dir: BorrowedFd<'a>, name: Option<&CStr>) -> Source<'a> {
        match name {
            None => Source::Fd(dir),
            Some(n) => {
                let mut p = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
                p.extend_from_slice(n.to_bytes());
                Source::Path(CString::new(p).expect("names hold no NUL"))
            }
        }
    }

    fn list(&self, buf: &mut [u8]) -> Result<usize, Errno> {
        match self {
            Source::Fd(fd) => rustix::fs::flistxattr(fd, buf),
            Source::Path(p) => rustix::fs::llistxattr(p.as_c_str(), buf),
        }
    }

    fn get(&self, key: &CStr, buf: &mut [u8]) -> Result<usize, Errno> {
        match self {
            Source::Fd(fd) => rustix::fs::fgetxattr(fd, key, buf),
            Source::Path(p) => rustix::fs::lgetxattr(p.as_c_str(), key, buf),
        }
    }
}

/// Calls `f` with ever larger buffers until the answer fits (the kernel
/// caps lists and values at 64 KiB, so this ends).
fn grow(mut f: impl FnMut(&mut [u8]) -> Result<usize, Errno>) -> Result<Vec<u8>, Errno> {
    let mut buf = vec![0u8; 256];
    loop {
        match f(&mut buf) {
            Ok(n) => {
                buf.truncate(n);
                return Ok(buf);
            }
            Err(Errno::RANGE) => {
                let need = f(&mut [])?;
                buf.resize(need.max(buf.len() * 2), 0);
            }
            Err(Errno::INTR) => {}
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn dir_with_traps() -> (tempfile::TempDir, Dir) {
        let t = tempfile::tempdir().unwrap();
        let p = t.path();
        std::fs::create_dir(p.join("sub")).unwrap();
        std::fs::write(p.join("sub/file"), b"inside").unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            p.join("fifo"),
            rustix::fs::FileType::Fifo,
            Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        symlink("sub/file", p.join("to-file")).unwrap();
        symlink("sub", p.join("to-dir")).unwrap();
        symlink("/", p.join("to-root")).unwrap();
        let _ = rustix::fs::setxattr(
            p.join("sub/file").as_path(),
            "user.x",
            b"1",
            rustix::fs::XattrFlags::empty(),
        );
        let d = Dir::open_root(p).unwrap();
        (t, d)
    }

    #[test]
    fn nothing_but_regular_files_and_real_directories_is_opened() {
        let (_t, d) = dir_with_traps();
        // A FIFO is refused at once, not waited on.
        let e = d.read_file(c"fifo", 10).unwrap_err().to_string();
        assert!(e.ends_with("fifo: cannot open: Invalid argument (os error 22)"), "{e}");
        assert!(d.read_file(c"to-file", 10).is_err());
        assert!(d.open_dir(c"to-dir").is_err());
        assert!(d.open_dir(c"to-root").is_err());
        let sub = d.open_dir(c"sub").unwrap();
        assert_eq!(sub.read_file(c"file", 100).unwrap(), b"inside");
        assert_eq!(sub.read_file(c"file", 3).unwrap(), b"ins");
        // xattrs of a symlink are its own, never its target's.
        assert!(d.xattrs(Some(c"to-file")).unwrap().is_empty());
        assert_eq!(d.readlink(c"to-root").unwrap(), b"/");
        assert_eq!(
            d.names().unwrap(),
            [c"fifo", c"sub", c"to-dir", c"to-file", c"to-root"].map(CStr::to_owned)
        );
    }

    #[test]
    fn the_upper_directory_is_reached_through_no_symlink() {
        let (t, _d) = dir_with_traps();
        assert!(Dir::open_root(&t.path().join("sub")).is_ok());
        let e = Dir::open_root(&t.path().join("to-dir")).err().unwrap().to_string();
        assert!(e.contains("cannot open the upper directory"), "{e}");
    }
}
