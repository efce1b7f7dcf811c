//! Reads a composefs EROFS image back into a tree, checking every offset.
//!
//! The image is untrusted input. Every offset, length, count and name read
//! from it is checked against the image before use; the walk visits each
//! directory once; what it allocates is bounded by the image's size (see
//! [`decode_budget`]). A bad image gives an [`ImageError`] naming the inode
//! (by nid and byte offset) and what is wrong with it, never a panic or a
//! hang. [`read_image`] is the single entry point (and the one a fuzz target
//! calls).
//!
//! Reading undoes the composefs conventions that the builder applies, so
//! that building the returned tree gives back the same image:
//!
//! - on a regular file, `trusted.overlay.redirect` becomes the payload (one
//!   leading `/` removed) and a 36-byte `trusted.overlay.metacopy` the
//!   fs-verity digest (its bytes 4..36); neither stays an xattr;
//! - an empty regular file carrying `trusted.overlay.overlay.whiteout`
//!   becomes a whiteout (character device 0/0) again, without that xattr and
//!   `user.overlay.whiteout`; a directory holding such a whiteout (as its
//!   primary entry) loses the `whiteouts` markers the builder gave it, and
//!   in version 1 images also the `opaque=x` markers;
//! - any other `trusted.overlay.overlay.X` is unescaped to
//!   `trusted.overlay.X`, and any other `trusted.overlay.*` (such as the
//!   root's `trusted.overlay.opaque`) is dropped;
//! - character devices 0/0 in the image are the 256 root whiteouts `00`..`ff`
//!   the builder adds (whiteouts from the source are stored as marked regular
//!   files): they are dropped, and so are `.` and `..`;
//! - each inode's xattrs are sorted by key, the builder's canonical order;
//! - a device, fifo or socket stored as an extended inode for no reason
//!   but a size (which the builder takes from the source but does not
//!   store) over 32 bits gets size 2^32, where `composefs-info` shows 0;
//! - when several entries name one inode, the primary one (the others are
//!   hardlinks) is chosen so that the builder's breadth-first inode order
//!   puts every inode at the nid it has in the image.

use super::format::{
    self, ino, overlay, sb, BLOCK_BITS, BLOCK_SIZE, CHUNK_FORMAT_BLKBITS_MASK, CHUNK_FORMAT_INDEXES,
    COMPOSEFS_FLAG_HAS_ACL, COMPOSEFS_HEADER_SIZE, COMPOSEFS_HEADER_VERSION, COMPOSEFS_MAGIC, COMPOSEFS_VERSION_MAX,
    DIRENT_SIZE, EROFS_SUPER_MAGIC, EROFS_SUPER_OFFSET, EROFS_SUPER_SIZE, FEATURE_COMPAT_XATTR_FILTER,
    INODE_COMPACT_SIZE, INODE_EXTENDED_SIZE, LAYOUT_CHUNK_BASED, LAYOUT_FLAT_INLINE, LAYOUT_FLAT_PLAIN, SLOT_BITS,
    XATTR_ENTRY_SIZE, XATTR_IBODY_HEADER_SIZE, XATTR_PREFIXES,
};
use crate::tree::{
    Entry, FileType, Inode, Timespec, Tree, Xattr, MAX_INLINE_CONTENT, MAX_NAME_LEN, MAX_PAYLOAD_LEN,
    MAX_XATTR_NAME_LEN, ROOT, S_IFCHR, S_IFMT,
};
use std::collections::{HashMap, HashSet, VecDeque};

/// What the image says about itself beyond the tree: its composefs header
/// and EROFS superblock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageInfo {
    /// composefs format version from the header (0 or 1).
    pub version: u32,
    /// Header flag: the image has POSIX ACLs.
    pub has_acl: bool,
    /// All header flags, as stored (unknown bits are kept, not refused).
    pub flags: u32,
    /// Superblock build time: the mtime of every compact inode.
    pub build_time: Timespec,
    /// Size of the image in blocks, from the superblock.
    pub blocks: u32,
    /// Number of inodes, from the superblock (the builder counts the root's
    /// 256 whiteouts too).
    pub inodes: u64,
    /// nid of the root directory.
    pub root_nid: u64,
    /// First block of the inode area (nids count 32-byte slots from here).
    pub meta_blkaddr: u32,
    /// First block of the shared xattr area.
    pub xattr_blkaddr: u32,
    pub feature_compat: u32,
    pub feature_incompat: u32,
}

/// An image that cannot be read, and why.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// No composefs header: some other file.
    #[error("not a composefs image: {0}")]
    NotComposefs(String),
    /// A well-formed image using something this reader does not know.
    #[error("unsupported image: {0}")]
    Unsupported(String),
    /// The image contradicts itself or the format.
    #[error("corrupt image: {0}")]
    Corrupt(String),
    /// The image would decode to far more metadata than its size explains
    /// (the same bytes referenced over and over).
    #[error("image too large to read: {0}")]
    TooLarge(String),
}

type Result<T> = std::result::Result<T, ImageError>;

/// Everything the tree may hold, beyond what is proportional to the image
/// itself: `base + factor * image size` bytes of names, xattrs, contents
/// and payloads (with a fixed overhead per item). Real images decode to a
/// few times their size; only images that reference the same bytes over
/// and over (the same shared xattr from every inode, the same content block
/// for every file) come near it.
pub fn decode_budget(image_len: usize) -> u64 {
    const BASE: u64 = 64 << 20;
    const FACTOR: u64 = 64;
    BASE.saturating_add((image_len as u64).saturating_mul(FACTOR))
}

/// Deepest directory nesting read: path components of the deepest
/// directory.
/// Deeper trees are refused, so that code walking a tree recursively
/// cannot be made to overflow its stack; a path through them would be
/// longer than PATH_MAX anyway.
pub const MAX_DEPTH: usize = 2048;

// Accounting overheads, roughly the memory an item costs beyond its bytes.
const COST_NODE: u64 = 128;
const COST_ENTRY: u64 = 48;
const COST_XATTR: u64 = 48;

/// The composefs version of an image, from its header alone.
pub fn image_version(image: &[u8]) -> Result<u32> {
    Ok(read_header(image)?.version)
}

/// The owner (uid, gid) of an image's root directory, reading only its
/// header, superblock and root inode.
pub fn root_owner(image: &[u8]) -> Result<(u32, u32)> {
    let info = read_info(image)?;
    let h = Reader::new(image, &info, decode_budget(image.len()), false).head(info.root_nid)?;
    Ok((h.uid, h.gid))
}

/// The header and superblock of an image, checked, without reading its
/// inodes.
pub fn read_info(image: &[u8]) -> Result<ImageInfo> {
    let header = read_header(image)?;
    let s: &[u8; EROFS_SUPER_SIZE] = array(image, EROFS_SUPER_OFFSET as u64).ok_or_else(|| {
        ImageError::Corrupt(format!(
            "truncated: {} bytes, too short for the superblock at offset {EROFS_SUPER_OFFSET}",
            image.len()
        ))
    })?;
    let magic = le32(s, sb::MAGIC);
    check(magic == EROFS_SUPER_MAGIC, || {
        format!("bad EROFS superblock magic {magic:#010x} (expected {EROFS_SUPER_MAGIC:#010x})")
    })?;
    let blkszbits = s[sb::BLKSZBITS];
    if u32::from(blkszbits) != BLOCK_BITS {
        return Err(ImageError::Unsupported(format!(
            "block size 2^{blkszbits}, only 2^{BLOCK_BITS} is supported"
        )));
    }
    let feature_incompat = le32(s, sb::FEATURE_INCOMPAT);
    let unknown = feature_incompat & !format::FEATURE_INCOMPAT_KNOWN;
    if unknown != 0 {
        return Err(ImageError::Unsupported(format!(
            "incompatible EROFS features {unknown:#x} (composefs images use none)"
        )));
    }
    let info = ImageInfo {
        version: header.version,
        has_acl: header.flags & COMPOSEFS_FLAG_HAS_ACL != 0,
        flags: header.flags,
        build_time: Timespec {
            sec: le64(s, sb::BUILD_TIME) as i64,
            nsec: le32(s, sb::BUILD_TIME_NSEC),
        },
        blocks: le32(s, sb::BLOCKS),
        inodes: le64(s, sb::INOS),
        root_nid: u64::from(le16(s, sb::ROOT_NID)),
        meta_blkaddr: le32(s, sb::META_BLKADDR),
        xattr_blkaddr: le32(s, sb::XATTR_BLKADDR),
        feature_compat: le32(s, sb::FEATURE_COMPAT),
        feature_incompat,
    };
    let needed = u64::from(info.blocks) * BLOCK_SIZE;
    check(needed <= image.len() as u64, || {
        format!(
            "truncated: the superblock says {} blocks ({needed} bytes) but the image is {} bytes",
            info.blocks,
            image.len()
        )
    })?;
    let meta_start = u64::from(info.meta_blkaddr) * BLOCK_SIZE;
    check(meta_start < image.len() as u64, || {
        format!(
            "inode area at block {} (offset {meta_start}) is past the end of the {}-byte image",
            info.meta_blkaddr,
            image.len()
        )
    })?;
    Ok(info)
}

/// Reads a whole image into a tree.
pub fn read_image(image: &[u8]) -> Result<(Tree, ImageInfo)> {
    read_image_within(image, decode_budget(image.len()))
}

/// [`read_image`] with an explicit limit on what the tree may hold.
fn read_image_within(image: &[u8], budget: u64) -> Result<(Tree, ImageInfo)> {
    let info = read_info(image)?;
    let mut r = Reader::new(image, &info, budget, true);
    let dirs = r.walk(info.root_nid)?;
    let primary = choose_primaries(&r.nodes, &dirs);
    let inodes = r.inodes.take().unwrap_or_default();
    let tree = build_tree(r.nodes, inodes, dirs, primary, info.version);
    Ok((tree, info))
}

// ---------------------------------------------------------------------------
// Checked access to untrusted bytes.

/// `Ok` if `ok`, else a corrupt-image error with the message `msg` makes.
pub(super) fn check(ok: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(ImageError::Corrupt(msg()))
    }
}

/// `len` bytes of `data` at `off`, if they are all there.
pub(super) fn get(data: &[u8], off: u64, len: u64) -> Option<&[u8]> {
    let start = usize::try_from(off).ok()?;
    let end = usize::try_from(off.checked_add(len)?).ok()?;
    data.get(start..end)
}

/// `len` bytes at `off`, or an error saying which `what` ran off the image.
fn bytes(data: &[u8], off: u64, len: u64, what: impl FnOnce() -> String) -> Result<&[u8]> {
    get(data, off, len).ok_or_else(|| {
        ImageError::Corrupt(format!(
            "{} (offset {off}, {len} bytes) runs past the end of the {}-byte image",
            what(),
            data.len()
        ))
    })
}

/// A fixed-size record at `off`, if it is all there.
pub(super) fn array<const N: usize>(data: &[u8], off: u64) -> Option<&[u8; N]> {
    get(data, off, N as u64)?.try_into().ok()
}

// Little-endian fields of fixed-size records; offsets are format constants
// well inside the records they index.
pub(super) fn le16<const N: usize>(b: &[u8; N], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

pub(super) fn le32<const N: usize>(b: &[u8; N], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

pub(super) fn le64<const N: usize>(b: &[u8; N], off: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(v)
}

/// A name or value for messages: printable ASCII as is, the rest escaped.
fn show(s: &[u8]) -> String {
    s.escape_ascii().to_string()
}

// ---------------------------------------------------------------------------
// Header.

struct Header {
    version: u32,
    flags: u32,
}

fn read_header(image: &[u8]) -> Result<Header> {
    let h: &[u8; COMPOSEFS_HEADER_SIZE] = array(image, 0)
        .ok_or_else(|| ImageError::NotComposefs(format!("{} bytes, too short for a composefs header", image.len())))?;
    let magic = le32(h, format::header::MAGIC);
    if magic != COMPOSEFS_MAGIC {
        return Err(ImageError::NotComposefs(format!(
            "bad magic {magic:#010x} (expected {COMPOSEFS_MAGIC:#010x})"
        )));
    }
    let header_version = le32(h, format::header::VERSION);
    if header_version != COMPOSEFS_HEADER_VERSION {
        return Err(ImageError::Unsupported(format!(
            "composefs header version {header_version} (only {COMPOSEFS_HEADER_VERSION} is known)"
        )));
    }
    let version = le32(h, format::header::COMPOSEFS_VERSION);
    if version > COMPOSEFS_VERSION_MAX {
        return Err(ImageError::Unsupported(format!(
            "composefs version {version} (at most {COMPOSEFS_VERSION_MAX} is supported)"
        )));
    }
    Ok(Header {
        version,
        flags: le32(h, format::header::FLAGS),
    })
}

// ---------------------------------------------------------------------------
// Inodes.

/// One inode of the image, decoded (the inode itself, as the tree will
/// hold it, is in [`Reader::inodes`] when kept).
pub(super) struct Node<'a> {
    pub(super) nid: u64,
    /// Its type in the image (a whiteout is a regular file there).
    pub(super) kind: FileType,
    /// One of the builder's root whiteouts: not part of the tree.
    pub(super) skip: bool,
    /// A whiteout (conventions undone).
    pub(super) whiteout: bool,
    /// Carries the builder's `whiteouts` marker (once unescaped).
    pub(super) marked: bool,
    /// A directory that some entry (or the superblock) already leads to.
    dir_reached: bool,
    /// A directory's data, block by block (tail last), until it is walked.
    pub(super) dir_blocks: Vec<&'a [u8]>,
}

/// A directory's entries, in the image's (name) order, without `.`/`..`.
pub(super) struct Listing<'a> {
    pub(super) dir: usize,
    pub(super) entries: Vec<(&'a [u8], usize)>,
}

pub(super) struct Reader<'a> {
    pub(super) data: &'a [u8],
    meta_start: u64,
    xattr_start: u64,
    build_time: Timespec,
    xattr_filter: bool,
    budget: u64,
    limit: u64,
    pub(super) nodes: Vec<Node<'a>>,
    by_nid: HashMap<u64, usize>,
    /// The decoded inodes, by node (None: only checked, not kept).
    pub(super) inodes: Option<Vec<Inode>>,
    /// Some node (not skipped) has a security.selinux label.
    pub(super) selinux: bool,
    /// Contents of more than a block, by node, when the inodes are not
    /// kept (their blocks and inline tail are apart in the image).
    pub(super) long_contents: Vec<(usize, Vec<u8>)>,
    /// Every xattr name of the tree, when the inodes are not kept.
    pub(super) keys: HashSet<Box<[u8]>>,
}

/// An inode's fixed fields, as stored (see [`Reader::head`]).
pub(super) struct Head {
    pub(super) off: u64,
    pub(super) extended: bool,
    pub(super) layout: u16,
    pub(super) mode: u32,
    pub(super) kind: FileType,
    pub(super) nlink: u32,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) size: u64,
    pub(super) mtime: Timespec,
    /// raw_blkaddr, rdev or chunk format.
    pub(super) i_u: u32,
    pub(super) xattr_off: u64,
    pub(super) xattr_size: u64,
    pub(super) inline_off: u64,
}

impl Head {
    /// The size the tree gives a device, fifo or socket stored as an
    /// extended inode for no reason but a size (see `read_inode`).
    pub(super) fn tree_size(&self, build_time: Timespec) -> u64 {
        let special = !matches!(self.kind, FileType::Regular | FileType::Directory | FileType::Symlink);
        let fits_compact = self.mtime == build_time
            && self.nlink <= u32::from(u16::MAX)
            && self.uid <= u32::from(u16::MAX)
            && self.gid <= u32::from(u16::MAX);
        if special && self.extended && self.size == 0 && fits_compact {
            1 << 32
        } else {
            self.size
        }
    }
}

/// An xattr as stored: name index, name suffix, value, and where.
pub(super) struct RawXattr<'a> {
    pub(super) index: u8,
    pub(super) suffix: &'a [u8],
    pub(super) value: &'a [u8],
    off: u64,
}

impl<'a> Reader<'a> {
    /// A reader of `image` (whose header and superblock `info` says),
    /// keeping the inodes it decodes or only checking them.
    pub(super) fn new(image: &'a [u8], info: &ImageInfo, budget: u64, keep: bool) -> Reader<'a> {
        Reader {
            data: image,
            meta_start: u64::from(info.meta_blkaddr) * BLOCK_SIZE,
            xattr_start: u64::from(info.xattr_blkaddr) * BLOCK_SIZE,
            build_time: info.build_time,
            xattr_filter: info.feature_compat & FEATURE_COMPAT_XATTR_FILTER != 0,
            budget,
            limit: budget,
            nodes: Vec::new(),
            by_nid: HashMap::new(),
            inodes: keep.then(Vec::new),
            selinux: false,
            long_contents: Vec::new(),
            keys: HashSet::new(),
        }
    }

    pub(super) fn build_time(&self) -> Timespec {
        self.build_time
    }

    fn spend(&mut self, cost: u64) -> Result<()> {
        match self.budget.checked_sub(cost) {
            Some(left) => {
                self.budget = left;
                Ok(())
            }
            None => Err(ImageError::TooLarge(format!(
                "a {}-byte image decodes to more than {} bytes of metadata",
                self.data.len(),
                self.limit
            ))),
        }
    }

    /// Walks the directories breadth-first from the root, decoding every
    /// inode reached. Returns the listings in walk order (root first).
    pub(super) fn walk(&mut self, root_nid: u64) -> Result<Vec<Listing<'a>>> {
        let root = self.node(root_nid)?;
        let kind = self.nodes[root].kind;
        check(kind == FileType::Directory, || {
            format!("root nid {root_nid} is a {kind}, not a directory")
        })?;
        self.nodes[root].dir_reached = true;
        let mut queue = VecDeque::from([(root, 0)]);
        let mut listings = Vec::new();
        while let Some((dir, depth)) = queue.pop_front() {
            let dir_nid = self.nodes[dir].nid;
            let blocks = std::mem::take(&mut self.nodes[dir].dir_blocks);
            let mut entries = Vec::new();
            let mut prev: Option<&[u8]> = None;
            for block in blocks {
                self.spend(COST_ENTRY)?;
                for (name, nid, ftype) in read_dir_block(dir_nid, block)? {
                    self.spend(COST_ENTRY + name.len() as u64)?;
                    if let Some(p) = prev {
                        check(name != p, || {
                            format!("directory nid {dir_nid}: duplicate name \"{}\"", show(name))
                        })?;
                        check(name > p, || {
                            format!(
                                "directory nid {dir_nid}: names not in sorted order (\"{}\" after \"{}\")",
                                show(name),
                                show(p)
                            )
                        })?;
                    }
                    prev = Some(name);
                    if name == b"." || name == b".." {
                        continue;
                    }
                    let child = self.node(nid)?;
                    let node = &mut self.nodes[child];
                    let expected = file_type_code(node.kind);
                    check(ftype == expected, || {
                        format!(
                            "directory nid {dir_nid}: entry \"{}\" has file type {ftype} but nid {nid} is a {} (type {expected})",
                            show(name),
                            node.kind
                        )
                    })?;
                    if node.kind == FileType::Directory {
                        check(!node.dir_reached, || {
                            format!(
                                "directory nid {dir_nid}: entry \"{}\" leads to directory nid {nid}, which already has an entry (a directory hardlink or a cycle)",
                                show(name)
                            )
                        })?;
                        if depth >= MAX_DEPTH {
                            // (`depth` counts the path components of `dir`.)
                            return Err(ImageError::Unsupported(format!(
                                "directory nid {nid} is nested more than {MAX_DEPTH} deep"
                            )));
                        }
                        node.dir_reached = true;
                        queue.push_back((child, depth + 1));
                    }
                    entries.push((name, child));
                }
            }
            listings.push(Listing { dir, entries });
        }
        Ok(listings)
    }

    /// The index of the node for `nid`, decoding it on first sight.
    fn node(&mut self, nid: u64) -> Result<usize> {
        if let Some(&i) = self.by_nid.get(&nid) {
            return Ok(i);
        }
        self.spend(COST_NODE)?;
        if self.nodes.len() >= u32::MAX as usize {
            return Err(ImageError::TooLarge("more inodes than a tree holds".into()));
        }
        let (node, inode) = self.read_inode(nid)?;
        match &mut self.inodes {
            Some(v) => v.push(inode),
            None => {
                self.selinux |= !node.skip && inode.xattr(b"security.selinux").is_some();
                for x in inode.xattrs {
                    if !self.keys.contains(&x.key[..]) {
                        self.keys.insert(x.key.into_boxed_slice());
                    }
                }
                if let Some(c) = inode.content.filter(|c| c.len() as u64 > BLOCK_SIZE) {
                    self.long_contents.push((self.nodes.len(), c));
                }
            }
        }
        let i = self.nodes.len();
        self.nodes.push(node);
        self.by_nid.insert(nid, i);
        Ok(i)
    }

    /// The fixed fields of inode `nid`, checked.
    pub(super) fn head(&self, nid: u64) -> Result<Head> {
        let data = self.data;
        let off = nid
            .checked_mul(1 << SLOT_BITS)
            .and_then(|o| o.checked_add(self.meta_start))
            .filter(|&o| o < data.len() as u64)
            .ok_or_else(|| ImageError::Corrupt(format!("nid {nid} is past the end of the image")))?;
        let at = || format!("nid {nid} (offset {off})");
        let c: &[u8; INODE_COMPACT_SIZE] =
            array(data, off).ok_or_else(|| ImageError::Corrupt(format!("{}: truncated inode", at())))?;
        let i_format = le16(c, ino::FORMAT);
        check(i_format & !format::I_FORMAT_ALL == 0, || {
            format!("{}: unknown inode format bits {i_format:#06x}", at())
        })?;
        let extended = (i_format >> format::I_VERSION_BIT) & 1 != 0;
        let layout = (i_format >> format::I_DATALAYOUT_BIT) & format::I_DATALAYOUT_MASK;
        match layout {
            LAYOUT_FLAT_PLAIN | LAYOUT_FLAT_INLINE | LAYOUT_CHUNK_BASED => {}
            format::LAYOUT_COMPRESSED_FULL | format::LAYOUT_COMPRESSED_COMPACT => {
                return Err(ImageError::Unsupported(format!(
                    "{}: compressed inode (layout {layout})",
                    at()
                )))
            }
            _ => return Err(ImageError::Corrupt(format!("{}: unknown data layout {layout}", at()))),
        }
        let xattr_icount = le16(c, ino::XATTR_ICOUNT);
        let mode = u32::from(le16(c, ino::MODE));
        let i_u = le32(c, ino::U);
        let (size, nlink, uid, gid, mtime, isize);
        if extended {
            let e: &[u8; INODE_EXTENDED_SIZE] =
                array(data, off).ok_or_else(|| ImageError::Corrupt(format!("{}: truncated extended inode", at())))?;
            size = le64(e, ino::SIZE);
            nlink = le32(e, ino::E_NLINK);
            uid = le32(e, ino::UID);
            gid = le32(e, ino::E_GID);
            mtime = Timespec {
                sec: le64(e, ino::E_MTIME) as i64,
                nsec: le32(e, ino::E_MTIME_NSEC),
            };
            isize = INODE_EXTENDED_SIZE as u64;
        } else {
            size = u64::from(le32(c, ino::SIZE));
            nlink = u32::from(le16(c, ino::C_NLINK));
            uid = u32::from(le16(c, ino::UID));
            gid = u32::from(le16(c, ino::C_GID));
            mtime = self.build_time;
            isize = INODE_COMPACT_SIZE as u64;
        }
        let kind = FileType::from_mode(mode)
            .ok_or_else(|| ImageError::Corrupt(format!("{}: unknown file type in mode {mode:o}", at())))?;
        let xattr_size = if xattr_icount == 0 {
            0
        } else {
            XATTR_IBODY_HEADER_SIZE as u64 + 4 * (u64::from(xattr_icount) - 1)
        };
        let xattr_off = off + isize;
        Ok(Head {
            off,
            extended,
            layout,
            mode,
            kind,
            nlink,
            uid,
            gid,
            size,
            mtime,
            i_u,
            xattr_off,
            xattr_size,
            inline_off: xattr_off + xattr_size,
        })
    }

    /// Inode `nid`, decoded and checked, with the conventions undone.
    pub(super) fn read_inode(&mut self, nid: u64) -> Result<(Node<'a>, Inode)> {
        let data = self.data;
        let h = self.head(nid)?;
        let off = h.off;
        let at = || format!("nid {nid} (offset {off})");
        let (layout, size, i_u, kind, inline_off) = (h.layout, h.size, h.i_u, h.kind, h.inline_off);
        let mut inode = Inode::new(h.mode);
        inode.nlink = h.nlink;
        inode.uid = h.uid;
        inode.gid = h.gid;
        inode.mtime = h.mtime;
        inode.size = h.tree_size(self.build_time);
        let raw = self.read_xattrs(nid, h.xattr_off, h.xattr_size)?;

        let mut node = Node {
            nid,
            kind,
            skip: false,
            whiteout: false,
            marked: false,
            dir_reached: false,
            dir_blocks: Vec::new(),
        };
        let flat = || -> Result<(&'a [u8], &'a [u8])> {
            if layout == LAYOUT_CHUNK_BASED {
                return Err(ImageError::Unsupported(format!(
                    "{}: {kind} with a chunk-based layout",
                    at()
                )));
            }
            flat_data(data, nid, layout, size, i_u, inline_off)
        };
        match kind {
            FileType::Directory => {
                let (blocks, tail) = flat()?;
                self.spend(COST_ENTRY * (blocks.len() as u64 / BLOCK_SIZE + 1))?;
                node.dir_blocks = blocks.chunks(BLOCK_SIZE as usize).collect();
                if !tail.is_empty() {
                    node.dir_blocks.push(tail);
                }
            }
            FileType::Symlink => {
                check(size > 0, || format!("{}: symlink with an empty target", at()))?;
                check(size <= MAX_PAYLOAD_LEN as u64, || {
                    format!("{}: symlink target of {size} bytes (at most {MAX_PAYLOAD_LEN})", at())
                })?;
                let (blocks, tail) = flat()?;
                let target = [blocks, tail].concat();
                check(!target.contains(&0), || {
                    format!("{}: symlink target contains a NUL byte", at())
                })?;
                self.spend(target.len() as u64)?;
                inode.payload = Some(target);
            }
            FileType::Regular if size == 0 => {}
            FileType::Regular if layout == LAYOUT_CHUNK_BASED => {
                // Data in the store; the chunk map only says "holes".
                let chunk_format = i_u as u16;
                check(
                    chunk_format & !(CHUNK_FORMAT_BLKBITS_MASK | CHUNK_FORMAT_INDEXES) == 0,
                    || format!("{}: unknown chunk format {chunk_format:#06x}", at()),
                )?;
            }
            FileType::Regular => {
                check(size <= MAX_INLINE_CONTENT as u64, || {
                    format!("{}: inline file of {size} bytes (at most {MAX_INLINE_CONTENT})", at())
                })?;
                let (blocks, tail) = flat()?;
                self.spend(size)?;
                inode.content = Some([blocks, tail].concat());
            }
            FileType::CharDevice | FileType::BlockDevice => inode.rdev = i_u,
            FileType::Fifo | FileType::Socket => {}
        }
        self.apply_xattrs(&node, &mut inode, raw)?;
        // The builder's root whiteouts: the only character devices 0/0 an
        // image holds (whiteouts from the source become regular files).
        node.skip = kind == FileType::CharDevice && inode.rdev == 0;
        node.whiteout = inode.is_whiteout();
        node.marked = inode.xattr(UNESCAPED_WHITEOUTS).is_some();
        Ok((node, inode))
    }

    /// Decodes an inode's xattrs (inline ones, then shared ones).
    pub(super) fn read_xattrs(&self, nid: u64, off: u64, size: u64) -> Result<Vec<RawXattr<'a>>> {
        let mut out = Vec::new();
        if size == 0 {
            return Ok(out);
        }
        let data = self.data;
        let body = bytes(data, off, size, || format!("nid {nid}: xattrs"))?;
        let header: &[u8; XATTR_IBODY_HEADER_SIZE] =
            array(body, 0).ok_or_else(|| ImageError::Corrupt(format!("nid {nid}: xattr header truncated")))?;
        let filter = le32(header, 0);
        let shared_count = header[4];
        let shared_end = XATTR_IBODY_HEADER_SIZE as u64 + 4 * u64::from(shared_count);
        check(shared_end <= size, || {
            format!("nid {nid}: {shared_count} shared xattrs do not fit in {size} bytes of xattrs (offset {off})")
        })?;
        let mut pos = shared_end;
        while pos < size {
            let x = read_xattr_entry(body, pos, off + pos, || format!("nid {nid}: inline xattr"))?;
            pos += (XATTR_ENTRY_SIZE + x.suffix.len() + x.value.len()).next_multiple_of(4) as u64;
            out.push(x);
        }
        for i in 0..u64::from(shared_count) {
            let id: &[u8; 4] = array(body, XATTR_IBODY_HEADER_SIZE as u64 + 4 * i)
                .ok_or_else(|| ImageError::Corrupt(format!("nid {nid}: shared xattr id truncated")))?;
            let id = u32::from_le_bytes(*id);
            let at = self.xattr_start + 4 * u64::from(id);
            out.push(read_xattr_entry(data, at, at, || {
                format!("nid {nid}: shared xattr {id}")
            })?);
        }
        if self.xattr_filter {
            for x in &out {
                let bit = format::xattr_filter_bit(x.index, x.suffix);
                check(filter & (1 << bit) == 0, || {
                    format!(
                        "nid {nid}: the xattr name filter {filter:#010x} hides xattr \"{}{}\" (offset {})",
                        show(XATTR_PREFIXES[x.index as usize]),
                        show(x.suffix),
                        x.off
                    )
                })?;
            }
        }
        Ok(out)
    }

    /// Turns stored xattrs into the tree's, undoing the composefs overlay
    /// conventions on the way (see the module documentation).
    fn apply_xattrs(&mut self, node: &Node<'a>, inode: &mut Inode, raw: Vec<RawXattr<'a>>) -> Result<()> {
        let nid = node.nid;
        let is_reg = node.kind == FileType::Regular;
        let mut xattrs: Vec<(Vec<u8>, &[u8])> = Vec::with_capacity(raw.len());
        for x in raw {
            let prefix = XATTR_PREFIXES[x.index as usize];
            let key = [prefix, x.suffix].concat();
            check(!key.is_empty(), || {
                format!("nid {nid}: xattr with an empty name (offset {})", x.off)
            })?;
            // The limit is the name's once unescaped: an escaped overlay
            // name is stored with "overlay." more.
            let named = match key.starts_with(overlay::ESCAPE_PREFIX) {
                true => key.len() - (overlay::ESCAPE_PREFIX.len() - overlay::PREFIX.len()),
                false => key.len(),
            };
            check(named <= MAX_XATTR_NAME_LEN, || {
                format!(
                    "nid {nid}: xattr name of {named} bytes (at most {MAX_XATTR_NAME_LEN}; offset {})",
                    x.off
                )
            })?;
            check(!x.suffix.contains(&0), || {
                format!(
                    "nid {nid}: xattr name \"{}\" contains a NUL byte (offset {})",
                    show(&key),
                    x.off
                )
            })?;
            self.spend(COST_XATTR + (key.len() + x.value.len()) as u64)?;
            xattrs.push((key, x.value));
        }
        xattrs.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = xattrs.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(ImageError::Corrupt(format!(
                "nid {nid}: xattr \"{}\" appears twice",
                show(&w[0].0)
            )));
        }
        for (key, value) in xattrs {
            if key == overlay::REDIRECT {
                if is_reg {
                    let path = value.strip_prefix(b"/").unwrap_or(value);
                    check(!path.contains(&0), || {
                        format!("nid {nid}: redirect contains a NUL byte")
                    })?;
                    check(path.len() <= MAX_PAYLOAD_LEN, || {
                        format!(
                            "nid {nid}: redirect of {} bytes (at most {MAX_PAYLOAD_LEN})",
                            path.len()
                        )
                    })?;
                    inode.payload = (!path.is_empty()).then(|| path.to_vec());
                }
            } else if key == overlay::METACOPY {
                if is_reg && value.len() == 36 {
                    inode.digest = value.get(4..36).and_then(|d| d.try_into().ok());
                }
            } else if let Some(rest) = key.strip_prefix(overlay::ESCAPE_PREFIX) {
                inode.xattrs.push(Xattr {
                    key: [overlay::PREFIX, rest].concat(),
                    value: value.to_vec(),
                });
            } else if !key.starts_with(overlay::PREFIX) {
                inode.xattrs.push(Xattr {
                    key,
                    value: value.to_vec(),
                });
            }
        }
        // Unescaping moved some keys: restore the canonical order.
        inode.xattrs.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        // The builder's whiteouts are empty: a file with contents that
        // carries the marker had it in the source, and keeps it.
        if is_reg && inode.size == 0 && inode.remove_xattr(UNESCAPED_WHITEOUT) {
            inode.remove_xattr(overlay::USER_WHITEOUT);
            inode.mode = S_IFCHR | (inode.mode & !S_IFMT);
            inode.rdev = 0;
            inode.size = 0;
            inode.content = None;
            inode.payload = None;
            inode.digest = None;
        }
        Ok(())
    }
}

// The builder's whiteout markers once unescaped (see `apply_xattrs`).
pub(super) const UNESCAPED_WHITEOUT: &[u8] = b"trusted.overlay.whiteout";
pub(super) const UNESCAPED_WHITEOUTS: &[u8] = b"trusted.overlay.whiteouts";
pub(super) const UNESCAPED_OPAQUE: &[u8] = b"trusted.overlay.opaque";

/// One xattr entry (header, name, value) at `pos` in `buf`; `off` is its
/// image offset, for messages.
fn read_xattr_entry<'a>(buf: &'a [u8], pos: u64, off: u64, what: impl Fn() -> String) -> Result<RawXattr<'a>> {
    let h: &[u8; XATTR_ENTRY_SIZE] = array(buf, pos)
        .ok_or_else(|| ImageError::Corrupt(format!("{} at offset {off}: truncated entry header", what())))?;
    let name_len = u64::from(h[0]);
    let index = h[1];
    let value_len = u64::from(u16::from_le_bytes([h[2], h[3]]));
    check(usize::from(index) < XATTR_PREFIXES.len(), || {
        format!("{} at offset {off}: unknown name index {index}", what())
    })?;
    let start = pos + XATTR_ENTRY_SIZE as u64;
    let suffix = get(buf, start, name_len);
    let value = get(buf, start + name_len, value_len);
    match (suffix, value) {
        (Some(suffix), Some(value)) => Ok(RawXattr {
            index,
            suffix,
            value,
            off,
        }),
        _ => Err(ImageError::Corrupt(format!(
            "{} at offset {off}: name ({name_len} bytes) and value ({value_len} bytes) run past the end of their area",
            what()
        ))),
    }
}

/// The data of a flat inode: `size` bytes, in whole blocks from block
/// `blkaddr` and (inline layout) a tail right after the inode's xattrs.
pub(super) fn flat_data(
    data: &[u8],
    nid: u64,
    layout: u16,
    size: u64,
    blkaddr: u32,
    inline_off: u64,
) -> Result<(&[u8], &[u8])> {
    let block_off = u64::from(blkaddr) * BLOCK_SIZE;
    let what = || format!("nid {nid}: data at block {blkaddr}");
    if size == 0 {
        return Ok((&[], &[]));
    }
    if layout == LAYOUT_FLAT_PLAIN {
        return Ok((bytes(data, block_off, size, what)?, &[]));
    }
    // Inline: every block but the last is out of line; the last one (which
    // may be a whole block) follows the inode.
    let full = (size - 1) / BLOCK_SIZE * BLOCK_SIZE;
    let tail_len = size - full;
    let blocks = if full > 0 {
        bytes(data, block_off, full, what)?
    } else {
        &[]
    };
    check(inline_off % BLOCK_SIZE + tail_len <= BLOCK_SIZE, || {
        format!("nid {nid}: inline data ({tail_len} bytes at offset {inline_off}) crosses a block boundary")
    })?;
    let tail = bytes(data, inline_off, tail_len, || format!("nid {nid}: inline data"))?;
    Ok((blocks, tail))
}

/// The entries of one directory block: (name, nid, file type).
pub(super) fn read_dir_block(dir_nid: u64, block: &[u8]) -> Result<Vec<(&[u8], u64, u8)>> {
    let dirent = |i: usize| -> Option<&[u8; DIRENT_SIZE]> { array(block, (i * DIRENT_SIZE) as u64) };
    let first = dirent(0).ok_or_else(|| {
        ImageError::Corrupt(format!(
            "directory nid {dir_nid}: a {}-byte block holds no entry",
            block.len()
        ))
    })?;
    let names_start = usize::from(le16(first, 8));
    check(
        names_start % DIRENT_SIZE == 0 && names_start >= DIRENT_SIZE && names_start <= block.len(),
        || {
            format!(
                "directory nid {dir_nid}: first name offset {names_start} is not a multiple of {DIRENT_SIZE} within the {}-byte block",
                block.len()
            )
        },
    )?;
    let count = names_start / DIRENT_SIZE;
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let d =
            dirent(i).ok_or_else(|| ImageError::Corrupt(format!("directory nid {dir_nid}: dirent {i} truncated")))?;
        let start = usize::from(le16(d, 8));
        let end = match dirent(i + 1).filter(|_| i + 1 < count) {
            Some(next) => usize::from(le16(next, 8)),
            None => block.len(),
        };
        let raw = block.get(start..end).filter(|_| start >= names_start).ok_or_else(|| {
            ImageError::Corrupt(format!(
                "directory nid {dir_nid}: entry {i} has name offsets {start}..{end} outside {names_start}..{}",
                block.len()
            ))
        })?;
        // The last name runs to the end of the block, or to padding.
        let name = if i + 1 == count {
            raw.split(|&c| c == 0).next().unwrap_or(raw)
        } else {
            raw
        };
        check(!name.is_empty(), || {
            format!("directory nid {dir_nid}: entry {i} has an empty name")
        })?;
        check(name.len() <= MAX_NAME_LEN, || {
            format!(
                "directory nid {dir_nid}: entry {i} has a {}-byte name (at most {MAX_NAME_LEN})",
                name.len()
            )
        })?;
        check(!name.iter().any(|&c| c == b'/' || c == 0), || {
            format!(
                "directory nid {dir_nid}: name \"{}\" contains '/' or a NUL byte",
                show(name)
            )
        })?;
        out.push((name, le64(d, 0), d[10]));
    }
    Ok(out)
}

/// The dirent file type for an inode type.
fn file_type_code(t: FileType) -> u8 {
    match t {
        FileType::Regular => format::FT_REG_FILE,
        FileType::Directory => format::FT_DIR,
        FileType::CharDevice => format::FT_CHRDEV,
        FileType::BlockDevice => format::FT_BLKDEV,
        FileType::Fifo => format::FT_FIFO,
        FileType::Socket => format::FT_SOCK,
        FileType::Symlink => format::FT_SYMLINK,
    }
}

// ---------------------------------------------------------------------------
// Hardlinks and the tree.

/// For each listing entry, whether it is its inode's primary entry.
///
/// The builder numbers inodes breadth-first over primary entries
/// (directories in order, entries in name order), so in an image it made,
/// nids rise along that walk. Walking the same way, an entry to an inode
/// not yet placed is primary exactly when that inode has the smallest nid
/// not yet placed. An inode never placed that way (an image from another
/// builder) gets its first entry as primary.
///
/// Until the walk places another inode, a later entry to the inode just
/// placed would have given it the same nid. Only a whiteout tells such
/// entries apart: the builder marks the directory of its primary entry, so
/// the marked directory's entry is the primary one.
pub(super) fn choose_primaries(nodes: &[Node], dirs: &[Listing]) -> Vec<Vec<bool>> {
    let mut by_nid: Vec<usize> = (0..nodes.len()).collect();
    by_nid.sort_unstable_by_key(|&i| nodes[i].nid);
    let mut placed = vec![false; nodes.len()];
    if let Some(root) = dirs.first() {
        placed[root.dir] = true;
    }
    let marked = |d: &Listing| nodes[d.dir].marked;
    let mut next = 0;
    let mut first_entry: Vec<Option<(usize, usize)>> = vec![None; nodes.len()];
    let mut primary: Vec<Vec<bool>> = dirs.iter().map(|d| vec![false; d.entries.len()]).collect();
    // The entry (inode, listing, index) that placed the last inode.
    let mut last: Option<(usize, usize, usize)> = None;
    for (di, d) in dirs.iter().enumerate() {
        for (ei, &(_, child)) in d.entries.iter().enumerate() {
            if placed[child] {
                if let Some((c, pdi, pei)) = last {
                    if c == child && nodes[c].whiteout && marked(d) && !marked(&dirs[pdi]) {
                        primary[pdi][pei] = false;
                        primary[di][ei] = true;
                        last = Some((c, di, ei));
                    }
                }
                continue;
            }
            while next < by_nid.len() && placed[by_nid[next]] {
                next += 1;
            }
            // Directories have exactly one entry (the walk checked that).
            if nodes[child].kind == FileType::Directory || by_nid.get(next) == Some(&child) {
                placed[child] = true;
                primary[di][ei] = true;
                last = Some((child, di, ei));
            } else if first_entry[child].is_none() {
                first_entry[child] = Some((di, ei));
            }
        }
    }
    for (child, first) in first_entry.into_iter().enumerate() {
        if let (false, Some((di, ei))) = (placed[child], first) {
            primary[di][ei] = true;
        }
    }
    primary
}

/// Takes the markers the builder gives a directory holding whiteouts off
/// it (the builder adds them again).
pub(super) fn unmark(dir: &mut Inode, version: u32) {
    dir.remove_xattr(UNESCAPED_WHITEOUTS);
    dir.remove_xattr(overlay::USER_WHITEOUTS);
    if version >= 1 {
        for key in [UNESCAPED_OPAQUE, overlay::USER_OPAQUE] {
            if dir.xattr(key) == Some(&b"x"[..]) {
                dir.remove_xattr(key);
            }
        }
    }
}

/// The tree's order of the nodes walked: the root first, then the others
/// by nid. Returns the nodes in that order and each node's id (u32::MAX
/// for skipped ones).
pub(super) fn tree_order(nodes: &[Node], dirs: &[Listing]) -> (Vec<usize>, Vec<u32>) {
    let root = dirs.first().map_or(0, |d| d.dir);
    let mut order: Vec<usize> = (0..nodes.len()).filter(|&i| i != root && !nodes[i].skip).collect();
    order.sort_unstable_by_key(|&i| nodes[i].nid);
    order.insert(0, root);
    let mut id = vec![u32::MAX; nodes.len()];
    for (n, &i) in order.iter().enumerate() {
        id[i] = n as u32;
    }
    (order, id)
}

/// Assembles the tree: the root first, then the other inodes in nid order.
fn build_tree(
    nodes: Vec<Node>,
    mut all: Vec<Inode>,
    dirs: Vec<Listing>,
    primary: Vec<Vec<bool>>,
    version: u32,
) -> Tree {
    let (order, id) = tree_order(&nodes, &dirs);
    let mut inodes: Vec<Inode> = order.iter().map(|&i| std::mem::take(&mut all[i])).collect();
    for (d, prim) in dirs.into_iter().zip(primary) {
        let entries = d
            .entries
            .into_iter()
            .zip(prim)
            .filter(|&((_, child), _)| !nodes[child].skip)
            .map(|((name, child), primary)| Entry {
                name: name.to_vec(),
                inode: id[child],
                hardlink: !primary,
            })
            .collect();
        inodes[id[d.dir] as usize].entries = entries;
    }
    // Directories holding whiteouts carry markers the builder adds again.
    let marked: Vec<usize> = (0..inodes.len())
        .filter(|&i| {
            inodes[i]
                .entries
                .iter()
                .any(|e| !e.hardlink && inodes[e.inode as usize].is_whiteout())
        })
        .collect();
    for i in marked {
        unmark(&mut inodes[i], version);
    }
    debug_assert_eq!(ROOT, 0);
    Tree { inodes }
}

#[cfg(test)]
mod tests {
    //! Hand-made images: small enough to reason about byte by byte, so every
    //! check has an image that trips it. (Images from the reference builder
    //! are tested in `tests/reader.rs`.)

    use super::*;
    use crate::tree::{S_IFBLK, S_IFDIR, S_IFLNK, S_IFREG};
    use format::{put_u16, put_u32, put_u64, FT_CHRDEV, FT_DIR, FT_REG_FILE, FT_SYMLINK};
    use std::collections::BTreeMap;

    const ROOT_NID: u64 = 40;
    // The other inodes of `basic`, 512 bytes apart.
    const A: u64 = 56;
    const F: u64 = 72;
    const L: u64 = 88;
    const X: u64 = 104;
    const BUILD_TIME: i64 = 1000;

    /// One inode to encode.
    #[derive(Clone)]
    struct Spec {
        mode: u32,
        size: u64,
        layout: u16,
        i_u: u32,
        nlink: u32,
        extended: bool,
        mtime: i64,
        xattrs: Vec<u8>,
        tail: Vec<u8>,
    }

    fn spec(mode: u32) -> Spec {
        Spec {
            mode,
            size: 0,
            layout: LAYOUT_FLAT_PLAIN,
            i_u: 0,
            nlink: 1,
            extended: false,
            mtime: BUILD_TIME,
            xattrs: Vec::new(),
            tail: Vec::new(),
        }
    }

    /// A directory holding `entries` inline (`.` and `..` not added).
    fn dir(entries: &[(&[u8], u64, u8)]) -> Spec {
        let data = dirents(entries);
        Spec {
            size: data.len() as u64,
            layout: LAYOUT_FLAT_INLINE,
            nlink: 2,
            tail: data,
            ..spec(S_IFDIR | 0o755)
        }
    }

    fn inline_file(content: &[u8]) -> Spec {
        Spec {
            size: content.len() as u64,
            layout: LAYOUT_FLAT_INLINE,
            tail: content.to_vec(),
            ..spec(S_IFREG | 0o644)
        }
    }

    fn symlink(target: &[u8]) -> Spec {
        Spec {
            size: target.len() as u64,
            layout: LAYOUT_FLAT_INLINE,
            tail: target.to_vec(),
            ..spec(S_IFLNK | 0o777)
        }
    }

    fn dirents(entries: &[(&[u8], u64, u8)]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut nameoff = entries.len() * DIRENT_SIZE;
        for &(name, nid, ft) in entries {
            out.extend_from_slice(&nid.to_le_bytes());
            out.extend_from_slice(&(nameoff as u16).to_le_bytes());
            out.extend_from_slice(&[ft, 0]);
            nameoff += name.len();
        }
        for &(name, _, _) in entries {
            out.extend_from_slice(name);
        }
        out
    }

    /// An xattr body: header (filter 0), shared ids, inline entries.
    fn xattr_body(shared: &[u32], inline: &[(u8, &[u8], &[u8])]) -> Vec<u8> {
        let mut out = vec![0u8; XATTR_IBODY_HEADER_SIZE];
        out[4] = shared.len() as u8;
        for id in shared {
            out.extend_from_slice(&id.to_le_bytes());
        }
        for e in inline {
            out.extend_from_slice(&xattr_entry(*e));
        }
        out
    }

    fn xattr_entry((index, suffix, value): (u8, &[u8], &[u8])) -> Vec<u8> {
        let mut out = vec![suffix.len() as u8, index];
        out.extend_from_slice(&(value.len() as u16).to_le_bytes());
        out.extend_from_slice(suffix);
        out.extend_from_slice(value);
        out.resize(out.len().next_multiple_of(4), 0);
        out
    }

    fn encode(s: &Spec) -> Vec<u8> {
        let isize = if s.extended {
            INODE_EXTENDED_SIZE
        } else {
            INODE_COMPACT_SIZE
        };
        let mut b = vec![0u8; isize];
        put_u16(&mut b, ino::FORMAT, (s.layout << 1) | u16::from(s.extended));
        let icount = if s.xattrs.is_empty() {
            0
        } else {
            (s.xattrs.len() - XATTR_IBODY_HEADER_SIZE) / 4 + 1
        };
        put_u16(&mut b, ino::XATTR_ICOUNT, icount as u16);
        put_u16(&mut b, ino::MODE, s.mode as u16);
        put_u32(&mut b, ino::U, s.i_u);
        if s.extended {
            put_u64(&mut b, ino::SIZE, s.size);
            put_u32(&mut b, ino::E_NLINK, s.nlink);
            put_u64(&mut b, ino::E_MTIME, s.mtime as u64);
        } else {
            put_u32(&mut b, ino::SIZE, s.size as u32);
            put_u16(&mut b, ino::C_NLINK, s.nlink as u16);
        }
        b.extend_from_slice(&s.xattrs);
        b.extend_from_slice(&s.tail);
        b
    }

    /// A whole image: header, superblock, the inodes at their nids (meta
    /// block 0), extra bytes at given offsets, padded to whole blocks.
    fn image(version: u32, inodes: &BTreeMap<u64, Spec>, extra: &[(usize, Vec<u8>)]) -> Vec<u8> {
        let mut b = vec![0u8; 4096];
        let put = |b: &mut Vec<u8>, off: usize, data: &[u8]| {
            if b.len() < off + data.len() {
                b.resize(off + data.len(), 0);
            }
            b[off..off + data.len()].copy_from_slice(data);
        };
        put_u32(&mut b, format::header::MAGIC, COMPOSEFS_MAGIC);
        put_u32(&mut b, format::header::VERSION, COMPOSEFS_HEADER_VERSION);
        put_u32(&mut b, format::header::COMPOSEFS_VERSION, version);
        let s = EROFS_SUPER_OFFSET;
        put_u32(&mut b, s + sb::MAGIC, EROFS_SUPER_MAGIC);
        put_u32(
            &mut b,
            s + sb::FEATURE_COMPAT,
            format::FEATURE_COMPAT_MTIME | FEATURE_COMPAT_XATTR_FILTER,
        );
        b[s + sb::BLKSZBITS] = BLOCK_BITS as u8;
        put_u16(&mut b, s + sb::ROOT_NID, ROOT_NID as u16);
        put_u64(&mut b, s + sb::INOS, inodes.len() as u64);
        put_u64(&mut b, s + sb::BUILD_TIME, BUILD_TIME as u64);
        put_u32(&mut b, s + sb::BUILD_TIME_NSEC, 5);
        put_u32(&mut b, s + sb::XATTR_BLKADDR, 1);
        for (&nid, spec) in inodes {
            put(&mut b, nid as usize * 32, &encode(spec));
        }
        for (off, data) in extra {
            put(&mut b, *off, data);
        }
        b.resize(b.len().next_multiple_of(4096), 0);
        let blocks = (b.len() / 4096) as u32;
        put_u32(&mut b, s + sb::BLOCKS, blocks);
        b
    }

    /// / with a/, f (also /a/h), l -> target, and x, a root whiteout.
    fn basic() -> BTreeMap<u64, Spec> {
        let mut m = BTreeMap::new();
        m.insert(
            40,
            dir(&[
                (b".", 40, FT_DIR),
                (b"..", 40, FT_DIR),
                (b"a", A, FT_DIR),
                (b"f", F, FT_REG_FILE),
                (b"l", L, FT_SYMLINK),
                (b"x", X, FT_CHRDEV),
            ]),
        );
        m.insert(
            A,
            dir(&[(b".", A, FT_DIR), (b"..", 40, FT_DIR), (b"h", F, FT_REG_FILE)]),
        );
        m.insert(
            F,
            Spec {
                nlink: 2,
                extended: true,
                mtime: 7,
                ..inline_file(b"hello")
            },
        );
        m.insert(L, symlink(b"target"));
        m.insert(X, spec(S_IFCHR | 0o644));
        m
    }

    fn read(img: &[u8]) -> Result<Tree> {
        read_image(img).map(|(t, _)| t)
    }

    /// The corrupt-image message, or a panic if the image reads.
    fn corrupt(img: &[u8]) -> String {
        match read_image(img) {
            Ok(_) => panic!("image read despite its damage"),
            Err(e) => e.to_string(),
        }
    }

    fn entry<'t>(t: &'t Tree, dir: &[u8], name: &[u8]) -> &'t Entry {
        t.inode(t.lookup_path(dir).unwrap()).entry(name).unwrap()
    }

    #[test]
    fn reads_a_small_image() {
        let img = image(1, &basic(), &[]);
        let (t, info) = read_image(&img).unwrap();
        assert_eq!(info.version, 1);
        assert_eq!(info.build_time, Timespec { sec: 1000, nsec: 5 });
        assert_eq!(info.blocks, 1);
        let names: Vec<&[u8]> = t.root().entries.iter().map(|e| e.name.as_slice()).collect();
        assert_eq!(names, [&b"a"[..], b"f", b"l"], "dots and the root whiteout are dropped");
        assert_eq!(t.len(), 4);
        let f = entry(&t, b"/", b"f");
        assert!(!f.hardlink);
        let h = entry(&t, b"/a", b"h");
        assert!(h.hardlink && h.inode == f.inode);
        let file = t.inode(f.inode);
        assert_eq!(file.content.as_deref(), Some(&b"hello"[..]));
        assert_eq!((file.size, file.nlink, file.mtime.sec), (5, 2, 7));
        let l = t.inode(entry(&t, b"/", b"l").inode);
        assert_eq!(l.payload.as_deref(), Some(&b"target"[..]));
        assert_eq!(l.size, 6);
        assert_eq!(
            l.mtime,
            Timespec { sec: 1000, nsec: 5 },
            "compact inodes take the build time"
        );
        assert!(t.root().is_dir() && t.root().xattrs.is_empty());
        assert_eq!(image_version(&img).unwrap(), 1);
    }

    #[test]
    fn header_and_superblock_checks() {
        let good = image(0, &basic(), &[]);
        let mut bad = good.clone();
        bad[0] ^= 1;
        assert!(matches!(read_image(&bad), Err(ImageError::NotComposefs(_))));
        let mut bad = good.clone();
        put_u32(&mut bad, format::header::COMPOSEFS_VERSION, 2);
        assert!(matches!(read_image(&bad), Err(ImageError::Unsupported(_))));
        assert!(image_version(&bad).is_err());
        let mut bad = good.clone();
        bad[EROFS_SUPER_OFFSET + sb::BLKSZBITS] = 13;
        assert!(matches!(read_image(&bad), Err(ImageError::Unsupported(_))));
        let mut bad = good.clone();
        put_u32(&mut bad, EROFS_SUPER_OFFSET + sb::MAGIC, 0);
        assert!(corrupt(&bad).contains("superblock magic"));
        let mut bad = good.clone();
        put_u32(&mut bad, EROFS_SUPER_OFFSET + sb::BLOCKS, 2);
        assert!(corrupt(&bad).contains("truncated"));
        let mut bad = good.clone();
        put_u16(&mut bad, EROFS_SUPER_OFFSET + sb::ROOT_NID, F as u16);
        assert!(corrupt(&bad).contains("not a directory"));
        let mut bad = good;
        put_u16(&mut bad, EROFS_SUPER_OFFSET + sb::ROOT_NID, 200);
        assert!(corrupt(&bad).contains("nid 200"));
    }

    #[test]
    fn cycles_and_directory_hardlinks_are_corrupt() {
        let mut m = basic();
        m.insert(A, dir(&[(b".", A, FT_DIR), (b"..", 40, FT_DIR), (b"up", 40, FT_DIR)]));
        assert!(corrupt(&image(0, &m, &[])).contains("cycle"));
        let mut m = basic();
        m.insert(A, dir(&[(b".", A, FT_DIR), (b"..", 40, FT_DIR), (b"self", A, FT_DIR)]));
        assert!(corrupt(&image(0, &m, &[])).contains(&format!("directory nid {A}")));
        let mut m = basic();
        m.insert(40, dir(&[(b"a", A, FT_DIR), (b"b", A, FT_DIR)]));
        assert!(corrupt(&image(0, &m, &[])).contains("already has an entry"));
    }

    #[test]
    fn bad_names_are_corrupt() {
        let with = |entries: &[(&[u8], u64, u8)]| {
            let mut m = basic();
            m.insert(40, dir(entries));
            corrupt(&image(0, &m, &[]))
        };
        let e = with(&[(b"f", F, FT_REG_FILE), (b"a", A, FT_DIR)]);
        assert!(e.contains("sorted order") && e.contains("\"a\" after \"f\""), "{e}");
        assert!(with(&[(b"f", F, FT_REG_FILE), (b"f", L, FT_SYMLINK)]).contains("duplicate name \"f\""));
        assert!(with(&[(b"a/b", F, FT_REG_FILE)]).contains("'/'"));
        assert!(with(&[(b"a\0b", F, FT_REG_FILE), (b"c", L, FT_SYMLINK)]).contains("NUL"));
        assert!(with(&[(b"", F, FT_REG_FILE), (b"c", L, FT_SYMLINK)]).contains("empty name"));
        assert!(with(&[(&[b'n'; 256], F, FT_REG_FILE)]).contains("256-byte name"));
        // The file type in the dirent must be the inode's.
        assert!(with(&[(b"f", F, FT_SYMLINK)]).contains("file type"));
        // A name offset outside the block.
        let mut m = basic();
        let mut d = dir(&[(b"a", A, FT_DIR), (b"f", F, FT_REG_FILE)]);
        put_u16(&mut d.tail, DIRENT_SIZE + 8, 200);
        m.insert(40, d);
        assert!(corrupt(&image(0, &m, &[])).contains("name offsets"));
    }

    #[test]
    fn a_nul_padded_last_name_ends_at_the_padding() {
        let mut m = basic();
        let mut d = dir(&[(b"a", A, FT_DIR), (b"f", F, FT_REG_FILE)]);
        d.tail.extend_from_slice(&[0, 0, 0]);
        d.size += 3;
        m.insert(40, d);
        let t = read(&image(0, &m, &[])).unwrap();
        assert!(t.root().entry(b"f").is_some());
    }

    #[test]
    fn directories_span_blocks_and_tails() {
        // 300 entries: a first block of 4096 bytes at block 2, and the
        // rest inline.
        let names: Vec<Vec<u8>> = (0..300).map(|i| format!("file-{i:04}").into_bytes()).collect();
        let mut blocks = Vec::new();
        let mut cur: Vec<(&[u8], u64, u8)> = vec![(b".", 40, FT_DIR), (b"..", 40, FT_DIR)];
        let mut used = 2 * DIRENT_SIZE + 3;
        for n in &names {
            if used + DIRENT_SIZE + n.len() > 4096 {
                blocks.push(std::mem::take(&mut cur));
                used = 0;
            }
            cur.push((n, 120, FT_REG_FILE));
            used += DIRENT_SIZE + n.len();
        }
        assert_eq!(blocks.len(), 1);
        let mut block = dirents(&blocks[0]);
        block.resize(4096, 0);
        // The root's tail runs from 1312 to about 3600: the file goes after.
        let mut m = BTreeMap::new();
        let mut root = dir(&cur);
        root.size += 4096;
        root.i_u = 2;
        m.insert(40, root);
        m.insert(
            120,
            Spec {
                nlink: 300,
                ..inline_file(b"x")
            },
        );
        let t = read(&image(0, &m, &[(2 * 4096, block)])).unwrap();
        assert_eq!(t.root().entries.len(), 300);
        assert!(!t.root().entries[0].hardlink && t.root().entries[1..].iter().all(|e| e.hardlink));
        // The same with the tail out of line too (plain layout).
        let mut m2 = m.clone();
        let mut root = m2[&40].clone();
        let tail = std::mem::take(&mut root.tail);
        root.layout = LAYOUT_FLAT_PLAIN;
        m2.insert(40, root);
        let mut block = dirents(&blocks[0]);
        block.resize(4096, 0);
        block.extend_from_slice(&tail);
        let t2 = read(&image(0, &m2, &[(2 * 4096, block)])).unwrap();
        assert_eq!(t2, t);
        // An inline tail may not cross a block boundary.
        let mut m3 = m.clone();
        let mut big = Spec {
            nlink: 2,
            ..inline_file(&[b'y'; 4000])
        };
        big.tail.truncate(4000);
        m3.insert(100, big);
        let mut root = dir(&[(b"big", 100, FT_REG_FILE)]);
        root.nlink = 2;
        m3.insert(40, root);
        assert!(corrupt(&image(0, &m3, &[])).contains("crosses a block boundary"));
    }

    #[test]
    fn sizes_are_bounded() {
        let with = |s: Spec| {
            let mut m = basic();
            m.insert(F, Spec { nlink: 2, ..s });
            read(&image(0, &m, &[]))
        };
        // Content past 5000 bytes, or a huge size, is refused before any
        // allocation.
        let big = Spec {
            size: 6000,
            layout: LAYOUT_FLAT_PLAIN,
            i_u: 1,
            ..spec(S_IFREG | 0o644)
        };
        assert!(with(big.clone()).unwrap_err().to_string().contains("6000"));
        let huge = Spec {
            size: 1 << 60,
            extended: true,
            ..big.clone()
        };
        assert!(with(huge.clone()).is_err());
        assert!(with(Spec {
            mode: S_IFDIR | 0o755,
            ..huge.clone()
        })
        .is_err());
        let long_link = Spec {
            mode: S_IFLNK | 0o777,
            size: 5000,
            ..big.clone()
        };
        assert!(with(long_link)
            .unwrap_err()
            .to_string()
            .contains("symlink target of 5000"));
        assert!(with(Spec {
            size: 0,
            ..symlink(b"")
        })
        .unwrap_err()
        .to_string()
        .contains("empty target"));
        // Data past the end of the image.
        assert!(with(Spec {
            size: 10,
            ..big.clone()
        })
        .unwrap_err()
        .to_string()
        .contains("runs past the end"));
        // A huge external file is just a number.
        let external = Spec {
            layout: LAYOUT_CHUNK_BASED,
            i_u: 31,
            ..huge
        };
        let t = with(external.clone()).unwrap();
        let f = t.inode(t.root().entry(b"f").unwrap().inode);
        assert!(f.is_external() && f.size == 1 << 60 && f.content.is_none());
        assert!(with(Spec { i_u: 0x40, ..external })
            .unwrap_err()
            .to_string()
            .contains("chunk format"));
        // Unknown layouts and format bits.
        assert!(matches!(
            with(Spec {
                layout: 1,
                ..big.clone()
            }),
            Err(ImageError::Unsupported(_))
        ));
        assert!(with(Spec {
            layout: 5,
            ..big.clone()
        })
        .is_err());
        assert!(with(Spec { mode: 0o644, ..big })
            .unwrap_err()
            .to_string()
            .contains("unknown file type"));
    }

    #[test]
    fn xattrs_are_decoded_sorted_and_checked() {
        let shared = xattr_entry((XATTR_INDEX_SECURITY, b"selinux", b"label"));
        let with = |body: Vec<u8>| {
            let mut m = basic();
            m.insert(
                L,
                Spec {
                    xattrs: body,
                    ..symlink(b"target")
                },
            );
            read(&image(0, &m, &[(4096, shared.clone())])).map(|t| t.inode(t.root().entry(b"l").unwrap().inode).clone())
        };
        use format::{XATTR_INDEX_SECURITY, XATTR_INDEX_TRUSTED, XATTR_INDEX_USER};
        let l = with(xattr_body(
            &[0],
            &[
                (XATTR_INDEX_USER, b"b", b"2"),
                (XATTR_INDEX_USER, b"a", b"1"),
                (0, b"other.x", b"3"),
            ],
        ))
        .unwrap();
        let keys: Vec<&[u8]> = l.xattrs.iter().map(|x| x.key.as_slice()).collect();
        assert_eq!(keys, [&b"other.x"[..], b"security.selinux", b"user.a", b"user.b"]);
        // An overlay name of 255 bytes is stored escaped, 8 bytes longer
        // (found by fuzzing: the builder wrote what the reader refused).
        let long = [&b"overlay.overlay."[..], &[b'x'; 239]].concat();
        let escaped = with(xattr_body(&[], &[(XATTR_INDEX_TRUSTED, &long, b"v")])).unwrap();
        assert_eq!(escaped.xattrs.len(), 1);
        assert_eq!(escaped.xattrs[0].key.len(), 255);
        assert!(escaped.xattrs[0].key.starts_with(b"trusted.overlay.xxx"));
        assert_eq!(l.xattr(b"security.selinux"), Some(&b"label"[..]));
        assert_eq!(
            l.payload.as_deref(),
            Some(&b"target"[..]),
            "the tail follows the xattrs"
        );

        let e = with(xattr_body(&[], &[(7, b"x", b"")])).unwrap_err().to_string();
        assert!(e.contains("unknown name index 7"), "{e}");
        let e = with(xattr_body(
            &[],
            &[(XATTR_INDEX_USER, b"a", b""), (XATTR_INDEX_USER, b"a", b"")],
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("appears twice"), "{e}");
        assert!(with(xattr_body(&[], &[(0, b"", b"")]))
            .unwrap_err()
            .to_string()
            .contains("empty name"));
        assert!(with(xattr_body(&[], &[(XATTR_INDEX_USER, b"a\0", b"")])).is_err());
        assert!(with(xattr_body(&[100_000], &[]))
            .unwrap_err()
            .to_string()
            .contains("shared xattr 100000"));
        let mut body = xattr_body(&[], &[(XATTR_INDEX_USER, b"a", b"1")]);
        body[XATTR_IBODY_HEADER_SIZE + 2] = 200; // value size past the body
        assert!(with(body)
            .unwrap_err()
            .to_string()
            .contains("run past the end of their area"));
        let mut body = xattr_body(&[], &[]);
        body[4] = 3; // shared ids that are not there
        assert!(with(body).unwrap_err().to_string().contains("do not fit"));
        // The name filter must not hide a present xattr.
        let mut body = xattr_body(&[], &[(XATTR_INDEX_USER, b"a", b"1")]);
        let bit = format::xattr_filter_bit(XATTR_INDEX_USER, b"a");
        body[..4].copy_from_slice(&(1u32 << bit).to_le_bytes());
        assert!(with(body).unwrap_err().to_string().contains("filter"));
        // Overlay xattrs: escaped ones come back, the builder's own go.
        let l = with(xattr_body(
            &[],
            &[
                (XATTR_INDEX_TRUSTED, b"overlay.overlay.foo", b"1"),
                (XATTR_INDEX_TRUSTED, b"overlay.opaque", b"y"),
                (XATTR_INDEX_TRUSTED, b"overlay.redirect", b"/ab/cd"),
            ],
        ))
        .unwrap();
        assert_eq!(l.xattrs.len(), 1);
        assert_eq!(l.xattr(b"trusted.overlay.foo"), Some(&b"1"[..]));
        assert_eq!(
            l.payload.as_deref(),
            Some(&b"target"[..]),
            "redirects only matter on regular files"
        );
    }

    #[test]
    fn external_files_get_payload_and_digest() {
        use format::XATTR_INDEX_TRUSTED;
        let digest = [0xabu8; 32];
        let mut metacopy = vec![0, 36, 0, 1];
        metacopy.extend_from_slice(&digest);
        let mut m = basic();
        m.insert(
            F,
            Spec {
                size: 100_000,
                layout: LAYOUT_CHUNK_BASED,
                nlink: 2,
                xattrs: xattr_body(
                    &[],
                    &[
                        (XATTR_INDEX_TRUSTED, b"overlay.metacopy", &metacopy),
                        (XATTR_INDEX_TRUSTED, b"overlay.redirect", b"/ab/cdef"),
                    ],
                ),
                ..spec(S_IFREG | 0o644)
            },
        );
        let t = read(&image(0, &m, &[])).unwrap();
        let f = t.inode(t.root().entry(b"f").unwrap().inode);
        assert_eq!(f.payload.as_deref(), Some(&b"ab/cdef"[..]));
        assert_eq!(f.digest, Some(digest));
        assert!(f.xattrs.is_empty() && f.is_external());
    }

    #[test]
    fn whiteouts_come_back_and_their_markers_go() {
        use format::{XATTR_INDEX_TRUSTED, XATTR_INDEX_USER};
        let marked = |version: u32| {
            let mut m = basic();
            let mut root = m[&40].clone();
            root.xattrs = xattr_body(
                &[],
                &[
                    (XATTR_INDEX_TRUSTED, b"overlay.opaque", b"y"),
                    (XATTR_INDEX_TRUSTED, b"overlay.overlay.opaque", b"x"),
                    (XATTR_INDEX_TRUSTED, b"overlay.overlay.whiteouts", b""),
                    (XATTR_INDEX_USER, b"keep", b"1"),
                    (XATTR_INDEX_USER, b"overlay.opaque", b"x"),
                    (XATTR_INDEX_USER, b"overlay.whiteouts", b""),
                ],
            );
            m.insert(40, root);
            let mut dir_a = m[&A].clone();
            dir_a.xattrs = xattr_body(&[], &[(XATTR_INDEX_USER, b"overlay.whiteouts", b"")]);
            m.insert(A, dir_a);
            m.insert(
                F,
                Spec {
                    nlink: 2,
                    xattrs: xattr_body(
                        &[],
                        &[
                            (XATTR_INDEX_TRUSTED, b"overlay.overlay.whiteout", b""),
                            (XATTR_INDEX_USER, b"overlay.whiteout", b""),
                            (XATTR_INDEX_USER, b"z", b""),
                        ],
                    ),
                    ..spec(S_IFREG | 0o600)
                },
            );
            read(&image(version, &m, &[])).unwrap()
        };
        let t = marked(1);
        let f = t.inode(t.root().entry(b"f").unwrap().inode);
        assert!(f.is_whiteout() && f.mode == S_IFCHR | 0o600 && f.size == 0 && f.nlink == 2);
        assert_eq!(f.xattrs.len(), 1);
        let keys: Vec<&[u8]> = t.root().xattrs.iter().map(|x| x.key.as_slice()).collect();
        assert_eq!(keys, [&b"user.keep"[..]]);
        // /a holds the whiteout only as a hardlink: its marker stays.
        assert!(entry(&t, b"/a", b"h").hardlink);
        assert_eq!(t.inode(entry(&t, b"/", b"a").inode).xattrs.len(), 1);
        // A file with contents is no whiteout of the builder's: it keeps
        // the (unescaped) marker it had in the source.
        let mut m = basic();
        m.insert(
            F,
            Spec {
                size: 10,
                layout: LAYOUT_CHUNK_BASED,
                nlink: 2,
                xattrs: xattr_body(&[], &[(XATTR_INDEX_TRUSTED, b"overlay.overlay.whiteout", b"")]),
                ..spec(S_IFREG | 0o600)
            },
        );
        let t2 = read(&image(1, &m, &[])).unwrap();
        let f = t2.inode(t2.root().entry(b"f").unwrap().inode);
        assert!(f.is_reg() && f.size == 10 && f.xattr(b"trusted.overlay.whiteout") == Some(&b""[..]));
        // Before version 1 the builder adds no opaque markers: any are the
        // source's own.
        let t = marked(0);
        let keys: Vec<&[u8]> = t.root().xattrs.iter().map(|x| x.key.as_slice()).collect();
        assert_eq!(
            keys,
            [&b"trusted.overlay.opaque"[..], b"user.keep", b"user.overlay.opaque"]
        );
    }

    #[test]
    fn primaries_follow_the_nid_order() {
        // nids A < F < L < X. / : "0" -> L, "a" (A), "b" -> X; /a: "x" -> L,
        // "y" -> F. The walk meets 0, a, b, a/x, a/y. At "0" the smallest
        // unplaced nid is A: "0" waits. "a" places A. At "b" F is the
        // smallest: "b" waits, and so does a/x. a/y places F. L and X were
        // never the smallest when met: their first entries, "0" and "b",
        // become primary.
        let mut m = basic();
        m.insert(
            40,
            dir(&[(b"0", L, FT_REG_FILE), (b"a", A, FT_DIR), (b"b", X, FT_REG_FILE)]),
        );
        m.insert(A, dir(&[(b"x", L, FT_REG_FILE), (b"y", F, FT_REG_FILE)]));
        m.insert(F, inline_file(b"y"));
        m.insert(
            L,
            Spec {
                nlink: 2,
                ..inline_file(b"x")
            },
        );
        m.insert(X, inline_file(b"b"));
        let t = read(&image(0, &m, &[])).unwrap();
        assert!(!entry(&t, b"/", b"0").hardlink && entry(&t, b"/a", b"x").hardlink);
        assert!(!entry(&t, b"/", b"b").hardlink && !entry(&t, b"/a", b"y").hardlink);

        // The builder's own order: / : "0" -> L, "a" (A); /a: "x" -> L.
        // The walk meets "0" while A is still unplaced, so the primary is
        // /a/x, which the builder numbered after /a.
        let mut m = basic();
        m.insert(40, dir(&[(b"0", L, FT_REG_FILE), (b"a", A, FT_DIR)]));
        m.insert(A, dir(&[(b"x", L, FT_REG_FILE)]));
        m.insert(
            L,
            Spec {
                nlink: 2,
                ..inline_file(b"x")
            },
        );
        m.remove(&F);
        m.remove(&X);
        let t = read(&image(0, &m, &[])).unwrap();
        assert!(entry(&t, b"/", b"0").hardlink && !entry(&t, b"/a", b"x").hardlink);
        // Inode order in the arena: root, then by nid.
        assert_eq!(t.inodes.len(), 3);
        assert!(t.inodes[1].is_dir() && t.inodes[2].is_reg());
    }

    #[test]
    fn special_files_extended_for_their_size_stay_extended() {
        // The builder makes a fifo with a source size over 32 bits an
        // extended inode but stores size 0 (fuzz finding, parse_dump).
        let with = |fifo: Spec| {
            let extended = fifo.extended;
            let mut m = basic();
            m.insert(X, fifo);
            let mut root = dir(&[(b"a", A, FT_DIR), (b"x", X, format::FT_FIFO)]);
            root.nlink = 3;
            m.insert(40, root);
            let mut img = image(0, &m, &[]);
            if extended {
                // The build time's nanoseconds, as the builder stores them.
                put_u32(&mut img, X as usize * 32 + ino::E_MTIME_NSEC, 5);
            }
            let t = read(&img).unwrap();
            t.inode(t.root().entry(b"x").unwrap().inode).size
        };
        let fifo = spec(crate::tree::S_IFIFO | 0o644);
        assert_eq!(with(fifo.clone()), 0);
        let extended = Spec {
            extended: true,
            ..fifo.clone()
        };
        assert_eq!(with(extended.clone()), 1 << 32);
        // Extended for another reason, or with a size: as stored.
        assert_eq!(
            with(Spec {
                mtime: 7,
                ..extended.clone()
            }),
            0
        );
        assert_eq!(
            with(Spec {
                nlink: 70_000,
                ..extended.clone()
            }),
            0
        );
        assert_eq!(with(Spec { size: 5, ..extended }), 5);
    }

    #[test]
    fn devices_keep_rdev() {
        let mut m = basic();
        m.insert(
            X,
            Spec {
                i_u: 0x0801,
                ..spec(S_IFBLK | 0o600)
            },
        );
        let mut root = dir(&[(b"a", A, FT_DIR), (b"dev", X, format::FT_BLKDEV)]);
        root.nlink = 3;
        m.insert(40, root);
        let t = read(&image(0, &m, &[])).unwrap();
        let d = t.inode(t.root().entry(b"dev").unwrap().inode);
        assert_eq!(d.rdev, 0x0801);
        let dir_a = t.inode(t.root().entry(b"a").unwrap().inode);
        assert_eq!(dir_a.rdev, 0, "rdev only for devices");
    }

    #[test]
    fn the_budget_bounds_what_an_image_expands_to() {
        // 40 files, each 4000 bytes of inline content from the same block:
        // 1280 bytes of inodes decode to 160000 bytes of content.
        let mut m = BTreeMap::new();
        let names: Vec<Vec<u8>> = (0..40).map(|i| format!("f{i:02}").into_bytes()).collect();
        let entries: Vec<(&[u8], u64, u8)> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_slice(), 100 + i as u64, FT_REG_FILE))
            .collect();
        m.insert(40, dir(&entries));
        for i in 0..40 {
            let file = Spec {
                size: 4000,
                i_u: 2,
                ..spec(S_IFREG | 0o644)
            };
            m.insert(100 + i, file);
        }
        let img = image(0, &m, &[(2 * 4096, vec![7u8; 4000])]);
        let (t, _) = read_image_within(&img, 1 << 20).unwrap();
        assert_eq!(t.len(), 41);
        let err = read_image_within(&img, 100_000).unwrap_err();
        assert!(matches!(err, ImageError::TooLarge(_)), "{err}");
        assert!(err.to_string().contains("100000"), "{err}");
    }

    #[test]
    fn nesting_is_bounded() {
        // A chain of directories /d/d/d/..., one every 64 bytes.
        let chain = |depth: u64| {
            let mut m = BTreeMap::new();
            for k in 0..=depth {
                let nid = ROOT_NID + 2 * k;
                let entries: &[(&[u8], u64, u8)] = if k < depth { &[(b"d", nid + 2, FT_DIR)] } else { &[] };
                m.insert(nid, dir(entries));
            }
            image(0, &m, &[])
        };
        let t = read(&chain(MAX_DEPTH as u64)).unwrap();
        assert_eq!(t.len(), MAX_DEPTH + 1);
        let path = vec![&b"d"[..]; MAX_DEPTH].join(&b'/');
        assert!(t.lookup_path(&path).is_some());
        // Recursive walks manage that depth (on a test thread's small stack).
        let mut n = 0;
        t.walk(|_, _, _| n += 1);
        assert_eq!(n, MAX_DEPTH + 1);
        let e = read(&chain(MAX_DEPTH as u64 + 1)).unwrap_err();
        assert!(matches!(e, ImageError::Unsupported(_)), "{e}");
    }

    /// Fixed-seed generator for the damage tests.
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 33
        }
    }

    #[test]
    fn damaged_images_never_panic() {
        use format::{XATTR_INDEX_TRUSTED, XATTR_INDEX_USER};
        let mut m = basic();
        let mut root = m[&40].clone();
        root.xattrs = xattr_body(
            &[0],
            &[
                (XATTR_INDEX_USER, b"a", b"1"),
                (XATTR_INDEX_TRUSTED, b"overlay.opaque", b"y"),
            ],
        );
        m.insert(40, root);
        let img = image(1, &m, &[(4096, xattr_entry((XATTR_INDEX_USER, b"shared", b"v")))]);
        assert!(read(&img).is_ok());
        for len in 0..img.len() {
            assert!(read(&img[..len]).is_err(), "{len}-byte prefix");
        }
        let mut rng = Lcg(42);
        let mut buf = img.clone();
        let mut refused = 0;
        for n in 0..3000 {
            // Most flips in the metadata (the first 2600 bytes).
            let pos = rng.next() as usize % if n % 8 == 0 { buf.len() } else { 2600 };
            let old = buf[pos];
            buf[pos] = old ^ (1 + (rng.next() % 255) as u8);
            refused += usize::from(read(&buf).is_err());
            buf[pos] = old;
        }
        assert!(refused > 100, "only {refused} damaged images refused");
    }
}
