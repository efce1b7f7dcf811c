//! fs-verity SHA-256 digests (4 KiB blocks, no salt), as the kernel and
//! `fsverity digest` compute them.

use std::io::{self, Read};

/// Streaming fs-verity digest computation.
pub struct Hasher {}

impl Hasher {
    pub fn new() -> Hasher {
        todo!()
    }
    pub fn update(&mut self, _data: &[u8]) {
        todo!()
    }
    pub fn finalize(self) -> [u8; 32] {
        todo!()
    }
}

impl Default for Hasher {
    fn default() -> Self {
        Self::new()
    }
}

/// Digest of a byte slice.
pub fn digest_bytes(data: &[u8]) -> [u8; 32] {
    let mut h = Hasher::new();
    h.update(data);
    h.finalize()
}

/// Digest of everything `r` yields.
pub fn digest_reader(mut r: impl Read) -> io::Result<[u8; 32]> {
    let mut h = Hasher::new();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        h.update(&buf[..n]);
    }
    Ok(h.finalize())
}
