//! A minimal front end to the FUSE server, for trying it and for tests
//! before the `tilefs` CLI calls it:
//!
//! ```text
//! fuse-mount [-f] [--verity off|auto|require] [--threads N] [--log FILE] STORE IMAGE MOUNTPOINT
//! fuse-mount --umount MOUNTPOINT
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use tilefs_fuse::{FuseMount, Verity};

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let mut m = FuseMount::default();
    let mut pos: Vec<PathBuf> = Vec::new();
    while let Some(a) = args.next() {
        match a.to_str() {
            Some("-f") => m.foreground = true,
            Some("--umount") => {
                let mnt = PathBuf::from(args.next().expect("mountpoint"));
                return match tilefs_fuse::unmount(&mnt, false) {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("fuse-mount: {e}");
                        ExitCode::FAILURE
                    }
                };
            }
            Some("--verity") => {
                m.verity = match args.next().and_then(|v| v.into_string().ok()).as_deref() {
                    Some("off") => Verity::Off,
                    Some("auto") => Verity::Auto,
                    Some("require") => Verity::Require,
                    v => {
                        eprintln!("fuse-mount: bad --verity {v:?}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            Some("--threads") => {
                m.threads = args
                    .next()
                    .and_then(|v| v.into_string().ok()?.parse().ok())
                    .unwrap_or(0)
            }
            Some("--log") => m.log_file = args.next().map(PathBuf::from),
            _ => pos.push(a.into()),
        }
    }
    let [store, image, mnt] = <[PathBuf; 3]>::try_from(pos).unwrap_or_else(|_| {
        eprintln!(
            "usage: fuse-mount [-f] [--verity off|auto|require] [--threads N] [--log FILE] STORE IMAGE MOUNTPOINT"
        );
        std::process::exit(2)
    });
    m.store = store;
    m.image = image;
    m.mountpoint = mnt;
    match tilefs_fuse::mount(&m) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fuse-mount: {e}");
            ExitCode::FAILURE
        }
    }
}
