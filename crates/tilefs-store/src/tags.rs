//! Tagged images: `STORE/images/NAME`, the roots `gc` keeps alive.
//!
//! A tag is written like an object: into `STORE/.tmp/`, synced, renamed
//! into `images/`, and the directory synced, so a tag is either the old
//! image or the new one, whole, even across a crash.
//!
//! Nothing here follows a symlink inside the store: `images/` and `.tmp/`
//! must be real directories, and only regular files in `images/` are tags.
//! The images tilefs components hold (see [`crate::owned`]) are written,
//! listed and read by the same code, in their own directories.

use crate::layout::{temp_name, IMAGES_DIR, TMP_DIR};
use crate::{Store, StoreError};
use rustix::fd::OwnedFd;
use rustix::fs::{self as rfs, AtFlags, Mode, OFlags};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// One tagged image, or one image a tilefs component holds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TagInfo {
    pub name: String,
    pub path: PathBuf,
    pub image_bytes: u64,
    /// The id of the component that holds it (`STORE/.owned/OWNER/NAME`);
    /// None for the user's tags (`STORE/images/NAME`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// Longest tag name, in bytes.
pub const MAX_TAG_LEN: usize = 255;

/// A tag name: 1-255 bytes of `[A-Za-z0-9._:@+-]`, not starting with `.`.
pub fn validate_tag(name: &str) -> Result<(), StoreError> {
    let bad = |why: &str| Err(StoreError::Invalid(format!("invalid tag name {name:?}: {why}")));
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > MAX_TAG_LEN {
        return bad("longer than 255 bytes");
    }
    if name.starts_with('.') {
        return bad("starts with '.'");
    }
    if let Some(c) = name
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '@' | '+' | '-')))
    {
        return bad(&format!("{c:?} is not allowed (use letters, digits and . _ : @ + -)"));
    }
    Ok(())
}

/// Path of a tag's image (which may not exist).
pub fn tag_path(store: &Store, name: &str) -> PathBuf {
    store.join(IMAGES_DIR).join(name)
}

/// Records `image` under `name`, atomically (replacing an older image).
///
/// Takes no lock: a build calls this while it still holds the store lock
/// shared from its imports, so that no gc runs between the last import and
/// the tag (which would find the new objects unreferenced).
pub fn write_tag(store: &Store, name: &str, image: &[u8]) -> Result<PathBuf, StoreError> {
    validate_tag(name)?;
    let images = store.open_subdir(IMAGES_DIR)?;
    write_image_in(store, &images, &store.join(IMAGES_DIR), name, image)
}

/// Writes `image` as `name` in the store directory `dir` (at `dir_path`),
/// atomically: through `.tmp/`, synced, renamed, the directory synced.
pub(crate) fn write_image_in(
    store: &Store,
    dir: &OwnedFd,
    dir_path: &Path,
    name: &str,
    image: &[u8],
) -> Result<PathBuf, StoreError> {
    let final_path = dir_path.join(name);
    let tmp = store.open_subdir(TMP_DIR)?;
    let tmp_dir_path = store.join(TMP_DIR);

    // O_EXCL with a fresh name; a clash (a pid reused after a crash) just
    // takes the next name.
    let (tmp_name, fd) = loop {
        let tmp_name = temp_name("tag-");
        match rfs::openat(
            &tmp,
            tmp_name.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        ) {
            Ok(fd) => break (tmp_name, fd),
            Err(rustix::io::Errno::EXIST) => continue,
            Err(e) => {
                return Err(StoreError::io(
                    &tmp_dir_path,
                    "cannot create a temporary file",
                    e.into(),
                ))
            }
        }
    };
    let tmp_path = tmp_dir_path.join(&tmp_name);
    let cleanup = |e: StoreError| {
        let _ = rfs::unlinkat(&tmp, tmp_name.as_str(), AtFlags::empty());
        e
    };
    let mut file = std::fs::File::from(fd);
    file.write_all(image)
        .and_then(|_| file.sync_all())
        .map_err(|e| cleanup(StoreError::io(&tmp_path, "cannot write tag image", e)))?;
    // The umask may have taken bits off: images are as readable as objects.
    rfs::fchmod(&file, Mode::from_raw_mode(0o644))
        .map_err(|e| cleanup(StoreError::io(&tmp_path, "cannot set permissions", e.into())))?;
    drop(file);
    rfs::renameat(&tmp, tmp_name.as_str(), dir, name).map_err(|e| {
        cleanup(StoreError::io(
            &final_path,
            "cannot rename the new image into place",
            e.into(),
        ))
    })?;
    rfs::fsync(dir).map_err(|e| StoreError::io(dir_path, "cannot sync directory", e.into()))?;
    Ok(final_path)
}

/// What `images/` holds: tags, and everything that is not one (symlinks,
/// directories, names that are not tag names).
#[derive(Debug, Default)]
pub(crate) struct ImagesScan {
    pub tags: Vec<TagInfo>,
    pub others: Vec<PathBuf>,
}

/// Lists `images/`. A store without one has no tags; an `images` that is
/// not a real directory is reported in `others` (and has no tags).
pub(crate) fn scan_images(store: &Store) -> Result<ImagesScan, StoreError> {
    let dir_path = store.join(IMAGES_DIR);
    let fd = match store.open_existing_subdir(IMAGES_DIR) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(ImagesScan::default()),
        Err(_)
            if std::fs::symlink_metadata(&dir_path)
                .map(|m| !m.file_type().is_dir())
                .unwrap_or(false) =>
        {
            return Ok(ImagesScan {
                tags: Vec::new(),
                others: vec![dir_path],
            });
        }
        Err(e) => return Err(StoreError::io(&dir_path, "cannot open directory", e)),
    };
    scan_dir(&fd, &dir_path, None, |_| false)
}

/// Lists the images in directory `fd` (at `dir_path`), held by `owner`;
/// names `skip` accepts are neither images nor others.
pub(crate) fn scan_dir(
    fd: &OwnedFd,
    dir_path: &Path,
    owner: Option<&str>,
    skip: impl Fn(&[u8]) -> bool,
) -> Result<ImagesScan, StoreError> {
    let mut scan = ImagesScan::default();
    let mut dir = rfs::Dir::read_from(fd).map_err(|e| StoreError::io(dir_path, "cannot list", e.into()))?;
    while let Some(entry) = dir.read() {
        let entry = entry.map_err(|e| StoreError::io(dir_path, "cannot list", e.into()))?;
        let raw = entry.file_name().to_bytes();
        if raw == b"." || raw == b".." || skip(raw) {
            continue;
        }
        let path = dir_path.join(std::ffi::OsStr::from_bytes(raw));
        let st = match rfs::statat(fd, entry.file_name(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(rustix::io::Errno::NOENT) => continue, // removed meanwhile
            Err(e) => return Err(StoreError::io(&path, "cannot stat", e.into())),
        };
        let is_file = rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::RegularFile;
        match std::str::from_utf8(raw) {
            Ok(name) if is_file && validate_tag(name).is_ok() => scan.tags.push(TagInfo {
                name: name.to_string(),
                path,
                image_bytes: st.st_size as u64,
                owner: owner.map(str::to_string),
            }),
            _ => scan.others.push(path),
        }
    }
    scan.tags.sort_by(|a, b| a.name.cmp(&b.name));
    scan.others.sort();
    Ok(scan)
}

/// Every tag, sorted by name. Entries of `images/` that are not tags
/// (symlinks, directories, other names) are left out; `fsck` reports them.
pub fn list_tags(store: &Store) -> Result<Vec<TagInfo>, StoreError> {
    let dir_path = store.join(IMAGES_DIR);
    if let Ok(m) = std::fs::symlink_metadata(&dir_path) {
        if !m.file_type().is_dir() {
            return Err(StoreError::io(
                &dir_path,
                "cannot list tags",
                io::Error::other("not a directory (a symlink or file where the store keeps its images)"),
            ));
        }
    }
    Ok(scan_images(store)?.tags)
}

/// Reads a tag's image, without following a symlink; a name no tag has
/// but an image a tilefs component holds has (see [`crate::owned`]) reads
/// that one.
pub fn read_tag(store: &Store, name: &str) -> Result<Vec<u8>, StoreError> {
    if let Some(bytes) = read_tag_if_present(store, name)? {
        return Ok(bytes);
    }
    match crate::owned::find(store, name)? {
        Some(held) => crate::owned::read_root_if_present(store, &held.owner_id, name)?,
        None => None,
    }
    .ok_or_else(|| no_such_tag(store, name))
}

/// Reads a tag's image, or None if there is no such tag (any more).
pub(crate) fn read_tag_if_present(store: &Store, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
    validate_tag(name)?;
    let dir = match store.open_existing_subdir(IMAGES_DIR) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StoreError::io(&store.join(IMAGES_DIR), "cannot open directory", e)),
    };
    read_in(&dir, &tag_path(store, name), name)
}

/// Reads the image of a tag, or of a root a component holds, as listed:
/// None if it went since.
pub fn read_listed(store: &Store, t: &TagInfo) -> Result<Option<Vec<u8>>, StoreError> {
    match &t.owner {
        None => read_tag_if_present(store, &t.name),
        Some(owner) => crate::owned::read_root_if_present(store, owner, &t.name),
    }
}

/// Reads image `name` in directory `dir` (its path `path`), without
/// following a symlink or blocking on what is no regular file.
pub(crate) fn read_in(dir: &OwnedFd, path: &Path, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
    let fd = match rfs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(rustix::io::Errno::LOOP) => {
            return Err(StoreError::io(
                path,
                "cannot read tag",
                io::Error::other("a symlink, not an image"),
            ))
        }
        Err(e) => return Err(StoreError::io(path, "cannot read tag", e.into())),
    };
    // Opened without blocking (a FIFO planted here must not hang us), and
    // read only if it is a plain file.
    match rfs::fstat(&fd) {
        Ok(st) if rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::RegularFile => {}
        Ok(_) => {
            return Err(StoreError::io(
                path,
                "cannot read tag",
                io::Error::other("not a regular file"),
            ))
        }
        Err(e) => return Err(StoreError::io(path, "cannot read tag", e.into())),
    }
    let _ = rfs::fcntl_setfl(&fd, OFlags::empty());
    let mut file = std::fs::File::from(fd);
    let mut bytes = Vec::new();
    io::Read::read_to_end(&mut file, &mut bytes).map_err(|e| StoreError::io(path, "cannot read tag", e))?;
    Ok(Some(bytes))
}

fn no_such_tag(store: &Store, name: &str) -> StoreError {
    StoreError::Invalid(format!("no tag {name:?} in store {}", store.path().display()))
}

/// Removes a tag (its objects stay until `gc`). Holds the store lock
/// shared meanwhile, as a build does to tag, so that a running gc never
/// sees a tag vanish between listing and reading it. A name that is no
/// tag of the user's but an image a tilefs component holds is refused,
/// naming the holder: it goes when the holder lets it go.
pub fn remove_tag(store: &Store, name: &str) -> Result<(), StoreError> {
    validate_tag(name)?;
    let _lock = store.lock(crate::LockMode::Shared, true)?;
    let dir_path = store.join(IMAGES_DIR);
    let missing = || match crate::owned::find(store, name) {
        Ok(Some(held)) => StoreError::Invalid(held.refusal(name)),
        Ok(None) => no_such_tag(store, name),
        Err(e) => e,
    };
    let dir = match store.open_existing_subdir(IMAGES_DIR) {
        Ok(dir) => dir,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(missing()),
        Err(e) => return Err(StoreError::io(&dir_path, "cannot open directory", e)),
    };
    match rfs::unlinkat(&dir, name, AtFlags::empty()) {
        Ok(()) => {}
        Err(rustix::io::Errno::NOENT) => return Err(missing()),
        Err(e) => return Err(StoreError::io(&tag_path(store, name), "cannot remove tag", e.into())),
    }
    rfs::fsync(&dir).map_err(|e| StoreError::io(&dir_path, "cannot sync directory", e.into()))
}

/// An IMAGE argument: an existing file, or else a tag in `store`.
pub fn resolve_image(store: Option<&Store>, arg: &Path) -> Result<PathBuf, StoreError> {
    match std::fs::metadata(arg) {
        Ok(m) if !m.is_dir() => return Ok(arg.to_path_buf()),
        Ok(_) | Err(_) => {}
    }
    let as_tag = arg.to_str().filter(|s| validate_tag(s).is_ok());
    if let (Some(store), Some(name)) = (store, as_tag) {
        let p = tag_path(store, name);
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_file()) {
            return Ok(p);
        }
        // An image a tilefs component holds, by its name (to look at or
        // mount: it is still not the user's to remove).
        if let Ok(Some(held)) = crate::owned::find(store, name) {
            return Ok(held.path);
        }
    }
    let what = if arg.is_dir() {
        "is a directory, not an image file"
    } else {
        "no such image file"
    };
    Err(StoreError::Invalid(match (store, as_tag) {
        (Some(store), Some(_)) => format!(
            "{}: {what}, and no tag of that name in store {}",
            arg.display(),
            store.path().display()
        ),
        (Some(_), None) => format!("{}: {what} (and not a valid tag name)", arg.display()),
        (None, Some(_)) => format!("{}: {what} (to use a tagged image, give --store)", arg.display()),
        (None, None) => format!("{}: {what}", arg.display()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_names() {
        for ok in ["a", "fedora:40", "x86_64@sha256-abc", "a.b+c-d_e", &"x".repeat(255)] {
            validate_tag(ok).unwrap();
        }
        for bad in ["", ".hidden", "..", "a/b", "a b", "é", &"x".repeat(256), "a\0b"] {
            assert!(validate_tag(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn write_list_remove() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(dir.path()).unwrap();
        assert!(list_tags(&s).unwrap().is_empty());
        write_tag(&s, "b", b"two").unwrap();
        write_tag(&s, "a", b"one!").unwrap();
        write_tag(&s, "b", b"second").unwrap();
        let tags = list_tags(&s).unwrap();
        assert_eq!(
            tags.iter()
                .map(|t| (t.name.as_str(), t.image_bytes))
                .collect::<Vec<_>>(),
            [("a", 4), ("b", 6)]
        );
        assert_eq!(read_tag(&s, "b").unwrap(), b"second");
        // Nothing left in .tmp.
        assert_eq!(std::fs::read_dir(dir.path().join(TMP_DIR)).unwrap().count(), 0);
        remove_tag(&s, "a").unwrap();
        let e = remove_tag(&s, "a").unwrap_err().to_string();
        assert!(e.contains("no tag \"a\""), "{e}");
        assert!(write_tag(&s, "../x", b"").is_err());
    }

    #[test]
    fn resolve() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::create(&dir.path().join("store")).unwrap();
        write_tag(&s, "t", b"img").unwrap();
        let file = dir.path().join("file.img");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(resolve_image(Some(&s), &file).unwrap(), file);
        assert_eq!(resolve_image(Some(&s), Path::new("t")).unwrap(), tag_path(&s, "t"));
        let e = resolve_image(Some(&s), Path::new("nope")).unwrap_err().to_string();
        assert!(
            e.contains("no such image file") && e.contains("no tag of that name"),
            "{e}"
        );
        let e = resolve_image(None, Path::new("t")).unwrap_err().to_string();
        assert!(e.contains("--store"), "{e}");
    }
}
