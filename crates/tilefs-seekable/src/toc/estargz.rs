//! eStargz: a gzip layer whose files start gzip members, with its table
//! of contents in a last member before a footer.
//!
//! Blob layout (facts of the format): gzip members holding the tar
//! stream, cut so that each chunk of a regular file starts a member (or,
//! past `innerOffset`, lies in one); then a member holding a tar archive
//! whose one entry, `stargz.index.json`, is the table of contents; then
//! the footer, an empty gzip member whose extra field says where the table
//! starts. The footer is 51 bytes: a 10-byte header with FEXTRA, the
//! extra field's length (26), a subfield `SG` of 22 bytes holding the
//! offset as 16 hex digits and `STARGZ`, an empty stored block (5 bytes)
//! and a trailer of zeros (8 bytes). The legacy footer (47 bytes) has the
//! 22 bytes as the whole extra field. The annotation
//! [`TOC_DIGEST_ANNOTATION`] of the layer carries the SHA-256 of the
//! table's JSON.

use std::ops::Range;

use super::json::{parse, Layout};
use super::{Format, Toc, MAX_TOC_JSON};
use crate::digest::Digest;
use crate::error::{Error, Result};
use crate::gzip::{Event, Inflater};

/// The layer annotation holding the digest of the table of contents.
pub const TOC_DIGEST_ANNOTATION: &str = "containerd.io/snapshot/stargz/toc.digest";
/// The layer annotation holding the size of the uncompressed layer.
pub const UNCOMPRESSED_SIZE_ANNOTATION: &str = "io.containers.estargz.uncompressed-size";
/// The length of the footer.
pub const FOOTER_SIZE: u64 = 51;
/// The length of the legacy footer.
pub const LEGACY_FOOTER_SIZE: u64 = 47;
/// The name of the tar entry that holds the table of contents.
pub const TOC_TAR_NAME: &str = "stargz.index.json";

/// Tar's end: up to two zero blocks after the JSON's padding (and a writer
/// may round the archive up to a 10 KiB record).
const MAX_TAR_TAIL: usize = 10240 + 512;

/// Where the table of contents is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footer {
    pub toc_offset: u64,
    /// [`FOOTER_SIZE`], or [`LEGACY_FOOTER_SIZE`] for a legacy footer.
    pub size: u64,
}

impl Footer {
    /// The bytes of the blob that hold the table of contents (one gzip
    /// member, up to the footer).
    pub fn toc_range(&self, blob_size: u64) -> Range<u64> {
        self.toc_offset..blob_size - self.size
    }
}

/// The bytes to fetch first: the blob's last 51 bytes (both footers are
/// at the end of them).
pub fn footer_range(blob_size: u64) -> Result<Range<u64>> {
    if blob_size < LEGACY_FOOTER_SIZE {
        return Err(Error::toc(format!(
            "a blob of {blob_size} bytes is too small for an eStargz footer"
        )));
    }
    Ok(blob_size.saturating_sub(FOOTER_SIZE)..blob_size)
}

/// Parses the footer from the bytes of [`footer_range`] (the 51-byte
/// footer, else the legacy one), and checks that the table of contents it
/// points at lies between the start of the blob and the footer.
pub fn parse_footer(tail: &[u8], blob_size: u64) -> Result<Footer> {
    if tail.len() as u64 != blob_size.min(FOOTER_SIZE) {
        return Err(Error::range(format!(
            "{} footer bytes, not the {} of footer_range",
            tail.len(),
            blob_size.min(FOOTER_SIZE)
        )));
    }
    let current = footer_offset(tail, FOOTER_SIZE, |extra| match extra {
        [b'S', b'G', 22, 0, rest @ ..] if rest.len() == 22 => Ok(rest),
        _ => Err("its extra field is not one `SG` subfield of 22 bytes".into()),
    });
    let (toc_offset, size) = match current {
        Ok(off) => (off, FOOTER_SIZE),
        Err(e) => match footer_offset(tail, LEGACY_FOOTER_SIZE, |extra| {
            if extra.len() == 22 {
                Ok(extra)
            } else {
                Err("its extra field is not 22 bytes".into())
            }
        }) {
            Ok(off) => (off, LEGACY_FOOTER_SIZE),
            Err(legacy) => {
                return Err(Error::toc(format!(
                    "no eStargz footer: {e}; nor a legacy footer: {legacy}"
                )))
            }
        },
    };
    if toc_offset >= blob_size - size {
        return Err(Error::toc(format!(
            "the eStargz footer puts the table of contents at byte {toc_offset}, past the footer (byte {})",
            blob_size - size
        )));
    }
    Ok(Footer { toc_offset, size })
}

/// The offset a footer of `size` bytes at the end of `tail` gives: an
/// empty gzip member whose extra field `subfield` reduces to 16 hex digits
/// and `STARGZ`.
fn footer_offset(tail: &[u8], size: u64, subfield: impl Fn(&[u8]) -> Result<&[u8], String>) -> Result<u64, String> {
    let Some(start) = tail.len().checked_sub(size as usize) else {
        return Err(format!("the blob is shorter than {size} bytes"));
    };
    let bytes = &tail[start..];
    let mut inf = Inflater::at_member(bytes, 0, 0);
    loop {
        match inf.advance(None).map_err(|e| e.to_string())? {
            Event::End => break,
            _ if !inf.pending().is_empty() => return Err("its gzip member is not empty".into()),
            _ => {}
        }
    }
    if inf.members != 1 {
        return Err(format!("{} gzip members, not one", inf.members));
    }
    let field = subfield(&inf.extra)?;
    let (digits, magic) = field.split_at(16);
    if magic != b"STARGZ" {
        return Err("no STARGZ in its extra field".into());
    }
    if !digits.iter().all(|c| c.is_ascii_hexdigit()) {
        return Err("its offset is not 16 hex digits".into());
    }
    let text = std::str::from_utf8(digits).map_err(|e| e.to_string())?;
    u64::from_str_radix(text, 16).map_err(|e| e.to_string())
}

/// Decodes the table of contents from the bytes of `footer.toc_range`,
/// checks its JSON against `expected` (the layer's
/// [`TOC_DIGEST_ANNOTATION`]) and parses it.
pub fn parse_toc(fetched: &[u8], footer: &Footer, blob_size: u64, expected: &Digest) -> Result<Toc> {
    let range = footer.toc_range(blob_size);
    if fetched.len() as u64 != range.end - range.start {
        return Err(Error::range(format!(
            "{} bytes of table of contents, not the {} of its range",
            fetched.len(),
            range.end - range.start
        )));
    }
    let json = toc_json(fetched, range.start)?;
    expected.verify(&json, || "the eStargz table of contents".into())?;
    parse_json(&json, footer.toc_offset)
}

/// Parses the JSON of a table of contents that starts at `toc_offset`:
/// the part of [`parse_toc`] after the digest check.
pub fn parse_json(json: &[u8], toc_offset: u64) -> Result<Toc> {
    parse(
        json,
        Layout {
            format: Format::Estargz,
            payload_end: toc_offset,
        },
    )
}

/// The JSON out of the table's gzip member(s) and tar archive: one ustar
/// header named [`TOC_TAR_NAME`], the JSON, and tar's zero padding up to
/// the end of the decoded bytes.
pub fn toc_json(fetched: &[u8], at: u64) -> Result<Vec<u8>> {
    toc_entry(fetched, at).map(|(json, _)| json)
}

/// [`toc_json`], and the tar header of its entry (512 bytes, checked): an
/// ordinary pull of the layer reads that entry as a file of the layer, so
/// a lazy one must make the same file.
pub fn toc_entry(fetched: &[u8], at: u64) -> Result<(Vec<u8>, Vec<u8>)> {
    let mut inf = Inflater::at_member(fetched, at, 0);
    let limit = 512 + MAX_TOC_JSON as usize + MAX_TAR_TAIL;
    let mut out = Vec::new();
    loop {
        let pending = inf.pending();
        if !pending.is_empty() {
            if out.len() + pending.len() > limit {
                return Err(Error::toc(format!(
                    "the eStargz table of contents decodes past {limit} bytes"
                )));
            }
            out.extend_from_slice(pending);
            let n = pending.len();
            inf.take(n);
            continue;
        }
        if let Event::End = inf.advance(None)? {
            break;
        }
    }
    let size = tar_header(&out)?;
    let end = 512 + size as usize;
    let Some(json) = out.get(512..end) else {
        return Err(Error::toc(format!(
            "the eStargz table of contents ends before its {size} bytes of JSON"
        )));
    };
    let tail = &out[end..];
    if tail.len() > MAX_TAR_TAIL || tail.iter().any(|&b| b != 0) {
        return Err(Error::toc(
            "the eStargz table of contents has more than tar padding after its JSON",
        ));
    }
    Ok((json.to_vec(), out[..512].to_vec()))
}

/// Checks the ustar header of the table's tar entry; returns its size.
fn tar_header(out: &[u8]) -> Result<u64> {
    let bad = |why: &str| Error::toc(format!("the eStargz table of contents' tar header: {why}"));
    let h = out.get(..512).ok_or_else(|| bad("missing"))?;
    let stored = octal(&h[148..156]).ok_or_else(|| bad("bad checksum field"))?;
    let sum: u64 = h
        .iter()
        .enumerate()
        .map(|(i, &b)| if (148..156).contains(&i) { 32 } else { u64::from(b) })
        .sum();
    if stored != sum {
        return Err(bad("checksum does not match"));
    }
    if &h[257..263] != b"ustar\0" && &h[257..265] != b"ustar  \0" {
        return Err(bad("not a ustar header"));
    }
    let name_len = h[..100].iter().position(|&b| b == 0).unwrap_or(100);
    if &h[..name_len] != TOC_TAR_NAME.as_bytes() || h[345] != 0 {
        return Err(bad(&format!("the entry is not named {TOC_TAR_NAME}")));
    }
    if !matches!(h[156], b'0' | 0) {
        return Err(bad("the entry is not a regular file"));
    }
    let size = octal(&h[124..136]).ok_or_else(|| bad("bad size field"))?;
    if size > MAX_TOC_JSON {
        return Err(bad(&format!("{size} bytes of JSON, over {MAX_TOC_JSON}")));
    }
    Ok(size)
}

/// A tar number: octal digits, maybe led by spaces, ended by NUL or
/// space.
fn octal(field: &[u8]) -> Option<u64> {
    let start = field.iter().position(|&b| b != b' ')?;
    let digits = field[start..].iter().take_while(|b| b.is_ascii_digit()).count();
    let (num, rest) = field[start..].split_at(digits);
    if digits == 0 || rest.first().is_some_and(|&b| b != 0 && b != b' ') {
        return None;
    }
    num.iter().try_fold(0u64, |n, &b| {
        (b <= b'7')
            .then(|| n.checked_mul(8))
            .flatten()
            .map(|n| n + u64::from(b - b'0'))
    })
}
