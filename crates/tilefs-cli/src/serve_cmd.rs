//! `tilefs serve --vhost-user`: the image as a virtio-fs device of a VM.

use crate::logging::LogTo;
use crate::present_args::PresentArgs;
use anyhow::{anyhow, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub present: PresentArgs,
    /// Serve it as a vhost-user-fs device on this socket (QEMU's vhost-user-fs-pci,
    /// cloud-hypervisor's --fs connect to it)
    #[arg(long, value_name = "SOCKET", required = true)]
    pub vhost_user: PathBuf,
    /// The virtio-fs tag, for a VMM that asks the device for it (with QEMU, give `tag=` to
    /// vhost-user-fs-pci)
    #[arg(long, value_name = "TAG")]
    pub virtiofs_tag: Option<String>,
    /// Request queues offered (besides virtio-fs's high-priority queue): the most the VMM may
    /// use (QEMU's num-request-queues, 1 to 63)
    #[arg(long, default_value_t = 8, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=63))]
    pub queues: u16,
    /// Share the socket with this group (name or gid): mode 0660 (else it is 0600, the
    /// owner's alone, whatever the umask); for a VMM running as another user of that group
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,
    /// Exit when the VMM disconnects (else serve the next one)
    #[arg(long)]
    pub once: bool,
    /// Write the server's log to FILE (else stderr)
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
}

const SIGNALS: [i32; 3] = [
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGHUP,
];

pub fn run(a: ServeArgs) -> Result<ExitCode> {
    tilefs_fuse::raise_nofile();
    let socket_group = match &a.socket_group {
        Some(g) => Some(
            g.parse()
                .ok()
                .or_else(|| tilefs_sys::users::gid_of(g))
                .ok_or_else(|| anyhow!("--socket-group: no group {g:?}"))?,
        ),
        None => None,
    };
    let log = match &a.log {
        Some(p) => LogTo::File(p.clone()),
        None => LogTo::Stderr,
    };
    crate::logging::to_server_log(&log)?;
    let req = a.present.request()?;
    let spec = tilefs_present::serve_spec(&req)?;
    let server = tilefs_fuse::Server::build(&spec)?;
    // Its objects stay while it serves, whatever is done to its tag.
    let _record = tilefs_present::record_served(&spec, &server)
        .map_err(|e| eprintln!("tilefs: {}", tilefs_present::Notice::NotRecorded(e.to_string())))
        .ok();
    // The same worker count as a FUSE mount of the image would have.
    let threads = server.serve_config(req.fuse.threads, true, Some(false)).threads;
    let fs = Arc::new(server.filesystem());
    let socket = std::path::absolute(&a.vhost_user).context("--vhost-user")?;
    // A signal ends the server: every write of the guest is in the upper
    // directory already (each is written before it is answered).
    let mut signals = signal_hook::iterator::Signals::new(SIGNALS).context("cannot handle signals")?;
    {
        let socket = socket.clone();
        std::thread::spawn(move || {
            if let Some(sig) = signals.forever().next() {
                tracing::info!("signal {sig}: exiting");
                let _ = std::fs::remove_file(&socket);
                std::process::exit(0);
            }
        });
    }
    let opts = tilefs_vhost::Options {
        socket: socket.clone(),
        tag: a.virtiofs_tag.clone(),
        request_queues: usize::from(a.queues),
        threads,
        once: a.once,
        socket_group,
    };
    let r = tilefs_vhost::serve(fs, &opts);
    let _ = std::fs::remove_file(&socket);
    r?;
    Ok(ExitCode::SUCCESS)
}
