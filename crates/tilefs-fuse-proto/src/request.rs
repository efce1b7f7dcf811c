//! Requests: the header, and each opcode's arguments parsed into [`Op`].
//!
//! A request arrives in two parts: the opcode's fixed structure and the
//! variable part after it (names, written data). Read from /dev/fuse they
//! are contiguous; through io_uring the kernel puts the first in the ring
//! entry's header and the second in its payload buffer. [`parse`] takes
//! both, so each transport hands over what it has without copying.
//! Everything is checked: a message that is too short or a name without
//! its terminating NUL is an error (EINVAL), never a misread.

use crate::abi::{self, opcode};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use zerocopy::FromBytes;

/// Who asks, and about which node.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    pub unique: u64,
    pub opcode: u32,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

impl Request {
    pub(crate) fn from_header(h: &abi::InHeader) -> Request {
        Request {
            unique: h.unique,
            opcode: h.opcode,
            nodeid: h.nodeid,
            uid: h.uid,
            gid: h.gid,
            pid: h.pid,
        }
    }
}

/// A request's arguments. Names are as the kernel sent them (never empty,
/// never containing `/`: checked).
#[derive(Debug)]
pub enum Op<'a> {
    Lookup {
        name: &'a OsStr,
    },
    Getattr {
        fh: Option<u64>,
    },
    Setattr(abi::SetattrIn),
    Readlink,
    Symlink {
        name: &'a OsStr,
        target: &'a [u8],
    },
    Mknod {
        name: &'a OsStr,
        mode: u32,
        rdev: u32,
        umask: u32,
    },
    Mkdir {
        name: &'a OsStr,
        mode: u32,
        umask: u32,
    },
    Unlink {
        name: &'a OsStr,
    },
    Rmdir {
        name: &'a OsStr,
    },
    /// RENAME and RENAME2 (`flags` 0 for the first).
    Rename {
        name: &'a OsStr,
        newdir: u64,
        newname: &'a OsStr,
        flags: u32,
    },
    Link {
        oldnode: u64,
        newname: &'a OsStr,
    },
    Open {
        flags: u32,
        open_flags: u32,
    },
    Read(abi::ReadIn),
    Write {
        arg: abi::WriteIn,
        data: &'a [u8],
    },
    Statfs,
    Release(abi::ReleaseIn),
    Fsync {
        fh: u64,
        datasync: bool,
    },
    Setxattr {
        name: &'a OsStr,
        value: &'a [u8],
        flags: u32,
        setxattr_flags: u32,
    },
    Getxattr {
        name: &'a OsStr,
        size: u32,
    },
    Listxattr {
        size: u32,
    },
    Removexattr {
        name: &'a OsStr,
    },
    Flush {
        fh: u64,
        lock_owner: u64,
    },
    Opendir {
        flags: u32,
    },
    Readdir {
        arg: abi::ReadIn,
        plus: bool,
    },
    Releasedir(abi::ReleaseIn),
    Fsyncdir {
        fh: u64,
        datasync: bool,
    },
    Getlk(abi::LkIn),
    Setlk {
        arg: abi::LkIn,
        sleep: bool,
    },
    Access {
        mask: u32,
    },
    /// CREATE, and TMPFILE (`tmpfile`: an unnamed file; `name` is the
    /// dentry's placeholder name).
    Create {
        name: &'a OsStr,
        arg: abi::CreateIn,
        tmpfile: bool,
    },
    Fallocate(abi::FallocateIn),
    Lseek(abi::LseekIn),
    CopyFileRange(abi::CopyFileRangeIn),
    Syncfs,
    /// Anything else (IOCTL, POLL, BMAP, STATX, ...): answered ENOSYS.
    Other(u32),
}

/// Negotiated details that change how requests are laid out.
#[derive(Debug, Clone, Copy, Default)]
pub struct Layout {
    /// FUSE_SETXATTR_EXT: SETXATTR's structure is 16 bytes, else 8.
    pub setxattr_ext: bool,
}

/// Why a request could not be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

/// Size of the fixed structure opening `opcode`'s arguments: the part the
/// io_uring transport delivers in the entry header. Zero for opcodes whose
/// arguments are only names.
pub fn op_header_size(opcode: u32, layout: Layout) -> usize {
    use core::mem::size_of;
    match opcode {
        opcode::FORGET => size_of::<abi::ForgetIn>(),
        opcode::GETATTR => size_of::<abi::GetattrIn>(),
        opcode::SETATTR => size_of::<abi::SetattrIn>(),
        opcode::MKNOD => size_of::<abi::MknodIn>(),
        opcode::MKDIR => size_of::<abi::MkdirIn>(),
        opcode::RENAME => size_of::<abi::RenameIn>(),
        opcode::RENAME2 => size_of::<abi::Rename2In>(),
        opcode::LINK => size_of::<abi::LinkIn>(),
        opcode::OPEN | opcode::OPENDIR => size_of::<abi::OpenIn>(),
        opcode::READ | opcode::READDIR | opcode::READDIRPLUS => size_of::<abi::ReadIn>(),
        opcode::WRITE => size_of::<abi::WriteIn>(),
        opcode::RELEASE | opcode::RELEASEDIR => size_of::<abi::ReleaseIn>(),
        opcode::FSYNC | opcode::FSYNCDIR => size_of::<abi::FsyncIn>(),
        opcode::SETXATTR if layout.setxattr_ext => size_of::<abi::SetxattrIn>(),
        opcode::SETXATTR => 8,
        opcode::GETXATTR | opcode::LISTXATTR => size_of::<abi::GetxattrIn>(),
        opcode::FLUSH => size_of::<abi::FlushIn>(),
        opcode::GETLK | opcode::SETLK | opcode::SETLKW => size_of::<abi::LkIn>(),
        opcode::ACCESS => size_of::<abi::AccessIn>(),
        opcode::CREATE | opcode::TMPFILE => size_of::<abi::CreateIn>(),
        opcode::INTERRUPT => size_of::<abi::InterruptIn>(),
        opcode::BATCH_FORGET => size_of::<abi::BatchForgetIn>(),
        opcode::FALLOCATE => size_of::<abi::FallocateIn>(),
        opcode::LSEEK => size_of::<abi::LseekIn>(),
        opcode::COPY_FILE_RANGE => size_of::<abi::CopyFileRangeIn>(),
        opcode::SYNCFS => 8,
        _ => 0,
    }
}

fn read<T: FromBytes>(b: &[u8]) -> Result<T, Malformed> {
    T::read_from_prefix(b).map(|(v, _)| v).map_err(|_| Malformed)
}

/// Reads a NUL-terminated name from the start of `b`; returns it and what
/// follows the NUL.
fn name(b: &[u8]) -> Result<(&OsStr, &[u8]), Malformed> {
    let end = b.iter().position(|&c| c == 0).ok_or(Malformed)?;
    let n = &b[..end];
    if n.is_empty() || n.contains(&b'/') {
        return Err(Malformed);
    }
    Ok((OsStr::from_bytes(n), &b[end + 1..]))
}

/// A name that may be anything but empty (xattr names may contain `/`).
fn xattr_name(b: &[u8]) -> Result<(&OsStr, &[u8]), Malformed> {
    let end = b.iter().position(|&c| c == 0).ok_or(Malformed)?;
    if end == 0 {
        return Err(Malformed);
    }
    Ok((OsStr::from_bytes(&b[..end]), &b[end + 1..]))
}

/// Parses a request other than INIT, FORGET, BATCH_FORGET and INTERRUPT
/// (the session handles those): `head` is the opcode's fixed structure (at
/// least [`op_header_size`] bytes), `rest` what follows it.
pub fn parse<'a>(opcode: u32, head: &'a [u8], rest: &'a [u8], layout: Layout) -> Result<Op<'a>, Malformed> {
    if head.len() < op_header_size(opcode, layout) {
        return Err(Malformed);
    }
    Ok(match opcode {
        opcode::LOOKUP => Op::Lookup { name: name(rest)?.0 },
        opcode::GETATTR => {
            let a: abi::GetattrIn = read(head)?;
            Op::Getattr {
                fh: (a.getattr_flags & abi::GETATTR_FH != 0).then_some(a.fh),
            }
        }
        opcode::SETATTR => Op::Setattr(read(head)?),
        opcode::READLINK => Op::Readlink,
        opcode::SYMLINK => {
            let (n, rest) = name(rest)?;
            let end = rest.iter().position(|&c| c == 0).ok_or(Malformed)?;
            Op::Symlink {
                name: n,
                target: &rest[..end],
            }
        }
        opcode::MKNOD => {
            let a: abi::MknodIn = read(head)?;
            Op::Mknod {
                name: name(rest)?.0,
                mode: a.mode,
                rdev: a.rdev,
                umask: a.umask,
            }
        }
        opcode::MKDIR => {
            let a: abi::MkdirIn = read(head)?;
            Op::Mkdir {
                name: name(rest)?.0,
                mode: a.mode,
                umask: a.umask,
            }
        }
        opcode::UNLINK => Op::Unlink { name: name(rest)?.0 },
        opcode::RMDIR => Op::Rmdir { name: name(rest)?.0 },
        opcode::RENAME | opcode::RENAME2 => {
            let (newdir, flags) = if opcode == opcode::RENAME {
                (read::<abi::RenameIn>(head)?.newdir, 0)
            } else {
                let a: abi::Rename2In = read(head)?;
                (a.newdir, a.flags)
            };
            let (old, rest) = name(rest)?;
            let (new, _) = name(rest)?;
            Op::Rename {
                name: old,
                newdir,
                newname: new,
                flags,
            }
        }
        opcode::LINK => Op::Link {
            oldnode: read::<abi::LinkIn>(head)?.oldnodeid,
            newname: name(rest)?.0,
        },
        opcode::OPEN => {
            let a: abi::OpenIn = read(head)?;
            Op::Open {
                flags: a.flags,
                open_flags: a.open_flags,
            }
        }
        opcode::READ => Op::Read(read(head)?),
        opcode::WRITE => {
            let arg: abi::WriteIn = read(head)?;
            let data = rest.get(..arg.size as usize).ok_or(Malformed)?;
            Op::Write { arg, data }
        }
        opcode::STATFS => Op::Statfs,
        opcode::RELEASE => Op::Release(read(head)?),
        opcode::FSYNC | opcode::FSYNCDIR => {
            let a: abi::FsyncIn = read(head)?;
            let datasync = a.fsync_flags & abi::FSYNC_FDATASYNC != 0;
            if opcode == opcode::FSYNC {
                Op::Fsync { fh: a.fh, datasync }
            } else {
                Op::Fsyncdir { fh: a.fh, datasync }
            }
        }
        opcode::SETXATTR => {
            let size = u32::from_ne_bytes(head[0..4].try_into().expect("4 bytes"));
            let flags = u32::from_ne_bytes(head[4..8].try_into().expect("4 bytes"));
            let setxattr_flags = if layout.setxattr_ext {
                u32::from_ne_bytes(head[8..12].try_into().expect("4 bytes"))
            } else {
                0
            };
            let (n, rest) = xattr_name(rest)?;
            let value = rest.get(..size as usize).ok_or(Malformed)?;
            Op::Setxattr {
                name: n,
                value,
                flags,
                setxattr_flags,
            }
        }
        opcode::GETXATTR => Op::Getxattr {
            size: read::<abi::GetxattrIn>(head)?.size,
            name: xattr_name(rest)?.0,
        },
        opcode::LISTXATTR => Op::Listxattr {
            size: read::<abi::GetxattrIn>(head)?.size,
        },
        opcode::REMOVEXATTR => Op::Removexattr {
            name: xattr_name(rest)?.0,
        },
        opcode::FLUSH => {
            let a: abi::FlushIn = read(head)?;
            Op::Flush {
                fh: a.fh,
                lock_owner: a.lock_owner,
            }
        }
        opcode::OPENDIR => Op::Opendir {
            flags: read::<abi::OpenIn>(head)?.flags,
        },
        opcode::READDIR | opcode::READDIRPLUS => Op::Readdir {
            arg: read(head)?,
            plus: opcode == opcode::READDIRPLUS,
        },
        opcode::RELEASEDIR => Op::Releasedir(read(head)?),
        opcode::GETLK => Op::Getlk(read(head)?),
        opcode::SETLK | opcode::SETLKW => Op::Setlk {
            arg: read(head)?,
            sleep: opcode == opcode::SETLKW,
        },
        opcode::ACCESS => Op::Access {
            mask: read::<abi::AccessIn>(head)?.mask,
        },
        opcode::CREATE => Op::Create {
            arg: read(head)?,
            name: name(rest)?.0,
            tmpfile: false,
        },
        // The kernel names an unnamed file's dentry "/": not a name.
        opcode::TMPFILE => Op::Create {
            arg: read(head)?,
            name: OsStr::new(""),
            tmpfile: true,
        },
        opcode::FALLOCATE => Op::Fallocate(read(head)?),
        opcode::LSEEK => Op::Lseek(read(head)?),
        opcode::COPY_FILE_RANGE => Op::CopyFileRange(read(head)?),
        opcode::SYNCFS => Op::Syncfs,
        other => Op::Other(other),
    })
}

/// The (nodeid, nlookup) pairs of a BATCH_FORGET.
pub fn batch_forget(head: &[u8], rest: &[u8]) -> Result<Vec<abi::ForgetOne>, Malformed> {
    let a: abi::BatchForgetIn = read(head)?;
    let one = core::mem::size_of::<abi::ForgetOne>();
    let n = (a.count as usize).min(rest.len() / one);
    Ok((0..n).filter_map(|i| read(&rest[i * one..]).ok()).collect())
}

/// The nlookup of a FORGET.
pub fn forget(head: &[u8]) -> Result<u64, Malformed> {
    Ok(read::<abi::ForgetIn>(head)?.nlookup)
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerocopy::IntoBytes;

    #[test]
    fn names_are_checked() {
        assert!(
            matches!(parse(opcode::LOOKUP, &[], b"abc\0", Layout::default()), Ok(Op::Lookup { name }) if name == "abc")
        );
        for bad in [&b"abc"[..], b"\0", b"a/b\0", b""] {
            assert_eq!(
                parse(opcode::LOOKUP, &[], bad, Layout::default()).unwrap_err(),
                Malformed
            );
        }
    }

    #[test]
    fn rename_and_symlink() {
        let head = abi::Rename2In {
            newdir: 7,
            flags: 1,
            padding: 0,
        };
        match parse(opcode::RENAME2, head.as_bytes(), b"a\0b\0", Layout::default()) {
            Ok(Op::Rename {
                name,
                newdir: 7,
                newname,
                flags: 1,
            }) => assert_eq!((name, newname), (OsStr::new("a"), OsStr::new("b"))),
            other => panic!("{other:?}"),
        }
        match parse(opcode::SYMLINK, &[], b"l\0/t/x\0", Layout::default()) {
            Ok(Op::Symlink { name, target }) => assert_eq!((name.as_bytes(), target), (&b"l"[..], &b"/t/x"[..])),
            other => panic!("{other:?}"),
        }
        assert!(parse(opcode::RENAME2, &head.as_bytes()[..8], b"a\0b\0", Layout::default()).is_err());
    }

    #[test]
    fn write_data_must_all_be_there() {
        let head = abi::WriteIn {
            size: 5,
            ..Default::default()
        };
        assert!(matches!(
            parse(opcode::WRITE, head.as_bytes(), b"hello", Layout::default()),
            Ok(Op::Write { data: b"hello", .. })
        ));
        assert!(parse(opcode::WRITE, head.as_bytes(), b"hell", Layout::default()).is_err());
    }

    #[test]
    fn setxattr_both_layouts() {
        let mut head = vec![];
        head.extend_from_slice(&3u32.to_ne_bytes());
        head.extend_from_slice(&1u32.to_ne_bytes());
        let rest = b"user.x\0abc";
        match parse(opcode::SETXATTR, &head, rest, Layout::default()) {
            Ok(Op::Setxattr {
                name, value, flags: 1, ..
            }) => assert_eq!((name.as_bytes(), value), (&b"user.x"[..], &b"abc"[..])),
            other => panic!("{other:?}"),
        }
        // The extended layout needs 16 bytes.
        assert!(parse(opcode::SETXATTR, &head, rest, Layout { setxattr_ext: true }).is_err());
        head.extend_from_slice(&[0; 8]);
        assert!(parse(opcode::SETXATTR, &head, rest, Layout { setxattr_ext: true }).is_ok());
    }

    #[test]
    fn batch_forget_never_reads_past_the_message() {
        let head = abi::BatchForgetIn { count: 1000, dummy: 0 };
        let one = abi::ForgetOne { nodeid: 5, nlookup: 2 };
        let v = batch_forget(head.as_bytes(), one.as_bytes()).unwrap();
        assert_eq!(v, vec![one]);
    }

    /// Every opcode, every truncation of its arguments: an error or a
    /// value, never a panic.
    #[test]
    fn truncated_requests_are_refused() {
        let big = [0x41u8; 512];
        for op in 1..=60u32 {
            let size = op_header_size(op, Layout::default());
            for cut in 0..=size {
                let _ = parse(op, &big[..cut], &big[..16], Layout::default());
            }
            for cut in 0..64 {
                let _ = parse(op, &big[..size], &big[..cut], Layout::default());
            }
        }
    }
}
