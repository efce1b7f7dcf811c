//! zstd:chunked: a zstd layer whose files start zstd frames, with its
//! table of contents (the "manifest") in a skippable frame near the end.
//!
//! Blob layout (facts of the format): zstd frames holding the tar stream,
//! cut so that each chunk of a regular file is frames of its own; then
//! three skippable frames (magic `50 2a 4d 18`, a 4-byte little-endian
//! length, the data): the manifest (the table's JSON, zstd-compressed),
//! the tar-split (zstd-compressed), and the footer. The footer's 64 bytes
//! are seven little-endian u64 (manifest offset, compressed length,
//! uncompressed length, manifest type = 1, tar-split offset, compressed
//! length, uncompressed length) and the magic `GNUlInUx`. The layer's
//! annotations say the same: [`MANIFEST_POSITION_ANNOTATION`] as
//! `offset:compressed:uncompressed:type`, [`TAR_SPLIT_POSITION_ANNOTATION`]
//! as `offset:compressed:uncompressed`, and
//! [`MANIFEST_CHECKSUM_ANNOTATION`] the SHA-256 of the compressed
//! manifest.

use std::ops::Range;

use super::json::{parse, Layout};
use super::{Format, Toc, MAX_TOC_JSON};
use crate::digest::Digest;
use crate::error::{Error, Result};

/// The layer annotation holding the digest of the compressed manifest.
pub const MANIFEST_CHECKSUM_ANNOTATION: &str = "io.github.containers.zstd-chunked.manifest-checksum";
/// The layer annotation saying where the manifest is.
pub const MANIFEST_POSITION_ANNOTATION: &str = "io.github.containers.zstd-chunked.manifest-position";
/// The layer annotation saying where the tar-split is.
pub const TAR_SPLIT_POSITION_ANNOTATION: &str = "io.github.containers.zstd-chunked.tarsplit-position";
/// The length of the footer: a skippable frame's 8-byte header and 64
/// bytes of data.
pub const FOOTER_SIZE: u64 = 72;

const SKIPPABLE_MAGIC: [u8; 4] = [0x50, 0x2a, 0x4d, 0x18];
const FOOTER_MAGIC: &[u8; 8] = b"GNUlInUx";
/// The only manifest type there is (a CRFS-style JSON table).
const MANIFEST_TYPE_CRFS: u64 = 1;

/// Where a compressed part of the blob is: the manifest or the tar-split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    pub offset: u64,
    pub compressed_len: u64,
    pub uncompressed_len: u64,
}

impl Position {
    /// The bytes of the blob to fetch.
    pub fn range(&self) -> Range<u64> {
        self.offset..self.offset + self.compressed_len
    }

    fn check(self, what: &str, blob_size: u64) -> Result<Position> {
        let end = self.offset.checked_add(self.compressed_len);
        if self.offset < 8 || end.is_none_or(|e| e > blob_size) {
            return Err(Error::toc(format!(
                "the zstd:chunked {what} at {}+{} is not within the blob's {blob_size} bytes after a frame header",
                self.offset, self.compressed_len
            )));
        }
        if self.compressed_len == 0 || self.uncompressed_len > MAX_TOC_JSON || self.compressed_len > MAX_TOC_JSON {
            return Err(Error::toc(format!(
                "the zstd:chunked {what} of {} bytes ({} compressed) is empty or over {MAX_TOC_JSON}",
                self.uncompressed_len, self.compressed_len
            )));
        }
        Ok(self)
    }
}

/// What the footer says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footer {
    pub manifest: Position,
    /// Absent when the footer gives no tar-split.
    pub tar_split: Option<Position>,
}

fn numbers<const N: usize>(s: &str, what: &str) -> Result<[u64; N]> {
    let bad = || {
        Error::toc(format!(
            "{what} {:?} is not {N} numbers joined by `:`",
            crate::digest::truncate(s)
        ))
    };
    let mut out = [0u64; N];
    let mut parts = s.split(':');
    for n in &mut out {
        let p = parts.next().ok_or_else(bad)?;
        if p.is_empty() || !p.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        *n = p.parse().map_err(|_| bad())?;
    }
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(out)
}

/// Parses [`MANIFEST_POSITION_ANNOTATION`] and checks it against the blob.
pub fn parse_manifest_position(annotation: &str, blob_size: u64) -> Result<Position> {
    let [offset, compressed_len, uncompressed_len, kind] = numbers(annotation, "manifest position")?;
    if kind != MANIFEST_TYPE_CRFS {
        return Err(Error::toc(format!(
            "zstd:chunked manifest type {kind}, not {MANIFEST_TYPE_CRFS}"
        )));
    }
    Position {
        offset,
        compressed_len,
        uncompressed_len,
    }
    .check("manifest", blob_size)
}

/// Parses [`TAR_SPLIT_POSITION_ANNOTATION`] and checks it against the blob.
pub fn parse_tar_split_position(annotation: &str, blob_size: u64) -> Result<Position> {
    let [offset, compressed_len, uncompressed_len] = numbers(annotation, "tar-split position")?;
    Position {
        offset,
        compressed_len,
        uncompressed_len,
    }
    .check("tar-split", blob_size)
}

/// The bytes that hold the footer.
pub fn footer_range(blob_size: u64) -> Result<Range<u64>> {
    if blob_size < FOOTER_SIZE {
        return Err(Error::toc(format!(
            "a blob of {blob_size} bytes is too small for a zstd:chunked footer"
        )));
    }
    Ok(blob_size - FOOTER_SIZE..blob_size)
}

/// Parses the footer from the bytes of [`footer_range`].
pub fn parse_footer(bytes: &[u8], blob_size: u64) -> Result<Footer> {
    let bytes: &[u8; FOOTER_SIZE as usize] = bytes
        .try_into()
        .map_err(|_| Error::range(format!("{} footer bytes, not {FOOTER_SIZE}", bytes.len())))?;
    if bytes[..4] != SKIPPABLE_MAGIC || bytes[4..8] != 64u32.to_le_bytes() {
        return Err(Error::toc("no zstd:chunked footer (not a skippable frame of 64 bytes)"));
    }
    if &bytes[64..] != FOOTER_MAGIC {
        return Err(Error::toc("no zstd:chunked footer (no GNUlInUx magic)"));
    }
    let n = |i: usize| u64::from_le_bytes(bytes[8 + 8 * i..16 + 8 * i].try_into().unwrap());
    if n(3) != MANIFEST_TYPE_CRFS {
        return Err(Error::toc(format!(
            "zstd:chunked manifest type {}, not {MANIFEST_TYPE_CRFS}",
            n(3)
        )));
    }
    let manifest = Position {
        offset: n(0),
        compressed_len: n(1),
        uncompressed_len: n(2),
    }
    .check("manifest", blob_size - FOOTER_SIZE)?;
    let tar_split = match n(4) {
        0 => None,
        offset => Some(
            Position {
                offset,
                compressed_len: n(5),
                uncompressed_len: n(6),
            }
            .check("tar-split", blob_size - FOOTER_SIZE)?,
        ),
    };
    Ok(Footer { manifest, tar_split })
}

/// Checks the compressed manifest (the bytes of `position.range()`)
/// against `expected` (the layer's [`MANIFEST_CHECKSUM_ANNOTATION`]),
/// decompresses and parses it.
pub fn parse_manifest(fetched: &[u8], position: &Position, expected: &Digest) -> Result<Toc> {
    if fetched.len() as u64 != position.compressed_len {
        return Err(Error::range(format!(
            "{} bytes of manifest, not the {} of its position",
            fetched.len(),
            position.compressed_len
        )));
    }
    expected.verify(fetched, || "the zstd:chunked manifest".into())?;
    let json = decompress_exact(fetched, position.uncompressed_len, "manifest")?;
    parse_json(&json, position)
}

/// Parses the JSON of a manifest at `position`: the part of
/// [`parse_manifest`] after the digest check and decompression.
pub fn parse_json(json: &[u8], position: &Position) -> Result<Toc> {
    parse(
        json,
        Layout {
            format: Format::ZstdChunked,
            // The manifest's skippable frame header starts 8 bytes before it.
            payload_end: position.offset - 8,
        },
    )
}

/// Checks the compressed tar-split (the bytes of `position.range()`)
/// against the table's `tar_split_digest` and decompresses it: JSON lines
/// that rebuild the layer's tar headers byte for byte.
pub fn read_tar_split(fetched: &[u8], position: &Position, expected: &Digest) -> Result<Vec<u8>> {
    if fetched.len() as u64 != position.compressed_len {
        return Err(Error::range(format!(
            "{} bytes of tar-split, not the {} of its position",
            fetched.len(),
            position.compressed_len
        )));
    }
    expected.verify(fetched, || "the zstd:chunked tar-split".into())?;
    decompress_exact(fetched, position.uncompressed_len, "tar-split")
}

fn decompress_exact(data: &[u8], len: u64, what: &str) -> Result<Vec<u8>> {
    let out = zstd::bulk::decompress(data, len as usize).map_err(|e| {
        Error::toc(format!(
            "the zstd:chunked {what} does not decompress to {len} bytes: {e}"
        ))
    })?;
    if out.len() as u64 != len {
        return Err(Error::toc(format!(
            "the zstd:chunked {what} decompresses to {} bytes, not {len}",
            out.len()
        )));
    }
    Ok(out)
}
