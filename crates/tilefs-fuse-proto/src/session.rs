//! A FUSE connection: the INIT handshake, then serving requests with a
//! pool of /dev/fuse readers or, where the kernel offers it, per-CPU
//! io_uring queues, until the filesystem is unmounted.

use crate::abi::{self, opcode};
use crate::dev::{self, DevSink};
use crate::readers::Readers;
use crate::reply::{Reply, Sink};
use crate::request::{self, Layout, Op, Request};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use zerocopy::{FromBytes, IntoBytes};

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

/// How requests are read.
#[derive(Debug, Clone, Copy)]
pub struct ServeConfig {
    /// /dev/fuse reader threads (when io_uring is not used).
    pub threads: usize,
    /// Use FUSE over io_uring when the kernel offers it.
    pub uring: bool,
    /// Ring entries per queue.
    pub uring_depth: u16,
    /// Splice READ replies from files (the /dev/fuse transport).
    pub splice: bool,
    /// Keep idle CPUs polling, not halting, while requests flow (root
    /// only; see [`crate::idle_poll_worth_it`]).
    pub idle_poll: bool,
}

impl Default for ServeConfig {
    fn default() -> ServeConfig {
        ServeConfig {
            threads: 2,
            uring: true,
            uring_depth: 8,
            splice: true,
            idle_poll: false,
        }
    }
}

/// The connection, as the filesystem sees it: passthrough backing files
/// and notifications to the kernel. A transport other than /dev/fuse (a
/// virtqueue) has neither: backing files are refused and notifications
/// dropped there.
pub struct Connection {
    fd: Option<Arc<OwnedFd>>,
    notify: Mutex<Option<mpsc::Sender<Notice>>>,
}

enum Notice {
    InvalEntry(u64, Vec<u8>),
    InvalInode(u64, i64, i64),
    Delete(u64, u64, Vec<u8>),
}

/// A file the kernel reads and writes itself for opens answered with
/// FOPEN_PASSTHROUGH; unregistered when dropped.
pub struct BackingId {
    id: i32,
    fd: Arc<OwnedFd>,
}

impl BackingId {
    pub fn id(&self) -> i32 {
        self.id
    }
}

impl Drop for BackingId {
    fn drop(&mut self) {
        tilefs_sys::fuse_dev::backing_close(self.fd.as_fd(), self.id);
    }
}

impl Connection {
    /// The connection of a /dev/fuse descriptor.
    pub fn of_device(fd: Arc<OwnedFd>) -> Arc<Connection> {
        Arc::new(Connection {
            fd: Some(fd),
            notify: Mutex::new(None),
        })
    }

    /// A connection without a /dev/fuse descriptor (requests carried some
    /// other way): no passthrough, no notifications.
    pub fn without_device() -> Arc<Connection> {
        Arc::new(Connection {
            fd: None,
            notify: Mutex::new(None),
        })
    }

    /// Registers `file` as a backing file (needs CAP_SYS_ADMIN and
    /// FUSE_PASSTHROUGH).
    pub fn open_backing(&self, file: BorrowedFd<'_>) -> io::Result<BackingId> {
        let Some(dev) = &self.fd else {
            return Err(io::Error::from(io::ErrorKind::Unsupported));
        };
        let r = tilefs_sys::fuse_dev::backing_open(dev.as_fd(), file)?;
        Ok(BackingId { id: r, fd: dev.clone() })
    }

    fn queue(&self, n: Notice) {
        let Some(dev) = &self.fd else { return };
        let mut guard = self.notify.lock().unwrap();
        if guard.is_none() {
            // Notifications are written by a thread of their own: the
            // kernel may need locks that a request being answered holds.
            let (tx, rx) = mpsc::channel::<Notice>();
            let fd = dev.clone();
            let spawned = std::thread::Builder::new().name("fuse-notify".into()).spawn(move || {
                for n in rx {
                    if let Err(e) = send_notice(fd.as_fd(), &n) {
                        // ENOENT: nothing cached to invalidate.
                        if e.raw_os_error() != Some(libc::ENOENT) {
                            tracing::warn!("notifying the kernel failed: {e}");
                        }
                    }
                }
            });
            if spawned.is_err() {
                return;
            }
            *guard = Some(tx);
        }
        if let Some(tx) = guard.as_ref() {
            let _ = tx.send(n);
        }
    }

    /// Drops the kernel's cached entry `name` of directory `parent`.
    pub fn inval_entry(&self, parent: u64, name: &[u8]) {
        self.queue(Notice::InvalEntry(parent, name.to_vec()))
    }

    /// Drops the kernel's cached attributes of `ino`, and its cached data
    /// from `off` for `len` bytes (`len` 0: to the end; `off` -1: none).
    pub fn inval_inode(&self, ino: u64, off: i64, len: i64) {
        self.queue(Notice::InvalInode(ino, off, len))
    }

    /// Tells the kernel `child`, named `name` in `parent`, was deleted.
    pub fn delete(&self, parent: u64, child: u64, name: &[u8]) {
        self.queue(Notice::Delete(parent, child, name.to_vec()))
    }
}

fn send_notice(fd: BorrowedFd<'_>, n: &Notice) -> io::Result<()> {
    match n {
        Notice::InvalEntry(parent, name) => {
            let out = abi::NotifyInvalEntryOut {
                parent: *parent,
                namelen: name.len() as u32,
                flags: 0,
            };
            dev::write_message(fd, 0, abi::notify::INVAL_ENTRY, &[out.as_bytes(), name, &[0]])
        }
        Notice::InvalInode(ino, off, len) => {
            let out = abi::NotifyInvalInodeOut {
                ino: *ino,
                off: *off,
                len: *len,
            };
            dev::write_message(fd, 0, abi::notify::INVAL_INODE, &[out.as_bytes()])
        }
        Notice::Delete(parent, child, name) => {
            let out = abi::NotifyDeleteOut {
                parent: *parent,
                child: *child,
                namelen: name.len() as u32,
                padding: 0,
            };
            dev::write_message(fd, 0, abi::notify::DELETE, &[out.as_bytes(), name, &[0]])
        }
    }
}

/// An initialized connection, ready to serve.
pub struct Session<F: Filesystem> {
    fs: Arc<F>,
    dev: Arc<OwnedFd>,
    conn: Arc<Connection>,
    agreed: Agreed,
}

/// Oldest protocol spoken: 7.31 (Linux 5.9), for FUSE_MAX_PAGES,
/// FUSE_CACHE_SYMLINKS and the modern structure sizes.
const MIN_MINOR: u32 = 31;

/// What the INIT exchange settled, whatever carried it.
#[derive(Debug, Clone, Copy)]
pub struct Agreed {
    pub layout: Layout,
    /// The kernel agreed to FUSE over io_uring.
    pub uring: bool,
    /// Largest request payload (written data): sizes the buffers.
    pub max_write: usize,
}

/// The answer to one INIT request.
#[derive(Debug)]
pub enum Init {
    /// Reply `out`; requests follow as agreed.
    Agreed { out: Vec<u8>, agreed: Agreed },
    /// Reply `out` (our major version): the kernel asks again.
    AskAgain { out: Vec<u8> },
    /// Refuse it with this errno: the kernel is too old.
    Refused { errno: i32, why: String },
}

/// Answers an INIT request whose body (after the header) is `body`: `fs`
/// chooses the settings from what the kernel offers, `uring` says whether
/// to ask for FUSE over io_uring. The same for every transport.
pub fn negotiate<F: Filesystem>(fs: &F, conn: &Arc<Connection>, body: &[u8], uring: bool) -> Init {
    let mut init = abi::InitIn::default();
    let take = body.len().min(core::mem::size_of::<abi::InitIn>());
    init.as_mut_bytes()[..take].copy_from_slice(&body[..take]);
    if init.major > abi::KERNEL_VERSION {
        let out = abi::InitOut {
            major: abi::KERNEL_VERSION,
            minor: abi::KERNEL_MINOR_VERSION,
            ..Default::default()
        };
        return Init::AskAgain {
            out: out.as_bytes()[..8].to_vec(),
        };
    }
    if init.major < abi::KERNEL_VERSION || init.minor < MIN_MINOR {
        return Init::Refused {
            errno: libc::EPROTO,
            why: format!(
                "the kernel speaks FUSE {}.{}; at least 7.{MIN_MINOR} is needed",
                init.major, init.minor
            ),
        };
    }
    let mut flags = u64::from(init.flags);
    if flags & abi::init::INIT_EXT != 0 {
        flags |= u64::from(init.flags2) << 32;
    }
    let kernel = KernelInit {
        minor: init.minor,
        flags,
        max_readahead: init.max_readahead,
    };
    let mut cfg = fs.init(&kernel, conn);
    if uring {
        cfg.want |= abi::init::OVER_IO_URING;
    }
    // Extended flags need INIT_EXT; SETXATTR_EXT is always taken (its
    // layout is known).
    cfg.want |= abi::init::INIT_EXT | abi::init::SETXATTR_EXT;
    let want = cfg.want & flags;
    let max_pages = cfg.max_write.div_ceil(4096).clamp(1, 256) as u16;
    let out = abi::InitOut {
        major: abi::KERNEL_VERSION,
        minor: init.minor.min(abi::KERNEL_MINOR_VERSION),
        max_readahead: cfg.max_readahead.min(init.max_readahead),
        flags: want as u32,
        max_background: cfg.max_background,
        congestion_threshold: cfg.congestion_threshold,
        max_write: cfg.max_write,
        time_gran: cfg.time_gran,
        max_pages,
        map_alignment: 0,
        flags2: (want >> 32) as u32,
        max_stack_depth: cfg.max_stack_depth,
        request_timeout: 0,
        unused: [0; 11],
    };
    Init::Agreed {
        out: out.as_bytes().to_vec(),
        agreed: Agreed {
            layout: Layout {
                setxattr_ext: want & abi::init::SETXATTR_EXT != 0,
            },
            uring: want & abi::init::OVER_IO_URING != 0,
            max_write: (cfg.max_write as usize).max(usize::from(max_pages) * 4096),
        },
    }
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

impl<F: Filesystem> Session<F> {
    /// Answers the kernel's INIT on `fd` (a fresh connection): `fs` chooses
    /// the settings, `uring` says whether to ask for io_uring.
    pub fn new(fd: OwnedFd, fs: F, uring: bool) -> io::Result<Session<F>> {
        let dev = Arc::new(fd);
        let conn = Connection::of_device(dev.clone());
        let fs = Arc::new(fs);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let Some(n) = dev::read_request(dev.as_fd(), &mut buf)? else {
                return Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    "the connection ended before INIT",
                ));
            };
            let (h, body) = split_header(&buf[..n]).ok_or_else(|| io::Error::other("malformed request"))?;
            if h.opcode != opcode::INIT {
                dev::write_message(dev.as_fd(), h.unique, -libc::EIO, &[])?;
                continue;
            }
            match negotiate(&*fs, &conn, body, uring) {
                Init::AskAgain { out } => dev::write_message(dev.as_fd(), h.unique, 0, &[&out])?,
                Init::Refused { errno, why } => {
                    dev::write_message(dev.as_fd(), h.unique, -errno, &[])?;
                    return Err(io::Error::other(why));
                }
                Init::Agreed { out, agreed } => {
                    dev::write_message(dev.as_fd(), h.unique, 0, &[&out])?;
                    return Ok(Session { fs, dev, conn, agreed });
                }
            }
        }
    }

    pub fn connection(&self) -> &Arc<Connection> {
        &self.conn
    }

    /// The kernel agreed to FUSE over io_uring (requests then arrive on
    /// per-CPU queues once [`Session::run`] has registered them).
    pub fn uring_agreed(&self) -> bool {
        self.agreed.uring
    }

    /// The device descriptor (to duplicate, e.g. for a parent process to
    /// give up its copy).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.dev.as_fd()
    }

    /// Serves until the filesystem is unmounted (or the connection is
    /// aborted). Returns how requests were carried.
    pub fn run(self, cfg: ServeConfig) -> io::Result<Transport> {
        let stop = Arc::new(AtomicBool::new(false));
        let _idle_poll = match cfg.idle_poll.then(crate::poll::Guard::start) {
            Some(Err(e)) => {
                tracing::warn!("idle CPUs will halt between requests: /dev/cpu_dma_latency: {e}");
                None
            }
            g => g.and_then(Result::ok),
        };
        let mut queues = None;
        let handler = Arc::new(Handler::new(self.fs.clone(), &self.agreed));
        if self.agreed.uring && cfg.uring {
            match crate::uring::start(
                handler.clone(),
                self.dev.clone(),
                self.agreed.max_write + 4096,
                cfg.uring_depth,
                stop.clone(),
            ) {
                Ok(q) => queues = Some(q),
                Err(e) => tracing::warn!("FUSE over io_uring is unavailable ({e}); reading /dev/fuse instead"),
            }
        }
        let transport = if let Some(q) = &queues {
            Transport::Uring { queues: q.len() }
        } else {
            Transport::Dev {
                threads: cfg.threads.max(1),
            }
        };
        // With io_uring, /dev/fuse still carries FORGETs and INTERRUPTs.
        let readers = if queues.is_some() { 1 } else { cfg.threads.max(1) };
        let forgets_only = queues.is_some();
        let splice = Arc::new(AtomicBool::new(cfg.splice));
        let buf_size = self.agreed.max_write + 4096 + abi::MIN_READ_BUFFER;
        let pool = Readers::new(readers);
        let watchdog = if readers > 1 {
            let pool = pool.clone();
            Some(
                std::thread::Builder::new()
                    .name("fuse-watchdog".into())
                    .spawn(move || pool.watchdog())?,
            )
        } else {
            None
        };
        let mut workers = Vec::new();
        for i in 1..readers {
            let fd = dev::clone_fd(self.dev.as_fd())
                .map(Arc::new)
                .unwrap_or_else(|| self.dev.clone());
            let (handler, splice, stop, mine) = (handler.clone(), splice.clone(), stop.clone(), pool.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("fuse-{i}"))
                .spawn(move || serve_dev(&handler, fd.as_fd(), &splice, &stop, &mine, buf_size, false));
            match spawned {
                Ok(w) => workers.push(w),
                Err(e) => {
                    pool.stop();
                    return Err(e);
                }
            }
        }
        let result = serve_dev(
            &handler,
            self.dev.as_fd(),
            &splice,
            &stop,
            &pool,
            buf_size,
            forgets_only,
        );
        stop.store(true, Ordering::Relaxed);
        pool.stop();
        for w in workers {
            let _ = w.join();
        }
        if let Some(w) = watchdog {
            let _ = w.join();
        }
        if let Some(q) = queues {
            q.join();
        }
        self.fs.destroy();
        stats::report();
        result.map(|()| transport)
    }
}

/// How a session carried its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Dev { threads: usize },
    Uring { queues: usize },
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
pub(crate) fn dispatch<F: Filesystem>(
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

/// How long the /dev/fuse reader waits after a FORGET when io_uring carries
/// every other request. The kernel wakes the reader for each FORGET it
/// queues (an inode evicted: one per file `rm -rf` removes), which on a
/// 2-vCPU VM is a wake-up of a halted CPU each; forgets that queue up
/// meanwhile arrive as one BATCH_FORGET. Nothing waits for a FORGET, and
/// INTERRUPTs, the only other requests left on /dev/fuse, are ignored.
const FORGET_BATCH_WAIT: Duration = Duration::from_millis(5);

/// Reads and answers requests from /dev/fuse until the connection ends.
/// `forgets_only`: io_uring carries the requests that take a reply, so
/// FORGETs may be left to batch up (see FORGET_BATCH_WAIT).
fn serve_dev<F: Filesystem>(
    handler: &Handler<F>,
    fd: BorrowedFd<'_>,
    splice: &AtomicBool,
    stop: &AtomicBool,
    pool: &Arc<Readers>,
    buf_size: usize,
    forgets_only: bool,
) -> io::Result<()> {
    pool.enter();
    let mut buf = vec![0u8; buf_size];
    let mut sink = DevSink { fd, splice };
    while !stop.load(Ordering::Relaxed) {
        let n = match dev::read_request(fd, &mut buf) {
            Ok(Some(n)) => n,
            Ok(None) => {
                stop.store(true, Ordering::Relaxed);
                pool.stop();
                return Ok(());
            }
            Err(e) => {
                pool.left();
                return Err(e);
            }
        };
        pool.took();
        let msg = &buf[..n];
        let forget = abi::InHeader::read_from_prefix(msg)
            .is_ok_and(|(h, _)| matches!(h.opcode, opcode::FORGET | opcode::BATCH_FORGET));
        if forget && !forgets_only {
            // The kernel sends queued FORGETs ahead of other requests: while
            // they flow (rm -rf: one per file removed), a second reader keeps
            // them off the path of the requests somebody waits for.
            crate::readers::may_block();
        }
        handler.handle(msg, &mut sink);
        if forget && forgets_only {
            std::thread::sleep(FORGET_BATCH_WAIT);
        }
        if !pool.answered() {
            break;
        }
    }
    Ok(())
}

/// Requests counted per opcode, with the time spent answering them, when
/// `TILEFS_FUSE_STATS` is set in the server's environment (for profiling):
/// written to the server's log when the session ends.
mod stats {
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
