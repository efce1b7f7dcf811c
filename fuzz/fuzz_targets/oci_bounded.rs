//! The bounded readers. `bounded::read_at_most` over any bytes, handed
//! over in pieces of any size: the bytes whole when they are within its
//! limit, refused (and no more than one byte past the limit read) when
//! not. The layer reader over the same bytes as a tar stream, told to stop
//! after any number of reads and given a small budget of sparse holes:
//! entries or an error naming the layer (or "interrupted"), never a panic,
//! and never more holes taken than the budget held.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::io::{self, Read};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use tilefs_oci::bounded::{read_at_most, ReadError};
use tilefs_oci::layer::{read_entries, ReadOptions};
use tilefs_oci::OciError;
use tilefs_store::ingest::{Ingest, Method};
use tilefs_store::Store;

fn store() -> &'static Store {
    static STORE: OnceLock<Store> = OnceLock::new();
    STORE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tilefs-fuzz-store-{}", std::process::id()));
        Store::create(&dir).unwrap()
    })
}

/// Hands `data` over `piece` bytes at a time, counting what it gave.
struct Pieces<'a> {
    data: &'a [u8],
    piece: usize,
    given: usize,
}

impl Read for Pieces<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.data.len().min(buf.len()).min(self.piece);
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        self.given += n;
        Ok(n)
    }
}

/// Holes the layer reader may take here: a megabyte.
const BUDGET: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let Some((&[limit, piece, stop_after], rest)) = data.split_first_chunk::<3>() else {
        return;
    };
    let limit = u64::from(limit) * 7;
    let piece = usize::from(piece).max(1);
    let mut r = Pieces { data: rest, piece, given: 0 };
    match read_at_most(&mut r, limit) {
        Ok(v) => assert_eq!(v, rest),
        Err(ReadError::TooLarge(l)) => assert!(l == limit && rest.len() as u64 > limit),
        Err(ReadError::Io(e)) => panic!("{e}"),
    }
    assert!(r.given as u64 <= limit + 1, "{} bytes read past a limit of {limit}", r.given);

    let reads = AtomicU64::new(0);
    let stop = || stop_after != 255 && reads.fetch_add(1, Relaxed) >= u64::from(stop_after);
    let budget = AtomicU64::new(BUDGET);
    let ingest = Ingest::new(store(), Method::Copy).unwrap();
    let opts = ReadOptions {
        stop: Some(&stop),
        sparse_budget: Some(&budget),
        ..ReadOptions::default()
    };
    let mut tar = Pieces { data: rest, piece, given: 0 };
    match read_entries(&mut tar, "fuzz", &ingest, opts) {
        Ok(_) | Err(OciError::Interrupted) => {}
        Err(e) => assert!(e.to_string().starts_with("layer fuzz"), "{e}"),
    }
    assert!(budget.load(Relaxed) <= BUDGET);
});
