//! The store directory: opening it, its lock, object names and the scan of
//! its objects. What lies where under it is [`crate::layout`].

use crate::StoreError;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{self as rfs, FlockOperation, Mode, OFlags};
use std::path::{Path, PathBuf};

pub use crate::layout::{
    temp_name, DIGEST_CACHE, IMAGES_DIR, LAYER_CACHE, LOCK_FILE, NO_VERITY_NOTED, QUARANTINE_DIR, TMP_DIR, TRUST_DIR,
};

/// An open object store.
#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    dir: OwnedFd,
    /// Fan-out directories seen to be real directories (one bit each):
    /// an object in one is then found with a single stat.
    fanouts: [std::sync::atomic::AtomicU64; 4],
}

fn not_a_directory(path: &Path) -> StoreError {
    StoreError::Invalid(format!("{}: not a directory (a store is a directory)", path.display()))
}

/// Whether a lock excludes others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    /// Builds: many at once.
    Shared,
    /// gc: alone.
    Exclusive,
}

/// A held store lock; released on drop.
#[derive(Debug)]
pub struct StoreLock {
    _fd: OwnedFd,
}

impl Store {
    /// Opens an existing store directory.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let dir = rfs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            rustix::io::Errno::NOENT => StoreError::Invalid(format!("{}: no such store directory", path.display())),
            rustix::io::Errno::NOTDIR => not_a_directory(path),
            e => StoreError::io(path, "cannot open store", e.into()),
        })?;
        Ok(Store {
            root: path.to_path_buf(),
            dir,
            fanouts: Default::default(),
        })
    }

    /// Opens a store, creating its directory (and parents) if needed. A
    /// new store is mode 0700: its objects are the contents of every file
    /// of every image, whatever their modes there, so only the owner (and
    /// mounts, which check each file's own mode) may read them.
    pub fn create(path: &Path) -> Result<Store, StoreError> {
        use std::os::unix::fs::DirBuilderExt;
        if std::fs::metadata(path).is_ok_and(|m| !m.is_dir()) {
            return Err(not_a_directory(path));
        }
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| StoreError::io(parent, "cannot create store", e))?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StoreError::io(path, "cannot create store", e)),
        }
        Store::open(path)
    }

    /// Who besides the owner can read the store's objects, if anyone: a
    /// store's mode is for its owner to decide, but a store readable by
    /// every local user gives each of them every file of every image,
    /// root-only ones included.
    pub fn exposure(&self) -> Option<String> {
        let st = rfs::fstat(&self.dir).ok()?;
        let mode = st.st_mode & 0o777;
        let who = if mode & 0o005 == 0o005 {
            "every local user"
        } else if mode & 0o050 == 0o050 {
            "the members of its group"
        } else {
            return None;
        };
        Some(format!(
            "{} is mode {mode:04o}: {who} can read its objects and images, which hold the contents of every file of every image whatever their modes (chmod 700 {} unless that is meant)",
            self.root.display(),
            self.root.display()
        ))
    }

    pub fn path(&self) -> &Path {
        &self.root
    }

    pub fn dir_fd(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
    }

    /// Absolute path of a store-relative path.
    pub fn join(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.root.join(rel)
    }

    /// Store-relative path of an object.
    pub fn object_rel(digest: &[u8; 32]) -> String {
        tilefs_image::tree::digest_object_path(digest)
    }

    pub fn object_path(&self, digest: &[u8; 32]) -> PathBuf {
        self.root.join(Store::object_rel(digest))
    }

    /// Whether the object is present as a regular file.
    pub fn has_object(&self, digest: &[u8; 32]) -> bool {
        self.stat_object(digest).is_some()
    }

    /// Size in bytes of an object, if present.
    pub fn object_size(&self, digest: &[u8; 32]) -> Option<u64> {
        self.stat_object(digest).map(|st| st.st_size as u64)
    }

    /// Stat of an object that is a regular file reached without following
    /// any symlink: a symlinked fan-out directory or object is not an
    /// object, so nothing outside the store can pass for one. The fan-out
    /// directory is checked once (it is a directory, not a symlink); each
    /// object then costs one stat, not an open, a stat and a close (a
    /// build of 50k files with every object present asks 50k times).
    fn stat_object(&self, digest: &[u8; 32]) -> Option<rfs::Stat> {
        use std::sync::atomic::Ordering::Relaxed;
        let fan = digest[0] as usize;
        let (word, bit) = (&self.fanouts[fan / 64], 1u64 << (fan % 64));
        if word.load(Relaxed) & bit == 0 {
            let st = rfs::statat(&self.dir, format!("{fan:02x}"), rfs::AtFlags::SYMLINK_NOFOLLOW).ok()?;
            if rfs::FileType::from_raw_mode(st.st_mode) != rfs::FileType::Directory {
                return None;
            }
            word.fetch_or(bit, Relaxed);
        }
        rfs::statat(&self.dir, Store::object_rel(digest), rfs::AtFlags::SYMLINK_NOFOLLOW)
            .ok()
            .filter(|st| rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::RegularFile)
            // A placeholder is no object (not fetched yet).
            .filter(|st| !crate::placeholder::is_placeholder(st))
    }

    /// Creates (if needed) a store subdirectory and opens it, refusing
    /// anything but a real directory (never a symlink: in a store others may
    /// write, one would lead our writes out of the store).
    pub fn open_subdir(&self, name: &str) -> Result<OwnedFd, StoreError> {
        let path = self.subdir(name)?;
        self.open_existing_subdir(name)
            .map_err(|e| StoreError::io(&path, "cannot open directory", e))
    }

    /// Opens an existing store subdirectory without following a symlink.
    pub fn open_existing_subdir(&self, name: &str) -> std::io::Result<OwnedFd> {
        rfs::openat(
            &self.dir,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            if e == rustix::io::Errno::LOOP || e == rustix::io::Errno::NOTDIR {
                std::io::Error::other("not a directory (a symlink or file where the store keeps a directory)")
            } else {
                e.into()
            }
        })
    }

    /// Opens (creating it if needed) the fan-out directory `XX` of an object
    /// about to be stored; a symlink or file in its place is refused, never
    /// written through.
    pub fn open_fanout(&self, digest: &[u8; 32]) -> Result<OwnedFd, StoreError> {
        self.open_subdir(&format!("{:02x}", digest[0]))
    }

    /// Creates (if needed) and returns a store subdirectory.
    pub fn subdir(&self, name: &str) -> Result<PathBuf, StoreError> {
        match rfs::mkdirat(&self.dir, name, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => Ok(self.root.join(name)),
            Err(e) => Err(StoreError::io(
                &self.root.join(name),
                "cannot create directory",
                e.into(),
            )),
        }
    }

    /// Takes the store lock, waiting for it when `wait` (otherwise failing
    /// with [`StoreError::Busy`]).
    pub fn lock(&self, mode: LockMode, wait: bool) -> Result<StoreLock, StoreError> {
        let path = self.root.join(LOCK_FILE);
        let fd = rfs::openat(
            &self.dir,
            LOCK_FILE,
            OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )
        .map_err(|e| StoreError::io(&path, "cannot open lock file", e.into()))?;
        let op = match (mode, wait) {
            (LockMode::Shared, true) => FlockOperation::LockShared,
            (LockMode::Shared, false) => FlockOperation::NonBlockingLockShared,
            (LockMode::Exclusive, true) => FlockOperation::LockExclusive,
            (LockMode::Exclusive, false) => FlockOperation::NonBlockingLockExclusive,
        };
        match rfs::flock(&fd, op) {
            Ok(()) => Ok(StoreLock { _fd: fd }),
            Err(rustix::io::Errno::WOULDBLOCK) => Err(StoreError::Busy(self.root.clone())),
            Err(e) => Err(StoreError::io(&path, "cannot lock store", e.into())),
        }
    }

    /// Every entry under the 256 fan-out directories: valid objects with
    /// their digests, and anything else as stray paths.
    pub fn scan_objects(&self) -> Result<ObjectScan, StoreError> {
        let mut scan = ObjectScan::default();
        let top = std::fs::read_dir(&self.root).map_err(|e| StoreError::io(&self.root, "cannot list store", e))?;
        for entry in top {
            let entry = entry.map_err(|e| StoreError::io(&self.root, "cannot list store", e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                scan.strays.push(entry.path());
                continue;
            };
            if crate::layout::BOOKKEEPING.contains(&name) {
                continue;
            }
            if name.starts_with(".tmp") {
                // The reference's temporary objects (STORE/.tmpXXXXXX).
                scan.leftovers.push(entry.path());
                continue;
            }
            let is_fanout = name.len() == 2 && name.bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase());
            let ft = entry
                .file_type()
                .map_err(|e| StoreError::io(&entry.path(), "cannot stat", e))?;
            if !is_fanout || !ft.is_dir() {
                scan.strays.push(entry.path());
                continue;
            }
            let sub = std::fs::read_dir(entry.path()).map_err(|e| StoreError::io(&entry.path(), "cannot list", e))?;
            for obj in sub {
                let obj = obj.map_err(|e| StoreError::io(&entry.path(), "cannot list", e))?;
                let rest = obj.file_name();
                let digest = rest
                    .to_str()
                    .and_then(|r| parse_object_rel(format!("{name}/{r}").as_bytes()))
                    .filter(|_| obj.file_type().is_ok_and(|t| t.is_file()));
                match digest {
                    Some(d) => scan.objects.push((d, obj.path())),
                    None => scan.strays.push(obj.path()),
                }
            }
        }
        let tmp = self.root.join(TMP_DIR);
        if let Ok(rd) = std::fs::read_dir(&tmp) {
            for e in rd.flatten() {
                scan.leftovers.push(e.path());
            }
        }
        scan.objects.sort();
        Ok(scan)
    }
}

/// What is under a store's fan-out directories.
#[derive(Debug, Default)]
pub struct ObjectScan {
    /// Well-named objects (digest, path), sorted by digest.
    pub objects: Vec<([u8; 32], PathBuf)>,
    /// Entries that are not objects (bad names, non-files, unknown dirs).
    pub strays: Vec<PathBuf>,
    /// Temporary files of interrupted imports.
    pub leftovers: Vec<PathBuf>,
}

/// The digest named by a store-relative object path (`XX/` + 62 lower-case
/// hex digits), or None for anything else. This is the only form of
/// redirect tilefs follows, so no path from an image can leave the store.
pub fn parse_object_rel(rel: &[u8]) -> Option<[u8; 32]> {
    let rel = rel.strip_prefix(b"/").unwrap_or(rel);
    if rel.len() != 65 || rel[2] != b'/' {
        return None;
    }
    let mut hexdigits = [0u8; 64];
    hexdigits[..2].copy_from_slice(&rel[..2]);
    hexdigits[2..].copy_from_slice(&rel[3..]);
    if !hexdigits
        .iter()
        .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    {
        return None;
    }
    let mut d = [0u8; 32];
    hex::decode_to_slice(hexdigits, &mut d).ok()?;
    Some(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_names() {
        let d = [0xabu8; 32];
        let rel = Store::object_rel(&d);
        assert_eq!(rel.len(), 65);
        assert_eq!(parse_object_rel(rel.as_bytes()), Some(d));
        assert_eq!(parse_object_rel(format!("/{rel}").as_bytes()), Some(d));
        assert_eq!(parse_object_rel(rel.to_uppercase().as_bytes()), None);
        assert_eq!(parse_object_rel(b"../etc/passwd"), None);
        assert_eq!(parse_object_rel(format!("ab/../{}", &rel[6..]).as_bytes()), None);
    }

    #[test]
    fn symlinked_fanout_is_not_an_object() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let s = Store::create(dir.path()).unwrap();
        let d = [0x5au8; 32];
        let rel = Store::object_rel(&d);
        std::fs::write(outside.path().join(&rel[3..]), b"outside").unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join(&rel[..2])).unwrap();
        assert!(!s.has_object(&d));
        std::fs::remove_file(dir.path().join(&rel[..2])).unwrap();
        std::fs::create_dir(dir.path().join(&rel[..2])).unwrap();
        std::fs::write(dir.path().join(&rel), b"inside").unwrap();
        assert_eq!(s.object_size(&d), Some(6));
    }

    #[test]
    fn locks_exclude() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(dir.path()).unwrap();
        let a = s.lock(LockMode::Shared, false).unwrap();
        let _b = s.lock(LockMode::Shared, false).unwrap();
        assert!(matches!(s.lock(LockMode::Exclusive, false), Err(StoreError::Busy(_))));
        drop(a);
        drop(_b);
        let _c = s.lock(LockMode::Exclusive, false).unwrap();
    }
}

/// Opens `path` (relative to `dir`) for reading, without blocking whatever
/// it turns out to be, and only if it is a regular file: a FIFO or device
/// planted in a store or a layout must not hang the reader. With `follow`
/// false, a symlink is refused too.
pub fn open_regular(dir: impl AsFd, path: &Path, follow: bool) -> std::io::Result<std::fs::File> {
    let nofollow = if follow { OFlags::empty() } else { OFlags::NOFOLLOW };
    let fd = rfs::openat(
        dir,
        path,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK | OFlags::NOCTTY | nofollow,
        Mode::empty(),
    )?;
    if rfs::FileType::from_raw_mode(rfs::fstat(&fd)?.st_mode) != rfs::FileType::RegularFile {
        return Err(std::io::Error::other("not a regular file"));
    }
    // Known regular: read it as any other.
    rfs::fcntl_setfl(&fd, OFlags::empty())?;
    Ok(std::fs::File::from(fd))
}

/// The store a command uses when not given `--store`: `$TILEFS_STORE`
/// (relative to the working directory if relative), else
/// `/var/lib/tilefs/store` for root and `$XDG_DATA_HOME/tilefs/store`
/// (`~/.local/share/tilefs/store`) for other users.
pub fn default_store_path() -> Result<PathBuf, StoreError> {
    default_store_path_from(
        rustix::process::geteuid().is_root(),
        std::env::var_os("TILEFS_STORE"),
        std::env::var_os("XDG_DATA_HOME"),
        std::env::var_os("HOME"),
    )
}

fn default_store_path_from(
    root: bool,
    tilefs_store: Option<std::ffi::OsString>,
    xdg_data_home: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
) -> Result<PathBuf, StoreError> {
    // $TILEFS_STORE is ours: a relative one is resolved against the
    // working directory, as --store is. Empty or relative XDG values are
    // ignored, as the XDG spec says.
    if let Some(p) = tilefs_store.filter(|v| !v.is_empty()) {
        return std::path::absolute(&p)
            .map_err(|e| StoreError::Invalid(format!("$TILEFS_STORE {}: {e}", PathBuf::from(&p).display())));
    }
    let absolute = |v: Option<std::ffi::OsString>| v.map(PathBuf::from).filter(|p| p.is_absolute());
    if root {
        return Ok(PathBuf::from("/var/lib/tilefs/store"));
    }
    if let Some(d) = absolute(xdg_data_home) {
        return Ok(d.join("tilefs/store"));
    }
    if let Some(h) = absolute(home) {
        return Ok(h.join(".local/share/tilefs/store"));
    }
    Err(StoreError::Invalid(
        "no store given, and no default: set $TILEFS_STORE, $XDG_DATA_HOME or $HOME, or pass --store".into(),
    ))
}

#[cfg(test)]
mod default_store_tests {
    use super::default_store_path_from as d;
    use std::path::PathBuf;

    #[test]
    fn default_store() {
        let s = |v: &str| Some(v.into());
        assert_eq!(d(true, s("/x"), None, None).unwrap(), PathBuf::from("/x"));
        assert_eq!(
            d(true, s("rel"), s("/d"), s("/h")).unwrap(),
            std::env::current_dir().unwrap().join("rel")
        );
        assert_eq!(
            d(true, s(""), s("/d"), s("/h")).unwrap(),
            PathBuf::from("/var/lib/tilefs/store")
        );
        assert_eq!(
            d(false, None, s("/d"), s("/h")).unwrap(),
            PathBuf::from("/d/tilefs/store")
        );
        assert_eq!(
            d(false, s(""), s(""), s("/h")).unwrap(),
            PathBuf::from("/h/.local/share/tilefs/store")
        );
        assert!(d(false, None, None, None).is_err());
    }
}
