//! The /dev/fuse transport: each worker reads requests from its own
//! descriptor of the connection (cloned with FUSE_DEV_IOC_CLONE where it
//! may be) and writes replies on that same descriptor, so that replies
//! spliced from a file go back where their request came from.

use crate::abi;
use crate::reply::{read_full, Sink};
use rustix::io::Errno;
use rustix::pipe::{fcntl_getpipe_size, fcntl_setpipe_size, pipe_with, splice, PipeFlags, SpliceFlags};
use std::cell::RefCell;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use zerocopy::IntoBytes;

/// A new descriptor of the connection `fd` belongs to, or None if the
/// device cannot be opened (an unprivileged user when /dev/fuse is 0600:
/// the workers then share one descriptor).
pub(crate) fn clone_fd(fd: BorrowedFd<'_>) -> Option<OwnedFd> {
    let new = rustix::fs::open(
        "/dev/fuse",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .ok()?;
    tilefs_sys::fuse_dev::clone_device(new.as_fd(), fd).ok()?;
    Some(new)
}

/// Reads one request into `buf`; returns its length. `Ok(None)` when the
/// connection is gone (unmounted or aborted).
pub(crate) fn read_request(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        match rustix::io::read(fd, &mut *buf) {
            Ok(n) => return Ok(Some(n)),
            // Interrupted before we read it, or a signal: read the next.
            Err(Errno::NOENT) | Err(Errno::INTR) | Err(Errno::AGAIN) => {}
            Err(Errno::NODEV) | Err(Errno::CONNABORTED) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Writes a whole message (header and parts) in one writev.
pub(crate) fn write_message(fd: BorrowedFd<'_>, unique: u64, error: i32, parts: &[&[u8]]) -> io::Result<()> {
    let len = core::mem::size_of::<abi::OutHeader>() + parts.iter().map(|p| p.len()).sum::<usize>();
    let header = abi::OutHeader {
        len: len as u32,
        error,
        unique,
    };
    let mut iov = Vec::with_capacity(parts.len() + 1);
    iov.push(IoSlice::new(header.as_bytes()));
    iov.extend(parts.iter().filter(|p| !p.is_empty()).map(|p| IoSlice::new(p)));
    loop {
        match rustix::io::writev(fd, &iov) {
            Ok(n) if n == len => return Ok(()),
            Ok(_) => return Err(io::Error::other("short write to /dev/fuse")),
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Replies of one worker thread, written to its descriptor.
pub(crate) struct DevSink<'a> {
    pub(crate) fd: BorrowedFd<'a>,
    /// Splice READ replies from files (off after the kernel refused one).
    pub(crate) splice: &'a AtomicBool,
}

impl Sink for DevSink<'_> {
    fn send(&mut self, unique: u64, error: i32, parts: &[&[u8]]) -> io::Result<()> {
        write_message(self.fd, unique, error, parts)
    }

    fn send_file(&mut self, unique: u64, file: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<()> {
        if len > 0 && self.splice.load(Ordering::Relaxed) {
            match splice_reply(self.fd, unique, file, offset, len) {
                Spliced::Sent => return Ok(()),
                Spliced::Gone => return Err(io::Error::from_raw_os_error(libc::ENOENT)),
                Spliced::NotSent => {}
                Spliced::Refused => self.splice.store(false, Ordering::Relaxed),
            }
        }
        READ_BUF.with(|b| {
            let mut b = b.borrow_mut();
            if b.len() < len {
                b.resize(len, 0);
            }
            let n = read_full(file, offset, &mut b[..len])?;
            write_message(self.fd, unique, 0, &[&b[..n]])
        })
    }
}

thread_local! {
    static READ_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static PIPE: RefCell<Option<Pipe>> = const { RefCell::new(None) };
}

// Spliced READ replies.
//
// A reply built with pread + write copies every byte twice: from the file's
// page cache into our buffer, then into the FUSE file's page cache. Spliced,
// the kernel copies the file's cached pages straight into the FUSE file's,
// and no buffer of ours is touched. The reply goes through a pipe per
// thread: the header is written into it, the file's bytes spliced in after
// it, and the whole message spliced into the device in one call, as the
// kernel requires.

/// Pipe size asked for: what an unprivileged user may have by default
/// (/proc/sys/fs/pipe-max-size); larger replies take the copying path.
const PIPE_SIZE: usize = 1 << 20;

struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    capacity: usize,
}

enum Spliced {
    /// The kernel has the reply.
    Sent,
    /// Nothing was sent: reply the usual way (too large for the pipe, the
    /// file shorter than expected, no pipe to be had).
    NotSent,
    /// The request is gone (interrupted).
    Gone,
    /// The kernel refused the reply: stop splicing.
    Refused,
}

fn new_pipe() -> Option<Pipe> {
    let (read, write) = pipe_with(PipeFlags::CLOEXEC).ok()?;
    // Refused beyond the user's pipe quota: the default size then serves
    // the smaller replies.
    let _ = fcntl_setpipe_size(&write, PIPE_SIZE);
    let capacity = fcntl_getpipe_size(&write).ok()?;
    Some(Pipe { read, write, capacity })
}

fn splice_reply(dev: BorrowedFd<'_>, unique: u64, file: BorrowedFd<'_>, offset: u64, len: usize) -> Spliced {
    PIPE.with(|slot| {
        let mut slot = slot.borrow_mut();
        if slot.is_none() {
            *slot = new_pipe();
        }
        let Some(pipe) = slot.as_ref() else {
            return Spliced::NotSent;
        };
        // The header takes a page of the pipe; the data one page per page
        // of the file it touches.
        let page = rustix::param::page_size();
        let pages = 1 + (offset as usize % page + len).div_ceil(page);
        if pages * page > pipe.capacity {
            return Spliced::NotSent;
        }
        let result = splice_through(pipe, dev, unique, file, offset, len);
        if !matches!(result, Spliced::Sent) {
            // Whatever is left in the pipe must not start the next reply.
            *slot = None;
        }
        result
    })
}

fn splice_through(
    pipe: &Pipe,
    dev: BorrowedFd<'_>,
    unique: u64,
    file: BorrowedFd<'_>,
    offset: u64,
    len: usize,
) -> Spliced {
    let total = core::mem::size_of::<abi::OutHeader>() + len;
    let header = abi::OutHeader {
        len: total as u32,
        error: 0,
        unique,
    };
    if rustix::io::write(&pipe.write, header.as_bytes()) != Ok(header.as_bytes().len()) {
        return Spliced::NotSent;
    }
    let mut off = offset;
    let mut left = len;
    while left > 0 {
        // Non-blocking: a pipe that cannot take it all must not wait for a
        // reader that is this very thread.
        match splice(file, Some(&mut off), &pipe.write, None, left, SpliceFlags::NONBLOCK) {
            Ok(0) | Err(_) => return Spliced::NotSent,
            Ok(n) => left -= n,
        }
    }
    match splice(&pipe.read, None, dev.as_fd(), None, total, SpliceFlags::empty()) {
        Ok(n) if n == total => Spliced::Sent,
        Ok(_) => Spliced::Refused,
        Err(Errno::NOENT) => Spliced::Gone,
        Err(_) => Spliced::Refused,
    }
}
