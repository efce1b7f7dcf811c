//! tilefs images as OCI artifacts: the layout `tilefs push` writes to a
//! registry and `tilefs pull` recognizes (documented in the README).
//!
//! A standard OCI image manifest whose `artifactType` is [`ARTIFACT_TYPE`]:
//! - config ([`CONFIG_TYPE`]): JSON naming the image's fs-verity digest and
//!   counting its objects;
//! - layer 0 ([`EROFS_TYPE`]): the composefs EROFS image itself;
//! - layer 1 ([`INDEX_TYPE`]): the object index, JSON: where each object
//!   lies in the packs;
//! - layers 2.. ([`PACK_TYPE`]): packs, the objects' bytes concatenated,
//!   uncompressed, so that one object (or a run of them) is one HTTP range
//!   request.
//!
//! A *runnable* artifact (`tilefs push --runnable-from`) holds the same
//! blobs under layer media types ([`RUNNABLE_EROFS_TYPE`] and its
//! siblings: containerd treats a type under `application/vnd.oci.image.layer.`
//! as a layer and asks its snapshotter for it) and, for configuration, an
//! OCI image configuration (the command, environment, … of the image it
//! was made from) whose `rootfs.diff_ids` are the blobs' digests and whose
//! labels ([`LABEL_FSVERITY`], …) carry what [`Config`] holds. containerd's
//! CRI pull of it through the tilefs snapshotter downloads none of its
//! layers: the snapshotter serves the image lazily.
//!
//! Packs are cut from the objects in the image's tree order (a directory's
//! files together, so reading a directory reads neighbouring ranges), each
//! closed once it holds [`PACK_TARGET`] bytes; the same image always gives
//! the same blobs, so pushing it again uploads nothing.

use crate::digest::Digest;
use crate::OciError;
use serde::{Deserialize, Serialize};
use tilefs_image::Tree;
use tilefs_store::parse_object_rel;

pub const ARTIFACT_TYPE: &str = "application/vnd.tilefs.image.v1";
pub const CONFIG_TYPE: &str = "application/vnd.tilefs.image.config.v1+json";
pub const EROFS_TYPE: &str = "application/vnd.tilefs.image.erofs.v1";
pub const INDEX_TYPE: &str = "application/vnd.tilefs.image.objects.v1+json";
pub const PACK_TYPE: &str = "application/vnd.tilefs.image.pack.v1";

pub const RUNNABLE_EROFS_TYPE: &str = "application/vnd.oci.image.layer.tilefs.erofs.v1";
pub const RUNNABLE_INDEX_TYPE: &str = "application/vnd.oci.image.layer.tilefs.objects.v1+json";
pub const RUNNABLE_PACK_TYPE: &str = "application/vnd.oci.image.layer.tilefs.pack.v1";
pub const OCI_CONFIG_TYPE: &str = "application/vnd.oci.image.config.v1+json";
/// A runnable artifact's configuration labels.
pub const LABEL_FSVERITY: &str = "org.tilefs.fsverity";
pub const LABEL_OBJECTS: &str = "org.tilefs.objects";
pub const LABEL_OBJECT_BYTES: &str = "org.tilefs.object-bytes";

/// The media types of an artifact's image, index and packs.
pub fn blob_types(runnable: bool) -> [&'static str; 3] {
    if runnable {
        [RUNNABLE_EROFS_TYPE, RUNNABLE_INDEX_TYPE, RUNNABLE_PACK_TYPE]
    } else {
        [EROFS_TYPE, INDEX_TYPE, PACK_TYPE]
    }
}

/// Whether a manifest whose configuration and first layer have these media
/// types is a tilefs artifact.
pub fn is_artifact(config_type: &str, first_layer_type: Option<&str>) -> bool {
    config_type == CONFIG_TYPE || matches!(first_layer_type, Some(EROFS_TYPE | RUNNABLE_EROFS_TYPE))
}

/// A pack is closed once it holds this much.
pub const PACK_TARGET: u64 = 64 << 20;

/// Largest EROFS image and object index accepted from a registry.
pub const MAX_IMAGE: u64 = 4 << 30;
pub const MAX_INDEX: u64 = 1 << 30;
/// Largest configuration accepted.
pub const MAX_CONFIG: u64 = 64 << 10;

/// The artifact's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The EROFS image's fs-verity digest (SHA-256, 4 KiB blocks), hex.
    pub fsverity: String,
    /// Distinct objects the image references, and their total size.
    pub objects: u64,
    pub object_bytes: u64,
}

/// Where an object lies: pack number (0 is the manifest's third layer),
/// offset and size in that pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Location {
    pub pack: u32,
    pub offset: u64,
    pub size: u64,
}

/// The object index blob: `{"version":1,"objects":[[hex, pack, offset,
/// size], ...]}`, in pack order.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct IndexFile {
    version: u32,
    objects: Vec<(String, u32, u64, u64)>,
}

/// An object of the image: its digest (also its store name) and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectRef {
    pub digest: [u8; 32],
    pub size: u64,
}

/// The distinct objects `tree` references, in tree order (first use).
pub fn objects_of(tree: &Tree) -> Vec<ObjectRef> {
    let mut seen = rustc_hash::FxHashSet::default();
    let mut out = Vec::new();
    tree.walk(|_, entry, id| {
        if entry.is_some_and(|e| e.hardlink) {
            return;
        }
        let inode = tree.inode(id);
        if !inode.is_external() {
            return;
        }
        if let Some(d) = inode.payload.as_deref().and_then(parse_object_rel) {
            if seen.insert(d) {
                out.push(ObjectRef {
                    digest: d,
                    size: inode.size,
                });
            }
        }
    });
    out
}

/// A pack: its size and the objects (a run of the list) it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pack {
    pub size: u64,
    pub objects: std::ops::Range<usize>,
}

/// Cuts `objects` (in order) into packs; returns each object's location
/// and the packs.
pub fn plan_packs(objects: &[ObjectRef]) -> (Vec<Location>, Vec<Pack>) {
    let mut locs = Vec::with_capacity(objects.len());
    let mut packs: Vec<Pack> = Vec::new();
    for (i, o) in objects.iter().enumerate() {
        if packs.last().is_none_or(|p| p.size >= PACK_TARGET) {
            packs.push(Pack { size: 0, objects: i..i });
        }
        let n = packs.len() - 1;
        let pack = &mut packs[n];
        locs.push(Location {
            pack: n as u32,
            offset: pack.size,
            size: o.size,
        });
        pack.size += o.size;
        pack.objects.end = i + 1;
    }
    (locs, packs)
}

/// The index blob for `objects` at `locs`.
pub fn encode_index(objects: &[ObjectRef], locs: &[Location]) -> Vec<u8> {
    let file = IndexFile {
        version: 1,
        objects: objects
            .iter()
            .zip(locs)
            .map(|(o, l)| (hex::encode(o.digest), l.pack, l.offset, l.size))
            .collect(),
    };
    serde_json::to_vec(&file).expect("an index serializes")
}

/// A parsed, checked object index, sorted by digest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectIndex {
    pub objects: Vec<([u8; 32], Location)>,
}

impl ObjectIndex {
    /// Parses an index blob for an artifact whose packs have `pack_sizes`:
    /// every location must lie inside its pack, every digest be 64 hex
    /// digits, no digest appear twice. `what` names the blob in errors.
    pub fn parse(bytes: &[u8], pack_sizes: &[u64], what: &str) -> Result<ObjectIndex, OciError> {
        let bad = |r: String| OciError::manifest(what, r);
        let file: IndexFile =
            serde_json::from_slice(bytes).map_err(|e| bad(format!("not a tilefs object index: {e}")))?;
        if file.version != 1 {
            return Err(bad(format!(
                "object index version {} (this tilefs reads 1)",
                file.version
            )));
        }
        let mut objects = Vec::with_capacity(file.objects.len());
        for (hex_digest, pack, offset, size) in file.objects {
            let digest: [u8; 32] = hex::decode(&hex_digest)
                .ok()
                .and_then(|b| b.try_into().ok())
                .filter(|_| hex_digest.bytes().all(|c| !c.is_ascii_uppercase()))
                .ok_or_else(|| bad(format!("{hex_digest:?} is not an object digest")))?;
            let Some(&pack_size) = pack_sizes.get(pack as usize) else {
                return Err(bad(format!(
                    "object {hex_digest} lies in pack {pack}, but the artifact has {} packs",
                    pack_sizes.len()
                )));
            };
            if offset.checked_add(size).is_none_or(|end| end > pack_size) {
                return Err(bad(format!(
                    "object {hex_digest} at offset {offset}, {size} bytes, lies outside pack {pack} ({pack_size} bytes)"
                )));
            }
            objects.push((digest, Location { pack, offset, size }));
        }
        objects.sort_unstable_by_key(|a| a.0);
        if let Some(w) = objects.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(bad(format!("object {} is listed twice", hex::encode(w[0].0))));
        }
        Ok(ObjectIndex { objects })
    }

    pub fn get(&self, digest: &[u8; 32]) -> Option<Location> {
        self.objects
            .binary_search_by(|(d, _)| d.cmp(digest))
            .ok()
            .map(|i| self.objects[i].1)
    }

    /// Checks that the index places every object of `needed` with the size
    /// the image gives it, and keeps only those.
    pub fn restrict_to(self, needed: &[ObjectRef], what: &str) -> Result<ObjectIndex, OciError> {
        let mut objects = Vec::with_capacity(needed.len());
        for o in needed {
            let loc = self.get(&o.digest).ok_or_else(|| {
                OciError::manifest(
                    what,
                    format!(
                        "the image needs object {}, which the index does not list",
                        hex::encode(o.digest)
                    ),
                )
            })?;
            if loc.size != o.size {
                return Err(OciError::manifest(
                    what,
                    format!(
                        "object {} is {} bytes in the image but {} in the index",
                        hex::encode(o.digest),
                        o.size,
                        loc.size
                    ),
                ));
            }
            objects.push((o.digest, loc));
        }
        objects.sort_unstable_by_key(|a| a.0);
        Ok(ObjectIndex { objects })
    }
}

/// The manifest of an artifact, as bytes (what is pushed and hashed).
/// `runnable`: the configuration is an OCI image configuration and the
/// blobs have layer media types.
pub fn manifest(
    config: (&Digest, u64),
    image: (&Digest, u64),
    index: (&Digest, u64),
    packs: &[(Digest, u64)],
    fsverity: &str,
    runnable: bool,
) -> Vec<u8> {
    let desc =
        |t: &str, d: &Digest, size: u64| serde_json::json!({"mediaType": t, "digest": d.to_string(), "size": size});
    let [erofs_type, index_type, pack_type] = blob_types(runnable);
    let mut layers = vec![
        {
            let mut d = desc(erofs_type, image.0, image.1);
            d["annotations"] = serde_json::json!({"org.tilefs.fsverity": fsverity});
            d
        },
        desc(index_type, index.0, index.1),
    ];
    layers.extend(packs.iter().map(|(d, s)| desc(pack_type, d, *s)));
    let config_type = if runnable { OCI_CONFIG_TYPE } else { CONFIG_TYPE };
    let m = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": crate::manifest::OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": desc(config_type, config.0, config.1),
        "layers": layers,
    });
    serde_json::to_vec(&m).expect("a manifest serializes")
}

/// A runnable artifact's configuration: `base` (the image configuration
/// of the image it stands for) with `rootfs` listing `blobs` (the
/// artifact's uncompressed blobs: each its own diff ID), no history (which
/// would count other layers), and `config`'s facts among its labels.
pub fn runnable_config(base: &[u8], config: &Config, blobs: &[Digest]) -> Result<Vec<u8>, String> {
    let mut v: serde_json::Value =
        serde_json::from_slice(base).map_err(|e| format!("not an image configuration: {e}"))?;
    let obj = v
        .as_object_mut()
        .filter(|o| o.contains_key("rootfs"))
        .ok_or("not an image configuration (no rootfs)")?;
    obj.remove("history");
    obj.insert(
        "rootfs".into(),
        serde_json::json!({"type": "layers", "diff_ids": blobs.iter().map(|d| d.to_string()).collect::<Vec<_>>()}),
    );
    let run = obj.entry("config").or_insert_with(|| serde_json::json!({}));
    if run.is_null() {
        *run = serde_json::json!({});
    }
    let run = run.as_object_mut().ok_or("its \"config\" is not an object")?;
    let labels = run.entry("Labels").or_insert_with(|| serde_json::json!({}));
    if labels.is_null() {
        *labels = serde_json::json!({});
    }
    let labels = labels.as_object_mut().ok_or("its config.Labels is not an object")?;
    labels.insert(LABEL_FSVERITY.into(), config.fsverity.clone().into());
    labels.insert(LABEL_OBJECTS.into(), config.objects.to_string().into());
    labels.insert(LABEL_OBJECT_BYTES.into(), config.object_bytes.to_string().into());
    Ok(serde_json::to_vec(&v).expect("JSON serializes"))
}

/// What a runnable artifact's configuration says of the image, checked
/// against its `blobs` (each must be its own diff ID).
pub fn parse_runnable_config(raw: &[u8], blobs: &[Digest]) -> Result<Config, String> {
    let v: serde_json::Value = serde_json::from_slice(raw).map_err(|e| format!("not JSON: {e}"))?;
    let diff_ids: Vec<&str> = v
        .pointer("/rootfs/diff_ids")
        .and_then(|d| d.as_array())
        .ok_or("not an image configuration (no rootfs.diff_ids)")?
        .iter()
        .map(|d| d.as_str().unwrap_or(""))
        .collect();
    let want: Vec<String> = blobs.iter().map(|d| d.to_string()).collect();
    if diff_ids != want {
        return Err(format!(
            "its rootfs.diff_ids ({}) are not the artifact's blobs ({})",
            diff_ids.join(", "),
            want.join(", ")
        ));
    }
    let label = |k: &str| {
        v.pointer("/config/Labels")
            .and_then(|l| l.get(k))
            .and_then(|x| x.as_str())
            .ok_or_else(|| format!("label {k} is missing"))
    };
    let number = |k: &str| {
        label(k)?
            .parse::<u64>()
            .map_err(|_| format!("label {k} is not a number"))
    };
    Ok(Config {
        fsverity: label(LABEL_FSVERITY)?.to_string(),
        objects: number(LABEL_OBJECTS)?,
        object_bytes: number(LABEL_OBJECT_BYTES)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(n: u8, size: u64) -> ObjectRef {
        ObjectRef { digest: [n; 32], size }
    }

    #[test]
    fn packs_close_at_the_target_and_index_round_trips() {
        let objs = [obj(1, PACK_TARGET - 10), obj(2, 20), obj(3, 5), obj(4, 0)];
        let (locs, packs) = plan_packs(&objs);
        let packs: Vec<u64> = packs.iter().map(|p| p.size).collect();
        assert_eq!(packs, vec![PACK_TARGET + 10, 5]);
        assert_eq!(
            locs[1],
            Location {
                pack: 0,
                offset: PACK_TARGET - 10,
                size: 20
            }
        );
        assert_eq!(
            locs[2],
            Location {
                pack: 1,
                offset: 0,
                size: 5
            }
        );
        let bytes = encode_index(&objs, &locs);
        let idx = ObjectIndex::parse(&bytes, &packs, "index").unwrap();
        assert_eq!(idx.get(&[3; 32]), Some(locs[2]));
        assert!(idx.clone().restrict_to(&[obj(2, 20)], "i").is_ok());
        assert!(idx.clone().restrict_to(&[obj(2, 21)], "i").is_err());
        assert!(idx.restrict_to(&[obj(9, 1)], "i").is_err());
    }

    #[test]
    fn a_runnable_configuration_keeps_the_image_and_states_the_blobs() {
        let base = br#"{"architecture":"amd64","os":"linux","config":{"Cmd":["/bin/sh"],"Labels":null},
            "rootfs":{"type":"layers","diff_ids":["sha256:aa"]},"history":[{"created_by":"x"}]}"#;
        let cfg = Config {
            fsverity: "ab".repeat(32),
            objects: 3,
            object_bytes: 99,
        };
        let blobs: Vec<Digest> = [b"a".as_slice(), b"b", b"c"]
            .iter()
            .map(|b| Digest::sha256_of(b))
            .collect();
        let raw = runnable_config(base, &cfg, &blobs).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&raw).unwrap();
        assert_eq!(v["config"]["Cmd"][0], "/bin/sh");
        assert!(v.get("history").is_none());
        assert_eq!(parse_runnable_config(&raw, &blobs).unwrap(), cfg);
        let e = parse_runnable_config(&raw, &blobs[..2]).unwrap_err();
        assert!(e.contains("not the artifact's blobs"), "{e}");
        assert!(runnable_config(b"{}", &cfg, &blobs).unwrap_err().contains("no rootfs"));
        let bare = runnable_config(br#"{"config":null,"rootfs":{}}"#, &cfg, &blobs).unwrap();
        assert_eq!(parse_runnable_config(&bare, &blobs).unwrap(), cfg);
    }

    #[test]
    fn lying_indexes_are_refused() {
        let d = hex::encode([7u8; 32]);
        for (json, why) in [
            (format!(r#"{{"version":1,"objects":[["{d}",0,10,5]]}}"#), "outside pack"),
            (format!(r#"{{"version":1,"objects":[["{d}",1,0,1]]}}"#), "1 packs"),
            (
                format!(r#"{{"version":1,"objects":[["{d}",0,18446744073709551615,2]]}}"#),
                "outside pack",
            ),
            (
                format!(r#"{{"version":1,"objects":[["{d}",0,0,1],["{d}",0,1,1]]}}"#),
                "twice",
            ),
            (
                r#"{"version":1,"objects":[["zz",0,0,1]]}"#.to_string(),
                "not an object digest",
            ),
            (r#"{"version":2,"objects":[]}"#.to_string(), "version 2"),
            (r#"{"objects":[]}"#.to_string(), "not a tilefs object index"),
        ] {
            let e = ObjectIndex::parse(json.as_bytes(), &[12], "idx")
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{json}: {e}");
        }
    }
}
