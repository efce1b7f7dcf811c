//! A FUSE connection: the INIT handshake, then serving requests with a
//! pool of /dev/fuse readers or, where the kernel offers it, per-CPU
//! io_uring queues, until the filesystem is unmounted.

use crate::abi::{self, opcode};
use crate::connection::Connection;
use crate::dev::{self, DevSink};
use crate::handler::{split_header, stats, Agreed, Filesystem, Handler, KernelInit};
use crate::readers::Readers;
use crate::request::Layout;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use zerocopy::{FromBytes, IntoBytes};

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
