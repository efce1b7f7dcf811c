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

/// How a pushed manifest is signed: `tilefs push` and `tilefs index`.
#[derive(Args, Debug, Clone)]
pub struct SignArgs {
    /// Sign the pushed manifest with this GnuPG key (from the user's keyring): a simple signature
    /// in the lookaside store registries.d names for the destination (lookaside-staging)
    #[arg(long, value_name = "FINGERPRINT")]
    pub sign_by: Option<String>,
    /// Sign the pushed manifest with this sigstore private key (cosign's encrypted format): an
    /// attachment in the destination repository (registries.d must enable
    /// use-sigstore-attachments for it)
    #[arg(long, value_name = "FILE")]
    pub sign_by_sigstore_private_key: Option<PathBuf>,
    /// The passphrase of the signing key, on the first line of FILE
    #[arg(long, value_name = "FILE")]
    pub sign_passphrase_file: Option<PathBuf>,
    /// The identity signatures claim [default: the destination reference]
    #[arg(long, value_name = "REFERENCE")]
    pub sign_identity: Option<String>,
}

impl SignArgs {
    /// The signing options, with the trust configuration's paths.
    pub fn options(&self, trust: &TrustOptions) -> tilefs_oci::trust::SignOptions {
        tilefs_oci::trust::SignOptions {
            gpg: self.sign_by.clone(),
            sigstore_key: self.sign_by_sigstore_private_key.clone(),
            passphrase_file: self.sign_passphrase_file.clone(),
            identity: self.sign_identity.clone(),
            paths: trust.paths.clone(),
        }
    }
}

/// What a registry command's result becomes: [`crate::build::Interrupted`]
/// when SIGINT or SIGTERM (`cancel`) ended it, else its error with `what`
/// (the operation and its references) before the reason.
pub fn outcome<T>(
    result: Result<T, tilefs_oci::OciError>,
    cancel: &std::sync::atomic::AtomicBool,
    what: impl FnOnce() -> String,
) -> anyhow::Result<T> {
    match result {
        Ok(t) => Ok(t),
        Err(tilefs_oci::OciError::Interrupted) => Err(crate::build::Interrupted.into()),
        Err(_) if cancel.load(std::sync::atomic::Ordering::Relaxed) => Err(crate::build::Interrupted.into()),
        Err(e) => Err(anyhow::Error::new(e).context(what())),
    }
}
