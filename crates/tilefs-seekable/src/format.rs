//! The serialized seek index, version 1: the specification.
//!
//! This format is tilefs's own. A seek index describes one compressed
//! layer blob (gzip or zstd) by *checkpoints*: places where decoding can
//! start without the bytes before them. It is made while the layer
//! streams through a pull ([`crate::gzip::GzipIndexer`],
//! [`crate::zstd::ZstdIndexer`]) and read by [`crate::SeekIndex::decode`],
//! which refuses anything this page does not allow.
//!
//! All integers are little-endian. Offsets count bytes from the start of
//! the compressed blob ("compressed") or of the uncompressed stream, the
//! tar archive ("uncompressed").
//!
//! # Layout
//!
//! ```text
//! header       40 bytes
//! checkpoints  count × 28 bytes
//! windows      the stored windows, in checkpoint order, back to back
//! ```
//!
//! Nothing follows the last window: the length of the whole is exactly
//! 40 + 28 × count + the sum of the checkpoints' `stored` fields.
//!
//! ## Header
//!
//! | offset | size | field | value |
//! |---|---|---|---|
//! | 0 | 8 | magic | `TFSEEKIX` |
//! | 8 | 2 | version | 1 |
//! | 10 | 1 | codec | 1 gzip (RFC 1952, one member or more), 2 zstd (RFC 8878, one frame or more, skippable frames allowed) |
//! | 11 | 1 | reserved | 0 |
//! | 12 | 4 | count | number of checkpoints, at least 1 |
//! | 16 | 8 | compressed size | size of the blob |
//! | 24 | 8 | uncompressed size | size of the stream it decodes to |
//! | 32 | 8 | span | the spacing asked for when indexing, at least 1 |
//!
//! ## Checkpoint
//!
//! | offset | size | field | meaning |
//! |---|---|---|---|
//! | 0 | 8 | compressed | the first byte of the blob to fetch |
//! | 8 | 8 | uncompressed | the offset of the first byte decoded from there |
//! | 16 | 4 | window size | uncompressed length of the window, 0 to 32768 |
//! | 20 | 4 | stored | length of the window in the windows area |
//! | 24 | 1 | kind | 0 stream start, 1 deflate block |
//! | 25 | 1 | bits | kind 1: bits of the block in the byte before `compressed`, 0 to 7 |
//! | 26 | 1 | bit value | kind 1: those bits, in the low `bits` bits; the others 0 |
//! | 27 | 1 | reserved | 0 |
//!
//! **Kind 0, stream start**: a gzip member header (gzip) or a zstd frame,
//! skippable or not (zstd), begins at `compressed`. Bits, bit value and
//! the window sizes are 0. The decoder starts as at the start of a blob.
//!
//! **Kind 1, deflate block** (gzip only): a deflate block of a member
//! begins `bits` bits before `compressed`, in the byte at `compressed - 1`
//! whose high `bits` bits they are (deflate fills bytes from the least
//! significant bit, so the block's first bits are the unused high bits of
//! that byte). They are kept in the checkpoint so that the fetch starts at
//! `compressed`. With `bits` = 0 the block starts at `compressed` exactly.
//! The window is the last `window size` bytes that the member decoded
//! before the block: 32768, or all of the member's output if it had
//! made less. The block and those after it may copy from the window but
//! never from before it: a deflate distance reaching past the window is an
//! error, as it is past the start of a member. The member's CRC-32 and
//! length cannot be checked when decoding starts here; the reader checks
//! what it reads against the digests it trusts.
//!
//! A window is stored as one zstd frame (RFC 8878) that decodes to exactly
//! `window size` bytes; `stored` is 0 exactly when `window size` is 0.
//!
//! ## Rules
//!
//! - The first checkpoint is kind 0 at compressed 0, uncompressed 0.
//! - Each further checkpoint has a larger compressed offset than the one
//!   before and an uncompressed offset at least `span` past it.
//! - Every compressed offset is below the compressed size; every
//!   uncompressed offset is at most the uncompressed size.
//! - A window is no larger than the checkpoint's uncompressed offset.
//!
//! A stream with a single checkpoint (such as a zstd layer written as one
//! frame) cannot be entered anywhere else: a reader fetches it whole.
//!
//! # Reading a range
//!
//! To read uncompressed bytes `[a, b)`: take the last checkpoint at or
//! before `a`, fetch the blob from its compressed offset to that of the
//! first checkpoint at or after `b` (or to the end of the blob), decode
//! from the checkpoint, drop the first `a - uncompressed` bytes and keep
//! `b - a`. Decoding crosses gzip members and zstd frames as the stream
//! does.
//!
//! # Sizes
//!
//! Windows dominate: 32 KiB compressed about as well as the layer around
//! them, so a gzip index is about `32 KiB / span` of the compressed blob
//! (measured on a tar of /usr/share at gzip -6, 300 MiB: 3.2%, 1.6%,
//! 0.84% and 0.4% at spans of 1, 2, 4 and 8 MiB). A zstd checkpoint costs
//! 28 bytes.

/// The first bytes of every seek index.
pub const MAGIC: &[u8; 8] = b"TFSEEKIX";
/// The version this crate writes and reads.
pub const VERSION: u16 = 1;
/// The length of the header.
pub const HEADER_LEN: usize = 40;
/// The length of one checkpoint record.
pub const CHECKPOINT_LEN: usize = 28;
