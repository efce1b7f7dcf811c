//! Tables of contents of seekable layers, one model for both formats:
//! eStargz ([`estargz`]) and zstd:chunked ([`zstd_chunked`]). Each lists
//! the layer's entries and, per regular file, its chunks: the range of the
//! blob that holds each, and the digest its bytes must have.
//!
//! A table of contents is untrusted until its digest matches the one the
//! layer's annotations carry (the manifest vouches for those); after that,
//! every chunk is checked against its own digest when read.

pub mod estargz;
mod json;
pub mod zstd_chunked;

use std::ops::Range;

use crate::digest::Digest;
use crate::error::{Error, Result};
pub use crate::time::Timestamp;

/// The largest table of contents read, in JSON bytes (a layer of 100,000
/// files has about 40 MiB of eStargz TOC).
pub const MAX_TOC_JSON: u64 = 64 << 20;
/// The most entries (files and chunks) a table of contents may list.
pub const MAX_ENTRIES: usize = 1 << 20;
/// The longest path or link target, in bytes (PATH_MAX less its NUL).
pub const MAX_PATH: usize = 4095;
/// The longest name in a path (NAME_MAX).
pub const MAX_NAME: usize = 255;
/// The most names in a path.
pub const MAX_DEPTH: usize = 2048;

/// Which format a table of contents came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Estargz,
    ZstdChunked,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Toc {
    pub format: Format,
    /// In the order of the table (the layer's tar order), one per path.
    pub entries: Vec<Entry>,
    /// zstd:chunked: the digest of the compressed tar-split, when the
    /// table names one.
    pub tar_split_digest: Option<Digest>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Below the layer's root, names joined by `/`, without `./` or a
    /// trailing `/`; the empty path is the root itself.
    pub path: String,
    pub kind: Kind,
    /// Permission bits and set-id and sticky bits (`0o7777`), as the pull
    /// keeps them.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: Option<Timestamp>,
    /// Extended attributes, sorted by name.
    pub xattrs: Vec<(String, Vec<u8>)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File(File),
    Symlink {
        target: String,
    },
    /// `target` is an earlier entry of the table that is neither a
    /// directory nor a hardlink (a link to a link is resolved).
    Hardlink {
        target: String,
    },
    CharDevice {
        major: u32,
        minor: u32,
    },
    BlockDevice {
        major: u32,
        minor: u32,
    },
    Fifo,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct File {
    pub size: u64,
    /// The digest of the whole content, when the table gives it.
    pub digest: Option<Digest>,
    /// In file order, back to back from offset 0 to `size`.
    pub chunks: Vec<Chunk>,
}

/// A piece of a regular file and where the blob holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Offset in the file.
    pub offset: u64,
    pub size: u64,
    /// The bytes of the blob to fetch: gzip members (eStargz) or zstd
    /// frames (zstd:chunked) that start with this chunk's data, after
    /// `skip` decoded bytes.
    pub compressed: Range<u64>,
    /// eStargz's `innerOffset`: decoded bytes before the chunk's data
    /// when several small chunks share a gzip member.
    pub skip: u64,
    pub digest: Digest,
    /// zstd:chunked's hole: the chunk is all zeros and needs no fetch.
    pub zeros: bool,
}

impl Toc {
    /// Decodes `chunk` from `fetched` (the blob's bytes from
    /// `chunk.compressed.start`, at least to its end; nothing for a zeros
    /// chunk) into `out` (exactly `chunk.size` bytes) and checks its digest.
    pub fn read_chunk(&self, chunk: &Chunk, fetched: &[u8], out: &mut [u8]) -> Result<()> {
        if out.len() as u64 != chunk.size {
            return Err(Error::range(format!(
                "an output buffer of {} bytes for a chunk of {}",
                out.len(),
                chunk.size
            )));
        }
        if chunk.zeros {
            out.fill(0);
        } else {
            let fetched = &fetched[..fetched
                .len()
                .min((chunk.compressed.end - chunk.compressed.start) as usize)];
            match self.format {
                Format::Estargz => crate::gzip::read_members(chunk.compressed.start, fetched, chunk.skip, out)?,
                Format::ZstdChunked => crate::zstd::read_frames(chunk.compressed.start, fetched, out)?,
            }
        }
        chunk.digest.verify(out, || {
            format!(
                "the chunk at file offset {} (blob bytes {}..{})",
                chunk.offset, chunk.compressed.start, chunk.compressed.end
            )
        })
    }
}

/// What a layer's annotations say about its table of contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Annotated {
    /// An eStargz layer: fetch [`estargz::footer_range`], then the table.
    Estargz { toc_digest: Digest },
    /// A zstd:chunked layer: the manifest is at `manifest`.
    ZstdChunked {
        manifest: zstd_chunked::Position,
        manifest_digest: Digest,
        tar_split: Option<zstd_chunked::Position>,
    },
}

/// Reads a layer descriptor's annotations (`get` looks one up by name):
/// `None` for an ordinary layer, else the format and what the manifest
/// vouches for. A layer that claims both formats is refused, as
/// containers/storage refuses it.
pub fn from_annotations<'a>(get: impl Fn(&str) -> Option<&'a str>, blob_size: u64) -> Result<Option<Annotated>> {
    let estargz = get(estargz::TOC_DIGEST_ANNOTATION);
    let chunked = get(zstd_chunked::MANIFEST_CHECKSUM_ANNOTATION);
    match (estargz, chunked) {
        (None, None) => Ok(None),
        (Some(_), Some(_)) => Err(Error::toc(
            "the layer's annotations claim both eStargz and zstd:chunked",
        )),
        (Some(d), None) => Ok(Some(Annotated::Estargz {
            toc_digest: Digest::parse(d, estargz::TOC_DIGEST_ANNOTATION)?,
        })),
        (None, Some(d)) => {
            let position = get(zstd_chunked::MANIFEST_POSITION_ANNOTATION).ok_or_else(|| {
                Error::toc(format!(
                    "a zstd:chunked layer without {}",
                    zstd_chunked::MANIFEST_POSITION_ANNOTATION
                ))
            })?;
            Ok(Some(Annotated::ZstdChunked {
                manifest: zstd_chunked::parse_manifest_position(position, blob_size)?,
                manifest_digest: Digest::parse(d, zstd_chunked::MANIFEST_CHECKSUM_ANNOTATION)?,
                tar_split: get(zstd_chunked::TAR_SPLIT_POSITION_ANNOTATION)
                    .map(|p| zstd_chunked::parse_tar_split_position(p, blob_size))
                    .transpose()?,
            }))
        }
    }
}

/// Normalizes a path from a table of contents as the pull does with tar
/// names: `./`, repeated and trailing slashes go; absolute paths, `..`,
/// NUL bytes and names or paths over the limits are refused.
pub(crate) fn clean_path(raw: &str) -> Result<String> {
    let bad = |why: &str| Error::toc(format!("path {:?}: {why}", crate::digest::truncate(raw)));
    if raw.starts_with('/') {
        return Err(bad("absolute (escapes the root)"));
    }
    if raw.contains('\0') {
        return Err(bad("holds a NUL byte"));
    }
    if raw.len() > MAX_PATH {
        return Err(bad("longer than PATH_MAX"));
    }
    let mut out = String::with_capacity(raw.len());
    let mut depth = 0;
    for name in raw.split('/') {
        match name {
            "" | "." => continue,
            ".." => return Err(bad("holds `..` (escapes the root)")),
            n if n.len() > MAX_NAME => return Err(bad("a name is longer than NAME_MAX")),
            n => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(bad("too deep"));
                }
                if !out.is_empty() {
                    out.push('/');
                }
                out.push_str(n);
            }
        }
    }
    Ok(out)
}

/// A symlink target: any text a symlink can hold.
pub(crate) fn check_target(path: &str, target: &str) -> Result<String> {
    if target.is_empty() || target.len() > MAX_PATH || target.contains('\0') {
        return Err(Error::toc(format!(
            "{path:?}: symlink target of {} bytes{}",
            target.len(),
            if target.contains('\0') { " with a NUL byte" } else { "" }
        )));
    }
    Ok(target.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_cleaned_as_the_pull_cleans_tar_names() {
        assert_eq!(clean_path("./usr//bin/").unwrap(), "usr/bin");
        assert_eq!(clean_path("./").unwrap(), "");
        assert_eq!(clean_path("a/./b").unwrap(), "a/b");
        for bad in ["/etc", "a/../b", "..", "a\0b", &"x".repeat(256), &"a/".repeat(2049)] {
            assert!(clean_path(bad).is_err(), "{bad}");
        }
    }
}
