//! `tilefs mountd`: the mount service (see tilefs_mount::mountd).

use anyhow::{anyhow, Context, Result};
use clap::Args;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, OnceLock};
use tilefs_mount::mountd::{helper, server};

/// What `tilefs mountd --help` and tilefs-mountd(1) say: the policy's
/// format is here, where an administrator looks for it.
pub const LONG_ABOUT: &str = "Run the mount service (as root): kernel mounts of trusted images for \
users without privilege.

Users reach it with `tilefs mount --delegated` (or plain `tilefs mount` without privilege); the \
caller is known by the socket's peer credentials. It mounts only tagged images of the stores its \
policy lists, for the users and groups the policy names, nosuid and nodev, and a writable mount \
as the overlay the caller could make without privilege.

The policy (TOML, --policy, default /etc/tilefs/mountd.toml):

  max_mounts_per_user = 64         # optional: live mounts kept for one user
  [[store]]
  path = \"/var/lib/tilefs/store\"   # absolute: a store whose tags may be mounted
  users = [\"alice\", \"1001\"]        # user names or uids
  groups = [\"builders\"]            # group names or gids
  images = [\"os:1\"]                # optional: only these tags (default: all)
  verity = \"require\"               # optional: require | auto | off, over what users ask
  writable = true                  # optional: allow --upper/--work (default false)
  signature_policy = \"/etc/containers/policy.json\"  # optional: mount only images it accepts
  [store.pinned]                   # optional: tags that mount only with this digest
  \"os:1\" = \"sha256:6d0c...\"

Unknown keys, names that resolve to no user or group, and relative paths are errors when the \
policy is loaded. The policy, the signature policies and key files it names, and the stores' \
tags and check records are read only if root alone could have written them (root's, writable by \
no one else, every directory above them too, reached through no symlink). Each request has \
--request-timeout seconds; one whose client hangs up or whose time runs out is not carried out. \
Clients find the service at $TILEFS_MOUNTD_SOCKET, else /run/tilefs/mountd.sock. SIGTERM or SIGINT stops it; it removes the socket it made.";

#[derive(Args)]
pub struct MountdArgs {
    /// Socket to listen on (ignored when systemd passes one: socket activation)
    #[arg(long, value_name = "PATH", default_value = server::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Policy: which users may mount which stores' tagged images (TOML; see tilefs-mountd(1))
    #[arg(long, value_name = "FILE", default_value = server::DEFAULT_POLICY)]
    pub policy: PathBuf,
    /// How long a request may take once asked (checking its directories, building and attaching
    /// the mount); past it the client is told so and nothing is done for it
    #[arg(long, value_name = "SECONDS", default_value_t = server::DEFAULT_REQUEST_TIMEOUT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub request_timeout: u64,
}

/// The arguments the service starts its helper process with.
pub const HELPER_ARGS: [&str; 2] = ["mountd", "--helper"];

/// Runs as the service's helper process, on the socket at stdin.
pub fn helper() -> ExitCode {
    match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(ctl) => ExitCode::from(helper::main(ctl) as u8),
        Err(e) => {
            eprintln!("tilefs mountd: the helper's socket: {e}");
            ExitCode::FAILURE
        }
    }
}

pub fn run(a: MountdArgs) -> Result<ExitCode> {
    crate::logging::set_name("tilefs-mountd");
    let config = server::Config {
        socket: a.socket,
        policy: a.policy,
        helper: helper::HelperCommand {
            program: "/proc/self/exe".into(),
            args: HELPER_ARGS.iter().map(Into::into).collect(),
        },
        request_timeout: std::time::Duration::from_secs(a.request_timeout),
    };
    // Signals are taken before the socket exists: a SIGTERM right after
    // it appears still shuts down cleanly.
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM])
        .context("cannot handle signals")?;
    let service: Arc<OnceLock<Arc<server::Service>>> = Arc::default();
    let on_signal = service.clone();
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            let name = if sig == signal_hook::consts::SIGINT {
                "SIGINT"
            } else {
                "SIGTERM"
            };
            // Its socket exists a moment before the service can be
            // stopped cleanly: a signal in between waits for it.
            let end = std::time::Instant::now() + std::time::Duration::from_secs(2);
            while on_signal.get().is_none() && std::time::Instant::now() < end {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            match on_signal.get() {
                Some(svc) => svc.shutdown(name),
                None => eprintln!("tilefs-mountd: stopped by {name} while starting"),
            }
            std::process::exit(0);
        }
    });
    let svc = Arc::new(server::Service::bind(&config).map_err(|e| anyhow!(e))?);
    let _ = service.set(svc.clone());
    svc.serve().map_err(|e| anyhow!(e))?;
    Ok(ExitCode::SUCCESS)
}
