//! Images whose objects are fetched on demand (`tilefs pull --lazy`).
//!
//! Such an image is tagged before its objects are all here: a record in
//! `STORE/.remote/<image fs-verity digest>` says where they can be fetched
//! from. Its contents belong to whoever fetches (the OCI crate); the store
//! only knows that the record exists, so that fsck counts the absent
//! objects of these images as not yet fetched rather than as damage, gc
//! drops records of images no longer tagged, and a kernel mount (which
//! cannot fetch) is refused until the store is complete.

use crate::{Store, StoreError};
use std::collections::HashSet;
use std::path::PathBuf;

/// Where the records live, under the store.
pub use crate::layout::REMOTE_DIR;

/// Fetches objects the store lacks, each checked against its digest and
/// stored under its final name only when complete.
pub trait ObjectSource: Send + Sync {
    /// Makes the object `digest`, of `size` bytes as the image says,
    /// present in the store, or says why it cannot (the message names the
    /// object and where it was fetched from).
    fn fetch(&self, digest: &[u8; 32], size: u64) -> Result<(), String>;

    /// Starts what a first fetch needs (a registry client: its
    /// certificates, credentials, signature policy), so that the first
    /// reader does not wait for it. Failures are the first fetch's to say.
    fn warm(&self) {}
}

/// The record of the image whose fs-verity digest is `image`.
pub fn record_path(store: &Store, image: &[u8; 32]) -> PathBuf {
    store.join(REMOTE_DIR).join(hex::encode(image))
}

/// Whether the image `image` was pulled lazily and not yet completed.
pub fn is_lazy(store: &Store, image: &[u8; 32]) -> bool {
    std::fs::symlink_metadata(record_path(store, image)).is_ok_and(|m| m.file_type().is_file())
}

/// The images with a record (usually none: then no caller need hash an
/// image to ask whether it is one of them).
pub fn records(store: &Store) -> HashSet<[u8; 32]> {
    let dir = store.join(REMOTE_DIR);
    // A real directory of the store, never one a symlink points to.
    if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
        return HashSet::new();
    }
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return HashSet::new();
    };
    rd.flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| {
            let name = e.file_name();
            let mut d = [0u8; 32];
            hex::decode_to_slice(name.to_str()?, &mut d).ok()?;
            Some(d)
        })
        .collect()
}

/// Forgets the record of `image` (its objects are all present now, or the
/// image is gone).
pub fn forget(store: &Store, image: &[u8; 32]) -> Result<(), StoreError> {
    let path = record_path(store, image);
    // Through the real directory, never one a symlink points to.
    let removed = store.open_existing_subdir(REMOTE_DIR).and_then(|dir| {
        rustix::fs::unlinkat(&dir, hex::encode(image), rustix::fs::AtFlags::empty()).map_err(Into::into)
    });
    match removed {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io(&path, "cannot remove", e)),
    }
}

/// Removes the records of `images` (gc: those no tag or mount names).
pub(crate) fn prune(store: &Store, images: impl IntoIterator<Item = [u8; 32]>) {
    for d in images {
        let _ = forget(store, &d);
    }
}

/// An image pulled lazily whose objects are not all here yet.
#[derive(Debug, Clone, Copy)]
pub struct Incomplete {
    /// The image's fs-verity digest (its record's name).
    pub digest: [u8; 32],
    /// Objects the store still lacks, of those the image needs.
    pub absent: usize,
    pub total: usize,
}

/// For an image (its bytes) pulled lazily: what the store still lacks.
/// None when the image was not pulled lazily or is complete now (its
/// record is then dropped). A store without records costs one stat.
pub fn incomplete(store: &Store, image: &[u8]) -> Option<Incomplete> {
    let records = records(store);
    if records.is_empty() {
        return None;
    }
    let digest = tilefs_image::verity::digest_bytes(image);
    if !records.contains(&digest) {
        return None;
    }
    let (tree, _) = tilefs_image::erofs::read_image(image).ok()?;
    let objects = tilefs_image::summary::objects(&tree);
    let total = objects.len();
    let mut digests = Vec::with_capacity(total);
    let mut bad = 0;
    for p in objects {
        match crate::parse_object_rel(p) {
            Some(d) => digests.push(d),
            // An image pulled from a table of contents names its files by
            // alias until they are fetched.
            None => match crate::alias::parse_alias_rel(p) {
                Some(d) if crate::alias::size(store, &d).is_some() => {}
                _ => bad += 1,
            },
        }
    }
    let absent = crate::presence::absent(store, digests).len() + bad;
    if absent == 0 {
        let _ = forget(store, &digest);
        return None;
    }
    Some(Incomplete { digest, absent, total })
}

impl std::fmt::Display for Incomplete {
    /// Why a kernel mount of it is refused.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (absent, total) = (self.absent, self.total);
        write!(
            f,
            "{absent} of its {total} objects are not in the store yet (the image was pulled with --lazy): \
         `tilefs pull` it again to fetch them, or mount it with --fuse, which fetches each as it is first read"
        )
    }
}
