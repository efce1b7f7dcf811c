//! CRI's lazy path, in the state machine: a Prepare with CRI's labels
//! for a layer of a runnable tilefs artifact, of an ordinary image with a
//! tilefs index or of an eStargz or zstd:chunked image becomes a committed
//! snapshot at once (see [`lazy`] for what is served and how), answered
//! AlreadyExists; containerd's walk that follows is shown it.

use crate::error::{Error, Result};
use crate::snapshots::{Inner, LazyClaim, Snapshots};
use crate::state::{self, Record, SnapKind};
use crate::{layer, lazy};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;
use tilefs_oci::lazy_index::LazyKind;

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

/// The image a lazy chain snapshot is of ([`Snapshots::make_lazy_chain`]).
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

impl Snapshots {
    /// A Prepare of `key` over `parent` with `labels`: if CRI's labels name
    /// a layer this snapshotter serves lazily, its snapshot is made (or
    /// found) and the answer is AlreadyExists; if serving it failed,
    /// Unavailable; otherwise the Prepare goes on as any.
    pub(crate) fn try_lazy(self: &Arc<Self>, key: &str, parent: &str, labels: &HashMap<String, String>) -> Result<()> {
        let (Some(lz), Some(target)) = (&self.lazy, lazy::Target::of(labels)) else {
            return Ok(());
        };
        let t = match target {
            Ok(t) => t,
            Err(e) => {
                tracing::info!("{key:?}: not served lazily: {e}");
                return Ok(());
            }
        };
        let whole = |why: &str| self.said.whole(&t.repo_digest, why.to_string());
        match self.make_lazy(&t, parent, labels, lz) {
            Ok(name) => Err(Error::ServedLazily(name)),
            // containerd unpacks it then, as any image.
            Err(NotLazy::Because(e)) => {
                tracing::info!("{key:?}: not served lazily: {e}");
                whole(&e);
                Ok(())
            }
            // An artifact containerd cannot unpack: its error.
            Err(NotLazy::Failed(e)) => {
                tracing::warn!("{key:?}: {e}");
                whole(&e);
                Err(Error::Lazy(e))
            }
        }
    }

    /// Before CRI's pull of `image` (as CRI names it) goes on to
    /// containerd, through the image service proxy ([`crate::cri`]): the image is
    /// judged by the signature policy (Err: the policy's refusal) and what
    /// its lazy start can go by is found now, for the Prepares that follow;
    /// what an earlier pull of it said is forgotten. Any other failure is
    /// left to containerd's pull (and the Prepares) to meet.
    pub(crate) fn before_pull(&self, image: &str) -> Result<()> {
        let Some(lz) = &self.lazy else {
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
                self.said.begin(&format!("{repo}@{m}"), top.as_deref());
                if let Ok(key) = lazy::by_digest(&image, &m) {
                    self.plans.remember(key.to_string(), Arc::new(plan));
                }
                Ok(())
            }
            Err(tilefs_oci::OciError::Refused(why)) => {
                tracing::warn!("{image}: refused: {why}");
                Err(Error::Refused(why.to_string()))
            }
            Err(e) => {
                tracing::warn!("{image}: {e} (containerd's pull goes on)");
                Ok(())
            }
        }
    }

    /// What became of the image with these repo digests (CRI's), if the
    /// snapshotter knows: how it is served lazily, or why it was pulled
    /// whole.
    pub(crate) fn said_of(&self, repo_digests: &[String]) -> Option<(bool, String)> {
        self.said.of(repo_digests)
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
        let plan = self.plans.plan(&t.reference, lz).map_err(|e| NotLazy::Because(e.0))?;
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

    /// [`Snapshots::make_lazy`] of a layer of the runnable artifact whose
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
        let chain = lazy::check(t, layers, layers).map_err(|e| NotLazy::Because(e.0))?;
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
        let started = std::time::Instant::now();
        let pulled = parent_image.is_none();
        let image = match parent_image {
            Some(digest) => digest,
            None => Some(
                self.backend
                    .pull_lazy(id, &t.reference, &lz.pull)
                    .map_err(|e| failed(e.to_string()))?,
            ),
        };
        let r = Self::lazy_record(id, &name, parent, labels, image, false);
        if !self.insert_lazy(r, pulled).map_err(|e| failed(e.to_string()))? {
            let _ = self.backend.release(id, false);
        }
        tracing::info!(
            "{name:?}: layer {} of {} made lazily ({:.2} s)",
            chain.len(),
            t.reference,
            started.elapsed().as_secs_f64()
        );
        Ok((name, format!("lazy: {} is a runnable tilefs image", t.reference)))
    }

    /// [`Snapshots::make_lazy`] of a layer of an ordinary image with a tilefs
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

    /// [`Snapshots::make_lazy`] of a layer of an eStargz or zstd:chunked image
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
    /// [`crate::backend::Backend::build_chain`]) made the snapshot's, for the top layer now,
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
        let chain = lazy::check(t, &blobs, c.diff_ids).map_err(|e| NotLazy::Because(e.0))?;
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
            self.insert_lazy(r, false).map_err(|e| failed(e.to_string()))?;
            tracing::info!(
                "{name:?}: layer {n} of {} made lazily through {through}, its image made at \
                 its first mount ({:.2} s)",
                t.reference,
                started.elapsed().as_secs_f64()
            );
            return Ok(name);
        }
        let absent = (|| -> Result<u64> {
            let (digest, absent) = self.backend.build_chain(id, kind, n)?;
            let r = Self::lazy_record(id, &name, parent, labels, Some(digest), true);
            // The top layer's image is the one containers run on.
            if !self.insert_lazy(r, true)? {
                let _ = self.backend.release(id, false);
            }
            Ok(absent)
        })()
        .map_err(|e| {
            let _ = self.backend.release(id, false);
            failed(e.to_string())
        })?;
        tracing::info!(
            "{name:?}: layer {n} of {} made lazily through {through}, {absent} files to fetch \
             on first read ({:.2} s)",
            t.reference,
            started.elapsed().as_secs_f64()
        );
        Ok(name)
    }

    /// Makes deferred snapshot `r`'s chain image ([`Record::deferred`]),
    /// its mount lock held and `inner` locked (no Remove meanwhile): the
    /// record, no longer deferred.
    pub(crate) fn build_deferred(&self, inner: &mut Inner, r: &Record) -> Result<Record> {
        let started = std::time::Instant::now();
        let fail = |e: String| Error::Broken(format!("snapshot {:?}: cannot make its image: {e}", r.key));
        let lz = self
            .lazy
            .as_ref()
            .ok_or_else(|| fail("this snapshotter serves no lazy images".into()))?;
        let t = lazy::Target::of(&r.labels)
            .ok_or_else(|| fail("its labels name no image layer".into()))?
            .map_err(|e| fail(e.to_string()))?;
        let plan = self.plans.plan(&t.reference, lz).map_err(|e| fail(e.to_string()))?;
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
        let n = lazy::check(&t, &blobs, diff_ids)
            .map_err(|e| fail(e.to_string()))?
            .len();
        let (digest, absent) = self.backend.build_chain(r.id, &plan.kind, n).map_err(|e| {
            let _ = self.backend.release(r.id, false);
            fail(e.to_string())
        })?;
        let mut built = r.clone();
        built.image = Some(digest);
        built.deferred = false;
        if let Err(e) = state::save(&self.root, &built) {
            let _ = self.backend.release(r.id, false);
            return Err(e);
        }
        inner.by_key.insert(built.key.clone(), built.clone());
        tracing::info!(
            "{:?}: image of layer {n} of {} made, {absent} files to fetch on first read ({:.2} s)",
            r.key,
            t.reference,
            started.elapsed().as_secs_f64()
        );
        Ok(built)
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
    fn insert_lazy(self: &Arc<Self>, r: Record, mount: bool) -> Result<bool> {
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
                    tracing::warn!("{:?}: {e}", r.key);
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
}
