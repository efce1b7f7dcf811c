//! Real images (see `make-seeds.sh`), mutated mostly in place by a
//! structure-aware mutator, through the stronger image checks: reading never
//! panics, and a tree that reads writes an image that reads back and
//! rebuilds to the same bytes, directly and through dump text.

#![no_main]

use libfuzzer_sys::{fuzz_mutator, fuzz_target, fuzzer_mutate};

fuzz_target!(|data: &[u8]| tilefs_fuzz::roundtrip_image(data));

/// xorshift64, seeded by libFuzzer.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const SUPER: usize = 1024;
const INODES: usize = 1152;

/// Overwrites 1, 2, 4 or 8 bytes at an offset, as a field would be: with
/// a small change of its value, an interesting value, or bytes copied from
/// elsewhere in the image (nids, offsets and sizes that exist).
fn mutate_field(buf: &mut [u8], rng: &mut Rng) {
    let len = [1, 2, 4, 8][rng.below(4)];
    if buf.len() < len {
        return;
    }
    let pos = match rng.below(8) {
        // The superblock.
        0 => SUPER + rng.below(128),
        // The first inodes: the root and its neighbours.
        1 | 2 => INODES + rng.below(4096),
        _ => rng.below(buf.len()),
    }
    .min(buf.len() - len);
    let field = &mut buf[pos..pos + len];
    let mut v = [0u8; 8];
    v[..len].copy_from_slice(field);
    let old = u64::from_le_bytes(v);
    let new = match rng.below(6) {
        0 => old.wrapping_add(1 + rng.below(16) as u64),
        1 => old.wrapping_sub(1 + rng.below(16) as u64),
        2 => [0, 1, u64::MAX, 0x80, 0x7f, 4095, 4096][rng.below(7)],
        3 => rng.next(),
        _ => {
            let from = rng.below(buf.len() - len + 1);
            v[..len].copy_from_slice(&buf[from..from + len]);
            u64::from_le_bytes(v)
        }
    };
    buf[pos..pos + len].copy_from_slice(&new.to_le_bytes()[..len]);
}

/// Puts back what any reader checks first (magics, header version, block
/// size), so that mutations are spent past them.
fn repair(buf: &mut [u8]) {
    if buf.len() < INODES {
        return;
    }
    buf[0..4].copy_from_slice(&0xd078_629au32.to_le_bytes());
    buf[4..8].copy_from_slice(&1u32.to_le_bytes());
    buf[12] &= 1;
    buf[13..16].fill(0);
    buf[SUPER..SUPER + 4].copy_from_slice(&0xe0f5_e1e2u32.to_le_bytes());
    buf[SUPER + 12] = 12;
}

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    let mut rng = Rng(u64::from(seed) << 32 | 0x9e37_79b9);
    let size = if rng.below(4) == 0 {
        // libFuzzer's own mutations: also insert, erase, cross over.
        fuzzer_mutate(data, size, max_size)
    } else {
        for _ in 0..1 + rng.below(4) {
            mutate_field(&mut data[..size], &mut rng);
        }
        size
    };
    repair(&mut data[..size]);
    size
});
