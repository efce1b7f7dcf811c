//! `tilefs generate-sigstore-key`: a key pair for `push
//! --sign-by-sigstore-private-key` and `sigstoreSigned` policies, in the
//! files skopeo's and cosign's commands of the same purpose write.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct GenerateSigstoreKeyArgs {
    /// Write the private key to PREFIX.key and the public key to PREFIX.pub
    #[arg(long, value_name = "PREFIX")]
    pub output_prefix: PathBuf,
    /// Encrypt the private key with the passphrase on the first line of FILE [default: an
    /// empty passphrase]
    #[arg(long, value_name = "FILE")]
    pub passphrase_file: Option<PathBuf>,
}

pub fn run(a: GenerateSigstoreKeyArgs) -> Result<ExitCode> {
    let pass = match &a.passphrase_file {
        Some(p) => {
            let raw = std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?;
            let line = raw.split(|&b| b == b'\n').next().unwrap_or(&[]).to_vec();
            line.strip_suffix(b"\r").map(<[u8]>::to_vec).unwrap_or(line)
        }
        None => Vec::new(),
    };
    let (private, public) = tilefs_trust::sigstore::generate(&pass)?;
    let with = |ext: &str| {
        let mut s = a.output_prefix.clone().into_os_string();
        s.push(ext);
        PathBuf::from(s)
    };
    let (key, pubkey) = (with(".key"), with(".pub"));
    for p in [&key, &pubkey] {
        if std::fs::symlink_metadata(p).is_ok() {
            bail!("{} exists already", p.display());
        }
    }
    for (p, text, mode) in [(&key, &private, 0o600), (&pubkey, &public, 0o644)] {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(p)
            .with_context(|| format!("cannot create {}", p.display()))?;
        f.write_all(text.as_bytes())
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    eprintln!(
        "tilefs: wrote the private key {} and the public key {}",
        key.display(),
        pubkey.display()
    );
    Ok(ExitCode::SUCCESS)
}
