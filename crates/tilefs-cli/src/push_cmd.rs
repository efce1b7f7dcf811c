//! `tilefs push`: a tagged image and its objects out to a registry.

use crate::progress::{self, Progress};
use crate::registry_arg::RegistryArgs;
use crate::store_arg::StoreArg;
use anyhow::{Context, Result};
use clap::Args;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tilefs_oci::push::{PushOptions, PushProgress};
use tilefs_oci::ImageRef;

#[derive(Args)]
pub struct PushArgs {
    /// Tag of the image in the store
    pub name: String,
    /// Where to: docker://HOST[:PORT]/REPO[:TAG]
    pub reference: String,
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub sign: crate::registry_arg::SignArgs,
    /// Push a runnable image: the command, environment and platform of the OCI image REF (any
    /// reference pull takes) with this image's files, which containerd's CRI runs through `tilefs
    /// snapshotter` without downloading its layers (the snapshotter fetches files on first read)
    #[arg(long, value_name = "REF")]
    pub runnable_from: Option<String>,
    /// Keep the packs of the tilefs artifact tagged TAG in the destination's repository (the
    /// previous version) where this image still uses them: only its new files are packed and
    /// uploaded [default: the artifact the destination's tag names now, if any]
    #[arg(long, value_name = "TAG")]
    pub base: Option<String>,
    /// Artifact format to write: 3, the image's tree in chunks (a new version uploads only the
    /// chunks around what changed), or 2, the image whole (what tilefs before format 3 pulls)
    #[arg(long, default_value_t = 3, value_name = "N", value_parser = clap::value_parser!(u32).range(2..=3))]
    pub artifact_format: u32,
    /// Blobs uploaded at once
    #[arg(short, long, default_value_t = 4, value_name = "N")]
    pub jobs: usize,
    /// No progress display
    #[arg(short, long)]
    pub quiet: bool,
    /// Print a JSON summary (manifest digest, blobs sent, present, mounted, bytes, seconds)
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: PushArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let r = ImageRef::parse(&a.reference)?;
    let store = crate::store_cmds::open_store(&a.store.path()?)?;
    let cancel = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, cancel.clone()).context("cannot handle signals")?;
    }
    let counters = Arc::new(PushProgress::default());
    let runnable_from = match &a.runnable_from {
        Some(from) => {
            let from_ref = ImageRef::parse(from)?;
            let pull = tilefs_oci::pull::PullOptions {
                registry: a.registry.options(),
                trust: a.registry.trust(None),
                ..Default::default()
            };
            Some(
                tilefs_oci::pull::image_config(&from_ref, &pull)
                    .with_context(|| format!("cannot read the image configuration of {from_ref}"))?,
            )
        }
        None => None,
    };
    let opts = PushOptions {
        runnable_from,
        base: a.base.clone(),
        registry: a.registry.options(),
        jobs: a.jobs.max(1),
        cancel: Some(cancel.clone()),
        progress: Some(counters.clone()),
        trust: a.registry.trust(None),
        sign: a.sign.options(&a.registry.trust(None)),
        format_2: a.artifact_format == 2,
    };
    let display = progress::enabled(a.quiet || a.json).then(|| {
        let c = counters.clone();
        let s = counters.clone();
        Progress::staged(
            "pushing",
            "blobs",
            move || (c.blobs_done.load(Relaxed), c.bytes_done.load(Relaxed)),
            counters.bytes_total.clone(),
            move || s.stage.get(),
        )
    });
    let result = tilefs_oci::push::push(&store, &a.name, &r, &opts);
    drop(display);
    let report = crate::registry_arg::outcome(result, &cancel, || format!("cannot push {:?} to {r}", a.name))?;
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["seconds"] = started.elapsed().as_secs_f64().into();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        if !a.quiet {
            eprintln!(
                "tilefs: pushed {:?} to {r}: {} blobs ({} uploaded, {} bytes; {} already there; {} mounted from another repository)",
                a.name,
                report.blobs,
                report.blobs_uploaded,
                report.bytes_uploaded,
                report.blobs_present,
                report.blobs_mounted
            );
            if let Some(s) = &report.signed {
                eprintln!("tilefs: signed as {}: {}", s.identity, s.signatures.join(", "));
            }
        }
        println!("{}", report.manifest_digest);
    }
    Ok(ExitCode::SUCCESS)
}
