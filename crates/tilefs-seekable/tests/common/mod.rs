//! Test data: streams with what compressors treat differently (text with
//! near and far repeats, incompressible runs, zeros), and CLI compressors.

// Tests may print (what they skip, and why), helpers as #[test]s.
#![allow(clippy::print_stdout, clippy::print_stderr)]
#![allow(dead_code)]

use std::io::Write;
use std::process::{Command, Stdio};

use tilefs_seekable::SeekIndex;

/// A small xorshift generator: the same bytes on every run.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `len` bytes mixing words, copies from up to 32 KiB back, random bytes
/// and zero runs.
pub fn corpus(seed: u64, len: usize) -> Vec<u8> {
    let words = [
        "usr",
        "share",
        "lib",
        "the ",
        "and ",
        "of ",
        "tilefs ",
        "layer ",
        "0123",
        "\n",
        "#include <stdio.h>\n",
        "static int ",
        "return 0;\n",
        "    ",
        "{\n",
        "}\n",
    ];
    let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut out = Vec::with_capacity(len + 64 * 1024);
    while out.len() < len {
        match r.below(10) {
            0..=4 => {
                for _ in 0..r.below(200) {
                    out.extend_from_slice(words[r.below(words.len() as u64) as usize].as_bytes());
                }
            }
            5 | 6 if out.len() > 100 => {
                let back = 1 + r.below(out.len().min(32768) as u64) as usize;
                let n = 3 + r.below(300) as usize;
                let start = out.len() - back;
                for i in 0..n {
                    out.push(out[start + i]);
                }
            }
            7 => {
                for _ in 0..r.below(4096) {
                    out.push(r.next() as u8);
                }
            }
            8 => out.resize(out.len() + r.below(20000) as usize, 0),
            _ => out.push(r.next() as u8),
        }
    }
    out.truncate(len);
    out
}

/// Runs a compressor CLI over `data`; `None` when it is not installed.
pub fn cli(program: &str, args: &[&str], data: &[u8]) -> Option<Vec<u8>> {
    let mut child = match Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("skipping {program} {args:?}: {program} is not installed");
            return None;
        }
        Err(e) => panic!("{program}: {e}"),
    };
    let mut stdin = child.stdin.take().unwrap();
    let data = data.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&data).unwrap());
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(out.status.success(), "{program} {args:?} failed");
    Some(out.stdout)
}

/// Reads `a..b` through the index from the bytes `fetch_range` names.
pub fn read(index: &SeekIndex, blob: &[u8], a: u64, b: u64) -> Vec<u8> {
    let f = index.fetch_range(a..b).unwrap();
    let mut out = vec![0u8; (b - a) as usize];
    index
        .read_at(a..b, &blob[f.start as usize..f.end as usize], &mut out)
        .unwrap();
    out
}
