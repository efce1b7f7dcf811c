//! Idle CPUs kept polling, not halting, while requests flow.
//!
//! Every FUSE request is a round trip between two tasks: the caller sleeps
//! until the server replies, the server sleeps until the next request. In
//! a VM whose idle CPUs halt to the hypervisor (guest halt polling off),
//! waking a task on a halted CPU costs an exit and an entry, and these
//! dominate a metadata-heavy workload: an untar into the writable mount
//! ran 2x slower than with the CPUs kept awake (bench/PROFILE.md, "What
//! placement costs").
//!
//! So while requests come, the server holds a CPU latency QoS request of
//! 0 µs (/dev/cpu_dma_latency, root only): the cpuidle governor then picks
//! its polling state, the idle task spins instead of halting, and a wake-up
//! there needs no interrupt. The CPUs stay truly idle for the scheduler
//! (unlike a spinning thread of ours, which kept compilers from being
//! pulled onto them: a build ran 10-60% slower). The request is relaxed
//! once no request came for [`WINDOW`], and re-armed by the next one.

use std::fs::File;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

/// How long the CPUs keep polling after the last request.
pub const WINDOW: Duration = Duration::from_millis(1);

/// The latency the kernel assumes when nobody asks (PM_QOS's default):
/// writing it relaxes our request.
const NO_CONSTRAINT_US: i32 = 2_000_000_000;

/// What the request path touches, and the guard's state.
struct Activity {
    /// A request came since the manager last looked. Set only when clear,
    /// so that requests in a burst read it and do not bounce its line
    /// between CPUs.
    busy: AtomicBool,
    /// Our QoS request is 0 now (or about to be).
    armed: AtomicBool,
    /// /dev/cpu_dma_latency, held open while a guard runs; writes to it
    /// are serialized here.
    qos: Mutex<Option<File>>,
    manager: OnceLock<Thread>,
}

static ACTIVITY: Activity = Activity {
    busy: AtomicBool::new(false),
    armed: AtomicBool::new(true),
    qos: Mutex::new(None),
    manager: OnceLock::new(),
};

/// Called for every request received: marks the mount busy, and arms the
/// latency request if it was relaxed. (Without a guard, `armed` stays
/// true.)
#[inline]
pub(crate) fn request() {
    let a = &ACTIVITY;
    if !a.busy.load(Ordering::Relaxed) {
        a.busy.store(true, Ordering::Relaxed);
    }
    if !a.armed.load(Ordering::Relaxed) && !a.armed.swap(true, Ordering::AcqRel) {
        if let Some(f) = a.qos.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            // The device takes the value as a binary s32.
            let _ = f.write_all(&0i32.to_ne_bytes());
        }
        if let Some(t) = a.manager.get() {
            t.unpark();
        }
    }
}

/// CPUs at most for `worth_it`: the request holds every idle CPU of the
/// machine polling, not only those a caller and the server run on.
const MAX_CPUS: usize = 8;

/// Whether keeping CPUs polling is worth it here: in a VM (where a halted
/// CPU wakes through the hypervisor) whose kernel does not poll before
/// halting already, with 2 to MAX_CPUS CPUs. Otherwise the reason not to.
pub fn worth_it() -> Result<(), &'static str> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        return Err("one CPU");
    }
    if cpus > MAX_CPUS {
        return Err("more than 8 CPUs: every idle one would poll");
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let in_vm = cpuinfo
        .lines()
        .any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "hypervisor"));
    if !in_vm {
        return Err("not in a VM: waking an idle CPU is cheap");
    }
    let guest_poll = std::fs::read_to_string("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    if guest_poll > 0 {
        return Err("the kernel's guest halt polling is on");
    }
    Ok(())
}

/// Holds the latency request while requests flow, until dropped.
pub(crate) struct Guard {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Guard {
    /// Opens /dev/cpu_dma_latency (root only) and starts the thread that
    /// relaxes the request when requests stop. One per process.
    pub(crate) fn start() -> io::Result<Guard> {
        let a = &ACTIVITY;
        let mut qos = a.qos.lock().unwrap_or_else(|e| e.into_inner());
        if qos.is_some() || a.manager.get().is_some() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "already running in this process",
            ));
        }
        let mut f = File::options().write(true).open("/dev/cpu_dma_latency")?;
        f.write_all(&0i32.to_ne_bytes())?;
        *qos = Some(f);
        drop(qos);
        a.armed.store(true, Ordering::SeqCst);
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("fuse-idle-poll".into())
            .spawn(move || manage(&s))?;
        let _ = a.manager.set(thread.thread().clone());
        Ok(Guard {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
        // Closing the device removes the request.
        *ACTIVITY.qos.lock().unwrap_or_else(|e| e.into_inner()) = None;
        ACTIVITY.armed.store(true, Ordering::SeqCst);
    }
}

/// Relaxes the request once a WINDOW passes without a request; waits for
/// `request` to arm it again.
fn manage(stop: &AtomicBool) {
    let a = &ACTIVITY;
    while !stop.load(Ordering::SeqCst) {
        if !a.armed.load(Ordering::SeqCst) {
            std::thread::park();
            continue;
        }
        std::thread::sleep(WINDOW);
        if a.busy.swap(false, Ordering::Relaxed) {
            continue;
        }
        // Under the device's lock, so an arming write cannot come between
        // our flag and our write and be undone by it.
        let mut qos = a.qos.lock().unwrap_or_else(|e| e.into_inner());
        if !a.busy.load(Ordering::Relaxed) {
            a.armed.store(false, Ordering::SeqCst);
            if let Some(f) = qos.as_mut() {
                let _ = f.write_all(&NO_CONSTRAINT_US.to_ne_bytes());
            }
        }
    }
}
