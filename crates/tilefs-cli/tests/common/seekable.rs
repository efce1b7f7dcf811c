//! eStargz and zstd:chunked images for the tests that start them lazily:
//! their layers written by the stargz project's estargz package and
//! containers/storage's chunked compressor (seekable-gen,
//! crates/tilefs-seekable/testdata-gen), pushed to a real registry.

use super::oci::checked;
use super::registry::{curl_put, Registry};
use super::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// seekable-gen, built by its build.sh (scripts/setup runs it; a no-op once
/// built). None only when Go is not installed.
pub fn generator() -> Option<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tilefs-seekable/testdata-gen/build.sh");
    let out = Command::new("bash").arg(&script).output().unwrap();
    match out.status.code() {
        Some(0) => Some(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()).join("seekable-gen")),
        Some(3) => {
            eprintln!("skipping: Go is not installed, so seekable-gen cannot be built");
            None
        }
        _ => panic!("building seekable-gen failed: {}", stderr(&out)),
    }
}

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// `tilefs/NAME:v1` in `registry`: one layer per tree a function of
/// `layers` fills, tarred by GNU tar and written by seekable-gen as
/// `format` (`estargz` or `zstd-chunked`); the manifest carries the
/// annotations it prints, but for `bad_toc` a wrong table digest on the
/// first layer. Returns the reference.
pub fn push_seekable(
    generator: &Path,
    area: &Area,
    registry: &Registry,
    name: &str,
    format: &str,
    layers: &[&dyn Fn(&Path)],
    bad_toc: bool,
) -> String {
    let repo = format!("tilefs/{name}");
    let (mut descs, mut diff_ids) = (Vec::new(), Vec::new());
    for (i, fill) in layers.iter().enumerate() {
        let root = area.dir(&format!("{name}-tree{i}"));
        fill(&root);
        let tar = area.path(&format!("{name}-{i}.tar"));
        let blob = area.path(&format!("{name}-{i}.blob"));
        checked(
            Command::new("tar")
                .args(["--numeric-owner", "--owner=0", "--group=0", "--sort=name", "-C"])
                .arg(&root)
                .arg("-cf")
                .arg(&tar)
                .arg("."),
        );
        let out = checked(Command::new(generator).arg(format).arg(&tar).arg(&blob));
        let mut annotations: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&out).unwrap();
        diff_ids.push(match annotations.remove("diffID") {
            Some(d) => d.as_str().unwrap().to_string(),
            None => format!("sha256:{}", sha256_hex(&fs::read(&tar).unwrap())),
        });
        if bad_toc && i == 0 {
            let key = "containerd.io/snapshot/stargz/toc.digest";
            assert!(annotations.contains_key(key), "{annotations:?}");
            annotations.insert(key.into(), format!("sha256:{}", sha256_hex(b"another table")).into());
        }
        let (digest, size) = registry.upload_blob(&repo, &fs::read(&blob).unwrap());
        let media = match format {
            "estargz" => "application/vnd.oci.image.layer.v1.tar+gzip",
            _ => "application/vnd.oci.image.layer.v1.tar+zstd",
        };
        descs.push(serde_json::json!({"mediaType": media, "digest": digest, "size": size, "annotations": annotations}));
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap();
    let (cd, cs) = registry.upload_blob(&repo, &config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
        "layers": descs,
    }))
    .unwrap();
    curl_put(
        &format!("http://{}/v2/{repo}/manifests/v1", registry.addr),
        OCI_MANIFEST,
        &manifest,
        "PUT",
    );
    format!("{}/{repo}:v1", registry.addr)
}
