//! An image served straight from its bytes: the tree [`read_image`] would
//! give, read on demand, with a few small side tables instead of a whole
//! in-memory tree (a FUSE server holding a 63 MB image of 642k entries
//! needs the image and about 10 bytes per inode, not 340).
//!
//! [`ImageView::open`] walks the whole image once with the very checks of
//! [`read_image`] (the same reader, keeping nothing but what the tables
//! need), so an image one refuses the other refuses too. Inode ids,
//! entries, hardlinks and xattrs are those of the tree [`read_image`]
//! returns: id 0 is the root, the other inodes follow in nid order; an
//! entry is a hardlink unless it is its inode's primary entry; directories
//! holding whiteouts lose the builder's markers. Every later read goes
//! through the same checked accessors and gives an [`ImageError`] rather
//! than a panic, should the bytes ever disagree with the walk.
//!
//! [`read_image`]: super::read_image

use super::format::{overlay, BLOCK_SIZE, DIRENT_SIZE, LAYOUT_CHUNK_BASED, XATTR_PREFIXES};
use super::reader::{
    choose_primaries, decode_budget, flat_data, get, le16, le64, read_info, tree_order, unmark, ImageError, ImageInfo,
    Reader, UNESCAPED_OPAQUE, UNESCAPED_WHITEOUT, UNESCAPED_WHITEOUTS,
};
use crate::flat::Meta;
use crate::tree::{FileType, Inode, InodeId, ROOT, S_IFCHR, S_IFMT};
use std::collections::{HashMap, HashSet};

type Result<T> = std::result::Result<T, ImageError>;

/// Which nids are inodes of the tree (the root aside), and their rank.
#[derive(Default)]
struct NidRank {
    words: Vec<u64>,
    /// Set bits in the words before each word.
    before: Vec<u32>,
}

impl NidRank {
    /// From nids in ascending order.
    fn new(nids: &[u64]) -> NidRank {
        let words = nids.last().map_or(0, |&n| (n / 64 + 1) as usize);
        let mut r = NidRank {
            words: vec![0; words],
            before: vec![0; words],
        };
        for &n in nids {
            r.words[(n / 64) as usize] |= 1 << (n % 64);
        }
        let mut total = 0u32;
        for (w, b) in r.words.iter().zip(r.before.iter_mut()) {
            *b = total;
            total += w.count_ones();
        }
        r
    }

    fn rank(&self, nid: u64) -> Option<u32> {
        let w = usize::try_from(nid / 64).ok()?;
        let word = *self.words.get(w)?;
        let bit = 1u64 << (nid % 64);
        (word & bit != 0).then(|| self.before[w] + (word & (bit - 1)).count_ones())
    }
}

/// An image and the tables that serve it.
pub struct ImageView {
    data: Box<[u8]>,
    info: ImageInfo,
    /// nid of each inode, by id.
    nids: Vec<u64>,
    rank: NidRank,
    /// Parent of each directory, by id (the root is its own).
    parent: Vec<InodeId>,
    /// Directories holding a whiteout as a primary entry.
    marked: HashSet<InodeId>,
    /// Inodes with several entries: the directory and name of the primary.
    primaries: HashMap<InodeId, (InodeId, Box<[u8]>)>,
    /// Inline contents longer than a block (apart in the image), joined.
    long_contents: HashMap<InodeId, Box<[u8]>>,
    /// Every xattr name the tree holds, so that xattrs borrow their names.
    keys: HashSet<Box<[u8]>>,
    has_selinux: bool,
}

/// An inode's attributes and what a regular file or symlink holds, as the
/// tree has them (borrowed from the image).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node<'a> {
    pub attr: Meta,
    /// Symlink target, or the path of a regular file's object.
    pub payload: Option<&'a [u8]>,
    /// Inline contents of a small regular file.
    pub content: Option<&'a [u8]>,
    /// fs-verity digest of a regular file's contents.
    pub digest: Option<[u8; 32]>,
}

/// One entry of a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirEntry<'a> {
    pub name: &'a [u8],
    pub inode: InodeId,
    /// A secondary link to an inode whose primary entry is elsewhere.
    pub hardlink: bool,
}

/// A place in a directory's listing: before the entry with index `index`
/// (counted as the tree counts its entries), at a dirent of a block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirPos {
    block: u32,
    slot: u32,
    /// Index of the next entry.
    pub index: u64,
}

/// The entries of a directory, from some position on.
pub struct Entries<'a> {
    dir: Dir<'a>,
    block: Option<Block<'a>>,
    pos: DirPos,
}

impl Entries<'_> {
    /// Where the listing stands: before the entry `next` will give.
    pub fn pos(&self) -> DirPos {
        self.pos
    }
}

impl<'a> Iterator for Entries<'a> {
    type Item = DirEntry<'a>;

    fn next(&mut self) -> Option<DirEntry<'a>> {
        loop {
            let b = match self.block {
                Some(b) => b,
                None => *self.block.insert(self.dir.block(self.pos.block as usize)?),
            };
            if self.pos.slot as usize >= b.count {
                self.pos.block += 1;
                self.pos.slot = 0;
                self.block = None;
                continue;
            }
            let (name, nid) = b.get(self.pos.slot as usize)?;
            self.pos.slot += 1;
            if let Some(e) = self.dir.make(name, nid) {
                self.pos.index += 1;
                return Some(e);
            }
        }
    }
}

/// A directory of an image.
#[derive(Clone, Copy)]
pub struct Dir<'a> {
    view: &'a ImageView,
    id: InodeId,
    /// Whole blocks, then the inline tail.
    blocks: &'a [u8],
    tail: &'a [u8],
}

/// The dirents of one directory block.
#[derive(Clone, Copy)]
struct Block<'a> {
    b: &'a [u8],
    count: usize,
}

impl<'a> Block<'a> {
    fn new(b: &'a [u8]) -> Option<Block<'a>> {
        let first = get(b, 8, 2)?;
        let names_start = usize::from(u16::from_le_bytes([first[0], first[1]]));
        (names_start % DIRENT_SIZE == 0 && names_start >= DIRENT_SIZE && names_start <= b.len()).then_some(Block {
            b,
            count: names_start / DIRENT_SIZE,
        })
    }

    /// Name and nid of dirent `i`.
    fn get(&self, i: usize) -> Option<(&'a [u8], u64)> {
        let d: &[u8; DIRENT_SIZE] = get(self.b, (i * DIRENT_SIZE) as u64, DIRENT_SIZE as u64)?
            .try_into()
            .ok()?;
        let start = usize::from(le16(d, 8));
        let end = if i + 1 < self.count {
            let n = get(self.b, ((i + 1) * DIRENT_SIZE + 8) as u64, 2)?;
            usize::from(u16::from_le_bytes([n[0], n[1]]))
        } else {
            self.b.len()
        };
        let raw = self.b.get(start..end)?;
        let name = if i + 1 == self.count {
            raw.split(|&c| c == 0).next().unwrap_or(raw)
        } else {
            raw
        };
        Some((name, le64(d, 0)))
    }
}

impl<'a> Dir<'a> {
    fn block_count(&self) -> usize {
        self.blocks.len().div_ceil(BLOCK_SIZE as usize) + usize::from(!self.tail.is_empty())
    }

    fn block(&self, i: usize) -> Option<Block<'a>> {
        let full = self.blocks.len().div_ceil(BLOCK_SIZE as usize);
        let b = if i < full {
            let s = i * BLOCK_SIZE as usize;
            self.blocks.get(s..(s + BLOCK_SIZE as usize).min(self.blocks.len()))?
        } else if i == full && !self.tail.is_empty() {
            self.tail
        } else {
            return None;
        };
        Block::new(b)
    }

    fn make(&self, name: &'a [u8], nid: u64) -> Option<DirEntry<'a>> {
        if name == b"." || name == b".." {
            return None;
        }
        let inode = self.view.id_of_nid(nid)?;
        Some(DirEntry {
            name,
            inode,
            hardlink: self.view.is_hardlink(self.id, name, inode),
        })
    }

    /// The entries in name order (`.`, `..` and the builder's root
    /// whiteouts left out, as in the tree).
    pub fn entries(&self) -> Entries<'a> {
        self.entries_at(DirPos::default())
    }

    /// The entries from `pos` on (a position an [`Entries`] of this
    /// directory gave).
    pub fn entries_at(&self, pos: DirPos) -> Entries<'a> {
        Entries {
            dir: *self,
            block: None,
            pos,
        }
    }

    /// The entry `name`, found by binary search.
    pub fn entry(&self, name: &[u8]) -> Option<DirEntry<'a>> {
        // The last block whose first name is not after `name`.
        let (mut lo, mut hi) = (0, self.block_count());
        while lo < hi {
            let mid = (lo + hi) / 2;
            let (first, _) = self.block(mid)?.get(0)?;
            if first <= name {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let b = self.block(lo.checked_sub(1)?)?;
        let (mut lo, mut hi) = (0, b.count);
        while lo < hi {
            let mid = (lo + hi) / 2;
            let (n, nid) = b.get(mid)?;
            match n.cmp(name) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return self.make(n, nid),
            }
        }
        None
    }
}

impl ImageView {
    /// Checks a whole image (as [`read_image`](super::read_image) does) and
    /// keeps it to serve.
    pub fn open(data: Vec<u8>) -> Result<ImageView> {
        let info = read_info(&data)?;
        let mut r = Reader::new(&data, &info, decode_budget(data.len()), false);
        let dirs = r.walk(info.root_nid)?;
        let primary = choose_primaries(&r.nodes, &dirs);
        let nodes = &r.nodes;
        let (order, id) = tree_order(nodes, &dirs);
        let nids: Vec<u64> = order.iter().map(|&i| nodes[i].nid).collect();
        let rank = NidRank::new(&nids[1..]);
        let mut parent = vec![ROOT; nids.len()];
        let mut marked = HashSet::new();
        let mut links = vec![0u8; nodes.len()];
        for d in &dirs {
            for &(_, child) in &d.entries {
                links[child] = links[child].saturating_add(1);
            }
        }
        let mut primaries = HashMap::new();
        for (d, prim) in dirs.iter().zip(&primary) {
            for (&(name, child), &p) in d.entries.iter().zip(prim) {
                if nodes[child].skip || !p {
                    continue;
                }
                if nodes[child].kind == FileType::Directory {
                    parent[id[child] as usize] = id[d.dir];
                } else if nodes[child].whiteout {
                    marked.insert(id[d.dir]);
                }
                if links[child] > 1 {
                    primaries.insert(id[child], (id[d.dir], Box::from(name)));
                }
            }
        }
        let has_selinux = r.selinux;
        let keys = std::mem::take(&mut r.keys);
        let long_contents = std::mem::take(&mut r.long_contents)
            .into_iter()
            .filter(|(i, _)| !nodes[*i].skip)
            .map(|(i, c)| (id[i], c.into_boxed_slice()))
            .collect();
        drop(dirs);
        drop(primary);
        drop(r);
        Ok(ImageView {
            data: data.into_boxed_slice(),
            info,
            nids,
            rank,
            parent,
            marked,
            primaries,
            long_contents,
            keys,
            has_selinux,
        })
    }

    pub fn info(&self) -> &ImageInfo {
        &self.info
    }

    /// The image's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Number of inodes (ids are 0..len).
    pub fn len(&self) -> usize {
        self.nids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nids.is_empty()
    }

    /// Some inode has a security.selinux label.
    pub fn has_selinux(&self) -> bool {
        self.has_selinux
    }

    /// Parent of directory `id` (the root is its own); 0 for others.
    pub fn parent(&self, id: InodeId) -> InodeId {
        self.parent.get(id as usize).copied().unwrap_or(ROOT)
    }

    /// The parents of all inodes, by id.
    pub fn parents(&self) -> &[InodeId] {
        &self.parent
    }

    /// Directory `id` holds a whiteout (as a primary entry).
    pub fn is_marked(&self, id: InodeId) -> bool {
        self.marked.contains(&id)
    }

    /// The id of the inode at `nid`, if it is one of the tree.
    pub fn id_of_nid(&self, nid: u64) -> Option<InodeId> {
        if self.nids.first() == Some(&nid) {
            return Some(ROOT);
        }
        self.rank.rank(nid).map(|r| r + 1)
    }

    fn is_hardlink(&self, dir: InodeId, name: &[u8], child: InodeId) -> bool {
        self.primaries
            .get(&child)
            .is_some_and(|(d, n)| !(*d == dir && **n == *name))
    }

    fn reader(&self) -> Reader<'_> {
        Reader::new(&self.data, &self.info, u64::MAX, true)
    }

    fn nid(&self, id: InodeId) -> Result<u64> {
        self.nids
            .get(id as usize)
            .copied()
            .ok_or_else(|| ImageError::Corrupt(format!("no inode {id}")))
    }

    /// The attributes of inode `id`, without decoding more than needed.
    pub fn attr(&self, id: InodeId) -> Result<Meta> {
        let r = self.reader();
        let nid = self.nid(id)?;
        let h = r.head(nid)?;
        let mut a = Meta {
            mode: h.mode,
            nlink: h.nlink,
            uid: h.uid,
            gid: h.gid,
            rdev: 0,
            size: h.tree_size(r.build_time()),
            mtime: h.mtime,
        };
        match h.kind {
            FileType::CharDevice | FileType::BlockDevice => a.rdev = h.i_u,
            // An empty file marked as a whiteout is one (see the reader).
            FileType::Regular if h.size == 0 && h.xattr_size > 0 => {
                let raw = r.read_xattrs(nid, h.xattr_off, h.xattr_size)?;
                let escaped = |x: &super::reader::RawXattr| {
                    let p = XATTR_PREFIXES.get(x.index as usize).copied().unwrap_or_default();
                    overlay::ESCAPED_WHITEOUT.strip_prefix(p) == Some(x.suffix)
                };
                if raw.iter().any(escaped) {
                    a.mode = S_IFCHR | (a.mode & !S_IFMT);
                }
            }
            _ => {}
        }
        Ok(a)
    }

    /// The attributes of inode `id` and its payload, contents and digest.
    pub fn node(&self, id: InodeId) -> Result<Node<'_>> {
        let r = self.reader();
        let nid = self.nid(id)?;
        let h = r.head(nid)?;
        let attr = self.attr(id)?;
        let mut n = Node {
            attr,
            payload: None,
            content: None,
            digest: None,
        };
        let flat = || -> Result<(&[u8], &[u8])> {
            if h.layout == LAYOUT_CHUNK_BASED {
                return Err(ImageError::Unsupported(format!(
                    "nid {nid}: {} with a chunk-based layout",
                    h.kind
                )));
            }
            flat_data(&self.data, nid, h.layout, h.size, h.i_u, h.inline_off)
        };
        let whole = |parts| self.whole(id, nid, parts);
        match h.kind {
            FileType::Symlink => n.payload = Some(whole(flat()?)?),
            FileType::Regular if attr.is_whiteout() => {}
            FileType::Regular => {
                if h.size > 0 && h.layout != LAYOUT_CHUNK_BASED {
                    n.content = Some(whole(flat()?)?);
                }
                for x in r.read_xattrs(nid, h.xattr_off, h.xattr_size)? {
                    let prefix = XATTR_PREFIXES.get(x.index as usize).copied().unwrap_or_default();
                    let is = |key: &[u8]| key.strip_prefix(prefix) == Some(x.suffix);
                    if is(overlay::REDIRECT) {
                        let path = x.value.strip_prefix(b"/").unwrap_or(x.value);
                        n.payload = (!path.is_empty()).then_some(path);
                    } else if is(overlay::METACOPY) && x.value.len() == 36 {
                        n.digest = x.value.get(4..36).and_then(|d| d.try_into().ok());
                    }
                }
            }
            _ => {}
        }
        Ok(n)
    }

    /// The xattrs of inode `id` as the tree holds them, sorted by name.
    pub fn xattrs(&self, id: InodeId) -> Result<Vec<(&[u8], &[u8])>> {
        let r = self.reader();
        let nid = self.nid(id)?;
        let h = r.head(nid)?;
        let raw = r.read_xattrs(nid, h.xattr_off, h.xattr_size)?;
        let mut out: Vec<(&[u8], &[u8])> = Vec::with_capacity(raw.len());
        let mut buf = [0u8; 2 * 256];
        for x in raw {
            let prefix = XATTR_PREFIXES.get(x.index as usize).copied().unwrap_or_default();
            let (p, s) = match (prefix, x.suffix) {
                // An escaped overlay xattr is the tree's unescaped one.
                (b"trusted.", s) if s.starts_with(b"overlay.overlay.") => (overlay::PREFIX, &s[16..]),
                (b"trusted.", s) if s.starts_with(b"overlay.") => continue,
                (p, s) => (p, s),
            };
            let len = p.len() + s.len();
            let key = buf
                .get_mut(..len)
                .ok_or_else(|| ImageError::Corrupt(format!("nid {nid}: xattr name of {len} bytes")))?;
            key[..p.len()].copy_from_slice(p);
            key[p.len()..].copy_from_slice(s);
            // Markers the conventions take off are in no tree.
            const MARKERS: [&[u8]; 6] = [
                UNESCAPED_WHITEOUT,
                UNESCAPED_WHITEOUTS,
                UNESCAPED_OPAQUE,
                overlay::USER_WHITEOUT,
                overlay::USER_WHITEOUTS,
                overlay::USER_OPAQUE,
            ];
            let key = MARKERS
                .iter()
                .find(|m| **m == &key[..])
                .copied()
                .or_else(|| self.keys.get(&key[..]).map(|k| &k[..]))
                .ok_or_else(|| ImageError::Corrupt(format!("nid {nid}: xattr \"{}\" unseen", key.escape_ascii())))?;
            out.push((key, x.value));
        }
        out.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let drop = |out: &mut Vec<(&[u8], &[u8])>, key: &[u8], value: Option<&[u8]>| {
            out.retain(|(k, v)| !(*k == key && value.is_none_or(|want| want == *v)));
        };
        if h.kind == FileType::Regular && h.size == 0 && out.iter().any(|(k, _)| *k == UNESCAPED_WHITEOUT) {
            drop(&mut out, UNESCAPED_WHITEOUT, None);
            drop(&mut out, overlay::USER_WHITEOUT, None);
        }
        if self.is_marked(id) {
            drop(&mut out, UNESCAPED_WHITEOUTS, None);
            drop(&mut out, overlay::USER_WHITEOUTS, None);
            if self.info.version >= 1 {
                drop(&mut out, UNESCAPED_OPAQUE, Some(b"x"));
                drop(&mut out, overlay::USER_OPAQUE, Some(b"x"));
            }
        }
        Ok(out)
    }

    /// Data in one piece: one of its two parts, or the joined copy of both.
    fn whole<'s>(&'s self, id: InodeId, nid: u64, (blocks, tail): (&'s [u8], &'s [u8])) -> Result<&'s [u8]> {
        match (blocks.is_empty(), tail.is_empty()) {
            (true, _) => Ok(tail),
            (_, true) => Ok(blocks),
            _ => self
                .long_contents
                .get(&id)
                .map(|c| &c[..])
                .ok_or_else(|| ImageError::Corrupt(format!("nid {nid}: data in two parts"))),
        }
    }

    /// Inode `id` as the tree holds it, but for its entries (see
    /// [`dir`](Self::dir)).
    pub fn inode(&self, id: InodeId) -> Result<Inode> {
        let mut r = self.reader();
        let (_, mut inode) = r.read_inode(self.nid(id)?)?;
        if self.is_marked(id) {
            unmark(&mut inode, self.info.version);
        }
        Ok(inode)
    }

    /// Directory `id`.
    pub fn dir(&self, id: InodeId) -> Result<Dir<'_>> {
        self.try_dir(id)?.ok_or_else(|| {
            let nid = self.nids[id as usize];
            ImageError::Corrupt(format!("nid {nid} is not a directory"))
        })
    }

    /// The entries of inode `id` if it is a directory (None if not), from
    /// its fixed fields alone: what a lookup needs.
    pub fn try_dir(&self, id: InodeId) -> Result<Option<Dir<'_>>> {
        let r = self.reader();
        let nid = self.nid(id)?;
        let h = r.head(nid)?;
        if h.kind != FileType::Directory {
            return Ok(None);
        }
        if h.layout == LAYOUT_CHUNK_BASED {
            return Err(ImageError::Unsupported(format!(
                "nid {nid}: directory with a chunk-based layout"
            )));
        }
        let (blocks, tail) = flat_data(&self.data, nid, h.layout, h.size, h.i_u, h.inline_off)?;
        Ok(Some(Dir {
            view: self,
            id,
            blocks,
            tail,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::erofs::{read_image, write_image, WriteOptions};
    use crate::tree::{Tree, S_IFDIR, S_IFLNK, S_IFREG};

    /// A tree with every kind of thing a view decodes: nested and large
    /// directories, inline contents of one and of two parts, external
    /// files, symlinks, xattrs (escaped overlay ones too), a whiteout and
    /// a hardlink.
    fn tree() -> Tree {
        let mut t = Tree::new(Inode::new(S_IFDIR | 0o755));
        let d = t.add_child(ROOT, b"dir", Inode::new(S_IFDIR | 0o755)).unwrap();
        for i in 0..400 {
            let mut f = Inode::new(S_IFREG | 0o644);
            f.size = 100 + i;
            f.payload = Some(format!("ab/{i:062}").into_bytes());
            f.digest = Some([i as u8; 32]);
            f.set_xattr(b"user.n", format!("{i}").as_bytes(), 60000).unwrap();
            t.add_child(d, format!("file-with-a-long-name-{i:05}").as_bytes(), f)
                .unwrap();
        }
        let mut small = Inode::new(S_IFREG | 0o600);
        small.size = 5;
        small.content = Some(b"hello".to_vec());
        small.set_xattr(b"trusted.overlay.custom", b"kept", 60000).unwrap();
        let s = t.add_child(ROOT, b"small", small).unwrap();
        t.link(d, b"small-link", s, true).unwrap();
        t.inode_mut(s).nlink = 2;
        let mut long = Inode::new(S_IFREG | 0o644);
        long.size = 4500;
        long.content = Some((0..4500).map(|i| i as u8).collect());
        t.add_child(ROOT, b"long", long).unwrap();
        let mut l = Inode::new(S_IFLNK | 0o777);
        l.payload = Some(b"dir/small-link".to_vec());
        l.size = 14;
        t.add_child(ROOT, b"link", l).unwrap();
        t.add_child(d, b"gone", Inode::new(S_IFCHR)).unwrap();
        t
    }

    /// Reads everything the view serves, for every inode.
    fn read_all(v: &ImageView) -> usize {
        let mut n = 0;
        for id in 0..v.len() as InodeId + 2 {
            n += v.attr(id).is_ok() as usize;
            n += v.node(id).is_ok() as usize;
            n += v.inode(id).is_ok() as usize;
            n += v.xattrs(id).is_ok() as usize;
            if let Ok(d) = v.dir(id) {
                for e in d.entries() {
                    n += d.entry(e.name).is_some() as usize;
                }
                n += d.entry(b"file-with-a-long-name-00200").is_some() as usize;
            }
        }
        n
    }

    #[test]
    fn the_view_is_the_tree() {
        let img = write_image(&tree(), &WriteOptions::default()).unwrap();
        let (t, _) = read_image(&img.bytes).unwrap();
        let v = ImageView::open(img.bytes.clone()).unwrap();
        assert_eq!(v.len(), t.inodes.len());
        let long = t.lookup_path(b"long").unwrap();
        assert_eq!(v.node(long).unwrap().content, t.inode(long).content.as_deref());
        assert!(
            v.long_contents.contains_key(&long),
            "4500 bytes inline are in two parts"
        );
        let dir = v.dir(t.lookup_path(b"dir").unwrap()).unwrap();
        let e = dir.entry(b"small-link").unwrap();
        assert_eq!((e.inode, e.hardlink), (t.lookup_path(b"small").unwrap(), true));
        assert_eq!(dir.entries().count(), 402);
        // A listing resumed where another stopped goes on as it would have.
        let all: Vec<_> = dir.entries().collect();
        for k in [0, 1, 57, 200, 401, 402] {
            let mut it = dir.entries();
            it.by_ref().take(k).for_each(drop);
            let pos = it.pos();
            assert_eq!(pos.index, k as u64);
            assert_eq!(dir.entries_at(pos).collect::<Vec<_>>(), all[k..]);
        }
        assert!(v.is_marked(t.lookup_path(b"dir").unwrap()));
    }

    /// Bytes that change after the checking walk (they never do: the view
    /// owns them) give errors, never a panic or an out-of-bounds read.
    #[test]
    fn damage_after_the_walk_gives_errors() {
        let img = write_image(&tree(), &WriteOptions::default()).unwrap();
        let mut v = ImageView::open(img.bytes.clone()).unwrap();
        let whole = read_all(&v);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let meta = v.info.meta_blkaddr as usize * BLOCK_SIZE as usize;
        let mut fewer = 0;
        for n in 0..3000 {
            let at = if n % 2 == 0 {
                meta + rnd() as usize % (v.data.len() - meta).min(8192)
            } else {
                rnd() as usize % v.data.len()
            };
            let old = v.data[at];
            v.data[at] = if n % 3 == 0 { 0xff } else { old ^ (1 << (rnd() % 8)) };
            fewer += (read_all(&v) < whole) as usize;
            v.data[at] = old;
        }
        assert!(fewer > 100, "damage went unnoticed: {fewer}");
        assert_eq!(read_all(&v), whole);
    }
}
