//! Content digests (`sha256:…`, `sha512:…`) and a reader that checks a
//! blob against its digest and size as it streams.

use sha2::{Digest as _, Sha256, Sha512};
use std::fmt;
use std::io::{self, Read};
use std::sync::{Arc, Mutex};

/// A content digest as OCI descriptors spell it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Digest {
    algorithm: Algorithm,
    hex: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    Sha256,
    Sha512,
}

impl Digest {
    /// Parses `ALGORITHM:HEX`; only sha256 and sha512, in lower-case hex of
    /// the right length (anything else could name a path).
    pub fn parse(s: &str) -> Result<Digest, String> {
        let (alg, hex) = s
            .split_once(':')
            .ok_or_else(|| format!("{s:?} is not a digest (no algorithm)"))?;
        let (algorithm, len) = match alg {
            "sha256" => (Algorithm::Sha256, 64),
            "sha512" => (Algorithm::Sha512, 128),
            _ => return Err(format!("{s:?}: unsupported digest algorithm {alg:?}")),
        };
        if hex.len() != len || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(format!("{s:?} is not a valid {alg} digest"));
        }
        Ok(Digest {
            algorithm,
            hex: hex.to_string(),
        })
    }

    /// The SHA-256 digest of `data`.
    pub fn sha256_of(data: &[u8]) -> Digest {
        Digest {
            algorithm: Algorithm::Sha256,
            hex: hex::encode(Sha256::digest(data)),
        }
    }

    /// A SHA-256 digest computed elsewhere.
    pub fn from_sha256(hash: [u8; 32]) -> Digest {
        Digest {
            algorithm: Algorithm::Sha256,
            hex: hex::encode(hash),
        }
    }

    pub fn algorithm(&self) -> &'static str {
        match self.algorithm {
            Algorithm::Sha256 => "sha256",
            Algorithm::Sha512 => "sha512",
        }
    }

    pub fn hex(&self) -> &str {
        &self.hex
    }

    /// The blob's path in an OCI layout: `blobs/ALG/HEX`.
    pub fn layout_path(&self) -> String {
        format!("blobs/{}/{}", self.algorithm(), self.hex)
    }

    /// Whether `data` has this digest.
    pub fn matches(&self, data: &[u8]) -> bool {
        let mut h = Hasher::new(self.algorithm);
        h.update(data);
        h.finish_hex() == self.hex
    }

    /// A short form for progress displays: `sha256:0123456789ab`.
    pub fn short(&self) -> String {
        format!("{}:{}", self.algorithm(), &self.hex[..12])
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.algorithm(), self.hex)
    }
}

enum Hasher {
    Sha256(Sha256),
    Sha512(Sha512),
}

impl Hasher {
    fn new(a: Algorithm) -> Hasher {
        match a {
            Algorithm::Sha256 => Hasher::Sha256(Sha256::new()),
            Algorithm::Sha512 => Hasher::Sha512(Sha512::new()),
        }
    }

    fn update(&mut self, data: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(data),
            Hasher::Sha512(h) => h.update(data),
        }
    }

    fn finish_hex(self) -> String {
        match self {
            Hasher::Sha256(h) => hex::encode(h.finalize()),
            Hasher::Sha512(h) => hex::encode(h.finalize()),
        }
    }
}

/// The outcome of a [`Verified`] stream, shared with whoever reads it
/// through other layers (a decompressor, a tar reader), so that a digest
/// mismatch is reported as such rather than as the corrupt data it causes.
#[derive(Clone, Default)]
pub struct BlobCheck(Arc<Mutex<CheckState>>);

#[derive(Default)]
struct CheckState {
    done: bool,
    failure: Option<String>,
}

impl BlobCheck {
    /// Why the blob was refused, if it was (so far).
    pub fn failure(&self) -> Option<String> {
        self.0.lock().unwrap().failure.clone()
    }

    /// Ok once the whole blob was read and matched; the reason otherwise.
    pub fn result(&self) -> Result<(), String> {
        let s = self.0.lock().unwrap();
        match (&s.failure, s.done) {
            (Some(f), _) => Err(f.clone()),
            (None, true) => Ok(()),
            (None, false) => Err("the blob was not read to its end".to_string()),
        }
    }

    fn fail(&self, reason: String) -> io::Error {
        let mut s = self.0.lock().unwrap();
        s.failure.get_or_insert(reason.clone());
        io::Error::new(io::ErrorKind::InvalidData, reason)
    }
}

/// Reads a blob, hashing it; at its end, checks its size and digest and
/// fails the read (and records why in its [`BlobCheck`]) if they differ
/// from the descriptor's. Reading past the stated size fails at once; a
/// transfer that fails is recorded as the blob's failure too.
pub struct Verified<R> {
    inner: R,
    hasher: Option<Hasher>,
    expected: Digest,
    size: Option<u64>,
    read: u64,
    check: BlobCheck,
    counter: Option<Arc<std::sync::atomic::AtomicU64>>,
}

impl<R: Read> Verified<R> {
    /// `size` is the descriptor's size, where there is one.
    pub fn new(inner: R, expected: Digest, size: Option<u64>) -> Verified<R> {
        Verified {
            inner,
            hasher: Some(Hasher::new(expected.algorithm)),
            expected,
            size,
            read: 0,
            check: BlobCheck::default(),
            counter: None,
        }
    }

    /// Counts the bytes read into `counter` too (for progress).
    pub fn counting(mut self, counter: Arc<std::sync::atomic::AtomicU64>) -> Self {
        self.counter = Some(counter);
        self
    }

    pub fn check(&self) -> BlobCheck {
        self.check.clone()
    }
}

impl<R: Read> Read for Verified<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(h) = self.hasher.as_mut() else {
            return Ok(0);
        };
        let n = match self.inner.read(buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Err(e),
            // The transfer failed: that is what is wrong with the blob,
            // whatever the readers above make of what came.
            Err(e) => return Err(self.check.fail(e.to_string())),
        };
        if n > 0 {
            h.update(&buf[..n]);
            self.read += n as u64;
            if let Some(c) = &self.counter {
                c.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            }
            if self.size.is_some_and(|s| self.read > s) {
                return Err(self.check.fail(format!(
                    "longer than the {} bytes its descriptor states",
                    self.size.unwrap()
                )));
            }
            return Ok(n);
        }
        let actual = self.hasher.take().unwrap().finish_hex();
        if let Some(s) = self.size.filter(|&s| s != self.read) {
            return Err(self.check.fail(format!(
                "{} bytes where its descriptor states {s} (truncated)",
                self.read
            )));
        }
        if actual != self.expected.hex {
            return Err(self.check.fail(format!(
                "content does not match its digest (got {}:{actual})",
                self.expected.algorithm()
            )));
        }
        self.check.0.lock().unwrap().done = true;
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_strictly() {
        let d = Digest::sha256_of(b"abc");
        assert_eq!(Digest::parse(&d.to_string()).unwrap(), d);
        assert!(Digest::parse("sha256:../../etc/passwd").is_err());
        assert!(Digest::parse("md5:00").is_err());
        assert!(Digest::parse(&format!("sha256:{}", "A".repeat(64))).is_err());
    }

    #[test]
    fn mismatches_fail_the_read_and_say_why() {
        let d = Digest::sha256_of(b"hello");
        let mut ok = Verified::new(&b"hello"[..], d.clone(), Some(5));
        io::copy(&mut ok, &mut io::sink()).unwrap();
        assert!(ok.check().result().is_ok());
        let mut bad = Verified::new(&b"hellO"[..], d.clone(), Some(5));
        assert!(io::copy(&mut bad, &mut io::sink()).is_err());
        assert!(bad.check().result().unwrap_err().contains("does not match"));
        let mut short = Verified::new(&b"hell"[..], d.clone(), Some(5));
        assert!(io::copy(&mut short, &mut io::sink()).is_err());
        assert!(short.check().failure().unwrap().contains("truncated"));
        let mut long = Verified::new(&b"hello!"[..], d, Some(5));
        assert!(io::copy(&mut long, &mut io::sink()).is_err());
    }
}
