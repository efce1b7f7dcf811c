//! `tilefs mount` and `tilefs umount`.

use crate::store_arg::StoreArg;
use anyhow::{anyhow, bail, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use tilefs_mount::options::{Backend, ParsedOptions};
use tilefs_mount::{ErofsBacking, MountOptions, Verity};
use tilefs_store::{tags, Store};

#[derive(Args)]
pub struct MountArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// Image file, or a tag in the store
    pub image: PathBuf,
    /// Where to mount
    pub mountpoint: PathBuf,
    /// Mount with the kernel (EROFS + overlayfs; needs privilege)
    #[arg(long, conflicts_with = "fuse")]
    pub kernel: bool,
    /// Mount with the tilefs FUSE server (works without privilege)
    #[arg(long)]
    pub fuse: bool,
    /// Have the mount service (`tilefs mountd`) make a kernel mount of a tagged image for you
    /// (without privilege, if its policy allows you the store)
    #[arg(long, conflicts_with_all = ["kernel", "fuse"])]
    pub delegated: bool,
    /// Make the mount writable: changes go to this directory (overlayfs upperdir), in
    /// overlayfs's format whether the kernel or the FUSE server serves the mount
    #[arg(long, value_name = "DIR", requires = "work")]
    pub upper: Option<PathBuf>,
    /// Empty directory on the same filesystem as --upper (overlayfs workdir)
    #[arg(long, value_name = "DIR", requires = "upper")]
    pub work: Option<PathBuf>,
    /// Check objects against the image's digests: require (refuse to mount unless every file can be
    /// verified), auto (wherever possible; default) or off
    #[arg(long, value_name = "MODE", value_parser = ["require", "auto", "off"])]
    pub verity: Option<String>,
    /// Refuse the image unless its fs-verity digest is this (64 hex digits, as `tilefs digest` prints)
    #[arg(long, value_name = "DIGEST")]
    pub digest: Option<String>,
    /// Mount options as for `mount -o`: ro, nosuid, nodev, noexec, noatime, ...; for writable
    /// FUSE mounts uidmapping=STORED:SHOWN:LEN[:...] and gidmapping=... (ids inside a user
    /// namespace); anything unknown to tilefs is passed to overlayfs
    #[arg(short = 'o', long = "options", value_name = "OPTS")]
    pub options: Vec<String>,
    /// FUSE: stay in the foreground until unmounted
    #[arg(short, long)]
    pub foreground: bool,
    /// FUSE: also write the server's log lines to FILE (in the background they go to syslog)
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// FUSE: serve every read from the server, even as root where the kernel could read objects
    /// itself (passthrough): opening a file then never leaves the kernel, large reads cost more.
    /// Writable mounts: upper files are then written through the server with writeback caching
    #[arg(long, conflicts_with = "kernel")]
    pub no_passthrough: bool,
    /// FUSE: read requests from /dev/fuse even where the kernel offers FUSE over io_uring
    /// (the fuse module's enable_uring parameter; requests then stay on the caller's CPU)
    #[arg(long, conflicts_with = "kernel")]
    pub no_uring: bool,
    /// FUSE, as root: keep idle CPUs polling instead of halting while requests flow (a CPU
    /// latency request of 0 µs, for every CPU, relaxed 1 ms after the last request). auto: in a
    /// VM of 2 to 8 CPUs whose kernel does not poll before halting, where waking a halted CPU
    /// costs more than the request
    #[arg(long, value_name = "WHEN", default_value = "auto", value_parser = ["auto", "on", "off"], conflicts_with = "kernel")]
    pub idle_poll: String,
    /// FUSE: worker threads (the default is one per core, at least 2; at least 16 for an image pulled
    /// with --lazy, whose fetches hold their threads)
    #[arg(long, default_value_t = tilefs_fuse::default_threads(), value_name = "N")]
    pub threads: usize,
    /// How EROFS reads the image: auto, file or loop (for testing)
    #[arg(long, hide = true, default_value = "auto", value_parser = ["auto", "file", "loop"])]
    pub erofs_backing: String,
}

#[derive(Args)]
pub struct UmountArgs {
    /// Mount point
    pub mountpoint: PathBuf,
    /// Detach now even if files are open in it (they keep working until closed)
    #[arg(short, long)]
    pub lazy: bool,
}

/// A mount request, from `tilefs mount` or `mount.tilefs`.
pub struct Request {
    pub image: PathBuf,
    pub stores: Vec<PathBuf>,
    pub mountpoint: PathBuf,
    pub options: ParsedOptions,
    pub backend: Option<Backend>,
    pub foreground: bool,
    pub log: Option<PathBuf>,
    pub threads: usize,
    pub erofs_backing: ErofsBacking,
    /// FUSE: let other users in without `-o allow_other` (mount.tilefs as
    /// root: a system mount, visible to all as a kernel mount would be).
    pub allow_other: bool,
}

pub fn mount(a: MountArgs) -> Result<ExitCode> {
    let mut options = ParsedOptions::default();
    for o in &a.options {
        options.add(o).map_err(|e| anyhow!("-o {o}: {e}"))?;
    }
    if let Some(v) = &a.verity {
        options.verity = Some(v.parse().map_err(|e: String| anyhow!(e))?);
    }
    if let Some(d) = &a.digest {
        options.digest = Some(tilefs_mount::options::parse_digest(d).map_err(|e| anyhow!("--digest: {e}"))?);
    }
    if a.no_passthrough {
        options.passthrough = Some(false);
    }
    if a.no_uring {
        options.uring = Some(false);
    }
    match a.idle_poll.as_str() {
        "on" => options.idle_poll = Some(true),
        "off" => options.idle_poll = Some(false),
        _ => {}
    }
    if a.upper.is_some() {
        options.upper = a.upper.clone();
        options.work = a.work.clone();
    }
    // (mount.tilefs takes `rw` quietly: mount(8) passes it unasked.)
    if options.read_only == Some(false) && options.upper.is_none() {
        bail!("option rw: the mount is read-only unless it has --upper/--work");
    }
    let mut stores = vec![a.store.path()?];
    stores.append(&mut options.stores);
    let backend = if a.delegated {
        Some(Backend::Delegated)
    } else if a.kernel {
        Some(Backend::Kernel)
    } else if a.fuse {
        Some(Backend::Fuse)
    } else {
        options.backend
    };
    let req = Request {
        image: a.image,
        stores,
        mountpoint: a.mountpoint,
        options,
        backend,
        foreground: a.foreground,
        log: a.log.clone(),
        threads: a.threads,
        allow_other: false,
        erofs_backing: match a.erofs_backing.as_str() {
            "file" => ErofsBacking::File,
            "loop" => ErofsBacking::Loop,
            _ => ErofsBacking::Auto,
        },
    };
    run(&req)?;
    Ok(ExitCode::SUCCESS)
}

/// Mounts as `req` says: with the kernel when asked, or when not told and
/// the kernel can (privilege, EROFS and overlayfs, and fs-verity when
/// verification is required); otherwise with FUSE.
pub fn run(req: &Request) -> Result<()> {
    let store = match Store::open(&req.stores[0]) {
        Ok(s) => s,
        // A store this user may not read (root's, mode 0700): only the
        // mount service can mount its images for them.
        Err(tilefs_store::StoreError::Io { err, .. })
            if err.kind() == std::io::ErrorKind::PermissionDenied
                && matches!(req.backend, None | Some(Backend::Delegated)) =>
        {
            return delegated(req, &req.stores[0]).map_err(|why| {
                anyhow!(
                    "{}: cannot read the store ({err}), and the mount service did not mount it: {why:#}",
                    req.stores[0].display()
                )
            });
        }
        Err(e) => return Err(e.into()),
    };
    let image = tags::resolve_image(Some(&store), &req.image)?;
    let o = &req.options;
    let verity = o.verity.unwrap_or_default();
    // A lazily pulled image still missing objects: only FUSE can fetch them.
    // (The image is read for it only when the store has such images.)
    let lazy = if tilefs_store::remote::records(&store).is_empty() {
        None
    } else {
        read_image(&image)?.and_then(|b| tilefs_store::remote::incomplete(&store, &b))
    };
    // Why an automatic choice fell on FUSE, for the message if FUSE fails.
    let mut no_kernel = None;
    let backend = match (req.backend, lazy) {
        (Some(Backend::Kernel | Backend::Delegated), Some(missing)) => {
            bail!("{}: cannot be mounted by the kernel: {missing}", req.image.display());
        }
        (Some(b), _) => b,
        (None, Some(missing)) => {
            eprintln!(
                "{}: notice: using the FUSE mount: {} of the image's {} objects are still to be fetched \
                 (pulled with --lazy), and only it fetches them",
                prog(),
                missing.absent,
                missing.total
            );
            Backend::Fuse
        }
        (None, _) => match tilefs_mount::kernel_available() {
            // Without privilege: the mount service, when it is there and
            // may mount this image for us.
            Err(tilefs_mount::MountError::NotPermitted(e)) => match delegated(req, store.path()) {
                Ok(()) => return Ok(()),
                Err(why) => {
                    eprintln!(
                        "{}: notice: using the FUSE mount: no kernel mount here ({e}; {why:#})",
                        prog()
                    );
                    no_kernel = Some(e);
                    Backend::Fuse
                }
            },
            Ok(()) if verity == Verity::Require => match tilefs_mount::verity_unavailable(&req.stores) {
                Some(why) => {
                    eprintln!(
                        "{}: notice: using the FUSE mount, which verifies objects itself: {why}",
                        prog()
                    );
                    Backend::Fuse
                }
                None => Backend::Kernel,
            },
            Ok(()) => Backend::Kernel,
            Err(e) => {
                eprintln!("{}: notice: using the FUSE mount: no kernel mount here ({e})", prog());
                no_kernel = Some(e.to_string());
                Backend::Fuse
            }
        },
    };
    match backend {
        Backend::Delegated => delegated(req, store.path())?,
        Backend::Kernel => {
            // Held from the mount to its record, so a gc cannot run between.
            let lock = store.lock(tilefs_store::LockMode::Shared, true);
            let mounted = tilefs_mount::mount(&MountOptions {
                image: image.clone(),
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
            })
            .map_err(|e| match e {
                tilefs_mount::MountError::NotPermitted(_) => anyhow!("{e}; the FUSE mount (--fuse) needs no privilege"),
                e => e.into(),
            })?;
            for n in &mounted.notices {
                eprintln!("{}: notice: {n}", prog());
            }
            if let Err(e) = lock.and_then(|_lock| record_kernel_mount(&store, &mounted)) {
                eprintln!(
                    "{}: notice: the mount is not recorded in the store, so gc there may remove its objects: {e}",
                    prog()
                );
            }
        }
        Backend::Fuse => fuse(req, &image, verity, lazy.map(|m| m.digest)).map_err(|e| match no_kernel {
            Some(why) => anyhow!("{e:#} (and no kernel mount: {why})"),
            None => e,
        })?,
    }
    Ok(())
}

/// Has the mount service make the mount (a tagged image only: the service
/// mounts only what its policy trusts).
fn delegated(req: &Request, store: &std::path::Path) -> Result<()> {
    let o = &req.options;
    if req.stores.len() > 1 {
        bail!("a delegated mount serves one object store");
    }
    for (asked, what) in [(o.suid_asked, "suid"), (o.dev_asked, "dev")] {
        if asked {
            bail!("option {what} cannot be honoured: delegated mounts are always nosuid and nodev");
        }
    }
    if let Some((k, _)) = o.overlay.first() {
        bail!("option {k} cannot be honoured by a delegated mount");
    }
    if o.digest.is_some() {
        bail!("--digest cannot be honoured by a delegated mount (the service's policy pins digests)");
    }
    if o.attrs.atime.is_some() || o.attrs.nodiratime {
        bail!("access-time options cannot be honoured by a delegated mount (it keeps the kernel's default, relatime)");
    }
    let tag = req
        .image
        .to_str()
        .filter(|t| tags::validate_tag(t).is_ok() && !req.image.exists())
        .ok_or_else(|| anyhow!("{}: the mount service mounts tagged images only", req.image.display()))?;
    let socket = tilefs_mount::mountd::server::socket_path();
    let store_path = std::fs::canonicalize(store).map_err(|e| anyhow!("{}: {e}", store.display()))?;
    let verity = o.verity.map(|v| v.to_string());
    let notices = tilefs_mount::mountd::client::mount(
        &socket,
        &tilefs_mount::mountd::client::DelegatedMount {
            store: &store_path,
            image: tag,
            mountpoint: &req.mountpoint,
            noexec: o.attrs.noexec,
            nosymfollow: o.attrs.nosymfollow,
            verity: verity.as_deref(),
            upper: o.upper.as_deref().zip(o.work.as_deref()),
        },
    )?;
    for n in notices {
        eprintln!("{}: notice: {n}", prog());
    }
    eprintln!("{}: mounted by the mount service (a kernel mount)", prog());
    Ok(())
}

/// Records a kernel mount in its store: a gc root while it is mounted.
fn record_kernel_mount(store: &Store, m: &tilefs_mount::Mounted) -> Result<(), tilefs_store::StoreError> {
    let id = tilefs_store::mounts::mount_id_of(&m.mountpoint)
        .ok_or_else(|| tilefs_store::StoreError::Invalid(format!("{}: no mount there", m.mountpoint.display())))?;
    tilefs_store::mounts::register_kernel(store, &m.image, &m.mountpoint, id)
}

/// The bytes of the image file, read without blocking on whatever it is
/// (None if it is no regular file: the mount itself then says so).
fn read_image(image: &std::path::Path) -> Result<Option<Vec<u8>>> {
    use std::io::Read;
    let Ok(mut f) = tilefs_store::open_regular(rustix::fs::CWD, image, true) else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes)
        .map_err(|e| anyhow!("{}: cannot read: {e}", image.display()))?;
    Ok(Some(bytes))
}

/// `lazy`: the digest of an image pulled lazily, whose objects the server
/// fetches as they are read.
fn fuse(req: &Request, image: &std::path::Path, verity: Verity, lazy: Option<[u8; 32]>) -> Result<()> {
    let o = &req.options;
    let fetcher = match lazy {
        Some(digest) => tilefs_oci::fetch::LazySource::open(&req.stores[0], &digest)?
            .map(|s| tilefs_fuse::Fetcher(std::sync::Arc::new(s))),
        None => None,
    };
    let upper = match (&o.upper, &o.work) {
        (Some(u), Some(w)) => Some((u.clone(), w.clone())),
        (None, None) => None,
        _ => bail!("a writable mount needs both --upper and --work"),
    };
    if (o.uid_map.is_some() || o.gid_map.is_some()) && upper.is_none() {
        bail!("uidmapping and gidmapping apply to writable mounts (--upper/--work)");
    }
    if let Some((k, _)) = o.overlay.first() {
        bail!("option {k} is an overlayfs option: it needs a kernel mount (--kernel)");
    }
    let asked = |flag: bool, asked_off: bool| match (flag, asked_off) {
        (true, _) => Some(true),
        (false, true) => Some(false),
        (false, false) => None,
    };
    if req.stores.len() > 1 {
        bail!("the FUSE mount serves one object store");
    }
    tilefs_mount::check_mountpoint(&req.mountpoint)?;
    tilefs_fuse::mount(&tilefs_fuse::FuseMount {
        verity: match verity {
            Verity::Require => tilefs_fuse::Verity::Require,
            Verity::Auto => tilefs_fuse::Verity::Auto,
            Verity::Off => tilefs_fuse::Verity::Off,
        },
        foreground: req.foreground,
        log_file: req.log.clone(),
        threads: req.threads,
        image_digest: o.digest,
        allow_other: o.allow_other || req.allow_other,
        flags: tilefs_fuse::MountFlags {
            nosuid: asked(o.attrs.nosuid, o.suid_asked),
            nodev: asked(o.attrs.nodev, o.dev_asked),
            noexec: o.attrs.noexec,
            nosymfollow: o.attrs.nosymfollow,
        },
        tuning: tilefs_fuse::Tuning {
            passthrough: o.passthrough.unwrap_or(true),
            ..tilefs_fuse::Tuning::default()
        },
        fetcher,
        no_uring: o.uring == Some(false),
        idle_poll: o.idle_poll,
        upper,
        uid_map: o.uid_map.clone(),
        gid_map: o.gid_map.clone(),
        ..tilefs_fuse::FuseMount::new(image, &req.stores[0], &req.mountpoint)
    })
    .map_err(|e| anyhow!("FUSE mount of {} at {}: {e}", image.display(), req.mountpoint.display()))
}

/// This program's name, for messages (`tilefs` or `mount.tilefs`).
fn prog() -> String {
    std::env::args_os()
        .next()
        .and_then(|a| PathBuf::from(a).file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "tilefs".into())
}

pub fn umount(a: UmountArgs) -> Result<ExitCode> {
    // A FUSE mount whose server died cannot even be resolved (ENOTCONN):
    // find it in the mount table by its absolute path.
    let abs = match std::fs::canonicalize(&a.mountpoint) {
        Ok(p) => p,
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => std::path::absolute(&a.mountpoint)?,
        Err(_) => a.mountpoint.clone(),
    };
    match tilefs_mount::mountinfo::mounted_at(&abs) {
        Some(m) if m.is_fuse() && m.is_tilefs() => {
            tilefs_fuse::unmount(&abs, a.lazy).map_err(|e| anyhow!("{e}"))?;
            // Done only when the server is gone (a lazy detach leaves it
            // serving those still inside).
            let owner = m
                .super_options
                .split(',')
                .find_map(|o| o.strip_prefix("user_id=")?.parse().ok())
                .unwrap_or(0);
            if !a.lazy && !tilefs_fuse::wait_for_server(owner, &m.dev, std::time::Duration::from_secs(30)) {
                bail!(
                    "{}: unmounted, but its FUSE server has not exited after 30 s",
                    abs.display()
                );
            }
        }
        // A kernel mount the service made for us: the service unmounts it.
        Some(m) if m.is_tilefs() && !rustix::process::geteuid().is_root() => {
            tilefs_mount::mountd::client::umount(&tilefs_mount::mountd::server::socket_path(), &abs, a.lazy)?
        }
        _ => tilefs_mount::umount(&a.mountpoint, a.lazy)?,
    }
    Ok(ExitCode::SUCCESS)
}
