//! What a peer sends is read with a cap: a document (a manifest, an index,
//! a configuration, a signature, a registry's error or tag list) is read
//! into memory while it streams and refused as soon as it passes its
//! limit, never read whole first. The limits are those of containers/image
//! (`internal/iolimits`), so that what skopeo and podman take, tilefs takes.

use std::io::{self, Read};

/// A manifest or an index (also the distribution project's limit for what
/// a registry accepts).
pub const MAX_MANIFEST: u64 = 4 << 20;
/// An image configuration.
pub const MAX_CONFIG: u64 = 4 << 20;
/// A signature, a sigstore payload, a signature attachments manifest.
pub const MAX_SIGNATURE: u64 = 4 << 20;
/// A registry's error body (only its first part is shown) or tag list.
pub const MAX_ERROR_BODY: u64 = 1 << 20;
/// A token server's answer (a JSON object holding a token of a few KiB).
pub const MAX_TOKEN_ANSWER: u64 = 1 << 20;

/// Why a bounded read failed.
#[derive(Debug)]
pub enum ReadError {
    /// More than the limit came (the limit).
    TooLarge(u64),
    Io(io::Error),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::TooLarge(limit) => write!(f, "larger than {} (the limit)", size(*limit)),
            ReadError::Io(e) => write!(f, "cannot read: {e}"),
        }
    }
}

impl std::error::Error for ReadError {}

/// Reads `r` to its end, failing as soon as more than `limit` bytes have
/// come: at most `limit + 1` bytes are read, and memory grows with what
/// came, not with what was announced.
pub fn read_at_most(r: &mut dyn Read, limit: u64) -> Result<Vec<u8>, ReadError> {
    let mut out = Vec::new();
    r.take(limit.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(ReadError::Io)?;
    if out.len() as u64 > limit {
        return Err(ReadError::TooLarge(limit));
    }
    Ok(out)
}

/// `n` bytes for messages: "4 MiB", "1536 bytes".
pub fn size(n: u64) -> String {
    const UNITS: [(u64, &str); 4] = [(1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        if n >= unit && n.is_multiple_of(unit) {
            return format!("{} {name}", n / unit);
        }
    }
    format!("{n} bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hands out its bytes a few at a time, then fails or ends.
    struct Trickle<'a>(&'a [u8], usize);

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.0.len().min(buf.len()).min(self.1);
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    #[test]
    fn reads_up_to_the_limit_and_refuses_one_byte_more() {
        let data = vec![7u8; 100];
        assert_eq!(read_at_most(&mut Trickle(&data, 3), 100).unwrap(), data);
        let e = read_at_most(&mut Trickle(&data, 3), 99).unwrap_err();
        assert!(matches!(e, ReadError::TooLarge(99)), "{e}");
        assert_eq!(e.to_string(), "larger than 99 bytes (the limit)");
        assert_eq!(
            ReadError::TooLarge(MAX_MANIFEST).to_string(),
            "larger than 4 MiB (the limit)"
        );
    }

    #[test]
    fn an_endless_stream_costs_the_limit() {
        let mut endless = io::repeat(b' ');
        assert!(matches!(
            read_at_most(&mut endless, 1 << 20),
            Err(ReadError::TooLarge(_))
        ));
    }
}
