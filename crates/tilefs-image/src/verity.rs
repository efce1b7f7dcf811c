//! fs-verity SHA-256 digests (4 KiB blocks, no salt), as the kernel and
//! `fsverity digest` compute them.
//!
//! The file is cut into 4 KiB blocks; each block's SHA-256 goes into a
//! level of the Merkle tree, 128 hashes to a 4 KiB tree block (the last one
//! of a level zero-padded), each level hashed into the one above until a
//! single hash remains: the root. A file of one block has that block's hash
//! as its root; an empty file has an all-zero root. The digest is the
//! SHA-256 of a 256-byte descriptor holding the root hash and data size.
//!
//! [`Hasher`] streams: it keeps one partial block per level, so memory is
//! proportional to the tree height, and whole data blocks are hashed
//! straight from the caller's buffer.

use sha2::{Digest, Sha256};
use std::io;

/// Data and tree block size.
pub const BLOCK_SIZE: usize = 4096;
/// Size of a SHA-256 hash.
const HASH_SIZE: usize = 32;

/// Descriptor constants (`struct fsverity_descriptor`).
const DESC_VERSION: u8 = 1;
const DESC_HASH_ALG_SHA256: u8 = 1;
const DESC_LOG_BLOCKSIZE: u8 = 12;
const DESC_SIZE: usize = 256;

/// SHA-256 of one block (`BLOCK_SIZE` bytes exactly).
#[inline]
fn hash_block(block: &[u8]) -> [u8; HASH_SIZE] {
    debug_assert_eq!(block.len(), BLOCK_SIZE);
    Sha256::digest(block).into()
}

/// Calls `f` with the hash of each block of `data` (whole blocks), in
/// order: two blocks at a time where the CPU can (see [`crate::sha_x2`]).
#[inline]
fn hash_blocks(data: &[u8], mut f: impl FnMut([u8; HASH_SIZE])) {
    debug_assert_eq!(data.len() % BLOCK_SIZE, 0);
    let mut blocks = data.chunks_exact(BLOCK_SIZE);
    if data.len() >= 2 * BLOCK_SIZE && crate::sha_x2::available() {
        while let (Some(a), Some(b)) = (blocks.next(), blocks.next()) {
            let (Ok(a), Ok(b)) = (a.try_into(), b.try_into()) else {
                unreachable!("chunks_exact gives whole blocks")
            };
            let (ha, hb) = crate::sha_x2::hash_4k_x2(a, b);
            f(ha);
            f(hb);
        }
        // An odd block was taken by the last `next()` above: hash it.
        if data.len() / BLOCK_SIZE % 2 == 1 {
            f(hash_block(&data[data.len() - BLOCK_SIZE..]));
        }
        return;
    }
    for b in blocks {
        f(hash_block(b));
    }
}

/// One level of the tree under construction: the hashes of the level below
/// that do not yet fill a tree block, and how many hashes it has received.
struct Level {
    block: Box<[u8; BLOCK_SIZE]>,
    /// Bytes used in `block` (a multiple of `HASH_SIZE`).
    used: usize,
    /// Hashes received in total.
    count: u64,
}

impl Level {
    fn new() -> Level {
        Level {
            block: Box::new([0u8; BLOCK_SIZE]),
            used: 0,
            count: 0,
        }
    }
}

/// Streaming fs-verity digest computation.
pub struct Hasher {
    /// A data block not yet complete.
    partial: Box<[u8; BLOCK_SIZE]>,
    partial_len: usize,
    /// Bytes of data seen.
    size: u64,
    /// Tree levels, leaves (hashes of data blocks) first.
    levels: Vec<Level>,
}

impl Hasher {
    pub fn new() -> Hasher {
        Hasher {
            partial: Box::new([0u8; BLOCK_SIZE]),
            partial_len: 0,
            size: 0,
            levels: Vec::new(),
        }
    }

    /// Adds a hash to level `i`, hashing full tree blocks upwards.
    fn push_hash(&mut self, mut i: usize, mut hash: [u8; HASH_SIZE]) {
        loop {
            if i == self.levels.len() {
                self.levels.push(Level::new());
            }
            let level = &mut self.levels[i];
            level.block[level.used..level.used + HASH_SIZE].copy_from_slice(&hash);
            level.used += HASH_SIZE;
            level.count += 1;
            if level.used < BLOCK_SIZE {
                return;
            }
            hash = hash_block(&level.block[..]);
            level.used = 0;
            i += 1;
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        self.size += data.len() as u64;
        if self.partial_len > 0 {
            let take = (BLOCK_SIZE - self.partial_len).min(data.len());
            self.partial[self.partial_len..self.partial_len + take].copy_from_slice(&data[..take]);
            self.partial_len += take;
            data = &data[take..];
            if self.partial_len < BLOCK_SIZE {
                return;
            }
            let h = hash_block(&self.partial[..]);
            self.partial_len = 0;
            self.push_hash(0, h);
        }
        let whole = data.len() - data.len() % BLOCK_SIZE;
        hash_blocks(&data[..whole], |h| self.push_hash(0, h));
        let rest = &data[whole..];
        self.partial[..rest.len()].copy_from_slice(rest);
        self.partial_len = rest.len();
    }

    /// Adds `len` zero bytes (a hole) without hashing each block: whole
    /// zero blocks all have the same hash.
    pub fn update_zeros(&mut self, mut len: u64) {
        static ZEROS: [u8; BLOCK_SIZE] = [0u8; BLOCK_SIZE];
        if self.partial_len > 0 {
            let take = ((BLOCK_SIZE - self.partial_len) as u64).min(len);
            self.update(&ZEROS[..take as usize]);
            len -= take;
        }
        let blocks = len / BLOCK_SIZE as u64;
        if blocks > 0 {
            self.push_same(0, hash_block(&ZEROS), blocks);
            self.size += blocks * BLOCK_SIZE as u64;
        }
        self.update(&ZEROS[..(len % BLOCK_SIZE as u64) as usize]);
    }

    /// Adds `n` copies of `hash` to level `i`. Where they fill whole tree
    /// blocks, each of those blocks has one hash, pushed to the level above
    /// without filling the block: a run of zeros costs a few hashes per
    /// level, however long it is (10 TiB of holes hash in microseconds).
    fn push_same(&mut self, i: usize, hash: [u8; HASH_SIZE], mut n: u64) {
        const PER_BLOCK: u64 = (BLOCK_SIZE / HASH_SIZE) as u64;
        while n > 0 {
            let aligned = self.levels.get(i).is_none_or(|l| l.used == 0);
            if !aligned || n < PER_BLOCK {
                self.push_hash(i, hash);
                n -= 1;
                continue;
            }
            if i == self.levels.len() {
                self.levels.push(Level::new());
            }
            let full = n / PER_BLOCK;
            self.levels[i].count += full * PER_BLOCK;
            let block: Vec<u8> = hash.iter().copied().cycle().take(BLOCK_SIZE).collect();
            self.push_same(i + 1, hash_block(&block), full);
            n -= full * PER_BLOCK;
        }
    }

    /// Adds `len` bytes of data given by the hashes of their blocks, as
    /// [`block_hashes`] computes them: lets callers hash parts of a large
    /// file in parallel. The data must start on a block boundary (all data
    /// added so far is a whole number of blocks), and if `len` is not, no
    /// data may follow.
    pub(crate) fn update_block_hashes(&mut self, len: u64, hashes: &[[u8; HASH_SIZE]]) {
        debug_assert_eq!(self.partial_len, 0);
        debug_assert_eq!(self.size % BLOCK_SIZE as u64, 0);
        debug_assert_eq!(hashes.len() as u64, len.div_ceil(BLOCK_SIZE as u64));
        self.size += len;
        for h in hashes {
            self.push_hash(0, *h);
        }
    }

    /// The root hash of the Merkle tree.
    fn root_hash(&mut self) -> [u8; HASH_SIZE] {
        if self.size == 0 {
            return [0u8; HASH_SIZE];
        }
        if self.levels.is_empty() && self.size <= BLOCK_SIZE as u64 {
            // A single data block is its own root.
            self.partial[self.partial_len..].fill(0);
            return hash_block(&self.partial[..]);
        }
        if self.partial_len > 0 {
            self.partial[self.partial_len..].fill(0);
            let h = hash_block(&self.partial[..]);
            self.partial_len = 0;
            self.push_hash(0, h);
        }
        // Close each level bottom-up; the first level that received a
        // single hash, with nothing above it, holds the root.
        let mut i = 0;
        loop {
            let top = i + 1 == self.levels.len();
            let level = &mut self.levels[i];
            if top && level.count == 1 {
                let mut root = [0u8; HASH_SIZE];
                root.copy_from_slice(&level.block[..HASH_SIZE]);
                return root;
            }
            if level.used > 0 {
                level.block[level.used..].fill(0);
                let h = hash_block(&level.block[..]);
                level.used = 0;
                // Always creates or extends the level above.
                self.push_hash(i + 1, h);
            }
            i += 1;
        }
    }

    pub fn finalize(mut self) -> [u8; 32] {
        let root = self.root_hash();
        let mut desc = [0u8; DESC_SIZE];
        desc[0] = DESC_VERSION;
        desc[1] = DESC_HASH_ALG_SHA256;
        desc[2] = DESC_LOG_BLOCKSIZE;
        desc[3] = 0; // salt size
                     // desc[4..8]: reserved
        desc[8..16].copy_from_slice(&self.size.to_le_bytes());
        desc[16..16 + HASH_SIZE].copy_from_slice(&root);
        // The rest (root hash padding to 64 bytes, salt, reserved) is zero.
        Sha256::digest(desc).into()
    }
}

impl Default for Hasher {
    fn default() -> Self {
        Self::new()
    }
}

/// Appends to `out` the hash of each block of `data` (which starts on a
/// block boundary), the last one zero-padded.
pub(crate) fn block_hashes(data: &[u8], out: &mut Vec<[u8; HASH_SIZE]>) {
    let whole = data.len() - data.len() % BLOCK_SIZE;
    hash_blocks(&data[..whole], |h| out.push(h));
    let rest = &data[whole..];
    if !rest.is_empty() {
        let mut last = [0u8; BLOCK_SIZE];
        last[..rest.len()].copy_from_slice(rest);
        out.push(hash_block(&last));
    }
}

/// Digest of a byte slice.
pub fn digest_bytes(data: &[u8]) -> [u8; 32] {
    let mut h = Hasher::new();
    h.update(data);
    h.finalize()
}

/// Digest of a whole file, read with pread (the file offset is only used
/// to find holes). Holes are hashed as zeros without being read, so a
/// sparse 5 GiB file with little data costs little. `progress` gets the
/// number of bytes done after each step.
pub fn digest_file(f: &std::fs::File, mut progress: impl FnMut(u64)) -> io::Result<[u8; 32]> {
    thread_local! {
        // Reused: verifying many small objects should not map and fault
        // in a fresh megabyte each time.
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let size = f.metadata()?.len();
    BUF.with_borrow_mut(|buf| {
        let want = size.clamp(BLOCK_SIZE as u64, 1 << 20) as usize;
        if buf.len() < want {
            buf.resize(want, 0);
        }
        digest_file_with(f, size, buf, &mut progress)
    })
}

fn digest_file_with(
    f: &std::fs::File,
    size: u64,
    buf: &mut [u8],
    progress: &mut dyn FnMut(u64),
) -> io::Result<[u8; 32]> {
    use rustix::fs::SeekFrom;
    use std::os::unix::fs::FileExt;
    let mut h = Hasher::new();
    let mut off = 0u64;
    loop {
        // Where the next data starts: ENXIO means none before the end;
        // a filesystem that cannot tell treats everything as data.
        let data = match rustix::fs::seek(f, SeekFrom::Data(off)) {
            Ok(d) => d.max(off),
            Err(rustix::io::Errno::NXIO) => size.max(off),
            Err(_) => off,
        };
        if data > off {
            h.update_zeros(data - off);
            progress(data - off);
            off = data;
        }
        if off >= size {
            // Data appended since fstat is still read, to the real end.
            let n = read_some(f, buf, off)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            progress(n as u64);
            off += n as u64;
            continue;
        }
        let end = match rustix::fs::seek(f, SeekFrom::Hole(off)) {
            Ok(e) if e > off => e,
            _ => size,
        };
        while off < end {
            let want = ((end - off) as usize).min(buf.len());
            let n = read_some(f, &mut buf[..want], off)?;
            if n == 0 {
                // Shrunk while being read: the digest is of what was there.
                return Ok(h.finalize());
            }
            h.update(&buf[..n]);
            progress(n as u64);
            off += n as u64;
        }
    }

    fn read_some(f: &std::fs::File, buf: &mut [u8], off: u64) -> io::Result<usize> {
        loop {
            match f.read_at(buf, off) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => return r,
            }
        }
    }
    Ok(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_has_zero_root() {
        // Descriptor of an empty file: only the header bytes set.
        let mut desc = [0u8; DESC_SIZE];
        desc[..4].copy_from_slice(&[1, 1, 12, 0]);
        let want: [u8; 32] = Sha256::digest(desc).into();
        assert_eq!(digest_bytes(&[]), want);
    }

    #[test]
    fn single_block_root_is_block_hash() {
        let data = b"hello";
        let mut block = [0u8; BLOCK_SIZE];
        block[..5].copy_from_slice(data);
        let root: [u8; 32] = Sha256::digest(block).into();
        let mut desc = [0u8; DESC_SIZE];
        desc[..4].copy_from_slice(&[1, 1, 12, 0]);
        desc[8..16].copy_from_slice(&5u64.to_le_bytes());
        desc[16..48].copy_from_slice(&root);
        let want: [u8; 32] = Sha256::digest(desc).into();
        assert_eq!(digest_bytes(data), want);
    }

    #[test]
    fn zeros_match_zero_bytes() {
        for (before, zeros) in [
            (0usize, 0u64),
            (0, 5),
            (0, 4096),
            (10, 4086),
            (10, 200_000),
            (4096, 1 << 20),
            (3, 1),
        ] {
            let data: Vec<u8> = (0..before).map(|i| i as u8 | 1).collect();
            let mut h = Hasher::new();
            h.update(&data);
            h.update_zeros(zeros);
            h.update(b"tail");
            let mut all = data.clone();
            all.resize(before + zeros as usize, 0);
            all.extend_from_slice(b"tail");
            assert_eq!(h.finalize(), digest_bytes(&all), "{before} then {zeros} zeros");
        }
    }

    #[test]
    fn long_runs_of_zeros_match_zero_bytes_at_every_alignment() {
        // Runs over several whole tree blocks of one, two and three levels
        // (128, 128^2 blocks), starting at and off tree-block boundaries.
        let block = BLOCK_SIZE as u64;
        for (before, zeros) in [
            (0usize, 128 * block),
            (0, 129 * block + 7),
            (4096 * 5, 128 * 128 * block),
            (4096 * 127, (2 * 128 * 128 + 3) * block),
            (17, 128 * 128 * block + 1),
        ] {
            let data: Vec<u8> = (0..before).map(|i| i as u8 | 1).collect();
            let mut h = Hasher::new();
            h.update(&data);
            h.update_zeros(zeros);
            h.update(b"tail");
            let mut naive = Hasher::new();
            naive.update(&data);
            let chunk = vec![0u8; 1 << 20];
            let mut left = zeros;
            while left > 0 {
                let n = left.min(chunk.len() as u64) as usize;
                naive.update(&chunk[..n]);
                left -= n as u64;
            }
            naive.update(b"tail");
            assert_eq!(h.finalize(), naive.finalize(), "{before} then {zeros} zeros");
        }
        // A hole of 10 TiB costs nothing to hash.
        let t = std::time::Instant::now();
        let mut h = Hasher::new();
        h.update_zeros(10 << 40);
        h.update(b"x");
        h.finalize();
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "{:?}", t.elapsed());
    }

    #[test]
    fn sparse_files_digest_like_their_bytes() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let mib = 1u64 << 20;
        // (offset, length) of data runs, and the file size.
        let layouts: [(&[(u64, usize)], u64); 6] = [
            (&[], 3 * mib + 5),
            (&[(0, 100)], 8 * mib),
            (&[(5 * mib, 70_000)], 5 * mib + 70_000),
            (&[(4096, 10), (2 * mib + 17, 9000), (7 * mib, 1)], 9 * mib + 3),
            (&[(0, 3 * mib as usize)], 3 * mib),
            (&[(mib - 1, 2)], 2 * mib),
        ];
        for (i, (runs, size)) in layouts.iter().enumerate() {
            let path = dir.path().join(format!("f{i}"));
            let f = std::fs::File::create(&path).unwrap();
            f.set_len(*size).unwrap();
            let mut bytes = vec![0u8; *size as usize];
            for &(off, len) in runs.iter() {
                let run: Vec<u8> = (0..len).map(|j| (j as u8).wrapping_mul(31) | 1).collect();
                f.write_all_at(&run, off).unwrap();
                bytes[off as usize..off as usize + len].copy_from_slice(&run);
            }
            let f = std::fs::File::open(&path).unwrap();
            let mut done = 0;
            let got = digest_file(&f, |n| done += n).unwrap();
            assert_eq!(got, digest_bytes(&bytes), "layout {i}");
            assert_eq!(done, *size, "progress of layout {i}");
        }
    }

    #[test]
    fn pieces_match_whole() {
        let data: Vec<u8> = (0..(200 * BLOCK_SIZE + 17) as u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let whole = digest_bytes(&data);
        for step in [1usize, 3, 63, 4095, 4097, 10000] {
            let mut h = Hasher::new();
            let mut rest = &data[..];
            let mut k = 0;
            while !rest.is_empty() {
                // Vary the piece sizes around `step`.
                let n = (step + k % 7).min(rest.len());
                h.update(&rest[..n]);
                rest = &rest[n..];
                k += 1;
            }
            assert_eq!(h.finalize(), whole, "step {step}");
        }
    }

    #[test]
    fn block_hashes_match_streaming() {
        let data = random_bytes(300 * BLOCK_SIZE + 123, 5);
        let whole = digest_bytes(&data);
        for seg in [BLOCK_SIZE, 7 * BLOCK_SIZE, 128 * BLOCK_SIZE, 1000 * BLOCK_SIZE] {
            let mut h = Hasher::new();
            for piece in data.chunks(seg) {
                let mut hashes = Vec::new();
                block_hashes(piece, &mut hashes);
                h.update_block_hashes(piece.len() as u64, &hashes);
            }
            assert_eq!(h.finalize(), whole, "segments of {seg}");
        }
        // Streamed data first, then block hashes.
        let mut h = Hasher::new();
        h.update(&data[..3 * BLOCK_SIZE]);
        let mut hashes = Vec::new();
        block_hashes(&data[3 * BLOCK_SIZE..], &mut hashes);
        h.update_block_hashes((data.len() - 3 * BLOCK_SIZE) as u64, &hashes);
        assert_eq!(h.finalize(), whole);
    }

    /// Deterministic pseudo-random bytes (splitmix64).
    fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut state = seed;
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            out.extend_from_slice(&z.to_le_bytes());
        }
        out.truncate(len);
        out
    }

    /// Compares with `fsverity digest` from fsverity-utils (which
    /// scripts/setup installs: its absence fails the test, never skips it).
    #[test]
    fn matches_fsverity_utils() {
        let tool_ok = std::process::Command::new("fsverity")
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        assert!(
            tool_ok,
            "this test cannot run here: the `fsverity` tool (fsverity-utils) is missing (scripts/setup installs it)"
        );
        let dir = tempfile::tempdir().unwrap();
        let sizes = [
            0usize,
            1,
            4095,
            4096,
            4097,
            128 * 4096,
            128 * 4096 + 1,
            129 * 4096,
            128 * 128 * 4096,
            128 * 128 * 4096 + 1,
            (16 << 20) + 3,
        ];
        for (k, &size) in sizes.iter().enumerate() {
            let data = random_bytes(size, 0x7469_6c65 + k as u64);
            let path = dir.path().join(format!("f{size}"));
            std::fs::write(&path, &data).unwrap();
            let out = std::process::Command::new("fsverity")
                .args(["digest", "--compact"])
                .arg(&path)
                .output()
                .unwrap();
            assert!(out.status.success(), "fsverity digest failed: {out:?}");
            let want = String::from_utf8(out.stdout).unwrap();
            let want = want.trim();
            assert_eq!(hex::encode(digest_bytes(&data)), want, "size {size}");
            let mut h = Hasher::new();
            for piece in data.chunks(4093) {
                h.update(piece);
            }
            assert_eq!(hex::encode(h.finalize()), want, "size {size} in pieces");
            let from_file = digest_file(&std::fs::File::open(&path).unwrap(), |_| {}).unwrap();
            assert_eq!(hex::encode(from_file), want, "size {size} from the file");
        }
    }
}
