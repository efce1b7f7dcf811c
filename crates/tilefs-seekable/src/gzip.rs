//! gzip random access: an indexer that records checkpoints while a layer
//! streams through the pull, and decoding that starts at one of them.
//!
//! Decoding uses miniz_oxide's inflater, which can stop between deflate
//! blocks, say how many bits of the last byte belong to the next block, and
//! start again there from those bits and the 32 KiB window, all through a
//! safe interface (zlib-rs's safe interface can do neither; only its C
//! interface, unsafe to call, can). It decodes as fast as zlib-rs on a tar
//! of /usr/share.

use std::io::{self, BufRead, Read};

use miniz_oxide::inflate::core::inflate_flags::{
    TINFL_FLAG_HAS_MORE_INPUT, TINFL_FLAG_STOP_ON_BLOCK_BOUNDARY, TINFL_FLAG_USING_NON_WRAPPING_OUTPUT_BUF,
};
use miniz_oxide::inflate::core::{decompress_with_limit, BlockBoundaryState, DecompressorOxide};
use miniz_oxide::inflate::TINFLStatus;

use crate::error::{Error, Result};
use crate::index::{Checkpoint, Codec, Resume, SeekIndex, Window, MAX_WINDOW};
use crate::input::{skip_and_fill, Counted, Decode, Flow};

/// The default spacing of checkpoints, in uncompressed bytes. Each costs a
/// window: 32 KiB compressed about as well as the layer (15.8 KiB on a tar
/// of /usr/share at gzip -6, ratio 2.3), so the index is about
/// 32 KiB / span of the compressed layer whatever its ratio: 0.84% there
/// (1 MiB: 3.2%, 2 MiB: 1.6%, 8 MiB: 0.4%), leaving most of issue 44's 5%
/// to the rest of the index artifact. A read decodes 2 MiB on average
/// before the bytes it wants (about 5 ms).
pub const DEFAULT_SPAN: u64 = 4 << 20;

/// The longest file name or comment a gzip header may carry here (gzip
/// writes the input's name; nothing writes 64 KiB of it).
pub const MAX_HEADER_TEXT: usize = 64 * 1024;

const RESERVED_FLAGS: u8 = 0xe0;
const FHCRC: u8 = 0x02;
const FEXTRA: u8 = 0x04;
const FNAME: u8 = 0x08;
const FCOMMENT: u8 = 0x10;

/// History kept in the buffer: as far back as deflate can copy from.
const HIST: usize = MAX_WINDOW;
/// History plus room for output: each slide moves 32 KiB to make 256 KiB.
const BUF_LEN: usize = HIST + 256 * 1024;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before a member, or at the end of the input.
    Between,
    /// A member starts here; its header is next.
    Header,
    Deflate,
    Trailer,
    End,
}

/// What one step of decoding came to.
pub(crate) enum Event {
    /// Maybe some output; nothing else to note.
    Output,
    /// A member header starts at this compressed offset (not yet read).
    Member(u64),
    /// A deflate block starts here (only when asked to stop there).
    Boundary,
    /// The end of the input, between members.
    End,
}

/// A multi-member gzip decoder over a counted input, with its output and
/// the 32 KiB before it in one buffer.
pub(crate) struct Inflater<R> {
    input: Counted<R>,
    state: Box<DecompressorOxide>,
    buf: Box<[u8]>,
    /// Decoded bytes end here.
    pos: usize,
    /// Bytes before this were handed out (or are history).
    read: usize,
    /// Bytes the current member decoded (as far as this decoder knows).
    member_out: u64,
    /// Uncompressed offset of `buf[pos]`.
    total_out: u64,
    phase: Phase,
    /// The CRC-32 of the member so far, when it was decoded from its header.
    crc: Option<crc32fast::Hasher>,
    /// Compressed offset of the current member's header, for messages.
    member_at: u64,
    pub(crate) members: u64,
    /// The extra field (FEXTRA) of the last member header.
    pub(crate) extra: Vec<u8>,
}

impl<R: BufRead> Inflater<R> {
    /// Decodes from a member header at compressed offset `at` that decodes
    /// to uncompressed offset `out_at`.
    pub(crate) fn at_member(input: R, at: u64, out_at: u64) -> Self {
        Inflater {
            input: Counted::new(input, at),
            state: Box::default(),
            buf: vec![0; BUF_LEN].into_boxed_slice(),
            pos: 0,
            read: 0,
            member_out: 0,
            total_out: out_at,
            phase: Phase::Between,
            crc: None,
            member_at: at,
            members: 0,
            extra: Vec::new(),
        }
    }

    /// Decodes from a checkpoint; `input` starts at its compressed offset.
    pub(crate) fn at_checkpoint(cp: &Checkpoint, input: R) -> Result<Self> {
        let mut inf = Inflater::at_member(input, cp.compressed, cp.uncompressed);
        if let Resume::Deflate {
            bits,
            bit_value,
            window,
        } = &cp.resume
        {
            let w = window.decompress()?;
            inf.buf[..w.len()].copy_from_slice(&w);
            inf.pos = w.len();
            inf.read = w.len();
            inf.member_out = w.len() as u64;
            *inf.state = DecompressorOxide::from_block_boundary_state(&BlockBoundaryState {
                num_bits: *bits,
                bit_buf: *bit_value,
                ..Default::default()
            });
            inf.phase = Phase::Deflate;
        }
        Ok(inf)
    }

    /// Decoded bytes not yet handed out.
    pub(crate) fn pending(&self) -> &[u8] {
        &self.buf[self.read..self.pos]
    }

    pub(crate) fn take(&mut self, n: usize) {
        debug_assert!(n <= self.pos - self.read);
        self.read += n;
    }

    /// Uncompressed bytes decoded so far (to the end of `pending`).
    pub(crate) fn total_out(&self) -> u64 {
        self.total_out
    }

    /// Compressed bytes consumed so far.
    pub(crate) fn total_in(&self) -> u64 {
        self.input.pos
    }

    pub(crate) fn into_input(self) -> R {
        self.input.into_inner()
    }

    pub(crate) fn input_ref(&self) -> &R {
        self.input.get_ref()
    }

    /// The window at the current position: what the member decoded last.
    fn window(&self) -> &[u8] {
        let w = (self.member_out.min(HIST as u64)) as usize;
        &self.buf[self.pos - w..self.pos]
    }

    /// The bits of the next block that the last consumed byte still holds,
    /// at a [`Event::Boundary`].
    fn boundary_bits(&self) -> Result<(u8, u8)> {
        let st = self
            .state
            .block_boundary_state()
            .ok_or_else(|| Error::corrupt("the inflater stopped between blocks but has no block state"))?;
        Ok((st.num_bits, st.bit_buf & ((1u16 << st.num_bits) - 1) as u8))
    }

    /// One step of decoding. Call only once `pending` is empty. With
    /// `stop_from`, decoding stops at the first deflate block boundary at
    /// or after that uncompressed offset.
    pub(crate) fn advance(&mut self, stop_from: Option<u64>) -> Result<Event> {
        debug_assert_eq!(self.read, self.pos);
        match self.phase {
            Phase::Between => {
                let at = self.input.pos;
                if self.input.fill()?.is_empty() {
                    self.phase = Phase::End;
                    return Ok(Event::End);
                }
                self.phase = Phase::Header;
                Ok(Event::Member(at))
            }
            Phase::Header => {
                self.member_at = self.input.pos;
                self.extra = self.header()?;
                self.state.init();
                self.pos = 0;
                self.read = 0;
                self.member_out = 0;
                self.crc = Some(crc32fast::Hasher::new());
                self.members += 1;
                self.phase = Phase::Deflate;
                Ok(Event::Output)
            }
            Phase::Deflate => self.inflate(stop_from),
            Phase::Trailer => {
                let mut t = [0u8; 8];
                self.input.exact(&mut t, "a gzip member trailer")?;
                if let Some(crc) = self.crc.take() {
                    let (want_crc, want_len) = (u32::from_le_bytes(t[..4].try_into().unwrap()), &t[4..]);
                    let crc = crc.finalize();
                    if crc != want_crc || (self.member_out as u32).to_le_bytes() != want_len {
                        return Err(Error::corrupt(format!(
                            "the gzip member at compressed byte {} decodes to {} bytes with CRC-32 {crc:08x}, \
                             its trailer says {} bytes and {want_crc:08x}",
                            self.member_at,
                            self.member_out,
                            u32::from_le_bytes(want_len.try_into().unwrap())
                        )));
                    }
                }
                self.phase = Phase::Between;
                Ok(Event::Output)
            }
            Phase::End => Ok(Event::End),
        }
    }

    fn inflate(&mut self, stop_from: Option<u64>) -> Result<Event> {
        if self.pos == self.buf.len() {
            // Keep the window, make room after it.
            self.buf.copy_within(self.pos - HIST..self.pos, 0);
            self.pos = HIST;
            self.read = HIST;
        }
        let mut flags = TINFL_FLAG_HAS_MORE_INPUT | TINFL_FLAG_USING_NON_WRAPPING_OUTPUT_BUF;
        // Before the offset, decode up to it (boundaries there are not
        // wanted); from it on, stop at the next boundary.
        let mut limit = usize::MAX;
        match stop_from {
            Some(from) if self.total_out >= from => flags |= TINFL_FLAG_STOP_ON_BLOCK_BOUNDARY,
            Some(from) => limit = usize::try_from(from - self.total_out).unwrap_or(usize::MAX),
            None => {}
        }
        let input = self.input.fill()?;
        let eof = input.is_empty();
        let (status, used, made) = decompress_with_limit(&mut self.state, input, &mut self.buf, self.pos, limit, flags);
        self.input.consume(used);
        if made > 0 {
            if let Some(crc) = &mut self.crc {
                crc.update(&self.buf[self.pos..self.pos + made]);
            }
            self.pos += made;
            self.member_out += made as u64;
            self.total_out += made as u64;
        }
        let stuck = used == 0 && made == 0;
        match status {
            TINFLStatus::Done => {
                self.phase = Phase::Trailer;
                Ok(Event::Output)
            }
            TINFLStatus::BlockBoundary => Ok(Event::Boundary),
            TINFLStatus::NeedsMoreInput if stuck && eof => Err(Error::corrupt(format!(
                "the compressed stream ends at byte {} inside the deflate data of the gzip member at byte {}",
                self.input.pos, self.member_at
            ))),
            TINFLStatus::NeedsMoreInput | TINFLStatus::HasMoreOutput if !stuck => Ok(Event::Output),
            s => Err(Error::corrupt(format!(
                "invalid deflate data at compressed byte {} in the gzip member at byte {} ({s:?})",
                self.input.pos, self.member_at
            ))),
        }
    }

    /// Reads a member header (RFC 1952, 2.3), returning its extra field.
    fn header(&mut self) -> Result<Vec<u8>> {
        let at = self.input.pos;
        let mut crc = crc32fast::Hasher::new();
        let mut fixed = [0u8; 10];
        self.input.exact(&mut fixed, "a gzip member header")?;
        crc.update(&fixed);
        let bad = |why: String| Error::corrupt(format!("the gzip member header at compressed byte {at}: {why}"));
        if fixed[..2] != [0x1f, 0x8b] {
            return Err(bad(format!("no gzip magic (starts {:02x} {:02x})", fixed[0], fixed[1])));
        }
        if fixed[2] != 8 {
            return Err(bad(format!("compression method {} is not deflate", fixed[2])));
        }
        let flags = fixed[3];
        if flags & RESERVED_FLAGS != 0 {
            return Err(bad(format!("reserved flags set ({flags:#04x})")));
        }
        let mut extra = Vec::new();
        if flags & FEXTRA != 0 {
            let mut len = [0u8; 2];
            self.input.exact(&mut len, "a gzip extra field")?;
            extra = vec![0; u16::from_le_bytes(len) as usize];
            self.input.exact(&mut extra, "a gzip extra field")?;
            crc.update(&len);
            crc.update(&extra);
        }
        for (flag, what) in [(FNAME, "file name"), (FCOMMENT, "comment")] {
            if flags & flag == 0 {
                continue;
            }
            let mut n = 0;
            loop {
                let b = self
                    .input
                    .byte()?
                    .ok_or_else(|| bad(format!("the stream ends inside its {what}")))?;
                crc.update(&[b]);
                if b == 0 {
                    break;
                }
                n += 1;
                if n > MAX_HEADER_TEXT {
                    return Err(bad(format!("{what} longer than {MAX_HEADER_TEXT} bytes")));
                }
            }
        }
        if flags & FHCRC != 0 {
            let mut want = [0u8; 2];
            self.input.exact(&mut want, "a gzip header CRC")?;
            let have = crc.finalize() as u16;
            if u16::from_le_bytes(want) != have {
                return Err(bad(format!(
                    "header CRC {:04x}, computed {have:04x}",
                    u16::from_le_bytes(want)
                )));
            }
        }
        Ok(extra)
    }
}

/// A `Read` adapter for the single pass of a pull: hands out the
/// decompressed gzip stream (every member, as `MultiGzDecoder` would,
/// CRC-32 and length of each checked) and records a checkpoint at the
/// first deflate block or member boundary at least `span` uncompressed
/// bytes after the last one. [`GzipIndexer::finish`] gives the index.
pub struct GzipIndexer<R> {
    state: Indexing<R>,
    flow: Flow,
}

/// The decoder and the checkpoints so far.
struct Indexing<R> {
    inf: Inflater<R>,
    span: u64,
    checkpoints: Vec<Checkpoint>,
}

impl<R: BufRead> GzipIndexer<R> {
    /// An indexer at [`DEFAULT_SPAN`].
    pub fn new(input: R) -> Self {
        Self::with_span(input, DEFAULT_SPAN)
    }

    /// An indexer with checkpoints about every `span` uncompressed bytes
    /// (at least 1).
    pub fn with_span(input: R, span: u64) -> Self {
        GzipIndexer {
            state: Indexing {
                inf: Inflater::at_member(input, 0, 0),
                span: span.max(1),
                checkpoints: vec![Checkpoint {
                    compressed: 0,
                    uncompressed: 0,
                    resume: Resume::Stream,
                }],
            },
            flow: Flow::default(),
        }
    }

    /// The compressed input.
    pub fn get_ref(&self) -> &R {
        self.state.inf.input_ref()
    }

    /// Reads what is left of the stream (a pull reads it all anyway, to
    /// check the blob's digest) and returns the index.
    pub fn finish(mut self) -> Result<SeekIndex> {
        self.flow.drain(&mut self.state)?;
        let s = self.state;
        Ok(SeekIndex {
            codec: Codec::Gzip,
            compressed_size: s.inf.total_in(),
            uncompressed_size: s.inf.total_out(),
            span: s.span,
            checkpoints: s.checkpoints,
        })
    }

    /// The compressed input, once the index is no longer wanted.
    pub fn into_inner(self) -> R {
        self.state.inf.into_input()
    }
}

impl<R: BufRead> Read for GzipIndexer<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        self.flow.read(&mut self.state, out)
    }
}

impl<R: BufRead> Indexing<R> {
    /// Where the next checkpoint is due: a span after the last.
    fn due_at(&self) -> u64 {
        let last = self
            .checkpoints
            .last()
            .expect("the first checkpoint is there from the start");
        last.uncompressed.saturating_add(self.span)
    }

    fn push(&mut self, compressed: u64, resume: Resume) {
        let last = self
            .checkpoints
            .last()
            .expect("the first checkpoint is there from the start");
        // Output came, so input was consumed: the offsets grow (checked, so
        // a strange stream cannot make an index that does not decode).
        if compressed > last.compressed {
            self.checkpoints.push(Checkpoint {
                compressed,
                uncompressed: self.inf.total_out(),
                resume,
            });
        }
    }
}

impl<R: BufRead> Decode for Indexing<R> {
    fn pending(&self) -> &[u8] {
        self.inf.pending()
    }
    fn take(&mut self, n: usize) {
        self.inf.take(n)
    }
    fn more(&mut self) -> Result<bool> {
        let due_at = self.due_at();
        let due = self.inf.total_out() >= due_at;
        match self.inf.advance(Some(due_at))? {
            Event::Output => {}
            Event::Member(at) if due => self.push(at, Resume::Stream),
            Event::Boundary if due => {
                let (bits, bit_value) = self.inf.boundary_bits()?;
                let window = Window::compress(self.inf.window());
                self.push(
                    self.inf.total_in(),
                    Resume::Deflate {
                        bits,
                        bit_value,
                        window,
                    },
                );
            }
            Event::Member(_) | Event::Boundary => {}
            Event::End if self.inf.members == 0 => return Err(Error::corrupt("an empty stream is not gzip")),
            Event::End => return Ok(false),
        }
        Ok(true)
    }
    fn total_out(&self) -> u64 {
        self.inf.total_out()
    }
}

impl<R: BufRead> Decode for Inflater<R> {
    fn pending(&self) -> &[u8] {
        Inflater::pending(self)
    }
    fn take(&mut self, n: usize) {
        Inflater::take(self, n)
    }
    fn more(&mut self) -> Result<bool> {
        Ok(!matches!(self.advance(None)?, Event::End))
    }
    fn total_out(&self) -> u64 {
        self.total_out
    }
}

/// Decodes from `cp` (`fetched` starts at its compressed offset), drops
/// `skip` bytes and fills `out`.
pub(crate) fn read_from(cp: &Checkpoint, fetched: &[u8], skip: u64, out: &mut [u8]) -> Result<()> {
    let mut inf = Inflater::at_checkpoint(cp, fetched)?;
    skip_and_fill(&mut inf, skip, out, cp.compressed, fetched.len())
}

/// Decodes gzip members from compressed offset `at` (where `fetched`
/// starts), drops `skip` bytes and fills `out`: an eStargz chunk.
pub(crate) fn read_members(at: u64, fetched: &[u8], skip: u64, out: &mut [u8]) -> Result<()> {
    let cp = Checkpoint {
        compressed: at,
        uncompressed: 0,
        resume: Resume::Stream,
    };
    read_from(&cp, fetched, skip, out)
}
