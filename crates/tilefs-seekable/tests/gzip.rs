//! gzip layers indexed in one pass, then read from their checkpoints.

mod common;

use std::io::{BufReader, Read, Write};

use common::{cli, corpus, read, Rng};
use flate2::write::GzEncoder;
use flate2::Compression;
use tilefs_seekable::gzip::GzipIndexer;
use tilefs_seekable::{Codec, Resume, SeekIndex};

fn gz(data: &[u8], level: u32) -> Vec<u8> {
    let mut e = GzEncoder::new(Vec::new(), Compression::new(level));
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// Streams `blob` through the indexer as a pull would (small reads
/// through a BufReader), checks the output, and returns the index.
fn build_index(blob: &[u8], span: u64, expect: &[u8]) -> SeekIndex {
    let mut ix = GzipIndexer::with_span(BufReader::with_capacity(4096, blob), span);
    let mut out = Vec::new();
    let mut buf = vec![0u8; 7000];
    loop {
        let n = ix.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    assert!(out == expect, "the indexer's output differs from the data");
    let index = ix.finish().unwrap();
    assert_eq!(index.codec(), Codec::Gzip);
    assert_eq!(index.compressed_size(), blob.len() as u64);
    assert_eq!(index.uncompressed_size(), expect.len() as u64);
    let decoded = SeekIndex::decode(&index.encode()).unwrap();
    assert_eq!(decoded, index, "the index does not round-trip through its encoding");
    index
}

/// Every checkpoint, reads across checkpoints and random ranges give the
/// data's bytes.
fn check_reads(index: &SeekIndex, blob: &[u8], data: &[u8], seed: u64) {
    let n = data.len() as u64;
    let cps = index.checkpoints();
    for (i, c) in cps.iter().enumerate() {
        let end = (c.uncompressed + 5000).min(n);
        assert_eq!(
            read(index, blob, c.uncompressed, end),
            &data[c.uncompressed as usize..end as usize],
            "checkpoint {i}"
        );
        if c.uncompressed > 0 {
            // Straddling the checkpoint: starts at the one before.
            let a = c.uncompressed - 1;
            let b = (c.uncompressed + 1).min(n);
            assert_eq!(read(index, blob, a, b), &data[a as usize..b as usize]);
        }
    }
    let mut r = Rng(seed | 1);
    for _ in 0..40 {
        let a = r.below(n + 1);
        let b = a + r.below((n - a).min(300_000) + 1);
        assert_eq!(read(index, blob, a, b), &data[a as usize..b as usize], "range {a}..{b}");
    }
    assert_eq!(read(index, blob, 0, n), data);
}

#[test]
fn every_level_indexes_and_reads_back() {
    let data = corpus(1, 3 << 20);
    for level in [0, 1, 2, 6, 9] {
        let blob = gz(&data, level);
        let index = build_index(&blob, 128 << 10, &data);
        check_reads(&index, &blob, &data, level as u64);
        if level == 1 {
            // zlib-rs's fastest level writes the whole stream as one
            // deflate block: nowhere to enter but the start.
            continue;
        }
        assert!(
            index.checkpoints().len() >= 15,
            "level {level}: {} checkpoints",
            index.checkpoints().len()
        );
        assert!(index
            .checkpoints()
            .iter()
            .skip(1)
            .all(|c| matches!(c.resume, Resume::Deflate { .. })));
    }
}

#[test]
fn checkpoints_keep_their_spacing() {
    let data = corpus(2, 2 << 20);
    let blob = gz(&data, 6);
    for span in [1, 1000, 100_000, 1 << 20, 1 << 30] {
        let index = build_index(&blob, span, &data);
        for w in index.checkpoints().windows(2) {
            assert!(w[1].uncompressed - w[0].uncompressed >= span);
            assert!(w[1].compressed > w[0].compressed);
        }
        if span == 1 {
            // Every block boundary: check them all.
            assert!(index.checkpoints().len() > 5, "{}", index.checkpoints().len());
            check_reads(&index, &blob, &data, 3);
        }
        if span == 1 << 30 {
            assert!(!index.is_enterable());
            assert_eq!(index.fetch_range(5..6).unwrap(), 0..blob.len() as u64);
        }
    }
}

#[test]
fn cli_compressors_block_layouts() {
    let data = corpus(3, 3 << 20);
    for (program, args) in [
        ("gzip", &["-c", "-1"][..]),
        ("gzip", &["-c", "-9"]),
        ("gzip", &["-c", "--rsyncable"]),
        ("pigz", &["-c", "-p", "2", "-b", "128"]),
        ("pigz", &["-c", "-i", "-b", "64"]),
    ] {
        let Some(blob) = cli(program, args, &data) else {
            continue;
        };
        let index = build_index(&blob, 100_000, &data);
        assert!(index.is_enterable(), "{program} {args:?}");
        check_reads(&index, &blob, &data, 4);
    }
}

#[test]
fn members_are_checkpoints_without_windows() {
    let data = corpus(4, 1 << 20);
    // Three members, an empty one between them, each a few hundred KiB.
    let parts = [
        &data[..300_000],
        &data[300_000..300_000],
        &data[300_000..700_000],
        &data[700_000..],
    ];
    let mut blob = Vec::new();
    let mut member_at = Vec::new();
    for p in parts {
        member_at.push(blob.len() as u64);
        blob.extend(gz(p, 6));
    }
    // Span larger than any block run inside a member: member starts are
    // the only boundaries due at the right time.
    let index = build_index(&blob, 250_000, &data);
    let streams: Vec<u64> = index
        .checkpoints()
        .iter()
        .filter(|c| c.resume == Resume::Stream)
        .map(|c| c.compressed)
        .collect();
    assert!(streams.len() >= 2, "{streams:?}");
    assert!(
        streams.iter().all(|s| member_at.contains(s)),
        "{streams:?} vs {member_at:?}"
    );
    check_reads(&index, &blob, &data, 5);
}

#[test]
fn broken_streams_are_refused_with_the_reason() {
    let data = corpus(5, 200_000);
    let blob = gz(&data, 6);
    let run = |b: &[u8]| -> String {
        let mut ix = GzipIndexer::new(b);
        let mut sink = Vec::new();
        match ix.read_to_end(&mut sink) {
            Err(e) => {
                // The error stays: a later read says it again.
                assert!(ix.read(&mut [0u8; 10]).is_err());
                e.to_string()
            }
            Ok(_) => ix.finish().map(|_| String::new()).unwrap_or_else(|e| e.to_string()),
        }
    };
    assert!(run(&[]).contains("empty"));
    let e = run(&blob[..blob.len() - 3]);
    assert!(e.contains("ends at byte"), "{e}");
    let e = run(&blob[..blob.len() / 2]);
    assert!(e.contains("ends at byte"), "{e}");
    let mut bad_crc = blob.clone();
    let n = bad_crc.len();
    bad_crc[n - 6] ^= 1;
    let e = run(&bad_crc);
    assert!(e.contains("CRC-32"), "{e}");
    let mut garbage = blob.clone();
    garbage.extend_from_slice(b"garbage!!!");
    let e = run(&garbage);
    assert!(e.contains("no gzip magic"), "{e}");
    let mut zeros = blob.clone();
    zeros.extend_from_slice(&[0; 100]);
    assert!(run(&zeros).contains("no gzip magic"));
    let mut flags = blob.clone();
    flags[3] = 0x80;
    assert!(run(&flags).contains("reserved flags"));
    let mut body = blob.clone();
    body[40] ^= 0xff;
    body[41] ^= 0xff;
    assert!(!run(&body).is_empty(), "a corrupt body must fail");
}

#[test]
fn header_fields_are_read_and_bounded() {
    let data = b"hello, header fields".repeat(100);
    let mut e = flate2::GzBuilder::new()
        .filename("layer.tar")
        .comment("a comment")
        .extra(vec![1, 2, 3, 4])
        .write(Vec::new(), Compression::default());
    e.write_all(&data).unwrap();
    let mut blob = e.finish().unwrap();
    let index = build_index(&blob, 1 << 20, &data);
    check_reads(&index, &blob, &data, 6);
    // A header CRC (FHCRC) over what precedes it.
    let mut with_hcrc = blob[..10].to_vec();
    with_hcrc[3] |= 0x02;
    let rest_start = 10;
    let hdr_end = blob.len() - blob[rest_start..].len() + {
        // extra: 2 + 4, name and comment each NUL-terminated
        6 + "layer.tar".len() + 1 + "a comment".len() + 1
    };
    with_hcrc.extend_from_slice(&blob[rest_start..hdr_end]);
    let crc = crc32fast::hash(&with_hcrc) as u16;
    with_hcrc.extend_from_slice(&crc.to_le_bytes());
    with_hcrc.extend_from_slice(&blob[hdr_end..]);
    index_ok(&with_hcrc, &data);
    let n = with_hcrc.len();
    let mut bad = with_hcrc.clone();
    bad[hdr_end] ^= 1;
    let mut ix = GzipIndexer::new(&bad[..]);
    let e = ix.read_to_end(&mut Vec::new()).unwrap_err().to_string();
    assert!(e.contains("header CRC"), "{e} ({n} bytes)");
    // A file name longer than the bound.
    blob = vec![0x1f, 0x8b, 8, 0x08, 0, 0, 0, 0, 0, 3];
    blob.extend(std::iter::repeat_n(b'a', 70_000));
    blob.push(0);
    let mut ix = GzipIndexer::new(&blob[..]);
    let e = ix.read_to_end(&mut Vec::new()).unwrap_err().to_string();
    assert!(e.contains("longer than"), "{e}");
}

fn index_ok(blob: &[u8], data: &[u8]) {
    build_index(blob, 1 << 20, data);
}

#[test]
fn reads_refuse_short_fetches_and_bad_ranges() {
    let data = corpus(6, 1 << 20);
    let blob = gz(&data, 6);
    let index = build_index(&blob, 64 << 10, &data);
    let (a, b) = (500_000, 600_000);
    let f = index.fetch_range(a..b).unwrap();
    let mut out = vec![0u8; (b - a) as usize];
    let short = &blob[f.start as usize..f.start as usize + 100];
    let e = index.read_at(a..b, short, &mut out).unwrap_err().to_string();
    assert!(e.contains("ends at"), "{e}");
    assert!(index.fetch_range(10..(data.len() as u64 + 1)).is_err());
    assert!(index.read_at(10..20, &blob, &mut [0u8; 5]).is_err());
    assert!(index
        .read_at(std::ops::Range { start: 20, end: 10 }, &blob, &mut [])
        .is_err());
    index.read_at(7..7, &[], &mut []).unwrap();
}

/// What a lazy mount does with an ordinary layer: each file of the tar
/// read on its own, from where the tar stream holds it.
#[test]
fn every_file_of_a_tar_layer_reads_back_alone() {
    let mut b = tar::Builder::new(Vec::new());
    let mut files = Vec::new();
    let mut r = Rng(9);
    for i in 0..150u64 {
        let len = match i % 5 {
            0 => 0,
            1 => r.below(100) as usize,
            2 => r.below(20_000) as usize,
            3 => r.below(200_000) as usize,
            _ => 1 + r.below(1 << 20) as usize,
        };
        let data = corpus(1000 + i, len);
        let mut h = tar::Header::new_ustar();
        h.set_size(len as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, format!("dir/file-{i}"), &data[..]).unwrap();
        files.push(data);
    }
    let tar = b.into_inner().unwrap();
    let Some(blob) = cli("gzip", &["-c", "-6", "-n"], &tar) else {
        return;
    };
    let index = build_index(&blob, 256 << 10, &tar);
    let mut archive = tar::Archive::new(&tar[..]);
    for (i, entry) in archive.entries().unwrap().enumerate() {
        let entry = entry.unwrap();
        let (at, len) = (entry.raw_file_position(), entry.size());
        assert_eq!(read(&index, &blob, at, at + len), files[i], "file {i}");
    }
}
