//! What answers a request, whatever carried it (/dev/fuse, an io_uring
//! queue, a virtqueue): the [`Filesystem`] a server implements and the
//! [`Handler`] that parses each message and hands it to it.

use crate::abi::{self, opcode};
use crate::connection::Connection;
use crate::reply::{Reply, Sink};
use crate::request::{self, Layout, Op, Request};
use std::sync::Arc;
use zerocopy::FromBytes;

/// What the kernel offered in its INIT.
#[derive(Debug, Clone, Copy)]
pub struct KernelInit {
    pub minor: u32,
    /// `abi::init` flags, `flags2` shifted up by 32.
    pub flags: u64,
    pub max_readahead: u32,
}

impl KernelInit {
    pub fn offers(&self, flag: u64) -> bool {
        self.flags & flag == flag
    }
}

/// What the filesystem wants, answered to INIT. Flags the kernel did not
/// offer are dropped.
#[derive(Debug, Clone, Copy)]
pub struct InitConfig {
    pub want: u64,
    pub max_write: u32,
    pub max_readahead: u32,
    pub max_background: u16,
    pub congestion_threshold: u16,
    /// Nanoseconds: the granularity of the times we keep.
    pub time_gran: u32,
    /// Passthrough backing files may be on filesystems this deep.
    pub max_stack_depth: u32,
}

impl Default for InitConfig {
    fn default() -> InitConfig {
        InitConfig {
            want: abi::init::ASYNC_READ | abi::init::BIG_WRITES,
            max_write: 128 * 1024,
            max_readahead: u32::MAX,
            max_background: 16,
            congestion_threshold: 12,
            time_gran: 1,
            max_stack_depth: 0,
        }
    }
}

/// A filesystem served over FUSE. Requests may arrive on several threads
/// at once.
pub trait Filesystem: Send + Sync + 'static {
    /// Chooses the connection's settings from what the kernel offers.
    /// `conn` stays valid for the whole session (keep it for passthrough
    /// and notifications).
    fn init(&self, kernel: &KernelInit, conn: &Arc<Connection>) -> InitConfig;

    /// Answers one request (every opcode but INIT, FORGET, BATCH_FORGET,
    /// INTERRUPT and DESTROY).
    fn handle(&self, req: &Request, op: Op<'_>, reply: Reply<'_>);

    /// The kernel dropped `nlookup` references to `nodeid`.
    fn forget(&self, nodeid: u64, nlookup: u64) {
        let _ = (nodeid, nlookup);
    }

    /// The connection is gone.
    fn destroy(&self) {}
}

/// What the INIT exchange settled, whatever carried it.
#[derive(Debug, Clone, Copy)]
pub struct Agreed {
    pub layout: Layout,
    /// The kernel agreed to FUSE over io_uring.
    pub uring: bool,
    /// Largest request payload (written data): sizes the buffers.
    pub max_write: usize,
}

/// Answers requests of a negotiated connection, one message at a time,
/// whatever carries them: /dev/fuse, io_uring or a virtqueue.
pub struct Handler<F: Filesystem> {
    fs: Arc<F>,
    layout: Layout,
}

impl<F: Filesystem> Handler<F> {
    pub fn new(fs: Arc<F>, agreed: &Agreed) -> Handler<F> {
        Handler {
            fs,
            layout: agreed.layout,
        }
    }

    /// Answers the request `msg` (header and body, as the kernel sent it)
    /// into `sink`. Returns false for a request that takes no reply (and
    /// for a malformed message, which is dropped).
    pub fn handle(&self, msg: &[u8], sink: &mut dyn Sink) -> bool {
        let Some((h, body)) = split_header(msg) else {
            return false;
        };
        let split = request::op_header_size(h.opcode, self.layout).min(body.len());
        let (head, rest) = body.split_at(split);
        self.handle_parts(&h, head, rest, sink)
    }

    /// [`Handler::handle`] for a transport that carries a request in
    /// parts: its header, the opcode's fixed structure (`head`, of
    /// [`Handler::head_size`] bytes) and what follows it (`rest`).
    pub fn handle_parts(&self, h: &abi::InHeader, head: &[u8], rest: &[u8], sink: &mut dyn Sink) -> bool {
        dispatch(&*self.fs, self.layout, h, head, rest, sink)
    }

    /// The size of `opcode`'s fixed structure on this connection.
    pub fn head_size(&self, opcode: u32) -> usize {
        request::op_header_size(opcode, self.layout)
    }

    pub fn filesystem(&self) -> &Arc<F> {
        &self.fs
    }
}

/// Splits a message read from the device into its header and body (the
/// extensions at its end left out). None if it is malformed.
pub(crate) fn split_header(msg: &[u8]) -> Option<(abi::InHeader, &[u8])> {
    let (h, _) = abi::InHeader::read_from_prefix(msg).ok()?;
    let len = (h.len as usize).min(msg.len());
    let body = msg.get(core::mem::size_of::<abi::InHeader>()..len)?;
    let ext = usize::from(h.total_extlen) * 8;
    Some((h, &body[..body.len().saturating_sub(ext)]))
}

/// Handles one request: `head` holds the opcode's fixed structure, `rest`
/// what follows. Returns false for requests that get no reply.
fn dispatch<F: Filesystem>(
    fs: &F,
    layout: Layout,
    h: &abi::InHeader,
    head: &[u8],
    rest: &[u8],
    sink: &mut dyn Sink,
) -> bool {
    let _timer = stats::Timer::start(h.opcode);
    crate::poll::request();
    match h.opcode {
        opcode::FORGET => {
            if let Ok(n) = request::forget(head) {
                fs.forget(h.nodeid, n);
            }
            false
        }
        opcode::BATCH_FORGET => {
            if let Ok(v) = request::batch_forget(head, rest) {
                for f in v {
                    fs.forget(f.nodeid, f.nlookup);
                }
            }
            false
        }
        // Requests finish quickly or not at all; nothing to interrupt.
        opcode::INTERRUPT | opcode::NOTIFY_REPLY => false,
        opcode::INIT => {
            let _ = sink.send(h.unique, -libc::EIO, &[]);
            true
        }
        opcode::DESTROY => {
            let _ = sink.send(h.unique, 0, &[]);
            true
        }
        op => {
            let req = Request::from_header(h);
            match request::parse(op, head, rest, layout) {
                Ok(Op::Other(_)) => {
                    let _ = sink.send(h.unique, -libc::ENOSYS, &[]);
                }
                Ok(parsed) => fs.handle(&req, parsed, Reply::new(h.unique, sink)),
                Err(_) => {
                    let _ = sink.send(h.unique, -libc::EINVAL, &[]);
                }
            }
            true
        }
    }
}

/// Requests counted per opcode, with the time spent answering them, when
/// `TILEFS_FUSE_STATS` is set in the server's environment (for profiling):
/// written to the server's log when the session ends.
pub(crate) mod stats {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::Instant;

    const N: usize = 64;
    static COUNT: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
    static NANOS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];

    fn on() -> bool {
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| std::env::var_os("TILEFS_FUSE_STATS").is_some())
    }

    pub(crate) struct Timer(Option<(usize, Instant)>);

    impl Timer {
        pub(crate) fn start(opcode: u32) -> Timer {
            let i = (opcode as usize).min(N - 1);
            Timer(on().then(|| (i, Instant::now())))
        }
    }

    impl Drop for Timer {
        fn drop(&mut self) {
            if let Some((i, t)) = self.0 {
                COUNT[i].fetch_add(1, Ordering::Relaxed);
                NANOS[i].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        }
    }

    pub(crate) fn report() {
        if !on() {
            return;
        }
        let mut line = String::from("requests (opcode: count, ms):");
        for i in 0..N {
            let c = COUNT[i].load(Ordering::Relaxed);
            if c > 0 {
                let ms = NANOS[i].load(Ordering::Relaxed) / 1_000_000;
                line.push_str(&format!(" {i}: {c} {ms};"));
            }
        }
        tracing::info!("{line}");
    }
}
