//! SHA-256 digests as OCI writes them (`sha256:` and 64 lowercase hex
//! digits): the only algorithm the tables of contents use.

use std::fmt;

use sha2::{Digest as _, Sha256};

use crate::error::{Error, Result};

/// A SHA-256 digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// Parses `sha256:<64 lowercase hex digits>`; `what` names the field
    /// for the error.
    pub fn parse(s: &str, what: &str) -> Result<Digest> {
        let hex_part = s
            .strip_prefix("sha256:")
            .ok_or_else(|| Error::toc(format!("{what}: {:?} is not a sha256 digest", truncate(s))))?;
        if hex_part.len() != 64 || !hex_part.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(Error::toc(format!(
                "{what}: {:?} is not 64 lowercase hex digits",
                truncate(s)
            )));
        }
        let mut d = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut d).map_err(|e| Error::toc(format!("{what}: {e}")))?;
        Ok(Digest(d))
    }

    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Digest {
        Digest(Sha256::digest(data).into())
    }

    /// Checks that `data` has this digest; `what` names the data.
    pub fn verify(&self, data: &[u8], what: impl FnOnce() -> String) -> Result<()> {
        let actual = Digest::of(data);
        if actual != *self {
            return Err(Error::Digest {
                what: what(),
                expected: self.to_string(),
                actual: actual.to_string(),
            });
        }
        Ok(())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// At most 80 characters of untrusted text, for an error message.
pub(crate) fn truncate(s: &str) -> &str {
    match s.char_indices().nth(80) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_sha256_only() {
        let s = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(Digest::parse(&s, "x").unwrap().to_string(), s);
        for bad in [
            "sha512:00".to_string(),
            format!("sha256:{}", "AB".repeat(32)),
            format!("sha256:{}", "ab".repeat(31)),
            format!("sha256:{}g", "a".repeat(63)),
            "".to_string(),
        ] {
            assert!(Digest::parse(&bad, "x").is_err(), "{bad}");
        }
    }

    #[test]
    fn verify_names_what_failed() {
        let d = Digest::of(b"abc");
        assert!(d.verify(b"abc", || "x".into()).is_ok());
        let e = d.verify(b"abd", || "chunk 3 of a/b".into()).unwrap_err().to_string();
        assert!(e.starts_with("chunk 3 of a/b: digest is sha256:"), "{e}");
    }
}
