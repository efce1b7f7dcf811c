//! `tilefs mount` and `tilefs umount`.

use crate::logging::LogTo;
use crate::present_args::PresentArgs;
use anyhow::{anyhow, bail, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use tilefs_mount::options::Backend;
use tilefs_mount::ErofsBacking;
use tilefs_present::{Presented, Request};

#[derive(Args)]
pub struct MountArgs {
    #[command(flatten)]
    pub present: PresentArgs,
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
    /// FUSE, and a kernel mount of a lazily pulled image (its filler): stay in the foreground
    /// until unmounted
    #[arg(short, long)]
    pub foreground: bool,
    /// FUSE, and a kernel lazy mount's filler: write the server's log lines to FILE (the default: stderr in the foreground; in the
    /// background the system log, or where there is none ~/.local/state/tilefs/fuse.log, for root
    /// /var/log/tilefs/fuse.log, for a root that cannot write there (podman unshare) the user's)
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// Print no notices (facts of the machine, such as no kernel mount without privilege, are
    /// said once per boot anyway)
    #[arg(short, long)]
    pub quiet: bool,
    /// A kernel mount of a lazily pulled image: also fetch the objects no reader asked for, in
    /// the background, at most RATE bytes a second on average (suffix K, M or G: 1024-based);
    /// readers never wait for it. Once all are fetched the image is complete
    #[arg(long, value_name = "RATE", value_parser = parse_rate)]
    pub fetch_rest: Option<u64>,
    /// FUSE: serve every read from the server, even as root where the kernel could read objects
    /// itself (passthrough): opening a file then never leaves the kernel, large reads cost more.
    /// (Writable mounts do without passthrough unless --passthrough is given)
    #[arg(long, conflicts_with_all = ["kernel", "passthrough"])]
    pub no_passthrough: bool,
    /// FUSE, writable mounts, as root: the kernel reads and writes upper files itself
    /// (passthrough). Every open of a file then costs two requests (OPEN, RELEASE), which a build
    /// pays for each #include. Without it (the default) no open is asked for, and writes to upper
    /// files go through the server as they are made
    #[arg(long, conflicts_with = "kernel")]
    pub passthrough: bool,
    /// FUSE: read requests from /dev/fuse even where the kernel offers FUSE over io_uring
    /// (the fuse module's enable_uring parameter; requests then stay on the caller's CPU)
    #[arg(long, conflicts_with = "kernel")]
    pub no_uring: bool,
    /// FUSE, as root: keep idle CPUs polling instead of halting while requests flow (a CPU
    /// latency request of 0 µs, for every CPU, relaxed 1 ms after the last request)
    #[arg(long, value_name = "WHEN", value_enum, default_value_t = IdlePoll::Auto, conflicts_with = "kernel")]
    pub idle_poll: IdlePoll,
    /// For the snapshotter: registry credentials for the image's repository, as JSON on stdin,
    /// used by the fetches of a lazily pulled image (kept in memory only)
    #[arg(long, hide = true)]
    pub credentials_stdin: bool,
    /// For the snapshotter: containerd's registry host configuration (DIR/HOST/hosts.toml) that the
    /// fetches of a lazily pulled image honour
    #[arg(long, hide = true, value_name = "DIR")]
    pub hosts_dir: Option<PathBuf>,
    /// For the snapshotter: a kernel mount of a lazily pulled image file as EROFS alone (the
    /// container's overlay adds the store as its data-only lower), its placeholders filled on
    /// first access; exit code 3 (the reason on stderr) where the kernel cannot fill them here
    #[arg(long, hide = true, conflicts_with_all = ["fuse", "kernel", "delegated", "foreground"])]
    pub erofs_alone: bool,
}

#[derive(Args)]
pub struct UmountArgs {
    /// Mount point
    pub mountpoint: PathBuf,
    /// Detach now even if files are open in it (they keep working until closed)
    #[arg(short, long)]
    pub lazy: bool,
}

/// `--idle-poll`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IdlePoll {
    /// In a VM of 2 to 8 CPUs whose kernel does not poll before halting, where waking a halted
    /// CPU costs more than the request
    Auto,
    /// Always
    On,
    /// Never
    Off,
}

/// What the command line adds to a request: how to run a FUSE server.
pub struct Serving {
    /// Stay in the foreground until unmounted.
    pub foreground: bool,
    /// The server's log file (else stderr in the foreground, syslog in
    /// the background, or a file of the user's where there is no syslog).
    pub log: Option<PathBuf>,
    /// Print no notices.
    pub quiet: bool,
    /// A kernel lazy mount: fetch the rest at this many bytes a second.
    pub fetch_rest: Option<u64>,
}

/// `--fetch-rest`: bytes a second, with an optional K, M or G.
pub(crate) fn parse_rate(s: &str) -> Result<u64, String> {
    let (num, unit) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&s[..i], c.to_ascii_uppercase()),
        _ => (s, 'B'),
    };
    let shift = match unit {
        'B' => 0,
        'K' => 10,
        'M' => 20,
        'G' => 30,
        _ => return Err(format!("{s}: a number of bytes a second, with K, M or G")),
    };
    match num
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_shl(shift).filter(|v| v >> shift == n))
    {
        Some(v) if v > 0 => Ok(v),
        _ => Err(format!("{s}: a number of bytes a second above 0, with K, M or G")),
    }
}

pub fn mount(a: MountArgs) -> Result<ExitCode> {
    if a.credentials_stdin {
        let mut json = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(std::io::stdin(), 1 << 20), &mut json)
            .map_err(|e| anyhow!("--credentials-stdin: cannot read: {e}"))?;
        let entry: tilefs_oci::transport::keychain::Entry =
            serde_json::from_slice(&json).map_err(|e| anyhow!("--credentials-stdin: not credentials: {e}"))?;
        tilefs_oci::transport::keychain::import(entry);
    }
    if a.hosts_dir.is_some() {
        tilefs_oci::transport::hosts::set_config_path(a.hosts_dir.clone());
    }
    if a.erofs_alone {
        return erofs_alone(&a);
    }
    let mut req = a.present.request()?;
    let o = &mut req.options;
    if a.no_passthrough {
        o.passthrough = Some(false);
    }
    if a.passthrough {
        o.passthrough = Some(true);
    }
    if a.no_uring {
        o.uring = Some(false);
    }
    match a.idle_poll {
        IdlePoll::On => o.idle_poll = Some(true),
        IdlePoll::Off => o.idle_poll = Some(false),
        IdlePoll::Auto => {}
    }
    if a.delegated {
        req.backend = Some(Backend::Delegated);
    } else if a.kernel {
        req.backend = Some(Backend::Kernel);
    } else if a.fuse {
        req.backend = Some(Backend::Fuse);
    }
    req.mountpoint = a.mountpoint;
    req.erofs_backing = erofs_backing()?;
    run(
        req,
        &Serving {
            foreground: a.foreground,
            log: a.log.clone(),
            quiet: a.quiet,
            fetch_rest: a.fetch_rest,
        },
    )?;
    Ok(ExitCode::SUCCESS)
}

/// `--erofs-alone` (see there): the exit code 3 says the kernel cannot
/// fill this image's placeholders here (the reason on stderr), the
/// caller's cue to serve it by FUSE.
fn erofs_alone(a: &MountArgs) -> Result<ExitCode> {
    use tilefs_present::kernel_lazy::{self, NotMounted};
    let store = tilefs_store::Store::open(&a.present.store.path()?)?;
    let (armed, id) = match kernel_lazy::mount_erofs_alone(&store, &a.present.image, &a.mountpoint) {
        Ok(m) => m,
        Err(NotMounted::Unable(why)) => {
            eprintln!("{why}");
            return Ok(ExitCode::from(3));
        }
        Err(NotMounted::Failed(why)) => bail!(why),
    };
    let Some(armed) = armed else {
        return Ok(ExitCode::SUCCESS);
    };
    let log_file = a
        .log
        .clone()
        .or_else(|| (!has_syslog()).then(|| default_log_file("fuse.log")).flatten());
    crate::lazy_serve::serve(armed, &a.mountpoint, id, a.fetch_rest, false, log_file.as_deref())?;
    Ok(ExitCode::SUCCESS)
}

/// Presents the image as `req` says (see tilefs_present), tells the user
/// what they should know, and serves a FUSE mount as `serving` says.
pub fn run(req: Request, serving: &Serving) -> Result<()> {
    // The server keeps objects open for the kernel, and removed files
    // until the kernel forgets them.
    tilefs_fuse::raise_nofile();
    let mut said = Vec::new();
    let log_file = match (&serving.log, serving.foreground) {
        (Some(p), _) => Some(p.clone()),
        (None, true) => None,
        (None, false) if has_syslog() => None,
        (None, false) => {
            let f = default_log_file("fuse.log");
            if let Some(p) = &f {
                said.push(format!(
                    "a FUSE server's messages go to {} (there is no system log here)",
                    p.display()
                ));
            }
            f
        }
    };
    crate::logging::to_server_log(&match (&log_file, serving.foreground) {
        (Some(p), _) => LogTo::File(p.clone()),
        (None, true) => LogTo::Stderr,
        (None, false) => LogTo::Syslog,
    })?;
    let presented = tilefs_present::mount(&req).map_err(with_flags)?;
    if serving.fetch_rest.is_some() && !matches!(presented, Presented::KernelLazy { .. }) {
        eprintln!(
            "{}: notice: --fetch-rest: only a kernel mount of a lazily pulled image fetches in the background",
            prog()
        );
    }
    let notices = presented.notices().iter().map(|n| (n.to_string(), n.is_machine_fact()));
    for (n, once) in notices.chain(said.into_iter().map(|s| (s, true))) {
        if !serving.quiet && (!once || crate::once::first_time(&n)) {
            eprintln!("{}: notice: {n}", prog());
        }
    }
    match presented {
        Presented::Fuse { mounted, config, .. } => {
            crate::fuse_serve::serve(mounted, config, serving.foreground, log_file.as_deref())?
        }
        Presented::KernelLazy {
            armed,
            mountpoint,
            mount_id,
            ..
        } => crate::lazy_serve::serve(
            armed,
            &mountpoint,
            mount_id,
            serving.fetch_rest,
            serving.foreground,
            log_file.as_deref(),
        )?,
        Presented::Kernel { .. } => {}
    }
    Ok(())
}

/// How EROFS reads the image: `$TILEFS_EROFS_BACKING` (auto, file or
/// loop), for tests of the loop device path on kernels that read files.
fn erofs_backing() -> Result<ErofsBacking> {
    match std::env::var("TILEFS_EROFS_BACKING").as_deref() {
        Err(_) | Ok("" | "auto") => Ok(ErofsBacking::Auto),
        Ok("file") => Ok(ErofsBacking::File),
        Ok("loop") => Ok(ErofsBacking::Loop),
        Ok(v) => bail!("$TILEFS_EROFS_BACKING={v}: auto, file or loop"),
    }
}

/// Whether a system log listens (/dev/log is a socket).
pub(crate) fn has_syslog() -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata("/dev/log").is_ok_and(|m| m.file_type().is_socket())
}

/// Where a background server logs when there is no system log: `name` in
/// the user's state directory (root: /var/log/tilefs), made if needed. A
/// root that cannot write there (root of a user namespace, `podman
/// unshare`) logs in its user's state directory instead.
pub(crate) fn default_log_file(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let make = |dir: PathBuf| {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .ok()?;
        // Made, or there already: writable by us?
        rustix::fs::access(&dir, rustix::fs::Access::WRITE_OK).ok()?;
        Some(dir.join(name))
    };
    if rustix::process::geteuid().is_root() {
        if let Some(p) = make(PathBuf::from("/var/log/tilefs")) {
            return Some(p);
        }
    }
    let abs = |v: Option<std::ffi::OsString>| v.map(PathBuf::from).filter(|p| p.is_absolute());
    let dir = abs(std::env::var_os("XDG_STATE_HOME"))
        .or_else(|| abs(std::env::var_os("HOME")).map(|h| h.join(".local/state")))?
        .join("tilefs");
    make(dir)
}

/// A library error, with the command-line flag that helps where one does.
fn with_flags(e: tilefs_present::Error) -> anyhow::Error {
    use tilefs_mount::MountError;
    match &e {
        tilefs_present::Error::Kernel(MountError::NotPermitted(_)) => {
            anyhow!("{e}; the FUSE mount (--fuse) needs no privilege")
        }
        tilefs_present::Error::Kernel(MountError::Verity(_)) => {
            anyhow!("{e} (--verity require; the FUSE mount, --fuse, verifies objects in userspace)")
        }
        tilefs_present::Error::Refused(tilefs_present::Refusal::LazyNeedsFuse { .. }) => {
            anyhow!("{e}: mount it with --fuse, or fetch the rest with `tilefs pull` (it was pulled with --lazy)")
        }
        _ => e.into(),
    }
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
            tilefs_fuse::unmount(&abs, a.lazy).map_err(|e| match e {
                tilefs_fuse::FuseError::Busy(_) => anyhow!("{e} (--lazy)"),
                e => anyhow!("{e}"),
            })?;
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
        found => {
            tilefs_mount::umount(&a.mountpoint, a.lazy).map_err(|e| match e {
                tilefs_mount::MountError::UmountBusy(_) => anyhow!("{e} (--lazy)"),
                e => e.into(),
            })?;
            // A lazily pulled image's kernel mount is done when its filler
            // is gone (no other kernel mount has one: nothing to wait for).
            if let Some(m) = found.filter(|m| m.is_tilefs() && !a.lazy) {
                if !tilefs_fuse::wait_for_server(0, &m.dev, std::time::Duration::from_secs(30)) {
                    bail!("{}: unmounted, but its filler has not exited after 30 s", abs.display());
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
