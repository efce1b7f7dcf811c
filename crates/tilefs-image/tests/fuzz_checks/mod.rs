//! The properties the fuzz targets check, in one place: the targets in
//! `fuzz/fuzz_targets/` call these (through `fuzz/src/lib.rs`, which
//! includes this file), and `tests/fuzz_regressions.rs` replays every
//! input the fuzzers ever crashed on through them in a normal `cargo test`.
//!
//! Each function takes arbitrary bytes and panics exactly when a property
//! is broken; refusing the input (an `Err`) is always fine.

use std::io::BufReader;
use tilefs_image::dump::{self, ParseOptions};
use tilefs_image::erofs::{self, ImageInfo, WriteOptions};
use tilefs_image::Tree;

/// Options that write an image at exactly the version `info` records.
fn same_version(info: &ImageInfo) -> WriteOptions {
    WriteOptions {
        min_version: info.version,
        max_version: info.version,
    }
}

fn dump_text(tree: &Tree) -> Vec<u8> {
    let mut text = Vec::new();
    dump::print(tree, &mut text).expect("printing a tree the reader or parser made");
    text
}

/// The start of a dump, for panic messages (inputs can be large).
fn head(text: &[u8]) -> String {
    const MAX: usize = 2000;
    let cut = &text[..text.len().min(MAX)];
    format!(
        "{}{}",
        String::from_utf8_lossy(cut),
        if text.len() > MAX { "..." } else { "" }
    )
}

/// An image we wrote must read back, and building what was read must give
/// the same bytes (`build(read(image)) == image`), directly and through
/// dump text (`build(parse(dump(image))) == image`, what
/// `tilefs dump | tilefs build --from-dump` does).
fn check_canonical_image(bytes: &[u8]) {
    let (tree, info) = erofs::read_image(bytes).unwrap_or_else(|e| panic!("reading an image we wrote: {e}"));
    let again = erofs::write_image(&tree, &same_version(&info))
        .unwrap_or_else(|e| panic!("writing the tree read from an image we wrote: {e}"));
    assert!(
        again.bytes == bytes,
        "build(read(image)) differs from the image ({} vs {} bytes)",
        again.bytes.len(),
        bytes.len()
    );
    let text = dump_text(&tree);
    let parsed = dump::parse(BufReader::new(&text[..]), ParseOptions { strict: true })
        .unwrap_or_else(|e| panic!("the dump of an image we wrote does not parse: {e}\n{}", head(&text)));
    let rebuilt = erofs::write_image(&parsed, &same_version(&info))
        .unwrap_or_else(|e| panic!("building the dump of an image we wrote: {e}"));
    assert!(
        rebuilt.bytes == bytes,
        "build(parse(dump(image))) differs from the image ({} vs {} bytes)",
        rebuilt.bytes.len(),
        bytes.len()
    );
}

/// Target `read_image`: any bytes either read or are refused; a tree that
/// was read prints and writes (or is refused) without panicking.
pub fn read_image(data: &[u8]) {
    let view = erofs::ImageView::open(data.to_vec());
    let Ok((tree, info)) = erofs::read_image(data) else {
        if let Ok(v) = view {
            panic!("the view opens an image the reader refuses ({} inodes)", v.len());
        }
        return;
    };
    let view = view.unwrap_or_else(|e| panic!("the view refuses an image the reader reads: {e}"));
    check_view(&view, &tree, &info);
    dump_text(&tree);
    let _ = erofs::write_image(&tree, &same_version(&info));
}

/// Target `roundtrip_image`: as [`read_image`], and when the tree writes,
/// the image written is canonical (see `check_canonical_image`).
pub fn roundtrip_image(data: &[u8]) {
    let Ok((tree, info)) = erofs::read_image(data) else {
        return;
    };
    dump_text(&tree);
    if let Ok(image) = erofs::write_image(&tree, &same_version(&info)) {
        check_canonical_image(&image.bytes);
    }
}

/// Target `parse_dump`: any bytes parse or are refused, in both modes.
/// What the strict mode accepts the lenient one accepts too, as the same
/// tree. A parsed tree prints as text that parses (strictly) to the same
/// tree, and writes an image (or is refused) that is canonical.
pub fn parse_dump(data: &[u8]) {
    let parse = |bytes: &[u8], strict| dump::parse(BufReader::new(bytes), ParseOptions { strict });
    let lenient = parse(data, false);
    let strict = parse(data, true);
    if let Ok(s) = &strict {
        match &lenient {
            Ok(l) => assert!(l == s, "strict and lenient parses differ"),
            Err(e) => panic!("accepted strictly, refused leniently: {e}"),
        }
    }
    let Ok(tree) = lenient else {
        return;
    };
    let text = dump_text(&tree);
    let reparsed = parse(&text, true).unwrap_or_else(|e| panic!("printed dump does not parse: {e}\n{}", head(&text)));
    assert!(reparsed == tree, "parse(print(tree)) != tree\n{}", head(&text));
    if let Ok(image) = erofs::write_image(&tree, &WriteOptions::default()) {
        check_canonical_image(&image.bytes);
    }
}

/// An image served from its bytes shows exactly the tree the reader
/// gives: the same ids, attributes, inodes, entries (with hardlinks and
/// lookups), parents and whiteout-marked directories.
pub fn check_view(view: &erofs::ImageView, tree: &Tree, info: &ImageInfo) {
    use tilefs_image::tree::InodeId;
    assert_eq!(view.info(), info);
    assert_eq!(view.len(), tree.inodes.len(), "inode count");
    let mut parent = vec![0 as InodeId; tree.inodes.len()];
    let mut marked = std::collections::HashSet::new();
    for (id, inode) in tree.inodes.iter().enumerate() {
        for e in inode.entries.iter().filter(|e| !e.hardlink) {
            let child = &tree.inodes[e.inode as usize];
            if child.is_dir() {
                parent[e.inode as usize] = id as InodeId;
            } else if child.is_whiteout() {
                marked.insert(id as InodeId);
            }
        }
    }
    assert_eq!(view.parents(), &parent[..], "parents");
    let selinux = tree.inodes.iter().any(|i| i.xattr(b"security.selinux").is_some());
    assert_eq!(view.has_selinux(), selinux, "selinux");
    for (id, want) in tree.inodes.iter().enumerate() {
        let id = id as InodeId;
        assert_eq!(view.is_marked(id), marked.contains(&id), "inode {id}: marked");
        let a = view.attr(id).unwrap_or_else(|e| panic!("inode {id}: attr: {e}"));
        let got = (a.mode, a.nlink, a.uid, a.gid, a.rdev, a.size, a.mtime);
        let exp = (
            want.mode, want.nlink, want.uid, want.gid, want.rdev, want.size, want.mtime,
        );
        assert_eq!(got, exp, "inode {id}: attributes");
        let n = view.node(id).unwrap_or_else(|e| panic!("inode {id}: node: {e}"));
        assert_eq!(n.attr, a, "inode {id}: node attributes");
        assert_eq!(n.payload, want.payload.as_deref(), "inode {id}: payload");
        assert_eq!(n.content, want.content.as_deref(), "inode {id}: content");
        assert_eq!(n.digest, want.digest, "inode {id}: digest");
        let xattrs = view.xattrs(id).unwrap_or_else(|e| panic!("inode {id}: xattrs: {e}"));
        let exp: Vec<(&[u8], &[u8])> = want.xattrs.iter().map(|x| (&x.key[..], &x.value[..])).collect();
        assert_eq!(xattrs, exp, "inode {id}: xattrs");
        let mut inode = view.inode(id).unwrap_or_else(|e| panic!("inode {id}: {e}"));
        inode.entries = want.entries.clone();
        assert!(&inode == want, "inode {id}: {inode:?} vs {want:?}");
        if !want.is_dir() {
            assert!(view.dir(id).is_err(), "inode {id}: a directory view of a non-directory");
            continue;
        }
        let dir = view.dir(id).unwrap_or_else(|e| panic!("inode {id}: dir: {e}"));
        let got: Vec<(Vec<u8>, InodeId, bool)> =
            dir.entries().map(|e| (e.name.to_vec(), e.inode, e.hardlink)).collect();
        let exp: Vec<(Vec<u8>, InodeId, bool)> = want
            .entries
            .iter()
            .map(|e| (e.name.clone(), e.inode, e.hardlink))
            .collect();
        assert_eq!(got, exp, "inode {id}: entries");
        for e in &want.entries {
            let found = dir.entry(&e.name).map(|f| (f.inode, f.hardlink));
            assert_eq!(found, Some((e.inode, e.hardlink)), "inode {id}: lookup of {:?}", e.name);
            let mut other = e.name.clone();
            other.push(0xff);
            if want.entry(&other).is_none() {
                assert!(dir.entry(&other).is_none(), "inode {id}: lookup of a missing name");
            }
        }
        for missing in [&b"."[..], b"..", b"", b"\x00"] {
            assert_eq!(dir.entry(missing).is_some(), want.entry(missing).is_some());
        }
    }
}
