//! One way to mount, several doors: every front end (the CLI,
//! `mount.tilefs`, the containerd snapshotter, the VM server) presents an
//! image through this crate, so all decide alike and check alike.
//!
//! - [`decide`]: the decision, a pure function of the request and of what
//!   the machine offers (kernel mounts, privilege, verification, a lazily
//!   pulled image, a store this user may read);
//! - [`mount`]: carries it out for every backend (the kernel, the mount
//!   service, FUSE), wires a lazy image's fetcher into the FUSE server, and
//!   records every mount it makes as a gc root of its store alike;
//! - [`Notice`]: what the user should be told, in the library's words.
//!
//! A FUSE mount comes back mounted but not yet served: serving on threads
//! of the caller, or in a process it forks, is the front end's choice.

pub mod decide;
pub mod kernel_lazy;
mod notice;

pub use decide::{decide, Decision, KernelAccess, Machine, Plan, Refusal};
pub use notice::Notice;

use std::io::Read;
use std::path::{Path, PathBuf};
use tilefs_mount::mountd::client::{self, ClientError};
use tilefs_mount::options::{Backend, ParsedOptions};
use tilefs_mount::{ErofsBacking, MountError, MountOptions};
use tilefs_store::{tags, Store, StoreError, Verity};

/// A request to present an image.
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// An image file, or a tag in the first store.
    pub image: PathBuf,
    /// Object stores; the first holds the tags.
    pub stores: Vec<PathBuf>,
    pub mountpoint: PathBuf,
    pub options: ParsedOptions,
    /// The backend asked for; None: choose.
    pub backend: Option<Backend>,
    pub fuse: FuseSettings,
    pub erofs_backing: ErofsBacking,
}

/// How a FUSE server is run.
#[derive(Debug, Clone, Default)]
pub struct FuseSettings {
    /// Worker threads (0: the default).
    pub threads: usize,
    /// Let other users in even without `allow_other` among the options (a
    /// system mount, visible to all as a kernel mount would be).
    pub allow_other: bool,
}

/// An image presented.
pub enum Presented {
    /// A kernel mount (made here or by the mount service): nothing to serve.
    Kernel { notices: Vec<Notice> },
    /// A kernel mount of a lazily pulled image: the caller keeps `armed`
    /// (its fanotify group) alive and fills placeholders with it (see
    /// [`kernel_lazy`]) for as long as the mount `mount_id` is at
    /// `mountpoint`. Dropping it unserved lets readers of placeholders in.
    KernelLazy {
        armed: kernel_lazy::Armed,
        mountpoint: PathBuf,
        mount_id: u64,
        notices: Vec<Notice>,
    },
    /// A FUSE server mounted: the caller serves it, with `config`.
    Fuse {
        mounted: tilefs_fuse::Mounted,
        config: tilefs_fuse::ServeConfig,
        notices: Vec<Notice>,
    },
}

impl Presented {
    pub fn notices(&self) -> &[Notice] {
        match self {
            Presented::Kernel { notices } | Presented::Fuse { notices, .. } | Presented::KernelLazy { notices, .. } => {
                notices
            }
        }
    }
}

/// Why an image was not presented. Nothing is left mounted.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The kernel mount failed.
    #[error(transparent)]
    Kernel(#[from] MountError),
    /// The mount service did not mount it.
    #[error(transparent)]
    Service(#[from] ClientError),
    /// The store cannot be read by this user, and the service did not
    /// mount from it.
    #[error("{}: cannot read the store ({err}), and the mount service did not mount it: {why}", store.display())]
    StoreUnreadable {
        store: PathBuf,
        err: std::io::Error,
        why: Box<Error>,
    },
    /// The FUSE mount failed (`no_kernel`: why the kernel was not used).
    #[error("FUSE mount of {} at {}: {msg}{}", image.display(), mountpoint.display(), no_kernel.as_ref().map(|w| format!(" (and no kernel mount: {w})")).unwrap_or_default())]
    Fuse {
        image: PathBuf,
        mountpoint: PathBuf,
        msg: String,
        no_kernel: Option<String>,
    },
    /// The request asks what this backend cannot do.
    #[error("{0}")]
    Unsupported(String),
}

fn absolute(p: &Path) -> Result<PathBuf, Error> {
    std::path::absolute(p).map_err(|err| {
        Error::Store(StoreError::Io {
            path: p.to_path_buf(),
            what: "cannot resolve the path",
            err,
        })
    })
}

/// `req` with every path absolute: a FUSE server serves from `/` once it
/// is detached, and the mount service resolves paths in a directory of its
/// own. An image file is made absolute; a tag is left as it is.
fn absolute_paths(req: &Request) -> Result<Request, Error> {
    let mut r = req.clone();
    for s in r.stores.iter_mut().chain(r.options.stores.iter_mut()) {
        *s = absolute(s)?;
    }
    for d in [&mut r.options.upper, &mut r.options.work].into_iter().flatten() {
        *d = absolute(d)?;
    }
    // (A server of another transport has no mount point.)
    if !r.mountpoint.as_os_str().is_empty() {
        r.mountpoint = absolute(&r.mountpoint)?;
    }
    if std::fs::metadata(&r.image).is_ok_and(|m| !m.is_dir()) {
        r.image = absolute(&r.image)?;
    }
    Ok(r)
}

/// Presents the image `req` names, as [`decide`] chooses.
pub fn mount(req: &Request) -> Result<Presented, Error> {
    let req = &absolute_paths(req)?;
    let first = req
        .stores
        .first()
        .ok_or_else(|| Error::Unsupported("no object store given".into()))?;
    let (store, unreadable) = match Store::open(first) {
        Ok(s) => (Some(s), None),
        Err(StoreError::Io { err, .. }) if err.kind() == std::io::ErrorKind::PermissionDenied => (None, Some(err)),
        Err(e) => return Err(e.into()),
    };
    let image = match &store {
        Some(s) => absolute(&tags::resolve_image(Some(s), &req.image)?)?,
        None => req.image.clone(),
    };
    let verity = req.options.verity.unwrap_or_default();
    let lazy = match &store {
        Some(s) => lazy_missing(s, &image)?,
        None => None,
    };
    let mut machine = Machine {
        store_readable: store.is_some(),
        lazy: lazy.as_ref().map(|m| (m.absent, m.total)),
        no_lazy_kernel: None,
        kernel: KernelAccess::Yes,
        kernel_cannot_verify: None,
    };
    // What the kernel offers is asked only when the choice is ours.
    if req.backend.is_none() && machine.store_readable {
        machine.kernel = match tilefs_mount::kernel_available() {
            Ok(()) => KernelAccess::Yes,
            Err(MountError::NotPermitted(e)) => KernelAccess::NotPermitted(e),
            Err(e) => KernelAccess::Unavailable(e.to_string()),
        };
        if machine.kernel == KernelAccess::Yes && verity == Verity::Require {
            machine.kernel_cannot_verify = tilefs_mount::verity_unavailable(&req.stores);
        }
    }
    if let (Some(_), None | Some(Backend::Kernel), KernelAccess::Yes) = (&lazy, req.backend, &machine.kernel) {
        machine.no_lazy_kernel = lazy_kernel_why_not(req, first, &image)?;
    }
    let Decision {
        plan,
        mut notices,
        no_kernel,
    } = decide(req.backend, verity, &machine)?;
    // mount(8) users expect to hear when a mount hides files.
    if std::fs::read_dir(&req.mountpoint).is_ok_and(|mut d| d.next().is_some()) {
        notices.push(Notice::Covers(req.mountpoint.clone()));
    }
    let lazy_digest = lazy.map(|m| m.digest);
    let presented = match plan {
        Plan::Kernel => {
            let store = store.ok_or_else(|| Error::Unsupported("the store cannot be read".into()))?;
            kernel(req, &store, &image, verity, false, &mut notices)?
        }
        Plan::KernelLazy => {
            let store = store.ok_or_else(|| Error::Unsupported("the store cannot be read".into()))?;
            let digest = lazy_digest.expect("a lazy plan for a lazy image");
            kernel_lazy_mount(req, &store, &image, digest, verity, &mut notices)?
        }
        Plan::Delegated => match delegated(req, &mut notices) {
            Ok(()) => Presented::Kernel { notices: Vec::new() },
            Err(why) => {
                return Err(match unreadable {
                    Some(err) => Error::StoreUnreadable {
                        store: first.clone(),
                        err,
                        why: Box::new(why),
                    },
                    None => why,
                })
            }
        },
        Plan::Fuse => fuse(req, &image, verity, lazy_digest, no_kernel)?,
        Plan::DelegatedElseFuse { no_kernel } => match delegated(req, &mut notices) {
            Ok(()) => Presented::Kernel { notices: Vec::new() },
            Err(why) => {
                notices.push(Notice::ServiceDeclined {
                    no_kernel: no_kernel.clone(),
                    why: why.to_string(),
                });
                fuse(req, &image, verity, lazy_digest, Some(no_kernel))?
            }
        },
    };
    // Notices of the decision first, then those of the mount.
    Ok(match presented {
        Presented::Kernel { notices: more } => {
            notices.extend(more);
            Presented::Kernel { notices }
        }
        Presented::KernelLazy {
            armed,
            mountpoint,
            mount_id,
            notices: more,
        } => {
            notices.extend(more);
            Presented::KernelLazy {
                armed,
                mountpoint,
                mount_id,
                notices,
            }
        }
        Presented::Fuse {
            mounted,
            config,
            notices: more,
        } => {
            notices.extend(more);
            Presented::Fuse {
                mounted,
                config,
                notices,
            }
        }
    })
}

/// The bytes of the image file, read without blocking on whatever it is
/// (None if it is no regular file: the mount itself then says so).
/// What a lazily pulled image still lacks in `store` (None: it lacks
/// nothing, or was not pulled lazily; the image is read only when the
/// store has lazy images at all).
fn lazy_missing(store: &Store, image: &Path) -> Result<Option<tilefs_store::remote::Incomplete>, Error> {
    if tilefs_store::remote::records(store).is_empty() {
        return Ok(None);
    }
    Ok(read_image(image)?.and_then(|b| tilefs_store::remote::incomplete(store, &b)))
}

/// The source of a lazily pulled image's objects, for its FUSE server.
fn fetcher(store: &Path, image: &[u8; 32]) -> Result<Option<tilefs_fuse::Fetcher>, String> {
    Ok(tilefs_oci::toc_lazy::open_source(store, image)
        .map_err(|e| e.to_string())?
        .map(tilefs_fuse::Fetcher))
}

fn read_image(image: &Path) -> Result<Option<Vec<u8>>, Error> {
    let Ok(mut f) = tilefs_store::open_regular(rustix::fs::CWD, image, true) else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes)
        .map_err(|e| StoreError::io(image, "cannot read", e))?;
    Ok(Some(bytes))
}

/// The ids to show root's files as, when `writable` by a user other than
/// root and the image's root directory belongs to root (an OCI image, a
/// system tree): without a mapping, root's files could not be changed at
/// all, and a user namespace of the user's (bwrap, unshare -r) would see
/// them owned by nobody.
fn fake_root(writable: bool, image: &Path) -> Result<Option<(u32, u32)>, Error> {
    let me = rustix::process::geteuid();
    if !writable || me.is_root() {
        return Ok(None);
    }
    let Some(bytes) = read_image(image)? else {
        return Ok(None);
    };
    Ok(match tilefs_image::erofs::root_owner(&bytes) {
        Ok((0, _)) => Some((me.as_raw(), rustix::process::getegid().as_raw())),
        _ => None,
    })
}

/// A kernel mount, recorded in its store as a gc root (`placeholders_filled`:
/// a lazily pulled image's, see [`kernel_lazy_mount`]).
fn kernel(
    req: &Request,
    store: &Store,
    image: &Path,
    verity: Verity,
    placeholders_filled: bool,
    notices: &mut Vec<Notice>,
) -> Result<Presented, Error> {
    let o = &req.options;
    // Held from the mount to its record, so a gc cannot run between.
    let lock = store.lock(tilefs_store::LockMode::Shared, true);
    let mounted = tilefs_mount::mount(&MountOptions {
        image: image.to_path_buf(),
        stores: req.stores.clone(),
        mountpoint: req.mountpoint.clone(),
        upper: o.upper.clone(),
        work: o.work.clone(),
        verity,
        digest: o.digest,
        read_only: o.read_only.unwrap_or(false),
        attrs: o.attrs,
        overlay_options: o.overlay.clone(),
        erofs_backing: req.erofs_backing,
        placeholders_filled,
    })?;
    notices.extend(mounted.notices.iter().cloned().map(Notice::Mount));
    let recorded = lock.and_then(|_lock| {
        let id = tilefs_store::mounts::mount_id_of(&mounted.mountpoint)
            .ok_or_else(|| StoreError::Invalid(format!("{}: no mount there", mounted.mountpoint.display())))?;
        tilefs_store::mounts::register_kernel(store, &mounted.image, &mounted.mountpoint, id)
    });
    if let Err(e) = recorded {
        notices.push(Notice::NotRecorded(e.to_string()));
    }
    Ok(Presented::Kernel { notices: Vec::new() })
}

/// Why the kernel cannot mount this lazily pulled image, filling its
/// objects on first access (None: it can).
fn lazy_kernel_why_not(req: &Request, store: &Path, image: &Path) -> Result<Option<String>, Error> {
    if req.options.upper.is_some() {
        return Ok(Some(
            "a writable mount of a lazily pulled image is served by FUSE".into(),
        ));
    }
    if req.stores.len() > 1 {
        return Ok(Some("a lazily pulled image is served from one store".into()));
    }
    if !rustix::process::geteuid().is_root() {
        return Ok(Some(
            "filling objects on first read (fanotify pre-content events) needs root".into(),
        ));
    }
    let Some(bytes) = read_image(image)? else {
        return Ok(Some(format!("{}: not a regular file", image.display())));
    };
    Ok(match tilefs_image::erofs::read_image(&bytes) {
        Ok((tree, _)) => kernel_lazy::why_not(store, &tree),
        Err(e) => Some(format!("{}: {e}", image.display())),
    })
}

/// A kernel mount of a lazily pulled image: its absent objects made
/// placeholders and marked first, so that no read of one can come before
/// its filler is asked.
fn kernel_lazy_mount(
    req: &Request,
    store: &Store,
    image: &Path,
    digest: [u8; 32],
    verity: Verity,
    notices: &mut Vec<Notice>,
) -> Result<Presented, Error> {
    let bytes =
        read_image(image)?.ok_or_else(|| Error::Unsupported(format!("{}: not a regular file", image.display())))?;
    let (tree, _) =
        tilefs_image::erofs::read_image(&bytes).map_err(|e| Error::Unsupported(format!("{}: {e}", image.display())))?;
    // Its lazy-pull record is judged now, as the FUSE server's is: one
    // that is not the caller's (or root's) refuses the mount, rather than
    // failing every read after it.
    fetcher(store.path(), &digest).map_err(|e| Error::Unsupported(format!("{}: {e}", image.display())))?;
    let armed = kernel_lazy::Armed::arm(store, digest, &tree)
        .map_err(|e| Error::Unsupported(format!("{}: {e}", image.display())))?;
    kernel(req, store, image, verity, true, notices)?;
    let mount_id = tilefs_store::mounts::mount_id_of(&req.mountpoint)
        .ok_or_else(|| Error::Unsupported(format!("{}: no mount there", req.mountpoint.display())))?;
    Ok(Presented::KernelLazy {
        armed,
        mountpoint: req.mountpoint.clone(),
        mount_id,
        notices: Vec::new(),
    })
}

/// Has the mount service make the mount: a tagged image only (the service
/// mounts only what its policy trusts), one store, nosuid and nodev.
fn delegated(req: &Request, notices: &mut Vec<Notice>) -> Result<(), Error> {
    let o = &req.options;
    let refuse = |m: &str| Err(Error::Unsupported(m.to_string()));
    if req.stores.len() > 1 {
        return refuse("a delegated mount serves one object store");
    }
    for (asked, what) in [(o.suid_asked, "suid"), (o.dev_asked, "dev")] {
        if asked {
            return refuse(&format!(
                "option {what} cannot be honoured: delegated mounts are always nosuid and nodev"
            ));
        }
    }
    if let Some((k, _)) = o.overlay.first() {
        return refuse(&format!("option {k} cannot be honoured by a delegated mount"));
    }
    if o.digest.is_some() {
        return refuse("a digest cannot be asked of a delegated mount (the service's policy pins digests)");
    }
    if o.attrs.atime.is_some() || o.attrs.nodiratime {
        return refuse(
            "access-time options cannot be honoured by a delegated mount (it keeps the kernel's default, relatime)",
        );
    }
    let tag = req
        .image
        .to_str()
        .filter(|t| tags::validate_tag(t).is_ok() && !req.image.exists())
        .ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: the mount service mounts tagged images only",
                req.image.display()
            ))
        })?;
    let store = &req.stores[0];
    let store = std::fs::canonicalize(store).map_err(|e| StoreError::io(store, "cannot resolve", e))?;
    let verity = o.verity.map(|v| v.to_string());
    let said = client::mount(
        &tilefs_mount::mountd::server::socket_path(),
        &client::DelegatedMount {
            store: &store,
            image: tag,
            mountpoint: &req.mountpoint,
            noexec: o.attrs.noexec,
            nosymfollow: o.attrs.nosymfollow,
            verity: verity.as_deref(),
            upper: o.upper.as_deref().zip(o.work.as_deref()),
        },
    )?;
    notices.extend(said.into_iter().map(Notice::Mount));
    notices.push(Notice::ByService);
    Ok(())
}

/// The FUSE server's spec for `req`, whose image is `image`: the checks and
/// settings a FUSE mount and a server of another transport (a VM's
/// virtio-fs device, [`serve_spec`]) share. `lazy`: the digest of a lazily
/// pulled image, whose objects the server fetches as they are read.
fn fuse_spec(
    req: &Request,
    image: &Path,
    verity: Verity,
    lazy: Option<[u8; 32]>,
    failed: &dyn Fn(String) -> Error,
) -> Result<tilefs_fuse::ServeSpec, Error> {
    let o = &req.options;
    let upper = match (&o.upper, &o.work) {
        (Some(u), Some(w)) => Some((u.clone(), w.clone())),
        (None, None) => None,
        _ => {
            return Err(failed(
                "a writable mount needs both an upper and a work directory".into(),
            ))
        }
    };
    if (o.uid_map.is_some() || o.gid_map.is_some()) && upper.is_none() {
        return Err(failed("uidmapping and gidmapping apply to writable mounts".into()));
    }
    if let Some((k, _)) = o.overlay.first() {
        return Err(failed(format!(
            "option {k} is an overlayfs option: it needs a kernel mount"
        )));
    }
    if req.stores.len() > 1 {
        return Err(failed("the FUSE server serves one object store".into()));
    }
    let store = &req.stores[0];
    let fetcher = match lazy {
        Some(digest) => fetcher(store, &digest).map_err(failed)?,
        None => None,
    };
    Ok(tilefs_fuse::ServeSpec {
        image: image.to_path_buf(),
        store: store.clone(),
        verity,
        tuning: tilefs_fuse::Tuning {
            // Writable mounts pass upper files through only when asked:
            // that needs an OPEN and a RELEASE for every open of every
            // file, which cost a build more than passthrough saves it.
            passthrough: o.passthrough.unwrap_or(upper.is_none()),
            ..tilefs_fuse::Tuning::default()
        },
        image_digest: o.digest,
        fetcher,
        upper,
        uid_map: o.uid_map.clone(),
        gid_map: o.gid_map.clone(),
    })
}

/// A FUSE mount, recorded in its store as a gc root while its server
/// lives; `lazy`: the digest of a lazily pulled image, whose objects the
/// server fetches as they are read.
fn fuse(
    req: &Request,
    image: &Path,
    verity: Verity,
    lazy: Option<[u8; 32]>,
    no_kernel: Option<String>,
) -> Result<Presented, Error> {
    let o = &req.options;
    let failed = |msg: String| Error::Fuse {
        image: image.to_path_buf(),
        mountpoint: req.mountpoint.clone(),
        msg,
        no_kernel: no_kernel.clone(),
    };
    let mut spec = fuse_spec(req, image, verity, lazy, &failed)?;
    tilefs_mount::check_mountpoint(&req.mountpoint)?;
    let store = &spec.store.clone();
    let upper = spec.upper.clone();
    let mut notices = Vec::new();
    if let Some((uid, gid)) = fake_root(
        upper.is_some() && spec.uid_map.is_none() && spec.gid_map.is_none(),
        image,
    )? {
        spec.uid_map = Some(format!("0:{uid}:1"));
        spec.gid_map = Some(format!("0:{gid}:1"));
        notices.push(Notice::FakeRoot { uid, gid });
    }
    let server = tilefs_fuse::Server::build(&spec).map_err(|e| failed(e.to_string()))?;
    let config = server.serve_config(req.fuse.threads, o.uring == Some(false), o.idle_poll);
    // A gc root while the server lives (the objects of an image mounted by
    // path are protected by no tag). A store we may not write cannot hold
    // one; the mount goes on, and says so.
    let record = Store::open(store).and_then(|s| {
        tilefs_store::mounts::register_fuse(
            &s,
            server.image_bytes(),
            &tilefs_fuse::record_where(&req.mountpoint, upper.as_ref()),
        )
    });
    let asked = |flag: bool, asked_off: bool| match (flag, asked_off) {
        (true, _) => Some(true),
        (false, true) => Some(false),
        (false, false) => None,
    };
    let uring = server.wants_uring(o.uring == Some(false));
    let mut mounted = tilefs_fuse::mount(
        server,
        &tilefs_fuse::DevMount {
            mountpoint: req.mountpoint.clone(),
            allow_other: o.allow_other || req.fuse.allow_other,
            flags: tilefs_fuse::MountFlags {
                nosuid: asked(o.attrs.nosuid, o.suid_asked),
                nodev: asked(o.attrs.nodev, o.dev_asked),
                noexec: o.attrs.noexec,
                nosymfollow: o.attrs.nosymfollow,
            },
            uring,
        },
    )
    .map_err(|e| failed(e.to_string()))?;
    match record {
        Ok(r) => mounted.keep_record(r),
        Err(e) => notices.push(Notice::NotRecorded(e.to_string())),
    }
    Ok(Presented::Fuse {
        mounted,
        config,
        notices,
    })
}

/// Records `server`, which serves `spec` over another transport than a
/// mount (a VM's virtio-fs device), as a gc root of its store for as long
/// as the returned record (the serving process) lives, as a FUSE mount's
/// is.
pub fn record_served(
    spec: &tilefs_fuse::ServeSpec,
    server: &tilefs_fuse::Server,
) -> Result<tilefs_store::mounts::MountRecord, Error> {
    let store = Store::open(&spec.store)?;
    Ok(tilefs_store::mounts::register_fuse(
        &store,
        server.image_bytes(),
        &tilefs_store::mounts::FuseWhere::default(),
    )?)
}

/// What a server of another transport than a mount (a virtio-fs device
/// for a VM) serves for `req` (its mount point and backend unused): the
/// FUSE server a FUSE mount of it would have, with nothing passed through
/// (the guest's kernel reads through the server), a lazily pulled image's
/// objects fetched on first read.
pub fn serve_spec(req: &Request) -> Result<tilefs_fuse::ServeSpec, Error> {
    let req = &absolute_paths(req)?;
    let store = req
        .stores
        .first()
        .ok_or_else(|| Error::Unsupported("no object store given".into()))?;
    if matches!(req.backend, Some(Backend::Kernel | Backend::Delegated)) {
        return Err(Error::Unsupported(
            "a virtio-fs device is served by the FUSE server, not the kernel".into(),
        ));
    }
    // Every option asked for applies, or the request is refused: the
    // guest mounts the device with mount options of its own.
    let o = &req.options;
    let a = &o.attrs;
    if a.nosuid || a.nodev || a.noexec || a.nosymfollow || o.suid_asked || o.dev_asked || o.allow_other {
        return Err(Error::Unsupported(
            "nosuid, nodev, noexec, nosymfollow, suid, dev and allow_other are mount options: \
             the guest mounts the virtio-fs device with its own"
                .into(),
        ));
    }
    let s = Store::open(store)?;
    let image = absolute(&tags::resolve_image(Some(&s), &req.image)?)?;
    let lazy = lazy_missing(&s, &image)?.map(|m| m.digest);
    let failed = |msg: String| Error::Unsupported(format!("{}: {msg}", image.display()));
    let verity = req.options.verity.unwrap_or_default();
    let spec = fuse_spec(req, &image, verity, lazy, &failed)?;
    Ok(tilefs_fuse::ServeSpec {
        tuning: tilefs_fuse::Tuning {
            passthrough: false,
            splice: false,
            ..tilefs_fuse::Tuning::default()
        },
        ..spec
    })
}
