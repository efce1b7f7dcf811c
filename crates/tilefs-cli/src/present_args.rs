//! The flags `mount` and `serve` share, declared once: what to present and
//! how, made into the one request both go through
//! ([`tilefs_present::Request`]).

use crate::store_arg::StoreArg;
use anyhow::{anyhow, bail, Result};
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use tilefs_mount::options::ParsedOptions;
use tilefs_present::{FuseSettings, Request};
use tilefs_store::Verity;

#[derive(Args)]
pub struct PresentArgs {
    #[command(flatten)]
    pub store: StoreArg,
    /// Image file, or a tag in the store
    pub image: PathBuf,
    /// Make it writable: changes go to this directory (overlayfs upperdir), in overlayfs's
    /// format whichever server serves it
    #[arg(long, value_name = "DIR", requires = "work")]
    pub upper: Option<PathBuf>,
    /// Empty directory on the same filesystem as --upper (overlayfs workdir)
    #[arg(long, value_name = "DIR", requires = "upper")]
    pub work: Option<PathBuf>,
    /// Check objects against the image's digests [default: auto]
    #[arg(long, value_name = "MODE")]
    pub verity: Option<VerityArg>,
    /// Refuse the image unless its fs-verity digest is this (64 hex digits, as `tilefs digest` prints)
    #[arg(long, value_name = "DIGEST")]
    pub digest: Option<String>,
    /// Options as for `mount -o`: ro, nosuid, nodev, noexec, noatime, store=DIR (more stores), ...;
    /// for writable FUSE servers uidmapping=STORED:SHOWN:LEN[:...] and gidmapping=... (ids inside
    /// a user namespace; a user's mount of root's image defaults to 0:UID:1, `none` keeps ids as
    /// stored); anything unknown to tilefs is passed to overlayfs (kernel mounts only)
    #[arg(short = 'o', long = "options", value_name = "OPTS")]
    pub options: Vec<String>,
    /// Requests answered at once (by FUSE, or on each virtio-fs request queue; the default is one
    /// per core, at least 2; at least 16 for an image pulled with --lazy, whose fetches hold their
    /// threads). One thread reads; another takes over while a request waits (a fetch, a copy-up,
    /// a disk read, an fsync)
    #[arg(long, default_value_t = tilefs_fuse::default_threads(), value_name = "N")]
    pub threads: usize,
}

/// `--verity`.
#[derive(Clone, Copy, ValueEnum)]
pub enum VerityArg {
    /// Refuse to present the image unless every file can be verified
    Require,
    /// Verify wherever possible
    Auto,
    /// Do not verify
    Off,
}

impl From<VerityArg> for Verity {
    fn from(v: VerityArg) -> Verity {
        match v {
            VerityArg::Require => Verity::Require,
            VerityArg::Auto => Verity::Auto,
            VerityArg::Off => Verity::Off,
        }
    }
}

impl PresentArgs {
    /// The request these flags make; the command adds its mount point and
    /// backend.
    pub fn request(&self) -> Result<Request> {
        let mut options = ParsedOptions::default();
        for o in &self.options {
            options.add(o).map_err(|e| anyhow!("-o {o}: {e}"))?;
        }
        if let Some(v) = self.verity {
            options.verity = Some(v.into());
        }
        if let Some(d) = &self.digest {
            options.digest = Some(tilefs_mount::options::parse_digest(d).map_err(|e| anyhow!("--digest: {e}"))?);
        }
        if self.upper.is_some() {
            options.upper = self.upper.clone();
            options.work = self.work.clone();
        }
        // (mount.tilefs takes `rw` quietly: mount(8) passes it unasked.)
        if options.read_only == Some(false) && options.upper.is_none() {
            bail!("option rw: the image is read-only unless it has --upper/--work");
        }
        let mut stores = vec![self.store.path()?];
        stores.append(&mut options.stores);
        Ok(Request {
            image: self.image.clone(),
            stores,
            backend: options.backend,
            options,
            fuse: FuseSettings {
                threads: self.threads,
                ..FuseSettings::default()
            },
            ..Request::default()
        })
    }
}
