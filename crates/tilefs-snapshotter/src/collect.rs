//! Giving the space back: the objects of the images of removed snapshots
//! are collected a while after the last Remove, without anyone running
//! `tilefs gc`.
//!
//! containerd removes an image's snapshots one by one (its gc, after
//! `crictl rmi` or `ctr images rm`); each Remove lets go of an image the
//! snapshotter held and hands its objects here as candidates. Once no
//! Remove came for the configured delay, a gc limited to the candidates
//! runs ([`tilefs_store::gc::GcOptions::only`]): every root of the store
//! (tags, held images, live mounts) is read, and only candidates none of
//! them references go. Objects the snapshotter never knew of (an image a
//! user untagged) are left to `tilefs gc`.
//!
//! gc takes the store's lock exclusively: it is asked for without waiting,
//! and a store busy with an import (a layer the snapshotter stores, a pull)
//! is tried again a little later, so neither waits for the other. The
//! candidates are appended to `ROOT/uncollected` as they come, so a stop or
//! crash before the collection does not lose them: the next start
//! collects them.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tilefs_store::gc::{gc, GcOptions};
use tilefs_store::{Store, StoreError};

/// Candidates not yet collected.
pub const UNCOLLECTED: &str = "uncollected";
/// How soon a collection that found the store busy is tried again.
const RETRY: Duration = Duration::from_secs(2);
/// How soon one that failed otherwise is.
const AFTER_FAILURE: Duration = Duration::from_secs(300);

pub struct Collector {
    store: PathBuf,
    file: PathBuf,
    /// None: no collection (candidates are only recorded).
    delay: Option<Duration>,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    /// Waiting for the next collection.
    candidates: HashSet<[u8; 32]>,
    /// Being collected (an image let go meanwhile may add them again).
    collecting: HashSet<[u8; 32]>,
    due: Option<Instant>,
}

impl Collector {
    /// A collector for `store`, its candidates kept under `root`; with a
    /// delay, its thread started (and the candidates a stop left
    /// scheduled).
    pub fn start(store: &Path, root: &Path, delay: Option<Duration>) -> crate::Result<Arc<Collector>> {
        let file = root.join(UNCOLLECTED);
        let candidates = load(&file);
        let due = (!candidates.is_empty())
            .then(Instant::now)
            .zip(delay)
            .map(|(t, d)| t + d);
        let c = Arc::new(Collector {
            store: store.to_path_buf(),
            file,
            delay,
            state: Mutex::new(State {
                candidates,
                due,
                ..State::default()
            }),
            wake: Condvar::new(),
        });
        if delay.is_some() {
            let me = c.clone();
            std::thread::Builder::new()
                .name("tilefs-collect".into())
                .spawn(move || me.run())
                .map_err(|e| crate::Error::Broken(format!("cannot start the snapshotter's collector: {e}")))?;
        }
        Ok(c)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `objects` may be free now: collected after the delay (which
    /// starts again).
    pub fn add(&self, objects: impl IntoIterator<Item = [u8; 32]>) {
        let mut st = self.state();
        let new: Vec<[u8; 32]> = objects.into_iter().filter(|d| st.candidates.insert(*d)).collect();
        // (Those being collected are recorded again: the collection
        // rewrites the file with what remains.)
        if !new.is_empty() {
            // Not synced: a power loss loses only the chance to collect
            // them without `tilefs gc`.
            let appended = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.file)
                .and_then(|mut f| f.write_all(&new.concat()));
            if let Err(e) = appended {
                tracing::warn!("{}: {e}", self.file.display());
            }
        }
        if let Some(d) = self.delay {
            st.due = Some(Instant::now() + d);
            self.wake.notify_all();
        }
    }

    fn run(&self) {
        loop {
            let mut st = self.state();
            let now = Instant::now();
            match st.due {
                Some(due) if due <= now => {}
                Some(due) => {
                    drop(self.wake.wait_timeout(st, due - now));
                    continue;
                }
                None => {
                    drop(self.wake.wait(st));
                    continue;
                }
            }
            st.collecting = std::mem::take(&mut st.candidates);
            st.due = None;
            let taken = st.collecting.clone();
            drop(st);
            let next = self.collect(taken);
            let mut st = self.state();
            let collecting = std::mem::take(&mut st.collecting);
            if let Some(after) = next {
                st.candidates.extend(collecting);
                // A Remove meanwhile may have set it sooner or later.
                st.due.get_or_insert(Instant::now() + after);
            }
            let rest: Vec<u8> = st.candidates.iter().flatten().copied().collect();
            let saved = if rest.is_empty() {
                std::fs::remove_file(&self.file).or_else(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => Ok(()),
                    _ => Err(crate::Error::io(&self.file, "cannot remove", e)),
                })
            } else {
                crate::state::write_atomic(&self.file, &rest)
            };
            if let Err(e) = saved {
                tracing::warn!("{}: {e}", self.file.display());
            }
        }
    }

    /// Collects `taken`; when to try again, if need be.
    fn collect(&self, taken: HashSet<[u8; 32]>) -> Option<Duration> {
        let started = Instant::now();
        let count = taken.len();
        let opts = GcOptions {
            only: Some(taken),
            no_wait: true,
            ..GcOptions::default()
        };
        let r = match Store::open(&self.store).and_then(|s| gc(&s, &opts)) {
            Ok(r) => r,
            Err(StoreError::Busy(_)) => return Some(RETRY),
            Err(e) => {
                tracing::warn!(
                    "collecting the objects of removed snapshots failed (tried again in {} s): {e}",
                    AFTER_FAILURE.as_secs()
                );
                return Some(AFTER_FAILURE);
            }
        };
        tracing::info!(
            "collected {} objects ({} bytes) of {count} that removed snapshots used, in {:.2} s",
            r.objects_removed,
            r.bytes_removed,
            started.elapsed().as_secs_f64()
        );
        None
    }
}

/// The candidates recorded in `file` (32 bytes each; a torn last one is
/// dropped).
fn load(file: &Path) -> HashSet<[u8; 32]> {
    let mut bytes = Vec::new();
    if let Ok(f) = std::fs::File::open(file) {
        // At most a million candidates are remembered across a restart.
        let _ = f.take(32 << 20).read_to_end(&mut bytes);
    }
    bytes
        .chunks_exact(32)
        .map(|c| c.try_into().expect("32 bytes"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_survive_a_restart_and_are_collected() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::create(&dir.path().join("store")).unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let put = |bytes: &[u8]| {
            let d = tilefs_image::verity::digest_bytes(bytes);
            let p = store.object_path(&d);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, bytes).unwrap();
            d
        };
        let (a, b) = (put(&[1u8; 100]), put(&[2u8; 100]));
        // Recorded without collecting, as by a snapshotter that stops.
        Collector::start(store.path(), &root, None).unwrap().add([a, b]);
        assert_eq!(load(&root.join(UNCOLLECTED)).len(), 2);
        let c = Collector::start(store.path(), &root, Some(Duration::from_millis(10))).unwrap();
        let t = Instant::now();
        while store.has_object(&a) || store.has_object(&b) || root.join(UNCOLLECTED).exists() {
            assert!(t.elapsed() < Duration::from_secs(10), "not collected");
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(c);
    }
}
