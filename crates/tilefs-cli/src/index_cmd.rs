//! `tilefs index`: an ordinary OCI image's lazy index, pushed beside it.

use crate::progress::{self, Progress};
use crate::registry_arg::RegistryArgs;
use crate::store_arg::StoreArg;
use anyhow::{Context, Result};
use clap::Args;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tilefs_oci::lazy_index::IndexOptions;
use tilefs_oci::manifest::Platform;
use tilefs_oci::pull::PullProgress;
use tilefs_oci::{ImageRef, PullOptions};

#[derive(Args)]
pub struct IndexArgs {
    /// The image: docker://HOST[:PORT]/REPO[:TAG|@DIGEST] (the index is pushed to its repository)
    pub reference: String,
    /// The store the layers' files go through once (as a pull's; untagged, `tilefs gc` removes
    /// them)
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// The signature policy the image must pass (containers-policy.json) [default: as pull's]
    #[arg(long, value_name = "FILE")]
    pub signature_policy: Option<std::path::PathBuf>,
    /// Platform to pick from a multi-platform image [default: this machine's]
    #[arg(long, value_name = "OS/ARCH[/VARIANT]")]
    pub platform: Option<String>,
    #[command(flatten)]
    pub sign: crate::registry_arg::SignArgs,
    /// Index format to write: 2, the image's tree in chunks (the index of a new version uploads
    /// only the chunks around what changed), or 1, the image whole (what tilefs before format 2
    /// reads)
    #[arg(long, default_value_t = 2, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=2))]
    pub index_format: u32,
    /// Layers read at once [default: one per core, at least 2]
    #[arg(short, long, default_value_t = 0, value_name = "N", hide_default_value = true)]
    pub jobs: usize,
    /// No progress display
    #[arg(short, long)]
    pub quiet: bool,
    /// Print a JSON summary (index digest, sizes against the layers', how it is listed)
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: IndexArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let r = ImageRef::parse(&a.reference)?;
    let platform = a.platform.as_deref().map(Platform::parse).transpose()?;
    let store = tilefs_store::Store::create(&a.store.path()?)?;
    let cancel = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, cancel.clone()).context("cannot handle signals")?;
    }
    let counters = Arc::new(PullProgress::default());
    let trust = a.registry.trust(a.signature_policy.clone());
    let opts = IndexOptions {
        pull: PullOptions {
            platform,
            registry: a.registry.options(),
            jobs: a.jobs,
            cancel: Some(cancel.clone()),
            progress: Some(counters.clone()),
            trust: trust.clone(),
            ..Default::default()
        },
        sign: a.sign.options(&trust),
        format_1: a.index_format == 1,
    };
    let display = progress::enabled(a.quiet || a.json).then(|| {
        let c = counters.clone();
        let s = counters.clone();
        Progress::staged(
            "indexing",
            "entries",
            move || (c.entries.load(Relaxed), c.blob_bytes.load(Relaxed)),
            counters.blob_total.clone(),
            move || s.stage.get(),
        )
    });
    let result = tilefs_oci::lazy_index::index(&store, &r, &opts);
    drop(display);
    let report = crate::registry_arg::outcome(result, &cancel, || format!("cannot index {r}"))?;
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["seconds"] = started.elapsed().as_secs_f64().into();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    if !a.quiet {
        eprintln!(
            "tilefs: indexed {r}: {} bytes for {} layers of {} bytes ({:.2}%), listed {}",
            report.index_bytes,
            report.layers,
            report.layer_bytes,
            report.percent,
            match &report.listed.fallback_tag {
                Some(t) => format!("in the fallback tag {t}"),
                None => "by the registry's referrers API".to_string(),
            }
        );
        if let Some(s) = &report.signed {
            eprintln!("tilefs: signed as {}: {}", s.identity, s.signatures.join(", "));
        }
    }
    println!("{}", report.manifest_digest);
    Ok(ExitCode::SUCCESS)
}
