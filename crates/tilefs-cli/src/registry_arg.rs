//! The options `pull` and `push` share for reaching registries, and the
//! trust configuration they read.

use clap::Args;
use std::path::PathBuf;
use std::time::Duration;
use tilefs_oci::transport::RegistryOptions;
use tilefs_oci::trust::TrustOptions;

#[derive(Args, Clone, Debug)]
pub struct RegistryArgs {
    /// Require HTTPS and valid certificates from registries (false: plain HTTP, or HTTPS without
    /// certificate checks) [default: true, or false for a registry registries.conf marks insecure]
    #[arg(long, value_name = "BOOL", action = clap::ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub tls_verify: Option<bool>,
    /// Seconds to wait for a registry that does not answer (a connection, an answer, the next
    /// bytes of a transfer; a manifest must come whole within it) before the command fails
    /// (recorded by `pull --lazy` for the fetches of its FUSE mounts) [default: 60]
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Least average rate of a transfer, in bytes per second, over each --timeout it waits for
    /// data: a registry that sends less (drips) fails it (0: no least rate; --timeout alone then
    /// ends a transfer that stops; a lazy mount's fetches use the default) [default: 1024]
    #[arg(long, value_name = "BYTES")]
    pub min_rate: Option<u64>,
    /// registries.conf to read (and the drop-ins of FILE.d/) [default: $CONTAINERS_REGISTRIES_CONF,
    /// else ~/.config/containers/registries.conf if it exists, else /etc/containers/registries.conf,
    /// with their registries.conf.d]
    #[arg(long, value_name = "FILE")]
    pub registries_conf: Option<PathBuf>,
    /// Directory of registries.d files (where signatures are stored) [default:
    /// ~/.config/containers/registries.d if it exists, else /etc/containers/registries.d]
    #[arg(long = "registries.d", value_name = "DIR")]
    pub registries_d: Option<PathBuf>,
}

impl RegistryArgs {
    pub fn options(&self) -> RegistryOptions {
        RegistryOptions {
            tls_verify: self.tls_verify.unwrap_or(true),
            timeout: Duration::from_secs(self.timeout.unwrap_or(60).max(1)),
            min_rate: self.min_rate.unwrap_or(tilefs_oci::transport::DEFAULT_MIN_RATE),
            cancel: None,
        }
    }

    /// The trust configuration, with `policy` (`--signature-policy`).
    pub fn trust(&self, policy: Option<PathBuf>) -> TrustOptions {
        TrustOptions {
            paths: tilefs_trust::Paths {
                signature_policy: policy,
                registries_d: self.registries_d.clone(),
                registries_conf: self.registries_conf.clone(),
            },
            tls_verify_explicit: self.tls_verify.is_some(),
        }
    }
}
