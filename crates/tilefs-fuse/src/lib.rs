//! The tilefs FUSE server: serves an image and its store without privilege,
//! verifying each object against the image's digest before serving it.
//!
//! In three steps, each the caller's to take: [`Server::build`] reads and
//! checks the whole image (a corrupt image is refused before anything is
//! mounted) and opens the store and the upper layer; [`mount`] mounts it
//! through /dev/fuse (with mount(2) as root, the setuid `fusermount3`
//! otherwise) and answers the kernel's INIT; [`Mounted::start`] serves on
//! threads of this process until the mount goes away. Whether to serve in
//! the background (a fork), and what signals do, is the program's choice.
//! Another transport (a virtqueue) takes [`Server::filesystem`] and answers
//! requests with `tilefs_fuse_proto`'s `Handler`. [`unmount`] ends a mount
//! from outside, also one whose server died.

mod fs;
pub mod layer_store;
mod lower;
mod mountpoint;
mod objects;
mod overlay;
mod server_lock;

use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
pub use tilefs_fuse_proto::ServeConfig;
use tilefs_fuse_proto::Session;

pub use mountpoint::unmount;

/// Waits (up to `timeout`) for the server of a FUSE mount that was just
/// unmounted to exit: the mount of device `dev` (`major:minor`, as in
/// mountinfo) made by user `uid`. False if it is still running then.
pub fn wait_for_server(uid: u32, dev: &str, timeout: std::time::Duration) -> bool {
    server_lock::wait_for_exit(uid, dev, timeout)
}

/// Takes the lock [`wait_for_server`] waits on for the mount of device
/// `dev` and keeps it until this process and every process it forks after
/// (they share it) have exited: a kernel lazy mount's holder and fillers,
/// which `tilefs umount` waits for as for a FUSE server. False if it could
/// not be taken (umount then does not wait).
pub fn hold_server_lock(dev: &str) -> bool {
    server_lock::ServerLock::take(dev)
        .map(server_lock::ServerLock::keep_until_exit)
        .is_some()
}

pub use tilefs_store::Verity;

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
    /// Answer open with ENOSYS when reads (and on writable mounts,
    /// writes) are served by us, not passed through: the kernel stops
    /// sending open and release, opens every file with FOPEN_KEEP_CACHE
    /// and reads and writes name the inode alone. Objects are opened and
    /// checked at their first read instead of at open, and files of the
    /// image copied up at their first write.
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
    /// FUSE_WRITEBACK_CACHE on writable mounts that answer open without
    /// passthrough of upper files (`open`): the kernel caches writes and
    /// sends them in large requests.
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

/// What a server serves: an image, its store, and how.
#[derive(Debug, Clone, Default)]
pub struct ServeSpec {
    pub image: PathBuf,
    pub store: PathBuf,
    pub verity: Verity,
    /// Caching settings; `TILEFS_FUSE_TUNING` in the environment changes them.
    pub tuning: Tuning,
    /// Refuse the image unless its fs-verity digest is this.
    pub image_digest: Option<[u8; 32]>,
    /// Fetches objects the store lacks (an image pulled lazily).
    pub fetcher: Option<Fetcher>,
    /// Writable: changes go to this upper directory (overlayfs's format),
    /// with this work directory on the same filesystem.
    pub upper: Option<(PathBuf, PathBuf)>,
    /// Writable mounts: ids as stored, shown to the kernel as other ids
    /// (`STORED:SHOWN:LEN[:...]`, as fuse-overlayfs's uidmapping).
    pub uid_map: Option<String>,
    pub gid_map: Option<String>,
}

impl ServeSpec {
    /// A read-only spec with default settings.
    pub fn new(image: impl Into<PathBuf>, store: impl Into<PathBuf>) -> ServeSpec {
        ServeSpec {
            image: image.into(),
            store: store.into(),
            ..ServeSpec::default()
        }
    }
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

/// Why a FUSE server or mount failed.
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    #[error("{0}")]
    Failed(String),
    /// An unmount refused because the mount is in use.
    #[error("{}: the mount is busy (a process has a file open or its working directory in it); close them and retry, or unmount lazily", .0.display())]
    Busy(PathBuf),
}

fn fail(msg: impl Into<String>) -> FuseError {
    FuseError::Failed(msg.into())
}

/// Default number of worker threads: one per core (at least 2, so that a
/// slow request never stalls the mount). Only one reads requests at a time
/// (see tilefs-fuse-proto's `readers`); the others answer requests that
/// wait.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 16)
}

/// Worker threads, at least, of a mount that fetches objects (a lazily
/// pulled image): a fetch holds its thread for a round trip to the
/// registry, or for its timeout, and readers of other files (a container
/// start has many in flight) must find threads free.
pub const LAZY_THREADS: usize = 16;

/// The filesystem a server answers requests for, whatever carries them
/// (/dev/fuse, io_uring, a virtqueue): the image read-only, or with a
/// writable upper layer. (One per mount, so the size of the larger variant
/// costs nothing; a box would cost a pointer chase per request.)
#[allow(clippy::large_enum_variant)]
pub enum TileFilesystem {
    ReadOnly(fs::TileFs),
    Writable(overlay::OverlayFs),
    /// Many images, each a layer of podman's (see [`layer_store`]).
    LayerStore(layer_store::LayerStoreFs),
}

pub use fs::TileFs;
pub use overlay::OverlayFs;

impl tilefs_fuse_proto::Filesystem for TileFilesystem {
    fn init(
        &self,
        kernel: &tilefs_fuse_proto::KernelInit,
        conn: &Arc<tilefs_fuse_proto::Connection>,
    ) -> tilefs_fuse_proto::InitConfig {
        match self {
            TileFilesystem::ReadOnly(f) => f.init(kernel, conn),
            TileFilesystem::Writable(f) => f.init(kernel, conn),
            TileFilesystem::LayerStore(f) => f.init(kernel, conn),
        }
    }

    #[inline]
    fn handle(
        &self,
        req: &tilefs_fuse_proto::Request,
        op: tilefs_fuse_proto::Op<'_>,
        reply: tilefs_fuse_proto::Reply<'_>,
    ) {
        match self {
            TileFilesystem::ReadOnly(f) => f.handle(req, op, reply),
            TileFilesystem::Writable(f) => f.handle(req, op, reply),
            TileFilesystem::LayerStore(f) => f.handle(req, op, reply),
        }
    }

    fn forget(&self, nodeid: u64, nlookup: u64) {
        match self {
            TileFilesystem::ReadOnly(f) => f.forget(nodeid, nlookup),
            TileFilesystem::Writable(f) => f.forget(nodeid, nlookup),
            TileFilesystem::LayerStore(f) => f.forget(nodeid, nlookup),
        }
    }

    fn destroy(&self) {
        match self {
            TileFilesystem::ReadOnly(f) => f.destroy(),
            TileFilesystem::Writable(f) => f.destroy(),
            TileFilesystem::LayerStore(f) => f.destroy(),
        }
    }
}

/// A server ready to answer requests: the image read and checked (a
/// corrupt image is refused here, before anything is mounted), its store
/// and upper layer opened.
pub struct Server {
    fs: TileFilesystem,
    image: PathBuf,
    /// It fetches objects (an image pulled lazily).
    fetches: bool,
    /// Splice read replies (the tuning's choice).
    splice: bool,
    /// The kernel checks permissions (`default_permissions`): always for
    /// writable mounts, whose permissions are what the server shows.
    default_permissions: bool,
}

impl Server {
    /// Builds the server `spec` describes. Descriptor budgets follow the
    /// open-file limit in force: raise it first (see [`raise_nofile`]).
    pub fn build(spec: &ServeSpec) -> Result<Server, FuseError> {
        let (fs, default_permissions) = match &spec.upper {
            None => {
                let f = TileFs::from_spec(spec)?;
                let dp = f.default_permissions();
                (TileFilesystem::ReadOnly(f), dp)
            }
            // Permissions are the kernel's to check, against what we show.
            Some(_) => (TileFilesystem::Writable(OverlayFs::from_spec(spec)?), true),
        };
        Ok(Server {
            fs,
            image: spec.image.clone(),
            fetches: spec.fetcher.is_some(),
            splice: spec.tuning.from_env()?.splice,
            default_permissions,
        })
    }

    /// Whether to ask for FUSE over io_uring (unless the caller said not
    /// to): not for a server that fetches objects, where a queue waiting
    /// for a fetch would hold up every caller on its CPU.
    pub fn wants_uring(&self, no_uring: bool) -> bool {
        !no_uring && !self.fetches
    }

    /// A layer store's server (see [`layer_store`]): it fetches, so it
    /// serves on [`LAZY_THREADS`] threads or more.
    pub fn layer_store(fs: layer_store::LayerStoreFs) -> Server {
        Server {
            fs: TileFilesystem::LayerStore(fs),
            image: PathBuf::from("tilefs-layer-store"),
            fetches: true,
            splice: false,
            default_permissions: true,
        }
    }

    /// How to serve it through /dev/fuse: `threads` workers (0: the
    /// default; at least [`LAZY_THREADS`] for a server that fetches),
    /// io_uring as [`Server::wants_uring`] says, idle CPUs polling as
    /// `idle_poll` says (None: as root, where it pays).
    pub fn serve_config(&self, threads: usize, no_uring: bool, idle_poll: Option<bool>) -> ServeConfig {
        let threads = if threads == 0 { default_threads() } else { threads };
        ServeConfig {
            threads: if self.fetches {
                threads.max(LAZY_THREADS)
            } else {
                threads
            },
            uring: self.wants_uring(no_uring),
            splice: self.splice,
            idle_poll: idle_poll.unwrap_or_else(|| {
                rustix::process::geteuid().is_root() && tilefs_fuse_proto::idle_poll_worth_it().is_ok()
            }),
            ..ServeConfig::default()
        }
    }

    /// The filesystem, for a transport of the caller's (a virtqueue).
    pub fn filesystem(self) -> TileFilesystem {
        self.fs
    }

    /// The bytes of the image served (for a gc record of the mount).
    pub fn image_bytes(&self) -> &[u8] {
        match &self.fs {
            TileFilesystem::ReadOnly(f) => f.image_bytes(),
            TileFilesystem::Writable(f) => f.lower().view.bytes(),
            TileFilesystem::LayerStore(_) => &[],
        }
    }
}

impl TileFs {
    /// The read-only filesystem of `spec` (its upper layer, if any, aside).
    pub fn from_spec(spec: &ServeSpec) -> Result<TileFs, FuseError> {
        let tuning = spec.tuning.from_env()?;
        let lower = open_lower(spec, &tuning, true)?;
        Ok(TileFs::new(lower, tuning, nofile_limit() / 2))
    }

    /// The bytes of the image it serves.
    pub fn image_bytes(&self) -> &[u8] {
        self.lower.view.bytes()
    }

    /// Whether the kernel is to check permissions (`default_permissions`).
    fn default_permissions(&self) -> bool {
        self.tune.default_permissions
    }
}

impl OverlayFs {
    /// The writable filesystem of `spec`, which names an upper directory.
    pub fn from_spec(spec: &ServeSpec) -> Result<OverlayFs, FuseError> {
        let tuning = spec.tuning.from_env()?;
        let (upper, work) = spec
            .upper
            .as_ref()
            .ok_or_else(|| fail("a writable filesystem needs an upper and a work directory"))?;
        let map = |s: &Option<String>, what: &str| {
            s.as_deref()
                .map(overlay::IdMap::parse)
                .transpose()
                .map_err(|e| fail(format!("{what}: {e}")))
                .map(Option::unwrap_or_default)
        };
        let (uids, gids) = (map(&spec.uid_map, "uidmapping")?, map(&spec.gid_map, "gidmapping")?);
        let up = overlay::UpperDir::open(upper, work, uids, gids).map_err(fail)?;
        let lower = open_lower(spec, &tuning, true)?;
        OverlayFs::new(lower, up, tuning, nofile_limit()).map_err(fail)
    }
}

/// The image's side of a server: the image read (its digest checked when
/// one is asked for) and its store opened; the heap trimmed after if
/// `trim` (a server that opens many leaves it to its own pace).
fn open_lower(spec: &ServeSpec, tuning: &Tuning, trim: bool) -> Result<lower::Lower, FuseError> {
    // Opened without blocking, and only if a regular file.
    let data = tilefs_store::open_regular(rustix::fs::CWD, &spec.image, true)
        .and_then(|mut f| {
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut data).map(|_| data)
        })
        .map_err(|e| fail(format!("{}: {e}", spec.image.display())))?;
    if let Some(want) = spec.image_digest {
        let got = tilefs_image::verity::digest_bytes(&data);
        if got != want {
            return Err(fail(format!(
                "{}: fs-verity digest is {}, expected {}",
                spec.image.display(),
                hex::encode(got),
                hex::encode(want)
            )));
        }
    }
    // Served from its bytes: the image and small tables stay in memory,
    // never a tree of it.
    let view = tilefs_image::erofs::ImageView::open(data)
        .map_err(|e| fail(format!("{}: refusing to mount: {e}", spec.image.display())))?;
    if trim {
        tilefs_sys::mem::trim_heap();
    }
    let store: OwnedFd = rustix::fs::open(
        &spec.store,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| fail(format!("{}: cannot open the store: {e}", spec.store.display())))?;
    let mut lower = lower::Lower::new(view, spec.image.display().to_string(), store, spec.verity);
    lower.fetcher = spec.fetcher.clone();
    lower.selinux_enotsup = tuning.selinux_enotsup;
    Ok(lower)
}

/// How a server is mounted through /dev/fuse.
#[derive(Debug, Clone, Default)]
pub struct DevMount {
    pub mountpoint: PathBuf,
    /// Let other users see the mount (without root this needs
    /// `user_allow_other` in /etc/fuse.conf).
    pub allow_other: bool,
    /// Per-mount flags, applied by the kernel to the FUSE mount itself.
    pub flags: MountFlags,
    /// Ask for FUSE over io_uring where the kernel offers it (see
    /// [`Server::wants_uring`]).
    pub uring: bool,
}

/// A server mounted: the kernel's INIT answered, no request served yet.
pub struct Mounted {
    session: Session<TileFilesystem>,
    mountpoint: PathBuf,
    record: Option<tilefs_store::mounts::MountRecord>,
}

/// Mounts `server` (with mount(2) as root, through the setuid
/// `fusermount3` otherwise) and answers the kernel's INIT.
pub fn mount(server: Server, m: &DevMount) -> Result<Mounted, FuseError> {
    let mnt = std::fs::canonicalize(&m.mountpoint).map_err(|e| {
        let hint = if e.raw_os_error() == Some(libc::ENOTCONN) {
            " (a dead FUSE mount: unmount it first)"
        } else {
            ""
        };
        fail(format!("{}: {e}{hint}", m.mountpoint.display()))
    })?;
    if !mnt.is_dir() {
        return Err(fail(format!("{}: not a directory", mnt.display())));
    }
    // A layer store takes podman's notices (a `use` file made, a layer's
    // directory removed): the mount itself must let them through.
    let writable = matches!(server.fs, TileFilesystem::Writable(_) | TileFilesystem::LayerStore(_));
    let fuse_fd = mountpoint::mount_fuse(
        &mnt,
        &server.image,
        m.allow_other,
        server.default_permissions,
        m.flags,
        writable,
    )?;
    let session = match Session::new(fuse_fd, server.fs, m.uring) {
        Ok(s) => s,
        Err(e) => {
            mountpoint::take_down(&mnt);
            return Err(fail(format!("{}: FUSE handshake failed: {e}", mnt.display())));
        }
    };
    Ok(Mounted {
        session,
        mountpoint: mnt,
        record: None,
    })
}

impl Mounted {
    /// Where it is mounted (canonical).
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Keeps `record` (the mount's gc root in its store) while serving.
    pub fn keep_record(&mut self, record: tilefs_store::mounts::MountRecord) {
        self.record = Some(record);
    }

    /// In a process that hands the mount to another (a parent after fork):
    /// lets go of the record without removing it; the server's copy of its
    /// descriptor keeps it.
    pub fn leave_record(&mut self) {
        if let Some(r) = self.record.take() {
            r.leave();
        }
    }

    /// Unmounts it without serving (a caller that gave up).
    pub fn abandon(self) {
        mountpoint::take_down(&self.mountpoint);
    }

    /// Starts serving, on threads of this process.
    pub fn start(self, cfg: ServeConfig) -> Result<Running, FuseError> {
        let Mounted {
            session,
            mountpoint,
            record,
        } = self;
        let runner = std::thread::Builder::new()
            .name("tilefs-fuse".into())
            .spawn(move || session.run(cfg))
            .map_err(|e| fail(format!("cannot start the server: {e}")))?;
        Ok(Running {
            runner,
            mountpoint,
            alive: Liveness { record, lock: None },
            unmounting: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

/// A server serving. Dropped or waited for, it leaves its gc record and
/// its server lock as `tilefs umount` expects (see [`Liveness`]).
pub struct Running {
    runner: std::thread::JoinHandle<std::io::Result<tilefs_fuse_proto::Transport>>,
    mountpoint: PathBuf,
    alive: Liveness,
    unmounting: std::sync::atomic::AtomicBool,
}

impl Running {
    /// Waits for the mount to answer its first request, and takes the
    /// lock that tells `tilefs umount` this server lives. The error says
    /// why the mount does not answer.
    pub fn ready(&mut self) -> Result<(), String> {
        let first = std::fs::metadata(&self.mountpoint).map_err(|e| format!("the new mount does not answer: {e}"))?;
        let dev = first.dev();
        self.alive.lock =
            server_lock::ServerLock::take(&format!("{}:{}", rustix::fs::major(dev), rustix::fs::minor(dev)));
        Ok(())
    }

    /// Whether serving has ended (the mount is gone).
    pub fn is_finished(&self) -> bool {
        self.runner.is_finished()
    }

    /// Unmounts (serving then ends); asked again, detaches the mount even
    /// while it is busy.
    pub fn unmount(&self, why: &str) {
        let mnt = &self.mountpoint;
        if self.unmounting.swap(true, std::sync::atomic::Ordering::SeqCst) {
            tracing::warn!("{why} again: detaching {}", mnt.display());
            let _ = mountpoint::detach(mnt);
        } else if let Err(e) = unmount(mnt, false) {
            tracing::warn!("{why}: unmounting {} failed: {e}", mnt.display());
        }
    }

    /// Waits until serving ends. A server that failed leaves no dead mount
    /// behind.
    pub fn wait(self) -> Result<(), FuseError> {
        let Running {
            runner,
            mountpoint,
            alive,
            unmounting,
            ..
        } = self;
        let result = match runner.join() {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(fail(format!("{}: server failed: {e}", mountpoint.display()))),
            Err(_) => Err(fail(format!("{}: server thread panicked", mountpoint.display()))),
        };
        if result.is_err() && !unmounting.into_inner() {
            mountpoint::take_down(&mountpoint);
        }
        drop(alive);
        result
    }
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

/// Where a FUSE mount is and, if writable, its layers: the store's record
/// says so, for `tilefs commit`.
pub fn record_where(mountpoint: &Path, upper: Option<&(PathBuf, PathBuf)>) -> tilefs_store::mounts::FuseWhere {
    let canon = |p: &Path| std::fs::canonicalize(p).ok();
    tilefs_store::mounts::FuseWhere {
        mountpoint: canon(mountpoint),
        upper: upper.and_then(|(u, w)| {
            Some(tilefs_store::mounts::UpperLayer {
                upper: canon(u)?,
                work: canon(w)?,
                xattrs: overlay::xattr_namespace(),
            })
        }),
    }
}

/// The open-file limit in force: the server keeps objects open for the
/// kernel's reads, and removed files until the kernel forgets them, within
/// budgets made from it.
/// Handles kept for I/O that names only the inode (no OPEN came, so no
/// RELEASE will say when one is done with): at most this many, fewer if
/// the limit on open files is low.
pub(crate) const UNOPENED_MAX: usize = 1024;

/// Keeps `v` under `k` in `map`, which holds at most `max` entries: when
/// full, any other one goes (reopening it costs an open) and is returned,
/// for the caller to drop after its lock.
pub(crate) fn keep_bounded<K: Copy + Eq + std::hash::Hash, V>(
    map: &mut rustc_hash::FxHashMap<K, V>,
    max: usize,
    k: K,
    v: V,
) -> Option<V> {
    let evicted = if map.len() >= max && !map.contains_key(&k) {
        map.keys().next().copied().and_then(|old| map.remove(&old))
    } else {
        None
    };
    map.insert(k, v);
    evicted
}

fn nofile_limit() -> u64 {
    rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX)
}

/// Raises the soft limit on open files to the hard one, and as root the
/// hard one to the kernel's ceiling (fs.nr_open). For a server's process,
/// before [`Server::build`]. Returns the limit in force.
pub fn raise_nofile() -> u64 {
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
