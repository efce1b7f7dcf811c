//! The in-memory tree model that sits between every input (directory, dump,
//! image) and every output (EROFS image, dump text).
//!
//! Inodes live in an arena (`Tree::inodes`, root at index 0); directories
//! hold sorted entries pointing into it. A hardlink is a second entry that
//! points at an inode already placed elsewhere: the entry with
//! `hardlink == false` is the inode's *primary* entry and decides where the
//! inode sits in the image's breadth-first inode order.

use std::fmt;

/// Index of an inode in [`Tree::inodes`].
pub type InodeId = u32;

/// The root directory's id.
pub const ROOT: InodeId = 0;

/// Longest file name the format holds (bytes), as the kernel's NAME_MAX.
pub const MAX_NAME_LEN: usize = 255;
/// Longest xattr name (bytes), as the kernel's XATTR_NAME_MAX.
pub const MAX_XATTR_NAME_LEN: usize = 255;
/// Longest xattr value (bytes): EROFS stores its length in 16 bits, one
/// byte short of the kernel's XATTR_SIZE_MAX (65536).
pub const MAX_XATTR_VALUE_LEN: usize = u16::MAX as usize;
/// Largest inline content the reader and writer accept.
pub const MAX_INLINE_CONTENT: usize = 5000;
/// Regular files up to this size are stored inline when built from a
/// directory (the size of a digest redirect they would otherwise need).
pub const RECOMMENDED_INLINE_MAX: u64 = 64;
/// Longest symlink target or payload (PATH_MAX - 1).
pub const MAX_PAYLOAD_LEN: usize = 4095;
/// Xattr budget per inode for external input (dumps, directories): half of
/// what EROFS can hold, leaving room for the overlay xattrs we add.
pub const EXTERNAL_XATTR_BUDGET: usize = u16::MAX as usize / 2;
/// Xattr budget per inode for input whose every xattr at its limits must
/// fit (OCI layers: composefs-rs writes them): what EROFS can hold (an
/// inode counts its xattr space in 16 bits of 4-byte words, after a
/// 12-byte header), less room for the overlay xattrs the writer adds.
pub const IMAGE_XATTR_BUDGET: usize = (u16::MAX as usize - 1) * 4 + XATTR_HEADER_BUDGET - 1024;

pub const S_IFMT: u32 = 0o170000;
pub const S_IFSOCK: u32 = 0o140000;
pub const S_IFLNK: u32 = 0o120000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFBLK: u32 = 0o060000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFCHR: u32 = 0o020000;
pub const S_IFIFO: u32 = 0o010000;

/// File type of an inode, from the `S_IFMT` bits of its mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileType {
    Regular,
    Directory,
    Symlink,
    BlockDevice,
    CharDevice,
    Fifo,
    Socket,
}

impl FileType {
    /// The type encoded in `mode`, or `None` for an unknown type.
    pub fn from_mode(mode: u32) -> Option<FileType> {
        Some(match mode & S_IFMT {
            S_IFREG => FileType::Regular,
            S_IFDIR => FileType::Directory,
            S_IFLNK => FileType::Symlink,
            S_IFBLK => FileType::BlockDevice,
            S_IFCHR => FileType::CharDevice,
            S_IFIFO => FileType::Fifo,
            S_IFSOCK => FileType::Socket,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            FileType::Regular => "regular file",
            FileType::Directory => "directory",
            FileType::Symlink => "symlink",
            FileType::BlockDevice => "block device",
            FileType::CharDevice => "character device",
            FileType::Fifo => "fifo",
            FileType::Socket => "socket",
        }
    }
}

/// Seconds and nanoseconds since the epoch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct Timespec {
    pub sec: i64,
    pub nsec: u32,
}

/// One extended attribute. Keys never contain NUL; values are raw bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Xattr {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
}

/// A directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: Vec<u8>,
    pub inode: InodeId,
    /// A secondary link to an inode whose primary entry is elsewhere.
    pub hardlink: bool,
}

/// One inode: metadata, optional payload/content/digest, xattrs, and (for
/// directories) entries sorted by name, without `.` and `..`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inode {
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    /// Device number in the kernel's 32-bit encoding (chardev/blockdev only).
    pub rdev: u32,
    pub size: u64,
    pub mtime: Timespec,
    /// Symlink target, or for a regular file the path of its object in the
    /// store (`XX/YYYY…`), relative to the store.
    pub payload: Option<Vec<u8>>,
    /// Inline contents of a small regular file.
    pub content: Option<Vec<u8>>,
    /// fs-verity SHA-256 digest of a regular file's contents.
    pub digest: Option<[u8; 32]>,
    pub xattrs: Vec<Xattr>,
    pub entries: Vec<Entry>,
}

impl Inode {
    /// A new inode with the given mode, nlink 1 and everything else zero.
    pub fn new(mode: u32) -> Inode {
        Inode {
            mode,
            nlink: 1,
            ..Inode::default()
        }
    }

    pub fn file_type(&self) -> Option<FileType> {
        FileType::from_mode(self.mode)
    }

    pub fn is_dir(&self) -> bool {
        self.mode & S_IFMT == S_IFDIR
    }

    pub fn is_reg(&self) -> bool {
        self.mode & S_IFMT == S_IFREG
    }

    /// An overlayfs whiteout: a character device with device number 0/0.
    pub fn is_whiteout(&self) -> bool {
        self.mode & S_IFMT == S_IFCHR && self.rdev == 0
    }

    /// A regular file whose data lives outside the image (in the store).
    pub fn is_external(&self) -> bool {
        self.is_reg() && self.size > 0 && self.content.is_none()
    }

    pub fn xattr(&self, key: &[u8]) -> Option<&[u8]> {
        self.xattrs.iter().find(|x| x.key == key).map(|x| x.value.as_slice())
    }

    /// Sets (or replaces) an xattr, refusing it if the inode's xattrs would
    /// then exceed `budget` bytes as EROFS counts them (worst case).
    pub fn set_xattr(&mut self, key: &[u8], value: &[u8], budget: usize) -> Result<(), TreeError> {
        check_xattr(key, value)?;
        self.xattrs.retain(|x| x.key != key);
        let used = xattr_budget(self.xattrs.iter().map(|x| (x.key.len(), x.value.len())))
            + xattr_entry_budget(key.len(), value.len())
            + if self.xattrs.is_empty() { XATTR_HEADER_BUDGET } else { 0 };
        if used > budget {
            return Err(TreeError::XattrsTooLarge { used, budget });
        }
        self.xattrs.push(Xattr {
            key: key.to_vec(),
            value: value.to_vec(),
        });
        Ok(())
    }

    /// Sets several xattrs, with exactly the result and errors of calling
    /// [`set_xattr`](Self::set_xattr) for each in turn (a repeated key
    /// replaces the earlier value and moves to the end; on error, the ones
    /// before the failing one stay set), in time linear in their number
    /// rather than quadratic.
    pub fn set_xattrs<K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &mut self,
        xattrs: impl IntoIterator<Item = (K, V)>,
        budget: usize,
    ) -> Result<(), TreeError> {
        use std::collections::HashMap;
        // Below this many xattrs a linear scan beats hashing.
        const INDEX_FROM: usize = 16;
        let mut slots: Vec<Option<Xattr>> = std::mem::take(&mut self.xattrs).into_iter().map(Some).collect();
        let mut total: usize = slots
            .iter()
            .flatten()
            .map(|x| xattr_entry_budget(x.key.len(), x.value.len()))
            .sum();
        let mut index: Option<HashMap<Vec<u8>, usize>> = None;
        let mut result = Ok(());
        for (key, value) in xattrs {
            let (key, value) = (key.as_ref(), value.as_ref());
            if let Err(e) = check_xattr(key, value) {
                result = Err(e);
                break;
            }
            if index.is_none() && slots.len() >= INDEX_FROM {
                let map = slots
                    .iter()
                    .enumerate()
                    .filter_map(|(i, s)| Some((s.as_ref()?.key.clone(), i)))
                    .collect();
                index = Some(map);
            }
            let old = match &index {
                Some(map) => map.get(key).copied(),
                None => slots.iter().position(|s| s.as_ref().is_some_and(|x| x.key == key)),
            };
            if let Some(old) = old {
                let x = slots[old].take().expect("indexed xattr is present");
                total -= xattr_entry_budget(x.key.len(), x.value.len());
            }
            let used = total + xattr_entry_budget(key.len(), value.len()) + XATTR_HEADER_BUDGET;
            if used > budget {
                result = Err(TreeError::XattrsTooLarge { used, budget });
                break;
            }
            total = used - XATTR_HEADER_BUDGET;
            if let Some(map) = &mut index {
                map.insert(key.to_vec(), slots.len());
            }
            slots.push(Some(Xattr {
                key: key.to_vec(),
                value: value.to_vec(),
            }));
        }
        self.xattrs = slots.into_iter().flatten().collect();
        result
    }

    /// Removes an xattr; true if it was there.
    pub fn remove_xattr(&mut self, key: &[u8]) -> bool {
        let n = self.xattrs.len();
        self.xattrs.retain(|x| x.key != key);
        n != self.xattrs.len()
    }

    /// Index into `entries` of `name`, or where it would be inserted.
    pub fn find_entry(&self, name: &[u8]) -> Result<usize, usize> {
        self.entries.binary_search_by(|e| e.name.as_slice().cmp(name))
    }

    pub fn entry(&self, name: &[u8]) -> Option<&Entry> {
        self.find_entry(name).ok().map(|i| &self.entries[i])
    }
}

pub(crate) const XATTR_HEADER_BUDGET: usize = 12;

/// The checks [`Inode::set_xattr`] makes on one xattr by itself.
pub(crate) fn check_xattr(key: &[u8], value: &[u8]) -> Result<(), TreeError> {
    if key.is_empty() {
        return Err(TreeError::EmptyXattrName);
    }
    if key.len() > MAX_XATTR_NAME_LEN {
        return Err(TreeError::XattrNameTooLong(key.len()));
    }
    if key.contains(&0) {
        return Err(TreeError::XattrNameNul);
    }
    if value.len() > MAX_XATTR_VALUE_LEN {
        return Err(TreeError::XattrValueTooLong(value.len()));
    }
    Ok(())
}

// Worst case per entry: a 4-byte header, the name and value, and up to 3
// bytes of alignment.
pub(crate) fn xattr_entry_budget(key_len: usize, value_len: usize) -> usize {
    7 + key_len + value_len
}

fn xattr_budget(it: impl Iterator<Item = (usize, usize)>) -> usize {
    let mut n = 0;
    let mut total = 0;
    for (k, v) in it {
        n += 1;
        total += xattr_entry_budget(k, v);
    }
    if n > 0 {
        total + XATTR_HEADER_BUDGET
    } else {
        0
    }
}

/// Why a tree operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    #[error("empty file name")]
    EmptyName,
    #[error("file name is {0} bytes, longer than the 255 the format holds (NAME_MAX)")]
    NameTooLong(usize),
    #[error("file name contains '/' or a NUL byte")]
    BadNameChar,
    #[error("'.' and '..' cannot be file names")]
    DotName,
    #[error("parent is not a directory")]
    NotADirectory,
    #[error("an entry with this name already exists")]
    Exists,
    #[error("empty xattr name")]
    EmptyXattrName,
    #[error("xattr name is {0} bytes, longer than 255 (XATTR_NAME_MAX)")]
    XattrNameTooLong(usize),
    #[error("xattr name contains a NUL byte")]
    XattrNameNul,
    #[error("xattr value is {0} bytes, longer than the 65535 an EROFS image holds (its length is 16 bits)")]
    XattrValueTooLong(usize),
    #[error("xattrs need {used} bytes, more than the {budget} an inode may use")]
    XattrsTooLarge { used: usize, budget: usize },
}

/// Checks that `name` can be a directory entry.
pub fn validate_name(name: &[u8]) -> Result<(), TreeError> {
    if name.is_empty() {
        return Err(TreeError::EmptyName);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(TreeError::NameTooLong(name.len()));
    }
    if name == b"." || name == b".." {
        return Err(TreeError::DotName);
    }
    if name.iter().any(|&c| c == b'/' || c == 0) {
        return Err(TreeError::BadNameChar);
    }
    Ok(())
}

/// A file tree: an arena of inodes with the root directory at [`ROOT`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tree {
    pub inodes: Vec<Inode>,
}

impl Tree {
    /// A tree holding only `root`, which must be a directory.
    pub fn new(root: Inode) -> Tree {
        debug_assert!(root.is_dir());
        Tree { inodes: vec![root] }
    }

    pub fn root(&self) -> &Inode {
        &self.inodes[ROOT as usize]
    }

    pub fn inode(&self, id: InodeId) -> &Inode {
        &self.inodes[id as usize]
    }

    pub fn inode_mut(&mut self, id: InodeId) -> &mut Inode {
        &mut self.inodes[id as usize]
    }

    /// Adds an inode to the arena (not yet linked anywhere).
    pub fn add_inode(&mut self, inode: Inode) -> InodeId {
        let id = self.inodes.len() as InodeId;
        self.inodes.push(inode);
        id
    }

    /// Adds the entry `name` -> `child` to directory `dir`, keeping entries
    /// sorted.
    pub fn link(&mut self, dir: InodeId, name: &[u8], child: InodeId, hardlink: bool) -> Result<(), TreeError> {
        validate_name(name)?;
        let d = &mut self.inodes[dir as usize];
        if !d.is_dir() {
            return Err(TreeError::NotADirectory);
        }
        // Sources usually arrive sorted: check the end first.
        let pos = match d.entries.last() {
            Some(last) if last.name.as_slice() < name => d.entries.len(),
            None => 0,
            _ => match d.find_entry(name) {
                Ok(_) => return Err(TreeError::Exists),
                Err(pos) => pos,
            },
        };
        d.entries.insert(
            pos,
            Entry {
                name: name.to_vec(),
                inode: child,
                hardlink,
            },
        );
        Ok(())
    }

    /// Adds `inode` as a new primary entry `name` in `dir`.
    pub fn add_child(&mut self, dir: InodeId, name: &[u8], inode: Inode) -> Result<InodeId, TreeError> {
        validate_name(name)?;
        if !self.inodes[dir as usize].is_dir() {
            return Err(TreeError::NotADirectory);
        }
        if self.inodes[dir as usize].find_entry(name).is_ok() {
            return Err(TreeError::Exists);
        }
        let id = self.add_inode(inode);
        self.link(dir, name, id, false)?;
        Ok(id)
    }

    /// Resolves a `/`-separated path from the root (leading, repeated and
    /// trailing slashes ignored).
    pub fn lookup_path(&self, path: &[u8]) -> Option<InodeId> {
        let mut cur = ROOT;
        for comp in path.split(|&c| c == b'/').filter(|c| !c.is_empty()) {
            let inode = self.inode(cur);
            if !inode.is_dir() {
                return None;
            }
            cur = inode.entry(comp)?.inode;
        }
        Some(cur)
    }

    /// Number of inodes reachable from the root (hardlinks counted once).
    pub fn len(&self) -> usize {
        self.inodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inodes.is_empty()
    }

    /// Visits every entry depth-first in name order, with its full path
    /// (starting with `/`). The root is visited first with path `/`.
    pub fn walk(&self, mut f: impl FnMut(&[u8], Option<&Entry>, InodeId)) {
        let mut path = Vec::with_capacity(256);
        path.push(b'/');
        f(&path, None, ROOT);
        self.walk_dir(ROOT, &mut path, &mut f);
    }

    fn walk_dir(&self, dir: InodeId, path: &mut Vec<u8>, f: &mut impl FnMut(&[u8], Option<&Entry>, InodeId)) {
        let base = path.len();
        for e in &self.inode(dir).entries {
            if base > 1 {
                path.push(b'/');
            }
            path.extend_from_slice(&e.name);
            f(path, Some(e), e.inode);
            if !e.hardlink && self.inode(e.inode).is_dir() {
                self.walk_dir(e.inode, path, f);
            }
            path.truncate(base);
        }
    }
}

/// Lower-case hex of a digest.
pub fn digest_hex(d: &[u8; 32]) -> String {
    hex::encode(d)
}

/// The object path of a digest in a store: `XX/YYYY…` (62 hex digits after
/// the slash).
pub fn digest_object_path(d: &[u8; 32]) -> String {
    let h = hex::encode(d);
    format!("{}/{}", &h[..2], &h[2..])
}

impl fmt::Display for FileType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
