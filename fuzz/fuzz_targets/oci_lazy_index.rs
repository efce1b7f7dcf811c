//! What `tilefs pull --lazy` reads of an ordinary image's index: a layer
//! map (zstd of postcard; the input's first 8 bytes give the layer's size,
//! the 9th picks the parser) decodes to a checked map or an error, never a
//! panic, and one that decodes encodes back to the same map; a referrers
//! list (from the API or a fallback tag) parses or is refused, and adding
//! an entry to one keeps every entry it had.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_oci::lazy_index::{IndexConfig, LayerMap};
use tilefs_oci::layer::{Content, Kind, Placement};
use tilefs_oci::referrers;

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let size = u64::from_le_bytes(data[..8].try_into().unwrap());
    let rest = &data[9..];
    match data[8] % 3 {
        0 => {
            let Ok(map) = LayerMap::decode(rest, size) else { return };
            let stream = map.seek.as_ref().map_or(size, |s| s.uncompressed_size());
            for (e, p) in map.entries.iter().zip(&map.placements) {
                if let (Kind::File { size, content: Content::Object(_) }, Placement::At(off)) = (&e.kind, p) {
                    assert!(off + size <= stream);
                }
            }
            let again = LayerMap::decode(&map.encode(), size).unwrap();
            assert_eq!((again.entries, again.placements, again.seek), (map.entries, map.placements, map.seek));
        }
        1 => {
            let Ok(list) = referrers::parse_list(rest, &["application/x.t"]) else { return };
            let entry = serde_json::json!({
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": format!("sha256:{}", "0".repeat(64)), "size": 1, "artifactType": "application/x.t",
            });
            if let Ok(added) = referrers::add_to_list(Some(rest), entry) {
                let now = referrers::parse_list(&added, &["application/x.t"]).unwrap();
                assert!(list.iter().filter(|r| r.digest.hex() != "0".repeat(64)).all(|r| now.contains(r)));
                assert_eq!(now.last().unwrap().digest.hex(), "0".repeat(64));
            }
        }
        _ => {
            let _ = serde_json::from_slice::<IndexConfig>(rest);
        }
    }
});
