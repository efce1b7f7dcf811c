//! Real eStargz and zstd:chunked layers, written by the stargz project's
//! estargz package and containers/storage's chunked compressor
//! (testdata-gen/), read back file by file through their tables of
//! contents and compared with the tar they were made from.

// Tests may print (what they skip, and why), helpers as #[test]s.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::corpus;
use tar::{EntryType, Header};
use tilefs_seekable::toc::{self, estargz, zstd_chunked, Annotated, Entry, Kind, Toc};
use tilefs_seekable::{Digest, Error};

/// The generator, built by testdata-gen/build.sh (scripts/setup runs it;
/// here it is a no-op once built). `None` only when Go is not installed.
fn generator() -> Option<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata-gen/build.sh");
    let out = Command::new("bash").arg(&script).output().unwrap();
    match out.status.code() {
        Some(0) => Some(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()).join("seekable-gen")),
        Some(3) => {
            eprintln!("skipping: Go is not installed, so seekable-gen cannot be built");
            None
        }
        _ => panic!("building seekable-gen failed: {}", String::from_utf8_lossy(&out.stderr)),
    }
}

/// What the tar holds at a path, as a table of contents must say it.
#[derive(Clone, Debug)]
struct Want {
    kind: EntryType,
    data: Vec<u8>,
    link: &'static str,
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: u64,
    dev: (u32, u32),
    xattrs: Vec<(&'static str, Vec<u8>)>,
}

fn want(kind: EntryType, data: Vec<u8>) -> Want {
    Want {
        kind,
        data,
        link: "",
        mode: 0o644,
        uid: 0,
        gid: 0,
        mtime: 1_700_000_000,
        dev: (0, 0),
        xattrs: Vec::new(),
    }
}

/// A tree with what the formats treat apart: files of every size class
/// (empty, small enough to share a gzip member, several chunks), a file
/// with a long run of zeros (a zstd:chunked hole), links, devices,
/// extended attributes, odd modes and owners.
fn tree() -> Vec<(String, Want)> {
    let mut t: Vec<(String, Want)> = Vec::new();
    let mut dir = want(EntryType::Directory, Vec::new());
    dir.mode = 0o755;
    t.push(("a".into(), dir.clone()));
    t.push(("a/b".into(), dir.clone()));
    t.push(("a/empty".into(), want(EntryType::Regular, Vec::new())));
    for i in 0..40u64 {
        let data = corpus(100 + i, (i * i * 37) as usize % 9000 + 1);
        t.push((format!("a/b/small-{i}"), want(EntryType::Regular, data)));
    }
    let mut big = want(EntryType::Regular, corpus(7, 3 << 20));
    big.mode = 0o4755;
    big.uid = 1000;
    big.gid = 100_000;
    big.mtime = 1_234_567_890;
    big.xattrs = vec![
        ("user.note", b"big file".to_vec()),
        ("security.capability", vec![1, 0, 0, 2, 0xff]),
    ];
    t.push(("a/big".into(), big));
    let mut holes = corpus(8, 100_000);
    holes.extend(vec![0u8; 300_000]);
    holes.extend(corpus(9, 100_000));
    t.push(("a/holes".into(), want(EntryType::Regular, holes)));
    let mut sym = want(EntryType::Symlink, Vec::new());
    sym.link = "../outside/target";
    sym.mode = 0o777;
    t.push(("a/link".into(), sym.clone()));
    sym.link = "/etc/passwd";
    t.push(("a/abs-link".into(), sym));
    let mut hard = want(EntryType::Link, Vec::new());
    hard.link = "a/b/small-3";
    t.push(("a/hard".into(), hard));
    let mut chr = want(EntryType::Char, Vec::new());
    chr.dev = (1, 3);
    t.push(("a/null".into(), chr));
    let mut blk = want(EntryType::Block, Vec::new());
    blk.dev = (259, 65536);
    t.push(("a/disk".into(), blk));
    t.push(("a/fifo".into(), want(EntryType::Fifo, Vec::new())));
    let mut x = want(EntryType::Directory, Vec::new());
    x.mode = 0o1777;
    x.xattrs = vec![("trusted.overlay.opaque", b"y".to_vec())];
    t.push(("tmp".into(), x));
    t
}

fn tar_of(tree: &[(String, Want)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, w) in tree {
        if !w.xattrs.is_empty() {
            let records: Vec<(String, &[u8])> = w
                .xattrs
                .iter()
                .map(|(k, v)| (format!("SCHILY.xattr.{k}"), &v[..]))
                .collect();
            b.append_pax_extensions(records.iter().map(|(k, v)| (k.as_str(), *v)))
                .unwrap();
        }
        let mut h = Header::new_ustar();
        h.set_entry_type(w.kind);
        h.set_size(w.data.len() as u64);
        h.set_mode(w.mode);
        h.set_uid(w.uid);
        h.set_gid(w.gid);
        h.set_mtime(w.mtime);
        if !w.link.is_empty() {
            h.set_link_name(w.link).unwrap();
        }
        if matches!(w.kind, EntryType::Char | EntryType::Block) {
            h.set_device_major(w.dev.0).unwrap();
            h.set_device_minor(w.dev.1).unwrap();
        }
        let name = if w.kind == EntryType::Directory {
            format!("{path}/")
        } else {
            path.clone()
        };
        b.append_data(&mut h, name, &w.data[..]).unwrap();
    }
    b.into_inner().unwrap()
}

/// Runs the generator; returns the blob and the layer's annotations.
fn generate(gen: &Path, args: &[&str], tar: &[u8]) -> (Vec<u8>, BTreeMap<String, String>) {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.tar"), dir.path().join("out"));
    std::fs::write(&input, tar).unwrap();
    let out = Command::new(gen).args(args).arg(&input).arg(&output).output().unwrap();
    assert!(
        out.status.success(),
        "seekable-gen {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let annotations = serde_json::from_slice(&out.stdout).unwrap();
    (std::fs::read(&output).unwrap(), annotations)
}

fn slice(blob: &[u8], r: std::ops::Range<u64>) -> &[u8] {
    &blob[r.start as usize..r.end as usize]
}

/// What a lazy mount does first: the format from the layer's annotations,
/// then the ranges they and the footer name.
fn annotated(blob: &[u8], annotations: &BTreeMap<String, String>) -> Result<Annotated, Error> {
    let get = |k: &str| annotations.get(k).map(String::as_str);
    Ok(toc::from_annotations(get, blob.len() as u64)?.expect("the generator annotates its layers"))
}

fn open_estargz(blob: &[u8], annotations: &BTreeMap<String, String>) -> Result<Toc, Error> {
    let Annotated::Estargz { toc_digest } = annotated(blob, annotations)? else {
        panic!("not eStargz")
    };
    let size = blob.len() as u64;
    let footer = estargz::parse_footer(slice(blob, estargz::footer_range(size)?), size)?;
    estargz::parse_toc(slice(blob, footer.toc_range(size)), &footer, size, &toc_digest)
}

fn open_zstd_chunked(blob: &[u8], annotations: &BTreeMap<String, String>) -> Result<Toc, Error> {
    let Annotated::ZstdChunked {
        manifest,
        manifest_digest,
        tar_split,
    } = annotated(blob, annotations)?
    else {
        panic!("not zstd:chunked")
    };
    let size = blob.len() as u64;
    let footer = zstd_chunked::parse_footer(slice(blob, zstd_chunked::footer_range(size)?), size)?;
    assert_eq!(footer.manifest, manifest, "the footer and the annotation disagree");
    let toc = zstd_chunked::parse_manifest(slice(blob, manifest.range()), &manifest, &manifest_digest)?;
    // The tar-split is where both say, and has the digest the table gives.
    let ts = tar_split.unwrap();
    assert_eq!(footer.tar_split, Some(ts));
    let split = zstd_chunked::read_tar_split(slice(blob, ts.range()), &ts, toc.tar_split_digest.as_ref().unwrap())?;
    assert!(split.starts_with(b"{"), "tar-split is JSON lines");
    Ok(toc)
}

/// Reads every file through its chunks and compares the table with the
/// tree; returns how many chunks were read.
fn compare(toc: &Toc, blob: &[u8], tree: &[(String, Want)]) -> usize {
    let by_path: BTreeMap<&str, &Entry> = toc.entries.iter().map(|e| (e.path.as_str(), e)).collect();
    let mut chunks = 0;
    for (path, w) in tree {
        let e = by_path
            .get(path.as_str())
            .unwrap_or_else(|| panic!("{path} is not in the table"));
        assert_eq!(e.mode, w.mode, "{path}");
        assert_eq!((u64::from(e.uid), u64::from(e.gid)), (w.uid, w.gid), "{path}");
        assert_eq!(e.mtime.map(|t| t.secs), Some(w.mtime as i64), "{path}");
        let mut xattrs: Vec<(String, Vec<u8>)> = w.xattrs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        xattrs.sort();
        assert_eq!(e.xattrs, xattrs, "{path}");
        match (&e.kind, w.kind) {
            (Kind::File(f), EntryType::Regular) => {
                assert_eq!(f.size, w.data.len() as u64, "{path}");
                let mut content = Vec::new();
                for c in &f.chunks {
                    let mut out = vec![0u8; c.size as usize];
                    let fetched = if c.zeros {
                        &[][..]
                    } else {
                        slice(blob, c.compressed.clone())
                    };
                    toc.read_chunk(c, fetched, &mut out)
                        .unwrap_or_else(|e| panic!("{path}: {e}"));
                    content.extend(out);
                    chunks += 1;
                }
                assert!(content == w.data, "{path}: content differs");
                if let Some(d) = f.digest {
                    d.verify(&content, || path.clone()).unwrap();
                }
            }
            (Kind::Dir, EntryType::Directory) | (Kind::Fifo, EntryType::Fifo) => {}
            (Kind::Symlink { target }, EntryType::Symlink) => assert_eq!(target, w.link),
            (Kind::Hardlink { target }, EntryType::Link) => assert_eq!(target, w.link),
            (Kind::CharDevice { major, minor }, EntryType::Char)
            | (Kind::BlockDevice { major, minor }, EntryType::Block) => assert_eq!((*major, *minor), w.dev),
            (k, t) => panic!("{path}: {k:?} for a tar {t:?}"),
        }
    }
    // Nothing else but the landmark eStargz adds.
    for e in &toc.entries {
        assert!(
            tree.iter().any(|(p, _)| *p == e.path) || e.path.ends_with("prefetch.landmark"),
            "{} is not in the tar",
            e.path
        );
    }
    chunks
}

#[test]
fn estargz_layers_read_back_file_by_file() {
    let Some(gen) = generator() else { return };
    let tree = tree();
    let tar = tar_of(&tree);
    for args in [
        &["estargz"][..],
        &[
            "estargz",
            "-chunk-size",
            "262144",
            "-min-chunk-size",
            "65536",
            "-level",
            "9",
        ],
    ] {
        let (blob, annotations) = generate(&gen, args, &tar);
        let toc = open_estargz(&blob, &annotations).unwrap();
        let chunks = compare(&toc, &blob, &tree);
        let shared = toc
            .entries
            .iter()
            .filter_map(|e| if let Kind::File(f) = &e.kind { Some(f) } else { None })
            .flat_map(|f| &f.chunks)
            .filter(|c| c.skip > 0)
            .count();
        eprintln!(
            "{args:?}: {} entries, {chunks} chunks, {shared} inside a shared member",
            toc.entries.len()
        );
        if args.len() > 1 {
            assert!(chunks > 50 && shared > 10, "{chunks} chunks, {shared} shared");
        }
        // Pulled as an ordinary gzip layer (a member per chunk and more),
        // its seek index reads the big file through its checkpoints.
        let mut ix = tilefs_seekable::gzip::GzipIndexer::with_span(&blob[..], 64 << 10);
        let mut stream = Vec::new();
        std::io::Read::read_to_end(&mut ix, &mut stream).unwrap();
        let index = ix.finish().unwrap();
        let members = index
            .checkpoints()
            .iter()
            .filter(|c| c.resume == tilefs_seekable::Resume::Stream)
            .count();
        assert!(
            members >= 1 && index.checkpoints().len() > 20,
            "{members} member checkpoints"
        );
        let big = &tree.iter().find(|(p, _)| p == "a/big").unwrap().1.data;
        let at = stream.windows(4096).position(|w| w == &big[..4096]).unwrap() as u64;
        let f = index.fetch_range(at..at + big.len() as u64).unwrap();
        let mut out = vec![0u8; big.len()];
        index
            .read_at(at..at + big.len() as u64, slice(&blob, f), &mut out)
            .unwrap();
        assert!(&out == big);
    }
}

#[test]
fn zstd_chunked_layers_read_back_file_by_file() {
    let Some(gen) = generator() else { return };
    let tree = tree();
    let tar = tar_of(&tree);
    let (blob, annotations) = generate(&gen, &["zstd-chunked"], &tar);
    let toc = open_zstd_chunked(&blob, &annotations).unwrap();
    let chunks = compare(&toc, &blob, &tree);
    let zeros = toc
        .entries
        .iter()
        .filter_map(|e| if let Kind::File(f) = &e.kind { Some(f) } else { None })
        .flat_map(|f| &f.chunks)
        .filter(|c| c.zeros)
        .count();
    eprintln!(
        "zstd:chunked: {} entries, {chunks} chunks, {zeros} holes",
        toc.entries.len()
    );
    assert!(zeros >= 1, "the run of zeros is a hole");
    // The blob is an ordinary zstd stream too: its seek index reads the
    // same tar.
    let mut ix = tilefs_seekable::zstd::ZstdIndexer::with_span(&blob[..], 1).unwrap();
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut ix, &mut out).unwrap();
    assert!(out == tar, "the zstd:chunked blob decodes to the tar");
    let index = ix.finish().unwrap();
    assert!(index.checkpoints().len() > 40, "a frame per file and chunk");
}

#[test]
fn wrong_digests_and_damaged_chunks_are_refused() {
    let Some(gen) = generator() else { return };
    let tree = tree();
    let tar = tar_of(&tree);
    for kind in ["estargz", "zstd-chunked"] {
        let (mut blob, mut annotations) = generate(&gen, &[kind], &tar);
        let other = format!("sha256:{}", "0".repeat(64));
        let key = if kind == "estargz" {
            estargz::TOC_DIGEST_ANNOTATION
        } else {
            zstd_chunked::MANIFEST_CHECKSUM_ANNOTATION
        };
        let right = std::mem::replace(annotations.get_mut(key).unwrap(), other);
        let open = |blob: &[u8], a: &BTreeMap<String, String>| {
            if kind == "estargz" {
                open_estargz(blob, a)
            } else {
                open_zstd_chunked(blob, a)
            }
        };
        let e = open(&blob, &annotations).unwrap_err();
        assert!(matches!(e, Error::Digest { .. }), "{kind}: {e}");
        annotations.insert(key.into(), right);
        let toc = open(&blob, &annotations).unwrap();
        // A byte of the big file's first chunk changed in the blob.
        let f = toc
            .entries
            .iter()
            .find_map(|e| match &e.kind {
                Kind::File(f) if e.path == "a/big" => Some(f.clone()),
                _ => None,
            })
            .unwrap();
        let c = &f.chunks[0];
        let at = (c.compressed.start + (c.compressed.end - c.compressed.start) / 2) as usize;
        blob[at] ^= 0x40;
        let mut out = vec![0u8; c.size as usize];
        let e = toc
            .read_chunk(c, slice(&blob, c.compressed.clone()), &mut out)
            .unwrap_err();
        eprintln!("{kind}: {e}");
        // Too few bytes: an error, not a panic or a short read.
        let e = toc
            .read_chunk(c, &slice(&blob, c.compressed.clone())[..10], &mut out)
            .unwrap_err();
        assert!(matches!(e, Error::Corrupt(_) | Error::Range(_)), "{e}");
    }
}

/// Seeds for the fuzz targets `seekable_*` (fuzz/README.md): real layers,
/// tables, footers and indexes, each checked to be what its target wants;
/// written to `$TILEFS_WRITE_SEEKABLE_SEEDS/<target>/` when that is set
/// (fuzz/make-seeds.sh sets it).
#[test]
fn fuzz_seeds_are_valid_inputs() {
    let mut seeds: Vec<(&str, Vec<u8>)> = Vec::new();
    let data = corpus(20, 60_000);
    let mut gz = Vec::new();
    for level in [0, 1, 6, 9] {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(level));
        std::io::Write::write_all(&mut e, &data).unwrap();
        gz.push(e.finish().unwrap());
    }
    let members: Vec<u8> = gz[1..].concat();
    gz.push(members);
    if let Some(p) = common::cli("pigz", &["-c", "-b", "32"], &data) {
        gz.push(p);
    }
    for (i, blob) in gz.iter().enumerate() {
        // Span byte: 2^12 .. 2^15.
        seeds.push(("seekable_gzip", [&[12 + i as u8 % 4][..], blob].concat()));
        let mut ix = tilefs_seekable::gzip::GzipIndexer::with_span(&blob[..], 8192);
        std::io::copy(&mut ix, &mut std::io::sink()).unwrap();
        let encoded = ix.finish().unwrap().encode();
        let len = (encoded.len() as u16) << 1;
        seeds.push(("seekable_index", [&len.to_le_bytes()[..], &encoded, blob].concat()));
        // A hostile checkpoint: 6 bytes of fields (3 leftover bits of value 5,
        // a 16-byte window of "ab"), then the stream after its header.
        seeds.push((
            "seekable_index",
            [&[13u8, 0, 3, 5, 16, 0, b'a', b'b'][..], &blob[10..]].concat(),
        ));
    }
    let mut zs = vec![zstd::encode_all(&data[..], 3).unwrap()];
    let frames: Vec<u8> = data
        .chunks(7000)
        .flat_map(|c| zstd::encode_all(c, 1).unwrap())
        .collect();
    zs.push([&[0x5a, 0x2a, 0x4d, 0x18, 2, 0, 0, 0, 7, 7][..], &frames].concat());
    for blob in &zs {
        seeds.push(("seekable_zstd", [&[12u8][..], blob].concat()));
        let mut ix = tilefs_seekable::zstd::ZstdIndexer::with_span(&blob[..], 4096).unwrap();
        std::io::copy(&mut ix, &mut std::io::sink()).unwrap();
        let encoded = ix.finish().unwrap().encode();
        let len = (encoded.len() as u16) << 1;
        seeds.push(("seekable_index", [&len.to_le_bytes()[..], &encoded, blob].concat()));
    }
    seeds.push(("seekable_footer", b"200:300:1000:1".to_vec()));
    if let Some(gen) = generator() {
        // Small trees keep the tables small.
        let tree: Vec<(String, Want)> = tree().into_iter().filter(|(p, _)| p != "a/big").collect();
        let tar = tar_of(&tree);
        for args in [
            &["estargz"][..],
            &["estargz", "-chunk-size", "65536", "-min-chunk-size", "8192"],
        ] {
            let (blob, a) = generate(&gen, args, &tar);
            let size = blob.len() as u64;
            let footer = estargz::parse_footer(slice(&blob, estargz::footer_range(size).unwrap()), size).unwrap();
            let toc_bytes = slice(&blob, footer.toc_range(size));
            let json = estargz::toc_json(toc_bytes, footer.toc_offset).unwrap();
            Digest::parse(&a[estargz::TOC_DIGEST_ANNOTATION], "x")
                .unwrap()
                .verify(&json, String::new)
                .unwrap();
            // Offset byte: the table starts 8 + 2^k into the blob, past
            // every chunk.
            let k = 64 - footer.toc_offset.leading_zeros() as u8;
            estargz::parse_json(&json, 8 + (1 << k)).unwrap();
            seeds.push(("seekable_toc", [&[k << 1][..], &json].concat()));
            seeds.push(("seekable_footer", blob[blob.len() - 51..].to_vec()));
            seeds.push(("seekable_footer", toc_bytes.to_vec()));
        }
        let (blob, a) = generate(&gen, &["zstd-chunked"], &tar);
        let size = blob.len() as u64;
        let p = zstd_chunked::parse_manifest_position(&a[zstd_chunked::MANIFEST_POSITION_ANNOTATION], size).unwrap();
        let json = zstd::bulk::decompress(slice(&blob, p.range()), p.uncompressed_len as usize).unwrap();
        let k = 64 - p.offset.leading_zeros() as u8;
        seeds.push(("seekable_toc", [&[k << 1 | 1][..], &json].concat()));
        seeds.push(("seekable_footer", blob[blob.len() - 72..].to_vec()));
        seeds.push((
            "seekable_footer",
            a[zstd_chunked::MANIFEST_POSITION_ANNOTATION].as_bytes().to_vec(),
        ));
        seeds.push(("seekable_zstd", [&[10u8][..], &blob].concat()));
    }
    let Some(dir) = std::env::var_os("TILEFS_WRITE_SEEKABLE_SEEDS") else {
        return;
    };
    for (target, bytes) in seeds {
        let d = Path::new(&dir).join(target);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(Digest::of(&bytes).to_string().replace("sha256:", "")), bytes).unwrap();
    }
}
