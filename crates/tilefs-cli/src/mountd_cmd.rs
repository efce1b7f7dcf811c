//! `tilefs mountd`: the mount service (see tilefs_mount::mountd).

use anyhow::{anyhow, Context, Result};
use clap::Args;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, OnceLock};
use tilefs_mount::mountd::{helper, server};

#[derive(Args)]
pub struct MountdArgs {
    /// Socket to listen on (ignored when systemd passes one: socket activation)
    #[arg(long, value_name = "PATH", default_value = server::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Policy: which users may mount which stores' tagged images (TOML; see tilefs-mountd(1))
    #[arg(long, value_name = "FILE", default_value = server::DEFAULT_POLICY)]
    pub policy: PathBuf,
    /// Run as the service's helper process on the socket at stdin (the service starts it)
    #[arg(long, hide = true)]
    pub helper: bool,
}

pub fn run(a: MountdArgs) -> Result<ExitCode> {
    if a.helper {
        let ctl = std::io::stdin()
            .as_fd()
            .try_clone_to_owned()
            .context("the helper's socket")?;
        return Ok(ExitCode::from(helper::main(ctl) as u8));
    }
    let config = server::Config {
        socket: a.socket,
        policy: a.policy,
        helper: helper::HelperCommand {
            program: "/proc/self/exe".into(),
            args: vec!["mountd".into(), "--helper".into()],
        },
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
