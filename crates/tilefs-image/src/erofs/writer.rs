//! Writes a tree as a composefs EROFS image, byte for byte as the reference
//! `mkcomposefs` lays it out.
//!
//! The writer reads a [`FlatTree`] (a [`Tree`] is converted first) and
//! assembles the image in memory (metadata images are small: the 64k-entry
//! CentOS tree is 10 MB) in passes over the inodes in breadth-first order:
//! order and check them, decide each one's xattrs, place it, then write it.
//! Per inode it keeps one fixed-size record and its list of xattr ids;
//! directory entries are read from the tree again when needed rather than
//! copied. The image buffer is allocated once, zeroed, at its final size,
//! and every part is written in place.
//!
//! Layout: composefs header at 0; EROFS superblock at 1024; inodes from 1152
//! in 32-byte slots (nid = offset / 32), each followed by its xattrs and
//! inline tail; shared xattrs; then 4 KiB data blocks (directory blocks and
//! the few file and symlink blocks that do not fit inline).

use super::format::{self as f, overlay};
use crate::flat::{hash_pair, FlatTree, Meta, NONE};
use crate::tree::{self, FileType, InodeId, Timespec, Tree, S_IFMT, S_IFREG};
use crate::verity;
use hashbrown::HashTable;
use std::io;
use std::os::unix::fs::FileExt;

/// Format version choice, as `mkcomposefs --min-version/--max-version`.
#[derive(Debug, Clone, Copy)]
pub struct WriteOptions {
    /// Version to write unless the tree needs a newer one.
    pub min_version: u32,
    /// Newest version the writer may move up to (version 1 marks directories
    /// holding whiteouts with the opaque=x convention).
    pub max_version: u32,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            min_version: 0,
            max_version: 1,
        }
    }
}

/// Why an image could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error("unsupported format version {0} (this tool writes 0 and 1)")]
    Version(u32),
    #[error(transparent)]
    TooLarge(#[from] crate::flat::TooLarge),
    #[error("cannot write the image: {0}")]
    Io(io::Error),
}

/// A written image: its bytes, its fs-verity digest and its format version.
pub struct Image {
    pub bytes: Vec<u8>,
    pub digest: [u8; 32],
    pub version: u32,
}

/// Writes `tree` as an image.
pub fn write_image(tree: &Tree, opts: &WriteOptions) -> Result<Image, WriteError> {
    let flat = FlatTree::from_tree(tree)?;
    let (bytes, version) = write_flat(&flat, opts)?;
    let digest = verity::digest_bytes(&bytes);
    Ok(Image { bytes, digest, version })
}

/// Writes `tree` as an image: its bytes and format version (the digest is
/// left to callers that need it).
pub fn write_flat(tree: &FlatTree, opts: &WriteOptions) -> Result<(Vec<u8>, u32), WriteError> {
    write_flat_with(tree, opts, |w, x, shared, version| {
        let (_, total) = w.layout(shared);
        // Zeroed memory from the allocator (fresh pages for a large image):
        // every gap and padding is already there.
        let mut out = vec![0u8; total as usize];
        w.emit(x, shared, version, &mut out)?;
        Ok(out)
    })
}

/// Lays the image out, then hands it to `emit` to be written.
fn write_flat_with<T>(
    tree: &FlatTree,
    opts: &WriteOptions,
    emit: impl FnOnce(&Writer<'_>, &Xattrs<'_>, &Shared, u32) -> io::Result<T>,
) -> Result<(T, u32), WriteError> {
    if opts.min_version > f::COMPOSEFS_VERSION_MAX {
        return Err(WriteError::Version(opts.min_version));
    }
    if opts.max_version > f::COMPOSEFS_VERSION_MAX {
        return Err(WriteError::Version(opts.max_version));
    }
    let max_version = opts.max_version.max(opts.min_version);
    let mut w = Writer::new(tree)?;
    // Version 1 is needed only to mark whiteouts the new way.
    let version = if opts.min_version < 1 && max_version >= 1 && w.nodes.iter().any(|n| n.whiteout_in_source) {
        1
    } else {
        opts.min_version
    };
    // Values the overlay xattrs borrow: built before the table that points
    // into them.
    let metacopy: Vec<[u8; 36]> = tree
        .digests
        .iter()
        .map(|d| {
            let mut v = [0u8; 36];
            v[..4].copy_from_slice(&[0, 36, 0, 1]);
            v[4..].copy_from_slice(d);
            v
        })
        .collect();
    let escaped: Vec<Option<Vec<u8>>> = (0..tree.xattrs.len() as u32)
        .map(|id| {
            tree.xattrs
                .key(id)
                .strip_prefix(overlay::PREFIX)
                .map(|rest| [overlay::ESCAPE_PREFIX, rest].concat())
        })
        .collect();
    let mut x = Xattrs::new(tree, &metacopy, &escaped);
    w.rewrite_overlay(&mut x, version)?;
    let shared = x.share();
    w.place_inodes(&x, &shared)?;
    let out = emit(&w, &x, &shared, version).map_err(WriteError::Io)?;
    Ok((out, version))
}

/// Writes `tree` as an image into `file` (from offset 0, through two
/// buffers of 1 MiB, one per region of the image): the image never needs
/// to be whole in memory. Returns its size and format version; `file` is
/// extended to the full size, and gaps are left as holes (zeros).
pub fn write_flat_to(tree: &FlatTree, opts: &WriteOptions, file: &std::fs::File) -> Result<(u64, u32), WriteError> {
    write_flat_with(tree, opts, |w, x, shared, version| {
        let (data_start, total) = w.layout(shared);
        let mut out = FileOut::new(file, data_start);
        w.emit(x, shared, version, &mut out)?;
        out.finish(total)?;
        Ok(total)
    })
}

/// Marks a node that is one of the root's whiteouts `00`..`ff` (its
/// number in the low bits) rather than an inode of the tree.
const WHITEOUT: u32 = 1 << 31;

/// One inode as it will appear in the image.
#[derive(Clone, Copy)]
struct Node {
    /// The tree inode it comes from, or WHITEOUT | n.
    src: u32,
    parent: u32,
    nlink: u32,
    /// Its mode in the image (a whiteout of the source is a regular file).
    mode: u32,
    whiteout_in_source: bool,
    /// A regular file whose data lives in the store.
    external: bool,
    compact: bool,
    /// Its final xattrs: `lists[xattrs..xattrs + n_xattrs]`, sorted by key.
    xattrs: u32,
    n_xattrs: u16,
    /// Layout, filled by place_inodes.
    tail: u16,
    n_blocks: u32,
    xattr_size: u32,
    nid: u64,
}

/// The effective metadata of a node, after the overlay rewrite.
#[derive(Clone, Copy)]
struct NodeMeta {
    mode: u32,
    uid: u32,
    gid: u32,
    rdev: u32,
    size: u64,
    mtime: Timespec,
}

/// The image's xattrs: every distinct (key, value) once, with the number
/// of inodes that have it. Keys and values are borrowed from the tree or
/// from the writer's few arenas. Keys are numbered too, and ranked in byte
/// order, so that lists are sorted and searched by comparing numbers.
struct Xattrs<'a> {
    metacopy: &'a [[u8; 36]],
    keys: Vec<&'a [u8]>,
    key_index: HashTable<u32>,
    /// Per key: its place in byte order among all keys.
    rank: Vec<u32>,
    /// Per key: its xattr name index, suffix length and filter bit.
    key_info: Vec<(u8, u8, u8)>,
    /// (key, value).
    pairs: Vec<(u32, &'a [u8])>,
    count: Vec<u32>,
    index: HashTable<u32>,
    /// The pair id here of each of the tree's xattrs, its key escaped if
    /// it is an overlay xattr.
    from_tree: Vec<u32>,
    k: WellKnown,
}

/// Ids of the keys and pairs the overlay rewrite adds.
#[derive(Default)]
struct WellKnown {
    metacopy: u32,
    redirect: u32,
    selinux: u32,
    empty_metacopy: u32,
    escaped_whiteout: u32,
    user_whiteout: u32,
    escaped_whiteouts: u32,
    user_whiteouts: u32,
    escaped_opaque: u32,
    user_opaque: u32,
    opaque: u32,
}

fn hash_key(key: &[u8]) -> u64 {
    hash_pair(key, b"")
}

fn hash_kv(key: u32, value: &[u8]) -> u64 {
    use std::hash::Hasher as _;
    let mut h = rustc_hash::FxHasher::default();
    h.write_u32(key);
    h.write(value);
    h.finish()
}

impl<'a> Xattrs<'a> {
    /// Every key the image can have is known from the start: the tree's
    /// (escaped) and the overlay's.
    fn new(tree: &'a FlatTree, metacopy: &'a [[u8; 36]], escaped: &'a [Option<Vec<u8>>]) -> Xattrs<'a> {
        // Each external file may add a redirect and a metacopy of its own.
        let external = (0..tree.len() as InodeId).filter(|&id| tree.is_external(id)).count();
        let capacity = tree.xattrs.len() + 16 + external + metacopy.len();
        let mut x = Xattrs {
            metacopy,
            keys: Vec::new(),
            key_index: HashTable::new(),
            rank: Vec::new(),
            key_info: Vec::new(),
            pairs: Vec::with_capacity(capacity),
            count: Vec::with_capacity(capacity),
            index: HashTable::with_capacity(capacity),
            from_tree: Vec::with_capacity(tree.xattrs.len()),
            k: WellKnown::default(),
        };
        let mk = |x: &mut Xattrs<'a>, key: &'static [u8], value: &'static [u8]| {
            let k = x.key_id(key);
            (k, x.pair(k, value))
        };
        let (metacopy_key, empty_metacopy) = mk(&mut x, overlay::METACOPY, b"");
        x.k = WellKnown {
            metacopy: metacopy_key,
            redirect: x.key_id(overlay::REDIRECT),
            selinux: x.key_id(b"security.selinux"),
            empty_metacopy,
            escaped_whiteout: mk(&mut x, overlay::ESCAPED_WHITEOUT, b"").1,
            user_whiteout: mk(&mut x, overlay::USER_WHITEOUT, b"").1,
            escaped_whiteouts: mk(&mut x, overlay::ESCAPED_WHITEOUTS, b"").1,
            user_whiteouts: mk(&mut x, overlay::USER_WHITEOUTS, b"").1,
            escaped_opaque: mk(&mut x, overlay::ESCAPED_OPAQUE, b"x").1,
            user_opaque: mk(&mut x, overlay::USER_OPAQUE, b"x").1,
            opaque: mk(&mut x, overlay::OPAQUE, b"y").1,
        };
        for tid in 0..tree.xattrs.len() as u32 {
            let key = match &escaped[tid as usize] {
                Some(k) => &k[..],
                None => tree.xattrs.key(tid),
            };
            let k = x.key_id(key);
            let p = x.pair(k, tree.xattrs.value(tid));
            x.from_tree.push(p);
        }
        let mut order: Vec<u32> = (0..x.keys.len() as u32).collect();
        order.sort_unstable_by(|&a, &b| x.keys[a as usize].cmp(x.keys[b as usize]));
        x.rank = vec![0; x.keys.len()];
        for (r, &k) in order.iter().enumerate() {
            x.rank[k as usize] = r as u32;
        }
        x.key_info = x
            .keys
            .iter()
            .map(|k| {
                let (index, suffix) = f::xattr_split(k);
                (index, suffix.len() as u8, f::xattr_filter_bit(index, suffix) as u8)
            })
            .collect();
        x
    }

    fn key_id(&mut self, key: &'a [u8]) -> u32 {
        let hash = hash_key(key);
        let keys = &self.keys;
        if let Some(&id) = self.key_index.find(hash, |&id| keys[id as usize] == key) {
            return id;
        }
        let id = self.keys.len() as u32;
        self.keys.push(key);
        let keys = &self.keys;
        self.key_index
            .insert_unique(hash, id, |&id| hash_key(keys[id as usize]));
        id
    }

    /// The id of (key, value), added if new.
    fn pair(&mut self, key: u32, value: &'a [u8]) -> u32 {
        let hash = hash_kv(key, value);
        let pairs = &self.pairs;
        if let Some(&id) = self.index.find(hash, |&id| pairs[id as usize] == (key, value)) {
            return id;
        }
        let id = self.pairs.len() as u32;
        self.pairs.push((key, value));
        self.count.push(0);
        let pairs = &self.pairs;
        self.index.insert_unique(hash, id, |&id| {
            let (k, v) = pairs[id as usize];
            hash_kv(k, v)
        });
        id
    }

    fn key(&self, id: u32) -> &'a [u8] {
        self.keys[self.pairs[id as usize].0 as usize]
    }

    fn rank(&self, id: u32) -> u32 {
        self.rank[self.pairs[id as usize].0 as usize]
    }

    /// Sets pair `id` in an unsorted list, replacing the value of its key
    /// if the list has it.
    fn set(&self, list: &mut Vec<u32>, id: u32) {
        let key = self.pairs[id as usize].0;
        match list.iter_mut().find(|x| self.pairs[**x as usize].0 == key) {
            Some(x) => *x = id,
            None => list.push(id),
        }
    }

    /// Bytes of one xattr entry in an inode or the shared area.
    fn entry_size(&self, id: u32) -> u64 {
        let (key, value) = self.pairs[id as usize];
        let suffix = self.key_info[key as usize].1 as usize;
        ((f::XATTR_ENTRY_SIZE + suffix + value.len()) as u64).next_multiple_of(4)
    }

    fn filter_bit(&self, id: u32) -> u32 {
        self.key_info[self.pairs[id as usize].0 as usize].2 as u32
    }

    /// Writes one xattr entry.
    fn put(&self, out: &mut [u8], at: &mut usize, id: u32) {
        put_xattr(out, at, self.key(id), self.pairs[id as usize].1);
    }

    /// Xattrs (key and value) used by more than one inode are stored once in
    /// the shared area, in descending (key, length, value) order.
    fn share(&mut self) -> Shared {
        let mut ids: Vec<u32> = (0..self.pairs.len() as u32)
            .filter(|&i| self.count[i as usize] > 1)
            .collect();
        ids.sort_unstable_by(|&a, &b| {
            let (av, bv) = (self.pairs[a as usize].1, self.pairs[b as usize].1);
            self.rank(b)
                .cmp(&self.rank(a))
                .then(bv.len().cmp(&av.len()))
                .then(bv.cmp(av))
        });
        let mut offset_of = vec![NONE; self.pairs.len()];
        let mut off = 0u64;
        for &i in &ids {
            offset_of[i as usize] = off as u32;
            off += self.entry_size(i);
        }
        Shared {
            ids,
            offset_of,
            size: off,
        }
    }
}

/// The shared xattr area.
struct Shared {
    /// Pair ids in the order they are stored.
    ids: Vec<u32>,
    /// Offset of each pair in the area, or NONE if it is not shared.
    offset_of: Vec<u32>,
    size: u64,
}

impl Shared {
    /// Calls `f(id, Some(offset))` for each of a node's xattrs stored in the
    /// shared area and `f(id, None)` for the others, in the list's order.
    fn each(&self, list: &[u32], mut f: impl FnMut(u32, Option<u32>)) {
        let mut n_shared = 0u8;
        for &id in list {
            match self.offset_of[id as usize] {
                // At most 127 shared references fit an inode's header.
                o if o != NONE && n_shared < f::XATTR_LONG_PREFIX => {
                    n_shared += 1;
                    f(id, Some(o))
                }
                _ => f(id, None),
            }
        }
    }
}

struct Writer<'a> {
    tree: &'a FlatTree,
    nodes: Vec<Node>,
    /// The node of each tree inode (NONE: not in the image).
    index_of: Vec<u32>,
    /// The root's whiteouts: (name, node), in name order.
    root_whiteouts: Vec<(&'static [u8], u32)>,
    /// Final xattr ids of every node, one run per node.
    lists: Vec<u32>,
    min_mtime: Timespec,
    inodes_end: u64,
    n_data_blocks: u64,
}

impl<'a> Writer<'a> {
    /// Orders the tree's inodes breadth-first over primary entries, with
    /// children sorted by name, and checks what the format cannot hold.
    fn new(tree: &'a FlatTree) -> Result<Writer<'a>, WriteError> {
        if tree.is_empty() || !tree.meta(tree::ROOT).is_dir() {
            return Err(invalid(b"/", "the root must be a directory"));
        }
        let mut w = Writer {
            tree,
            nodes: Vec::with_capacity(tree.len() + 256),
            index_of: vec![NONE; tree.len()],
            root_whiteouts: Vec::with_capacity(256),
            lists: Vec::new(),
            min_mtime: tree.meta(tree::ROOT).mtime,
            inodes_end: 0,
            n_data_blocks: 0,
        };
        w.index_of[tree::ROOT as usize] = 0;
        w.nodes.push(w.node_of_inode(tree::ROOT, 0));

        // Breadth-first over primary entries: the queue is `nodes` itself.
        let mut i = 0;
        while i < w.nodes.len() {
            let id = w.nodes[i].src;
            if id & WHITEOUT != 0 {
                i += 1;
                continue;
            }
            let entries = tree.entries(id);
            if !tree.meta(id).is_dir() {
                if !entries.is_empty() {
                    return Err(invalid(&w.path_of(i), "only directories can have entries"));
                }
                i += 1;
                continue;
            }
            // The root also gets the whiteouts `00`..`ff` (where no entry has
            // that name), in name order among its entries.
            let mut whiteouts: &[[u8; 2]] = if i == 0 { &WHITEOUT_NAMES } else { &[] };
            for e in entries {
                let name = tree.name(e);
                while let Some((wname, rest)) = whiteouts.split_first().filter(|(wn, _)| wn.as_slice() <= name) {
                    if wname.as_slice() != name {
                        w.push_root_whiteout(wname);
                    }
                    whiteouts = rest;
                }
                if e.hardlink() {
                    continue;
                }
                if e.inode as usize >= tree.len() {
                    return Err(invalid(&join(&w.path_of(i), name), "entry points to a missing inode"));
                }
                if w.index_of[e.inode as usize] != NONE {
                    return Err(invalid(
                        &join(&w.path_of(i), name),
                        "inode has two primary entries (make one a hardlink)",
                    ));
                }
                w.index_of[e.inode as usize] = w.nodes.len() as u32;
                let node = w.node_of_inode(e.inode, i as u32);
                w.nodes.push(node);
            }
            for wname in whiteouts {
                w.push_root_whiteout(wname);
            }
            i += 1;
        }

        // Every entry (hardlinks too) must name an inode in the image.
        for i in 0..w.nodes.len() {
            let id = w.nodes[i].src;
            if id & WHITEOUT != 0 || !tree.meta(id).is_dir() {
                continue;
            }
            for e in tree.entries(id) {
                if e.len() > tree::MAX_NAME_LEN {
                    return Err(invalid(
                        &join(&w.path_of(i), tree.name(e)),
                        "file name longer than 255 bytes",
                    ));
                }
                let target = w.index_of.get(e.inode as usize).copied().unwrap_or(NONE);
                if target == NONE {
                    return Err(invalid(
                        &join(&w.path_of(i), tree.name(e)),
                        "hardlink to a file that is not in the tree",
                    ));
                }
                if e.hardlink() && tree.meta(e.inode).is_dir() {
                    return Err(invalid(
                        &join(&w.path_of(i), tree.name(e)),
                        "directories cannot be hardlinked",
                    ));
                }
            }
        }
        // Directories: 2 + subdirectories, whatever the source said.
        for i in 1..w.nodes.len() {
            if w.nodes[i].mode & S_IFMT == tree::S_IFDIR {
                let p = w.nodes[i].parent as usize;
                w.nodes[p].nlink += 1;
            }
        }
        for i in 0..w.nodes.len() {
            let id = w.nodes[i].src;
            if id & WHITEOUT == 0 {
                w.validate(id).map_err(|reason| invalid(&w.path_of(i), &reason))?;
            }
        }
        Ok(w)
    }

    fn node_of_inode(&self, id: InodeId, parent: u32) -> Node {
        let m = self.tree.meta(id);
        let whiteout_in_source = m.is_whiteout();
        Node {
            src: id,
            parent,
            nlink: if m.is_dir() { 2 } else { m.nlink },
            mode: if whiteout_in_source {
                S_IFREG | (m.mode & !S_IFMT)
            } else {
                m.mode
            },
            whiteout_in_source,
            external: self.tree.is_external(id),
            compact: false,
            xattrs: 0,
            n_xattrs: 0,
            tail: 0,
            n_blocks: 0,
            xattr_size: 0,
            nid: 0,
        }
    }

    fn push_root_whiteout(&mut self, name: &'static [u8; 2]) {
        let n = self.nodes.len() as u32;
        self.root_whiteouts.push((&name[..], n));
        let k = (name_value(name[0]) << 4 | name_value(name[1])) as u32;
        self.nodes.push(Node {
            src: WHITEOUT | k,
            parent: 0,
            nlink: 1,
            mode: tree::S_IFCHR | 0o644,
            whiteout_in_source: false,
            external: false,
            compact: false,
            xattrs: 0,
            n_xattrs: 0,
            tail: 0,
            n_blocks: 0,
            xattr_size: 0,
            nid: 0,
        });
    }

    /// Mode, owner, size and mtime as the image gives them: the root's
    /// whiteouts are 0/0 character devices with the root's owner and mtime,
    /// a whiteout of the source becomes an empty regular file, a symlink's
    /// size is its target's length.
    fn node_meta(&self, n: &Node) -> NodeMeta {
        if n.src & WHITEOUT != 0 {
            let root = self.tree.meta(tree::ROOT);
            return NodeMeta {
                mode: tree::S_IFCHR | 0o644,
                uid: root.uid,
                gid: root.gid,
                rdev: 0,
                size: 0,
                mtime: root.mtime,
            };
        }
        let m: &Meta = self.tree.meta(n.src);
        let size = if n.whiteout_in_source {
            0
        } else if m.mode & S_IFMT == tree::S_IFLNK {
            self.tree.payload(n.src).map_or(0, |p| p.len() as u64)
        } else {
            m.size
        };
        NodeMeta {
            mode: n.mode,
            uid: m.uid,
            gid: m.gid,
            rdev: m.rdev,
            size,
            mtime: m.mtime,
        }
    }

    fn content(&self, n: &Node) -> Option<&'a [u8]> {
        if n.src & WHITEOUT != 0 {
            None
        } else {
            self.tree.content(n.src)
        }
    }

    fn payload(&self, n: &Node) -> Option<&'a [u8]> {
        if n.src & WHITEOUT != 0 {
            None
        } else {
            self.tree.payload(n.src)
        }
    }

    fn list(&self, n: &Node) -> &[u32] {
        &self.lists[n.xattrs as usize..n.xattrs as usize + n.n_xattrs as usize]
    }

    /// A directory node's entries including `.` and `..` (and for the root
    /// its whiteouts), sorted: (name, node).
    fn children(&self, i: usize, out: &mut Vec<(&'a [u8], u32)>) {
        let tree = self.tree;
        out.clear();
        let src = self.nodes[i].src;
        out.extend(tree.entries(src).iter().map(|e| {
            let target = self.index_of.get(e.inode as usize).copied().unwrap_or(NONE);
            (tree.name(e), target)
        }));
        // Entries are sorted; `.` and `..` go where they sort.
        let pos = out.partition_point(|(n, _)| before_dot(n));
        out.insert(pos, (b".", i as u32));
        let pos = out.partition_point(|(n, _)| before_dotdot(n));
        out.insert(pos, (b"..", self.nodes[i].parent));
        if i == 0 {
            out.extend(self.root_whiteouts.iter().copied());
            out.sort_unstable_by(|a, b| a.0.cmp(b.0));
        }
    }

    /// Applies the composefs overlay conventions: escape the source's own
    /// `trusted.overlay.*` xattrs, add metacopy/redirect to external files,
    /// turn whiteouts into marked regular files, make the root opaque and
    /// give it the 256 whiteouts `00`..`ff` that hide the store's fan-out
    /// directories when it is an overlay lower layer.
    fn rewrite_overlay(&mut self, x: &mut Xattrs<'a>, version: u32) -> Result<(), WriteError> {
        let tree = self.tree;
        // Directories holding a whiteout are marked; parents come before
        // their children, so know them first.
        let mut marked = vec![false; self.nodes.len()];
        for n in &self.nodes {
            if n.whiteout_in_source {
                marked[n.parent as usize] = true;
            }
        }
        let root_selinux = tree
            .xattr_ids(tree::ROOT)
            .iter()
            .copied()
            .find(|&t| tree.xattrs.key(t) == b"security.selinux");
        let k = std::mem::take(&mut x.k);
        let mut list: Vec<u32> = Vec::new();
        self.lists.reserve(self.nodes.len() * 2);
        for (i, &is_marked) in marked.iter().enumerate() {
            let n = self.nodes[i];
            list.clear();
            if n.src & WHITEOUT != 0 {
                if let Some(t) = root_selinux {
                    let v = tree.xattrs.value(t);
                    list.push(x.pair(k.selinux, v));
                }
            } else {
                list.extend(tree.xattr_ids(n.src).iter().map(|&t| x.from_tree[t as usize]));
                if n.external {
                    let metacopy = match tree.inodes[n.src as usize].digest {
                        NONE => k.empty_metacopy,
                        d => x.pair(k.metacopy, &x.metacopy[d as usize][..]),
                    };
                    x.set(&mut list, metacopy);
                    if let Some(p) = tree.slash_payload(n.src).filter(|p| p.len() > 1) {
                        let redirect = x.pair(k.redirect, p);
                        x.set(&mut list, redirect);
                    }
                }
                if n.whiteout_in_source {
                    x.set(&mut list, k.escaped_whiteout);
                    x.set(&mut list, k.user_whiteout);
                }
                if is_marked {
                    x.set(&mut list, k.escaped_whiteouts);
                    x.set(&mut list, k.user_whiteouts);
                    if version >= 1 {
                        x.set(&mut list, k.escaped_opaque);
                        x.set(&mut list, k.user_opaque);
                    }
                }
                if i == 0 {
                    x.set(&mut list, k.opaque);
                }
            }
            if list.len() > 1 {
                list.sort_unstable_by_key(|&a| x.rank(a));
            }
            let node = &mut self.nodes[i];
            node.xattrs = self.lists.len() as u32;
            node.n_xattrs = u16::try_from(list.len()).map_err(|_| invalid(b"?", "too many xattrs"))?;
            for &id in &list {
                x.count[id as usize] += 1;
            }
            self.lists.extend_from_slice(&list);
            if u32::try_from(self.lists.len()).is_err() {
                return Err(crate::flat::TooLarge.into());
            }
        }
        for n in &self.nodes {
            let mtime = self.node_meta(n).mtime;
            if mtime < self.min_mtime {
                self.min_mtime = mtime;
            }
        }
        Ok(())
    }

    /// Decides each inode's shape and position.
    fn place_inodes(&mut self, x: &Xattrs, shared: &Shared) -> Result<(), WriteError> {
        let mut pos = (f::EROFS_SUPER_OFFSET + f::EROFS_SUPER_SIZE) as u64;
        let min_mtime = self.min_mtime;
        let mut children = Vec::new();
        for i in 0..self.nodes.len() {
            let n = self.nodes[i];
            let m = self.node_meta(&n);
            if m.mode & S_IFMT == tree::S_IFDIR {
                self.children(i, &mut children);
            }
            let (mut n_blocks, mut tail) = self.data_shape(&n, &m, &children);
            let size = if m.mode & S_IFMT == tree::S_IFDIR {
                n_blocks * f::BLOCK_SIZE + tail
            } else {
                m.size
            };
            let compact = m.mtime == min_mtime
                && n.nlink <= u16::MAX as u32
                && m.uid <= u16::MAX as u32
                && m.gid <= u16::MAX as u32
                && size <= u32::MAX as u64;
            let inode_size = if compact {
                f::INODE_COMPACT_SIZE
            } else {
                f::INODE_EXTENDED_SIZE
            } as u64;
            let mut inline_xattrs = 0u64;
            let mut n_shared = 0u64;
            shared.each(self.list(&n), |id, o| match o {
                Some(_) => n_shared += 1,
                None => inline_xattrs += x.entry_size(id),
            });
            let xattr_size = if n.n_xattrs == 0 {
                0
            } else {
                (f::XATTR_IBODY_HEADER_SIZE as u64 + n_shared * 4 + inline_xattrs).next_multiple_of(4)
            };
            // The inode counts its xattr space in 16 bits of 4-byte units.
            if xattr_size > (u16::MAX as u64 - 1) * 4 + f::XATTR_IBODY_HEADER_SIZE as u64 {
                return Err(invalid(&self.path_of(i), "xattrs too large for one inode"));
            }

            pos = pos.next_multiple_of(f::SLOT_SIZE);
            pos += tail_padding(m.mode, &mut n_blocks, &mut tail, xattr_size, pos, inode_size);
            self.n_data_blocks += n_blocks;
            let node = &mut self.nodes[i];
            node.compact = compact;
            node.n_blocks = n_blocks as u32;
            node.tail = tail as u16;
            node.xattr_size = xattr_size as u32;
            node.nid = pos / f::SLOT_SIZE;
            pos += inode_size + xattr_size + tail;
        }
        self.inodes_end = pos.next_multiple_of(f::SLOT_SIZE);
        Ok(())
    }

    /// Blocks and inline tail of a node's data.
    fn data_shape(&self, n: &Node, m: &NodeMeta, children: &[(&[u8], u32)]) -> (u64, u64) {
        let bs = f::BLOCK_SIZE;
        match m.mode & S_IFMT {
            tree::S_IFDIR => {
                let mut blocks = 0;
                let mut used = 0u64;
                for (name, _) in children {
                    let len = (f::DIRENT_SIZE + name.len()) as u64;
                    if used + len > bs {
                        blocks += 1;
                        used = 0;
                    }
                    used += len;
                }
                // Never inline more than half a block.
                if used > bs / 2 {
                    (blocks + 1, 0)
                } else {
                    (blocks, used)
                }
            }
            tree::S_IFLNK => (0, self.payload(n).map_or(0, |p| p.len() as u64)),
            tree::S_IFREG if m.size > 0 => {
                if self.content(n).is_some() {
                    let (b, t) = (m.size / bs, m.size % bs);
                    if t > bs / 2 {
                        (b + 1, 0)
                    } else {
                        (b, t)
                    }
                } else {
                    (0, f::chunk_count(m.size) * 4)
                }
            }
            _ => (0, 0),
        }
    }

    /// Size of the image: metadata (header, superblock, inodes, shared
    /// xattrs), then the data blocks from `data_start`.
    fn layout(&self, shared: &Shared) -> (u64, u64) {
        let data_start = (self.inodes_end + shared.size).next_multiple_of(f::BLOCK_SIZE);
        (data_start, data_start + self.n_data_blocks * f::BLOCK_SIZE)
    }

    /// Writes the image to `out`, each of its two regions (metadata, data
    /// blocks) in increasing offsets; what is not written is zeros.
    fn emit(&self, x: &Xattrs, shared: &Shared, version: u32, out: &mut dyn Out) -> io::Result<()> {
        let (data_start, total) = self.layout(shared);
        let mut head = [0u8; f::EROFS_SUPER_OFFSET + f::EROFS_SUPER_SIZE];

        // composefs header
        let has_acl = self.lists.iter().any(|&id| {
            let k = x.key(id);
            k == b"system.posix_acl_access" || k == b"system.posix_acl_default"
        });
        f::put_u32(&mut head, f::header::MAGIC, f::COMPOSEFS_MAGIC);
        f::put_u32(&mut head, f::header::VERSION, f::COMPOSEFS_HEADER_VERSION);
        f::put_u32(
            &mut head,
            f::header::FLAGS,
            if has_acl { f::COMPOSEFS_FLAG_HAS_ACL } else { 0 },
        );
        f::put_u32(&mut head, f::header::COMPOSEFS_VERSION, version);

        // superblock
        let sb = &mut head[f::EROFS_SUPER_OFFSET..];
        f::put_u32(sb, f::sb::MAGIC, f::EROFS_SUPER_MAGIC);
        f::put_u32(
            sb,
            f::sb::FEATURE_COMPAT,
            f::FEATURE_COMPAT_MTIME | f::FEATURE_COMPAT_XATTR_FILTER,
        );
        sb[f::sb::BLKSZBITS] = f::BLOCK_BITS as u8;
        f::put_u16(sb, f::sb::ROOT_NID, self.nodes[0].nid as u16);
        f::put_u64(sb, f::sb::INOS, self.nodes.len() as u64);
        f::put_u64(sb, f::sb::BUILD_TIME, self.min_mtime.sec as u64);
        f::put_u32(sb, f::sb::BUILD_TIME_NSEC, self.min_mtime.nsec);
        f::put_u32(
            sb,
            f::sb::BLOCKS,
            (data_start / f::BLOCK_SIZE + self.n_data_blocks) as u32,
        );
        f::put_u32(
            sb,
            f::sb::META_BLKADDR,
            ((f::EROFS_SUPER_OFFSET + f::EROFS_SUPER_SIZE) as u64 / f::BLOCK_SIZE) as u32,
        );
        f::put_u32(sb, f::sb::XATTR_BLKADDR, (self.inodes_end / f::BLOCK_SIZE) as u32);
        out.put(0, &head)?;

        // inodes, and their data blocks in inode order; each assembled in a
        // zeroed scratch buffer, then handed over whole
        let mut next_block = data_start;
        let mut children = Vec::new();
        let mut scratch: Vec<u8> = Vec::new();
        for (ino, n) in self.nodes.iter().enumerate() {
            let m = self.node_meta(n);
            let is_dir = m.mode & S_IFMT == tree::S_IFDIR;
            if is_dir {
                self.children(ino, &mut children);
            }
            let blkaddr = if n.n_blocks > 0 {
                let b = next_block / f::BLOCK_SIZE;
                next_block += n.n_blocks as u64 * f::BLOCK_SIZE;
                Some(b)
            } else {
                None
            };
            let len = if n.compact { 32 } else { 64 } + n.xattr_size as usize + n.tail as usize;
            scratch.clear();
            scratch.resize(len, 0);
            let mut at = 0;
            self.emit_inode(
                &mut scratch,
                &mut at,
                x,
                shared,
                n,
                &m,
                ino as u32,
                blkaddr.map(|b| b as u32),
                &children,
            );
            debug_assert_eq!(at, len);
            out.put(n.nid * f::SLOT_SIZE, &scratch)?;
            let Some(b) = blkaddr else { continue };
            let blocks = n.n_blocks as usize;
            scratch.clear();
            scratch.resize(blocks * f::BLOCK_SIZE as usize, 0);
            if is_dir {
                let mut at = 0;
                for chunk in dirent_chunks(&children).take(blocks) {
                    self.put_dirents(&mut scratch, &mut at, &children[chunk]);
                    at = at.next_multiple_of(f::BLOCK_SIZE as usize);
                }
            } else if n.external {
                // Chunk indexes that spilled out of the inode: all holes.
                scratch[..f::BLOCK_SIZE as usize].fill(0xff);
            } else {
                let data = self.content(n).or(self.payload(n)).unwrap_or_default();
                let len = (blocks * f::BLOCK_SIZE as usize).min(data.len());
                scratch[..len].copy_from_slice(&data[..len]);
            }
            out.put(b * f::BLOCK_SIZE, &scratch)?;
        }
        debug_assert_eq!(next_block, total);

        scratch.clear();
        scratch.resize(shared.size as usize, 0);
        let mut at = 0;
        for &id in &shared.ids {
            x.put(&mut scratch, &mut at, id);
        }
        out.put(self.inodes_end, &scratch)
    }

    #[allow(clippy::too_many_arguments)]
    fn emit_inode(
        &self,
        out: &mut [u8],
        at: &mut usize,
        x: &Xattrs,
        shared: &Shared,
        n: &Node,
        m: &NodeMeta,
        ino: u32,
        blkaddr: Option<u32>,
        children: &[(&[u8], u32)],
    ) {
        let ftype = m.mode & S_IFMT;
        let external = n.external;
        let mut layout = if n.tail > 0 {
            f::LAYOUT_FLAT_INLINE
        } else {
            f::LAYOUT_FLAT_PLAIN
        };
        let mut chunk_format = None;
        let size = match ftype {
            tree::S_IFDIR => n.n_blocks as u64 * f::BLOCK_SIZE + n.tail as u64,
            tree::S_IFREG => {
                if external {
                    layout = f::LAYOUT_CHUNK_BASED;
                    chunk_format = Some((f::chunk_bits(m.size) - f::BLOCK_BITS) as u16);
                }
                m.size
            }
            tree::S_IFLNK if n.n_blocks == 0 => n.tail as u64,
            tree::S_IFLNK => m.size,
            _ => 0,
        };
        let xattr_icount = if n.xattr_size == 0 {
            0
        } else {
            (n.xattr_size - f::XATTR_IBODY_HEADER_SIZE as u32) / 4 + 1
        } as u16;
        let format = layout << f::I_DATALAYOUT_BIT | (!n.compact as u16) << f::I_VERSION_BIT;

        let mut u = [0u8; 4];
        match ftype {
            tree::S_IFCHR | tree::S_IFBLK => u = m.rdev.to_le_bytes(),
            tree::S_IFDIR | tree::S_IFREG | tree::S_IFLNK => {
                if let Some(b) = blkaddr {
                    u = b.to_le_bytes();
                }
                if let Some(cf) = chunk_format {
                    u[..2].copy_from_slice(&cf.to_le_bytes());
                }
            }
            _ => {}
        }

        if n.compact {
            let i = &mut out[*at..*at + f::INODE_COMPACT_SIZE];
            f::put_u16(i, f::ino::FORMAT, format);
            f::put_u16(i, f::ino::XATTR_ICOUNT, xattr_icount);
            f::put_u16(i, f::ino::MODE, m.mode as u16);
            f::put_u16(i, f::ino::C_NLINK, n.nlink as u16);
            f::put_u32(i, f::ino::SIZE, size as u32);
            i[f::ino::U..f::ino::U + 4].copy_from_slice(&u);
            f::put_u32(i, f::ino::INO, ino);
            f::put_u16(i, f::ino::UID, m.uid as u16);
            f::put_u16(i, f::ino::C_GID, m.gid as u16);
            *at += f::INODE_COMPACT_SIZE;
        } else {
            let i = &mut out[*at..*at + f::INODE_EXTENDED_SIZE];
            f::put_u16(i, f::ino::FORMAT, format);
            f::put_u16(i, f::ino::XATTR_ICOUNT, xattr_icount);
            f::put_u16(i, f::ino::MODE, m.mode as u16);
            f::put_u64(i, f::ino::SIZE, size);
            i[f::ino::U..f::ino::U + 4].copy_from_slice(&u);
            f::put_u32(i, f::ino::INO, ino);
            f::put_u32(i, f::ino::UID, m.uid);
            f::put_u32(i, f::ino::E_GID, m.gid);
            f::put_u64(i, f::ino::E_MTIME, m.mtime.sec as u64);
            f::put_u32(i, f::ino::E_MTIME_NSEC, m.mtime.nsec);
            f::put_u32(i, f::ino::E_NLINK, n.nlink);
            *at += f::INODE_EXTENDED_SIZE;
        }

        if n.xattr_size > 0 {
            let list = self.list(n);
            let mut filter = 0u32;
            for &id in list {
                filter |= 1 << x.filter_bit(id);
            }
            let start = *at;
            f::put_u32(out, start, f::XATTR_FILTER_DEFAULT & !filter);
            // out[start + 4] (the shared count) is set below; 7 bytes reserved.
            *at += f::XATTR_IBODY_HEADER_SIZE;
            let base = self.inodes_end % f::BLOCK_SIZE;
            let mut n_shared = 0u8;
            shared.each(list, |_, o| {
                if let Some(off) = o {
                    f::put_u32(out, *at, ((base + off as u64) / 4) as u32);
                    *at += 4;
                    n_shared += 1;
                }
            });
            out[start + 4] = n_shared;
            shared.each(list, |id, o| {
                if o.is_none() {
                    x.put(out, at, id);
                }
            });
            *at = start + n.xattr_size as usize;
        }

        if n.tail > 0 {
            match ftype {
                tree::S_IFDIR => {
                    if let Some(last) = dirent_chunks(children).nth(n.n_blocks as usize) {
                        self.put_dirents(out, at, &children[last]);
                    }
                }
                tree::S_IFLNK => put(out, at, self.payload(n).unwrap_or_default()),
                _ if external => {
                    let len = f::chunk_count(m.size) as usize * 4;
                    out[*at..*at + len].fill(0xff);
                    *at += len;
                }
                _ => {
                    let c = self.content(n).unwrap_or_default();
                    put(out, at, &c[c.len() - n.tail as usize..]);
                }
            }
        }
    }

    /// One block's (or the tail's) worth of directory entries: the dirent
    /// table, then the names.
    fn put_dirents(&self, out: &mut [u8], at: &mut usize, children: &[(&[u8], u32)]) {
        let mut nameoff = children.len() * f::DIRENT_SIZE;
        for &(name, target) in children {
            let t = &self.nodes[target as usize];
            let d = &mut out[*at..*at + f::DIRENT_SIZE];
            f::put_u64(d, 0, t.nid);
            f::put_u16(d, 8, nameoff as u16);
            d[10] = dirent_type(t.mode);
            *at += f::DIRENT_SIZE;
            nameoff += name.len();
        }
        for &(name, _) in children {
            put(out, at, name);
        }
    }

    /// Checks an inode against what the format can hold.
    fn validate(&self, id: InodeId) -> Result<(), String> {
        let t = self.tree;
        let m = t.meta(id);
        let Some(ft) = FileType::from_mode(m.mode) else {
            return Err(format!("unknown file type in mode {:o}", m.mode));
        };
        match ft {
            FileType::Regular => {
                if let Some(c) = t.content(id) {
                    if c.len() as u64 != m.size {
                        return Err("inline content length differs from the file size".into());
                    }
                    if c.len() > tree::MAX_INLINE_CONTENT {
                        return Err("inline content is larger than 5000 bytes".into());
                    }
                } else if m.size > 0 && f::chunk_count(m.size) > f::MAX_EXTERNAL_CHUNKS {
                    return Err(format!("file size {} is larger than the format can describe", m.size));
                }
            }
            FileType::Symlink => match t.payload(id) {
                Some(p) if !p.is_empty() && p.len() <= tree::MAX_PAYLOAD_LEN => {}
                Some(p) if !p.is_empty() => return Err("symlink target longer than 4095 bytes".into()),
                _ => return Err("symlink without a target".into()),
            },
            _ => {}
        }
        Ok(())
    }

    /// Name of node `i`'s primary entry (for messages only).
    fn name_of(&self, i: usize) -> Vec<u8> {
        let n = &self.nodes[i];
        if n.src & WHITEOUT != 0 {
            return WHITEOUT_NAMES[(n.src & 0xff) as usize].to_vec();
        }
        let parent = self.nodes[n.parent as usize].src;
        self.tree
            .entries(parent)
            .iter()
            .find(|e| !e.hardlink() && e.inode == n.src)
            .map(|e| self.tree.name(e).to_vec())
            .unwrap_or_default()
    }

    /// Path of node `i` from its primary entries (for messages only).
    fn path_of(&self, mut i: usize) -> Vec<u8> {
        let mut parts = Vec::new();
        while i != 0 {
            parts.push(self.name_of(i));
            i = self.nodes[i].parent as usize;
        }
        let mut p = Vec::new();
        for part in parts.iter().rev() {
            p.push(b'/');
            p.extend_from_slice(part);
        }
        if p.is_empty() {
            p.push(b'/');
        }
        p
    }
}

/// Where the image's bytes go. The writer puts each piece once, in
/// increasing offsets within each of the image's two regions (metadata from
/// 0, data blocks from `data_start`); what it never puts is zeros.
trait Out {
    fn put(&mut self, off: u64, bytes: &[u8]) -> io::Result<()>;
}

/// The whole image in memory, zeroed beforehand.
impl Out for Vec<u8> {
    fn put(&mut self, off: u64, bytes: &[u8]) -> io::Result<()> {
        let at = off as usize;
        self[at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }
}

/// An image file, written through one window of `WINDOW` bytes per region.
struct FileOut<'f> {
    file: &'f std::fs::File,
    data_start: u64,
    windows: [Window; 2],
}

/// A buffered run of the file: bytes `base..base + used` are in `buf`.
struct Window {
    base: u64,
    used: usize,
    buf: Vec<u8>,
}

const WINDOW: usize = 1 << 20;

impl<'f> FileOut<'f> {
    fn new(file: &'f std::fs::File, data_start: u64) -> FileOut<'f> {
        let window = |base| Window {
            base,
            used: 0,
            buf: Vec::new(),
        };
        FileOut {
            file,
            data_start,
            windows: [window(0), window(data_start)],
        }
    }

    /// Writes what is buffered and gives the file its size.
    fn finish(mut self, total: u64) -> io::Result<()> {
        for i in 0..2 {
            self.flush(i)?;
        }
        self.file.set_len(total)
    }

    fn flush(&mut self, i: usize) -> io::Result<()> {
        let w = &mut self.windows[i];
        if w.used > 0 {
            self.file.write_all_at(&w.buf[..w.used], w.base)?;
            w.buf[..w.used].fill(0);
            w.base += w.used as u64;
            w.used = 0;
        }
        Ok(())
    }
}

impl Out for FileOut<'_> {
    fn put(&mut self, off: u64, bytes: &[u8]) -> io::Result<()> {
        let i = usize::from(off >= self.data_start);
        let w = &self.windows[i];
        debug_assert!(off >= w.base, "image pieces come in increasing offsets");
        if off + bytes.len() as u64 > w.base + WINDOW as u64 {
            self.flush(i)?;
            // A gap after the flushed bytes stays a hole.
            self.windows[i].base = off;
            if bytes.len() >= WINDOW {
                self.file.write_all_at(bytes, off)?;
                self.windows[i].base = off + bytes.len() as u64;
                return Ok(());
            }
        }
        let w = &mut self.windows[i];
        if w.buf.is_empty() {
            w.buf = vec![0u8; WINDOW];
        }
        let at = (off - w.base) as usize;
        w.buf[at..at + bytes.len()].copy_from_slice(bytes);
        w.used = w.used.max(at + bytes.len());
        Ok(())
    }
}

/// Padding before an inode so its inline tail does not cross a block
/// boundary; moves the tail to a block of its own when padding cannot help.
fn tail_padding(mode: u32, n_blocks: &mut u64, tail: &mut u64, xattr_size: u64, pos: u64, inode_size: u64) -> u64 {
    let bs = f::BLOCK_SIZE;
    let head = inode_size + xattr_size;
    if mode & S_IFMT == tree::S_IFLNK {
        // A symlink keeps inode and target in one block when it can.
        let total = head + *tail;
        if total >= bs {
            *n_blocks += 1;
            *tail = 0;
        }
        return if pos / bs != (pos + total - 1) / bs {
            pos.next_multiple_of(bs) - pos
        } else {
            0
        };
    }
    let room = bs - (pos + head) % bs;
    if room >= *tail {
        return 0;
    }
    let pad = room.next_multiple_of(f::SLOT_SIZE);
    if *tail <= bs - (pos + head + pad) % bs {
        return pad;
    }
    *n_blocks += 1;
    *tail = 0;
    pos.next_multiple_of(bs) - pos
}

/// Splits sorted directory entries into block-sized runs.
fn dirent_chunks<'c>(children: &'c [(&[u8], u32)]) -> impl Iterator<Item = std::ops::Range<usize>> + 'c {
    let mut start = 0;
    let mut used = 0u64;
    let mut i = 0;
    let mut done = false;
    std::iter::from_fn(move || {
        while i < children.len() {
            let len = (f::DIRENT_SIZE + children[i].0.len()) as u64;
            if used + len > f::BLOCK_SIZE {
                let chunk = start..i;
                start = i;
                used = len;
                i += 1;
                return Some(chunk);
            }
            used += len;
            i += 1;
        }
        if done {
            return None;
        }
        done = true;
        Some(start..children.len())
    })
}

/// `name < "."`, without a call to memcmp.
fn before_dot(name: &[u8]) -> bool {
    name.first().is_none_or(|&c| c < b'.')
}

/// `name < ".."`, without a call to memcmp.
fn before_dotdot(name: &[u8]) -> bool {
    match name {
        [] | [b'.'] => true,
        [b'.', c, ..] => *c < b'.',
        [c, ..] => *c < b'.',
    }
}

fn dirent_type(mode: u32) -> u8 {
    match mode & S_IFMT {
        tree::S_IFREG => f::FT_REG_FILE,
        tree::S_IFDIR => f::FT_DIR,
        tree::S_IFLNK => f::FT_SYMLINK,
        tree::S_IFCHR => f::FT_CHRDEV,
        tree::S_IFBLK => f::FT_BLKDEV,
        tree::S_IFIFO => f::FT_FIFO,
        tree::S_IFSOCK => f::FT_SOCK,
        _ => f::FT_UNKNOWN,
    }
}

fn put(out: &mut [u8], at: &mut usize, bytes: &[u8]) {
    out[*at..*at + bytes.len()].copy_from_slice(bytes);
    *at += bytes.len();
}

fn put_xattr(out: &mut [u8], at: &mut usize, key: &[u8], value: &[u8]) {
    let (index, suffix) = f::xattr_split(key);
    let start = *at;
    out[start] = suffix.len() as u8;
    out[start + 1] = index;
    f::put_u16(out, start + 2, value.len() as u16);
    *at += 4;
    put(out, at, suffix);
    put(out, at, value);
    *at = start + (*at - start).next_multiple_of(4);
}

fn name_value(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        _ => c - b'a' + 10,
    }
}

/// The 256 names `00`..`ff` of the root's whiteouts.
static WHITEOUT_NAMES: [[u8; 2]; 256] = {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut names = [[0u8; 2]; 256];
    let mut i = 0;
    while i < 256 {
        names[i] = [HEX[i >> 4], HEX[i & 15]];
        i += 1;
    }
    names
};

fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = dir.to_vec();
    if !p.ends_with(b"/") {
        p.push(b'/');
    }
    p.extend_from_slice(name);
    p
}

fn invalid(path: &[u8], reason: &str) -> WriteError {
    WriteError::Invalid {
        path: String::from_utf8_lossy(path).into_owned(),
        reason: reason.to_string(),
    }
}
