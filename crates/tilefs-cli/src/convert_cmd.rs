//! `tilefs convert`: an OCI image in a registry to a runnable tilefs
//! artifact in a registry, without a store of the user's.

use crate::progress::{self, Progress};
use crate::registry_arg::RegistryArgs;
use anyhow::{Context, Result};
use clap::Args;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tilefs_oci::manifest::Platform;
use tilefs_oci::pull::PullProgress;
use tilefs_oci::push::{ConvertOptions, PushOptions, PushProgress};
use tilefs_oci::{ImageRef, PullOptions};

#[derive(Args)]
pub struct ConvertArgs {
    /// The OCI image to convert: docker://[HOST[:PORT]/]REPO[:TAG|@DIGEST] (or any reference
    /// pull takes)
    pub source: String,
    /// Where the runnable artifact goes: docker://HOST[:PORT]/REPO[:TAG]
    pub destination: String,
    #[command(flatten)]
    pub registry: RegistryArgs,
    #[command(flatten)]
    pub sign: crate::registry_arg::SignArgs,
    /// The signature policy the source must pass (containers-policy.json) [default: as pull]
    #[arg(long, value_name = "FILE")]
    pub signature_policy: Option<std::path::PathBuf>,
    /// Platform to pick from a multi-platform image [default: this machine's, e.g. linux/amd64]
    #[arg(long, value_name = "OS/ARCH[/VARIANT]")]
    pub platform: Option<String>,
    /// Directory for the scratch store (the image's files, uncompressed, and its packs while they
    /// are sent; removed at the end) [default: $TMPDIR, else /tmp]
    #[arg(long, value_name = "DIR")]
    pub tmpdir: Option<std::path::PathBuf>,
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
    /// Print a JSON summary (the artifact's manifest digest and image digest, blobs sent,
    /// present, mounted, bytes read and sent, seconds)
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: ConvertArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let src = ImageRef::parse(&a.source)?;
    let dest = ImageRef::parse(&a.destination)?;
    let platform = a.platform.as_deref().map(Platform::parse).transpose()?;
    let cancel = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, cancel.clone()).context("cannot handle signals")?;
    }
    let reading = Arc::new(PullProgress::default());
    let sending = Arc::new(PushProgress::default());
    let trust = a.registry.trust(a.signature_policy.clone());
    let opts = ConvertOptions {
        pull: PullOptions {
            platform,
            registry: a.registry.options(),
            cancel: Some(cancel.clone()),
            progress: Some(reading.clone()),
            trust: trust.clone(),
            ..Default::default()
        },
        push: PushOptions {
            registry: a.registry.options(),
            jobs: a.jobs.max(1),
            cancel: Some(cancel.clone()),
            progress: Some(sending.clone()),
            trust: a.registry.trust(None),
            sign: a.sign.options(&a.registry.trust(None)),
            runnable_from: None,
            base: a.base.clone(),
            format_2: a.artifact_format == 2,
        },
        tmpdir: a.tmpdir.clone(),
    };
    // One display: the reading's counters, then the sending's.
    let display = progress::enabled(a.quiet || a.json).then(|| {
        let total = Arc::new(AtomicU64::new(0));
        let (r, s, t) = (reading.clone(), sending.clone(), total.clone());
        let (r2, s2) = (reading.clone(), sending.clone());
        Progress::staged(
            "converting",
            "blobs",
            move || {
                if s.stage.get().0.is_empty() {
                    t.store(r.blob_total.load(Relaxed), Relaxed);
                    (r.layers_done.load(Relaxed), r.blob_bytes.load(Relaxed))
                } else {
                    t.store(s.bytes_total.load(Relaxed), Relaxed);
                    (s.blobs_done.load(Relaxed), s.bytes_done.load(Relaxed))
                }
            },
            total,
            move || match s2.stage.get() {
                (stage, _) if stage.is_empty() => r2.stage.get(),
                sent => sent,
            },
        )
    });
    let result = tilefs_oci::push::convert(&src, &dest, &opts);
    drop(display);
    let report = crate::registry_arg::outcome(result, &cancel, || format!("cannot convert {src} to {dest}"))?;
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["seconds"] = started.elapsed().as_secs_f64().into();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        if !a.quiet {
            eprintln!(
                "tilefs: converted {src} ({} bytes read) to {dest}: {} blobs ({} uploaded, {} bytes; {} already there; {} mounted from another repository)",
                report.source_bytes,
                report.push.blobs,
                report.push.blobs_uploaded,
                report.push.bytes_uploaded,
                report.push.blobs_present,
                report.push.blobs_mounted
            );
        }
        println!("{}", report.push.manifest_digest);
    }
    Ok(ExitCode::SUCCESS)
}
