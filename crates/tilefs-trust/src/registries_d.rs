//! Where signatures are stored, containers-registries.d(5): YAML files
//! (`*.yaml`) in one directory, merged (a `default-docker` section and
//! each `docker` scope may be defined once across all of them); for an
//! image the most precisely matching `docker` scope applies, else
//! `default-docker`, else the built-in lookaside directory.

use crate::dockerref::DockerRef;
use crate::Error;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One configuration section.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Section {
    pub lookaside: Option<String>,
    #[serde(rename = "lookaside-staging")]
    pub lookaside_staging: Option<String>,
    /// The old names of `lookaside` and `lookaside-staging`.
    pub sigstore: Option<String>,
    #[serde(rename = "sigstore-staging")]
    pub sigstore_staging: Option<String>,
    #[serde(rename = "use-sigstore-attachments")]
    pub use_sigstore_attachments: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
struct File {
    #[serde(rename = "default-docker")]
    default_docker: Option<Section>,
    docker: Option<BTreeMap<String, Section>>,
}

/// The merged configuration.
#[derive(Debug, Clone, Default)]
pub struct RegistriesD {
    /// The directory read, for messages.
    pub dir: PathBuf,
    default_docker: Option<Section>,
    docker: BTreeMap<String, Section>,
}

/// What applies to one image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Storage {
    /// Which section applied (`docker: SCOPE`, `default-docker`, `built-in`).
    pub from: String,
    /// The lookaside base URL to read signatures from.
    pub lookaside: Option<String>,
    /// The lookaside base URL to write signatures to.
    pub staging: Option<String>,
    pub use_sigstore_attachments: bool,
}

impl RegistriesD {
    /// The directory used by default: the user's if it exists, else the
    /// system's.
    pub fn default_dir() -> PathBuf {
        if let Some(home) = crate::home() {
            let user = home.join(".config/containers/registries.d");
            if user.is_dir() {
                return user;
            }
        }
        PathBuf::from("/etc/containers/registries.d")
    }

    /// Parses the text of one file into `self` (named `name` in messages).
    pub fn add(&mut self, raw: &[u8], name: &str) -> Result<(), Error> {
        let text = std::str::from_utf8(raw).map_err(|_| Error::invalid(name, "not UTF-8"))?;
        let f: File = if text.trim().is_empty() {
            File::default()
        } else {
            serde_norway::from_str(text).map_err(|e| Error::invalid(name, format!("{e}")))?
        };
        if let Some(d) = f.default_docker {
            if self.default_docker.is_some() {
                return Err(Error::invalid(name, "default-docker is defined in more than one file"));
            }
            self.default_docker = Some(d);
        }
        for (scope, s) in f.docker.unwrap_or_default() {
            // Host names as references keep them (lower case).
            let scope = crate::dockerref::lower_host(&scope);
            if self.docker.contains_key(&scope) {
                return Err(Error::invalid(
                    name,
                    format!("docker scope {scope:?} is defined more than once (host names have no case)"),
                ));
            }
            self.docker.insert(scope, s);
        }
        Ok(())
    }

    /// Reads every `*.yaml` file of `dir` (none when it does not exist).
    pub fn load(dir: &Path) -> Result<RegistriesD, Error> {
        let mut out = RegistriesD {
            dir: dir.to_path_buf(),
            ..Default::default()
        };
        let rd = match std::fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(Error::read(dir, e)),
        };
        let mut names: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        names.sort();
        for p in names {
            let raw = crate::read_config(&p).map_err(|e| Error::read(&p, e))?;
            out.add(&raw, &p.display().to_string())?;
        }
        Ok(out)
    }

    /// The storage that applies to `r`.
    pub fn storage_for(&self, r: &DockerRef) -> Storage {
        let scopes = std::iter::once(r.identity()).chain(r.namespaces().into_iter().filter(|n| !n.starts_with("*.")));
        let (from, s) = match scopes
            .into_iter()
            .find_map(|k| self.docker.get(&k).map(|s| (format!("docker scope {k:?}"), s.clone())))
        {
            Some(found) => found,
            None => match &self.default_docker {
                Some(d) => ("default-docker".to_string(), d.clone()),
                None => {
                    return Storage {
                        from: "the built-in default".into(),
                        lookaside: Some(builtin_lookaside()),
                        staging: Some(builtin_lookaside()),
                        use_sigstore_attachments: false,
                    }
                }
            },
        };
        let lookaside = s.lookaside.clone().or(s.sigstore.clone());
        Storage {
            from: format!("{from} of {}", self.dir.display()),
            staging: s.lookaside_staging.or(s.sigstore_staging).or(lookaside.clone()),
            lookaside,
            use_sigstore_attachments: s.use_sigstore_attachments.unwrap_or(false),
        }
    }
}

/// `file:///var/lib/containers/sigstore` for root,
/// `file://$HOME/.local/share/containers/sigstore` for others.
pub fn builtin_lookaside() -> String {
    if rustix::process::geteuid().is_root() {
        return "file:///var/lib/containers/sigstore".into();
    }
    match crate::home() {
        Some(h) => format!("file://{}", h.join(".local/share/containers/sigstore").display()),
        None => "file:///var/lib/containers/sigstore".into(),
    }
}

/// The URL of signature `n` (from 1) of the manifest `digest` of the
/// repository whose path in its registry is `repo` (without the host, as
/// containers/image names them) under the lookaside `base`:
/// `BASE/PATH@ALG=HEX/signature-N`.
pub fn lookaside_url(base: &str, repo: &str, digest: &str, n: usize) -> Result<String, Error> {
    if !crate::dockerref::valid_digest(digest) {
        return Err(Error::invalid("lookaside", format!("{digest:?} is not a digest")));
    }
    let (alg, hex) = digest.split_once(':').expect("a valid digest");
    Ok(format!(
        "{}/{repo}@{alg}={hex}/signature-{n}",
        base.trim_end_matches('/')
    ))
}

/// The local path of a `file://` URL.
pub fn file_path(url: &str) -> Option<PathBuf> {
    url.strip_prefix("file://").map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn most_precise_scope_then_default() {
        let mut d = RegistriesD::default();
        d.add(
            b"default-docker:\n  lookaside: https://sigs.example/d\ndocker:\n  reg.io:\n    lookaside: file:///srv/reg\n  reg.io/team/app:\n    use-sigstore-attachments: true\n",
            "a.yaml",
        )
        .unwrap();
        d.add(
            b"docker:\n  other.io:\n    sigstore: http://x/y\n    sigstore-staging: file:///tmp/s\n",
            "b.yaml",
        )
        .unwrap();
        let r = |s: &str| DockerRef::parse_normalized(s).unwrap();
        let s = d.storage_for(&r("reg.io/team/app:1"));
        assert!(s.use_sigstore_attachments);
        assert_eq!(s.lookaside, None);
        let s = d.storage_for(&r("reg.io/team/x:1"));
        assert_eq!(s.lookaside.as_deref(), Some("file:///srv/reg"));
        assert!(!s.use_sigstore_attachments);
        let s = d.storage_for(&r("other.io/z"));
        assert_eq!(s.lookaside.as_deref(), Some("http://x/y"));
        assert_eq!(s.staging.as_deref(), Some("file:///tmp/s"));
        assert_eq!(
            d.storage_for(&r("q.io/z")).lookaside.as_deref(),
            Some("https://sigs.example/d")
        );
        assert!(d.add(b"docker:\n  reg.io:\n    lookaside: x\n", "c.yaml").is_err());
        assert!(d.add(b"default-docker:\n  lookaside: x\n", "c.yaml").is_err());
        assert!(d.add(b"docker: [1, 2", "c.yaml").is_err());
        assert_eq!(
            lookaside_url(
                "file:///s/",
                "team/a",
                "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                2
            )
            .unwrap(),
            "file:///s/team/a@sha256=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef/signature-2"
        );
    }
}
