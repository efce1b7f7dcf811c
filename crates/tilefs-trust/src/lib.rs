//! tilefs-trust: whether an image may come in, and from where, read from
//! the files podman, skopeo, CRI-O and buildah read.
//!
//! - [`policy`]: containers-policy.json(5), the signature verification
//!   policy: scopes by transport, registry, namespace, repository and
//!   tag/digest; `insecureAcceptAnything`, `reject`, `signedBy` (OpenPGP
//!   simple signing) and `sigstoreSigned` (public keys), `signedIdentity`;
//! - [`registries_d`]: containers-registries.d(5), where signatures are
//!   (lookaside storage, sigstore attachments);
//! - [`registries_conf`]: containers-registries.conf(5) and its drop-ins:
//!   mirrors, insecure and blocked registries, short names;
//! - [`gpg`], [`sigstore`], [`payload`]: the signatures themselves;
//! - [`rootfile`]: reading files a root service trusts (no one else could
//!   have written them);
//! - [`dockerref`]: docker references in their fully expanded form.
//!
//! The check is a library call ([`policy::Policy::evaluate`]) so that every
//! path that brings an image in makes the same one: `tilefs pull` (and
//! `--lazy`), the first fetch of a lazily pulled image's FUSE mount, and a
//! containerd snapshotter, which builds a [`policy::Subject`] from the
//! image reference CRI gives it, loads the node's [`Paths`] and calls
//! `evaluate` with the top-level manifest it resolved and a
//! [`policy::SignatureSource`] for its registry (tilefs-oci's
//! `trust::check_registry_image` does all of it for a registry image).

pub mod dockerref;
pub mod error;
pub mod evidence;
pub mod gpg;
pub mod payload;
pub mod policy;
pub mod refused;
pub mod registries_conf;
pub mod registries_d;
pub mod rootfile;
pub mod sigstore;

pub use dockerref::DockerRef;
pub use error::Error;
pub use policy::{Accepted, Policy, Refusal, SignatureSource, Subject};
pub use refused::Refused;
pub use registries_conf::RegistriesConf;
pub use registries_d::RegistriesD;

use sha2::Digest as _;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The largest configuration or key file read.
pub const MAX_CONFIG: u64 = 16 << 20;

/// Reads a configuration file: a regular file (never a FIFO or device put
/// in its place), at most [`MAX_CONFIG`] bytes.
pub fn read_config(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)?;
    let m = f.metadata()?;
    if !m.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut v = Vec::new();
    f.take(MAX_CONFIG + 1).read_to_end(&mut v)?;
    if v.len() as u64 > MAX_CONFIG {
        return Err(std::io::Error::other(format!("larger than {MAX_CONFIG} bytes")));
    }
    Ok(v)
}

/// `$HOME`, if set.
pub fn home() -> Option<PathBuf> {
    std::env::var_os("HOME").filter(|h| !h.is_empty()).map(PathBuf::from)
}

/// Whether `digest` (`sha256:HEX` or `sha512:HEX`) is the digest of `bytes`.
pub fn digest_matches(digest: &str, bytes: &[u8]) -> bool {
    match digest.split_once(':') {
        Some(("sha256", hex)) => hex::encode(sha2::Sha256::digest(bytes)) == hex,
        Some(("sha512", hex)) => hex::encode(sha2::Sha512::digest(bytes)) == hex,
        _ => false,
    }
}

/// What a lazily pulled image keeps of its check, so that its mount's
/// fetches check it again: the reference it was pulled as and the
/// configuration files used.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TrustRecord {
    /// The image as the policy judged it (`docker://HOST/REPO:TAG`).
    pub logical: String,
    /// The top-level manifest's digest.
    pub manifest_digest: String,
    pub paths: Paths,
}

/// Where the configuration is read from. Unset fields take the defaults
/// podman and skopeo use.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Paths {
    /// policy.json (`--signature-policy`): default
    /// `$HOME/.config/containers/policy.json` if it exists, else
    /// `/etc/containers/policy.json`.
    pub signature_policy: Option<PathBuf>,
    /// registries.d (`--registries.d`): default
    /// `$HOME/.config/containers/registries.d` if it exists, else
    /// `/etc/containers/registries.d`.
    pub registries_d: Option<PathBuf>,
    /// registries.conf (`--registries-conf`, else `$CONTAINERS_REGISTRIES_CONF`,
    /// else `$REGISTRIES_CONFIG_PATH`): that file and the drop-ins of
    /// `FILE.d/`; by default `$HOME/.config/containers/registries.conf` with
    /// its `.d` if it exists, else `/etc/containers/registries.conf`, the
    /// drop-ins of `/etc/containers/registries.conf.d/` and then of
    /// `$HOME/.config/containers/registries.conf.d/`.
    pub registries_conf: Option<PathBuf>,
}

const SYSTEM_POLICY: &str = "/etc/containers/policy.json";

impl Paths {
    /// The policy file that applies.
    pub fn policy_path(&self) -> PathBuf {
        if let Some(p) = &self.signature_policy {
            return p.clone();
        }
        if let Some(h) = home() {
            let user = h.join(".config/containers/policy.json");
            if user.exists() {
                return user;
            }
        }
        PathBuf::from(SYSTEM_POLICY)
    }

    /// Loads the policy. Without any policy file the pull is refused, as
    /// podman and skopeo refuse it.
    pub fn load_policy(&self) -> Result<Policy, Error> {
        let p = self.policy_path();
        match read_config(&p) {
            Ok(raw) => Policy::parse(&raw, &p.display().to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && self.signature_policy.is_none() => {
                Err(Error::NoPolicy {
                    path: p,
                    user: home().map(|h| h.join(".config/containers/policy.json")),
                })
            }
            Err(e) => Err(Error::read(&p, format!("signature policy: {e}"))),
        }
    }

    pub fn registries_d_dir(&self) -> PathBuf {
        self.registries_d.clone().unwrap_or_else(RegistriesD::default_dir)
    }

    pub fn load_registries_d(&self) -> Result<RegistriesD, Error> {
        RegistriesD::load(&self.registries_d_dir())
    }

    /// The registries.conf explicitly chosen (flag or environment).
    pub fn explicit_registries_conf(&self) -> Option<PathBuf> {
        self.registries_conf.clone().or_else(|| {
            ["CONTAINERS_REGISTRIES_CONF", "REGISTRIES_CONFIG_PATH"]
                .iter()
                .find_map(|v| std::env::var_os(v).filter(|s| !s.is_empty()).map(PathBuf::from))
        })
    }

    pub fn load_registries_conf(&self) -> Result<RegistriesConf, Error> {
        let dot_d = |p: &Path| {
            let mut s = p.as_os_str().to_owned();
            s.push(".d");
            PathBuf::from(s)
        };
        if let Some(f) = self.explicit_registries_conf() {
            let d = dot_d(&f);
            return RegistriesConf::load(Some(&f), &[d]);
        }
        let user = home().map(|h| h.join(".config/containers/registries.conf"));
        let mut c = match &user {
            Some(u) if u.exists() => RegistriesConf::load(Some(u), &[dot_d(u)])?,
            _ => {
                let sys = Path::new("/etc/containers/registries.conf");
                let mut d = vec![dot_d(sys)];
                d.extend(user.as_deref().map(dot_d));
                RegistriesConf::load(Some(sys), &d)?
            }
        };
        // A root in a user namespace (rootless podman's, `podman unshare`)
        // is the user, whose aliases podman keeps in the user's cache.
        let cache = if rustix::process::geteuid().is_root() && tilefs_sys::ns::in_initial_userns() {
            Some(PathBuf::from("/var/cache/containers/short-name-aliases.conf"))
        } else {
            home().map(|h| h.join(".cache/containers/short-name-aliases.conf"))
        };
        if let Some(cache) = cache {
            c.add_alias_cache(&cache)?;
        }
        Ok(c)
    }

    /// The same paths made absolute (as they were resolved now), to be
    /// recorded and used again later by another process.
    pub fn resolved(&self) -> Paths {
        let abs = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
        Paths {
            signature_policy: Some(abs(self.policy_path())),
            registries_d: Some(abs(self.registries_d_dir())),
            registries_conf: self.explicit_registries_conf().map(abs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests() {
        assert!(digest_matches(
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            b""
        ));
        assert!(!digest_matches("sha256:00", b""));
        assert!(!digest_matches("md5:d41d8cd98f00b204e9800998ecf8427e", b""));
    }
}
