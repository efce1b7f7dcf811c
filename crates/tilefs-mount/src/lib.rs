//! Kernel mounts of tilefs images: EROFS for the metadata, overlayfs on top
//! with the object store as a data-only lower layer.
//!
//! Everything is built with the new mount API, detached: EROFS is mounted
//! straight from the image file (a loop device only when the kernel cannot
//! mount a file), handed to overlayfs by file descriptor, and only the
//! finished overlay is attached, by one `move_mount`. No intermediate mount
//! is ever visible, and a failure at any step leaves nothing mounted (the
//! detached mounts vanish with their descriptors).
//!
//! Overlay options are those of the reference `mount.composefs`
//! (`metacopy=on`, `redirect_dir=on`, `lowerdir+=` the image,
//! `datadir+=` each store, `verity=` as asked), and EROFS gets `noacl` when
//! the image has no ACLs, so `ls -l` does not pay for missing ACL xattrs.

pub mod mountd;
pub mod mountinfo;
pub mod options;
pub mod verity;

mod fsctx;
mod loopdev;

use fsctx::FsContext;
use rustix::fd::{AsFd, AsRawFd, OwnedFd};
use rustix::io::Errno;
use rustix::mount::{MountAttrFlags, MoveMountFlags};
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use tilefs_image::erofs;

/// The overlay's `source`, as mountinfo shows it: `tilefs:IMAGE`.
pub const MOUNT_SOURCE: &str = "tilefs";

pub use tilefs_store::Verity;

/// Access time updates of the mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Atime {
    Relatime,
    NoAtime,
    Strict,
}

/// Per-mount flags (`nosuid`, `nodev`, ...).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MountAttrs {
    pub nosuid: bool,
    pub nodev: bool,
    pub noexec: bool,
    pub nosymfollow: bool,
    pub nodiratime: bool,
    pub atime: Option<Atime>,
}

impl MountAttrs {
    pub(crate) fn flags(&self, read_only: bool) -> MountAttrFlags {
        let mut f = MountAttrFlags::empty();
        let mut set = |on: bool, flag: MountAttrFlags| {
            if on {
                f |= flag;
            }
        };
        set(read_only, MountAttrFlags::MOUNT_ATTR_RDONLY);
        set(self.nosuid, MountAttrFlags::MOUNT_ATTR_NOSUID);
        set(self.nodev, MountAttrFlags::MOUNT_ATTR_NODEV);
        set(self.noexec, MountAttrFlags::MOUNT_ATTR_NOEXEC);
        set(self.nosymfollow, MountAttrFlags::MOUNT_ATTR_NOSYMFOLLOW);
        set(self.nodiratime, MountAttrFlags::MOUNT_ATTR_NODIRATIME);
        match self.atime {
            Some(Atime::NoAtime) => f |= MountAttrFlags::MOUNT_ATTR_NOATIME,
            Some(Atime::Strict) => f |= MountAttrFlags::MOUNT_ATTR_STRICTATIME,
            Some(Atime::Relatime) | None => {}
        }
        f
    }
}

/// How EROFS reaches the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErofsBacking {
    /// The file itself; a loop device only if the kernel refuses files.
    #[default]
    Auto,
    /// The file itself, or fail.
    File,
    /// Always a loop device (for testing the fallback).
    Loop,
}

/// A kernel mount request.
#[derive(Debug, Clone, Default)]
pub struct MountOptions {
    /// The image file (a tag must be resolved to its file first).
    pub image: PathBuf,
    /// Object stores, searched in order (overlayfs data-only layers).
    pub stores: Vec<PathBuf>,
    pub mountpoint: PathBuf,
    /// Writable mount: overlayfs upper and work directories (both or none).
    pub upper: Option<PathBuf>,
    pub work: Option<PathBuf>,
    pub verity: Verity,
    /// Refuse the image unless its fs-verity digest is this.
    pub digest: Option<[u8; 32]>,
    /// Read-only even with an upper directory.
    pub read_only: bool,
    pub attrs: MountAttrs,
    /// More overlayfs options (key, value), passed as they are.
    pub overlay_options: Vec<(String, Option<String>)>,
    pub erofs_backing: ErofsBacking,
    /// The objects a lazily pulled image lacks are placeholders that a
    /// filler (tilefs-present's `kernel_lazy`) fills on first access: the
    /// mount may go on without them.
    pub placeholders_filled: bool,
}

/// A mount that succeeded.
#[derive(Debug, Clone)]
pub struct Mounted {
    /// Where it is (canonical path).
    pub mountpoint: PathBuf,
    /// How EROFS read the image: `file` or the loop device's path.
    pub backing: String,
    /// The overlay's `verity=` mode: `off`, `on` or `require`.
    pub verity: &'static str,
    /// Things the user should know (one line each), e.g. verification
    /// being off because the kernel cannot do it.
    pub notices: Vec<String>,
    /// The bytes of the image mounted (read once, from the file mounted).
    pub image: Vec<u8>,
}

/// Why a mount or unmount failed. Whatever the error, nothing was mounted.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("{0}")]
    Usage(String),
    /// The image is not one (checked before any mount call).
    #[error("{}: {msg}", path.display())]
    Image { path: PathBuf, msg: String },
    #[error("{}: its fs-verity digest is {actual}, not {expected} as required: refusing to mount it", path.display())]
    DigestMismatch {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    /// A mount point, store or upper/work directory that cannot be used.
    #[error("{}: {msg}", path.display())]
    Path { path: PathBuf, msg: String },
    #[error("{}: already a mount point ({what}); unmount it first", path.display())]
    Busy { path: PathBuf, what: String },
    #[error("verification required: {0}")]
    Verity(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    NotPermitted(String),
    #[error("{}", kernel_message(fstype, step, *errno, log))]
    Kernel {
        fstype: &'static str,
        step: String,
        errno: Errno,
        log: Vec<String>,
    },
    // The cause is part of the message, so it is not also a `source()`.
    #[error("{}: {what}: {err}", path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        err: std::io::Error,
    },
    #[error("{}: not a mount point", .0.display())]
    NotMounted(PathBuf),
    #[error("{}: not a tilefs mount ({what}); use umount(8) for it", path.display())]
    NotTilefs { path: PathBuf, what: String },
    #[error("{}: the mount is busy (a process has a file open or its working directory in it); close them and retry, or unmount lazily", .0.display())]
    UmountBusy(PathBuf),
}

fn kernel_message(fstype: &str, step: &str, errno: Errno, log: &[String]) -> String {
    let mut s = format!(
        "the kernel refused the {fstype} mount ({step}): {}",
        std::io::Error::from(errno)
    );
    if !log.is_empty() {
        s.push_str(&format!(" [{}]", log.join("; ")));
    }
    s
}

impl MountError {
    /// The errno of a refused mount system call, if that is what failed.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            MountError::Kernel { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(std::io::Error) -> MountError + 'a {
    move |err| MountError::Io {
        path: path.to_path_buf(),
        what,
        err,
    }
}

/// Whether this process can make kernel mounts: EROFS and overlayfs exist
/// and it may mount them. The error says what is missing.
pub fn kernel_available() -> Result<(), MountError> {
    // Root of a user namespace (`unshare -Urm`, a rootless container) may
    // open an EROFS context but never create one: EROFS is not mountable
    // outside the initial user namespace.
    if !tilefs_sys::ns::in_initial_userns() {
        return Err(MountError::NotPermitted(
            "inside a user namespace: EROFS mounts need privilege in the initial user namespace".into(),
        ));
    }
    FsContext::open("erofs")?;
    FsContext::open("overlay")?;
    Ok(())
}

/// Why the kernel cannot verify objects in `stores`, or None when it can.
pub fn verity_unavailable(stores: &[PathBuf]) -> Option<String> {
    stores.iter().find_map(|s| verity::unavailable(s))
}

/// Mounts an image as [`MountOptions`] says.
pub fn mount(o: &MountOptions) -> Result<Mounted, MountError> {
    let image_file = open_image(&o.image)?;
    let mountpoint = check_mountpoint(&o.mountpoint)?;
    let built = build_detached(o, image_file)?;
    // The only visible step.
    rustix::mount::move_mount(
        &built.mount,
        "",
        rustix::fs::CWD,
        &mountpoint,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .map_err(|errno| MountError::Kernel {
        fstype: "overlay",
        step: format!("attaching it at {}", mountpoint.display()),
        errno,
        log: Vec::new(),
    })?;
    Ok(Mounted {
        mountpoint,
        backing: built.backing,
        verity: built.verity,
        notices: built.notices,
        image: built.image,
    })
}

/// Mounts the EROFS image `image` alone, read-only, at `mountpoint`: a
/// lower layer for an overlay that someone else assembles (containerd,
/// from a snapshotter's mounts). Its regular files show the image's
/// redirects, not the store's data, until stacked.
pub fn mount_erofs_at(image: &Path, mountpoint: &Path, backing: ErofsBacking) -> Result<(), MountError> {
    let image_file = open_image(image)?;
    let mountpoint = check_mountpoint(mountpoint)?;
    let mut bytes = Vec::new();
    (&image_file)
        .read_to_end(&mut bytes)
        .map_err(io_err(image, "cannot read image"))?;
    let info = erofs::read_info(&bytes).map_err(|e| MountError::Image {
        path: image.to_path_buf(),
        msg: e.to_string(),
    })?;
    let image_abs = std::fs::canonicalize(image).unwrap_or_else(|_| image.to_path_buf());
    let (mnt, _) = mount_erofs(&image_file, &image_abs, info.has_acl, backing)?;
    rustix::mount::move_mount(
        &mnt,
        "",
        rustix::fs::CWD,
        &mountpoint,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .map_err(|errno| MountError::Kernel {
        fstype: "erofs",
        step: format!("attaching it at {}", mountpoint.display()),
        errno,
        log: Vec::new(),
    })
}

/// Opens an image file for [`build_detached`]: a regular file.
/// The open never blocks (a FIFO in the image's place must not hang the
/// mount).
pub fn open_image(path: &Path) -> Result<File, MountError> {
    tilefs_store::open_regular(rustix::fs::CWD, path, true).map_err(|e| match e.raw_os_error() {
        Some(_) => io_err(path, "cannot open image")(e),
        None => MountError::Image {
            path: path.to_path_buf(),
            msg: "not a regular file".into(),
        },
    })
}

/// A finished mount, attached nowhere yet.
#[derive(Debug)]
pub struct Detached {
    /// The overlay's mount (`move_mount` it somewhere, or drop it).
    pub mount: OwnedFd,
    pub backing: String,
    pub verity: &'static str,
    pub notices: Vec<String>,
    /// The bytes of the image mounted.
    pub image: Vec<u8>,
}

/// Builds the mount [`MountOptions`] describes (its `mountpoint` aside)
/// from `image_file`, the already open image (named `o.image` in messages),
/// detached: nothing is visible anywhere until the caller attaches it.
pub fn build_detached(o: &MountOptions, image_file: File) -> Result<Detached, MountError> {
    let mut notices = Vec::new();
    if o.upper.is_some() != o.work.is_some() {
        return Err(MountError::Usage(
            "a writable mount needs both an upper and a work directory (on the same filesystem)".into(),
        ));
    }

    // 1. The image: read once, checked, and exactly that file mounted.
    let mut bytes = Vec::new();
    (&image_file)
        .read_to_end(&mut bytes)
        .map_err(io_err(&o.image, "cannot read image"))?;
    let info = erofs::read_info(&bytes).map_err(|e| MountError::Image {
        path: o.image.clone(),
        msg: e.to_string(),
    })?;
    if let Some(want) = o.digest {
        let got = tilefs_image::verity::digest_bytes(&bytes);
        if got != want {
            return Err(MountError::DigestMismatch {
                path: o.image.clone(),
                expected: hex::encode(want),
                actual: hex::encode(got),
            });
        }
    }
    let image_abs = std::fs::canonicalize(&o.image).unwrap_or_else(|_| o.image.clone());
    // A lazily pulled image whose objects are not all here: the kernel
    // cannot fetch them, and would fail those files' reads.
    if let Some(missing) = o
        .stores
        .first()
        .filter(|_| !o.placeholders_filled)
        .and_then(|s| tilefs_store::Store::open(s).ok())
        .and_then(|s| tilefs_store::remote::incomplete(&s, &bytes))
    {
        return Err(MountError::Image {
            path: o.image.clone(),
            msg: missing.to_string(),
        });
    }

    // 2. The directories.
    let stores = o
        .stores
        .iter()
        .map(|s| existing_dir(s, "object store"))
        .collect::<Result<Vec<_>, _>>()?;
    let upper = o
        .upper
        .as_deref()
        .map(|p| existing_dir(p, "upper directory"))
        .transpose()?;
    let work = o
        .work
        .as_deref()
        .map(|p| existing_dir(p, "work directory"))
        .transpose()?;

    // 3. Verification.
    let verity = decide_verity(o.verity, &o.image, &bytes, &stores, &mut notices)?;

    // 4. EROFS, detached.
    let (erofs_mnt, backing) = mount_erofs(&image_file, &image_abs, info.has_acl, o.erofs_backing)?;

    // 5. overlayfs on it, detached.
    let ovl = FsContext::open("overlay")?;
    ovl.set_string("source", format!("{MOUNT_SOURCE}:{}", image_abs.display()))?;
    ovl.set_string("metacopy", "on")?;
    ovl.set_string("redirect_dir", "on")?;
    if verity != "off" {
        ovl.set_string("verity", verity).map_err(|e| match e.errno() {
            Some(Errno::INVAL) => {
                MountError::Verity("this kernel's overlayfs has no verity option (Linux 6.6 or later is needed)".into())
            }
            _ => e,
        })?;
    }
    set_lower(&ovl, &erofs_mnt)?;
    for s in &stores {
        ovl.set_string("datadir+", s)?;
    }
    if let (Some(u), Some(w)) = (&upper, &work) {
        ovl.set_string("upperdir", u)?;
        ovl.set_string("workdir", w)?;
        // The layers are on different filesystems: without xino a
        // directory's inode number changes when its inode is evicted,
        // which tar and find take for a rename. An explicit xino option
        // is the caller's to give.
        if !o.overlay_options.iter().any(|(k, _)| k == "xino") {
            ovl.set_string("xino", "on")?;
        }
    }
    for (k, v) in &o.overlay_options {
        match v {
            Some(v) => ovl.set_string(k, v)?,
            None => ovl.set_flag(k)?,
        }
    }
    ovl.create()?;
    // The overlay holds its own private clone of the EROFS mount now.
    drop(erofs_mnt);
    let read_only = o.read_only || upper.is_none();
    let ovl_mnt = ovl.fsmount(o.attrs.flags(read_only))?;

    Ok(Detached {
        mount: ovl_mnt,
        backing,
        verity,
        notices,
        image: bytes,
    })
}

fn existing_dir(p: &Path, what: &str) -> Result<PathBuf, MountError> {
    let c = std::fs::canonicalize(p).map_err(|e| MountError::Path {
        path: p.to_path_buf(),
        msg: match e.kind() {
            std::io::ErrorKind::NotFound => format!("{what} does not exist"),
            _ => format!("{what}: {e}"),
        },
    })?;
    if !c.is_dir() {
        return Err(MountError::Path {
            path: p.to_path_buf(),
            msg: format!("{what} is not a directory"),
        });
    }
    Ok(c)
}

/// A mount point that can be mounted on: an existing directory that is not
/// already the root of a mount. Returns its canonical path.
pub fn check_mountpoint(p: &Path) -> Result<PathBuf, MountError> {
    let c = existing_dir(p, "mount point")?;
    if is_mount_root(&c) {
        let what = mountinfo::mounted_at(&c)
            .map(|m| format!("{} from {}", m.fstype, m.source))
            .unwrap_or_else(|| "something is mounted there".into());
        return Err(MountError::Busy { path: c, what });
    }
    Ok(c)
}

/// Whether `path` is the root of a mount.
pub fn is_mount_root(path: &Path) -> bool {
    use rustix::fs::{AtFlags, StatxAttributes, StatxFlags};
    match rustix::fs::statx(rustix::fs::CWD, path, AtFlags::NO_AUTOMOUNT, StatxFlags::empty()) {
        Ok(st) if st.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT) => {
            st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT)
        }
        _ => mountinfo::mounted_at(path).is_some(),
    }
}

/// The overlay's `verity=` value for a request, or an error for `require`
/// when something is missing.
fn decide_verity(
    want: Verity,
    image: &Path,
    bytes: &[u8],
    stores: &[PathBuf],
    notices: &mut Vec<String>,
) -> Result<&'static str, MountError> {
    if want == Verity::Off {
        return Ok("off");
    }
    let fallback = |notices: &mut Vec<String>, why: String| {
        notices.push(format!(
            "objects are not verified: {why} (verified where possible: mounted with verity off)"
        ));
        Ok("off")
    };
    if let Some(why) = verity_unavailable(stores) {
        return match want {
            Verity::Require => Err(MountError::Verity(format!(
                "{why}, so the kernel cannot verify objects"
            ))),
            _ => fallback(notices, why),
        };
    }
    let problems = unverifiable(image, bytes, stores)?;
    if problems.is_empty() {
        return Ok(if want == Verity::Require { "require" } else { "on" });
    }
    let (path, why) = &problems[0];
    let summary = format!(
        "{} file{} cannot be verified (first: {}: {why})",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" },
        String::from_utf8_lossy(path)
    );
    match want {
        Verity::Require => Err(MountError::Verity(summary)),
        _ => fallback(notices, summary),
    }
}

/// Files of the image the kernel could not verify: no digest in the image,
/// object missing, or object without fs-verity (or with another digest).
fn unverifiable(image: &Path, bytes: &[u8], stores: &[PathBuf]) -> Result<Vec<(Vec<u8>, String)>, MountError> {
    let (tree, _) = erofs::read_image(bytes).map_err(|e| MountError::Image {
        path: image.to_path_buf(),
        msg: e.to_string(),
    })?;
    let mut problems = Vec::new();
    let mut seen: HashMap<[u8; 32], Option<String>> = HashMap::new();
    tree.walk(|path, entry, id| {
        if entry.is_some_and(|e| e.hardlink) {
            return;
        }
        let ino = tree.inode(id);
        if !ino.is_external() {
            return;
        }
        let Some(digest) = ino.digest else {
            problems.push((path.to_vec(), "the image holds no fs-verity digest for it".to_string()));
            return;
        };
        let problem = seen.entry(digest).or_insert_with(|| object_problem(&digest, stores));
        if let Some(p) = problem {
            problems.push((path.to_vec(), p.clone()));
        }
    });
    Ok(problems)
}

fn object_problem(digest: &[u8; 32], stores: &[PathBuf]) -> Option<String> {
    let rel = tilefs_image::tree::digest_object_path(digest);
    for s in stores {
        let p = s.join(&rel);
        let Ok(f) = File::open(&p) else { continue };
        return match verity::measure(&f) {
            Ok(Some(d)) if &d == digest => None,
            Ok(Some(d)) => Some(format!(
                "object {} has fs-verity digest {}, not its name",
                p.display(),
                hex::encode(d)
            )),
            Ok(None) => Some(format!(
                "object {} does not have fs-verity enabled (fsverity enable {})",
                p.display(),
                p.display()
            )),
            Err(e) => Some(format!("object {}: cannot measure fs-verity: {e}", p.display())),
        };
    }
    Some(format!("object {rel} is missing from the store"))
}

/// Mounts EROFS (detached) from the open image file, or a loop device over
/// it when the kernel cannot read a file directly.
fn mount_erofs(
    image: &File,
    image_path: &Path,
    has_acl: bool,
    backing: ErofsBacking,
) -> Result<(OwnedFd, String), MountError> {
    // The kernel opens the file through our descriptor: the very file we
    // checked, whatever happens to the path meanwhile.
    let source = format!("/proc/self/fd/{}", image.as_raw_fd());
    if backing != ErofsBacking::Loop {
        match erofs_from(&source, has_acl) {
            Ok(m) => return Ok((m, "file".into())),
            // ENOTBLK: this EROFS mounts block devices only.
            Err(e) if backing == ErofsBacking::Auto && e.errno() == Some(Errno::NOTBLK) => {}
            Err(e) => return Err(e),
        }
    }
    let dev = loopdev::attach(image.as_fd(), image_path)?;
    let m = erofs_from(&dev.name, has_acl)?;
    // EROFS holds the device now; with autoclear it goes away with the mount.
    Ok((m, dev.name.clone()))
}

fn erofs_from(source: &str, has_acl: bool) -> Result<OwnedFd, MountError> {
    let fs = FsContext::open("erofs")?;
    fs.set_string("source", source)?;
    fs.set_flag("ro")?;
    if !has_acl {
        fs.set_flag("noacl")?;
    }
    fs.create()?;
    fs.fsmount(MountAttrFlags::MOUNT_ATTR_RDONLY)
}

/// Gives overlayfs the detached EROFS mount as its lower layer: by file
/// descriptor (Linux 6.13+), else by its /proc/self/fd path.
fn set_lower(ovl: &FsContext, erofs_mnt: &OwnedFd) -> Result<(), MountError> {
    let by_fd = match ovl.set_fd("lowerdir+", erofs_mnt, "the image's EROFS mount") {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    let path = format!("/proc/self/fd/{}", erofs_mnt.as_raw_fd());
    match ovl.set_string("lowerdir+", &path) {
        Ok(()) => Ok(()),
        Err(by_path) => Err(MountError::Unsupported(format!(
            "this kernel's overlayfs cannot stack on a detached EROFS mount (Linux 6.15 or later is needed): {by_fd}; {by_path}"
        ))),
    }
}

/// Unmounts a tilefs mount (as root, also a FUSE one). The image's EROFS mount was
/// never attached anywhere and goes away with the overlay. `lazy` detaches
/// it even while files are open in it.
pub fn umount(mountpoint: &Path, lazy: bool) -> Result<(), MountError> {
    let c = std::fs::canonicalize(mountpoint).map_err(|e| MountError::Path {
        path: mountpoint.to_path_buf(),
        msg: match e.kind() {
            std::io::ErrorKind::NotFound => "does not exist".into(),
            _ => e.to_string(),
        },
    })?;
    let entry = mountinfo::mounted_at(&c).ok_or_else(|| MountError::NotMounted(c.clone()))?;
    if !entry.is_tilefs() {
        return Err(MountError::NotTilefs {
            path: c,
            what: format!("{} from {}", entry.fstype, entry.source),
        });
    }
    let flags = if lazy {
        rustix::mount::UnmountFlags::DETACH
    } else {
        rustix::mount::UnmountFlags::empty()
    };
    match rustix::mount::unmount(&c, flags) {
        Ok(()) => Ok(()),
        Err(Errno::BUSY) => Err(MountError::UmountBusy(c)),
        Err(errno) => Err(MountError::Kernel {
            fstype: "overlay",
            step: "unmounting it".into(),
            errno,
            log: Vec::new(),
        }),
    }
}
