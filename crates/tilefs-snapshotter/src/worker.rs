//! The worker: stores committed layers after their Commit, in commit
//! order, while containerd unpacks the next one; removes the upper
//! directories nothing needs any more; syncs what Commits left unsynced.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::snapshots::Snapshots;
use crate::state::{self, SnapKind};
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

/// The worker's nice value: storing layers yields the CPU to the unpack
/// of the next one, which a pull waits for.
const WORKER_NICE: i32 = 10;

/// How long after a layer is stored its files are synced.
const SYNC_DELAY: std::time::Duration = std::time::Duration::from_secs(30);

/// How long after a reap found an upper directory in use it asks again.
const REAP_RETRY: std::time::Duration = std::time::Duration::from_secs(60);

/// The worker's jobs, done in order.
pub(crate) enum Job {
    /// Store a pending snapshot's layer and make its image.
    Ingest(u64),
    /// Remove the upper directories no pending layer or mount needs.
    Reap,
}

/// Starts `s`'s worker thread, given the layers a stop left pending.
pub(crate) fn start(s: &Arc<Snapshots>) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    *s.jobs.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
    let worker = s.clone();
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
        .map_err(|e| Error::Broken(format!("cannot start the snapshotter's worker: {e}")))?;
    // Layers a stop left pending, oldest (so parents) first.
    let mut pending: Vec<u64> = s.lock().by_key.values().filter(|r| r.pending).map(|r| r.id).collect();
    pending.sort_unstable();
    for id in pending {
        s.send(Job::Ingest(id));
    }
    Ok(())
}

impl Snapshots {
    /// Stores pending snapshot `id`'s layer and makes its chain's image,
    /// then marks it stored. A failure gives its upper directory back as
    /// it was ([`Backend::undo_store`]) and is remembered for the mounts
    /// that need it.
    fn ingest(self: &Arc<Self>, id: u64) {
        let (key, chain) = {
            let mut inner = self.lock();
            let Some(r) = inner.by_key.values().find(|r| r.id == id && r.pending).cloned() else {
                return;
            };
            let chain = match Self::chain(&inner, &r.parent) {
                Ok(c) => c,
                Err(e) => {
                    inner.failed.insert(id, e.to_string());
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
            .backend
            .undo_store(id)
            .and_then(|()| self.backend.store_layer(id, &chain));
        let mut inner = self.lock();
        let done = built.and_then(|stored| {
            let mut r = inner
                .by_key
                .get(&key)
                .filter(|r| r.id == id)
                .cloned()
                .ok_or_else(|| Error::NotFound(key.clone()))?;
            r.pending = false;
            r.unsynced = true;
            r.usage = Some(stored.usage);
            r.image = Some(stored.image.clone());
            state::save(&self.root, &r)?;
            inner.by_key.insert(key.clone(), r);
            tracing::info!(
                "stored {key:?}: {} entries, {} bytes of files, image {} ({:.2} s)",
                stored.usage.inodes,
                stored.usage.size,
                stored.image.get(..12).unwrap_or(&stored.image),
                started.elapsed().as_secs_f64()
            );
            Ok(())
        });
        if let Err(e) = done {
            let mut msg = e.to_string();
            if let Err(u) = self.backend.undo_store(id) {
                msg = format!("{msg}; and giving its files back failed (the next start retries): {u}");
            }
            tracing::warn!("storing {key:?} failed: {msg}");
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
    pub(crate) fn reap(&self) {
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
            let gone = crate::recovery::ids_in(&self.root, state::SNAPSHOTS)
                .into_iter()
                .filter(|id| !known.contains(id) && inner.ingesting != Some(*id))
                .map(|id| (id, true));
            leftovers
                .chain(gone)
                .filter(|(id, _)| {
                    let d = state::snapshot_dir(&self.root, *id);
                    d.join("fs").exists() || d.join("work").exists() || !known.contains(id)
                })
                .filter(|(id, _)| inner.in_use.get(id).is_none_or(|t| t.elapsed() >= REAP_RETRY))
                .collect()
        };
        for (id, gone) in todo {
            let d = state::snapshot_dir(&self.root, id);
            let removed = if gone {
                match remove_snapshot_dir(self.backend.as_ref(), &d) {
                    Ok(()) => !d.exists(),
                    Err(e) => {
                        tracing::warn!("{e}");
                        false
                    }
                }
            } else {
                remove_leftovers(self.backend.as_ref(), &d)
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
    pub(crate) fn sync_committed(&self) {
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
        let synced = self.backend.sync().and_then(|()| {
            std::fs::File::open(&self.root)
                .and_then(|f| Ok(rustix::fs::syncfs(&f)?))
                .map_err(|e| Error::io(&self.root, "cannot sync", e))
        });
        if let Err(e) = synced {
            tracing::warn!("{e}");
            return;
        }
        let mut inner = self.lock();
        for r in inner.by_key.values_mut().filter(|r| r.unsynced && ids.contains(&r.id)) {
            let mut synced = r.clone();
            synced.unsynced = false;
            match state::save(&self.root, &synced) {
                Ok(()) => *r = synced,
                Err(e) => tracing::warn!("{e}"),
            }
        }
    }
}

/// Removes a snapshot's upper and work directories and its commit journal
/// (a committed snapshot's files are in the store now), unless a live
/// overlay has them: a container's, whose snapshot was committed or
/// removed under it, which goes on writing there as under containerd's
/// overlayfs snapshotter. Those stay until a later reap finds them free.
/// Whether they are gone.
pub(crate) fn remove_leftovers(backend: &dyn Backend, dir: &Path) -> bool {
    let fs = dir.join("fs");
    // Held while they go: no overlay takes them meanwhile.
    let _hold = if fs.exists() {
        match backend.hold_upper(&fs, &dir.join(state::CLAIM)) {
            Some(h) => Some(h),
            None => return false,
        }
    } else {
        None
    };
    let _ = std::fs::remove_file(dir.join(state::UNDO));
    for sub in ["fs", "work"] {
        let p = dir.join(sub);
        if let Err(e) = std::fs::remove_dir_all(&p) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("{}: cannot remove: {e}", p.display());
            }
        }
    }
    true
}

/// Removes the directory of a snapshot that is gone, but for an upper
/// directory a live overlay has (see [`remove_leftovers`]).
pub(crate) fn remove_snapshot_dir(backend: &dyn Backend, dir: &Path) -> Result<()> {
    if !remove_leftovers(backend, dir) {
        let _ = std::fs::remove_file(dir.join("layer"));
        return Ok(());
    }
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(dir, "cannot remove", e)),
        _ => Ok(()),
    }
}
