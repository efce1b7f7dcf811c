//! `mount.tilefs`: the helper mount(8) runs for `mount -t tilefs` and for
//! fstab lines of type `tilefs`:
//!
//! ```text
//! mount.tilefs IMAGE MOUNTPOINT [-sfnv] [-N NAMESPACE] [-o OPTIONS]
//! ```
//!
//! IMAGE is an image file or a tag in the store; OPTIONS are those of
//! `tilefs mount -o` plus `store=DIR` (required), `upper=DIR`, `work=DIR`,
//! `verity=require|auto|off`, `digest=HEX`, `kernel`, `fuse`.

//!
//! It is the `tilefs` binary itself, run under the name `mount.tilefs`
//! (installed as a link to it).

use crate::mount_cmd;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use tilefs_mount::options::ParsedOptions;

/// mount(8)'s exit statuses: usage or permission, and mount failure.
const EX_USAGE: u8 = 1;
const EX_FAIL: u8 = 32;

const USAGE: &str = "usage: mount.tilefs IMAGE MOUNTPOINT [-sfnv] [-N NAMESPACE] [-o store=STORE[,OPTIONS]]

Mounts a tilefs (composefs) image: called by mount(8) for `mount -t tilefs`
and fstab lines of type tilefs.

  IMAGE       image file, or a tag in the store
  -o OPTIONS  store=DIR (required; also basedir=DIR[:DIR...]), upper=DIR and
              work=DIR (writable), verity=require|auto|off, digest=HEX,
              ro, rw, nosuid, nodev, noexec, noatime, relatime, kernel, fuse;
              options for mount(8) itself (noauto, user, nofail, x-*, ...) are
              ignored; anything else is passed to overlayfs
  -f          check everything, mount nothing
  -s -n -v    accepted (sloppy, no mtab, verbose)
  -N NS       mount in the mount namespace NS (a PID or a /proc/PID/ns/mnt path)";

/// `mount.tilefs`: what `main` runs when called by that name.
pub fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, msg)) => {
            eprintln!("mount.tilefs: {msg}");
            ExitCode::from(code)
        }
    }
}

fn run() -> Result<(), (u8, String)> {
    let usage = |m: String| (EX_USAGE, format!("{m}\n{USAGE}"));
    let mut args = std::env::args_os().skip(1);
    let mut positional: Vec<OsString> = Vec::new();
    let mut options = ParsedOptions::default();
    let mut fake = false;
    let mut verbose = false;
    let mut namespace: Option<String> = None;
    while let Some(arg) = args.next() {
        let s = arg.to_string_lossy().into_owned();
        match s.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            "-V" | "--version" => {
                println!("mount.tilefs {} ({})", env!("CARGO_PKG_VERSION"), env!("TILEFS_COMMIT"));
                return Ok(());
            }
            "-o" | "-t" | "-N" => {
                let v = args
                    .next()
                    .ok_or_else(|| usage(format!("{s} needs a value")))?
                    .to_string_lossy()
                    .into_owned();
                match s.as_str() {
                    "-o" => options.add(&v).map_err(|e| (EX_USAGE, e))?,
                    "-N" => namespace = Some(v),
                    // -t tilefs (or tilefs.SUBTYPE): the type is ours.
                    _ => {}
                }
            }
            _ if s.starts_with("-o") => options.add(&s[2..]).map_err(|e| (EX_USAGE, e))?,
            _ if s.starts_with("-N") => namespace = Some(s[2..].to_string()),
            _ if s.starts_with("-t") => {}
            _ if s.starts_with('-') && s.len() > 1 => {
                for c in s[1..].chars() {
                    match c {
                        'f' => fake = true,
                        'v' => verbose = true,
                        's' | 'n' | 'r' | 'w' => {}
                        c => return Err(usage(format!("unknown flag -{c}"))),
                    }
                }
            }
            _ => positional.push(arg),
        }
    }
    let [image, mountpoint] = <[OsString; 2]>::try_from(positional)
        .map_err(|p| usage(format!("expected IMAGE and MOUNTPOINT, got {} arguments", p.len())))?;
    if options.stores.is_empty() {
        return Err(usage("no object store: give -o store=DIR".into()));
    }
    if options.upper.is_some() != options.work.is_some() {
        return Err((EX_USAGE, "upper= and work= go together".into()));
    }
    if let Some(ns) = &namespace {
        enter_namespace(ns).map_err(|e| (EX_FAIL, e))?;
    }
    let stores = std::mem::take(&mut options.stores);
    let backend = options.backend;
    let req = tilefs_present::Request {
        image: PathBuf::from(image),
        stores,
        mountpoint: PathBuf::from(mountpoint),
        options,
        backend,
        fuse: tilefs_present::FuseSettings {
            // A system mount (fstab, `mount -t tilefs` by root) is for
            // every user, as a kernel mount is, also when FUSE serves it.
            allow_other: rustix::process::geteuid().is_root(),
            ..tilefs_present::FuseSettings::default()
        },
        erofs_backing: tilefs_mount::ErofsBacking::Auto,
    };
    if fake {
        return check_only(&req).map_err(|e| (EX_FAIL, format!("{e:#}")));
    }
    let (image, mountpoint) = (req.image.clone(), req.mountpoint.clone());
    let serving = mount_cmd::Serving {
        foreground: false,
        log: None,
        quiet: false,
        fetch_rest: None,
    };
    mount_cmd::run(req, &serving).map_err(|e| (EX_FAIL, format!("{e:#}")))?;
    if verbose {
        eprintln!("mount.tilefs: mounted {} on {}", image.display(), mountpoint.display());
    }
    Ok(())
}

/// `-f`: everything but the mount itself.
fn check_only(req: &tilefs_present::Request) -> anyhow::Result<()> {
    use anyhow::Context;
    let store = tilefs_store::Store::open(&req.stores[0])?;
    let image = tilefs_store::tags::resolve_image(Some(&store), &req.image)?;
    let bytes = std::fs::read(&image).with_context(|| format!("cannot read {}", image.display()))?;
    tilefs_image::erofs::read_info(&bytes).with_context(|| image.display().to_string())?;
    if let Some(want) = req.options.digest {
        let got = tilefs_image::verity::digest_bytes(&bytes);
        anyhow::ensure!(
            got == want,
            "{}: its fs-verity digest is {}, not {}",
            image.display(),
            hex::encode(got),
            hex::encode(want)
        );
    }
    anyhow::ensure!(
        req.mountpoint.is_dir(),
        "{}: mount point does not exist or is not a directory",
        req.mountpoint.display()
    );
    Ok(())
}

fn enter_namespace(ns: &str) -> Result<(), String> {
    let path = if ns.bytes().all(|c| c.is_ascii_digit()) {
        format!("/proc/{ns}/ns/mnt")
    } else {
        ns.to_string()
    };
    let fd = rustix::fs::open(
        path.as_str(),
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| format!("{path}: {e}"))?;
    rustix::thread::move_into_link_name_space(
        rustix::fd::AsFd::as_fd(&fd),
        Some(rustix::thread::LinkNameSpaceType::Mount),
    )
    .map_err(|e| format!("cannot enter mount namespace {path}: {e}"))
}
