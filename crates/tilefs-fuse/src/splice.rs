//! READ replies spliced from the object file into /dev/fuse.
//!
//! A reply built with pread + write copies every byte twice: from the
//! object's page cache into our buffer, then into the FUSE file's page
//! cache. Spliced, the kernel copies the object's cached pages straight
//! into the FUSE file's pages, and our buffer is never touched.
//!
//! The reply goes through a pipe per thread: the reply header is written
//! into it, the object's bytes spliced in after it, and the whole message
//! spliced into the FUSE device in one call, as the kernel requires.
//! fuser cannot send such a reply, so it is written on our own descriptor
//! of the session's device; that is only valid when every worker reads
//! that same device (no cloned descriptors), which the caller ensures.

use std::cell::RefCell;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};

use rustix::io::Errno;
use rustix::pipe::{fcntl_setpipe_size, pipe_with, splice, PipeFlags, SpliceFlags};

/// Size of the fuse_out_header that starts every reply.
const HEADER: usize = 16;
/// Pipe size asked for: room for a 1 MiB reply would need a little more,
/// but this is what an unprivileged user may have by default
/// (/proc/sys/fs/pipe-max-size); larger replies take the copying path.
const PIPE_SIZE: usize = 1 << 20;

pub(crate) struct Splicer {
    /// The session's FUSE device (a duplicate of the descriptor the
    /// workers read requests from).
    dev: OwnedFd,
}

/// A worker thread's pipe, and how many bytes it holds.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    capacity: usize,
}

thread_local! {
    static PIPE: RefCell<Option<Pipe>> = const { RefCell::new(None) };
}

/// What became of a spliced reply.
pub(crate) enum Spliced {
    /// The kernel has the reply.
    Sent,
    /// Nothing was sent: reply the usual way (too large for the pipe, the
    /// object shorter than expected, no pipe to be had).
    NotSent,
    /// The request is gone (interrupted): there is no one to reply to.
    Gone,
    /// The kernel refused the reply: reply the usual way, and stop
    /// splicing (a refusal would not be a one-off).
    Failed(Errno),
}

impl Splicer {
    pub(crate) fn new(dev: OwnedFd) -> Splicer {
        Splicer { dev }
    }

    /// Replies to request `unique` with the `len` bytes of `file` at
    /// `offset` (which the caller knows the file holds).
    pub(crate) fn reply(&self, unique: u64, file: &File, offset: u64, len: usize) -> Spliced {
        PIPE.with(|slot| {
            let mut slot = slot.borrow_mut();
            if slot.is_none() {
                *slot = new_pipe();
            }
            let Some(pipe) = slot.as_ref() else {
                return Spliced::NotSent;
            };
            // The header takes a page of the pipe; the data one page per
            // page of the file it touches.
            let page = rustix::param::page_size();
            let pages = 1 + (offset as usize % page + len).div_ceil(page);
            if pages * page > pipe.capacity {
                return Spliced::NotSent;
            }
            let result = send(pipe, &self.dev, unique, file, offset, len);
            if !matches!(result, Spliced::Sent) {
                // Whatever is left in the pipe must not start the next reply.
                *slot = None;
            }
            result
        })
    }
}

fn new_pipe() -> Option<Pipe> {
    let (read, write) = pipe_with(PipeFlags::CLOEXEC).ok()?;
    // Refused beyond the user's pipe quota: the default size then serves
    // the smaller replies.
    let _ = fcntl_setpipe_size(&write, PIPE_SIZE);
    let capacity = rustix::pipe::fcntl_getpipe_size(&write).ok()?;
    Some(Pipe { read, write, capacity })
}

fn send(pipe: &Pipe, dev: &OwnedFd, unique: u64, file: &File, offset: u64, len: usize) -> Spliced {
    let total = HEADER + len;
    let mut header = [0u8; HEADER];
    header[0..4].copy_from_slice(&(total as u32).to_ne_bytes());
    // bytes 4..8: error 0
    header[8..16].copy_from_slice(&unique.to_ne_bytes());
    if rustix::io::write(&pipe.write, &header) != Ok(HEADER) {
        return Spliced::NotSent;
    }
    let mut off = offset;
    let mut left = len;
    while left > 0 {
        // Non-blocking: a pipe that cannot take it all must not wait for a
        // reader that is this very thread.
        match splice(
            file.as_fd(),
            Some(&mut off),
            &pipe.write,
            None,
            left,
            SpliceFlags::NONBLOCK,
        ) {
            Ok(0) | Err(_) => return Spliced::NotSent,
            Ok(n) => left -= n,
        }
    }
    match splice(&pipe.read, None, dev, None, total, SpliceFlags::empty()) {
        Ok(n) if n == total => Spliced::Sent,
        Ok(_) => Spliced::Failed(Errno::IO),
        Err(Errno::NOENT) => Spliced::Gone,
        Err(e) => Spliced::Failed(e),
    }
}
