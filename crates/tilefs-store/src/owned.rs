//! Images tilefs components hold: `STORE/.owned/OWNER/NAME`, gc roots
//! that are not the user's.
//!
//! A component that keeps images alive for something only it knows of (the
//! containerd snapshotter, for its committed snapshots) holds them here,
//! apart from the user's tags: `tilefs untag` refuses them, naming the
//! holder, and `tilefs images` lists them in a section of their own. gc
//! keeps their objects like a tag's.
//!
//! Each holder has a directory, named by its id, with a record of who it
//! is (`.owner`, JSON: `{"kind":"containerd-snapshotter","root":"/var/lib/tilefs/snapshotter"}`,
//! written first) and its images, written and read as tags are (see
//! [`crate::tags`]). A holder that is gone for good (its state directory
//! removed) leaves its images behind: they stay roots, `fsck` reports them
//! and `tilefs untag --orphaned` lets them go; nothing is collected
//! silently.

use crate::layout::{temp_name, TMP_DIR};
use crate::tags::{self, TagInfo};
use crate::{Store, StoreError};
use rustix::fd::OwnedFd;
use rustix::fs::{self as rfs, AtFlags, Mode, OFlags};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

pub use crate::layout::{OWNED_DIR, OWNER_FILE};
/// The largest holder record read.
pub const MAX_OWNER_RECORD: u64 = 16 << 10;

/// Who holds images.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Holder {
    /// `tilefs snapshotter --root ROOT`: the images of its committed
    /// snapshots' chains, one per snapshot.
    ContainerdSnapshotter { root: PathBuf },
    /// `tilefs layer-store`: the image of each layer podman uses, while it
    /// uses it (`state` is the layer store's state directory).
    LayerStore { state: PathBuf },
}

impl Holder {
    /// Its directory's name: the kind and a digest of what tells holders
    /// of that kind apart (12 hex digits of the SHA-256 of the root).
    pub fn id(&self) -> String {
        match self {
            Holder::ContainerdSnapshotter { root } => {
                let d = <sha2::Sha256 as sha2::Digest>::digest(root.as_os_str().as_bytes());
                format!("snapshotter-{}", &hex::encode(d)[..12])
            }
            Holder::LayerStore { state } => {
                let d = <sha2::Sha256 as sha2::Digest>::digest(state.as_os_str().as_bytes());
                format!("layer-store-{}", &hex::encode(d)[..12])
            }
        }
    }

    /// "the containerd snapshotter at ROOT".
    pub fn describe(&self) -> String {
        match self {
            Holder::ContainerdSnapshotter { root } => {
                format!(
                    "the containerd snapshotter at {}",
                    root.display().to_string().escape_debug()
                )
            }
            Holder::LayerStore { state } => format!(
                "the podman layer store with state {}",
                state.display().to_string().escape_debug()
            ),
        }
    }

    /// When an image it holds goes.
    pub fn released_when(&self) -> &'static str {
        match self {
            Holder::ContainerdSnapshotter { .. } => "it goes when containerd removes the snapshot that uses it",
            Holder::LayerStore { .. } => "it goes when podman removes the last of its images that uses the layer",
        }
    }

    /// Why the holder is gone for good, if it is: its state is no longer
    /// there (not merely unreadable).
    pub fn gone(&self) -> Option<String> {
        match self {
            Holder::ContainerdSnapshotter { root } => {
                let metadata = root.join("metadata");
                match std::fs::symlink_metadata(&metadata) {
                    Ok(m) if m.is_dir() => None,
                    Ok(_) => Some(format!("{} is not a directory", metadata.display())),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Some(if root.exists() {
                        format!("{} holds no snapshotter state (no metadata directory)", root.display())
                    } else {
                        format!("{} does not exist", root.display())
                    }),
                    Err(_) => None,
                }
            }
            Holder::LayerStore { state } => (!state.exists()).then(|| format!("{} does not exist", state.display())),
        }
    }

    /// A holder record's bytes, read back.
    pub fn parse(bytes: &[u8]) -> Result<Holder, String> {
        if bytes.len() as u64 > MAX_OWNER_RECORD {
            return Err(format!("larger than {MAX_OWNER_RECORD} bytes"));
        }
        let h: Holder = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        match &h {
            Holder::ContainerdSnapshotter { root } | Holder::LayerStore { state: root } if !root.is_absolute() => {
                Err(format!("the root {} is not absolute", root.display()))
            }
            _ => Ok(h),
        }
    }
}

/// An image a holder has, found by name.
#[derive(Debug)]
pub struct Held {
    pub owner_id: String,
    /// Its record, or why it cannot be read.
    pub holder: Result<Holder, String>,
    pub path: PathBuf,
}

impl Held {
    /// Why `tilefs untag NAME` does not remove it.
    pub fn refusal(&self, name: &str) -> String {
        match &self.holder {
            Ok(h) => format!(
                "tag {name:?} is held by {}: {} (`tilefs untag` removes only your own tags)",
                h.describe(),
                h.released_when()
            ),
            Err(why) => format!(
                "tag {name:?} is held by tilefs ({}, whose record cannot be read: {why}); `tilefs untag` removes only \
                 your own tags",
                self.path.parent().unwrap_or(&self.path).display()
            ),
        }
    }
}

/// A holder's directory as found in the store.
#[derive(Debug)]
pub struct Owned {
    pub id: String,
    pub holder: Result<Holder, String>,
    /// Its images, sorted by name.
    pub roots: Vec<TagInfo>,
}

/// What `.owned/` holds: the holders, and everything that is not one of
/// theirs (entries that are no holder directory, or no image in one).
#[derive(Debug, Default)]
pub struct OwnedScan {
    pub owners: Vec<Owned>,
    pub others: Vec<PathBuf>,
}

impl OwnedScan {
    /// Every held image.
    pub fn roots(&self) -> impl Iterator<Item = &TagInfo> {
        self.owners.iter().flat_map(|o| &o.roots)
    }
}

fn owned_path(store: &Store) -> PathBuf {
    store.join(OWNED_DIR)
}

/// Opens `.owned/` (None if the store has none), never through a symlink.
fn open_owned(store: &Store) -> Result<Option<OwnedFd>, StoreError> {
    match store.open_existing_subdir(OWNED_DIR) {
        Ok(fd) => Ok(Some(fd)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(StoreError::io(&owned_path(store), "cannot open directory", e)),
    }
}

/// Opens holder directory `id` in `.owned` (`owned`), without following a
/// symlink; None if it is not there.
fn open_holder_dir(owned: &OwnedFd, owned_path: &Path, id: &str) -> Result<Option<OwnedFd>, StoreError> {
    match rfs::openat(
        owned,
        id,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => Ok(Some(fd)),
        Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(e) => Err(StoreError::io(
            &owned_path.join(id),
            "cannot open directory",
            if e == rustix::io::Errno::LOOP || e == rustix::io::Errno::NOTDIR {
                io::Error::other("not a directory (a symlink or file where the store keeps a directory)")
            } else {
                e.into()
            },
        )),
    }
}

/// The directory of `holder`, created with its record if need be.
fn holder_dir(store: &Store, holder: &Holder) -> Result<(OwnedFd, PathBuf), StoreError> {
    let id = holder.id();
    let owned = store.open_subdir(OWNED_DIR)?;
    let path = owned_path(store).join(&id);
    match rfs::mkdirat(&owned, id.as_str(), Mode::from_raw_mode(0o755)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(StoreError::io(&path, "cannot create directory", e.into())),
    }
    let dir = open_holder_dir(&owned, &owned_path(store), &id)?
        .ok_or_else(|| StoreError::io(&path, "cannot open directory", io::ErrorKind::NotFound.into()))?;
    if read_record(&dir).ok() != Some(holder.clone()) {
        write_record(store, &dir, &path, holder)?;
    }
    Ok((dir, path))
}

/// Reads a holder's record in its directory `dir`.
fn read_record(dir: &OwnedFd) -> Result<Holder, String> {
    let fd = rfs::openat(
        dir,
        OWNER_FILE,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    )
    .map_err(|e| match e {
        rustix::io::Errno::NOENT => "it has none".to_string(),
        rustix::io::Errno::LOOP => "a symlink".to_string(),
        e => io::Error::from(e).to_string(),
    })?;
    let st = rfs::fstat(&fd).map_err(|e| io::Error::from(e).to_string())?;
    if rfs::FileType::from_raw_mode(st.st_mode) != rfs::FileType::RegularFile {
        return Err("not a regular file".into());
    }
    let _ = rfs::fcntl_setfl(&fd, OFlags::empty());
    let mut bytes = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_OWNER_RECORD + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    Holder::parse(&bytes)
}

/// Writes `holder`'s record into its directory, whole (by rename).
fn write_record(store: &Store, dir: &OwnedFd, dir_path: &Path, holder: &Holder) -> Result<(), StoreError> {
    let path = dir_path.join(OWNER_FILE);
    let tmp = store.open_subdir(TMP_DIR)?;
    let name = temp_name("owner-");
    let fd = rfs::openat(
        &tmp,
        name.as_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o644),
    )
    .map_err(|e| StoreError::io(&store.join(TMP_DIR), "cannot create a temporary file", e.into()))?;
    let mut f = std::fs::File::from(fd);
    let bytes = serde_json::to_vec(holder).map_err(|e| StoreError::Invalid(e.to_string()))?;
    let done = f
        .write_all(&bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| StoreError::io(&path, "cannot write the holder's record", e))
        .and_then(|()| {
            rfs::renameat(&tmp, name.as_str(), dir, OWNER_FILE)
                .map_err(|e| StoreError::io(&path, "cannot write the holder's record", e.into()))
        });
    if done.is_err() {
        let _ = rfs::unlinkat(&tmp, name.as_str(), AtFlags::empty());
    }
    done?;
    rfs::fsync(dir).map_err(|e| StoreError::io(dir_path, "cannot sync directory", e.into()))
}

/// Records `holder` in the store (its directory and record), so that its
/// images name it from the first.
pub fn register(store: &Store, holder: &Holder) -> Result<(), StoreError> {
    holder_dir(store, holder).map(drop)
}

/// Where `holder` keeps image `name` (which may not exist).
pub fn root_path(store: &Store, holder: &Holder, name: &str) -> PathBuf {
    owned_path(store).join(holder.id()).join(name)
}

/// Writes `image` as `holder`'s image `name`, atomically (as a tag is
/// written: see [`tags::write_tag`], whose locking rules hold here too).
pub fn write_root(store: &Store, holder: &Holder, name: &str, image: &[u8]) -> Result<PathBuf, StoreError> {
    tags::validate_tag(name)?;
    let (dir, path) = holder_dir(store, holder)?;
    tags::write_image_in(store, &dir, &path, name, image)
}

/// Removes `holder`'s image `name`; false if it had none. Under the store
/// lock, shared, as [`tags::remove_tag`].
pub fn remove_root(store: &Store, holder: &Holder, name: &str) -> Result<bool, StoreError> {
    tags::validate_tag(name)?;
    let _lock = store.lock(crate::LockMode::Shared, true)?;
    let Some(owned) = open_owned(store)? else {
        return Ok(false);
    };
    let dir_path = owned_path(store).join(holder.id());
    let Some(dir) = open_holder_dir(&owned, &owned_path(store), &holder.id())? else {
        return Ok(false);
    };
    match rfs::unlinkat(&dir, name, AtFlags::empty()) {
        Ok(()) => {}
        Err(rustix::io::Errno::NOENT) => return Ok(false),
        Err(e) => return Err(StoreError::io(&dir_path.join(name), "cannot remove image", e.into())),
    }
    rfs::fsync(&dir).map_err(|e| StoreError::io(&dir_path, "cannot sync directory", e.into()))?;
    Ok(true)
}

/// Makes the user's tag `name` (of a tilefs before holders had their own
/// images, or written by a pull for the holder) `holder`'s image: the
/// image is written as the holder's first, then the tag removed, so a
/// crash between leaves both, never neither. False if there is no such
/// tag.
pub fn adopt(store: &Store, holder: &Holder, name: &str) -> Result<bool, StoreError> {
    let Some(bytes) = tags::read_tag_if_present(store, name)? else {
        return Ok(false);
    };
    write_root(store, holder, name, &bytes)?;
    match tags::remove_tag(store, name) {
        Ok(()) => Ok(true),
        // Removed meanwhile: it is the holder's now all the same.
        Err(_) if !tags::tag_path(store, name).exists() => Ok(true),
        Err(e) => Err(e),
    }
}

/// Reads `holder`'s image `name` (never through a symlink); None if it
/// has none.
pub fn read_root(store: &Store, holder: &Holder, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
    read_root_if_present(store, &holder.id(), name)
}

/// Reads image `name` of the holder whose id is `owner_id`; None if it is
/// not there.
pub(crate) fn read_root_if_present(store: &Store, owner_id: &str, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
    tags::validate_tag(name)?;
    tags::validate_tag(owner_id)?;
    let Some(owned) = open_owned(store)? else {
        return Ok(None);
    };
    let Some(dir) = open_holder_dir(&owned, &owned_path(store), owner_id)? else {
        return Ok(None);
    };
    tags::read_in(&dir, &owned_path(store).join(owner_id).join(name), name)
}

/// Every holder's images. A holder directory whose record cannot be read
/// still holds its images (they stay roots).
pub fn scan(store: &Store) -> Result<OwnedScan, StoreError> {
    let mut scan = OwnedScan::default();
    let base = owned_path(store);
    let owned = match store.open_existing_subdir(OWNED_DIR) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(scan),
        Err(_) if std::fs::symlink_metadata(&base).is_ok_and(|m| !m.is_dir()) => {
            scan.others.push(base);
            return Ok(scan);
        }
        Err(e) => return Err(StoreError::io(&base, "cannot open directory", e)),
    };
    let mut ids = Vec::new();
    let mut dir = rfs::Dir::read_from(&owned).map_err(|e| StoreError::io(&base, "cannot list", e.into()))?;
    while let Some(entry) = dir.read() {
        let entry = entry.map_err(|e| StoreError::io(&base, "cannot list", e.into()))?;
        let raw = entry.file_name().to_bytes();
        if raw == b"." || raw == b".." {
            continue;
        }
        match std::str::from_utf8(raw) {
            Ok(id) if tags::validate_tag(id).is_ok() => ids.push(id.to_string()),
            _ => scan.others.push(base.join(std::ffi::OsStr::from_bytes(raw))),
        }
    }
    ids.sort();
    for id in ids {
        let path = base.join(&id);
        let fd = match open_holder_dir(&owned, &base, &id) {
            Ok(Some(fd)) => fd,
            Ok(None) => continue,
            Err(_) => {
                scan.others.push(path);
                continue;
            }
        };
        let found = tags::scan_dir(&fd, &path, Some(&id), |n| n == OWNER_FILE.as_bytes())?;
        scan.others.extend(found.others);
        scan.owners.push(Owned {
            holder: read_record(&fd),
            id,
            roots: found.tags,
        });
    }
    Ok(scan)
}

/// The holder of image `name`, if one has it.
pub fn find(store: &Store, name: &str) -> Result<Option<Held>, StoreError> {
    if tags::validate_tag(name).is_err() {
        return Ok(None);
    }
    for o in scan(store)?.owners {
        if o.roots.iter().any(|r| r.name == name) {
            let path = owned_path(store).join(&o.id).join(name);
            return Ok(Some(Held {
                owner_id: o.id,
                holder: o.holder,
                path,
            }));
        }
    }
    Ok(None)
}

/// Lets go the images of holders that are gone for good (see
/// [`Holder::gone`], checked now): each holder's images, its record and
/// directory are removed. Returns them, with why each holder is gone.
pub fn release_orphaned(store: &Store) -> Result<Vec<(Owned, String)>, StoreError> {
    let _lock = store.lock(crate::LockMode::Shared, true)?;
    let Some(owned) = open_owned(store)? else {
        return Ok(Vec::new());
    };
    let mut released = Vec::new();
    for o in scan(store)?.owners {
        let Some(why) = o.holder.as_ref().ok().and_then(Holder::gone) else {
            continue;
        };
        let path = owned_path(store).join(&o.id);
        let Some(dir) = open_holder_dir(&owned, &owned_path(store), &o.id)? else {
            continue;
        };
        for r in &o.roots {
            match rfs::unlinkat(&dir, r.name.as_str(), AtFlags::empty()) {
                Ok(()) | Err(rustix::io::Errno::NOENT) => {}
                Err(e) => return Err(StoreError::io(&r.path, "cannot remove image", e.into())),
            }
        }
        let _ = rfs::unlinkat(&dir, OWNER_FILE, AtFlags::empty());
        drop(dir);
        match rfs::unlinkat(&owned, o.id.as_str(), AtFlags::REMOVEDIR) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(StoreError::io(&path, "cannot remove directory", e.into())),
        }
        released.push((o, why));
    }
    let _ = rfs::fsync(&owned);
    Ok(released)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshotter(root: &Path) -> Holder {
        Holder::ContainerdSnapshotter {
            root: root.to_path_buf(),
        }
    }

    #[test]
    fn held_images_are_listed_apart_read_and_not_untagged() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(&dir.path().join("store")).unwrap();
        let root = dir.path().join("snap");
        std::fs::create_dir_all(root.join("metadata")).unwrap();
        let h = snapshotter(&root);
        let name = format!("{}-1", h.id());
        write_root(&s, &h, &name, b"held image").unwrap();
        tags::write_tag(&s, "mine", b"user image").unwrap();
        assert_eq!(
            tags::list_tags(&s).unwrap().iter().map(|t| &t.name).collect::<Vec<_>>(),
            ["mine"]
        );
        let scan = scan(&s).unwrap();
        assert!(scan.others.is_empty(), "{:?}", scan.others);
        assert_eq!(scan.owners.len(), 1);
        assert_eq!(scan.owners[0].holder.as_ref().unwrap(), &h);
        assert_eq!(scan.owners[0].roots[0].name, name);
        assert_eq!(tags::read_tag(&s, &name).unwrap(), b"held image");
        let e = tags::remove_tag(&s, &name).unwrap_err().to_string();
        assert!(
            e.contains("held by the containerd snapshotter at") && e.contains("when containerd removes"),
            "{e}"
        );
        assert!(root_path(&s, &h, &name).exists());
        assert!(tags::resolve_image(Some(&s), Path::new(&name)).is_ok());
        // Gone for good only once its state is.
        assert!(release_orphaned(&s).unwrap().is_empty());
        std::fs::remove_dir_all(&root).unwrap();
        assert!(h.gone().unwrap().contains("does not exist"));
        let released = release_orphaned(&s).unwrap();
        assert_eq!(released.len(), 1);
        assert!(!root_path(&s, &h, &name).exists());
        assert!(scan_is_empty(&s));
    }

    fn scan_is_empty(s: &Store) -> bool {
        let sc = scan(s).unwrap();
        sc.owners.is_empty() && sc.others.is_empty()
    }

    #[test]
    fn adoption_writes_the_held_image_before_removing_the_tag() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(dir.path()).unwrap();
        let h = snapshotter(Path::new("/var/lib/tilefs/snapshotter"));
        let name = format!("{}-7", h.id());
        tags::write_tag(&s, &name, b"old tag").unwrap();
        // A crash after the write, before the removal: both there.
        write_root(&s, &h, &name, b"old tag").unwrap();
        assert!(adopt(&s, &h, &name).unwrap());
        assert!(tags::list_tags(&s).unwrap().is_empty());
        assert_eq!(read_root_if_present(&s, &h.id(), &name).unwrap().unwrap(), b"old tag");
        assert!(!adopt(&s, &h, &name).unwrap());
    }

    #[test]
    fn holder_records_are_checked() {
        assert!(Holder::parse(br#"{"kind":"containerd-snapshotter","root":"/r"}"#).is_ok());
        for bad in [
            &br#"{"kind":"containerd-snapshotter","root":"rel"}"#[..],
            br#"{"kind":"other","root":"/r"}"#,
            br#"{"kind":"containerd-snapshotter","root":"/r","x":1}"#,
            b"",
            b"\xff",
        ] {
            assert!(Holder::parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert!(Holder::parse(&vec![b' '; (MAX_OWNER_RECORD + 1) as usize]).is_err());
    }

    #[test]
    fn odd_entries_are_reported_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(dir.path()).unwrap();
        let h = snapshotter(Path::new("/r"));
        write_root(&s, &h, "a", b"x").unwrap();
        let hd = dir.path().join(OWNED_DIR).join(h.id());
        std::os::unix::fs::symlink("/etc/passwd", hd.join("link")).unwrap();
        std::os::unix::fs::symlink("/etc", dir.path().join(OWNED_DIR).join("elsewhere")).unwrap();
        let sc = scan(&s).unwrap();
        assert_eq!(sc.roots().count(), 1);
        assert_eq!(sc.others.len(), 2, "{:?}", sc.others);
    }
}
