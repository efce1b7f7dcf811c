//! The real [`Backend`]: layers moved into the shared store ([`layer`]),
//! chains flattened into EROFS images by the code and rules of
//! `tilefs pull`, images held in the store as the snapshotter's
//! ([`tilefs_store::owned`]: gc roots `tilefs untag` does not remove),
//! mounted by the kernel (EROFS; a lazy image's placeholders filled on
//! first access) or by the lazy path's FUSE server.

use crate::backend::{Backend, Hold, Stored};
use crate::error::{Error, Result};
use crate::layer;
use crate::lazy::{How, Lazy, MountFn, Refused};
use crate::state::{self, Record};
use crate::{claim, collect};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tilefs_oci::apply::Applier;
use tilefs_oci::compat;
use tilefs_oci::lazy_index::LazyKind;
use tilefs_oci::pull::PullOptions;
use tilefs_oci::ImageRef;
use tilefs_store::ingest::{Ingest, Method};
use tilefs_store::owned::{self, Holder};
use tilefs_store::{tags, Store};

/// When a store's steps began (reading the chain, the layer, writing the
/// image).
type BuildTimes = (std::time::Instant, std::time::Instant, std::time::Instant);

pub struct StoreBackend {
    /// The snapshotter's root (its snapshots' directories).
    root: PathBuf,
    store: PathBuf,
    /// Who holds the snapshots' images in the store.
    holder: Holder,
    /// Names of the images: this prefix and the snapshot's id.
    tag_prefix: String,
    collector: Arc<collect::Collector>,
    /// How lazy images are mounted (by the front end).
    lazy: Option<LazyMounts>,
}

/// How lazy images are mounted, and what was said of it.
struct LazyMounts {
    mount: Arc<MountFn>,
    /// By the kernel where it can be.
    kernel: Option<How>,
    /// Why the kernel could not, each said once (to the log).
    said: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl StoreBackend {
    /// Opens (creating) `store` for the snapshotter rooted at `root`
    /// (canonical), its images' objects collected `gc_delay` after a
    /// release (None: by `tilefs gc` only).
    pub fn open(
        root: &Path,
        store: &Path,
        gc_delay: Option<std::time::Duration>,
        lazy: Option<&Lazy>,
    ) -> Result<StoreBackend> {
        if !store.exists() {
            Store::create(store)?;
        }
        // Said at each start, as fsck says it: the containers' files are
        // as open as the store.
        if let Some(w) = Store::open(store)?.exposure() {
            tracing::warn!("warning: {w}");
        }
        let store = std::fs::canonicalize(store).map_err(|e| Error::io(store, "cannot resolve", e))?;
        crate::check_option_safe(&store)?;
        let holder = Holder::ContainerdSnapshotter {
            root: root.to_path_buf(),
        };
        let tag_prefix = format!("{}-", holder.id());
        adopt_tags(&store, &holder, &tag_prefix)?;
        let collector = collect::Collector::start(&store, root, gc_delay)?;
        Ok(StoreBackend {
            root: root.to_path_buf(),
            store,
            holder,
            tag_prefix,
            collector,
            lazy: lazy.map(|l| LazyMounts {
                mount: l.mount.clone(),
                kernel: l.kernel.then_some(How::Kernel {
                    fetch_rest: l.fetch_rest,
                }),
                said: Default::default(),
            }),
        })
    }

    fn tag(&self, id: u64) -> String {
        format!("{}{id}", self.tag_prefix)
    }

    fn open_store(&self) -> Result<Store> {
        Ok(Store::open(&self.store)?)
    }

    /// [`Backend::store_layer`]'s work through `ingest`: the image, the
    /// layer's usage, and when its steps began.
    fn build_with(
        &self,
        store: &Store,
        ingest: &Ingest,
        id: u64,
        chain: &[u64],
    ) -> Result<(tilefs_image::erofs::Image, layer::LayerUsage, BuildTimes)> {
        let dir = state::snapshot_dir(&self.root, id);
        let t0 = std::time::Instant::now();
        let mut applier = Applier::new(false);
        for &a in chain {
            let entries = state::load_layer(&self.root, a)?;
            applier
                .apply_layer(&format!("snapshot {a}"), entries)
                .map_err(|e| Error::from(e).context(format!("snapshot {a}")))?;
        }
        let journal = |undo: &[layer::Undo]| {
            let bytes = postcard::to_stdvec(undo)
                .map_err(|e| Error::Broken(format!("cannot encode the commit journal: {e}")))?;
            state::write_atomic(&dir.join(state::UNDO), &bytes)
        };
        let t1 = std::time::Instant::now();
        let (mut entries, usage) =
            layer::read_upper(&dir.join("fs"), ingest, applier.tree_mut(), journal).map_err(|e| e.context("commit"))?;
        let t2 = std::time::Instant::now();
        // overlayfs may leave whiteouts of names no layer below holds.
        let tree = applier.tree_mut();
        entries.retain(|e| {
            !matches!(e.kind, tilefs_oci::layer::Kind::Whiteout) || tree.lookup_path(&e.path.join(&b'/')).is_some()
        });
        state::save_layer(&self.root, id, &entries)?;
        applier
            .apply_layer(&format!("snapshot {id}"), entries)
            .map_err(|e| Error::from(e).context("commit"))?;
        let (_, image) =
            compat::write_image(applier).map_err(|e| Error::Broken(format!("commit: cannot write the image: {e}")))?;
        ingest.finish()?;
        owned::write_root(store, &self.holder, &self.tag(id), &image.bytes)?;
        Ok((image, usage, (t0, t1, t2)))
    }
}

impl Backend for StoreBackend {
    fn store_layer(&self, id: u64, chain: &[u64]) -> Result<Stored> {
        let store = self.open_store()?;
        let dir = state::snapshot_dir(&self.root, id);
        // Files are moved only out of an upper directory no live overlay
        // has (an unpack's, which containerd's differ wrote and closed),
        // held from overlayfs while they move; a running container's
        // Commit copies them and leaves its upper directory to it.
        let claimed = match claim::claim(&dir.join("fs"), &dir.join(state::CLAIM)) {
            Ok(claim::Upper::Free(c)) => Some(c),
            Ok(claim::Upper::InUse) => None,
            Err(e) => {
                tracing::warn!("snapshot {id}: {e}: its files are copied");
                None
            }
        };
        let method = if claimed.is_some() { Method::Move } else { Method::Copy };
        // Held until the image is written: no gc removes the new objects.
        let mut ingest = Ingest::new(&store, method)?;
        // Synced after the Commit (see `Backend::sync`).
        ingest.defer_sync();
        let (image, usage, (t0, t1, t2)) = match self.build_with(&store, &ingest, id, chain) {
            Ok(m) => m,
            Err(e) => {
                // Objects stored before the failure (a batch committed,
                // the image not written) go as a Remove's would, once no
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
        tracing::info!(
            "snapshot {id}: chain of {} read in {:.2} s, layer read and its files stored in {:.2} s ({}), image \
             written in {:.2} s",
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
        Ok(Stored {
            image: hex::encode(image.digest),
            usage,
        })
    }

    fn undo_store(&self, id: u64) -> Result<()> {
        self.release(id, false)?;
        let dir = state::snapshot_dir(&self.root, id);
        let journal = dir.join(state::UNDO);
        match std::fs::read(&journal) {
            Ok(bytes) => {
                let undo: Vec<layer::Undo> = postcard::from_bytes(&bytes)
                    .map_err(|e| Error::Broken(format!("{}: not a commit journal: {e}", journal.display())))?;
                layer::restore(&dir.join("fs"), &undo)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&journal, "cannot read", e)),
        }
        let _ = std::fs::remove_file(dir.join("layer"));
        match std::fs::remove_file(&journal) {
            Ok(()) => state::sync_dir(&dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(&journal, "cannot remove", e)),
        }
    }

    fn build_chain(&self, id: u64, kind: &LazyKind, n: usize) -> Result<(String, u64)> {
        let store = self.open_store()?;
        // Held shared until the image is held: a gc meanwhile would take
        // the objects found present for unreferenced.
        let lock = store.lock(tilefs_store::LockMode::Shared, true)?;
        let (image, digest, absent, resolved) = match kind {
            LazyKind::Indexed(img) => {
                let c = img.chain(n)?;
                let absent = tilefs_store::presence::absent(&store, c.objects.iter().map(|o| o.digest)).len();
                match absent {
                    0 => tilefs_store::remote::forget(&store, &c.digest)?,
                    _ => c.record.save(&store, &c.digest)?,
                }
                (c.image, c.digest, absent as u64, &img.resolved)
            }
            LazyKind::Toc(img) => {
                let made = img
                    .tables
                    .image(&store, n, img.opts.keep_all_xattrs)
                    .map_err(Error::Broken)?;
                match &made.record {
                    Some(r) => r.save(&store, &made.digest)?,
                    None => tilefs_store::remote::forget(&store, &made.digest)?,
                }
                (made.image, made.digest, made.lazy_files, &img.resolved)
            }
            LazyKind::Artifact(_) | LazyKind::Whole(_) => {
                return Err(Error::Broken(
                    "its image is planned to be pulled, not made from its layers".into(),
                ))
            }
        };
        tilefs_oci::trust::save_evidence(&store, &digest, resolved)?;
        owned::write_root(&store, &self.holder, &self.tag(id), &image)?;
        drop(lock);
        Ok((hex::encode(digest), absent))
    }

    fn pull_lazy(&self, id: u64, reference: &ImageRef, opts: &PullOptions) -> Result<String> {
        let store = self.open_store()?;
        let tag = self.tag(id);
        let opts = PullOptions {
            lazy: true,
            ..opts.clone()
        };
        let report = tilefs_oci::pull::pull(&store, reference, &tag, &opts)?;
        // The pull tags it: held from here, as every image of ours.
        owned::adopt(&store, &self.holder, &tag)?;
        Ok(report.digest)
    }

    fn mount(&self, r: &Record, at: &Path) -> Result<()> {
        let store = self.open_store()?;
        let image = owned::root_path(&store, &self.holder, &self.tag(r.id));
        if r.lazy {
            let lazy = self.lazy.as_ref().ok_or_else(|| {
                Error::Broken(format!(
                    "snapshot {:?} was made lazily, and this snapshotter serves no lazy images",
                    r.key
                ))
            })?;
            let reference = crate::lazy::Target::of(&r.labels)
                .and_then(Result::ok)
                .map(|t| t.reference);
            let mount = |how| (lazy.mount)(&self.store, &image.to_string_lossy(), at, reference.as_ref(), how);
            let why = match lazy.kernel.map(mount) {
                None => return refused(mount(How::Fuse)),
                Some(Ok(())) => return Ok(()),
                Some(Err(Refused::KernelUnable(why))) => why,
                Some(Err(Refused::Failed(e))) => format!("{:?}: {e}", r.key),
            };
            // Nothing the kernel attempt left may stay below the FUSE mount.
            self.unmount(at);
            if lazy.said.lock().unwrap_or_else(|e| e.into_inner()).insert(why.clone()) {
                tracing::warn!("lazily pulled images are served by FUSE, not the kernel: {why}");
            }
            return refused(mount(How::Fuse));
        }
        tilefs_mount::mount_erofs_at(&image, at, tilefs_mount::ErofsBacking::Auto)
            .map_err(|e| Error::Broken(e.to_string()))
    }

    fn is_mounted(&self, at: &Path) -> bool {
        tilefs_mount::is_mount_root(at)
    }

    fn needs_data_lower(&self, at: &Path) -> bool {
        // EROFS's magic (EROFS_SUPER_MAGIC_V1): a kernel mount of a chain's
        // image, not a lazy image's FUSE server (which serves data itself).
        rustix::fs::statfs(at).is_ok_and(|s| s.f_type as u64 == 0xE0F5_E1E2)
    }

    fn unmount(&self, at: &Path) {
        if tilefs_mount::is_mount_root(at) {
            if let Err(e) = rustix::mount::unmount(at, rustix::mount::UnmountFlags::DETACH) {
                tracing::warn!("{}: cannot unmount: {e}", at.display());
            }
        }
    }

    fn release(&self, id: u64, collect: bool) -> Result<()> {
        let store = self.open_store()?;
        // An image that cannot be read frees nothing it would name.
        let objects = collect
            .then(|| owned::read_root(&store, &self.holder, &self.tag(id)).ok().flatten())
            .flatten()
            .and_then(|bytes| tilefs_store::gc::objects_of(&bytes).ok());
        owned::remove_root(&store, &self.holder, &self.tag(id))?;
        if let Some(objects) = objects {
            self.collector.add(objects);
        }
        Ok(())
    }

    fn held(&self) -> Result<Vec<u64>> {
        let store = self.open_store()?;
        let held = owned::scan(&store)?;
        Ok(held
            .owners
            .iter()
            .filter(|o| o.id == self.holder.id())
            .flat_map(|o| &o.roots)
            .filter_map(|t| t.name.strip_prefix(&self.tag_prefix)?.parse::<u64>().ok())
            .collect())
    }

    fn hold_upper(&self, upper: &Path, scratch: &Path) -> Option<Hold> {
        match claim::claim(upper, scratch) {
            Ok(claim::Upper::Free(c)) => Some(Box::new(c)),
            Ok(claim::Upper::InUse) => None,
            Err(e) => {
                tracing::warn!("{e}: kept as if it were in use");
                None
            }
        }
    }

    fn sync(&self) -> Result<()> {
        std::fs::File::open(&self.store)
            .and_then(|f| Ok(rustix::fs::syncfs(&f)?))
            .map_err(|e| Error::io(&self.store, "cannot sync", e))
    }

    fn check_layer(&self, id: u64) -> Result<usize> {
        let store = self.open_store()?;
        let mut damaged = 0;
        for e in state::load_layer(&self.root, id)? {
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
        Ok(damaged)
    }

    fn data_lower(&self) -> &Path {
        &self.store
    }
}

/// A lazy mount's outcome as the backend's.
fn refused(r: std::result::Result<(), Refused>) -> Result<()> {
    r.map_err(|e| match e {
        Refused::KernelUnable(why) => Error::Broken(why),
        Refused::Failed(e) => e,
    })
}

/// Makes the snapshotter `holder` of its images in the store: registered
/// first, then the tags an older tilefs kept them as
/// (`STORE/images/snapshotter-HASH-ID`, which `tilefs untag` could remove
/// under a running container) made its held images, each written held
/// before its tag goes (a crash between leaves both; the next start ends
/// the move).
fn adopt_tags(store: &Path, holder: &Holder, prefix: &str) -> Result<()> {
    let s = Store::open(store)?;
    owned::register(&s, holder)?;
    let mut moved = 0;
    // A store whose tags cannot be listed has none of ours to move (fsck
    // says what is wrong with it).
    for t in tags::list_tags(&s).unwrap_or_default() {
        if t.name.strip_prefix(prefix).is_some_and(|id| id.parse::<u64>().is_ok()) {
            owned::adopt(&s, holder, &t.name)?;
            moved += 1;
        }
    }
    if moved > 0 {
        tracing::info!(
            "the images of {moved} snapshots, tagged in {} by an older tilefs, are held apart from the user's tags now \
             (in {})",
            store.display(),
            owned::root_path(&s, holder, "").display()
        );
    }
    Ok(())
}
