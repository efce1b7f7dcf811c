//! zstd layers indexed in one pass at frame starts, then read from them.

mod common;

use std::io::{BufReader, Read};

use common::{cli, corpus, read, Rng};
use tilefs_seekable::zstd::ZstdIndexer;
use tilefs_seekable::{Codec, Resume, SeekIndex};

fn build_index(blob: &[u8], span: u64, expect: &[u8]) -> SeekIndex {
    let mut ix = ZstdIndexer::with_span(BufReader::with_capacity(3000, blob), span).unwrap();
    let mut out = Vec::new();
    ix.read_to_end(&mut out).unwrap();
    assert!(out == expect, "the indexer's output differs from the data");
    let index = ix.finish().unwrap();
    assert_eq!(index.codec(), Codec::Zstd);
    assert_eq!(index.compressed_size(), blob.len() as u64);
    assert_eq!(index.uncompressed_size(), expect.len() as u64);
    assert!(index.checkpoints().iter().all(|c| c.resume == Resume::Stream));
    assert_eq!(SeekIndex::decode(&index.encode()).unwrap(), index);
    index
}

fn check_reads(index: &SeekIndex, blob: &[u8], data: &[u8]) {
    let n = data.len() as u64;
    for c in index.checkpoints() {
        let end = (c.uncompressed + 3000).min(n);
        assert_eq!(
            read(index, blob, c.uncompressed, end),
            &data[c.uncompressed as usize..end as usize]
        );
    }
    let mut r = Rng(7);
    for _ in 0..40 {
        let a = r.below(n + 1);
        let b = a + r.below((n - a).min(200_000) + 1);
        assert_eq!(read(index, blob, a, b), &data[a as usize..b as usize], "range {a}..{b}");
    }
}

fn skippable(magic_low: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0x50 | (magic_low & 0xf), 0x2a, 0x4d, 0x18];
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

#[test]
fn one_frame_cannot_be_entered() {
    let data = corpus(10, 2 << 20);
    let blob = zstd::encode_all(&data[..], 3).unwrap();
    let index = build_index(&blob, 1, &data);
    assert!(!index.is_enterable());
    assert_eq!(index.checkpoints().len(), 1);
    assert_eq!(
        index.fetch_range(1 << 20..(1 << 20) + 10).unwrap(),
        0..blob.len() as u64
    );
    check_reads(&index, &blob, &data);
}

#[test]
fn frames_and_skippable_frames() {
    let data = corpus(11, 3 << 20);
    let mut blob = skippable(0, b"leading metadata");
    let mut starts = Vec::new();
    let mut at = 0;
    let mut r = Rng(3);
    while at < data.len() {
        let n = (50_000 + r.below(400_000) as usize).min(data.len() - at);
        starts.push((blob.len() as u64, at as u64));
        blob.extend(zstd::encode_all(&data[at..at + n], 1 + r.below(9) as i32).unwrap());
        if r.below(3) == 0 {
            blob.extend(skippable(r.next() as u8, &vec![7u8; r.below(100) as usize]));
        }
        if r.below(4) == 0 {
            // An empty frame: no output, so no checkpoint of its own.
            blob.extend(zstd::encode_all(&[][..], 3).unwrap());
        }
        at += n;
    }
    blob.extend(skippable(0xf, b"trailing"));
    for span in [1, 300_000] {
        let index = build_index(&blob, span, &data);
        assert!(index.is_enterable());
        for c in &index.checkpoints()[1..] {
            // Each checkpoint is a data frame's start or a skippable or
            // empty frame right before one, at the same uncompressed offset.
            assert!(starts.iter().any(|&(_, u)| u == c.uncompressed), "{c:?}");
            assert!(c.uncompressed < data.len() as u64);
        }
        if span == 1 {
            assert_eq!(index.checkpoints().len(), starts.len());
        }
        check_reads(&index, &blob, &data);
    }
}

#[test]
fn pzstd_frames_with_their_skippable_headers() {
    let data = corpus(12, 6 << 20);
    let Some(blob) = cli("pzstd", &["-c", "-p", "2", "-1", "-q"], &data) else {
        return;
    };
    let index = build_index(&blob, 1, &data);
    assert!(index.is_enterable(), "pzstd -1 writes a frame per 2 MiB");
    check_reads(&index, &blob, &data);
    let Some(blob) = cli("zstd", &["-c", "-q", "-T2"], &data) else {
        return;
    };
    let single = build_index(&blob, 1, &data);
    check_reads(&single, &blob, &data);
}

#[test]
fn broken_streams_are_refused() {
    let data = corpus(13, 300_000);
    let mut e = zstd::Encoder::new(Vec::new(), 3).unwrap();
    e.include_checksum(true).unwrap();
    std::io::Write::write_all(&mut e, &data).unwrap();
    let blob = e.finish().unwrap();
    let run = |b: &[u8]| -> String {
        let mut ix = ZstdIndexer::new(b).unwrap();
        match ix.read_to_end(&mut Vec::new()) {
            Err(e) => {
                assert!(ix.read(&mut [0u8; 10]).is_err());
                e.to_string()
            }
            Ok(_) => ix.finish().map(|_| String::new()).unwrap_or_else(|e| e.to_string()),
        }
    };
    assert!(run(&[]).contains("empty"));
    assert!(run(&blob[..blob.len() - 5]).contains("ends at byte"));
    let mut garbage = blob.clone();
    garbage.extend_from_slice(b"garbage!");
    assert!(run(&garbage).contains("invalid zstd data"));
    let mut bad = blob.clone();
    let n = bad.len();
    bad[n / 2] ^= 0x55;
    bad[n / 2 + 1] ^= 0x55;
    assert!(!run(&bad).is_empty());
}
