//! What containerd mounts for an active snapshot or a view: one kernel
//! overlay over the parent chain's image (mounted here, read-only, under
//! `ROOT/mnt/ID`) with the store as its data-only lower layer, or over the
//! upper directories of the layers not stored yet, for an unpack.

use crate::error::{Error, Result};
use crate::lazy;
use crate::snapshots::{Inner, Snapshots};
use crate::state::{self, Record, SnapKind};
use crate::worker::Job;
use containerd_snapshots::api::types::Mount;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

/// Whether `r` is containerd's unpack of a layer, whose differ writes the
/// layer into it and reads its parents only for directories' metadata
/// (so the upper directories of layers not stored yet do as lowers).
/// containerd's unpacker says so by the label naming the snapshot it will
/// commit ([`lazy::LABEL_TARGET`]); its older path (`rootfs.ApplyLayers`,
/// `ctr image unpack`) gives no labels, only its key format
/// (`extract-NONCE CHAINID`).
fn is_unpack(r: &Record) -> bool {
    r.kind == SnapKind::Active
        && (r.labels.contains_key(lazy::LABEL_TARGET)
            || r.key.rsplit('/').next().is_some_and(|k| k.starts_with("extract-")))
}

fn bind(source: String) -> Vec<Mount> {
    vec![Mount {
        r#type: "bind".into(),
        source,
        target: String::new(),
        options: vec!["ro".into(), "rbind".into()],
    }]
}

fn overlay(options: Vec<String>) -> Vec<Mount> {
    vec![Mount {
        r#type: "overlay".into(),
        source: "overlay".into(),
        target: String::new(),
        options,
    }]
}

impl Snapshots {
    pub(crate) fn mounts(&self, key: &str) -> Result<Vec<Mount>> {
        let inner = self.lock();
        let r = inner.by_key.get(key).ok_or_else(|| Error::NotFound(key.to_string()))?;
        if r.kind == SnapKind::Committed {
            return Err(Error::NoMounts(key.to_string()));
        }
        self.mounts_when_ready(inner, key)
    }

    /// The mounts of active snapshot or view `key`, once its chain's layers
    /// are stored; an unpack's ([`is_unpack`]) at once, over the pending
    /// uppers. A layer the worker failed to store is tried again once.
    pub(crate) fn mounts_when_ready<'a>(&'a self, mut inner: MutexGuard<'a, Inner>, key: &str) -> Result<Vec<Mount>> {
        let mut retried = false;
        loop {
            let r = inner
                .by_key
                .get(key)
                .cloned()
                .ok_or_else(|| Error::NotFound(key.to_string()))?;
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
                    return Err(Error::Broken(format!(
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
            if is_unpack(&r) {
                return self.mounts_of(&mut inner, &r);
            }
            inner = self.changed.wait(inner).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The mounts of an active snapshot or a view: one overlay over its
    /// parent's image, or over the pending uppers of its chain and the
    /// image below them.
    fn mounts_of(&self, inner: &mut Inner, r: &Record) -> Result<Vec<Mount>> {
        let dir = state::snapshot_dir(&self.root, r.id);
        let fs = dir.join("fs");
        if r.parent.is_empty() && r.kind == SnapKind::View {
            return Ok(bind(fs.to_string_lossy().into_owned()));
        }
        if r.parent.is_empty() {
            // An overlay over an empty directory rather than a bind mount:
            // overlayfs marks its upper directory in use while it lives,
            // which a Commit asks (see `claim`) before it moves a file.
            return Ok(overlay(vec![
                format!("workdir={}", dir.join("work").display()),
                format!("upperdir={}", fs.display()),
                format!("lowerdir={}", self.root.join(state::EMPTY).display()),
            ]));
        }
        let mut lowers = Vec::new();
        let mut uppers = Vec::new();
        // The store is the data-only lower of EROFS images (a lazy one's
        // too, its placeholders filled on first access).
        let mut data_only = true;
        let mut at = r.parent.clone();
        while !at.is_empty() {
            let p = inner
                .by_key
                .get(&at)
                .ok_or_else(|| Error::Broken(format!("snapshot {:?}: its ancestor {at:?} is gone", r.key)))?;
            if p.pending || p.kept {
                if p.pending {
                    uppers.push(p.id);
                }
                lowers.push(state::snapshot_dir(&self.root, p.id).join("fs"));
                at = p.parent.clone();
            } else {
                // Its image holds all below it; a lazy image's FUSE server
                // serves its files' data itself.
                let (owner, lazy) = (Self::image_owner(inner, p).clone(), p.lazy);
                let mnt = self.ensure_mounted(inner, &owner)?;
                data_only = !lazy || self.backend.needs_data_lower(&mnt);
                lowers.push(mnt);
                break;
            }
        }
        if !uppers.is_empty() {
            inner.lower_users.insert(r.id, uppers);
        }
        if r.kind == SnapKind::View && !data_only && lowers.len() == 1 {
            // overlayfs wants two layers without an upper one: the lazy
            // image's mount, read-only, is the view.
            return Ok(bind(lowers[0].display().to_string()));
        }
        let mut options = Vec::new();
        if r.kind == SnapKind::Active {
            options.push(format!("workdir={}", dir.join("work").display()));
            options.push(format!("upperdir={}", fs.display()));
        }
        let lowers: Vec<String> = lowers.iter().map(|l| l.display().to_string()).collect();
        if data_only {
            options.push(format!(
                "lowerdir={}::{}",
                lowers.join(":"),
                self.backend.data_lower().display()
            ));
        } else {
            options.push(format!("lowerdir={}", lowers.join(":")));
        }
        options.push("metacopy=on".into());
        options.push("redirect_dir=on".into());
        Ok(overlay(options))
    }

    /// The committed snapshot's chain image, mounted (EROFS, read-only)
    /// under `ROOT/mnt/ID`; made first if it was deferred.
    fn ensure_mounted(&self, inner: &mut Inner, r: &Record) -> Result<PathBuf> {
        let lock = self.mount_lock(r.id);
        let _one = lock.lock().unwrap_or_else(|e| e.into_inner());
        if r.deferred {
            let built = self.build_deferred(inner, r)?;
            return self.mount_image(&built);
        }
        self.mount_image(r)
    }

    pub(crate) fn mount_lock(&self, id: u64) -> Arc<Mutex<()>> {
        self.mounting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(id)
            .or_default()
            .clone()
    }

    /// [`Snapshots::ensure_mounted`], its mount lock held.
    pub(crate) fn mount_image(&self, r: &Record) -> Result<PathBuf> {
        let mnt = state::mount_dir(&self.root, r.id);
        if self.backend.is_mounted(&mnt) {
            return Ok(mnt);
        }
        std::fs::create_dir_all(&mnt).map_err(|e| Error::io(&mnt, "cannot create", e))?;
        self.backend
            .mount(r, &mnt)
            .map_err(|e| e.context(format!("snapshot {:?}: cannot mount its image", r.key)))?;
        Ok(mnt)
    }

    /// The committed snapshot whose image holds `r`'s: `r`, or for a layer
    /// made lazily the artifact's first layer (every layer of an artifact
    /// shows its whole image; the first goes last, as a parent outlives its
    /// children).
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
}
