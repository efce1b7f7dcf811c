//! Objects out of ordinary layer blobs, for lazy mounts of images with an
//! index ([`crate::lazy_index`]): a run of files of a layer is read as a
//! range of its uncompressed tar stream, the compressed bytes its seek
//! index names fetched by range and decoded from the checkpoint before
//! it; a layer that cannot be entered mid-stream is read whole once, every
//! file of it stored on the way. What is read is checked against each
//! object's digest by the caller (nothing is stored under a name its bytes
//! do not have).

use crate::digest::Verified;
use crate::layer::{self, Compression, ReadOptions};
use crate::manifest::BlobRef;
use crate::transport::Transport;
use crate::OciError;
use std::io::{self, BufRead, BufReader, Read};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use tilefs_seekable::SeekIndex;
use tilefs_store::ingest::Ingest;

/// Uncompressed bytes decoded per range request, about (at most twice
/// this): a long file is read in pieces, each from its own checkpoint, so
/// memory stays bounded (about this plus its compressed bytes).
const PIECE: u64 = 8 << 20;

/// Most compressed bytes one piece may need: past it, the layer is read
/// whole (streamed) instead.
const MAX_FETCH: u64 = 64 << 20;

/// How a layer's tar stream is reached.
pub(crate) enum Coding {
    /// Not compressed: the stream is the blob.
    Plain,
    Seek(SeekIndex),
}

impl Coding {
    /// Whether `size` bytes at `offset` of the stream are best read
    /// without the rest: not in a compressed layer of one checkpoint, nor
    /// where the compressed bytes of a piece would pass [`MAX_FETCH`]
    /// (checkpoints far apart: big zstd frames), which are held in memory.
    pub(crate) fn enterable_at(&self, offset: u64, size: u64) -> bool {
        match self {
            Coding::Plain => true,
            Coding::Seek(s) => {
                s.is_enterable()
                    && s.fetch_range(offset..offset.saturating_add(size.min(PIECE)))
                        .is_ok_and(|r| r.end - r.start <= MAX_FETCH)
            }
        }
    }

    /// Where the compressed bytes fetched to read up to `at` stop giving
    /// more for free: the first checkpoint at or after it (None: the end
    /// of the stream; or an uncompressed layer, where read-ahead is bounded
    /// as a pack's is).
    pub(crate) fn free_until(&self, at: u64) -> Option<u64> {
        match self {
            Coding::Plain => None,
            Coding::Seek(s) => s.checkpoints().iter().map(|c| c.uncompressed).find(|&u| u >= at),
        }
    }
}

/// Runs `f` on a reader of `len` bytes of the tar stream of `blob` from
/// `start`. Bytes the compressed stream cannot give (a corrupt range)
/// fail the read and set `corrupt`: not worth asking again.
pub(crate) fn with_stream_range<R>(
    t: &dyn Transport,
    blob: &BlobRef,
    coding: &Coding,
    start: u64,
    len: u64,
    corrupt: &AtomicBool,
    f: impl FnOnce(&mut dyn Read) -> R,
) -> Result<R, OciError> {
    match coding {
        Coding::Plain => {
            let mut r = t.open_range(blob, start, len)?;
            Ok(f(&mut r))
        }
        Coding::Seek(seek) => {
            let mut r = Pieces {
                t,
                blob,
                seek,
                pos: start,
                end: start + len,
                current: io::Cursor::new(Vec::new()),
                corrupt,
            };
            Ok(f(&mut r))
        }
    }
}

/// The stream `pos..end`, a piece at a time.
struct Pieces<'a> {
    t: &'a dyn Transport,
    blob: &'a BlobRef,
    seek: &'a SeekIndex,
    pos: u64,
    end: u64,
    current: io::Cursor<Vec<u8>>,
    corrupt: &'a AtomicBool,
}

impl Pieces<'_> {
    /// Where the piece from `pos` ends: at the checkpoint nearest
    /// [`PIECE`] on (the last before it or the first after it, within
    /// twice that), so that the next piece's fetch starts where this one's
    /// ended and no compressed byte is fetched twice; else after `PIECE`.
    fn piece_end(&self) -> u64 {
        let limit = self.pos + PIECE;
        if limit >= self.end {
            return self.end;
        }
        let points = self.seek.checkpoints();
        let after = points.partition_point(|c| c.uncompressed <= limit);
        let within = points[..after].last().map(|c| c.uncompressed).filter(|&u| u > self.pos);
        let near = points
            .get(after)
            .map(|c| c.uncompressed)
            .filter(|&u| u - self.pos <= 2 * PIECE);
        [within, near]
            .into_iter()
            .flatten()
            .min_by_key(|u| u.abs_diff(limit))
            .unwrap_or(limit)
            .min(self.end)
    }

    fn next_piece(&mut self) -> io::Result<()> {
        let to = self.piece_end();
        let want = self.pos..to;
        let bad = |e: tilefs_seekable::Error| {
            self.corrupt.store(true, Relaxed);
            io::Error::new(io::ErrorKind::InvalidData, e.to_string())
        };
        let range = self.seek.fetch_range(want.clone()).map_err(bad)?;
        if range.end - range.start > MAX_FETCH {
            self.corrupt.store(true, Relaxed);
            return Err(io::Error::other(format!(
                "the seek index's checkpoints around {}..{to} are {} bytes apart, more than {}",
                self.pos,
                range.end - range.start,
                crate::bounded::size(MAX_FETCH)
            )));
        }
        let mut fetched = Vec::with_capacity((range.end - range.start) as usize);
        self.t
            .open_range(self.blob, range.start, range.end - range.start)
            .map_err(io::Error::other)?
            .read_to_end(&mut fetched)?;
        if (fetched.len() as u64) < range.end - range.start {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the range ended early"));
        }
        let mut out = vec![0u8; (to - self.pos) as usize];
        self.seek.read_at(want, &fetched, &mut out).map_err(bad)?;
        self.pos = to;
        self.current = io::Cursor::new(out);
        Ok(())
    }
}

impl Read for Pieces<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let n = self.current.read(buf)?;
            if n > 0 || buf.is_empty() || self.pos >= self.end {
                return Ok(n);
            }
            self.next_piece()?;
        }
    }
}

/// Reads the layer `blob` whole, checked against its digest, storing every
/// file of it through `ingest` (the ones a mount wants among them).
pub(crate) fn fetch_whole(t: &dyn Transport, blob: &BlobRef, ingest: &Ingest) -> Result<(), OciError> {
    let name = blob.digest.to_string();
    let verified = Verified::new(t.open_blob(blob)?, blob.digest.clone(), blob.size);
    let check = verified.check();
    let mut buf = BufReader::with_capacity(1 << 20, verified);
    let result = (|| -> Result<(), OciError> {
        let head = buf
            .fill_buf()
            .map_err(|e| OciError::layer(&name, None, format!("cannot read: {e}")))?;
        let mut stream: Box<dyn Read> = match Compression::sniff(head) {
            Compression::None => Box::new(&mut buf),
            Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(&mut buf)),
            Compression::Zstd => Box::new(
                zstd::Decoder::with_buffer(&mut buf).map_err(|e| OciError::layer(&name, None, format!("zstd: {e}")))?,
            ),
        };
        layer::read_entries(&mut stream, &name, ingest, ReadOptions::default())?;
        io::copy(&mut stream, &mut io::sink()).map_err(|e| OciError::layer(&name, None, e.to_string()))?;
        Ok(())
    })();
    if let Some(f) = check.failure() {
        return Err(OciError::blob(&name, f));
    }
    result?;
    check.result().map_err(|f| OciError::blob(&name, f))
}
