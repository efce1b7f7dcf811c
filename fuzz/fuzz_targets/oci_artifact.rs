//! A tilefs artifact's object index (format 1, JSON; format 2, zstd of
//! postcard), its zstd blobs and frames, and its configuration: any bytes
//! give a checked index (every location inside its pack, a compressed
//! object smaller than itself) or an error, never a panic; an index that
//! parses round-trips through its encoding. A frame decodes to at most the
//! object's size, whatever it declares, or fails. A runnable artifact's
//! configuration parses (against its blobs) or is refused; one built from
//! any image configuration parses back to the facts it was given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::io::Read;
use tilefs_oci::artifact::{self, Config, Location, ObjectIndex, ObjectRef, Stored};
use tilefs_oci::digest::Digest;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else { return };
    // The first byte chooses the packs' sizes, and the image's objects.
    let packs: Vec<u64> = (0..n % 8).map(|i| u64::from(n) << (i * 7)).collect();
    let inside = |index: &ObjectIndex| {
        for (d, loc) in &index.objects {
            assert!(loc.offset + loc.stored_len() <= packs[loc.pack as usize]);
            if let Stored::Zstd(s) = loc.stored {
                assert!(s < loc.size);
            }
            assert_eq!(index.get(d), Some(*loc));
        }
    };
    if let Ok(index) = ObjectIndex::parse_v1(rest, &packs, "fuzz") {
        inside(&index);
        let objects: Vec<ObjectRef> = index.objects.iter().map(|(d, l)| ObjectRef { digest: *d, size: l.size }).collect();
        let _ = index.restrict_to(&objects, "fuzz").unwrap();
    }
    let objects: Vec<ObjectRef> = (0..n % 5)
        .map(|i| ObjectRef {
            digest: {
                let mut d = [n; 32];
                d[0] = i;
                d
            },
            size: u64::from(n) * (u64::from(i) + 1),
        })
        .collect();
    if let Ok(index) = ObjectIndex::parse_v2(rest, &objects, &packs, "fuzz") {
        inside(&index);
        let locs: Vec<Location> = objects.iter().map(|o| index.get(&o.digest).unwrap()).collect();
        let again = ObjectIndex::parse_v2(&artifact::encode_index(&objects, &locs), &objects, &packs, "fuzz").unwrap();
        assert_eq!(again, index);
    }
    // A pack's frame for an object of the size the first byte gives.
    let loc = Location {
        pack: 0,
        offset: 0,
        size: u64::from(n) << 8,
        stored: Stored::Zstd(rest.len() as u64),
    };
    if let Ok(r) = artifact::unpack(rest, &loc) {
        let mut out = Vec::new();
        let _ = r.take(loc.size + 1).read_to_end(&mut out);
        assert!(out.len() as u64 <= loc.size + 1);
    }
    if let Ok(image) = artifact::unzstd(rest, 1 << 20) {
        assert!(image.len() <= 1 << 20);
    }
    let _ = serde_json::from_slice::<Config>(rest);
    let blobs: Vec<Digest> = (0..n % 4).map(|i| Digest::sha256_of(&[i])).collect();
    let _ = artifact::parse_runnable_config(rest, &blobs);
    let facts = Config {
        fsverity: "ab".repeat(32),
        objects: u64::from(n),
        object_bytes: u64::from(n) << 20,
    };
    if let Ok(raw) = artifact::runnable_config(rest, &facts, &blobs) {
        assert_eq!(artifact::parse_runnable_config(&raw, &blobs).unwrap(), facts);
    }
});
