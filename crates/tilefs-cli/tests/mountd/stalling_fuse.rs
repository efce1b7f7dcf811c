//! A hostile user's FUSE filesystem that stops answering: mounted as
//! fusermount3 mounts one for a user (`user_id=` the user, `allow_other`,
//! as /etc/fuse.conf's `user_allow_other` permits), with one directory
//! `sub` of the user's own. Once armed ([`StallingFuse::arm`]), it
//! answers the kernel until the mount service has checked `sub` as a
//! mount point (the check ends with an ACCESS of the root, as the service
//! walks up), then holds every request from the next look at `sub` on (the
//! service checking it again before it attaches) unanswered until
//! [`StallingFuse::release`], and answers everything from then on. Dropping it closes /dev/fuse (the kernel
//! fails whatever was held) and detaches the mount.

use std::io::Read;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tilefs_fuse_proto::abi::{self, opcode};
use zerocopy::{FromBytes, IntoBytes};

const SUB: u64 = 2;

pub struct StallingFuse {
    pub root: PathBuf,
    state: Arc<State>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A request held: its unique id, opcode, node and body.
type Held = (u64, u32, u64, Vec<u8>);

struct State {
    dev: std::fs::File,
    uid: u32,
    /// Requests are held, not answered.
    stalled: AtomicBool,
    /// The next GETATTR of `sub` after an ACCESS of the root stalls it.
    armed: AtomicBool,
    root_checked: AtomicBool,
    held: Mutex<Vec<Held>>,
    /// Requests held so far, all told.
    held_total: AtomicUsize,
    stop: AtomicBool,
}

impl StallingFuse {
    /// Mounts it at `root` (an existing directory) for user `uid`.
    pub fn mount(root: &Path, uid: u32) -> StallingFuse {
        let dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
            .unwrap();
        let data = std::ffi::CString::new(format!(
            "fd={},rootmode=40755,user_id={uid},group_id={uid},allow_other",
            std::os::fd::AsRawFd::as_raw_fd(&dev)
        ))
        .unwrap();
        rustix::mount::mount(
            "stalling",
            root,
            "fuse.stalling",
            rustix::mount::MountFlags::NOSUID | rustix::mount::MountFlags::NODEV,
            data.as_c_str(),
        )
        .unwrap();
        let state = Arc::new(State {
            dev,
            uid,
            stalled: AtomicBool::new(false),
            armed: AtomicBool::new(false),
            root_checked: AtomicBool::new(false),
            held: Mutex::new(Vec::new()),
            held_total: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let s = state.clone();
        let thread = std::thread::spawn(move || s.serve());
        StallingFuse {
            root: root.to_path_buf(),
            state,
            thread: Some(thread),
        }
    }

    /// The user's directory in it.
    pub fn sub(&self) -> PathBuf {
        self.root.join("sub")
    }

    /// Waits until at least `n` requests have been held (since mounting).
    pub fn wait_held(&self, n: usize) {
        let end = std::time::Instant::now() + Duration::from_secs(20);
        while self.state.held_total.load(Ordering::SeqCst) < n {
            assert!(std::time::Instant::now() < end, "fewer than {n} requests came");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stalls at the next check of `sub` after the next ACCESS of the root.
    pub fn arm(&self) {
        self.state.root_checked.store(false, Ordering::SeqCst);
        self.state.armed.store(true, Ordering::SeqCst);
    }

    /// Answers what was held and everything after.
    pub fn release(&self) {
        self.state.armed.store(false, Ordering::SeqCst);
        self.state.stalled.store(false, Ordering::SeqCst);
        let held = std::mem::take(&mut *self.state.held.lock().unwrap());
        for (unique, op, node, body) in held {
            self.state.answer(unique, op, node, &body);
        }
    }
}

impl Drop for StallingFuse {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = rustix::mount::unmount(&self.root, rustix::mount::UnmountFlags::DETACH);
        // The last reference to /dev/fuse goes with `state`: the kernel
        // aborts the connection, failing whatever it still waits for.
    }
}

impl State {
    fn serve(&self) {
        let mut buf = vec![0u8; 1 << 17];
        loop {
            let mut poll = [rustix::event::PollFd::new(&self.dev, rustix::event::PollFlags::IN)];
            let tick = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 50_000_000,
            };
            let _ = rustix::event::poll(&mut poll, Some(&tick));
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            if poll[0].revents().is_empty() {
                continue;
            }
            let n = match (&self.dev).read(&mut buf) {
                Ok(n) => n,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) || e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(_) => return,
            };
            let Ok((h, body)) = abi::InHeader::read_from_prefix(&buf[..n]) else {
                continue;
            };
            if matches!(h.opcode, opcode::FORGET | opcode::BATCH_FORGET) {
                continue;
            }
            if h.opcode == opcode::GETATTR
                && h.nodeid == SUB
                && self.armed.load(Ordering::SeqCst)
                && self.root_checked.load(Ordering::SeqCst)
            {
                self.stalled.store(true, Ordering::SeqCst);
            }
            if self.stalled.load(Ordering::SeqCst) {
                self.held
                    .lock()
                    .unwrap()
                    .push((h.unique, h.opcode, h.nodeid, body.to_vec()));
                self.held_total.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            if h.opcode == opcode::ACCESS && h.nodeid == abi::ROOT_ID {
                self.root_checked.store(true, Ordering::SeqCst);
            }
            self.answer(h.unique, h.opcode, h.nodeid, body);
        }
    }

    fn attr(&self, node: u64) -> abi::Attr {
        abi::Attr {
            ino: node,
            mode: libc::S_IFDIR | 0o755,
            nlink: 2,
            uid: self.uid,
            gid: self.uid,
            blksize: 4096,
            ..abi::Attr::default()
        }
    }

    fn answer(&self, unique: u64, op: u32, node: u64, body: &[u8]) {
        let (error, out): (i32, Vec<u8>) = match op {
            opcode::INIT => {
                let init = abi::InitIn::read_from_prefix(body).map(|(i, _)| i).unwrap_or_default();
                let out = abi::InitOut {
                    major: abi::KERNEL_VERSION,
                    minor: init.minor.min(abi::KERNEL_MINOR_VERSION),
                    max_readahead: init.max_readahead,
                    max_write: 4096,
                    ..abi::InitOut::default()
                };
                (0, out.as_bytes().to_vec())
            }
            opcode::LOOKUP if node == abi::ROOT_ID && body.starts_with(b"sub\0") => {
                let e = abi::EntryOut {
                    nodeid: SUB,
                    entry_valid: 3600,
                    attr: self.attr(SUB),
                    ..abi::EntryOut::default()
                };
                (0, e.as_bytes().to_vec())
            }
            opcode::LOOKUP => (-libc::ENOENT, Vec::new()),
            // Attributes never cached: every stat asks.
            opcode::GETATTR => {
                let a = abi::AttrOut {
                    attr: self.attr(node),
                    ..abi::AttrOut::default()
                };
                (0, a.as_bytes().to_vec())
            }
            opcode::ACCESS => (0, Vec::new()),
            _ => (-libc::ENOSYS, Vec::new()),
        };
        let h = abi::OutHeader {
            len: (std::mem::size_of::<abi::OutHeader>() + out.len()) as u32,
            error,
            unique,
        };
        let mut msg = h.as_bytes().to_vec();
        msg.extend_from_slice(&out);
        let _ = rustix::io::write(self.dev.as_fd(), &msg);
    }
}
