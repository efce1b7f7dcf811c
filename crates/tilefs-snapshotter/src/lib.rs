//! tilefs as a containerd snapshotter, served as a proxy plugin over
//! containerd's snapshots API (`containerd.services.snapshots.v1`).
//!
//! - An active snapshot is an upper and a work directory; a committed one
//!   is a layer: the upper directory's regular files moved into the shared
//!   store ([`tilefs_store::ingest::Method::Move`]: linked in, not copied;
//!   dropped where the store has them already) and its entries kept
//!   ([`layer`]). Only what no writer can reach is moved: an upper
//!   directory a live overlay has (a running container's, see [`claim`])
//!   is copied and left to it, as is a file linked elsewhere or open for
//!   writing; no object changes after it is stored.
//! - Each committed snapshot's chain is one EROFS image, flattened from
//!   its layers by the code and rules of `tilefs pull` (so the same bytes
//!   as a pull of the same OCI image), built once at Commit and held in
//!   the store ([`tilefs_store::owned`]: a gc root while the snapshot
//!   exists, which `tilefs untag` does not remove).
//! - Mounts returns one kernel overlay mount, which containerd mounts
//!   itself: the chain's EROFS image (mounted here, read-only, under
//!   `ROOT/mnt/ID`) with the store as its data-only lower layer, and the
//!   snapshot's upper and work directories when it is active.
//! - Records ([`state`]) are written whole by rename: a Commit is one
//!   rename of its record. Storing the layer (files moved into the store,
//!   image written) is done after, by a worker, in commit order, while
//!   containerd unpacks the next layer; a failure or a crash meanwhile
//!   gives the upper directory back as it was (from a journal) and the
//!   worker tries again. Until it is stored a committed snapshot is
//!   "pending": its upper directory is whole, and containerd's differ
//!   (which applies a layer straight into the child's upper directory and
//!   reads the parents only for directories' metadata) gets the pending
//!   uppers as lower directories; any other mount waits for the worker,
//!   which changes the owner and mode of the files it moves.
//! - CRI's lazy path ([`lazy`]): a layer of a runnable tilefs artifact,
//!   or of an ordinary image with a tilefs index, becomes a committed
//!   snapshot at once, from the artifact's image and index (from the
//!   index's layer maps); containers on it read through a FUSE mount of the image that
//!   fetches files on first read, below their overlay. A Commit over such
//!   an image keeps its upper directory as its layer (flattening the chain
//!   would fetch the whole image), a lower directory of the mounts above.
//! - Remove gives the space back ([`collect`]): the objects of the images
//!   of removed snapshots are collected a while after the last Remove.
//! - Commit does not wait for the disk: the layer's files (which
//!   containerd wrote without syncing) are synced in the background, and a
//!   committed snapshot is marked synced after. One that a crash left
//!   unsynced has its objects checked at the next start, and damaged ones
//!   removed.

pub mod claim;
pub mod collect;
pub mod cri;
pub mod filter;
pub mod into_containerd;
pub mod layer;
pub mod lazy;
pub mod state;

use containerd_snapshots::api::types::Mount;
use containerd_snapshots::{Info, Kind, Snapshotter, Usage};
use state::{Record, SnapKind};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;
use tilefs_oci::apply::Applier;
use tilefs_oci::compat;
use tilefs_oci::lazy_index::LazyKind;
use tilefs_store::ingest::{Ingest, Method};
use tilefs_store::owned::{self, Holder};
use tilefs_store::{tags, Store};
use tonic::{Code, Status};

/// Where the snapshotter keeps things, and what it does by itself.
#[derive(Debug, Clone)]
pub struct Config {
    /// Its state: records, upper directories, EROFS mounts.
    pub root: PathBuf,
    /// The object store (shared with `tilefs pull`, `mount`, `gc`).
    pub store: PathBuf,
    /// The unix socket containerd connects to.
    pub socket: PathBuf,
    /// How long after the last Remove the objects removed snapshots used
    /// are collected ([`collect`]); None: never (`tilefs gc` does).
    pub gc_delay: Option<std::time::Duration>,
    /// Where containerd's CRI plugin says a proxy snapshotter's images
    /// are (`CONTAINERD_ROOT/io.containerd.snapshotter.v1.NAME`, which
    /// `crictl imagefsinfo` and the kubelet's image gc read): made a
    /// symlink to the store at start ([`link_imagefs`]).
    pub cri_imagefs: Option<PathBuf>,
    /// containerd's CRI socket: CRI's image service is served on
    /// `socket` too, as a proxy in front of it that keeps each pull's
    /// credentials for the lazy path ([`cri`]).
    pub cri_image_service: Option<PathBuf>,
}

/// The collection delay unless configured.
pub const DEFAULT_GC_DELAY: std::time::Duration = std::time::Duration::from_secs(10);
/// containerd's default root: where CRI's path for a proxy snapshotter
/// named `tilefs` is, unless configured.
pub const DEFAULT_CONTAINERD_ROOT: &str = "/var/lib/containerd";
/// The name of the plugin in containerd's `proxy_plugins` that the README
/// gives (CRI's path for it ends in it).
pub const DEFAULT_PLUGIN_NAME: &str = "tilefs";

/// The worker's nice value: storing layers yields the CPU to the unpack
/// of the next one, which a pull waits for.
const WORKER_NICE: i32 = 10;

/// When a Commit's steps began (reading the chain, the layer, writing the image).
type BuildTimes = (std::time::Instant, std::time::Instant, std::time::Instant);

/// How long after a layer is stored its files are synced.
const SYNC_DELAY: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a stop waits for clients to close their connections.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

pub const DEFAULT_SOCKET: &str = "/run/tilefs/snapshotter.sock";
pub const DEFAULT_ROOT: &str = "/var/lib/tilefs/snapshotter";

/// The snapshotter.
#[derive(Clone)]
pub struct Tilefs {
    s: Arc<Shared>,
}

struct Shared {
    root: PathBuf,
    store: PathBuf,
    /// Who holds the committed snapshots' images in the store.
    holder: Holder,
    /// Names of committed snapshots' images: this prefix and the id.
    tag_prefix: String,
    collector: Arc<collect::Collector>,
    inner: Mutex<Inner>,
    /// Held by the one background sync that runs.
    syncing: Mutex<()>,
    /// Signalled when the worker finished a job.
    changed: std::sync::Condvar,
    jobs: Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    /// CRI's lazy path, if the front end offers it.
    lazy: Option<lazy::Lazy>,
    plans: lazy::Plans,
    /// What became of the images CRI pulled (for its ImageStatus).
    said: lazy::Said,
    /// The lazy snapshot a Prepare for each (chain ID, parent) was last
    /// answered with: containerd's walk that follows is shown that one
    /// alone (see [`lazy`]).
    lazy_claims: Mutex<HashMap<(String, String), LazyClaim>>,
    /// Signalled when a walk took up a claim.
    walked: std::sync::Condvar,
    /// Per snapshot id, held while its image is mounted under `ROOT/mnt`
    /// (and while it is unmounted): one mount each, whoever asks first,
    /// and a slow mount holds up no other.
    mounting: Mutex<HashMap<u64, Arc<Mutex<()>>>>,
}

struct Inner {
    by_key: HashMap<String, Record>,
    next_id: u64,
    /// The pending snapshot the worker is storing.
    ingesting: Option<u64>,
    /// Pending snapshots the worker failed to store, and why.
    failed: HashMap<u64, String>,
    /// Snapshots (an unpack's) mounted over pending uppers: those uppers.
    lower_users: HashMap<u64, Vec<u64>>,
    /// Upper directories a reap found a live overlay's, and when.
    in_use: HashMap<u64, std::time::Instant>,
}

/// What a Prepare answered AlreadyExists for a lazy snapshot told
/// containerd, which walks for it by its chain ID label and parent next.
struct LazyClaim {
    name: String,
    /// A walk for it came since.
    walked: bool,
}

/// How long a Prepare for a lazy snapshot of another reference waits for
/// containerd's walk of the one claimed before it (the two walk for the
/// same label and parent: each must be shown its own).
const CLAIM_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a Prepare with CRI's labels made no lazy snapshot.
enum NotLazy {
    /// The labels do not name a runnable artifact's layer (or lie about
    /// it): an ordinary Prepare follows.
    Because(String),
    /// They do, and serving it failed (the registry, the store).
    Failed(String),
}

/// The image a lazy chain snapshot is of ([`Shared::make_lazy_chain`]).
struct Chain<'a> {
    /// As the policy accepted it.
    resolved: &'a tilefs_oci::transport::Resolved,
    /// Its layers' diff IDs, in the manifest's order.
    diff_ids: &'a [tilefs_oci::digest::Digest],
    /// What its files are placed by, as the log says it.
    through: String,
}

/// How an image served lazily was judged, as `crictl inspecti` says it.
fn judged<T>(trust: &Option<T>) -> &'static str {
    match trust {
        Some(_) => "accepted by the signature policy as the image",
        None => "not judged by a signature policy",
    }
}

/// The worker's jobs, done in order.
enum Job {
    /// Store a pending snapshot's layer and make its image.
    Ingest(u64),
    /// Remove the upper directories no pending layer or mount needs.
    Reap,
}

/// An error as containerd gets it: a gRPC code (NotFound, AlreadyExists,
/// FailedPrecondition, InvalidArgument map to containerd's errdefs) and a
/// message.
#[derive(Debug)]
pub struct Error {
    pub code: Code,
    pub msg: String,
}

impl Error {
    fn new(code: Code, msg: impl Into<String>) -> Error {
        Error { code, msg: msg.into() }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        Status::new(e.code, e.msg)
    }
}

fn not_found(key: &str) -> Error {
    Error::new(Code::NotFound, format!("snapshot {key:?} does not exist"))
}

fn internal(e: impl std::fmt::Display) -> Error {
    Error::new(Code::Internal, e.to_string())
}

impl Tilefs {
    /// Opens (creating) the snapshotter's root and store, loads the records
    /// and removes what a crash left behind.
    pub fn open(cfg: &Config, lazy: Option<lazy::Lazy>) -> Result<Tilefs, String> {
        let (root, store) = (cfg.root.as_path(), cfg.store.as_path());
        for d in [state::METADATA, state::SNAPSHOTS, state::MOUNTS, state::EMPTY] {
            let p = root.join(d);
            std::fs::create_dir_all(&p).map_err(|e| format!("{}: cannot create: {e}", p.display()))?;
        }
        let root = std::fs::canonicalize(root).map_err(|e| format!("{}: {e}", root.display()))?;
        // Only root may reach the upper directories and mounts.
        rustix::fs::chmod(&root, rustix::fs::Mode::from_raw_mode(0o700))
            .map_err(|e| format!("{}: cannot set its mode: {e}", root.display()))?;
        if !store.exists() {
            Store::create(store).map_err(|e| e.to_string())?;
        }
        // Said at each start, as fsck says it: the containers' files are
        // as open as the store.
        if let Some(w) = Store::open(store).map_err(|e| e.to_string())?.exposure() {
            eprintln!("tilefs snapshotter: warning: {w}");
        }
        let store = std::fs::canonicalize(store).map_err(|e| format!("{}: {e}", store.display()))?;
        // Both appear in overlayfs's options, which separate with these.
        for p in [&root, &store] {
            let s = p.to_string_lossy();
            if s.contains([':', ',', '\n']) || p.to_str().is_none() {
                return Err(format!(
                    "{}: a snapshotter's root and store paths must not hold ':' or ',' (overlayfs options use them)",
                    p.display()
                ));
            }
        }
        let holder = Holder::ContainerdSnapshotter { root: root.clone() };
        let tag_prefix = format!("{}-", holder.id());
        adopt_tags(&store, &holder, &tag_prefix)?;
        let collector = collect::Collector::start(&store, &root, cfg.gc_delay)?;
        let records = state::load(&root)?;
        let mut next_id = records.iter().map(|r| r.id).max().unwrap_or(0) + 1;
        if let Ok(rd) = std::fs::read_dir(root.join(state::SNAPSHOTS)) {
            for e in rd.flatten() {
                if let Some(id) = e.file_name().to_str().and_then(|n| n.parse::<u64>().ok()) {
                    next_id = next_id.max(id + 1);
                }
            }
        }
        let mut by_key = HashMap::new();
        for r in records {
            if let Some(old) = by_key.insert(r.key.clone(), r) {
                return Err(format!(
                    "{}: two records name snapshot {:?}",
                    state::record_path(&root, old.id).display(),
                    old.key
                ));
            }
        }
        let t = Tilefs {
            s: Arc::new(Shared {
                root,
                store,
                holder,
                tag_prefix,
                collector,
                inner: Mutex::new(Inner {
                    by_key,
                    next_id,
                    ingesting: None,
                    failed: HashMap::new(),
                    lower_users: HashMap::new(),
                    in_use: HashMap::new(),
                }),
                syncing: Mutex::new(()),
                changed: std::sync::Condvar::new(),
                jobs: Mutex::new(None),
                lazy,
                plans: lazy::Plans::default(),
                said: lazy::Said::default(),
                lazy_claims: Mutex::new(HashMap::new()),
                walked: std::sync::Condvar::new(),
                mounting: Mutex::new(HashMap::new()),
            }),
        };
        t.s.check_unsynced();
        t.s.cleanup().map_err(|e| e.msg)?;
        let (tx, rx) = std::sync::mpsc::channel();
        *t.s.jobs.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        let worker = t.s.clone();
        std::thread::Builder::new()
            .name("tilefs-layers".into())
            .spawn(move || {
                // Below containerd's unpack, which waits for nothing of it
                // (its hashing threads inherit this).
                let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), WORKER_NICE);
                for job in rx {
                    match job {
                        Job::Ingest(id) => worker.ingest(id),
                        Job::Reap => worker.reap(),
                    }
                }
            })
            .map_err(|e| format!("cannot start the snapshotter's worker: {e}"))?;
        // Layers a stop left pending, oldest (so parents) first.
        let mut pending: Vec<u64> = t.s.lock().by_key.values().filter(|r| r.pending).map(|r| r.id).collect();
        pending.sort_unstable();
        for id in pending {
            t.s.send(Job::Ingest(id));
        }
        Ok(t)
    }

    pub fn root(&self) -> &Path {
        &self.s.root
    }

    /// Before CRI's pull of `image` (as CRI names it) goes on to
    /// containerd, through the image service proxy ([`cri`]): the image is
    /// judged by the signature policy (Err: the policy's refusal) and what
    /// its lazy start can go by is found now, for the Prepares that follow;
    /// what an earlier pull of it said is forgotten. Any other failure is
    /// left to containerd's pull (and the Prepares) to meet.
    pub fn before_pull(&self, image: &str) -> Result<(), String> {
        let Some(lz) = &self.s.lazy else {
            return Ok(());
        };
        let image = lazy::normalized(image);
        let Ok(r) = tilefs_oci::ImageRef::parse(&format!("docker://{image}")) else {
            return Ok(());
        };
        match tilefs_oci::lazy_index::plan(&r, &lz.pull) {
            Ok(plan) => {
                let Some(m) = plan.manifest_digest.as_ref().map(|d| d.to_string()) else {
                    return Ok(());
                };
                let repo = lazy::repository(&image);
                let top = plan.top_digest.as_ref().map(|d| format!("{repo}@{d}"));
                self.s.said.begin(&format!("{repo}@{m}"), top.as_deref());
                if let Ok(key) = lazy::by_digest(&image, &m) {
                    self.s.plans.remember(key.to_string(), Arc::new(plan));
                }
                Ok(())
            }
            Err(tilefs_oci::OciError::Refused(why)) => {
                eprintln!("tilefs snapshotter: {image}: refused: {why}");
                Err(why)
            }
            Err(e) => {
                eprintln!("tilefs snapshotter: {image}: {e} (containerd's pull goes on)");
                Ok(())
            }
        }
    }

    /// What became of the image with these repo digests (CRI's), if the
    /// snapshotter knows: how it is served lazily, or why it was pulled
    /// whole.
    pub fn said_of(&self, repo_digests: &[String]) -> Option<(bool, String)> {
        self.s.said.of(repo_digests)
    }
}

/// Makes the snapshotter `holder` of its images in the store: registered
/// first, then the tags an older tilefs kept them as
/// (`STORE/images/snapshotter-HASH-ID`, which `tilefs untag` could remove
/// under a running container) made its held images, each written held
/// before its tag goes (a crash between leaves both; the next start ends
/// the move).
fn adopt_tags(store: &Path, holder: &Holder, prefix: &str) -> Result<(), String> {
    let s = Store::open(store).map_err(|e| e.to_string())?;
    owned::register(&s, holder).map_err(|e| e.to_string())?;
    let mut moved = 0;
    // A store whose tags cannot be listed has none of ours to move (fsck
    // says what is wrong with it).
    for t in tags::list_tags(&s).unwrap_or_default() {
        if t.name.strip_prefix(prefix).is_some_and(|id| id.parse::<u64>().is_ok()) {
            owned::adopt(&s, holder, &t.name).map_err(|e| e.to_string())?;
            moved += 1;
        }
    }
    if moved > 0 {
        eprintln!(
            "tilefs snapshotter: the images of {moved} snapshots, tagged in {} by an older tilefs, are held apart from \
             the user's tags now (in {})",
            store.display(),
            owned::root_path(&s, holder, "").display()
        );
    }
    Ok(())
}

/// Makes `link` a symlink to `store`: the path containerd's CRI plugin
/// reports as the image filesystem of a proxy snapshotter
/// (`crictl imagefsinfo`, the kubelet's image gc, which measures the
/// filesystem that path is on: the store's, where the images are). A
/// symlink elsewhere is replaced; anything else there is left alone.
pub fn link_imagefs(link: &Path, store: &Path) -> Result<(), String> {
    match std::fs::read_link(link) {
        Ok(to) if to == store => return Ok(()),
        Ok(_) => {}
        Err(_) if std::fs::symlink_metadata(link).is_ok() => {
            return Err(format!(
                "{}: exists and is no symlink: left as it is (CRI reports it as the image filesystem)",
                link.display()
            ))
        }
        Err(_) => {}
    }
    let dir = link
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: cannot create: {e}", dir.display()))?;
    let tmp = dir.join(format!(".tilefs-imagefs-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(store, &tmp)
        .and_then(|()| std::fs::rename(&tmp, link))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("{}: cannot link it to {}: {e}", link.display(), store.display())
        })
}

/// Runs `f` on a thread that may block.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, Error> + Send + 'static) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::new(Code::Internal, format!("the snapshotter's worker failed: {e}")))?
}

fn kind_of(k: SnapKind) -> Kind {
    match k {
        SnapKind::View => Kind::View,
        SnapKind::Active => Kind::Active,
        SnapKind::Committed => Kind::Committed,
    }
}

fn kind_name(k: SnapKind) -> &'static str {
    match k {
        SnapKind::View => "view",
        SnapKind::Active => "active",
        SnapKind::Committed => "committed",
    }
}

fn info_of(r: &Record) -> Info {
    Info {
        kind: kind_of(r.kind),
        name: r.key.clone(),
        parent: r.parent.clone(),
        labels: r.labels.clone(),
        created_at: r.created,
        updated_at: r.updated,
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn tag(&self, id: u64) -> String {
        format!("{}{id}", self.tag_prefix)
    }

    fn create(
        self: &Arc<Self>,
        key: String,
        parent: String,
        labels: HashMap<String, String>,
        kind: SnapKind,
    ) -> Result<Vec<Mount>, Error> {
        if key.is_empty() {
            return Err(Error::new(Code::InvalidArgument, "a snapshot key must not be empty"));
        }
        if kind == SnapKind::Active {
            if let (Some(lz), Some(target)) = (&self.lazy, lazy::Target::of(&labels)) {
                let t = match target {
                    Ok(t) => Some(t),
                    Err(e) => {
                        eprintln!("tilefs snapshotter: {key:?}: not served lazily: {e}");
                        None
                    }
                };
                let whole = |t: &lazy::Target, why: &str| self.said.whole(&t.repo_digest, why.to_string());
                match t.map(|t| (self.make_lazy(&t, &parent, &labels, lz), t)) {
                    Some((Ok(name), _)) => {
                        return Err(Error::new(
                            Code::AlreadyExists,
                            format!("target snapshot {name:?} exists (served lazily)"),
                        ))
                    }
                    // containerd unpacks it then, as any image.
                    Some((Err(NotLazy::Because(e)), t)) => {
                        eprintln!("tilefs snapshotter: {key:?}: not served lazily: {e}");
                        whole(&t, &e);
                    }
                    // An artifact containerd cannot unpack: its error.
                    Some((Err(NotLazy::Failed(e)), t)) => {
                        eprintln!("tilefs snapshotter: {key:?}: {e}");
                        whole(&t, &e);
                        return Err(Error::new(Code::Unavailable, e));
                    }
                    None => {}
                }
            }
        }
        let mut inner = self.lock();
        Self::name_free(&inner, &key)?;
        if !parent.is_empty() {
            let p = inner
                .by_key
                .get(&parent)
                .ok_or_else(|| Error::new(Code::NotFound, format!("parent snapshot {parent:?} does not exist")))?;
            if p.kind != SnapKind::Committed {
                return Err(Error::new(
                    Code::InvalidArgument,
                    format!("parent snapshot {parent:?} is not committed"),
                ));
            }
        }
        let id = inner.next_id;
        inner.next_id += 1;
        let dir = state::snapshot_dir(&self.root, id);
        let mk =
            |p: &Path| std::fs::create_dir_all(p).map_err(|e| internal(format!("{}: cannot create: {e}", p.display())));
        mk(&dir.join("fs"))?;
        // As a layer without a `./` entry implies its root: 0755, time zero.
        let fs = dir.join("fs");
        let _ = rustix::fs::chmod(&fs, rustix::fs::Mode::from_raw_mode(0o755));
        let zero = rustix::fs::Timestamps {
            last_access: rustix::fs::Timespec { tv_sec: 0, tv_nsec: 0 },
            last_modification: rustix::fs::Timespec { tv_sec: 0, tv_nsec: 0 },
        };
        let _ = rustix::fs::utimensat(rustix::fs::CWD, &fs, &zero, rustix::fs::AtFlags::empty());
        if kind == SnapKind::Active {
            mk(&dir.join("work"))?;
        }
        let now = SystemTime::now();
        let r = Record {
            id,
            key: key.clone(),
            kind,
            parent,
            labels,
            created: now,
            updated: now,
            usage: None,
            image: None,
            unsynced: false,
            pending: false,
            lazy: false,
            kept: false,
            indexed: false,
            deferred: false,
        };
        if let Err(e) = state::save(&self.root, &r) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(internal(e));
        }
        inner.by_key.insert(key.clone(), r);
        let mounts = self.mounts_when_ready(inner, &key);
        if mounts.is_err() {
            // No mounts, no snapshot: containerd may try the key again.
            let mut inner = self.lock();
            if inner.by_key.get(&key).is_some_and(|r| r.id == id) {
                inner.by_key.remove(&key);
                inner.lower_users.remove(&id);
                let _ = state::delete(&self.root, id);
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        mounts
    }

    /// CRI's lazy path: if `t` names a layer of a runnable tilefs artifact,
    /// of an ordinary image with a tilefs index or of an eStargz or
    /// zstd:chunked image (checked, see
    /// [`lazy::check`]), the committed snapshot of it for `t`'s reference
    /// ([`lazy::snapshot_name`]), made now (or found made), and its name,
    /// claimed for containerd's walk.
    fn make_lazy(
        self: &Arc<Self>,
        t: &lazy::Target,
        parent: &str,
        labels: &HashMap<String, String>,
        lz: &lazy::Lazy,
    ) -> Result<String, NotLazy> {
        let made = [
            lazy::snapshot_name(&t.reference, &t.name),
            lazy::snapshot_name_on(&t.reference, &t.name, parent, ""),
        ];
        let found = {
            let inner = self.lock();
            made.into_iter()
                .find(|n| inner.by_key.get(n).is_some_and(|r| r.lazy && r.parent == parent))
        };
        if let Some(name) = found {
            self.said.lazy(&t.repo_digest, format!("lazy: {name} was made before"));
            self.claim_lazy(&t.name, parent, &name);
            return Ok(name);
        }
        let plan = self.plans.plan(&t.reference, lz).map_err(NotLazy::Because)?;
        let (name, how) = match &plan.kind {
            LazyKind::Artifact(layers) => self.make_lazy_artifact(t, parent, labels, lz, layers)?,
            LazyKind::Indexed(image) => self.make_lazy_indexed(t, parent, labels, image, &plan.kind)?,
            LazyKind::Toc(image) => self.make_lazy_toc(t, parent, labels, image, &plan.kind)?,
            LazyKind::Whole(why) => return Err(NotLazy::Because(why.clone())),
        };
        self.said.lazy(&t.repo_digest, how);
        self.claim_lazy(&t.name, parent, &name);
        Ok(name)
    }

    /// [`Shared::make_lazy`] of a layer of the runnable artifact whose
    /// blobs are `layers`: every layer shows the whole image, which the
    /// first pulls. The name, and how it is served.
    fn make_lazy_artifact(
        self: &Arc<Self>,
        t: &lazy::Target,
        parent: &str,
        labels: &HashMap<String, String>,
        lz: &lazy::Lazy,
        layers: &[tilefs_oci::digest::Digest],
    ) -> Result<(String, String), NotLazy> {
        let name = lazy::snapshot_name(&t.reference, &t.name);
        let chain = lazy::check(t, layers, layers).map_err(NotLazy::Because)?;
        let below = chain
            .len()
            .checked_sub(2)
            .map(|i| lazy::snapshot_name(&t.reference, &chain[i]))
            .unwrap_or_default();
        if parent != below {
            return Err(NotLazy::Because(format!(
                "its parent is {parent:?}, but the layer below it in {} is {below:?}",
                t.reference
            )));
        }
        // The first layer pulls the image and index; those above it show
        // the same image (its tag, see `image_tag`).
        let parent_image = {
            let inner = self.lock();
            match inner.by_key.get(parent) {
                Some(p) if p.lazy => Some(p.image.clone()),
                Some(_) => return Err(NotLazy::Because(format!("its parent {parent:?} was not made lazily"))),
                None if parent.is_empty() => None,
                None => return Err(NotLazy::Because(format!("its parent {parent:?} does not exist"))),
            }
        };
        // From here it is the artifact's layer: a failure is the Prepare's.
        let failed = |e: String| NotLazy::Failed(format!("layer of {}: {e}", t.reference));
        let id = self.new_id();
        let store = Store::open(&self.store).map_err(|e| failed(e.to_string()))?;
        let started = std::time::Instant::now();
        let tag = self.tag(id);
        let pulled = parent_image.is_none();
        let image = match parent_image {
            Some(digest) => digest,
            None => {
                let opts = tilefs_oci::pull::PullOptions {
                    lazy: true,
                    ..lz.pull.clone()
                };
                let report =
                    tilefs_oci::pull::pull(&store, &t.reference, &tag, &opts).map_err(|e| failed(e.to_string()))?;
                // The pull tags it: held from here, as every image of ours.
                owned::adopt(&store, &self.holder, &tag).map_err(|e| failed(e.to_string()))?;
                Some(report.digest)
            }
        };
        let r = Self::lazy_record(id, &name, parent, labels, image, false);
        if !self.insert_lazy(r, pulled).map_err(failed)? {
            let _ = self.remove_tag(id);
        }
        eprintln!(
            "tilefs snapshotter: {name:?}: layer {} of {} made lazily ({:.2} s)",
            chain.len(),
            t.reference,
            started.elapsed().as_secs_f64()
        );
        Ok((name, format!("lazy: {} is a runnable tilefs image", t.reference)))
    }

    /// [`Shared::make_lazy`] of a layer of an ordinary image with a tilefs
    /// index: the image of its chain made from the index's layer maps
    /// (nothing of the layers fetched), its files placed in the layer blobs
    /// for the FUSE server to fetch by range.
    fn make_lazy_indexed(
        self: &Arc<Self>,
        t: &lazy::Target,
        parent: &str,
        labels: &HashMap<String, String>,
        img: &tilefs_oci::lazy_index::IndexedImage,
        kind: &LazyKind,
    ) -> Result<(String, String), NotLazy> {
        let index = &img.index.manifest_digest;
        let chain = Chain {
            resolved: &img.resolved,
            diff_ids: &img.diff_ids,
            through: format!("index {index}"),
        };
        let how = judged(&img.index.trust);
        let name = self.make_lazy_chain(t, parent, labels, chain, kind)?;
        Ok((name, format!("lazy: through tilefs index {index} ({how})")))
    }

    /// [`Shared::make_lazy`] of a layer of an eStargz or zstd:chunked image
    /// without a tilefs index: the image of its chain made from the layers'
    /// tables of contents, its files fetched by range and checked against
    /// them.
    fn make_lazy_toc(
        self: &Arc<Self>,
        t: &lazy::Target,
        parent: &str,
        labels: &HashMap<String, String>,
        img: &tilefs_oci::lazy_index::TocImages,
        kind: &LazyKind,
    ) -> Result<(String, String), NotLazy> {
        let formats = img.tables.formats();
        let chain = Chain {
            resolved: &img.resolved,
            diff_ids: &img.diff_ids,
            through: format!("its {formats} tables of contents"),
        };
        let name = self.make_lazy_chain(t, parent, labels, chain, kind)?;
        let how = judged(&img.resolved.trust);
        Ok((name, format!("lazy: through its {formats} tables of contents ({how})")))
    }

    /// The lazy snapshot of `t`, a layer of an ordinary image planned as
    /// `kind`: the image of its chain (the layers up to it, see
    /// [`Shared::write_chain`]) made the snapshot's, for the top layer now,
    /// for one below it at its first mount ([`Record::deferred`]). A
    /// failure leaves the layer to containerd, which can unpack it.
    fn make_lazy_chain(
        self: &Arc<Self>,
        t: &lazy::Target,
        parent: &str,
        labels: &HashMap<String, String>,
        c: Chain,
        kind: &LazyKind,
    ) -> Result<String, NotLazy> {
        let blobs: Vec<_> = c.resolved.layers.iter().map(|l| l.digest.clone()).collect();
        let chain = lazy::check(t, &blobs, c.diff_ids).map_err(NotLazy::Because)?;
        let n = chain.len();
        // The parent's files are not used (the chain's image holds them
        // all): any committed snapshot of the chain below will do, the
        // image's own lazy one or one containerd unpacked.
        if (n == 1) != parent.is_empty() {
            return Err(NotLazy::Because(format!(
                "layer {n} of {} over parent {parent:?}",
                t.reference
            )));
        }
        if !parent.is_empty()
            && self
                .lock()
                .by_key
                .get(parent)
                .is_none_or(|p| p.kind != SnapKind::Committed)
        {
            return Err(NotLazy::Because(format!(
                "its parent {parent:?} is no committed snapshot"
            )));
        }
        let below = n.checked_sub(2).map(|i| chain[i].as_str()).unwrap_or_default();
        let name = lazy::snapshot_name_on(&t.reference, &t.name, parent, below);
        let through = &c.through;
        let failed = |e: String| NotLazy::Because(format!("layer {n} of {} through {through}: {e}", t.reference));
        let id = self.new_id();
        let started = std::time::Instant::now();
        if n < blobs.len() {
            let mut r = Self::lazy_record(id, &name, parent, labels, None, true);
            r.deferred = true;
            self.insert_lazy(r, false).map_err(failed)?;
            eprintln!(
                "tilefs snapshotter: {name:?}: layer {n} of {} made lazily through {through}, its image made at \
                 its first mount ({:.2} s)",
                t.reference,
                started.elapsed().as_secs_f64()
            );
            return Ok(name);
        }
        let absent = (|| -> Result<u64, String> {
            let (digest, absent) = self.write_chain(id, kind, n)?;
            let r = Self::lazy_record(id, &name, parent, labels, Some(digest), true);
            // The top layer's image is the one containers run on.
            if !self.insert_lazy(r, true)? {
                let _ = self.remove_tag(id);
            }
            Ok(absent)
        })()
        .map_err(|e| {
            let _ = self.remove_tag(id);
            failed(e)
        })?;
        eprintln!(
            "tilefs snapshotter: {name:?}: layer {n} of {} made lazily through {through}, {absent} files to fetch \
             on first read ({:.2} s)",
            t.reference,
            started.elapsed().as_secs_f64()
        );
        Ok(name)
    }

    /// Makes the image of the chain of the first `n` layers of the image
    /// planned as `kind` (from its index's layer maps or its tables of
    /// contents), writes its lazy record and holds it as snapshot `id`'s:
    /// its fs-verity digest (hex) and the number of files to fetch.
    fn write_chain(&self, id: u64, kind: &LazyKind, n: usize) -> Result<(String, u64), String> {
        let store = Store::open(&self.store).map_err(|e| e.to_string())?;
        // Held shared until the image is held: a gc meanwhile would take
        // the objects found present for unreferenced.
        let lock = store
            .lock(tilefs_store::LockMode::Shared, true)
            .map_err(|e| e.to_string())?;
        let (image, digest, absent, resolved) = match kind {
            LazyKind::Indexed(img) => {
                let c = img.chain(n).map_err(|e| e.to_string())?;
                let absent = tilefs_store::presence::absent(&store, c.objects.iter().map(|o| o.digest)).len();
                match absent {
                    0 => tilefs_store::remote::forget(&store, &c.digest).map_err(|e| e.to_string())?,
                    _ => c.record.save(&store, &c.digest).map_err(|e| e.to_string())?,
                }
                (c.image, c.digest, absent as u64, &img.resolved)
            }
            LazyKind::Toc(img) => {
                let made = img.tables.image(&store, n, img.opts.keep_all_xattrs)?;
                match &made.record {
                    Some(r) => r.save(&store, &made.digest).map_err(|e| e.to_string())?,
                    None => tilefs_store::remote::forget(&store, &made.digest).map_err(|e| e.to_string())?,
                }
                (made.image, made.digest, made.lazy_files, &img.resolved)
            }
            LazyKind::Artifact(_) | LazyKind::Whole(_) => {
                return Err("its image is planned to be pulled, not made from its layers".into())
            }
        };
        tilefs_oci::trust::save_evidence(&store, &digest, resolved).map_err(|e| e.to_string())?;
        owned::write_root(&store, &self.holder, &self.tag(id), &image).map_err(|e| e.to_string())?;
        drop(lock);
        Ok((hex::encode(digest), absent))
    }

    /// Makes deferred snapshot `r`'s chain image ([`Record::deferred`]),
    /// its mount lock held and `inner` locked (no Remove meanwhile): the
    /// record, no longer deferred.
    fn build_deferred(&self, inner: &mut Inner, r: &Record) -> Result<Record, Error> {
        let started = std::time::Instant::now();
        let fail = |e: String| internal(format!("snapshot {:?}: cannot make its image: {e}", r.key));
        let lz = self
            .lazy
            .as_ref()
            .ok_or_else(|| fail("this snapshotter serves no lazy images".into()))?;
        let t = lazy::Target::of(&r.labels)
            .ok_or_else(|| fail("its labels name no image layer".into()))?
            .map_err(fail)?;
        let plan = self.plans.plan(&t.reference, lz).map_err(fail)?;
        let (blobs, diff_ids) = match &plan.kind {
            LazyKind::Indexed(img) => (&img.resolved.layers, &img.diff_ids),
            LazyKind::Toc(img) => (&img.resolved.layers, &img.diff_ids),
            _ => {
                return Err(fail(format!(
                    "{} is no longer served through an index or tables of contents",
                    t.reference
                )))
            }
        };
        let blobs: Vec<_> = blobs.iter().map(|l| l.digest.clone()).collect();
        let n = lazy::check(&t, &blobs, diff_ids).map_err(fail)?.len();
        let (digest, absent) = self.write_chain(r.id, &plan.kind, n).map_err(|e| {
            let _ = self.remove_tag(r.id);
            fail(e)
        })?;
        let mut built = r.clone();
        built.image = Some(digest);
        built.deferred = false;
        if let Err(e) = state::save(&self.root, &built) {
            let _ = self.remove_tag(r.id);
            return Err(internal(e));
        }
        inner.by_key.insert(built.key.clone(), built.clone());
        eprintln!(
            "tilefs snapshotter: {:?}: image of layer {n} of {} made, {absent} files to fetch on first read ({:.2} s)",
            r.key,
            t.reference,
            started.elapsed().as_secs_f64()
        );
        Ok(built)
    }

    fn new_id(&self) -> u64 {
        let mut inner = self.lock();
        inner.next_id += 1;
        inner.next_id - 1
    }

    /// The record of a committed snapshot made lazily.
    fn lazy_record(
        id: u64,
        name: &str,
        parent: &str,
        labels: &HashMap<String, String>,
        image: Option<String>,
        indexed: bool,
    ) -> Record {
        let now = SystemTime::now();
        Record {
            id,
            key: name.to_string(),
            kind: SnapKind::Committed,
            parent: parent.to_string(),
            labels: labels.clone(),
            created: now,
            updated: now,
            usage: Some(layer::LayerUsage::default()),
            image,
            unsynced: false,
            pending: false,
            lazy: true,
            kept: false,
            indexed,
            deferred: false,
        }
    }

    /// Saves and keeps `r`, unless a snapshot of its name was made
    /// meanwhile (by another Prepare): whether it was. With `mount`, its
    /// image's FUSE server starts now, while containerd prepares the
    /// other layers, not when the container's Mounts comes.
    fn insert_lazy(self: &Arc<Self>, r: Record, mount: bool) -> Result<bool, String> {
        let mut inner = self.lock();
        if inner.by_key.contains_key(&r.key) {
            return Ok(false);
        }
        state::save(&self.root, &r)?;
        inner.by_key.insert(r.key.clone(), r.clone());
        drop(inner);
        if mount {
            let me = self.clone();
            std::thread::spawn(move || {
                // Locks in the order Mounts takes them; a Remove that came
                // first leaves nothing to mount, one after waits for this.
                let inner = me.lock();
                if inner.by_key.get(&r.key).is_none_or(|x| x.id != r.id) {
                    return;
                }
                let lock = me.mount_lock(r.id);
                let _one = lock.lock().unwrap_or_else(|e| e.into_inner());
                drop(inner);
                if let Err(e) = me.mount_image(&r) {
                    eprintln!("tilefs snapshotter: {:?}: {}", r.key, e.msg);
                }
            });
        }
        Ok(true)
    }

    /// Makes `name` the lazy snapshot containerd's walk for chain ID
    /// `target` over `parent` is shown. A claim of another name that no
    /// walk took up yet is waited for first (for at most [`CLAIM_WAIT`]):
    /// two Prepares of one artifact from two references, whatever their
    /// order, each get their own.
    fn claim_lazy(&self, target: &str, parent: &str, name: &str) {
        let key = (target.to_string(), parent.to_string());
        let deadline = std::time::Instant::now() + CLAIM_WAIT;
        let mut claims = self.lazy_claims.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let now = std::time::Instant::now();
            match claims.get(&key) {
                Some(c) if c.name != name && !c.walked && now < deadline => {
                    claims = self
                        .walked
                        .wait_timeout(claims, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                _ => break,
            }
        }
        claims.insert(
            key,
            LazyClaim {
                name: name.to_string(),
                walked: false,
            },
        );
    }

    fn send(&self, job: Job) {
        if let Some(tx) = self.jobs.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = tx.send(job);
        }
    }

    /// The mounts of active snapshot or view `key`, once its chain's layers
    /// are stored; an unpack's (containerd's key `extract-…`) at once, over
    /// the pending uppers. A layer the worker failed to store is tried
    /// again once.
    fn mounts_when_ready<'a>(
        &'a self,
        mut inner: std::sync::MutexGuard<'a, Inner>,
        key: &str,
    ) -> Result<Vec<Mount>, Error> {
        let mut retried = false;
        loop {
            let r = inner.by_key.get(key).cloned().ok_or_else(|| not_found(key))?;
            let mut pending = Vec::new();
            let mut at = r.parent.clone();
            while let Some(p) = inner.by_key.get(&at) {
                if p.pending {
                    pending.push(p.id);
                }
                at = p.parent.clone();
            }
            if pending.is_empty() {
                return self.mounts_of(&mut inner, &r);
            }
            let failed: Vec<u64> = pending
                .iter()
                .filter(|id| inner.failed.contains_key(id))
                .copied()
                .collect();
            if !failed.is_empty() {
                if retried {
                    let why = failed
                        .iter()
                        .filter_map(|id| inner.failed.get(id))
                        .cloned()
                        .collect::<Vec<_>>();
                    return Err(internal(format!(
                        "snapshot {key:?}: a layer below it could not be stored: {}",
                        why.join("; ")
                    )));
                }
                retried = true;
                for id in failed {
                    inner.failed.remove(&id);
                    self.send(Job::Ingest(id));
                }
            }
            let unpack =
                r.kind == SnapKind::Active && key.rsplit('/').next().is_some_and(|k| k.starts_with("extract-"));
            if unpack {
                return self.mounts_of(&mut inner, &r);
            }
            inner = self.changed.wait(inner).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The mounts of an active snapshot or a view: one overlay over its
    /// parent's image, or over the pending uppers of its chain and the
    /// image below them.
    fn mounts_of(&self, inner: &mut Inner, r: &Record) -> Result<Vec<Mount>, Error> {
        let dir = state::snapshot_dir(&self.root, r.id);
        let fs = dir.join("fs");
        if r.parent.is_empty() && r.kind == SnapKind::View {
            return Ok(vec![Mount {
                r#type: "bind".into(),
                source: fs.to_string_lossy().into_owned(),
                target: String::new(),
                options: vec!["ro".into(), "rbind".into()],
            }]);
        }
        if r.parent.is_empty() {
            // An overlay over an empty directory rather than a bind mount:
            // overlayfs marks its upper directory in use while it lives,
            // which a Commit asks (see `claim`) before it moves a file.
            return Ok(vec![Mount {
                r#type: "overlay".into(),
                source: "overlay".into(),
                target: String::new(),
                options: vec![
                    format!("workdir={}", dir.join("work").display()),
                    format!("upperdir={}", fs.display()),
                    format!("lowerdir={}", self.root.join(state::EMPTY).display()),
                ],
            }]);
        }
        let mut lowers = Vec::new();
        let mut uppers = Vec::new();
        // The store is the data-only lower of EROFS images; a lazy image's
        // FUSE mount serves its files itself.
        let mut data_only = true;
        let mut at = r.parent.clone();
        while !at.is_empty() {
            let p = inner
                .by_key
                .get(&at)
                .ok_or_else(|| internal(format!("snapshot {:?}: its ancestor {at:?} is gone", r.key)))?;
            if p.pending || p.kept {
                if p.pending {
                    uppers.push(p.id);
                }
                lowers.push(state::snapshot_dir(&self.root, p.id).join("fs"));
                at = p.parent.clone();
            } else {
                // Its image holds all below it.
                let owner = Self::image_owner(inner, p).clone();
                data_only = !p.lazy;
                lowers.push(self.ensure_mounted(inner, &owner)?);
                break;
            }
        }
        if !uppers.is_empty() {
            inner.lower_users.insert(r.id, uppers);
        }
        if r.kind == SnapKind::View && !data_only && lowers.len() == 1 {
            // overlayfs wants two layers without an upper one: the lazy
            // image's mount, read-only, is the view.
            return Ok(vec![Mount {
                r#type: "bind".into(),
                source: lowers[0].display().to_string(),
                target: String::new(),
                options: vec!["ro".into(), "rbind".into()],
            }]);
        }
        let mut options = Vec::new();
        if r.kind == SnapKind::Active {
            options.push(format!("workdir={}", dir.join("work").display()));
            options.push(format!("upperdir={}", fs.display()));
        }
        let lowers: Vec<String> = lowers.iter().map(|l| l.display().to_string()).collect();
        if data_only {
            options.push(format!("lowerdir={}::{}", lowers.join(":"), self.store.display()));
        } else {
            options.push(format!("lowerdir={}", lowers.join(":")));
        }
        options.push("metacopy=on".into());
        options.push("redirect_dir=on".into());
        Ok(vec![Mount {
            r#type: "overlay".into(),
            source: "overlay".into(),
            target: String::new(),
            options,
        }])
    }

    /// The committed snapshot's chain image, mounted (EROFS, read-only)
    /// under `ROOT/mnt/ID`; made first if it was deferred.
    fn ensure_mounted(&self, inner: &mut Inner, r: &Record) -> Result<PathBuf, Error> {
        let lock = self.mount_lock(r.id);
        let _one = lock.lock().unwrap_or_else(|e| e.into_inner());
        if r.deferred {
            let built = self.build_deferred(inner, r)?;
            return self.mount_image(&built);
        }
        self.mount_image(r)
    }

    fn mount_lock(&self, id: u64) -> Arc<Mutex<()>> {
        self.mounting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(id)
            .or_default()
            .clone()
    }

    /// [`Shared::ensure_mounted`], its mount lock held.
    fn mount_image(&self, r: &Record) -> Result<PathBuf, Error> {
        let mnt = state::mount_dir(&self.root, r.id);
        if tilefs_mount::is_mount_root(&mnt) {
            return Ok(mnt);
        }
        let store = Store::open(&self.store).map_err(internal)?;
        let image = owned::root_path(&store, &self.holder, &self.tag(r.id));
        std::fs::create_dir_all(&mnt).map_err(|e| internal(format!("{}: cannot create: {e}", mnt.display())))?;
        if r.lazy {
            let lz = self.lazy.as_ref().ok_or_else(|| {
                internal(format!(
                    "snapshot {:?} was made lazily, and this snapshotter serves no lazy images",
                    r.key
                ))
            })?;
            let reference = lazy::Target::of(&r.labels).and_then(Result::ok).map(|t| t.reference);
            (lz.mount)(&self.store, &image.to_string_lossy(), &mnt, reference.as_ref())
                .map_err(|e| internal(format!("snapshot {:?}: cannot mount its image: {e}", r.key)))?;
            return Ok(mnt);
        }
        tilefs_mount::mount_erofs_at(&image, &mnt, tilefs_mount::ErofsBacking::Auto)
            .map_err(|e| internal(format!("snapshot {:?}: cannot mount its image: {e}", r.key)))?;
        Ok(mnt)
    }

    fn mounts(&self, key: &str) -> Result<Vec<Mount>, Error> {
        let inner = self.lock();
        let r = inner.by_key.get(key).ok_or_else(|| not_found(key))?;
        if r.kind == SnapKind::Committed {
            return Err(Error::new(
                Code::FailedPrecondition,
                format!("snapshot {key:?} is committed: it has no mounts (prepare or view one on it)"),
            ));
        }
        self.mounts_when_ready(inner, key)
    }

    /// The committed snapshot whose tag and mount hold `r`'s image: `r`,
    /// or for a layer made lazily the artifact's first layer (every layer
    /// of an artifact shows its whole image; the first goes last, as a
    /// parent outlives its children).
    fn image_owner<'a>(inner: &'a Inner, r: &'a Record) -> &'a Record {
        let mut at = r;
        while at.lazy && !at.indexed {
            match inner.by_key.get(&at.parent) {
                Some(p) if p.lazy => at = p,
                _ => break,
            }
        }
        at
    }

    /// AlreadyExists if a snapshot is named `key`.
    fn name_free(inner: &Inner, key: &str) -> Result<(), Error> {
        if inner.by_key.contains_key(key) {
            return Err(Error::new(
                Code::AlreadyExists,
                format!("snapshot {key:?} already exists"),
            ));
        }
        Ok(())
    }

    /// Active snapshot `r`'s record as committed snapshot `name`.
    fn committed(r: &Record, name: &str, labels: HashMap<String, String>) -> Record {
        let mut r = r.clone();
        r.key = name.to_string();
        r.kind = SnapKind::Committed;
        r.labels = labels;
        r.updated = SystemTime::now();
        r
    }

    /// The switch of a Commit: active snapshot `key` becomes `r`, on the
    /// disk first (from there it is committed), then in the map.
    fn switch(&self, inner: &mut Inner, key: &str, r: Record) -> Result<(), Error> {
        state::save(&self.root, &r).map_err(internal)?;
        inner.by_key.remove(key);
        inner.lower_users.remove(&r.id);
        inner.by_key.insert(r.key.clone(), r);
        Ok(())
    }

    /// Whether a snapshot made lazily is at or below `parent`.
    fn over_lazy(inner: &Inner, parent: &str) -> bool {
        let mut at = parent;
        while let Some(p) = inner.by_key.get(at) {
            if p.lazy {
                return true;
            }
            at = &p.parent;
        }
        false
    }

    /// Committed ancestors of `parent`, the oldest first.
    fn chain(inner: &Inner, parent: &str) -> Result<Vec<u64>, Error> {
        let mut ids = Vec::new();
        let mut at = parent.to_string();
        while !at.is_empty() {
            let r = inner
                .by_key
                .get(&at)
                .ok_or_else(|| internal(format!("snapshot {at:?} of a chain is gone")))?;
            ids.push(r.id);
            at = r.parent.clone();
            if ids.len() > 100_000 {
                return Err(internal("a chain of snapshots that loops"));
            }
        }
        ids.reverse();
        Ok(ids)
    }

    /// Commits active snapshot `key` as `name`: the record switched, in
    /// one rename; the worker stores the layer after.
    fn commit(&self, name: String, key: String, labels: HashMap<String, String>) -> Result<(), Error> {
        if name.is_empty() {
            return Err(Error::new(Code::InvalidArgument, "a snapshot name must not be empty"));
        }
        let mut inner = self.lock();
        let r = inner.by_key.get(&key).ok_or_else(|| not_found(&key))?;
        if r.kind != SnapKind::Active {
            return Err(Error::new(
                Code::FailedPrecondition,
                format!("snapshot {key:?} is not active: only an active snapshot is committed"),
            ));
        }
        Self::name_free(&inner, &name)?;
        if Self::over_lazy(&inner, &r.parent) {
            let id = r.id;
            drop(inner);
            return self.commit_kept(name, key, id, labels);
        }
        let mut r = Self::committed(r, &name, labels);
        r.pending = true;
        let id = r.id;
        self.switch(&mut inner, &key, r)?;
        drop(inner);
        self.send(Job::Ingest(id));
        self.send(Job::Reap);
        Ok(())
    }

    /// Commits active snapshot `key` (snapshot `id`), which is over an
    /// image served lazily, as `name`: its upper directory is kept as its
    /// layer, on the disk before the record says so.
    fn commit_kept(&self, name: String, key: String, id: u64, labels: HashMap<String, String>) -> Result<(), Error> {
        let dir = state::snapshot_dir(&self.root, id);
        let fs = dir.join("fs");
        std::fs::File::open(&fs)
            .and_then(|f| Ok(rustix::fs::syncfs(&f)?))
            .map_err(|e| internal(format!("{}: cannot sync: {e}", fs.display())))?;
        let (size, inodes) = disk_usage(&fs);
        let mut inner = self.lock();
        // Checked again: the lock was let go for the sync.
        let r = inner
            .by_key
            .get(&key)
            .filter(|r| r.id == id && r.kind == SnapKind::Active)
            .ok_or_else(|| not_found(&key))?;
        Self::name_free(&inner, &name)?;
        let mut r = Self::committed(r, &name, labels);
        r.kept = true;
        r.usage = Some(layer::LayerUsage { size, inodes });
        self.switch(&mut inner, &key, r)?;
        drop(inner);
        // overlayfs's work directory is of no use to a committed layer.
        let _ = std::fs::remove_dir_all(dir.join("work"));
        Ok(())
    }

    /// The worker: stores pending snapshot `id`'s layer and makes its
    /// chain's image, then marks it stored. A failure gives its upper
    /// directory back as it was (see [`Shared::undo_commit`]) and is
    /// remembered for the mounts that need it.
    fn ingest(self: &Arc<Self>, id: u64) {
        let (key, chain) = {
            let mut inner = self.lock();
            let Some(r) = inner.by_key.values().find(|r| r.id == id && r.pending).cloned() else {
                return;
            };
            let chain = match Self::chain(&inner, &r.parent) {
                Ok(c) => c,
                Err(e) => {
                    inner.failed.insert(id, e.msg);
                    self.changed.notify_all();
                    return;
                }
            };
            inner.ingesting = Some(id);
            (r.key, chain)
        };
        let started = std::time::Instant::now();
        // A stop during an earlier try left files half moved: back first.
        let built = self
            .undo_commit(id)
            .map_err(internal)
            .and_then(|()| self.build(id, &chain));
        let mut inner = self.lock();
        let done = built.and_then(|(digest, usage)| {
            let mut r = inner
                .by_key
                .get(&key)
                .filter(|r| r.id == id)
                .cloned()
                .ok_or_else(|| not_found(&key))?;
            r.pending = false;
            r.unsynced = true;
            r.usage = Some(usage);
            r.image = Some(digest.clone());
            state::save(&self.root, &r).map_err(internal)?;
            inner.by_key.insert(key.clone(), r);
            eprintln!(
                "tilefs snapshotter: stored {key:?}: {} entries, {} bytes of files, image {} ({:.2} s)",
                usage.inodes,
                usage.size,
                &digest[..12],
                started.elapsed().as_secs_f64()
            );
            Ok(())
        });
        if let Err(e) = done {
            let mut msg = e.msg;
            if let Err(u) = self.undo_commit(id) {
                msg = format!("{msg}; and giving its files back failed (the next start retries): {u}");
            }
            eprintln!("tilefs snapshotter: storing {key:?} failed: {msg}");
            inner.failed.insert(id, msg);
        }
        inner.ingesting = None;
        self.changed.notify_all();
        drop(inner);
        self.reap();
        // The layer's writeback, later: a sync now would make every fsync
        // (the next Commit's record) wait for it. The kernel writes dirty
        // data back after about as long anyway.
        let me = self.clone();
        std::thread::spawn(move || {
            std::thread::sleep(SYNC_DELAY);
            me.sync_committed()
        });
    }

    /// Removes the upper and work directories of stored snapshots that no
    /// unpack's mount uses, and what is left of removed snapshots, but for
    /// upper directories a live overlay has (asked again a minute after).
    fn reap(&self) {
        const RETRY: std::time::Duration = std::time::Duration::from_secs(60);
        let todo: Vec<(u64, bool)> = {
            let inner = self.lock();
            let used: HashSet<u64> = inner.lower_users.values().flatten().copied().collect();
            let known: HashSet<u64> = inner.by_key.values().map(|r| r.id).collect();
            let leftovers = inner
                .by_key
                .values()
                .filter(|r| r.kind == SnapKind::Committed && !r.pending && !r.kept && !used.contains(&r.id))
                .map(|r| (r.id, false));
            // Read under the lock: a snapshot's directory and record are
            // made together under it.
            let gone = ids_in(&self.root, state::SNAPSHOTS)
                .into_iter()
                .filter(|id| !known.contains(id) && inner.ingesting != Some(*id))
                .map(|id| (id, true));
            leftovers
                .chain(gone)
                .filter(|(id, _)| {
                    let d = state::snapshot_dir(&self.root, *id);
                    d.join("fs").exists() || d.join("work").exists() || !known.contains(id)
                })
                .filter(|(id, _)| inner.in_use.get(id).is_none_or(|t| t.elapsed() >= RETRY))
                .collect()
        };
        for (id, gone) in todo {
            let d = state::snapshot_dir(&self.root, id);
            let removed = if gone {
                match remove_snapshot_dir(&d) {
                    Ok(()) => !d.exists(),
                    Err(e) => {
                        eprintln!("tilefs snapshotter: {e}");
                        false
                    }
                }
            } else {
                remove_leftovers(&d)
            };
            let mut inner = self.lock();
            if removed {
                inner.in_use.remove(&id);
            } else {
                inner.in_use.insert(id, std::time::Instant::now());
            }
        }
    }

    /// Syncs the store's and the root's filesystems, then marks the
    /// committed snapshots that were unsynced before as synced. One at a
    /// time; a sync that finds nothing to do returns at once.
    fn sync_committed(&self) {
        let _one = self.syncing.lock().unwrap_or_else(|e| e.into_inner());
        let ids: HashSet<u64> = self
            .lock()
            .by_key
            .values()
            .filter(|r| r.unsynced)
            .map(|r| r.id)
            .collect();
        if ids.is_empty() {
            return;
        }
        for p in [&self.store, &self.root] {
            if let Err(e) = std::fs::File::open(p).and_then(|f| Ok(rustix::fs::syncfs(&f)?)) {
                eprintln!("tilefs snapshotter: {}: cannot sync: {e}", p.display());
                return;
            }
        }
        let mut inner = self.lock();
        for r in inner.by_key.values_mut().filter(|r| r.unsynced && ids.contains(&r.id)) {
            let mut synced = r.clone();
            synced.unsynced = false;
            match state::save(&self.root, &synced) {
                Ok(()) => *r = synced,
                Err(e) => eprintln!("tilefs snapshotter: {e}"),
            }
        }
    }

    /// At start: committed snapshots whose sync a crash prevented. Their
    /// objects are checked against their digests (a power loss may have
    /// left names without their bytes); damaged ones are removed, so that
    /// no later layer is deduplicated against them, and the snapshot is
    /// named.
    fn check_unsynced(&self) {
        let todo: Vec<(u64, String)> = self
            .lock()
            .by_key
            .values()
            .filter(|r| r.unsynced && r.kind == SnapKind::Committed)
            .map(|r| (r.id, r.key.clone()))
            .collect();
        if todo.is_empty() {
            return;
        }
        let store = match Store::open(&self.store) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("tilefs snapshotter: {e}");
                return;
            }
        };
        for (id, key) in todo {
            let entries = match state::load_layer(&self.root, id) {
                Ok(e) => e,
                Err(e) => {
                    eprintln!("tilefs snapshotter: snapshot {key:?}: {e}");
                    continue;
                }
            };
            let mut damaged = 0usize;
            for e in entries {
                let tilefs_oci::layer::Kind::File {
                    content: tilefs_oci::layer::Content::Object(d),
                    ..
                } = e.kind
                else {
                    continue;
                };
                let p = store.object_path(&d);
                let good = std::fs::File::open(&p)
                    .and_then(|f| tilefs_image::verity::digest_file(&f, |_| {}))
                    .is_ok_and(|x| x == d);
                if !good {
                    damaged += 1;
                    let _ = std::fs::remove_file(&p);
                }
            }
            if damaged > 0 {
                eprintln!(
                    "tilefs snapshotter: snapshot {key:?}: {damaged} of its files did not reach the disk before a \
                     crash and were removed from the store: remove its image and pull it again"
                );
            }
        }
        self.sync_committed();
    }

    /// Undoes what a Commit of snapshot `id` that failed (or crashed) did:
    /// its tag and layer record removed, its files given back as they were
    /// ([`layer::restore`]), then the journal removed.
    fn undo_commit(&self, id: u64) -> Result<(), String> {
        self.remove_tag(id).map_err(|e| e.msg)?;
        let dir = state::snapshot_dir(&self.root, id);
        let journal = dir.join(state::UNDO);
        match std::fs::read(&journal) {
            Ok(bytes) => {
                let undo: Vec<layer::Undo> = postcard::from_bytes(&bytes)
                    .map_err(|e| format!("{}: not a commit journal: {e}", journal.display()))?;
                layer::restore(&dir.join("fs"), &undo)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{}: cannot read: {e}", journal.display())),
        }
        let _ = std::fs::remove_file(dir.join("layer"));
        match std::fs::remove_file(&journal) {
            Ok(()) => state::sync_dir(&dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("{}: cannot remove: {e}", journal.display())),
        }
    }

    /// Makes snapshot `id`'s layer and its chain's image: files moved into
    /// the store, entries recorded, image tagged. Returns the image's
    /// digest (hex) and the layer's usage.
    fn build(&self, id: u64, chain: &[u64]) -> Result<(String, layer::LayerUsage), Error> {
        let store = Store::open(&self.store).map_err(internal)?;
        let dir = state::snapshot_dir(&self.root, id);
        let upper = dir.join("fs");
        // Files are moved only out of an upper directory no live overlay
        // has (an unpack's, which containerd's differ wrote and closed),
        // held from overlayfs while they move; a running container's
        // Commit copies them and leaves its upper directory to it.
        let claimed = match claim::claim(&upper, &dir.join(state::CLAIM)) {
            Ok(claim::Upper::Free(c)) => Some(c),
            Ok(claim::Upper::InUse) => None,
            Err(e) => {
                eprintln!("tilefs snapshotter: snapshot {id}: {e}: its files are copied");
                None
            }
        };
        let method = if claimed.is_some() { Method::Move } else { Method::Copy };
        // Held until the tag is written: no gc removes the new objects.
        let mut ingest = Ingest::new(&store, method).map_err(internal)?;
        // Synced after the Commit (see `sync_committed`).
        ingest.defer_sync();
        let made = self.build_with(&store, &ingest, id, chain, &dir, &upper);
        let (image, usage, (t0, t1, t2)) = match made {
            Ok(m) => m,
            Err(e) => {
                // Objects stored before the failure (a batch committed,
                // the image not tagged) go as a Remove's would, once no
                // root names them.
                let objects = ingest.imported();
                drop(ingest);
                self.collector.add(objects);
                return Err(e);
            }
        };
        let copied = ingest.stats.copied.load(std::sync::atomic::Ordering::Relaxed);
        drop(ingest);
        drop(claimed);
        // Where a Commit's time goes, for whoever tunes it.
        eprintln!(
            "tilefs snapshotter: snapshot {id}: chain of {} read in {:.2} s, layer read and its files stored in {:.2} s \
             ({}), image written in {:.2} s",
            chain.len(),
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            match (method, copied) {
                (Method::Copy, _) => "copied: a live overlay has its upper directory".to_string(),
                (_, 0) => "moved".to_string(),
                (_, n) => format!("moved, but {n} copied: linked elsewhere or open for writing"),
            },
            t2.elapsed().as_secs_f64()
        );
        Ok((hex::encode(image.digest), usage))
    }

    /// [`Shared::build`]'s work through `ingest`: the image, the layer's
    /// usage, and when its steps began.
    fn build_with(
        &self,
        store: &Store,
        ingest: &Ingest,
        id: u64,
        chain: &[u64],
        dir: &Path,
        upper: &Path,
    ) -> Result<(tilefs_image::erofs::Image, layer::LayerUsage, BuildTimes), Error> {
        let t0 = std::time::Instant::now();
        let mut applier = Applier::new(false);
        for &a in chain {
            let entries = state::load_layer(&self.root, a).map_err(internal)?;
            applier
                .apply_layer(&format!("snapshot {a}"), entries)
                .map_err(|e| internal(format!("snapshot {a}: {e}")))?;
        }
        let journal = |undo: &[layer::Undo]| {
            let bytes = postcard::to_stdvec(undo).map_err(|e| format!("cannot encode the commit journal: {e}"))?;
            state::write_atomic(&dir.join(state::UNDO), &bytes)
        };
        let t1 = std::time::Instant::now();
        let (mut entries, usage) = layer::read_upper(upper, ingest, applier.tree_mut(), journal)
            .map_err(|e| internal(format!("commit: {e}")))?;
        let t2 = std::time::Instant::now();
        // overlayfs may leave whiteouts of names no layer below holds.
        let tree = applier.tree_mut();
        entries.retain(|e| {
            !matches!(e.kind, tilefs_oci::layer::Kind::Whiteout) || tree.lookup_path(&e.path.join(&b'/')).is_some()
        });
        state::save_layer(&self.root, id, &entries).map_err(internal)?;
        applier
            .apply_layer(&format!("snapshot {id}"), entries)
            .map_err(|e| internal(format!("commit: {e}")))?;
        let (_, image) =
            compat::write_image(applier).map_err(|e| internal(format!("commit: cannot write the image: {e}")))?;
        ingest.finish().map_err(internal)?;
        owned::write_root(store, &self.holder, &self.tag(id), &image.bytes).map_err(internal)?;
        Ok((image, usage, (t0, t1, t2)))
    }

    /// Lets go of snapshot `id`'s image (if it has one).
    fn remove_tag(&self, id: u64) -> Result<(), Error> {
        let store = Store::open(&self.store).map_err(internal)?;
        owned::remove_root(&store, &self.holder, &self.tag(id))
            .map(drop)
            .map_err(internal)
    }

    /// Lets go of snapshot `id`'s image, its objects handed to the
    /// collector.
    fn release_image(&self, id: u64) -> Result<(), Error> {
        let store = Store::open(&self.store).map_err(internal)?;
        // An image that cannot be read frees nothing it would name.
        let objects = owned::read_root(&store, &self.holder, &self.tag(id))
            .ok()
            .flatten()
            .and_then(|bytes| tilefs_store::gc::objects_of(&bytes).ok());
        self.remove_tag(id)?;
        if let Some(objects) = objects {
            self.collector.add(objects);
        }
        Ok(())
    }

    fn remove(&self, key: &str) -> Result<(), Error> {
        let mut inner = self.lock();
        // Not while the worker stores it.
        while inner
            .ingesting
            .is_some_and(|i| inner.by_key.get(key).is_some_and(|r| r.id == i))
        {
            inner = self.changed.wait(inner).unwrap_or_else(|e| e.into_inner());
        }
        let r = inner.by_key.get(key).ok_or_else(|| not_found(key))?;
        if let Some(child) = inner.by_key.values().find(|c| c.parent == key) {
            return Err(Error::new(
                Code::FailedPrecondition,
                format!("snapshot {key:?} has a child ({:?}): remove it first", child.key),
            ));
        }
        let id = r.id;
        let committed = r.kind == SnapKind::Committed;
        // The record first: from here the snapshot is gone, whatever of it
        // a crash leaves (Cleanup removes that).
        state::delete(&self.root, id).map_err(internal)?;
        inner.by_key.remove(key);
        inner.failed.remove(&id);
        self.lazy_claims
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, c| c.name != key);
        inner.lower_users.remove(&id);
        drop(inner);
        if committed {
            let lock = self.mount_lock(id);
            let _one = lock.lock().unwrap_or_else(|e| e.into_inner());
            unmount(&state::mount_dir(&self.root, id));
            self.mounting.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            self.release_image(id)?;
        }
        let removed = remove_snapshot_dir(&state::snapshot_dir(&self.root, id)).map_err(internal);
        // Upper directories this one held as lowers, or that were in use,
        // may be free now.
        self.send(Job::Reap);
        removed
    }

    fn stat(&self, key: &str) -> Result<Info, Error> {
        let inner = self.lock();
        inner.by_key.get(key).map(info_of).ok_or_else(|| not_found(key))
    }

    fn update(&self, info: Info, paths: Option<Vec<String>>) -> Result<Info, Error> {
        let mut inner = self.lock();
        let key = info.name.clone();
        let r = inner.by_key.get(&key).ok_or_else(|| not_found(&key))?;
        let mut r = r.clone();
        let paths = paths.unwrap_or_default();
        if paths.is_empty() {
            r.labels = info.labels;
        } else {
            for p in &paths {
                if p == "labels" {
                    r.labels = info.labels.clone();
                } else if let Some(l) = p.strip_prefix("labels.") {
                    match info.labels.get(l) {
                        Some(v) => r.labels.insert(l.to_string(), v.clone()),
                        None => r.labels.remove(l),
                    };
                } else {
                    return Err(Error::new(
                        Code::InvalidArgument,
                        format!("cannot update field {p:?} of snapshot {key:?} (only labels can be)"),
                    ));
                }
            }
        }
        r.updated = SystemTime::now();
        state::save(&self.root, &r).map_err(internal)?;
        let out = info_of(&r);
        inner.by_key.insert(key, r);
        Ok(out)
    }

    fn usage(&self, key: &str) -> Result<Usage, Error> {
        let (kind, id, stored, pending) = {
            let inner = self.lock();
            let r = inner.by_key.get(key).ok_or_else(|| not_found(key))?;
            (r.kind, r.id, r.usage, r.pending)
        };
        match kind {
            SnapKind::Committed if !pending => {
                let u = stored.unwrap_or_default();
                Ok(Usage {
                    size: u.size,
                    inodes: u.inodes,
                })
            }
            _ => {
                let (size, inodes) = disk_usage(&state::snapshot_dir(&self.root, id).join("fs"));
                Ok(Usage { size, inodes })
            }
        }
    }

    /// The snapshots `filters` match. A walk for a chain ID label
    /// (containerd's, after AlreadyExists) is shown, of the snapshots made
    /// lazily for one chain ID and parent, only the one claimed last (see
    /// [`Shared::claim_lazy`]), and takes up that claim; other lists (gc's)
    /// show all.
    fn list(&self, filters: &[String]) -> Result<Vec<Info>, Error> {
        let f = filter::Filter::parse(filters).map_err(|e| Error::new(Code::InvalidArgument, e))?;
        let walk = filters.iter().any(|f| f.contains(lazy::LABEL_TARGET));
        let inner = self.lock();
        let mut claims = self.lazy_claims.lock().unwrap_or_else(|e| e.into_inner());
        let claim_of = |r: &Record| {
            let target = r.labels.get(lazy::LABEL_TARGET).filter(|_| r.lazy)?;
            Some((target.clone(), r.parent.clone()))
        };
        let shown = |r: &Record| !walk || claim_of(r).and_then(|k| claims.get(&k)).is_none_or(|c| c.name == r.key);
        let mut out: Vec<Info> = inner
            .by_key
            .values()
            .filter(|r| shown(r))
            .filter(|r| {
                f.matches(&filter::Fields {
                    name: &r.key,
                    parent: &r.parent,
                    kind: kind_name(r.kind),
                    labels: &r.labels,
                })
            })
            .map(info_of)
            .collect();
        if walk {
            for i in &out {
                let Some(target) = i.labels.get(lazy::LABEL_TARGET) else {
                    continue;
                };
                if let Some(c) = claims.get_mut(&(target.clone(), i.parent.clone())) {
                    c.walked |= c.name == i.name;
                }
            }
            self.walked.notify_all();
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Removes what no record accounts for: directories, mounts and tags of
    /// snapshots removed (or never finished) before a crash, and the upper
    /// directories of committed snapshots.
    fn cleanup(&self) -> Result<(), Error> {
        let inner = self.lock();
        let ids: HashMap<u64, SnapKind> = inner.by_key.values().map(|r| (r.id, r.kind)).collect();
        // A kept layer's work directory that a stop left.
        for r in inner.by_key.values().filter(|r| r.kept) {
            let _ = std::fs::remove_dir_all(state::snapshot_dir(&self.root, r.id).join("work"));
        }
        // Uppers still needed: pending and kept layers', and those under an
        // unpack.
        let mut keep: HashSet<u64> = inner.lower_users.values().flatten().copied().collect();
        keep.extend(inner.by_key.values().filter(|r| r.pending || r.kept).map(|r| r.id));
        let busy: HashSet<u64> = inner.ingesting.into_iter().collect();
        for id in ids_in(&self.root, state::MOUNTS) {
            if ids.get(&id) != Some(&SnapKind::Committed) {
                let m = state::mount_dir(&self.root, id);
                unmount(&m);
                let _ = std::fs::remove_dir(&m);
            }
        }
        for id in ids_in(&self.root, state::SNAPSHOTS) {
            let dir = state::snapshot_dir(&self.root, id);
            match ids.get(&id) {
                None if !busy.contains(&id) => {
                    if let Err(e) = remove_snapshot_dir(&dir) {
                        eprintln!("tilefs snapshotter: {e}");
                    }
                }
                Some(SnapKind::Committed) if !keep.contains(&id) => {
                    remove_leftovers(&dir);
                }
                // A Commit that crashed: its files given back.
                Some(SnapKind::Active) if !busy.contains(&id) && dir.join(state::UNDO).exists() => {
                    if let Err(e) = self.undo_commit(id) {
                        eprintln!("tilefs snapshotter: snapshot {id}: {e}");
                    }
                }
                _ => {}
            }
        }
        let store = Store::open(&self.store).map_err(internal)?;
        let held = owned::scan(&store).map_err(internal)?;
        let ours = held.owners.iter().filter(|o| o.id == self.holder.id());
        for t in ours.flat_map(|o| &o.roots) {
            let Some(id) = t
                .name
                .strip_prefix(&self.tag_prefix)
                .and_then(|i| i.parse::<u64>().ok())
            else {
                continue;
            };
            if ids.get(&id) != Some(&SnapKind::Committed) && !busy.contains(&id) {
                let _ = self.release_image(id);
            }
        }
        Ok(())
    }
}

/// Removes a snapshot's upper and work directories and its commit journal
/// (a committed snapshot's files are in the store now), unless a live
/// overlay has them: a container's, whose snapshot was committed or
/// removed under it, which goes on writing there as under containerd's
/// overlayfs snapshotter. Those stay until a later reap finds them free.
/// Whether they are gone.
fn remove_leftovers(dir: &Path) -> bool {
    let fs = dir.join("fs");
    // Held while they go: no overlay takes them meanwhile.
    let _claim = if fs.exists() {
        match claim::claim(&fs, &dir.join(state::CLAIM)) {
            Ok(claim::Upper::Free(c)) => Some(c),
            Ok(claim::Upper::InUse) => return false,
            Err(e) => {
                eprintln!("tilefs snapshotter: {e}: kept as if it were in use");
                return false;
            }
        }
    } else {
        None
    };
    let _ = std::fs::remove_file(dir.join(state::UNDO));
    for sub in ["fs", "work"] {
        let p = dir.join(sub);
        if let Err(e) = std::fs::remove_dir_all(&p) {
            if e.kind() != std::io::ErrorKind::NotFound {
                eprintln!("tilefs snapshotter: {}: cannot remove: {e}", p.display());
            }
        }
    }
    true
}

/// Removes the directory of a snapshot that is gone, but for an upper
/// directory a live overlay has (see [`remove_leftovers`]).
fn remove_snapshot_dir(dir: &Path) -> Result<(), String> {
    if !remove_leftovers(dir) {
        let _ = std::fs::remove_file(dir.join("layer"));
        return Ok(());
    }
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(format!("{}: cannot remove: {e}", dir.display())),
        _ => Ok(()),
    }
}

/// The ids of the entries of `ROOT/sub` (snapshots' or mounts').
fn ids_in(root: &Path, sub: &str) -> Vec<u64> {
    std::fs::read_dir(root.join(sub))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u64>().ok()))
                .collect()
        })
        .unwrap_or_default()
}

fn unmount(m: &Path) {
    if tilefs_mount::is_mount_root(m) {
        if let Err(e) = rustix::mount::unmount(m, rustix::mount::UnmountFlags::DETACH) {
            eprintln!("tilefs snapshotter: {}: cannot unmount: {e}", m.display());
        }
    }
}

/// Bytes (allocated) and inodes below `dir`, each inode counted once,
/// symlinks not followed, other filesystems not entered.
fn disk_usage(dir: &Path) -> (i64, i64) {
    use std::os::unix::fs::MetadataExt;
    let Ok(top) = std::fs::symlink_metadata(dir) else {
        return (0, 0);
    };
    let mut seen = HashSet::new();
    let (mut size, mut inodes) = (0i64, 0i64);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.dev() != top.dev() || !seen.insert(m.ino()) {
                continue;
            }
            inodes += 1;
            size += (m.blocks() * 512) as i64;
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    (size, inodes)
}

#[tonic::async_trait]
impl Snapshotter for Tilefs {
    type Error = Error;

    async fn stat(&self, key: String) -> Result<Info, Error> {
        let s = self.s.clone();
        blocking(move || s.stat(&key)).await
    }

    async fn update(&self, info: Info, fieldpaths: Option<Vec<String>>) -> Result<Info, Error> {
        let s = self.s.clone();
        blocking(move || s.update(info, fieldpaths)).await
    }

    async fn usage(&self, key: String) -> Result<Usage, Error> {
        let s = self.s.clone();
        blocking(move || s.usage(&key)).await
    }

    async fn mounts(&self, key: String) -> Result<Vec<Mount>, Error> {
        let s = self.s.clone();
        blocking(move || s.mounts(&key)).await
    }

    async fn prepare(&self, key: String, parent: String, labels: HashMap<String, String>) -> Result<Vec<Mount>, Error> {
        let s = self.s.clone();
        blocking(move || s.create(key, parent, labels, SnapKind::Active)).await
    }

    async fn view(&self, key: String, parent: String, labels: HashMap<String, String>) -> Result<Vec<Mount>, Error> {
        let s = self.s.clone();
        blocking(move || s.create(key, parent, labels, SnapKind::View)).await
    }

    async fn commit(&self, name: String, key: String, labels: HashMap<String, String>) -> Result<(), Error> {
        let s = self.s.clone();
        blocking(move || s.commit(name, key, labels)).await
    }

    async fn remove(&self, key: String) -> Result<(), Error> {
        let s = self.s.clone();
        blocking(move || s.remove(&key)).await
    }

    async fn clear(&self) -> Result<(), Error> {
        let s = self.s.clone();
        blocking(move || s.cleanup()).await
    }

    type InfoStream = tokio_stream::Iter<std::vec::IntoIter<Result<Info, Error>>>;

    async fn list(&self, _snapshotter: String, filters: Vec<String>) -> Result<Self::InfoStream, Error> {
        let s = self.s.clone();
        let infos = blocking(move || s.list(&filters)).await?;
        Ok(tokio_stream::iter(infos.into_iter().map(Ok).collect::<Vec<_>>()))
    }
}

/// Serves the snapshotter on `cfg.socket` until SIGINT or SIGTERM.
pub fn serve(cfg: &Config, lazy: Option<lazy::Lazy>, ready: impl FnOnce(&Path)) -> Result<(), String> {
    let snap = Tilefs::open(cfg, lazy)?;
    if let Some(link) = &cfg.cri_imagefs {
        match link_imagefs(link, &snap.s.store) {
            Ok(()) => eprintln!(
                "tilefs snapshotter: {} (CRI's image filesystem) leads to the store",
                link.display()
            ),
            Err(e) => eprintln!("tilefs snapshotter: {e}"),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(16)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    rt.block_on(async move {
        let sock = &cfg.socket;
        if let Some(dir) = sock.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: cannot create: {e}", dir.display()))?;
        }
        if std::os::unix::net::UnixStream::connect(sock).is_ok() {
            return Err(format!("{}: another server listens there", sock.display()));
        }
        match std::fs::symlink_metadata(sock) {
            Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
                let _ = std::fs::remove_file(sock);
            }
            Ok(_) => return Err(format!("{}: exists and is no socket", sock.display())),
            Err(_) => {}
        }
        let listener =
            tokio::net::UnixListener::bind(sock).map_err(|e| format!("{}: cannot listen: {e}", sock.display()))?;
        rustix::fs::chmod(sock, rustix::fs::Mode::from_raw_mode(0o600))
            .map_err(|e| format!("{}: cannot set its mode: {e}", sock.display()))?;
        ready(sock);
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shared = snap.s.clone();
        let images = cfg.cri_image_service.as_deref().map(|b| cri::server(b, snap.clone()));
        let mut server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(containerd_snapshots::server(Arc::new(snap)))
                .add_optional_service(images)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                }),
        );
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        let signalled = async {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
            }
        };
        let done = tokio::select! {
            r = &mut server => Some(r),
            _ = signalled => None,
        };
        let done = match done {
            Some(r) => r,
            None => {
                // Requests under way finish; a client that keeps its
                // connection open (idle) does not hold the stop up for long.
                let _ = stop.send(());
                match tokio::time::timeout(STOP_GRACE, &mut server).await {
                    Ok(r) => r,
                    Err(_) => {
                        eprintln!(
                            "tilefs snapshotter: clients still connected {} s after the signal: stopping",
                            STOP_GRACE.as_secs()
                        );
                        server.abort();
                        Ok(Ok(()))
                    }
                }
            }
        };
        let r = match done {
            Ok(r) => r.map_err(|e| format!("{}: serving failed: {e}", sock.display())),
            Err(e) => Err(format!("{}: the server stopped: {e}", sock.display())),
        };
        let _ = std::fs::remove_file(sock);
        // Stopped: what Commits left unsynced is synced now, not checked
        // at the next start.
        shared.sync_committed();
        r
    })
}
