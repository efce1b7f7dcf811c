//! `tilefs images`, `untag`, `fsck`, `gc`: looking after a store.

use crate::store_arg::StoreArg;
use anyhow::{Context, Result};
use clap::Args;
use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use serde_json::json;
use std::collections::BTreeSet;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tilefs_store::fsck::{FsckOptions, FsckReport};
use tilefs_store::gc::GcOptions;
use tilefs_store::store::QUARANTINE_DIR;
use tilefs_store::{parse_object_rel, tags, LockMode, Store, StoreError};

#[derive(Args)]
pub struct ImagesArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct UntagArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// Tag to remove (its objects stay until gc); images tilefs holds (the snapshotter's) are
    /// refused, naming their holder
    #[arg(required_unless_present = "orphaned", conflicts_with = "orphaned")]
    pub name: Option<String>,
    /// Let go of the images held by tilefs components that are gone for good (`tilefs fsck`
    /// names them), instead of a tag
    #[arg(long)]
    pub orphaned: bool,
}

#[derive(Args)]
pub struct FsckArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// Move corrupt objects and strays aside, to STORE/.quarantine
    #[arg(long)]
    pub repair: bool,
    /// Threads (the default is one per core)
    #[arg(short, long, default_value_t = std::thread::available_parallelism().map_or(1, |n| n.get()), value_name = "N")]
    pub jobs: usize,
    /// No progress display, and nothing printed when the store is clean
    #[arg(short, long)]
    pub quiet: bool,
    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct GcArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// Show what would be removed, remove nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Print nothing (errors aside)
    #[arg(short, long, conflicts_with = "json")]
    pub quiet: bool,
    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,
}

/// "1 object", "2 objects".
fn plural(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else if let Some(stem) = what.strip_suffix('y') {
        format!("{n} {stem}ies")
    } else {
        format!("{n} {what}s")
    }
}

pub fn open_store(path: &Path) -> Result<Store> {
    Ok(Store::open(path)?)
}

/// Takes no lock, but says so on stderr when `mode` would have to wait, so
/// that a command blocked behind a build or a gc does not look hung.
fn say_if_waiting(store: &Store, mode: LockMode) {
    if let Err(StoreError::Busy(_)) = store.lock(mode, false) {
        let who = match mode {
            LockMode::Shared => "a gc is running",
            LockMode::Exclusive => "a build, fsck or untag is running",
        };
        eprintln!(
            "tilefs: waiting for the lock of store {} ({who})",
            store.path().display()
        );
    }
}

/// One row of `tilefs images`.
#[derive(serde::Serialize)]
struct ImageRow {
    tag: String,
    path: PathBuf,
    image_bytes: u64,
    /// Distinct objects referenced.
    objects: u64,
    /// Sum of the sizes of the external files.
    external_bytes: u64,
    /// Referenced objects absent from the store (or references that cannot
    /// name an object).
    missing: u64,
    /// Pulled with --lazy: the absent objects are to be fetched on first
    /// read, not missing.
    lazy: bool,
    /// Who holds it, for an image a tilefs component holds (null for the
    /// user's tags): its id, and its record (`kind`, `root`...), what it
    /// is (`description`) and why it is gone for good (`gone`), if it is.
    owner: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// The `owner` of the rows of holder `o`.
fn owner_json(o: &tilefs_store::owned::Owned) -> serde_json::Value {
    let mut v = match &o.holder {
        Ok(h) => {
            let mut v = serde_json::to_value(h).unwrap_or_else(|_| json!({}));
            v["description"] = json!(h.describe());
            v["gone"] = json!(h.gone());
            v
        }
        Err(e) => json!({ "error": e }),
    };
    v["id"] = json!(o.id);
    v
}

/// `lazy`: the images pulled lazily (their absent objects are to come).
fn image_row(
    store: &Store,
    t: &tags::TagInfo,
    owner: Option<serde_json::Value>,
    lazy: &std::collections::HashSet<[u8; 32]>,
) -> ImageRow {
    let mut row = ImageRow {
        tag: t.name.clone(),
        path: t.path.clone(),
        image_bytes: t.image_bytes,
        objects: 0,
        external_bytes: 0,
        missing: 0,
        lazy: false,
        owner,
        error: None,
    };
    let read = tags::read_listed(store, t)
        .map_err(|e| e.to_string())
        .and_then(|bytes| bytes.ok_or_else(|| "removed meanwhile".to_string()))
        .and_then(|bytes| {
            row.lazy = !lazy.is_empty() && lazy.contains(&tilefs_image::verity::digest_bytes(&bytes));
            tilefs_image::erofs::read_image(&bytes).map_err(|e| e.to_string())
        });
    match read {
        Ok((tree, _)) => {
            let objects: BTreeSet<&[u8]> = tilefs_image::summary::objects(&tree);
            row.objects = objects.len() as u64;
            row.external_bytes = tilefs_image::summary::summarize(&tree).external_bytes;
            row.missing = objects
                .iter()
                .filter(|p| !parse_object_rel(p).is_some_and(|d| store.has_object(&d)))
                .count() as u64;
        }
        Err(e) => row.error = Some(e),
    }
    row
}

pub fn images(a: ImagesArgs) -> Result<ExitCode> {
    let store = open_store(&a.store.path()?)?;
    let tags = tags::list_tags(&store)?;
    let held = tilefs_store::owned::scan(&store)?;
    let lazy = tilefs_store::remote::records(&store);
    let mut rows: Vec<ImageRow> = tags.par_iter().map(|t| image_row(&store, t, None, &lazy)).collect();
    // The images tilefs holds, by holder.
    let mut sections = Vec::new();
    for o in &held.owners {
        let owner = owner_json(o);
        let first = rows.len();
        rows.extend(o.roots.iter().map(|t| image_row(&store, t, Some(owner.clone()), &lazy)));
        let title = match &o.holder {
            Ok(h) => match h.gone() {
                None => format!("held by {} ({}):", h.describe(), h.released_when()),
                Some(why) => format!(
                    "held by {}, which is gone ({why}; `tilefs untag --orphaned` lets them go):",
                    h.describe()
                ),
            },
            Err(e) => format!("held by tilefs ({}: its record cannot be read: {e}):", o.id),
        };
        sections.push((title, first..rows.len()));
    }
    let bad = rows.iter().filter(|r| r.error.is_some()).count();
    let mut out = std::io::stdout().lock();
    if a.json {
        serde_json::to_writer_pretty(&mut out, &rows)?;
        writeln!(out)?;
    } else {
        print_image_table(&mut out, &rows[..tags.len()])?;
        for (title, range) in sections.into_iter().filter(|(_, r)| !r.is_empty()) {
            writeln!(out, "\n{title}")?;
            print_image_table(&mut out, &rows[range])?;
        }
    }
    out.flush()?;
    drop(out);
    for r in &rows {
        if let Some(e) = &r.error {
            eprintln!(
                "tilefs: tagged image {} ({}) cannot be read: {e}",
                r.tag,
                r.path.display()
            );
        }
    }
    Ok(if bad > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// The table of `tilefs images`: tag left-aligned, numbers right-aligned.
fn print_image_table(out: &mut impl Write, rows: &[ImageRow]) -> std::io::Result<()> {
    let cells: Vec<[String; 5]> = rows
        .iter()
        .map(|r| match &r.error {
            None => [
                r.tag.clone(),
                HumanBytes(r.image_bytes).to_string(),
                r.objects.to_string(),
                HumanBytes(r.external_bytes).to_string(),
                if r.lazy && r.missing > 0 {
                    format!("{} (lazy)", r.missing)
                } else {
                    r.missing.to_string()
                },
            ],
            Some(_) => [
                r.tag.clone(),
                HumanBytes(r.image_bytes).to_string(),
                "-".into(),
                "-".into(),
                "-".into(),
            ],
        })
        .collect();
    let header = ["TAG", "IMAGE SIZE", "OBJECTS", "EXTERNAL BYTES", "MISSING"].map(String::from);
    let mut widths = header.clone().map(|h| h.len());
    for c in &cells {
        for (w, s) in widths.iter_mut().zip(c) {
            *w = (*w).max(s.chars().count());
        }
    }
    for c in std::iter::once(&header).chain(&cells) {
        // Tag left-aligned, numbers right-aligned.
        let line = format!(
            "{:<w0$}  {:>w1$}  {:>w2$}  {:>w3$}  {:>w4$}",
            c[0],
            c[1],
            c[2],
            c[3],
            c[4],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3],
            w4 = widths[4]
        );
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

pub fn untag(a: UntagArgs) -> Result<ExitCode> {
    let store = open_store(&a.store.path()?)?;
    say_if_waiting(&store, LockMode::Shared);
    let Some(name) = a.name else {
        let released = tilefs_store::owned::release_orphaned(&store)?;
        if released.is_empty() {
            eprintln!("no image is held by a tilefs component that is gone");
        }
        for (o, why) in released {
            let who = o.holder.as_ref().map(|h| h.describe()).unwrap_or(o.id.clone());
            let their = if o.roots.len() == 1 { "its" } else { "their" };
            eprintln!(
                "let go of {} held by {who}, which is gone ({why}): {}; {their} objects stay until `tilefs gc`",
                plural(o.roots.len() as u64, "image"),
                o.roots.iter().map(|r| r.name.as_str()).collect::<Vec<_>>().join(", ")
            );
        }
        return Ok(ExitCode::SUCCESS);
    };
    tags::remove_tag(&store, &name)?;
    eprintln!("untagged {name}: its objects stay until `tilefs gc`");
    Ok(ExitCode::SUCCESS)
}

fn fsck_json(store: &Store, r: &FsckReport) -> serde_json::Value {
    json!({
        "store": store.path(),
        "clean": r.is_clean(),
        "objects": r.objects,
        "bytes": r.bytes,
        "images": r.images,
        "held": r.held,
        "orphaned": r.orphaned,
        "leftovers": r.leftovers,
        "placeholders": r.placeholders,
        "corrupt": r.corrupt,
        "corrupt_used_by": r.corrupt_used_by.iter().map(|(o, t)| json!({"object": o, "tags": t})).collect::<Vec<_>>(),
        "unreadable": r.unreadable.iter().map(|(p, why)| json!({"path": p, "reason": why})).collect::<Vec<_>>(),
        "missing": r.missing.iter().map(|(o, t)| json!({"object": o, "tags": t})).collect::<Vec<_>>(),
        "not_fetched": r.not_fetched,
        "strays": r.strays,
        "bad_images": r.bad_images.iter().map(|(t, why)| json!({"tag": t, "reason": why})).collect::<Vec<_>>(),
        "repaired": r.repaired,
        "quarantine": store.join(QUARANTINE_DIR),
        "exposed": r.exposed,
    })
}

/// The report; `quiet`: only what is wrong and what to do about it.
fn print_fsck(out: &mut impl Write, store: &Store, r: &FsckReport, repair: bool, quiet: bool) -> std::io::Result<()> {
    let quarantine = store.join(QUARANTINE_DIR);
    let repaired: BTreeSet<&PathBuf> = r.repaired.iter().collect();
    let fixed = |p: &PathBuf| {
        if repaired.contains(p) {
            " (moved to quarantine)"
        } else {
            ""
        }
    };
    for p in &r.corrupt {
        let used = match r.corrupt_used_by.get(p) {
            Some(tags) => format!(" (used by {})", tags.join(", ")),
            None => String::new(),
        };
        writeln!(out, "corrupt object: {}{used}{}", p.display(), fixed(p))?;
    }
    for (p, why) in &r.unreadable {
        writeln!(out, "unreadable object: {}: {why}", p.display())?;
    }
    for (o, tags) in &r.missing {
        writeln!(
            out,
            "missing object: {} (needed by {})",
            store.join(o).display(),
            tags.join(", ")
        )?;
    }
    for p in &r.strays {
        writeln!(out, "stray (not an object): {}{}", p.display(), fixed(p))?;
    }
    for (t, why) in &r.bad_images {
        writeln!(out, "bad image {t}: {why}")?;
    }
    if quiet && r.is_clean() {
        return Ok(());
    }
    let held = if r.held > 0 {
        format!(" and {} held by tilefs", plural(r.held, "image"))
    } else {
        String::new()
    };
    writeln!(
        out,
        "checked {} ({}) and {}{held} in {}",
        plural(r.objects, "object"),
        HumanBytes(r.bytes),
        plural(r.images, "tagged image"),
        store.path().display()
    )?;
    for o in &r.orphaned {
        let keep = if o.images.len() == 1 { "keeps its" } else { "keep their" };
        writeln!(
            out,
            "warning: {} held by {}, which is gone ({}), {keep} objects: `tilefs untag --orphaned` lets them go ({})",
            plural(o.images.len() as u64, "image"),
            o.holder.as_deref().unwrap_or(&o.owner),
            o.why,
            o.images.join(", ")
        )?;
    }
    for (tag, n) in &r.not_fetched {
        writeln!(
            out,
            "{tag}: {} not fetched yet (pulled with --lazy: read through a lazy mount, or `tilefs pull` again to complete it)",
            plural(*n, "object")
        )?;
    }
    if let Some(why) = &r.exposed {
        writeln!(out, "warning: {why}")?;
    }
    if r.placeholders > 0 {
        writeln!(
            out,
            "{} (objects of lazily pulled images not fetched yet, filled when a kernel mount first reads them)",
            plural(r.placeholders, "placeholder")
        )?;
    }
    if r.leftovers > 0 {
        writeln!(
            out,
            "{} of interrupted imports (harmless; `tilefs gc` removes them)",
            plural(r.leftovers, "leftover temporary file")
        )?;
    }
    if r.is_clean() {
        writeln!(out, "clean")?;
        return Ok(());
    }
    let mut problems = Vec::new();
    for (n, what) in [
        (r.corrupt.len(), "corrupt"),
        (r.unreadable.len(), "unreadable"),
        (r.missing.len(), "missing"),
        (r.strays.len(), "stray"),
        (r.bad_images.len(), "bad image"),
    ] {
        if n > 0 {
            problems.push(format!("{n} {what}"));
        }
    }
    writeln!(out, "problems found: {}", problems.join(", "))?;
    if !r.repaired.is_empty() {
        writeln!(
            out,
            "repaired: moved {} (corrupt objects and strays) to {}",
            plural(r.repaired.len() as u64, "entry"),
            quarantine.display()
        )?;
    }
    if !repair && (!r.corrupt.is_empty() || !r.strays.is_empty()) {
        writeln!(
            out,
            "run `tilefs fsck --repair` to move corrupt objects and strays aside"
        )?;
    }
    if !r.missing.is_empty() {
        writeln!(
            out,
            "missing objects cannot be repaired by fsck: re-create the images that need them as they were made (`tilefs pull` again for a pulled image: it fetches only what is missing; `tilefs build` for a built one)"
        )?;
    } else if r.repaired.iter().any(|p| r.corrupt.contains(p)) {
        writeln!(
            out,
            "objects moved aside that tagged images need are now missing: re-create the images that need them as they were made (`tilefs pull` again for a pulled image: it fetches only what is missing; `tilefs build` for a built one)"
        )?;
    }
    if !r.unreadable.is_empty() {
        writeln!(
            out,
            "unreadable objects were left in place: check permissions and the disk"
        )?;
    }
    Ok(())
}

pub fn fsck(a: FsckArgs) -> Result<ExitCode> {
    let store = open_store(&a.store.path()?)?;
    let opts = FsckOptions {
        repair: a.repair,
        jobs: a.jobs,
    };
    let show = !a.quiet && std::io::stderr().is_terminal();
    if !a.quiet {
        say_if_waiting(&store, LockMode::Shared);
    }
    // fsck reports progress into atomics; a drawing thread reads them.
    let done = AtomicU64::new(0);
    let total = AtomicU64::new(0);
    let finished = AtomicBool::new(false);
    let started = AtomicBool::new(false);
    let progress = |d: u64, t: u64| {
        done.fetch_max(d, Ordering::Relaxed);
        total.store(t, Ordering::Relaxed);
        started.store(true, Ordering::Relaxed);
    };
    let report = std::thread::scope(|s| {
        let bar = show.then(|| {
            let pb = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr_with_hz(10));
            pb.set_style(
                ProgressStyle::with_template(
                    "checking objects [{wide_bar}] {bytes}/{total_bytes} ({binary_bytes_per_sec}, ETA {eta})",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            pb
        });
        if let Some(pb) = bar.clone() {
            let (done, total, started, finished) = (&done, &total, &started, &finished);
            s.spawn(move || {
                while !finished.load(Ordering::Relaxed) {
                    // Nothing to show until the scan has found the total.
                    if started.load(Ordering::Relaxed) {
                        pb.set_length(total.load(Ordering::Relaxed));
                        pb.set_position(done.load(Ordering::Relaxed));
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
        }
        let r = tilefs_store::fsck::fsck(&store, &opts, &progress);
        finished.store(true, Ordering::Relaxed);
        if let Some(pb) = bar {
            pb.finish_and_clear();
        }
        r
    })
    .with_context(|| format!("fsck of store {}", store.path().display()))?;

    let mut out = std::io::stdout().lock();
    if a.json {
        serde_json::to_writer_pretty(&mut out, &fsck_json(&store, &report))?;
        writeln!(out)?;
    } else {
        print_fsck(&mut out, &store, &report, a.repair, a.quiet)?;
    }
    out.flush()?;
    Ok(if report.is_clean() || repaired_all(&report) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Whether a repair left the store sound: every corrupt object and stray
/// moved aside, none of them needed by a tagged image, nothing else wrong.
fn repaired_all(r: &FsckReport) -> bool {
    let moved: BTreeSet<&PathBuf> = r.repaired.iter().collect();
    r.missing.is_empty()
        && r.unreadable.is_empty()
        && r.bad_images.is_empty()
        && r.corrupt_used_by.is_empty()
        && r.corrupt.iter().chain(&r.strays).all(|p| moved.contains(p))
}

pub fn gc(a: GcArgs) -> Result<ExitCode> {
    let store = open_store(&a.store.path()?)?;
    if !a.quiet {
        say_if_waiting(&store, LockMode::Exclusive);
    }
    let r = tilefs_store::gc::gc(
        &store,
        &GcOptions {
            dry_run: a.dry_run,
            ..GcOptions::default()
        },
    )?;
    if a.quiet {
        return Ok(ExitCode::SUCCESS);
    }
    let mut out = std::io::stdout().lock();
    if a.json {
        serde_json::to_writer_pretty(&mut out, &r)?;
        writeln!(out)?;
    } else {
        let verb = if r.dry_run { "would remove" } else { "removed" };
        writeln!(
            out,
            "{verb} {} ({}) and {} ({})",
            plural(r.objects_removed, "object"),
            HumanBytes(r.bytes_removed),
            plural(r.leftovers_removed, "leftover temporary file"),
            HumanBytes(r.leftover_bytes_removed)
        )?;
        if r.placeholders_removed > 0 {
            writeln!(
                out,
                "{verb} {} (objects never fetched)",
                plural(r.placeholders_removed, "placeholder")
            )?;
        }
        let mut by = vec![plural(r.images, "tagged image")];
        if r.held > 0 {
            by.push(format!("{} held by tilefs", plural(r.held, "image")));
        }
        if r.mounts > 0 {
            by.push(plural(r.mounts, "live mount"));
        }
        writeln!(
            out,
            "kept {} ({}) referenced by {}",
            plural(r.objects_kept, "object"),
            HumanBytes(r.bytes_kept),
            by.join(" and ")
        )?;
        if r.dry_run {
            writeln!(out, "dry run: nothing was removed")?;
        }
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}
