//! The one error type of the crate.

use std::io;

/// What went wrong, with the reason in words. The crate does not know the
/// names of the blobs it is handed: the caller adds the blob's digest when
/// it reports the error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The compressed stream is not valid gzip, deflate or zstd, or ends
    /// too early.
    #[error("{0}")]
    Corrupt(String),
    /// A serialized seek index breaks the format (see [`crate::format`]).
    #[error("seek index: {0}")]
    Index(String),
    /// An eStargz or zstd:chunked footer or table of contents is invalid.
    #[error("{0}")]
    Toc(String),
    /// Bytes that do not have the digest that vouches for them.
    #[error("{what}: digest is {actual}, not {expected}")]
    Digest {
        what: String,
        expected: String,
        actual: String,
    },
    /// The caller asked for something outside what it described, or handed
    /// fewer bytes than the range it was told to fetch.
    #[error("{0}")]
    Range(String),
    /// Reading the compressed input failed.
    #[error("cannot read the compressed stream: {0}")]
    Io(#[from] io::Error),
}

impl Error {
    pub(crate) fn corrupt(msg: impl Into<String>) -> Self {
        Error::Corrupt(msg.into())
    }
    pub(crate) fn index(msg: impl Into<String>) -> Self {
        Error::Index(msg.into())
    }
    pub(crate) fn toc(msg: impl Into<String>) -> Self {
        Error::Toc(msg.into())
    }
    pub(crate) fn range(msg: impl Into<String>) -> Self {
        Error::Range(msg.into())
    }
}

/// The crate's errors inside an [`io::Error`] (for the `Read` adapters):
/// an I/O error of the input comes back as it was, anything else as
/// `InvalidData` carrying the [`Error`].
impl From<Error> for io::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Io(e) => e,
            e => io::Error::new(io::ErrorKind::InvalidData, e),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
