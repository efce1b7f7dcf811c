//! An eStargz or zstd:chunked table of contents made into the image a lazy
//! pull writes (`tilefs_oci::toc_lazy`): any JSON that parses as a table
//! gives layer entries or an error, never a panic, and entries given are
//! applied (over themselves too, as a later layer would be) into an image
//! the writer accepts or an error naming the layer.
//!
//! Input: as `seekable_toc`'s: the first byte chooses the format (low bit)
//! and where the table starts; the rest is the JSON.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_oci::apply::Applier;
use tilefs_oci::toc_lazy::entries_of;
use tilefs_seekable::toc::{estargz, zstd_chunked};

fuzz_target!(|data: &[u8]| {
    let Some((&first, json)) = data.split_first() else {
        return;
    };
    let at = 8 + (1u64 << (first >> 1).min(62));
    let toc = if first & 1 == 0 {
        estargz::parse_json(json, at)
    } else {
        let position = zstd_chunked::Position {
            offset: at,
            compressed_len: 1,
            uncompressed_len: json.len() as u64,
        };
        zstd_chunked::parse_json(json, &position)
    };
    let Ok(toc) = toc else { return };
    let Ok(entries) = entries_of(&toc) else { return };
    let mut applier = Applier::new(true);
    for _ in 0..2 {
        if applier.apply_layer("fuzz", entries.clone()).is_err() {
            return;
        }
    }
    let _ = tilefs_oci::compat::write_image(applier);
});
