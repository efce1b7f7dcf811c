//! Writes a tree as a composefs EROFS image, byte for byte as the reference
//! `mkcomposefs` lays it out.
//!
//! The image is assembled in memory (metadata images are small: the 64k-entry
//! CentOS tree is a few MiB) in three passes over the inodes in breadth-first
//! order: decide each inode's shape (xattrs, compact or extended, inline
//! tail), place it, then emit the bytes.
//!
//! Layout: composefs header at 0; EROFS superblock at 1024; inodes from 1152
//! in 32-byte slots (nid = offset / 32), each followed by its xattrs and
//! inline tail; shared xattrs; then 4 KiB data blocks (directory blocks and
//! the few file and symlink blocks that do not fit inline).

use super::format::{self as f, overlay};
use crate::tree::{self, FileType, Inode, InodeId, Timespec, Tree, S_IFMT, S_IFREG};
use crate::verity;
use rustc_hash::FxHashMap;
use std::borrow::Cow;

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
}

/// A written image: its bytes, its fs-verity digest and its format version.
pub struct Image {
    pub bytes: Vec<u8>,
    pub digest: [u8; 32],
    pub version: u32,
}

/// Writes `tree` as an image.
pub fn write_image(tree: &Tree, opts: &WriteOptions) -> Result<Image, WriteError> {
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
    w.rewrite_overlay(version)?;
    w.share_xattrs();
    w.place_inodes();
    let bytes = w.emit(version);
    let digest = verity::digest_bytes(&bytes);
    Ok(Image { bytes, digest, version })
}

type Bytes<'a> = Cow<'a, [u8]>;
type XattrRef<'a> = (&'a [u8], &'a [u8]);

/// One inode as it will appear in the image.
#[derive(Default)]
struct Node<'a> {
    /// The tree inode it comes from (None for the root's whiteouts).
    src: Option<InodeId>,
    /// Name of the primary entry (empty for the root).
    name: &'a [u8],
    parent: u32,
    mode: u32,
    nlink: u32,
    uid: u32,
    gid: u32,
    rdev: u32,
    size: u64,
    mtime: Timespec,
    payload: Option<&'a [u8]>,
    content: Option<&'a [u8]>,
    digest: Option<[u8; 32]>,
    whiteout_in_source: bool,
    /// Final xattrs, sorted by key once rewriting is done.
    xattrs: Vec<(Bytes<'a>, Bytes<'a>)>,
    /// Directory entries including `.` and `..`, sorted: (name, node index).
    children: Vec<(Bytes<'a>, u32)>,

    // Layout, filled by share_xattrs and place_inodes.
    /// Offset into the shared xattr area of each xattr, or None if inline.
    shared: Vec<Option<u32>>,
    compact: bool,
    n_blocks: u64,
    tail: u64,
    ipad: u64,
    xattr_size: u64,
    nid: u64,
}

impl Node<'_> {
    fn ftype(&self) -> u32 {
        self.mode & S_IFMT
    }

    fn is_external(&self) -> bool {
        self.ftype() == S_IFREG && self.size > 0 && self.content.is_none()
    }
}

struct Writer<'a> {
    tree: &'a Tree,
    nodes: Vec<Node<'a>>,
    min_mtime: Timespec,
    /// Shared xattrs in the order they are stored, with their offsets.
    shared: Vec<(Bytes<'a>, Bytes<'a>)>,
    shared_size: u64,
    inodes_end: u64,
    n_data_blocks: u64,
}

impl<'a> Writer<'a> {
    /// Orders the tree's inodes breadth-first over primary entries, with
    /// children sorted by name, and checks what the format cannot hold.
    fn new(tree: &'a Tree) -> Result<Writer<'a>, WriteError> {
        let root = tree.root();
        if !root.is_dir() {
            return Err(invalid(b"/", "the root must be a directory"));
        }
        let mut index_of: Vec<u32> = vec![u32::MAX; tree.inodes.len()];
        let mut nodes: Vec<Node<'a>> = Vec::with_capacity(tree.inodes.len() + 256);
        index_of[tree::ROOT as usize] = 0;
        nodes.push(Node::from_inode(tree::ROOT, root, b"", 0));
        let mut root_whiteouts = Vec::new();

        // Breadth-first over primary entries: the queue is `nodes` itself.
        let mut i = 0;
        while i < nodes.len() {
            let Some(id) = nodes[i].src else {
                i += 1;
                continue;
            };
            let inode = tree.inode(id);
            if !inode.is_dir() {
                if !inode.entries.is_empty() {
                    return Err(invalid(&path_of(&nodes, i), "only directories can have entries"));
                }
                i += 1;
                continue;
            }
            // The root also gets the whiteouts `00`..`ff` (where no entry has
            // that name), in name order among its entries.
            let mut whiteouts: &[[u8; 2]] = if i == 0 { &WHITEOUT_NAMES } else { &[] };
            for e in &inode.entries {
                while let Some((w, rest)) = whiteouts
                    .split_first()
                    .filter(|(w, _)| w.as_slice() <= e.name.as_slice())
                {
                    if w.as_slice() != e.name.as_slice() {
                        root_whiteouts.push((&w[..], nodes.len() as u32));
                        nodes.push(Node::root_whiteout(root, w));
                    }
                    whiteouts = rest;
                }
                if e.hardlink {
                    continue;
                }
                let Some(child) = tree.inodes.get(e.inode as usize) else {
                    return Err(invalid(
                        &join(&path_of(&nodes, i), &e.name),
                        "entry points to a missing inode",
                    ));
                };
                if index_of[e.inode as usize] != u32::MAX {
                    return Err(invalid(
                        &join(&path_of(&nodes, i), &e.name),
                        "inode has two primary entries (make one a hardlink)",
                    ));
                }
                index_of[e.inode as usize] = nodes.len() as u32;
                nodes.push(Node::from_inode(e.inode, child, &e.name, i as u32));
            }
            for w in whiteouts {
                root_whiteouts.push((&w[..], nodes.len() as u32));
                nodes.push(Node::root_whiteout(root, w));
            }
            i += 1;
        }

        // Now that every inode has its place, build each directory's entries.
        for i in 0..nodes.len() {
            let Some(id) = nodes[i].src else { continue };
            let inode = tree.inode(id);
            if !inode.is_dir() {
                continue;
            }
            let mut children: Vec<(Bytes<'a>, u32)> = Vec::with_capacity(inode.entries.len() + 2);
            for e in &inode.entries {
                let target = index_of.get(e.inode as usize).copied().unwrap_or(u32::MAX);
                if target == u32::MAX {
                    return Err(invalid(
                        &join(&path_of(&nodes, i), &e.name),
                        "hardlink to a file that is not in the tree",
                    ));
                }
                if e.hardlink && tree.inode(e.inode).is_dir() {
                    return Err(invalid(
                        &join(&path_of(&nodes, i), &e.name),
                        "directories cannot be hardlinked",
                    ));
                }
                children.push((Cow::Borrowed(e.name.as_slice()), target));
            }
            // Entries are sorted; `.` and `..` go where they sort.
            for (name, target) in [(&b"."[..], i as u32), (&b".."[..], nodes[i].parent)] {
                let pos = children.partition_point(|(n, _)| n.as_ref() < name);
                children.insert(pos, (Cow::Borrowed(name), target));
            }
            if i == 0 {
                children.extend(root_whiteouts.iter().map(|&(n, t)| (Cow::Borrowed(n), t)));
                children.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            }
            nodes[i].children = children;
        }
        // Directories: 2 + subdirectories, whatever the source said.
        for i in 1..nodes.len() {
            if nodes[i].ftype() == tree::S_IFDIR {
                let p = nodes[i].parent as usize;
                nodes[p].nlink += 1;
            }
        }

        for (i, node) in nodes.iter().enumerate() {
            if let Some(id) = node.src {
                validate(node, tree.inode(id)).map_err(|reason| invalid(&path_of(&nodes, i), &reason))?;
            }
        }

        Ok(Writer {
            tree,
            nodes,
            min_mtime: root.mtime,
            shared: Vec::new(),
            shared_size: 0,
            inodes_end: 0,
            n_data_blocks: 0,
        })
    }

    /// Applies the composefs overlay conventions: escape the source's own
    /// `trusted.overlay.*` xattrs, add metacopy/redirect to external files,
    /// turn whiteouts into marked regular files, make the root opaque and
    /// give it the 256 whiteouts `00`..`ff` that hide the store's fan-out
    /// directories when it is an overlay lower layer.
    fn rewrite_overlay(&mut self, version: u32) -> Result<(), WriteError> {
        let mut marked_parents = Vec::new();
        for node in &mut self.nodes {
            let Some(id) = node.src else { continue };
            let inode = self.tree.inode(id);
            let mut xattrs: Vec<(Bytes<'a>, Bytes<'a>)> = Vec::with_capacity(inode.xattrs.len() + 2);
            for x in &inode.xattrs {
                let key = match x.key.strip_prefix(overlay::PREFIX) {
                    Some(rest) => Cow::Owned([overlay::ESCAPE_PREFIX, rest].concat()),
                    None => Cow::Borrowed(x.key.as_slice()),
                };
                xattrs.push((key, Cow::Borrowed(x.value.as_slice())));
            }
            node.xattrs = xattrs;
            if node.is_external() {
                let metacopy = match node.digest {
                    Some(d) => {
                        let mut v = vec![0u8, 36, 0, 1];
                        v.extend_from_slice(&d);
                        v
                    }
                    None => Vec::new(),
                };
                set(&mut node.xattrs, overlay::METACOPY, metacopy);
                if let Some(p) = node.payload.filter(|p| !p.is_empty()) {
                    set(&mut node.xattrs, overlay::REDIRECT, [b"/", p].concat());
                }
            }
            if node.whiteout_in_source {
                node.size = 0;
                node.mode = S_IFREG | (node.mode & !S_IFMT);
                set(&mut node.xattrs, overlay::ESCAPED_WHITEOUT, Vec::new());
                set(&mut node.xattrs, overlay::USER_WHITEOUT, Vec::new());
                marked_parents.push(node.parent as usize);
            }
        }
        for p in marked_parents {
            let x = &mut self.nodes[p].xattrs;
            set(x, overlay::ESCAPED_WHITEOUTS, Vec::new());
            set(x, overlay::USER_WHITEOUTS, Vec::new());
            if version >= 1 {
                set(x, overlay::ESCAPED_OPAQUE, b"x".to_vec());
                set(x, overlay::USER_OPAQUE, b"x".to_vec());
            }
        }
        set(&mut self.nodes[0].xattrs, overlay::OPAQUE, b"y".to_vec());

        for node in &mut self.nodes {
            node.xattrs.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            if node.xattrs.len() > u16::MAX as usize {
                return Err(invalid(b"?", "too many xattrs"));
            }
            if node.mtime < self.min_mtime {
                self.min_mtime = node.mtime;
            }
        }
        Ok(())
    }

    /// Xattrs (key and value) used by more than one inode are stored once in
    /// the shared area, in descending (key, length, value) order.
    fn share_xattrs(&mut self) {
        // Intern every (key, value): one hash lookup per xattr.
        let total: usize = self.nodes.iter().map(|n| n.xattrs.len()).sum();
        let mut ids: FxHashMap<(&[u8], &[u8]), u32> =
            FxHashMap::with_capacity_and_hasher(total / 2, Default::default());
        // (key, value) and the number of inodes that have it.
        let mut distinct: Vec<(XattrRef, u32)> = Vec::new();
        let mut flat: Vec<u32> = Vec::with_capacity(total);
        for node in &self.nodes {
            for (k, v) in &node.xattrs {
                let id = *ids.entry((k.as_ref(), v.as_ref())).or_insert_with(|| {
                    distinct.push(((k.as_ref(), v.as_ref()), 0));
                    distinct.len() as u32 - 1
                });
                distinct[id as usize].1 += 1;
                flat.push(id);
            }
        }
        let mut shared: Vec<u32> = (0..distinct.len() as u32)
            .filter(|&i| distinct[i as usize].1 > 1)
            .collect();
        shared.sort_unstable_by(|&a, &b| {
            let ((ak, av), _) = distinct[a as usize];
            let ((bk, bv), _) = distinct[b as usize];
            bk.cmp(ak).then(bv.len().cmp(&av.len())).then(bv.cmp(av))
        });
        let mut offset_of = vec![u32::MAX; distinct.len()];
        let mut off = 0u64;
        for &i in &shared {
            offset_of[i as usize] = off as u32;
            let (k, v) = distinct[i as usize].0;
            off += xattr_entry_size(k, v);
        }
        self.shared_size = off;
        let shared_owned: Vec<(Bytes<'a>, Bytes<'a>)> = shared
            .iter()
            .map(|&i| {
                let (k, v) = distinct[i as usize].0;
                (Cow::Owned(k.to_vec()), Cow::Owned(v.to_vec()))
            })
            .collect();
        drop(ids);
        drop(distinct);
        let mut flat = flat.into_iter();
        for node in &mut self.nodes {
            let mut n_shared = 0u8;
            node.shared = (&mut flat)
                .take(node.xattrs.len())
                .map(|id| match offset_of[id as usize] {
                    // At most 127 shared references fit an inode's header.
                    o if o != u32::MAX && n_shared < f::XATTR_LONG_PREFIX => {
                        n_shared += 1;
                        Some(o)
                    }
                    _ => None,
                })
                .collect();
        }
        self.shared = shared_owned;
    }

    /// Decides each inode's shape and position.
    fn place_inodes(&mut self) {
        let mut pos = (f::EROFS_SUPER_OFFSET + f::EROFS_SUPER_SIZE) as u64;
        let min_mtime = self.min_mtime;
        for node in &mut self.nodes {
            let (n_blocks, tail) = data_shape(node);
            node.n_blocks = n_blocks;
            node.tail = tail;
            let size = if node.ftype() == tree::S_IFDIR {
                n_blocks * f::BLOCK_SIZE + tail
            } else {
                node.size
            };
            node.compact = node.mtime == min_mtime
                && node.nlink <= u16::MAX as u32
                && node.uid <= u16::MAX as u32
                && node.gid <= u16::MAX as u32
                && size <= u32::MAX as u64;
            let inode_size = if node.compact {
                f::INODE_COMPACT_SIZE
            } else {
                f::INODE_EXTENDED_SIZE
            } as u64;
            let mut inline_xattrs = 0u64;
            let mut n_shared = 0u64;
            for ((k, v), s) in node.xattrs.iter().zip(&node.shared) {
                match s {
                    Some(_) => n_shared += 1,
                    None => inline_xattrs += xattr_entry_size(k, v),
                }
            }
            node.xattr_size = if node.xattrs.is_empty() {
                0
            } else {
                (f::XATTR_IBODY_HEADER_SIZE as u64 + n_shared * 4 + inline_xattrs).next_multiple_of(4)
            };

            let aligned = pos.next_multiple_of(f::SLOT_SIZE);
            node.ipad = aligned - pos;
            pos = aligned;
            let extra = tail_padding(node, pos, inode_size);
            node.ipad += extra;
            pos += extra;
            self.n_data_blocks += node.n_blocks;
            node.nid = pos / f::SLOT_SIZE;
            pos += inode_size + node.xattr_size + node.tail;
        }
        self.inodes_end = pos.next_multiple_of(f::SLOT_SIZE);
    }

    fn emit(&self, version: u32) -> Vec<u8> {
        let data_start = (self.inodes_end + self.shared_size).next_multiple_of(f::BLOCK_SIZE);
        let total = data_start + self.n_data_blocks * f::BLOCK_SIZE;
        let mut out = Vec::with_capacity(total as usize);

        // composefs header
        let has_acl = self.nodes.iter().any(|n| {
            n.xattrs
                .iter()
                .any(|(k, _)| k.as_ref() == b"system.posix_acl_access" || k.as_ref() == b"system.posix_acl_default")
        });
        out.extend_from_slice(&f::COMPOSEFS_MAGIC.to_le_bytes());
        out.extend_from_slice(&f::COMPOSEFS_HEADER_VERSION.to_le_bytes());
        out.extend_from_slice(&(if has_acl { f::COMPOSEFS_FLAG_HAS_ACL } else { 0 }).to_le_bytes());
        out.extend_from_slice(&version.to_le_bytes());
        out.resize(f::EROFS_SUPER_OFFSET, 0);

        // superblock
        let mut sb = [0u8; f::EROFS_SUPER_SIZE];
        f::put_u32(&mut sb, f::sb::MAGIC, f::EROFS_SUPER_MAGIC);
        f::put_u32(
            &mut sb,
            f::sb::FEATURE_COMPAT,
            f::FEATURE_COMPAT_MTIME | f::FEATURE_COMPAT_XATTR_FILTER,
        );
        sb[f::sb::BLKSZBITS] = f::BLOCK_BITS as u8;
        f::put_u16(&mut sb, f::sb::ROOT_NID, self.nodes[0].nid as u16);
        f::put_u64(&mut sb, f::sb::INOS, self.nodes.len() as u64);
        f::put_u64(&mut sb, f::sb::BUILD_TIME, self.min_mtime.sec as u64);
        f::put_u32(&mut sb, f::sb::BUILD_TIME_NSEC, self.min_mtime.nsec);
        f::put_u32(
            &mut sb,
            f::sb::BLOCKS,
            (data_start / f::BLOCK_SIZE + self.n_data_blocks) as u32,
        );
        f::put_u32(
            &mut sb,
            f::sb::META_BLKADDR,
            ((f::EROFS_SUPER_OFFSET + f::EROFS_SUPER_SIZE) as u64 / f::BLOCK_SIZE) as u32,
        );
        f::put_u32(&mut sb, f::sb::XATTR_BLKADDR, (self.inodes_end / f::BLOCK_SIZE) as u32);
        out.extend_from_slice(&sb);

        // inodes
        let mut next_block = data_start;
        for (ino, node) in self.nodes.iter().enumerate() {
            out.resize(out.len() + node.ipad as usize, 0);
            debug_assert_eq!(out.len() as u64, node.nid * f::SLOT_SIZE);
            let blkaddr = if node.n_blocks > 0 {
                let b = next_block / f::BLOCK_SIZE;
                next_block += node.n_blocks * f::BLOCK_SIZE;
                Some(b as u32)
            } else {
                None
            };
            self.emit_inode(&mut out, node, ino as u32, blkaddr);
        }
        out.resize(out.len().next_multiple_of(f::SLOT_SIZE as usize), 0);
        debug_assert_eq!(out.len() as u64, self.inodes_end);

        for (k, v) in &self.shared {
            push_xattr(&mut out, k, v);
        }
        out.resize(data_start as usize, 0);

        // data blocks, in inode order
        for node in &self.nodes {
            if node.ftype() == tree::S_IFDIR {
                let chunks = dirent_chunks(&node.children);
                for chunk in chunks.iter().take(node.n_blocks as usize) {
                    self.push_dirents(&mut out, &node.children[chunk.clone()]);
                    out.resize(out.len().next_multiple_of(f::BLOCK_SIZE as usize), 0);
                }
            } else if node.n_blocks > 0 {
                let start = out.len();
                if node.is_external() {
                    // Chunk indexes that spilled out of the inode: all holes.
                    for _ in 0..f::BLOCK_SIZE / 4 {
                        out.extend_from_slice(&f::NULL_ADDR.to_le_bytes());
                    }
                } else {
                    let data = node.content.or(node.payload).unwrap_or_default();
                    let len = (node.n_blocks * f::BLOCK_SIZE).min(data.len() as u64) as usize;
                    out.extend_from_slice(&data[..len]);
                }
                out.resize(start + (node.n_blocks * f::BLOCK_SIZE) as usize, 0);
            }
        }
        debug_assert_eq!(out.len() as u64, total);
        out
    }

    fn emit_inode(&self, out: &mut Vec<u8>, node: &Node, ino: u32, blkaddr: Option<u32>) {
        let ftype = node.ftype();
        let mut layout = if node.tail > 0 {
            f::LAYOUT_FLAT_INLINE
        } else {
            f::LAYOUT_FLAT_PLAIN
        };
        let mut chunk_format = None;
        let size = match ftype {
            tree::S_IFDIR => node.n_blocks * f::BLOCK_SIZE + node.tail,
            tree::S_IFREG => {
                if node.is_external() {
                    layout = f::LAYOUT_CHUNK_BASED;
                    chunk_format = Some((f::chunk_bits(node.size) - f::BLOCK_BITS) as u16);
                }
                node.size
            }
            tree::S_IFLNK if node.n_blocks == 0 => node.tail,
            tree::S_IFLNK => node.size,
            _ => 0,
        };
        let xattr_icount = if node.xattr_size == 0 {
            0
        } else {
            (node.xattr_size - f::XATTR_IBODY_HEADER_SIZE as u64) / 4 + 1
        } as u16;
        let format = layout << f::I_DATALAYOUT_BIT | (!node.compact as u16) << f::I_VERSION_BIT;

        let mut u = [0u8; 4];
        match ftype {
            tree::S_IFCHR | tree::S_IFBLK => u = node.rdev.to_le_bytes(),
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

        let start = out.len();
        if node.compact {
            let mut i = [0u8; f::INODE_COMPACT_SIZE];
            f::put_u16(&mut i, f::ino::FORMAT, format);
            f::put_u16(&mut i, f::ino::XATTR_ICOUNT, xattr_icount);
            f::put_u16(&mut i, f::ino::MODE, node.mode as u16);
            f::put_u16(&mut i, f::ino::C_NLINK, node.nlink as u16);
            f::put_u32(&mut i, f::ino::SIZE, size as u32);
            i[f::ino::U..f::ino::U + 4].copy_from_slice(&u);
            f::put_u32(&mut i, f::ino::INO, ino);
            f::put_u16(&mut i, f::ino::UID, node.uid as u16);
            f::put_u16(&mut i, f::ino::C_GID, node.gid as u16);
            out.extend_from_slice(&i);
        } else {
            let mut i = [0u8; f::INODE_EXTENDED_SIZE];
            f::put_u16(&mut i, f::ino::FORMAT, format);
            f::put_u16(&mut i, f::ino::XATTR_ICOUNT, xattr_icount);
            f::put_u16(&mut i, f::ino::MODE, node.mode as u16);
            f::put_u64(&mut i, f::ino::SIZE, size);
            i[f::ino::U..f::ino::U + 4].copy_from_slice(&u);
            f::put_u32(&mut i, f::ino::INO, ino);
            f::put_u32(&mut i, f::ino::UID, node.uid);
            f::put_u32(&mut i, f::ino::E_GID, node.gid);
            f::put_u64(&mut i, f::ino::E_MTIME, node.mtime.sec as u64);
            f::put_u32(&mut i, f::ino::E_MTIME_NSEC, node.mtime.nsec);
            f::put_u32(&mut i, f::ino::E_NLINK, node.nlink);
            out.extend_from_slice(&i);
        }

        if node.xattr_size > 0 {
            let mut filter = 0u32;
            for (k, _) in &node.xattrs {
                let (index, suffix) = f::xattr_split(k);
                filter |= 1 << f::xattr_filter_bit(index, suffix);
            }
            let n_shared = node.shared.iter().flatten().count();
            out.extend_from_slice(&(f::XATTR_FILTER_DEFAULT & !filter).to_le_bytes());
            out.push(n_shared as u8);
            out.extend_from_slice(&[0; 7]);
            let base = self.inodes_end % f::BLOCK_SIZE;
            for off in node.shared.iter().flatten() {
                out.extend_from_slice(&(((base + *off as u64) / 4) as u32).to_le_bytes());
            }
            for ((k, v), s) in node.xattrs.iter().zip(&node.shared) {
                if s.is_none() {
                    push_xattr(out, k, v);
                }
            }
        }

        if node.tail > 0 {
            match ftype {
                tree::S_IFDIR => {
                    let chunks = dirent_chunks(&node.children);
                    if let Some(last) = chunks.get(node.n_blocks as usize) {
                        self.push_dirents(out, &node.children[last.clone()]);
                    }
                }
                tree::S_IFLNK => out.extend_from_slice(node.payload.unwrap_or_default()),
                _ if node.is_external() => {
                    for _ in 0..f::chunk_count(node.size) {
                        out.extend_from_slice(&f::NULL_ADDR.to_le_bytes());
                    }
                }
                _ => {
                    let c = node.content.unwrap_or_default();
                    out.extend_from_slice(&c[c.len() - node.tail as usize..]);
                }
            }
        }
        debug_assert_eq!(
            (out.len() - start) as u64,
            node_isize(node, if node.compact { 32 } else { 64 })
        );
    }

    /// One block's (or the tail's) worth of directory entries: the dirent
    /// table, then the names.
    fn push_dirents(&self, out: &mut Vec<u8>, children: &[(Bytes, u32)]) {
        let mut nameoff = children.len() * f::DIRENT_SIZE;
        for (name, target) in children {
            let t = &self.nodes[*target as usize];
            out.extend_from_slice(&(t.nid).to_le_bytes());
            out.extend_from_slice(&(nameoff as u16).to_le_bytes());
            out.push(dirent_type(t.mode));
            out.push(0);
            nameoff += name.len();
        }
        for (name, _) in children {
            out.extend_from_slice(name);
        }
    }
}

impl<'a> Node<'a> {
    /// One of the root's whiteouts: a 0/0 character device with the root's
    /// owner, mtime and SELinux label.
    fn root_whiteout(root: &'a Inode, name: &'a [u8]) -> Node<'a> {
        let selinux = root.xattr(b"security.selinux");
        Node {
            src: None,
            name,
            parent: 0,
            mode: tree::S_IFCHR | 0o644,
            nlink: 1,
            uid: root.uid,
            gid: root.gid,
            rdev: 0,
            size: 0,
            mtime: root.mtime,
            payload: None,
            content: None,
            digest: None,
            whiteout_in_source: false,
            xattrs: selinux
                .map(|v| vec![(Cow::Borrowed(&b"security.selinux"[..]), Cow::Borrowed(v))])
                .unwrap_or_default(),
            ..Node::default()
        }
    }

    fn from_inode(id: InodeId, inode: &'a Inode, name: &'a [u8], parent: u32) -> Node<'a> {
        let nlink = if inode.is_dir() { 2 } else { inode.nlink };
        Node {
            src: Some(id),
            name,
            parent,
            mode: inode.mode,
            nlink,
            uid: inode.uid,
            gid: inode.gid,
            rdev: inode.rdev,
            size: if inode.mode & S_IFMT == tree::S_IFLNK {
                inode.payload.as_ref().map_or(0, |p| p.len() as u64)
            } else {
                inode.size
            },
            mtime: inode.mtime,
            payload: inode.payload.as_deref(),
            content: inode.content.as_deref(),
            digest: inode.digest,
            whiteout_in_source: inode.is_whiteout(),
            xattrs: Vec::new(),
            ..Node::default()
        }
    }
}

/// Checks an inode against what the format can hold.
fn validate(node: &Node, inode: &Inode) -> Result<(), String> {
    let Some(ft) = FileType::from_mode(node.mode) else {
        return Err(format!("unknown file type in mode {:o}", node.mode));
    };
    match ft {
        FileType::Regular => {
            if let Some(c) = &inode.content {
                if c.len() as u64 != inode.size {
                    return Err("inline content length differs from the file size".into());
                }
                if c.len() > tree::MAX_INLINE_CONTENT {
                    return Err("inline content is larger than 5000 bytes".into());
                }
            } else if inode.size > 0 && f::chunk_count(inode.size) > f::MAX_EXTERNAL_CHUNKS {
                return Err(format!(
                    "file size {} is larger than the format can describe",
                    inode.size
                ));
            }
        }
        FileType::Symlink => match &inode.payload {
            Some(p) if !p.is_empty() && p.len() <= tree::MAX_PAYLOAD_LEN => {}
            Some(p) if !p.is_empty() => return Err("symlink target longer than 4095 bytes".into()),
            _ => return Err("symlink without a target".into()),
        },
        _ => {}
    }
    Ok(())
}

/// Blocks and inline tail of an inode's data.
fn data_shape(node: &Node) -> (u64, u64) {
    let bs = f::BLOCK_SIZE;
    match node.ftype() {
        tree::S_IFDIR => {
            let mut blocks = 0;
            let mut used = 0u64;
            for (name, _) in &node.children {
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
        tree::S_IFLNK => (0, node.payload.map_or(0, |p| p.len() as u64)),
        tree::S_IFREG if node.size > 0 => {
            if node.content.is_some() {
                let (b, t) = (node.size / bs, node.size % bs);
                if t > bs / 2 {
                    (b + 1, 0)
                } else {
                    (b, t)
                }
            } else {
                (0, f::chunk_count(node.size) * 4)
            }
        }
        _ => (0, 0),
    }
}

/// Padding before an inode so its inline tail does not cross a block
/// boundary; moves the tail to a block of its own when padding cannot help.
fn tail_padding(node: &mut Node, pos: u64, inode_size: u64) -> u64 {
    let bs = f::BLOCK_SIZE;
    let head = inode_size + node.xattr_size;
    if node.ftype() == tree::S_IFLNK {
        // A symlink keeps inode and target in one block when it can.
        let total = head + node.tail;
        if total >= bs {
            node.n_blocks += 1;
            node.tail = 0;
        }
        return if pos / bs != (pos + total - 1) / bs {
            pos.next_multiple_of(bs) - pos
        } else {
            0
        };
    }
    let room = bs - (pos + head) % bs;
    if room >= node.tail {
        return 0;
    }
    let pad = room.next_multiple_of(f::SLOT_SIZE);
    if node.tail <= bs - (pos + head + pad) % bs {
        return pad;
    }
    node.n_blocks += 1;
    node.tail = 0;
    pos.next_multiple_of(bs) - pos
}

fn node_isize(node: &Node, inode_size: u64) -> u64 {
    inode_size + node.xattr_size + node.tail
}

/// Splits sorted directory entries into block-sized runs.
fn dirent_chunks(children: &[(Bytes, u32)]) -> Vec<std::ops::Range<usize>> {
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut used = 0u64;
    for (i, (name, _)) in children.iter().enumerate() {
        let len = (f::DIRENT_SIZE + name.len()) as u64;
        if used + len > f::BLOCK_SIZE {
            chunks.push(start..i);
            start = i;
            used = 0;
        }
        used += len;
    }
    chunks.push(start..children.len());
    chunks
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

fn xattr_entry_size(key: &[u8], value: &[u8]) -> u64 {
    let (_, suffix) = f::xattr_split(key);
    ((f::XATTR_ENTRY_SIZE + suffix.len() + value.len()) as u64).next_multiple_of(4)
}

fn push_xattr(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    let (index, suffix) = f::xattr_split(key);
    let start = out.len();
    out.push(suffix.len() as u8);
    out.push(index);
    out.extend_from_slice(&(value.len() as u16).to_le_bytes());
    out.extend_from_slice(suffix);
    out.extend_from_slice(value);
    out.resize(start + ((out.len() - start).next_multiple_of(4)), 0);
}

/// Sets or replaces an xattr in an unsorted list.
fn set<'a>(xattrs: &mut Vec<(Bytes<'a>, Bytes<'a>)>, key: &'static [u8], value: Vec<u8>) {
    match xattrs.iter_mut().find(|(k, _)| k.as_ref() == key) {
        Some(x) => x.1 = Cow::Owned(value),
        None => xattrs.push((Cow::Borrowed(key), Cow::Owned(value))),
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

/// Path of node `i` from its primary entries (for messages only).
fn path_of(nodes: &[Node], mut i: usize) -> Vec<u8> {
    let mut parts = Vec::new();
    while i != 0 {
        parts.push(nodes[i].name);
        i = nodes[i].parent as usize;
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
