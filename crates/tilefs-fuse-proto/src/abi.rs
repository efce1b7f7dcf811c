//! The kernel's FUSE interface (`include/uapi/linux/fuse.h`), declared once.
//!
//! Only what this crate speaks is declared. Every structure is `repr(C)`,
//! has no implicit padding, and is read from and written to byte buffers
//! with zerocopy, so a short or misaligned message can never be misread:
//! parsing checks lengths, never casts pointers. The sizes are tested
//! against the header's (see the tests at the end).

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Protocol major version spoken.
pub const KERNEL_VERSION: u32 = 7;
/// Highest minor version this crate knows (Linux 6.18 speaks 7.45).
pub const KERNEL_MINOR_VERSION: u32 = 45;
/// The root's node id.
pub const ROOT_ID: u64 = 1;
/// The smallest read buffer the kernel accepts.
pub const MIN_READ_BUFFER: usize = 8192;

macro_rules! wire {
    ($($(#[$m:meta])* pub struct $name:ident { $($(#[$fm:meta])* pub $f:ident: $t:ty,)* })*) => {$(
        $(#[$m])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
        pub struct $name { $($(#[$fm])* pub $f: $t,)* }
    )*};
}

wire! {
    /// Precedes every request.
    pub struct InHeader {
        pub len: u32,
        pub opcode: u32,
        pub unique: u64,
        pub nodeid: u64,
        pub uid: u32,
        pub gid: u32,
        pub pid: u32,
        /// Length of extensions at the end of the request, in 8-byte units.
        pub total_extlen: u16,
        pub padding: u16,
    }

    /// Precedes every reply and notification.
    pub struct OutHeader {
        pub len: u32,
        /// 0, or a negated errno; for notifications the notify code.
        pub error: i32,
        pub unique: u64,
    }

    pub struct Attr {
        pub ino: u64,
        pub size: u64,
        pub blocks: u64,
        pub atime: u64,
        pub mtime: u64,
        pub ctime: u64,
        pub atimensec: u32,
        pub mtimensec: u32,
        pub ctimensec: u32,
        pub mode: u32,
        pub nlink: u32,
        pub uid: u32,
        pub gid: u32,
        pub rdev: u32,
        pub blksize: u32,
        pub flags: u32,
    }

    pub struct Kstatfs {
        pub blocks: u64,
        pub bfree: u64,
        pub bavail: u64,
        pub files: u64,
        pub ffree: u64,
        pub bsize: u32,
        pub namelen: u32,
        pub frsize: u32,
        pub padding: u32,
        pub spare: [u32; 6],
    }

    pub struct FileLock {
        pub start: u64,
        pub end: u64,
        pub typ: u32,
        pub pid: u32,
    }

    pub struct EntryOut {
        pub nodeid: u64,
        pub generation: u64,
        pub entry_valid: u64,
        pub attr_valid: u64,
        pub entry_valid_nsec: u32,
        pub attr_valid_nsec: u32,
        pub attr: Attr,
    }

    pub struct ForgetIn {
        pub nlookup: u64,
    }

    pub struct ForgetOne {
        pub nodeid: u64,
        pub nlookup: u64,
    }

    pub struct BatchForgetIn {
        pub count: u32,
        pub dummy: u32,
    }

    pub struct GetattrIn {
        pub getattr_flags: u32,
        pub dummy: u32,
        pub fh: u64,
    }

    pub struct AttrOut {
        pub attr_valid: u64,
        pub attr_valid_nsec: u32,
        pub dummy: u32,
        pub attr: Attr,
    }

    pub struct MknodIn {
        pub mode: u32,
        pub rdev: u32,
        pub umask: u32,
        pub padding: u32,
    }

    pub struct MkdirIn {
        pub mode: u32,
        pub umask: u32,
    }

    pub struct RenameIn {
        pub newdir: u64,
    }

    pub struct Rename2In {
        pub newdir: u64,
        pub flags: u32,
        pub padding: u32,
    }

    pub struct LinkIn {
        pub oldnodeid: u64,
    }

    pub struct SetattrIn {
        pub valid: u32,
        pub padding: u32,
        pub fh: u64,
        pub size: u64,
        pub lock_owner: u64,
        pub atime: u64,
        pub mtime: u64,
        pub ctime: u64,
        pub atimensec: u32,
        pub mtimensec: u32,
        pub ctimensec: u32,
        pub mode: u32,
        pub unused4: u32,
        pub uid: u32,
        pub gid: u32,
        pub unused5: u32,
    }

    pub struct OpenIn {
        pub flags: u32,
        pub open_flags: u32,
    }

    pub struct CreateIn {
        pub flags: u32,
        pub mode: u32,
        pub umask: u32,
        pub open_flags: u32,
    }

    pub struct OpenOut {
        pub fh: u64,
        pub open_flags: u32,
        pub backing_id: i32,
    }

    pub struct ReleaseIn {
        pub fh: u64,
        pub flags: u32,
        pub release_flags: u32,
        pub lock_owner: u64,
    }

    pub struct FlushIn {
        pub fh: u64,
        pub unused: u32,
        pub padding: u32,
        pub lock_owner: u64,
    }

    pub struct ReadIn {
        pub fh: u64,
        pub offset: u64,
        pub size: u32,
        pub read_flags: u32,
        pub lock_owner: u64,
        pub flags: u32,
        pub padding: u32,
    }

    pub struct WriteIn {
        pub fh: u64,
        pub offset: u64,
        pub size: u32,
        pub write_flags: u32,
        pub lock_owner: u64,
        pub flags: u32,
        pub padding: u32,
    }

    pub struct WriteOut {
        pub size: u32,
        pub padding: u32,
    }

    pub struct StatfsOut {
        pub st: Kstatfs,
    }

    pub struct FsyncIn {
        pub fh: u64,
        pub fsync_flags: u32,
        pub padding: u32,
    }

    /// The extended form (FUSE_SETXATTR_EXT); without it only the first
    /// two fields are sent.
    pub struct SetxattrIn {
        pub size: u32,
        pub flags: u32,
        pub setxattr_flags: u32,
        pub padding: u32,
    }

    pub struct GetxattrIn {
        pub size: u32,
        pub padding: u32,
    }

    pub struct GetxattrOut {
        pub size: u32,
        pub padding: u32,
    }

    pub struct LkIn {
        pub fh: u64,
        pub owner: u64,
        pub lk: FileLock,
        pub lk_flags: u32,
        pub padding: u32,
    }

    pub struct LkOut {
        pub lk: FileLock,
    }

    pub struct AccessIn {
        pub mask: u32,
        pub padding: u32,
    }

    pub struct InitIn {
        pub major: u32,
        pub minor: u32,
        pub max_readahead: u32,
        pub flags: u32,
        pub flags2: u32,
        pub unused: [u32; 11],
    }

    pub struct InitOut {
        pub major: u32,
        pub minor: u32,
        pub max_readahead: u32,
        pub flags: u32,
        pub max_background: u16,
        pub congestion_threshold: u16,
        pub max_write: u32,
        pub time_gran: u32,
        pub max_pages: u16,
        pub map_alignment: u16,
        pub flags2: u32,
        pub max_stack_depth: u32,
        pub request_timeout: u16,
        pub unused: [u16; 11],
    }

    pub struct InterruptIn {
        pub unique: u64,
    }

    pub struct FallocateIn {
        pub fh: u64,
        pub offset: u64,
        pub length: u64,
        pub mode: u32,
        pub padding: u32,
    }

    pub struct LseekIn {
        pub fh: u64,
        pub offset: u64,
        pub whence: u32,
        pub padding: u32,
    }

    pub struct LseekOut {
        pub offset: u64,
    }

    pub struct CopyFileRangeIn {
        pub fh_in: u64,
        pub off_in: u64,
        pub nodeid_out: u64,
        pub fh_out: u64,
        pub off_out: u64,
        pub len: u64,
        pub flags: u64,
    }

    /// A directory entry of a READDIR reply; the name follows, the whole
    /// padded to 8 bytes.
    pub struct Dirent {
        pub ino: u64,
        pub off: u64,
        pub namelen: u32,
        pub typ: u32,
    }

    pub struct NotifyInvalInodeOut {
        pub ino: u64,
        pub off: i64,
        pub len: i64,
    }

    pub struct NotifyInvalEntryOut {
        pub parent: u64,
        pub namelen: u32,
        pub flags: u32,
    }

    pub struct NotifyDeleteOut {
        pub parent: u64,
        pub child: u64,
        pub namelen: u32,
        pub padding: u32,
    }

    /// Part of [`UringReqHeader`]: what the kernel says of the request in
    /// a ring entry, and where the reply says how much payload it has.
    pub struct UringEntInOut {
        pub flags: u64,
        /// Names the request when its reply is committed.
        pub commit_id: u64,
        /// Bytes of payload (request: from the kernel; reply: ours).
        pub payload_sz: u32,
        pub padding: u32,
        pub reserved: u64,
    }

    /// The 80-byte command area of a FUSE io_uring submission.
    pub struct UringCmdReq {
        pub flags: u64,
        pub commit_id: u64,
        pub qid: u16,
        pub padding: [u8; 6],
    }
}

/// The header buffer of a ring entry.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct UringReqHeader {
    /// The request's InHeader, or the reply's OutHeader.
    pub in_out: [u8; URING_IN_OUT_HEADER_SZ],
    /// The request's first argument (the opcode's fixed structure).
    pub op_in: [u8; URING_OP_IN_OUT_SZ],
    pub ring_ent_in_out: UringEntInOut,
}

/// A direntplus record: the entry, then a [`Dirent`] and the name.
pub const DIRENTPLUS_ENTRY_SIZE: usize = core::mem::size_of::<EntryOut>();

pub const URING_IN_OUT_HEADER_SZ: usize = 128;
pub const URING_OP_IN_OUT_SZ: usize = 128;

/// `enum fuse_uring_cmd`.
pub const URING_CMD_REGISTER: u32 = 1;
pub const URING_CMD_COMMIT_AND_FETCH: u32 = 2;

/// `enum fuse_opcode`.
pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const GETLK: u32 = 31;
    pub const SETLK: u32 = 32;
    pub const SETLKW: u32 = 33;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const BMAP: u32 = 37;
    pub const DESTROY: u32 = 38;
    pub const IOCTL: u32 = 39;
    pub const POLL: u32 = 40;
    pub const NOTIFY_REPLY: u32 = 41;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const READDIRPLUS: u32 = 44;
    pub const RENAME2: u32 = 45;
    pub const LSEEK: u32 = 46;
    pub const COPY_FILE_RANGE: u32 = 47;
    pub const SYNCFS: u32 = 50;
    pub const TMPFILE: u32 = 51;
    pub const STATX: u32 = 52;
}

/// `enum fuse_notify_code`.
pub mod notify {
    pub const INVAL_INODE: i32 = 2;
    pub const INVAL_ENTRY: i32 = 3;
    pub const DELETE: i32 = 6;
}

/// INIT flags (`flags`, and bits 32.. in `flags2`).
pub mod init {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const POSIX_LOCKS: u64 = 1 << 1;
    pub const ATOMIC_O_TRUNC: u64 = 1 << 3;
    pub const EXPORT_SUPPORT: u64 = 1 << 4;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const DONT_MASK: u64 = 1 << 6;
    pub const SPLICE_WRITE: u64 = 1 << 7;
    pub const SPLICE_MOVE: u64 = 1 << 8;
    pub const SPLICE_READ: u64 = 1 << 9;
    pub const FLOCK_LOCKS: u64 = 1 << 10;
    pub const AUTO_INVAL_DATA: u64 = 1 << 12;
    pub const DO_READDIRPLUS: u64 = 1 << 13;
    pub const READDIRPLUS_AUTO: u64 = 1 << 14;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const WRITEBACK_CACHE: u64 = 1 << 16;
    pub const NO_OPEN_SUPPORT: u64 = 1 << 17;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const HANDLE_KILLPRIV: u64 = 1 << 19;
    pub const POSIX_ACL: u64 = 1 << 20;
    pub const ABORT_ERROR: u64 = 1 << 21;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const CACHE_SYMLINKS: u64 = 1 << 23;
    pub const NO_OPENDIR_SUPPORT: u64 = 1 << 24;
    pub const EXPLICIT_INVAL_DATA: u64 = 1 << 25;
    pub const HANDLE_KILLPRIV_V2: u64 = 1 << 28;
    pub const SETXATTR_EXT: u64 = 1 << 29;
    pub const INIT_EXT: u64 = 1 << 30;
    pub const HAS_EXPIRE_ONLY: u64 = 1 << 35;
    pub const DIRECT_IO_ALLOW_MMAP: u64 = 1 << 36;
    pub const PASSTHROUGH: u64 = 1 << 37;
    pub const NO_EXPORT_SUPPORT: u64 = 1 << 38;
    pub const HAS_RESEND: u64 = 1 << 39;
    pub const OVER_IO_URING: u64 = 1 << 41;
}

/// OpenOut `open_flags`.
pub mod fopen {
    pub const DIRECT_IO: u32 = 1 << 0;
    pub const KEEP_CACHE: u32 = 1 << 1;
    pub const NONSEEKABLE: u32 = 1 << 2;
    pub const CACHE_DIR: u32 = 1 << 3;
    pub const STREAM: u32 = 1 << 4;
    pub const NOFLUSH: u32 = 1 << 5;
    pub const PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
    pub const PASSTHROUGH: u32 = 1 << 7;
}

/// SetattrIn `valid`.
pub mod fattr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const FH: u32 = 1 << 6;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
    pub const LOCKOWNER: u32 = 1 << 9;
    pub const CTIME: u32 = 1 << 10;
    pub const KILL_SUIDGID: u32 = 1 << 11;
}

pub const GETATTR_FH: u32 = 1 << 0;
pub const RELEASE_FLUSH: u32 = 1 << 0;
pub const RELEASE_FLOCK_UNLOCK: u32 = 1 << 1;
pub const LK_FLOCK: u32 = 1 << 0;
pub const WRITE_CACHE: u32 = 1 << 0;
pub const WRITE_LOCKOWNER: u32 = 1 << 1;
pub const WRITE_KILL_SUIDGID: u32 = 1 << 2;
pub const FSYNC_FDATASYNC: u32 = 1 << 0;
pub const OPEN_KILL_SUIDGID: u32 = 1 << 0;
pub const SETXATTR_ACL_KILL_SGID: u32 = 1 << 0;

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    /// The sizes fuse.h gives its structures.
    #[test]
    fn sizes_match_the_kernel_header() {
        assert_eq!(size_of::<InHeader>(), 40);
        assert_eq!(size_of::<OutHeader>(), 16);
        assert_eq!(size_of::<Attr>(), 88);
        assert_eq!(size_of::<Kstatfs>(), 80);
        assert_eq!(size_of::<FileLock>(), 24);
        assert_eq!(size_of::<EntryOut>(), 128);
        assert_eq!(size_of::<AttrOut>(), 104);
        assert_eq!(size_of::<GetattrIn>(), 16);
        assert_eq!(size_of::<MknodIn>(), 16);
        assert_eq!(size_of::<MkdirIn>(), 8);
        assert_eq!(size_of::<Rename2In>(), 16);
        assert_eq!(size_of::<SetattrIn>(), 88);
        assert_eq!(size_of::<OpenIn>(), 8);
        assert_eq!(size_of::<CreateIn>(), 16);
        assert_eq!(size_of::<OpenOut>(), 16);
        assert_eq!(size_of::<ReleaseIn>(), 24);
        assert_eq!(size_of::<FlushIn>(), 24);
        assert_eq!(size_of::<ReadIn>(), 40);
        assert_eq!(size_of::<WriteIn>(), 40);
        assert_eq!(size_of::<WriteOut>(), 8);
        assert_eq!(size_of::<FsyncIn>(), 16);
        assert_eq!(size_of::<SetxattrIn>(), 16);
        assert_eq!(size_of::<GetxattrIn>(), 8);
        assert_eq!(size_of::<LkIn>(), 48);
        assert_eq!(size_of::<InitIn>(), 64);
        assert_eq!(size_of::<InitOut>(), 64);
        assert_eq!(size_of::<FallocateIn>(), 32);
        assert_eq!(size_of::<LseekIn>(), 24);
        assert_eq!(size_of::<CopyFileRangeIn>(), 56);
        assert_eq!(size_of::<Dirent>(), 24);
        assert_eq!(size_of::<NotifyInvalInodeOut>(), 24);
        assert_eq!(size_of::<NotifyInvalEntryOut>(), 16);
        assert_eq!(size_of::<NotifyDeleteOut>(), 24);
        assert_eq!(size_of::<UringEntInOut>(), 32);
        assert_eq!(size_of::<UringReqHeader>(), 288);
        assert_eq!(size_of::<UringCmdReq>(), 24);
    }
}
