//! A buffered input that counts what it consumed: the compressed offset
//! every checkpoint and error names.

use std::io::{self, BufRead, ErrorKind};

use crate::error::{Error, Result};

pub(crate) struct Counted<R> {
    inner: R,
    /// Offset in the blob of the next byte.
    pub(crate) pos: u64,
}

impl<R: BufRead> Counted<R> {
    pub(crate) fn new(inner: R, pos: u64) -> Self {
        Counted { inner, pos }
    }

    pub(crate) fn into_inner(self) -> R {
        self.inner
    }

    pub(crate) fn get_ref(&self) -> &R {
        &self.inner
    }

    /// What is buffered; empty only at the end of the input.
    pub(crate) fn fill(&mut self) -> Result<&[u8]> {
        loop {
            match self.inner.fill_buf() {
                // Asked again below: a borrow returned from inside the loop
                // is one the borrow checker cannot yet accept.
                Ok(_) => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::Io(e)),
            }
        }
        Ok(self.inner.fill_buf()?)
    }

    pub(crate) fn consume(&mut self, n: usize) {
        self.inner.consume(n);
        self.pos += n as u64;
    }

    /// The next byte, or `None` at the end of the input.
    pub(crate) fn byte(&mut self) -> Result<Option<u8>> {
        let b = self.fill()?.first().copied();
        if b.is_some() {
            self.consume(1);
        }
        Ok(b)
    }

    /// Exactly `buf.len()` bytes; `what` names them if the input ends first.
    pub(crate) fn exact(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let start = self.pos;
            let avail = self.fill()?;
            if avail.is_empty() {
                return Err(Error::corrupt(format!(
                    "the compressed stream ends at byte {start} inside {what}"
                )));
            }
            let n = avail.len().min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&avail[..n]);
            self.consume(n);
            done += n;
        }
        Ok(())
    }
}

/// `io::Read` for what an adapter hands out of its buffer.
pub(crate) fn copy_out(src: &[u8], dst: &mut [u8]) -> usize {
    let n = src.len().min(dst.len());
    dst[..n].copy_from_slice(&src[..n]);
    n
}

/// A decoder seen from a reader of ranges: decoded bytes waiting, and a
/// way to decode more.
pub(crate) trait Decode {
    fn pending(&self) -> &[u8];
    fn take(&mut self, n: usize);
    /// Decodes some more; `false` at the end of the input.
    fn more(&mut self) -> Result<bool>;
    fn total_out(&self) -> u64;
}

/// Drops `skip` decoded bytes and fills `out` with those after them.
/// `fetched` and `at` (its compressed offset) are for the message when the
/// input ends first.
pub(crate) fn skip_and_fill(d: &mut impl Decode, mut skip: u64, out: &mut [u8], at: u64, fetched: usize) -> Result<()> {
    let mut done = 0;
    while done < out.len() {
        let pending = d.pending();
        if pending.is_empty() {
            if !d.more()? {
                return Err(Error::range(format!(
                    "decoding from compressed byte {at} ends at uncompressed byte {}, before the range does \
                     ({fetched} bytes fetched)",
                    d.total_out()
                )));
            }
            continue;
        }
        let n = if skip > 0 {
            let n = (pending.len() as u64).min(skip) as usize;
            skip -= n as u64;
            n
        } else {
            let n = copy_out(pending, &mut out[done..]);
            done += n;
            n
        };
        d.take(n);
    }
    Ok(())
}

/// How an indexer's `Read` goes: it hands out what is decoded and decodes
/// a step more when nothing is. The end is kept, and so is an error that
/// broke the stream: every later read says it again rather than decoding
/// on from a broken state.
#[derive(Default)]
pub(crate) struct Flow {
    done: bool,
    failed: Option<String>,
}

impl Flow {
    pub(crate) fn read(&mut self, d: &mut impl Decode, out: &mut [u8]) -> io::Result<usize> {
        if let Some(msg) = &self.failed {
            return Err(Error::corrupt(msg.clone()).into());
        }
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            let pending = d.pending();
            if !pending.is_empty() {
                let n = copy_out(pending, out);
                d.take(n);
                return Ok(n);
            }
            if self.done {
                return Ok(0);
            }
            match d.more() {
                Ok(more) => self.done = !more,
                Err(e) => {
                    if !matches!(e, Error::Io(_)) {
                        self.failed = Some(e.to_string());
                    }
                    return Err(e.into());
                }
            }
        }
    }

    /// Reads the rest of the stream (an indexer's `finish`).
    pub(crate) fn drain(&mut self, d: &mut impl Decode) -> Result<()> {
        if let Some(msg) = &self.failed {
            return Err(Error::corrupt(msg.clone()));
        }
        while !self.done {
            let n = d.pending().len();
            if n > 0 {
                d.take(n);
            } else {
                self.done = !d.more()?;
            }
        }
        Ok(())
    }
}
