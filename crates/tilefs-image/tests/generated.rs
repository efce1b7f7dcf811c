//! Byte compatibility beyond the vectors: seeded, generated trees with
//! everything awkward the format holds, built by us and compared with the
//! image the reference `mkcomposefs` writes for the same dump.
//!
//! The reference's image hashes are recorded in `tests/data/generated.sha256`
//! so the comparison runs everywhere. With `TILEFS_MKCOMPOSEFS=/path/to/mkcomposefs`
//! the test runs the reference itself and checks the recorded hashes; with
//! `TILEFS_BLESS=1` as well it rewrites them.

use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use tilefs_image::dump::{self, ParseOptions};
use tilefs_image::erofs::{self, WriteOptions};

/// xorshift64*: small, seeded, good enough to shape trees.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

fn esc(out: &mut String, b: &[u8]) {
    for &c in b {
        if c.is_ascii_alphanumeric() || c == b'.' || c == b'_' || c == b'/' {
            out.push(c as char);
        } else {
            write!(out, "\\x{c:02x}").unwrap();
        }
    }
}

fn name(rng: &mut Rng) -> Vec<u8> {
    const AWKWARD: &[u8] = b" =\n\t\\-@.#%:'\"";
    let len = match rng.below(20) {
        0 => 255,
        1 => 1,
        _ => 1 + rng.below(30) as usize,
    };
    loop {
        let n: Vec<u8> = (0..len)
            .map(|_| match rng.below(6) {
                0 => AWKWARD[rng.below(AWKWARD.len() as u64) as usize],
                1 => 0x80 + rng.below(0x80) as u8,
                _ => b'a' + rng.below(26) as u8,
            })
            .collect();
        if n != b"." && n != b".." {
            return n;
        }
    }
}

struct Gen {
    rng: Rng,
    out: String,
    /// Paths of non-directory primary entries, for hardlinks.
    files: Vec<Vec<u8>>,
    shared_xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    base_time: u64,
}

impl Gen {
    fn mtime(&mut self) -> String {
        if self.rng.chance(60) {
            format!("{}.0", self.base_time)
        } else {
            format!(
                "{}.{}",
                self.base_time + self.rng.below(1 << 33),
                self.rng.below(1_000_000_000)
            )
        }
    }

    fn ids(&mut self) -> (u64, u64) {
        let mut id = || {
            if self.rng.chance(20) {
                65536 + self.rng.below(1 << 31)
            } else {
                self.rng.below(1000)
            }
        };
        (id(), id())
    }

    fn xattrs(&mut self) -> String {
        let mut s = String::new();
        let n = match self.rng.below(10) {
            0..=4 => 0,
            5..=8 => 1 + self.rng.below(3),
            _ => 4 + self.rng.below(20),
        };
        let mut keys: Vec<Vec<u8>> = Vec::new();
        for _ in 0..n {
            let (k, v) = if self.rng.chance(50) {
                let i = self.rng.below(self.shared_xattrs.len() as u64) as usize;
                self.shared_xattrs[i].clone()
            } else {
                let prefix: &[u8] = match self.rng.below(7) {
                    0 => b"user.",
                    1 => b"trusted.",
                    2 => b"security.",
                    3 => b"trusted.overlay.",
                    4 => b"system.posix_acl_access",
                    5 => b"lustre.",
                    _ => b"user.overlay.",
                };
                let mut k = prefix.to_vec();
                if prefix != b"system.posix_acl_access" || self.rng.chance(50) {
                    k.extend(name(&mut self.rng).iter().filter(|&&c| c != 0).take(40));
                }
                let vlen = match self.rng.below(20) {
                    0 => 2000 + self.rng.below(2000) as usize,
                    1 => 0,
                    _ => self.rng.below(80) as usize,
                };
                (k, self.rng.bytes(vlen))
            };
            if keys.contains(&k) {
                continue;
            }
            keys.push(k.clone());
            s.push(' ');
            esc(&mut s, &k);
            s.push('=');
            esc(&mut s, &v);
        }
        s
    }

    #[allow(clippy::too_many_arguments)]
    fn line(
        &mut self,
        path: &[u8],
        size: u64,
        mode: u32,
        nlink: u64,
        rdev: u64,
        payload: &str,
        content: &str,
        digest: &str,
    ) {
        let (uid, gid) = self.ids();
        let mtime = self.mtime();
        let xattrs = self.xattrs();
        let mut s = String::new();
        esc(&mut s, path);
        let _ = writeln!(
            s,
            " {size} {mode:o} {nlink} {uid} {gid} {rdev} {mtime} {payload} {content} {digest}{xattrs}"
        );
        self.out.push_str(&s);
    }

    fn dir(&mut self, path: &[u8], depth: u32, budget: &mut u32) {
        let n_entries = match self.rng.below(30) {
            0 => 300 + self.rng.below(400),
            1..=3 => 40 + self.rng.below(60),
            _ => self.rng.below(12),
        };
        let mut names: Vec<Vec<u8>> = (0..n_entries).map(|_| name(&mut self.rng)).collect();
        names.sort();
        names.dedup();
        for n in names {
            if *budget == 0 {
                return;
            }
            *budget -= 1;
            let mut p = path.to_vec();
            if p != b"/" {
                p.push(b'/');
            }
            p.extend_from_slice(&n);
            let kind = self.rng.below(100);
            match kind {
                0..=11 if depth < 40 => {
                    let mode = 0o40000 | self.perm();
                    self.line(&p, 4096, mode, 2, 0, "-", "-", "-");
                    let deeper = if self.rng.chance(10) { 40 } else { depth + 1 };
                    self.dir(&p, deeper, budget);
                }
                12..=17 if !self.files.is_empty() => {
                    let t = self.files[self.rng.below(self.files.len() as u64) as usize].clone();
                    let mut target = String::new();
                    esc(&mut target, &t);
                    // Hardlink lines carry only the path and target.
                    let mut s = String::new();
                    esc(&mut s, &p);
                    let _ = writeln!(s, " 0 @100644 0 0 0 0 0.0 {target} - -");
                    self.out.push_str(&s);
                }
                18..=27 => {
                    let len = if self.rng.chance(10) {
                        4000 + self.rng.below(96)
                    } else {
                        1 + self.rng.below(100)
                    };
                    let target: Vec<u8> = (0..len).map(|_| b'a' + self.rng.below(26) as u8).collect();
                    let mut t = String::new();
                    esc(&mut t, &target);
                    self.line(&p, len, 0o120777, 1, 0, &t, "-", "-");
                    self.files.push(p);
                }
                28..=31 => {
                    let (mode, rdev) = match self.rng.below(5) {
                        0 => (0o010644, 0),
                        1 => (0o140755, 0),
                        2 => (0o020000 | self.perm(), 0),
                        3 => (0o020000 | self.perm(), self.rng.below(1 << 32)),
                        _ => (0o060000 | self.perm(), self.rng.below(1 << 32)),
                    };
                    self.line(&p, 0, mode, 1, rdev, "-", "-", "-");
                    self.files.push(p);
                }
                32..=51 => {
                    let size = match self.rng.below(10) {
                        0 => 0,
                        1 => 4000 + self.rng.below(1001),
                        2 => 2000 + self.rng.below(2000),
                        _ => 1 + self.rng.below(200),
                    };
                    let data = self.rng.bytes(size as usize);
                    let mut c = String::new();
                    esc(&mut c, &data);
                    if size == 0 {
                        c = "-".into();
                    }
                    let nlink = 1 + self.rng.below(3);
                    let mode = 0o100000 | self.perm();
                    self.line(&p, size, mode, nlink, 0, "-", &c, "-");
                    self.files.push(p);
                }
                _ => {
                    let size = match self.rng.below(12) {
                        0 => (1 << 32) + self.rng.below(1 << 40),
                        1 => 1 << (12 + self.rng.below(31)),
                        2 => (1u64 << 43) * 1024 - self.rng.below(4096),
                        _ => 65 + self.rng.below(1 << 24),
                    };
                    let d = self.rng.bytes(32);
                    let h: String = d.iter().map(|b| format!("{b:02x}")).collect();
                    let payload = if self.rng.chance(90) {
                        format!("{}/{}", &h[..2], &h[2..])
                    } else {
                        "-".into()
                    };
                    let digest = if self.rng.chance(90) { h.clone() } else { "-".into() };
                    let nlink = 1 + self.rng.below(3);
                    let mode = 0o100000 | self.perm();
                    self.line(&p, size, mode, nlink, 0, &payload, "-", &digest);
                    self.files.push(p);
                }
            }
        }
    }

    fn perm(&mut self) -> u32 {
        [0o755, 0o644, 0o600, 0o4755, 0o1777, 0o2711, 0o000][self.rng.below(7) as usize]
    }
}

/// A dump with up to `max_entries` entries, deterministic in `seed`.
pub fn generate_dump(seed: u64, max_entries: u32) -> String {
    let mut rng = Rng::new(seed);
    let shared_xattrs = (0..6)
        .map(|i| {
            let v = rng.bytes(if i == 0 { 3000 } else { 1 + i * 7 });
            (format!("user.shared{i}").into_bytes(), v)
        })
        .chain([(b"security.selinux".to_vec(), b"system_u:object_r:usr_t:s0".to_vec())])
        .collect();
    let mut g = Gen {
        rng,
        out: String::new(),
        files: Vec::new(),
        shared_xattrs,
        base_time: 1_600_000_000,
    };
    g.line(b"/", 4096, 0o40755, 2, 0, "-", "-", "-");
    let mut budget = max_entries;
    g.dir(b"/", 0, &mut budget);
    g.out
}

const SEEDS: std::ops::Range<u64> = 1..41;

fn build(dump_text: &str, version: (u32, u32)) -> Result<Vec<u8>, String> {
    let tree = dump::parse(BufReader::new(dump_text.as_bytes()), ParseOptions::default()).map_err(|e| e.to_string())?;
    let image = erofs::write_image(
        &tree,
        &WriteOptions {
            min_version: version.0,
            max_version: version.1,
        },
    )
    .map_err(|e| e.to_string())?;
    Ok(image.bytes)
}

fn recorded_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/generated.sha256")
}

fn reference_hash(mkcomposefs: &Path, dump_text: &str, version: (u32, u32)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("t.dump");
    let img = dir.path().join("t.img");
    std::fs::write(&d, dump_text).unwrap();
    let st = std::process::Command::new(mkcomposefs)
        .arg("--from-file")
        .arg(format!("--min-version={}", version.0))
        .arg(format!("--max-version={}", version.1))
        .arg(&d)
        .arg(&img)
        .output()
        .unwrap();
    if !st.status.success() {
        return format!("error: {}", String::from_utf8_lossy(&st.stderr).trim());
    }
    hex::encode(Sha256::digest(std::fs::read(&img).unwrap()))
}

#[test]
fn generated_trees_match_reference() {
    let reference = std::env::var_os("TILEFS_MKCOMPOSEFS").map(PathBuf::from);
    let bless = std::env::var_os("TILEFS_BLESS").is_some();
    let recorded = std::fs::read_to_string(recorded_path()).unwrap_or_default();
    let mut lines = Vec::new();
    let mut compared = 0;
    for seed in SEEDS {
        let text = generate_dump(seed, 1500);
        for version in [(0, 1), (0, 0), (1, 1)] {
            let key = format!("{seed} {}-{}", version.0, version.1);
            let ours = match build(&text, version) {
                Ok(bytes) => hex::encode(Sha256::digest(&bytes)),
                Err(_) => "error".to_string(),
            };
            let want = match &reference {
                Some(r) => {
                    let h = reference_hash(r, &text, version);
                    if h.starts_with("error") {
                        "error".to_string()
                    } else {
                        h
                    }
                }
                None => recorded
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("{key} ")))
                    .unwrap_or_else(|| panic!("no recorded reference hash for {key}; run with TILEFS_MKCOMPOSEFS"))
                    .to_string(),
            };
            if ours != want {
                let p = std::env::temp_dir().join(format!("tilefs-generated-{seed}.dump"));
                std::fs::write(&p, &text).unwrap();
                panic!(
                    "seed {seed} version {version:?}: ours {ours}, reference {want} (dump saved to {})",
                    p.display()
                );
            }
            lines.push(format!("{key} {want}"));
            compared += (want != "error") as usize;
        }
    }
    if bless {
        std::fs::create_dir_all(recorded_path().parent().unwrap()).unwrap();
        std::fs::write(recorded_path(), lines.join("\n") + "\n").unwrap();
    }
    eprintln!("{compared} generated images identical to the reference's");
    assert!(compared > 60, "only {compared} generated trees built at all");
}

/// A tree with every feature must actually have them: guard the generator.
#[test]
fn generator_covers_the_format() {
    let all: String = SEEDS.map(|s| generate_dump(s, 1500)).collect();
    for needle in [
        " @100644 ",
        " 120777 ",
        " 10644 ",
        " 140755 ",
        "\\x0a",
        "\\x3d",
        "\\x20",
        "trusted.overlay",
        "user.shared0",
    ] {
        assert!(all.contains(needle), "generator never produced {needle:?}");
    }
    let trees: Vec<_> = SEEDS
        .map(|s| {
            dump::parse(
                BufReader::new(generate_dump(s, 1500).as_bytes()),
                ParseOptions::default(),
            )
        })
        .filter_map(Result::ok)
        .collect();
    assert!(trees.len() * 2 > SEEDS.count(), "most generated dumps must parse");
    let inodes = || trees.iter().flat_map(|t| t.inodes.iter());
    assert!(inodes().any(|i| i.size > 1 << 32), "no file over 4 GiB");
    assert!(inodes().any(|i| i.uid > 65535));
    assert!(inodes().any(|i| i.entries.len() > 300), "no directory spanning blocks");
    assert!(inodes().any(|i| i.content.as_ref().is_some_and(|c| c.len() > 4096)));
    assert!(inodes().any(|i| i.payload.as_ref().is_some_and(|c| c.len() > 4000) && !i.is_reg()));
}
