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
//!   index's layer maps); containers on it are kernel overlays over the
//!   image whose objects arrive on their first read (fanotify pre-content
//!   events), or where the store cannot have those, read through a FUSE
//!   mount of the image that fetches files on first read, below their
//!   overlay. A Commit over such
//!   an image keeps its upper directory as its layer (flattening the chain
//!   would fetch the whole image), a lower directory of the mounts above.
//! - Remove gives the space back ([`collect`]): the objects of the images
//!   of removed snapshots are collected a while after the last Remove.
//! - Commit does not wait for the disk: the layer's files (which
//!   containerd wrote without syncing) are synced in the background, and a
//!   committed snapshot is marked synced after. One that a crash left
//!   unsynced has its objects checked at the next start, and damaged ones
//!   removed.

//!
//! The modules: [`snapshots`] is the state machine over containerd's
//! operations, [`backend`] what it asks of the store and the kernel
//! ([`store_backend`] the real one), [`mounts`] what containerd mounts,
//! [`worker`] the storing of committed layers, [`recovery`] what a start
//! finds, [`lazy_snapshots`] CRI's lazy path, [`grpc`] the API containerd
//! calls. The socket and the signals are the front end's (`tilefs
//! snapshotter`).

pub mod backend;
pub mod claim;
pub mod collect;
pub mod cri;
pub mod error;
pub mod filter;
pub mod grpc;
pub mod into_containerd;
pub mod layer;
pub mod lazy;
mod lazy_snapshots;
mod mounts;
mod recovery;
mod snapshots;
pub mod state;
pub mod store_backend;
mod worker;

#[cfg(test)]
mod tests;

pub use error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

pub const DEFAULT_SOCKET: &str = "/run/tilefs/snapshotter.sock";
pub const DEFAULT_ROOT: &str = "/var/lib/tilefs/snapshotter";

/// The snapshotter: a handle on its state machine, shared by its gRPC
/// services.
#[derive(Clone)]
pub struct Tilefs {
    s: Arc<snapshots::Snapshots>,
}

impl Tilefs {
    /// Opens (creating) the snapshotter's root and store, loads the records
    /// and removes what a crash left behind.
    pub fn open(cfg: &Config, lazy: Option<lazy::Lazy>) -> Result<Tilefs> {
        let root = make_root(&cfg.root)?;
        let backend = store_backend::StoreBackend::open(&root, &cfg.store, cfg.gc_delay, lazy.as_ref())?;
        Tilefs::with_backend(root, Box::new(backend), lazy)
    }

    /// The snapshotter rooted at `root` (made by [`make_root`]) over
    /// `backend`.
    pub fn with_backend(root: PathBuf, backend: Box<dyn backend::Backend>, lazy: Option<lazy::Lazy>) -> Result<Tilefs> {
        let s = Arc::new(snapshots::Snapshots::new(root, backend, lazy)?);
        s.check_unsynced();
        s.cleanup()?;
        worker::start(&s)?;
        Ok(Tilefs { s })
    }

    pub fn root(&self) -> &Path {
        &self.s.root
    }

    /// The store its images are in (the data-only lower of their mounts).
    pub fn store(&self) -> &Path {
        self.s.backend.data_lower()
    }

    /// Before CRI's pull of `image` (as CRI names it) goes on to
    /// containerd, through the image service proxy ([`cri`]): the image is
    /// judged by the signature policy (Err: the policy's refusal) and what
    /// its lazy start can go by is found now, for the Prepares that follow;
    /// what an earlier pull of it said is forgotten. Any other failure is
    /// left to containerd's pull (and the Prepares) to meet.
    pub fn before_pull(&self, image: &str) -> Result<()> {
        self.s.before_pull(image)
    }

    /// What became of the image with these repo digests (CRI's), if the
    /// snapshotter knows: how it is served lazily, or why it was pulled
    /// whole.
    pub fn said_of(&self, repo_digests: &[String]) -> Option<(bool, String)> {
        self.s.said_of(repo_digests)
    }

    /// At a stop: what Commits left unsynced is synced now, not checked
    /// at the next start.
    pub fn stop(&self) {
        self.s.sync_committed();
    }
}

/// Makes (if need be) the snapshotter's root `root`, its directories, and
/// its mode root's alone: its canonical path.
pub fn make_root(root: &Path) -> Result<PathBuf> {
    for d in [state::METADATA, state::SNAPSHOTS, state::MOUNTS, state::EMPTY] {
        let p = root.join(d);
        std::fs::create_dir_all(&p).map_err(|e| Error::io(&p, "cannot create", e))?;
    }
    let root = std::fs::canonicalize(root).map_err(|e| Error::io(root, "cannot resolve", e))?;
    // Only root may reach the upper directories and mounts.
    rustix::fs::chmod(&root, rustix::fs::Mode::from_raw_mode(0o700))
        .map_err(|e| Error::io(&root, "cannot set its mode", e.into()))?;
    check_option_safe(&root)?;
    Ok(root)
}

/// A root or store path appears in overlayfs's options, which separate
/// with ':' and ','.
pub(crate) fn check_option_safe(p: &Path) -> Result<()> {
    let s = p.to_string_lossy();
    if s.contains([':', ',', '\n']) || p.to_str().is_none() {
        return Err(Error::Broken(format!(
            "{}: a snapshotter's root and store paths must not hold ':' or ',' (overlayfs options use them)",
            p.display()
        )));
    }
    Ok(())
}

/// Makes `link` a symlink to `store`: the path containerd's CRI plugin
/// reports as the image filesystem of a proxy snapshotter
/// (`crictl imagefsinfo`, the kubelet's image gc, which measures the
/// filesystem that path is on: the store's, where the images are). A
/// symlink elsewhere is replaced; anything else there is left alone.
pub fn link_imagefs(link: &Path, store: &Path) -> Result<()> {
    match std::fs::read_link(link) {
        Ok(to) if to == store => return Ok(()),
        Ok(_) => {}
        Err(_) if std::fs::symlink_metadata(link).is_ok() => {
            return Err(Error::Broken(format!(
                "{}: exists and is no symlink: left as it is (CRI reports it as the image filesystem)",
                link.display()
            )))
        }
        Err(_) => {}
    }
    let dir = link
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "cannot create", e))?;
    let tmp = dir.join(format!(".tilefs-imagefs-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(store, &tmp)
        .and_then(|()| std::fs::rename(&tmp, link))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::Broken(format!(
                "{}: cannot link it to {}: {e}",
                link.display(),
                store.display()
            ))
        })
}
