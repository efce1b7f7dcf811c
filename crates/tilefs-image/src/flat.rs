//! A compact tree for building images.
//!
//! [`Tree`] is the model to edit (OCI layers, the FUSE server): every inode
//! owns its vectors, which costs several heap allocations per file. Building
//! an image only appends, so the dump parser and the directory scanner fill a
//! [`FlatTree`] instead, which the EROFS writer reads directly: names,
//! payloads and contents live in a few large arenas, each distinct xattr
//! (name and value) is stored once, and an inode is one fixed-size record.
//! A 64k-entry tree then takes a few large allocations instead of several
//! hundred thousand small ones, and about a third of the memory.
//!
//! Inode ids are indexes into the inode array; the root is 0. A directory's
//! entries are kept in the order they are linked (sorted by name when the
//! tree comes from a dump, a directory or a [`Tree`]), like
//! [`Inode::entries`].

use crate::tree::{Entry, Inode, InodeId, Timespec, Tree, Xattr, S_IFDIR, S_IFMT, S_IFREG};
use hashbrown::HashTable;
use std::hash::Hasher as _;

/// "No such index" in the compact records.
pub(crate) const NONE: u32 = u32::MAX;

/// A tree whose arenas would need offsets beyond 32 bits (more than 4 GiB
/// of names, payloads or xattrs), or more than 2^31 inodes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the tree is too large: more than 4 GiB of names, symlink targets, contents or xattrs, or 2^31 inodes")]
pub struct TooLarge;

/// A range of one of the arenas; `len == NONE` means absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub off: u32,
    pub len: u32,
}

impl Span {
    pub const ABSENT: Span = Span { off: 0, len: NONE };

    pub fn is_some(self) -> bool {
        self.len != NONE
    }
}

/// An inode's metadata: everything but its names, data and xattrs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Meta {
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    /// Device number in the kernel's 32-bit encoding.
    pub rdev: u32,
    pub size: u64,
    pub mtime: Timespec,
}

impl Meta {
    pub fn is_dir(&self) -> bool {
        self.mode & S_IFMT == S_IFDIR
    }

    pub fn is_reg(&self) -> bool {
        self.mode & S_IFMT == S_IFREG
    }

    /// An overlay whiteout: a character device 0/0.
    pub fn is_whiteout(&self) -> bool {
        self.mode & S_IFMT == crate::tree::S_IFCHR && self.rdev == 0
    }
}

/// One inode's record.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FlatInode {
    pub meta: Meta,
    /// Symlink target or object path, in `data`, preceded there by a `/`
    /// (so the redirect xattr `/PAYLOAD` is a slice of the arena too).
    pub payload: Span,
    /// Inline contents, in `data`.
    pub content: Span,
    /// Index into `digests`, or NONE.
    pub digest: u32,
    /// This inode's xattr ids: `xattr_lists[xattrs..xattrs + n_xattrs]`.
    pub xattrs: u32,
    pub n_xattrs: u32,
    /// Index into `dirs` of its entries, or NONE (none yet).
    pub dir: u32,
}

/// A directory entry: its name in `names`, and the inode it names.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FlatEntry {
    pub name: u32,
    /// Name length; the top bit marks a hardlink (a secondary entry).
    len_link: u32,
    pub inode: InodeId,
}

const HARDLINK_BIT: u32 = 1 << 31;

impl FlatEntry {
    pub fn len(&self) -> usize {
        (self.len_link & !HARDLINK_BIT) as usize
    }

    pub fn hardlink(&self) -> bool {
        self.len_link & HARDLINK_BIT != 0
    }
}

/// Distinct xattrs (name and value), each stored once.
#[derive(Default, Clone)]
pub(crate) struct XattrTable {
    data: Vec<u8>,
    /// (offset in `data`, key length, value length); the value follows the key.
    pairs: Vec<(u32, u32, u32)>,
    index: HashTable<u32>,
}

pub(crate) fn hash_pair(key: &[u8], value: &[u8]) -> u64 {
    let mut h = rustc_hash::FxHasher::default();
    h.write_usize(key.len());
    h.write(key);
    h.write(value);
    h.finish()
}

impl XattrTable {
    /// The id of (key, value), added if new.
    pub fn intern(&mut self, key: &[u8], value: &[u8]) -> Result<u32, TooLarge> {
        let hash = hash_pair(key, value);
        let (data, pairs) = (&self.data, &self.pairs);
        let eq = |&id: &u32| {
            let (off, kl, vl) = pairs[id as usize];
            let (off, kl, vl) = (off as usize, kl as usize, vl as usize);
            kl == key.len()
                && vl == value.len()
                && &data[off..off + kl] == key
                && &data[off + kl..off + kl + vl] == value
        };
        if let Some(&id) = self.index.find(hash, eq) {
            return Ok(id);
        }
        let off = u32::try_from(self.data.len()).map_err(|_| TooLarge)?;
        let kl = u32::try_from(key.len()).map_err(|_| TooLarge)?;
        let vl = u32::try_from(value.len()).map_err(|_| TooLarge)?;
        if (off as u64) + kl as u64 + vl as u64 > u32::MAX as u64 || self.pairs.len() >= NONE as usize {
            return Err(TooLarge);
        }
        self.data.extend_from_slice(key);
        self.data.extend_from_slice(value);
        let id = self.pairs.len() as u32;
        self.pairs.push((off, kl, vl));
        let (data, pairs) = (&self.data, &self.pairs);
        self.index.insert_unique(hash, id, |&id| {
            let (off, kl, vl) = pairs[id as usize];
            let (off, kl, vl) = (off as usize, kl as usize, vl as usize);
            hash_pair(&data[off..off + kl], &data[off + kl..off + kl + vl])
        });
        Ok(id)
    }

    pub fn key(&self, id: u32) -> &[u8] {
        let (off, kl, _) = self.pairs[id as usize];
        &self.data[off as usize..(off + kl) as usize]
    }

    pub fn value(&self, id: u32) -> &[u8] {
        let (off, kl, vl) = self.pairs[id as usize];
        &self.data[(off + kl) as usize..(off + kl + vl) as usize]
    }

    pub fn len(&self) -> usize {
        self.pairs.len()
    }
}

/// A file tree in a few arenas; see the module documentation.
#[derive(Clone)]
pub struct FlatTree {
    pub(crate) inodes: Vec<FlatInode>,
    /// Entries of each directory (see [`FlatInode::dir`]).
    pub(crate) dirs: Vec<Vec<FlatEntry>>,
    pub(crate) names: Vec<u8>,
    pub(crate) data: Vec<u8>,
    pub(crate) digests: Vec<[u8; 32]>,
    pub(crate) xattrs: XattrTable,
    pub(crate) xattr_lists: Vec<u32>,
}

/// What a new inode holds besides its metadata.
#[derive(Debug, Default, Clone, Copy)]
pub struct NewInode<'a> {
    pub payload: Option<&'a [u8]>,
    pub content: Option<&'a [u8]>,
    pub digest: Option<[u8; 32]>,
}

impl FlatTree {
    /// A tree holding only the root directory `root` (its mode should be a
    /// directory's; the writer refuses it otherwise).
    pub fn new(root: Meta) -> FlatTree {
        let mut t = FlatTree {
            inodes: Vec::new(),
            dirs: Vec::new(),
            names: Vec::new(),
            data: Vec::new(),
            digests: Vec::new(),
            xattrs: XattrTable::default(),
            xattr_lists: Vec::new(),
        };
        t.inodes.push(FlatInode::new(root));
        t
    }

    /// Number of inodes.
    pub fn len(&self) -> usize {
        self.inodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inodes.is_empty()
    }

    pub fn meta(&self, id: InodeId) -> &Meta {
        &self.inodes[id as usize].meta
    }

    pub fn meta_mut(&mut self, id: InodeId) -> &mut Meta {
        &mut self.inodes[id as usize].meta
    }

    pub(crate) fn span(&self, s: Span) -> Option<&[u8]> {
        s.is_some()
            .then(|| &self.data[s.off as usize..(s.off + s.len) as usize])
    }

    /// Symlink target or object path.
    pub fn payload(&self, id: InodeId) -> Option<&[u8]> {
        self.span(self.inodes[id as usize].payload)
    }

    /// `/` followed by the payload: the value of an overlay redirect.
    pub(crate) fn slash_payload(&self, id: InodeId) -> Option<&[u8]> {
        let s = self.inodes[id as usize].payload;
        s.is_some()
            .then(|| &self.data[s.off as usize - 1..(s.off + s.len) as usize])
    }

    /// Inline contents of a small regular file.
    pub fn content(&self, id: InodeId) -> Option<&[u8]> {
        self.span(self.inodes[id as usize].content)
    }

    pub fn digest(&self, id: InodeId) -> Option<&[u8; 32]> {
        match self.inodes[id as usize].digest {
            NONE => None,
            i => Some(&self.digests[i as usize]),
        }
    }

    pub(crate) fn xattr_ids(&self, id: InodeId) -> &[u32] {
        let i = &self.inodes[id as usize];
        &self.xattr_lists[i.xattrs as usize..(i.xattrs + i.n_xattrs) as usize]
    }

    /// The xattrs of an inode, in the order they were set.
    pub fn xattrs(&self, id: InodeId) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.xattr_ids(id)
            .iter()
            .map(|&x| (self.xattrs.key(x), self.xattrs.value(x)))
    }

    pub(crate) fn entries(&self, id: InodeId) -> &[FlatEntry] {
        match self.inodes[id as usize].dir {
            NONE => &[],
            d => &self.dirs[d as usize],
        }
    }

    pub(crate) fn entries_mut(&mut self, id: InodeId) -> &mut Vec<FlatEntry> {
        let d = match self.inodes[id as usize].dir {
            NONE => {
                let d = self.dirs.len() as u32;
                self.dirs.push(Vec::new());
                self.inodes[id as usize].dir = d;
                d
            }
            d => d,
        };
        &mut self.dirs[d as usize]
    }

    pub(crate) fn name(&self, e: &FlatEntry) -> &[u8] {
        &self.names[e.name as usize..e.name as usize + e.len()]
    }

    /// Number of entries of `id` (0 for non-directories).
    pub fn entry_count(&self, id: InodeId) -> usize {
        self.entries(id).len()
    }

    /// Entries of `id`: (name, inode, hardlink), in their order.
    pub fn entry_iter(&self, id: InodeId) -> impl Iterator<Item = (&[u8], InodeId, bool)> + '_ {
        self.entries(id).iter().map(|e| (self.name(e), e.inode, e.hardlink()))
    }

    /// Copies `bytes` into the data arena.
    pub(crate) fn push_data(&mut self, bytes: &[u8]) -> Result<Span, TooLarge> {
        let off = u32::try_from(self.data.len()).map_err(|_| TooLarge)?;
        let len = u32::try_from(bytes.len()).map_err(|_| TooLarge)?;
        if off as u64 + len as u64 >= NONE as u64 {
            return Err(TooLarge);
        }
        self.data.extend_from_slice(bytes);
        Ok(Span { off, len })
    }

    /// Copies a payload into the data arena, after a `/`.
    pub(crate) fn push_payload(&mut self, bytes: &[u8]) -> Result<Span, TooLarge> {
        self.data.push(b'/');
        self.push_data(bytes)
    }

    pub(crate) fn push_digest(&mut self, d: [u8; 32]) -> Result<u32, TooLarge> {
        let i = u32::try_from(self.digests.len())
            .ok()
            .filter(|&i| i != NONE)
            .ok_or(TooLarge)?;
        self.digests.push(d);
        Ok(i)
    }

    /// Records an inode's xattr list (ids of `self.xattrs`).
    pub(crate) fn push_xattr_list(&mut self, ids: &[u32]) -> Result<(u32, u32), TooLarge> {
        if ids.is_empty() {
            return Ok((0, 0));
        }
        let start = u32::try_from(self.xattr_lists.len()).map_err(|_| TooLarge)?;
        if start as u64 + ids.len() as u64 >= NONE as u64 {
            return Err(TooLarge);
        }
        self.xattr_lists.extend_from_slice(ids);
        Ok((start, ids.len() as u32))
    }

    /// Adds an inode (not linked anywhere yet) with the given xattrs.
    pub fn add_inode<'k>(
        &mut self,
        meta: Meta,
        new: NewInode<'_>,
        xattrs: impl IntoIterator<Item = (&'k [u8], &'k [u8])>,
    ) -> Result<InodeId, TooLarge> {
        let mut ids = Vec::new();
        for (k, v) in xattrs {
            ids.push(self.xattrs.intern(k, v)?);
        }
        let mut i = FlatInode::new(meta);
        if let Some(p) = new.payload {
            i.payload = self.push_payload(p)?;
        }
        if let Some(c) = new.content {
            i.content = self.push_data(c)?;
        }
        if let Some(d) = new.digest {
            i.digest = self.push_digest(d)?;
        }
        (i.xattrs, i.n_xattrs) = self.push_xattr_list(&ids)?;
        self.push_inode(i)
    }

    pub(crate) fn push_inode(&mut self, i: FlatInode) -> Result<InodeId, TooLarge> {
        let id = u32::try_from(self.inodes.len())
            .ok()
            .filter(|&id| id < 1 << 31)
            .ok_or(TooLarge)?;
        self.inodes.push(i);
        Ok(id)
    }

    /// Sets the xattrs of an inode (replacing any it had).
    pub fn set_xattrs<'k>(
        &mut self,
        id: InodeId,
        xattrs: impl IntoIterator<Item = (&'k [u8], &'k [u8])>,
    ) -> Result<(), TooLarge> {
        let mut ids = Vec::new();
        for (k, v) in xattrs {
            ids.push(self.xattrs.intern(k, v)?);
        }
        let (start, n) = self.push_xattr_list(&ids)?;
        let i = &mut self.inodes[id as usize];
        (i.xattrs, i.n_xattrs) = (start, n);
        Ok(())
    }

    /// Appends the entry `name` -> `child` to `dir`'s entries (no check:
    /// the caller keeps them sorted and unique).
    pub fn push_entry(&mut self, dir: InodeId, name: &[u8], child: InodeId, hardlink: bool) -> Result<(), TooLarge> {
        let e = self.new_entry(name, child, hardlink)?;
        self.entries_mut(dir).push(e);
        Ok(())
    }

    /// Stores `name` and makes an entry for it, not yet in any directory.
    pub(crate) fn new_entry(&mut self, name: &[u8], child: InodeId, hardlink: bool) -> Result<FlatEntry, TooLarge> {
        let off = u32::try_from(self.names.len()).map_err(|_| TooLarge)?;
        if name.len() >= HARDLINK_BIT as usize || off as u64 + name.len() as u64 > u32::MAX as u64 {
            return Err(TooLarge);
        }
        self.names.extend_from_slice(name);
        Ok(FlatEntry {
            name: off,
            len_link: name.len() as u32 | if hardlink { HARDLINK_BIT } else { 0 },
            inode: child,
        })
    }

    /// The same tree as a [`FlatTree`], inode ids unchanged.
    pub fn from_tree(tree: &Tree) -> Result<FlatTree, TooLarge> {
        let mut t = FlatTree {
            inodes: Vec::with_capacity(tree.inodes.len()),
            dirs: Vec::new(),
            names: Vec::new(),
            data: Vec::new(),
            digests: Vec::new(),
            xattrs: XattrTable::default(),
            xattr_lists: Vec::new(),
        };
        for inode in &tree.inodes {
            let meta = Meta {
                mode: inode.mode,
                nlink: inode.nlink,
                uid: inode.uid,
                gid: inode.gid,
                rdev: inode.rdev,
                size: inode.size,
                mtime: inode.mtime,
            };
            let new = NewInode {
                payload: inode.payload.as_deref(),
                content: inode.content.as_deref(),
                digest: inode.digest,
            };
            let id = t.add_inode(meta, new, inode.xattrs.iter().map(|x| (&x.key[..], &x.value[..])))?;
            if !inode.entries.is_empty() {
                let mut entries = Vec::with_capacity(inode.entries.len());
                for e in &inode.entries {
                    entries.push(t.new_entry(&e.name, e.inode, e.hardlink)?);
                }
                let d = t.dirs.len() as u32;
                t.dirs.push(entries);
                t.inodes[id as usize].dir = d;
            }
        }
        Ok(t)
    }

    /// The same tree as a [`Tree`], inode ids unchanged.
    pub fn to_tree(&self) -> Tree {
        let inodes = (0..self.inodes.len() as InodeId)
            .map(|id| {
                let m = self.meta(id);
                Inode {
                    mode: m.mode,
                    nlink: m.nlink,
                    uid: m.uid,
                    gid: m.gid,
                    rdev: m.rdev,
                    size: m.size,
                    mtime: m.mtime,
                    payload: self.payload(id).map(<[u8]>::to_vec),
                    content: self.content(id).map(<[u8]>::to_vec),
                    digest: self.digest(id).copied(),
                    xattrs: self
                        .xattrs(id)
                        .map(|(k, v)| Xattr {
                            key: k.to_vec(),
                            value: v.to_vec(),
                        })
                        .collect(),
                    entries: self
                        .entries(id)
                        .iter()
                        .map(|e| Entry {
                            name: self.name(e).to_vec(),
                            inode: e.inode,
                            hardlink: e.hardlink(),
                        })
                        .collect(),
                }
            })
            .collect();
        Tree { inodes }
    }

    /// Distinct object paths (payloads of external regular files), as
    /// [`summary::objects`](crate::summary::objects) gives them for a [`Tree`].
    pub fn objects(&self) -> std::collections::BTreeSet<&[u8]> {
        (0..self.inodes.len() as InodeId)
            .filter(|&id| self.is_external(id))
            .filter_map(|id| self.payload(id))
            .filter(|p| !p.is_empty())
            .collect()
    }

    /// A regular file whose data lives outside the image (in the store).
    pub fn is_external(&self, id: InodeId) -> bool {
        let i = &self.inodes[id as usize];
        i.meta.is_reg() && i.meta.size > 0 && !i.content.is_some()
    }
}

impl FlatInode {
    pub(crate) fn new(meta: Meta) -> FlatInode {
        FlatInode {
            meta,
            payload: Span::ABSENT,
            content: Span::ABSENT,
            digest: NONE,
            xattrs: 0,
            n_xattrs: 0,
            dir: NONE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::{S_IFLNK, S_IFREG};

    #[test]
    fn round_trip_through_tree() {
        let mut tree = Tree::new(Inode::new(S_IFDIR | 0o755));
        let mut f = Inode::new(S_IFREG | 0o644);
        f.size = 3;
        f.content = Some(b"abc".to_vec());
        f.set_xattr(b"user.a", b"1", usize::MAX).unwrap();
        f.set_xattr(b"security.selinux", b"x", usize::MAX).unwrap();
        let a = tree.add_child(0, b"a", f).unwrap();
        let mut l = Inode::new(S_IFLNK | 0o777);
        l.payload = Some(b"/target".to_vec());
        l.digest = Some([7; 32]);
        l.set_xattr(b"user.a", b"1", usize::MAX).unwrap();
        tree.add_child(0, b"l", l).unwrap();
        tree.link(0, b"z", a, true).unwrap();
        let flat = FlatTree::from_tree(&tree).unwrap();
        assert_eq!(flat.to_tree(), tree);
        // The shared xattr is stored once.
        assert_eq!(flat.xattrs.len(), 2);
        assert_eq!(flat.slash_payload(2), Some(&b"//target"[..]));
    }
}
