//! Objects being fetched, across every process using a store: a fetch
//! holds, for each object it brings, a byte-range lock on
//! `STORE/.fetch-lock` over a span that stands for the object (callers
//! choose spans: one object, one span, in every process). Another fetch
//! of the object waits for the lock and then finds the object stored.
//!
//! The locks are open-file-description locks: two fetches of one process
//! exclude each other as two processes do, and a process that dies lets go
//! of its locks with its descriptors. Nothing else depends on them: an
//! object is checked and stored whole whoever fetches it, so a fetch that
//! cannot lock (a store it may not write, a filesystem without locks) only
//! risks a second transfer of an object, never a wrong one.

use crate::Store;
use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{self as rfs, Mode, OFlags};
use rustix::io::Errno;
use std::time::{Duration, Instant};
use tilefs_sys::fs::{ofd_lock, RangeLock};

/// The lock file, at the store's top.
pub use crate::layout::FETCH_LOCK;

/// Bytes `start..start + len` of the lock file (`len` at least 1: a zero
/// length would lock to the end of the file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: u64,
    pub len: u64,
}

/// The locks one fetch holds, on its own open file description of the
/// lock file; all let go when dropped.
pub struct FetchLocks {
    fd: OwnedFd,
}

impl FetchLocks {
    /// Opens the store's lock file for a new fetch. None when it cannot be
    /// (a store we may not write, a symlink or other non-file there): the
    /// fetch then goes on uncoordinated with other processes.
    pub fn open(store: &Store) -> Option<FetchLocks> {
        let fd = rfs::openat(
            store.dir_fd(),
            FETCH_LOCK,
            OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            // Only those who may write the store fetch into it; a reader's
            // shared lock could only hold their fetches back.
            Mode::from_raw_mode(0o600),
        )
        .ok()?;
        let regular = rfs::fstat(&fd).is_ok_and(|st| rfs::FileType::from_raw_mode(st.st_mode).is_file());
        regular.then_some(FetchLocks { fd })
    }

    /// Takes the lock of `span` if no other fetch holds it. A lock the
    /// filesystem cannot take at all counts as taken (see the module's
    /// comment: the locks only save transfers).
    pub fn try_lock(&self, span: Span) -> bool {
        match self.set(span, RangeLock::Exclusive) {
            Ok(()) => true,
            Err(e) => !matches!(e, Errno::AGAIN | Errno::ACCESS),
        }
    }

    /// Takes the lock of `span`, waiting while another fetch holds it, but
    /// not past `deadline` (a fetch elsewhere that hangs, or a process
    /// stopped while it held the lock, must not stall ours): false if the
    /// deadline came first.
    pub fn lock(&self, span: Span, deadline: Instant) -> bool {
        let mut pause = Duration::from_millis(2);
        loop {
            if self.try_lock(span) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Lets go of the lock of `span`.
    pub fn unlock(&self, span: Span) {
        let _ = self.set(span, RangeLock::Unlock);
    }

    fn set(&self, span: Span, kind: RangeLock) -> Result<(), Errno> {
        ofd_lock(self.fd.as_fd(), kind, span.start, span.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_exclude_other_fetches_until_let_go() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::create(dir.path()).unwrap();
        let (a, b) = (FetchLocks::open(&store).unwrap(), FetchLocks::open(&store).unwrap());
        let mode = rfs::fstat(&a.fd).unwrap().st_mode & 0o7777;
        assert_eq!(mode, 0o600, "only the store's writers may lock");
        let x = Span { start: 100, len: 50 };
        let y = Span { start: 150, len: 10 };
        assert!(a.try_lock(x) && a.try_lock(y));
        assert!(!b.try_lock(Span { start: 120, len: 1 }));
        assert!(
            !b.lock(y, Instant::now() + Duration::from_millis(20)),
            "waits no longer than asked"
        );
        a.unlock(y);
        assert!(b.try_lock(y), "a span let go is free");
        assert!(!b.try_lock(x));
        drop(a);
        assert!(b.try_lock(x), "every span goes with its fetch");
    }
}
