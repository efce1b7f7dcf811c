//! The nodes the kernel knows of a writable mount, and where each is.
//!
//! A node is a file or directory of the merged tree: its image inode (the
//! lower part), its upper entry, or both (a merged directory). Nodes are
//! found again by name in their directory, by upper inode (the names of
//! an upper hardlink are one node), and by image directory (each image
//! directory appears once in the merged tree). A file of the image is a
//! node per path: copying up one name of an image hardlink must not change
//! what its other names show, as in the kernel's overlay.

use rustc_hash::FxHashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use tilefs_image::tree::InodeId;

pub(crate) type NodeId = u64;

pub(crate) const ROOT: NodeId = 1;

/// Where a node's upper entry is.
pub(crate) struct Node {
    /// Lookups the kernel holds.
    pub(crate) refs: u64,
    /// S_IFMT bits of the type shown.
    pub(crate) kind: u32,
    /// The inode number shown.
    pub(crate) ino: u64,
    /// Names it has in the merged tree (directory, name): the first is
    /// the one used to reach its upper entry. A directory has one.
    pub(crate) names: Vec<(NodeId, Box<[u8]>)>,
    /// The image inode shown (a file not copied up, or the image side of
    /// a directory).
    pub(crate) lower: Option<InodeId>,
    /// It has an upper entry.
    pub(crate) upper: bool,
    /// A directory's upper directory (O_PATH), once known.
    pub(crate) dir_fd: Option<Arc<OwnedFd>>,
    /// A directory that hides the image directory of its name.
    pub(crate) opaque: bool,
    /// The upper entry's inode (non-directories: the key of `by_upper`).
    pub(crate) upper_ino: Option<u64>,
    /// An upper file with no name left (unlinked while open, or an
    /// O_TMPFILE): a descriptor of it.
    pub(crate) orphan: Option<Arc<OwnedFd>>,
}

impl Node {
    pub(crate) fn is_dir(&self) -> bool {
        self.kind == libc::S_IFDIR
    }

    /// The name used to reach the upper entry, if any.
    pub(crate) fn primary(&self) -> Option<(NodeId, &[u8])> {
        self.names.first().map(|(p, n)| (*p, &n[..]))
    }
}

#[derive(Default)]
pub(crate) struct Nodes {
    pub(crate) map: FxHashMap<NodeId, Node>,
    /// (directory, name) -> node, for every name of every node.
    pub(crate) by_name: FxHashMap<(NodeId, Box<[u8]>), NodeId>,
    /// Upper inode -> node, for upper non-directories.
    pub(crate) by_upper: FxHashMap<u64, NodeId>,
    /// Image directory -> node.
    pub(crate) by_lower_dir: FxHashMap<InodeId, NodeId>,
    next: NodeId,
}

impl Nodes {
    pub(crate) fn new(root: Node) -> Nodes {
        let mut n = Nodes {
            next: ROOT + 1,
            ..Nodes::default()
        };
        if let Some(l) = root.lower {
            n.by_lower_dir.insert(l, ROOT);
        }
        n.map.insert(ROOT, root);
        n
    }

    pub(crate) fn get(&self, id: NodeId) -> Option<&Node> {
        self.map.get(&id)
    }

    pub(crate) fn get_mut(&mut self, id: NodeId) -> Option<&mut Node> {
        self.map.get_mut(&id)
    }

    pub(crate) fn insert(&mut self, node: Node) -> NodeId {
        let id = self.next;
        self.next += 1;
        self.index(id, &node);
        self.map.insert(id, node);
        id
    }

    fn index(&mut self, id: NodeId, node: &Node) {
        for (p, n) in &node.names {
            self.by_name.insert((*p, n.clone()), id);
        }
        if node.is_dir() {
            if let Some(l) = node.lower {
                self.by_lower_dir.insert(l, id);
            }
        } else if let Some(u) = node.upper_ino {
            self.by_upper.insert(u, id);
        }
    }

    fn unindex(&mut self, id: NodeId) {
        let Some(node) = self.map.get(&id) else { return };
        let names: Vec<_> = node.names.clone();
        let (dir, lower, upper_ino) = (node.is_dir(), node.lower, node.upper_ino);
        for (p, n) in names {
            if self.by_name.get(&(p, n.clone())) == Some(&id) {
                self.by_name.remove(&(p, n));
            }
        }
        if dir {
            if let Some(l) = lower {
                if self.by_lower_dir.get(&l) == Some(&id) {
                    self.by_lower_dir.remove(&l);
                }
            }
        } else if let Some(u) = upper_ino {
            if self.by_upper.get(&u) == Some(&id) {
                self.by_upper.remove(&u);
            }
        }
    }

    /// Re-indexes a node after its names or identity changed.
    pub(crate) fn update(&mut self, id: NodeId, f: impl FnOnce(&mut Node)) {
        self.unindex(id);
        if let Some(n) = self.map.get_mut(&id) {
            f(n);
        }
        if let Some(n) = self.map.remove(&id) {
            self.index(id, &n);
            self.map.insert(id, n);
        }
    }

    /// Adds a name to a node.
    pub(crate) fn add_name(&mut self, id: NodeId, parent: NodeId, name: &[u8]) {
        let key = (parent, Box::<[u8]>::from(name));
        if let Some(n) = self.map.get_mut(&id) {
            if !n.names.iter().any(|(p, m)| *p == parent && **m == *name) {
                n.names.push(key.clone());
            }
        }
        self.by_name.insert(key, id);
    }

    /// Removes a name from whatever node has it.
    pub(crate) fn remove_name(&mut self, parent: NodeId, name: &[u8]) -> Option<NodeId> {
        let id = self.by_name.remove(&(parent, Box::<[u8]>::from(name)))?;
        if let Some(n) = self.map.get_mut(&id) {
            n.names.retain(|(p, m)| !(*p == parent && **m == *name));
        }
        Some(id)
    }

    /// The kernel dropped `count` lookups of `id`. Returns the node if
    /// that was the last: the caller drops it once the lock is released,
    /// since closing its descriptors may free a removed file's blocks.
    pub(crate) fn forget(&mut self, id: NodeId, count: u64) -> Option<Node> {
        if id == ROOT {
            return None;
        }
        let n = self.map.get_mut(&id)?;
        n.refs = n.refs.saturating_sub(count);
        if n.refs > 0 {
            return None;
        }
        self.unindex(id);
        self.map.remove(&id)
    }
}
