//! `tilefs snapshotter`: tilefs as a containerd snapshotter (proxy plugin),
//! see tilefs_snapshotter.

use crate::registry_arg::RegistryArgs;
use crate::store_arg::StoreArg;
use anyhow::{anyhow, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tilefs_snapshotter::{
    Config, DEFAULT_CONTAINERD_ROOT, DEFAULT_GC_DELAY, DEFAULT_PLUGIN_NAME, DEFAULT_ROOT, DEFAULT_SOCKET,
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
    /// TOML file with `root`, `store`, `socket`, `gc`, `gc_delay` and `cri_imagefs` (options given on
    /// the command line win)
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
    /// containers-policy.json(5) that each image the lazy path serves is checked against, in its
    /// own registry [default: ~/.config/containers/policy.json if it exists, else
    /// /etc/containers/policy.json; without one no image is served lazily]
    #[arg(long, value_name = "FILE")]
    pub signature_policy: Option<PathBuf>,
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
}

pub fn run(a: SnapshotterArgs) -> Result<ExitCode> {
    let file: FileConfig = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?;
            toml::from_str(&text).map_err(|e| anyhow!("{}: {}", p.display(), e.message()))?
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
    let cfg = Config {
        root: a.root.or(file.root).unwrap_or_else(|| DEFAULT_ROOT.into()),
        store,
        socket: a.socket.or(file.socket).unwrap_or_else(|| DEFAULT_SOCKET.into()),
        gc_delay: gc.then_some(delay),
        cri_imagefs,
    };
    let lazy = tilefs_snapshotter::lazy::Lazy {
        pull: tilefs_oci::pull::PullOptions {
            registry: a.registry.options(),
            trust: a.registry.trust(a.signature_policy.clone()),
            ..Default::default()
        },
        mount: std::sync::Arc::new(mount_lazy),
    };
    tilefs_snapshotter::serve(&cfg, Some(lazy), |sock| {
        eprintln!("tilefs snapshotter: serving on {}", sock.display())
    })
    .map_err(|e| anyhow!(e))?;
    Ok(ExitCode::SUCCESS)
}

/// Serves a lazily pulled image for the snapshotter: `tilefs mount`, whose
/// FUSE server runs in a process of its own, so that containers keep
/// reading through a restart of the snapshotter.
fn mount_lazy(store: &std::path::Path, tag: &str, mountpoint: &std::path::Path) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the tilefs program: {e}"))?;
    let out = std::process::Command::new(exe)
        .arg("mount")
        .arg("--fuse")
        .arg("--quiet")
        .arg("--store")
        .arg(store)
        .args(["-o", "ro,allow_other"])
        .arg(tag)
        .arg(mountpoint)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run tilefs mount: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    Ok(())
}
