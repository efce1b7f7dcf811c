//! How the kernel does the I/O of each open file: through its page cache
//! and our READ/WRITE, or (as root, FUSE_PASSTHROUGH) straight on the upper
//! file, which costs no request at all.
//!
//! The kernel insists that every open of an inode use one mode, and one
//! backing file for passthrough; an open answered otherwise fails with EIO.
//! So the mode is chosen per node: passthrough for upper files while no
//! open of the node goes through the page cache (files of the image are
//! always read through it: one opened before its copy-up keeps its mode),
//! with one backing file registered per node while it has such opens.
//!
//! Our counts fall at RELEASE, after the kernel's have, so they are never
//! below the kernel's: a mode we choose never conflicts with an open the
//! kernel still holds.

use super::nodes::NodeId;
use rustc_hash::FxHashMap;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use tilefs_fuse_proto::{BackingId, Connection};

pub(crate) struct IoModes {
    /// Passthrough negotiated and not refused since.
    passthrough: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    nodes: FxHashMap<NodeId, NodeIo>,
    /// Open file handle -> its node, and whether it is in passthrough.
    opens: FxHashMap<u64, (NodeId, bool)>,
}

#[derive(Default)]
struct NodeIo {
    cached: u32,
    passthrough: u32,
    backing: Option<BackingId>,
}

/// The mode chosen for one open.
pub(crate) enum IoMode {
    Cached,
    /// FOPEN_PASSTHROUGH with this backing id.
    Passthrough(i32),
}

impl IoModes {
    pub(crate) fn new() -> IoModes {
        IoModes {
            passthrough: AtomicBool::new(false),
            state: Mutex::new(State::default()),
        }
    }

    pub(crate) fn set_passthrough(&self, on: bool) {
        self.passthrough.store(on, Ordering::Relaxed);
    }

    pub(crate) fn passthrough(&self) -> bool {
        self.passthrough.load(Ordering::Relaxed)
    }

    /// Chooses the mode of open `fh` of node `id`; `upper`: the open upper
    /// file (None for a file of the image). Why passthrough stops, if the
    /// kernel refuses a backing file, goes to the server's log.
    pub(crate) fn open(&self, conn: Option<&Connection>, id: NodeId, fh: u64, upper: Option<BorrowedFd<'_>>) -> IoMode {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let n = st.nodes.entry(id).or_default();
        let mut mode = IoMode::Cached;
        if let (true, Some(fd), Some(conn), 0) = (self.passthrough(), upper, conn, n.cached) {
            if n.backing.is_none() {
                match conn.open_backing(fd) {
                    Ok(b) => n.backing = Some(b),
                    Err(e) => {
                        // An upper directory on a stacked filesystem, say:
                        // from now on every open goes through the cache.
                        self.passthrough.store(false, Ordering::Relaxed);
                        tracing::warn!("passthrough of upper files refused by the kernel ({e}); writing through the server instead");
                    }
                }
            }
            if let Some(b) = &n.backing {
                mode = IoMode::Passthrough(b.id());
            }
        }
        let pt = matches!(mode, IoMode::Passthrough(_));
        if pt {
            n.passthrough += 1;
        } else {
            n.cached += 1;
        }
        st.opens.insert(fh, (id, pt));
        mode
    }

    /// The open handles of node `id`.
    pub(crate) fn opens_of(&self, id: NodeId) -> Vec<u64> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !st.nodes.contains_key(&id) {
            return Vec::new();
        }
        st.opens
            .iter()
            .filter(|(_, (n, _))| *n == id)
            .map(|(fh, _)| *fh)
            .collect()
    }

    /// Open `fh` was released.
    pub(crate) fn release(&self, fh: u64) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some((id, pt)) = st.opens.remove(&fh) else {
            return;
        };
        let Some(n) = st.nodes.get_mut(&id) else {
            return;
        };
        if pt {
            n.passthrough = n.passthrough.saturating_sub(1);
        } else {
            n.cached = n.cached.saturating_sub(1);
        }
        if n.passthrough == 0 {
            n.backing = None;
        }
        if n.passthrough == 0 && n.cached == 0 {
            st.nodes.remove(&id);
        }
    }
}
