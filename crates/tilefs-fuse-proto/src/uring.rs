//! FUSE over io_uring (Linux 6.14+, fuse module parameter `enable_uring`).
//!
//! The kernel keeps one queue per possible CPU and hands a request to the
//! queue of the CPU its caller runs on. We run one thread per queue, pinned
//! to that CPU, with an io_uring of its own: it registers ring entries (a
//! header buffer and a payload buffer each), and for each request the
//! kernel fills one and completes its command; we answer in the same
//! buffers and commit, which also fetches the next request. Request and
//! reply never leave the caller's CPU, so a lookup costs no cross-CPU
//! wake-up, which is what a /dev/fuse round trip pays.

use crate::abi;
use crate::handler::{Filesystem, Handler};
use crate::reply::{read_full, Sink};
use io_uring::{cqueue, squeue, types, IoUring};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;
use zerocopy::{FromBytes, IntoBytes};

/// The running queues.
pub(crate) struct Queues {
    threads: Vec<JoinHandle<()>>,
}

impl Queues {
    pub(crate) fn len(&self) -> usize {
        self.threads.len()
    }

    pub(crate) fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// The CPUs the kernel may run a caller on (one queue each).
fn possible_cpus() -> usize {
    // "0-3" or "0,2-5": the highest number plus one.
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| {
            s.trim()
                .split([',', '-'])
                .filter_map(|n| n.parse::<usize>().ok())
                .max()
                .map(|m| m + 1)
        })
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Starts a queue thread per possible CPU; returns once every queue has
/// registered its entries (the kernel then routes requests to them), or
/// the first error.
pub(crate) fn start<F: Filesystem>(
    handler: Arc<Handler<F>>,
    fd: Arc<OwnedFd>,
    payload: usize,
    depth: u16,
    stop: Arc<AtomicBool>,
) -> io::Result<Queues> {
    let n = possible_cpus();
    let (tx, rx) = mpsc::channel::<io::Result<()>>();
    let mut threads = Vec::new();
    for qid in 0..n {
        let (handler, fd, stop, tx) = (handler.clone(), fd.clone(), stop.clone(), tx.clone());
        threads.push(
            std::thread::Builder::new()
                .name(format!("fuse-q{qid}"))
                .spawn(move || {
                    let mut q = match Queue::new(qid as u16, fd, payload, depth.max(1)) {
                        Ok(q) => q,
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = tx.send(Ok(()));
                    drop(tx);
                    if let Err(e) = q.serve(&handler, &stop) {
                        tracing::warn!("io_uring queue {qid} stopped: {e}");
                    }
                })?,
        );
    }
    drop(tx);
    for _ in 0..n {
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                // The queues that did register are ended with the
                // connection; they do not serve before all are ready.
                stop.store(true, Ordering::Relaxed);
                return Err(e);
            }
            Err(_) => return Err(io::Error::other("an io_uring queue thread failed to start")),
        }
    }
    Ok(Queues { threads })
}

/// One ring entry's buffers. Boxed, so their addresses stay put while the
/// kernel holds them.
struct Ent {
    header: abi::UringReqHeader,
    payload: Vec<u8>,
    iov: [libc::iovec; 2],
}

struct Queue {
    qid: u16,
    fd: Arc<OwnedFd>,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    // Boxed: the kernel holds pointers into each entry, which must not
    // move when the vector grows.
    #[allow(clippy::vec_box)]
    ents: Vec<Box<Ent>>,
    /// Entries the kernel still holds a command of.
    live: usize,
}

/// The command area of a FUSE ring submission.
fn cmd_area(qid: u16, commit_id: u64) -> [u8; 80] {
    let req = abi::UringCmdReq {
        flags: 0,
        commit_id,
        qid,
        padding: [0; 6],
    };
    let mut cmd = [0u8; 80];
    cmd[..core::mem::size_of::<abi::UringCmdReq>()].copy_from_slice(req.as_bytes());
    cmd
}

/// Sets the `len` field of a 128-byte submission, which the io-uring
/// crate's URING_CMD builder leaves 0 and FUSE's REGISTER requires to be
/// the number of iovecs (2).
fn with_len(sqe: squeue::Entry128, len: u32) -> squeue::Entry128 {
    // SAFETY: Entry128 is repr(C): the 64-byte io_uring_sqe followed by the
    // 64 bytes of command; every bit pattern is a valid value of both
    // types. `len` is the u32 at byte 24 of io_uring_sqe (tested below
    // against rustix's declaration of the kernel structure).
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
    raw[SQE_LEN_OFFSET..SQE_LEN_OFFSET + 4].copy_from_slice(&len.to_ne_bytes());
    // SAFETY: as above.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

const SQE_LEN_OFFSET: usize = 24;

impl Queue {
    fn new(qid: u16, fd: Arc<OwnedFd>, payload: usize, depth: u16) -> io::Result<Queue> {
        // Pinned to its CPU, so the kernel's wake-up of this thread for a
        // request from that CPU stays there.
        let mut set = rustix::thread::CpuSet::new();
        set.set(usize::from(qid));
        let _ = rustix::thread::sched_setaffinity(None, &set);
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(u32::from(depth).next_power_of_two())?;
        let mut q = Queue {
            qid,
            fd,
            ring,
            ents: Vec::new(),
            live: 0,
        };
        for i in 0..usize::from(depth) {
            let mut e = Box::new(Ent {
                header: abi::UringReqHeader {
                    in_out: [0; abi::URING_IN_OUT_HEADER_SZ],
                    op_in: [0; abi::URING_OP_IN_OUT_SZ],
                    ring_ent_in_out: abi::UringEntInOut::default(),
                },
                payload: vec![0u8; payload],
                iov: [libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                }; 2],
            });
            e.iov[0] = libc::iovec {
                iov_base: (&mut e.header as *mut abi::UringReqHeader).cast(),
                iov_len: core::mem::size_of::<abi::UringReqHeader>(),
            };
            e.iov[1] = libc::iovec {
                iov_base: e.payload.as_mut_ptr().cast(),
                iov_len: e.payload.len(),
            };
            let sqe = io_uring::opcode::UringCmd80::new(types::Fd(q.fd.as_raw_fd()), abi::URING_CMD_REGISTER)
                .cmd(cmd_area(qid, 0))
                .addr(Some(e.iov.as_ptr() as u64))
                .build()
                .user_data(i as u64);
            q.ents.push(e);
            q.push(with_len(sqe, 2))?;
        }
        // The kernel registers each entry when it takes the submission;
        // a refusal completes it at once with an error.
        q.ring.submit()?;
        q.live = q.ents.len();
        let refused = q.ring.completion().next().map(|c| c.result());
        match refused {
            Some(r) if r < 0 => Err(io::Error::from_raw_os_error(-r)),
            _ => Ok(q),
        }
    }

    fn push(&mut self, sqe: squeue::Entry128) -> io::Result<()> {
        loop {
            // SAFETY: the entry's buffers (and the iovec array, read at
            // submission) live in `self.ents` for as long as the ring.
            if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
                return Ok(());
            }
            self.ring.submit()?;
        }
    }

    fn serve<F: Filesystem>(&mut self, handler: &Handler<F>, stop: &AtomicBool) -> io::Result<()> {
        let timeout = types::Timespec::from(Duration::from_millis(500));
        let args = types::SubmitArgs::new().timespec(&timeout);
        let mut done = Vec::new();
        while self.live > 0 {
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                    ) => {}
                Err(e) => return Err(e),
            }
            done.clear();
            done.extend(self.ring.completion().map(|c| (c.user_data() as usize, c.result())));
            if done.is_empty() && stop.load(Ordering::Relaxed) {
                // The connection is gone and the kernel returned nothing:
                // it ends the commands with the ring.
                return Ok(());
            }
            for &(i, res) in &done {
                if res < 0 {
                    // ENOTCONN/ECANCELED: the connection ended.
                    self.live -= 1;
                    continue;
                }
                let commit = self.answer(handler, i);
                let sqe =
                    io_uring::opcode::UringCmd80::new(types::Fd(self.fd.as_raw_fd()), abi::URING_CMD_COMMIT_AND_FETCH)
                        .cmd(cmd_area(self.qid, commit))
                        .build()
                        .user_data(i as u64);
                self.push(sqe)?;
            }
        }
        Ok(())
    }

    /// Answers the request in entry `i`; returns its commit id.
    fn answer<F: Filesystem>(&mut self, handler: &Handler<F>, i: usize) -> u64 {
        let Ent { header, payload, .. } = &mut *self.ents[i];
        let commit = header.ring_ent_in_out.commit_id;
        let h = abi::InHeader::read_from_prefix(&header.in_out[..])
            .map(|(h, _)| h)
            .unwrap_or_default();
        let size = (header.ring_ent_in_out.payload_sz as usize).min(payload.len());
        let head_len = handler.head_size(h.opcode).min(abi::URING_OP_IN_OUT_SZ);
        let head = header.op_in;
        let mut sink = EntSink {
            header,
            payload: None,
            staged: Vec::new(),
            replied: false,
        };
        if size <= SMALL {
            // Names and such: copied out, so that the reply can be written
            // straight into the payload buffer (a READ's data included).
            let mut rest = [0u8; SMALL];
            rest[..size].copy_from_slice(&payload[..size]);
            sink.payload = Some(payload);
            handler.handle_parts(&h, &head[..head_len], &rest[..size], &mut sink);
        } else {
            // Written data: read in place; the (small) reply is staged and
            // copied in after.
            handler.handle_parts(&h, &head[..head_len], &payload[..size], &mut sink);
            let staged = std::mem::take(&mut sink.staged);
            payload[..staged.len()].copy_from_slice(&staged);
        }
        if !sink.replied {
            // Nothing to say (a request that takes no reply, which the
            // kernel sends over /dev/fuse): the entry must still go back.
            sink.header(h.unique, -libc::ENOSYS, 0);
        }
        commit
    }
}

/// Requests whose variable part is at most this are copied out of the
/// entry before they are answered.
const SMALL: usize = 4096;

/// Replies written into a ring entry's buffers.
struct EntSink<'a> {
    header: &'a mut abi::UringReqHeader,
    /// The payload buffer, when the request does not borrow it; otherwise
    /// the reply is staged.
    payload: Option<&'a mut Vec<u8>>,
    staged: Vec<u8>,
    replied: bool,
}

impl EntSink<'_> {
    fn header(&mut self, unique: u64, error: i32, payload: usize) {
        let out = abi::OutHeader {
            len: (core::mem::size_of::<abi::OutHeader>() + payload) as u32,
            error,
            unique,
        };
        self.header.in_out[..16].copy_from_slice(out.as_bytes());
        self.header.ring_ent_in_out.payload_sz = payload as u32;
        self.replied = true;
    }
}

impl Sink for EntSink<'_> {
    fn send(&mut self, unique: u64, error: i32, parts: &[&[u8]]) -> io::Result<()> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        match self.payload.as_deref_mut() {
            Some(buf) if total <= buf.len() => {
                let mut at = 0;
                for p in parts {
                    buf[at..at + p.len()].copy_from_slice(p);
                    at += p.len();
                }
            }
            None if total <= SMALL => {
                self.staged.clear();
                for p in parts {
                    self.staged.extend_from_slice(p);
                }
            }
            _ => {
                self.header(unique, -libc::EIO, 0);
                return Err(io::Error::other("reply larger than the ring's payload buffer"));
            }
        }
        self.header(unique, error, total);
        Ok(())
    }

    fn send_file(&mut self, unique: u64, file: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<()> {
        let Some(buf) = self.payload.as_deref_mut() else {
            return Err(io::Error::other("a file reply to a request carrying data"));
        };
        let len = len.min(buf.len());
        let n = read_full(file, offset, &mut buf[..len])?;
        self.header(unique, 0, n);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqe_len_offset_matches_the_kernel_structure() {
        assert_eq!(
            core::mem::offset_of!(rustix::io_uring::io_uring_sqe, len),
            SQE_LEN_OFFSET
        );
        let sqe = io_uring::opcode::UringCmd80::new(types::Fd(7), 1)
            .addr(Some(0x1234))
            .build();
        // SAFETY: Entry128 is 128 bytes of plain data (see with_len).
        let raw: [u8; 128] = unsafe { std::mem::transmute(with_len(sqe, 2)) };
        assert_eq!(&raw[24..28], &2u32.to_ne_bytes());
        assert_eq!(&raw[16..24], &0x1234u64.to_ne_bytes());
        assert_eq!(&raw[4..8], &7i32.to_ne_bytes());
    }
}
