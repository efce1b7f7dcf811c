//! Seek indexes (tilefs-seekable's serialized form) from anywhere: any
//! bytes decode or are refused, never a panic or an allocation past what
//! the bytes hold. What decodes encodes back to the same bytes, and reads
//! through it from any compressed bytes give the range or an error.
//!
//! Input: a u16 length, that many bytes of index, then the "fetched"
//! compressed bytes; with the first byte's low bit set, the index part is
//! instead the fields of one hostile deflate checkpoint (bits, bit value,
//! a window), written into a valid index, so that resuming with hostile
//! state is reached without first finding the format.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tilefs_seekable::SeekIndex;

/// An index with a stream start and one deflate checkpoint built from
/// `fields`: [bits, value, window length (2 bytes), window...].
fn hostile(fields: &[u8], fetched_len: u64) -> Vec<u8> {
    let (bits, value) = (
        fields.first().copied().unwrap_or(0) & 7,
        fields.get(1).copied().unwrap_or(0),
    );
    let value = value & ((1u16 << bits) - 1) as u8;
    let wlen = u16::from_le_bytes([fields.get(2).copied().unwrap_or(0), fields.get(3).copied().unwrap_or(0)]) as usize;
    let window: Vec<u8> = fields.iter().skip(4).copied().cycle().take(wlen.min(32768)).collect();
    let stored = if window.is_empty() {
        Vec::new()
    } else {
        zstd::bulk::compress(&window, 1).unwrap()
    };
    let mut out = Vec::new();
    out.extend_from_slice(b"TFSEEKIX");
    out.extend_from_slice(&1u16.to_le_bytes());
    out.push(1);
    out.push(0);
    out.extend_from_slice(&2u32.to_le_bytes());
    out.extend_from_slice(&(fetched_len + 2).to_le_bytes());
    out.extend_from_slice(&(1u64 << 24).to_le_bytes());
    out.extend_from_slice(&1u64.to_le_bytes());
    for (c, u, size, st, kind) in [
        (0u64, 0u64, 0u32, 0u32, 0u8),
        (1, window.len() as u64 + 1, window.len() as u32, stored.len() as u32, 1),
    ] {
        out.extend_from_slice(&c.to_le_bytes());
        out.extend_from_slice(&u.to_le_bytes());
        out.extend_from_slice(&size.to_le_bytes());
        out.extend_from_slice(&st.to_le_bytes());
        out.extend_from_slice(&[
            kind,
            if kind == 1 { bits } else { 0 },
            if kind == 1 { value } else { 0 },
            0,
        ]);
    }
    out.extend_from_slice(&stored);
    out
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let len = (u16::from_le_bytes([data[0], data[1]]) >> 1) as usize;
    let rest = &data[2..];
    let (part, fetched) = rest.split_at(len.min(rest.len()));
    let encoded = if data[0] & 1 == 1 {
        hostile(part, fetched.len() as u64)
    } else {
        part.to_vec()
    };
    let Ok(index) = SeekIndex::decode(&encoded) else {
        assert!(data[0] & 1 == 0, "a hostile index of valid form is refused");
        return;
    };
    assert_eq!(index.encode(), encoded, "decode then encode changes the bytes");
    // A range near each checkpoint and one over the whole stream, at most
    // 1 MiB each, read from the fetched bytes.
    let n = index.uncompressed_size();
    let mut ranges: Vec<(u64, u64)> = index
        .checkpoints()
        .iter()
        .map(|c| (c.uncompressed, c.uncompressed + 4096))
        .collect();
    ranges.push((0, n));
    for (a, b) in ranges.into_iter().take(8) {
        let a = a.min(n);
        let b = b.min(n).min(a + (1 << 20));
        let f = index.fetch_range(a..b).unwrap();
        assert!(f.start <= f.end && f.end <= index.compressed_size());
        let mut out = vec![0u8; (b - a) as usize];
        let _ = index.read_at(a..b, fetched, &mut out);
    }
});
