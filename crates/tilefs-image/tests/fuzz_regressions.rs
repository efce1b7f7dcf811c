//! Inputs the fuzz targets (`fuzz/` at the top of the repository) failed on,
//! replayed through the same checks (`fuzz_checks`) in every `cargo test`.
//!
//! Each input is a file in `tests/data/fuzz/<target>/`, named after what it
//! caught; adding one is enough for it to run here. Findings that are
//! easier to read as code are tests of their own below.

mod fuzz_checks;

use std::io::BufReader;
use std::path::Path;
use tilefs_image::dump::{self, ParseOptions};

/// Runs `check` on every input saved for `target`; returns how many.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/fuzz")
        .join(target);
    let mut files: Vec<_> = match std::fs::read_dir(&dir) {
        Ok(rd) => rd.map(|e| e.unwrap().path()).collect(),
        Err(_) => return 0,
    };
    files.sort();
    for f in &files {
        let data = std::fs::read(f).unwrap();
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        if std::panic::catch_unwind(|| check(&data)).is_err() {
            panic!("fuzz regression {target}/{name} fails again");
        }
    }
    files.len()
}

#[test]
fn read_image_inputs() {
    replay("read_image", fuzz_checks::read_image);
}

#[test]
fn roundtrip_image_inputs() {
    replay("roundtrip_image", fuzz_checks::roundtrip_image);
}

#[test]
fn parse_dump_inputs() {
    replay("parse_dump", fuzz_checks::parse_dump);
}

/// Found by `parse_dump`: the cap on a line's xattrs counted escaped text,
/// so a long binary value (raw bytes in, `\xHH` out) made a dump whose
/// printed form no longer parsed. The cap now counts decoded bytes, and the
/// round trip holds.
#[test]
fn long_binary_xattrs_round_trip_through_dump_text() {
    let mut line = b"/ 4096 40755 2 0 0 0 0.0 - - - user.bin=".to_vec();
    line.extend(std::iter::repeat_n(0x95u8, 30_000));
    line.push(b'\n');
    let tree = dump::parse(BufReader::new(&line[..]), ParseOptions { strict: true }).unwrap();
    let mut text = Vec::new();
    dump::print(&tree, &mut text).unwrap();
    assert!(text.len() > 120_000);
    let again = dump::parse(BufReader::new(&text[..]), ParseOptions { strict: true }).unwrap();
    assert_eq!(again, tree);
    fuzz_checks::parse_dump(&line);
}

/// Found while reviewing the writer for the fuzz targets: a hardlink entry
/// to an inode that is not in the arena panicked (an index out of bounds)
/// instead of being refused like a primary entry to one.
#[test]
fn writer_refuses_hardlinks_to_missing_inodes() {
    use tilefs_image::erofs::{self, WriteOptions};
    use tilefs_image::tree::S_IFDIR;
    use tilefs_image::{Entry, Inode, Tree};
    let mut root = Inode::new(S_IFDIR | 0o755);
    root.entries.push(Entry {
        name: b"h".to_vec(),
        inode: 99,
        hardlink: true,
    });
    let err = erofs::write_image(&Tree::new(root), &WriteOptions::default())
        .err()
        .expect("a hardlink to a missing inode is refused");
    assert!(err.to_string().contains("not in the tree"), "{err}");
}
