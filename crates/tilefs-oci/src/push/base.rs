//! The packs a push keeps: those of the artifact it replaces (the one the
//! destination's tag names, or another tag given; of format 2 or 3), where the new image
//! still uses most of their bytes. Only the objects left go into new packs
//! ([`artifact::plan_packs`]), so a new version with a few files changed
//! uploads about those files, compressed.
//!
//! A kept pack may hold objects the new image no longer uses: at most a
//! quarter of its bytes ([`KEEP_FROM`]); below that it is left, and its
//! objects the image still uses are packed again.

use crate::artifact::{self, Format, Location, ObjectIndex, ObjectRef};
use crate::digest::Digest;
use crate::manifest::BlobRef;
use crate::transport::registry::Registry;
use crate::OciError;
use std::collections::HashMap;

/// A pack is kept when at least this share of its bytes (numerator,
/// denominator) are objects the new image uses.
const KEEP_FROM: (u64, u64) = (3, 4);

/// The artifact whose packs a push may keep.
pub struct Base {
    /// Its packs' digests and sizes, in its manifest's order.
    packs: Vec<(Digest, u64)>,
    index: ObjectIndex,
}

/// What a push puts where.
pub struct Plan {
    /// Packs kept, in the base's order: the artifact's first packs.
    pub kept: Vec<(Digest, u64)>,
    /// The objects that lie in them, and where (pack numbers among `kept`).
    pub kept_objects: Vec<(ObjectRef, Location)>,
    /// The other objects, in tree order, and the packs they make (runs of
    /// them), which follow the kept ones.
    pub fresh: Vec<ObjectRef>,
    pub fresh_packs: Vec<std::ops::Range<usize>>,
}

/// The artifact tagged `tag` in `registry`'s repository, if it is one of
/// format 2. Anything else there (nothing, an ordinary image, an older
/// artifact) is no base, or an error when the user `named` it.
pub fn read(registry: &Registry, tag: &str, named: bool) -> Result<Option<Base>, OciError> {
    let what = format!("{}:{tag}", registry.repository());
    let none = |why: &str| match named {
        true => Err(OciError::manifest(&what, format!("cannot keep its packs: {why}"))),
        false => Ok(None),
    };
    let Some(raw) = registry.manifest_at(tag)? else {
        return none("no such tag");
    };
    let Ok(m) = serde_json::from_slice::<serde_json::Value>(&raw) else {
        return none("not a JSON manifest");
    };
    let blob = |l: &serde_json::Value| -> Option<BlobRef> {
        Some(BlobRef {
            digest: Digest::parse(l.get("digest")?.as_str()?).ok()?,
            size: Some(l.get("size")?.as_u64()?),
            media_type: l.get("mediaType")?.as_str()?.to_string(),
            member: None,
        })
    };
    let Some(layers) = m
        .get("layers")
        .and_then(|l| l.as_array())
        .and_then(|l| l.iter().map(blob).collect::<Option<Vec<_>>>())
    else {
        return none("not an image manifest");
    };
    let (image_ref, index_ref, packs) = match layers.as_slice() {
        [i, x, p @ ..] => match artifact::format_of(&i.media_type) {
            Some((Format::V2, runnable)) => {
                let [_, index_type, pack_type] = artifact::blob_types(runnable, Format::V2);
                if x.media_type != index_type || p.iter().any(|b| b.media_type != pack_type) {
                    return none("its blobs are not those of a tilefs artifact");
                }
                (i, x, p)
            }
            Some((Format::V3, runnable)) => {
                let opened = crate::artifact_tree::open(registry, &layers, runnable, None, &what)?;
                return Ok(Some(Base {
                    packs: opened
                        .packs
                        .iter()
                        .map(|p| (p.digest.clone(), p.size.unwrap_or(0)))
                        .collect(),
                    index: opened.index,
                }));
            }
            Some((Format::V1, _)) => return none("an artifact of format 1 (uncompressed packs)"),
            None => return none("not a tilefs artifact"),
        },
        _ => return none("not a tilefs artifact"),
    };
    let image = artifact::unzstd(
        &registry.blob_bytes(image_ref, artifact::MAX_IMAGE)?,
        artifact::MAX_IMAGE,
    )
    .map_err(|e| OciError::blob(&image_ref.digest.to_string(), format!("the image: {e}")))?;
    let (tree, _) = tilefs_image::erofs::read_image(&image)
        .map_err(|e| OciError::blob(&image_ref.digest.to_string(), format!("not a composefs image: {e}")))?;
    let objects = artifact::objects_of(&tree);
    drop(tree);
    let sizes: Vec<u64> = packs.iter().map(|p| p.size.unwrap_or(0)).collect();
    let index = ObjectIndex::parse_v2(
        &registry.blob_bytes(index_ref, artifact::MAX_INDEX)?,
        &objects,
        &sizes,
        &format!("object index {} of {what}", index_ref.digest),
    )?;
    Ok(Some(Base {
        packs: packs.iter().map(|p| (p.digest.clone(), p.size.unwrap_or(0))).collect(),
        index,
    }))
}

/// Where `objects` (the image's, in tree order) go: in the packs of `base`
/// that the image uses enough of, else in new packs.
pub fn plan(objects: &[ObjectRef], base: Option<&Base>) -> Plan {
    let placed: Vec<Option<Location>> = objects
        .iter()
        .map(|o| base.and_then(|b| b.index.get(&o.digest)).filter(|l| l.size == o.size))
        .collect();
    let mut used: HashMap<u32, u64> = HashMap::new();
    for l in placed.iter().flatten() {
        *used.entry(l.pack).or_default() += l.stored_len();
    }
    // Old pack number → its number in the new artifact.
    let mut kept_at: HashMap<u32, u32> = HashMap::new();
    let mut kept = Vec::new();
    for (i, (digest, size)) in base.map_or(&[][..], |b| &b.packs[..]).iter().enumerate() {
        let used = used.get(&(i as u32)).copied().unwrap_or(0);
        if used > 0 && used * KEEP_FROM.1 >= size * KEEP_FROM.0 {
            kept_at.insert(i as u32, kept.len() as u32);
            kept.push((digest.clone(), *size));
        }
    }
    let mut kept_objects = Vec::new();
    let mut fresh = Vec::new();
    for (o, l) in objects.iter().zip(placed) {
        match l.and_then(|l| Some((l, *kept_at.get(&l.pack)?))) {
            Some((l, pack)) => kept_objects.push((*o, Location { pack, ..l })),
            None => fresh.push(*o),
        }
    }
    let fresh_packs = artifact::plan_packs(&fresh);
    Plan {
        kept,
        kept_objects,
        fresh,
        fresh_packs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::Stored;

    fn obj(n: u8, size: u64) -> ObjectRef {
        ObjectRef { digest: [n; 32], size }
    }

    #[test]
    fn packs_used_enough_are_kept_and_the_rest_packed_again() {
        let z = |pack, offset, size, n| Location {
            pack,
            offset,
            size,
            stored: Stored::Zstd(n),
        };
        // Pack 0: objects 1 (40 bytes stored) and 2 (60); pack 1: 3 (100).
        let mut objects = vec![
            ([1; 32], z(0, 0, 100, 40)),
            ([2; 32], z(0, 40, 100, 60)),
            ([3; 32], Location::raw(1, 0, 100)),
        ];
        objects.sort_by_key(|o| o.0);
        let base = Base {
            packs: vec![(Digest::sha256_of(b"p0"), 100), (Digest::sha256_of(b"p1"), 100)],
            index: ObjectIndex { objects },
        };
        // Object 2 gone (pack 0 60% unused: left), 3 kept, 9 new, 1 again.
        let image = [obj(9, 10), obj(3, 100), obj(1, 100)];
        let p = plan(&image, Some(&base));
        assert_eq!(p.kept, vec![(Digest::sha256_of(b"p1"), 100)]);
        assert_eq!(p.kept_objects, vec![(obj(3, 100), Location::raw(0, 0, 100))]);
        assert_eq!(p.fresh, vec![obj(9, 10), obj(1, 100)]);
        assert_eq!(p.fresh_packs, vec![0..2]);
        // An object of another size is not the base's.
        let p = plan(&[obj(3, 99)], Some(&base));
        assert!(p.kept.is_empty() && p.fresh.len() == 1);
        // No base: all fresh.
        assert_eq!(plan(&image, None).fresh.len(), 3);
    }
}
