//! The composefs reference vectors: every dump builds to exactly the image
//! bytes the reference `mkcomposefs` writes, and every should-fail dump is
//! refused.

mod common;

use common::*;
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{BufReader, Read};
use std::path::Path;
use tilefs_image::dump::{self, ParseOptions};
use tilefs_image::erofs::{self, WriteOptions};

fn read_dump_bytes(path: &Path) -> Vec<u8> {
    let mut raw = fs::read(path).unwrap();
    // Some assets are git symlinks stored as plain files holding the name
    // of the dump they stand for.
    if let Ok(target) = std::str::from_utf8(&raw) {
        let sibling = path.with_file_name(target.trim());
        if !target.contains(' ') && !target.contains('\n') && sibling.is_file() {
            raw = fs::read(sibling).unwrap();
        }
    }
    if path.extension().is_some_and(|e| e == "gz") {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..]).read_to_end(&mut out).unwrap();
        out
    } else {
        raw
    }
}

#[test]
fn vectors_build_reference_bytes() {
    let dir = assets_dir();
    let mut checked = 0;
    for entry in fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        let Some(dump_name) = name.strip_suffix(".sha256") else {
            continue;
        };
        let dump_path = dir.join(dump_name);
        if !dump_path.exists() {
            eprintln!("skipping {dump_name}: the dump itself is not among the assets");
            continue;
        }
        let want = fs::read_to_string(&p).unwrap().trim().to_string();
        let (min, max) = match fs::read_to_string(dir.join(format!("{dump_name}.version"))) {
            Ok(v) => {
                let v: u32 = v.trim().parse().unwrap();
                (v, v)
            }
            Err(_) => (0, 1),
        };
        let bytes = read_dump_bytes(&dump_path);
        let tree = dump::parse(BufReader::new(&bytes[..]), ParseOptions::default())
            .unwrap_or_else(|e| panic!("{dump_name}: {e}"));
        let image = erofs::write_image(
            &tree,
            &WriteOptions {
                min_version: min,
                max_version: max,
            },
        )
        .unwrap_or_else(|e| panic!("{dump_name}: {e}"));
        let got = hex::encode(Sha256::digest(&image.bytes));
        assert_eq!(got, want, "{dump_name}: image differs from the reference's");
        checked += 1;
    }
    assert!(checked >= 12, "only {checked} vectors found in {}", dir.display());
}

#[test]
fn should_fail_vectors_are_refused() {
    let dir = assets_dir();
    let mut checked = 0;
    for entry in fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if !name.starts_with("should-fail-") {
            continue;
        }
        let bytes = read_dump_bytes(&p);
        for strict in [false, true] {
            let refused = match dump::parse(BufReader::new(&bytes[..]), ParseOptions { strict }) {
                Err(e) => {
                    assert!(e.line > 0 && !e.reason.is_empty(), "{name}: vague error {e:?}");
                    true
                }
                Ok(tree) => erofs::write_image(&tree, &WriteOptions::default()).is_err(),
            };
            assert!(refused, "{name} (strict: {strict}) was accepted");
        }
        checked += 1;
    }
    assert!(checked >= 14, "only {checked} should-fail vectors");
}
