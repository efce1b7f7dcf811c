//! `tilefs layer-store`: an additional layer store for podman
//! (containers/storage), see tilefs_fuse::layer_store and
//! tilefs_oci::layer_store.

use crate::logging::LogTo;
use crate::registry_arg::RegistryArgs;
use crate::store_arg::StoreArg;
use anyhow::{anyhow, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use tilefs_fuse::layer_store::{BlobReader, LayerFiles, LayerSource, LayerStoreFs};

pub const LONG_ABOUT: &str = "Serve an additional layer store for podman (containers/storage) at DIR, over a tilefs \
store: a layer of an image tilefs can start lazily (one with a `tilefs index`, eStargz, zstd:chunked) appears there when podman \
looks it up, so `podman pull` downloads none of its layers and each file is fetched on its first read, checked \
before a byte is served, into the store shared with every other image. Other images are left to podman. \
Registries are reached as podman reaches them: the credentials of the user running it (`podman login`'s \
auth.json, or $REGISTRY_AUTH_FILE), registries.conf (mirrors, insecure) and the signature policy; credentials \
given to one podman command (--authfile, --creds) do not reach it, and podman then pulls the image itself. \
In storage.conf: [storage.options] additionallayerstores = [\"DIR:ref\"]. Runs in the background once DIR \
answers, or with --foreground until DIR is unmounted (SIGTERM, SIGINT unmount it).";

#[derive(Args)]
pub struct LayerStoreArgs {
    /// Where to serve the layer store (the DIR of storage.conf's `additionallayerstores = ["DIR:ref"]`)
    #[arg(long, value_name = "DIR")]
    pub mount: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArg,
    /// TOML file with any of `mount`, `store`, `state`, `log`, `tls_verify`, `timeout`, `min_rate`,
    /// `registries_conf`, `registries_d`, `signature_policy`; options given on the command line win
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Where the layers served are recorded, so that podman's paths into DIR stay valid across
    /// restarts [default: layer-store beside the store directory]
    #[arg(long, value_name = "DIR")]
    pub state: Option<PathBuf>,
    /// Serve in the foreground (messages on stderr) until DIR is unmounted
    #[arg(long)]
    pub foreground: bool,
    /// Append the server's messages to FILE [default: in the foreground stderr; in the background
    /// the system log, or where there is none /var/log/tilefs/layer-store.log for root,
    /// ~/.local/state/tilefs/layer-store.log for others and for root in a user namespace]
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// How registries are reached (as `tilefs pull` reaches them: its credentials, registries.conf)
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// containers-policy.json(5) that each image served is checked against [default:
    /// ~/.config/containers/policy.json if it exists, else /etc/containers/policy.json]
    #[arg(long, value_name = "FILE")]
    pub signature_policy: Option<PathBuf>,
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    mount: Option<PathBuf>,
    store: Option<PathBuf>,
    state: Option<PathBuf>,
    log: Option<PathBuf>,
    tls_verify: Option<bool>,
    timeout: Option<u64>,
    min_rate: Option<u64>,
    registries_conf: Option<PathBuf>,
    registries_d: Option<PathBuf>,
    signature_policy: Option<PathBuf>,
}

/// The library's layers, as the FUSE filesystem asks for them.
struct Source(tilefs_oci::layer_store::LayerStore, PathBuf);

struct Blob(Arc<tilefs_oci::layer_store::BlobSource>);

impl BlobReader for Blob {
    fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>, String> {
        self.0.read_at(offset, len)
    }
}

impl LayerSource for Source {
    fn layer(&self, reference: &str, digest: &str) -> Result<Option<LayerFiles>, String> {
        let Some(s) = self.0.layer(reference, digest).map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        let fetcher = match s.source {
            Some(source) => Some(source),
            None => tilefs_oci::toc_lazy::open_source_later(&self.1, &s.image).map_err(|e| e.to_string())?,
        }
        .map(tilefs_fuse::Fetcher);
        Ok(Some(LayerFiles {
            image: s.image_path,
            fetcher,
            info: s.info,
            blob_size: s.blob_size,
            blob: Arc::new(Blob(s.blob)),
        }))
    }

    fn used(&self, reference: &str, digest: &str) -> Result<(), String> {
        self.0
            .note_use(reference, digest, true)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn released(&self, reference: &str, digest: &str) -> Result<bool, String> {
        self.0.note_use(reference, digest, false).map_err(|e| e.to_string())
    }

    fn epoch(&self) -> u64 {
        tilefs_oci::layer_store::credentials_epoch()
    }
}

pub fn run(mut a: LayerStoreArgs) -> Result<ExitCode> {
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
    let mount = a
        .mount
        .clone()
        .or(file.mount)
        .ok_or_else(|| anyhow!("--mount DIR is needed (or `mount` in --config)"))?;
    let store = match (a.store.store.clone(), file.store) {
        (Some(s), _) | (None, Some(s)) => s,
        (None, None) => a.store.path()?,
    };
    let state = match a.state.clone().or(file.state) {
        Some(s) => s,
        None => store.parent().map(|p| p.join("layer-store")).ok_or_else(|| {
            anyhow!(
                "{}: no directory beside it for the state; give --state",
                store.display()
            )
        })?,
    };
    let r = &mut a.registry;
    r.tls_verify = r.tls_verify.or(file.tls_verify);
    r.timeout = r.timeout.or(file.timeout);
    r.min_rate = r.min_rate.or(file.min_rate);
    r.registries_conf = r.registries_conf.take().or(file.registries_conf);
    r.registries_d = r.registries_d.take().or(file.registries_d);
    let pull = tilefs_oci::pull::PullOptions {
        registry: a.registry.options(),
        trust: a.registry.trust(a.signature_policy.clone().or(file.signature_policy)),
        ..Default::default()
    };
    let log_file = match (a.log.clone().or(file.log), a.foreground) {
        (Some(p), _) => Some(p),
        (None, true) => None,
        (None, false) if crate::mount_cmd::has_syslog() => None,
        (None, false) => crate::mount_cmd::default_log_file("layer-store.log"),
    };
    let log = match (&log_file, a.foreground) {
        (Some(p), _) => LogTo::File(p.clone()),
        (None, true) => LogTo::Stderr,
        (None, false) => LogTo::Syslog,
    };
    crate::logging::to_server_log(&log)?;
    tilefs_fuse::raise_nofile();
    let layers = tilefs_oci::layer_store::LayerStore::open(&store, &state, pull).map_err(|e| anyhow!(e))?;
    let fs = LayerStoreFs::new(store.clone(), Arc::new(Source(layers, store))).map_err(|e| anyhow!(e))?;
    let server = tilefs_fuse::Server::layer_store(fs);
    let config = server.serve_config(0, true, None);
    let mounted = tilefs_fuse::mount(
        server,
        &tilefs_fuse::DevMount {
            mountpoint: mount,
            // podman's processes other than the one that mounted read it.
            allow_other: rustix::process::geteuid().is_root(),
            ..Default::default()
        },
    )
    .map_err(|e| anyhow!(e))?;
    crate::fuse_serve::serve(mounted, config, a.foreground, log_file.as_deref())?;
    Ok(ExitCode::SUCCESS)
}
