//! The options `pull` and `push` share for reaching registries.

use clap::Args;
use std::time::Duration;
use tilefs_oci::transport::RegistryOptions;

#[derive(Args, Clone, Debug)]
pub struct RegistryArgs {
    /// Require HTTPS and valid certificates from registries (false: plain HTTP, or HTTPS without
    /// certificate checks)
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set,
          num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub tls_verify: bool,
    /// Seconds a registry connection or read may stall before the command fails (recorded by
    /// `pull --lazy` for the fetches of its FUSE mounts)
    #[arg(long, default_value_t = 60, value_name = "SECS")]
    pub timeout: u64,
}

impl RegistryArgs {
    pub fn options(&self) -> RegistryOptions {
        RegistryOptions {
            tls_verify: self.tls_verify,
            timeout: Duration::from_secs(self.timeout.max(1)),
        }
    }
}
