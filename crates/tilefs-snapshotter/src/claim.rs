//! Whether a snapshot's upper directory is a live overlay's, as the kernel
//! knows it (issue 43: nothing anyone can still write may become an
//! object).
//!
//! overlayfs marks the upper and work directories of each of its
//! superblocks "in use" for the superblock's whole life: while a
//! container's overlay is mounted, and after a lazy unmount for as long as
//! an open file or a process's root keeps it alive, which no mount table
//! shows. A new overlay over an upper directory so marked is refused with
//! EBUSY when it asks for an index (`index=on`). A claim is such an
//! overlay, made with the new mount API and attached nowhere: made, the
//! directory was no live overlay's, and while the claim is held it is
//! ours (another overlay with `index=on` is refused; one without only
//! warns in the kernel log, and the snapshotter hands a committed
//! snapshot's upper directory to no mount). Dropping it ends the overlay.
//!
//! What the claim leaves is cleaned when it is dropped: `index=on` gives
//! the upper directory's root a `trusted.overlay.origin` (and maybe
//! `trusted.overlay.uuid`) xattr, removed unless they were there before
//! (the layer reader never takes `trusted.overlay.*` for a file's xattrs
//! anyway), and the claim's own lower and work directories go. A refused
//! claim costs one line in the kernel log ("upperdir is in-use ...").

use rustix::fd::OwnedFd;
use rustix::io::Errno;
use rustix::mount::FsOpenFlags;
use std::ffi::CString;
use std::path::{Path, PathBuf};

/// What a claim found.
pub enum Upper {
    /// No live overlay has it; ours while the claim lives.
    Free(Claim),
    /// A live overlay has it (or had, at the moment of asking).
    InUse,
}

/// An overlay superblock over an upper directory, attached nowhere.
pub struct Claim {
    fs: Option<OwnedFd>,
    upper: PathBuf,
    scratch: PathBuf,
    added: Vec<CString>,
}

/// Claims `upper`, with `scratch` (a directory of the same filesystem,
/// outside `upper`, that the claim makes and removes) for the overlay's
/// empty lower and work directories. Err: the kernel refused for another
/// reason (the caller takes it as in use: safe, and said).
pub fn claim(upper: &Path, scratch: &Path) -> crate::Result<Upper> {
    let before = overlay_xattrs(upper);
    let _ = std::fs::remove_dir_all(scratch);
    let (lower, work) = (scratch.join("lower"), scratch.join("work"));
    for d in [&lower, &work] {
        std::fs::create_dir_all(d).map_err(|e| crate::Error::io(d, "cannot create", e))?;
    }
    let mut made = make(upper, &lower, &work);
    if matches!(made, Err(Errno::STALE)) {
        // An origin xattr a claim that crashed left, naming another lower.
        let _ = rustix::fs::lremovexattr(upper, c"trusted.overlay.origin");
        made = make(upper, &lower, &work);
    }
    let fs = match made {
        Ok(fs) => fs,
        Err(e) => {
            let _ = std::fs::remove_dir_all(scratch);
            return match e {
                Errno::BUSY => Ok(Upper::InUse),
                e => Err(crate::Error::io(
                    upper,
                    "cannot tell whether an overlay uses it",
                    e.into(),
                )),
            };
        }
    };
    let added = overlay_xattrs(upper)
        .into_iter()
        .filter(|k| !before.contains(k))
        .collect();
    Ok(Upper::Free(Claim {
        fs: Some(fs),
        upper: upper.to_path_buf(),
        scratch: scratch.to_path_buf(),
        added,
    }))
}

/// Whether `upper` is (or cannot be shown not to be) a live overlay's.
pub fn in_use(upper: &Path, scratch: &Path) -> bool {
    match claim(upper, scratch) {
        Ok(Upper::Free(_)) => false,
        Ok(Upper::InUse) => true,
        Err(e) => {
            tracing::warn!("{e}: kept as if it were in use");
            true
        }
    }
}

fn make(upper: &Path, lower: &Path, work: &Path) -> Result<OwnedFd, Errno> {
    let fs = rustix::mount::fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC)?;
    rustix::mount::fsconfig_set_string(&fs, "lowerdir", lower)?;
    rustix::mount::fsconfig_set_string(&fs, "upperdir", upper)?;
    rustix::mount::fsconfig_set_string(&fs, "workdir", work)?;
    rustix::mount::fsconfig_set_string(&fs, "index", "on")?;
    rustix::mount::fsconfig_create(&fs)?;
    Ok(fs)
}

/// The names of `dir`'s own `trusted.overlay.*` xattrs.
fn overlay_xattrs(dir: &Path) -> Vec<CString> {
    let mut buf = vec![0u8; 64 << 10];
    let Ok(n) = rustix::fs::llistxattr(dir, &mut buf) else {
        return Vec::new();
    };
    buf[..n]
        .split(|&c| c == 0)
        .filter(|k| k.starts_with(b"trusted.overlay."))
        .filter_map(|k| CString::new(k).ok())
        .collect()
}

impl Drop for Claim {
    fn drop(&mut self) {
        // The overlay first: its index holds the upper's root.
        drop(self.fs.take());
        for k in &self.added {
            let _ = rustix::fs::lremovexattr(&self.upper, k.as_c_str());
        }
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}
