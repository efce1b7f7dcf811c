//! The seek index of one gzip or zstd layer: checkpoints where decoding can
//! start, what a range of the uncompressed stream costs to fetch, and the
//! reading of that range from the fetched bytes. Its serialized form is
//! specified in [`crate::format`].

use std::ops::Range;

use crate::error::{Error, Result};
use crate::format::{CHECKPOINT_LEN, HEADER_LEN, MAGIC, VERSION};
use crate::{gzip, zstd};

/// The compression of the indexed stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// gzip (RFC 1952), one member or several.
    Gzip,
    /// zstd (RFC 8878), one frame or several, skippable frames included.
    Zstd,
}

/// How decoding starts at a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resume {
    /// A gzip member or a zstd frame starts at the checkpoint's compressed
    /// offset: nothing before it is needed.
    Stream,
    /// A deflate block of a gzip member starts `bits` bits before the
    /// checkpoint's compressed offset: those bits are the high `bits` bits
    /// of the byte before it, kept here as the low bits of `bit_value`
    /// (so the fetch starts at a byte boundary). `window` is what the member
    /// decoded last before the block, which the block may copy from.
    Deflate { bits: u8, bit_value: u8, window: Window },
}

/// Up to 32 KiB of uncompressed history, kept zstd-compressed as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    size: u32,
    stored: Vec<u8>,
}

/// The largest window deflate can refer back to.
pub const MAX_WINDOW: usize = 32 * 1024;

/// The zstd level windows are compressed at: as small as level 9 within
/// 2% and four times as fast, which keeps indexing cheap during a pull.
const WINDOW_LEVEL: i32 = 3;

impl Window {
    /// Compresses a window (at most [`MAX_WINDOW`] bytes).
    pub(crate) fn compress(data: &[u8]) -> Window {
        debug_assert!(data.len() <= MAX_WINDOW);
        if data.is_empty() {
            return Window {
                size: 0,
                stored: Vec::new(),
            };
        }
        // Compressing a slice into a Vec cannot fail but for allocation.
        let stored = ::zstd::bulk::compress(data, WINDOW_LEVEL).expect("zstd compresses a 32 KiB window");
        Window {
            size: data.len() as u32,
            stored,
        }
    }

    /// The number of uncompressed bytes.
    pub fn size(&self) -> usize {
        self.size as usize
    }

    /// The bytes as stored in the index.
    pub fn stored(&self) -> &[u8] {
        &self.stored
    }

    /// The uncompressed window; the index was checked when decoded, but the
    /// stored bytes are decompressed only here.
    pub fn decompress(&self) -> Result<Vec<u8>> {
        if self.size == 0 {
            return Ok(Vec::new());
        }
        let out = ::zstd::bulk::decompress(&self.stored, MAX_WINDOW)
            .map_err(|e| Error::index(format!("a window does not decompress: {e}")))?;
        if out.len() != self.size as usize {
            return Err(Error::index(format!(
                "a window decompresses to {} bytes, not the {} it says",
                out.len(),
                self.size
            )));
        }
        Ok(out)
    }
}

/// A place where decoding can start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    /// Offset in the compressed blob of the first byte to fetch.
    pub compressed: u64,
    /// Offset in the uncompressed stream of the first byte decoded there.
    pub uncompressed: u64,
    pub resume: Resume,
}

/// The checkpoints of one compressed stream, in stream order: the first at
/// offset 0 of both streams, each further one at least `span` uncompressed
/// bytes after the one before.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeekIndex {
    pub(crate) codec: Codec,
    pub(crate) compressed_size: u64,
    pub(crate) uncompressed_size: u64,
    pub(crate) span: u64,
    pub(crate) checkpoints: Vec<Checkpoint>,
}

impl SeekIndex {
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// The size of the compressed blob.
    pub fn compressed_size(&self) -> u64 {
        self.compressed_size
    }

    /// The size of the uncompressed stream (the tar archive).
    pub fn uncompressed_size(&self) -> u64 {
        self.uncompressed_size
    }

    /// The spacing the index was built with (uncompressed bytes).
    pub fn span(&self) -> u64 {
        self.span
    }

    pub fn checkpoints(&self) -> &[Checkpoint] {
        &self.checkpoints
    }

    /// Whether decoding can start anywhere but at the beginning. A stream
    /// that cannot (one zstd frame, a gzip stream shorter than the span)
    /// is best fetched whole on first use.
    pub fn is_enterable(&self) -> bool {
        self.checkpoints.len() > 1
    }

    /// The checkpoint to start from for uncompressed offset `at`: the last
    /// one at or before it.
    fn start_for(&self, at: u64) -> usize {
        self.checkpoints
            .partition_point(|c| c.uncompressed <= at)
            .saturating_sub(1)
    }

    fn check_range(&self, range: &Range<u64>) -> Result<()> {
        if range.start > range.end || range.end > self.uncompressed_size {
            return Err(Error::range(format!(
                "uncompressed range {}..{} is not within the stream's {} bytes",
                range.start, range.end, self.uncompressed_size
            )));
        }
        Ok(())
    }

    /// The bytes of the compressed blob to fetch to read the uncompressed
    /// `range`: from the checkpoint at or before its start to the first
    /// checkpoint at or after its end (or the end of the blob).
    pub fn fetch_range(&self, range: Range<u64>) -> Result<Range<u64>> {
        self.check_range(&range)?;
        let i = self.start_for(range.start);
        let end = self.checkpoints[i + 1..]
            .iter()
            .find(|c| c.uncompressed >= range.end)
            .map_or(self.compressed_size, |c| c.compressed);
        Ok(self.checkpoints[i].compressed..end)
    }

    /// Reads the uncompressed `range` into `out` (exactly its length) from
    /// `fetched`, the compressed bytes from `fetch_range(range).start` on
    /// (at least up to its end). The bytes are whatever the compressed
    /// stream says: the caller checks them against the digest it trusts.
    pub fn read_at(&self, range: Range<u64>, fetched: &[u8], out: &mut [u8]) -> Result<()> {
        self.check_range(&range)?;
        let want = range.end - range.start;
        if out.len() as u64 != want {
            return Err(Error::range(format!(
                "an output buffer of {} bytes for a range of {want}",
                out.len()
            )));
        }
        if want == 0 {
            return Ok(());
        }
        let cp = &self.checkpoints[self.start_for(range.start)];
        let skip = range.start - cp.uncompressed;
        match self.codec {
            Codec::Gzip => gzip::read_from(cp, fetched, skip, out),
            Codec::Zstd => zstd::read_from(cp, fetched, skip, out),
        }
    }

    /// The serialized form ([`crate::format`]).
    pub fn encode(&self) -> Vec<u8> {
        let windows: usize = self
            .checkpoints
            .iter()
            .map(|c| window_of(c).map_or(0, |w| w.stored.len()))
            .sum();
        let mut out = Vec::with_capacity(HEADER_LEN + self.checkpoints.len() * CHECKPOINT_LEN + windows);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.push(match self.codec {
            Codec::Gzip => 1,
            Codec::Zstd => 2,
        });
        out.push(0);
        out.extend_from_slice(&(self.checkpoints.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.compressed_size.to_le_bytes());
        out.extend_from_slice(&self.uncompressed_size.to_le_bytes());
        out.extend_from_slice(&self.span.to_le_bytes());
        for c in &self.checkpoints {
            out.extend_from_slice(&c.compressed.to_le_bytes());
            out.extend_from_slice(&c.uncompressed.to_le_bytes());
            let (kind, bits, value, size, stored) = match &c.resume {
                Resume::Stream => (0u8, 0u8, 0u8, 0u32, 0u32),
                Resume::Deflate {
                    bits,
                    bit_value,
                    window,
                } => (1, *bits, *bit_value, window.size, window.stored.len() as u32),
            };
            out.extend_from_slice(&size.to_le_bytes());
            out.extend_from_slice(&stored.to_le_bytes());
            out.extend_from_slice(&[kind, bits, value, 0]);
        }
        for c in &self.checkpoints {
            if let Some(w) = window_of(c) {
                out.extend_from_slice(&w.stored);
            }
        }
        out
    }

    /// Decodes and checks a serialized index: every rule of
    /// [`crate::format`], so that what decodes is an index this crate could
    /// have made (windows are decompressed only when used).
    pub fn decode(data: &[u8]) -> Result<SeekIndex> {
        let mut r = Cursor { data, pos: 0 };
        if r.take(MAGIC.len())? != MAGIC {
            return Err(Error::index("not a tilefs seek index (bad magic)"));
        }
        let version = u16::from_le_bytes(r.array()?);
        if version != VERSION {
            return Err(Error::index(format!("version {version}, this tilefs reads {VERSION}")));
        }
        let codec = match r.u8()? {
            1 => Codec::Gzip,
            2 => Codec::Zstd,
            c => return Err(Error::index(format!("unknown codec {c}"))),
        };
        if r.u8()? != 0 {
            return Err(Error::index("reserved header byte is not zero"));
        }
        let count = u32::from_le_bytes(r.array()?) as usize;
        let compressed_size = r.u64()?;
        let uncompressed_size = r.u64()?;
        let span = r.u64()?;
        if span == 0 {
            return Err(Error::index("span is zero"));
        }
        if count == 0 {
            return Err(Error::index("no checkpoint"));
        }
        // The table must fit in what is there before anything is allocated.
        if count > (data.len() - r.pos) / CHECKPOINT_LEN {
            return Err(Error::index(format!(
                "{count} checkpoints do not fit in {} bytes",
                data.len()
            )));
        }
        let mut checkpoints = Vec::with_capacity(count);
        let mut stored_lens = Vec::with_capacity(count);
        for i in 0..count {
            let compressed = r.u64()?;
            let uncompressed = r.u64()?;
            let size = u32::from_le_bytes(r.array()?);
            let stored = u32::from_le_bytes(r.array()?);
            let [kind, bits, value, reserved] = r.array()?;
            let bad = |why: String| Error::index(format!("checkpoint {i}: {why}"));
            if reserved != 0 {
                return Err(bad("reserved byte is not zero".into()));
            }
            let resume = match (kind, codec) {
                (0, _) => {
                    if bits != 0 || value != 0 || size != 0 || stored != 0 {
                        return Err(bad("a stream start with bits or a window".into()));
                    }
                    Resume::Stream
                }
                (1, Codec::Gzip) => {
                    if bits > 7 || u32::from(value) >> bits != 0 {
                        return Err(bad(format!("{bits} leftover bits with value {value:#x}")));
                    }
                    if size as usize > MAX_WINDOW || (size == 0) != (stored == 0) {
                        return Err(bad(format!("window of {size} bytes stored in {stored}")));
                    }
                    if u64::from(size) > uncompressed {
                        return Err(bad(format!(
                            "window of {size} bytes before uncompressed offset {uncompressed}"
                        )));
                    }
                    Resume::Deflate {
                        bits,
                        bit_value: value,
                        window: Window {
                            size,
                            stored: Vec::new(),
                        },
                    }
                }
                (k, c) => return Err(bad(format!("kind {k} in a {c:?} index"))),
            };
            if let Some(prev) = checkpoints.last() {
                let prev: &Checkpoint = prev;
                if compressed <= prev.compressed || uncompressed < prev.uncompressed.saturating_add(span) {
                    return Err(bad(format!(
                        "at {compressed}/{uncompressed}, not a span ({span}) past {}/{}",
                        prev.compressed, prev.uncompressed
                    )));
                }
            } else if compressed != 0 || uncompressed != 0 || resume != Resume::Stream {
                return Err(bad("the first checkpoint is not the start of the stream".into()));
            }
            if compressed >= compressed_size || uncompressed > uncompressed_size {
                return Err(bad(format!(
                    "at {compressed}/{uncompressed}, past the stream's {compressed_size}/{uncompressed_size} bytes"
                )));
            }
            checkpoints.push(Checkpoint {
                compressed,
                uncompressed,
                resume,
            });
            stored_lens.push(stored as usize);
        }
        for (c, len) in checkpoints.iter_mut().zip(stored_lens) {
            if let Resume::Deflate { window, .. } = &mut c.resume {
                window.stored = r.take(len)?.to_vec();
            }
        }
        if r.pos != data.len() {
            return Err(Error::index(format!(
                "{} bytes after the last window",
                data.len() - r.pos
            )));
        }
        Ok(SeekIndex {
            codec,
            compressed_size,
            uncompressed_size,
            span,
            checkpoints,
        })
    }
}

fn window_of(c: &Checkpoint) -> Option<&Window> {
    match &c.resume {
        Resume::Deflate { window, .. } => Some(window),
        Resume::Stream => None,
    }
}

/// Bounds-checked reads of a serialized index.
struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        let end = end.ok_or_else(|| Error::index(format!("ends at byte {} inside a field", self.data.len())))?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("take gives N bytes"))
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}
