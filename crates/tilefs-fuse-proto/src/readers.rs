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
//! does the same for a request that has run 10 to 20 ms ([`STALL`]) without
//! saying so. FORGETs call a second reader as well (see `serve_dev`).

use rustix::io::{preadv2, ReadWriteFlags};
use std::cell::RefCell;
use std::io::IoSliceMut;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// The watchdog's tick: a request that has run a whole tick with nobody
/// reading (so for 10 to 20 ms) gets a parked worker called.
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
/// (Not even looked at when no worker could take over.)
pub(crate) fn may_block_reading(file: BorrowedFd<'_>, offset: u64, len: usize) {
    let could = POOL.with(|p| p.borrow().as_ref().is_some_and(|r| r.could_call(&r.lock())));
    if !could || len == 0 {
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

    /// Whether [`Readers::call`] would call a worker.
    fn could_call(&self, st: &State) -> bool {
        st.reading == 0 && st.parked > st.called && !st.stop
    }

    /// Calls a parked worker to read if nobody does.
    fn call(&self, st: &mut State) {
        if self.could_call(st) {
            st.called += 1;
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

    /// Calls a parked worker whenever a whole tick ([`STALL`]) went by
    /// with no request taken and nobody reading; returns when the pool stops.
    pub(crate) fn watchdog(&self) {
        let mut st = self.lock();
        let mut seen = st.taken;
        let mut quiet = Duration::ZERO;
        while !st.stop {
            st = self.watch.wait_timeout(st, STALL).unwrap_or_else(|e| e.into_inner()).0;
            if st.taken != seen {
                (seen, quiet) = (st.taken, Duration::ZERO);
            } else if st.reading == 0 {
                // The request being answered was taken before this tick.
                self.call(&mut st);
            } else {
                quiet += STALL;
                if quiet >= IDLE {
                    st.watchdog_asleep = true;
                    while st.watchdog_asleep && !st.stop {
                        st = self.watch.wait(st).unwrap_or_else(|e| e.into_inner());
                    }
                    (seen, quiet) = (st.taken, Duration::ZERO);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::thread::JoinHandle;
    use std::time::Instant;

    /// Of a pool of two, worker A takes a request and answers it while the
    /// other still reads, so it parks. Returns A and the flag it sets when
    /// it is called back to read.
    fn park_one(r: &Arc<Readers>) -> (JoinHandle<bool>, Arc<AtomicBool>) {
        let called = Arc::new(AtomicBool::new(false));
        let a = {
            let (r, called) = (r.clone(), called.clone());
            std::thread::spawn(move || {
                r.enter();
                r.took();
                let again = r.answered();
                called.store(true, Ordering::SeqCst);
                again
            })
        };
        while r.lock().parked == 0 {
            std::thread::yield_now();
        }
        (a, called)
    }

    /// Waits up to 5 s for `flag`; stops the pool (so nothing is left
    /// waiting) if it never comes.
    fn wait_for(r: &Readers, flag: &AtomicBool, what: &str) {
        let t = Instant::now();
        while !flag.load(Ordering::SeqCst) {
            if t.elapsed() > Duration::from_secs(5) {
                r.stop();
                panic!("{what}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_worker_that_may_block_hands_reading_over() {
        let r = Readers::new(2);
        let (a, called) = park_one(&r);
        r.enter();
        // This thread still reads: nothing to hand over.
        may_block();
        std::thread::sleep(Duration::from_millis(20));
        assert!(!called.load(Ordering::SeqCst), "called while another read");
        // It takes a request that may block: A reads instead.
        r.took();
        may_block();
        wait_for(&r, &called, "the parked worker was not called to read");
        assert!(a.join().unwrap());
        assert_eq!(r.lock().reading, 1);
        r.stop();
        assert!(!r.answered(), "a stopped pool sends its workers home");
    }

    #[test]
    fn the_watchdog_calls_a_parked_worker_when_nobody_reads() {
        let r = Readers::new(2);
        let dog = {
            let r = r.clone();
            std::thread::spawn(move || r.watchdog())
        };
        let (a, called) = park_one(&r);
        std::thread::sleep(STALL * 3);
        assert!(!called.load(Ordering::SeqCst), "called while another read");
        // The reader takes a request that runs on without saying so.
        r.took();
        wait_for(&r, &called, "the watchdog called nobody");
        assert!(a.join().unwrap());
        r.stop();
        dog.join().unwrap();
    }
}
