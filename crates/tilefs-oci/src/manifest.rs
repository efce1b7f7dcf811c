//! From an image index or manifest (OCI or Docker schema 2 media types) to
//! the image's layers: an index is resolved to the manifest of one
//! platform, a manifest is checked to be an image's, and its layers listed.

use crate::digest::Digest;
use crate::OciError;
use oci_spec::image::{ImageIndex, ImageManifest};

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";

/// Media types a registry may answer a manifest request with.
pub const MANIFEST_TYPES: &[&str] = &[OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST];

/// Largest manifest or index accepted (see [`crate::bounded`]).
pub use crate::bounded::MAX_MANIFEST;

/// A blob to fetch: its digest, size and media type, and for archives the
/// member holding it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobRef {
    pub digest: Digest,
    pub size: Option<u64>,
    pub media_type: String,
    /// The file inside an archive, where the archive names it (Docker
    /// archives); otherwise the blob is found by digest.
    pub member: Option<String>,
}

/// The platform to pick from an index: `OS/ARCH[/VARIANT]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    pub os: String,
    pub arch: String,
    pub variant: Option<String>,
}

impl Platform {
    /// Parses `linux/amd64`, `linux/arm64/v8`.
    pub fn parse(s: &str) -> Result<Platform, OciError> {
        let parts: Vec<&str> = s.split('/').collect();
        match parts.as_slice() {
            [os, arch] if !os.is_empty() && !arch.is_empty() => Ok(Platform {
                os: os.to_string(),
                arch: arch.to_string(),
                variant: None,
            }),
            [os, arch, v] if !os.is_empty() && !arch.is_empty() && !v.is_empty() => Ok(Platform {
                os: os.to_string(),
                arch: arch.to_string(),
                variant: Some(v.to_string()),
            }),
            _ => Err(OciError::Reference(format!(
                "invalid platform {s:?} (expected OS/ARCH[/VARIANT], e.g. linux/amd64)"
            ))),
        }
    }

    /// This machine's platform, in OCI's names.
    pub fn host() -> Platform {
        let arch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            "x86" => "386",
            "powerpc64" => "ppc64le",
            "loongarch64" => "loong64",
            other => other,
        };
        Platform {
            os: "linux".into(),
            arch: arch.into(),
            variant: None,
        }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.arch)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// A parsed index or manifest.
pub enum Document {
    Index(Box<ImageIndex>),
    Manifest(Box<ImageManifest>),
}

/// Parses a manifest or index; `what` names it in messages.
pub fn parse(bytes: &[u8], what: &str) -> Result<Document, OciError> {
    let bad = |r: String| OciError::manifest(what, r);
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("not a manifest (invalid JSON: {e})")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad("not a manifest (not a JSON object)".into()))?;
    match obj.get("schemaVersion").and_then(|s| s.as_u64()) {
        Some(2) => {}
        Some(1) => {
            return Err(bad(
                "Docker schema 1 manifests are not supported (re-push the image)".into()
            ))
        }
        _ => return Err(bad("not a manifest (no schemaVersion 2)".into())),
    }
    if obj.contains_key("manifests") {
        let index = ImageIndex::from_reader(bytes).map_err(|e| bad(format!("invalid index: {e}")))?;
        Ok(Document::Index(Box::new(index)))
    } else if obj.contains_key("layers") || obj.contains_key("config") {
        let m = ImageManifest::from_reader(bytes).map_err(|e| bad(format!("invalid manifest: {e}")))?;
        Ok(Document::Manifest(Box::new(m)))
    } else {
        Err(bad("neither an image index nor an image manifest".into()))
    }
}

/// A descriptor's digest, checked (it will name a path and a request).
pub fn descriptor_digest(d: &oci_spec::image::Descriptor, what: &str) -> Result<Digest, OciError> {
    Digest::parse(d.digest().as_ref()).map_err(|e| OciError::manifest(what, e))
}

/// The descriptor of `index` for `platform`: exactly the variant asked
/// for, or when none was asked, the first of the OS and architecture.
pub fn pick(index: &ImageIndex, platform: &Platform, what: &str) -> Result<(Digest, u64), OciError> {
    let mut seen = Vec::new();
    for d in index.manifests() {
        let Some(p) = d.platform() else {
            continue;
        };
        let (os, arch) = (p.os().to_string(), p.architecture().to_string());
        let variant = p.variant().clone();
        seen.push(match &variant {
            Some(v) => format!("{os}/{arch}/{v}"),
            None => format!("{os}/{arch}"),
        });
        if os == platform.os && arch == platform.arch && (platform.variant.is_none() || platform.variant == variant) {
            return Ok((descriptor_digest(d, what)?, d.size()));
        }
    }
    // An index of one manifest without a platform (an OCI layout's, say)
    // has nothing to choose between.
    if let [only] = index.manifests().as_slice() {
        if only.platform().is_none() {
            return Ok((descriptor_digest(only, what)?, only.size()));
        }
    }
    Err(OciError::manifest(
        what,
        format!(
            "no manifest for {platform} (the index has {}; choose one with --platform)",
            if seen.is_empty() {
                "none with a platform".to_string()
            } else {
                seen.join(", ")
            }
        ),
    ))
}

/// The layers of an image manifest, checked to be image layers (unless
/// `any_type`: the blobs of an artifact).
pub fn layers(m: &ImageManifest, what: &str, any_type: bool) -> Result<Vec<BlobRef>, OciError> {
    let mut out = Vec::new();
    for (i, l) in m.layers().iter().enumerate() {
        let media_type = l.media_type().to_string();
        let digest = descriptor_digest(l, what)?;
        if !any_type && !is_layer_type(&media_type) {
            return Err(OciError::manifest(
                what,
                format!(
                    "layer {} ({digest}) is not an image layer (media type {media_type})",
                    i + 1
                ),
            ));
        }
        out.push(BlobRef {
            digest,
            size: Some(l.size()),
            media_type,
            member: None,
        });
    }
    Ok(out)
}

/// The configuration blob of an image manifest.
pub fn config(m: &ImageManifest, what: &str) -> Result<BlobRef, OciError> {
    let c = m.config();
    let digest = descriptor_digest(c, what)?;
    Ok(BlobRef {
        digest,
        size: Some(c.size()),
        media_type: c.media_type().to_string(),
        member: None,
    })
}

fn is_layer_type(t: &str) -> bool {
    t.starts_with("application/vnd.oci.image.layer.")
        || t.starts_with("application/vnd.docker.image.rootfs.")
        || t == "application/x-tar"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_manifests_are_refused_with_the_reason() {
        let e = parse(b"{}", "m").err().unwrap().to_string();
        assert!(e.contains("no schemaVersion"), "{e}");
        let e = parse(b"[1]", "m").err().unwrap().to_string();
        assert!(e.contains("not a JSON object"), "{e}");
        let e = parse(br#"{"schemaVersion":1,"fsLayers":[]}"#, "m")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("schema 1"), "{e}");
        let e = parse(b"\x1f\x8b", "m").err().unwrap().to_string();
        assert!(e.contains("invalid JSON"), "{e}");
    }

    #[test]
    fn platforms_parse() {
        assert_eq!(Platform::parse("linux/arm64/v8").unwrap().to_string(), "linux/arm64/v8");
        assert!(Platform::parse("linux").is_err());
        assert!(Platform::parse("linux//").is_err());
    }
}
