//! Which /dev/fuse workers read: one at a time, the others parked until
//! a request may block.
//!
//! The kernel hands each request to the worker that has waited longest in
//! read(2). With every worker reading, requests therefore go round the
//! workers in turn, each one cold and often woken on the other CPU; one
//! worker answering everything was 2-3% faster on cold lookups and 2-4% on
//! a build (bench/PROFILE.md). But a request that waits (for a disk, a copy,
//! a registry) must not hold up the others. So a worker about to wait says
//! so ([`may_block`]) and a parked one takes over reading, and a watchdog
//! does the same for a request that has run longer than [`STALL`] without
//! saying so. FORGETs call a second reader as well (see `serve_dev`).

use rustix::io::{preadv2, ReadWriteFlags};
use std::cell::RefCell;
use std::io::IoSliceMut;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long the mount may go unread while a request runs before the
/// watchdog wakes a parked worker.
pub(crate) const STALL: Duration = Duration::from_millis(10);

/// With no request for this long, the watchdog sleeps until the next one
/// (so an idle mount wakes no CPU).
const IDLE: Duration = Duration::from_secs(1);

pub(crate) struct Readers {
    state: Mutex<State>,
    /// Parked workers wait here.
    parked: Condvar,
    /// The watchdog waits here.
    watch: Condvar,
}

#[derive(Default)]
struct State {
    /// Workers in read(2), or on their way there.
    reading: usize,
    /// Workers parked, and how many of them have been called.
    parked: usize,
    called: usize,
    /// Since when no worker reads while one answers a request.
    unread_since: Option<Instant>,
    /// Requests taken so far (the watchdog's sign of activity).
    taken: u64,
    watchdog_asleep: bool,
    stop: bool,
}

thread_local! {
    /// The pool of the worker running on this thread, if any.
    static POOL: RefCell<Option<Arc<Readers>>> = const { RefCell::new(None) };
}

/// Says that this thread's request is about to wait (for I/O, a lock held
/// long, the network): if the thread is a /dev/fuse worker and nobody else
/// reads, a parked worker takes over reading. Elsewhere it does nothing.
pub fn may_block() {
    POOL.with(|p| {
        if let Some(r) = &*p.borrow() {
            let mut st = r.lock();
            r.call(&mut st);
        }
    });
}

/// [`may_block`] if reading `len` bytes of `file` at `offset` would wait
/// for the disk: when its first or last page is not in the page cache.
pub(crate) fn may_block_reading(file: BorrowedFd<'_>, offset: u64, len: usize) {
    let pooled = POOL.with(|p| p.borrow().is_some());
    if !pooled || len == 0 {
        return;
    }
    let mut byte = [0u8; 1];
    // Any error (EAGAIN: not cached; EINVAL: O_DIRECT) counts as a wait.
    let mut cached = |at: u64| preadv2(file, &mut [IoSliceMut::new(&mut byte)], at, ReadWriteFlags::NOWAIT).is_ok();
    let last = offset.saturating_add(len as u64 - 1);
    if !cached(offset) || (last / 4096 != offset / 4096 && !cached(last)) {
        may_block();
    }
}

impl Readers {
    /// A pool of `workers`, all of them reading at first. The first to
    /// come back from a request while another reads parks.
    pub(crate) fn new(workers: usize) -> Arc<Readers> {
        Arc::new(Readers {
            state: Mutex::new(State {
                reading: workers,
                ..State::default()
            }),
            parked: Condvar::new(),
            watch: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Calls a parked worker to read if nobody does.
    fn call(&self, st: &mut State) {
        if st.reading == 0 && st.parked > st.called && !st.stop {
            st.called += 1;
            st.unread_since = None;
            self.parked.notify_one();
        }
    }

    /// Makes this thread a worker of the pool (for [`may_block`]).
    pub(crate) fn enter(self: &Arc<Self>) {
        POOL.with(|p| *p.borrow_mut() = Some(self.clone()));
    }

    /// The worker read a request and is about to answer it.
    pub(crate) fn took(&self) {
        let mut st = self.lock();
        st.reading -= 1;
        st.taken += 1;
        if st.reading == 0 {
            st.unread_since = Some(Instant::now());
        }
        if st.watchdog_asleep {
            st.watchdog_asleep = false;
            self.watch.notify_one();
        }
    }

    /// The worker answered its request. Returns true when it is to read
    /// again, false when the pool stops.
    pub(crate) fn answered(&self) -> bool {
        let mut st = self.lock();
        while st.reading > 0 && !st.stop {
            st.parked += 1;
            st = self.parked.wait(st).unwrap_or_else(|e| e.into_inner());
            st.parked -= 1;
            if st.called > 0 {
                st.called -= 1;
                break;
            }
        }
        if st.stop {
            return false;
        }
        st.reading += 1;
        st.unread_since = None;
        true
    }

    /// A reading worker leaves (its read failed): another reads instead.
    pub(crate) fn left(&self) {
        let mut st = self.lock();
        st.reading -= 1;
        self.call(&mut st);
    }

    /// The connection ended: every worker and the watchdog stop.
    pub(crate) fn stop(&self) {
        let mut st = self.lock();
        st.stop = true;
        self.parked.notify_all();
        self.watch.notify_all();
    }

    /// Wakes a parked worker whenever a request has run for [`STALL`]
    /// with nobody reading; returns when the pool stops.
    pub(crate) fn watchdog(&self) {
        let mut st = self.lock();
        let mut seen = st.taken;
        let mut quiet = Duration::ZERO;
        while !st.stop {
            if let Some(t) = st.unread_since {
                if t.elapsed() >= STALL {
                    self.call(&mut st);
                }
            }
            if st.taken == seen {
                quiet += STALL;
            } else {
                (seen, quiet) = (st.taken, Duration::ZERO);
            }
            if quiet >= IDLE && st.unread_since.is_none() {
                st.watchdog_asleep = true;
                while st.watchdog_asleep && !st.stop {
                    st = self.watch.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                quiet = Duration::ZERO;
                seen = st.taken;
                continue;
            }
            st = self.watch.wait_timeout(st, STALL).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Two workers: one stays reading while the other answers, and the
    /// parked one is called when a request may block.
    #[test]
    fn a_worker_that_may_block_hands_reading_over() {
        let r = Readers::new(2);
        // Worker A takes a request, answers it: B still reads, so A parks
        // until B takes one and says it may block.
        let a = {
            let r = r.clone();
            std::thread::spawn(move || {
                r.enter();
                r.took();
                r.answered()
            })
        };
        while r.lock().parked == 0 {
            std::thread::yield_now();
        }
        r.enter();
        r.took();
        may_block();
        assert!(a.join().unwrap(), "the parked worker was called to read");
        assert_eq!(r.lock().reading, 1);
        r.stop();
        assert!(!r.answered());
    }

    /// A request that runs past STALL without saying so gets the parked
    /// worker called by the watchdog.
    #[test]
    fn the_watchdog_calls_a_parked_worker_when_nobody_reads() {
        let r = Readers::new(2);
        let woken = Arc::new(AtomicUsize::new(0));
        let dog = {
            let r = r.clone();
            std::thread::spawn(move || r.watchdog())
        };
        let a = {
            let (r, woken) = (r.clone(), woken.clone());
            std::thread::spawn(move || {
                r.took();
                let again = r.answered();
                woken.fetch_add(1, Ordering::SeqCst);
                again
            })
        };
        while r.lock().parked == 0 {
            std::thread::yield_now();
        }
        r.took();
        std::thread::sleep(STALL * 5);
        assert_eq!(woken.load(Ordering::SeqCst), 1, "called after a stall");
        assert!(a.join().unwrap());
        r.stop();
        dog.join().unwrap();
    }
}
