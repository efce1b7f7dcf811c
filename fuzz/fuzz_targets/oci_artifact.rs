//! A tilefs artifact's object index and configuration: any bytes give a
//! checked index (every location inside its pack) or an error, never a
//! panic; an index that parses round-trips through its encoding. A
//! runnable artifact's configuration parses (against its blobs) or is
//! refused; one built from any image configuration parses back to the
//! facts it was given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_oci::artifact::{self, Config, ObjectIndex, ObjectRef};
use tilefs_oci::digest::Digest;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else { return };
    // The first byte chooses the packs' sizes.
    let packs: Vec<u64> = (0..n % 8).map(|i| u64::from(n) << (i * 7)).collect();
    if let Ok(index) = ObjectIndex::parse(rest, &packs, "fuzz") {
        for (d, loc) in &index.objects {
            assert!(loc.offset + loc.size <= packs[loc.pack as usize]);
            assert_eq!(index.get(d), Some(*loc));
        }
        let objects: Vec<ObjectRef> = index.objects.iter().map(|(d, l)| ObjectRef { digest: *d, size: l.size }).collect();
        let locs: Vec<_> = index.objects.iter().map(|(_, l)| *l).collect();
        let again = ObjectIndex::parse(&artifact::encode_index(&objects, &locs), &packs, "fuzz").unwrap();
        assert_eq!(again, index);
        let _ = index.restrict_to(&objects, "fuzz").unwrap();
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
