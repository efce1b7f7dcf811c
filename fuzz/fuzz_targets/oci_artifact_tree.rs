//! A format 3 artifact's tree chunks (`tilefs_oci::artifact_tree`): any
//! bytes give a chunk or an error naming it, never a panic; a chunk that
//! decodes encodes to a blob that decodes to the same chunk. Chunks that
//! decode rebuild an image (which then reads) or are refused, and the
//! places they give the image's files are checked against the packs (each
//! inside its pack, a compressed object smaller than itself) or refused.
//! The first byte chooses the packs' sizes and how the rest is read: with
//! its high bit, as dump text in a chunk whose objects lie in those packs
//! (to reach the rebuild with lines that parse); otherwise as a chunk
//! blob, and as the postcard bytes of one (zstd added: past the decoder).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_oci::artifact::Stored;
use tilefs_oci::artifact_tree::{self, Chunk};
use tilefs_oci::digest::Digest;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else { return };
    let packs: Vec<Digest> = (0..n % 4).map(|i| Digest::sha256_of(&[i])).collect();
    let sizes: Vec<u64> = (0..packs.len()).map(|i| u64::from(n) << (i * 9)).collect();
    let mut chunks = Vec::new();
    if n & 0x80 != 0 {
        chunks.push(Chunk {
            version: artifact_tree::VERSION,
            erofs_version: u32::from(n & 1),
            packs: packs.iter().map(|p| p.to_string()).collect(),
            dump: String::from_utf8_lossy(rest).into_owned(),
            objects: (0..u64::from(n % 16))
                .map(|i| ((i % packs.len().max(1) as u64) as u32, i * 100, i % 3))
                .collect(),
        });
    } else {
        for blob in [rest.to_vec(), zstd::bulk::compress(rest, 1).unwrap()] {
            if let Ok(c) = artifact_tree::decode(&blob, "fuzz") {
                assert_eq!(artifact_tree::decode(&artifact_tree::encode_chunk(&c), "fuzz").unwrap(), c);
                chunks.push(c);
            }
        }
    }
    for c in chunks {
        let Ok(r) = artifact_tree::rebuild(&[c], &["fuzz".into()], &packs, "fuzz", None) else {
            continue;
        };
        let (tree, _) = tilefs_image::erofs::read_image(&r.image).expect("a rebuilt image reads");
        if let Ok(index) = artifact_tree::index_of(&tree, &r.objects, &sizes, "fuzz") {
            for (d, loc) in &index.objects {
                assert!(loc.offset + loc.stored_len() <= sizes[loc.pack as usize]);
                if let Stored::Zstd(s) = loc.stored {
                    assert!(s < loc.size);
                }
                assert_eq!(index.get(d), Some(*loc));
            }
        }
    }
});
