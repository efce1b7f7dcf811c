//! Directory builds give the reference's exact bytes. The reference's image
//! hashes for the generated tree are recorded in `tests/data/dir-tree.sha256`;
//! with `TILEFS_MKCOMPOSEFS=/path/to/mkcomposefs` the test runs the reference
//! and checks them, and with `TILEFS_BLESS=1` too, rewrites them.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const VARIANTS: [&[&str]; 5] = [
    &[],
    &["--use-epoch"],
    &["--skip-devices"],
    &["--skip-xattrs"],
    &["--user-xattrs", "--max-version=0"],
];

fn recorded_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/dir-tree.sha256")
}

fn sha256_file(p: &Path) -> String {
    sha256_hex(&std::fs::read(p).unwrap())
}

#[test]
fn directory_builds_match_reference() {
    require(not_root(
        "the generated tree needs it: devices, owners, trusted.* xattrs",
    ));
    let reference = std::env::var_os("TILEFS_MKCOMPOSEFS").map(PathBuf::from);
    let recorded = std::fs::read_to_string(recorded_path()).unwrap_or_default();
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    make_source_tree(&src, 11);
    let mut lines = Vec::new();
    for (i, variant) in VARIANTS.iter().enumerate() {
        let ours = tmp.path().join(format!("ours-{i}.img"));
        let mut args = vec![os("build")];
        args.extend(variant.iter().map(|a| os(a)));
        args.extend([src.as_os_str(), ours.as_os_str()]);
        tilefs(&args);
        let got = sha256_file(&ours);
        let key = format!("variant{i}");
        let want = match &reference {
            Some(r) => {
                let theirs = tmp.path().join(format!("theirs-{i}.img"));
                let st = Command::new(r).args(*variant).arg(&src).arg(&theirs).status().unwrap();
                assert!(st.success(), "reference failed on {variant:?}");
                sha256_file(&theirs)
            }
            None => recorded
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{key} ")))
                .unwrap_or_else(|| panic!("no recorded hash for {key}"))
                .to_string(),
        };
        assert_eq!(got, want, "directory build with {variant:?} differs from the reference");
        lines.push(format!("{key} {want}"));
    }
    if std::env::var_os("TILEFS_BLESS").is_some() {
        std::fs::create_dir_all(recorded_path().parent().unwrap()).unwrap();
        std::fs::write(recorded_path(), lines.join("\n") + "\n").unwrap();
    }
}
