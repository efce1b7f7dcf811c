//! Opening objects from the store and checking them against the image.
//!
//! Only store-relative paths of plain components (as overlayfs follows a
//! data-only redirect) are ever opened, relative to the store's directory fd, with symlinks refused at
//! every component: nothing an image says can reach outside the store.
//!
//! An object's fs-verity digest is computed once and remembered together
//! with the identity and change state of the file it was computed from
//! (device, inode, size, mtime, ctime). A later open of the same object
//! finds the record and skips the work when the file is unchanged; any
//! change (rewrite, rename over, chmod, touch) makes the stat differ and
//! the object is hashed again.

use rustc_hash::FxHashMap;
use rustix::fs::{fstat, openat2, Mode, OFlags, ResolveFlags};
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use tilefs_image::verity::digest_file;
pub(crate) use tilefs_store::FileState;

/// Why an object cannot be served.
#[derive(Debug)]
pub(crate) enum ObjectError {
    /// The image's payload is not an object path.
    BadPath,
    Open(std::io::Error),
    NotRegular,
    Read(std::io::Error),
    /// The object's digest differs from the image's.
    Mismatch {
        found: [u8; 32],
    },
    /// Verity::Require and the image has no digest for the file.
    NoDigest,
    /// The object was absent and fetching it failed (a lazily pulled image).
    Fetch(String),
}

impl std::fmt::Display for ObjectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ObjectError::BadPath => f.write_str("the image's redirect is not a path inside the store"),
            ObjectError::Open(e) => write!(f, "cannot open the object: {e}"),
            ObjectError::NotRegular => f.write_str("the object is not a regular file"),
            ObjectError::Read(e) => write!(f, "cannot read the object: {e}"),
            ObjectError::Mismatch { found } => write!(
                f,
                "fs-verity digest mismatch: the object's is {}",
                tilefs_image::tree::digest_hex(found)
            ),
            ObjectError::NoDigest => f.write_str("the image has no digest for this file and verity is required"),
            ObjectError::Fetch(why) => f.write_str(why),
        }
    }
}

/// The store-relative path of a redirect, if the kernel's overlayfs would
/// follow it inside a data-only layer: one or more plain components
/// (optionally after a leading `/`), none empty, `.` or `..`. This takes in
/// composefs's `XX/<62 hex>` names and ostree's `XX/<62 hex>.file` alike;
/// what the object must hold is the image's digest, not its name.
fn store_relative(rel: &[u8]) -> Option<&str> {
    let rel = rel.strip_prefix(b"/").unwrap_or(rel);
    let path = std::str::from_utf8(rel).ok()?;
    let plain = |c: &str| !c.is_empty() && c != "." && c != ".." && !c.contains('\0');
    (!path.is_empty() && path.split('/').all(plain)).then_some(path)
}

/// Opens `rel` (an object path from the image) under `store`, read-only,
/// refusing symlinks and anything but a regular file.
///
/// The open itself never blocks: O_NONBLOCK keeps a FIFO planted in the
/// store from holding the worker until a writer comes (and O_NOCTTY a
/// terminal from becoming ours); the type is checked on the descriptor
/// before anything is read from it.
pub(crate) fn open_object(store: impl AsFd, rel: &[u8]) -> Result<File, ObjectError> {
    let path = store_relative(rel).ok_or(ObjectError::BadPath)?;
    let fd: OwnedFd = openat2(
        store,
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| ObjectError::Open(e.into()))?;
    let st = fstat(&fd).map_err(|e| ObjectError::Open(e.into()))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(ObjectError::NotRegular);
    }
    // A placeholder (not fetched yet) is no object: a lazy mount fetches it.
    if tilefs_store::placeholder::is_placeholder(&st) {
        return Err(ObjectError::Open(std::io::ErrorKind::NotFound.into()));
    }
    // Back to blocking reads, as for any regular file.
    rustix::fs::fcntl_setfl(&fd, OFlags::empty()).map_err(|e| ObjectError::Open(e.into()))?;
    Ok(File::from(fd))
}

/// Digests already checked, each with the file state it was checked on.
#[derive(Default)]
pub(crate) struct VerifiedObjects {
    map: Mutex<FxHashMap<[u8; 32], FileState>>,
    /// Objects being hashed now: others wanting the same one wait for that
    /// result instead of hashing it again.
    busy: Mutex<FxHashMap<[u8; 32], Arc<Mutex<()>>>>,
}

impl VerifiedObjects {
    /// Checks `f` (opened from the object named by `digest`) against
    /// `digest`, unless the same file in the same state was checked before.
    /// Returns the state it was checked in.
    pub(crate) fn check(&self, f: &File, digest: &[u8; 32]) -> Result<FileState, ObjectError> {
        let key = FileState::of_fd(f).map_err(ObjectError::Read)?;
        if self.map.lock().unwrap().get(digest) == Some(&key) {
            return Ok(key);
        }
        let slot = self.busy.lock().unwrap().entry(*digest).or_default().clone();
        let _hashing = slot.lock().unwrap_or_else(|p| p.into_inner());
        if self.map.lock().unwrap().get(digest) == Some(&key) {
            return Ok(key);
        }
        let result = self.hash_and_record(f, digest, key);
        self.busy.lock().unwrap().remove(digest);
        result
    }

    fn hash_and_record(&self, f: &File, digest: &[u8; 32], key: FileState) -> Result<FileState, ObjectError> {
        tilefs_fuse_proto::may_block();
        let found = digest_file(f, |_| {}).map_err(ObjectError::Read)?;
        // The file may have changed while it was read: only a digest taken
        // of one unchanged state counts.
        let after = FileState::of_fd(f).map_err(ObjectError::Read)?;
        if found != *digest {
            self.map.lock().unwrap().remove(digest);
            return Err(ObjectError::Mismatch { found });
        }
        if after != key {
            return Err(ObjectError::Read(std::io::Error::other(
                "the object changed while it was being verified",
            )));
        }
        self.map.lock().unwrap().insert(*digest, key);
        Ok(key)
    }

    /// Whether `digest` is recorded as verified in state `key`.
    pub(crate) fn is_verified(&self, digest: &[u8; 32], key: &FileState) -> bool {
        self.map.lock().unwrap().get(digest) == Some(key)
    }

    /// Before more of an object opened in state `key` is served: passes if
    /// the file is still in that state (or another verified one), and
    /// otherwise hashes it again.
    pub(crate) fn recheck(&self, f: &File, digest: &[u8; 32], key: &FileState) -> Result<(), ObjectError> {
        let now = FileState::of_fd(f).map_err(ObjectError::Read)?;
        if now == *key || self.is_verified(digest, &now) {
            return Ok(());
        }
        self.check(f, digest).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use tilefs_image::verity::digest_bytes;

    fn store_with(data: &[u8]) -> (tempfile::TempDir, OwnedFd, String, [u8; 32]) {
        let tmp = tempfile::tempdir().unwrap();
        let d = digest_bytes(data);
        let rel = tilefs_image::tree::digest_object_path(&d);
        fs::create_dir_all(tmp.path().join(&rel[..2])).unwrap();
        fs::write(tmp.path().join(&rel), data).unwrap();
        let fd = File::open(tmp.path()).unwrap().into();
        (tmp, fd, rel, d)
    }

    #[test]
    fn only_object_paths_inside_the_store_open() {
        let (tmp, store, rel, _) = store_with(b"some object contents");
        assert!(open_object(&store, rel.as_bytes()).is_ok());
        assert!(open_object(&store, format!("/{rel}").as_bytes()).is_ok());
        for bad in ["../etc/passwd", "ab/../../x", "ab//cd", "./ab", "", "/", "ab/"] {
            assert!(
                matches!(open_object(&store, bad.as_bytes()), Err(ObjectError::BadPath)),
                "{bad}"
            );
        }
        // A symlinked fan-out directory or object is refused.
        let other = tilefs_image::tree::digest_object_path(&[0x11; 32]);
        std::os::unix::fs::symlink("/etc", tmp.path().join(&other[..2])).unwrap();
        assert!(matches!(
            open_object(&store, other.as_bytes()),
            Err(ObjectError::Open(_))
        ));
        let third = tilefs_image::tree::digest_object_path(&[0x22; 32]);
        fs::create_dir(tmp.path().join(&third[..2])).unwrap();
        std::os::unix::fs::symlink(tmp.path().join(&rel), tmp.path().join(&third)).unwrap();
        assert!(matches!(
            open_object(&store, third.as_bytes()),
            Err(ObjectError::Open(_))
        ));
    }

    #[test]
    fn changes_after_verification_are_caught() {
        let (tmp, store, rel, d) = store_with(&[7u8; 10000]);
        let v = VerifiedObjects::default();
        let f = open_object(&store, rel.as_bytes()).unwrap();
        let key = v.check(&f, &d).unwrap();
        assert!(v.is_verified(&d, &key));
        assert_eq!(
            v.check(&f, &d).unwrap(),
            key,
            "a second check of the same state is free"
        );
        let mut bad = vec![7u8; 10000];
        bad[5000] = 8;
        fs::write(tmp.path().join(&rel), &bad).unwrap();
        let f = open_object(&store, rel.as_bytes()).unwrap();
        assert!(matches!(v.check(&f, &d), Err(ObjectError::Mismatch { .. })));
        fs::write(tmp.path().join(&rel), [7u8; 10000]).unwrap();
        let f = open_object(&store, rel.as_bytes()).unwrap();
        assert!(v.check(&f, &d).is_ok());
    }
}
