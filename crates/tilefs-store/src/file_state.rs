//! One state of a file's contents, as far as stat can tell.

use rustix::fd::AsFd;
use rustix::fs::{fstat, Stat};

/// Device, inode, size, mtime and ctime of a file. A change to the
/// contents changes ctime, which users cannot set, so while this stays the
/// same the contents do too. The digest cache of imports and the FUSE
/// server's record of verified objects both key on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FileState {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
}

impl FileState {
    pub fn of(st: &Stat) -> FileState {
        FileState {
            dev: st.st_dev,
            ino: st.st_ino,
            size: st.st_size as u64,
            mtime: (st.st_mtime, st.st_mtime_nsec as u32),
            ctime: (st.st_ctime, st.st_ctime_nsec as u32),
        }
    }

    pub fn of_fd(fd: impl AsFd) -> std::io::Result<FileState> {
        Ok(FileState::of(&fstat(fd)?))
    }
}
