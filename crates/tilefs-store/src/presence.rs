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
}

impl Presence {
    fn fanout(&self, store: &Store, fan: u8) -> Arc<HashSet<[u8; 31]>> {
        if let Some(set) = self.listed.lock().unwrap().get(&fan) {
            return set.clone();
        }
        let mut set = HashSet::new();
        if let Ok(rd) = std::fs::read_dir(store.join(format!("{fan:02x}"))) {
            for e in rd.filter_map(|e| e.ok()) {
                let mut rest = [0u8; 31];
                let name = e.file_name();
                if hex::decode_to_slice(std::os::unix::ffi::OsStrExt::as_bytes(name.as_os_str()), &mut rest).is_ok()
                    && e.file_type().is_ok_and(|t| t.is_file())
                {
                    set.insert(rest);
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
