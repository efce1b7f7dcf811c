//! What the decoders refuse: serialized indexes that break a rule of the
//! format, and tables of contents that break the model's.

mod common;

use std::io::Write;

use tilefs_seekable::gzip::GzipIndexer;
use tilefs_seekable::toc::{estargz, zstd_chunked, Kind, Toc, MAX_ENTRIES};
use tilefs_seekable::{Digest, Error, SeekIndex};

fn real_index() -> Vec<u8> {
    let data = common::corpus(30, 1 << 20);
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
    e.write_all(&data).unwrap();
    let blob = e.finish().unwrap();
    let mut ix = GzipIndexer::with_span(&blob[..], 20_000);
    std::io::copy(&mut ix, &mut std::io::sink()).unwrap();
    let index = ix.finish().unwrap();
    assert!(index.checkpoints().len() >= 3);
    index.encode()
}

fn refused(bytes: &[u8], why: &str) {
    match SeekIndex::decode(bytes) {
        Err(Error::Index(msg)) => assert!(msg.contains(why), "{msg:?} does not say {why:?}"),
        other => panic!("{why}: {other:?}"),
    }
}

#[test]
fn index_rules() {
    let good = real_index();
    SeekIndex::decode(&good).unwrap();
    let with = |at: usize, bytes: &[u8]| {
        let mut b = good.clone();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        b
    };
    // Header: magic, version, codec, reserved, span, count.
    refused(&with(0, b"X"), "bad magic");
    refused(&with(8, &[2, 0]), "version 2");
    refused(&with(10, &[3]), "unknown codec");
    refused(&with(11, &[1]), "reserved");
    refused(&with(12, &[0, 0, 0, 0]), "no checkpoint");
    refused(&with(12, &[0xff, 0xff, 0xff, 0x0f]), "do not fit");
    refused(&with(32, &[0; 8]), "span is zero");
    // Checkpoint 0 must be the stream's start; 1 and on are deflate blocks.
    let cp = |i: usize| 40 + 28 * i;
    refused(&with(cp(0), &[1]), "first checkpoint");
    refused(&with(cp(0) + 24, &[1]), "first checkpoint");
    refused(&with(cp(0) + 25, &[1]), "a stream start with bits or a window");
    refused(&with(cp(1) + 25, &[8]), "leftover bits");
    refused(&with(cp(1) + 25, &[0, 1]), "leftover bits");
    refused(&with(cp(1) + 16, &[1, 0x80, 0, 0]), "window of");
    refused(&with(cp(1) + 24, &[2]), "kind 2");
    refused(&with(cp(1) + 27, &[1]), "reserved byte");
    // Offsets: growing by a span, within the stream.
    refused(&with(cp(1), &[0; 8]), "not a span");
    refused(
        &with(cp(1) + 8, &[1, 0, 0, 0, 0, 0, 0, 0]),
        "window of 32768 bytes before uncompressed offset 1",
    );
    refused(&with(16, &[1, 0, 0, 0, 0, 0, 0, 0]), "past the stream");
    refused(&with(cp(1) + 8, &[0, 0, 0, 0, 0, 0, 0, 0x10]), "past the stream");
    // The windows area: exactly as long as the table says.
    let mut longer = good.clone();
    longer.push(0);
    refused(&longer, "after the last window");
    refused(&good[..good.len() - 1], "inside a field");
    refused(&good[..30], "inside a field");
    // A zstd index has no deflate checkpoints.
    refused(&with(10, &[2]), "kind 1 in a Zstd index");
    // A window that decodes to another size is caught when it is used.
    let mut index = SeekIndex::decode(&with(cp(1) + 16, &[1, 0, 0, 0])).unwrap_or_else(|e| panic!("{e}"));
    let a = index.checkpoints()[1].uncompressed;
    let mut out = vec![0u8; 10];
    let e = index.read_at(a..a + 10, &[0; 100], &mut out).unwrap_err();
    assert!(e.to_string().contains("window"), "{e}");
    index = SeekIndex::decode(&good).unwrap();
    assert!(index.is_enterable());
}

const D: &str = "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";

fn estargz(entries: &str) -> Result<Toc, Error> {
    estargz::parse_json(
        format!(r#"{{"version":1,"entries":[{entries}]}}"#).as_bytes(),
        1_000_000,
    )
}

fn zchunked(entries: &str) -> Result<Toc, Error> {
    let p = zstd_chunked::Position {
        offset: 1_000_008,
        compressed_len: 10,
        uncompressed_len: 10,
    };
    zstd_chunked::parse_json(format!(r#"{{"version":1,"entries":[{entries}]}}"#).as_bytes(), &p)
}

fn says(r: Result<Toc, Error>, why: &str) {
    match r {
        Err(e) => assert!(e.to_string().contains(why), "{e} does not say {why:?}"),
        Ok(t) => panic!("accepted ({why}): {t:?}"),
    }
}

fn file(name: &str, size: u64, offset: u64) -> String {
    format!(r#"{{"name":"{name}","type":"reg","size":{size},"offset":{offset},"chunkDigest":"{D}"}}"#)
}

#[test]
fn estargz_tables() {
    let t = estargz(
        &[
            r#"{"name":"./","type":"dir","mode":493}"#.to_string(),
            r#"{"name":"a/","type":"dir","mode":16877,"modtime":"2020-01-02T03:04:05Z","xattrs":{"user.x":"aGk="}}"#
                .into(),
            file("a/f", 5, 100),
            // Two chunks of one file sharing a member with the next file.
            format!(r#"{{"name":"a/g","type":"reg","size":10,"offset":200,"chunkSize":4,"chunkDigest":"{D}"}}"#),
            format!(
                r#"{{"name":"a/g","type":"chunk","offset":200,"innerOffset":600,"chunkOffset":4,"chunkDigest":"{D}"}}"#
            ),
            format!(r#"{{"name":"a/h","type":"reg","size":3,"offset":200,"innerOffset":1200,"chunkDigest":"{D}"}}"#),
            r#"{"name":"a/l","type":"hardlink","linkName":"a/f"}"#.into(),
            r#"{"name":"a/l2","type":"hardlink","linkName":"./a/l"}"#.into(),
            r#"{"name":"a/s","type":"symlink","linkName":"/x/../y"}"#.into(),
            r#"{"name":"a/c","type":"char","devMajor":1,"devMinor":5}"#.into(),
        ]
        .join(","),
    )
    .unwrap();
    let paths: Vec<&str> = t.entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["", "a", "a/f", "a/g", "a/h", "a/l", "a/l2", "a/s", "a/c"]);
    assert_eq!(t.entries[1].mode, 0o755, "type bits in the mode are dropped");
    assert_eq!(t.entries[1].xattrs, vec![("user.x".to_string(), b"hi".to_vec())]);
    assert_eq!(t.entries[1].mtime.unwrap().secs, 1577934245);
    let Kind::File(f) = &t.entries[2].kind else { panic!() };
    assert_eq!((f.chunks[0].compressed.clone(), f.chunks[0].size), (100..200, 5));
    let Kind::File(g) = &t.entries[3].kind else { panic!() };
    let spans: Vec<_> = g
        .chunks
        .iter()
        .map(|c| (c.offset, c.size, c.compressed.clone(), c.skip))
        .collect();
    assert_eq!(spans, [(0, 4, 200..1_000_000, 0), (4, 6, 200..1_000_000, 600)]);
    assert_eq!(
        t.entries[6].kind,
        Kind::Hardlink { target: "a/f".into() },
        "a link to a link is resolved"
    );

    says(estargz(r#"{"name":"a","type":"dir","colour":"red"}"#), "unknown field");
    says(estargz::parse_json(br#"{"version":2,"entries":[]}"#, 10), "version 2");
    assert!(estargz::parse_json(br#"{"version":1,"entries":null}"#, 10)
        .unwrap()
        .entries
        .is_empty());
    says(estargz(r#"{"name":"../x","type":"dir"}"#), "escapes the root");
    says(estargz(r#"{"name":"/x","type":"dir"}"#), "absolute");
    says(
        estargz(r#"{"name":"x","type":"dir"},{"name":"x/","type":"dir"}"#),
        "listed twice",
    );
    says(estargz(r#"{"name":"x","type":"socket"}"#), "unknown type");
    says(
        estargz(r#"{"name":"./","type":"symlink","linkName":"x"}"#),
        "the root as a symlink",
    );
    says(
        estargz(&format!(
            r#"{{"name":"x","type":"chunk","offset":5,"chunkDigest":"{D}"}}"#
        )),
        "follows no regular file",
    );
    let f10 = format!(r#"{{"name":"a","type":"reg","size":10,"offset":100,"chunkSize":4,"chunkDigest":"{D}"}}"#);
    says(
        estargz(&format!(
            r#"{f10},{{"name":"b","type":"chunk","offset":200,"chunkOffset":4,"chunkDigest":"{D}"}}"#
        )),
        "another file",
    );
    says(
        estargz(&format!(
            r#"{f10},{{"name":"a","type":"chunk","offset":200,"chunkOffset":5,"chunkDigest":"{D}"}}"#
        )),
        "does not continue",
    );
    says(estargz(&f10), "cover 4 of 10");
    says(
        estargz(r#"{"name":"a","type":"reg","size":10,"offset":100}"#),
        "without a digest",
    );
    says(
        estargz(r#"{"name":"a","type":"reg","size":10,"offset":9,"chunkDigest":"sha256:00"}"#),
        "64 lowercase hex",
    );
    says(estargz(&file("a", 10, 0)), "without an offset");
    says(estargz(&file("a", 10, 1_000_000)), "not before the table");
    says(
        estargz(&[file("a", 1, 500), file("b", 1, 400)].join(",")),
        "is not before the next",
    );
    says(
        estargz(r#"{"name":"l","type":"hardlink","linkName":"nowhere"}"#),
        "not an earlier entry",
    );
    says(
        estargz(r#"{"name":"d","type":"dir"},{"name":"l","type":"hardlink","linkName":"d"}"#),
        "to a directory",
    );
    says(estargz(r#"{"name":"s","type":"symlink"}"#), "symlink target of 0 bytes");
    says(estargz(r#"{"name":"d","type":"dir","uid":-1}"#), "uid -1 out of range");
    says(
        estargz(r#"{"name":"d","type":"dir","gid":4294967296}"#),
        "gid 4294967296 out of range",
    );
    says(estargz(r#"{"name":"d","type":"dir","size":3}"#), "a dir with a size");
    says(
        estargz(r#"{"name":"d","type":"dir","linkName":"x"}"#),
        "with a link name",
    );
    says(estargz(r#"{"name":"d","type":"fifo","devMajor":1}"#), "device numbers");
    says(
        estargz(r#"{"name":"d","type":"dir","modtime":"yesterday"}"#),
        "RFC 3339",
    );
    says(
        estargz(r#"{"name":"d","type":"dir","xattrs":{"user.a":"!!"}}"#),
        "extended attribute",
    );
    says(
        estargz(r#"{"name":"d","type":"dir","xattrs":{"user.a":"","user.a":""}}"#),
        "twice",
    );
    says(
        estargz(r#"{"name":"d","type":"dir","endOffset":5}"#),
        "endOffset is not of this format",
    );
    says(estargz(r#"{"name":"d","type":"dir","mode":1.5}"#), "invalid type");
}

#[test]
fn zstd_chunked_tables() {
    let t = zchunked(&[
        format!(r#"{{"type":"reg","name":"one","size":7,"offset":50,"endOffset":90,"digest":"{D}"}}"#),
        format!(r#"{{"type":"reg","name":"big","size":9,"offset":100,"endOffset":400,"digest":"{D}","chunkSize":4,"chunkDigest":"{D}"}}"#),
        format!(r#"{{"type":"chunk","name":"big","offset":200,"chunkSize":3,"chunkOffset":4,"chunkDigest":"{D}","chunkType":"zeros"}}"#),
        format!(r#"{{"type":"chunk","name":"big","offset":300,"chunkSize":2,"chunkOffset":7,"chunkDigest":"{D}"}}"#),
    ]
    .join(","))
    .unwrap();
    let Kind::File(one) = &t.entries[0].kind else { panic!() };
    assert_eq!(one.chunks[0].compressed, 50..90);
    let Kind::File(big) = &t.entries[1].kind else { panic!() };
    let spans: Vec<_> = big.chunks.iter().map(|c| (c.compressed.clone(), c.zeros)).collect();
    assert_eq!(spans, [(100..200, false), (200..300, true), (300..400, false)]);

    says(
        zchunked(r#"{"type":"reg","name":"a","size":7,"offset":50,"digest":"x"}"#),
        "not a sha256 digest",
    );
    says(
        zchunked(&format!(
            r#"{{"type":"reg","name":"a","size":7,"offset":50,"digest":"{D}"}}"#
        )),
        "not a range before",
    );
    says(
        zchunked(&format!(
            r#"{{"type":"reg","name":"a","size":7,"offset":50,"endOffset":1000001,"digest":"{D}"}}"#
        )),
        "not a range before",
    );
    says(
        zchunked(&format!(
            r#"{{"type":"reg","name":"a","size":7,"offset":50,"endOffset":60,"digest":"{D}","chunkType":"holes"}}"#
        )),
        "unknown chunkType",
    );
    says(
        zchunked(r#"{"type":"dir","name":"a","innerOffset":3}"#),
        "innerOffset is not of this format",
    );
    says(
        zstd_chunked::parse_json(
            br#"{"version":1,"entries":[],"tarSplitDigest":"sha256:0"}"#,
            &zstd_chunked::Position {
                offset: 8,
                compressed_len: 1,
                uncompressed_len: 1,
            },
        ),
        "64 lowercase hex",
    );
}

#[test]
fn too_many_entries_are_refused_while_read() {
    let mut json = String::from(r#"{"version":1,"entries":["#);
    for i in 0..=MAX_ENTRIES {
        if i > 0 {
            json.push(',');
        }
        json.push_str(r#"{"name":"d","type":"dir"}"#);
    }
    json.push_str("]}");
    says(estargz::parse_json(json.as_bytes(), 10), "more than");
}

#[test]
fn footers_and_positions() {
    // A footer made by hand from the format's facts.
    let mut f = vec![0x1f, 0x8b, 8, 4, 0, 0, 0, 0, 0, 0xff, 26, 0, b'S', b'G', 22, 0];
    f.extend_from_slice(format!("{:016x}STARGZ", 12345).as_bytes());
    f.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    f.extend_from_slice(&[0; 8]);
    assert_eq!(f.len(), 51);
    let footer = estargz::parse_footer(&f, 100_000).unwrap();
    assert_eq!((footer.toc_offset, footer.size), (12345, 51));
    assert_eq!(footer.toc_range(100_000), 12345..100_000 - 51);
    assert!(estargz::parse_footer(&f, 12000).is_err(), "a table past the footer");
    let mut bad = f.clone();
    bad[30] = b'g';
    assert!(estargz::parse_footer(&bad, 100_000)
        .unwrap_err()
        .to_string()
        .contains("hex"));
    // The legacy footer: the 22 bytes as the whole extra field.
    let mut legacy = vec![0; 4];
    legacy.extend_from_slice(&[0x1f, 0x8b, 8, 4, 0, 0, 0, 0, 0, 0xff, 22, 0]);
    legacy.extend_from_slice(format!("{:016x}STARGZ", 777).as_bytes());
    legacy.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    legacy.extend_from_slice(&[0; 8]);
    let footer = estargz::parse_footer(&legacy, 5000).unwrap();
    assert_eq!((footer.toc_offset, footer.size), (777, 47));
    assert_eq!(
        estargz::footer_range(30).unwrap_err().to_string(),
        "a blob of 30 bytes is too small for an eStargz footer"
    );

    let p = zstd_chunked::parse_manifest_position("100:50:400:1", 1000).unwrap();
    assert_eq!(p.range(), 100..150);
    for bad in [
        "100:50:400:2",
        "100:50:400",
        "100:50:400:1:5",
        "100:-5:400:1",
        "4:50:400:1",
        "900:200:400:1",
        "a:b:c:d",
        "100:0:0:1",
    ] {
        assert!(zstd_chunked::parse_manifest_position(bad, 1000).is_err(), "{bad}");
    }
    let mut zf = vec![0x50, 0x2a, 0x4d, 0x18, 64, 0, 0, 0];
    for n in [100u64, 50, 400, 1, 158, 30, 90] {
        zf.extend_from_slice(&n.to_le_bytes());
    }
    zf.extend_from_slice(b"GNUlInUx");
    let footer = zstd_chunked::parse_footer(&zf, 1000).unwrap();
    assert_eq!(footer.manifest, p);
    assert_eq!(footer.tar_split.unwrap().range(), 158..188);
    zf[64] = b'X';
    assert!(zstd_chunked::parse_footer(&zf, 1000).is_err());
    // Digests: sha256 only, as OCI writes them.
    assert!(Digest::parse(D, "x").is_ok());
}

#[test]
fn annotations_name_the_format() {
    use tilefs_seekable::toc::{from_annotations, Annotated};
    let get = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| *v)
    };
    assert_eq!(
        from_annotations(get(&[("org.opencontainers.x", "y")]), 100).unwrap(),
        None
    );
    let e = from_annotations(get(&[(estargz::TOC_DIGEST_ANNOTATION, D)]), 100).unwrap();
    assert!(matches!(e, Some(Annotated::Estargz { .. })));
    const BOTH: [(&str, &str); 2] = [
        (estargz::TOC_DIGEST_ANNOTATION, D),
        (zstd_chunked::MANIFEST_CHECKSUM_ANNOTATION, D),
    ];
    assert!(from_annotations(get(&BOTH), 100)
        .unwrap_err()
        .to_string()
        .contains("both"));
    const NO_POSITION: [(&str, &str); 1] = [(zstd_chunked::MANIFEST_CHECKSUM_ANNOTATION, D)];
    assert!(from_annotations(get(&NO_POSITION), 100)
        .unwrap_err()
        .to_string()
        .contains("manifest-position"));
    const Z: [(&str, &str); 2] = [
        (zstd_chunked::MANIFEST_CHECKSUM_ANNOTATION, D),
        (zstd_chunked::MANIFEST_POSITION_ANNOTATION, "10:20:30:1"),
    ];
    let Some(Annotated::ZstdChunked {
        manifest, tar_split, ..
    }) = from_annotations(get(&Z), 100).unwrap()
    else {
        panic!()
    };
    assert_eq!((manifest.range(), tar_split), (10..30, None));
    assert!(from_annotations(get(&[(estargz::TOC_DIGEST_ANNOTATION, "sha256:x")]), 100).is_err());
}
