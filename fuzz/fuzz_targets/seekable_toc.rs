//! Tables of contents (eStargz and zstd:chunked JSON) into
//! tilefs-seekable's model: any bytes give a table or an error, never a
//! panic; a table that parses keeps the model's promises (clean paths,
//! chunks back to back over each file, ranges before the table, hardlinks
//! to earlier entries that are not directories).
//!
//! Input: the first byte chooses the format (low bit) and where the table
//! starts (the rest: 2^(b>>1) bytes into the blob); the rest is the JSON.
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use tilefs_seekable::toc::{estargz, zstd_chunked, Kind};

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
    let payload_end = if first & 1 == 0 { at } else { at - 8 };
    let mut seen: HashMap<&str, &Kind> = HashMap::new();
    for e in &toc.entries {
        assert!(!e.path.starts_with('/') && !e.path.ends_with('/'), "{:?}", e.path);
        assert!(
            e.path.split('/').all(|n| !matches!(n, "" | "." | "..")) || e.path.is_empty(),
            "{:?}",
            e.path
        );
        assert!(e.mode <= 0o7777);
        match &e.kind {
            Kind::File(f) => {
                let mut next = 0;
                for c in &f.chunks {
                    assert_eq!(c.offset, next);
                    assert!(c.size > 0);
                    assert!(c.compressed.start < c.compressed.end && c.compressed.end <= payload_end);
                    next += c.size;
                }
                assert_eq!(next, f.size);
            }
            Kind::Hardlink { target } => {
                let t = seen.get(target.as_str()).expect("hardlink to an earlier entry");
                assert!(!matches!(t, Kind::Dir | Kind::Hardlink { .. }));
            }
            _ => {}
        }
        assert!(seen.insert(&e.path, &e.kind).is_none(), "a path twice");
    }
});
