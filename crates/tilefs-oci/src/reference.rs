//! Image references in skopeo's transport syntax:
//! `oci:DIR[:TAG]`, `oci-archive:FILE[:TAG]`, `docker-archive:FILE[:REPO:TAG]`,
//! `docker://[HOST[:PORT]/]REPO[:TAG|@DIGEST]`.

use crate::OciError;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRef {
    /// An OCI image layout directory, and the image's
    /// `org.opencontainers.image.ref.name` in it.
    OciDir { dir: PathBuf, tag: Option<String> },
    /// A tar archive of an OCI image layout.
    OciArchive { file: PathBuf, tag: Option<String> },
    /// A `docker save` archive, and which of its images (`REPO:TAG`).
    DockerArchive { file: PathBuf, image: Option<String> },
    /// A registry: the reference as written after `docker://`.
    Registry { reference: String },
    /// An image name as podman takes it (`busybox`, `quay.io/team/app:1`),
    /// no transport: a short name is resolved through registries.conf's
    /// aliases and search registries ([`crate::trust`]).
    Name { name: String },
}

impl ImageRef {
    pub fn parse(s: &str) -> Result<ImageRef, OciError> {
        let bad = |why: &str| OciError::Reference(format!("invalid image reference {s:?}: {why}"));
        let (transport, rest) = match s.split_once(':') {
            Some(split) => split,
            None if tilefs_trust::DockerRef::parse_normalized(s).is_ok() => {
                check_lower_case(s, s)?;
                return Ok(ImageRef::Name { name: s.to_string() });
            }
            None if s.chars().any(|c| c.is_ascii_uppercase()) => return Err(upper_case(s, s)),
            None => {
                return Err(bad(
                    "expected TRANSPORT:DETAILS (oci:DIR, oci-archive:FILE, docker-archive:FILE, docker://REF) or an image name",
                ))
            }
        };
        // As skopeo: the path ends at the first colon.
        let path_and_tag = |rest: &str| -> Result<(PathBuf, Option<String>), OciError> {
            let (p, tag) = match rest.split_once(':') {
                Some((p, t)) => (p, Some(t.to_string())),
                None => (rest, None),
            };
            if p.is_empty() {
                return Err(bad("empty path"));
            }
            if tag.as_deref() == Some("") {
                return Err(bad("empty tag after ':'"));
            }
            Ok((PathBuf::from(p), tag))
        };
        match transport {
            "oci" => {
                let (dir, tag) = path_and_tag(rest)?;
                Ok(ImageRef::OciDir { dir, tag })
            }
            "oci-archive" => {
                let (file, tag) = path_and_tag(rest)?;
                Ok(ImageRef::OciArchive { file, tag })
            }
            "docker-archive" => {
                let (file, image) = path_and_tag(rest)?;
                Ok(ImageRef::DockerArchive { file, image })
            }
            "docker" => {
                let r = rest
                    .strip_prefix("//")
                    .ok_or_else(|| bad("a registry reference is docker://[HOST/]REPO[:TAG|@DIGEST]"))?;
                if r.is_empty() || r.contains(char::is_whitespace) {
                    return Err(bad("empty or malformed registry reference"));
                }
                check_lower_case(s, r)?;
                if let Err(e) = tilefs_trust::DockerRef::parse_normalized(r) {
                    return Err(bad(&e.why));
                }
                Ok(ImageRef::Registry {
                    reference: r.to_string(),
                })
            }
            _ if !s.contains("://") && tilefs_trust::DockerRef::parse_normalized(s).is_ok() => {
                check_lower_case(s, s)?;
                Ok(ImageRef::Name { name: s.to_string() })
            }
            // A registry name with capitals (`NU/deb:12`,
            // `127.0.0.1:5000/NU/deb`).
            _ if !s.contains("://")
                && (transport.contains(['/', '.']) || rest.contains('/'))
                && s.chars().any(|c| c.is_ascii_uppercase()) =>
            {
                Err(upper_case(s, s))
            }
            other if !s.contains("://") && (other.contains('.') || other == "localhost") => Err(bad(&format!(
                "unsupported transport {other:?}; for an image in a registry write docker://{s}"
            ))),
            other => Err(bad(&format!(
                "unsupported transport {other:?} (use oci:, oci-archive:, docker-archive:, docker:// or an image name)"
            ))),
        }
    }

    /// The tag an image pulled from here gets unless told otherwise: the
    /// repository (without `docker.io/library/`) and tag, or the layout's
    /// file name and tag, with `/` made `_` (a tag is one file name).
    pub fn default_tag(&self) -> String {
        let base = |p: &Path| -> String {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "image".into());
            name.strip_suffix(".tar").map(str::to_string).unwrap_or(name)
        };
        let raw = match self {
            ImageRef::OciDir { dir: p, tag } | ImageRef::OciArchive { file: p, tag } => match tag {
                Some(t) => format!("{}:{t}", base(p)),
                None => base(p),
            },
            ImageRef::DockerArchive { file, image: None } => base(file),
            ImageRef::Registry { reference }
            | ImageRef::Name { name: reference }
            | ImageRef::DockerArchive {
                image: Some(reference), ..
            } => {
                let r = reference.strip_prefix("docker.io/").unwrap_or(reference);
                r.strip_prefix("library/").unwrap_or(r).to_string()
            }
        };
        let mut tag: String = raw
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '@' | '+' | '-') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        while tag.starts_with('.') {
            tag.remove(0);
        }
        tag.truncate(tilefs_store::tags::MAX_TAG_LEN);
        if tag.is_empty() {
            tag = "image".into();
        }
        tag
    }
}

/// Refuses capitals in a registry image name: repositories are lower case
/// (a registry host may have capitals, but none of its repositories).
/// `shown`: the reference as written, `name` the registry name in it.
fn check_lower_case(shown: &str, name: &str) -> Result<(), OciError> {
    let bare = name.split('@').next().unwrap_or(name);
    let rest = match bare.split_once('/') {
        Some((host, rest)) if host.contains(['.', ':']) || host == "localhost" => rest,
        _ => bare,
    };
    // The tag (after the last colon past the last slash) may have capitals.
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let path = match rest[last_slash..].rfind(':') {
        Some(i) => &rest[..last_slash + i],
        None => rest,
    };
    if path.chars().any(|c| c.is_ascii_uppercase()) {
        return Err(upper_case(shown, path));
    }
    Ok(())
}

fn upper_case(name: &str, path: &str) -> OciError {
    OciError::Reference(format!(
        "invalid image reference {name:?}: repository names are lower case (write {:?})",
        name.replacen(path, &path.to_ascii_lowercase(), 1)
    ))
}

/// Whether two image names written by people (`nu/deb:12`,
/// `docker.io/nu/deb:12`, `busybox`) name the same image, normalized as
/// containers/image normalizes them: a name without a registry is on
/// docker.io, a docker.io name without a slash is under `library/`, and a
/// name with neither tag nor digest means `:latest`. Names that do not
/// parse are compared as written.
pub fn same_image_name(a: &str, b: &str) -> bool {
    let norm = |s: &str| {
        tilefs_trust::DockerRef::parse_normalized(s)
            .map(|r| r.with_default_tag().identity())
            .unwrap_or_else(|_| s.to_string())
    };
    a == b || norm(a) == norm(b)
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let with = |t: &Option<String>| t.as_ref().map(|t| format!(":{t}")).unwrap_or_default();
        match self {
            ImageRef::OciDir { dir, tag } => write!(f, "oci:{}{}", dir.display(), with(tag)),
            ImageRef::OciArchive { file, tag } => write!(f, "oci-archive:{}{}", file.display(), with(tag)),
            ImageRef::DockerArchive { file, image } => write!(f, "docker-archive:{}{}", file.display(), with(image)),
            ImageRef::Registry { reference } => write!(f, "docker://{reference}"),
            ImageRef::Name { name } => write!(f, "{name}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transports_parse_as_skopeo_spells_them() {
        assert_eq!(
            ImageRef::parse("oci:/srv/img:v1").unwrap(),
            ImageRef::OciDir {
                dir: "/srv/img".into(),
                tag: Some("v1".into())
            }
        );
        assert_eq!(
            ImageRef::parse("docker://127.0.0.1:5000/a/b:1").unwrap(),
            ImageRef::Registry {
                reference: "127.0.0.1:5000/a/b:1".into()
            }
        );
        assert!(ImageRef::parse("docker:foo").is_err());
        assert!(ImageRef::parse("ftp://x").is_err());
        assert!(ImageRef::parse("oci:").is_err());
        assert_eq!(
            ImageRef::parse("busybox").unwrap(),
            ImageRef::Name { name: "busybox".into() }
        );
        assert_eq!(
            ImageRef::parse("127.0.0.1:5000/a:1").unwrap(),
            ImageRef::Name {
                name: "127.0.0.1:5000/a:1".into()
            }
        );
        assert!(ImageRef::parse("Not a name").is_err());
    }

    #[test]
    fn mistakes_in_names_are_explained() {
        let msg = |s: &str| ImageRef::parse(s).unwrap_err().to_string();
        for (r, fix) in [
            ("NU/deb:12", "\"nu/deb:12\""),
            ("NU/deb", "\"nu/deb\""),
            (
                "docker://127.0.0.1:5000/NU/deb:12",
                "\"docker://127.0.0.1:5000/nu/deb:12\"",
            ),
            ("127.0.0.1:5000/Nu/deb:12", "\"127.0.0.1:5000/nu/deb:12\""),
        ] {
            let m = msg(r);
            assert!(m.contains("repository names are lower case"), "{r}: {m}");
            assert!(m.contains(fix), "{r}: {m}");
        }
        // A tag may have capitals.
        assert!(ImageRef::parse("docker://127.0.0.1:5000/nu/deb:V12").is_ok());
        let m = msg("127.0.0.1:5000/nu/deb:12:x");
        assert!(m.contains("docker://127.0.0.1:5000/nu/deb:12:x"), "{m}");
    }

    #[test]
    fn names_normalize_as_containers_image_does() {
        for (a, b) in [
            ("nu/deb:12", "docker.io/nu/deb:12"),
            ("busybox", "docker.io/library/busybox:latest"),
            ("index.docker.io/library/busybox:1", "busybox:1"),
            ("localhost:5000/a", "localhost:5000/a:latest"),
        ] {
            assert!(same_image_name(a, b), "{a} {b}");
            assert!(same_image_name(b, a), "{b} {a}");
        }
        for (a, b) in [("nu/deb:12", "nu/deb:13"), ("quay.io/nu/deb:12", "nu/deb:12")] {
            assert!(!same_image_name(a, b), "{a} {b}");
        }
    }

    #[test]
    fn default_tags_are_valid_tag_names() {
        let zeros = "0".repeat(64);
        let (by_digest, by_digest_tag) = (
            format!("docker://127.0.0.1:5000/team/app@sha256:{zeros}"),
            format!("127.0.0.1:5000_team_app@sha256:{zeros}"),
        );
        for (r, want) in [
            ("docker://docker.io/library/busybox:1.36", "busybox:1.36"),
            (by_digest.as_str(), by_digest_tag.as_str()),
            ("oci:/srv/img:v1", "img:v1"),
            ("oci-archive:/tmp/x.tar", "x"),
            ("docker-archive:/tmp/.y.tar", "y"),
            ("docker-archive:/tmp/y.tar:docker.io/nu/deb:12", "nu_deb:12"),
            ("docker-archive:/tmp/y.tar:nu/deb:12", "nu_deb:12"),
            ("docker-archive:/tmp/y.tar:docker.io/library/deb:12", "deb:12"),
        ] {
            let t = ImageRef::parse(r).unwrap().default_tag();
            assert_eq!(t, want);
            tilefs_store::tags::validate_tag(&t).unwrap();
        }
    }
}
