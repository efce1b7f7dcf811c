//! The snapshots' state machine: containerd's operations (Prepare, View,
//! Commit, Remove, Stat, Update, Usage, Walk) over the records
//! ([`state`]), each change on the disk (one rename) before it is in
//! memory. What needs the store or the kernel goes through the
//! [`Backend`]; the mounts are [`crate::mounts`]', the storing of
//! committed layers [`crate::worker`]'s, what a start finds
//! [`crate::recovery`]'s and CRI's lazy snapshots [`crate::lazy_snapshots`]'.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::state::{self, Record, SnapKind};
use crate::worker::Job;
use crate::{filter, layer, lazy};
use containerd_snapshots::api::types::Mount;
use containerd_snapshots::{Info, Kind, Usage};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::SystemTime;

pub(crate) struct Snapshots {
    pub(crate) root: PathBuf,
    pub(crate) backend: Box<dyn Backend>,
    pub(crate) inner: Mutex<Inner>,
    /// Held by the one background sync that runs.
    pub(crate) syncing: Mutex<()>,
    /// Signalled when the worker finished a job.
    pub(crate) changed: Condvar,
    pub(crate) jobs: Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    /// CRI's lazy path, if the front end offers it.
    pub(crate) lazy: Option<lazy::Lazy>,
    pub(crate) plans: lazy::Plans,
    /// What became of the images CRI pulled (for its ImageStatus).
    pub(crate) said: lazy::Said,
    /// The lazy snapshot a Prepare for each (chain ID, parent) was last
    /// answered with: containerd's walk that follows is shown that one
    /// alone (see [`lazy`]).
    pub(crate) lazy_claims: Mutex<HashMap<(String, String), LazyClaim>>,
    /// Signalled when a walk took up a claim.
    pub(crate) walked: Condvar,
    /// Per snapshot id, held while its image is mounted under `ROOT/mnt`
    /// (and while it is unmounted): one mount each, whoever asks first,
    /// and a slow mount holds up no other.
    pub(crate) mounting: Mutex<HashMap<u64, Arc<Mutex<()>>>>,
}

pub(crate) struct Inner {
    pub(crate) by_key: HashMap<String, Record>,
    pub(crate) next_id: u64,
    /// The pending snapshot the worker is storing.
    pub(crate) ingesting: Option<u64>,
    /// Pending snapshots the worker failed to store, and why.
    pub(crate) failed: HashMap<u64, String>,
    /// Snapshots (an unpack's) mounted over pending uppers: those uppers.
    pub(crate) lower_users: HashMap<u64, Vec<u64>>,
    /// Upper directories a reap found a live overlay's, and when.
    pub(crate) in_use: HashMap<u64, std::time::Instant>,
}

/// What a Prepare answered AlreadyExists for a lazy snapshot told
/// containerd, which walks for it by its chain ID label and parent next.
pub(crate) struct LazyClaim {
    pub(crate) name: String,
    /// A walk for it came since.
    pub(crate) walked: bool,
}

impl Snapshots {
    /// The state machine over `backend` rooted at `root` (canonical, made),
    /// its records loaded.
    pub(crate) fn new(root: PathBuf, backend: Box<dyn Backend>, lazy: Option<lazy::Lazy>) -> Result<Snapshots> {
        let records = state::load(&root)?;
        let mut next_id = records.iter().map(|r| r.id).max().unwrap_or(0) + 1;
        for id in crate::recovery::ids_in(&root, state::SNAPSHOTS) {
            next_id = next_id.max(id + 1);
        }
        let mut by_key = HashMap::new();
        for r in records {
            if let Some(old) = by_key.insert(r.key.clone(), r) {
                return Err(Error::Broken(format!(
                    "{}: two records name snapshot {:?}",
                    state::record_path(&root, old.id).display(),
                    old.key
                )));
            }
        }
        Ok(Snapshots {
            root,
            backend,
            inner: Mutex::new(Inner {
                by_key,
                next_id,
                ingesting: None,
                failed: HashMap::new(),
                lower_users: HashMap::new(),
                in_use: HashMap::new(),
            }),
            syncing: Mutex::new(()),
            changed: Condvar::new(),
            jobs: Mutex::new(None),
            lazy,
            plans: lazy::Plans::default(),
            said: lazy::Said::default(),
            lazy_claims: Mutex::new(HashMap::new()),
            walked: Condvar::new(),
            mounting: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn new_id(&self) -> u64 {
        let mut inner = self.lock();
        inner.next_id += 1;
        inner.next_id - 1
    }

    /// Prepare (`kind` Active) or View.
    pub(crate) fn create(
        self: &Arc<Self>,
        key: String,
        parent: String,
        labels: HashMap<String, String>,
        kind: SnapKind,
    ) -> Result<Vec<Mount>> {
        if key.is_empty() {
            return Err(Error::Empty("key"));
        }
        if kind == SnapKind::Active {
            self.try_lazy(&key, &parent, &labels)?;
        }
        let mut inner = self.lock();
        Self::name_free(&inner, &key)?;
        if !parent.is_empty() {
            let p = inner
                .by_key
                .get(&parent)
                .ok_or_else(|| Error::ParentNotFound(parent.clone()))?;
            if p.kind != SnapKind::Committed {
                return Err(Error::ParentNotCommitted(parent));
            }
        }
        let id = inner.next_id;
        inner.next_id += 1;
        let dir = state::snapshot_dir(&self.root, id);
        let mk = |p: &Path| std::fs::create_dir_all(p).map_err(|e| Error::io(p, "cannot create", e));
        let fs = dir.join("fs");
        mk(&fs)?;
        // As a layer without a `./` entry implies its root: 0755, time zero.
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
            return Err(e);
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

    /// AlreadyExists if a snapshot is named `key`.
    pub(crate) fn name_free(inner: &Inner, key: &str) -> Result<()> {
        if inner.by_key.contains_key(key) {
            return Err(Error::AlreadyExists(key.to_string()));
        }
        Ok(())
    }

    /// Active snapshot `r`'s record as committed snapshot `name`: a new
    /// snapshot to containerd, made now (as its own snapshotters date it).
    fn committed(r: &Record, name: &str, labels: HashMap<String, String>) -> Record {
        let mut r = r.clone();
        r.key = name.to_string();
        r.kind = SnapKind::Committed;
        r.labels = labels;
        r.created = SystemTime::now();
        r.updated = r.created;
        r
    }

    /// The switch of a Commit: active snapshot `key` becomes `r`, on the
    /// disk first (from there it is committed), then in the map.
    fn switch(&self, inner: &mut Inner, key: &str, r: Record) -> Result<()> {
        state::save(&self.root, &r)?;
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
    pub(crate) fn chain(inner: &Inner, parent: &str) -> Result<Vec<u64>> {
        let mut ids = Vec::new();
        let mut at = parent.to_string();
        while !at.is_empty() {
            let r = inner
                .by_key
                .get(&at)
                .ok_or_else(|| Error::Broken(format!("snapshot {at:?} of a chain is gone")))?;
            ids.push(r.id);
            at = r.parent.clone();
            if ids.len() > 100_000 {
                return Err(Error::Broken("a chain of snapshots that loops".into()));
            }
        }
        ids.reverse();
        Ok(ids)
    }

    /// Commits active snapshot `key` as `name`: the record switched, in
    /// one rename; the worker stores the layer after.
    pub(crate) fn commit(&self, name: String, key: String, labels: HashMap<String, String>) -> Result<()> {
        if name.is_empty() {
            return Err(Error::Empty("name"));
        }
        let mut inner = self.lock();
        let r = inner.by_key.get(&key).ok_or_else(|| Error::NotFound(key.clone()))?;
        if r.kind != SnapKind::Active {
            return Err(Error::NotActive(key));
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
    fn commit_kept(&self, name: String, key: String, id: u64, labels: HashMap<String, String>) -> Result<()> {
        let dir = state::snapshot_dir(&self.root, id);
        let fs = dir.join("fs");
        std::fs::File::open(&fs)
            .and_then(|f| Ok(rustix::fs::syncfs(&f)?))
            .map_err(|e| Error::io(&fs, "cannot sync", e))?;
        let (size, inodes) = disk_usage(&fs);
        let mut inner = self.lock();
        // Checked again: the lock was let go for the sync.
        let r = inner
            .by_key
            .get(&key)
            .filter(|r| r.id == id && r.kind == SnapKind::Active)
            .ok_or_else(|| Error::NotFound(key.clone()))?;
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

    pub(crate) fn remove(&self, key: &str) -> Result<()> {
        let mut inner = self.lock();
        // Not while the worker stores it.
        while inner
            .ingesting
            .is_some_and(|i| inner.by_key.get(key).is_some_and(|r| r.id == i))
        {
            inner = self.changed.wait(inner).unwrap_or_else(|e| e.into_inner());
        }
        let r = inner.by_key.get(key).ok_or_else(|| Error::NotFound(key.to_string()))?;
        if let Some(child) = inner.by_key.values().find(|c| c.parent == key) {
            return Err(Error::HasChild {
                key: key.to_string(),
                child: child.key.clone(),
            });
        }
        let id = r.id;
        let committed = r.kind == SnapKind::Committed;
        // The record first: from here the snapshot is gone, whatever of it
        // a crash leaves (Cleanup removes that).
        state::delete(&self.root, id)?;
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
            self.backend.unmount(&state::mount_dir(&self.root, id));
            self.mounting.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            self.backend.release(id, true)?;
        }
        let removed = crate::worker::remove_snapshot_dir(self.backend.as_ref(), &state::snapshot_dir(&self.root, id));
        // Upper directories this one held as lowers, or that were in use,
        // may be free now.
        self.send(Job::Reap);
        removed
    }

    pub(crate) fn stat(&self, key: &str) -> Result<Info> {
        let inner = self.lock();
        inner
            .by_key
            .get(key)
            .map(info_of)
            .ok_or_else(|| Error::NotFound(key.to_string()))
    }

    /// Update: only labels change (all of them, or those `paths` name as
    /// `labels` or `labels.KEY`).
    pub(crate) fn update(&self, info: Info, paths: Option<Vec<String>>) -> Result<Info> {
        let mut inner = self.lock();
        let key = info.name.clone();
        let r = inner.by_key.get(&key).ok_or_else(|| Error::NotFound(key.clone()))?;
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
                    return Err(Error::Immutable { key, field: p.clone() });
                }
            }
        }
        r.updated = SystemTime::now();
        state::save(&self.root, &r)?;
        let out = info_of(&r);
        inner.by_key.insert(key, r);
        Ok(out)
    }

    pub(crate) fn usage(&self, key: &str) -> Result<Usage> {
        let (kind, id, stored, pending) = {
            let inner = self.lock();
            let r = inner.by_key.get(key).ok_or_else(|| Error::NotFound(key.to_string()))?;
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
    /// [`Snapshots::claim_lazy`]), and takes up that claim; other lists
    /// (gc's) show all.
    pub(crate) fn list(&self, filters: &[String]) -> Result<Vec<Info>> {
        let f = filter::Filter::parse(filters)?;
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

    pub(crate) fn send(&self, job: Job) {
        if let Some(tx) = self.jobs.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = tx.send(job);
        }
    }

    /// The ids of the snapshots whose upper directories the state still
    /// needs: pending and kept layers', and those under an unpack.
    pub(crate) fn needed_uppers(inner: &Inner) -> HashSet<u64> {
        let mut keep: HashSet<u64> = inner.lower_users.values().flatten().copied().collect();
        keep.extend(inner.by_key.values().filter(|r| r.pending || r.kept).map(|r| r.id));
        keep
    }
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

/// Bytes (allocated) and inodes below `dir`, each inode counted once,
/// symlinks not followed, other filesystems not entered.
pub(crate) fn disk_usage(dir: &Path) -> (i64, i64) {
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
