//! `tilefs pull`: an OCI image in, a tagged image in the store out.

use crate::build::NewStore;
use crate::progress::{self, Progress};
use crate::registry_arg::RegistryArgs;
use crate::store_arg::StoreArg;
use anyhow::{Context, Result};
use clap::Args;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tilefs_oci::manifest::Platform;
use tilefs_oci::pull::PullProgress;
use tilefs_oci::{ImageRef, PullOptions};
use tilefs_store::Store;

#[derive(Args)]
pub struct PullArgs {
    /// Image reference: oci:DIR[:NAME], oci-archive:FILE[:NAME], docker-archive:FILE[:REPO:TAG],
    /// docker://[HOST[:PORT]/]REPO[:TAG|@DIGEST], or an image name as podman takes it
    /// ([HOST[:PORT]/]REPO[:TAG|@DIGEST], a short name resolved through registries.conf)
    pub reference: String,
    #[command(flatten)]
    pub store: StoreArg,
    /// Tag to record the image under [default: the reference's repository and tag, e.g.
    /// busybox:1.36, with '/' made '_']
    #[arg(long, value_name = "NAME")]
    pub tag: Option<String>,
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// The signature policy (containers-policy.json) [default: ~/.config/containers/policy.json
    /// if it exists, else /etc/containers/policy.json; without one the pull is refused, as
    /// podman refuses it]
    #[arg(long, value_name = "FILE")]
    pub signature_policy: Option<std::path::PathBuf>,
    /// Platform to pick from a multi-platform image [default: this machine's, e.g. linux/amd64]
    #[arg(long, value_name = "OS/ARCH[/VARIANT]")]
    pub platform: Option<String>,
    /// Keep every xattr the layers carry (by default only security.capability is kept, as
    /// composefs-rs does, so both tools give the same image)
    #[arg(long)]
    pub all_xattrs: bool,
    /// Layers read at once [default: one per core, at least 2]
    #[arg(short, long, default_value_t = 0, value_name = "N", hide_default_value = true)]
    pub jobs: usize,
    /// Fetch only the image and where its files are: for an image pushed by `tilefs push`, its
    /// object index; for an ordinary image, its index made by `tilefs index` (without one, the
    /// image is pulled whole, saying why). A FUSE mount then fetches each file on its first read
    /// (`tilefs pull` without --lazy completes the store)
    #[arg(long)]
    pub lazy: bool,
    /// Make the image in containerd, whose socket this is (e.g. /run/containerd/containerd.sock),
    /// not in a store: its layers the tilefs snapshotter's lazy snapshots where it can serve them
    /// so (a runnable tilefs image, a `tilefs index`, eStargz or zstd:chunked tables of
    /// contents), else fetched into containerd's content store and unpacked by it. `ctr run
    /// --snapshotter tilefs` and nerdctl then run it
    #[arg(long, value_name = "ADDRESS", conflicts_with_all = ["tag", "lazy", "all_xattrs", "jobs"])]
    pub containerd: Option<std::path::PathBuf>,
    /// containerd's namespace for --containerd (ctr's is "default", nerdctl's too, CRI's
    /// "k8s.io")
    #[arg(long, value_name = "NS", default_value = "default", requires = "containerd")]
    pub namespace: String,
    /// The tilefs snapshotter's name in containerd (its proxy plugin's) for --containerd
    #[arg(long, value_name = "NAME", default_value = tilefs_snapshotter::DEFAULT_PLUGIN_NAME, requires = "containerd")]
    pub snapshotter: String,
    /// No progress display
    #[arg(short, long)]
    pub quiet: bool,
    /// Print a JSON summary (tag, digest, layers, bytes, objects, seconds)
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: PullArgs) -> Result<ExitCode> {
    if a.containerd.is_some() {
        return run_containerd(a);
    }
    let started = Instant::now();
    let r = ImageRef::parse(&a.reference)?;
    let tag = a.tag.clone().unwrap_or_else(|| r.default_tag());
    tilefs_store::tags::validate_tag(&tag)?;
    let platform = a.platform.as_deref().map(Platform::parse).transpose()?;
    let store_path = a.store.path()?;
    let mut new_store = NewStore(
        std::fs::symlink_metadata(&store_path)
            .is_err()
            .then(|| store_path.clone()),
    );
    let store = Store::create(&store_path)?;
    let cancel = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, cancel.clone()).context("cannot handle signals")?;
    }
    let counters = Arc::new(PullProgress::default());
    let opts = PullOptions {
        platform,
        registry: a.registry.options(),
        keep_all_xattrs: a.all_xattrs,
        jobs: a.jobs,
        cancel: Some(cancel.clone()),
        progress: Some(counters.clone()),
        lazy: a.lazy,
        trust: a.registry.trust(a.signature_policy.clone()),
    };
    let display = progress::enabled(a.quiet || a.json).then(|| {
        let c = counters.clone();
        let s = counters.clone();
        Progress::staged(
            "pulling",
            "entries",
            move || (c.entries.load(Relaxed), c.blob_bytes.load(Relaxed)),
            counters.blob_total.clone(),
            move || {
                let (mut stage, network) = s.stage.get();
                let total = s.layers_total.load(Relaxed);
                if total > 1 && stage.starts_with("reading") {
                    stage.push_str(&format!(" ({} done)", s.layers_done.load(Relaxed)));
                }
                (stage, network)
            },
        )
    });
    let result = tilefs_oci::pull(&store, &r, &tag, &opts);
    drop(display);
    let report = crate::registry_arg::outcome(result, &cancel, || format!("cannot pull {r}"))?;
    new_store.0 = None;
    if !a.quiet {
        for n in &report.notes {
            eprintln!("tilefs: note: {n}");
        }
    }
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["store"] = store_path.display().to_string().into();
        v["reference"] = r.to_string().into();
        v["seconds"] = started.elapsed().as_secs_f64().into();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        if a.quiet {
        } else if report.lazy_objects > 0 {
            eprintln!(
                "tilefs: pulled {r} as {tag:?} in {} lazily ({} entries; {} objects to fetch on first read through `tilefs mount --fuse`)",
                store_path.display(),
                report.entries,
                report.lazy_objects
            );
        } else if report.layers == 0 {
            // A tilefs artifact: objects, not layers.
            eprintln!(
                "tilefs: pulled {r} as {tag:?} in {} ({} entries, {} objects fetched, {} bytes)",
                store_path.display(),
                report.entries,
                report.objects.new_objects,
                report.blob_bytes
            );
        } else {
            eprintln!(
                "tilefs: pulled {r} as {tag:?} in {} ({}, {} entries, {} new objects)",
                store_path.display(),
                if report.layers == 1 {
                    "1 layer".to_string()
                } else {
                    format!("{} layers", report.layers)
                },
                report.entries,
                report.objects.new_objects
            );
        }
        println!("{}", report.digest);
    }
    Ok(ExitCode::SUCCESS)
}

/// `tilefs pull --containerd`: the image made in containerd
/// ([`tilefs_snapshotter::into_containerd`]).
fn run_containerd(a: PullArgs) -> Result<ExitCode> {
    use tilefs_snapshotter::into_containerd::{self, Error};
    let started = Instant::now();
    let r = ImageRef::parse(&a.reference)?;
    let platform = a.platform.as_deref().map(Platform::parse).transpose()?;
    let cancel = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, cancel.clone()).context("cannot handle signals")?;
    }
    let counters = Arc::new(PullProgress::default());
    let opts = into_containerd::Options {
        address: a.containerd.clone().expect("--containerd"),
        namespace: a.namespace.clone(),
        snapshotter: a.snapshotter.clone(),
        pull: PullOptions {
            platform,
            registry: a.registry.options(),
            cancel: Some(cancel.clone()),
            progress: Some(counters.clone()),
            trust: a.registry.trust(a.signature_policy.clone()),
            ..Default::default()
        },
    };
    let display = progress::enabled(a.quiet || a.json).then(|| {
        let (c, s) = (counters.clone(), counters.clone());
        Progress::staged(
            "pulling",
            "layers",
            move || (c.layers_done.load(Relaxed), c.blob_bytes.load(Relaxed)),
            counters.blob_total.clone(),
            move || s.stage.get(),
        )
    });
    let result = into_containerd::pull(&r, &opts);
    drop(display);
    let what = || format!("cannot pull {r} into containerd");
    let result = match result {
        Err(Error::Containerd(e)) => return Err(anyhow::anyhow!(e).context(what())),
        Err(Error::Oci(e)) => Err(e),
        Ok(report) => Ok(report),
    };
    let report = crate::registry_arg::outcome(result, &cancel, what)?;
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["reference"] = r.to_string().into();
        v["seconds"] = started.elapsed().as_secs_f64().into();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        if !a.quiet {
            eprintln!(
                "tilefs: pulled {r} into containerd (namespace {}) as {}: {} of {} layers lazily, {} unpacked ({} bytes fetched), {} there already; {}",
                report.namespace,
                report.name,
                report.lazy_layers,
                report.layers,
                report.unpacked_layers,
                report.blob_bytes,
                report.present_layers,
                report.lazy
            );
        }
        println!("{}", report.digest);
    }
    Ok(ExitCode::SUCCESS)
}
