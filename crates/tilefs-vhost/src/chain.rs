//! One virtio-fs request: a descriptor chain gathered from guest memory
//! (the FUSE request in its device-readable buffers, room for the reply in
//! its device-writable ones), and the [`Sink`] that writes the reply back.
//!
//! Everything here distrusts the guest: each buffer is checked to lie
//! wholly in guest memory before a byte is read or written, readable
//! buffers after writable ones are refused, and lengths are capped, so a
//! bad chain costs an error reply (or, when not even the request's header
//! can be read, an empty one), never a panic or a read outside the guest.

use std::io;
use std::os::fd::BorrowedFd;
use tilefs_fuse_proto::{abi, Sink};
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};
use zerocopy::{FromBytes, IntoBytes};

/// Largest request read from the guest: a WRITE of 1 MiB (256 pages,
/// FUSE's most) with its headers, and room to spare.
pub const MAX_REQUEST: usize = (1 << 20) + 64 * 1024;

/// Largest reply written to the guest: a READ of 1 MiB and its header.
pub const MAX_REPLY: usize = (1 << 20) + 4096;

/// Why a chain is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A device-readable buffer after a device-writable one.
    Order,
    /// A buffer not wholly in guest memory.
    OutsideMemory,
    /// More to read than any request needs.
    TooLong,
}

/// A request gathered from a descriptor chain.
#[derive(Debug, Default)]
pub struct Chain {
    /// The device-readable bytes, in order: the FUSE request.
    pub msg: Vec<u8>,
    /// The device-writable buffers (each wholly in guest memory), up to
    /// [`MAX_REPLY`] bytes of them.
    pub out: Vec<(GuestAddress, usize)>,
    /// What was wrong with the chain, if anything.
    pub fault: Option<Fault>,
}

impl Chain {
    /// Room for the reply.
    pub fn capacity(&self) -> usize {
        self.out.iter().map(|&(_, l)| l).sum()
    }

    /// Gathers the buffers `descs` (address, length, device-writable) of a
    /// chain into `self` (cleared first; its allocations reused).
    pub fn gather<M: GuestMemory>(&mut self, mem: &M, descs: impl IntoIterator<Item = (GuestAddress, u32, bool)>) {
        self.msg.clear();
        self.out.clear();
        self.fault = None;
        let mut cap = 0usize;
        let mut writing = false;
        for (addr, len, writable) in descs {
            let len = len as usize;
            let access = if writable {
                Permissions::Write
            } else {
                Permissions::Read
            };
            if !mem.check_range(addr, len, access) {
                self.fault.get_or_insert(Fault::OutsideMemory);
                // Nothing after a bad buffer is trusted to be in order.
                break;
            }
            if writable {
                writing = true;
                // Room past what any reply needs is left unused.
                let take = len.min(MAX_REPLY - cap);
                if take > 0 {
                    self.out.push((addr, take));
                    cap += take;
                }
            } else if writing {
                self.fault.get_or_insert(Fault::Order);
                break;
            } else if self.fault.is_none() {
                if self.msg.len() + len > MAX_REQUEST {
                    self.fault = Some(Fault::TooLong);
                    continue;
                }
                let start = self.msg.len();
                self.msg.resize(start + len, 0);
                if mem.read_slice(&mut self.msg[start..], addr).is_err() {
                    self.msg.truncate(start);
                    self.fault = Some(Fault::OutsideMemory);
                }
            }
        }
    }

    /// The request's header, if the chain holds one.
    pub fn header(&self) -> Option<abi::InHeader> {
        abi::InHeader::read_from_prefix(&self.msg).ok().map(|(h, _)| h)
    }
}

/// Writes one reply into a chain's writable buffers.
pub struct GuestSink<'a, M: GuestMemory> {
    mem: &'a M,
    out: &'a [(GuestAddress, usize)],
    cap: usize,
    /// Bytes written (the used length to report).
    pub written: u32,
    /// A reading buffer for file data.
    buf: &'a mut Vec<u8>,
}

const OUT_HEADER: usize = core::mem::size_of::<abi::OutHeader>();

impl<'a, M: GuestMemory> GuestSink<'a, M> {
    pub fn new(mem: &'a M, chain: &'a Chain, buf: &'a mut Vec<u8>) -> GuestSink<'a, M> {
        GuestSink {
            mem,
            out: &chain.out,
            cap: chain.capacity(),
            written: 0,
            buf,
        }
    }

    /// Writes `parts` one after another across the writable buffers.
    fn write_parts(&mut self, parts: &[&[u8]]) -> io::Result<()> {
        let (mut seg, mut at) = (0usize, 0usize);
        for part in parts {
            let mut part = *part;
            while !part.is_empty() {
                let Some(&(addr, len)) = self.out.get(seg) else {
                    return Err(io::Error::from_raw_os_error(libc::EOVERFLOW));
                };
                let n = part.len().min(len - at);
                let dst = addr
                    .0
                    .checked_add(at as u64)
                    .ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))?;
                self.mem
                    .write_slice(&part[..n], GuestAddress(dst))
                    .map_err(|_| io::Error::from_raw_os_error(libc::EFAULT))?;
                self.written += n as u32;
                part = &part[n..];
                at += n;
                if at == len {
                    seg += 1;
                    at = 0;
                }
            }
        }
        Ok(())
    }
}

impl<M: GuestMemory> Sink for GuestSink<'_, M> {
    fn send(&mut self, unique: u64, error: i32, parts: &[&[u8]]) -> io::Result<()> {
        if self.written > 0 {
            // One reply per request.
            return Err(io::Error::from_raw_os_error(libc::EALREADY));
        }
        let parts = if error == 0 { parts } else { &[] };
        let total = OUT_HEADER + parts.iter().map(|p| p.len()).sum::<usize>();
        if total > self.cap {
            // The guest left too little room: it hears EIO, if even that fits.
            if self.cap >= OUT_HEADER {
                let h = abi::OutHeader {
                    len: OUT_HEADER as u32,
                    error: -libc::EIO,
                    unique,
                };
                self.write_parts(&[h.as_bytes()])?;
            }
            return Err(io::Error::from_raw_os_error(libc::EOVERFLOW));
        }
        let h = abi::OutHeader {
            len: total as u32,
            error,
            unique,
        };
        let mut all: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
        all.push(h.as_bytes());
        all.extend_from_slice(parts);
        self.write_parts(&all)
    }

    fn send_file(&mut self, unique: u64, file: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<()> {
        // No more than the guest has room for.
        let len = len.min(self.cap.saturating_sub(OUT_HEADER));
        if self.buf.len() < len {
            self.buf.resize(len, 0);
        }
        let mut buf = std::mem::take(self.buf);
        let r = read_full(file, offset, &mut buf[..len]);
        let r = r.and_then(|n| self.send(unique, 0, &[&buf[..n]]));
        *self.buf = buf;
        r
    }
}

/// A sink that drops what it is sent (for an INIT answered outside a queue).
pub struct DiscardSink;

impl Sink for DiscardSink {
    fn send(&mut self, _unique: u64, _error: i32, _parts: &[&[u8]]) -> io::Result<()> {
        Ok(())
    }

    fn send_file(&mut self, _unique: u64, _file: BorrowedFd<'_>, _offset: u64, _len: usize) -> io::Result<()> {
        Ok(())
    }
}

/// Reads up to `buf.len()` bytes of `file` at `offset`, fewer only at its end.
fn read_full(file: BorrowedFd<'_>, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
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
