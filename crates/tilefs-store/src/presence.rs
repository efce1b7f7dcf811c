//! Which objects a store holds, for checks over many objects at once
//! (a whole image's): fan-out directories are listed, names only, each at
//! most once, rather than each object looked up (a cold lookup reads an
//! inode per object).

use crate::Store;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// Which objects the store holds, learnt by listing the fan-out
/// directories (names only: no inode is read per object, which is what a
/// cold check would cost), each at most once.
#[derive(Default)]
pub struct Presence {
    listed: Mutex<HashMap<u8, Arc<HashSet<[u8; 31]>>>>,
    /// Placeholders (listed under their object names, but not fetched).
    placeholders: std::sync::OnceLock<HashSet<[u8; 32]>>,
}

impl Presence {
    fn fanout(&self, store: &Store, fan: u8) -> Arc<HashSet<[u8; 31]>> {
        if let Some(set) = self.listed.lock().unwrap().get(&fan) {
            return set.clone();
        }
        use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags};
        let mut set = HashSet::new();
        // The fan-out directory itself, never one a symlink points to.
        let dir = rustix::fs::openat(
            store.dir_fd(),
            format!("{fan:02x}"),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        );
        if let Ok(dir) = dir {
            if let Ok(mut entries) = Dir::read_from(&dir) {
                while let Some(Ok(e)) = entries.next() {
                    let mut rest = [0u8; 31];
                    if hex::decode_to_slice(e.file_name().to_bytes(), &mut rest).is_err() {
                        continue;
                    }
                    // Filesystems that do not say the type in the listing
                    // are asked (names only would not do: a directory or
                    // a symlink there is no object).
                    let regular = match e.file_type() {
                        FileType::Unknown => rustix::fs::statat(&dir, e.file_name(), AtFlags::SYMLINK_NOFOLLOW)
                            .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::RegularFile),
                        t => t == FileType::RegularFile,
                    };
                    if regular {
                        set.insert(rest);
                    }
                }
            }
        }
        let set = Arc::new(set);
        self.listed.lock().unwrap().insert(fan, set.clone());
        set
    }

    /// Whether every one of `objects` (sorted by first byte, for one
    /// listing per fan-out) is present.
    pub fn all_present(&self, store: &Store, objects: &[&[u8; 32]]) -> bool {
        let placeholders = self.placeholders.get_or_init(|| crate::placeholder::list(store));
        if objects.iter().any(|o| placeholders.contains(*o)) {
            return false;
        }
        let mut current: Option<(u8, Arc<HashSet<[u8; 31]>>)> = None;
        objects.iter().all(|o| {
            let set = match &current {
                Some((fan, set)) if *fan == o[0] => set.clone(),
                _ => {
                    let set = self.fanout(store, o[0]);
                    current = Some((o[0], set.clone()));
                    set
                }
            };
            let mut rest = [0u8; 31];
            rest.copy_from_slice(&o[1..]);
            set.contains(&rest)
        })
    }
}

/// The objects of `objects` the store does not hold.
pub fn absent(store: &Store, objects: impl IntoIterator<Item = [u8; 32]>) -> Vec<[u8; 32]> {
    let p = Presence::default();
    objects.into_iter().filter(|d| !p.all_present(store, &[d])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_behind_a_symlinked_fanout_are_not_present() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::create(&tmp.path().join("store")).unwrap();
        let (here, there) = ([0x11u8; 32], [0x22u8; 32]);
        let put = |root: &std::path::Path, d: &[u8; 32]| {
            let rel = Store::object_rel(d);
            std::fs::create_dir_all(root.join(&rel[..2])).unwrap();
            std::fs::write(root.join(&rel), b"x").unwrap();
        };
        put(store.path(), &here);
        // Another tree's fan-out directory, linked into the store.
        let outside = tmp.path().join("outside");
        put(&outside, &there);
        std::os::unix::fs::symlink(outside.join("22"), store.path().join("22")).unwrap();
        assert_eq!(absent(&store, [here, there]), vec![there]);
        assert!(!store.has_object(&there));
    }
}
