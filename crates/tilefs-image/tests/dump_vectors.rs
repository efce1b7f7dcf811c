//! The composefs-dump(5) parser and printer against the reference test
//! vectors in `shared/composefs-assets`, and (when its binaries are there)
//! against the reference `mkcomposefs` / `composefs-info` themselves.
//!
//! Set `TILEFS_ASSETS` to the vector directory and `TILEFS_REF_BIN` to the
//! directory holding the reference binaries to override the defaults.

mod common;

use common::*;
use flate2::read::GzDecoder;
use std::io::Read;
use std::process::Command;
use tilefs_image::dump::{parse, print, DumpError, ParseOptions};
use tilefs_image::Tree;

const STRICT: ParseOptions = ParseOptions { strict: true };
const LENIENT: ParseOptions = ParseOptions { strict: false };

/// Accepted by the reference only in its lenient mode.
const LENIENT_ONLY: &[&str] = &[
    "no-newline.dump",
    "longlink.dump",
    "honggfuzz-longlink-unterminated.dump",
];

struct Vector {
    name: String,
    text: Vec<u8>,
}

impl Vector {
    fn should_fail(&self) -> bool {
        self.name.starts_with("should-fail-")
    }

    fn lenient_only(&self) -> bool {
        LENIENT_ONLY.contains(&self.name.as_str())
    }
}

/// Every `*.dump` and `*.dump.gz` in the vector directory, decompressed. A
/// file whose whole content names another file there is a symlink that
/// lost its link-ness in a copy: it is read as that file.
fn vectors() -> Vec<Vector> {
    let dir = assets_dir();
    let mut out = Vec::new();
    for ent in std::fs::read_dir(&dir).unwrap() {
        let name = ent.unwrap().file_name().into_string().unwrap();
        if !name.ends_with(".dump") && !name.ends_with(".dump.gz") {
            continue;
        }
        let mut raw = std::fs::read(dir.join(&name)).unwrap();
        if let Ok(s) = std::str::from_utf8(&raw) {
            let s = s.trim_end();
            if !s.is_empty() && !s.contains(['/', ' ', '\n']) && dir.join(s).is_file() {
                raw = std::fs::read(dir.join(s)).unwrap();
            }
        }
        let text = if name.ends_with(".gz") {
            let mut t = Vec::new();
            GzDecoder::new(&raw[..]).read_to_end(&mut t).unwrap();
            t
        } else {
            raw
        };
        out.push(Vector { name, text });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    assert!(out.len() >= 20, "expected the composefs vectors in {}", dir.display());
    out
}

fn print_to_vec(tree: &Tree) -> Vec<u8> {
    let mut out = Vec::new();
    print(tree, &mut out).unwrap();
    out
}

#[test]
fn should_fail_vectors_are_refused() {
    let vs = vectors();
    let mut n = 0;
    for v in vs.iter().filter(|v| v.should_fail()) {
        n += 1;
        for opts in [LENIENT, STRICT] {
            let err: DumpError = match parse(&v.text[..], opts) {
                Ok(_) => panic!("{} was accepted (strict: {})", v.name, opts.strict),
                Err(e) => e,
            };
            assert!(err.line >= 1, "{}: error without a line: {err}", v.name);
            assert!(!err.reason.is_empty(), "{}: error without a reason", v.name);
            eprintln!("{} (strict: {}): {err}", v.name, opts.strict);
        }
    }
    assert!(vs.is_empty() || n >= 14, "only {n} should-fail vectors");
}

#[test]
fn vectors_parse() {
    for v in vectors().iter().filter(|v| !v.should_fail()) {
        let lenient = parse(&v.text[..], LENIENT).unwrap_or_else(|e| panic!("{}: {e}", v.name));
        match parse(&v.text[..], STRICT) {
            Ok(strict) => {
                assert!(!v.lenient_only(), "{} parsed in strict mode", v.name);
                assert_eq!(strict, lenient, "{}: strict and lenient trees differ", v.name);
            }
            Err(e) => assert!(v.lenient_only(), "{} (strict): {e}", v.name),
        }
    }
}

#[test]
fn vectors_round_trip() {
    for v in vectors().iter().filter(|v| !v.should_fail()) {
        let tree = parse(&v.text[..], LENIENT).unwrap();
        let text = print_to_vec(&tree);
        // What we print is always acceptable in strict mode.
        let again = parse(&text[..], STRICT).unwrap_or_else(|e| panic!("{}: reparse: {e}", v.name));
        assert!(again == tree, "{}: round trip changed the tree", v.name);
        assert!(print_to_vec(&again) == text, "{}: second print differs", v.name);
        // Dumps written by composefs-info come back byte for byte.
        if v.name.starts_with("cs9-") || v.name.starts_with("config") {
            assert!(text == v.text, "{}: print differs from the input", v.name);
        }
    }
}

/// Negative and truncated times, truncated device numbers, escapes in
/// every field, `-` as a value, hardlinks before their target.
const EDGE_CASES: &str = "/ 4096 40755 2 0 0 0 0.0 - - - user.a\\x3d\\x20b=\\x3d\\x00 user.-=-
/a\\x20b\\\\c\\td\\xff 1 100644 1 0 0 0 -1.0 - \\x2d -
/b\\n 0 @100644 1 0 0 0 0.0 /dir/x - -
/c 0 20644 1 0 0 4294967302 1.5000000000 - - - trusted.x=\\xe2\\x82\\xac\\\\
/dir 0 40700 2 7 8 0 9.9 - - -
/dir/x 3 100600 2 0 0 0 0.0 - a\\x00= - user.z=1 user.y=2
/l 3 120777 1 0 0 0 0.0 \\x2d\\x2d\\x2d - -
/m 0 100644 1 0 0 0 0.0 - - -
";

/// Builds an image of each vector with the reference mkcomposefs, dumps it
/// with the reference composefs-info, and checks that our print of our
/// parse of that dump is the same text, byte for byte. (The image is not
/// the vector: the writer adds overlay xattrs, computes directory sizes and
/// so on, so the reference's dump is compared with itself.)
#[test]
#[ignore = "needs the reference composefs tools in $TILEFS_REF_BIN (default /work/ref/bin)"]
fn matches_reference_composefs_info() {
    let (mkcomposefs, info) = (ref_bin("mkcomposefs"), ref_bin("composefs-info"));
    let tmp = tempfile::tempdir().unwrap();
    let mut compared = 0;
    let mut all = vectors();
    let want = if all.is_empty() { 1 } else { 9 };
    all.push(Vector {
        name: "edge cases".into(),
        text: EDGE_CASES.as_bytes().to_vec(),
    });
    for v in all.iter().filter(|v| !v.should_fail()) {
        // The large root filesystems take the reference ~2 s each; one of
        // them (with hardlinks) is enough here.
        if v.name.starts_with("cs9-") || v.name == "config.dump.gz" {
            continue;
        }
        let input = tmp.path().join("in.dump");
        let image = tmp.path().join("out.img");
        std::fs::write(&input, &v.text).unwrap();
        let st = Command::new(&mkcomposefs)
            .arg("--from-file")
            .arg(&input)
            .arg(&image)
            .status()
            .unwrap();
        assert!(st.success(), "{}: reference mkcomposefs failed", v.name);
        let out = Command::new(&info).arg("dump").arg(&image).output().unwrap();
        assert!(out.status.success(), "{}: reference composefs-info failed", v.name);
        let reference = out.stdout;

        let ours = print_to_vec(&parse(&reference[..], STRICT).unwrap_or_else(|e| panic!("{}: {e}", v.name)));
        assert_lines_eq(&v.name, &reference, &ours);
        compared += 1;
    }
    assert!(compared >= want, "compared only {compared} vectors");
}

fn assert_lines_eq(name: &str, want: &[u8], got: &[u8]) {
    if want == got {
        return;
    }
    let lines = |t: &[u8]| {
        String::from_utf8_lossy(t)
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let (want, got) = (lines(want), lines(got));
    for (w, g) in want.iter().zip(&got) {
        assert_eq!(w, g, "{name}: first differing line");
    }
    assert_eq!(want.len(), got.len(), "{name}: line count");
    panic!("{name}: output differs (line endings?)");
}

/// Timing of the largest vector; run with
/// `cargo test --release -p tilefs-image --test dump_vectors -- --ignored --nocapture`.
#[test]
#[ignore]
fn time_cs9_developer() {
    let Some(v) = vectors().into_iter().find(|v| v.name == "cs9-x86_64-developer.dump.gz") else {
        return;
    };
    let mut best = (std::time::Duration::MAX, std::time::Duration::MAX);
    for _ in 0..5 {
        let t0 = std::time::Instant::now();
        let tree = parse(&v.text[..], STRICT).unwrap();
        let t1 = std::time::Instant::now();
        let out = print_to_vec(&tree);
        let t2 = std::time::Instant::now();
        assert!(out == v.text);
        best = (best.0.min(t1 - t0), best.1.min(t2 - t1));
    }
    eprintln!("{} lines: parse {:?}, print {:?}", tree_lines(&v.text), best.0, best.1);
}

fn tree_lines(t: &[u8]) -> usize {
    t.iter().filter(|&&c| c == b'\n').count()
}

/// Random edits of the small vectors: never a panic, errors always carry a
/// line, and whatever is accepted prints to text that parses back to the
/// same tree.
#[test]
fn mutated_vectors() {
    let seeds: Vec<Vector> = vectors().into_iter().filter(|v| v.text.len() < 10_000).collect();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n.max(1) as u64) as usize
    };
    const BYTES: &[u8] = b" -=@\\/.0179afx\n\0\xff";
    let mut accepted = 0;
    for _ in 0..3000 {
        let Some(v) = seeds.get(next(seeds.len())) else {
            return;
        };
        let mut t = v.text.clone();
        for _ in 0..1 + next(3) {
            let at = next(t.len() + 1);
            match next(3) {
                0 if at < t.len() => t[at] = BYTES[next(BYTES.len())],
                1 if at < t.len() => {
                    t.remove(at);
                }
                _ => t.insert(at, BYTES[next(BYTES.len())]),
            }
        }
        let strict = next(2) == 0;
        match parse(&t[..], ParseOptions { strict }) {
            Ok(tree) => {
                accepted += 1;
                let text = print_to_vec(&tree);
                let again = parse(&text[..], STRICT).unwrap_or_else(|e| panic!("{}: reparse: {e}", v.name));
                assert!(again == tree, "{}: mutated round trip changed the tree", v.name);
            }
            Err(e) => assert!(
                (e.line >= 1 || t.is_empty()) && !e.reason.is_empty(),
                "{}: {e:?}",
                v.name
            ),
        }
    }
    eprintln!("{accepted} of 3000 mutations accepted");
    assert!(accepted > 100, "only {accepted} mutations were accepted");
}
