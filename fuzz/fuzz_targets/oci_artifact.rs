//! A tilefs artifact's object index and configuration: any bytes give a
//! checked index (every location inside its pack) or an error, never a
//! panic; an index that parses round-trips through its encoding.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_oci::artifact::{self, Config, ObjectIndex, ObjectRef};

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
});
