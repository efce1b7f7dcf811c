//! zstd random access: an indexer that records frame boundaries while a
//! layer streams through the pull, and decoding from one of them. Frames
//! are independent, so a frame start needs nothing before it; a layer
//! written as one frame cannot be entered anywhere else and is fetched
//! whole ([`SeekIndex::is_enterable`]).

use std::io::{self, BufRead, Read};

use zstd::stream::raw::{Decoder, Operation};

use crate::error::{Error, Result};
use crate::index::{Checkpoint, Codec, Resume, SeekIndex};
use crate::input::{skip_and_fill, Counted, Decode, Flow};

/// The default spacing of checkpoints, in uncompressed bytes: a zstd
/// checkpoint costs 28 bytes, so frame starts are kept densely (a pzstd
/// layer of /usr/share, 86 frames: a 2.4 KB index).
pub const DEFAULT_SPAN: u64 = 256 << 10;

const BUF_LEN: usize = 128 * 1024;

pub(crate) enum Event {
    Output,
    /// A frame (skippable or not) starts at this compressed offset.
    Frame(u64),
    End,
}

/// A zstd decoder over a counted input that notes where frames start.
pub(crate) struct Frames<R> {
    input: Counted<R>,
    dec: Decoder<'static>,
    buf: Box<[u8]>,
    pos: usize,
    read: usize,
    total_out: u64,
    frame_at: u64,
    in_frame: bool,
    pub(crate) frames: u64,
}

impl<R: BufRead> Frames<R> {
    /// Decodes from a frame at compressed offset `at` that decodes to
    /// uncompressed offset `out_at`.
    pub(crate) fn at_frame(input: R, at: u64, out_at: u64) -> Result<Self> {
        Ok(Frames {
            input: Counted::new(input, at),
            dec: Decoder::new().map_err(|e| Error::corrupt(format!("cannot start a zstd decoder: {e}")))?,
            buf: vec![0; BUF_LEN].into_boxed_slice(),
            pos: 0,
            read: 0,
            total_out: out_at,
            frame_at: at,
            in_frame: false,
            frames: 0,
        })
    }

    pub(crate) fn pending(&self) -> &[u8] {
        &self.buf[self.read..self.pos]
    }

    pub(crate) fn take(&mut self, n: usize) {
        debug_assert!(n <= self.pos - self.read);
        self.read += n;
    }

    pub(crate) fn total_out(&self) -> u64 {
        self.total_out
    }

    pub(crate) fn total_in(&self) -> u64 {
        self.input.pos
    }

    /// One step of decoding; call only once `pending` is empty.
    pub(crate) fn advance(&mut self) -> Result<Event> {
        debug_assert_eq!(self.read, self.pos);
        self.pos = 0;
        self.read = 0;
        if !self.in_frame {
            let at = self.input.pos;
            if self.input.fill()?.is_empty() {
                return Ok(Event::End);
            }
            self.in_frame = true;
            self.frame_at = at;
            self.frames += 1;
            return Ok(Event::Frame(at));
        }
        let input = self.input.fill()?;
        let eof = input.is_empty();
        let st = self.dec.run_on_buffers(input, &mut self.buf).map_err(|e| {
            Error::corrupt(format!(
                "invalid zstd data in the frame at compressed byte {}: {e}",
                self.frame_at
            ))
        })?;
        self.input.consume(st.bytes_read);
        self.pos = st.bytes_written;
        self.total_out += st.bytes_written as u64;
        if st.remaining == 0 {
            // The frame is decoded and flushed; the decoder stops there.
            self.in_frame = false;
        } else if eof && st.bytes_read == 0 && st.bytes_written == 0 {
            return Err(Error::corrupt(format!(
                "the compressed stream ends at byte {} inside the zstd frame at byte {}",
                self.input.pos, self.frame_at
            )));
        }
        Ok(Event::Output)
    }
}

/// A `Read` adapter for the single pass of a pull: hands out the
/// decompressed zstd stream (every frame; skippable frames skipped) and
/// records a checkpoint at the first frame start at least `span`
/// uncompressed bytes after the last one. [`ZstdIndexer::finish`] gives
/// the index.
pub struct ZstdIndexer<R> {
    state: Indexing<R>,
    flow: Flow,
}

/// The decoder and the checkpoints so far.
struct Indexing<R> {
    fr: Frames<R>,
    span: u64,
    checkpoints: Vec<Checkpoint>,
    /// A frame start due as a checkpoint, kept once output follows it (so
    /// skippable and empty frames at the end make none).
    candidate: Option<(u64, u64)>,
}

impl<R: BufRead> ZstdIndexer<R> {
    /// An indexer at [`DEFAULT_SPAN`].
    pub fn new(input: R) -> Result<Self> {
        Self::with_span(input, DEFAULT_SPAN)
    }

    /// An indexer with checkpoints about every `span` uncompressed bytes
    /// (at least 1).
    pub fn with_span(input: R, span: u64) -> Result<Self> {
        Ok(ZstdIndexer {
            state: Indexing {
                fr: Frames::at_frame(input, 0, 0)?,
                span: span.max(1),
                checkpoints: vec![Checkpoint {
                    compressed: 0,
                    uncompressed: 0,
                    resume: Resume::Stream,
                }],
                candidate: None,
            },
            flow: Flow::default(),
        })
    }

    /// The compressed input.
    pub fn get_ref(&self) -> &R {
        self.state.fr.input.get_ref()
    }

    /// Reads what is left of the stream and returns the index.
    pub fn finish(mut self) -> Result<SeekIndex> {
        self.flow.drain(&mut self.state)?;
        let s = self.state;
        Ok(SeekIndex {
            codec: Codec::Zstd,
            compressed_size: s.fr.total_in(),
            uncompressed_size: s.fr.total_out(),
            span: s.span,
            checkpoints: s.checkpoints,
        })
    }

    /// The compressed input, once the index is no longer wanted.
    pub fn into_inner(self) -> R {
        self.state.fr.input.into_inner()
    }
}

impl<R: BufRead> Read for ZstdIndexer<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        self.flow.read(&mut self.state, out)
    }
}

impl<R: BufRead> Decode for Indexing<R> {
    fn pending(&self) -> &[u8] {
        self.fr.pending()
    }
    fn take(&mut self, n: usize) {
        self.fr.take(n)
    }
    fn more(&mut self) -> Result<bool> {
        let before = self.fr.total_out();
        match self.fr.advance()? {
            Event::Frame(at) => {
                let last = self
                    .checkpoints
                    .last()
                    .expect("the first checkpoint is there from the start");
                if at > last.compressed && before - last.uncompressed >= self.span {
                    self.candidate = Some((at, before));
                }
            }
            Event::Output => {
                if self.fr.total_out() > before {
                    if let Some((compressed, uncompressed)) = self.candidate.take() {
                        self.checkpoints.push(Checkpoint {
                            compressed,
                            uncompressed,
                            resume: Resume::Stream,
                        });
                    }
                }
            }
            Event::End if self.fr.frames == 0 => return Err(Error::corrupt("an empty stream is not zstd")),
            Event::End => return Ok(false),
        }
        Ok(true)
    }
    fn total_out(&self) -> u64 {
        self.fr.total_out()
    }
}

impl<R: BufRead> Decode for Frames<R> {
    fn pending(&self) -> &[u8] {
        Frames::pending(self)
    }
    fn take(&mut self, n: usize) {
        Frames::take(self, n)
    }
    fn more(&mut self) -> Result<bool> {
        Ok(!matches!(self.advance()?, Event::End))
    }
    fn total_out(&self) -> u64 {
        self.total_out
    }
}

/// Decodes from the frame start `cp` (`fetched` starts at its compressed
/// offset), drops `skip` bytes and fills `out`.
pub(crate) fn read_from(cp: &Checkpoint, fetched: &[u8], skip: u64, out: &mut [u8]) -> Result<()> {
    if cp.resume != Resume::Stream {
        return Err(Error::index("a zstd checkpoint that is not a frame start"));
    }
    let mut fr = Frames::at_frame(fetched, cp.compressed, cp.uncompressed)?;
    skip_and_fill(&mut fr, skip, out, cp.compressed, fetched.len())
}

/// Decodes zstd frames from compressed offset `at` (where `fetched`
/// starts) into `out`: a zstd:chunked chunk.
pub(crate) fn read_frames(at: u64, fetched: &[u8], out: &mut [u8]) -> Result<()> {
    let cp = Checkpoint {
        compressed: at,
        uncompressed: 0,
        resume: Resume::Stream,
    };
    read_from(&cp, fetched, 0, out)
}
