//! The tilefs FUSE server: serves an image and its store without privilege,
//! verifying each object against the image's digest before serving it.
//!
//! [`mount`] reads and checks the whole image first (a corrupt image is
//! refused before anything is mounted), mounts (with mount(2) as root,
//! through the setuid `fusermount3` otherwise), answers the kernel's INIT,
//! and then either serves in the foreground or forks a server and returns
//! once that server has answered a first request. SIGTERM, SIGINT and SIGHUP
//! make the server unmount and exit; [`unmount`] ends a mount from outside,
//! also one whose server died.

mod fs;
mod log;
mod lower;
mod mountpoint;
mod objects;
mod overlay;
mod server_lock;

use crate::log::Logger;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tilefs_fuse_proto::{ServeConfig, Session};

pub use mountpoint::unmount;

/// Waits (up to `timeout`) for the server of a FUSE mount that was just
/// unmounted to exit: the mount of device `dev` (`major:minor`, as in
/// mountinfo) made by user `uid`. False if it is still running then.
pub fn wait_for_server(uid: u32, dev: &str, timeout: std::time::Duration) -> bool {
    server_lock::wait_for_exit(uid, dev, timeout)
}

/// How objects are checked before their data is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verity {
    /// Every object must match the digest in the image; files without a
    /// digest in the image are refused (EIO).
    Require,
    /// Objects with a digest in the image are checked; others are served.
    #[default]
    Auto,
    /// No checks.
    Off,
}

/// What the kernel is asked to cache and how requests are answered. Every
/// field defaults to on except `readdirplus_auto`; the switches exist to
/// measure each one's effect (see `TILEFS_FUSE_TUNING` in
/// [`Tuning::from_env`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// Answer failed lookups with a negative entry the kernel keeps.
    pub negative_cache: bool,
    /// FUSE_CACHE_SYMLINKS: symlink targets kept in the page cache.
    pub cache_symlinks: bool,
    /// FUSE_DO_READDIRPLUS: listings carry attributes.
    pub readdirplus: bool,
    /// FUSE_READDIRPLUS_AUTO: let the kernel choose between the two.
    pub readdirplus_auto: bool,
    /// FOPEN_CACHE_DIR (+ KEEP_CACHE) on opendir: listings kept in the
    /// directory's page cache across opens (when opendir is answered).
    pub cache_dir: bool,
    /// Answer opendir with ENOSYS: the kernel stops sending opendir and
    /// releasedir (two round trips per directory listed) and keeps
    /// directory caches by itself (FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR).
    /// Measured 0.5-0.6x the `ls -lR` time of answering opendir.
    pub no_opendir: bool,
    /// FOPEN_KEEP_CACHE on open: file pages kept across opens.
    pub keep_cache: bool,
    /// Answer open with ENOSYS when reads are served by us (no
    /// passthrough): the kernel stops sending open and release, opens every
    /// file with FOPEN_KEEP_CACHE and reads name the inode alone. Objects
    /// are opened and checked at their first read instead of at open.
    pub no_open: bool,
    /// Answer flush with ENOSYS (and open with FOPEN_NOFLUSH): nothing is
    /// ever written, so close(2) need not wait for a round trip.
    pub no_flush: bool,
    /// FUSE_POSIX_ACL (for images flagged as having ACLs): the kernel
    /// checks and caches POSIX ACLs.
    pub posix_acl: bool,
    /// `default_permissions`: permission checks (access(2), path walks)
    /// stay in the kernel.
    pub default_permissions: bool,
    /// FUSE passthrough of object files, and of upper files on writable
    /// mounts (used only when the server may: it needs CAP_SYS_ADMIN).
    pub passthrough: bool,
    /// FUSE_MAX_PAGES and 1 MiB requests.
    pub max_pages: bool,
    /// Answer getxattr of security.selinux with EOPNOTSUPP when no file in
    /// the image has a label (ENODATA otherwise).
    pub selinux_enotsup: bool,
    /// FUSE_WRITEBACK_CACHE on writable mounts without passthrough of
    /// upper files: the kernel caches writes and sends them in large
    /// requests.
    pub writeback_cache: bool,
    /// Splice read replies from the object files (one copy, by the kernel)
    /// rather than read them into a buffer and write that (two). All
    /// workers then share one descriptor of the FUSE device.
    pub splice: bool,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            negative_cache: true,
            cache_symlinks: true,
            readdirplus: true,
            readdirplus_auto: false,
            cache_dir: true,
            no_opendir: true,
            keep_cache: true,
            no_open: true,
            no_flush: true,
            posix_acl: true,
            default_permissions: true,
            passthrough: true,
            max_pages: true,
            selinux_enotsup: true,
            writeback_cache: true,
            splice: true,
        }
    }
}

impl Tuning {
    /// `self` changed by the comma-separated words of `TILEFS_FUSE_TUNING`
    /// (for measurements): `no-negative`, `no-symlinks`, `no-readdirplus`,
    /// `readdirplus-auto`, `no-cache-dir` (with `opendir`), `opendir`, `no-keep-cache`,
    /// `open`, `flush`, `no-acl`, `no-default-permissions`, `no-passthrough`, `no-max-pages`,
    /// `no-selinux-enotsup`, `no-splice`, `no-writeback`.
    pub fn from_env(mut self) -> Result<Tuning, FuseError> {
        let Some(v) = std::env::var_os("TILEFS_FUSE_TUNING") else {
            return Ok(self);
        };
        for w in v.to_string_lossy().split(',').map(str::trim).filter(|w| !w.is_empty()) {
            match w {
                "no-negative" => self.negative_cache = false,
                "no-symlinks" => self.cache_symlinks = false,
                "no-readdirplus" => self.readdirplus = false,
                "readdirplus-auto" => self.readdirplus_auto = true,
                "no-cache-dir" => self.cache_dir = false,
                "opendir" => self.no_opendir = false,
                "no-keep-cache" => self.keep_cache = false,
                "open" => self.no_open = false,
                "flush" => self.no_flush = false,
                "no-acl" => self.posix_acl = false,
                "no-default-permissions" => self.default_permissions = false,
                "no-passthrough" => self.passthrough = false,
                "no-max-pages" => self.max_pages = false,
                "no-selinux-enotsup" => self.selinux_enotsup = false,
                "no-splice" => self.splice = false,
                "no-writeback" => self.writeback_cache = false,
                _ => return Err(FuseError::Failed(format!("TILEFS_FUSE_TUNING: unknown setting {w:?}"))),
            }
        }
        Ok(self)
    }
}

/// Whether to ask the kernel for FUSE passthrough: wanted, offered, and
/// ours to use. The kernel lets only CAP_SYS_ADMIN register backing files;
/// without it, do not ask (inside a user namespace the first open still
/// finds out and falls back).
pub(crate) fn passthrough_possible(tune: &Tuning, kernel: &tilefs_fuse_proto::KernelInit) -> bool {
    tune.passthrough
        && kernel.offers(tilefs_fuse_proto::abi::init::PASSTHROUGH)
        && rustix::thread::capabilities(None)
            .is_ok_and(|c| c.effective.contains(rustix::thread::CapabilitySet::SYS_ADMIN))
}

/// Per-mount flags of a FUSE mount (`mount -o`), enforced by the kernel.
/// `nosuid` and `nodev` are `None` when not asked either way: a mount made
/// by root then honours setuid bits and devices (as a kernel mount does),
/// and one made through fusermount3 never does. Asking for `suid` or `dev`
/// (`Some(false)`) where fusermount3 must mount is refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MountFlags {
    pub nosuid: Option<bool>,
    pub nodev: Option<bool>,
    pub noexec: bool,
    pub nosymfollow: bool,
}

/// A FUSE mount request.
#[derive(Debug, Clone, Default)]
pub struct FuseMount {
    pub image: PathBuf,
    pub store: PathBuf,
    pub mountpoint: PathBuf,
    pub verity: Verity,
    /// Stay in the foreground until unmounted (otherwise return once the
    /// mount is ready, leaving the server running in the background).
    pub foreground: bool,
    /// Worker threads (0: [`default_threads`]).
    pub threads: usize,
    /// Append the server's messages to this file (otherwise stderr in the
    /// foreground, syslog in the background).
    pub log_file: Option<PathBuf>,
    /// Let other users see the mount (without root this needs
    /// `user_allow_other` in /etc/fuse.conf).
    pub allow_other: bool,
    /// Per-mount flags, applied by the kernel to the FUSE mount itself.
    pub flags: MountFlags,
    /// Caching settings; `TILEFS_FUSE_TUNING` in the environment changes them.
    pub tuning: Tuning,
    /// Refuse the image unless its fs-verity digest is this.
    pub image_digest: Option<[u8; 32]>,
    /// Fetches objects the store lacks (an image pulled lazily).
    pub fetcher: Option<Fetcher>,
    /// Read /dev/fuse even where the kernel offers FUSE over io_uring.
    pub no_uring: bool,
    /// Keep idle CPUs polling while requests flow (root only); None: where
    /// it pays ([`tilefs_fuse_proto::idle_poll_worth_it`]).
    pub idle_poll: Option<bool>,
    /// Writable: changes go to this upper directory (overlayfs's format),
    /// with this work directory on the same filesystem.
    pub upper: Option<(PathBuf, PathBuf)>,
    /// Writable mounts: ids as stored, shown to the kernel as other ids
    /// (`STORED:SHOWN:LEN[:...]`, as fuse-overlayfs's uidmapping).
    pub uid_map: Option<String>,
    pub gid_map: Option<String>,
}

/// Where objects absent from the store come from: each is fetched on the
/// first open of a file that needs it, then served as any other.
#[derive(Clone)]
pub struct Fetcher(pub Arc<dyn tilefs_store::remote::ObjectSource>);

impl std::fmt::Debug for Fetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Fetcher")
    }
}

impl FuseMount {
    /// Whether to ask for FUSE over io_uring: not for a mount that fetches
    /// objects, where a queue waiting for a fetch would hold up every
    /// caller on its CPU.
    fn uring(&self) -> bool {
        !self.no_uring && self.fetcher.is_none()
    }

    /// A request with default settings.
    pub fn new(image: impl Into<PathBuf>, store: impl Into<PathBuf>, mountpoint: impl Into<PathBuf>) -> FuseMount {
        FuseMount {
            image: image.into(),
            store: store.into(),
            mountpoint: mountpoint.into(),
            ..FuseMount::default()
        }
    }
}

/// Why a FUSE mount failed.
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    #[error("{0}")]
    Failed(String),
}

fn fail(msg: impl Into<String>) -> FuseError {
    FuseError::Failed(msg.into())
}

/// Default number of worker threads: one per core (at least 2, so that a
/// slow request never stalls the mount). More threads than cores only add
/// cross-CPU wake-ups: on 2 cores, 2 workers answered cold stats in 0.75x
/// the time of 4.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 16)
}

/// Worker threads, at least, of a mount that fetches objects (a lazily
/// pulled image): a fetch holds its thread for a round trip to the
/// registry, or for its timeout, and readers of other files (a container
/// start has many in flight) must find threads free.
pub const LAZY_THREADS: usize = 16;

/// Mounts and serves `m`. Returns when the mount is ready (or, with
/// `foreground`, when it has been unmounted).
pub fn mount(m: &FuseMount) -> Result<(), FuseError> {
    let tuning = m.tuning.from_env()?;
    // Opened without blocking, and only if a regular file.
    let data = tilefs_store::open_regular(rustix::fs::CWD, &m.image, true)
        .and_then(|mut f| {
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut data).map(|_| data)
        })
        .map_err(|e| fail(format!("{}: {e}", m.image.display())))?;
    if let Some(want) = m.image_digest {
        let got = tilefs_image::verity::digest_bytes(&data);
        if got != want {
            return Err(fail(format!(
                "{}: fs-verity digest is {}, expected {}",
                m.image.display(),
                hex::encode(got),
                hex::encode(want)
            )));
        }
    }
    // Served from its bytes: the image and small tables stay in memory,
    // never a tree of it.
    let view = tilefs_image::erofs::ImageView::open(data)
        .map_err(|e| fail(format!("{}: refusing to mount: {e}", m.image.display())))?;
    trim_heap();
    // A gc root while the server lives (the objects of an image mounted by
    // path are protected by no tag). A store we may not write cannot hold
    // one; the mount goes on, and says so.
    let record = match tilefs_store::Store::open(&m.store)
        .and_then(|s| tilefs_store::mounts::register_fuse(&s, view.bytes(), &record_where(m)))
    {
        Ok(r) => Some(r),
        Err(e) => {
            eprintln!(
                "tilefs: notice: the mount is not recorded in the store, so gc there may remove its objects: {e}"
            );
            None
        }
    };
    let store: OwnedFd = rustix::fs::open(
        &m.store,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| fail(format!("{}: cannot open the store: {e}", m.store.display())))?;
    let mnt = std::fs::canonicalize(&m.mountpoint).map_err(|e| {
        let hint = if e.raw_os_error() == Some(libc::ENOTCONN) {
            " (a dead FUSE mount: `tilefs umount` clears it)"
        } else {
            ""
        };
        fail(format!("{}: {e}{hint}", m.mountpoint.display()))
    })?;
    if !mnt.is_dir() {
        return Err(fail(format!("{}: not a directory", mnt.display())));
    }
    let logger = match (&m.log_file, m.foreground) {
        (Some(p), _) => Logger::file(p).map_err(|e| fail(format!("{}: {e}", p.display())))?,
        (None, true) => Logger::Stderr,
        (None, false) => Logger::syslog(),
    };
    let logger = Arc::new(logger);
    let name = m.image.display().to_string();
    let mut lower = lower::Lower::new(view, name, store, m.verity, logger.clone());
    lower.fetcher = m.fetcher.clone();
    lower.selinux_enotsup = tuning.selinux_enotsup;
    let nofile = raise_nofile();
    let budget = nofile / 2;
    let threads = if m.threads == 0 { default_threads() } else { m.threads };
    let serve_cfg = ServeConfig {
        threads: if m.fetcher.is_some() {
            threads.max(LAZY_THREADS)
        } else {
            threads
        },
        uring: m.uring(),
        splice: tuning.splice,
        idle_poll: m
            .idle_poll
            .unwrap_or_else(|| rustix::process::geteuid().is_root() && tilefs_fuse_proto::idle_poll_worth_it().is_ok()),
        ..ServeConfig::default()
    };
    let Some((upper, work)) = &m.upper else {
        let fs = fs::TileFs::new(lower, tuning, budget);
        return start(
            m,
            fs,
            serve_cfg,
            &mnt,
            logger,
            record,
            tuning.default_permissions,
            false,
        );
    };
    let map = |s: &Option<String>, what: &str| {
        s.as_deref()
            .map(overlay::IdMap::parse)
            .transpose()
            .map_err(|e| fail(format!("{what}: {e}")))
            .map(Option::unwrap_or_default)
    };
    let (uids, gids) = (map(&m.uid_map, "uidmapping")?, map(&m.gid_map, "gidmapping")?);
    let up = overlay::UpperDir::open(upper, work, uids, gids).map_err(fail)?;
    let fs = overlay::OverlayFs::new(lower, up, tuning, nofile).map_err(fail)?;
    // Permissions are the kernel's to check, against what we show.
    start(m, fs, serve_cfg, &mnt, logger, record, true, true)
}

/// Where the mount is and, if writable, its layers: the store's record
/// says so, for `tilefs commit`.
fn record_where(m: &FuseMount) -> tilefs_store::mounts::FuseWhere {
    let canon = |p: &Path| std::fs::canonicalize(p).ok();
    tilefs_store::mounts::FuseWhere {
        mountpoint: canon(&m.mountpoint),
        upper: m.upper.as_ref().and_then(|(u, w)| {
            Some(tilefs_store::mounts::UpperLayer {
                upper: canon(u)?,
                work: canon(w)?,
                xattrs: overlay::xattr_namespace(),
            })
        }),
    }
}

/// Mounts, answers INIT and serves `fs` (in the foreground, or in a
/// forked server).
#[allow(clippy::too_many_arguments)]
fn start<F: tilefs_fuse_proto::Filesystem>(
    m: &FuseMount,
    fs: F,
    serve_cfg: ServeConfig,
    mnt: &Path,
    logger: Arc<Logger>,
    record: Option<tilefs_store::mounts::MountRecord>,
    default_permissions: bool,
    writable: bool,
) -> Result<(), FuseError> {
    let fuse_fd = mountpoint::mount_fuse(mnt, &m.image, m.allow_other, default_permissions, m.flags, writable)?;
    let log = logger.clone();
    let session = match Session::new(fuse_fd, fs, m.uring(), Arc::new(move |msg: &str| log.log(msg))) {
        Ok(s) => s,
        Err(e) => {
            mountpoint::take_down(mnt);
            return Err(fail(format!("{}: FUSE handshake failed: {e}", mnt.display())));
        }
    };
    if m.foreground {
        return serve(session, serve_cfg, mnt, &logger, None, record);
    }
    daemonize(session, serve_cfg, mnt, logger, m.log_file.as_deref(), record)
}

/// Raises the soft limit on open files to the hard one, and as root the
/// hard one to the kernel's ceiling (fs.nr_open): the server keeps objects
/// open for the kernel's reads, and removed files until the kernel forgets
/// them. Returns the limit in force.
fn raise_nofile() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let l = getrlimit(Resource::Nofile);
    let ceiling = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .filter(|&c| l.maximum.is_none_or(|max| c > max));
    // Highest first; the ceiling is refused without CAP_SYS_RESOURCE.
    for want in [ceiling, l.maximum].into_iter().flatten() {
        if l.current == Some(want)
            || setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(want),
                    maximum: Some(want),
                },
            )
            .is_ok()
        {
            return want;
        }
    }
    l.current.unwrap_or(u64::MAX)
}

/// Forks a server for `session`; returns in the parent once the server has
/// answered a request on the mount.
fn daemonize<F: tilefs_fuse_proto::Filesystem>(
    session: Session<F>,
    cfg: ServeConfig,
    mnt: &Path,
    logger: Arc<Logger>,
    log_file: Option<&Path>,
    record: Option<tilefs_store::mounts::MountRecord>,
) -> Result<(), FuseError> {
    let (rd, wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| fail(format!("pipe: {e}")))?;
    // SAFETY: the process is single-threaded here (the session's threads
    // start in the child); the child only calls async-signal-safe functions
    // until it has set itself up, then runs ordinary Rust code, which is
    // fine in a single-threaded child.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let e = std::io::Error::last_os_error();
        mountpoint::take_down(mnt);
        return Err(fail(format!("fork: {e}")));
    }
    if pid > 0 {
        drop(wr);
        // The server's copy of the record's descriptor keeps it locked.
        if let Some(r) = record {
            r.leave();
        }
        // The child owns the connection now: the parent's copy of the
        // descriptor is closed with the session.
        drop(session);
        return wait_ready(rd, pid, mnt);
    }
    drop(rd);
    // Child: a new session, no terminal, no inherited stdio.
    // SAFETY: plain syscalls on fds this process owns.
    unsafe {
        libc::setsid();
        let _ = libc::chdir(c"/".as_ptr());
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            libc::dup2(null, 0);
            libc::dup2(null, 1);
            libc::dup2(null, 2);
            if null > 2 {
                libc::close(null);
            }
        }
    }
    if let Some(p) = log_file {
        if let Ok(f) = std::fs::OpenOptions::new().append(true).create(true).open(p) {
            // SAFETY: dup2 onto stderr of an fd we own.
            unsafe { libc::dup2(f.as_raw_fd(), 2) };
        }
    }
    let code = match serve(session, cfg, mnt, &logger, Some(wr), record) {
        Ok(()) => 0,
        Err(e) => {
            logger.log(&e.to_string());
            1
        }
    };
    std::process::exit(code)
}

/// Waits for the server's "ready" (or its error) on `rd`.
fn wait_ready(rd: OwnedFd, pid: libc::pid_t, mnt: &Path) -> Result<(), FuseError> {
    use std::io::Read;
    let mut f = std::fs::File::from(rd);
    let mut msg = Vec::new();
    let _ = f.read_to_end(&mut msg);
    if msg == b"ready" {
        return Ok(());
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    mountpoint::take_down(mnt);
    let why = if msg.is_empty() {
        format!("the server exited before the mount was ready (status {status:#x})")
    } else {
        String::from_utf8_lossy(&msg).into_owned()
    };
    Err(fail(format!("{}: {why}", mnt.display())))
}

/// What tells others the server lives: its mount record in the store (a
/// gc root) and its server lock (`tilefs umount` waits for it). On the way
/// out the record goes first, and the lock stays until the process exits,
/// so an umount returns only once the server is gone and gc then sees no
/// live mount.
struct Liveness {
    record: Option<tilefs_store::mounts::MountRecord>,
    lock: Option<server_lock::ServerLock>,
}

impl Drop for Liveness {
    fn drop(&mut self) {
        drop(self.record.take());
        if let Some(l) = self.lock.take() {
            l.keep_until_exit();
        }
    }
}

const SIGNALS: [libc::c_int; 4] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT];

fn signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise the set in place.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in SIGNALS {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Runs the session until the mount goes away; a termination signal
/// unmounts. `ready` gets "ready" once the mount answers a request.
fn serve<F: tilefs_fuse_proto::Filesystem>(
    session: Session<F>,
    cfg: ServeConfig,
    mnt: &Path,
    logger: &Logger,
    ready: Option<OwnedFd>,
    record: Option<tilefs_store::mounts::MountRecord>,
) -> Result<(), FuseError> {
    // Declared first, so dropped last, whichever way this returns.
    let mut alive = Liveness { record, lock: None };
    let set = signal_set();
    // Block the signals here and in every thread started from here; this
    // thread takes them with sigtimedwait.
    // SAFETY: set is initialised; the old mask is not needed.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    let runner = std::thread::Builder::new()
        .name("tilefs-fuse".into())
        .spawn(move || session.run(cfg))
        .map_err(|e| fail(format!("cannot start the server: {e}")))?;
    // The first request on the mount: answered only once workers run.
    // Its device names the lock that tells `tilefs umount` we are alive.
    let first = std::fs::metadata(mnt);
    alive.lock = first.as_ref().ok().and_then(|m| {
        let dev = m.dev();
        server_lock::ServerLock::take(&format!("{}:{}", rustix::fs::major(dev), rustix::fs::minor(dev)))
    });
    if let Some(wr) = ready {
        let msg = match first {
            Ok(_) => "ready".to_string(),
            Err(e) => format!("the new mount does not answer: {e}"),
        };
        let mut f = std::fs::File::from(wr);
        let _ = std::io::Write::write_all(&mut f, msg.as_bytes());
    }
    let mut unmounting = false;
    while !runner.is_finished() {
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 200_000_000,
        };
        // SAFETY: set and ts are valid; no siginfo wanted.
        let sig = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &ts) };
        if sig > 0 {
            if unmounting {
                logger.log(&format!("signal {sig} again: detaching {}", mnt.display()));
                let _ = mountpoint::detach(mnt);
                continue;
            }
            unmounting = true;
            if let Err(e) = unmount(mnt, false) {
                logger.log(&format!("signal {sig}: unmounting {} failed: {e}", mnt.display()));
            }
        }
    }
    let result = match runner.join() {
        Ok(Ok(_)) => return Ok(()),
        Ok(Err(e)) => fail(format!("{}: server failed: {e}", mnt.display())),
        Err(_) => fail(format!("{}: server thread panicked", mnt.display())),
    };
    // Do not leave a dead mount behind.
    if !unmounting {
        mountpoint::take_down(mnt);
    }
    Err(result)
}

/// Returns the heap the image's checking walk used to the system (glibc's
/// malloc_trim): its tables were many small allocations, freed by now.
fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases memory no allocation uses.
    unsafe {
        libc::malloc_trim(0);
    }
}
