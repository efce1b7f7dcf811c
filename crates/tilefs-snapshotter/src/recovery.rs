//! What a start (or containerd's Cleanup) finds: what no record accounts
//! for after a crash removed, a Commit that crashed given back, and the
//! objects of layers whose sync a crash prevented checked.

use crate::error::Result;
use crate::snapshots::Snapshots;
use crate::state::{self, SnapKind};
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// The ids of the entries of `ROOT/sub` (snapshots' or mounts').
pub(crate) fn ids_in(root: &Path, sub: &str) -> Vec<u64> {
    std::fs::read_dir(root.join(sub))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u64>().ok()))
                .collect()
        })
        .unwrap_or_default()
}

impl Snapshots {
    /// Removes what no record accounts for: directories, mounts and images
    /// of snapshots removed (or never finished) before a crash, and the
    /// upper directories of committed snapshots.
    pub(crate) fn cleanup(&self) -> Result<()> {
        let inner = self.lock();
        let ids: HashMap<u64, SnapKind> = inner.by_key.values().map(|r| (r.id, r.kind)).collect();
        // A kept layer's work directory that a stop left.
        for r in inner.by_key.values().filter(|r| r.kept) {
            let _ = std::fs::remove_dir_all(state::snapshot_dir(&self.root, r.id).join("work"));
        }
        let keep = Self::needed_uppers(&inner);
        let busy: HashSet<u64> = inner.ingesting.into_iter().collect();
        for id in ids_in(&self.root, state::MOUNTS) {
            if ids.get(&id) != Some(&SnapKind::Committed) {
                let m = state::mount_dir(&self.root, id);
                self.backend.unmount(&m);
                let _ = std::fs::remove_dir(&m);
            }
        }
        for id in ids_in(&self.root, state::SNAPSHOTS) {
            let dir = state::snapshot_dir(&self.root, id);
            match ids.get(&id) {
                None if !busy.contains(&id) => {
                    if let Err(e) = crate::worker::remove_snapshot_dir(self.backend.as_ref(), &dir) {
                        tracing::warn!("{e}");
                    }
                }
                Some(SnapKind::Committed) if !keep.contains(&id) => {
                    crate::worker::remove_leftovers(self.backend.as_ref(), &dir);
                }
                // A Commit that crashed: its files given back.
                Some(SnapKind::Active) if !busy.contains(&id) && dir.join(state::UNDO).exists() => {
                    if let Err(e) = self.backend.undo_store(id) {
                        tracing::warn!("snapshot {id}: {e}");
                    }
                }
                _ => {}
            }
        }
        for id in self.backend.held()? {
            if ids.get(&id) != Some(&SnapKind::Committed) && !busy.contains(&id) {
                let _ = self.backend.release(id, true);
            }
        }
        Ok(())
    }

    /// At start: committed snapshots whose sync a crash prevented. Their
    /// objects are checked against their digests (a power loss may have
    /// left names without their bytes); damaged ones are removed, so that
    /// no later layer is deduplicated against them, and the snapshot is
    /// named.
    pub(crate) fn check_unsynced(&self) {
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
        for (id, key) in todo {
            match self.backend.check_layer(id) {
                Ok(0) => {}
                Ok(damaged) => tracing::warn!(
                    "snapshot {key:?}: {damaged} of its files did not reach the disk before a crash and were removed \
                     from the store: remove its image and pull it again"
                ),
                Err(e) => tracing::warn!("snapshot {key:?}: {e}"),
            }
        }
        self.sync_committed();
    }
}
