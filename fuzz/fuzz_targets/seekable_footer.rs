//! The small parsers of tilefs-seekable's tables of contents: eStargz
//! footers (current and legacy), the table's gzip member and tar header,
//! zstd:chunked footers and position annotations. Any bytes give a value
//! or an error, never a panic; what parses points inside the blob.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_seekable::toc::{estargz, zstd_chunked};

fuzz_target!(|data: &[u8]| {
    // The input is the end of a blob of len + 1000 bytes.
    let size = data.len() as u64 + 1000;
    let tail = &data[data.len().saturating_sub(51)..];
    if tail.len() == 51 {
        if let Ok(f) = estargz::parse_footer(tail, size) {
            let r = f.toc_range(size);
            assert!(r.start < r.end && r.end <= size);
        }
    }
    if let Ok(r) = zstd_chunked::footer_range(size) {
        let n = (r.end - r.start) as usize;
        if data.len() >= n {
            if let Ok(f) = zstd_chunked::parse_footer(&data[data.len() - n..], size) {
                assert!(f.manifest.range().end <= size);
            }
        }
    }
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(p) = zstd_chunked::parse_manifest_position(s, size) {
            assert!(p.range().end <= size);
        }
        let _ = zstd_chunked::parse_tar_split_position(s, size);
    }
    let _ = estargz::toc_json(data, 0);
});
