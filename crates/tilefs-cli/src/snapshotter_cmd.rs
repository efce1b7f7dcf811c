//! `tilefs snapshotter`: tilefs as a containerd snapshotter (proxy plugin),
//! see tilefs_snapshotter: its options, and its life on the socket until
//! SIGINT or SIGTERM.

use crate::registry_arg::RegistryArgs;
use crate::store_arg::StoreArg;
use anyhow::{anyhow, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tilefs_snapshotter::lazy::{How, Refused};
use tilefs_snapshotter::{
    Config, Tilefs, DEFAULT_CONTAINERD_ROOT, DEFAULT_GC_DELAY, DEFAULT_PLUGIN_NAME, DEFAULT_ROOT, DEFAULT_SOCKET,
};

#[derive(Args)]
pub struct SnapshotterArgs {
    /// Unix socket containerd connects to (its config's proxy_plugins address)
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// State directory: snapshot records, upper directories, image mounts
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArg,
    /// TOML file with any of the options below (`root`, `store`, `socket`, `gc_delay`, `gc = false`,
    /// `cri_imagefs`, `tls_verify`, `timeout`, `min_rate`, `registries_conf`, `registries_d`,
    /// `signature_policy`, `lazy_fuse = true`, `lazy_fetch_rest = "RATE"`), and the tables `[cri_keychain]` (`enable_keychain`,
    /// `image_service_path`: serve CRI's image service here, in front of containerd's) and
    /// `[registry]` (`config_path`: containerd's hosts.toml directory); options given on the command
    /// line win
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Collect the objects removed snapshots used this long after the last Remove (default 10)
    #[arg(long, value_name = "SECONDS")]
    pub gc_delay: Option<u64>,
    /// Never collect by itself (`tilefs gc` does)
    #[arg(long)]
    pub no_gc: bool,
    /// Make PATH (the image filesystem containerd's CRI names for this proxy plugin:
    /// CONTAINERD_ROOT/io.containerd.snapshotter.v1.NAME) a symlink to the store; empty: none
    /// [default: /var/lib/containerd/io.containerd.snapshotter.v1.tilefs, if /var/lib/containerd
    /// is a directory]
    #[arg(long, value_name = "PATH")]
    pub cri_imagefs: Option<std::ffi::OsString>,
    /// How CRI's lazy path reaches registries (as `tilefs pull` does)
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// containers-policy.json(5) that each image the lazy path serves (and its tilefs index), and
    /// each pull through the CRI image service proxy, is checked against, in its own registry
    /// [default: ~/.config/containers/policy.json if it exists, else /etc/containers/policy.json;
    /// without one no image is served lazily]
    #[arg(long, value_name = "FILE")]
    pub signature_policy: Option<PathBuf>,
    /// Serve lazily started containers' images by FUSE even where the kernel could (EROFS and
    /// overlayfs, objects filled on first access through fanotify pre-content events)
    #[arg(long)]
    pub lazy_fuse: bool,
    /// Images served lazily by the kernel: also fetch the objects no container asked for, in the
    /// background, at most RATE bytes a second on average each (suffix K, M or G: 1024-based), so
    /// that the node ends up with complete images; containers never wait for it
    #[arg(long, value_name = "RATE", value_parser = crate::mount_cmd::parse_rate)]
    pub lazy_fetch_rest: Option<u64>,
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    root: Option<PathBuf>,
    store: Option<PathBuf>,
    socket: Option<PathBuf>,
    gc: Option<bool>,
    gc_delay: Option<u64>,
    cri_imagefs: Option<PathBuf>,
    tls_verify: Option<bool>,
    timeout: Option<u64>,
    min_rate: Option<u64>,
    registries_conf: Option<PathBuf>,
    registries_d: Option<PathBuf>,
    signature_policy: Option<PathBuf>,
    lazy_fuse: Option<bool>,
    lazy_fetch_rest: Option<String>,
    cri_keychain: Option<CriKeychain>,
    registry: Option<RegistryHosts>,
}

/// stargz-snapshotter's keys.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CriKeychain {
    #[serde(default)]
    enable_keychain: bool,
    image_service_path: Option<PathBuf>,
}

/// containerd's key.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RegistryHosts {
    config_path: Option<PathBuf>,
}

/// containerd's CRI socket, unless `image_service_path` says.
const DEFAULT_IMAGE_SERVICE: &str = "/run/containerd/containerd.sock";

/// How long a stop waits for clients to close their connections.
const STOP_GRACE: Duration = Duration::from_secs(5);

pub fn run(mut a: SnapshotterArgs) -> Result<ExitCode> {
    let file: FileConfig = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?;
            toml::from_str(&text).map_err(|e| {
                let line = e
                    .span()
                    .map_or(0, |s| text[..s.start.min(text.len())].matches('\n').count() + 1);
                anyhow!("{}: line {line}: {}", p.display(), e.message())
            })?
        }
        None => FileConfig::default(),
    };
    let store = match (a.store.store.clone(), file.store) {
        (Some(s), _) | (None, Some(s)) => s,
        (None, None) => a.store.path()?,
    };
    let gc = !a.no_gc && file.gc != Some(false);
    let delay = a
        .gc_delay
        .or(file.gc_delay)
        .map_or(DEFAULT_GC_DELAY, Duration::from_secs);
    let cri_imagefs = match a.cri_imagefs.map(PathBuf::from).or(file.cri_imagefs) {
        Some(p) if p.as_os_str().is_empty() => None,
        Some(p) => Some(p),
        None => Path::new(DEFAULT_CONTAINERD_ROOT).is_dir().then(|| {
            Path::new(DEFAULT_CONTAINERD_ROOT).join(format!("io.containerd.snapshotter.v1.{DEFAULT_PLUGIN_NAME}"))
        }),
    };
    let r = &mut a.registry;
    r.tls_verify = r.tls_verify.or(file.tls_verify);
    r.timeout = r.timeout.or(file.timeout);
    r.min_rate = r.min_rate.or(file.min_rate);
    r.registries_conf = r.registries_conf.take().or(file.registries_conf);
    r.registries_d = r.registries_d.take().or(file.registries_d);
    let signature_policy = a.signature_policy.clone().or(file.signature_policy);
    let lazy_fetch_rest = match (a.lazy_fetch_rest, &file.lazy_fetch_rest) {
        (Some(r), _) => Some(r),
        (None, Some(r)) => Some(crate::mount_cmd::parse_rate(r).map_err(|e| {
            anyhow!(
                "{}: lazy_fetch_rest: {e}",
                a.config.as_deref().unwrap_or(Path::new("")).display()
            )
        })?),
        (None, None) => None,
    };
    // The lazy path's fetches, here and in the FUSE servers (which are
    // told the directory), honour containerd's hosts.toml.
    tilefs_oci::transport::hosts::set_config_path(file.registry.and_then(|r| r.config_path));
    let cri_image_service = file
        .cri_keychain
        .filter(|k| k.enable_keychain)
        .map(|k| k.image_service_path.unwrap_or_else(|| DEFAULT_IMAGE_SERVICE.into()));
    let cfg = Config {
        root: a.root.or(file.root).unwrap_or_else(|| DEFAULT_ROOT.into()),
        store,
        socket: a.socket.or(file.socket).unwrap_or_else(|| DEFAULT_SOCKET.into()),
        gc_delay: gc.then_some(delay),
        cri_imagefs,
        cri_image_service,
    };
    let lazy = tilefs_snapshotter::lazy::Lazy {
        pull: tilefs_oci::pull::PullOptions {
            registry: a.registry.options(),
            trust: a.registry.trust(signature_policy),
            ..Default::default()
        },
        mount: std::sync::Arc::new(mount_lazy),
        kernel: !a.lazy_fuse && file.lazy_fuse != Some(true),
        fetch_rest: lazy_fetch_rest,
    };
    crate::logging::set_name("tilefs snapshotter");
    let snap = Tilefs::open(&cfg, Some(lazy)).map_err(|e| anyhow!(e))?;
    if let Some(link) = &cfg.cri_imagefs {
        match tilefs_snapshotter::link_imagefs(link, snap.store()) {
            Ok(()) => tracing::info!("{} (CRI's image filesystem) leads to the store", link.display()),
            Err(e) => tracing::warn!("{e}"),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(16)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let served = rt.block_on(serve(&cfg, snap.clone()));
    // Stopped: what Commits left unsynced is synced now, not checked at
    // the next start.
    snap.stop();
    served?;
    Ok(ExitCode::SUCCESS)
}

/// Serves `snap` on `cfg.socket` until SIGINT or SIGTERM (or a failure),
/// the socket removed after.
async fn serve(cfg: &Config, snap: Tilefs) -> Result<()> {
    let sock = &cfg.socket;
    let listener = bind(sock)?;
    tracing::info!("serving on {}", sock.display());
    if let Some(p) = &cfg.cri_image_service {
        tracing::info!("serving CRI's image service there too, in front of {}", p.display());
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let images = cfg.cri_image_service.clone();
    let mut server = tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        tilefs_snapshotter::grpc::serve(snap, images.as_deref(), listener, shutdown).await
    });
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let signalled = async {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
    };
    let done = tokio::select! {
        r = &mut server => Some(r),
        _ = signalled => None,
    };
    let done = match done {
        Some(r) => r,
        None => {
            // Requests under way finish; a client that keeps its
            // connection open (idle) does not hold the stop up for long.
            let _ = stop.send(());
            match tokio::time::timeout(STOP_GRACE, &mut server).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!(
                        "clients still connected {} s after the signal: stopping",
                        STOP_GRACE.as_secs()
                    );
                    server.abort();
                    Ok(Ok(()))
                }
            }
        }
    };
    let _ = std::fs::remove_file(sock);
    match done {
        Ok(r) => r.with_context(|| format!("{}: serving failed", sock.display())),
        Err(e) => Err(anyhow!("{}: the server stopped: {e}", sock.display())),
    }
}

/// Listens on the unix socket `sock` (its directory made), refusing one a
/// live server listens on and replacing a stale one; only root may
/// connect.
fn bind(sock: &Path) -> Result<tokio::net::UnixListener> {
    if let Some(dir) = sock.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    }
    let fd = tilefs_sys::socket::bind_fresh(sock, rustix::net::SocketType::STREAM)?;
    // Root's only, before anyone can connect.
    rustix::fs::chmod(sock, rustix::fs::Mode::from_raw_mode(0o600))
        .with_context(|| format!("{}: cannot set its mode", sock.display()))?;
    rustix::net::listen(&fd, 128).with_context(|| format!("{}: cannot listen", sock.display()))?;
    let std_listener = std::os::unix::net::UnixListener::from(fd);
    std_listener
        .set_nonblocking(true)
        .with_context(|| format!("{}: cannot listen", sock.display()))?;
    let listener = tokio::net::UnixListener::from_std(std_listener)
        .with_context(|| format!("{}: cannot listen", sock.display()))?;
    Ok(listener)
}

/// Serves a lazily pulled image for the snapshotter as `how` says:
/// `tilefs mount`, whose filler or FUSE server runs in a process of its
/// own, so that containers keep reading through a restart of the
/// snapshotter. It is handed the credentials CRI gave for the image
/// (through a pipe) and the hosts.toml directory.
fn mount_lazy(
    store: &std::path::Path,
    tag: &str,
    mountpoint: &std::path::Path,
    reference: Option<&tilefs_oci::ImageRef>,
    how: How,
) -> Result<(), Refused> {
    use std::io::Write;
    use tilefs_oci::transport::{hosts, keychain};
    use tilefs_snapshotter::Error;
    let exe = std::env::current_exe().map_err(|e| Error::Broken(format!("cannot find the tilefs program: {e}")))?;
    let creds = reference.and_then(|r| keychain::export(&r.to_string()));
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("mount");
    if let Some(dir) = hosts::config_path() {
        cmd.arg("--hosts-dir").arg(dir);
    }
    if creds.is_some() {
        cmd.arg("--credentials-stdin");
    }
    match how {
        How::Kernel { fetch_rest } => {
            cmd.arg("--erofs-alone");
            if let Some(rate) = fetch_rest {
                cmd.arg(format!("--fetch-rest={rate}"));
            }
        }
        How::Fuse => {
            cmd.args(["--fuse", "-o", "ro,allow_other"]);
        }
    }
    let child = cmd
        .arg("--quiet")
        .arg("--store")
        .arg(store)
        .arg(tag)
        .arg(mountpoint)
        .stdin(match creds {
            Some(_) => std::process::Stdio::piped(),
            None => std::process::Stdio::null(),
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Error::Broken(format!("cannot run tilefs mount: {e}")))?;
    let mut child = child;
    if let (Some(c), Some(mut stdin)) = (creds, child.stdin.take()) {
        let json = serde_json::to_vec(&c).map_err(|e| Error::Broken(format!("cannot hand on the credentials: {e}")))?;
        // A mount that failed before reading says why below.
        let _ = stdin.write_all(&json);
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Error::Broken(format!("cannot run tilefs mount: {e}")))?;
    let said = String::from_utf8_lossy(&out.stderr).trim().to_string();
    match out.status.code() {
        Some(0) => Ok(()),
        // --erofs-alone: the kernel cannot fill this image's objects here.
        Some(3) if matches!(how, How::Kernel { .. }) => Err(Refused::KernelUnable(said)),
        _ => Err(Refused::Failed(Error::Broken(said))),
    }
}
