//! `tilefs commit`: the tree of a writable mount as a new tagged image.

use crate::build::Interrupted;
use crate::progress::{self, Progress};
use crate::store_arg::StoreArg;
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tilefs_commit::{CommitOptions, Progress as Counters};
use tilefs_store::Store;

#[derive(Args)]
pub struct CommitArgs {
    /// Mount point of a writable tilefs mount (kernel or FUSE, made with --upper and --work)
    pub mountpoint: PathBuf,
    /// Tag the new image NAME in the store (replacing an image of that name)
    #[arg(long, value_name = "NAME")]
    pub tag: String,
    #[command(flatten)]
    pub store: StoreArg,
    /// Threads digesting new and changed files (the default is 8 per core, as for build)
    #[arg(short, long, default_value_t = 0, value_name = "N", hide_default_value = true)]
    pub jobs: usize,
    /// No progress display and no messages
    #[arg(short, long)]
    pub quiet: bool,
    /// Print a JSON summary (tag, digest, entries, files digested, new objects, bytes, seconds)
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: CommitArgs) -> Result<ExitCode> {
    let started = Instant::now();
    tilefs_store::tags::validate_tag(&a.tag)?;
    let store = Store::open(&a.store.path()?)?;
    let cancel = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, cancel.clone()).context("cannot handle signals")?;
    }
    let counters = Arc::new(Counters::default());
    let opts = CommitOptions {
        tag: a.tag.clone(),
        jobs: a.jobs,
        cancel: Some(cancel.clone()),
    };
    let display = progress::enabled(a.quiet || a.json).then(|| {
        let c = counters.clone();
        Progress::bytes(
            "committing",
            "files",
            move || (c.files.load(Relaxed), c.bytes.load(Relaxed)),
            counters.total_bytes.clone(),
        )
    });
    let result = tilefs_commit::commit(&store, &a.mountpoint, &opts, &counters);
    drop(display);
    let done = match result {
        Ok(d) => d,
        Err(_) if cancel.load(Relaxed) => return Err(Interrupted.into()),
        Err(e) => return Err(e.into()),
    };
    let digest = hex::encode(done.digest);
    if a.json {
        let report = serde_json::json!({
            "mountpoint": a.mountpoint.display().to_string(),
            "kind": done.kind.name(),
            "store": store.path().display().to_string(),
            "tag": done.tag,
            "digest": digest,
            "image_bytes": done.image_bytes,
            "format_version": done.format_version,
            "entries": done.entries,
            "upper_entries": done.upper_entries,
            "files_digested": done.files,
            "bytes": done.bytes,
            "new_objects": done.new_objects,
            "new_bytes": done.new_bytes,
            "cache_hits": done.cache_hits,
            "seconds": started.elapsed().as_secs_f64(),
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    if !a.quiet {
        eprintln!(
            "tilefs: committed {} as {:?} in {} ({} entries; {} files digested, {} new objects)",
            a.mountpoint.display(),
            done.tag,
            store.path().display(),
            done.entries,
            done.files,
            done.new_objects
        );
    }
    println!("{digest}");
    Ok(ExitCode::SUCCESS)
}
