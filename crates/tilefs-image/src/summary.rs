//! What a tree holds: counts by file type, sizes, referenced objects.

use crate::tree::{FileType, Tree};
use std::collections::BTreeSet;

/// Counts and sizes of a tree, as `tilefs info` reports them.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Summary {
    pub inodes: u64,
    pub directories: u64,
    pub regular_files: u64,
    pub symlinks: u64,
    pub block_devices: u64,
    pub char_devices: u64,
    pub fifos: u64,
    pub sockets: u64,
    pub whiteouts: u64,
    /// Entries beyond the first for inodes with several names.
    pub hardlinks: u64,
    /// Regular files whose contents live in the image.
    pub inline_files: u64,
    pub inline_bytes: u64,
    /// Regular files whose contents live in the store.
    pub external_files: u64,
    pub external_bytes: u64,
    /// Distinct objects referenced.
    pub objects: u64,
    /// External files without an fs-verity digest.
    pub unverified_files: u64,
}

/// Summarises `tree`.
pub fn summarize(tree: &Tree) -> Summary {
    let mut s = Summary::default();
    let mut objects = BTreeSet::new();
    tree.walk(|_, entry, id| {
        if entry.is_some_and(|e| e.hardlink) {
            s.hardlinks += 1;
            return;
        }
        let inode = tree.inode(id);
        s.inodes += 1;
        match inode.file_type() {
            Some(FileType::Directory) => s.directories += 1,
            Some(FileType::Regular) => {
                s.regular_files += 1;
                if let Some(c) = &inode.content {
                    s.inline_files += 1;
                    s.inline_bytes += c.len() as u64;
                } else if inode.size > 0 {
                    s.external_files += 1;
                    s.external_bytes += inode.size;
                    if inode.digest.is_none() {
                        s.unverified_files += 1;
                    }
                    if let Some(p) = &inode.payload {
                        objects.insert(p.as_slice());
                    }
                }
            }
            Some(FileType::Symlink) => s.symlinks += 1,
            Some(FileType::BlockDevice) => s.block_devices += 1,
            Some(FileType::CharDevice) if inode.is_whiteout() => s.whiteouts += 1,
            Some(FileType::CharDevice) => s.char_devices += 1,
            Some(FileType::Fifo) => s.fifos += 1,
            Some(FileType::Socket) => s.sockets += 1,
            None => {}
        }
    });
    s.objects = objects.len() as u64;
    s
}

/// Distinct object paths (payloads of external regular files), sorted.
pub fn objects(tree: &Tree) -> BTreeSet<&[u8]> {
    tree.inodes
        .iter()
        .filter(|i| i.is_external())
        .filter_map(|i| i.payload.as_deref())
        .filter(|p| !p.is_empty())
        .collect()
}
