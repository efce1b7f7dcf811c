//! `docker save` archives (`docker-archive:FILE[:REPO:TAG]`): a tar holding
//! `manifest.json`, each image's configuration and its layers as
//! uncompressed tars. Layers are checked against the configuration's
//! `rootfs.diff_ids` (the digests of the uncompressed layers), the
//! configuration against the digest its name carries.

use super::layout::{ArchiveFiles, Files};
use super::{choose, Resolved, Transport};
use crate::digest::Digest;
use crate::manifest::{BlobRef, Platform, MAX_MANIFEST};
use crate::OciError;
use serde::Deserialize;
use std::io::Read;
use std::path::Path;

#[derive(Deserialize)]
struct Entry {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "RepoTags", default)]
    repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

#[derive(Deserialize)]
struct Config {
    rootfs: RootFs,
}

#[derive(Deserialize)]
struct RootFs {
    diff_ids: Vec<String>,
}

pub struct DockerArchive {
    files: Files,
    image: Option<String>,
}

impl DockerArchive {
    pub fn open(file: &Path, image: Option<String>) -> Result<DockerArchive, OciError> {
        Ok(DockerArchive {
            files: Files::Archive(ArchiveFiles::open(file)?),
            image,
        })
    }
}

impl Transport for DockerArchive {
    fn resolve(&self, _platform: &Platform) -> Result<Resolved, OciError> {
        let what = self.files.describe("manifest.json");
        let raw = self.files.read_small("manifest.json", MAX_MANIFEST)?;
        let entries: Vec<Entry> = serde_json::from_slice(&raw)
            .map_err(|e| OciError::manifest(&what, format!("not a docker-archive manifest: {e}")))?;
        let tags = |e: &Entry| e.repo_tags.clone().unwrap_or_default();
        // `nu/deb:12` names the image docker saved as `docker.io/nu/deb:12`
        // (and the other way round), as skopeo takes it.
        let wanted = self.image.as_deref().map(|w| {
            entries
                .iter()
                .flat_map(tags)
                .find(|t| crate::reference::same_image_name(w, t))
                .unwrap_or_else(|| w.to_string())
        });
        let entry = choose(&entries, wanted.as_deref(), tags, &what, "the archive", "FILE:REPO:TAG")?;
        let config_what = self.files.describe(&entry.config);
        let config_raw = self.files.read_small(&entry.config, MAX_MANIFEST)?;
        let config_digest = Digest::sha256_of(&config_raw);
        // Its name is its digest (`HEX.json` or `blobs/sha256/HEX`).
        let stem = entry.config.trim_end_matches(".json");
        let named = stem.rsplit('/').next().unwrap_or(stem);
        if named.len() == 64 && named != config_digest.hex() {
            return Err(OciError::blob(
                &entry.config,
                "the configuration does not match the digest its name carries",
            ));
        }
        let config: Config = serde_json::from_slice(&config_raw)
            .map_err(|e| OciError::manifest(&config_what, format!("not an image configuration: {e}")))?;
        if config.rootfs.diff_ids.len() != entry.layers.len() {
            return Err(OciError::manifest(
                &config_what,
                format!(
                    "{} layers in manifest.json but {} in the configuration's rootfs.diff_ids",
                    entry.layers.len(),
                    config.rootfs.diff_ids.len()
                ),
            ));
        }
        let mut layers = Vec::new();
        for (member, diff_id) in entry.layers.iter().zip(&config.rootfs.diff_ids) {
            let digest = Digest::parse(diff_id).map_err(|e| OciError::manifest(&config_what, e))?;
            let Files::Archive(a) = &self.files else { unreachable!() };
            let size = a
                .members
                .get(member.trim_start_matches("./"))
                .map(|m| m.1)
                .ok_or_else(|| OciError::manifest(&what, format!("layer {member} is not in the archive")))?;
            layers.push(BlobRef {
                digest,
                size: Some(size),
                media_type: "application/vnd.docker.image.rootfs.diff.tar".into(),
                member: Some(member.trim_start_matches("./").to_string()),
            });
        }
        Ok(Resolved {
            manifest_digest: None,
            config: None,
            layers,
            artifact: false,
            top_manifest: Vec::new(),
            manifest: Vec::new(),
            trust: None,
            evidence: None,
        })
    }

    fn open_blob(&self, blob: &BlobRef) -> Result<Box<dyn Read + Send + '_>, OciError> {
        let member = blob.member.as_deref().expect("docker-archive layers name their member");
        Ok(self.files.open(member)?.0)
    }

    fn origin(&self) -> String {
        self.files.describe("")
    }
}
