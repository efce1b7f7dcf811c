//! tilefs-seekable: random access into the compressed layers registries
//! already hold, for lazy starts without converting images.
//!
//! - [`gzip`]: a `Read` adapter for the pull's single pass over a gzip
//!   layer that records checkpoints (zran-style: deflate block boundaries
//!   with their leftover bits and 32 KiB window, or member starts) about
//!   every few MiB, and decoding from one;
//! - [`zstd`]: the same for zstd layers, at frame starts (a layer of one
//!   frame cannot be entered mid-stream: fetched whole);
//! - [`SeekIndex`]: the checkpoints of one layer, what a range of the tar
//!   stream costs to fetch ([`SeekIndex::fetch_range`]) and its reading
//!   from the fetched bytes ([`SeekIndex::read_at`]); serialized as
//!   [`format`](mod@format) specifies;
//! - [`toc`]: the tables of contents of eStargz and zstd:chunked layers,
//!   which need no index: footers, the ranges to fetch, the table checked
//!   against the digest in the layer's annotations, and every regular
//!   file's chunks with their ranges and digests ([`toc::Toc::read_chunk`]).
//!
//! Measured (`examples/measure.rs`; 2 cores shared with other builds, so
//! times are the best of three and approximate), on a tar of /usr/share
//! (685 MiB; gzip -6: 300 MiB, zstd -3: 287 MiB) and a 215 MiB gzip layer
//! of its first 439 MiB:
//!
//! | what | result |
//! |---|---|
//! | gzip index at the default 4 MiB span | 0.84% of the blob (168 checkpoints, 2.65 MB) |
//! | zstd index, one frame (`zstd`) / 86 frames (`pzstd`) | 68 bytes (fetched whole) / 2.4 KB |
//! | indexing during the stream, against flate2 (zlib-rs) alone | +8-14% (215 MiB layer, 1.55 s against 1.37 s; miniz_oxide inflates about 8% slower than zlib-rs) |
//! | zstd indexing, against the zstd crate alone | within noise (±5%) |
//! | 1 MiB from the middle of the 215 MiB gzip layer | 4.7 ms through a checkpoint (1.7 MiB fetched), 716 ms from the start |
//!
//! Nothing here fetches or mounts: callers hand in the bytes of the ranges
//! this crate names. Every parser is bounded and fuzzed
//! (`fuzz/fuzz_targets/seekable_*.rs`); bytes read through a checkpoint are
//! what the compressed stream says, to be checked by the caller against
//! the digest it trusts (chunks of a table of contents are checked here).

mod digest;
mod error;
pub mod format;
pub mod gzip;
mod index;
mod input;
mod time;
pub mod toc;
pub mod zstd;

pub use digest::Digest;
pub use error::{Error, Result};
pub use index::{Checkpoint, Codec, Resume, SeekIndex, Window, MAX_WINDOW};
pub use time::{parse_rfc3339, Timestamp};
