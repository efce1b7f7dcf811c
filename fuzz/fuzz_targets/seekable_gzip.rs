//! gzip streams through tilefs-seekable's indexer: any bytes give the
//! decompressed stream and an index, or an error; never a panic. When the
//! indexer accepts a stream, flate2 (zlib-rs) decodes it to the same
//! bytes, and every checkpoint reads back what the stream had there.
//!
//! Input: the first byte chooses the span (1 to 2^16 bytes, in powers of
//! two), the rest is the stream. Output is capped at 8 MiB.
#![no_main]

use std::io::Read;

use libfuzzer_sys::fuzz_target;
use tilefs_seekable::gzip::GzipIndexer;
use tilefs_seekable::SeekIndex;

const CAP: u64 = 8 << 20;

fuzz_target!(|data: &[u8]| {
    let Some((&first, blob)) = data.split_first() else {
        return;
    };
    let span = 1u64 << (first % 17);
    let mut ix = GzipIndexer::with_span(blob, span);
    let mut out = Vec::new();
    if (&mut ix).take(CAP).read_to_end(&mut out).is_err() {
        return;
    }
    if out.len() as u64 == CAP {
        return;
    }
    let Ok(index) = ix.finish() else { return };
    let mut theirs = Vec::new();
    flate2::read::MultiGzDecoder::new(blob)
        .take(CAP + 1)
        .read_to_end(&mut theirs)
        .unwrap_or_else(|e| {
            panic!("flate2 refuses a stream the indexer accepts: {e}");
        });
    assert!(theirs == out, "flate2 decodes the stream differently");
    assert_eq!(index.uncompressed_size(), out.len() as u64);
    assert_eq!(SeekIndex::decode(&index.encode()).unwrap(), index);
    for c in index.checkpoints() {
        let a = c.uncompressed;
        let b = (a + 1000).min(out.len() as u64);
        let f = index.fetch_range(a..b).unwrap();
        let mut got = vec![0u8; (b - a) as usize];
        index
            .read_at(a..b, &blob[f.start as usize..f.end as usize], &mut got)
            .unwrap();
        assert!(
            got == out[a as usize..b as usize],
            "checkpoint at {a} reads other bytes"
        );
    }
});
