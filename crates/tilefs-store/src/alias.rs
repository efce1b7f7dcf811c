//! Objects by the SHA-256 of their contents: `STORE/.sha256/XX/<62 hex>`,
//! each a hardlink of the object (named by its fs-verity digest) whose
//! contents have that SHA-256.
//!
//! Why: eStargz and zstd:chunked tables of contents give each file's
//! SHA-256, never its fs-verity digest, and the verity digest cannot be
//! known before the file's bytes are. An image pulled lazily from such a
//! table names each file not yet fetched by its alias (its redirect is
//! `.sha256/XX/…`, without a verity digest); the fetch checks the bytes
//! against the table's digests, stores them as an ordinary object and
//! links the alias to it. So a FUSE mount opens the alias as it opens any
//! object, the kernel's overlayfs could follow it too (it is a path under
//! the data directory), and the next image of a table that lists the same
//! SHA-256 finds it present and fetches nothing: dedup across eStargz and
//! zstd:chunked images. Once every file is present, the pull resolves each
//! alias to its object (hashing it) and writes the image `tilefs pull`
//! makes, which names objects only.
//!
//! Only a fetch that checked the bytes against the name makes an alias;
//! fsck checks every alias's SHA-256, gc keeps the aliases a tagged or
//! mounted image names and those of objects it keeps (the dedup index),
//! and removes the others.

use crate::{parse_object_rel, Store, StoreError};
use rustix::fs::{self as rfs, AtFlags, Mode, OFlags, ResolveFlags};
use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

/// Where the aliases live, under the store.
pub use crate::layout::ALIAS_DIR;

/// The store-relative path of the alias of contents whose SHA-256 is
/// `sha256`: what a lazy image's redirect holds.
pub fn alias_rel(sha256: &[u8; 32]) -> String {
    format!("{ALIAS_DIR}/{}", Store::object_rel(sha256))
}

/// The SHA-256 an alias path names (`.sha256/XX/` and 62 lower-case hex
/// digits, with or without a leading `/`), or None for anything else.
pub fn parse_alias_rel(rel: &[u8]) -> Option<[u8; 32]> {
    let rel = rel.strip_prefix(b"/").unwrap_or(rel);
    parse_object_rel(rel.strip_prefix(ALIAS_DIR.as_bytes())?.strip_prefix(b"/")?)
}

/// Opens the alias read-only, never through a symlink, refusing anything
/// but a regular file.
pub fn open(store: &Store, sha256: &[u8; 32]) -> io::Result<File> {
    let fd: OwnedFd = rfs::openat2(
        store.dir_fd(),
        alias_rel(sha256),
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK | OFlags::NOCTTY,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )?;
    let st = rfs::fstat(&fd)?;
    if rfs::FileType::from_raw_mode(st.st_mode) != rfs::FileType::RegularFile {
        return Err(io::Error::other("not a regular file"));
    }
    rfs::fcntl_setfl(&fd, OFlags::empty())?;
    Ok(File::from(fd))
}

/// The alias's size, if it is present as a regular file.
pub fn size(store: &Store, sha256: &[u8; 32]) -> Option<u64> {
    let fd = rfs::openat2(
        store.dir_fd(),
        alias_rel(sha256),
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .ok()?;
    let st = rfs::fstat(&fd).ok()?;
    (rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::RegularFile).then_some(st.st_size as u64)
}

/// The directory `.sha256/XX` of `sha256`, created if needed; a symlink or
/// file in the place of either is refused, never written through.
fn fanout(store: &Store, sha256: &[u8; 32]) -> Result<OwnedFd, StoreError> {
    let top = store.open_subdir(ALIAS_DIR)?;
    let name = format!("{:02x}", sha256[0]);
    let path = store.join(ALIAS_DIR).join(&name);
    match rfs::mkdirat(&top, &name, Mode::from_raw_mode(0o755)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(StoreError::io(&path, "cannot create directory", e.into())),
    }
    rfs::openat(
        &top,
        &name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| StoreError::io(&path, "cannot open directory", e.into()))
}

/// Links the alias `sha256` to the object `verity`, which the caller has
/// just checked to hold contents of that SHA-256. An alias already there
/// of the same size is kept (it holds the same contents, or fsck says it
/// does not); one of another size is damage, and replaced.
pub fn link(store: &Store, sha256: &[u8; 32], verity: &[u8; 32]) -> Result<(), StoreError> {
    let dir = fanout(store, sha256)?;
    let name = &Store::object_rel(sha256)[3..];
    let fail = |e: rustix::io::Errno| StoreError::io(&store.join(alias_rel(sha256)), "cannot link the alias", e.into());
    let link = || rfs::linkat(store.dir_fd(), Store::object_rel(verity), &dir, name, AtFlags::empty());
    match link() {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::EXIST) if size(store, sha256) == store.object_size(verity) => Ok(()),
        Err(rustix::io::Errno::EXIST) => {
            rfs::unlinkat(&dir, name, AtFlags::empty()).map_err(fail)?;
            link().map_err(fail)
        }
        Err(e) => Err(fail(e)),
    }
}

/// Names the contents of the alias `sha256` as the object `verity` again
/// (their fs-verity digest, which the caller computed from the alias), if
/// the object is absent: a gc may have removed the object's name while an
/// image still named the alias.
pub fn restore_object(store: &Store, sha256: &[u8; 32], verity: &[u8; 32]) -> Result<(), StoreError> {
    if store.has_object(verity) {
        return Ok(());
    }
    let dir = store.open_fanout(verity)?;
    let rel = Store::object_rel(verity);
    match rfs::linkat(store.dir_fd(), alias_rel(sha256), &dir, &rel[3..], AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => Ok(()),
        Err(e) => Err(StoreError::io(
            &store.object_path(verity),
            "cannot link the object",
            e.into(),
        )),
    }
}

/// The aliases an image's tree names (gc keeps them; fsck looks for them).
pub fn add_references(tree: &tilefs_image::Tree, aliases: &mut HashSet<[u8; 32]>) {
    for inode in tree.inodes.iter().filter(|i| i.is_external()) {
        if let Some(d) = inode.payload.as_deref().and_then(parse_alias_rel) {
            aliases.insert(d);
        }
    }
}

/// Every entry under `.sha256/`: well-named aliases (SHA-256, path) and
/// anything else (strays); both empty when the store has no aliases.
pub(crate) fn scan(store: &Store) -> (Vec<([u8; 32], PathBuf)>, Vec<PathBuf>) {
    let (mut aliases, mut strays) = (Vec::new(), Vec::new());
    let top = store.join(ALIAS_DIR);
    match std::fs::symlink_metadata(&top) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return (aliases, vec![top]),
        Err(_) => return (aliases, strays),
    }
    let Ok(rd) = std::fs::read_dir(&top) else {
        return (aliases, strays);
    };
    for fan in rd.flatten() {
        let name = fan.file_name();
        let fan_name = name
            .to_str()
            .filter(|n| n.len() == 2 && n.bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        let (Some(fan_name), true) = (fan_name, fan.file_type().is_ok_and(|t| t.is_dir())) else {
            strays.push(fan.path());
            continue;
        };
        let Ok(sub) = std::fs::read_dir(fan.path()) else {
            strays.push(fan.path());
            continue;
        };
        for e in sub.flatten() {
            let d = e
                .file_name()
                .to_str()
                .and_then(|r| parse_object_rel(format!("{fan_name}/{r}").as_bytes()))
                .filter(|_| e.file_type().is_ok_and(|t| t.is_file()));
            match d {
                Some(d) => aliases.push((d, e.path())),
                None => strays.push(e.path()),
            }
        }
    }
    aliases.sort();
    (aliases, strays)
}

/// gc: removes the aliases that no root names and whose file is no kept
/// object (`kept`: the (device, inode) of the objects gc keeps). Returns
/// how many went (their bytes are counted with their objects').
pub(crate) fn sweep(
    store: &Store,
    named: &HashSet<[u8; 32]>,
    kept: &HashSet<(u64, u64)>,
    dry_run: bool,
) -> Result<u64, StoreError> {
    use std::os::unix::fs::MetadataExt;
    let (aliases, _) = scan(store);
    let mut removed = 0;
    for (d, path) in aliases {
        let Ok(m) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if named.contains(&d) || kept.contains(&(m.dev(), m.ino())) {
            continue;
        }
        if !dry_run {
            let dir = fanout(store, &d)?;
            match rfs::unlinkat(&dir, &Store::object_rel(&d)[3..], AtFlags::empty()) {
                Ok(()) | Err(rustix::io::Errno::NOENT) => {}
                Err(e) => return Err(StoreError::io(&path, "cannot remove alias", e.into())),
            }
        }
        removed += 1;
    }
    Ok(removed)
}

/// fsck: whether the file at `path` has the SHA-256 `want`.
pub(crate) fn check(path: &std::path::Path, want: &[u8; 32]) -> io::Result<bool> {
    use sha2::Digest;
    let f = crate::open_regular(rustix::fs::CWD, path, false)?;
    let mut h = sha2::Sha256::new();
    io::copy(&mut io::BufReader::with_capacity(1 << 20, f), &mut h)?;
    Ok(h.finalize().as_slice() == want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alias_paths_round_trip_and_nothing_else_parses() {
        let d = [0xabu8; 32];
        let rel = alias_rel(&d);
        assert!(rel.starts_with(".sha256/ab/"));
        assert_eq!(parse_alias_rel(rel.as_bytes()), Some(d));
        assert_eq!(parse_alias_rel(format!("/{rel}").as_bytes()), Some(d));
        for bad in [&Store::object_rel(&d), ".sha256/../ab/x", ".sha256ab/ab", ".sha256/"] {
            assert_eq!(parse_alias_rel(bad.as_bytes()), None, "{bad}");
        }
    }
}
