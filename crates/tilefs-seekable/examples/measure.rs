//! Measures a seek index on a real layer: its size against the compressed
//! blob, the cost of building it during the stream against plain
//! decompression, and reading 1 MiB from the middle through a checkpoint
//! against decompressing from the start.
//!
//!     cargo run --release -p tilefs-seekable --example measure -- LAYER.tar.gz|LAYER.tar.zst [SPAN...]
//!
//! The blob is read into memory first, so disk speed plays no part;
//! times are the best of three runs.

// A program: it prints what it measured.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::{self, BufReader, Read};
use std::time::{Duration, Instant};

use tilefs_seekable::gzip::{self, GzipIndexer};
use tilefs_seekable::zstd::{self as zst, ZstdIndexer};
use tilefs_seekable::SeekIndex;

fn drain(mut r: impl Read) -> u64 {
    let mut buf = vec![0u8; 64 << 10];
    let mut n = 0;
    loop {
        match r.read(&mut buf).unwrap() {
            0 => return n,
            k => n += k as u64,
        }
    }
}

fn best<T>(runs: usize, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut best = Duration::MAX;
    let mut out = None;
    for _ in 0..runs {
        let t = Instant::now();
        let v = f();
        best = best.min(t.elapsed());
        out = Some(v);
    }
    (best, out.unwrap())
}

fn plain<'a>(blob: &'a [u8], gz: bool) -> Box<dyn Read + 'a> {
    let input = BufReader::with_capacity(1 << 20, blob);
    if gz {
        Box::new(flate2::bufread::MultiGzDecoder::new(input))
    } else {
        Box::new(zstd::Decoder::with_buffer(input).unwrap())
    }
}

fn index(blob: &[u8], gz: bool, span: u64) -> SeekIndex {
    let input = BufReader::with_capacity(1 << 20, blob);
    if gz {
        let mut ix = GzipIndexer::with_span(input, span);
        drain(&mut ix);
        ix.finish().unwrap()
    } else {
        let mut ix = ZstdIndexer::with_span(input, span).unwrap();
        drain(&mut ix);
        ix.finish().unwrap()
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: measure LAYER [SPAN...]");
    let blob = std::fs::read(path).unwrap();
    let gz = blob.starts_with(&[0x1f, 0x8b]);
    let default = if gz { gzip::DEFAULT_SPAN } else { zst::DEFAULT_SPAN };
    let mut spans: Vec<u64> = args[2..].iter().map(|s| s.parse().unwrap()).collect();
    if spans.is_empty() {
        spans.push(default);
    }
    let mib = |n: u64| n as f64 / (1 << 20) as f64;
    println!(
        "{path}: {:.1} MiB compressed ({})",
        mib(blob.len() as u64),
        if gz { "gzip" } else { "zstd" }
    );

    let (t_plain, size) = best(3, || drain(plain(&blob, gz)));
    println!(
        "plain decompression: {:.1} MiB in {t_plain:.2?} ({:.0} MiB/s)",
        mib(size),
        mib(size) / t_plain.as_secs_f64()
    );

    let mut last = None;
    for span in spans {
        let (t, ix) = best(3, || index(&blob, gz, span));
        let encoded = ix.encode().len();
        println!(
            "span {:.2} MiB: {} checkpoints, index {} bytes = {:.3}% of the blob; indexing {t:.2?}, {:+.1}% against plain",
            mib(span),
            ix.checkpoints().len(),
            encoded,
            encoded as f64 * 100.0 / blob.len() as f64,
            (t.as_secs_f64() / t_plain.as_secs_f64() - 1.0) * 100.0
        );
        last = Some(ix);
    }
    let ix = last.unwrap();

    // 1 MiB from the middle.
    let a = ix.uncompressed_size() / 2;
    let b = a + (1 << 20);
    let f = ix.fetch_range(a..b).unwrap();
    let fetched = &blob[f.start as usize..f.end as usize];
    let mut out = vec![0u8; (b - a) as usize];
    let (t_cp, ()) = best(5, || ix.read_at(a..b, fetched, &mut out).unwrap());
    let (t_start, from_start) = best(3, || {
        let mut r = plain(&blob, gz);
        io::copy(&mut (&mut r).take(a), &mut io::sink()).unwrap();
        let mut v = vec![0u8; (b - a) as usize];
        r.read_exact(&mut v).unwrap();
        v
    });
    assert!(out == from_start, "the checkpoint read differs");
    println!(
        "1 MiB at {:.1} MiB: through a checkpoint {t_cp:.2?} ({:.2} MiB fetched), from the start {t_start:.2?} ({:.1} MiB fetched)",
        mib(a),
        mib(fetched.len() as u64),
        mib(blob.len() as u64)
    );
}
