//! `composefs-rs-fuse IMAGE STORE MOUNTPOINT`
//!
//! Serves IMAGE (an EROFS image in the composefs format, as written by
//! `mkcomposefs` or `tilefs build`) at MOUNTPOINT with composefs-rs's FUSE
//! server (the `composefs-fuse` crate), file contents read from STORE (a
//! digest store: objects at `STORE/XX/YYYY…`). Runs in the foreground until
//! MOUNTPOINT is unmounted; SIGTERM, SIGINT and SIGHUP unmount it (lazily if it
//! is busy) and the program exits.
//!
//! For the benchmarks (bench/sections/fuse.py) only: composefs-rs has no
//! command for its FUSE server, just library functions, which this calls.

use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::ExitCode,
    sync::{Arc, Mutex},
    thread,
};

use anyhow::{bail, Context, Result};
use composefs::{
    erofs::reader::erofs_to_filesystem,
    fsverity::{Algorithm, Sha256HashValue},
    mount::mount_at,
    repository::Repository,
};
use rustix::{
    fs::CWD,
    io::Errno,
    mount::{unmount, UnmountFlags},
};
use signal_hook::{
    consts::{SIGHUP, SIGINT, SIGTERM},
    iterator::Signals,
};

const USAGE: &str = "usage: composefs-rs-fuse IMAGE STORE MOUNTPOINT";

/// What a signal has to undo: the mount once it exists, else the temporary repository.
#[derive(Default)]
struct State {
    mounted: Option<PathBuf>,
    repo_dir: Option<PathBuf>,
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("composefs-rs-fuse: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    if args.iter().any(|a| a == Path::new("-h") || a == Path::new("--help")) {
        println!("{USAGE}");
        return Ok(());
    }
    let [image, store, mountpoint] = &args[..] else {
        bail!("{USAGE}");
    };
    let store = fs::canonicalize(store).with_context(|| format!("{}", store.display()))?;
    if !store.is_dir() {
        bail!("{}: not a directory", store.display());
    }
    let mountpoint = fs::canonicalize(mountpoint).with_context(|| format!("{}", mountpoint.display()))?;

    let state = Arc::new(Mutex::new(State::default()));
    let mut signals = Signals::new([SIGTERM, SIGINT, SIGHUP]).context("installing signal handlers")?;
    {
        let state = Arc::clone(&state);
        thread::spawn(move || {
            for sig in signals.forever() {
                let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
                match st.mounted.take() {
                    // The server's loop ends when the kernel drops the connection;
                    // a second signal exits at once.
                    Some(m) => unmount_now(&m),
                    None => {
                        if let Some(d) = &st.repo_dir {
                            let _ = fs::remove_dir_all(d);
                        }
                        std::process::exit(128 + sig);
                    }
                }
            }
        });
    }

    let data = fs::read(image).with_context(|| format!("reading {}", image.display()))?;
    let filesystem = erofs_to_filesystem::<Sha256HashValue>(&data)
        .with_context(|| format!("{}: not a composefs image composefs-rs can read", image.display()))?;
    drop(data);

    // composefs-rs's Repository wants `REPO/meta.json` and its objects at
    // `REPO/objects/XX/YYYY…`; a digest store has them at `STORE/XX/YYYY…`.
    // So the repository is a temporary directory holding a `meta.json`
    // (sha256, written without fs-verity, so the repository is "insecure":
    // an object without fs-verity is served as is; one with fs-verity must
    // still match its digest) and a symlink `objects` -> STORE. It is
    // removed on exit; STORE is not written to.
    let repo_dir = tempfile::Builder::new()
        .prefix("composefs-rs-fuse.")
        .tempdir()
        .context("creating the temporary repository directory")?;
    state.lock().unwrap().repo_dir = Some(repo_dir.path().to_owned());
    symlink(&store, repo_dir.path().join("objects")).context("linking objects -> STORE")?;
    let (repo, _) = Repository::<Sha256HashValue>::init_path(CWD, repo_dir.path(), Algorithm::SHA256, false)
        .context("opening the repository")?;

    let dev_fuse = {
        let mut st = state.lock().unwrap();
        let dev_fuse = composefs_fuse::open_fuse()?;
        let mnt = composefs_fuse::mount_fuse(&dev_fuse).context("creating the FUSE mount")?;
        mount_at(&mnt, CWD, &mountpoint).with_context(|| format!("mounting on {}", mountpoint.display()))?;
        // Only the mount point refers to the mount now: a plain umount works.
        drop(mnt);
        st.mounted = Some(mountpoint.clone());
        dev_fuse
    };

    let served = composefs_fuse::serve_tree_fuse(dev_fuse, &filesystem, &repo);
    if served.is_err() {
        let _st = state.lock().unwrap();
        unmount_now(&mountpoint);
    }
    drop(repo);
    drop(repo_dir);
    served.context("serving FUSE requests")
}

/// Unmounts `m`, lazily if it is busy; quiet when it is not mounted any more.
fn unmount_now(m: &Path) {
    match unmount(m, UnmountFlags::empty()) {
        Ok(()) | Err(Errno::INVAL) | Err(Errno::NOENT) => {}
        Err(Errno::BUSY) => {
            if let Err(e) = unmount(m, UnmountFlags::DETACH) {
                eprintln!("composefs-rs-fuse: unmounting {}: {e}", m.display());
            }
        }
        Err(e) => eprintln!("composefs-rs-fuse: unmounting {}: {e}", m.display()),
    }
}
