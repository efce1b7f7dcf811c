//! Files a service running as root trusts (its policy, a signature policy
//! and the keys it names, a store's images and check records): read only
//! if no one but root could have written them. The file and every
//! directory on its path must be root's and writable by no one else (a
//! directory with the sticky bit excepted: there, others may add entries
//! but not rename or remove root's), and no component may be a symlink,
//! so that what is read is what root put at that path. Each component is
//! opened from its parent's descriptor and checked on that descriptor, so
//! a rename meanwhile cannot slip another file in.

use crate::Error;
use rustix::fd::OwnedFd;
use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use std::io::Read;
use std::path::{Component, Path};

/// Opens `path` (absolute) for reading if root alone could have written
/// it; `None` if it (or a directory above it) does not exist. The error
/// names the file and the reason.
pub fn open(path: &Path) -> Result<Option<std::fs::File>, Error> {
    let fail = |why: String| Error::read(path, why);
    if !path.is_absolute() {
        return Err(fail("not an absolute path".into()));
    }
    let names: Vec<_> = path
        .components()
        .filter(|c| !matches!(c, Component::RootDir | Component::CurDir))
        .collect();
    if names.iter().any(|c| matches!(c, Component::ParentDir)) {
        return Err(fail("a path with \"..\" in it".into()));
    }
    let Some((last, dirs)) = names.split_last() else {
        return Err(fail("not a file".into()));
    };
    let dir_flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let mut dir = rustix::fs::open("/", dir_flags, Mode::empty()).map_err(|e| fail(format!("/: {e}")))?;
    roots_alone(path, &dir, "/", true)?;
    let mut at = std::path::PathBuf::from("/");
    for name in dirs {
        at.push(name);
        let what = at.display().to_string();
        let Some(next) = step(path, &dir, name.as_os_str(), dir_flags, &what)? else {
            return Ok(None);
        };
        roots_alone(path, &next, &what, true)?;
        dir = next;
    }
    // Without blocking: a FIFO put there must not hang the service.
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let Some(fd) = step(path, &dir, last.as_os_str(), flags, "the file")? else {
        return Ok(None);
    };
    let st = rustix::fs::fstat(&fd).map_err(|e| fail(e.to_string()))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(fail("not a regular file".into()));
    }
    roots_alone(path, &fd, "the file", false)?;
    rustix::fs::fcntl_setfl(&fd, OFlags::empty()).map_err(|e| fail(e.to_string()))?;
    Ok(Some(std::fs::File::from(fd)))
}

/// Reads `path` as [`open`] opens it, refusing one larger than `max` bytes.
pub fn read(path: &Path, max: u64) -> Result<Option<Vec<u8>>, Error> {
    let Some(f) = open(path)? else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    f.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::read(path, e))?;
    if bytes.len() as u64 > max {
        return Err(Error::read(path, format!("larger than {max} bytes")));
    }
    Ok(Some(bytes))
}

/// [`read`], for a file that must exist.
pub fn read_existing(path: &Path, max: u64) -> Result<Vec<u8>, Error> {
    read(path, max)?.ok_or_else(|| Error::read(path, "no such file"))
}

/// Opens `name` in `dir`, following no symlink; `None` if it does not exist.
fn step(
    path: &Path,
    dir: &OwnedFd,
    name: &std::ffi::OsStr,
    flags: OFlags,
    what: &str,
) -> Result<Option<OwnedFd>, Error> {
    match rustix::fs::openat2(
        dir,
        name,
        flags,
        Mode::empty(),
        ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS | ResolveFlags::BENEATH,
    ) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::NOENT) => Ok(None),
        Err(Errno::LOOP) => Err(Error::read(
            path,
            format!(
                "{what} is a symlink, and a file the service trusts is reached through none (name the file itself)"
            ),
        )),
        Err(Errno::NOTDIR) => Err(Error::read(path, format!("{what} is not a directory"))),
        Err(e) => Err(Error::read(path, format!("{what}: {e}"))),
    }
}

/// Whether `fd` is root's and writable by no one else (a sticky directory
/// may be writable by others: they cannot replace root's entries there).
fn roots_alone(path: &Path, fd: &OwnedFd, what: &str, dir: bool) -> Result<(), Error> {
    let st = rustix::fs::fstat(fd).map_err(|e| Error::read(path, format!("{what}: {e}")))?;
    let sticky = dir && st.st_mode & 0o1000 != 0;
    if st.st_uid != 0 || (st.st_mode & 0o022 != 0 && !sticky) {
        return Err(Error::read(
            path,
            format!(
                "{what} is not root's alone (uid {}, mode {:04o}), so the service cannot trust what it holds",
                st.st_uid,
                st.st_mode & 0o7777
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn chown(p: &Path, uid: u32) {
        rustix::fs::chown(p, Some(rustix::fs::Uid::from_raw(uid)), None).unwrap();
    }

    /// Each way a file could be another user's to write, refused with the
    /// reason; root's own file read. Needs root (to own files as others).
    #[test]
    fn only_what_root_alone_could_write_is_read() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root, to give files to other users");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        chmod(t.path(), 0o755);
        let d = t.path().join("etc");
        std::fs::create_dir(&d).unwrap();
        let f = d.join("policy.json");
        std::fs::write(&f, b"{}").unwrap();
        chmod(&f, 0o644);
        assert_eq!(read_existing(&f, 100).unwrap(), b"{}");
        assert!(read(&d.join("none"), 100).unwrap().is_none());
        assert!(read(&d.join("none/x"), 100).unwrap().is_none());
        let e = read(&f, 1).unwrap_err().to_string();
        assert!(e.contains("larger than 1 bytes"), "{e}");
        // Writable by others, or its directory is.
        chmod(&f, 0o646);
        let e = read(&f, 100).unwrap_err().to_string();
        assert!(e.contains("the file is not root's alone") && e.contains("0646"), "{e}");
        chmod(&f, 0o644);
        chmod(&d, 0o775);
        let e = read(&f, 100).unwrap_err().to_string();
        assert!(e.contains(&format!("{} is not root's alone", d.display())), "{e}");
        // A sticky directory others may write is fine (root's entries stay).
        chmod(&d, 0o1777);
        assert!(read(&f, 100).is_ok());
        chmod(&d, 0o755);
        // A user's file, a user's directory.
        chown(&f, 65534);
        assert!(read(&f, 100).unwrap_err().to_string().contains("uid 65534"));
        chown(&f, 0);
        chown(&d, 65534);
        assert!(read(&f, 100).unwrap_err().to_string().contains("uid 65534"));
        chown(&d, 0);
        // A symlink, last or on the way, even to root's own file.
        let l = d.join("link.json");
        std::os::unix::fs::symlink(&f, &l).unwrap();
        assert!(read(&l, 100).unwrap_err().to_string().contains("is a symlink"));
        let ld = t.path().join("etc-link");
        std::os::unix::fs::symlink(&d, &ld).unwrap();
        assert!(read(&ld.join("policy.json"), 100)
            .unwrap_err()
            .to_string()
            .contains("is a symlink"));
        // Not a regular file; not absolute; "..".
        rustix::fs::mknodat(
            rustix::fs::CWD,
            d.join("fifo").as_path(),
            FileType::Fifo,
            Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        assert!(read(&d.join("fifo"), 100)
            .unwrap_err()
            .to_string()
            .contains("not a regular file"));
        assert!(read(Path::new("etc/x"), 100)
            .unwrap_err()
            .to_string()
            .contains("absolute"));
        assert!(read(&d.join("../etc/policy.json"), 100)
            .unwrap_err()
            .to_string()
            .contains(".."));
    }
}
